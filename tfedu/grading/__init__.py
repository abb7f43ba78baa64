"""Student versions and tamper-resistant autograding (``tfedu release``, ``tfedu grade``).

- :mod:`tfedu.grading.release`: solutions out, stubs in, hidden tests out, check cells locked.
- :mod:`tfedu.grading.grade`: trusted source notebook + the student's answer cells, judged in
  the grader's process on fresh random inputs (the design is in that module's docstring).
- :mod:`tfedu.grading.scan`: static scan of answer cells (escape hatches, the forbidden reference).
- :mod:`tfedu.grading.kernel`: a fresh, boxed Jupyter kernel in its own process session.
- :mod:`tfedu.grading.harness`: the probe cell injected into the kernel and how its export is read.
- :mod:`tfedu.grading.sandbox`: the bubblewrap sandbox each submission runs in, and what it promises.
- :mod:`tfedu.grading.inside`: the runner inside the sandbox that drives the kernel.

Nothing is imported here: the runner (which needs only the kernel and the harness) starts in
every sandbox without nbformat or torch. Import the modules: ``from tfedu.grading.grade import grade``.
"""

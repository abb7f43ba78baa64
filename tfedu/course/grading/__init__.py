"""Student versions and tamper-resistant autograding (``tfedu release``, ``tfedu grade``).

- :mod:`tfedu.course.grading.release`: solutions out, stubs in, hidden tests out, check cells locked.
- :mod:`tfedu.course.grading.grade`: trusted source notebook + the student's answer cells, judged in
  the grader's process on fresh random inputs (the design is in that module's docstring).
- :mod:`tfedu.checks.scan`: static scan of answer cells (escape hatches, the forbidden reference).
- :mod:`tfedu.course.grading.kernel`: a fresh, boxed Jupyter kernel in its own process session.
- :mod:`tfedu.course.grading.harness`: the probe cell injected into the kernel and how its export is read.
- :mod:`tfedu.course.grading.sandbox`: the bubblewrap sandbox each submission runs in, and what it promises.
- :mod:`tfedu.course.grading.inside`: the runner inside the sandbox that drives the kernel.
- :mod:`tfedu.course.grading.warm` and its script :mod:`tfedu.course.grading.zygote`: first kernels forked into
  the sandbox from a process that has imported torch already (where the grader runs as root).

Nothing is imported here: the runner (which needs only the kernel and the harness) starts in
every sandbox without nbformat or torch. Import the modules: ``from tfedu.course.grading.grade import grade``.
"""

"""Student versions and tamper-resistant autograding (``tfedu release``, ``tfedu grade``).

- :mod:`tfedu.grading.release`: solutions out, stubs in, hidden tests out, check cells locked.
- :mod:`tfedu.grading.grade`: trusted source notebook + the student's answer cells, judged in
  the grader's process on fresh random inputs (the design is in that module's docstring).
- :mod:`tfedu.grading.scan`: static scan of answer cells (escape hatches, the forbidden reference).
- :mod:`tfedu.grading.kernel`: a fresh, boxed Jupyter kernel in its own process session.
- :mod:`tfedu.grading.harness`: the probe cell injected into the kernel and how its export is read.
"""

from tfedu.grading.grade import Limits, grade, grade_submission
from tfedu.grading.release import release, student_version

__all__ = ["Limits", "grade", "grade_submission", "release", "student_version"]

"""Exercise checkers, one module per notebook (``tfedu.checks.nb00`` ...), and the static scan of answers.

They may import the experiments and the reference library, never ``tfedu.course`` (which grades with them).

Each module exposes ``check_<thing>(learner_object)`` functions and a ``PROBES`` dict
(check-cell grade_id -> :class:`tfedu.checks.core.Probe`) that the autograder uses.
"""

from tfedu.checks.core import CheckFailure, ExerciseNotDone, Probe, traceback_files

__all__ = ["CheckFailure", "ExerciseNotDone", "Probe", "traceback_files"]

"""Exercise checkers, one module per notebook (``tfedu.checks.nb00`` ...).

Each module exposes ``check_<thing>(learner_object)`` functions and a ``PROBES`` dict
(check-cell grade_id -> :class:`tfedu.checks.core.Probe`) that the autograder uses.
"""

from tfedu.checks.core import CheckFailure, ExerciseNotDone, Probe, traceback_files

__all__ = ["CheckFailure", "ExerciseNotDone", "Probe", "traceback_files"]

"""Helpers shared by the tests of the checker modules (tests/test_checks_nbNN.py)."""

import pytest

from tfedu.checks.core import CheckFailure, run_probe


def not_done(*args):
    """A learner's answer that has not been written yet."""
    raise NotImplementedError


def verdict(probe, namespace, seed, *, standins=False):
    """The grader's judgement of ``namespace``'s answer on the probe's inputs drawn with ``seed``: None passes.

    ``standins=True`` binds the probe's stand-ins for earlier exercises in ``namespace`` meanwhile, as the grader does."""
    outputs, expected = run_probe(probe, namespace, seed, standins=standins)
    return probe.compare(outputs, expected)


def failure_of(check, fn) -> str:
    """The feedback of ``check(fn)``, which must fail."""
    with pytest.raises(CheckFailure) as failure:
        check(fn)
    return str(failure.value)

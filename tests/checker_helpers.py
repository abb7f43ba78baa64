"""Helpers shared by the tests of the checker modules (tests/test_checks_nbNN.py)."""

import time

import numpy as np
import pytest

from tfedu.checks.core import CheckFailure, is_plain_data, run_probe


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


def names_everywhere(probes, check, probe_name, name, fn, words):
    """``fn`` fails ``check`` and the probe ``probes[probe_name]`` (two seeds) with feedback containing ``words``.

    The checker modules' tests bind ``probes`` with ``functools.partial(names_everywhere, nbNN.PROBES)``."""
    message = failure_of(check, fn)
    assert words in message, message
    probe = probes[probe_name]
    for seed in (0, 1):
        feedback = verdict(probe, {name: fn}, seed)
        assert feedback is not None and words in feedback, (seed, feedback)


def passes_everywhere(probes, check, probe_name, name, fn):
    """``fn`` passes ``check`` and the probe ``probes[probe_name]`` on four seeds, whose inputs are plain data."""
    check(fn)
    probe = probes[probe_name]
    for seed in range(4):
        assert is_plain_data(probe.make_inputs(np.random.default_rng(seed)))
        assert verdict(probe, {name: fn}, seed) is None, seed


def check_time(check, fn) -> float:
    """CPU seconds of one check of ``fn`` (a loaded machine's wall clock would inflate it)."""
    start = time.process_time()
    check(fn)
    return time.process_time() - start

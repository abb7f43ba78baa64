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


def run_under_the_harness(probe, context, answer, *, standins=False):
    """One hidden test as the grader runs it in the kernel: ``context`` (imports) and ``answer`` run as the notebook's
    cells, then the harness cell with its tripwire; returns (the tripwire's hits, the probe's feedback or None)."""
    import secrets
    import tempfile
    from pathlib import Path

    from tfedu.course.grading import harness

    namespace = {"__builtins__": __builtins__}
    exec(context + "\n" + answer, namespace)
    cell_globals = {"__builtins__": __builtins__, "globals": lambda: namespace}
    if standins:
        exec(harness.standin_sources(probe.standins)[0], cell_globals)
    folder = Path(tempfile.mkdtemp())
    inputs = probe.make_inputs(np.random.default_rng(0))
    harness.fresh_out(folder)
    nonce = secrets.token_hex(4)
    exec(harness.harness_source(folder, probe.run, probe.forbidden, nonce, harness.encode_inputs(inputs)), cell_globals)
    result = harness.read_result(folder, nonce)
    hits = [hit for hit in result["tripwire"] if "processes" not in hit]  # (run here, pytest's own processes count too)
    feedback = probe.compare(result["outputs"], probe.reference(inputs)) if result["error"] is None else result["error"]
    return hits, feedback

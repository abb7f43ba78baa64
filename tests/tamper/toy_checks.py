"""Checkers and probes for the toy four-exercise notebook built in tests/test_grading.py.

Imported by the toy notebook's check cells inside the kernel (PYTHONPATH) and by the grader.
``SEEN`` collects, in the grader's process, what the environment probe saw inside the kernel.
"""

import math

import numpy as np

from tfedu.checks.core import Probe, call_learner, checker, expect

SEEN: list = []


@checker("double")
def check_double(double):
    expect(call_learner(double, 3) == 6, "double(3) should be 6")


@checker("square")
def check_square(square):
    expect(np.allclose(call_learner(square, np.arange(3.0)), [0.0, 1.0, 4.0]), "square([0, 1, 2]) should be [0, 1, 4]")


@checker("total")
def check_total(total):
    expect(math.isclose(call_learner(total, [0.1] * 10), 1.0), "total([0.1] * 10) should be 1.0")


@checker("ready")
def check_ready(ready):
    expect(call_learner(ready) is True, "ready() should return True")


def _record(outputs, expected):
    SEEN.append(outputs)
    return None


ENV_PROBE = """
import os, sys
outputs = {
    "ready": ready(),
    "env": sorted(f"{k}={v}" for k, v in os.environ.items()),
    "cwd": os.getcwd(),
    "files": sorted(os.listdir(".")),
    "argv": list(sys.argv),
    "history": [str(h) for h in In],
    "names": sorted(k for k in globals() if not k.startswith("__")),
    "stdin_is_null": os.path.realpath("/proc/self/fd/0") == "/dev/null",
}
"""

PROBES = {
    # builds=None: no library allow-list (tfedu.checks.building_blocks), so that an answer here may crash its
    # kernel through NumPy's internals on purpose (tests/test_grading.py) and the run, not the scan, meets it
    "check_double": Probe("ex_double", lambda rng: {"xs": rng.integers(-1000, 1000, size=5).tolist()},
                          "outputs = {'y': [double(v) for v in inputs['xs']]}",
                          lambda inputs: {"y": [2 * v for v in inputs["xs"]]}, builds=None),
    "check_square": Probe("ex_square", lambda rng: {"x": rng.standard_normal(6)},
                          "outputs = {'y': np.asarray(square(inputs['x']), dtype=float)}",
                          lambda inputs: {"y": inputs["x"] ** 2}),
    "check_total": Probe("ex_total", lambda rng: {"xs": (rng.standard_normal(50) * 1e8).tolist()},
                         "outputs = {'y': total(inputs['xs'])}",
                         lambda inputs: {"y": math.fsum(inputs["xs"])}, forbidden=("math.fsum",), rtol=1e-9, atol=0),
    "check_ready": Probe("ex_ready", lambda rng: {}, ENV_PROBE, lambda inputs: {}, compare=_record),
}

"""How pytest-xdist spreads this suite, checked in a small pytest run with the suite's own options.

A test module's plain functions must run on one worker (its module fixtures are built once; the
tamper suite's took 4 minutes and was built on both workers while xdist's `loadgroup` did nothing
under pytest 9.2), and each per-notebook class (tests/per_notebook.py) is a unit of its own, so the
notebooks spread. Units go out in collection order (`--no-loadscope-reorder`), which tests/conftest.py
sorts costliest first. The toy run records which worker ran each test.
"""

import os
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RECORDER = '''
import os
from pathlib import Path


def record(name):
    Path(os.environ["TOY_RECORD"], f"{name} {os.environ['PYTEST_XDIST_WORKER']}").touch()
'''

PLAIN_MODULE = '''
import pytest
from recorder import record


@pytest.mark.parametrize("n", range(12))
def test_plain(n):
    record(f"{__name__} plain {n}")


def test_other():
    record(f"{__name__} other")
'''

CLASS_MODULE = '''
import time
from recorder import record


class Template:
    def test_one_notebook(self):
        time.sleep(1.0)
        record(f"{__name__} {type(self).__name__}")


for name in ("Test_00_a", "Test_01_b"):
    globals()[name] = type(name, (Template,), {})
'''


def toy_run(tmp_path):
    """Run the toy suite on two workers with pyproject.toml's addopts; {test module: {worker, ...}}."""
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    suite, record = tmp_path / "suite", tmp_path / "record"
    suite.mkdir()
    record.mkdir()
    (suite / "pytest.ini").write_text(f"[pytest]\naddopts = {addopts}\n")
    (suite / "recorder.py").write_text(RECORDER)
    for name in ("test_alpha", "test_beta", "test_gamma"):
        (suite / f"{name}.py").write_text(PLAIN_MODULE)
    # First in collection order, as tests/conftest.py puts the real ones: the first two units go out one to
    # each worker (with --no-loadscope-reorder; xdist's default reorder would put these one-test units last).
    (suite / "test_a_notebooks.py").write_text(CLASS_MODULE)
    env = {**os.environ, "TOY_RECORD": str(record), "PYTHONPATH": str(suite)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q"], cwd=suite,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = defaultdict(set)
    for entry in record.iterdir():
        *test, worker = entry.name.split(" ")
        unit = f"{test[0]}::{test[1]}" if test[0] == "test_a_notebooks" else test[0]
        workers[unit].add(worker)
    return workers


def test_a_modules_tests_share_one_worker_and_notebook_classes_spread(tmp_path):
    workers = toy_run(tmp_path)
    assert set(workers) == {"test_alpha", "test_beta", "test_gamma",
                            "test_a_notebooks::Test_00_a", "test_a_notebooks::Test_01_b"}
    for unit, ran_on in workers.items():
        assert len(ran_on) == 1, f"the tests of {unit} ran on workers {sorted(ran_on)}: a module's tests must share one"
    notebook_workers = workers["test_a_notebooks::Test_00_a"] | workers["test_a_notebooks::Test_01_b"]
    assert len(notebook_workers) == 2, "the two notebook classes ran on one worker: they are separate units"

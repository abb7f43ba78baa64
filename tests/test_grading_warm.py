"""Warm kernels (tfedu.course.grading.warm): a first kernel forked into the sandbox is boxed exactly like a
cold one, and grading with it gives the same marks.

The judge is the kernel itself: a notebook cell collects what code inside can observe about its own box
(user, groups, capabilities, no_new_privs, seccomp, namespaces and cgroup against the sandbox's init,
resource limits, open descriptors, environment, sys.path, what it may write, including the interpreter
behind /proc/self/exe) and the test compares a warm run's view with a cold run's. The grading suites
(tamper, honest mistakes, sandbox attacks) run warm wherever warm kernels are enabled, so they pass unchanged
or fail.
"""

import json
import os
import threading
import types
from pathlib import Path

import pytest

from tfedu.course import nbtools
from tfedu.course.grading import warm
from tfedu.course.grading.grade import Limits, grade

from optional_parts import REQUIRED, needs_sandbox

TAMPER = Path(__file__).resolve().parent / "tamper"

# What a kernel sees of its box; split over cells because a reported error is capped at 2,000 characters.
OBSERVE = r'''
import errno, json, os, resource, sys

def attempt(action):
    try:
        action()
        return "allowed"
    except OSError as err:
        return errno.errorcode.get(err.errno, type(err).__name__)

SEEN = {
    "status": {line.split(":")[0]: line.split(":", 1)[1].split() for line in open("/proc/self/status")
               if line.split(":")[0] in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                                         "NoNewPrivs", "Seccomp", "Seccomp_filters")},
    "namespaces like init": [os.readlink(f"/proc/self/ns/{n}") == os.readlink(f"/proc/1/ns/{n}")
                             for n in ("cgroup", "ipc", "uts", "net", "pid", "mnt", "user")],
    "cgroup like init": open("/proc/self/cgroup").read() == open("/proc/1/cgroup").read(),
    "limits": {n: resource.getrlimit(getattr(resource, n)) for n in
               ("RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_CORE")},
    "descriptors": len(os.listdir("/proc/self/fd")),
    "stdin": os.readlink("/proc/self/fd/0"),
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()],
    "cwd in /tmp": os.getcwd().startswith("/tmp/"),
    "root": sorted(os.listdir("/")),
    "environment": sorted(os.environ),
    "flags": [sys.flags.safe_path, sys.flags.dont_write_bytecode],
    "path": [p for p in sys.path if p],
    "processes": len([p for p in os.listdir("/proc") if p.isdigit()]),
    "interpreter read-only": bool(os.statvfs("/proc/self/exe").f_flag & os.ST_RDONLY),
    "write interpreter": attempt(lambda: open("/proc/self/exe", "r+b")),
    "write /etc": attempt(lambda: open("/etc/passwd", "a")),
    "memfd": attempt(lambda: os.memfd_create("x")),
    "open mapped files": attempt(lambda: [open("/proc/self/map_files/" + m, "rb") for m in os.listdir("/proc/self/map_files")]),
}
KEYS = sorted(SEEN)
'''
PARTS = 5


def observing_notebook():
    return nbtools.new_notebook([
        nbtools.code("two = 2"),
        nbtools.exercise("ex_double", "def double(x):\n    ### BEGIN SOLUTION\n    return two * x\n    ### END SOLUTION"),
        nbtools.check("check_double", "from toy_checks import check_double\n\ncheck_double(double)", points=1),
        nbtools.code(OBSERVE),
        *(nbtools.code(f"raise ValueError(json.dumps({{k: SEEN[k] for k in KEYS[{i}::{PARTS}]}}))") for i in range(PARTS)),
    ])


def seen(entry: dict) -> dict:
    found: dict = {}
    for error in entry["cell_errors"]:
        found.update(json.loads(error["error"].split("ValueError: ", 1)[1]))
    return found


@pytest.fixture
def toy_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TAMPER))
    monkeypatch.setenv("PYTHONPATH", str(TAMPER))
    path = tmp_path / "notebooks" / "99_toy.ipynb"
    path.parent.mkdir()
    nbtools.write(observing_notebook(), path)
    return path


def warm_or_skip():
    if not warm.enabled():
        if "bwrap" in REQUIRED and os.geteuid() == 0:
            pytest.fail("warm kernels are off on a machine that should have them (root, Linux, bwrap)")
        pytest.skip("warm kernels need Linux and a grader running as root (every kernel starts cold here)")


@needs_sandbox
def test_a_warm_kernel_is_boxed_exactly_like_a_cold_one(toy_path):
    warm_or_skip()
    views = {}
    for cold in (False, True):
        [entry] = grade([toy_path], source=toy_path, checks="toy_checks", full=True, cold=cold)["submissions"]
        assert entry["total"] == entry["max"] == 1, entry
        assert entry["kernel_start"] == ("cold" if cold else "warm")
        views["cold" if cold else "warm"] = seen(entry)
    assert len(views["warm"]) == len(views["cold"]) > 15
    differing = {k: (views["warm"][k], views["cold"][k]) for k in views["cold"] if views["warm"][k] != views["cold"][k]}
    assert differing == {}
    box = views["warm"]
    assert box["ids"] == [65534, 65534, 65534, []] and box["status"]["CapEff"] == ["0000000000000000"]
    assert box["status"]["NoNewPrivs"] == ["1"] and box["status"]["Seccomp"] == ["2"]
    assert all(box["namespaces like init"]) and box["cgroup like init"] and box["interpreter read-only"]
    assert box["memfd"] == "EPERM" and box["write /etc"] == "EROFS" and box["open mapped files"] == "EPERM"
    assert box["stdin"] == "/dev/null"


def write(nb, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbtools.write(nb, path)
    return path


@needs_sandbox
def test_a_warm_kernel_that_dies_or_hangs_is_blamed_on_the_answer_and_replaced_by_a_cold_one(tmp_path, monkeypatch):
    """A warm launcher is not the runner's child: its kernel's exit code reaches the runner through a file,
    a kernel past its time limit is killed through a pidfd, and the replay that follows starts cold."""
    warm_or_skip()
    monkeypatch.syspath_prepend(str(TAMPER))
    monkeypatch.setenv("PYTHONPATH", str(TAMPER))
    double = nbtools.exercise("ex_double", "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION")
    check_double = nbtools.check("check_double", "from toy_checks import check_double\n\ncheck_double(double)", points=1)
    exits = write(nbtools.new_notebook([double, nbtools.code("import os\nos._exit(3)"), check_double]),
                  tmp_path / "exits" / "99_toy.ipynb")
    [entry] = grade([exits], source=exits, checks="toy_checks", full=True)["submissions"]
    assert entry["kernel_start"] == "warm"
    assert "stopped the Python kernel (exit code 3" in entry["exercises"]["check_double"]["feedback"], entry

    square = nbtools.exercise("ex_square", "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION")
    check_square = nbtools.check("check_square", "from toy_checks import check_square\n\ncheck_square(square)", points=2)
    nb = nbtools.new_notebook([nbtools.code("import numpy as np"), double, check_double, square, check_square])
    source = write(nb, tmp_path / "notebooks" / "99_toy.ipynb")
    nb.cells[1].source = "def double(x):\n    while True:\n        pass"
    submission = write(nb, tmp_path / "submitted" / "99_toy.ipynb")
    [entry] = grade([submission], source=source, checks="toy_checks", limits=Limits(cell_timeout=5, timeout=120))["submissions"]
    assert entry["kernel_start"] == "warm"
    assert "per-cell time limit" in entry["exercises"]["check_double"]["feedback"] and entry["exercises"]["check_double"]["points"] == 0
    assert entry["exercises"]["check_square"]["points"] == 2, entry


@pytest.fixture
def started(monkeypatch) -> list:
    """The servers started during the test, in order."""
    found = []
    original = warm.Server.__init__

    def counting(self, *args, **kwargs):
        found.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(warm.Server, "__init__", counting)
    return found


@needs_sandbox
def test_one_warm_server_serves_a_whole_grading_call_and_ends_with_it(toy_path, tmp_path, monkeypatch, started):
    """Every submission of one call, on any of the pool's threads, is served by one server, and grading leaves no
    process behind: the server ends when the call returns."""
    warm_or_skip()
    # As in a `tfedu grade` process: no scope open around the call (the suite keeps one, tests/conftest.py).
    monkeypatch.setattr(warm, "_SERVERS", {})
    monkeypatch.setattr(warm, "_depth", 0)
    copies = []
    for name in ("a", "b", "c"):
        copy = tmp_path / name / toy_path.name
        copy.parent.mkdir()
        copy.write_bytes(toy_path.read_bytes())
        copies.append(copy)
    entries = grade(copies, source=toy_path, checks="toy_checks", jobs=2)["submissions"]
    assert [e["kernel_start"] for e in entries] == ["warm"] * 3 and all(e["total"] == 1 for e in entries)
    assert len(started) == 1 and started[0].proc.poll() is not None


@needs_sandbox
def test_an_open_scope_keeps_one_server_between_grading_calls(toy_path, started):
    """What the suite does (tests/conftest.py): calls inside one open scope share a server, which outlives them
    and ends with the scope."""
    warm_or_skip()
    with warm.scope(fresh=True):
        for _ in range(2):
            [entry] = grade([toy_path], source=toy_path, checks="toy_checks")["submissions"]
            assert entry["kernel_start"] == "warm" and entry["total"] == 1
            assert len(started) == 1 and started[0].proc.poll() is None
    assert started[0].proc.poll() is not None


class FakeServer:
    """Stands in for a server process in the bookkeeping tests below."""

    def __init__(self, env, bwrap):
        self.env, self.closed = env, False
        self.lock = threading.Lock()
        self.proc = self

    def poll(self):
        return 0 if self.closed else None

    def close(self):
        self.closed = True


def test_a_fresh_scope_ends_its_own_servers_and_leaves_the_outer_ones(monkeypatch):
    monkeypatch.setattr(warm, "Server", FakeServer)
    box = types.SimpleNamespace(bwrap="bwrap")
    with warm.scope(fresh=True):
        outer = warm.server({"A": "1"}, box)
        with warm.scope(fresh=True):
            inner = warm.server({"A": "1"}, box)
            assert inner is not outer  # the fresh scope does not use the outer one's server
            with warm.scope():  # a grading call inside it
                assert warm.server({"A": "1"}, box) is inner
            assert not inner.closed
        assert inner.closed and not outer.closed
        assert warm.server({"A": "1"}, box) is outer
    assert outer.closed


def test_at_most_kept_servers_live_and_the_least_recently_used_goes_first(monkeypatch):
    monkeypatch.setattr(warm, "Server", FakeServer)
    box = types.SimpleNamespace(bwrap="bwrap")
    with warm.scope(fresh=True):
        servers = [warm.server({"N": str(i)}, box) for i in range(warm.KEPT)]
        assert warm.server({"N": "0"}, box) is servers[0]  # used again: now the most recent
        busy = servers[1]
        with busy.lock:  # placing a kernel: not ended under it
            newest = warm.server({"N": "new"}, box)
        assert busy.closed is False and servers[2].closed and not servers[0].closed and not newest.closed
        assert warm.server({"N": "1"}, box) is busy
    assert all(s.closed for s in (*servers, newest))

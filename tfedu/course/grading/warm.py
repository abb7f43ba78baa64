"""Warm kernels: each submission's first kernel forked from a process that has imported torch already.

A cold kernel costs about four seconds of CPU before the notebook's first cell runs, most of it importing
torch; on a 2-core laptop that is a quarter of grading a short notebook. The grader therefore starts one
*warm-kernel server* (:mod:`tfedu.course.grading.zygote`, a script run with the runner's environment) per
environment and keeps it while a grading call lasts (:func:`scope`). For each submission, once the sandbox's runner is
running (bubblewrap has made every namespace, dropped every capability and set the seccomp filter), the grader
asks the server to put a launcher into that sandbox: a forked child joins the runner's cgroup and namespaces,
takes its identity, drops every capability, sets no_new_privs and the same seccomp filter, and forks the
launcher inside the sandbox's PID namespace. The launcher compares itself with the runner (user, groups,
capabilities, no_new_privs, seccomp, namespaces, cgroup) and refuses on any difference; the runner adopts it
through a rendezvous file and a pidfd. Restarts after a timeout or a crash are cold, as before; so is any
first kernel the server cannot place (the runner waits :data:`kernel.WARM_WAIT` at most).

What it keeps of the sandbox's promises (``tfedu grade --help``): the kernel runs in the same namespaces, as
the same unprivileged user, with the same seccomp filter and resource limits (set by the same launcher
code), in the same cgroup, with /dev/null as its standard streams and no other descriptor; it is killed with
the sandbox (its PID namespace). The server never sees a plan, a hidden input or a result, and it imports
only libraries the sandbox shows anyway. What differs: the libraries it had mapped before joining were opened
outside the sandbox (the same read-only files), and their shared pages count against the server's cgroup,
not the run's, until written. ``tfedu grade --cold`` (or ``TFEDU_GRADE_COLD=1``) starts every kernel cold.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from tfedu.course.grading import kernel, sandbox

PRELOAD = ("numpy", "torch", "ipykernel.kernelapp", "ipykernel.ipkernel", "IPython", "jupyter_client", "zmq")
READY_SECONDS = 120.0  # the server's imports, on a busy machine
ANSWER_SECONDS = 10.0
RUNNER_SECONDS = 10.0  # how long the grader looks for the sandbox's runner process


class Server:
    """One warm-kernel server process (see the module docstring); ``place`` is thread-safe."""

    def __init__(self, env: dict[str, str], bwrap: str):
        script = Path(__file__).with_name("zygote.py")
        # Its own mount namespace where every mount is read-only: a file it maps (the interpreter behind
        # /proc/self/exe, the libraries) stays read-only in the kernels it forks, as in a cold sandbox.
        # One writable folder, an empty private /var/tmp (tmpfs, gone with the server): some libraries need a
        # usable temporary folder while they are imported (dill, which torch imports when it is installed,
        # calls tempfile.gettempdir(), which tries /tmp, then /var/tmp), and with none the preload fails and
        # every kernel starts cold. Not /tmp itself: the folders on the kernels' import path (under /tmp in the
        # tests) must look to the server as they are, or its import caches would hide them from the kernels.
        # The kernels never see this folder: they join the sandbox's mount namespace.
        private_tmp = ["--tmpfs", "/var/tmp"] if Path("/var/tmp").is_dir() else []
        read_only = [bwrap, "--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev", "--bind", "/proc", "/proc",
                     "--bind-try", "/sys/fs/cgroup", "/sys/fs/cgroup", *private_tmp, "--"]
        # Not --die-with-parent: that follows the thread that started it (a grading pool's thread, gone after one
        # submission). The server ends when its standard input closes, as it does when this process ends.
        self.proc = subprocess.Popen([*read_only, sys.executable, "-P", str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, cwd="/", close_fds=True, start_new_session=True)
        setup = {"seccomp": base64.b64encode(sandbox.seccomp_program()).decode("ascii"), "launcher": kernel.LAUNCHER,
                 "kernel_args": list(kernel.KERNEL_ARGS), "preload": list(PRELOAD)}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(setup) + "\n").encode())
        self.proc.stdin.flush()
        self.lock = threading.Lock()
        self.ready: bool | None = None  # None: still importing
        self.env = env

    def _line(self, seconds: float) -> str | None:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], seconds)[0]:
            return None
        line = self.proc.stdout.readline().decode()
        return line or None

    def place(self, runner_pid: int, *, cgroup: Path | None, limits: tuple[int, int, int, int],
              kernel_env: dict[str, str]) -> bool:
        """Put a warm launcher into the sandbox of ``runner_pid``; whether the server says it did."""
        with self.lock:
            if self.ready is None:
                self.ready = self._line(READY_SECONDS) == "ready\n"
            if not self.ready or self.proc.poll() is not None:
                self.ready = False
                return False
            request = {"pid": runner_pid, "cgroup": str(cgroup.path) if cgroup is not None else None,
                       "limits": list(limits), "env": kernel_env, "rendezvous": kernel.WARM_RENDEZVOUS}
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
                line = self._line(ANSWER_SECONDS)
            except OSError:
                line = None
            if line is None:  # a server that does not answer is not asked again
                self.ready = False
                self.close()
                return False
            return bool(json.loads(line).get("ok"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


_SERVERS: dict[tuple, Server] = {}  # one per runner environment (a grading call has one), oldest first
_SERVERS_LOCK = threading.Lock()
_depth = 0  # open scopes (grading calls under way)
KEPT = 3  # servers kept at once (each holds torch in memory): starting a fourth ends the least recently used


@contextlib.contextmanager
def scope(*, fresh: bool = False):
    """Servers live while a scope is open (a grading call, nested or not); when the last one closes, every
    server ends: grading leaves no process of its own behind.

    A process that grades many times (the test suite) opens one scope around all of it and so keeps its servers
    between calls. ``fresh=True`` opens a scope of its own inside it: servers started within are used only
    there and end when it closes, as if no outer scope were open (what a test that checks grading leaves
    nothing behind needs). The servers are the process's: no grading may run in another thread meanwhile."""
    global _SERVERS, _depth
    with _SERVERS_LOCK:
        saved = (_SERVERS, _depth) if fresh else None
        if fresh:
            _SERVERS, _depth = {}, 0
        _depth += 1
    try:
        yield
    finally:
        ending: list[Server] = []
        with _SERVERS_LOCK:
            _depth -= 1
            if _depth == 0:
                ending = list(_SERVERS.values())
                _SERVERS.clear()
            if saved is not None:
                _SERVERS, _depth = saved
        for found in ending:
            found.close()


def enabled() -> bool:
    """Whether first kernels start warm here: Linux, a grader running as root (the server joins sandboxes
    that bwrap made as another user, from a read-only mount namespace of its own) and no ``TFEDU_GRADE_COLD``."""
    return (os.environ.get("TFEDU_GRADE_COLD", "") in ("", "0") and sys.platform.startswith("linux")
            and hasattr(os, "pidfd_open") and os.geteuid() == 0)


def server(env: dict[str, str], box: sandbox.Sandbox) -> Server:
    """The warm-kernel server for the runner environment ``env``, started on first use, kept until the
    outermost :func:`scope` closes or :data:`KEPT` more recently used ones push it out."""
    key = (box.bwrap, *sorted(env.items()))
    with _SERVERS_LOCK:
        found = _SERVERS.pop(key, None)
        if found is None or found.proc.poll() is not None:
            found = Server(env, box.bwrap)
        _SERVERS[key] = found  # now the most recently used
        idle = [k for k, s in _SERVERS.items() if k != key and not s.lock.locked()]
        ending = [_SERVERS.pop(k) for k in idle[:max(0, len(_SERVERS) - KEPT)]]
    for old in ending:  # a placement that races with this falls back to a cold start
        old.close()
    return found


def find_runner(bwrap: subprocess.Popen, seconds: float = RUNNER_SECONDS) -> int | None:
    """The host PID of the runner in the sandbox that ``bwrap`` started (bwrap, the sandbox's init, the runner),
    once it runs the runner's code; None if it does not within ``seconds``."""
    deadline = time.monotonic() + seconds
    wanted = [sys.executable, "-m", "tfedu.course.grading.inside"]
    while time.monotonic() < deadline and bwrap.poll() is None:
        chain = [bwrap.pid]
        while len(chain) < 3:
            below = _children(chain[-1])
            if len(below) != 1:
                break
            chain.append(below[0])
        if len(chain) == 3:
            try:
                argv = Path(f"/proc/{chain[2]}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                argv = []
            if argv[:3] == wanted:
                return chain[2]
        time.sleep(0.005)
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


@atexit.register
def _close_all() -> None:
    for found in list(_SERVERS.values()):
        found.close()

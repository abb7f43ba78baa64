"""A fresh Jupyter kernel in a child process, boxed in, driven one cell at a time (by the grader's
runner, :mod:`tfedu.course.grading.inside`, inside the submission's sandbox).

- The kernel (``python -P -m ipykernel_launcher``) starts in its own session and process group
  (``start_new_session``), in the folder it is given (the grader passes an empty temporary one),
  with stdin, stdout and stderr of the process on /dev/null, and without its working folder on
  ``sys.path`` (``-P``, ``ignore_cwd``). A tiny launcher sets
  ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` (file size), ``RLIMIT_NOFILE`` and ``RLIMIT_CORE``, starts the kernel
  and stays as its subreaper: processes the kernel's code detaches (``setsid``, double fork)
  are re-parented to it and killed with the kernel (see ``LAUNCHER``).
- The environment is the grader's own minus test-runner and Jupyter-parent variables: nothing
  tells the code it is being graded.
- Cells run with ``allow_stdin=False`` (``input()`` raises at once). Each cell has a deadline
  (the smaller of the per-cell limit and what is left of the total); past it, or when the kernel
  dies, every process of the kernel's session is killed with SIGKILL.
- Output is drained and capped: only the first :data:`OUTPUT_CAP` characters of a cell's
  stream output are kept, the rest is counted and dropped.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

OUTPUT_CAP = 20_000
# RLIMIT_NOFILE of the kernel and what it starts (soft and hard): a kernel running a notebook holds about
# 60 descriptors; the limit bounds how many pipes, sockets and files one run can pin in the host's memory.
OPEN_FILES = 512
TRACEBACK_CAP = 4_000
DROPPED_ENV_PREFIXES = ("PYTEST", "JPY_", "NBGRADER", "TFEDU_GRAD", "COV_CORE", "PYTHONBREAKPOINT", "PYTHONINSPECT")

# Runs as `python -c LAUNCHER mem fsize cpu nproc python -m ipykernel_launcher ...`. It sets the limits
# (RLIMIT_NOFILE to OPEN_FILES too), starts the kernel as its child and stays as a *subreaper* (prctl
# PR_SET_CHILD_SUBREAPER):
# a process the kernel's code double-forks or moves to a new session (setsid) is re-parented here
# instead of to init, so on SIGTERM, or when the kernel exits, the launcher can kill every one of
# them. Without prctl (not Linux) it degrades to killing its session, as before.
LAUNCHER = """\
import ctypes, os, resource, signal, sys, time
OPEN_FILES = {open_files}
mem, fsize, cpu, nproc = (int(v) for v in sys.argv[1:5])
if mem > 0:
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
if fsize > 0:
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
if cpu > 0:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
if nproc > 0:  # counts threads too; set only in a sandbox, whose user namespace counts its own processes
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
files = min(OPEN_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
try:
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
except Exception:
    pass
me = os.getpid()

def children():
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found

def reap_everything(*_):
    for _ in range(200):  # kill, collect, repeat: orphans of killed processes come back here
        pids = children()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    time.sleep(0.01)
            except ChildProcessError:
                break
    os._exit(0)

kernel = os.fork()
if kernel == 0:
    os.execv(sys.argv[5], sys.argv[5:])
signal.signal(signal.SIGTERM, reap_everything)
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        os._exit(0)
    if pid == kernel:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = os.waitstatus_to_exitcode(status)
        for other in children():
            try:
                os.kill(other, signal.SIGKILL)
            except OSError:
                pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(me, -code)
        os._exit(code)
""".replace("{open_files}", str(OPEN_FILES))


@dataclass
class CellResult:
    status: str  # "ok", "error", "timeout" or "dead"
    ename: str = ""
    evalue: str = ""
    stdout: str = ""
    stderr: str = ""
    dropped: int = 0  # characters of output beyond the cap
    exit_code: int | None = None
    seconds: float = 0.0
    errors: list[tuple[str, str]] = field(default_factory=list)
    traceback: str = ""  # the first error's traceback as the kernel rendered it, its last TRACEBACK_CAP characters


def clean_environment(cwd: str | Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_ENV_PREFIXES) and k != "OLDPWD"}
    env["PWD"] = str(cwd)
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return env


def kill_session(sid: int) -> None:
    """SIGKILL every process in session ``sid`` (the kernel and whatever it started)."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            pid = int(entry.name)
            try:
                if os.getsid(pid) == sid:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass


class Kernel:
    """One boxed kernel. ``start()``, then ``run(code, timeout)`` per cell, then ``stop()``."""

    def __init__(self, cwd: str | Path, *, memory_bytes: int = 4 << 30, file_bytes: int = 256 << 20,
                 cpu_seconds: int = 0, processes: int = 0, new_session: bool = True):
        self.cwd = Path(cwd)
        self.memory_bytes = memory_bytes
        self.file_bytes = file_bytes
        self.cpu_seconds = cpu_seconds  # RLIMIT_CPU of the kernel (and of each process it starts); 0: none
        self.processes = processes  # RLIMIT_NPROC (threads count); 0: none
        self.new_session = new_session  # False: stay in the caller's session, so the caller's session kill reaches it
        self.proc: subprocess.Popen | None = None
        self.client = None
        self._conn_dir = tempfile.mkdtemp()

    def start(self, timeout: float) -> None:
        from jupyter_client.blocking import BlockingKernelClient
        from jupyter_client.connect import write_connection_file

        connection_file = os.path.join(self._conn_dir, f"kernel-{uuid.uuid4()}.json")
        write_connection_file(connection_file, ip="127.0.0.1")
        # -P and ignore_cwd: the working folder is not on sys.path, so a module file written there
        # (by code that slipped past the scan) cannot be imported.
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        cmd = [sys.executable, "-c", LAUNCHER, str(self.memory_bytes), str(self.file_bytes), str(self.cpu_seconds), str(self.processes),
               sys.executable, *safe_path, "-m", "ipykernel_launcher", "-f", connection_file,
               "--HistoryManager.hist_file=:memory:", "--IPKernelApp.ignore_cwd=True"]
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=clean_environment(self.cwd), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=self.new_session)
        client = BlockingKernelClient()
        client.load_connection_file(connection_file)
        client.start_channels()
        self.client = client
        deadline = time.monotonic() + timeout
        sent: set[str] = set()
        while True:  # kernel_info until it answers, the process dies, or time runs out
            if self.proc.poll() is not None:
                raise RuntimeError(f"the kernel exited while starting (code {self.proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError("the kernel did not start in time")
            sent.add(client.kernel_info())
            try:
                reply = client.get_shell_msg(timeout=min(1.0, max(0.05, deadline - time.monotonic())))
            except queue.Empty:
                continue
            if reply["parent_header"].get("msg_id") in sent:
                break
        while True:  # drop the start-up chatter on iopub
            try:
                client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                break

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, code: str, timeout: float, *, silent: bool = False) -> CellResult:
        """Execute one cell; never raises for anything the cell does."""
        assert self.client is not None and self.proc is not None
        start = time.monotonic()
        deadline = start + max(0.0, timeout)
        result = CellResult(status="ok")
        out = {"stdout": [], "stderr": []}
        kept = 0
        msg_id = self.client.execute(code, silent=silent, store_history=not silent, allow_stdin=False, stop_on_error=False)
        reply = None
        idle = False
        while reply is None or not idle:
            if time.monotonic() > deadline:
                result.status = "timeout"
                self.kill()
                break
            if not self.alive():
                result.status = "dead"
                result.exit_code = self.proc.returncode
                self.kill()
                break
            got_something = False
            try:
                msg = self.client.get_iopub_msg(timeout=0.05)
                got_something = True
                if msg["parent_header"].get("msg_id") == msg_id:
                    kind, content = msg["msg_type"], msg["content"]
                    if kind == "stream":
                        text = str(content.get("text", ""))
                        room = max(0, OUTPUT_CAP - kept)
                        out["stderr" if content.get("name") == "stderr" else "stdout"].append(text[:room])
                        kept += min(len(text), room)
                        result.dropped += max(0, len(text) - room)
                    elif kind == "error":
                        result.errors.append((str(content.get("ename", ""))[:200], str(content.get("evalue", ""))[:2000]))
                        if not result.traceback:
                            frames = content.get("traceback")
                            text = "\n".join(str(f) for f in frames) if isinstance(frames, list) else ""
                            result.traceback = text[-TRACEBACK_CAP:]
                    elif kind == "status" and content.get("execution_state") == "idle":
                        idle = True
            except queue.Empty:
                pass
            if reply is None:
                try:
                    msg = self.client.get_shell_msg(timeout=0 if got_something else 0.01)
                    if msg["parent_header"].get("msg_id") == msg_id:
                        reply = msg["content"]
                except queue.Empty:
                    pass
        result.stdout, result.stderr = "".join(out["stdout"]), "".join(out["stderr"])
        result.seconds = time.monotonic() - start
        if reply is not None and result.status == "ok" and reply.get("status") != "ok":
            result.status = "error"
            result.ename = str(reply.get("ename", ""))[:200]
            result.evalue = str(reply.get("evalue", ""))[:2000]
        if result.status == "ok" and result.errors:
            result.status = "error"
            result.ename, result.evalue = result.errors[0]
        return result

    def kill(self) -> None:
        if self.proc is not None:
            # First ask the launcher (a subreaper) to kill everything that ever came from the
            # kernel, wherever it moved; then SIGKILL the session as a fallback.
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(signal.SIGTERM)
                    self.proc.wait(timeout=3)
                except (subprocess.TimeoutExpired, OSError):
                    pass
            kill_session(self.proc.pid)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def stop(self) -> None:
        self.kill()
        if self.client is not None:
            try:
                self.client.stop_channels()
            except Exception:
                pass
            self.client = None
        import shutil

        shutil.rmtree(self._conn_dir, ignore_errors=True)

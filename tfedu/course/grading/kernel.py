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
- ``start(warm=True)``: the first kernel of a sandboxed run may come warm, forked into the sandbox by the
  grader's warm-kernel server (:mod:`tfedu.course.grading.warm`) and supervised by the same launcher code;
  the runner hands it the connection file through :data:`WARM_RENDEZVOUS` and adopts it (:class:`Adopted`).
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
    if "start_kernel" in globals():  # a warm launcher (zygote.py) forks its kernel instead of executing one
        start_kernel()
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
        if "report_exit" in globals():  # a warm launcher has no parent to wait for it: it leaves the code in a file
            report_exit(code)
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(me, -code)
        os._exit(code)
""".replace("{open_files}", str(OPEN_FILES))


KERNEL_ARGS = ("--HistoryManager.hist_file=:memory:", "--IPKernelApp.ignore_cwd=True")
# Where the runner and a warm launcher meet in the sandbox: the runner writes the connection file's path, the
# kernel's working folder and the answer file's path here; the launcher answers there with its PID (or why it refused).
WARM_RENDEZVOUS = "/tmp/.tfedu-warm-kernel.json"
WARM_WAIT = 20.0  # seconds the runner waits for a warm launcher before it starts a cold kernel


class Adopted:
    """A warm launcher, which is not this runner's child: the parts of :class:`subprocess.Popen` that
    :class:`Kernel` uses, through a pidfd (its exit is seen, it cannot be confused with a reused PID)."""

    def __init__(self, pid: int, exit_file: str):
        self.pid, self.exit_file, self.returncode = pid, exit_file, None
        self.fd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        import select

        if self.returncode is None and select.select([self.fd], [], [], 0)[0]:
            try:
                self.returncode = int(Path(self.exit_file).read_text())
            except (OSError, ValueError):
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import select

        if self.returncode is None and not select.select([self.fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("warm kernel", timeout or 0)
        return self.poll()  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        signal.pidfd_send_signal(self.fd, sig)


def adopt_warm_launcher(connection_file: str, cwd: Path, timeout: float) -> Adopted:
    """Hand a warm launcher the connection file and working folder; its PID once it has checked itself
    against this process (see :mod:`tfedu.course.grading.zygote`). Raises RuntimeError otherwise."""
    import json

    answer = connection_file + ".launcher"
    part = WARM_RENDEZVOUS + ".part"
    Path(part).write_text(json.dumps({"connection_file": connection_file, "cwd": str(cwd), "answer": answer}))
    os.rename(part, WARM_RENDEZVOUS)
    deadline = time.monotonic() + timeout
    try:
        while not os.path.exists(answer):
            if time.monotonic() > deadline:
                raise RuntimeError("no warm launcher came")
            time.sleep(0.005)
    finally:
        Path(WARM_RENDEZVOUS).unlink(missing_ok=True)
    reply = json.loads(Path(answer).read_text())
    if "pid" not in reply:
        raise RuntimeError(f"the warm launcher refused: {reply.get('refused')}")
    try:
        return Adopted(int(reply["pid"]), answer + ".exit")
    except OSError as err:
        raise RuntimeError(f"the warm launcher is gone: {err}") from err


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


def clean_environment(cwd: str | Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """A kernel's environment: ``base`` (this process's) minus test-runner and Jupyter-parent variables."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(DROPPED_ENV_PREFIXES) and k != "OLDPWD"}
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
        self.proc: subprocess.Popen | Adopted | None = None
        self.client = None
        self.warm = False  # whether the running kernel came from the warm-kernel server
        self._conn_dir = tempfile.mkdtemp()

    def start(self, timeout: float, *, warm: bool = False) -> None:
        """Start the kernel and wait until it answers. ``warm``: a launcher forked by the grader's warm-kernel
        server (:mod:`tfedu.course.grading.warm`) is on its way into this sandbox; hand it the connection file
        and adopt it, and start a cold kernel as usual if it refuses or does not come within :data:`WARM_WAIT`."""
        from jupyter_client.connect import write_connection_file

        self.warm = False
        connection_file = os.path.join(self._conn_dir, f"kernel-{uuid.uuid4()}.json")
        write_connection_file(connection_file, ip="127.0.0.1")
        if warm:
            try:
                self.proc = adopt_warm_launcher(connection_file, self.cwd, min(WARM_WAIT, timeout))
                self._connect(connection_file, min(WARM_WAIT, timeout))
                self.warm = True
                return
            except RuntimeError:
                self.kill()
                self._disconnect()
                self.proc = None
                os.unlink(connection_file)
                write_connection_file(connection_file, ip="127.0.0.1")
        # -P and ignore_cwd: the working folder is not on sys.path, so a module file written there
        # (by code that slipped past the scan) cannot be imported.
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        cmd = [sys.executable, "-c", LAUNCHER, str(self.memory_bytes), str(self.file_bytes), str(self.cpu_seconds), str(self.processes),
               sys.executable, *safe_path, "-m", "ipykernel_launcher", "-f", connection_file, *KERNEL_ARGS]
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=clean_environment(self.cwd), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=self.new_session)
        self._connect(connection_file, timeout)

    def _connect(self, connection_file: str, timeout: float) -> None:
        from jupyter_client.blocking import BlockingKernelClient

        assert self.proc is not None
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

    def _disconnect(self) -> None:
        if self.client is not None:
            try:
                self.client.stop_channels()
            except Exception:
                pass
            self.client = None

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
        self._disconnect()
        import shutil

        shutil.rmtree(self._conn_dir, ignore_errors=True)

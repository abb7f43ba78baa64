"""The operating-system sandbox each submission is graded in (bubblewrap), and what it promises.

``tfedu grade`` runs every submission's whole run (the runner of :mod:`tfedu.course.grading.inside`, the
kernel it starts, and everything the student's code starts) in its own `bubblewrap
<https://github.com/containers/bubblewrap>`_ sandbox (``bwrap``, the tool Flatpak uses):

- **its own PID namespace** (``--unshare-pid``): ``/proc`` shows only the sandbox's processes,
  nothing outside can be signalled, and when the sandbox ends (the runner exits, or the grader
  kills it at the total time limit) the kernel kills every process in it: no daemon survives;
- **no network** (``--unshare-net``: only a loopback device), no IPC or UTS sharing, a new
  session (no terminal to inject keystrokes into), ``--die-with-parent``;
- **a read-only view of only what the run needs**: ``/usr`` and the system library folders, a
  few files of ``/etc``, the Python installation, the ``tfedu`` package, the course's ``data/``
  and the folders on ``PYTHONPATH``. Not the source notebooks (their cells come in on the
  runner's stdin, as code), not the other submissions, not the results;
- **private writable** ``/tmp``, ``$HOME`` (holding the IPython and Jupyter folders), ``/dev/shm``
  and ``/grading`` (where a hidden test writes its result; its inputs come inside its own cell, never
  as a file), each a ``tmpfs`` of bounded size that vanishes with the sandbox; everything else, bwrap's own root and ``/dev`` included, is read-only. No descriptor of a
  host file is writable inside: the runner reports through a file descriptor that only it holds (not
  dumpable, so not reachable through ``/proc``), and the sandbox has no stderr;
- **a short environment**: of the grader's variables only locale, thread counts, ``MPLBACKEND``,
  ``TFEDU_*`` and the like (``grade.SANDBOX_ENV``), never an instructor's tokens or paths;
- **an unprivileged user**: uid 65534 (nobody) inside a user namespace that may not create
  another; when the grader runs as root, bwrap itself runs as the real user ``nobody`` if that
  user can read everything the run needs, otherwise nobody-inside maps to root-outside with
  every capability dropped (so the read-only mounts are what protect the files);
- **limits**: address space, file size and CPU time per process (``RLIMIT_AS``, ``RLIMIT_FSIZE``,
  ``RLIMIT_CPU``), ``RLIMIT_NPROC``, and a watchdog in the runner that ends every process of the
  sandbox when it holds more than :attr:`Limits.processes` of them (``RLIMIT_NPROC`` is not
  enforced for a user namespace mapped to root). From outside, where nothing inside can stop it,
  :class:`tfedu.course.grading.grade.Monitor` ends a run that holds too many processes or threads, makes
  too many files (inodes) in a private folder, or takes more than its share of the CPU, and the
  wall-clock limit ends it at most ``BACKSTOP_SECONDS`` late.
  Memory for the whole sandbox: a cgroup v2 ``memory.max`` per run where the grader's own cgroup
  can delegate the memory controller (:func:`memory_cgroup`), elsewhere only per process. Either
  way a seccomp filter (:func:`seccomp_program`) denies ``memfd_create`` and SysV shared memory,
  which hold memory outside every per-process limit, and ``RLIMIT_NOFILE`` bounds the open files.

The runner reports through one file the grader opened and passed in as a file descriptor (the
sandbox sees no writable folder of the host at all); the grader reads it only after the whole
sandbox has exited, with size limits, as plain data.

Without bwrap (not installed, macOS, user namespaces disabled) ``tfedu grade`` refuses to run
unless ``--no-sandbox`` is given. Then each run still gets its own process session, a private
``$HOME``/``/tmp``/IPython folder, the same resource limits and clean-up, but it runs as the
grader's user and can see (and change) what that user can.
"""

from __future__ import annotations

import functools
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
HOME = "/home/student"
EXCHANGE = "/grading"
ETC_FILES = ("passwd", "group", "nsswitch.conf", "hosts", "localtime", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "fonts",
             "alternatives", "mime.types")
HIDDEN_SUFFIXES = (".ipynb", ".json", ".csv")  # notebooks, submissions, results
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")

INSTALL_HINT = (
    "grading needs a sandbox for each submission, and none could be made here ({why}). On Debian or "
    "Ubuntu install bubblewrap (`sudo apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`) "
    "and make sure user namespaces are enabled (`sysctl kernel.unprivileged_userns_clone=1` where that "
    "setting exists). On macOS or Windows grade inside a Linux container or VM. Or pass --no-sandbox to "
    "grade without one: then a submission runs as your user and could read or change your files "
    "(see `tfedu grade --help`)."
)


GUARANTEES = """\
What `tfedu grade` promises, each submission graded in its own sandbox:
  1. A wrong answer written in good faith never scores: an exercise scores only when its check
     cell passes and its hidden test (fresh random inputs, large magnitudes, longer sequences,
     gradients, exact return types) matches the reference computed in the grader's own process.
  2. Subverting the kernel changes at most the subverter's own marks: everything a submission
     runs stays in its sandbox, and only plain data comes out, judged outside.
  3. No submission can read or change another's result, your files, or the grader: the sandbox
     shows none of them and no folder of this machine is writable from inside it.
  4. Every run ends within its limits: the wall-clock limit (at most 5 s late), the process,
     thread and file counts and the CPU share are enforced from outside, and ending a sandbox
     ends every process in it.
     Memory: per sandbox where a cgroup v2 memory controller can be delegated (`tfedu check`
     says which rule is in force), per process (--memory-gib) elsewhere; memfd_create and SysV
     shared memory are denied and a process holds at most 512 open files.
  5. Obvious uses of the reference are flagged: a static scan and a run-time tripwire zero an
     answer that imports or calls the reference it is meant to build, or a library function
     outside the exercise's building blocks (its allow-list), and say so.
What it does not promise: the reference implementations ship with the course and the hidden
test runs in the same process as the student's code, so a student who copies the reference, or
subverts their own kernel, can raise their own score. Read the flagged feedback; sample the rest.
With --no-sandbox only 1 and 5 hold: a submission then runs as your user, can read and change
what you can, and a determined one can leave processes behind."""


class SandboxUnavailable(RuntimeError):
    """No sandbox can be made on this machine; the message says how to get one, ``why`` why not."""

    def __init__(self, why: str):
        super().__init__(INSTALL_HINT.format(why=why))
        self.why = why


@dataclass(frozen=True)
class Sandbox:
    bwrap: str
    as_nobody: bool  # bwrap itself runs as the real user nobody (only when the grader is root)

    def describe(self) -> str:
        who = ("the real user nobody" if self.as_nobody
               else "uid 65534 in a user namespace" + (" mapped to root, capabilities dropped" if os.geteuid() == 0 else ""))
        return f"bubblewrap sandbox ({self.bwrap}), {who}; {memory_policy()}"


def package_root() -> Path:
    """The folder that holds the ``tfedu`` package (bound read-only; its parent's other files are not)."""
    return Path(__file__).resolve().parents[2]


def readable_paths(extra: tuple[str, ...] = ()) -> list[Path]:
    """Every folder the run reads: the Python installation and its site folders, tfedu, data/, PYTHONPATH."""
    paths: list[Path] = []
    package = package_root()
    for value in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  *sysconfig.get_paths().values(), *site.getsitepackages(), site.getusersitepackages(),
                  Path(sys.executable).resolve().parent, *os.environ.get("PYTHONPATH", "").split(os.pathsep), *extra):
        # The course's own folder (PYTHONPATH=. in a checkout) is not bound whole: its notebooks, .git
        # (solutions in the history), earlier results. Only tfedu/ and data/ are, below.
        if value and Path(value).is_dir() and not package.is_relative_to(Path(value).resolve()):
            paths.append(Path(value).resolve())
    paths += [package, package.parent / "data"] if (package.parent / "data").is_dir() else [package]
    kept: list[Path] = []
    for path in sorted(set(paths), key=lambda p: len(p.parts)):
        if str(path) != "/" and not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


def python_path(extra: tuple[str, ...] = ()) -> str:
    """PYTHONPATH inside the sandbox: the folder holding tfedu first, then the grader's own entries."""
    entries = [str(package_root().parent), *os.environ.get("PYTHONPATH", "").split(os.pathsep), *extra]
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def seccomp_file():
    """A temporary file holding :func:`seccomp_program`, read from the start; pass its descriptor to
    :func:`command` (``seccomp_fd``) and to the process that runs bwrap (``pass_fds``), then close it."""
    import tempfile

    handle = tempfile.TemporaryFile()
    handle.write(seccomp_program())
    handle.seek(0)
    return handle


def command(sandbox: Sandbox, argv: list[str], *, env: dict[str, str], hide: list[Path],
            tmp_bytes: int, extra_paths: tuple[str, ...] = (), seccomp_fd: int | None = None) -> list[str]:
    """The bwrap command line that runs ``argv`` in a fresh sandbox.

    ``hide`` are host folders (the source notebooks, the submissions, the results) covered by an
    empty tmpfs should any bound folder contain them. ``seccomp_fd``: a descriptor open on
    :func:`seccomp_program` (:func:`seccomp_file`), the system calls denied inside.
    """
    size = str(int(tmp_bytes))
    args = [sandbox.bwrap, "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
            "--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    # The private folders first: a folder bound below (PYTHONPATH may point into /tmp) lies on top of them.
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
             "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", HOME,
             "--size", size, "--tmpfs", EXCHANGE]
    for name in SYSTEM_DIRS:
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    bound = readable_paths(extra_paths)
    for path in bound:
        args += ["--ro-bind", str(path), str(path)]
    hide = [*hide, *(b / ".git" for b in bound if (b / ".git").exists())]  # a bound checkout's history
    for path in hide:
        path = path.resolve()
        if not path.is_dir() or not any(path.is_relative_to(b) for b in bound):
            continue
        if not any(b.is_relative_to(path) for b in bound):
            args += ["--tmpfs", str(path), "--remount-ro", str(path)]  # an empty, read-only folder in its place
        else:  # the folder is itself needed (a checks module beside the notebooks): hide its notebooks and results
            for item in sorted(path.iterdir()):
                if item.suffix in HIDDEN_SUFFIXES and item.is_file() and not item.is_symlink():
                    args += ["--ro-bind", "/dev/null", str(item)]
    # bwrap's own root (the parents of the mount points, /etc) and /dev are tmpfs without a size limit:
    # read-only, so the size-bounded folders above are the only writable places
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", HOME, "--", *argv]
    return args


# A seccomp filter (classic BPF, what bwrap's --seccomp loads) that makes a few system calls fail with EPERM:
# the ones that take host memory past every per-process limit. memfd_create makes anonymous files that the
# private folders' size limits do not see; SysV shared memory (shmget, or ipc() for 32-bit code) outlives
# the mapping that RLIMIT_AS counts. The numbers are each architecture's own (linux/unistd.h); a process may
# use the 32-bit (and on x86-64 the x32) calling convention too, so those are covered as well.
DENIED_SYSCALLS = {  # AUDIT_ARCH_* -> {name: number}
    0xC000003E: {"memfd_create": 319, "shmget": 29},  # x86-64 (x32 numbers carry bit 30, masked below)
    0x40000003: {"memfd_create": 356, "shmget": 395, "ipc": 117},  # i386
    0xC00000B7: {"memfd_create": 279, "shmget": 194},  # aarch64
    0x40000028: {"memfd_create": 385, "shmget": 307, "ipc": 117},  # 32-bit arm
}
X32_BIT = 0x40000000


def seccomp_program() -> bytes:
    """The filter as bwrap reads it: ``struct sock_filter`` records (code, jt, jf, k), native byte order."""
    import struct

    ld_abs, jeq, ret, alu_and = 0x20, 0x15, 0x06, 0x54  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K, BPF_ALU|AND|K
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    blocks: list[list[tuple[int, int, int, int]]] = []
    for arch, calls in DENIED_SYSCALLS.items():
        block = [(ld_abs, 0, 0, 0)]  # seccomp_data.nr
        if arch == 0xC000003E:
            block.append((alu_and, 0, 0, ~X32_BIT & 0xFFFFFFFF))
        numbers = sorted(calls.values())
        for i, number in enumerate(numbers):  # on a match jump to the deny after this block's `ret allow`
            block.append((jeq, len(numbers) - i, 0, number))
        block += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
        blocks.append(block)
    head: list[tuple[int, int, int, int]] = [(ld_abs, 0, 0, 4)]  # seccomp_data.arch
    starts, offset = [], 0
    for block in blocks:
        starts.append(offset)
        offset += len(block)
    n = len(blocks)
    for i, arch in enumerate(DENIED_SYSCALLS):  # jump from test i (at 1 + i) to block i (at 1 + n + 1 + start)
        head.append((jeq, (n - i) + starts[i], 0, arch))
    head.append((ret, 0, 0, allow))  # an architecture not listed: nothing denied
    return b"".join(struct.pack("=HBBI", *record) for record in head + [r for b in blocks for r in b])


CGROUP_SLACK_GIB = 1.5  # a sandbox's memory.max over --memory-gib: the runner, bwrap and the private tmpfs folders


@functools.lru_cache(maxsize=1)
def memory_cgroup() -> Path | None:
    """The grader's own cgroup v2 folder, where it may make one child cgroup per run with its own
    ``memory.max``; None where this machine does not allow that (cgroup v1, the memory controller not
    delegated, or the grader's cgroup holding processes that keep it from handing the controller down)."""
    try:
        own = next(line[3:].strip() for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
        for fields in (line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()):
            if "-" in fields and fields[fields.index("-") + 1] == "cgroup2" and Path(own).is_relative_to(fields[3]):
                here = Path(fields[4]) / Path(own).relative_to(fields[3])
                break
        else:
            return None
        if "memory" not in (here / "cgroup.controllers").read_text().split():
            return None
        if "memory" not in (here / "cgroup.subtree_control").read_text().split():
            (here / "cgroup.subtree_control").write_text("+memory")
        trial = here / f"tfedu-trial-{os.getpid()}"
        trial.mkdir()
        works = (trial / "memory.max").is_file()
        trial.rmdir()
        return here if works else None
    except (OSError, StopIteration, ValueError):
        return None


class RunCgroup:
    """One run's cgroup v2 (a child of :func:`memory_cgroup`): every process of the sandbox is in it, and
    ``memory.max`` bounds their memory together, shared memory and the private folders' files included."""

    def __init__(self, parent: Path, memory_bytes: int):
        self.path = parent / f"tfedu-run-{os.getpid()}-{os.urandom(6).hex()}"
        self.path.mkdir()
        self.memory_bytes = memory_bytes
        (self.path / "memory.max").write_text(str(int(memory_bytes)))
        if (self.path / "memory.swap.max").is_file():
            (self.path / "memory.swap.max").write_text("0")
        self._procs = str(self.path / "cgroup.procs")

    def join(self) -> None:
        """Move the calling process in (between fork and exec: what bwrap starts is born inside)."""
        fd = os.open(self._procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def ran_out(self) -> bool:
        """Whether the kernel ended a process of the run for going over ``memory.max``."""
        try:
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def remove(self) -> None:
        """End whatever is left in the cgroup and remove it."""
        for _ in range(50):
            try:
                if (self.path / "cgroup.kill").is_file():
                    (self.path / "cgroup.kill").write_text("1")
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)


def memory_policy() -> str:
    """What bounds a sandbox's memory on this machine, in one line (``tfedu grade`` and ``tfedu check`` print it)."""
    always = "memfd_create and SysV shared memory are denied and each process may hold 512 open files"
    if memory_cgroup() is not None:
        return (f"memory bounded per sandbox (a cgroup v2 memory.max: --memory-gib plus {CGROUP_SLACK_GIB:g} GiB for "
                f"the runner and the private folders); {always}")
    return (f"memory bounded per process (--memory-gib) and by the private folders' sizes, not per sandbox (no cgroup "
            f"v2 memory controller can be delegated here); {always}")


def start_as(sandbox: Sandbox | None, cgroup: RunCgroup | None):
    """The ``preexec_fn`` that puts the sandbox's bwrap in ``cgroup`` and, where bwrap runs as the real user
    nobody, drops to it afterwards (joining needs the grader's rights); None when there is nothing to do."""
    drop = sandbox is not None and sandbox.as_nobody
    if cgroup is None:
        return _drop_to_nobody if drop else None

    def enter() -> None:
        cgroup.join()
        if drop:
            _drop_to_nobody()

    return enter


def diagnose(sandbox: Sandbox, prefix: list[str]) -> str:
    """Why a sandbox made with the bwrap arguments ``prefix`` (a :func:`command` without its argv) ended
    before its runner reported anything: the last line bwrap or Python printed when it is started again with
    only an import of the runner. A graded run has no stderr (nothing of the grader's is writable inside)."""
    probe = [sys.executable, "-c", "import tfedu.course.grading.inside"]
    try:
        done = subprocess.run([*prefix, *probe], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                              preexec_fn=_drop_to_nobody if sandbox.as_nobody else None)
    except (OSError, subprocess.SubprocessError) as err:
        return f"the sandbox could not be started: {type(err).__name__}: {err}"[:300]
    last = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode == 0:
        return "the sandbox started again without an error; the run itself ended early (a signal? memory?)"
    return f"the sandbox could not be started (exit code {done.returncode}): {last}"[:300]


def _drop_to_nobody() -> None:  # runs in the child between fork and exec
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _works(sandbox: Sandbox) -> tuple[bool, str]:
    probe = [sys.executable, "-c", "import tfedu.course.grading.inside, ipykernel, os; print(os.getuid())"]
    env = {"HOME": HOME, "PATH": "/usr/bin:/bin", "PYTHONPATH": python_path(), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        with seccomp_file() as rules:
            done = subprocess.run(command(sandbox, probe, env=env, hide=[], tmp_bytes=1 << 20, seccomp_fd=rules.fileno()),
                                  capture_output=True, text=True, timeout=120, pass_fds=(rules.fileno(),),
                                  preexec_fn=_drop_to_nobody if sandbox.as_nobody else None)
    except (OSError, subprocess.SubprocessError) as err:
        return False, f"{type(err).__name__}: {err}"
    if done.returncode == 0 and done.stdout.strip() == str(NOBODY):
        return True, ""
    return False, (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:300]


@functools.lru_cache(maxsize=1)
def find() -> Sandbox:
    """The best sandbox this machine can make (tried once per process); raises SandboxUnavailable."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"{sys.platform} has no Linux namespaces")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bwrap is not installed")
    why = ""
    for as_nobody in ((True, False) if os.geteuid() == 0 else (False,)):
        sandbox = Sandbox(bwrap, as_nobody)
        ok, why = _works(sandbox)
        if ok:
            return sandbox
    raise SandboxUnavailable(f"bwrap failed: {why}")

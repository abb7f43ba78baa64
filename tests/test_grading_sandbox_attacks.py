"""Regression suite for the grading sandbox (issue 10, section 5).

Two parts:

- **unit tests of** :func:`tfedu.grading.sandbox.command`: a tiny ``python -c`` program run in the
  sandbox reports what it can see and do (its uid, ``/proc``, the network, the private size-bounded
  tmpfs folders, the read-only system and Python folders, the host's folders it must not see);
- **attacks graded for real**: every ``tests/sandbox_attacks/*.py`` is an answer cell for notebook 00's
  ``ex_softmax`` that carries one of the attacks an outside reviewer made work before the sandbox
  existed (reading the instructor's and other students' files through ``/proc``, planting an IPython
  startup file for the next submission, a ``setsid`` daemon that kills the runner and rewrites the
  results, ``SIGSTOP`` to every process in sight, writing files outside the exercise folder through
  routes the scan does not see, filling ``/dev/shm``). Each one passes the static scan (asserted
  below), so it really runs and only the sandbox can contain it. They are graded together with
  innocent submissions in ONE ``grade`` call, next to decoy instructor files whose content must never
  come back, and afterwards nothing may be left behind: no process, no file outside the sandbox.

Attack sources are templates: ``{{NAME}}`` is replaced by ``repr`` of the test's value (paths of the
decoys, of the other submissions, of the results), so an attack knows exactly where to aim.
"""

import errno
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tfedu.grading import sandbox

ROOT = Path(__file__).resolve().parents[1]


def box_or_skip():
    try:
        return sandbox.find()
    except sandbox.SandboxUnavailable as err:
        pytest.skip(f"no sandbox on this machine: {err}")


def in_box(code, *, hide=(), tmp_bytes=4 << 20, timeout=60):
    """Run ``code`` (python) in a fresh sandbox; what it prints as its last line, parsed as JSON."""
    box = box_or_skip()
    env = {"HOME": sandbox.HOME, "PATH": "/usr/bin:/bin", "PYTHONPATH": sandbox.python_path(), "PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-c", "import json, os, sys\n" + textwrap.dedent(code)]
    done = subprocess.run(sandbox.command(box, argv, env=env, inputs={}, hide=[Path(h) for h in hide], tmp_bytes=tmp_bytes),
                          capture_output=True, text=True, timeout=timeout, preexec_fn=sandbox.preexec(box))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Unit tests of the sandbox command
# ---------------------------------------------------------------------------------------------


def test_runs_as_nobody_with_a_clean_environment(monkeypatch):
    monkeypatch.setenv("TFEDU_TEST_HOST_SECRET", "host-only-value")
    seen = in_box("print(json.dumps([os.getuid(), os.getgid(), os.geteuid(), dict(os.environ)]))")
    uid, gid, euid, env = seen
    assert uid == euid == sandbox.NOBODY and gid == sandbox.NOBODY
    assert "TFEDU_TEST_HOST_SECRET" not in env and "host-only-value" not in json.dumps(env)
    assert env["HOME"] == sandbox.HOME


def test_proc_shows_only_the_sandbox_processes():
    seen = in_box("""
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        names = {}
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                names[pid] = f.read().replace(b"\\0", b" ").decode()
        print(json.dumps([os.getpid(), names]))
    """)
    me, names = seen
    # bwrap's init (pid 1) and this program: nothing of the host (pytest, the shell, other graders)
    assert len(names) <= 3, names
    assert str(me) in names
    assert all("bwrap" in cmd or "import json" in cmd for cmd in names.values()), names
    assert not any("pytest" in cmd for cmd in names.values())


def test_a_signal_cannot_reach_a_host_process():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        seen = in_box(f"""
            out = []
            for pid in ({sleeper.pid}, {os.getpid()}, -1):
                try:
                    os.kill(pid, 19)  # SIGSTOP
                    out.append("sent")
                except OSError as err:
                    out.append(type(err).__name__)
            print(json.dumps(out))
        """)
        # kill(-1) from inside reaches only the sandbox's own processes; the host pids do not exist there
        assert seen[:2] == ["ProcessLookupError", "ProcessLookupError"] or all(s != "sent" for s in seen[:2])
        state = Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state != "T", "a process outside the sandbox was stopped from inside it"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_no_network_not_even_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        seen = in_box(f"""
            import socket
            out = {{"interfaces": [name for _, name in socket.if_nameindex()]}}
            for host, port in (("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)):
                s = socket.socket()
                s.settimeout(3)
                try:
                    s.connect((host, port))
                    out[host] = "connected"
                except OSError as err:
                    out[host] = type(err).__name__
                finally:
                    s.close()
            print(json.dumps(out))
        """)
    finally:
        server.close()
    assert seen["interfaces"] == ["lo"], seen
    assert seen["127.0.0.1"] == "ConnectionRefusedError", seen  # its own loopback, not the host's
    assert seen["1.1.1.1"] != "connected" and seen["8.8.8.8"] != "connected", seen


def test_tmp_home_and_shm_are_private_and_size_bounded(tmp_path):
    host_marker = Path("/tmp") / f"tfedu-sandbox-unit-{secrets.token_hex(4)}"
    seen = in_box(f"""
        out = {{}}
        with open({str(host_marker)!r}, "w") as f:
            f.write("inside")
        for folder in ("/tmp", os.environ["HOME"], "/dev/shm"):
            written, error = 0, None
            try:
                with open(folder + "/fill", "wb") as f:
                    for _ in range(64):  # 4 MiB, twice the tmpfs size
                        f.write(b"x" * (64 << 10))
                        f.flush()
                        written += 64 << 10
            except OSError as err:
                error = err.errno
            out[folder] = [written, error, sorted(os.listdir(folder))]
        out["host_tmp_folder_visible"] = os.path.exists({str(tmp_path)!r})
        print(json.dumps(out))
    """, tmp_bytes=2 << 20)
    for folder in ("/tmp", sandbox.HOME, "/dev/shm"):
        written, error, listing = seen[folder]
        assert error == errno.ENOSPC and written <= 2 << 20, (folder, seen[folder])
        # empty but for what it wrote: nothing of the host
        assert listing == (["fill", host_marker.name] if folder == "/tmp" else ["fill"]), (folder, listing)
    assert not seen["host_tmp_folder_visible"]
    assert not host_marker.exists(), "a file written to /tmp inside the sandbox appeared on the host"


def test_system_python_and_course_folders_are_read_only():
    targets = ["/usr/tfedu_probe", "/usr/lib/tfedu_probe", f"{sys.prefix}/tfedu_probe",
               str(ROOT / "tfedu" / "tfedu_probe.py"), str(ROOT / "tfedu_probe"), str(ROOT / "data" / "tfedu_probe")]
    seen = in_box(f"""
        out = {{}}
        for path in {targets!r}:
            try:
                open(path, "w").close()
                out[path] = "written"
            except OSError as err:
                out[path] = err.errno
        print(json.dumps(out))
    """)
    for path in targets:
        assert seen[path] in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT), (path, seen[path])
        assert not Path(path).exists()


def test_nothing_but_the_bounded_tmpfs_folders_is_writable():
    """The sandbox's own root (bwrap's tmpfs holding the mount points: /, /etc, /home, the parents of
    the bound folders) and /dev must not take writes: they are tmpfs WITHOUT a size limit (half the
    host's memory), so a submission could fill the grader's RAM past ``Limits.tmp_mib``."""
    targets = ["/tfedu_probe", "/etc/tfedu_probe", "/home/tfedu_probe", "/dev/tfedu_probe",
               str(ROOT.parent / "tfedu_probe"), "/root/tfedu_probe"]
    seen = in_box(f"""
        out = {{}}
        for path in {targets!r}:
            try:
                with open(path, "wb") as f:
                    f.write(b"x" * (1 << 20))
                out[path] = "written"
            except OSError as err:
                out[path] = err.errno
        print(json.dumps(out))
    """)
    assert all(seen[path] != "written" for path in targets), seen
    for path in targets:
        assert not Path(path).exists() or path.startswith("/dev/")


def test_hosts_private_folders_and_hidden_folders_are_not_visible(tmp_path):
    (tmp_path / "secret.txt").write_text("decoy")
    host_root = sorted(p.name for p in Path("/root").iterdir()) if Path("/root").is_dir() else []
    notebooks = ROOT / "notebooks"
    seen = in_box(f"""
        out = {{}}
        for folder in ("/root", {str(notebooks)!r}, {str(tmp_path)!r}, "/work", "/etc"):
            try:
                out[folder] = sorted(os.listdir(folder))
            except OSError as err:
                out[folder] = err.errno
        out["shadow"] = os.path.exists("/etc/shadow")
        print(json.dumps(out))
    """, hide=[notebooks])
    visible_root = seen["/root"] if isinstance(seen["/root"], list) else []
    # only the folders bound for Python (pyenv lives in /root on some machines), nothing else of the host's /root
    assert set(visible_root) <= {".pyenv", ".local"} & set(host_root) | ({".pyenv"} if ".pyenv" in host_root else set()), visible_root
    assert seen[str(notebooks)] == [], "the source notebooks' folder is visible in the sandbox"
    assert seen[str(tmp_path)] == errno.ENOENT
    assert seen["shadow"] is False
    assert set(seen["/etc"]) <= set(sandbox.ETC_FILES), seen["/etc"]


def test_a_detached_process_dies_with_the_sandbox():
    marker = f"sleep 47{secrets.randbelow(90) + 10}.5"
    in_box(f"""
        pid = os.posix_spawn("/bin/sh", ["sh", "-c", "trap '' HUP TERM; ({marker} &) ; {marker}"], {{}}, setsid=True)
        print(json.dumps(pid))
    """)
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"processes outlived their sandbox: {left}"

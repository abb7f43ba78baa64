"""Regression suite for the grading sandbox (issue 10, section 5).

Two parts:

- **unit tests of** :func:`tfedu.course.grading.sandbox.command`: a tiny ``python -c`` program run in the
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
import re
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tfedu.course.grading import sandbox, warm

from optional_parts import sandbox_or_skip

ROOT = Path(__file__).resolve().parents[1]


def in_private_tmp(path):
    """True for a path that lies in the sandbox's own /tmp (a checkout under /tmp, as CI clones may be):
    writes there land in the private, size-bounded tmpfs, not on the host."""
    path = Path(path)
    return path.is_relative_to("/tmp") and not any(path.is_relative_to(b) for b in sandbox.readable_paths())


def mount_point_parents_in_tmp():
    """The first folder under /tmp of every bound folder that lives there (bwrap makes them to mount on)."""
    return {b.relative_to("/tmp").parts[0] for b in sandbox.readable_paths() if b.is_relative_to("/tmp")}


def in_box(code, *, hide=(), tmp_bytes=4 << 20, timeout=60):
    """Run ``code`` (python) in a fresh sandbox; what it prints as its last line, parsed as JSON."""
    box = sandbox_or_skip()
    env = {"HOME": sandbox.HOME, "PATH": "/usr/bin:/bin", "PYTHONPATH": sandbox.python_path(), "PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-c", "import json, os, sys\n" + textwrap.dedent(code)]
    with sandbox.seccomp_file() as rules:
        done = subprocess.run(sandbox.command(box, argv, env=env, hide=[Path(h) for h in hide], tmp_bytes=tmp_bytes,
                                              seccomp_fd=rules.fileno()),
                              capture_output=True, text=True, timeout=timeout, pass_fds=(rules.fileno(),),
                              preexec_fn=sandbox.start_as(box, None))
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
        expected = {"fill", host_marker.name, *mount_point_parents_in_tmp()} if folder == "/tmp" else {"fill"}
        assert set(listing) <= expected and "fill" in listing, (folder, listing)
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
        if not in_private_tmp(path):
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
    assert all(seen[path] != "written" for path in targets if not in_private_tmp(path)), seen
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
    # empty (PYTHONPATH binds the repository and the folder is covered) or absent (only tfedu/ is bound)
    assert seen[str(notebooks)] in ([], errno.ENOENT), "the source notebooks' folder is visible in the sandbox"
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


# ---------------------------------------------------------------------------------------------
# Attacks graded for real, all in one `grade` call
# ---------------------------------------------------------------------------------------------

from tfedu.course.grading.grade import Limits, grade  # noqa: E402

from grading_limits import calibrated  # noqa: E402
from tfedu.checks.scan import scan_answer  # noqa: E402

ATTACKS_DIR = Path(__file__).resolve().parent / "sandbox_attacks"
SOURCE = ROOT / "notebooks" / "00_start_here.ipynb"
CHECK, ANSWER = "check_softmax", "ex_softmax"
# The limits on an idle machine; the `limits` fixture scales them to what the correct answer costs here and now.
IDLE_LIMITS = Limits(cell_timeout=8.0, timeout=15.0, memory_gib=2.0, startup_timeout=12.0, tmp_mib=32.0)


def backstop(limits):
    """The SIGSTOP attack freezes the runner: only the grader's backstop (timeout + startup_timeout + 15 s) ends it."""
    return limits.timeout + limits.startup_timeout + 15


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    sandbox_or_skip()
    path = tmp_path_factory.mktemp("calibration") / SOURCE.name
    path.write_text(submission(CORRECT))
    scaled, seconds = calibrated(IDLE_LIMITS, path, SOURCE)
    print(f"limits {scaled} from a correct run of {seconds:.1f} s")
    return scaled
ATTACKS = {  # file stem -> what the feedback must say (the attack ran, and why it scored zero)
    "sigstop_everything": "total time limit",
    "daemon_kills_runner_rewrites_results": "grading stopped",
    "raise_next_ipython_startup": "ATTACK[",
    "leak_proc_and_files": "LEAK[",
    "leak_runner_memory": "LEAK[",
    "write_outside": "ATTACK[",
    "fill_shm_tmp_home": "ATTACK[",
    "read_hidden_inputs_early": "ATTACK[found: ]",  # nothing of the hidden test's inputs exists yet
    "watch_inputs_from_a_thread": "threads started by the notebook were still running",
    "write_inherited_descriptors": "grading stopped",
    "hold_memory_outside_limits": "ATTACK[",
}
ROUTES = ATTACKS_DIR / "routes"  # attack_routes: os, threading, ctypes past the scan (on PYTHONPATH while grading)
MARKERS = ("sleep 4712", "tfedu_attack", "tfedu-attack")
CORRECT = '''def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    shifted = x - x.max(dim=-1, keepdim=True).values
    exps = shifted.exp()
    return exps / exps.sum(dim=-1, keepdim=True)
'''
STUB = '''def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, stable for large logits."""
    # YOUR CODE HERE
    raise NotImplementedError("replace this line with your code")
'''


def notebook_context():
    from tfedu.course import nbtools

    nb = nbtools.read(SOURCE)
    context = []
    for cell in nb.cells:
        if (nbtools.nbgrader_meta(cell) or {}).get("grade_id") == ANSWER:
            return context
        if cell.cell_type == "code":
            context.append(cell.source)
    raise AssertionError("no ex_softmax cell")


def attack_source(name, values):
    text = (ATTACKS_DIR / f"{name}.py").read_text()
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", repr(value))
    assert "{{" not in text, f"{name}: a placeholder was not filled"
    return text


def submission(answer):
    import nbformat

    from tfedu.course import nbtools
    from tfedu.course.grading.release import student_version

    nb = student_version(nbtools.read(SOURCE), SOURCE.name)
    cell = next(c for c in nb.cells if (nbtools.nbgrader_meta(c) or {}).get("grade_id") == ANSWER)
    cell.source = answer
    return nbformat.writes(nb)


def snapshot(*paths):
    """(path, size, mtime) of every file under ``paths``; missing paths are recorded as missing."""
    seen = {}
    for path in map(Path, paths):
        if path.is_dir():
            for item in sorted(path.rglob("*")):
                st = item.lstat()
                seen[str(item)] = (st.st_size, st.st_mtime_ns)
        elif path.exists() or path.is_symlink():
            st = path.lstat()
            seen[str(path)] = (st.st_size, st.st_mtime_ns)
        else:
            seen[str(path)] = None
    return seen


def left_behind(token):
    """Processes that carry this run's environment token or an attack's marker in their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if token.encode() in environ or any(m in cmdline for m in MARKERS):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


@pytest.fixture(scope="module")
def attacked(tmp_path_factory, limits):
    token = secrets.token_hex(8)
    base = tmp_path_factory.mktemp("sandbox-attacks")
    subs, instructor, results = base / "submissions", base / "instructor", base / "results"
    for folder in (subs, instructor, results):
        folder.mkdir()
    decoy = instructor / "secrets.txt"
    decoy_secret = f"decoy-instructor-secret-{secrets.token_hex(12)}"
    decoy.write_text(f"{decoy_secret}\n")
    (instructor / "solutions.ipynb").write_text(json.dumps({"cells": [{"source": decoy_secret}]}))
    innocent_tokens = {name: secrets.token_hex(12) for name in ("innocent_stub_first", "innocent_correct", "innocent_stub_last")}
    innocent_answers = {"innocent_stub_first": STUB, "innocent_correct": CORRECT, "innocent_stub_last": STUB}
    paths = {name: subs / f"{name}.ipynb" for name in [*ATTACKS, *innocent_tokens]}
    out = results / "results.json"
    home = Path(os.path.expanduser("~"))
    host_markers = [Path("/tmp") / f"tfedu_attack_marker_{token}", home / f"tfedu_attack_marker_{token}",
                    ROOT / "tfedu" / f"_tfedu_attack_marker_{token}", ROOT / "data" / f"_tfedu_attack_marker_{token}"]
    startup_folders = [str(home / ".ipython" / f"profile_tfedu_attack_{token}" / "startup"),
                       str(Path(sys.prefix) / "etc" / "ipython" / f"tfedu_attack_{token}")]
    import site

    site_files = [str(Path(site.getsitepackages()[0]) / f"zz_tfedu_attack_{token}.pth"),
                  str(Path(site.getsitepackages()[0]) / f"tfedu_attack_{token}_usercustomize.py")]
    values = {
        "TARGETS": [str(decoy), str(instructor / "solutions.ipynb"), str(SOURCE), str(ROOT / "notebooks" / "01_tokenization.ipynb"),
                    *(str(paths[n]) for n in innocent_tokens), str(out), "/etc/shadow"],
        "FOLDERS": [str(subs), str(instructor), str(ROOT / "notebooks"), str(results), "/root", "/tmp"],
        "STARTUP_FOLDERS": startup_folders,
        "SITE_FILES": site_files,
        "DAEMON_TARGETS": [str(out), str(out.with_suffix(".csv")), str(paths["innocent_correct"]), str(host_markers[0])],
        "WRITE_TARGETS": [str(subs / f"tfedu_attack_new_{token}"), str(paths["innocent_correct"]), str(out), str(decoy),
                          *map(str, host_markers)],
    }
    context = notebook_context()
    sources = {name: attack_source(name, values) for name in ATTACKS}
    for name, source in sources.items():
        paths[name].write_text(submission(source))
    for name, answer in innocent_answers.items():
        paths[name].write_text(submission(f"# {name} {innocent_tokens[name]}\n{answer}"))
    watched = [subs, instructor, *host_markers, *startup_folders, *site_files]
    before = snapshot(*watched)
    shm_before = set(os.listdir("/dev/shm"))
    os.environ["TFEDU_ATTACK_RUN"] = token  # every process of this run inherits it, in or out of the sandbox
    env_secret = f"decoy-env-secret-{secrets.token_hex(12)}"
    os.environ["INSTRUCTOR_API_TOKEN"] = env_secret  # an instructor's credential in the grader's environment
    python_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROUTES), *([python_path] if python_path else [])])
    try:
        start = time.monotonic()
        with warm.scope(fresh=True):  # as one `tfedu grade` call: its warm-kernel server ends with it
            graded = grade(list(paths.values()), out=out, source=SOURCE, limits=limits, jobs=3)
        elapsed = time.monotonic() - start
    finally:
        del os.environ["TFEDU_ATTACK_RUN"], os.environ["INSTRUCTOR_API_TOKEN"]
        if python_path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = python_path
    written = snapshot(out, out.with_suffix(".csv"))
    time.sleep(2.5)  # a daemon that outlived its sandbox would strike now
    after = {
        "watched": snapshot(*watched),
        "written": snapshot(out, out.with_suffix(".csv")),
        "shm": set(os.listdir("/dev/shm")),
        "processes": left_behind(token),
    }
    for path in [*host_markers, *map(Path, site_files)]:  # tidy up should a hole have let one through
        if path.is_file():
            path.unlink()
    return {"entries": {Path(e["file"]).stem: e for e in graded["submissions"]}, "elapsed": elapsed, "sources": sources,
            "context": context, "before": before, "written": written, "after": after, "shm_before": shm_before,
            "decoy_secret": decoy_secret, "env_secret": env_secret, "innocent_tokens": innocent_tokens, "out": out, "host_markers": host_markers,
            "limits": limits}


@pytest.mark.parametrize("name", ATTACKS)
def test_each_attack_passes_the_static_scan(attacked, name):
    # Otherwise it proves nothing about the sandbox: rewrite the attack through another route.
    assert scan_answer(attacked["sources"][name], context=attacked["context"]) == []


@pytest.mark.parametrize("name", ATTACKS)
def test_each_attack_runs_and_scores_zero(attacked, name):
    entry = attacked["entries"][name]
    feedback = entry["exercises"][CHECK]["feedback"]
    assert entry["total"] == 0 and entry["exercises"][CHECK]["points"] == 0, feedback
    assert ATTACKS[name] in feedback, feedback


def test_innocent_submissions_keep_exactly_their_own_results(attacked):
    entries = attacked["entries"]
    assert entries["innocent_correct"]["total"] == 2, entries["innocent_correct"]
    assert "passed" in entries["innocent_correct"]["exercises"][CHECK]["feedback"]
    # the last stub is graded after the startup-file attack: nothing planted there may raise it
    for name in ("innocent_stub_first", "innocent_stub_last"):
        assert entries[name]["total"] == 0 and "not done yet" in entries[name]["exercises"][CHECK]["feedback"], entries[name]


def test_feedback_never_holds_instructor_files_or_other_answers(attacked):
    text = json.dumps(list(attacked["entries"].values())) + attacked["out"].read_text()
    assert attacked["decoy_secret"] not in text
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    for name, token in attacked["innocent_tokens"].items():
        assert token not in text, f"the answer of {name} came back in the feedback"
    leak = attacked["entries"]["leak_proc_and_files"]["exercises"][CHECK]["feedback"]
    assert "pid 1:" in leak  # the attack did look at /proc


def test_feedback_never_holds_the_graders_environment(attacked):
    """The grader's environment (where an instructor may keep a token) must not reach the submission:
    the kernel gets the grader's variables (``os.environ``), and bwrap, pid 1 of the sandbox, carries
    them on its command line (``--setenv NAME VALUE``), readable in ``/proc/1/cmdline``."""
    leak = attacked["entries"]["leak_proc_and_files"]["exercises"][CHECK]["feedback"]
    assert "env: " in leak  # the attack looked
    assert attacked["env_secret"] not in leak, leak[:600]


def test_leak_attacks_see_only_their_own_sandbox(attacked):
    leak = attacked["entries"]["leak_proc_and_files"]["exercises"][CHECK]["feedback"]
    processes = re.findall(r"pid (\d+): ([^;]*)", leak)
    # bwrap's init (pid 1), the runner, the kernel's launcher, the kernel: nothing of the host
    assert 2 <= len(processes) <= 8, processes
    assert not any("pytest" in cmd for _, cmd in processes), processes
    # what the instructor's and the other students' files gave: nothing (they are not there)
    for path in ("secrets.txt", "solutions.ipynb", "00_start_here.ipynb", "innocent_correct.ipynb"):
        assert re.search(re.escape(path) + r"=(FileNotFoundError|PermissionError)", leak), (path, leak)
    memory = attacked["entries"]["leak_runner_memory"]["exercises"][CHECK]["feedback"]
    assert "hits" not in memory or " 0 hits" in memory, memory  # no process's memory could be read


def test_the_fill_attack_was_bounded_by_the_tmpfs_size(attacked):
    feedback = attacked["entries"]["fill_shm_tmp_home"]["exercises"][CHECK]["feedback"]
    filled = {folder: (int(mib), why) for folder, mib, why in re.findall(r"([/\w]+): (\d+) MiB, ([^;\]]+)", feedback)}
    assert set(filled) == {"/dev/shm", "/tmp", sandbox.HOME}, feedback
    for mib, why in filled.values():
        assert mib <= attacked["limits"].tmp_mib and why.strip() == f"errno {errno.ENOSPC}", feedback


def test_no_file_outside_the_sandbox_changed(attacked):
    before, after = attacked["before"], attacked["after"]
    changed = {p: (before.get(p), after["watched"].get(p)) for p in set(before) | set(after["watched"])
               if before.get(p) != after["watched"].get(p)}
    assert not changed, changed
    assert all(not p.exists() for p in attacked["host_markers"])
    assert attacked["written"] == after["written"], "the results changed after grade returned"
    assert "HACKED" not in attacked["out"].read_text() + attacked["out"].with_suffix(".csv").read_text()
    assert after["shm"] <= attacked["shm_before"], after["shm"] - attacked["shm_before"]


def test_the_hidden_tests_inputs_do_not_exist_before_the_hidden_test_runs(attacked):
    """Issue 37, class 3: the inputs travel in the runner's memory and are written only when their harness
    runs; an answer cell looking for them earlier finds nothing, and a thread of its own left to watch for
    them trips the harness."""
    early = attacked["entries"]["read_hidden_inputs_early"]["exercises"][CHECK]["feedback"]
    assert "ATTACK[found: ]" in early and "inputs.json" not in early, early
    watcher = attacked["entries"]["watch_inputs_from_a_thread"]["exercises"][CHECK]
    assert watcher["points"] == 0 and "threads started by the notebook" in watcher["feedback"], watcher["feedback"]


def test_no_writable_descriptor_of_the_grader_reaches_the_sandbox(attacked):
    """Issue 37, class 8: the attack wrote a forged report line and a forged error line into every descriptor
    it could open through /proc; none of them reached the grader (the sandbox has no stderr, the report's
    descriptor is the runner's alone)."""
    entry = attacked["entries"]["write_inherited_descriptors"]
    assert "FORGED" not in json.dumps(entry), entry
    assert "grading stopped" in entry["exercises"][CHECK]["feedback"]


def test_memory_outside_the_per_process_limits_is_bounded(attacked):
    """Issue 37, class 6: without a cgroup for the sandbox, anonymous files and SysV shared memory are denied
    (they hold memory that no per-process limit counts) and a process may hold 512 open files; with one,
    memory.max bounds them with everything else."""
    feedback = attacked["entries"]["hold_memory_outside_limits"]["exercises"][CHECK]["feedback"]
    assert f"memfd_create: errno {errno.EPERM}" in feedback and f"shmget: errno {errno.EPERM}" in feedback, feedback
    assert "open files: (512, 512)" in feedback, feedback


def test_the_memory_rule_in_force_is_said():
    """`tfedu grade` and `tfedu check` print which memory rule holds here (the README explains both)."""
    box = sandbox_or_skip()
    described = box.describe()
    if sandbox.memory_cgroup() is None:
        assert "memfd_create and SysV shared memory are denied" in described and "512" in described, described
    else:
        assert "memory.max" in described, described


def test_no_process_is_left_behind(attacked):
    assert not attacked["after"]["processes"], attacked["after"]["processes"]


def test_every_run_ended_within_its_limits(attacked):
    entries = attacked["entries"]
    for name, entry in entries.items():
        assert entry["seconds"] <= backstop(attacked["limits"]) + 10, (name, entry["seconds"])  # what the grader promises, SIGSTOP or not
    print(f"graded {len(entries)} submissions in {attacked['elapsed']:.1f} s")
    for name, entry in entries.items():
        print(f"{name} ({entry['seconds']} s): {entry['exercises'][CHECK]['feedback'][:1500]}")
    assert attacked["elapsed"] <= backstop(attacked["limits"]) + 3 * (attacked["limits"].timeout + 10)


def test_without_the_sandbox_the_safe_attacks_still_score_zero_and_the_grader_survives(tmp_path, limits, monkeypatch):
    """``sandboxed=False``: only the attacks that are safe to run as the grader's own user (reading,
    and writing into this test's tmp folder; no signals, daemons or writes to the real home). They
    are not contained here (they may read and write what the grader can), but the grader finishes,
    they score zero and the innocent submissions keep their own results."""
    subs, aim = tmp_path / "submissions", tmp_path / "aim"
    subs.mkdir()
    aim.mkdir()
    values = {"TARGETS": [str(aim / "secret.txt")], "FOLDERS": [str(aim)],
              "WRITE_TARGETS": [str(aim / "new"), str(aim / "other.ipynb")]}
    (aim / "secret.txt").write_text("readable without a sandbox")
    answers = {name: attack_source(name, values) for name in ("leak_proc_and_files", "write_outside")}
    answers.update(innocent_correct=CORRECT)
    paths = []
    for name, answer in answers.items():
        paths.append(subs / f"{name}.ipynb")
        paths[-1].write_text(submission(answer))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROUTES), *filter(None, [os.environ.get("PYTHONPATH")])]))
    results = grade(paths, out=tmp_path / "results.json", source=SOURCE, limits=limits, jobs=3, sandboxed=False)
    entries = {Path(e["file"]).stem: e for e in results["submissions"]}
    assert entries["innocent_correct"]["total"] == 2
    for name in ("leak_proc_and_files", "write_outside"):
        assert entries[name]["total"] == 0 and ("LEAK[" in entries[name]["exercises"][CHECK]["feedback"]
                                                or "ATTACK[" in entries[name]["exercises"][CHECK]["feedback"])
        assert entries[name]["seconds"] <= backstop(limits) + 10
    assert json.loads((tmp_path / "results.json").read_text())["submissions"]


def test_a_runs_cgroup_is_made_joined_read_and_removed(tmp_path):
    """The cgroup v2 path's own steps, on a stand-in folder (this machine's cgroups are v1, so a real
    memory.max is not tried here): the limit written, swap off, the process moved in by its pid, an OOM
    kill read back from memory.events, the folder removed."""
    run = sandbox.RunCgroup(tmp_path, 3 << 30)
    assert run.path.parent == tmp_path and (run.path / "memory.max").read_text() == str(3 << 30)
    (run.path / "cgroup.procs").write_text("")
    run.join()
    assert (run.path / "cgroup.procs").read_text() == str(os.getpid())
    assert not run.ran_out()
    (run.path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    assert run.ran_out()
    for name in ("memory.max", "cgroup.procs", "memory.events"):  # a real cgroup's files go with it
        (run.path / name).unlink()
    run.remove()
    assert not run.path.exists()

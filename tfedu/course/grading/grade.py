"""Autograding: ``tfedu grade SUBMISSION.ipynb... --out results.json`` (and a CSV next to it).

How one submission is graded:

1. **Trusted notebook.** The source notebook (found in ``notebooks/`` by the submission's file
   name, or given with ``--source``) is the program that runs. From the submission only the
   *answer cells* are taken, matched by the ``grade_id`` of the source's solution cells; the
   student's check and test cells, metadata, points and kernelspec are ignored. Points come
   from the source's check cells. Duplicated answer cells: the first one counts. An unreadable
   file (invalid JSON, not nbformat 4, no cells, a ``.py`` renamed) scores zero with a message.
2. **Static phase.** An answer cell that is still the released stub (up to blank lines and trailing
   spaces) scores zero, "not done yet", without running: its check cell could only raise
   ExerciseNotDone, and a notebook left unsolved costs no kernel. Then a **static scan**
   (:mod:`tfedu.checks.scan`) of every other answer cell for escape hatches, and of
   each exercise's own answer for its ``Probe.forbidden`` reference (earlier answers serve as
   context for aliases; indirect calls are left to the run-time tripwire). A flagged
   answer scores zero with the reason, and it is replaced by the release stub before running.
   The scan has its own limits (an answer over ``scan.MAX_ANSWER_CHARS`` characters, or whose
   scan runs past ``scan.SCAN_SECONDS``, scores zero), so no answer can stall the grader here.
3. **Run in a sandbox** (:mod:`tfedu.course.grading.sandbox`): the hidden tests' inputs are drawn first,
   from OS entropy, and travel in the plan (every cell's code, the answers or their stubs) on the
   stdin of a fresh bubblewrap sandbox's runner, which hands each probe's inputs to the kernel inside
   that probe's harness cell, never as a file: no cell before it can read them. The plan holds only what grading needs
   (:mod:`tfedu.course.grading.needs`): the answers, the check cells, the hidden tests and the cells of
   the notebook they use, not its demonstrations and experiments (``full=True``, ``--full``: every
   cell; so does an answer that reads names dynamically). Inside, the runner
   (:mod:`tfedu.course.grading.inside`) drives a fresh kernel (:mod:`tfedu.course.grading.kernel`: memory,
   file-size, CPU and process limits, no stdin, a per-cell and a total time limit). After each
   check cell a harness cell (:mod:`tfedu.course.grading.harness`) runs the check's ``Probe`` and exports
   plain data; the runner appends it to its report, one JSON line at a time, so a later crash
   cannot take it back. Reference stand-ins for the earlier exercises an exercise builds on are
   bound while its check cell and hidden test run (``Probe.standins``): one mistake costs one
   exercise. Past the total limit (plus :data:`BACKSTOP_SECONDS`) the grader kills the sandbox,
   and with it every process inside.
4. **Judge in the grader's own process**, after the sandbox has exited: ``probe.reference(inputs)``
   is computed here and compared with the exported data (``probe.compare`` or ``np.allclose``
   with the probe's tolerances). An exercise earns its points only when its check cell ran
   without error *and* the probe matched *and* the tripwire stayed silent. The check cell's hint
   is the feedback when it fails. The runner can only report zeros and data: no point comes from
   inside the sandbox.
5. **Failures stay local.** When a cell runs past its limit or the kernel dies, the runner blames
   the most recent student answer at or before that cell (zero, with the reason), replaces it by
   its stub, and a fresh kernel replays the notebook from the top and carries on. Past the total
   limit, whatever is not graded yet scores zero. Submissions are independent (``jobs`` of them
   run at once, each in its own sandbox). A cell of the notebook that is not an exercise (a demo,
   an experiment) and raises is listed in the entry's ``cell_errors`` (its index, the error, the
   traceback): the learner's answer may be why, or the course's own notebook is broken.
6. **Plain-text report.** Everything the grader reports (feedback, notes, file names) goes
   through :func:`clean_text` before it is returned, printed or written to the JSON and CSV: an
   error message is the student's text, and terminal escapes in it could forge the report.
"""

from __future__ import annotations

import base64
import csv
import importlib
import json
import os
import re
import secrets
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tfedu.course import nbtools
from tfedu.checks.core import NOT_DONE_MESSAGE, Probe, compare_plain
from tfedu.course.grading import harness, needs, sandbox, shards, warm
from tfedu.course.grading.inside import import_statements
from tfedu.course.grading.kernel import TRACEBACK_CAP, clean_environment, kill_session
from tfedu.course.grading.release import CODE_STUB, _replace_regions, is_check, is_solution
from tfedu.checks.scan import SCAN_SECONDS, SUBMISSION_SCAN_SECONDS, scan_answer

MAX_SUBMISSION_BYTES = 20 << 20
MAX_REPORT_BYTES = 64 << 20  # the runner's report (hidden tests' outputs, base64), read into the grader
MAX_CELL_ERRORS = 50  # errors of the notebook's other cells kept per submission
BACKSTOP_SECONDS = 5.0  # past the total limit, the grader kills the sandbox (the runner stopped or froze)
CPU_WINDOW_SECONDS = 10.0  # the CPU share is measured over this window

# Terminal escape sequences, removed whole so that their parameters do not stay behind as text:
# OSC (ESC ] ... BEL or ST, window titles and hyperlinks), CSI (ESC [ ... final byte, colours,
# cursor moves, line erasing; 0x9b is its one-byte C1 form), then any other two-byte ESC sequence.
_ESCAPES = re.compile(r"\x1b\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                      r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
                      r"|\x1b[ -~]?")


def clean_text(text: str, *, one_line: bool = False) -> str:
    r"""Student-controlled text made safe to print and to store: terminal escape sequences removed,
    control and format characters (carriage return, backspace, C1, bidi overrides such as U+202E,
    lone surrogates) dropped, tabs made spaces. Newlines stay, or become `` | `` with ``one_line``
    (a report line per exercise must not be forged by a newline in an error message).

    >>> clean_text("\x1b[2K\r\u2714 all checks passed\u202e")
    '\u2714 all checks passed'
    >>> clean_text("a\nb\tc", one_line=True)
    'a | b c'
    """
    text = _ESCAPES.sub("", str(text))
    kept = []
    for char in text:
        if char in "\n\u2028\u2029":
            kept.append(" | " if one_line else "\n")
        elif char == "\t":
            kept.append(" ")
        elif unicodedata.category(char) not in ("Cc", "Cf", "Cs"):
            kept.append(char)
    return "".join(kept)


def _clean_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """The one place a submission's results are made plain text before leaving the grader."""
    entry["file"] = clean_text(entry["file"], one_line=True)  # a newline in a file name could forge a report line
    entry["notes"] = [clean_text(note) for note in entry["notes"]]
    for exercise in entry["exercises"].values():
        exercise["feedback"] = clean_text(exercise["feedback"])
    for error in entry.setdefault("cell_errors", []):
        error["error"], error["traceback"] = clean_text(error["error"]), clean_text(error["traceback"])
    return entry


class ConfigError(RuntimeError):
    """The instructor's side is wrong (no source notebook, a check cell without a probe, ...)."""


class SubmissionError(ValueError):
    """The submission file cannot be read as a notebook."""


@dataclass(frozen=True)
class Limits:
    cell_timeout: float = 120.0  # seconds any one cell may run
    timeout: float = 900.0  # seconds for a whole submission, kernel starts and replays included
    memory_gib: float = 4.0  # address-space limit of the kernel and what it starts
    file_mib: float = 256.0  # largest file the kernel may write
    startup_timeout: float = 60.0
    processes: int = 128  # processes in the sandbox at once (and RLIMIT_NPROC, which counts threads)
    threads: int = 512  # threads of all its processes together (each takes a process ID of the host)
    files: int = 20_000  # files (inodes) in each private folder: a tmpfs's size does not bound them
    tmp_mib: float = 256.0  # size of each private tmpfs in the sandbox (/tmp, $HOME, /dev/shm, the exchange)


@dataclass
class Step:
    kind: str  # "code" (trusted), "answer", "check" or "probe"
    source: str
    cell: int  # index in the source notebook
    grade_id: str = ""  # the answer's or the check's grade_id


@dataclass
class Assignment:
    path: Path
    steps: list[Step]
    answers: list[str]  # solution grade_ids in notebook order
    stubs: dict[str, str]  # solution grade_id -> its released source
    points: dict[str, float]  # check grade_id -> points
    probes: dict[str, Probe]  # check grade_id -> probe


def default_notebooks_dir() -> Path:
    here = Path(__file__).resolve().parents[3] / "notebooks"
    return here if here.is_dir() else Path.cwd() / "notebooks"


def find_source(submission: Path, notebooks_dir: Path) -> Path:
    """The source notebook for ``submission``: same file name, else the longest name its stem starts with."""
    exact = notebooks_dir / submission.name
    if exact.is_file():
        return exact
    candidates = [p for p in notebooks_dir.glob("*.ipynb") if submission.stem.startswith(p.stem)]
    if not candidates:
        raise ConfigError(f"no source notebook in {notebooks_dir} matches {submission.name}; pass --source")
    return max(candidates, key=lambda p: len(p.stem))


def checks_module(source: Path, nb, name: str | None = None) -> Any:
    """The module holding the source's PROBES: ``name``, else tfedu.checks.nb<stem>, else the one its cells import."""
    if name:
        return importlib.import_module(name)
    names = [f"tfedu.checks.nb{source.stem}"]
    for cell in nb.cells:
        names += [f"tfedu.checks.{m}" for m in re.findall(r"tfedu\.checks\.(nb\w+)|from tfedu\.checks import (nb\w+)", cell.source) for m in m if m]
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ConfigError(f"{source.name}: no checks module found (tried {', '.join(dict.fromkeys(names))})")


def load_assignment(source: Path, checks: str | None = None) -> Assignment:
    nb = nbtools.read(source)
    module = checks_module(source, nb, checks)
    probes_all: dict[str, Probe] = getattr(module, "PROBES", {})
    steps: list[Step] = []
    answers, stubs, points, probes = [], {}, {}, {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        meta = nbtools.nbgrader_meta(cell) or {}
        grade_id = str(meta.get("grade_id", ""))
        if is_solution(cell):
            answers.append(grade_id)
            stub, replaced = _replace_regions(cell.source, nbtools.BEGIN_SOLUTION, nbtools.END_SOLUTION, CODE_STUB, grade_id)
            stubs[grade_id] = stub if replaced else CODE_STUB
            steps.append(Step("answer", cell.source, index, grade_id))
        elif is_check(cell):
            probe = probes_all.get(grade_id)
            if probe is None:
                raise ConfigError(f"{source.name}: check cell {grade_id} has no Probe in {module.__name__}.PROBES")
            if probe.exercise not in answers:
                raise ConfigError(f"{source.name}: probe {grade_id} grades {probe.exercise!r}, which is not an answer cell before it")
            points[grade_id] = float(meta.get("points", 0) or 0)
            probes[grade_id] = probe
            steps.append(Step("check", cell.source, index, grade_id))
            steps.append(Step("probe", "", index, grade_id))
        else:
            steps.append(Step("code", cell.source, index))
    return Assignment(source, steps, answers, stubs, points, probes)


def read_answers(path: Path, wanted: list[str]) -> tuple[dict[str, str], list[str]]:
    """The submission's answer sources by grade_id, plus notes for the student."""
    try:
        if not path.is_file():  # a FIFO, a device or a folder would block or never end
            raise SubmissionError("the submission is not a regular file")
        if path.stat().st_size > MAX_SUBMISSION_BYTES:
            raise SubmissionError(f"the file is larger than {MAX_SUBMISSION_BYTES >> 20} MiB")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        if isinstance(err, SubmissionError):
            raise
        raise SubmissionError(f"the file is not a Jupyter notebook (it is not valid JSON: {str(err)[:120]})") from None
    if isinstance(data, dict) and "nbformat" in data and data["nbformat"] != 4:
        raise SubmissionError(f"the notebook is nbformat {data['nbformat']!r}; open and save it in a current Jupyter (nbformat 4)")
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise SubmissionError("the file is not a Jupyter notebook (no list of cells); was a .py file renamed to .ipynb?")
    if not data["cells"]:
        raise SubmissionError("the notebook has no cells")
    answers: dict[str, str] = {}
    notes: list[str] = []
    for cell in data["cells"]:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        meta = cell.get("metadata")
        nbg = meta.get("nbgrader") if isinstance(meta, dict) else None
        grade_id = nbg.get("grade_id") if isinstance(nbg, dict) else None
        if not isinstance(grade_id, str) or grade_id not in wanted:
            continue
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if not isinstance(source, str):
            continue
        if grade_id in answers:
            notes.append(f"several answer cells carry grade_id {grade_id}; only the first was graded")
            continue
        answers[grade_id] = source
    return answers, notes


def judge(probe: Probe, inputs: dict, result: dict | None) -> str | None:
    """None when the exported result matches the reference; else feedback."""
    if result is None:
        return "the hidden test produced no result (did the answer interfere with the notebook or the files around it?)"
    processes = [t for t in result["tripwire"] if "process" in t and "profiler" not in t]
    if processes and len(processes) == len(result["tripwire"]):
        return ("the answer started processes that ran beside the hidden test (" + "; ".join(processes)
                + "); work that the grader cannot watch scores zero")
    if result["tripwire"]:
        return ("the answer called the reference it is supposed to build (" + "; ".join(result["tripwire"])
                + "); an answer that uses the reference scores zero")
    if result["error"]:
        error = result["error"]
        if error.startswith("NotImplementedError"):
            return NOT_DONE_MESSAGE
        return f"on fresh random inputs (the hidden test) your code raised {error}"
    expected = probe.reference(inputs)
    try:
        problem = probe.compare(result["outputs"], expected) if probe.compare else compare_plain(result["outputs"], expected, probe.rtol, probe.atol)
    except Exception as err:  # the outputs had an unexpected form
        problem = f"the result has an unexpected form ({type(err).__name__}: {str(err)[:200]})"
    return None if problem is None else f"on fresh random inputs (the hidden test): {problem}"


@dataclass
class Run:
    """The state of grading one submission."""

    assignment: Assignment
    answers: dict[str, str]
    limits: Limits
    outcome: dict[str, tuple[float, str]] = field(default_factory=dict)  # check id -> (points, feedback)
    stubbed: dict[str, str] = field(default_factory=dict)  # answer id -> why it was replaced
    answer_errors: dict[str, str] = field(default_factory=dict)
    cell_errors: list[dict[str, Any]] = field(default_factory=list)  # the notebook's other cells that raised
    steps: list[Step] | None = None  # what the run executes (default: every step; see graded_steps)
    kernel_start: str | None = None  # "warm" or "cold": how the sandboxed run's first kernel started (warm.py)

    def checks_of(self, answer: str) -> list[str]:
        return [c for c, p in self.assignment.probes.items() if p.exercise == answer]

    def zero(self, check: str, feedback: str) -> None:
        self.outcome.setdefault(check, (0.0, feedback))

    def zero_rest(self, feedback: str) -> None:
        for check in self.assignment.probes:
            self.zero(check, feedback)


def unchanged_stub(answer: str, stub: str) -> bool:
    r"""Whether ``answer`` is the released stub, up to blank lines and trailing spaces.

    >>> unchanged_stub("def f(x):\n    raise NotImplementedError  \n\n", "def f(x):\n    raise NotImplementedError")
    True
    >>> unchanged_stub("def f(x):\n    # TODO\n    raise NotImplementedError", "def f(x):\n    raise NotImplementedError")
    False
    """
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.splitlines() if line.strip()]

    return lines(answer) == lines(stub)


def graded_steps(run: Run) -> list[Step]:
    """The steps a graded run needs (:mod:`tfedu.course.grading.needs`): every answer (or its stub), every
    check cell and hidden test, and the notebook's cells they depend on. A check decided before the run
    only runs its cell's imports, so it reads nothing. Every step when an answer reads names dynamically."""
    a = run.assignment
    cells: list[tuple[str, bool, bool]] = []
    for step in a.steps:
        if step.kind == "code":
            cells.append((step.source, False, True))
        elif step.kind == "answer":
            source = a.stubs[step.grade_id] if step.grade_id in run.stubbed else run.answers[step.grade_id]
            if needs.dynamic(source):
                return list(a.steps)
            cells.append((source, True, False))
        elif step.kind == "check":
            decided = step.grade_id in run.outcome
            cells.append((import_statements(step.source) if decided else step.source, True, True))
        else:
            cells.append(("" if step.grade_id in run.outcome else a.probes[step.grade_id].run, True, True))
    keep = needs.needed(cells)
    return [step for index, step in enumerate(a.steps) if index in keep]


def static_phase(run: Run) -> None:
    a = run.assignment
    budget_end = time.monotonic() + SUBMISSION_SCAN_SECONDS

    def scan(source: str, **kwargs: Any) -> list[str]:  # per answer SCAN_SECONDS, per submission SUBMISSION_SCAN_SECONDS
        left = budget_end - time.monotonic()
        if left <= 0:
            return [f"the static scan of this submission ran past its total limit ({SUBMISSION_SCAN_SECONDS:g} s); "
                    "this answer was not scanned and nothing of it was run"]
        return scan_answer(source, time_limit=min(SCAN_SECONDS, left), **kwargs)

    context: list[str] = []
    answer_sources: dict[str, str] = {}
    for step in a.steps:
        if step.kind == "code":
            context.append(step.source)
        elif step.kind == "answer":
            gid = step.grade_id
            if gid not in run.answers:
                run.stubbed[gid] = f"no answer cell with grade_id {gid} was found in the submission (deleted, or its metadata changed?)"
                for check in run.checks_of(gid):
                    run.zero(check, run.stubbed[gid])
                continue
            source = run.answers[gid]
            if unchanged_stub(source, a.stubs[gid]):  # decided without running: its check cell raises ExerciseNotDone
                run.stubbed[gid] = NOT_DONE_MESSAGE
                for check in run.checks_of(gid):
                    run.zero(check, f"the answer cell is still the released stub: {NOT_DONE_MESSAGE}")
                continue
            problems = scan(source, context=context)  # over the size or time limit: one problem saying so
            if problems:
                run.stubbed[gid] = "; ".join(problems)
                for check in run.checks_of(gid):
                    run.zero(check, run.stubbed[gid])
            else:
                answer_sources[gid] = source
                context.append(source)
        elif step.kind == "check":
            probe = a.probes[step.grade_id]
            if not probe.forbidden and probe.builds is None:
                continue
            ctx: list[str] = []
            for earlier in a.steps[: a.steps.index(step)]:
                if earlier.kind == "code":
                    ctx.append(earlier.source)
                elif earlier.kind == "answer" and earlier.grade_id in answer_sources:
                    src = answer_sources[earlier.grade_id]
                    # Only the exercise's own answer is scanned for its reference. Earlier answers
                    # are context (an alias imported there and used here is still resolved), and a
                    # call into the reference through an earlier answer's function is caught by
                    # the run-time tripwire, so one misuse does not zero the exercises after it.
                    if earlier.grade_id == probe.exercise:
                        plain = set(scan(src, context=ctx))
                        hits = [p for p in scan(src, context=ctx, forbidden=probe.forbidden, allowed=probe.builds)
                                if p not in plain]
                        if hits:
                            run.zero(step.grade_id, "; ".join(hits))
                            run.stubbed.setdefault(earlier.grade_id, "; ".join(hits))
                    ctx.append(src)


# What a sandboxed run gets of the grader's environment: what Python, Jupyter and the course read,
# never the rest (an instructor's tokens and paths would otherwise reach every submission).
SANDBOX_ENV = {"LANG", "LANGUAGE", "TZ", "TERM", "MPLBACKEND", "PYTHONHASHSEED", "PYTHONUTF8", "PYTHONIOENCODING",
               "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TRITON_INTERPRET"}
SANDBOX_ENV_PREFIXES = ("LC_", "TFEDU_")


def _runner_environment(home: str, tmp: str, sandboxed: bool, cpus: float = 1.0) -> dict[str, str]:
    """The environment of the runner and its kernel: the grader's, minus test-runner variables, with a
    private home (IPython, Jupyter and matplotlib folders inside it) and temporary folder."""
    env = clean_environment(home)
    if sandboxed:
        env = {k: v for k, v in env.items() if k in SANDBOX_ENV or k.startswith(SANDBOX_ENV_PREFIXES)}
    for key in ("PYTHONSTARTUP", "OLDPWD", "IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
                "JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        env.pop(key, None)
    env.update(HOME=home, TMPDIR=tmp, IPYTHONDIR=f"{home}/.ipython", JUPYTER_CONFIG_DIR=f"{home}/.jupyter",
               JUPYTER_DATA_DIR=f"{home}/.local/share/jupyter", JUPYTER_RUNTIME_DIR=f"{home}/.local/share/jupyter/runtime",
               MPLCONFIGDIR=f"{home}/.config/matplotlib", XDG_CONFIG_HOME=f"{home}/.config", XDG_CACHE_HOME=f"{home}/.cache",
               PYTHONUSERBASE=site.getuserbase(), PYTHONDONTWRITEBYTECODE="1")
    env["TFEDU_MY_PARTS"] = "off"  # a graded notebook stands alone: other notebooks' parts are the reference
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # torch's threads: the run's CPU share (see Monitor)
        env.setdefault(key, str(max(1, int(cpus))))
    if sandboxed:
        env["PYTHONPATH"] = sandbox.python_path()
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"])
    return env


def _read_events(handle: Any) -> list[dict[str, Any]]:
    """The runner's report: JSON objects, one per line, at most MAX_REPORT_BYTES; a torn last line is dropped."""
    handle.seek(0)
    data = handle.read(MAX_REPORT_BYTES + 1)[:MAX_REPORT_BYTES]
    events = []
    for line in data.split(b"\n"):
        try:
            event = json.loads(line.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def _unpack(files: Any, folder: Path) -> None:
    """A hidden test's exported files, written into a fresh ``folder``/out for :func:`harness.read_result`."""
    out = folder / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(mode=0o700)
    if not isinstance(files, dict):
        return
    for name, data in list(files.items())[:1000]:
        if isinstance(name, str) and isinstance(data, str) and re.fullmatch(r"result\.json|[0-9]{1,6}\.npy", name):
            try:
                (out / name).write_bytes(base64.b64decode(data, validate=True))
            except ValueError:
                continue


def _end(proc: subprocess.Popen) -> None:
    """End the runner and everything it started. In a sandbox, killing bwrap ends its PID namespace.
    Without one, SIGTERM first lets the kernel's launcher (a subreaper) kill what its kernel started."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=3)
        except (OSError, subprocess.TimeoutExpired):
            pass
    kill_session(proc.pid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _process_tree(root: int) -> list[int]:
    """``root`` and every process below it (from the host's /proc: a sandbox's processes are in it too)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo and len(found) < 100_000:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _in_namespace(namespace: str, known: list[int]) -> list[int]:
    """The host PIDs of every process in the PID namespace ``namespace`` (a ``/proc/PID/ns/pid`` link) that is
    not in ``known``: a warm kernel's launcher (warm.py) is in the sandbox but not below bwrap, its parent
    having been outside."""
    seen, found = set(known), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in seen:
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _usage(pids: list[int]) -> tuple[float, int]:
    """CPU seconds of ``pids`` and of the children they have waited for (utime, stime, cutime,
    cstime), and their number of threads."""
    ticks, threads = 0, 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            ticks += sum(int(f) for f in fields[11:15])
            threads += int(fields[17])
        except (OSError, ValueError, IndexError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK"), threads


def _files_in_private_folders(pids: list[int]) -> int:
    """The most files (inodes) in any of the sandbox's private tmpfs, seen through /proc/PID/root of a
    process inside it. A tmpfs's --size bounds bytes, not inodes, and each inode costs host kernel memory."""
    for pid in pids[1:3]:  # bwrap's child (the sandbox's init) and the runner live in the sandbox's mounts
        try:
            counts = []
            for folder in ("tmp", sandbox.HOME.strip("/"), "dev/shm", sandbox.EXCHANGE.strip("/")):
                info = os.statvfs(f"/proc/{pid}/root/{folder}")
                counts.append(info.f_files - info.f_ffree)
            return max(counts)
        except OSError:
            continue
    return 0


class Monitor(threading.Thread):
    """Watches one run from outside its sandbox, where nothing in the sandbox can stop it: ends the run
    when it holds more than ``limits.processes`` processes, or uses more than its share of the CPU
    (``cpus`` cores, with some slack, over :data:`CPU_WINDOW_SECONDS`) and so slows down the
    submissions graded beside it. ``reason`` says why it ended a run."""

    def __init__(self, proc: subprocess.Popen, limits: Limits, cpus: float, sandboxed: bool = True):
        super().__init__(daemon=True)
        self.proc, self.limits, self.allowed, self.sandboxed = proc, limits, cpus * 1.2 + 0.2, sandboxed
        self.reason: str | None = None
        self.done = threading.Event()
        self.peak = 0.0  # the highest CPU rate seen (cores), for the record

    def run(self) -> None:
        samples: list[tuple[float, float]] = []
        namespace = None  # the sandbox's PID namespace, read from its init (bwrap's child)
        while self.proc.poll() is None and not self.done.is_set():
            pids = _process_tree(self.proc.pid)
            if self.sandboxed and namespace is None and len(pids) > 1:
                try:
                    namespace = os.readlink(f"/proc/{pids[1]}/ns/pid")
                    if namespace == os.readlink("/proc/self/ns/pid"):
                        namespace = None  # not made yet
                except OSError:
                    pass
            if namespace is not None:
                pids += _in_namespace(namespace, pids)
            now, (used, threads) = time.monotonic(), _usage(pids)
            samples = [s for s in samples if now - s[0] <= CPU_WINDOW_SECONDS] + [(now, used)]
            span = now - samples[0][0]
            rate = (used - samples[0][1]) / span if span >= CPU_WINDOW_SECONDS / 2 else 0.0
            self.peak = max(self.peak, rate)
            if len(pids) > self.limits.processes + 8:  # bwrap, its init, the runner and the launcher are not the answer's
                self.reason = f"the run held more than {self.limits.processes} processes at once"
            elif threads > self.limits.threads:
                self.reason = f"the run held more than {self.limits.threads} threads at once"
            elif self.sandboxed and _files_in_private_folders(pids) > self.limits.files:
                self.reason = f"the run made more than {self.limits.files} files in one of its private folders"
            elif rate > self.allowed:
                self.reason = (f"the run used {rate:.1f} CPU cores on average over {CPU_WINDOW_SECONDS:g} s, more than its "
                               f"share ({self.allowed:.2f}), slowing down the other submissions graded with it")
            if self.reason:
                kill_session(self.proc.pid)
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                return
            self.done.wait(0.5)


def execute(run: Run, box: sandbox.Sandbox | None, hide: list[Path], cpus: float = 1.0, cold: bool = False) -> None:
    """Run the notebook in a sandbox (``box``; None: without one), then judge what came back.

    The plan (every cell's code, the answers or their stubs, the hidden tests and their inputs)
    goes in on the runner's stdin; inputs are drawn here first, from OS entropy. The
    runner's report is read only after the runner, its kernel and everything they started are gone.
    """
    a, limits = run.assignment, run.limits
    exchange = Path(tempfile.mkdtemp(prefix="tfedu-grade-"))
    home = Path(tempfile.mkdtemp(prefix="tfedu-home-")) if box is None else None
    drawn: dict[str, tuple[dict[str, Any], str, Path]] = {}
    plan_probes: dict[str, dict[str, Any]] = {}
    cgroup: sandbox.RunCgroup | None = None
    try:
        for index, (check, probe) in enumerate(a.probes.items()):
            if check in run.outcome:
                continue
            folder = exchange / str(index)  # on this side only: where the probe's exported result is judged
            try:
                inputs = probe.make_inputs(np.random.default_rng(secrets.randbits(128)))
                encoded = harness.encode_inputs(inputs)
                folder.mkdir()
            except Exception as err:  # the instructor's probe is broken, not the answer
                run.zero(check, f"internal error in the hidden test, tell your instructor: {type(err).__name__}: {err}")
                continue
            nonce = secrets.token_hex(16)
            drawn[check] = (inputs, nonce, folder)
            plan_probes[check] = {"exercise": probe.exercise, "folder": str(index), "run": probe.run, "nonce": nonce,
                                  "inputs": encoded,
                                  "forbidden": list(probe.forbidden), "standins": getattr(probe, "standins", "") or ""}
        plan = {
            "steps": [{"kind": s.kind, "source": s.source, "cell": s.cell, "grade_id": s.grade_id}
                      for s in (a.steps if run.steps is None else run.steps)],
            "answers": {gid: src for gid, src in run.answers.items() if gid in a.stubs},
            "stubs": a.stubs, "stubbed": sorted(run.stubbed), "done": sorted(run.outcome), "probes": plan_probes,
            "cell_timeout": limits.cell_timeout, "timeout": limits.timeout, "startup_timeout": limits.startup_timeout,
            "memory_bytes": int(limits.memory_gib * (1 << 30)), "file_bytes": int(limits.file_mib * (1 << 20)),
            "cpu_seconds": int(limits.timeout * (os.cpu_count() or 1)) + 1,
            "processes": limits.processes if box is not None else 0, "sandboxed": box is not None,
            "not_done": NOT_DONE_MESSAGE,
        }
        with tempfile.TemporaryFile() as report, tempfile.TemporaryFile() as errors, sandbox.seccomp_file() as rules:
            if box is not None:
                argv = [sys.executable, "-m", "tfedu.course.grading.inside", sandbox.EXCHANGE, str(report.fileno())]
                env = _runner_environment(sandbox.HOME, "/tmp", True, cpus)
                cmd = sandbox.command(box, argv, env=env, tmp_bytes=int(limits.tmp_mib * (1 << 20)), seccomp_fd=rules.fileno(),
                                      hide=[a.path.parent, default_notebooks_dir(), *hide])
                popen_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            else:
                assert home is not None
                (home / "tmp").mkdir()
                cmd = [sys.executable, "-m", "tfedu.course.grading.inside", str(exchange), str(report.fileno())]
                env = popen_env = _runner_environment(str(home), str(home / "tmp"), False, cpus)
            if box is not None and box.as_nobody:
                os.fchmod(report.fileno(), 0o666)  # the runner, as nobody, writes its report here
            if box is not None and (parent := sandbox.memory_cgroup()) is not None:
                cgroup = sandbox.RunCgroup(parent, int((limits.memory_gib + sandbox.CGROUP_SLACK_GIB) * (1 << 30)))
            # In a sandbox nothing of the grader's is writable: not even a stderr, which bwrap's first process
            # (the sandbox's init) would hold open for the whole run. The runner reports its own failure in its
            # report; a sandbox that never started is asked why afterwards (sandbox.diagnose).
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL if box is not None else errors,
                                    pass_fds=(report.fileno(), rules.fileno()), start_new_session=True, env=popen_env,
                                    cwd=str(home) if home is not None else "/", preexec_fn=sandbox.start_as(box, cgroup))
            killed = False
            monitor = Monitor(proc, limits, cpus, sandboxed=box is not None)
            monitor.start()
            if box is not None and not cold and warm.enabled() and (runner := warm.find_runner(proc)) is not None:
                kernel_limits = (plan["memory_bytes"], plan["file_bytes"], plan["cpu_seconds"], plan["processes"])
                plan["warm"] = warm.server(env, box).place(runner, cgroup=cgroup, limits=kernel_limits,
                                                           kernel_env=clean_environment(sandbox.HOME, env))
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(plan).encode("utf-8"))
                proc.stdin.close()
            except OSError:
                pass
            try:  # the runner enforces the total limit itself; this is the backstop if it cannot
                proc.wait(timeout=limits.timeout + BACKSTOP_SECONDS)
            except subprocess.TimeoutExpired:
                killed = True
            monitor.done.set()
            monitor.join()
            _end(proc)
            events = _read_events(report)
            errors.seek(0)
            runner_error = errors.read(4000).decode("utf-8", "replace").strip().splitlines()[-1:]
            runner_error = [str(e["runner_error"]) for e in events if "runner_error" in e][:1] or runner_error
            if box is not None and not events and not monitor.reason and not killed:
                runner_error = [sandbox.diagnose(box, cmd[: len(cmd) - len(argv)])]
        finished = any(e.get("end") is True for e in events)
        run.kernel_start = next((e["kernel"] for e in events if e.get("kernel") in ("warm", "cold")),
                                "cold" if box is not None else None)
        for event in events:
            if type(event.get("cell_error")) is int and len(run.cell_errors) < MAX_CELL_ERRORS:
                run.cell_errors.append({"cell": event["cell_error"], "error": str(event.get("error", ""))[:2000],
                                        "traceback": str(event.get("traceback", ""))[-TRACEBACK_CAP:]})
            check = event.get("zero") or event.get("probe")
            if not isinstance(check, str) or check not in drawn:
                continue
            if "zero" in event:
                run.zero(check, str(event.get("feedback", ""))[:3000])
            elif check not in run.outcome:
                inputs, nonce, folder = drawn[check]
                _unpack(event.get("files"), folder)
                try:
                    problem = judge(a.probes[check], inputs, harness.read_result(folder, nonce))
                except Exception as err:  # probe.reference raised: the instructor's side
                    problem = f"internal error in the hidden test's reference, tell your instructor: {type(err).__name__}: {err}"
                if problem is None:
                    run.outcome[check] = (a.points[check], "passed: the check cell and the hidden test on fresh random inputs")
                else:
                    run.zero(check, problem)
        if monitor.reason:
            run.zero_rest(f"{monitor.reason}; it was stopped before this exercise was graded")
        elif killed:
            run.zero_rest(f"the run was stopped at the total time limit for a submission ({limits.timeout:g} s) before "
                          "this exercise was graded")
        elif cgroup is not None and cgroup.ran_out() and not finished:
            run.zero_rest(f"the run went over the memory limit of its whole sandbox ({cgroup.memory_bytes / (1 << 30):.1f} GiB) "
                          "before this exercise was graded")
        elif not finished:
            why = f": {runner_error[0][:300]}" if runner_error else ""
            run.zero_rest(f"grading stopped before this exercise was graded (the grader's runner ended early{why})")
    finally:
        shutil.rmtree(exchange, ignore_errors=True)
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)
        if cgroup is not None:
            cgroup.remove()


def grade_submission(path: str | Path, *, source: str | Path | None = None, notebooks_dir: str | Path | None = None,
                     limits: Limits = Limits(), checks: str | None = None, sandboxed: bool = True,
                     hide: tuple[str | Path, ...] = (), cpus: float | None = None, full: bool = False,
                     cold: bool = False) -> dict[str, Any]:
    """Grade one submission; the entry of the results JSON for it. Raises only for instructor errors.

    The run executes only the cells grading needs (:func:`graded_steps`); ``full`` runs every cell of
    the notebook, and lists in ``cell_errors`` each demonstration that raised.

    ``sandboxed=False`` runs it without the operating-system sandbox (see :mod:`tfedu.course.grading.sandbox`);
    with it, :class:`sandbox.SandboxUnavailable` is raised where none can be made. ``hide``: more host
    folders the sandbox must not show, should a folder it binds contain them.
    """
    path = Path(path)
    box = sandbox.find() if sandboxed else None
    started = time.monotonic()
    source_path = Path(source) if source else find_source(path, Path(notebooks_dir) if notebooks_dir else default_notebooks_dir())
    assignment = load_assignment(source_path, checks)
    entry: dict[str, Any] = {"file": str(path), "source": source_path.name, "total": 0.0,
                             "max": float(sum(assignment.points.values())), "exercises": {}, "notes": []}
    try:
        answers, notes = read_answers(path, assignment.answers)
        entry["notes"] = notes
        run = Run(assignment, answers, limits)
        static_phase(run)
        if any(check not in run.outcome for check in assignment.probes):
            run.steps = list(assignment.steps) if full else graded_steps(run)
            entry["cells_skipped"] = sum(s.kind == "code" for s in assignment.steps) - sum(s.kind == "code" for s in run.steps)
            with warm.scope():
                execute(run, box, [path.resolve().parent, *(Path(h) for h in hide)], cpus or float(os.cpu_count() or 1), cold)
    except SubmissionError as err:
        run = Run(assignment, {}, limits)
        run.zero_rest(f"the submission could not be graded: {err}")
    except Exception as err:  # a grader bug must not take the other submissions down with it
        run = Run(assignment, {}, limits)
        run.zero_rest(f"internal error while grading this submission, tell your instructor: {type(err).__name__}: {str(err)[:300]}")
    for check, points in assignment.points.items():
        got, feedback = run.outcome.get(check, (0.0, "not graded"))
        entry["exercises"][check] = {"points": got, "max": points, "feedback": feedback}
    entry["total"] = float(sum(e["points"] for e in entry["exercises"].values()))
    entry["cell_errors"] = run.cell_errors
    if run.kernel_start is not None:
        entry["kernel_start"] = run.kernel_start
    entry["seconds"] = round(time.monotonic() - started, 2)
    return _clean_entry(entry)


def grade(paths: list[str | Path], *, out: str | Path | None = None, source: str | Path | None = None,
          notebooks_dir: str | Path | None = None, limits: Limits = Limits(), jobs: int = 1,
          checks: str | None = None, sandboxed: bool = True, full: bool = False, cold: bool = False,
          shard: tuple[int, int] | None = None) -> dict[str, Any]:
    """Grade every submission (``jobs`` at a time); write ``out`` (JSON) and a CSV beside it.

    Only the cells grading needs run (the exercises, their checks and what they use); ``full`` runs
    every cell, demonstrations and experiments included. ``shard=(K, N)`` grades the K-th of N
    disjoint shares of ``paths`` (:mod:`tfedu.course.grading.shards`; ``merge`` joins them).

    ``checks`` names the module with the ``PROBES`` (default: ``tfedu.checks.nb<source stem>``).
    Each submission runs in its own sandbox; without one (``sandboxed=False``, ``--no-sandbox``)
    see :mod:`tfedu.course.grading.sandbox` for what is no longer guaranteed. Raises
    :class:`sandbox.SandboxUnavailable` before grading anything when a sandbox is asked for and none can be made.
    """
    if sandboxed:
        sandbox.find()
    place = None
    if shard is not None:
        place = {"index": shard[0], "count": shard[1], "submissions": len(paths)}
        paths = shards.share(list(paths), *shard)
    hide = tuple(str(Path(p).resolve().parent) for p in paths) + ((str(Path(out).resolve().parent),) if out is not None else ())
    unmatched: dict[str, str] = {}
    for path in paths:  # instructor errors first, before any kernel starts
        try:
            found = Path(source) if source else find_source(Path(path), Path(notebooks_dir) if notebooks_dir else default_notebooks_dir())
        except ConfigError as err:  # this file only: the others are still graded
            unmatched[str(path)] = str(err)
            continue
        load_assignment(found, checks)

    def one(path: str | Path) -> dict[str, Any]:
        if str(path) in unmatched:
            return _clean_entry({"file": str(path), "source": None, "total": 0.0, "max": 0.0, "exercises": {},
                                 "notes": [unmatched[str(path)]]})
        return grade_submission(path, source=source, notebooks_dir=notebooks_dir, limits=limits, checks=checks,
                                sandboxed=sandboxed, hide=hide, cpus=max(1.0, (os.cpu_count() or 1) / max(1, jobs)), full=full,
                                cold=cold)

    with warm.scope(), ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        entries = list(pool.map(one, paths))
    results: dict[str, Any] = {"submissions": entries}
    if place is not None:
        results["shard"] = place
    if out is not None:
        write_results(results, Path(out))
    return results


def write_results(results: dict[str, Any], out: Path) -> None:
    """The results JSON at ``out`` and the CSV beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    write_csv(results, out.with_suffix(".csv"))


def write_csv(results: dict[str, Any], path: Path) -> None:
    """One row per submission: file, total, max, then the points of each exercise."""
    columns: list[str] = []
    for entry in results["submissions"]:
        columns += [c for c in entry["exercises"] if c not in columns]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "total", "max", *columns])
        for entry in results["submissions"]:
            writer.writerow([entry["file"], entry["total"], entry["max"],
                             *(entry["exercises"].get(c, {}).get("points", "") for c in columns)])

"""The grader's runner: it runs *inside* a submission's sandbox and drives the student's kernel.

``python -m tfedu.course.grading.inside EXCHANGE RESULT_FD`` reads the plan (JSON) from stdin, runs the
notebook cell by cell in a fresh kernel (:mod:`tfedu.course.grading.kernel`), runs each hidden test's
harness cell after its check cell, and appends what happened to the file open on ``RESULT_FD``,
one JSON object per line, flushed as it goes (a run killed at the total limit keeps what it had):

- ``{"zero": CHECK_ID, "feedback": TEXT}``: the exercise scores zero, for the reason given;
- ``{"probe": CHECK_ID, "files": {NAME: BASE64}}``: the files the hidden test exported;
- ``{"cell_error": CELL, "error": TEXT, "traceback": TEXT}``: a cell of the source notebook that is not an
  exercise (a demo, an experiment) raised; CELL is its index in the source notebook;
- ``{"end": true}``: the plan ran to its end.

Nothing here awards a point. The grader (outside the sandbox, after the sandbox has exited)
judges each exported result against the reference computed in its own process. The student's
code shares this sandbox and could stop or fool this runner; that can only lose or forge the
data of this one submission, which is why the guarantees are stated the way they are (see
:mod:`tfedu.course.grading.sandbox`).

When a cell runs past its limit or the kernel dies, the most recent answer at or before that
cell is blamed (zero, with the reason), replaced by its stub, and a fresh kernel replays the
notebook from the top. Before an exercise's check cell the probe's stand-ins (reference versions
of the earlier exercises it builds on) are bound in the notebook, and the learner's own objects
are put back after its hidden test: one mistake costs one exercise.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tfedu.course.grading import harness
from tfedu.course.grading.kernel import Kernel

NOT_DONE_NAME = "ExerciseNotDone"
OUT_NAME = re.compile(r"^(result\.json|[0-9]{1,6}\.npy)$")
MAX_EXPORT_BYTES = 16 << 20  # one hidden test's exported files, before base64


class Report:
    """Append-only JSON lines on the result file descriptor."""

    def __init__(self, fd: int):
        self.handle = os.fdopen(fd, "w", encoding="utf-8", closefd=True)
        self.lock = threading.Lock()

    def emit(self, **event: Any) -> None:
        with self.lock:
            self.handle.write(json.dumps(event) + "\n")
            self.handle.flush()


def count_processes() -> int:
    return sum(1 for entry in os.listdir("/proc") if entry.isdigit())


class Watchdog(threading.Thread):
    """In a sandbox (its own PID namespace), ends every process but this runner and init when the
    namespace holds more than ``limit`` processes: a fork bomb is cut short even where
    RLIMIT_NPROC is not enforced (a user namespace mapped to root)."""

    def __init__(self, limit: int):
        super().__init__(daemon=True)
        self.limit = limit
        self.tripped = False

    def run(self) -> None:
        while True:
            try:
                if count_processes() > self.limit:
                    self.tripped = True
                    os.kill(-1, signal.SIGKILL)  # every process this one may signal, except itself and init
            except OSError:
                pass
            time.sleep(0.02)


def export(folder: Path) -> dict[str, str] | None:
    """The files a hidden test wrote, base64-encoded; None when there are none or they are too big."""
    out = folder / "out"
    files: dict[str, str] = {}
    total = 0
    try:
        for path in sorted(out.iterdir())[:1000]:
            if not OUT_NAME.match(path.name) or path.is_symlink() or not path.is_file():
                continue
            total += path.stat().st_size
            if total > MAX_EXPORT_BYTES:
                return None
            files[path.name] = base64.b64encode(path.read_bytes()).decode("ascii")
    except OSError:
        return None
    return files or None


def import_statements(source: str) -> str:
    """The top-level import statements of an instructor's cell, one per line ("" if none or unparsable).

    >>> import_statements("from tfedu.checks import nb07 as checks\\n\\nchecks.check_x(x)")
    'from tfedu.checks import nb07 as checks'
    """
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    return "\n".join(ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))


def run_plan(plan: dict[str, Any], exchange: Path, report: Report, watchdog: Watchdog | None) -> None:
    steps: list[dict[str, Any]] = plan["steps"]
    probes: dict[str, dict[str, Any]] = plan["probes"]
    stubs: dict[str, str] = plan["stubs"]
    answers: dict[str, str] = plan["answers"]
    stubbed: dict[str, str] = dict.fromkeys(plan["stubbed"], "")
    done: set[str] = set(plan["done"])  # checks decided before the run (the static scan)
    cell_timeout, total = float(plan["cell_timeout"]), float(plan["timeout"])
    deadline = time.monotonic() + total
    check_failed: dict[str, str] = {}
    answer_errors: dict[str, str] = {}
    first_answer = next((k for k, s in enumerate(steps) if s["kind"] == "answer"), len(steps))

    def zero(check: str, feedback: str) -> None:
        if check not in done:
            done.add(check)
            report.emit(zero=check, feedback=feedback)

    def zero_rest(feedback: str) -> None:
        for check in probes:
            zero(check, feedback)

    def checks_of(answer: str) -> list[str]:
        return [c for c, p in probes.items() if p["exercise"] == answer]

    warm = bool(plan.get("warm"))  # the first kernel comes from the grader's warm-kernel server
    while True:
        workdir = tempfile.mkdtemp()
        kernel = Kernel(workdir, memory_bytes=int(plan["memory_bytes"]), file_bytes=int(plan["file_bytes"]),
                        cpu_seconds=int(plan["cpu_seconds"]), processes=int(plan.get("processes", 0)),
                        new_session=bool(plan.get("sandboxed")))
        try:
            try:
                kernel.start(min(float(plan["startup_timeout"]), max(0.1, deadline - time.monotonic())), warm=warm)
                if warm:
                    report.emit(kernel="warm" if kernel.warm else "cold")
                warm = False
            except Exception as err:
                zero_rest(f"grading stopped: a fresh Python kernel could not be started ({err})")
                return
            # the threads of a fresh kernel: a thread the notebook starts later and leaves running could
            # compute an answer out of the hidden test's tripwire's sight (harness.BODY reports it)
            kernel.run(harness.THREADS_BASELINE, 10.0, silent=True)
            restart = False
            for k, step in enumerate(steps):
                kind, gid = step["kind"], step["grade_id"]
                if kind in ("check", "probe") and gid in done:
                    if kind == "check" and (imports := import_statements(step["source"])):
                        # the check is decided, but the names its cell imports (`checks`) serve later cells too
                        kernel.run(imports, min(10.0, max(0.1, deadline - time.monotonic())), silent=True)
                    continue
                if kind == "probe" and gid in check_failed:
                    zero(gid, check_failed[gid])
                    if probes[gid].get("standins"):
                        kernel.run(harness.standin_sources("")[1], 10, silent=True)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    zero_rest(f"the total time limit for a submission ({total:g} s) ran out before this exercise was graded")
                    return
                code, folder = step["source"], None
                if kind == "answer":
                    code = stubs[gid] if gid in stubbed else answers[gid]
                elif kind == "check" and probes[gid].get("standins"):
                    kernel.run(harness.standin_sources(probes[gid]["standins"])[0], min(10.0, remaining), silent=True)
                elif kind == "probe":
                    probe = probes[gid]
                    folder = exchange / probe["folder"]
                    harness.fresh_out(folder)
                    # the inputs travel inside the harness cell, from this runner's memory: no file holds them
                    code = harness.harness_source(folder, probe["run"], tuple(probe["forbidden"]), probe["nonce"],
                                                  probe["inputs"])
                # Cells before the first student answer are the instructor's alone (set-up, imports):
                # only the total limit applies to them, so a slow machine does not fail them.
                cell_limit = cell_timeout if k >= first_answer else remaining
                result = kernel.run(code, min(cell_limit, remaining), silent=kind == "probe")
                if result.status in ("timeout", "dead"):
                    out_of_time = time.monotonic() >= deadline - 0.05
                    if watchdog is not None and watchdog.tripped:
                        watchdog.tripped = False
                        what = f"started more than {watchdog.limit} processes at once"
                    elif result.status == "timeout":
                        what = (f"ran past the {'total' if out_of_time else 'per-cell'} time limit "
                                f"({total if out_of_time else cell_timeout:g} s)")
                    else:
                        what = (f"stopped the Python kernel (exit code {result.exit_code}; sys.exit, os._exit, a signal, "
                                "too much memory or CPU time)")
                    culprit = next((s["grade_id"] for s in reversed(steps[: k + 1])
                                    if s["kind"] == "answer" and s["grade_id"] not in stubbed), None)
                    if culprit is None:
                        zero_rest(f"grading stopped: cell {step['cell']} of the source notebook {what}; "
                                  "this is not your answer's fault, tell your instructor")
                        return
                    stubbed[culprit] = f"the answer {what}"
                    for check in checks_of(culprit):
                        zero(check, stubbed[culprit])
                    if out_of_time:
                        zero_rest(f"the total time limit for a submission ({total:g} s) ran out before this exercise was graded")
                        return
                    if all(check in done for check in probes):
                        return  # nothing left to grade: no need for a fresh kernel
                    restart = True
                    break
                if kind == "code" and result.status == "error":
                    report.emit(cell_error=step["cell"], error=f"{result.ename}: {result.evalue}"[:2000],
                                traceback=result.traceback)
                elif kind == "answer" and result.status == "error":
                    answer_errors[gid] = f"{result.ename}: {result.evalue}"
                elif kind == "check" and result.status == "error":
                    hint = result.evalue or result.ename
                    if result.ename == NOT_DONE_NAME or plan["not_done"] in hint:
                        hint = plan["not_done"]
                    answer = probes[gid]["exercise"]
                    if answer in answer_errors and result.ename != NOT_DONE_NAME:
                        hint += f" (your answer cell itself raised {answer_errors[answer][:300]})"
                    check_failed[gid] = f"the check cell failed: {hint}"
                elif kind == "probe":
                    assert folder is not None
                    files = export(folder)
                    if files is None:
                        zero(gid, "the hidden test produced no result (did the answer interfere with the notebook or the files around it?)")
                    else:
                        done.add(gid)
                        report.emit(probe=gid, files=files)
                    if probes[gid].get("standins"):
                        kernel.run(harness.standin_sources("")[1], min(10.0, max(0.1, deadline - time.monotonic())), silent=True)
            if not restart:
                zero_rest("this exercise was not reached")
                return
        finally:
            kernel.stop()
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    exchange, fd = Path(argv[0]), int(argv[1])
    try:  # not dumpable: code in the sandbox cannot open this process's files through /proc/PID/fd
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except Exception:
        pass
    os.set_inheritable(fd, False)
    report = Report(fd)
    plan = json.loads(sys.stdin.read())
    sys.stdin.close()
    watchdog = None
    if plan.get("sandboxed") and plan.get("processes"):
        watchdog = Watchdog(int(plan["processes"]))
        watchdog.start()
    try:
        run_plan(plan, exchange, report, watchdog)
    except BaseException as err:  # the runner has no stderr in a sandbox: its own failure goes in the report
        report.emit(runner_error=f"{type(err).__name__}: {err}"[:300])
        raise
    report.emit(end=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``tfedu bench grade``: seconds to grade one submission of each notebook, and a class of 300.

For every notebook of the course, submissions are graded the way an instructor grades them
(``tfedu.course.grading.grade.grade``: in the bubblewrap sandbox where this machine can make one,
without it elsewhere, as the table says):

- ``solved``: the source notebook as a submission (every exercise done), alone (``--jobs 1``);
- ``jobs 2``: two solved submissions at once (``--jobs 2``), the wall time divided by two;
- ``release``: the released student version, nothing done (decided without a kernel);
- ``full``: the peer, the same solved submission with ``--full`` (every cell of the notebook, as the
  grader ran before it learned which cells grading needs); ``full/solved`` above 1 means the
  grader's own run is faster;
- ``cold``: the second peer, the same solved submission with ``--cold`` (its kernel started afresh, not
  forked from the warm-kernel server, :mod:`tfedu.course.grading.warm`); ``cold/solved`` above 1 is what
  warm kernels save. ``start`` says how the solved run's kernel started (``warm`` or ``cold``). The
  server starts on first use and is kept: its own start-up counts in the first notebook's rows.

The projected time for 300 submissions is 300 times the seconds per submission at ``--jobs 2``. Every
solved submission must score full marks and every release zero, or the bench stops: a fast wrong
grade is not a result. ``--quick`` grades notebook 00 only, once each: it checks the bench runs.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from tfedu.course.bench.common import machine

CLASS_SIZE = 300
GOAL_SECONDS = 20.0  # per submission on the 2-core machine
GOAL_CLASS_MINUTES = 60.0


def _grade(paths: list[Path], source: Path, *, jobs: int, sandboxed: bool, full: bool = False,
           cold: bool = False) -> tuple[float, list[dict]]:
    from tfedu.course.grading.grade import grade

    start = time.perf_counter()
    entries = grade(paths, source=source, jobs=jobs, sandboxed=sandboxed, full=full, cold=cold)["submissions"]
    return time.perf_counter() - start, entries


def _expect(entries: list[dict], solved: bool, what: str) -> None:
    for entry in entries:
        if solved and entry["total"] != entry["max"]:
            problems = [f"{k}: {e['feedback']}" for k, e in entry["exercises"].items() if e["points"] != e["max"]]
            raise RuntimeError(f"{what}: the solved notebook scored {entry['total']:g} / {entry['max']:g} ({problems[0]})")
        if not solved and entry["total"] != 0:
            raise RuntimeError(f"{what}: the released notebook scored {entry['total']:g}")


def run(quick: bool = False) -> dict:
    from tfedu.course.grading import sandbox
    from tfedu.course.grading.grade import default_notebooks_dir
    from tfedu.course.grading.release import release

    try:
        box = sandbox.find()
        sandboxed, where = True, box.describe()
    except sandbox.SandboxUnavailable as err:
        sandboxed, where = False, f"no sandbox ({str(err).splitlines()[0][:120]}); graded with --no-sandbox"
    notebooks = sorted(default_notebooks_dir().glob("[0-9][0-9]_*.ipynb"))
    if quick:
        notebooks = notebooks[:1]
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="tfedu-bench-grade-"))
    try:
        for source in notebooks:
            work = folder / source.stem
            copies = [work / f"solved{i}" / source.name for i in range(3)]
            for copy in copies:
                copy.parent.mkdir(parents=True)
                shutil.copy(source, copy)
            [unsolved] = release([source], work / "released")
            # the release first: it needs no kernel, and it pays this process's one-time imports of the
            # notebook's checks module, which would otherwise count against whichever run came first
            seconds_release, entries = _grade([unsolved], source, jobs=1, sandboxed=sandboxed)
            _expect(entries, False, f"{source.name}, release")
            seconds_one, entries = _grade(copies[:1], source, jobs=1, sandboxed=sandboxed)
            _expect(entries, True, f"{source.name}, --jobs 1")
            skipped = entries[0].get("cells_skipped", 0)
            start = entries[0].get("kernel_start", "none")
            seconds_two, entries = _grade(copies[1:], source, jobs=2, sandboxed=sandboxed)
            _expect(entries, True, f"{source.name}, --jobs 2")
            seconds_full, entries = _grade(copies[:1], source, jobs=1, sandboxed=sandboxed, full=True)
            _expect(entries, True, f"{source.name}, --full")
            seconds_cold, entries = _grade(copies[:1], source, jobs=1, sandboxed=sandboxed, cold=True)
            _expect(entries, True, f"{source.name}, --cold")
            per_submission = seconds_two / 2
            rows.append({"notebook": source.stem, "solved_s": round(seconds_one, 2), "jobs2_s_per_submission": round(per_submission, 2),
                         "release_s": round(seconds_release, 2), "full_s": round(seconds_full, 2),
                         "full_over_solved": round(seconds_full / seconds_one, 2),
                         "cold_s": round(seconds_cold, 2), "cold_over_solved": round(seconds_cold / seconds_one, 2),
                         "kernel_start": start,
                         "cells_skipped": skipped,
                         "class_minutes": round(CLASS_SIZE * per_submission / 60, 1)})
            print(f"  graded {source.stem}: {seconds_one:.1f} s alone, {per_submission:.1f} s each at --jobs 2, "
                  f"{seconds_full:.1f} s with --full, {seconds_cold:.1f} s with --cold", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"bench": "grade", "quick": quick, "machine": machine(), "sandbox": where, "class_size": CLASS_SIZE,
            "goal": {"seconds_per_submission": GOAL_SECONDS, "class_minutes": GOAL_CLASS_MINUTES}, "rows": rows}


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [f"tfedu bench grade{' (quick)' if result['quick'] else ''}: seconds to grade one submission, "
             f"and {result['class_size']} of one notebook at --jobs 2",
             f"machine: {m['cpu_model']}, {m['cpu_count']} cores, load {m['load_average_1min']} at the start; {result['sandbox']}",
             f"{'notebook':<34} {'solved s':>8} {'start':>5} {'jobs 2 s':>8} {'release s':>9} {'full s':>7} "
             f"{'full/solved':>11} {'cold s':>6} {'cold/solved':>11} {'300 subs':>9}"]
    for row in result["rows"]:
        lines.append(f"{row['notebook']:<34} {row['solved_s']:>8.1f} {row['kernel_start']:>5} "
                     f"{row['jobs2_s_per_submission']:>8.1f} {row['release_s']:>9.2f} {row['full_s']:>7.1f} "
                     f"{row['full_over_solved']:>10.1f}x {row['cold_s']:>6.1f} {row['cold_over_solved']:>10.1f}x "
                     f"{row['class_minutes']:>6.1f} min")
    goal = result["goal"]
    if result["rows"]:
        worst = max(result["rows"], key=lambda r: r["jobs2_s_per_submission"])
        met = (all(r["solved_s"] <= goal["seconds_per_submission"] for r in result["rows"])
               and all(r["class_minutes"] < goal["class_minutes"] for r in result["rows"]))
        lines.append(f"goal: every submission in at most {goal['seconds_per_submission']:g} s alone and {result['class_size']} "
                     f"in under {goal['class_minutes']:g} min: {'met' if met else 'NOT met'} "
                     f"(slowest at --jobs 2: {worst['notebook']}, {worst['jobs2_s_per_submission']:.1f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv)))

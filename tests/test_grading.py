"""`tfedu grade` beyond notebook 00: several exercises per notebook, recovery after a crash or a
timeout, the runtime tripwire, what the kernel can see, the time bound, and the pieces
(static scan, plain-data comparison, reading submissions) on their own."""

import inspect
import json
import math
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest

from tfedu.course import cli, nbtools
from tfedu.checks.core import compare_plain
from tfedu.course.grading.grade import ConfigError, Limits, SubmissionError, grade, read_answers
from tfedu.course.grading.release import student_version
from tfedu.checks.scan import MAX_ANSWER_CHARS, MAX_PROBLEMS, scan_answer

from optional_parts import needs_sandbox

ROOT = Path(__file__).resolve().parents[1]
TAMPER = Path(__file__).resolve().parent / "tamper"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

ANSWERS = {
    "ex_double": "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
    "ex_square": "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION",
    "ex_total": "def total(xs):\n    ### BEGIN SOLUTION\n    result = 0.0\n    for x in xs:\n        result += x\n    return result\n    ### END SOLUTION",
    "ex_ready": "def ready():\n    ### BEGIN SOLUTION\n    return True\n    ### END SOLUTION",
}
CHECKS = {"ex_double": ("check_double", 1), "ex_square": ("check_square", 2), "ex_total": ("check_total", 3), "ex_ready": ("check_ready", 1)}


def toy_source():
    cells = [nbtools.md("# 90 · Toy"), nbtools.code("import math\nimport numpy as np")]
    for exercise, source in ANSWERS.items():
        check, points = CHECKS[exercise]
        name = exercise.removeprefix("ex_")
        cells.append(nbtools.exercise(exercise, source))
        prefix = "from math import fsum as exact_sum\n" if name == "total" else ""
        cells.append(nbtools.check(check, f"{prefix}from toy_checks import {check}\n\n{check}({name})", points=points))
    return nbtools.new_notebook(cells)


def submission(**answers):
    nb = student_version(toy_source())
    for cell in nb.cells:
        grade_id = (nbtools.nbgrader_meta(cell) or {}).get("grade_id")
        if grade_id in answers:
            cell.source = answers[grade_id]
    return nb


def correct(exercise):
    return ANSWERS[exercise].replace("    ### BEGIN SOLUTION\n", "").replace("    ### END SOLUTION", "")


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy source notebook on disk, with tests/tamper importable in the grader and in kernels."""
    import sys

    monkeypatch.syspath_prepend(str(TAMPER))
    monkeypatch.setenv("PYTHONPATH", str(TAMPER))
    sys.modules.pop("toy_checks", None)
    source = tmp_path / "90_toy.ipynb"
    nbtools.write(toy_source(), source)
    return source


def points(entry):
    return {k: v["points"] for k, v in entry["exercises"].items()}


@needs_sandbox
def test_failures_stay_with_their_exercise_and_the_rest_is_graded(toy, tmp_path):
    import toy_checks

    subs = {
        "all_correct": submission(**{k: correct(k) for k in ANSWERS}),
        "unfinished": submission(),
        # double crashes the kernel when checked; total loops forever when defined: a fresh kernel
        # replays the notebook with those answers stubbed, and square and ready still count.
        "crash_and_loop": submission(
            ex_double="import numpy as np\n\ndef double(x):\n    np.lib.stride_tricks.as_strided(np.zeros(1), shape=(1 << 36,), strides=(1 << 12,)).sum()\n    return 2 * x",
            ex_square=correct("ex_square"),
            ex_total="def total(xs):\n    return sum(xs)\n\nwhile True:\n    pass",
            ex_ready=correct("ex_ready")),
        # total calls math.fsum through a name the check cell binds after the answer: no static scan sees
        # it, the runtime tripwire does. double is wrong only on inputs the check does not try.
        "tripwire": submission(
            ex_double="def double(x):\n    return 6 if x == 3 else x",
            ex_square=correct("ex_square"),
            ex_total="def total(xs):\n    return exact_sum(xs)",
            ex_ready=correct("ex_ready")),
    }
    paths = []
    for name, nb in subs.items():
        paths.append(tmp_path / f"90_toy_{name}.ipynb")
        paths[-1].write_text(nbformat.writes(nb))
    toy_checks.SEEN.clear()
    results = grade(paths, out=tmp_path / "out" / "results.json", source=toy, checks="toy_checks",
                    limits=Limits(cell_timeout=6, timeout=60, memory_gib=2), jobs=2)
    got = {Path(e["file"]).stem.removeprefix("90_toy_"): e for e in results["submissions"]}
    assert points(got["all_correct"]) == {"check_double": 1, "check_square": 2, "check_total": 3, "check_ready": 1}
    assert got["all_correct"]["total"] == got["all_correct"]["max"] == 7
    assert points(got["unfinished"]) == dict.fromkeys(points(got["unfinished"]), 0)
    crash = got["crash_and_loop"]["exercises"]
    assert points(got["crash_and_loop"]) == {"check_double": 0, "check_square": 2, "check_total": 0, "check_ready": 1}
    assert "stopped the Python kernel" in crash["check_double"]["feedback"]
    assert "time limit" in crash["check_total"]["feedback"]
    trip = got["tripwire"]["exercises"]
    assert points(got["tripwire"]) == {"check_double": 0, "check_square": 2, "check_total": 0, "check_ready": 1}
    assert "called the reference" in trip["check_total"]["feedback"] and "math.fsum" in trip["check_total"]["feedback"]
    assert "fresh random inputs" in trip["check_double"]["feedback"]
    csv_rows = (tmp_path / "out" / "results.csv").read_text().splitlines()
    assert csv_rows[0] == "file,total,max,check_double,check_square,check_total,check_ready" and len(csv_rows) == 5

    # What the code saw inside the kernel (exported by the environment probe, read in this process).
    assert toy_checks.SEEN, "the environment probe never reported"
    for seen in toy_checks.SEEN:
        assert seen["ready"] is True and seen["stdin_is_null"] is True
        assert seen["files"] == [], "the kernel's working folder must start empty and stay free of grader files"
        assert not seen["cwd"].startswith(str(ROOT))
        everything = json.dumps([seen["env"], seen["argv"], seen["history"], seen["names"], seen["cwd"]]).lower()
        for word in ("grade", "grading", "pytest", "probe", "harness"):
            assert word not in everything, f"the kernel can see {word!r}"


@needs_sandbox
def test_a_looping_submission_returns_within_the_total_timeout(tmp_path):
    source = ROOT / "notebooks" / "00_start_here.ipynb"
    nb = student_version(nbtools.read(source))
    answer = next(c for c in nb.cells if (nbtools.nbgrader_meta(c) or {}).get("grade_id") == "ex_softmax")
    answer.source = "def softmax(x):\n    return x\n\nwhile True:\n    pass"
    path = tmp_path / "00_start_here.ipynb"
    path.write_text(nbformat.writes(nb))
    timeout = 8.0
    start = time.monotonic()
    results = grade([path], source=source, limits=Limits(cell_timeout=600, timeout=timeout))
    elapsed = time.monotonic() - start
    exercise = results["submissions"][0]["exercises"]["check_softmax"]
    assert exercise["points"] == 0 and "total time limit" in exercise["feedback"]
    assert elapsed < timeout + 6, f"grading took {elapsed:.1f} s for a {timeout} s limit"


@needs_sandbox
def test_cli_grade_writes_json_and_csv_and_reports_instructor_errors(tmp_path, capsys):
    source = ROOT / "notebooks" / "00_start_here.ipynb"
    bad = tmp_path / "00_start_here.ipynb"
    bad.write_text("not json")
    out = tmp_path / "r.json"
    assert cli.main(["grade", str(bad), "--out", str(out), "--timeout", "30"]) == 0
    data = json.loads(out.read_text())
    assert data["submissions"][0]["total"] == 0 and out.with_suffix(".csv").is_file()
    assert "not valid JSON" in capsys.readouterr().out
    stray = tmp_path / "77_unknown.ipynb"
    stray.write_text("{}")
    assert cli.main(["grade", str(stray), str(bad), "--out", str(out), "--timeout", "30"]) == 1
    assert "no source notebook" in capsys.readouterr().err
    entries = json.loads(out.read_text())["submissions"]
    assert entries[0]["source"] is None and entries[1]["source"] == "00_start_here.ipynb"
    assert source.is_file()


def test_cli_grade_prints_a_line_per_cell_that_raised(tmp_path, capsys, monkeypatch):
    from tfedu.course.grading import grade as grading

    entry = {"file": "x.ipynb", "source": "00_start_here.ipynb", "total": 2.0, "max": 2.0, "notes": [],
             "exercises": {"check_softmax": {"points": 2.0, "max": 2.0, "feedback": "passed"}},
             "cell_errors": [{"cell": 9, "error": "NameError: name 'probs' is not defined\nmore", "traceback": "..."}]}
    calls = []
    monkeypatch.setattr(grading, "grade", lambda *args, **kwargs: calls.append(kwargs) or {"submissions": [entry]})
    assert cli.main(["grade", "x.ipynb", "--out", str(tmp_path / "r.json"), "--no-sandbox"]) == 0
    assert "  cell 9 (not an exercise) raised NameError: name 'probs' is not defined | more" in capsys.readouterr().out
    assert cli.main(["grade", "x.ipynb", "--out", str(tmp_path / "r.json"), "--no-sandbox", "--full"]) == 0
    assert [c["full"] for c in calls] == [False, True]


@needs_sandbox
def test_a_check_cell_without_a_probe_is_an_instructor_error(toy, tmp_path):
    nb = toy_source()
    nb.cells.append(nbtools.check("check_orphan", "print('no probe for me')", points=1))
    source = tmp_path / "91_toy.ipynb"
    nbtools.write(nb, source)
    with pytest.raises(ConfigError, match="check_orphan has no Probe"):
        grade([source], source=source, checks="toy_checks")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_static_scan_passes_every_source_solution(path):
    """No false alarms on the course's own answers (the scan sees what the grader would see)."""
    from tfedu.course.grading.grade import load_assignment

    assignment = load_assignment(path)
    context = []
    for step in assignment.steps:
        if step.kind == "code":
            context.append(step.source)
        elif step.kind == "answer":
            assert scan_answer(step.source, context=context) == [], step.grade_id
            context.append(step.source)
        elif step.kind == "check":
            probe = assignment.probes[step.grade_id]
            answer = next(s for s in assignment.steps if s.kind == "answer" and s.grade_id == probe.exercise)
            found = scan_answer(answer.source, context=context, forbidden=probe.forbidden, allowed=probe.builds)
            assert found == [], (step.grade_id, found)


@pytest.mark.parametrize("source", [
    "from tfedu.softmax import softmax",
    "import tfedu.softmax as s",
    "import tfedu\nf = tfedu.softmax.softmax",
    "f = reference_softmax",
    "f = 'tfedu/softmax.py'",
])
def test_the_scan_flags_the_forbidden_reference(source):
    context = ["import torch\nfrom tfedu.softmax import softmax as reference_softmax"]
    assert any("tfedu.softmax" in p for p in scan_answer(source, context=context, forbidden=("tfedu.softmax",)))
    assert not any("reference" in p for p in scan_answer(source, context=context))


def test_the_scan_does_not_confuse_a_shadowing_definition_with_the_reference():
    context = ["from tfedu.softmax import softmax"]
    answer = "def softmax(x):\n    '''A softmax (see tfedu's notes).'''\n    return softmax_helper(x)\n\ndef softmax_helper(x):\n    return x"
    assert scan_answer(answer, context=context, forbidden=("tfedu.softmax",)) == []


def test_the_scan_refuses_a_cell_over_the_size_limit_without_parsing_it():
    assert scan_answer("x = 1\n" * (MAX_ANSWER_CHARS // 6)) == []
    big = "x = 1\n" * (MAX_ANSWER_CHARS // 6 + 1)
    assert scan_answer(big) == [f"the answer cell is {len(big):,} characters, over the limit of {MAX_ANSWER_CHARS:,}; nothing was run"]


def test_the_scan_stops_at_its_time_limit():
    bomb = "\n".join(f"!echo {i}" for i in range(450))  # 450 transform steps, each re-tokenising the cell
    start = time.monotonic()
    problems = scan_answer(bomb, time_limit=0.2)
    assert time.monotonic() - start < 2.0
    assert problems == ["the static scan of the answer cell ran past its limit of 0.2 s (too many IPython `!`/`%` lines, "
                        "or code nested too deep?); nothing was run"]
    assert any("get_ipython" in p for p in scan_answer("!echo hi\n%env X=1"))  # a few escape lines: flagged as before


def deepest_parsable_chain(limit=3000):
    """An attribute chain depth (up to ``limit``) that this interpreter parses from here. CPython 3.11 builds
    the AST with a budget of 3 levels per Python frame still free under the recursion limit, and refuses
    deeper nesting with RecursionError (3.11.7 under pytest: under 3000). Two levels per free frame stay
    inside it without provoking the error."""
    return min(limit, 2 * (sys.getrecursionlimit() - len(inspect.stack(0))))


def test_the_scan_is_linear_in_the_depth_of_an_attribute_chain():
    def seconds(depth):
        source = "y = torch" + ".link" * depth
        best = float("inf")
        for _ in range(3):
            start = time.monotonic()
            assert scan_answer(source) == []
            best = min(best, time.monotonic() - start)
        return best

    seconds(100)  # warm up IPython's transformer
    deep = deepest_parsable_chain()
    assert deep >= 1000, f"this interpreter parses attribute chains only {deep} deep"
    # Linear: four times the depth costs about four times as long (the quadratic scan took about 16 times
    # as long, 1.5 s at depth 3000); the floor keeps a fast machine's timer noise from counting.
    shallow, full = seconds(deep // 4), seconds(deep)
    assert full < max(10 * shallow, 0.05), f"depth {deep // 4}: {shallow:.3f} s; depth {deep}: {full:.3f} s"


def test_one_ast_is_built_at_a_time_across_threads():
    """CPython 3.11 shares the AST builder's recursion counter between threads (gh-106905): two scans at
    once (grade --jobs) could fail an honest answer with SystemError. A scan waits while another builds."""
    import threading

    from tfedu.checks import scan

    from tfedu.course.grading import needs

    # the scan and the grader's dependency analysis (which ran unlocked until a clean-clone CI run failed an
    # honest answer with "AST constructor recursion depth mismatch" on 2026-11-29)
    for build in (lambda: scan.parse("y = torch.ones(3)"), lambda: needs.analyse("y = torch.ones(3)", set(), {})):
        done = threading.Event()
        worker = threading.Thread(target=lambda: (build(), done.set()))
        with scan.AST_LOCK:
            worker.start()
            assert not done.wait(0.3), "the AST was built while another thread held the lock"
        assert done.wait(10)
        worker.join()


def test_the_scan_reports_a_bounded_number_of_short_problems():
    source = "\n".join(f"y{i} = torch._hidden{i}" + ".link" * 60 for i in range(40))
    problems = scan_answer(source, context=["import torch"])
    assert len(problems) == MAX_PROBLEMS + 1 and problems[-1] == f"and {40 - MAX_PROBLEMS} more problems"
    assert all(len(p) <= 503 for p in problems)


@pytest.mark.parametrize("text, clean", [
    ("\x1b[2K\r\x1b[32m\u2714 passed\x1b[0m", "\u2714 passed"),  # CSI: erase line, colours; carriage return
    ("\x1b]0;title\x07ok \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "ok link"),  # OSC: title, hyperlink
    ("\x9b31mred\x85", "red"),  # C1 controls: one-byte CSI, NEL
    ("ab\x08\x08cd\x00\x7f", "abcd"),  # backspace, NUL, DEL
    ("x \x1bc \x1b", "x  "),  # bare ESC and two-byte ESC sequences
    ("safe\u202eevil\u2066\u200b", "safeevil"),  # bidi override and isolate, zero-width space
    ("lone \ud800surrogate", "lone surrogate"),  # would break writing the CSV as UTF-8
    ("\u00e9\u4e2d \u2714 (x, y)\n\tnext", "\u00e9\u4e2d \u2714 (x, y)\n next"),  # text, newlines and tabs kept readable
])
def test_clean_text_strips_escapes_and_control_characters(text, clean):
    from tfedu.course.grading.grade import clean_text

    assert clean_text(text) == clean
    assert "\n" not in clean_text(text, one_line=True)


def test_compare_plain_accepts_close_numbers_and_names_the_difference():
    expected = {"y": np.array([[0.25, 0.75]], dtype=np.float32), "n": 3, "s": "ab", "flags": [True, False]}
    assert compare_plain({"y": np.array([[0.25, 0.75 + 1e-7]]), "n": 3, "s": "ab", "flags": [True, False]}, expected, 1e-4, 1e-5) is None
    assert "shape" in compare_plain({"y": np.zeros((2, 1)), "n": 3, "s": "ab", "flags": [True, False]}, expected, 1e-4, 1e-5)
    assert "NaN" in compare_plain({"y": np.array([[np.nan, 1.0]]), "n": 3, "s": "ab", "flags": [True, False]}, expected, 1e-4, 1e-5)
    assert "largest error" in compare_plain({"y": np.array([[0.5, 0.5]]), "n": 3, "s": "ab", "flags": [True, False]}, expected, 1e-4, 1e-5)
    assert "no entry" in compare_plain({"n": 3}, expected, 1e-4, 1e-5)
    assert compare_plain({"y": "all good", "n": 3, "s": "ab", "flags": [True, False]}, expected, 1e-4, 1e-5)
    assert compare_plain({"y": np.array([[0.25, 0.75]]), "n": 3, "s": "ab", "flags": [1, 0]}, expected, 1e-4, 1e-5)
    assert compare_plain(1.0000001, math.pi, 1e-4, 1e-5)


def test_read_answers_takes_answer_cells_by_grade_id_and_reports_duplicates(tmp_path):
    nb = submission(ex_double="A")
    nb.cells.append(nbformat.v4.new_code_cell("B", metadata={"nbgrader": {"grade_id": "ex_double"}}))
    path = tmp_path / "s.ipynb"
    path.write_text(nbformat.writes(nb))
    answers, notes = read_answers(path, ["ex_double", "ex_square"])
    assert answers["ex_double"] == "A" and "ex_square" in answers and "only the first" in notes[0]
    path.write_text("[]")
    with pytest.raises(SubmissionError):
        read_answers(path, ["ex_double"])


def test_a_planted_or_symlinked_result_is_not_read(tmp_path):
    from tfedu.course.grading import harness

    harness.fresh_out(tmp_path)
    good = {"error": None, "tripwire": [], "outputs": {"y": 1}, "nonce": "right"}
    (tmp_path / "out" / "result.json").write_text(json.dumps(good))
    assert harness.read_result(tmp_path, "right")["outputs"] == {"y": 1}
    assert harness.read_result(tmp_path, "wrong") is None  # planted before this run: another nonce
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "result.json").write_text(json.dumps(good))
    (tmp_path / "out" / "result.json").unlink()
    (tmp_path / "out" / "result.json").symlink_to(elsewhere / "result.json")
    assert harness.read_result(tmp_path, "right") is None
    harness.fresh_out(tmp_path)  # a fresh folder replaces whatever was there
    assert list((tmp_path / "out").iterdir()) == []
    assert harness.read_result(tmp_path, "right") is None


@needs_sandbox
def test_the_tripwire_catches_torch_functions_and_tensor_methods_named_in_forbidden(tmp_path, monkeypatch):
    """A probe may forbid library functions and C methods too (torch.softmax, torch.Tensor.softmax):
    calls the scan cannot resolve statically (a method on a tensor, a function captured under
    another name) are caught while the probe runs. The check cell here is lenient on purpose."""
    import sys

    module = tmp_path / "strict_softmax_checks.py"
    module.write_text(
        "from dataclasses import replace\n"
        "from tfedu.checks import nb00_start_here as base\n"
        "def check_softmax(softmax):\n"
        "    print('shape ok:', tuple(softmax(base.seeded_randn(0, 2, 3)).shape))\n"
        "PROBES = {'check_softmax': replace(base.PROBES['check_softmax'], forbidden=('tfedu.softmax', 'torch.softmax',"
        " 'torch.Tensor.softmax', 'torch.nn.functional.softmax'))}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    sys.modules.pop("strict_softmax_checks", None)
    source = tmp_path / "95_strict.ipynb"
    nbtools.write(nbtools.new_notebook([
        nbtools.code("import torch"),
        nbtools.exercise("ex_softmax", "def softmax(x):\n    ### BEGIN SOLUTION\n    e = (x - x.max(-1, keepdim=True).values).exp()\n"
                                       "    return e / e.sum(-1, keepdim=True)\n    ### END SOLUTION"),
        nbtools.check("check_softmax", "from strict_softmax_checks import check_softmax\n\ncheck_softmax(softmax)", points=2),
    ]), source)
    answers = {
        "method": "def softmax(x):\n    return x.softmax(-1)",
        "captured": "_sm = torch.Tensor.softmax\n\ndef softmax(x):\n    return _sm(x, -1)",
        "functional": "def softmax(x, _f=torch.nn.functional):\n    return _f.softmax(x, dim=-1)",
        "torchfn": "def softmax(x, _t=torch):\n    return _t.softmax(x, -1)",
        "correct": "def softmax(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n    return e / e.sum(-1, keepdim=True)",
    }
    paths = []
    for name, answer in answers.items():
        nb = student_version(nbtools.read(source))
        next(c for c in nb.cells if (nbtools.nbgrader_meta(c) or {}).get("grade_id") == "ex_softmax").source = answer
        paths.append(tmp_path / f"95_strict_{name}.ipynb")
        paths[-1].write_text(nbformat.writes(nb))
    results = grade(paths, source=source, checks="strict_softmax_checks", limits=Limits(cell_timeout=30, timeout=90), jobs=2)
    got = {Path(e["file"]).stem.rsplit("_", 1)[1]: e["exercises"]["check_softmax"] for e in results["submissions"]}
    assert got["correct"]["points"] == 2, got["correct"]["feedback"]
    assert "uses `torch.Tensor.softmax`" in got["captured"]["feedback"]  # the scan resolves this one
    for name in ("method", "functional", "torchfn"):  # these only the runtime tripwire sees
        assert got[name]["points"] == 0, name
        assert "called the reference" in got[name]["feedback"] and "softmax" in got[name]["feedback"], (name, got[name]["feedback"])


def test_the_kernel_is_boxed(tmp_path):
    """The working folder is not importable, stdin is empty, memory is capped, the session is killed."""
    from tfedu.course.grading.kernel import Kernel

    (tmp_path / "planted.py").write_text("VALUE = 1\n")
    kernel = Kernel(tmp_path, memory_bytes=2 << 30)
    try:
        kernel.start(60)
        assert kernel.run("import planted", 30).ename == "ModuleNotFoundError"
        assert kernel.run("input()", 30).status == "error"
        # its own session, led by its launcher (the subreaper that outlives anything it detaches)
        assert kernel.run("import os\nassert os.getsid(0) == os.getppid() and os.getsid(0) != os.getsid(1)", 30).status == "ok"
        assert kernel.run("x = bytearray(3 << 30)", 30).ename == "MemoryError"
        flood = kernel.run("for _ in range(2000):\n    print('y' * 10_000)", 30)
        assert flood.status == "ok" and len(flood.stdout) <= 20_000 and flood.dropped > 0
        assert kernel.run("while True:\n    pass", 2).status == "timeout"
        assert not kernel.alive()
    finally:
        kernel.stop()


@needs_sandbox
def test_a_forbidden_call_costs_only_the_exercise_that_depends_on_it(toy, tmp_path):
    """math.fsum is forbidden for `total` only. Using it in an earlier, unrelated answer costs nothing;
    reaching it from `total` through an alias or a helper defined in an earlier answer still scores zero."""
    subs = {
        "earlier_unrelated_use": submission(
            ex_double="import math\n\ndef double(x):\n    return math.fsum([x, x])",
            ex_square=correct("ex_square"), ex_total=correct("ex_total"), ex_ready=correct("ex_ready")),
        "alias_from_earlier_answer": submission(
            ex_double=correct("ex_double"),
            ex_square="from math import fsum as add_up\n\ndef square(x):\n    return x * x",
            ex_total="def total(xs):\n    return add_up(xs)", ex_ready=correct("ex_ready")),
        "helper_from_earlier_answer": submission(
            ex_double="import math\n\ndef add_up(xs):\n    return math.fsum(xs)\n\ndef double(x):\n    return 2 * x",
            ex_square=correct("ex_square"),
            ex_total="def total(xs):\n    return add_up(xs)", ex_ready=correct("ex_ready")),
    }
    paths = []
    for name, nb in subs.items():
        paths.append(tmp_path / f"90_toy_{name}.ipynb")
        paths[-1].write_text(nbformat.writes(nb))
    results = grade(paths, out=tmp_path / "out" / "results.json", source=toy, checks="toy_checks",
                    limits=Limits(cell_timeout=60, timeout=240, memory_gib=2), jobs=2)  # not a timing test: honest answers must not be stopped under load
    got = {Path(e["file"]).stem.removeprefix("90_toy_"): e for e in results["submissions"]}
    assert points(got["earlier_unrelated_use"]) == {"check_double": 1, "check_square": 2, "check_total": 3, "check_ready": 1}
    for name in ("alias_from_earlier_answer", "helper_from_earlier_answer"):
        assert points(got[name]) == {"check_double": 1, "check_square": 2, "check_total": 0, "check_ready": 1}, name
        assert "math.fsum" in got[name]["exercises"]["check_total"]["feedback"], name


def shared_checks_source():
    """As in the course's notebooks: the first check cell imports the checks module, the later ones use it."""
    return nbtools.new_notebook([
        nbtools.md("# 91 · Toy"), nbtools.code("import math"),
        nbtools.exercise("ex_total", ANSWERS["ex_total"]),
        nbtools.check("check_total", "import toy_checks as checks\n\nchecks.check_total(total)", points=3),
        nbtools.exercise("ex_double", ANSWERS["ex_double"]),
        nbtools.check("check_double", "checks.check_double(double)", points=1),
    ])


@needs_sandbox
def test_a_first_exercise_decided_before_the_run_keeps_the_check_imports_for_the_rest(toy, tmp_path):
    """A learner's notebook 07 with F.layer_norm in 7.2 scored 0 / 7: the grader skipped 7.2's decided check
    cell, and with it the `from tfedu.checks import ... as checks` that 7.4's and 7.6's check cells use.
    The first answer here is decided before the run twice over: by the static scan (a forbidden call) and
    as an unchanged stub; either way the later exercise keeps its marks."""
    source = tmp_path / "91_shared.ipynb"
    nbtools.write(shared_checks_source(), source)
    stub = student_version(shared_checks_source()).cells[2].source
    subs = {"forbidden_first": "import math\n\ndef total(xs):\n    return math.fsum(xs)", "stub_first": stub}
    paths = []
    for name, answer in subs.items():
        nb = student_version(shared_checks_source())
        nb.cells[2].source, nb.cells[4].source = answer, correct("ex_double")
        paths.append(tmp_path / f"91_shared_{name}.ipynb")
        paths[-1].write_text(nbformat.writes(nb))
    results = grade(paths, source=source, checks="toy_checks", limits=Limits(cell_timeout=60, timeout=240, memory_gib=2), jobs=2)
    got = {Path(e["file"]).stem.removeprefix("91_shared_"): e for e in results["submissions"]}
    assert "math.fsum" in got["forbidden_first"]["exercises"]["check_total"]["feedback"]
    assert "not done yet" in got["stub_first"]["exercises"]["check_total"]["feedback"]
    for name, entry in got.items():
        assert points(entry) == {"check_total": 0, "check_double": 1}, (name, entry)
        assert entry["cell_errors"] == [], (name, entry)


def test_an_unchanged_stub_is_decided_without_a_kernel(toy, tmp_path, monkeypatch):
    """Every answer is the release's stub (blank lines and trailing spaces aside): each exercise scores zero,
    "not done yet", and no kernel starts."""
    from tfedu.course.grading import grade as grading

    def no_run(*args, **kwargs):
        raise AssertionError("a kernel was started for a notebook of unchanged stubs")

    monkeypatch.setattr(grading, "execute", no_run)
    unfinished = submission()
    for cell in unfinished.cells:
        if (nbtools.nbgrader_meta(cell) or {}).get("grade_id") == "ex_square":
            cell.source = "\n" + cell.source.replace("\n", "  \n") + "\n\n"
    path = tmp_path / "90_toy_unfinished.ipynb"
    path.write_text(nbformat.writes(unfinished))
    [entry] = grade([path], source=toy, checks="toy_checks", sandboxed=False)["submissions"]
    assert points(entry) == {check: 0 for check, _ in CHECKS.values()}
    for exercise in entry["exercises"].values():
        assert "still the released stub" in exercise["feedback"] and "not done yet" in exercise["feedback"]


def test_processes_an_answer_detaches_are_killed_with_its_kernel(tmp_path):
    """setsid and the double fork move a process out of the kernel's session; the launcher is a
    subreaper, so they come back to it and die with the kernel."""
    import subprocess

    from tfedu.course.grading.kernel import Kernel

    kernel = Kernel(tmp_path)
    kernel.start(60)
    try:
        result = kernel.run(
            "import os, time\n"
            "os.system('setsid nohup sleep 4712 >/dev/null 2>&1 < /dev/null &')\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.execvp('sleep', ['sleep', '4713'])\n    os._exit(0)\n", 30)
        assert result.status == "ok"
        time.sleep(0.5)
        for marker in ("sleep 4712", "sleep 4713"):
            assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0, marker
    finally:
        kernel.stop()
    time.sleep(0.5)
    for marker in ("sleep 4712", "sleep 4713"):
        assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1, marker


@needs_sandbox
def test_a_fifo_or_folder_submission_is_refused_without_hanging(toy, tmp_path):
    import os

    fifo = tmp_path / "90_toy_fifo.ipynb"
    os.mkfifo(fifo)
    folder = tmp_path / "90_toy_folder.ipynb"
    folder.mkdir()
    start = time.monotonic()
    results = grade([fifo, folder], source=toy, checks="toy_checks", limits=Limits(cell_timeout=6, timeout=30, memory_gib=2))
    assert time.monotonic() - start < 20
    for entry in results["submissions"]:
        assert entry["total"] == 0 and "not a regular file" in json.dumps(entry)


def _without_seconds(entries):
    return [{k: v for k, v in entry.items() if k != "seconds"} for entry in entries]


def test_shards_merged_equal_one_run(tmp_path, capsys):
    """N machines each grade a share (--shard K/N) and --merge joins them: the same JSON and CSV as one run,
    for N smaller than, equal to and larger than the class. The submissions are decided without a kernel."""
    from tfedu.course.grading import shards
    from tfedu.course.grading.release import release

    source = ROOT / "notebooks" / "04_attention.ipynb"
    [released] = release([source], tmp_path / "released")
    paths = []
    for i in range(7):
        path = tmp_path / "class" / f"04_attention_student{i}.ipynb"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(released.read_bytes() if i % 2 else b"not a notebook %d" % i)
        paths.append(str(path))
    one = grade(paths, out=tmp_path / "one" / "results.json", sandboxed=False)
    for count in (1, 3, 7, 9):
        parts = []
        for index in range(1, count + 1):
            parts.append(tmp_path / f"n{count}" / f"part-{index}.json")
            assert cli.main(["grade", *paths, "--shard", f"{index}/{count}", "--out", str(parts[-1]), "--no-sandbox"]) == 0
        out = tmp_path / f"n{count}" / "all.json"
        assert cli.main(["grade", "--merge", *map(str, reversed(parts)), "--out", str(out)]) == 0
        merged = json.loads(out.read_text())
        assert _without_seconds(merged["submissions"]) == _without_seconds(one["submissions"]), count
        assert out.with_suffix(".csv").read_text() == (tmp_path / "one" / "results.csv").read_text()
    assert [len(shards.share(paths, k, 3)) for k in (1, 2, 3)] == [3, 2, 2]


def test_a_merge_refuses_shards_that_do_not_make_one_whole(tmp_path, capsys):
    from tfedu.course.grading import shards

    def part(index, count, total, entries):
        path = tmp_path / f"p{index}-{count}-{total}-{len(entries)}.json"
        path.write_text(json.dumps({"submissions": entries, "shard": {"index": index, "count": count, "submissions": total}}))
        return path

    e = {"file": "a.ipynb", "total": 0}
    with pytest.raises(shards.ShardError, match="missing shard: 2/2"):
        shards.merge([part(1, 2, 3, [e, e])])
    with pytest.raises(shards.ShardError, match="given twice"):
        shards.merge([part(1, 2, 3, [e, e]), part(1, 2, 3, [e, e])])
    with pytest.raises(shards.ShardError, match="the others are of 2 shards"):
        shards.merge([part(1, 2, 3, [e, e]), part(2, 3, 3, [e])])
    with pytest.raises(shards.ShardError, match="should hold 1 results, it holds 2"):
        shards.merge([part(2, 2, 3, [e, e])])
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"submissions": []}))
    with pytest.raises(shards.ShardError, match="not the results of a --shard run"):
        shards.merge([plain])
    assert cli.main(["grade", "--merge", str(plain), "--out", str(tmp_path / "x.json")]) == 2
    assert "not the results of a --shard run" in capsys.readouterr().err
    for bad in ("0/3", "4/3", "3", "a/b"):
        assert cli.main(["grade", "x.ipynb", "--shard", bad, "--out", str(tmp_path / "x.json"), "--no-sandbox"]) == 2
        assert "expected --shard K/N" in capsys.readouterr().err


def test_tfedu_check_grades_a_learners_own_notebook_with_the_same_grader(tmp_path, capsys, monkeypatch):
    """`tfedu check NOTEBOOK`: the instructor's grader, no files written, the sandbox where there is one."""
    from tfedu.course.grading import grade as grading
    from tfedu.course.grading import sandbox

    entry = {"file": "04_attention_me.ipynb", "source": "04_attention.ipynb", "total": 3.0, "max": 5.0, "notes": [],
             "exercises": {"check_attention": {"points": 3.0, "max": 3.0, "feedback": "passed"},
                           "check_self_attention": {"points": 0.0, "max": 2.0, "feedback": "the check cell failed: ..."}}}
    calls = []
    monkeypatch.setattr(grading, "grade", lambda paths, **kwargs: calls.append((paths, kwargs)) or {"submissions": [entry]})

    def no_sandbox():
        raise sandbox.SandboxUnavailable("bwrap is not installed")

    monkeypatch.setattr(sandbox, "find", no_sandbox)
    assert cli.main(["check", "04_attention_me.ipynb"]) == 0
    out, err = capsys.readouterr()
    assert "04_attention_me.ipynb: 3 / 5" in out and "check_self_attention: 0 / 2  the check cell failed" in out
    assert "wrote" not in out and "graded without one" in err
    [(paths, kwargs)] = calls
    assert paths == ["04_attention_me.ipynb"] and kwargs["out"] is None and kwargs["sandboxed"] is False
    assert kwargs["jobs"] == 1 and kwargs["full"] is False and kwargs["shard"] is None


def test_a_file_name_cannot_forge_a_report_line(tmp_path, capsys):
    """Issue 37, class 7: a submission named with a newline and a look-alike slash printed "...: 2 / 2 passed" as a
    line of its own. The name is one line everywhere it is printed or written (console, JSON, CSV)."""
    name = "00_start_here_eve\nbob.ipynb: 2 \u2215 2\n  check_softmax: 2 \u2215 2  passed.ipynb"
    path = tmp_path / name
    path.write_bytes(b"not a notebook")
    out = tmp_path / "out" / "results.json"
    assert cli.main(["grade", str(path), "--out", str(out), "--no-sandbox"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert not any(line.startswith(("bob", "  check_softmax: 2 \u2215 2")) for line in printed), printed
    [entry] = json.loads(out.read_text())["submissions"]
    assert "\n" not in entry["file"] and " | bob.ipynb" in entry["file"] and entry["total"] == 0
    rows = out.with_suffix(".csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].count(" | ") == 2

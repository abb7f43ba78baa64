"""Feedback in steps (issue 38, item 2): failures in words, three hints per exercise, the solution after trying.

- A checker's failure message names the mistake in words, never the code: :func:`test_checker_messages_hold_no_code`
  reads every message a checker module can print and looks for code in it (a library or method call with
  arguments, an assignment, a slice, ``float('-inf')``).
- Every exercise has three hints beside its checker (``HINTS``), and ``tfedu.hint("N.M")`` shows them one at a
  time; the leak test (tests/test_no_answer_on_the_page.py) reads them as checker messages, so none holds a line
  of the solution.
- ``tfedu.solution("N.M")`` shows the reference solution once the exercise's check has run, and not in a
  graded release.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tfedu.checks import core
from tfedu.course import hints, nbtools
from tfedu.course.grading.release import SOLUTIONS_OFF, student_version

from optional_parts import needs_sandbox
from per_notebook import NOTEBOOKS
from test_no_answer_on_the_page import messages

ROOT = Path(__file__).resolve().parents[1]
CHECKS = sorted((ROOT / "tfedu" / "checks").glob("nb[0-9][0-9]_*.py"))

# Code in a message: a library call with arguments (torch.ones(n, ...)), a method call with arguments
# (scores.masked_fill(~mask, ...), .tril(-1)), an assignment statement, a slice, a float('-inf') literal.
CODE = re.compile(r"""
    \b(?:torch|F|np|math|einops|nn|tfedu)\.[\w.]+\([^)\s]
  | (?<!\w)\.\w+\([^)\s][^)]*\)
  | \b\w+\.\w+\([^)\s][^)]*\)
  | ^\s*\w+(?:\[[^]]*\])?\s*[-+*/]?=\s*\S
  | [;:]\s*\w+\s*=\s*\w
  | float\(['"]-?inf['"]\)
  | \w\[[^]]*:[^]]*\]
""", re.X | re.M)



def hint_strings(module: Path) -> set[str]:
    """The strings inside the module's ``HINTS`` (a skeleton is code on purpose, with blanks)."""
    tree = ast.parse(module.read_text())
    return {node.value for assign in ast.walk(tree) if isinstance(assign, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "HINTS" for t in assign.targets)
            for node in ast.walk(assign.value) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def code_in_messages(module: Path) -> list[str]:
    skip = hint_strings(module)
    return [f"{found!r} in {text[:100]!r}" for text in messages(module) if text not in skip
            for found in [[m.group(0) for m in CODE.finditer(text)]] if found]


@pytest.mark.parametrize("module", CHECKS, ids=[m.stem for m in CHECKS])
def test_checker_messages_hold_no_code(module):
    found = code_in_messages(module)
    assert not found, f"{module.name}: messages that hand over code; say it in words:\n" + "\n".join(found)


def test_the_code_detector_finds_code_and_lets_words_and_inputs_pass():
    for code in ("e.g. torch.ones(n, n, dtype=torch.bool).tril()", "use .tril(-1)", "scores.masked_fill(~mask, x)",
                 "do this: out = a + b", "fill with float('-inf')", "call model(ids[:, -n_ctx:])"):
        assert CODE.search(code), code
    for words in ("causal_mask(5) has dtype torch.float32, expected torch.bool",
                  "row 3 of your weights sums to 0.71: are masked scores removed before the softmax?",
                  "you called torch.softmax; build it from max, exp and sum", "divide by sqrt(d_k), not d_k",
                  "the weights are (..., query_pos, key_pos), True = may attend"):
        assert not CODE.search(words), words


# ----------------------------------------------------------------------------- tfedu.hint and tfedu.solution

@pytest.fixture
def fresh(monkeypatch):
    """hint/solution state as a new kernel has it."""
    monkeypatch.setattr(hints, "_shown", {})
    monkeypatch.setattr(hints, "_off", [])
    monkeypatch.setattr(core, "ATTEMPTED", set())
    return hints


def test_hints_come_one_at_a_time_then_say_they_are_done(fresh):
    texts = [fresh.hint_text("5.2") for _ in range(4)]
    exercise = fresh.exercises()["5.2"].hints
    assert [exercise.idea in texts[0], exercise.approach in texts[1], exercise.skeleton.strip() in texts[2]] == [True] * 3
    assert "hint 1 of 3" in texts[0] and "hint 3 of 3" in texts[2] and "that was the last hint" in texts[3]
    assert exercise.approach in fresh.hint_text("5.2", 2)  # any level on request
    with pytest.raises(ValueError, match="level must be 1, 2 or 3"):
        fresh.hint_text("5.2", 7)


def test_an_unknown_exercise_is_named_with_the_numbers_that_exist(fresh):
    with pytest.raises(hints.UnknownExercise, match=r"no exercise '5\.9'.*5\.1, 5\.2, 5\.3"):
        fresh.hint_text("5.9")
    with pytest.raises(hints.UnknownExercise, match="as a string"):
        fresh.hint_text(52)


def test_the_solution_comes_after_the_check_has_run_and_not_when_switched_off(fresh):
    from tfedu.checks import nb05_masks_and_heads as checks

    assert "try it first" in fresh.solution_text("5.1")
    with pytest.raises(core.CheckFailure, match=r'tfedu\.hint\("5\.1"\)'):  # a failure points at the hints
        checks.check_causal_mask(lambda n: core.torch.ones(n, n, dtype=core.torch.bool))
    shown = fresh.solution_text("5.1")
    assert "the reference solution" in shown and "def causal_mask" in shown and "BEGIN SOLUTION" not in shown
    fresh.solutions_off("graded")
    assert "switched off in this course (graded)" in fresh.solution_text("5.1")
    # and the hints stop pointing at it: the third and the one after the last say it is off
    assert "solutions are switched off here" in fresh.hint_text("5.1", 3) and "tfedu.solution" not in fresh.hint_text("5.1", 3)
    last = fresh.hint_text("5.1", 4)
    assert "switched off in this course (graded)" in last and "tfedu.solution" not in last


def test_hint_and_solution_print_outside_jupyter():
    code = ("import tfedu; tfedu.hint('5.1'); tfedu.solution('5.1'); tfedu.solutions_off(); "
            "from tfedu.checks import nb05_masks_and_heads as c; c.check_causal_mask(c.reference.causal_mask.__wrapped__ "
            "if hasattr(c.reference.causal_mask, '__wrapped__') else lambda n: c.reference.causal_mask(n, n)); "
            "tfedu.solution('5.1')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "hint 1 of 3" in out.stdout and "try it first" in out.stdout and "switched off" in out.stdout


def test_the_packaged_solutions_are_the_source_notebooks_own():
    assert hints.SOLUTIONS.read_text(encoding="utf-8") == hints.solutions_json(NOTEBOOKS), \
        "tfedu/course/solutions.json drifted from the notebooks: run `tfedu clean`"
    solutions = json.loads(hints.SOLUTIONS.read_text(encoding="utf-8"))
    assert solutions["5.2"]["grade_id"] == "ex_masked_attention" and "### " not in solutions["5.2"]["code"]


def test_a_graded_release_switches_solutions_off_in_its_set_up_cell():
    source = nbtools.read(ROOT / "notebooks" / "05_masks_and_heads.ipynb")
    plain, graded = student_version(source, "05"), student_version(source, "05", solutions=False)
    assert not any(SOLUTIONS_OFF in c.source for c in plain.cells)
    setup = [c.source for c in graded.cells if SOLUTIONS_OFF in c.source]
    assert len(setup) == 1 and "import tfedu" in setup[0]


@needs_sandbox
def test_a_graded_releases_set_up_line_runs_in_the_grader(tmp_path):
    """The line --no-solutions adds runs inside the grader's kernel and costs the submission nothing."""
    from tfedu.course import cli

    source = nbtools.read(ROOT / "notebooks" / "00_start_here.ipynb")
    graded = student_version(source, "00", solutions=False)
    for done, cell in zip(source.cells, graded.cells):  # the learner answered: the source's solutions back in
        if (nbtools.nbgrader_meta(cell) or {}).get("solution"):
            cell.source = done.source
    submission = tmp_path / "00_start_here.ipynb"
    nbtools.write(graded, submission)
    out = tmp_path / "r.json"
    assert cli.main(["grade", str(submission), "--out", str(out), "--timeout", "120"]) == 0
    entry = json.loads(out.read_text())["submissions"][0]
    assert (entry["total"], entry["max"], entry["cell_errors"]) == (2.0, 2.0, [])

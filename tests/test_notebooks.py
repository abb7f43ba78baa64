"""Every source notebook in notebooks/ is graded as a submission: full marks, and its release zero.

`grade` runs what grading needs of the source notebook (its own solutions as the submission: the
answer, check and hidden-test cells and the cells they use, tfedu.course.grading.needs) cell by cell, in
order, in one fresh kernel (tfedu.course.grading.inside), inside the bubblewrap sandbox where this
machine can make one and without it elsewhere. The test asserts:
- no cell it ran that is not an exercise raised (the grader lists such cells in ``cell_errors``, with the
  error and the kernel's traceback; a failure here names the cell, its first line and the error);
- every exercise scores full marks: its check cell passed and its hidden test agreed with the reference
  on fresh random inputs, so no cell ran past a limit and the kernel was never restarted;
- the released student version, graded in the same call, scores zero with "not done yet" on every
  exercise (its answers are the release's stubs, which the grader decides without a kernel).
Every cell of every notebook runs in the released version's Run All, as a learner sees it in
JupyterLab (tests/test_release.py): the demonstrations and experiments are the same cells in the source
and the release, and none of them may call an unfinished exercise there (the release's stubs raise), so
running them once covers both. The grader's fast run against its full run is tested on a toy below.

(Until 2026-11 each notebook ran three more times: with nbclient here, and twice in the grading test.
Under nbval each cell was a test of its own, and pytest 9.2 with xdist 3.8 split a notebook's cells over
workers; here a notebook is one test, so no scheduler can split it.) Each notebook's test sits in a class
of its own (tests/per_notebook.py), so the notebooks spread over the workers.
"""

import shutil
from pathlib import Path

import pytest

from tfedu.course import nbtools
from tfedu.course.grading.grade import Limits, grade
from tfedu.course.grading.release import release

from optional_parts import REQUIRED, sandbox_problem
from per_notebook import NOTEBOOKS, one_class_per_notebook

TAMPER = Path(__file__).resolve().parent / "tamper"
# Generous: these are the course's own answers, not a timing test, and the machine runs other tests meanwhile.
LIMITS = Limits(cell_timeout=600, timeout=1800)


def test_there_are_notebooks_to_run():
    assert any(p.name == "00_start_here.ipynb" for p in NOTEBOOKS)


def sandboxed() -> bool:
    """The sandbox where this machine can make one (or where CI requires it: then a missing one fails)."""
    return sandbox_problem() is None or "bwrap" in REQUIRED


def failure_report(nb, error: dict) -> str:
    cell = nb.cells[error["cell"]]
    first_line = next((line for line in cell.source.splitlines() if line.strip()), "")
    return f"cell {error['cell']} ({first_line[:80]!r}) raised {error['error']}\n\n{error['traceback']}"


def grade_source_and_release(path: Path, folder: Path, checks: str | None = None, full: bool = False) -> tuple[dict, dict]:
    """The results of grading the source notebook (as a submission) and its released version, in one call."""
    solved = folder / "solved" / path.name
    solved.parent.mkdir(parents=True)
    shutil.copy(path, solved)
    [unsolved] = release([path], folder / "released")
    full, empty = grade([solved, unsolved], source=path, limits=LIMITS, jobs=2, checks=checks,
                        sandboxed=sandboxed(), full=full)["submissions"]
    return full, empty


class OneNotebook:
    path: Path

    def test_runs_top_to_bottom_and_scores_full_marks_and_its_release_zero(self, tmp_path):
        full, empty = grade_source_and_release(self.path, tmp_path)
        nb = nbtools.read(self.path)
        if full["cell_errors"]:
            pytest.fail(f"{self.path.name}, " + failure_report(nb, full["cell_errors"][0]), pytrace=False)
        assert full["max"] > 0 and full["exercises"], f"{self.path.name} has no graded exercises"
        for grade_id, exercise in full["exercises"].items():
            assert exercise["points"] == exercise["max"] > 0, f"{self.path.name} {grade_id}: {exercise['feedback']}"
        assert full["total"] == full["max"]
        assert empty["exercises"].keys() == full["exercises"].keys()
        for grade_id, exercise in empty["exercises"].items():
            assert exercise["points"] == 0, f"{self.path.name} {grade_id}: the unsolved version scored {exercise['points']}"
            assert "not done yet" in exercise["feedback"], f"{self.path.name} {grade_id}: {exercise['feedback']}"
        assert empty["total"] == 0 and empty["cell_errors"] == []
        print(f"{self.path.name}: graded in {full['seconds']:.1f} s")


one_class_per_notebook(OneNotebook, globals())


def toy_notebook():
    """Cells that share names, one exercise that uses one of them, and a demo cell that fails after it."""
    return nbtools.new_notebook([
        nbtools.code("x = 41"),
        nbtools.md("text"),
        nbtools.code("two = 2"),
        nbtools.exercise("ex_double", "def double(x):\n    ### BEGIN SOLUTION\n    return two * x\n    ### END SOLUTION"),
        nbtools.check("check_double", "from toy_checks import check_double\n\ncheck_double(double)", points=1),
        nbtools.code("y = x + 1"),
        nbtools.code("assert y == 42 and double(y) == 84\nraise ValueError(f'y is {y}')"),
    ])


def test_cells_share_one_kernel_and_a_failing_cell_is_named(tmp_path, monkeypatch):
    """The mechanism on a toy notebook: a later cell sees an earlier cell's names (in separate kernels it
    would raise NameError), and the cell that raised is reported with its error and traceback. Graded
    without --full the same scores come from the cells the exercise needs (``two``, not the demos)."""
    monkeypatch.syspath_prepend(str(TAMPER))
    monkeypatch.setenv("PYTHONPATH", str(TAMPER))
    path = tmp_path / "99_toy.ipynb"
    nbtools.write(toy_notebook(), path)
    fast, _ = grade_source_and_release(path, tmp_path / "fast", checks="toy_checks")
    assert fast["total"] == fast["max"] == 1 and fast["cell_errors"] == [] and fast["cells_skipped"] == 3
    full, empty = grade_source_and_release(path, tmp_path / "graded", checks="toy_checks", full=True)
    assert full["exercises"] == fast["exercises"] and full["cells_skipped"] == 0
    assert full["total"] == full["max"] == 1 and empty["total"] == 0
    [error] = full["cell_errors"]
    assert (error["cell"], error["error"]) == (6, "ValueError: y is 42")
    assert "ValueError" in error["traceback"] and "\x1b[" not in error["traceback"]
    report = failure_report(nbtools.read(path), error)
    assert report.startswith("cell 6 ('assert y == 42 and double(y) == 84') raised ValueError: y is 42")

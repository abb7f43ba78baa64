"""Every notebook in notebooks/ (a glob, so new ones are covered as they land): grading the source
notebook itself gives full marks on every exercise, and grading its released (unsolved) student
version gives zero everywhere. Both are graded in one `grade` call, two kernels at once, so this
takes about the notebook's own run time."""

import shutil
from pathlib import Path

import pytest

from tfedu.grading.grade import Limits, grade
from tfedu.grading.release import release

NOTEBOOKS = sorted(Path(__file__).resolve().parents[1].joinpath("notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_source_scores_full_marks_and_release_scores_zero(path, tmp_path):
    solved = tmp_path / "solved" / path.name
    solved.parent.mkdir()
    shutil.copy(path, solved)
    [unsolved] = release([path], tmp_path / "released")
    results = grade([solved, unsolved], source=path, limits=Limits(cell_timeout=600, timeout=1800), jobs=2)
    full, empty = results["submissions"]
    assert full["max"] > 0 and full["exercises"]
    for grade_id, exercise in full["exercises"].items():
        assert exercise["points"] == exercise["max"] > 0, f"{path.name} {grade_id}: {exercise['feedback']}"
    assert full["total"] == full["max"]
    for grade_id, exercise in empty["exercises"].items():
        assert exercise["points"] == 0, f"{path.name} {grade_id}: the unsolved version scored {exercise['points']}"
        assert "not done yet" in exercise["feedback"], f"{path.name} {grade_id}: {exercise['feedback']}"
    assert empty["total"] == 0

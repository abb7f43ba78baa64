"""Every notebook in notebooks/ (a glob, so new ones are covered as they land): grading the source
notebook itself gives full marks on every exercise, and grading its released (unsolved) student
version gives zero everywhere. Both are graded in one `grade` call, two kernels at once, so this
takes about the notebook's own run time."""

import shutil
from pathlib import Path

from tfedu.course.grading.grade import Limits, grade
from tfedu.course.grading.release import release

from optional_parts import needs_sandbox
from per_notebook import one_class_per_notebook


class OneNotebook:
    """One class per notebook (tests/per_notebook.py), so the notebooks spread over the workers."""

    path: Path

    @needs_sandbox
    def test_source_scores_full_marks_and_release_scores_zero(self, tmp_path):
        path = self.path
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


one_class_per_notebook(OneNotebook, globals())


@needs_sandbox
def test_a_zeroed_first_exercise_does_not_take_the_check_imports_with_it(tmp_path):
    """A learner's notebook 07 with F.layer_norm in 7.1 scored 0 / 7: the grader skipped 7.1's decided check
    cell, and with it the `from tfedu.checks import ... as checks` that 7.2's and 7.3's check cells use."""
    import nbformat

    path = Path(__file__).resolve().parents[1] / "notebooks" / "07_transformer_block.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "ex_layer_norm":
            cell.source = ("def layer_norm(x, weight, bias, eps=1e-5):\n"
                           "    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)\n")
    fused = tmp_path / "07_transformer_block.ipynb"
    nbformat.write(nb, fused)
    [result] = grade([fused], source=path, limits=Limits(cell_timeout=600, timeout=1800), jobs=1)["submissions"]
    exercises = result["exercises"]
    assert exercises["check_layer_norm"]["points"] == 0
    assert "torch.nn.functional.layer_norm" in exercises["check_layer_norm"]["feedback"]
    for later in ("check_pre_norm_block", "check_gpt2_param_count"):
        assert exercises[later]["points"] == exercises[later]["max"] > 0, exercises[later]["feedback"]

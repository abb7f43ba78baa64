"""Notebooks are committed clean and follow the conventions in tfedu/course/nbtools.py."""

from pathlib import Path

import nbformat
import pytest

from tfedu.course import course_map, nbtools

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert any(p.name == "00_start_here.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_clean_and_conventional(path):
    problems = nbtools.hygiene_problems(nbtools.read(path), path.name)
    assert not problems, f"{path.name}:\n- " + "\n- ".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_name_is_numbered(path):
    assert path.name[:2].isdigit() and path.name[2] == "_"


@pytest.fixture
def start_here():
    return nbtools.read(NOTEBOOKS[0])


def test_output_cell_is_caught(start_here):
    start_here.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi")]
    assert any("outputs" in p for p in nbtools.hygiene_problems(start_here, "00_start_here.ipynb"))


def test_execution_count_is_caught(start_here):
    start_here.cells[1].execution_count = 1
    assert any("execution count" in p for p in nbtools.hygiene_problems(start_here, "00_start_here.ipynb"))


def test_widget_state_is_caught(start_here):
    start_here.metadata["widgets"] = {}
    assert any("widget" in p for p in nbtools.hygiene_problems(start_here, "00_start_here.ipynb"))


def test_missing_header_parts_are_caught(start_here):
    start_here.cells[0].source = "# 00 · Start here\n\nno badge, no learning goals"
    problems = nbtools.hygiene_problems(start_here, "00_start_here.ipynb")
    assert any("What you will learn" in p for p in problems)
    assert any("Colab badge" in p for p in problems)


def test_missing_colab_setup_is_caught(start_here):
    for cell in start_here.cells:
        if "google.colab" in cell.source:
            cell.source = "import torch"
    assert any("Colab" in p for p in nbtools.hygiene_problems(start_here, "00_start_here.ipynb"))


def test_bad_kernelspec_is_caught(start_here):
    start_here.metadata["kernelspec"] = {"name": "julia-1.9", "language": "julia", "display_name": "Julia"}
    assert any("kernelspec" in p for p in nbtools.hygiene_problems(start_here, "00_start_here.ipynb"))


def graded(nb):
    return [c for c in nb.cells if nbtools.nbgrader_meta(c)]


def test_duplicate_grade_id_is_caught(start_here):
    first, second = graded(start_here)[:2]
    second.metadata["nbgrader"]["grade_id"] = first.metadata["nbgrader"]["grade_id"]
    assert any("repeats" in p for p in nbtools.hygiene_problems(start_here, "00_start_here.ipynb"))


def test_invalid_grade_id_is_caught(start_here):
    graded(start_here)[0].metadata["nbgrader"]["grade_id"] = "has spaces!"
    assert any("must match" in p for p in nbtools.hygiene_problems(start_here, "00_start_here.ipynb"))


def test_check_cell_without_metadata_is_caught(start_here):
    for cell in graded(start_here):
        del cell.metadata["nbgrader"]
    assert any("no nbgrader metadata" in p for p in nbtools.hygiene_problems(start_here, "00_start_here.ipynb"))


def test_unlocked_or_pointless_check_cell_is_caught(start_here):
    check = [c for c in graded(start_here) if c.metadata["nbgrader"]["grade"]][0]
    check.metadata["nbgrader"]["locked"] = False
    check.metadata["nbgrader"]["points"] = 0
    problems = nbtools.hygiene_problems(start_here, "00_start_here.ipynb")
    assert any("locked" in p for p in problems) and any("points" in p for p in problems)


def _exercise_header_cell(nb):
    return next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "### Exercise 0.1" in c.source)


def test_exercise_header_must_state_its_points(start_here):
    i = _exercise_header_cell(start_here)
    start_here.cells[i].source = start_here.cells[i].source.replace(", 2 points)", ")")
    problems = nbtools.hygiene_problems(start_here, "00_start_here.ipynb")
    assert any("must read '### Exercise N.M" in p for p in problems)


@pytest.mark.parametrize("edit", [(", importance: core,", ","), ("importance: core", "importance: high"),
                                  ("(easy,", "(tricky,")], ids=["no importance", "unknown importance", "unknown difficulty"])
def test_exercise_header_must_state_difficulty_and_importance_from_the_scale(start_here, edit):
    i = _exercise_header_cell(start_here)
    assert edit[0] in start_here.cells[i].source
    start_here.cells[i].source = start_here.cells[i].source.replace(*edit)
    problems = nbtools.hygiene_problems(start_here, "00_start_here.ipynb")
    assert any("importance: core|useful|optional" in p for p in problems)


def test_exercise_minutes_add_up_the_headers_and_count_a_range_by_its_upper_end():
    nb = nbtools.new_notebook([nbtools.md("### Exercise 1.1: a (easy, importance: core, about 5 minutes, 1 point)"),
                               nbtools.md("### Exercise 1.2: b (medium, importance: optional, about 10-15 minutes, 2 points)")])
    assert course_map.exercise_minutes(nb) == 20


def test_exercise_header_points_must_match_its_check_cells(start_here):
    i = _exercise_header_cell(start_here)
    start_here.cells[i].source = start_here.cells[i].source.replace(", 2 points)", ", 5 points)")
    problems = nbtools.hygiene_problems(start_here, "00_start_here.ipynb")
    assert any("exercise 0.1 states 5 points, its check cells carry 2" in p for p in problems)


def test_check_cell_before_any_exercise_header_is_caught(start_here):
    i = _exercise_header_cell(start_here)
    start_here.cells[i].source = start_here.cells[i].source.replace("### Exercise 0.1", "### Warm-up 0.1")
    problems = nbtools.hygiene_problems(start_here, "00_start_here.ipynb")
    assert any("check cell before any exercise header" in p for p in problems)

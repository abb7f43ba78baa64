"""Every exercise has its three hints (issue 38, item 2): the idea and the approach in words, then a skeleton."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tfedu.checks import core
from tfedu.course import nbtools

from per_notebook import NOTEBOOKS
from test_hints import CODE

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- every exercise has its three hints

def exercises_of(path: Path) -> list[tuple[str, str, str]]:
    """(number, solution grade_id, the source of its check cells) for each exercise."""
    return [(number, nbtools.nbgrader_meta(cell)["grade_id"], "\n".join(c.source for c in checks))
            for number, cell, checks in nbtools.exercise_cells(nbtools.read(path))]


def checker_module(path: Path):
    module = next((ROOT / "tfedu" / "checks").glob(f"nb{path.stem[:2]}_*.py"))
    return importlib.import_module(f"tfedu.checks.{module.stem}"), module


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_exercise_has_three_hints_in_words_then_a_skeleton(path):
    module, source = checker_module(path)
    given = getattr(module, "HINTS", {})
    exercises = exercises_of(path)
    assert set(given) == {grade_id for _, grade_id, _ in exercises}, f"{source.name}: HINTS and the exercises differ"
    for number, grade_id, checks in exercises:
        entry = given[grade_id]
        where = f"{source.name} HINTS[{grade_id!r}]"
        assert isinstance(entry, core.Hints), where
        assert entry.number == number, f"{where}: number {entry.number!r}, the header says {number!r}"
        assert callable(getattr(module, entry.check, None)), f"{where}: no checker {entry.check!r} in the module"
        assert re.search(rf"\.{entry.check}\(", checks), f"{where}: the check cells of {number} do not call {entry.check}"
        for level in ("idea", "approach"):
            text = getattr(entry, level)
            assert len(text) >= 80, f"{where}.{level} is too short to help"
            assert "```" not in text and not CODE.search(text), f"{where}.{level} holds code; the first two hints are words"
        skeleton = entry.skeleton
        assert core.BLANK in skeleton, f"{where}.skeleton has no blank to fill"
        ast.parse(skeleton.replace(core.BLANK, "_blank_"))  # reads as Python once the blanks are filled


def test_hint_numbers_are_unique_across_the_course():
    numbers = [h.number for path in NOTEBOOKS for h in getattr(checker_module(path)[0], "HINTS", {}).values()]
    assert len(numbers) == len(set(numbers))

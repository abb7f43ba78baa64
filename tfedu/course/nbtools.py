"""Notebook conventions in one place: building cells, stripping outputs, hygiene rules.

Every notebook in notebooks/ follows these rules (tests/test_notebook_hygiene.py enforces
them, ``tfedu clean`` fixes the mechanical ones):

1. The first cell is markdown: ``# NN · Title``, a ``## What you will learn`` list, and an
   Open-in-Colab badge.
2. Among the first three code cells is the set-up cell: it installs tfedu only when running
   on Colab (``"google.colab" in sys.modules``).
3. Exercise cells carry nbgrader metadata with ``solution: true`` and a unique ``grade_id``
   (``ex_<name>``); the solution sits between ``### BEGIN SOLUTION`` and ``### END SOLUTION``.
   Check cells carry ``grade: true, locked: true``, a unique ``grade_id`` (``check_<name>``)
   and points.
4. Committed notebooks have no outputs, execution counts or widget state.
5. Each exercise header reads ``### Exercise N.M: title (difficulty, importance: I, about K minutes, P points)``
   (I is core, useful or optional: how central the idea is),
   and P is the sum of the points of the check cells between it and the next header.
6. Every cell carries the slide metadata that :func:`slide_types` gives it (``tfedu clean`` writes it):
   the lecture deck (``tfedu slides``, RISE) is the notebook itself.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from typing import Any

import nbformat

from tfedu.course import course_map
from tfedu.course.course_map import EXERCISE_HEADER, HEADER_FORM



def repository_url() -> str:
    """The course's GitHub address, from the package metadata (``[project.urls] Repository``).

    In a checkout ``pyproject.toml`` is read (installed metadata may be older than the file);
    in an installed wheel, the metadata.
    """
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        urls = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("urls", {})
        if "Repository" in urls:
            return urls["Repository"]
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        entries = metadata("tfedu").get_all("Project-URL") or []
    except PackageNotFoundError:
        entries = []
    for entry in entries:
        label, _, url = entry.partition(",")
        if label.strip() == "Repository":
            return url.strip()
    raise RuntimeError("no Repository URL in tfedu's metadata: add it under [project.urls] in pyproject.toml")


REPO_URL = repository_url()
if not REPO_URL.startswith("https://github.com/"):
    raise RuntimeError(f"[project.urls] Repository must be a https://github.com/OWNER/NAME address, got {REPO_URL!r}")
COLAB_URL = "https://colab.research.google.com/github/" + REPO_URL.removeprefix("https://github.com/").rstrip("/") \
    + "/blob/main/notebooks/{name}"
PIP_LINE = f'%pip install --quiet "tfedu @ git+{REPO_URL}"'
NBGRADER_SCHEMA = 3
GRADE_ID = re.compile(r"^[A-Za-z0-9_-]+$")
BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"

SETUP_SOURCE = '''\
# Set-up. On Colab this installs tfedu; on your own machine `pip install -e .` already did.
import sys

if "google.colab" in sys.modules:
    {pip_line}

import torch
import tfedu

tfedu.seed_everything(0)
DEVICE = tfedu.device()
print(f"tfedu {{tfedu.__version__}}, torch {{torch.__version__}}, device: {{DEVICE}}")'''.format(pip_line=PIP_LINE)


def colab_badge(name: str) -> str:
    """Markdown for the Open-in-Colab badge of notebook file ``name``."""
    url = COLAB_URL.format(name=name)
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


_BADGE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")
_PIP = re.compile(r'%pip install --quiet "tfedu @ git\+[^"]*"')


def regenerate(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """Write the generated parts of notebook file ``name`` again, in place, from their one source.

    The Open-in-Colab badge in the header and the Colab install line come from ``REPO_URL``
    (``[project.urls]`` in pyproject.toml); notebook 00's course map from ``tfedu.course.course_map``; each
    cell's slide metadata from :func:`slide_types`.
    """
    if nb.cells and nb.cells[0].cell_type == "markdown":
        nb.cells[0].source = _BADGE.sub(lambda _: colab_badge(name), nb.cells[0].source)
    for cell, kind in zip(nb.cells, slide_types(nb.cells)):
        cell.metadata["slideshow"] = {"slide_type": kind}
        if cell.cell_type == "code" and "google.colab" in cell.source:
            cell.source = _PIP.sub(lambda _: PIP_LINE, cell.source)
        elif cell.cell_type == "markdown" and name == course_map.MAP_NOTEBOOK:
            cell.source = course_map.replace_table(cell.source, course_map.notebook_table())
    return nb


_SHOWS = ("print(", "display(", "plt.", ".plot(", ".show(", ".imshow(")


def _quiet_assertions(source: str) -> bool:
    """True for a code cell that only asserts: it shows nothing, and asserts are all or most of it.

    >>> _quiet_assertions("assert x == 1\\nassert y == 2")
    True
    >>> _quiet_assertions("y = f(x)\\nassert y == 2\\nprint(y)")
    False
    """
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        body = ast.parse("\n".join(lines)).body
    except SyntaxError:
        return False
    asserts = sum(isinstance(statement, ast.Assert) for statement in body)
    shows = any(word in source for word in _SHOWS) or (body and isinstance(body[-1], ast.Expr))
    return bool(asserts) and not shows and (asserts == len(body) or asserts >= 3)


def slide_types(cells: list[nbformat.NotebookNode]) -> list[str]:
    """Each cell's role in the lecture deck (``metadata.slideshow.slide_type``), from the content.

    The header opens the deck and each ``## `` section is a new slide. Below it, a sub-slide starts at
    each ``### `` heading (an exercise, a step) and at prose that follows shown code: one idea, then
    its code. Prose shows with its slide; code and its output come in as a fragment, so the lecturer
    talks first. Skipped: the set-up cell, solutions, check cells and cells that only assert (the
    notebook proves the claim; the slide states it).
    """
    types: list[str] = []
    after_code = False  # the last cell shown was code
    for index, cell in enumerate(cells):
        meta = nbgrader_meta(cell) or {}
        if cell.cell_type == "markdown":
            first = cell.source.lstrip().split("\n", 1)[0]
            if index == 0 or first.startswith("## "):
                kind = "slide"
            elif first.startswith(("### ", "#### ")) or after_code:
                kind = "subslide"
            else:
                kind = "-"
        elif (cell.cell_type != "code" or meta.get("solution") or meta.get("grade")
              or "google.colab" in cell.source or _quiet_assertions(cell.source)):
            kind = "skip"
        else:
            kind = "fragment"
        if kind != "skip":
            after_code = cell.cell_type == "code"
        types.append(kind)
    return types


def header(name: str, title: str, learn: list[str], intro: str = "") -> str:
    """The standard first cell of a notebook."""
    number = name[:2]
    bullets = "\n".join(f"- {item}" for item in learn)
    text = f"# {number} · {title}\n\n{colab_badge(name)}\n\n"
    if intro:
        text += intro.strip() + "\n\n"
    return text + f"## What you will learn\n\n{bullets}\n"


def md(source: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(source.strip("\n"))


def code(source: str, **metadata: Any) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source.strip("\n"), metadata=metadata)


def _nbgrader(grade_id: str, *, grade: bool, solution: bool, locked: bool, points: float | None = None) -> dict:
    if not GRADE_ID.match(grade_id):
        raise ValueError(f"grade_id {grade_id!r} must match [A-Za-z0-9_-]+")
    meta: dict[str, Any] = {
        "schema_version": NBGRADER_SCHEMA,
        "grade": grade,
        "solution": solution,
        "locked": locked,
        "task": False,
        "grade_id": grade_id,
    }
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def exercise(grade_id: str, source: str) -> nbformat.NotebookNode:
    """An answer cell; its source must hold a ``### BEGIN SOLUTION``/``### END SOLUTION`` region."""
    if BEGIN_SOLUTION not in source or END_SOLUTION not in source:
        raise ValueError(f"exercise {grade_id}: the source needs {BEGIN_SOLUTION!r} and {END_SOLUTION!r}")
    return code(source, **_nbgrader(grade_id, grade=False, solution=True, locked=False))


def check(grade_id: str, source: str, points: float = 1) -> nbformat.NotebookNode:
    """A locked, graded cell that calls a tfedu checker."""
    return code(source, **_nbgrader(grade_id, grade=True, solution=False, locked=True, points=points))


def new_notebook(cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Remove outputs, execution counts, widget state and run-time cell metadata, in place."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in ("execution", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
    return nb


def read(path: str | Path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def write(nb: nbformat.NotebookNode, path: str | Path) -> None:
    nbformat.validate(nb)
    Path(path).write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


def nbgrader_meta(cell: nbformat.NotebookNode) -> dict | None:
    meta = cell.get("metadata", {}).get("nbgrader")
    return meta if isinstance(meta, dict) else None


def exercise_cells(nb: nbformat.NotebookNode) -> list[tuple[str, nbformat.NotebookNode, list[nbformat.NotebookNode]]]:
    """(number, solution cell, its check cells) for each exercise in order; the number is the header's before it."""
    found: list[tuple[str, nbformat.NotebookNode, list[nbformat.NotebookNode]]] = []
    number = None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            headers = list(EXERCISE_HEADER.finditer(cell.source))
            number = headers[-1]["number"] if headers else number
        meta = nbgrader_meta(cell) or {}
        if meta.get("solution") and number is not None:
            found.append((number, cell, []))
            number = None
        elif meta.get("grade") and found:
            found[-1][2].append(cell)
    return found


def exercise_point_problems(nb: nbformat.NotebookNode) -> list[str]:
    """Each exercise header states difficulty, importance, minutes and points; the points are its check cells' sum.

    A header looks like ``### Exercise 4.1: scaled dot-product attention (easy, importance: core, about 10
    minutes, 2 points)``; the check cells between it and the next header carry those points in nbgrader.
    """
    problems: list[str] = []
    current: tuple[int, str, float] | None = None  # (cell index, exercise number, stated points)
    counted = 0.0

    def close() -> None:
        if current is not None and abs(counted - current[2]) > 1e-9:
            problems.append(f"cell {current[0]}: exercise {current[1]} states {current[2]:g} points, "
                            f"its check cells carry {counted:g}")

    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if re.match(r"#{2,4} Exercise\b", line):
                    match = EXERCISE_HEADER.match(line)
                    if match is None:
                        problems.append(f"cell {i}: exercise header {line!r} must read {HEADER_FORM}")
                        continue
                    close()
                    current, counted = (i, match["number"], float(match["points"])), 0.0
        meta = nbgrader_meta(cell) or {}
        if meta.get("grade") and not meta.get("solution"):
            if current is None:
                problems.append(f"cell {i}: a check cell before any exercise header")
            counted += float(meta.get("points") or 0)
    close()
    return problems


def hygiene_problems(nb: nbformat.NotebookNode, name: str) -> list[str]:
    """Everything wrong with a notebook as committed; empty when it follows the conventions."""
    problems = []
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as err:
        problems.append(f"invalid nbformat: {err.message}")
    kernelspec = nb.metadata.get("kernelspec", {})
    if kernelspec.get("name") != "python3" or kernelspec.get("language") != "python":
        problems.append("kernelspec must be python3 / python")
    if "widgets" in nb.metadata:
        problems.append("notebook metadata carries widget state (run `tfedu clean`)")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
            problems.append(f"cell {i} has outputs or an execution count (run `tfedu clean`)")
    first = nb.cells[0] if nb.cells else None
    if first is None or first.cell_type != "markdown":
        problems.append("the first cell must be the markdown header")
    else:
        if not re.match(rf"# {re.escape(name[:2])} · \S", first.source):
            problems.append(f"the header must start with '# {name[:2]} · Title'")
        if "## What you will learn" not in first.source:
            problems.append("the header needs a '## What you will learn' section")
        if COLAB_URL.format(name=name) not in first.source:
            problems.append("the header needs the Open-in-Colab badge for this file")
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    if not any("google.colab" in c.source and "pip install" in c.source for c in code_cells[:3]):
        problems.append("one of the first three code cells must install tfedu only on Colab")
    seen: dict[str, int] = {}
    for i, cell in enumerate(nb.cells):
        meta = nbgrader_meta(cell)
        looks_graded = BEGIN_SOLUTION in cell.source or "checks." in cell.source and "check_" in cell.source
        if meta is None:
            if cell.cell_type == "code" and looks_graded:
                problems.append(f"cell {i} looks like an exercise or check but has no nbgrader metadata")
            continue
        grade_id = meta.get("grade_id", "")
        if not GRADE_ID.match(str(grade_id)):
            problems.append(f"cell {i}: nbgrader grade_id {grade_id!r} must match [A-Za-z0-9_-]+")
        elif grade_id in seen:
            problems.append(f"cell {i}: grade_id {grade_id!r} repeats cell {seen[grade_id]}")
        seen[str(grade_id)] = i
        if meta.get("schema_version") != NBGRADER_SCHEMA:
            problems.append(f"cell {i}: nbgrader schema_version must be {NBGRADER_SCHEMA}")
        if meta.get("solution") and (BEGIN_SOLUTION not in cell.source or END_SOLUTION not in cell.source):
            problems.append(f"cell {i}: a solution cell needs BEGIN/END SOLUTION markers")
        if meta.get("grade") and not meta.get("solution"):
            if not meta.get("locked"):
                problems.append(f"cell {i}: check cells must be locked")
            if not isinstance(meta.get("points"), (int, float)) or meta["points"] <= 0:
                problems.append(f"cell {i}: check cells need positive points")
    for i, (cell, expected) in enumerate(zip(nb.cells, slide_types(nb.cells))):
        if cell.metadata.get("slideshow") != {"slide_type": expected}:
            problems.append(f"cell {i}: slide metadata must be {{'slide_type': {expected!r}}} (run `tfedu clean`)")
    problems.extend(exercise_point_problems(nb))
    return problems

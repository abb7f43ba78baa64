"""Student versions of the source notebooks: ``tfedu release NOTEBOOK... --out DIR``.

What a released notebook keeps and what it hides (the same as nbgrader's own student version,
tests/test_release.py checks the two agree on every notebook):

- every region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` becomes :data:`CODE_STUB`
  at the indentation of the BEGIN marker. The markers sit inside a function or method body,
  so the signature stays and calling the function raises ``NotImplementedError``; the check
  cell then reports "this exercise is not done yet". A solution cell without markers is
  replaced by the stub as a whole (markdown answer cells by :data:`TEXT_STUB`);
- every region between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` is removed,
  markers included;
- outputs, execution counts and widget state are cleared;
- check cells (nbgrader ``grade: true``) are kept, marked ``locked`` and made non-deletable
  and non-editable; answer cells are made non-deletable (nbgrader's ``LockCells``);
- check cells also get the ``raises-exception`` cell tag (:data:`RUN_ON_TAG`, added to any tags
  already there). This is the one thing nbgrader's student version does not do.

Everything else (markdown, set-up and demonstration cells, metadata) is kept as it is, except that
``solutions=False`` (``tfedu release --no-solutions``, for a graded course) ends the set-up cell with
:data:`SOLUTIONS_OFF`, so that ``tfedu.solution("N.M")`` answers that solutions are off; hints stay.

Why the tag. In a fresh student version every check cell fails with ``ExerciseNotDone``. Without
the tag, JupyterLab's Run All stops at the first of them: it sends every cell to the kernel at
once, each request carrying ``stop_on_error: true``, and the kernel aborts everything queued behind
a cell that raised. For a cell tagged ``raises-exception`` JupyterLab sends
``stop_on_error: false`` (``OutputArea.execute`` in @jupyterlab/outputarea, JupyterLab 4.6), so
the kernel goes on with the next cell; nbclient does the same. The failure stays visible: the
cell still shows its hint, only the run goes on (a wrong answer's ``CheckFailure`` too).
Demonstration cells never call the learner's functions, so the rest of the notebook runs with
the references. ``tfedu grade`` ignores a submission's cell metadata, so the tag changes nothing
in grading.

Source notebooks do not carry the tag. There every check must pass: a broken solution or
checker must stop Run All at that cell, and it fails the build (tests/test_notebooks.py).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

from tfedu.course import nbtools

CODE_STUB = '# YOUR CODE HERE\nraise NotImplementedError("replace this line with your code")'
TEXT_STUB = "YOUR ANSWER HERE"
SOLUTIONS_OFF = "tfedu.solutions_off()  # this course is graded: tfedu.solution() is off, tfedu.hint() is not"
RUN_ON_TAG = "raises-exception"  # JupyterLab's Run All and nbclient go past a failing cell with this tag


class ReleaseError(ValueError):
    """A source notebook cannot be turned into a student version (bad markers or metadata)."""


def _replace_regions(source: str, begin: str, end: str, stub: str | None, where: str) -> tuple[str, bool]:
    """Replace each begin/end region by ``stub`` (indented like the begin marker) or drop it."""
    out: list[str] = []
    inside = found = False
    for line in source.split("\n"):
        if begin in line:
            if inside:
                raise ReleaseError(f"{where}: nested {begin!r}")
            inside = found = True
            if stub is not None:
                indent = re.match(r"\s*", line).group(0)
                out.extend(indent + stub_line for stub_line in stub.split("\n"))
        elif end in line:
            if not inside:
                raise ReleaseError(f"{where}: {end!r} without a matching {begin!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ReleaseError(f"{where}: {begin!r} without a matching {end!r}")
    return "\n".join(out), found


def is_solution(cell) -> bool:
    meta = nbtools.nbgrader_meta(cell) or {}
    return bool(meta.get("solution"))


def is_check(cell) -> bool:
    meta = nbtools.nbgrader_meta(cell) or {}
    return bool(meta.get("grade")) and not meta.get("solution")


def setup_cell(nb: nbformat.NotebookNode) -> int | None:
    """The index of the set-up cell: the first code cell that imports tfedu."""
    return next((i for i, cell in enumerate(nb.cells)
                 if cell.cell_type == "code" and re.search(r"^import tfedu\b", cell.source, re.M)), None)


def student_version(nb: nbformat.NotebookNode, name: str = "notebook", *, solutions: bool = True) -> nbformat.NotebookNode:
    """Return the student version of source notebook ``nb`` (``nb`` itself is not changed); ``solutions=False``
    switches ``tfedu.solution`` off in its set-up cell."""
    nb = copy.deepcopy(nb)
    nbtools.strip(nb)
    nb.metadata.pop("celltoolbar", None)
    for index, cell in enumerate(nb.cells):
        where = f"{name} cell {index}"
        meta = nbtools.nbgrader_meta(cell)
        stub = CODE_STUB if cell.cell_type == "code" else TEXT_STUB
        cell.source, replaced = _replace_regions(cell.source, nbtools.BEGIN_SOLUTION, nbtools.END_SOLUTION, stub, where)
        if replaced and not is_solution(cell):
            raise ReleaseError(f"{where}: a solution region in a cell that is not an nbgrader solution cell")
        if is_solution(cell) and not replaced:
            cell.source = stub
        cell.source, _ = _replace_regions(cell.source, nbtools.BEGIN_HIDDEN, nbtools.END_HIDDEN, None, where)
        if meta is None:
            continue
        if is_solution(cell):
            cell.metadata["deletable"] = False
        elif meta.get("grade") or meta.get("locked"):
            meta["locked"] = True
            cell.metadata["deletable"] = False
            cell.metadata["editable"] = False
        if is_check(cell):
            tags = list(cell.metadata.get("tags", []))
            cell.metadata["tags"] = tags if RUN_ON_TAG in tags else [*tags, RUN_ON_TAG]
    if not solutions:
        setup = setup_cell(nb)
        if setup is None:
            raise ReleaseError(f"{name}: no set-up cell (a code cell with `import tfedu`) to switch solutions off in")
        nb.cells[setup].source = nb.cells[setup].source.rstrip("\n") + "\n" + SOLUTIONS_OFF
    nbformat.validate(nb)
    return nb


def release(paths: list[str | Path], out_dir: str | Path, *, solutions: bool = True) -> list[Path]:
    """Write the student version of each notebook in ``paths`` into ``out_dir`` (same file names)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in map(Path, paths):
        if path.suffix != ".ipynb" or not path.is_file():
            raise ReleaseError(f"{path}: expected an existing .ipynb notebook")
        target = out / path.name
        if target.resolve() == path.resolve():
            raise ReleaseError(f"{path}: --out must not be the folder of the source notebooks")
        nbtools.write(student_version(nbtools.read(path), path.name, solutions=solutions), target)
        written.append(target)
    return written

"""Every source notebook in notebooks/ runs top to bottom in one fresh kernel without an error.

Each notebook is ONE test: nbclient executes all its cells in order in one kernel, inside that test,
so no scheduler (pytest-xdist's or another) can send two cells of a notebook to different workers.
(Under nbval each cell was its own test, kept on one worker by xdist's `--dist loadgroup`. With
pytest 9.2 and xdist 3.8 that grouping does nothing: xdist renames `item._nodeid`, pytest 9.2 reads
`item._id`. The cells were split and the later ones failed with NameError in a fresh kernel.)
Each notebook's test sits in a class of its own (tests/per_notebook.py), so the notebooks spread over
the workers.

A failure names the notebook, the cell (its index and first line) and the error, with the
traceback as the kernel printed it.
"""

import re
import time
from pathlib import Path

import pytest

from tfedu.course import nbtools

from per_notebook import NOTEBOOKS, one_class_per_notebook
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def test_there_are_notebooks_to_run():
    assert any(p.name == "00_start_here.ipynb" for p in NOTEBOOKS)


def first_error(nb):
    """(index, cell, error output) of the first cell whose outputs hold an error, or None."""
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                return index, cell, output
    return None


def failure_report(name, index, cell, error):
    first_line = next((line for line in cell.source.splitlines() if line.strip()), "")
    traceback = ANSI.sub("", "\n".join(error.get("traceback", [])))
    return (f"{name}, cell {index} ({first_line[:80]!r}) raised {error.ename}: {error.evalue}\n\n"
            f"{traceback[-6000:]}")


def run_in_one_kernel(path):
    """Execute ``path`` with nbclient in one kernel started in notebooks/; the executed notebook."""
    from nbclient import NotebookClient

    nb = nbtools.read(path)
    # allow_errors: every cell runs and the first error is reported below with its cell and traceback
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


class OneNotebook:
    path: Path

    def test_runs_top_to_bottom_in_one_kernel(self):
        start = time.monotonic()
        nb = run_in_one_kernel(self.path)
        seconds = time.monotonic() - start
        failed = first_error(nb)
        if failed is not None:
            pytest.fail(failure_report(self.path.name, *failed), pytrace=False)
        counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
        # One kernel, in order: its execution counter numbers the code cells 1, 2, 3, ... A cell run in
        # another kernel (or skipped) would break the sequence.
        assert counts == list(range(1, len(counts) + 1)), f"{self.path.name}: execution counts {counts}"
        print(f"{self.path.name}: {len(counts)} code cells in {seconds:.1f} s")


one_class_per_notebook(OneNotebook, globals())


def test_cells_share_one_kernel_and_a_failure_names_its_cell(tmp_path):
    """The mechanism on a toy notebook: a later cell sees an earlier cell's names (in separate kernels it
    would raise NameError), the counts run 1, 2, 3, and the report names the failing cell and its error."""
    path = tmp_path / "99_toy.ipynb"
    nbtools.write(nbtools.new_notebook([nbtools.code("x = 41"), nbtools.md("text"), nbtools.code("y = x + 1"),
                                        nbtools.code("assert y == 42\nraise ValueError(f'y is {y}')")]), path)
    nb = run_in_one_kernel(path)
    assert [c.execution_count for c in nb.cells if c.cell_type == "code"] == [1, 2, 3]
    index, cell, error = first_error(nb)
    assert (index, error.ename, error.evalue) == (3, "ValueError", "y is 42")
    report = failure_report(path.name, index, cell, error)
    assert report.startswith("99_toy.ipynb, cell 3 ('assert y == 42') raised ValueError: y is 42")
    assert "\x1b[" not in report

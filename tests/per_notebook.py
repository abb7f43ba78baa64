"""One test class per notebook, so that pytest-xdist spreads the slow per-notebook tests over its workers.

The suite runs with ``--dist loadscope`` (pyproject.toml): xdist hands each test class to one worker as
a whole, and each test module's plain functions to one worker as a whole, so a module's fixtures (the
tamper and honest-grading submissions, for example) are built once. That grouping is xdist's own
documented rule, read from the node id; it needs no hook of ours and no marker. A test that executes
a whole notebook therefore lives in a class of its own, ``Test_<notebook>``, made here from a template
whose test methods read ``self.path``. Units are handed out in collection order (``--no-loadscope-reorder``:
xdist's default order, most tests first, put these one-test units last, and one worker ran notebook 08's
grading alone at the end), and tests/conftest.py puts the costliest files first.
tests/test_scheduling.py checks the grouping.
"""

from pathlib import Path

NOTEBOOKS = sorted(Path(__file__).resolve().parents[1].joinpath("notebooks").glob("[0-9][0-9]_*.ipynb"))


def one_class_per_notebook(template: type, namespace: dict) -> None:
    """Add ``Test_<stem>`` (a subclass of ``template`` with ``path`` set) to a test module's namespace."""
    for path in NOTEBOOKS:
        name = f"Test_{path.stem}"
        namespace[name] = type(name, (template,), {"path": path, "__module__": namespace["__name__"]})

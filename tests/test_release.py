"""`tfedu release`: what a student version hides and keeps, checked on every notebook.

For each notebook in notebooks/ (a glob, so new notebooks are covered as they land):
- the released version runs top to bottom with nbclient WITHOUT ``allow_errors`` (as JupyterLab's
  Run All does): every check cell carries the ``raises-exception`` tag, shows one
  ExerciseNotDone ("this exercise is not done yet") whose traceback is the hint without the
  checker's frames, and no other cell errors;
- nbgrader's own student-version preprocessors (ClearSolutions, ClearHiddenTests, LockCells,
  ClearOutput, run through nbconvert without a database) produce the same notebook, except for
  that one tag, which nbgrader does not add;
- the source's nbgrader metadata is valid for nbgrader's schema (version 3), and no source cell
  carries the tag (a source check that fails must stop Run All there, in JupyterLab; in
  tests/test_notebooks.py it costs the exercise its marks and fails the test).
"""

import re

from pathlib import Path

import nbformat
import pytest

from tfedu.course import cli, nbtools
from tfedu.checks import traceback_files
from tfedu.course.grading.release import CODE_STUB, RUN_ON_TAG, ReleaseError, is_check, release, student_version

from per_notebook import NOTEBOOKS, one_class_per_notebook

IDS = [p.stem for p in NOTEBOOKS]


def test_there_are_notebooks_to_release():
    assert any(p.name == "00_start_here.ipynb" for p in NOTEBOOKS)


def toy_notebook():
    cells = [
        nbtools.md("# toy"),
        nbtools.exercise("ex_double", '''
class Doubler:
    def __call__(self, x):
        """Twice x."""
        ### BEGIN SOLUTION
        y = x + x
        return y
        ### END SOLUTION

def triple(x):
    ### BEGIN SOLUTION
    return 3 * x
    ### END SOLUTION
'''),
        nbtools.check("check_double", '''
assert Doubler()(2) == 4
### BEGIN HIDDEN TESTS
assert Doubler()(5) == 10
### END HIDDEN TESTS
print("done")
''', points=3),
        nbtools.code("print('demo')"),
    ]
    nb = nbtools.new_notebook(cells)
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="demo\n")]
    nb.cells[3].execution_count = 7
    return nb


def test_solutions_become_stubs_at_the_marker_indentation_keeping_signatures():
    released = student_version(toy_notebook())
    source = released.cells[1].source
    stub_in_method = "\n".join("        " + line for line in CODE_STUB.split("\n"))
    stub_in_function = "\n".join("    " + line for line in CODE_STUB.split("\n"))
    assert source == (
        "class Doubler:\n    def __call__(self, x):\n        \"\"\"Twice x.\"\"\"\n" + stub_in_method
        + "\n\ndef triple(x):\n" + stub_in_function
    )
    assert "x + x" not in source and "3 * x" not in source and "BEGIN SOLUTION" not in source
    namespace: dict = {}
    exec(source, namespace)
    with pytest.raises(NotImplementedError):
        namespace["Doubler"]()(2)
    with pytest.raises(NotImplementedError):
        namespace["triple"](1)


def test_hidden_tests_are_removed_check_cells_locked_and_outputs_cleared():
    source_nb = toy_notebook()
    released = student_version(source_nb)
    check = released.cells[2]
    assert check.source == 'assert Doubler()(2) == 4\nprint("done")'
    assert check.metadata["nbgrader"]["locked"] is True
    assert check.metadata["nbgrader"]["points"] == 3
    assert check.metadata["editable"] is False and check.metadata["deletable"] is False
    assert check.metadata["tags"] == ["raises-exception"]
    assert all("tags" not in c.metadata for i, c in enumerate(released.cells) if i != 2)
    assert "tags" not in source_nb.cells[2].metadata
    assert released.cells[1].metadata["deletable"] is False
    assert released.cells[3].outputs == [] and released.cells[3].execution_count is None
    assert released.cells[3].source == "print('demo')"
    # the source notebook is untouched
    assert "### BEGIN HIDDEN TESTS" in source_nb.cells[2].source and source_nb.cells[3].outputs


def test_the_run_on_tag_keeps_existing_tags_and_is_not_doubled():
    nb = toy_notebook()
    nb.cells[2].metadata["tags"] = ["keep-me"]
    assert student_version(nb).cells[2].metadata["tags"] == ["keep-me", RUN_ON_TAG]
    nb.cells[2].metadata["tags"] = [RUN_ON_TAG, "keep-me"]
    assert student_version(nb).cells[2].metadata["tags"] == [RUN_ON_TAG, "keep-me"]


@pytest.mark.parametrize("source, problem", [
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "without a matching"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n", "nested"),
    ("def f():\n    return 1\n    ### END SOLUTION\n", "without a matching"),
])
def test_broken_markers_are_reported(source, problem):
    nb = toy_notebook()
    nb.cells[1].source = source
    with pytest.raises(ReleaseError, match=problem):
        student_version(nb)


def test_a_solution_region_outside_a_solution_cell_is_an_error():
    nb = toy_notebook()
    nb.cells[3].source = "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"
    with pytest.raises(ReleaseError, match="not an nbgrader solution cell"):
        student_version(nb)


def test_cli_release_writes_each_notebook_and_refuses_non_notebooks(tmp_path, capsys):
    src = tmp_path / "src" / "09_toy.ipynb"
    src.parent.mkdir()
    nbtools.write(toy_notebook(), src)
    assert cli.main(["release", str(src), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "09_toy.ipynb").is_file()
    assert cli.main(["release", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "out")]) == 2
    assert "expected an existing .ipynb" in capsys.readouterr().err
    assert cli.main(["release", str(src), "--out", str(src.parent)]) == 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_source_nbgrader_metadata_is_valid_for_nbgrader(path):
    from nbgrader.nbgraderformat import MetadataValidator

    nb = nbtools.read(path)
    MetadataValidator().validate_nb(nb)
    graded = [nbtools.nbgrader_meta(c) for c in nb.cells if nbtools.nbgrader_meta(c)]
    assert graded, f"{path.name} has no exercises"
    tagged = [i for i, c in enumerate(nb.cells) if RUN_ON_TAG in c.metadata.get("tags", [])]
    assert not tagged, f"{path.name}: source cells {tagged} carry {RUN_ON_TAG!r}; Run All would go on past a failing check"


def nbgrader_student_version(nb):
    from nbconvert.exporters import NotebookExporter
    from nbgrader.preprocessors import ClearHiddenTests, ClearOutput, ClearSolutions, LockCells
    from traitlets.config import Config

    config = Config()
    config.ClearSolutions.code_stub = {"python": CODE_STUB}
    exporter = NotebookExporter(config=config)
    for preprocessor in (ClearSolutions, ClearHiddenTests, LockCells, ClearOutput):
        exporter.register_preprocessor(preprocessor(config=config), enabled=True)
    text, _ = exporter.from_notebook_node(nb, resources={})
    return nbformat.reads(text, as_version=4)


@pytest.mark.parametrize("path", [*NOTEBOOKS, None], ids=[*IDS, "toy"])
def test_nbgrader_agrees_with_tfedu_release(path):
    nb = nbtools.read(path) if path else toy_notebook()
    ours, theirs = student_version(nb), nbgrader_student_version(nb)
    assert len(ours.cells) == len(theirs.cells) == len(nb.cells)
    for index, (a, b) in enumerate(zip(ours.cells, theirs.cells)):
        where = f"cell {index}"
        assert a.cell_type == b.cell_type, where
        assert a.source == b.source, where
        # The one documented difference: tfedu tags check cells so that Run All goes on past them.
        ours_meta = dict(a.metadata)
        if is_check(a):
            tags = list(ours_meta.pop("tags"))
            assert tags.count(RUN_ON_TAG) == 1 and RUN_ON_TAG not in b.metadata.get("tags", []), where
            tags.remove(RUN_ON_TAG)
            if tags:
                ours_meta["tags"] = tags
        assert ours_meta == dict(b.metadata), where
        if a.cell_type == "code":
            assert a.outputs == b.outputs == [] and a.execution_count is None and b.execution_count is None


ANSI = re.compile(r"\x1b\[[0-9;]*m")


class OneNotebook:
    """One class per notebook (tests/per_notebook.py), so the notebooks spread over the workers."""

    path: Path

    def test_released_notebook_runs_to_the_end_without_allow_errors(self, tmp_path, monkeypatch):
        """What JupyterLab's Run All does with a fresh student version: every cell runs, checks fail visibly."""
        path = self.path
        # One torch thread in the kernel, as in the grader's run of the source (tests/test_notebooks.py): the
        # suite runs a test per core, and a second thread per kernel only makes them contend.
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        from nbclient import NotebookClient

        [released_path] = release([path], tmp_path)
        nb = nbtools.read(released_path)
        text = released_path.read_text()
        assert "### BEGIN SOLUTION" not in text and "### BEGIN HIDDEN TESTS" not in text
        # No allow_errors: an error in any cell without the tag raises CellExecutionError here.
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
        checks = [i for i, c in enumerate(nb.cells) if is_check(c)]
        assert checks, f"{path.name} has no check cells"
        code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        assert all(nb.cells[i].execution_count is not None for i in code_cells), "some cells never ran"
        for index in code_cells:
            cell = nb.cells[index]
            errors = [o for o in cell.outputs if o.output_type == "error"]
            if index in checks:
                assert RUN_ON_TAG in cell.metadata["tags"]
                assert len(errors) == 1 and errors[0].ename == "ExerciseNotDone", (index, cell.source, errors)
                assert "not done yet" in errors[0].evalue
                shown = ANSI.sub("", "\n".join(errors[0].traceback))
                frames = [Path(f).name for f in traceback_files(shown)]
                assert "not done yet" in shown and "core.py" not in frames, shown
            else:
                assert not errors, f"{path.name} cell {index} errors in the student version: {errors[0].ename}: {errors[0].evalue}"


one_class_per_notebook(OneNotebook, globals())

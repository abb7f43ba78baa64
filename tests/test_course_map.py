"""The course map lives once, in tfedu.course.course_map: notebook 00's map and the README's table are
generated from it, and this fails when either drifts, when a title differs from its notebook's header,
or when a notebook and the list disagree."""

import re
from pathlib import Path

import pytest

from tfedu.course import cli, course_map, nbtools

ROOT = Path(__file__).resolve().parents[1]


def test_every_notebook_has_one_chapter_and_every_chapter_a_notebook():
    files = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    listed = [c.filename for c in course_map.CHAPTERS]
    assert listed == files, "tfedu/course/course_map.py and notebooks/ disagree"
    assert [c.number for c in course_map.CHAPTERS] == [f"{i:02d}" for i in range(len(files))]


@pytest.mark.parametrize("chapter", course_map.CHAPTERS, ids=lambda c: c.number)
def test_titles_are_the_notebook_headers(chapter):
    first_line = nbtools.read(ROOT / "notebooks" / chapter.filename).cells[0].source.splitlines()[0]
    assert first_line == f"# {chapter.number} · {chapter.title}"


def test_notebook_00_shows_the_generated_map():
    nb = nbtools.read(ROOT / "notebooks" / course_map.MAP_NOTEBOOK)
    maps = [c.source for c in nb.cells if course_map.BEGIN in c.source]
    assert len(maps) == 1, "notebook 00 needs one markdown cell with the course-map markers"
    assert f"{course_map.BEGIN}\n{course_map.notebook_table()}\n{course_map.END}" in maps[0], \
        "notebook 00's map drifted from tfedu/course/course_map.py: run `tfedu clean`"


def test_the_readme_shows_the_generated_map():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"{course_map.BEGIN}\n{course_map.readme_table()}\n{course_map.END}" in readme, \
        "README.md's table drifted from tfedu/course/course_map.py: run `tfedu clean`"


def test_statuses_say_ready_only_for_notebooks_with_content():
    for chapter in course_map.CHAPTERS:
        nb = nbtools.read(ROOT / "notebooks" / chapter.filename)
        assert chapter.status != "ready" or sum(c.cell_type == "code" for c in nb.cells) >= 5, chapter.number


def test_clean_repairs_a_drifted_map(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    nb = nbtools.read(ROOT / "notebooks" / course_map.MAP_NOTEBOOK)
    for cell in nb.cells:
        cell.source = cell.source.replace("| ready |", "| coming |", 1)
    nbtools.write(nb, tmp_path / "notebooks" / course_map.MAP_NOTEBOOK)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (tmp_path / "README.md").write_text(readme.replace(course_map.CHAPTERS[3].builds, "something else"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["clean", "--check"]) == 1
    assert cli.main(["clean"]) == 0
    assert cli.main(["clean", "--check"]) == 0
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme
    fixed = nbtools.read(tmp_path / "notebooks" / course_map.MAP_NOTEBOOK)
    assert course_map.notebook_table() in "".join(c.source for c in fixed.cells)


def test_bad_entries_and_markers_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="status must be one of"):
        course_map.Chapter("99", "x", "X", "y", "soon")
    with pytest.raises(ValueError, match="one table cell"):
        course_map.Chapter("99", "x", "X", "a | b")
    with pytest.raises(ValueError, match="end marker"):
        course_map.replace_table(f"{course_map.BEGIN}\n| a |\n", "| b |")
    (tmp_path / "README.md").write_text("no map here\n")
    with pytest.raises(ValueError, match="no course-map markers"):
        course_map.sync_readme(tmp_path / "README.md")
    assert re.search(r"\| 15 \| \[Looking inside", course_map.readme_table())

"""Slides and the course site (tfedu.course.publish), and the slide metadata they read (tfedu.course.nbtools.slide_types).

Every notebook is rendered as a page and as a deck without executing it (seconds); two notebooks are
executed and their pages opened in headless Chromium (Playwright), which checks that the maths is
typeset, the images load and nothing but the network-only Colab badge fails. The browser test runs
wherever a Chromium is installed (``.ci/run`` installs one with apt-get) and says why it skips elsewhere.
"""

import os
import re
from pathlib import Path

import nbformat
import pytest

from tfedu.course import cli, course_map, nbtools, publish
from tfedu.course.grading.release import CODE_STUB
from tfedu.course.widgets import WIDGET_VIEW

from optional_parts import chromium_path, needs_chromium

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = ["00_start_here.ipynb", "04_attention.ipynb"]  # fast, and between them maths, plots and a widget
SCREENSHOTS = Path(os.environ.get("TFEDU_SCREENSHOTS", ROOT / "build" / "screenshots"))


# ---- slide metadata -------------------------------------------------------------------------------------


def small_notebook():
    return nbtools.new_notebook([
        nbtools.md("# 99 · Title\n\nintro"),
        nbtools.code('import sys\nif "google.colab" in sys.modules:\n    pass'),
        nbtools.md("## A section\n\nThe idea."),
        nbtools.md("More prose on the same slide."),
        nbtools.code("x = 2\nprint(x)"),
        nbtools.code("assert x == 2\nassert x > 1"),
        nbtools.md("Prose after shown code starts a sub-slide."),
        nbtools.md("### Exercise 99.1: double (easy, about 1 minute, 1 point)"),
        nbtools.exercise("ex_double", "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"),
        nbtools.check("check_double", "checks.check_double(double)"),
        nbtools.md("After the exercise."),
    ])


def test_slide_types_follow_the_structure():
    assert nbtools.slide_types(small_notebook().cells) == [
        "slide",  # the header
        "skip",  # set-up
        "slide",  # ## section
        "-",  # prose on the same slide
        "fragment",  # code that shows something
        "skip",  # only asserts
        "subslide",  # prose after shown code
        "subslide",  # ### heading
        "skip",  # solution
        "skip",  # check
        "-",  # the last shown cell was a heading, not code
    ]


@pytest.mark.parametrize("source, quiet", [
    ("assert a\nassert b", True),
    ("y = f(x)\nassert y\nassert y > 0\nassert y < 9", True),  # three asserts, nothing shown
    ("y = f(x)\nassert y", False),  # a computation with one assert: keep it
    ("assert a\nprint(a)", False),
    ("assert a\na", False),  # the last expression is displayed
    ("def f(:", False),  # not Python: keep
])
def test_quiet_assertion_cells(source, quiet):
    assert nbtools._quiet_assertions(source) is quiet


def test_hygiene_reports_slide_metadata_that_drifted():
    nb = small_notebook()
    nbtools.regenerate(nb, "99_title.ipynb")
    assert not [p for p in nbtools.hygiene_problems(nb, "99_title.ipynb") if "slide" in p]
    nb.cells[9].metadata["slideshow"] = {"slide_type": "fragment"}  # a check cell shown in the deck
    problems = [p for p in nbtools.hygiene_problems(nb, "99_title.ipynb") if "slide" in p]
    assert problems == ["cell 9: slide metadata must be {'slide_type': 'skip'} (run `tfedu clean`)"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_notebook_hides_solutions_and_checks_from_its_deck(path):
    nb = nbtools.read(path)
    kinds = [cell.metadata["slideshow"]["slide_type"] for cell in nb.cells]
    assert kinds[0] == "slide"
    for cell, kind in zip(nb.cells, kinds):
        meta = nbtools.nbgrader_meta(cell) or {}
        if meta.get("solution") or meta.get("grade"):
            assert kind == "skip"
    sections = [c for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## ")]
    assert kinds.count("slide") == 1 + len(sections)


# ---- rendering without execution: every notebook --------------------------------------------------------


@pytest.fixture(scope="module")
def unexecuted_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    site = publish.build_site(NOTEBOOKS, out, run=False)
    assert site.failures == []
    return out


def test_site_has_a_page_per_notebook_and_an_index(unexecuted_site):
    pages = sorted(p.name for p in unexecuted_site.glob("*.html"))
    assert pages == sorted([p.stem + ".html" for p in NOTEBOOKS] + ["index.html"])
    index = (unexecuted_site / "index.html").read_text(encoding="utf-8")
    for chapter in course_map.CHAPTERS:
        assert f'href="{chapter.number}_{chapter.name}.html"' in index


@pytest.mark.parametrize("i", range(len(NOTEBOOKS)), ids=lambda i: NOTEBOOKS[i].stem[:2])
def test_each_page_links_its_neighbours_and_loads_nothing_remote(unexecuted_site, i):
    page = (unexecuted_site / (NOTEBOOKS[i].stem + ".html")).read_text(encoding="utf-8")
    nav = page[page.index('class="tfedu-nav"'):page.index("</nav>")]
    if i > 0:
        assert f'href="{NOTEBOOKS[i - 1].stem}.html" rel="prev"' in nav
    if i + 1 < len(NOTEBOOKS):
        assert f'href="{NOTEBOOKS[i + 1].stem}.html" rel="next"' in nav
    assert 'class="tfedu-current"' in nav
    scripts = re.findall(r'<script[^>]*\bsrc="([^"]*)"', page)
    assert scripts == [f"{publish.MATHJAX_DIR}/MathJax.js?config={publish.MATHJAX_CONFIG}"]
    assert not re.findall(r'<link[^>]*href="https?:', page)
    assert nbtools.BEGIN_SOLUTION in page  # the source version shows its solutions


def test_mathjax_is_copied_with_our_config(unexecuted_site):
    mathjax = unexecuted_site / publish.MATHJAX_DIR
    assert (mathjax / "MathJax.js").is_file()
    assert (mathjax / "config" / "TeX-AMS-MML_HTMLorMML-full.js").is_file()
    assert (mathjax / "config" / "tfedu.js").read_text() == publish.MATHJAX_OURS


def test_student_site_hides_the_solutions(tmp_path):
    site = publish.build_site(NOTEBOOKS[:2], tmp_path, student=True, run=False)
    assert site.failures == []
    for page in site.pages:
        text = page.read_text(encoding="utf-8")
        assert nbtools.BEGIN_SOLUTION not in text
        assert "NotImplementedError" in text and CODE_STUB.splitlines()[0] in text
    assert "student version" in (tmp_path / "index.html").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def unexecuted_slides(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    decks = publish.build_slides(NOTEBOOKS, out, run=False)
    assert decks.failures == []
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_each_deck_has_its_slides_and_skips_solutions_and_checks(unexecuted_slides, path):
    deck = (unexecuted_slides / (path.stem + ".slides.html")).read_text(encoding="utf-8")
    nb = nbtools.read(path)
    kinds = [cell.metadata["slideshow"]["slide_type"] for cell in nb.cells]
    # nbconvert nests a <section> per slide and one per sub-slide inside it
    assert deck.count("<section") == 2 * kinds.count("slide") + kinds.count("subslide")
    assert deck.count('class="fragment"') >= kinds.count("fragment")
    assert nbtools.BEGIN_SOLUTION not in deck
    assert "checks.check_" not in deck
    assert "google.colab" not in deck
    assert f"config={publish.MATHJAX_CONFIG}" in deck
    assert publish.REVEAL_CDN in deck


# ---- widgets and errors ---------------------------------------------------------------------------------


def test_widgets_fall_back_to_their_still_picture():
    nb = nbtools.new_notebook([nbtools.code("w")])
    nb.cells[0].outputs = [
        nbformat.v4.new_output("display_data", data={WIDGET_VIEW: {"model_id": "a"}, "image/png": "iVBO",
                                                     "text/plain": "interactive figure"}),
        nbformat.v4.new_output("display_data", data={WIDGET_VIEW: {"model_id": "b"}, "text/plain": "IntSlider()"}),
    ]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {}}
    publish.static_outputs(nb)
    still, bare = (output.data for output in nb.cells[0].outputs)
    assert WIDGET_VIEW not in still and still["image/png"] == "iVBO"
    assert WIDGET_VIEW not in bare and bare["text/html"] == publish.WIDGET_NOTE
    assert "widgets" not in nb.metadata


def test_a_failing_cell_is_named_and_the_other_pages_are_written(tmp_path):
    bad = tmp_path / "98_bad.ipynb"
    nbtools.write(nbtools.new_notebook([nbtools.md("# 98 · Bad"), nbtools.code("1 / 0")]), bad)
    good = tmp_path / "99_good.ipynb"
    nbtools.write(nbtools.new_notebook([nbtools.md("# 99 · Good"), nbtools.code("print(6 * 7)")]), good)
    site = publish.build_site([bad, good], tmp_path / "site", jobs=2)  # two worker processes
    assert site.failures == ["98_bad.ipynb: cell 1 failed while executing: ZeroDivisionError: division by zero"]
    assert [p.name for p in site.pages] == ["99_good.html"]
    assert "42" in site.pages[0].read_text(encoding="utf-8")


def test_cli_errors_name_what_was_expected(tmp_path, capsys):
    assert cli.main(["site", str(tmp_path / "missing.ipynb"), "--out", str(tmp_path / "site")]) == 2
    assert "expected an existing .ipynb notebook" in capsys.readouterr().err
    text = tmp_path / "notes.ipynb"
    text.write_text("not json", encoding="utf-8")
    assert cli.main(["slides", str(text), "--out", str(tmp_path / "slides"), "--no-execute"]) == 1
    assert "notes.ipynb: not a readable notebook" in capsys.readouterr().err


# ---- executed pages, in a browser -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def executed_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("executed-site")
    paths = [ROOT / "notebooks" / name for name in EXECUTED]
    assert cli.main(["site", *map(str, paths), "--out", str(out)]) == 0
    return out


def test_executed_pages_carry_plots_and_printed_output(executed_site):
    start = (executed_site / "00_start_here.html").read_text(encoding="utf-8")
    assert "device: cpu" in start or "device: cuda" in start  # the set-up cell's print
    attention = (executed_site / "04_attention.html").read_text(encoding="utf-8")
    assert len(re.findall(r'<img[^>]*src="data:image/png;base64,', attention)) >= 3
    assert WIDGET_VIEW not in attention and "widget-state" not in attention


def test_executed_slides_for_the_first_notebook(tmp_path):
    assert cli.main(["slides", str(ROOT / "notebooks" / EXECUTED[0]), "--out", str(tmp_path)]) == 0
    deck = (tmp_path / "00_start_here.slides.html").read_text(encoding="utf-8")
    assert "device: cpu" not in deck  # the set-up cell is skipped, output and all
    assert 'class="fragment"' in deck


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("name", EXECUTED)
def test_pages_in_headless_chromium(executed_site, name):
    from playwright import sync_api  # in the test extra
    page_path = executed_site / (Path(name).stem + ".html")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path())
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors, failed = [], []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
            page.on("requestfailed", lambda request: failed.append(request.url))
            page.goto(page_path.as_uri())
            page.wait_for_function("() => window.MathJax && MathJax.Hub && MathJax.Hub.queue"
                                   " && MathJax.Hub.queue.pending === 0 && MathJax.Hub.queue.running === 0",
                                   timeout=60_000)
            typeset = page.evaluate("document.querySelectorAll('.MathJax').length")
            raw = page.evaluate(r"""Array.from(document.querySelectorAll('.jp-RenderedMarkdown'))
                .map(e => e.innerText).join('\n').match(/\$[^$\n]{1,80}\$/g) || []""")
            images = page.evaluate("Array.from(document.images).map(i => [i.src.slice(0, 50), i.complete && i.naturalWidth > 0])")
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / (Path(name).stem + ".png")))
        finally:
            browser.close()
    assert typeset > 0, "no maths was typeset"
    assert raw == [], f"maths left as raw text: {raw[:3]}"
    badge = "https://colab.research.google.com/assets/colab-badge.svg"
    broken = [src for src, ok in images if not ok and not src.startswith(badge[:50])]
    assert broken == [], f"images that did not load: {broken}"
    assert len([src for src, ok in images if ok]) >= (3 if name.startswith("04") else 0)
    assert set(failed) <= {badge}, f"requests that failed: {set(failed) - {badge}}"
    # The one console error allowed: the badge, which needs the network ("net::ERR_..."), one per failure.
    unexpected = [e for e in errors if not e.startswith("Failed to load resource: net::ERR_")]
    assert unexpected == [] and len(errors) <= len(failed), f"console errors: {errors}"

"""Lecture slides and the course website, rendered from the notebooks by nbconvert.

    tfedu slides NOTEBOOK... [--out slides/]            a reveal.js deck per notebook
    tfedu site [NOTEBOOK...] [--out site/] [--student]  static HTML pages with a navigation bar

Both execute each notebook first (``--no-execute`` renders it as it is), so the pages and decks carry
the plots and numbers a learner would see on a CPU. The deck is the notebook itself: the slide
metadata that ``tfedu clean`` writes (:func:`tfedu.course.nbtools.slide_types`) says which cells open a
slide and which are skipped, and RISE (``pip install jupyterlab-rise``) reads the same metadata to
present inside JupyterLab.

Why nbconvert rather than Jupyter Book or MyST: nbconvert is already how the course releases and
grades notebooks, its "lab" template is JupyterLab's own stylesheet (a page looks like the notebook
a learner opens), and it needs nothing beside the notebooks: the order and titles come from
``tfedu.course.course_map``, as in notebook 00 and the README. Jupyter Book 1 adds Sphinx and a table of
contents file that would repeat that map; Jupyter Book 2 (MyST) adds a Node.js build. A site is a
folder of plain HTML files that any static host, or a double click, can serve.

Offline: maths is typeset by a copy of MathJax 2.7 from the ``jupyter-server-mathjax`` package (in
the ``instructor`` extra), written next to the pages, so a site needs no network except for the
Colab badge image. Without that package the pages load MathJax from nbconvert's default CDN. A
deck typesets its maths the same way, but nbconvert's reveal.js template loads reveal.js, require.js
and jQuery from CDNs: it needs the network (``--reveal-prefix`` points at another copy of reveal.js 4).
To lecture offline, present the notebook with RISE in JupyterLab.
"""

from __future__ import annotations

import concurrent.futures
import copy
import html
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from tfedu import __version__
from tfedu.course import course_map, nbtools
from tfedu.course.grading.release import student_version
from tfedu.course.widgets import WIDGET_VIEW

TEMPLATES = Path(__file__).resolve().parent / "templates"
SITE_TEMPLATE = "tfedu_site"  # nbconvert's "lab" template with a navigation bar
SLIDES_TEMPLATE = "tfedu_slides"  # nbconvert's "reveal" template without mermaid.js
MATHJAX_DIR = "_static/mathjax"  # in the output folder, next to the pages
# A config jupyter-server-mathjax ships, then ours (written by copy_mathjax). The package carries only the
# STIX-Web fonts, so ours tells the HTML-CSS output to use them, gives the blank font MathJax measures
# against a local source (its url('about:blank') is a console error in Chromium) and drops the web
# fonts of the MathML output, which Chromium would fetch (and miss) for the hidden assistive MathML.
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe,tfedu"
MATHJAX_OURS = """\
MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null,
               styles: {"@font-face": {"font-family": "MathJax_Blank", src: "local('MathJax_Blank')"}}}
});
MathJax.Hub.Register.StartupHook("NativeMML Jax Config", function () {
  var styles = MathJax.OutputJax.NativeMML.config.styles;
  for (var key in styles) { if (key.indexOf("@font-face") === 0) { delete styles[key]; } }
});
MathJax.Ajax.loadComplete("[MathJax]/config/tfedu.js");
"""
REVEAL_CDN = "https://unpkg.com/reveal.js@4.0.2"  # nbconvert's default
CELL_TIMEOUT = 900  # seconds per cell; the slowest cell of the course takes about 30 s on 2 cores
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes in IPython's tracebacks
WIDGET_NOTE = ("<p><em>An interactive control: it works in a running notebook (JupyterLab, Colab), "
               "not on this static page.</em></p>")


class PublishError(RuntimeError):
    """A notebook could not be executed or rendered; the message names the notebook and the cell."""


def execute(nb: nbformat.NotebookNode, name: str, cwd: Path, timeout: int = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Run every cell of ``nb`` in a fresh python3 kernel started in ``cwd``; return the run copy.

    The widget state nbclient records is dropped later by :func:`static_outputs` (nbclient 0.10 cannot run
    without recording it: an Output widget then raises KeyError); the pages show each widget's still.
    Cells tagged ``raises-exception`` (a student version's check cells) may fail; any other failure
    raises :class:`PublishError` naming the cell.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = copy.deepcopy(nb)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(cwd)}})
    # The inline backend, whatever the caller's MPLBACKEND says (CI exports Agg, which would draw nothing).
    env = {**os.environ, "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    try:
        client.execute(env=env)
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        failed = next((i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and any(
            output.get("output_type") == "error" for output in cell.get("outputs", []))), None)
        where = f"cell {failed}" if failed is not None else "a cell"
        message = ANSI.sub("", str(err)).strip()
        summary = message.splitlines()[-1] if message else type(err).__name__
        raise PublishError(f"{name}: {where} failed while executing: {summary}") from None
    return nb


def static_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Replace each widget view in the outputs by its static fallback, in place.

    ``tfedu.course.widgets.interactive_figure`` outputs carry a still picture beside the widget view; that is
    what a page shows. A bare widget (a slider on its own) gets a note that it needs a running kernel.
    """
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW not in data:
                continue
            del data[WIDGET_VIEW]
            if not {"image/png", "image/svg+xml", "text/html"} & set(data):
                data["text/html"] = WIDGET_NOTE
    nb.metadata.pop("widgets", None)
    return nb


def load(path: Path, *, student: bool, run: bool, timeout: int = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Read a source notebook, take its student version if asked, execute it if asked; static outputs."""
    try:
        nb = nbtools.read(path)
    except Exception as err:  # nbformat raises several kinds for a file that is not a notebook
        raise PublishError(f"{path}: not a readable notebook ({type(err).__name__}: {err})") from None
    if student:
        nb = student_version(nb, path.name)
    if run:
        nb = execute(nb, path.name, path.resolve().parent, timeout)
    return static_outputs(nb)


def _load_job(args: tuple[Path, bool, bool, int]) -> nbformat.NotebookNode | PublishError:
    """``load`` for a worker process: a failure comes back as a value, so the other notebooks go on."""
    path, student, run, timeout = args
    try:
        return load(path, student=student, run=run, timeout=timeout)
    except PublishError as err:
        return err


def load_all(paths: list[Path], *, student: bool, run: bool, jobs: int, timeout: int = CELL_TIMEOUT):
    """``load`` every notebook, ``jobs`` at a time; yield ``(path, notebook or PublishError)`` in order."""
    work = [(path, student, run, timeout) for path in paths]
    if jobs <= 1 or len(paths) <= 1:
        yield from zip(paths, map(_load_job, work))
        return
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        yield from zip(paths, pool.map(_load_job, work))


def copy_mathjax(out: Path) -> str:
    """Put MathJax next to the pages and return the URL the pages load it from.

    The copy comes from the ``jupyter-server-mathjax`` package; without it, nbconvert's CDN URL.
    """
    try:
        import jupyter_server_mathjax
    except ModuleNotFoundError:
        from nbconvert.exporters import HTMLExporter

        print("note: jupyter-server-mathjax is not installed (pip install -e '.[instructor]'), so the pages "
              "load MathJax from a CDN and need the network for their maths", file=sys.stderr)
        return HTMLExporter().mathjax_url
    source = Path(jupyter_server_mathjax.__file__).resolve().parent / "static"
    target = out / MATHJAX_DIR
    if not (target / "MathJax.js").is_file():
        shutil.copytree(source, target, dirs_exist_ok=True)
    (target / "config" / "tfedu.js").write_text(MATHJAX_OURS, encoding="utf-8")
    return f"{MATHJAX_DIR}/MathJax.js?config={MATHJAX_CONFIG}"


def page_name(path: Path) -> str:
    return path.stem + ".html"


def chapter_label(path: Path) -> str:
    """``NN · Title`` from the course map, or the file name for a notebook outside it."""
    for chapter in course_map.CHAPTERS:
        if chapter.filename == path.name:
            return f"{chapter.number} · {chapter.title}"
    return path.stem


@dataclass
class Rendered:
    """What a site or slides build wrote (pages or decks), and the notebooks that failed."""

    out: Path
    pages: list[Path]
    failures: list[str]


def site_navigation(paths: list[Path], current: int | None, version_note: str) -> dict:
    """The navigation bar's content for page ``current`` (None: the index page)."""
    def link(i: int) -> dict:
        return {"href": page_name(paths[i]), "label": chapter_label(paths[i])}

    built = {path.name for path in paths}
    chapters = [{"label": f"{c.number} · {c.title}", "href": page_name(Path(c.filename)) if c.filename in built else None,
                 "current": current is not None and c.filename == paths[current].name} for c in course_map.CHAPTERS]
    known = {c.filename for c in course_map.CHAPTERS}
    chapters += [{"label": p.stem, "href": page_name(p), "current": current is not None and p == paths[current]}
                 for p in paths if p.name not in known]
    return {
        "course": "tfedu",
        "home": "index.html",
        "prev": link(current - 1) if current is not None and current > 0 else None,
        "next": link(current + 1) if current is not None and current + 1 < len(paths) else (
            link(0) if current is None and paths else None),
        "chapters": chapters,
        "version_note": version_note,
    }


def index_notebook(paths: list[Path], student: bool) -> nbformat.NotebookNode:
    """The site's front page, as a one-cell notebook rendered like the others: the course map."""
    built = {path.name for path in paths}
    rows = ["| # | Notebook | What you build |", "|---|---|---|"]
    for c in course_map.CHAPTERS:
        title = f"[{c.title}]({page_name(Path(c.filename))})" if c.filename in built else c.title
        rows.append(f"| {c.number} | {title} | {c.builds} |")
    which = ("the **student version**: exercises are left for you, and their checks show what a fresh "
             "notebook shows") if student else "the **source version**, with the solutions in place"
    text = (f"# tfedu: the Transformer, built by hand\n\n"
            f"{len(course_map.CHAPTERS)} notebooks build every part of the Transformer, from byte-pair encoding to "
            f"training on many processes. "
            f"These pages are {which}, executed on a CPU. To work the exercises, open a notebook in "
            f"JupyterLab or Colab ({html.escape(nbtools.REPO_URL)}).\n\n" + "\n".join(rows) + "\n")
    return nbtools.new_notebook([nbtools.md(text)])


def _render_each(paths: list[Path], out: Path, render, *, student: bool, run: bool, jobs: int,
                 timeout: int) -> Rendered:
    """Load every notebook (see :func:`load_all`) and write ``render(i, path, nb) -> (file name, html)``.

    A notebook that fails is reported and left out; the others are still written.
    """
    written, failures = [], []
    for i, (path, nb) in enumerate(load_all(paths, student=student, run=run, jobs=jobs, timeout=timeout)):
        if isinstance(nb, PublishError):
            failures.append(str(nb))
            print(f"failed  {nb}", file=sys.stderr)
            continue
        filename, body = render(i, path, nb)
        target = out / filename
        target.write_text(body, encoding="utf-8")
        written.append(target)
        print(f"wrote   {target}")
    return Rendered(out, written, failures)


def build_site(paths: list[Path], out: Path, *, student: bool = False, run: bool = True, jobs: int = 1,
               timeout: int = CELL_TIMEOUT) -> Rendered:
    """Render ``paths`` (in course order) and an index page into ``out``; see the module docstring."""
    from nbconvert.exporters import HTMLExporter

    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name=SITE_TEMPLATE, extra_template_basedirs=[str(TEMPLATES)],
                            mathjax_url=copy_mathjax(out))
    version = "student version (exercises left blank)" if student else "source version (with solutions)"
    note = f"tfedu {__version__}, {version}, executed on a CPU" if run else \
        f"tfedu {__version__}, {version}, not executed (no outputs)"

    def page(i, path, nb):
        body, _ = exporter.from_notebook_node(nb, resources={
            "metadata": {"name": chapter_label(path)}, "tfedu_nav": site_navigation(paths, i, note)})
        return page_name(path), body

    site = _render_each(paths, out, page, student=student, run=run, jobs=jobs, timeout=timeout)
    body, _ = exporter.from_notebook_node(index_notebook(paths, student), resources={
        "metadata": {"name": "tfedu: the Transformer, built by hand"}, "tfedu_nav": site_navigation(paths, None, note)})
    (out / "index.html").write_text(body, encoding="utf-8")
    print(f"wrote   {out / 'index.html'}")
    return site


def build_slides(paths: list[Path], out: Path, *, run: bool = True, reveal_prefix: str = REVEAL_CDN,
                 jobs: int = 1, timeout: int = CELL_TIMEOUT) -> Rendered:
    """Write ``NN_name.slides.html``, a reveal.js deck, for each notebook in ``paths`` into ``out``."""
    from nbconvert.exporters import SlidesExporter

    out.mkdir(parents=True, exist_ok=True)
    exporter = SlidesExporter(template_name=SLIDES_TEMPLATE, extra_template_basedirs=[str(TEMPLATES)],
                              reveal_url_prefix=reveal_prefix, reveal_scroll=True, reveal_theme="simple",
                              reveal_transition="none", mathjax_url=copy_mathjax(out),
                              exclude_input_prompt=True, exclude_output_prompt=True)

    def deck(i, path, nb):
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": chapter_label(path)}})
        return path.stem + ".slides.html", body

    return _render_each(paths, out, deck, student=False, run=run, jobs=jobs, timeout=timeout)


def course_order(names: list[str]) -> list[Path]:
    """The notebooks to publish: those named, or every notebook in notebooks/, in file-name order."""
    paths = [Path(name) for name in names] or sorted(Path("notebooks").glob("*.ipynb"))
    if not paths:
        raise PublishError("no notebooks found: name them, or run this in the course folder (notebooks/*.ipynb)")
    for path in paths:
        if path.suffix != ".ipynb" or not path.is_file():
            raise PublishError(f"{path}: expected an existing .ipynb notebook")
    return sorted(paths, key=lambda p: p.name)


def _run(args, build) -> int:
    try:
        result = build(course_order(args.notebooks), Path(args.out))
    except PublishError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result.failures:
        print(f"\n{len(result.failures)} notebook(s) failed:", *result.failures, sep="\n- ", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    p_slides = sub.add_parser("slides", help="write a reveal.js slide deck for each notebook (nbconvert)")
    p_slides.add_argument("notebooks", nargs="+", help="source notebooks (.ipynb)")
    p_slides.add_argument("--out", default="slides", help="folder for the decks (default: slides/)")
    p_slides.add_argument("--reveal-prefix", default=REVEAL_CDN,
                          help=f"where the deck loads reveal.js 4 from (default: {REVEAL_CDN})")
    p_site = sub.add_parser("site", help="render the notebooks to a static website with a navigation bar (nbconvert)")
    p_site.add_argument("notebooks", nargs="*", help="default: every notebook in notebooks/")
    p_site.add_argument("--out", default="site", help="folder for the pages (default: site/)")
    p_site.add_argument("--student", action="store_true", help="render the student versions (exercises left blank)")
    for p in (p_slides, p_site):
        p.add_argument("--no-execute", action="store_true", help="render the notebooks as they are, without running them")
        p.add_argument("--jobs", type=int, default=1, help="notebooks executed at once (default 1)")
        p.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help=f"seconds per cell (default {CELL_TIMEOUT})")
    p_slides.set_defaults(func=lambda a: _run(a, lambda paths, out: build_slides(
        paths, out, run=not a.no_execute, reveal_prefix=a.reveal_prefix, jobs=a.jobs, timeout=a.timeout)))
    p_site.set_defaults(func=lambda a: _run(a, lambda paths, out: build_site(
        paths, out, student=a.student, run=not a.no_execute, jobs=a.jobs, timeout=a.timeout)))

"""Each notebook as Colab sees it: the badge opens this repository's copy of the file, and the set-up
cell, run with a simulated ``google.colab`` module, installs tfedu from the repository named once in
pyproject.toml (``[project.urls] Repository``); run locally, it installs nothing."""

import sys
import tomllib
import types
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager
from packaging.requirements import Requirement

from tfedu.course import nbtools

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def repository() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


class FakeShell:
    """Stands in for IPython: records the line magics a cell runs instead of running them."""

    def __init__(self):
        self.magics = []

    def run_line_magic(self, name, line):
        self.magics.append((name, line))


def run_setup_cell(path: Path, *, on_colab: bool) -> list[tuple[str, str]]:
    nb = nbtools.read(path)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "google.colab" in c.source)
    python = TransformerManager().transform_cell(cell.source)  # %pip -> get_ipython().run_line_magic(...)
    shell = FakeShell()
    saved = {name: sys.modules.get(name) for name in ("google", "google.colab")}
    try:
        if on_colab:
            google = types.ModuleType("google")
            google.colab = types.ModuleType("google.colab")
            sys.modules["google"], sys.modules["google.colab"] = google, google.colab
        else:
            sys.modules.pop("google.colab", None)
        exec(compile(python, f"{path.name}: set-up cell", "exec"), {"get_ipython": lambda: shell})
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return shell.magics


def test_the_url_lives_in_pyproject_and_nbtools_reads_it():
    url = repository()
    assert url.startswith("https://github.com/") and nbtools.repository_url() == nbtools.REPO_URL == url
    owner_name = url.removeprefix("https://github.com/")
    assert nbtools.COLAB_URL == f"https://colab.research.google.com/github/{owner_name}/blob/main/notebooks/{{name}}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_setup_cell_installs_from_the_repository_on_colab_only(path):
    magics = run_setup_cell(path, on_colab=True)
    assert len(magics) == 1 and magics[0][0] == "pip", magics
    args = magics[0][1].split(maxsplit=2)
    assert args[:2] == ["install", "--quiet"]
    requirement = Requirement(args[2].strip('"'))
    assert requirement.name == "tfedu" and requirement.url == f"git+{repository()}"
    assert run_setup_cell(path, on_colab=False) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_badge_opens_this_file_in_this_repository(path):
    header = nbtools.read(path).cells[0].source
    owner_name = repository().removeprefix("https://github.com/")
    assert (f"(https://colab.research.google.com/github/{owner_name}/blob/main/notebooks/{path.name})" in header)


def test_clean_regenerates_the_badge_and_the_install_line(tmp_path, monkeypatch):
    """A notebook with an old address is rewritten by ``tfedu clean`` from the one in pyproject.toml."""
    from tfedu.course import cli

    source = nbtools.read(NOTEBOOKS[1])
    old = "https://github.com/someone-else/old-name"
    for cell in source.cells[:3]:
        cell.source = cell.source.replace(nbtools.REPO_URL, old).replace(
            nbtools.COLAB_URL.format(name=NOTEBOOKS[1].name), f"https://colab.research.google.com/github/x/y/blob/main/notebooks/{NOTEBOOKS[1].name}")
    copy = tmp_path / NOTEBOOKS[1].name
    nbtools.write(source, copy)
    assert old in copy.read_text()
    assert cli.main(["clean", "--check", str(copy)]) == 1
    assert cli.main(["clean", str(copy)]) == 0
    assert old not in copy.read_text() and "github/x/y" not in copy.read_text()
    assert run_setup_cell(copy, on_colab=True) == run_setup_cell(NOTEBOOKS[1], on_colab=True)


def test_the_installed_metadata_carries_the_same_url():
    """What a wheel (Colab's install) reads when there is no pyproject.toml beside the package."""
    from importlib.metadata import metadata

    assert f"Repository, {repository()}" in (metadata("tfedu").get_all("Project-URL") or [])

"""pyproject.toml and environment.yml must install the same things."""

import re
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def names(requirements):
    return {re.split(r"[<>=!~ \[]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["test"])
    lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_section = [l.strip()[2:] for l in lines if l.startswith("      - ") and not l.strip().startswith("- -e")]
    assert names(pip_section) == names(wanted)
    assert {r.replace(" ", "") for r in pip_section} == {r.replace(" ", "") for r in wanted}, "version bounds differ"


def test_ci_installs_the_cpu_torch_pin_before_the_project():
    script = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script
    assert script.index("torch==2.13.0") < script.index('-e ".[test')


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    command = "python3 -m pytest"
    assert command in readme and command in (ROOT / ".ci" / "run").read_text()


def test_every_tfedu_package_is_listed_and_the_course_gpt_ships_in_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tfedu").rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders | {"tfedu.shipped"}
    assert setuptools["package-dir"]["tfedu.shipped"] == "data"
    assert setuptools["package-data"]["tfedu.shipped"] == ["course-gpt/*", "induction-gpt/*"]
    assert (ROOT / "data" / "course-gpt" / "model.safetensors").is_file()
    assert (ROOT / "data" / "induction-gpt" / "model.safetensors").is_file()
    # tfedu.publish's nbconvert templates (the course site and the slides) ship inside the package
    assert setuptools["package-data"]["tfedu"] == ["templates/*/*"]
    for template in ("tfedu_site", "tfedu_slides"):
        assert {p.name for p in (ROOT / "tfedu" / "templates" / template).iterdir()} == {"conf.json", "index.html.j2"}

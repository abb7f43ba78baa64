"""pyproject.toml, environment.yml, constraints.txt, the README and .ci/run must agree on what is installed."""

import importlib.util
import re
import tomllib
from pathlib import Path

from tfedu import cli

ROOT = Path(__file__).resolve().parent.parent


def names(requirements):
    return {re.split(r"[<>=!~ \[]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def expanded(project, extra):
    """The requirements of ``extra``, with the project's own extras it names (``tfedu[instructor]``) spelled out."""
    found = set()
    for requirement in project["optional-dependencies"][extra]:
        own = re.fullmatch(r"tfedu\[([a-z,]+)\]", requirement.replace(" ", ""))
        found |= set().union(*(expanded(project, e) for e in own.group(1).split(","))) if own else {requirement}
    return found


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | expanded(project, "test")
    lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_section = [l.strip()[2:] for l in lines if l.startswith("      - ") and not l.strip().startswith("- -e")]
    assert names(pip_section) == names(wanted)
    assert {r.replace(" ", "") for r in pip_section} == {r.replace(" ", "") for r in wanted}, "version bounds differ"


def test_ci_installs_the_cpu_torch_pin_before_the_project():
    script = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script
    assert script.index("torch==2.13.0") < script.index('-e ".[test')


def readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Run every test[^\n]*\n\n```bash\n(.+?)\n```", readme, re.DOTALL)
    assert block, "the README has no 'Run every test' command"
    [command] = block.group(1).splitlines()
    return command


def test_readme_test_command_is_what_ci_runs():
    command = readme_test_command()
    assert "-c constraints.txt" in command and command.endswith("python3 -m pytest")
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in lines, f"{command!r} is not a line of .ci/run"
    assert lines[-1] == command, "the test command is .ci/run's last step"
    assert 'TFEDU_REQUIRE="bwrap chromium"' in (ROOT / ".ci" / "run").read_text()


def load_pins():
    spec = importlib.util.spec_from_file_location("pins", ROOT / ".ci" / "pins.py")
    pins = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pins)
    return pins


def floors(requirements):
    matches = (load_pins().FLOOR.match(requirement) for requirement in requirements)
    return {match["name"]: match["version"] for match in matches if match}


def test_every_declared_floor_is_the_version_the_suite_last_passed_with():
    """A floor is a promise that the course works there; the suite only runs the pinned versions (and the
    newest, in .ci/newest), so each floor is the pinned version: .ci/pins.py raises them together."""
    pins = load_pins()
    pinned = cli.read_pins(ROOT / "constraints.txt")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = floors(project["dependencies"])
    for extra in project["optional-dependencies"]:
        declared |= floors(project["optional-dependencies"][extra])
    assert declared, "no floors found"
    wrong = {name: (floor, pinned.get(cli.canonical_name(name))) for name, floor in declared.items()
             if pinned.get(cli.canonical_name(name)) != floor}
    assert not wrong, f"floor vs pinned version (run `bash .ci/newest`, or .ci/pins.py write): {wrong}"
    assert project["requires-python"] == f">={pins.tested_python(ROOT / 'constraints.txt')}"


def test_raise_floors_rewrites_only_pinned_floors():
    pins = load_pins()
    text = 'deps = ["torch>=2.2", "Beartype >= 0.18", "triton>=3.2; platform_system == \'Linux\'", "tfedu[instructor]", "other>=1"]'
    assert pins.raise_floors(text, {"torch": "2.13.0", "beartype": "0.23.1", "triton": "3.9.0"}) == (
        'deps = ["torch>=2.13.0", "Beartype>=0.23.1", "triton>=3.9.0; platform_system == \'Linux\'", "tfedu[instructor]", "other>=1"]')


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

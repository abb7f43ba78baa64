"""pyproject.toml, environment.yml, constraints.txt, the README and .ci/run must agree on what is installed."""

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from tfedu.course import cli

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
    assert setuptools["package-data"]["tfedu.shipped"] == ["course-gpt/*", "induction-gpt/*", "course-chat/*", "course-draft/*",
                                                          "rivals/*", "corpus/*", "capstone/*"]
    assert (ROOT / "data" / "capstone" / "seeds.json").is_file()  # notebook 08's capstone reads it
    assert (ROOT / "data" / "corpus" / "pydoc_topics.json.gz").is_file()
    assert (ROOT / "data" / "course-gpt" / "model.safetensors").is_file()
    assert (ROOT / "data" / "induction-gpt" / "model.safetensors").is_file()
    assert (ROOT / "data" / "course-chat" / "model.safetensors").is_file()  # notebook 17 starts from it
    assert (ROOT / "data" / "course-draft" / "model.safetensors").is_file()  # notebook 18's draft model
    assert {p.name for p in (ROOT / "data" / "rivals").iterdir()} == {"recall.json", "lm.json"}  # notebook 19's sweeps
    # tfedu.course.publish's nbconvert templates (the course site and the slides) ship inside the package
    assert setuptools["package-data"]["tfedu.course"] == ["templates/*/*", "solutions.json"]  # tfedu.solution's
    assert (ROOT / "tfedu" / "course" / "solutions.json").is_file()
    for template in ("tfedu_site", "tfedu_slides"):
        assert {p.name for p in (ROOT / "tfedu" / "course" / "templates" / template).iterdir()} == {"conf.json", "index.html.j2"}


# ----------------------------------------------------------------------------- the layers (CONTRIBUTING.md)

LAYER_PACKAGES = {"course", "checks", "experiments"}  # above the reference library, in that order


def importlinter_contracts():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_top_of_tfedu_is_the_reference_library_and_three_packages_above_it():
    top = ROOT / "tfedu"
    packages = {p.name for p in top.iterdir() if (p / "__init__.py").is_file()}
    assert packages == LAYER_PACKAGES | {"kernels"}, packages
    [layers] = [c for c in importlinter_contracts() if c["type"] == "layers"]
    assert layers["layers"] == ["tfedu.course", "tfedu.checks", "tfedu.experiments"]


def test_the_reference_contract_names_every_reference_module():
    """A new module at the top of tfedu/ is reference library: the forbidden contract must cover it."""
    [forbidden] = [c for c in importlinter_contracts() if c["type"] == "forbidden"]
    top = ROOT / "tfedu"
    reference = {f"tfedu.{p.stem}" for p in top.glob("*.py") if p.stem != "__init__"} | {"tfedu.kernels"}
    assert set(forbidden["source_modules"]) == reference
    assert set(forbidden["forbidden_modules"]) == {f"tfedu.{name}" for name in LAYER_PACKAGES}


def lint_imports_on_a_copy(tmp_path, module, line):
    """Run lint-imports on a copy of tfedu/ with ``line`` added to the end of ``module``."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROOT / "tfedu", tmp_path / "tfedu", ignore=shutil.ignore_patterns("__pycache__", "shipped"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "tfedu" / module
    target.write_text(target.read_text() + f"\n\n{line}\n")
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", str(tmp_path / "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)


def test_lint_imports_fails_when_the_reference_library_imports_a_checker(tmp_path):
    done = lint_imports_on_a_copy(tmp_path, "attention.py", "def _later():\n    from tfedu.checks import core  # noqa")
    assert done.returncode != 0, done.stdout
    assert "tfedu.attention -> tfedu.checks.core" in done.stdout
    assert "BROKEN" in done.stdout


def test_lint_imports_fails_on_an_import_cycle_hidden_in_a_function(tmp_path):
    done = lint_imports_on_a_copy(tmp_path, "activations.py", "def _later():\n    from tfedu import layers  # noqa")
    assert done.returncode != 0, done.stdout
    assert "No import cycle anywhere in tfedu" in done.stdout and "BROKEN" in done.stdout


def test_every_pin_installs_on_the_oldest_python_the_project_supports_or_says_where_it_holds():
    """soupsieve 4.1.3 needs Python 3.11.5, and on Debian 12's Python 3.11.2 the README's install failed with
    ResolutionImpossible. A pin whose release needs a newer Python than requires-python's floor carries a
    marker (.ci/pins.py writes it), so elsewhere pip picks a release that installs."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"].removeprefix(">=")
    oldest = floor + ".0" * (2 - floor.count("."))
    unmarked = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or ";" in line:
            continue
        name, _, version = line.partition("==")
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        needs = dist.metadata.get("Requires-Python")
        if dist.version.split("+")[0] == version and needs and not SpecifierSet(needs).contains(oldest):
            unmarked.append(f"{name}=={version} needs Python {needs}")
    assert not unmarked, f"pins that cannot install on Python {oldest} and carry no marker: {unmarked}"


def test_read_pins_leaves_out_a_pin_whose_marker_is_false_here(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text('# header\nsoupsieve==4.1.3 ; python_full_version >= "3.0.1"\n'
                           'old-thing==1.0 ; python_version < "3.0"\nNumPy==2.4.6\n')
    assert cli.read_pins(constraints) == {"soupsieve": "4.1.3", "numpy": "2.4.6"}
    constraints.write_text("x==1 ; python_version >>> '3'\n")
    with pytest.raises(ValueError, match="not PEP 508"):
        cli.read_pins(constraints)

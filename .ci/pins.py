"""Record a green run's exact versions: constraints.txt, and the floors in pyproject.toml and environment.yml.

    python .ci/pins.py write    # run by .ci/newest with the fresh environment's Python, after the suite passed

constraints.txt is `pip freeze` of the environment that ran the suite (the project itself left out),
with local version labels dropped (torch 2.13.0+cpu is pinned as 2.13.0: the same release from any
index), and a Python marker on a pin whose release needs a newer Python than the oldest the project
supports (requires-python's major.minor, patch 0): there pip picks a release that installs. Every `>=`
floor of a dependency named in pyproject.toml and environment.yml is then raised to the version that ran:
a floor says the oldest release the suite passed with, and this suite only ever runs the pinned one.
tests/test_packaging.py checks both files against constraints.txt.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfedu, whichever one is installed
from tfedu.course.cli import canonical_name  # noqa: E402  the same names as `tfedu doctor`'s comparison
HEADER = """\
# The exact versions of the last green run of the suite, written by `bash .ci/newest` (.ci/pins.py).
# Install with them: pip install -c constraints.txt -e ".[test]"   (`tfedu doctor` names what differs)
# Python {python}
"""
PYTHON = re.compile(r"^# Python (\d+)\.(\d+)", re.MULTILINE)
FLOOR = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<extras>\[[^\]]*\])?\s*>=\s*(?P<version>[0-9][^,;\"'\s]*)")


def frozen() -> dict[str, str]:
    """name -> version of every package in this Python's environment but the editable project."""
    lines = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                           capture_output=True, text=True).stdout.splitlines()
    pins = {}
    for line in lines:
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"pip freeze gave {line!r}, not name==version: install from an index, then run again")
        pins[name] = version.split("+", 1)[0]
    return pins


def tested_python(path: Path = ROOT / "constraints.txt") -> str:
    """The Python (major.minor) of the green run that wrote ``path``."""
    match = PYTHON.search(path.read_text())
    if match is None:
        raise ValueError(f"{path} does not say which Python ran the suite (a '# Python X.Y.Z' line)")
    return f"{match[1]}.{match[2]}"


def raise_floors(text: str, pins: dict[str, str]) -> str:
    """``text`` with each ``name>=X`` of a pinned package rewritten as ``name>=<pinned version>`` (``python``
    is pinned as its major.minor)."""
    def floor(match: re.Match) -> str:
        version = pins.get(canonical_name(match["name"]))
        if version is None:
            return match[0]
        return f"{match['name']}{match['extras'] or ''}>={version}"

    return FLOOR.sub(floor, text)


def python_marker(name: str, oldest: str) -> str:
    """`` ; python_full_version ...`` when the installed ``name`` needs a newer Python than ``oldest`` (the
    oldest the project supports), else "". Such a pin holds only where its Python does: elsewhere pip picks
    a release that installs (soupsieve 4.1.3 needs 3.11.5; Debian 12's Python is 3.11.2)."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    needs = metadata.distribution(name).metadata.get("Requires-Python")
    if not needs or SpecifierSet(needs).contains(oldest):
        return ""
    return " ; " + " and ".join(f'python_full_version {s.operator} "{s.version}"' for s in SpecifierSet(needs))


def write() -> None:
    pins = frozen()
    python = ".".join(map(str, sys.version_info[:3]))
    oldest = ".".join(map(str, sys.version_info[:2])) + ".0"  # requires-python below: >= this major.minor
    lines = "".join(f"{n}=={v}{python_marker(n, oldest)}\n" for n, v in sorted(pins.items(), key=lambda p: canonical_name(p[0])))
    (ROOT / "constraints.txt").write_text(HEADER.format(python=python) + lines)
    canonical_pins = {canonical_name(n): v for n, v in pins.items()} | {"python": python.rsplit(".", 1)[0]}
    pyproject = (ROOT / "pyproject.toml").read_text()
    head, sep, rest = pyproject.partition("[project]")  # the build system's own floor (setuptools) stays
    rest = re.sub(r'requires-python = ">=[0-9.]+"', f'requires-python = ">={canonical_pins["python"]}"', rest)
    (ROOT / "pyproject.toml").write_text(head + sep + raise_floors(rest, canonical_pins))
    environment = (ROOT / "environment.yml").read_text()
    (ROOT / "environment.yml").write_text(raise_floors(environment, canonical_pins))
    print(f"wrote constraints.txt ({len(pins)} packages) and raised the floors in pyproject.toml and environment.yml")


if __name__ == "__main__":
    if sys.argv[1:] != ["write"]:
        raise SystemExit(__doc__)
    write()

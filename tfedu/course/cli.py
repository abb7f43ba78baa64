"""The ``tfedu`` command line for learners and instructors.

    tfedu doctor              is everything the course needs installed and working?
    tfedu clean NOTEBOOK...   strip outputs and widget state; regenerate badges, install lines, course maps
    tfedu release ... / tfedu grade ...   student versions and autograding (tfedu.course.grading)
    tfedu bench NAME          speed measured against named peers (tfedu.course.bench)
    tfedu train --preset course-gpt   train the course GPT shipped in data/course-gpt (tfedu.train)
    tfedu slides NOTEBOOK... / tfedu site     reveal.js decks and a static course website (tfedu.course.publish)
"""

from __future__ import annotations

import argparse
import importlib
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

# Packages the course cannot run without, and ones that only unlock extras.
REQUIRED = ("torch", "numpy", "jupyterlab", "ipywidgets", "matplotlib", "einops", "regex", "jaxtyping", "nbformat")
OPTIONAL = ("triton", "tiktoken", "tokenizers", "nbgrader")


def package_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def doctor() -> int:
    """Print versions, the device and the corpus status; return 1 if something required is missing."""
    failures = []
    print(f"python      {platform.python_version()} ({sys.executable})")
    if sys.version_info < (3, 11):
        failures.append("Python 3.11 or newer is required")
    for dist in REQUIRED:
        version = package_version(dist)
        print(f"{dist:<11} {version or 'MISSING'}")
        if version is None:
            failures.append(f"{dist} is not installed: run `pip install -e .` in the course folder")
    for dist in OPTIONAL:
        print(f"{dist:<11} {package_version(dist) or 'not installed (optional)'}")
    try:
        import torch

        import tfedu

        dev = tfedu.device()
        print(f"device      {dev}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
        print(f"gpu         {'yes' if torch.cuda.is_available() else 'no (the course runs on CPU; GPU-only cells are skipped)'}")
    except Exception as err:  # report, do not crash: doctor exists to diagnose
        failures.append(f"torch/device check failed: {err}")
    print(f"triton      {triton_status()}")
    try:  # only `tfedu grade` needs it; the course itself does not
        from tfedu.course.grading import sandbox

        print(f"sandbox     {sandbox.find().describe()}")
    except sandbox.SandboxUnavailable as err:
        print(f"sandbox     none ({err.why}): `tfedu grade` needs bubblewrap, or --no-sandbox (optional)")
    print(f"pins        {pin_report(CONSTRAINTS)}")
    try:
        from tfedu.data import load_corpus

        text = load_corpus()
        print(f"corpus      pydoc: {len(text):,} characters")
    except Exception as err:
        failures.append(f"the default corpus does not load: {err}")
    if failures:
        print("\nProblems:", *failures, sep="\n- ", file=sys.stderr)
        return 1
    print("\nAll good: open notebooks/00_start_here.ipynb")
    return 0


CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"  # in a checkout: the last green run's versions


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(constraints: Path) -> dict[str, str]:
    """Canonical name -> version of a constraints file's ``name==version`` lines (comments ignored) that
    apply to this Python: a line may end in a PEP 508 marker (``soupsieve==4.1.3 ; python_full_version >=
    "3.11.5"``), and where the marker is false pip leaves the package free, so it is left out here too."""
    from packaging.markers import InvalidMarker, Marker

    pins = {}
    for line in constraints.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement, _, marker = line.partition(";")
            name, sep, version = requirement.partition("==")
            if not sep:
                raise ValueError(f"{constraints}: expected name==version lines, got {line!r}")
            try:
                if marker.strip() and not Marker(marker.strip()).evaluate():
                    continue
            except InvalidMarker as err:
                raise ValueError(f"{constraints}: the marker of {line!r} is not PEP 508: {err}") from None
            pins[canonical_name(name.strip())] = version.strip()
    return pins


def pin_differences(constraints: Path) -> tuple[list[str], list[str], int]:
    """Installed packages whose version differs from ``constraints`` (``name==version`` lines), pinned
    packages that are not installed, and the number pinned. Local labels are ignored (2.13.0+cpu is 2.13.0)."""
    pins = read_pins(constraints)
    installed = {canonical_name(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    differ = [f"{name} {installed[name]} (pinned {version})" for name, version in sorted(pins.items())
              if name in installed and installed[name].split("+", 1)[0] != version.split("+", 1)[0]]
    missing = [name for name in sorted(pins) if name not in installed]
    return differ, missing, len(pins)


def pin_report(constraints: Path) -> str:
    """One line for ``tfedu doctor``: which installed packages differ from the last green run's."""
    if not constraints.is_file():
        return "no constraints.txt here (it is in a checkout of the course); versions not compared"
    try:
        differ, missing, count = pin_differences(constraints)
    except (OSError, ValueError) as err:
        return f"could not read {constraints.name}: {err}"
    if not differ and not missing:
        return f"all {count} packages of {constraints.name} installed at its versions (the last green run's)"
    parts = []
    if differ:
        parts.append(f"{len(differ)} differ from {constraints.name}: " + ", ".join(differ))
    if missing:
        parts.append(f"{len(missing)} pinned but not installed: " + ", ".join(missing))
    return "; ".join(parts) + f" (pip install -c {constraints.name} -e \".[test]\" installs the tested set)"


def triton_status() -> str:
    """Whether the Triton kernel (tfedu.kernels) runs here: on the GPU, in the CPU interpreter, or not at all.

    Runs one tiny ``flash_attention`` call and compares it with torch's SDPA (in the interpreter about
    0.1 s; on a GPU the first call compiles the kernel, a few seconds, cached on disk after that).
    """
    if not package_version("triton"):
        return "not installed (optional: `pip install triton` on Linux, for the kernels of notebook 09)"
    try:
        import torch
        import torch.nn.functional as F

        import tfedu.kernels as kernels  # before triton itself: it may switch on the interpreter

        ok, how = kernels.available()
        if not ok:
            return f"not usable: {how}"
        device, dtype = ("cpu", torch.float32) if kernels.INTERPRETED else ("cuda", torch.float16)
        q, k, v = torch.randn(3, 1, 2, 40, 16, generator=torch.Generator().manual_seed(0)).to(device, dtype).unbind(0)
        error = (kernels.flash_attention(q, k, v, causal=True) - F.scaled_dot_product_attention(q, k, v, is_causal=True))
        error = error.abs().max().item()
    except Exception as err:  # report, do not crash: doctor exists to diagnose
        return f"fails: {type(err).__name__}: {err}"
    if not error < 1e-2:
        return f"runs but disagrees with torch's SDPA by {error:.1e}: please report this"
    if kernels.INTERPRETED:
        return "CPU interpreter only (slow; for reading and small inputs); flash_attention agrees with SDPA"
    return "usable on GPU; flash_attention agrees with SDPA"


def clean(paths: list[str], check_only: bool) -> int:
    """Strip notebooks and write their generated parts again, in place (with --check, only report).

    Generated: the Colab badge and install line (from ``[project.urls]``), notebook 00's course map
    and, when no notebook is named (the whole course), the README's map (from ``tfedu.course.course_map``)
    and the reference solutions that ``tfedu.solution`` shows (``tfedu/course/solutions.json``).
    """
    import nbformat

    from tfedu.course import course_map, hints, nbtools

    targets = [Path(p) for p in paths] or sorted(Path("notebooks").glob("*.ipynb"))
    dirty = 0
    for path in targets:
        if not path.exists() or path.suffix != ".ipynb":
            print(f"{path}: not an .ipynb file", file=sys.stderr)
            return 2
        before = path.read_text(encoding="utf-8")
        nb = nbtools.regenerate(nbtools.strip(nbtools.read(path)), path.name)
        after = nbformat.writes(nb) + "\n"
        if after != before:
            dirty += 1
            print(f"{'would clean' if check_only else 'cleaned'} {path}")
            if not check_only:
                path.write_text(after, encoding="utf-8")
    solutions = hints.SOLUTIONS
    if not paths and solutions.parent.resolve() == (Path("tfedu") / "course").resolve():  # a checkout's root
        text = hints.solutions_json(targets)
        if not solutions.is_file() or solutions.read_text(encoding="utf-8") != text:
            dirty += 1
            print(f"{'would regenerate' if check_only else 'regenerated'} {solutions}")
            if not check_only:
                solutions.write_text(text, encoding="utf-8")
    readme = Path("README.md")
    if not paths and readme.is_file() and course_map.sync_readme(readme, check_only=check_only):
        dirty += 1
        print(f"{'would regenerate' if check_only else 'regenerated'} the course map in {readme}")
    return 1 if check_only and dirty else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfedu", description="The tfedu course command line.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check the installation, device and corpus")
    p_clean = sub.add_parser("clean", help="strip outputs and widget state from notebooks; regenerate the Colab "
                             "badges and install lines and the course maps (notebook 00, README)")
    p_clean.add_argument("notebooks", nargs="*", help="default: every notebook in notebooks/")
    p_clean.add_argument("--check", action="store_true", help="only report; exit 1 if any would change")
    # Further subcommands register themselves here, one line each.
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_parser(sub)
    return parser


# Modules with `add_parser(subparsers)`; each sets `func=callable(args) -> int` on its parser.
SUBCOMMAND_MODULES: tuple[str, ...] = ("tfedu.course.grading.cli", "tfedu.course.bench.cli", "tfedu.course.train_cli", "tfedu.course.publish")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor()
    if args.command == "clean":
        return clean(args.notebooks, args.check)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""``tfedu release`` and ``tfedu grade``, registered in :data:`tfedu.course.cli.SUBCOMMAND_MODULES`.

    tfedu release notebooks/04_attention.ipynb --out release/
    tfedu grade submissions/*.ipynb --out results.json --jobs 2 --timeout 600 --cell-timeout 120
"""

from __future__ import annotations

import argparse
import sys


def _release(args: argparse.Namespace) -> int:
    from tfedu.course.grading.release import ReleaseError, release

    try:
        for path in release(args.notebooks, args.out):
            print(f"released {path}")
    except ReleaseError as err:
        print(f"tfedu release: {err}", file=sys.stderr)
        return 2
    return 0


def _grade(args: argparse.Namespace) -> int:
    from tfedu.course.grading import sandbox
    from tfedu.course.grading.grade import ConfigError, Limits, clean_text, grade

    limits = Limits(cell_timeout=args.cell_timeout, timeout=args.timeout, memory_gib=args.memory_gib)
    no_sandbox = getattr(args, "no_sandbox", False)
    try:
        where = "WITHOUT a sandbox (--no-sandbox)" if no_sandbox else f"each in its own {sandbox.find().describe()}"
        print(f"grading {len(args.submissions)} submission(s) {where}", file=sys.stderr)
        results = grade(args.submissions, out=args.out, source=args.source, notebooks_dir=args.notebooks_dir,
                        limits=limits, jobs=args.jobs, checks=args.checks, sandboxed=not no_sandbox,
                        full=getattr(args, "full", False))
    except (ConfigError, sandbox.SandboxUnavailable) as err:
        print(f"tfedu grade: {clean_text(err)}", file=sys.stderr)
        return 2
    # Entries are plain text already (grade cleans them); one_line keeps one report line per exercise.
    unmatched = 0
    for entry in results["submissions"]:
        if entry["source"] is None:
            unmatched += 1
            print(f"{entry['file']}: NOT GRADED: {clean_text(entry['notes'][0], one_line=True)}", file=sys.stderr)
            continue
        print(f"{entry['file']}: {entry['total']:g} / {entry['max']:g}")
        for grade_id, ex in entry["exercises"].items():
            print(f"  {clean_text(grade_id)}: {ex['points']:g} / {ex['max']:g}  {clean_text(ex['feedback'], one_line=True)}")
        for error in entry.get("cell_errors", []):
            print(f"  cell {error['cell']} (not an exercise) raised {clean_text(error['error'], one_line=True)[:200]}")
    print(f"wrote {args.out} and {args.out.rsplit('.', 1)[0]}.csv")
    return 1 if unmatched else 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("release", help="write student versions of source notebooks")
    p.add_argument("notebooks", nargs="+", help="source notebooks (solutions in place)")
    p.add_argument("--out", required=True, help="folder for the student versions")
    p.set_defaults(func=_release)

    from tfedu.course.grading.sandbox import GUARANTEES

    g = subparsers.add_parser("grade", help="autograde submitted notebooks (JSON and CSV results)",
                              description="Autograde submitted notebooks, each in its own bubblewrap sandbox.",
                              epilog=GUARANTEES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("submissions", nargs="+", help="submitted .ipynb files")
    g.add_argument("--out", required=True, help="results JSON; the CSV goes next to it")
    g.add_argument("--source", help="the source notebook (default: notebooks/ file with the submission's name)")
    g.add_argument("--notebooks-dir", help="where to look for source notebooks (default: the course's notebooks/)")
    g.add_argument("--checks", help="module with the PROBES (default: tfedu.checks.nb<source name>)")
    g.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    g.add_argument("--timeout", type=_positive, default=900.0, help="seconds per submission in all (default 900)")
    g.add_argument("--cell-timeout", type=_positive, default=120.0, help="seconds per cell (default 120)")
    g.add_argument("--memory-gib", type=_positive, default=4.0, help="memory limit of the kernel in GiB (default 4)")
    g.add_argument("--full", action="store_true",
                   help="run every cell of the notebook, not only the exercises, their checks and the cells they use "
                        "(slower; lists each demonstration that raised)")
    g.add_argument("--no-sandbox", action="store_true",
                   help="grade without the operating-system sandbox where none can be made (weaker guarantees, below)")
    g.set_defaults(func=_grade)

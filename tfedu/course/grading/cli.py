"""``tfedu release`` and ``tfedu grade``, registered in :data:`tfedu.course.cli.SUBCOMMAND_MODULES`.

    tfedu release notebooks/04_attention.ipynb --out release/
    tfedu grade submissions/*.ipynb --out results.json --jobs 2 --timeout 600 --cell-timeout 120
    tfedu grade submissions/*.ipynb --shard 3/10 --out part-3.json     (one machine of ten)
    tfedu grade --merge part-*.json --out results.json
"""

from __future__ import annotations

import argparse
import sys


def _release(args: argparse.Namespace) -> int:
    from tfedu.course.grading.release import ReleaseError, release

    try:
        for path in release(args.notebooks, args.out, solutions=not args.no_solutions):
            print(f"released {path}")
    except ReleaseError as err:
        print(f"tfedu release: {err}", file=sys.stderr)
        return 2
    return 0


def _grade(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tfedu.course.grading import sandbox, shards
    from tfedu.course.grading.grade import ConfigError, Limits, clean_text, grade, write_results

    limits = Limits(cell_timeout=args.cell_timeout, timeout=args.timeout, memory_gib=args.memory_gib)
    no_sandbox = getattr(args, "no_sandbox", False)
    try:
        if getattr(args, "merge", False):
            results = shards.merge(args.submissions)
            write_results(results, Path(args.out))
            print(f"merged {len(args.submissions)} shard(s), {len(results['submissions'])} submission(s)", file=sys.stderr)
        else:
            shard = shards.parse(args.shard) if getattr(args, "shard", None) else None
            if getattr(args, "self_check", False):  # the learner's own notebook: the sandbox where there is one
                try:
                    sandbox.find()
                except sandbox.SandboxUnavailable as err:
                    no_sandbox = True
                    print(f"(no grading sandbox here: {clean_text(err, one_line=True)[:120]}; your notebook is graded "
                          "without one, which changes nothing for an honest notebook)", file=sys.stderr)
            where = "WITHOUT a sandbox (--no-sandbox)" if no_sandbox else f"each in its own {sandbox.find().describe()}"
            count = len(shards.share(args.submissions, *shard)) if shard else len(args.submissions)
            print(f"grading {count} submission(s){f' (shard {shard[0]}/{shard[1]})' if shard else ''} {where}",
                  file=sys.stderr)
            results = grade(args.submissions, out=args.out, source=args.source, notebooks_dir=args.notebooks_dir,
                            limits=limits, jobs=args.jobs, checks=args.checks, sandboxed=not no_sandbox,
                            full=getattr(args, "full", False), shard=shard, cold=getattr(args, "cold", False))
    except (ConfigError, sandbox.SandboxUnavailable, shards.ShardError) as err:
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
    if args.out is not None:
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
    p.add_argument("--no-solutions", action="store_true",
                   help="for a graded course: tfedu.solution() answers that solutions are off (hints stay)")
    p.set_defaults(func=_release)

    from tfedu.course.grading.sandbox import GUARANTEES

    g = subparsers.add_parser("grade", help="autograde submitted notebooks (JSON and CSV results)",
                              description="Autograde submitted notebooks, each in its own bubblewrap sandbox.",
                              epilog=GUARANTEES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("submissions", nargs="+", help="submitted .ipynb files (with --merge: the shards' results JSON)")
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
    g.add_argument("--cold", action="store_true",
                   help="start every kernel afresh instead of forking the first one from a warm process that has "
                        "imported torch already (slower; see tfedu.course.grading.warm)")
    g.add_argument("--shard", metavar="K/N",
                   help="grade only the K-th of N disjoint shares of the submissions (K = 1..N; one machine each; "
                        "every shard must be given the same list)")
    g.add_argument("--merge", action="store_true",
                   help="the arguments are the results JSON of every shard: join them into --out, as one run would have written it")
    g.add_argument("--no-sandbox", action="store_true",
                   help="grade without the operating-system sandbox where none can be made (weaker guarantees, below)")
    g.set_defaults(func=_grade)

    c = subparsers.add_parser("check", help="grade your own notebook as your instructor's grader will (nothing is written)",
                              description="Grade your own saved notebook with the course's grader: the same check cells and "
                                          "hidden tests on fresh random inputs as `tfedu grade`, in its sandbox where this machine "
                                          "can make one (Linux with bubblewrap) and without it elsewhere. Save the notebook first.")
    c.add_argument("submissions", nargs="+", metavar="notebook", help="your .ipynb file(s), named like the course's (04_attention*.ipynb)")
    c.add_argument("--source", help="the course's notebook it answers (default: found by its file name)")
    c.add_argument("--notebooks-dir", help="where the course's notebooks are (default: the installed course's notebooks/)")
    c.add_argument("--full", action="store_true", help="run every cell of the notebook, not only what grading needs")
    c.set_defaults(func=_grade, out=None, checks=None, jobs=1, timeout=900.0, cell_timeout=120.0, memory_gib=4.0,
                   self_check=True, no_sandbox=False, shard=None, merge=False)

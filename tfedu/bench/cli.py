"""The ``tfedu bench NAME [--json] [--quick]`` subcommand."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from tfedu.bench import BENCHES


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="measure tfedu's speed against named peers")
    parser.add_argument("name", choices=sorted(BENCHES), help="what to measure")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON object on the last line")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat: checks the bench runs, not the speed")
    parser.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHES[args.name])
    try:
        result = module.run(quick=args.quick)
    except ImportError as err:  # the peers are optional dependencies
        print(f"tfedu bench {args.name} needs {err.name or 'a peer library'}: pip install -e \".[test]\"", file=sys.stderr)
        return 2
    print(module.format_table(result), flush=True)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0

"""The ``tfedu bench NAME [--json] [--quick] [--device cpu|cuda]`` subcommand."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys

from tfedu.course.bench import BENCHES


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="measure tfedu's speed against named peers")
    parser.add_argument("name", choices=sorted(BENCHES), help="what to measure")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON object on the last line")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat: checks the bench runs, not the speed")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="benches that run models (model, attention, decode): only this device; default the CPU, then CUDA if present")
    parser.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHES[args.name])
    kwargs = {}
    if args.device is not None:
        if "device" not in inspect.signature(module.run).parameters:
            print(f"tfedu bench {args.name} has no --device: it runs on the CPU only", file=sys.stderr)
            return 2
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                print(f"tfedu bench {args.name} --device cuda: torch sees no CUDA device", file=sys.stderr)
                return 2
        kwargs["device"] = args.device
    try:
        result = module.run(quick=args.quick, **kwargs)
    except ImportError as err:  # the peers are optional dependencies
        print(f"tfedu bench {args.name} needs {err.name or 'a peer library'}: pip install -e \".[test]\"", file=sys.stderr)
        return 2
    print(module.format_table(result), flush=True)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0

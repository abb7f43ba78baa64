"""The ``tfedu train`` subcommand (kept apart from tfedu.train so that ``tfedu --help`` does not load torch)."""

from __future__ import annotations

import os
from pathlib import Path

PRESETS = ("course-gpt", "induction-gpt", "course-chat", "course-draft", "rivals-recall", "rivals-lm")


def add_parser(subparsers) -> None:
    """``tfedu train --preset course-gpt|induction-gpt|course-chat|course-draft|rivals-recall|rivals-lm [--out DIR] [--steps N] [--device cpu|cuda]``."""
    parser = subparsers.add_parser("train", help="train a preset model (the course GPT, the induction GPT, the course chat model, the draft model) or notebook 19's sweeps (rivals-recall, rivals-lm) and write its folder")
    parser.add_argument("--preset", choices=PRESETS, required=True, help="what to train")
    parser.add_argument("--out", default=None, help="folder to write (default: data/PRESET in the checkout)")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps (the schedule stays the full run's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu; every preset but course-gpt: cpu only)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_preset)


def run_preset(args) -> int:
    import json

    import torch

    from tfedu.experiments import course_gpt

    if args.preset == "induction-gpt":
        return _run_induction(args)
    if args.preset == "course-chat":
        return _run_chat(args)
    if args.preset == "course-draft":
        return _run_draft(args)
    if args.preset in ("rivals-recall", "rivals-lm"):
        return _run_rivals(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("tfedu train --device cuda: torch sees no CUDA device", flush=True)
        return 2
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    out = Path(args.out) if args.out else course_gpt.FOLDER
    log = course_gpt.build(out, steps=args.steps, device=device, progress=not args.no_progress)
    if log is not None:
        print(json.dumps({"out": str(out), "val_loss": round(log["val_loss"], 4), "seconds": log["seconds"],
                          "steps": len(log["history"])}))
    return 0


def _run_induction(args) -> int:
    import json

    import torch

    from tfedu.experiments import induction

    if args.device not in (None, "cpu"):
        print("tfedu train --preset induction-gpt runs on the CPU (one thread, so that the run repeats exactly)", flush=True)
        return 2
    torch.set_num_threads(1)
    out = Path(args.out) if args.out else induction.FOLDER
    log = induction.build(out, steps=args.steps, progress=not args.no_progress)
    print(json.dumps({"out": str(out), "loss": log["history"][-1]["loss"], "seconds": log["seconds"],
                      "steps": len(log["history"])}))
    return 0


def _run_chat(args) -> int:
    import json

    from tfedu.experiments import course_chat

    if args.device not in (None, "cpu"):
        print("tfedu train --preset course-chat runs on the CPU (one thread, so that the run repeats exactly)", flush=True)
        return 2
    if args.steps is not None:
        print("tfedu train --preset course-chat has no --steps: its measurements need the full runs", flush=True)
        return 2
    out = Path(args.out) if args.out else course_chat.FOLDER
    log = course_chat.build(out, progress=not args.no_progress)
    print(json.dumps({"out": str(out), "accuracy_before": round(log["before"]["all"], 4),
                      "accuracy_after": round(log["after"]["all"], 4), "seconds": log["seconds"]}))
    return 0


def _run_draft(args) -> int:
    import json

    import torch

    from tfedu.experiments import course_draft

    if args.device not in (None, "cpu"):
        print("tfedu train --preset course-draft runs on the CPU (one thread, so that the run repeats exactly)", flush=True)
        return 2
    torch.set_num_threads(1)
    out = Path(args.out) if args.out else course_draft.FOLDER
    log = course_draft.build(out, steps=args.steps, progress=not args.no_progress)
    print(json.dumps({"out": str(out), "val_loss": round(log["val_loss"], 4), "seconds": log["seconds"],
                      "steps": len(log["history"])}))
    return 0


def _run_rivals(args) -> int:
    import json

    import torch

    from tfedu.experiments import rivals

    if args.device not in (None, "cpu"):
        print(f"tfedu train --preset {args.preset} runs on the CPU (one thread, so that every run repeats exactly)",
              flush=True)
        return 2
    if args.steps is not None:
        print(f"tfedu train --preset {args.preset} has no --steps: its sweep's recipe is fixed", flush=True)
        return 2
    torch.set_num_threads(1)
    out = Path(args.out) if args.out else rivals.FOLDER
    build = rivals.build_recall if args.preset == "rivals-recall" else rivals.build_lm
    log = build(out, progress=not args.no_progress)
    print(json.dumps({"out": str(out), "runs": len(log["runs"]), "seconds": log["seconds"]}))
    return 0

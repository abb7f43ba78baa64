"""``tfedu bench model``: a training step of ``tfedu.model.GPT`` against Hugging Face's GPT-2.

Measured in one run, on the CPU and (when present) on CUDA:

- one Hugging Face ``GPT2LMHeadModel`` of GPT-2 small's shape (d_model 768, 12 layers, 12 heads,
  vocabulary 50257), random weights from a fixed seed (nothing is downloaded), dropout 0 so that
  every model does the same work, in train mode; timed with its default attention
  implementation (``sdpa`` in recent ``transformers``) and again with ``eager``, its by-hand
  equivalent;
- two tfedu ``GPT``s holding the same weights (``gpt_from_hf``): ``attention="manual"`` (the
  course's by-hand softmax) and ``attention="sdpa"`` (``F.scaled_dot_product_attention``).

Before any timing the logits and the loss of every model are compared with Hugging Face's on the
same batch (float32: they must agree to 1e-4), and after the first step so are the gradients of
the (tied) embedding, which every layer's backward reaches. A step is ``zero_grad``, then the
forward pass and ``loss.backward()`` of the mean next-token cross-entropy on a batch of 4
sequences of 256 tokens (the same batch for everyone). The models take turns (A B C D A B C D ...)
so that a burst of load elsewhere hits them all; each is reported by its median and best seconds
per step and tokens per second. On CUDA the clock waits for the device (``synchronize``), in
float32 and again under bfloat16 autocast.

Every ratio is tfedu's tokens/s divided by the peer's (= the peer's time over tfedu's): above 1
means tfedu is faster. ``ratios`` compare best steps (the least disturbed by other work on the
machine), ``ratios_median`` the medians. The goal is 0.9 against Hugging Face's default GPT-2.

Then a whole training step (``bench_train``): ``tfedu.train.train`` on the two tfedu GPTs against
``hf_train_loop``, a plain hand-written loop over the same Hugging Face GPT-2 doing the same work per
step (schedule, batch from the same ``TokenDataset``, forward, loss, backward, clipping, AdamW with
the same two weight-decay groups), same weights and batches, losses checked equal step by step
first. On the CPU in float32; on CUDA under bfloat16 autocast, as ``train`` runs there. Reported as
``train_sdpa_vs_hf_loop`` and ``train_manual_vs_hf_loop`` (worst run), goal 0.9 too.

``--quick`` runs tiny sizes on one CPU thread: it checks that the bench runs, not the speed.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

from tfedu.course.bench.common import (
    device_description, device_lines, devices_to_run, interleaved, machine, quick_threads, summary, timed, version,
)

GOAL = 0.9  # tfedu's tokens/s at least 0.9x Hugging Face's
LOGIT_TOLERANCE = 1e-4  # float32; bfloat16 autocast is reported, not held to it
GPT2_SMALL = {"d_vocab": 50257, "n_ctx": 1024, "d_model": 768, "n_layers": 12, "n_heads": 12}
# Rounds of the interleaved timing (one step of every model each), after warm-up rounds.
FULL = {**GPT2_SMALL, "batch": 4, "context": 256, "warmup": {"cpu": 1, "cuda": 3}, "rounds": {"cpu": 5, "cuda": 20},
        # The training measurement (bench_train): the first call of every contender checks the losses agree
        # and warms up; then `train_rounds` interleaved calls of `train_steps` optimizer steps each.
        "check_steps": {"cpu": 3, "cuda": 10}, "train_steps": {"cpu": 2, "cuda": 20}, "train_rounds": {"cpu": 3, "cuda": 10}}
QUICK = {"d_vocab": 256, "n_ctx": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "batch": 2, "context": 32,
         "warmup": {"cpu": 1, "cuda": 1}, "rounds": {"cpu": 3, "cuda": 3},
         "check_steps": {"cpu": 3, "cuda": 3}, "train_steps": {"cpu": 3, "cuda": 3}, "train_rounds": {"cpu": 3, "cuda": 3}}
MODELS = ("hf", "hf_eager", "tfedu_manual", "tfedu_sdpa")
RATIOS = {  # name: (tfedu model, peer)
    "tfedu_manual/hf": ("tfedu_manual", "hf"),
    "tfedu_sdpa/hf": ("tfedu_sdpa", "hf"),
    "tfedu_manual/hf_eager": ("tfedu_manual", "hf_eager"),
    "tfedu_sdpa/hf_eager": ("tfedu_sdpa", "hf_eager"),
}


def hf_gpt2(shape: dict, seed: int = 0):
    """A Hugging Face ``GPT2LMHeadModel`` of ``shape`` with dropout off and random weights from ``seed``.

    The weights are drawn without touching the caller's random state; nothing is downloaded.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=shape["d_vocab"], n_positions=shape["n_ctx"], n_embd=shape["d_model"],
        n_layer=shape["n_layers"], n_head=shape["n_heads"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout off: every model does the same work
        bos_token_id=shape["d_vocab"] - 1, eos_token_id=shape["d_vocab"] - 1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def build_models(shape: dict, seed: int = 0) -> dict:
    """Hugging Face's GPT-2 (default attention and eager) and tfedu's GPT (manual and sdpa), same weights.

    The weights are drawn from ``seed`` without touching the caller's random state.
    """
    from transformers import GPT2LMHeadModel

    from tfedu.checkpoints import gpt_from_hf

    hf = hf_gpt2(shape, seed)
    config = hf.config
    hf_eager = copy.deepcopy(hf)
    if hasattr(hf_eager, "set_attn_implementation"):  # transformers >= 4.48
        hf_eager.set_attn_implementation("eager")
    else:
        hf_eager = GPT2LMHeadModel._from_config(config, attn_implementation="eager")
        hf_eager.load_state_dict(hf.state_dict())
    models = {
        "hf": hf,
        "hf_eager": hf_eager,
        "tfedu_manual": gpt_from_hf(hf, attention="manual"),
        "tfedu_sdpa": gpt_from_hf(hf, attention="sdpa"),
    }
    return {name: model.train() for name, model in models.items()}  # train mode, as in training (dropout is 0)


def step_fns(models: dict, x, y, autocast_dtype=None) -> dict[str, Callable[[], object]]:
    """For each model, ``fn() -> (logits, loss)``: forward on ``x``, the next-token loss against ``y``."""
    import contextlib

    import torch
    import torch.nn.functional as F

    def cast():
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(x.device.type, dtype=autocast_dtype)

    def hf_fn(model):
        def fn():
            with cast():
                logits = model(input_ids=x, use_cache=False).logits
            # The same loss as tfedu.model.next_token_loss: mean cross-entropy in float32.
            return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

        return fn

    def tfedu_fn(model):
        def fn():
            with cast():
                return model(x, targets=y)

        return fn

    return {name: (hf_fn if name.startswith("hf") else tfedu_fn)(model) for name, model in models.items()}


def check_agreement(models: dict, fns: dict) -> dict:
    """Max |logit - HF's logit| and |loss - HF's loss| of every model, without gradients."""
    import torch

    with torch.no_grad():
        outputs = {name: fn() for name, fn in fns.items()}
    ref_logits, ref_loss = outputs["hf"]
    return {
        name: {
            "max_abs_logit_diff": (logits.float() - ref_logits.float()).abs().max().item(),
            "abs_loss_diff": abs(loss.item() - ref_loss.item()),
            "loss": loss.item(),
        }
        for name, (logits, loss) in outputs.items()
    }


def embedding_grad(name: str, model):
    """The gradient of the token embedding (tied to the unembedding: every layer's backward reaches it)."""
    return (model.transformer.wte if name.startswith("hf") else model.embed).weight.grad


def bench_one(models: dict, shape: dict, device: str, autocast_dtype=None, rounds: int = 5, warmup: int = 1) -> dict:
    """Agreement, then interleaved timings of a training step of every model on ``device``."""
    import torch

    models = {name: model.to(device) for name, model in models.items()}
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["d_vocab"], (shape["batch"], shape["context"] + 1), generator=generator)
    tokens = tokens.to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]  # predict each next token
    fns = step_fns(models, x, y, autocast_dtype)
    agreement = check_agreement(models, fns)
    sync = torch.cuda.synchronize if device == "cuda" else None
    cpu_seconds: dict[str, list[float]] = {name: [] for name in MODELS}

    def step(name: str) -> Callable[[], float]:
        def run_step() -> float:
            models[name].zero_grad(set_to_none=True)
            cpu_start = time.process_time()
            seconds, _ = timed(lambda: fns[name]()[1].backward(), sync)
            cpu_seconds[name].append(time.process_time() - cpu_start)
            return seconds

        return run_step

    steps = {name: step(name) for name in MODELS}
    interleaved(steps, warmup)
    for name in MODELS:
        cpu_seconds[name].clear()
    ref_grad = embedding_grad("hf", models["hf"])
    for name, model in models.items():
        agreement[name]["max_abs_embedding_grad_diff"] = (embedding_grad(name, model) - ref_grad).abs().max().item()
    times = interleaved(steps, rounds)
    tokens_per_step = shape["batch"] * shape["context"]
    timings = {}
    for name in MODELS:
        row = summary(times[name])
        # CPU time of this process (all its threads): far below the wall time when other work took the cores.
        row["cpu_s_median"] = statistics.median(cpu_seconds[name])
        row["tokens_per_s_median"] = tokens_per_step / row["median_s"]
        row["tokens_per_s_best"] = tokens_per_step / row["best_s"]
        timings[name] = row
    # The headline ratios use each model's best step, the one least disturbed by other work (as the
    # tokenizer bench does); on a loaded machine the medians mostly measure the load.
    ratios = {key: timings[ours]["tokens_per_s_best"] / timings[peer]["tokens_per_s_best"]
              for key, (ours, peer) in RATIOS.items()}
    ratios_median = {key: timings[ours]["tokens_per_s_median"] / timings[peer]["tokens_per_s_median"]
                     for key, (ours, peer) in RATIOS.items()}
    fp32 = autocast_dtype is None
    agree = all(
        row["max_abs_logit_diff"] <= LOGIT_TOLERANCE and row["abs_loss_diff"] <= LOGIT_TOLERANCE
        for row in agreement.values()
    )
    for model in models.values():
        model.zero_grad(set_to_none=True)
        model.to("cpu")  # give the device memory back
    return {
        "device": device,
        "dtype": "float32" if fp32 else f"{str(autocast_dtype).removeprefix('torch.')} autocast",
        "rounds": rounds,
        "warmup": warmup,
        "tokens_per_step": tokens_per_step,
        "agreement": agreement,
        "logits_agree": agree if fp32 else None,  # autocast rounds differently in every implementation
        "max_abs_logit_diff": max(row["max_abs_logit_diff"] for row in agreement.values()),
        "timings": timings,
        "ratios": ratios,
        "ratios_median": ratios_median,
    }


# ----------------------------------------------------------------------------- training: tfedu.train vs a plain loop

TRAIN_CONTENDERS = ("hf_loop", "tfedu_manual", "tfedu_sdpa")
TRAIN_RATIOS = {"tfedu_manual/hf_loop": ("tfedu_manual", "hf_loop"), "tfedu_sdpa/hf_loop": ("tfedu_sdpa", "hf_loop")}
LOSS_TOLERANCE = 1e-4  # float32, every step's loss, after several AdamW steps from the same weights


def hf_train_loop(model, data, cfg, device) -> dict:
    """The peer: a plain training loop over Hugging Face's ``GPT2LMHeadModel``, doing what ``train`` does per step.

    AdamW with the same two groups (decay on parameters with 2+ dims, none on biases and norm gains)
    and the same ``fused`` choice, the same learning rate set every step (``tfedu.train.learning_rate``),
    the same windows of ``data`` from a sampler seeded with ``cfg.seed``, the same autocast, the same
    loss (HF's ``labels=`` would shift the ids itself; the windows are already shifted, so the
    cross-entropy of the logits at ``x`` against ``y`` is taken here, in float32 like
    ``tfedu.model.next_token_loss``), zero_grad, backward, clipping to ``cfg.grad_clip``, step. What it
    does not do and ``train`` does: read the loss and the norm back every step (``.item()``: on CUDA a
    wait for the device), time the step, keep the history; here the losses are read once, at the end.
    """
    import math

    import torch
    import torch.nn.functional as F

    from tfedu.train import autocast_for, learning_rate

    seq_len = cfg.seq_len or model.config.n_positions
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")
    sampler = torch.Generator().manual_seed(cfg.seed)
    autocast = autocast_for(device)
    model.train()
    losses, norms = [], []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        x, y = data.batch(cfg.batch_size, seq_len, sampler)
        x, y = x.to(device), y.to(device)
        with autocast:
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf))
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses).tolist(), "grad_norms": torch.stack(norms).tolist()}


def bench_train(hf, shape: dict, device: str, check_steps: int, steps: int, rounds: int, seed: int = 2) -> dict:
    """Tokens/s of ``tfedu.train.train`` on tfedu's GPT (manual and sdpa) against ``hf_train_loop`` on ``hf``.

    Each contender trains its own copy of ``hf``'s weights (``gpt_from_hf``; ``hf`` itself is not
    touched). First every contender runs ``check_steps`` steps from those weights on the same batches;
    the losses (and gradient norms) must agree step by step with the HF loop's (float32: to
    ``LOSS_TOLERANCE``; under autocast they are reported, not held to it). That run is also the
    warm-up. Then the contenders take turns (HF loop, manual, sdpa, HF loop, ...) for ``rounds``
    calls of ``steps`` optimizer steps each, every call drawing the same batches again
    (the sampler is re-seeded) and continuing from the weights the last call left.

    The timed region is one whole call: ``train(model, data, cfg, device=..., progress=False)`` (no
    held-out data, no checkpoints) against ``hf_train_loop(...)``. It holds everything done per step
    (the learning rate, drawing the batch and copying it to the device, forward, loss, zero_grad,
    backward, clipping, AdamW's step, and in ``train`` the per-step record with its ``.item()`` reads)
    and, once per call on both sides, building AdamW and its first-step state, seeding the sampler
    and ``model.train()``; ``train`` also builds a (disabled) progress bar and checks for
    ``torchrun``. Outside it: building the models and the data set. On CUDA the clock waits for the
    device (``synchronize``) before it starts and before it stops.
    """
    import copy

    import torch

    from tfedu.checkpoints import gpt_from_hf
    from tfedu.data import TokenDataset
    from tfedu.train import TrainConfig, train

    dev = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    n_tokens = max(100_000, 4 * shape["batch"] * (shape["context"] + 1))
    data = TokenDataset.from_ids(torch.randint(0, shape["d_vocab"], (n_tokens,), generator=generator))
    hf_copy = copy.deepcopy(hf).to(dev)
    models = {"hf_loop": hf_copy,
              "tfedu_manual": gpt_from_hf(hf_copy, attention="manual").to(dev),
              "tfedu_sdpa": gpt_from_hf(hf_copy, attention="sdpa").to(dev)}

    def config(n_steps: int) -> TrainConfig:
        # warmup_steps=1: the schedule's warm-up and cosine branches are both used in a call.
        return TrainConfig(steps=n_steps, batch_size=shape["batch"], seq_len=shape["context"], lr=6e-4,
                           warmup_steps=1, weight_decay=0.1, grad_clip=1.0, eval_every=n_steps, seed=0)

    def call(name: str, cfg: TrainConfig) -> dict:
        if name == "hf_loop":
            return hf_train_loop(models[name], data, cfg, dev)
        result = train(models[name], data, cfg, device=dev, progress=False)
        return {"losses": result.losses, "grad_norms": [r["grad_norm"] for r in result.history],
                "tokens_per_s": [r["tokens_per_s"] for r in result.history]}

    outputs = {name: call(name, config(check_steps)) for name in TRAIN_CONTENDERS}  # agreement and warm-up
    ref = outputs["hf_loop"]
    agreement = {
        name: {
            "losses": out["losses"],
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(out["losses"], ref["losses"])),
            "max_rel_grad_norm_diff": max(abs(a - b) / b for a, b in zip(out["grad_norms"], ref["grad_norms"])),
        }
        for name, out in outputs.items()
    }
    fp32 = device != "cuda" or not torch.cuda.is_bf16_supported()
    losses_agree = all(row["max_abs_loss_diff"] <= LOSS_TOLERANCE for row in agreement.values())

    sync = torch.cuda.synchronize if device == "cuda" else None
    cfg = config(steps)
    reported: dict[str, list[float]] = {"tfedu_manual": [], "tfedu_sdpa": []}  # train()'s own per-step tokens/s

    def timed_call(name: str):
        def run_call() -> float:
            seconds, out = timed(lambda: call(name, cfg), sync)
            reported.get(name, []).extend(out.get("tokens_per_s", []))
            return seconds

        return run_call

    times = interleaved({name: timed_call(name) for name in TRAIN_CONTENDERS}, rounds)
    tokens_per_step = shape["batch"] * shape["context"]
    timings = {}
    for name in TRAIN_CONTENDERS:
        row = summary([s / steps for s in times[name]])  # seconds per step, each the mean over one call
        row["tokens_per_s_median"] = tokens_per_step / row["median_s"]
        row["tokens_per_s_best"] = tokens_per_step / row["best_s"]
        if name in reported:  # the tokens/s train() reports itself: its per-step clock, inside the call
            row["reported_tokens_per_s_median"] = statistics.median(reported[name])
        timings[name] = row
    ratios = {key: timings[ours]["tokens_per_s_best"] / timings[peer]["tokens_per_s_best"]
              for key, (ours, peer) in TRAIN_RATIOS.items()}
    ratios_median = {key: timings[ours]["tokens_per_s_median"] / timings[peer]["tokens_per_s_median"]
                     for key, (ours, peer) in TRAIN_RATIOS.items()}
    del models, hf_copy  # give the memory back
    return {
        "device": device,
        "dtype": "float32" if fp32 else "bfloat16 autocast",
        "check_steps": check_steps,
        "steps_per_call": steps,
        "rounds": rounds,
        "tokens_per_step": tokens_per_step,
        "train_config": {**vars(cfg), "betas": list(cfg.betas)},
        "dataset_tokens": n_tokens,
        "hf_loop_losses": ref["losses"],
        "agreement": agreement,
        "losses_agree": losses_agree if fp32 else None,  # autocast rounds differently in every implementation
        "max_abs_loss_diff": max(row["max_abs_loss_diff"] for row in agreement.values()),
        "timings": timings,
        "ratios": ratios,
        "ratios_median": ratios_median,
    }


def run(quick: bool = False, device: str | None = None) -> dict:
    """Measure on ``device``: "cpu", "cuda", or None for the CPU and then CUDA when present."""
    import transformers  # noqa: F401  (a missing peer fails here, before any work)

    devices = devices_to_run("model", device)
    with quick_threads(quick):
        return _run(quick, devices)


def _run(quick: bool, devices: list[str]) -> dict:
    import torch
    import transformers

    cfg = QUICK if quick else FULL
    shape = {key: cfg[key] for key in ("d_vocab", "n_ctx", "d_model", "n_layers", "n_heads", "batch", "context")}
    models = build_models(shape)
    result: dict = {
        "quick": quick,
        "shape": "quick (tiny)" if quick else "gpt2 small",
        **shape,
        "n_params": sum(p.numel() for p in models["tfedu_manual"].parameters()),
        "step": "zero_grad, forward, next-token cross-entropy (float32), backward",
        "train_step": "tfedu.train.train (lr schedule, batch, forward, loss, zero_grad, backward, clip, AdamW step, "
                      "record) vs the same in a plain loop over HF GPT-2; whole calls of k steps timed",
        **machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": version("numpy"),
        "hf_attn_implementation": models["hf"].config._attn_implementation,
        "hf_eager_attn_implementation": models["hf_eager"].config._attn_implementation,
        "goal": GOAL,
        "devices": {d: device_description(d) for d in devices},
        "runs": {},
    }
    for d in devices:
        rounds, warmup = cfg["rounds"][d], cfg["warmup"][d]
        result["runs"][f"{d} float32"] = bench_one(models, shape, d, None, rounds, warmup)
        if d == "cuda" and torch.cuda.is_bf16_supported():
            result["runs"][f"{d} bfloat16"] = bench_one(models, shape, d, torch.bfloat16, rounds, warmup)
    result["train"] = {}
    for d in devices:
        run_ = bench_train(models["hf"], shape, d, cfg["check_steps"][d], cfg["train_steps"][d], cfg["train_rounds"][d])
        result["train"][f"{d} {run_['dtype']}"] = run_
    runs = result["runs"].values()
    # The headline numbers: the worst run, not the best.
    result["manual_vs_hf"] = min(r["ratios"]["tfedu_manual/hf"] for r in runs)
    result["sdpa_vs_hf"] = min(r["ratios"]["tfedu_sdpa/hf"] for r in runs)
    result["manual_vs_hf_eager"] = min(r["ratios"]["tfedu_manual/hf_eager"] for r in runs)
    result["goal_met_sdpa"] = result["sdpa_vs_hf"] >= GOAL
    result["goal_met_manual"] = result["manual_vs_hf"] >= GOAL
    result["load_average_1min_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    result["logits_agree"] = all(r["logits_agree"] is not False for r in runs)
    train_runs = result["train"].values()
    result["train_sdpa_vs_hf_loop"] = min(r["ratios"]["tfedu_sdpa/hf_loop"] for r in train_runs)
    result["train_manual_vs_hf_loop"] = min(r["ratios"]["tfedu_manual/hf_loop"] for r in train_runs)
    result["goal_met_train_sdpa"] = result["train_sdpa_vs_hf_loop"] >= GOAL
    result["goal_met_train_manual"] = result["train_manual_vs_hf_loop"] >= GOAL
    result["train_losses_agree"] = all(r["losses_agree"] is not False for r in train_runs)
    result["max_abs_logit_diff"] = max(r["max_abs_logit_diff"] for r in runs if r["logits_agree"] is not None)
    return result


LABELS = {"hf": "HF GPT-2 ({hf})", "hf_eager": "HF GPT-2 (eager)", "tfedu_manual": "tfedu GPT (manual)",
          "tfedu_sdpa": "tfedu GPT (sdpa)"}


TRAIN_LABELS = {"hf_loop": "plain loop, HF GPT-2 ({hf})", "tfedu_manual": "tfedu.train, GPT (manual)",
                "tfedu_sdpa": "tfedu.train, GPT (sdpa)"}


def format_table(r: dict) -> str:
    """The results as a plain-text table (the JSON holds the same numbers)."""
    lines = [
        f"tfedu bench model{' (quick: sizes too small to mean anything)' if r['quick'] else ''}",
        f"{r['shape']}: d_model {r['d_model']}, {r['n_layers']} layers, {r['n_heads']} heads, vocab {r['d_vocab']}, "
        f"{r['n_params'] / 1e6:.1f}M parameters; batch {r['batch']} x context {r['context']}",
        f"step: {r['step']}; torch {r['torch']}, transformers {r['transformers']}; "
        f"load average {r['load_average_1min']} at the start, {r['load_average_1min_end']} at the end",
    ]
    lines += device_lines(r["devices"])
    for key, run in r["runs"].items():
        title = f"{key}, {run['rounds']} rounds"
        lines += ["", f"{title:<32}{'median s':>10}{'best s':>10}{'cpu s':>8}{'tokens/s':>11}{'vs HF':>8}"
                      f"{'(median)':>9}{'max |dlogit|':>14}{'max |dgrad|':>13}"]
        hf_best, hf_median = run["timings"]["hf"]["tokens_per_s_best"], run["timings"]["hf"]["tokens_per_s_median"]
        for name in MODELS:
            t, a = run["timings"][name], run["agreement"][name]
            label = LABELS[name].format(hf=r["hf_attn_implementation"])
            diffs = "" if name == "hf" else f"{a['max_abs_logit_diff']:>14.1e}{a['max_abs_embedding_grad_diff']:>13.1e}"
            lines.append(f"{label:<32}{t['median_s']:>10.4f}{t['best_s']:>10.4f}{t['cpu_s_median']:>8.2f}"
                         f"{t['tokens_per_s_best']:>11,.0f}{t['tokens_per_s_best'] / hf_best:>8.2f}"
                         f"{t['tokens_per_s_median'] / hf_median:>9.2f}{diffs}")
        ratios = run["ratios"]
        lines.append(
            f"tfedu/HF tokens/s (best steps): manual {ratios['tfedu_manual/hf']:.2f}, sdpa {ratios['tfedu_sdpa/hf']:.2f}; "
            f"against HF eager: manual {ratios['tfedu_manual/hf_eager']:.2f}, sdpa {ratios['tfedu_sdpa/hf_eager']:.2f}"
        )
    lines.append("(wall seconds per step, median and best; cpu s: this process's CPU seconds per step, median; "
                 "tokens/s and vs HF from the best step, vs HF (median) from the medians)")
    for key, run in r["train"].items():
        title = f"train, {key}, {run['rounds']} x {run['steps_per_call']} steps"
        lines += ["", f"{title:<40}{'median s':>10}{'best s':>10}{'tokens/s':>11}{'vs loop':>9}{'(median)':>9}"
                      f"{'own tok/s':>11}{'max |dloss|':>13}"]
        loop = run["timings"]["hf_loop"]
        for name in TRAIN_CONTENDERS:
            t, a = run["timings"][name], run["agreement"][name]
            label = TRAIN_LABELS[name].format(hf=r["hf_attn_implementation"])
            own = f"{t['reported_tokens_per_s_median']:>11,.0f}" if "reported_tokens_per_s_median" in t else f"{'':>11}"
            diff = "" if name == "hf_loop" else f"{a['max_abs_loss_diff']:>13.1e}"
            lines.append(f"{label:<40}{t['median_s']:>10.4f}{t['best_s']:>10.4f}{t['tokens_per_s_best']:>11,.0f}"
                         f"{t['tokens_per_s_best'] / loop['tokens_per_s_best']:>9.2f}"
                         f"{t['tokens_per_s_median'] / loop['tokens_per_s_median']:>9.2f}{own}{diff}")
        lines.append(f"losses of the first {run['check_steps']} steps (HF loop): "
                     + ", ".join(f"{loss:.4f}" for loss in run["hf_loop_losses"]))
    if r["train"]:
        lines.append("(wall seconds per step = one whole call of k steps / k, AdamW's construction included; "
                     "own tok/s: the median that train() reports per step, from its own clock)")
    lines += [
        "",
        f"sdpa_vs_hf {r['sdpa_vs_hf']:.2f}  manual_vs_hf {r['manual_vs_hf']:.2f}  "
        f"manual_vs_hf_eager {r['manual_vs_hf_eager']:.2f}  (worst run; above 1: tfedu faster)  "
        f"goal {r['goal']}: {'met' if r['goal_met_sdpa'] else 'NOT met'} with sdpa, "
        f"{'met' if r['goal_met_manual'] else 'not met'} by hand",
        f"train_sdpa_vs_hf_loop {r['train_sdpa_vs_hf_loop']:.2f}  train_manual_vs_hf_loop {r['train_manual_vs_hf_loop']:.2f}"
        f"  (tfedu.train.train vs a plain loop over HF GPT-2, worst run)  goal {r['goal']}: "
        f"{'met' if r['goal_met_train_sdpa'] else 'NOT met'} with sdpa, {'met' if r['goal_met_train_manual'] else 'not met'} by hand",
    ]
    if not r["logits_agree"]:
        lines.append(f"WARNING: tfedu's logits differ from HF's by {r['max_abs_logit_diff']:.1e} "
                     f"(> {LOGIT_TOLERANCE}): the timings compare unequal work")
    if not r["train_losses_agree"]:
        lines.append(f"WARNING: tfedu.train's losses differ from the HF loop's by more than {LOSS_TOLERANCE}: "
                     "the training timings compare unequal work")
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    out = run(quick="--quick" in sys.argv)
    print(format_table(out))
    print(json.dumps(out, sort_keys=True))

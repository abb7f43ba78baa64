"""``tfedu bench decode``: greedy decoding with tfedu's KV cache against transformers' and against no cache.

Measured in one run, on the CPU and (when present) on CUDA, float32:

- one Hugging Face ``GPT2LMHeadModel`` of GPT-2 small's shape (d_model 768, 12 layers, 12 heads,
  vocabulary 50257, n_ctx 1024), random weights from a fixed seed (nothing is downloaded), its
  default attention (``sdpa``), decoding with ``generate(do_sample=False, use_cache=True)`` (its
  ``DynamicCache``);
- tfedu's ``GPT`` holding the same weights (``gpt_from_hf``), decoding with
  ``tfedu.generate.generate``: with its cache (``use_cache=True``, ``attention="sdpa"``, and again
  with the by-hand ``attention="manual"``) and without it (``use_cache=False``: the whole context
  again at every step).

Each decoder writes 200 tokens greedily after the same 16-token prompt. A first, untimed call of
each checks that every decoder gives exactly transformers' token ids (an ``AssertionError`` otherwise:
timing unequal work means nothing) and measures its peak memory: on the CPU the bytes of the tensors
torch creates during the call (``tfedu.flash.peak_memory``: the cache, the logits, every
activation; not the weights made before), on CUDA ``torch.cuda.max_memory_allocated`` above what was
allocated before the call. Then the decoders take turns (A B C D A B C D ...) so that a burst of load
elsewhere hits them all. Tokens/s = new tokens / wall seconds of the whole call (the prompt's
forward pass included); on CUDA the clock waits for the device.

Ratios are tokens/s over tokens/s, from each decoder's best call (the least disturbed): above 1
means the first is faster. Goals: tfedu cached >= 1.0x transformers cached, tfedu cached >= 5x
tfedu uncached.

``--quick`` runs a tiny model on one CPU thread: it checks that the bench runs, not the speed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from tfedu.course.bench.common import (
    device_description, device_lines, devices_to_run, interleaved, machine, quick_threads, summary, timed, version,
)
from tfedu.course.bench.model import GPT2_SMALL, hf_gpt2

GOALS = {"cached_vs_hf": 1.0, "cached_vs_uncached": 5.0}
FULL = {**GPT2_SMALL, "prompt": 16, "new_tokens": 200, "rounds": {"cpu": 3, "cuda": 10}}
QUICK = {"d_vocab": 256, "n_ctx": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "prompt": 8, "new_tokens": 24,
         "rounds": {"cpu": 2, "cuda": 2}}
CONTENDERS = ("hf_cached", "tfedu_cached", "tfedu_cached_manual", "tfedu_uncached")
LABELS = {"hf_cached": "transformers, its cache ({hf})", "tfedu_cached": "tfedu, KV cache (sdpa)",
          "tfedu_cached_manual": "tfedu, KV cache (manual)", "tfedu_uncached": "tfedu, no cache (sdpa)"}
RATIOS = {  # name: (decoder, the one it is compared with)
    "tfedu_cached/hf_cached": ("tfedu_cached", "hf_cached"),
    "tfedu_cached_manual/hf_cached": ("tfedu_cached_manual", "hf_cached"),
    "tfedu_cached/tfedu_uncached": ("tfedu_cached", "tfedu_uncached"),
}


def decoders(hf, ours: dict, ids, new_tokens: int) -> dict[str, Callable[[], object]]:
    """For each contender, ``fn() -> ids`` (batch, prompt + new_tokens): greedy decoding of ``ids``."""
    import warnings

    import torch

    from tfedu.generate import generate

    def hf_fn():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # generation-config chatter
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                               eos_token_id=None, pad_token_id=hf.config.eos_token_id)

    return {
        "hf_cached": hf_fn,
        "tfedu_cached": lambda: generate(ours["sdpa"], ids, new_tokens, use_cache=True),
        "tfedu_cached_manual": lambda: generate(ours["manual"], ids, new_tokens, use_cache=True),
        "tfedu_uncached": lambda: generate(ours["sdpa"], ids, new_tokens, use_cache=False),
    }


def peak_bytes(fn: Callable[[], object], device: str) -> tuple[object, int]:
    """``(fn(), peak)``: the most bytes of tensors the call held at once beyond what existed before it."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - before
    from tfedu.flash import peak_memory

    return peak_memory(fn)


def first_difference(a, b) -> str:
    """Where two id tensors first differ, in words."""
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    row, col = (a != b).nonzero()[0].tolist()
    return f"row {row}, position {col}: {int(a[row, col])} against {int(b[row, col])}"


def bench_device(hf, shape: dict, device: str, rounds: int) -> dict:
    """Identical tokens and peak memory (one untimed call each), then interleaved timings on ``device``."""
    import torch

    from tfedu.checkpoints import gpt_from_hf
    from tfedu.kv_cache import kv_cache_bytes

    hf = hf.to(device).eval()
    ours = {attention: gpt_from_hf(hf, attention=attention).to(device).eval() for attention in ("sdpa", "manual")}
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["d_vocab"], (1, shape["prompt"]), generator=generator).to(device)
    fns = decoders(hf, ours, ids, shape["new_tokens"])
    peaks, outputs = {}, {}
    for name, fn in fns.items():
        outputs[name], peaks[name] = peak_bytes(fn, device)
    expected = outputs["hf_cached"]
    assert expected.shape == (1, shape["prompt"] + shape["new_tokens"]), tuple(expected.shape)
    for name, out in outputs.items():
        assert torch.equal(out, expected), (
            f"{LABELS[name].format(hf='')} decoded other tokens than transformers on {device} "
            f"({first_difference(out, expected)}): the timings would compare unequal work")

    sync = torch.cuda.synchronize if device == "cuda" else None
    times = interleaved({name: (lambda fn=fn: timed(fn, sync)[0]) for name, fn in fns.items()}, rounds)
    timings = {}
    for name in CONTENDERS:
        row = summary(times[name])
        row["tokens_per_s_best"] = shape["new_tokens"] / row["best_s"]
        row["tokens_per_s_median"] = shape["new_tokens"] / row["median_s"]
        row["peak_bytes"] = peaks[name]
        timings[name] = row
    ratios = {key: timings[a]["tokens_per_s_best"] / timings[b]["tokens_per_s_best"] for key, (a, b) in RATIOS.items()}
    ratios_median = {key: timings[a]["tokens_per_s_median"] / timings[b]["tokens_per_s_median"]
                     for key, (a, b) in RATIOS.items()}
    held = shape["prompt"] + shape["new_tokens"] - 1  # the last token is never fed back
    hf.to("cpu")  # give the device memory back
    return {
        "device": device,
        "dtype": "float32",
        "rounds": rounds,
        "tokens_identical": True,  # asserted above
        "kv_cache_bytes": kv_cache_bytes(ours["sdpa"].cfg, held),
        "kv_cache_tokens": held,
        "peak_memory": "tfedu.flash.peak_memory (bytes of tensors created during the call)" if device == "cpu"
                       else "torch.cuda.max_memory_allocated above the allocation before the call",
        "timings": timings,
        "ratios": ratios,
        "ratios_median": ratios_median,
    }


def run(quick: bool = False, device: str | None = None) -> dict:
    """Measure on ``device``: "cpu", "cuda", or None for the CPU and then CUDA when present."""
    devices = devices_to_run("decode", device)
    with quick_threads(quick):
        return _run(quick, devices)


def _run(quick: bool, devices: list[str]) -> dict:
    import torch
    import transformers

    cfg = QUICK if quick else FULL
    shape = {key: cfg[key] for key in ("d_vocab", "n_ctx", "d_model", "n_layers", "n_heads", "prompt", "new_tokens")}
    hf = hf_gpt2(shape).eval()
    result: dict = {
        "quick": quick,
        "shape": "quick (tiny)" if quick else "gpt2 small",
        **shape,
        "n_params": sum(p.numel() for p in hf.parameters()),
        "decoding": ("greedy, batch 1, float32 (tfedu's generate under torch.inference_mode, transformers' under its "
                     "torch.no_grad); tokens/s = new tokens / seconds of the whole call"),
        **machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": version("numpy"),
        "hf_attn_implementation": hf.config._attn_implementation,
        "goals": GOALS,
        "devices": {d: device_description(d) for d in devices},
        "runs": {},
    }
    for d in devices:
        result["runs"][f"{d} float32"] = bench_device(hf, shape, d, cfg["rounds"][d])
    runs = result["runs"].values()
    # The headline numbers: the worst run, not the best.
    result["cached_vs_hf"] = min(r["ratios"]["tfedu_cached/hf_cached"] for r in runs)
    result["manual_cached_vs_hf"] = min(r["ratios"]["tfedu_cached_manual/hf_cached"] for r in runs)
    result["cached_vs_uncached"] = min(r["ratios"]["tfedu_cached/tfedu_uncached"] for r in runs)
    result["goal_met_cached_vs_hf"] = result["cached_vs_hf"] >= GOALS["cached_vs_hf"]
    result["goal_met_cached_vs_uncached"] = result["cached_vs_uncached"] >= GOALS["cached_vs_uncached"]
    result["tokens_identical"] = all(r["tokens_identical"] for r in runs)
    result["load_average_1min_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return result


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def format_table(r: dict) -> str:
    """The results as a plain-text table (the JSON holds the same numbers)."""
    lines = [
        f"tfedu bench decode{' (quick: sizes too small to mean anything)' if r['quick'] else ''}",
        f"{r['shape']}: d_model {r['d_model']}, {r['n_layers']} layers, {r['n_heads']} heads, vocab {r['d_vocab']}, "
        f"n_ctx {r['n_ctx']}, {r['n_params'] / 1e6:.1f}M parameters; {r['new_tokens']} new tokens after a "
        f"{r['prompt']}-token prompt",
        f"{r['decoding']}; torch {r['torch']}, transformers {r['transformers']}; "
        f"load average {r['load_average_1min']} at the start, {r['load_average_1min_end']} at the end",
        *device_lines(r["devices"]),
    ]
    for key, run in r["runs"].items():
        title = f"{key}, {run['rounds']} rounds"
        lines += ["", f"{title:<36}{'median s':>10}{'best s':>10}{'tokens/s':>10}{'(median)':>10}{'peak memory':>14}"]
        for name in CONTENDERS:
            t = run["timings"][name]
            lines.append(f"{LABELS[name].format(hf=r['hf_attn_implementation']):<36}{t['median_s']:>10.3f}"
                         f"{t['best_s']:>10.3f}{t['tokens_per_s_best']:>10.1f}{t['tokens_per_s_median']:>10.1f}"
                         f"{_mib(t['peak_bytes']):>14}")
        ratios, medians = run["ratios"], run["ratios_median"]
        lines.append("ratios of tokens/s, best (median): "
                     + ", ".join(f"{key} {ratios[key]:.2f} ({medians[key]:.2f})" for key in RATIOS))
        lines.append(f"token ids identical to transformers': {run['tokens_identical']}; the KV cache of "
                     f"{run['kv_cache_tokens']} tokens is {_mib(run['kv_cache_bytes'])} (2 * n_layers * n_kv_heads "
                     f"* d_head * 4 bytes a token); peak memory: {run['peak_memory']}")
    lines += [
        "",
        f"cached_vs_hf {r['cached_vs_hf']:.2f} (goal {r['goals']['cached_vs_hf']}: "
        f"{'met' if r['goal_met_cached_vs_hf'] else 'NOT met'})  manual_cached_vs_hf {r['manual_cached_vs_hf']:.2f}  "
        f"cached_vs_uncached {r['cached_vs_uncached']:.2f} (goal {r['goals']['cached_vs_uncached']}: "
        f"{'met' if r['goal_met_cached_vs_uncached'] else 'NOT met'})  (worst run; above 1: the first is faster)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    out = run(quick="--quick" in sys.argv)
    print(format_table(out))
    print(json.dumps(out, sort_keys=True))

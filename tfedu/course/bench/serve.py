"""``tfedu bench serve``: continuous batching with the paged KV cache against ``transformers``' static batches.

A server receives requests at different times, with prompts and answers of different lengths. Two
ways to serve the same arrival trace, greedily, float32, on the CPU:

- **static batching** (the peer): whenever the server is idle it takes up to ``max_batch`` requests
  that have arrived and runs ``transformers``' ``generate`` on them together (left-padded prompts,
  an attention mask, its ``DynamicCache``) for the batch's longest answer; each request keeps its own
  number of tokens. A short answer waits for the longest in its batch, and a request that arrives
  during a batch waits for the whole batch.
- **continuous batching** (``tfedu.batching.serve``): at every step the scheduler admits the requests
  that have arrived into the running batch (when a row and KV-cache blocks are free), prefills them,
  decodes one token for every running request, and retires the finished ones at once, freeing their
  blocks (``tfedu.paged.PagedKVCache``).

Two models: the course GPT (``data/course-gpt``, 0.8M parameters, n_ctx 128) and a model of GPT-2
small's shape (124M parameters, random weights from a fixed seed; nothing is downloaded), each run by
tfedu and, with the same weights, by ``transformers`` (``hf_from_gpt`` / ``gpt_from_hf``).

The trace: prompt lengths uniform, answer lengths log-uniform (many short answers and a few long
ones, as in chat traffic), arrivals a Poisson process whose rate is twice what the continuous server
can serve (measured from one decode step at a full batch before the run), so that both servers are
busy and a queue forms: tokens/s measures the server, not the arrivals. Every request's tokens from
the two servers are asserted identical before any time is reported (and the tests check the
continuous server against decoding each request alone). Tokens/s = the requests' new tokens / the
seconds from the start of the trace to the last answer; latency = answer time - arrival time.

The servers take turns for a model's ``rounds`` rounds (A B A B); ratios come from each server's best round (the
least disturbed), medians beside them. Goal: continuous >= 2x static tokens/s on the CPU.

``--quick`` runs a tiny model on one CPU thread: it checks that the bench runs, not the speed.
"""

from __future__ import annotations

import math
import os
import statistics
import sys

from tfedu.course.bench.common import device_description, machine, quick_threads, version
from tfedu.course.bench.model import GPT2_SMALL, hf_gpt2

GOALS = {"continuous_vs_static": 2.0}
FULL = {
    "models": {
        "course-gpt": {"requests": 96, "max_batch": 8, "prompt": (8, 32), "new_tokens": (4, 96), "rounds": 5},
        "gpt2-small": {**GPT2_SMALL, "requests": 48, "max_batch": 8, "prompt": (8, 64), "new_tokens": (8, 256),
                       "rounds": 2},
    },
    "block_size": 16, "load": 2.0,
}
QUICK = {
    "models": {
        "tiny": {"d_vocab": 256, "n_ctx": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "requests": 6, "max_batch": 2,
                 "prompt": (2, 8), "new_tokens": (2, 12), "rounds": 1},
    },
    "block_size": 4, "load": 2.0,
}
SERVERS = ("continuous", "static")
LABELS = {"continuous": "tfedu continuous batching, paged cache", "static": "transformers generate, static batches"}


def trace(spec: dict, d_vocab: int, step_seconds: float, seed: int = 0, prompts: list | None = None) -> list:
    """The requests (``tfedu.batching.random_trace``), arriving at ``load`` times what a full batch serves.

    That rate is ``max_batch / (mean answer length * step_seconds)`` requests a second, for a step of
    ``step_seconds``; the mean of a log-uniform length between a and b is ``(b - a) / ln(b / a)``.
    """
    from tfedu.batching import random_trace

    lo, hi = spec["new_tokens"]
    mean = (hi - lo) / math.log(hi / lo) if hi > lo else lo
    rate = spec["load"] * spec["max_batch"] / (mean * step_seconds)
    return random_trace(spec["requests"], prompt_lengths=spec["prompt"], new_tokens=spec["new_tokens"], rate=rate,
                        texts=prompts, d_vocab=None if prompts is not None else d_vocab, seed=seed)


def hf_batch_generator(hf):
    """``generate_batch(prompts, max_new_tokens) -> new tokens per prompt``: transformers' generate, left-padded."""
    import warnings

    from tfedu.generate import pad_prompts

    pad = 0  # any id: the attention mask hides it and the positions skip it

    def generate_batch(prompts, max_new_tokens):
        ids, padding_mask = pad_prompts(prompts, pad_id=pad)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # generation-config chatter
            out = hf.generate(ids, attention_mask=padding_mask.long(), max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, do_sample=False, use_cache=True, eos_token_id=None,
                              pad_token_id=pad)
        return list(out[:, ids.shape[1]:])

    return generate_batch


def decode_step_seconds(model, max_batch: int, context: int, repeats: int = 10) -> float:
    """The fastest of ``repeats`` decode steps of ``model`` at a full batch after ``context`` cached positions.

    The fastest, after a first call to warm up: load elsewhere on the machine only slows a step, and a
    rate set from a slowed step would leave the servers waiting for requests.
    """
    import time

    import torch

    from tfedu.kv_cache import KVCache

    ids = torch.zeros(max_batch, context, dtype=torch.long)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            cache = KVCache.for_model(model, max_batch, capacity=context + 1)
            model(ids, kv_cache=cache)
            start = time.perf_counter()
            model(ids[:, :1], kv_cache=cache)
            times.append(time.perf_counter() - start)
    return min(times[1:])


def models_for(name: str, spec: dict):
    """``(tfedu model, transformers model, prompts or None)`` holding the same weights, in evaluation mode."""
    import torch

    from tfedu.checkpoints import gpt_from_hf, hf_from_gpt

    if name == "course-gpt":
        from tfedu.experiments import course_gpt

        ours, tokenizer = course_gpt.load()
        _, val = course_gpt.datasets(tokenizer)
        ids = torch.as_tensor(val.ids, dtype=torch.long)
        prompts = [ids[i:i + 256] for i in range(0, len(ids) - 256, 256)]  # held-out text to cut prompts from
        return ours.eval(), hf_from_gpt(ours).eval(), prompts
    hf = hf_gpt2(spec).eval()
    return gpt_from_hf(hf).eval(), hf, None


def summarize(requests: list, completions: list, seconds: float) -> dict:
    """Tokens/s over the whole trace and latency statistics (seconds) from one server's completions."""
    latencies = sorted(c.latency for c in completions)
    first = sorted(c.first_token - c.arrival for c in completions)
    tokens = sum(r.max_new_tokens for r in requests)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": latencies[min(len(latencies) - 1, math.ceil(0.9 * len(latencies)) - 1)],
        "time_to_first_token_mean_s": statistics.fmean(first),
    }


def first_mismatch(requests: list, a: list, b: list) -> str | None:
    """The first request whose new tokens differ between two servers, in words; None when all are equal."""
    import torch

    for request, x, y in zip(requests, a, b, strict=True):
        if x.tokens.shape != y.tokens.shape or not torch.equal(x.tokens, y.tokens):
            where = "their lengths" if x.tokens.shape != y.tokens.shape else \
                f"new token {int((x.tokens != y.tokens).nonzero()[0])}"
            return f"request {request.id} (prompt of {len(request.prompt)}, {request.max_new_tokens} new tokens): {where}"
    return None


def bench_model(name: str, spec: dict, cfg: dict) -> dict:
    """Both servers on one model's trace: identical tokens asserted, then ``rounds`` interleaved rounds."""
    import torch

    from tfedu.batching import serve, serve_static

    ours, hf, prompts = models_for(name, spec)
    max_batch, block_size = spec["max_batch"], cfg["block_size"]
    context = (spec["prompt"][1] + spec["new_tokens"][1]) // 2
    step = decode_step_seconds(ours, max_batch, context)
    requests = trace({**spec, "load": cfg["load"]}, ours.cfg.d_vocab, step, prompts=prompts)
    generate_batch = hf_batch_generator(hf)
    longest = max(len(r.prompt) + r.max_new_tokens - 1 for r in requests)
    n_blocks = max_batch * -(-longest // block_size)
    runs = {
        "continuous": lambda: serve(ours, requests, n_blocks=n_blocks, block_size=block_size, max_batch=max_batch),
        "static": lambda: serve_static(generate_batch, requests, batch_size=max_batch),
    }
    results: dict[str, list[dict]] = {server: [] for server in SERVERS}
    outputs = {}
    with torch.inference_mode():
        for _ in range(spec["rounds"]):
            for server in SERVERS:
                completions = runs[server]()
                seconds = max(c.finish for c in completions)
                outputs[server] = completions
                results[server].append(summarize(requests, completions, seconds))
            mismatch = first_mismatch(requests, outputs["continuous"], outputs["static"])
            assert mismatch is None, (f"{name}: continuous batching and transformers' static batches decoded other tokens "
                                      f"({mismatch}): the timings would compare unequal work")
    best = {server: max(results[server], key=lambda r: r["tokens_per_s"]) for server in SERVERS}
    medians = {server: statistics.median(r["tokens_per_s"] for r in results[server]) for server in SERVERS}
    lengths = [r.max_new_tokens for r in requests]
    return {
        "n_params": sum(p.numel() for p in ours.parameters()),
        "shape": {key: ours.cfg.as_dict()[key] for key in ("d_vocab", "n_ctx", "d_model", "n_layers", "n_heads")},
        "requests": len(requests), "max_batch": max_batch, "block_size": block_size, "n_blocks": n_blocks,
        "prompt_lengths": list(spec["prompt"]), "new_token_range": list(spec["new_tokens"]),
        "new_tokens_mean": statistics.fmean(lengths), "new_tokens_total": sum(lengths),
        "decode_step_s": step, "arrival_rate_per_s": len(requests) / max(requests[-1].arrival, 1e-9),
        "last_arrival_s": requests[-1].arrival,
        "tokens_identical": True,  # asserted above, every round
        "rounds": results,
        "best": best,
        "tokens_per_s_median": medians,
        "ratio": best["continuous"]["tokens_per_s"] / best["static"]["tokens_per_s"],
        "ratio_median": medians["continuous"] / medians["static"],
    }


def run(quick: bool = False) -> dict:
    """Both servers on every model of the configuration (CPU only)."""
    with quick_threads(quick):
        return _run(quick)


def _run(quick: bool) -> dict:
    import torch
    import transformers

    cfg = QUICK if quick else FULL
    result: dict = {
        "quick": quick,
        "decoding": "greedy, float32, CPU; tfedu under torch.inference_mode, transformers' generate under its no_grad",
        **machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": version("numpy"),
        "goals": GOALS,
        "devices": {"cpu": device_description("cpu")},
        "load": cfg["load"],
        "models": {},
    }
    for name, spec in cfg["models"].items():
        result["models"][name] = bench_model(name, spec, cfg)
    ratios = [m["ratio"] for m in result["models"].values()]
    result["continuous_vs_static"] = min(ratios)  # the headline: the worst model, not the best
    result["goal_met"] = result["continuous_vs_static"] >= GOALS["continuous_vs_static"]
    result["tokens_identical"] = all(m["tokens_identical"] for m in result["models"].values())
    result["load_average_1min_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return result


def format_table(r: dict) -> str:
    """The results as a plain-text table (the JSON holds the same numbers)."""
    lines = [
        f"tfedu bench serve{' (quick: sizes too small to mean anything)' if r['quick'] else ''}",
        f"{r['decoding']}; torch {r['torch']}, transformers {r['transformers']}; load average "
        f"{r['load_average_1min']} at the start, {r['load_average_1min_end']} at the end",
        f"cpu: {r['devices']['cpu']['name']}, {r['devices']['cpu']['cpu_count']} CPUs, torch threads "
        f"{r['devices']['cpu']['torch_threads']}",
    ]
    for name, m in r["models"].items():
        s = m["shape"]
        lines += [
            "",
            f"{name}: d_model {s['d_model']}, {s['n_layers']} layers, vocab {s['d_vocab']}, n_ctx {s['n_ctx']}, "
            f"{m['n_params'] / 1e6:.1f}M parameters",
            f"  {m['requests']} requests: prompts of {m['prompt_lengths'][0]}-{m['prompt_lengths'][1]} tokens, answers "
            f"{m['new_token_range'][0]}-{m['new_token_range'][1]} (log-uniform, mean {m['new_tokens_mean']:.1f}, "
            f"{m['new_tokens_total']} in all); Poisson arrivals, the last at {m['last_arrival_s']:.2f} s "
            f"(rate {r['load']}x what a full batch at {m['decode_step_s'] * 1e3:.1f} ms a step serves); "
            f"batches of {m['max_batch']}, blocks of {m['block_size']}",
            f"  {'server':<42}{'tokens/s':>10}{'(median)':>10}{'seconds':>9}{'latency':>9}{'p90':>8}{'first':>8}",
        ]
        for server in SERVERS:
            b = m["best"][server]
            lines.append(f"  {LABELS[server]:<42}{b['tokens_per_s']:>10.1f}{m['tokens_per_s_median'][server]:>10.1f}"
                         f"{b['seconds']:>9.2f}{b['latency_mean_s']:>9.2f}{b['latency_p90_s']:>8.2f}"
                         f"{b['time_to_first_token_mean_s']:>8.2f}")
        lines.append(f"  continuous / static tokens/s: {m['ratio']:.2f} best ({m['ratio_median']:.2f} median); tokens "
                     f"identical: {m['tokens_identical']} (latency: mean and p90 seconds from arrival to the last "
                     "token; first: to the first token)")
    lines += ["", f"continuous_vs_static {r['continuous_vs_static']:.2f} (goal {r['goals']['continuous_vs_static']}: "
              f"{'met' if r['goal_met'] else 'NOT met'}; the worst model)"]
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    out = run(quick="--quick" in sys.argv)
    print(format_table(out))
    print(json.dumps(out, sort_keys=True))

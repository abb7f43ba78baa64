"""``tfedu bench attention``: the course's FlashAttention against torch's attention kernels.

**On CUDA** (``--device cuda``): the Triton kernel of ``tfedu.kernels`` against
``F.scaled_dot_product_attention`` with each of its backends forced in turn
(``torch.nn.attention.sdpa_kernel``): ``FLASH_ATTENTION`` (FlashAttention-2's CUDA code),
``CUDNN_ATTENTION`` (NVIDIA's cuDNN kernel) and ``MATH`` (plain matmul-softmax-matmul, for scale).
bfloat16, pos N in {1024, 4096, 16384}, d_head in {64, 128}, causal and not. As in the
FlashAttention papers, the tokens per call are held at 16k (batch = 16384 / N) and the width at
2048 (n_heads = 2048 / d_head): batch 4 x 16 heads at N = 4096, d_head 128. Before any timing
every output and gradient is compared with the flash backend's. The forward pass is timed under
``torch.no_grad()``; forward+backward as ``torch.autograd.grad`` of the output. Each call
is timed with CUDA events after warm-up (the Triton kernel autotunes on its first calls), the
contenders taking turns; reported by the median.

FLOPs, the FlashAttention papers' convention: the forward pass is two matmuls of
(N x d_head) by (d_head x N) size, 4 * batch * n_heads * N^2 * d_head FLOPs, halved when causal
(only the lower triangle is computed); the backward pass is five such matmuls, counted as 2.5x the
forward (recomputing P is not counted). TFLOP/s = those FLOPs / median seconds.

Ratios are the peer's time over Triton's (above 1: the course's kernel is faster). The goals:
forward >= 1.0x the flash backend and >= 0.7x cuDNN; forward+backward >= 0.8x the flash backend.

**On the CPU** (``--device cpu``, the default without a GPU): the PyTorch tiles of ``tfedu.flash``
(``flash_attention``: the same algorithm in plain torch) against plain attention
(``tfedu.flash.standard_attention``, which holds the whole (N x N) scores) and against
``F.scaled_dot_product_attention``, float32, N up to 8192: seconds and peak memory
(``tfedu.flash.peak_memory``), ratios to the tiles from the best of 5 interleaved calls. The Triton kernel is not timed there: the
CPU interpreter runs it through numpy for reading, not for speed.

``--quick`` runs small sizes once: it checks that the bench runs, not the speed.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

from tfedu.course.bench.common import device_description, device_lines, devices_to_run, interleaved, machine, summary, timed, version

GOALS = {"forward_vs_flash": 1.0, "forward_vs_cudnn": 0.7, "fwd_bwd_vs_flash": 0.8}
TOKENS = 16384  # batch * N, held constant
WIDTH = 2048  # n_heads * d_head
FLOPS = ("forward: 4 * batch * n_heads * N^2 * d_head, halved when causal; backward: 2.5x forward "
         "(fwd+bwd: 3.5x forward)")
CUDA_FULL = {"lengths": (1024, 4096, 16384), "head_dims": (64, 128), "warmup": 3, "rounds": 20}
CUDA_QUICK = {"lengths": (1024,), "head_dims": (64,), "warmup": 1, "rounds": 3}
MATH_MAX_N = 4096  # the math backend holds batch * n_heads * N^2 scores (17 GB at N = 16384): skipped above
AGREE_ATOL = 3e-2  # bfloat16 outputs and gradients against the flash backend's
# block: the tiles' block_q = block_k (in Python on a CPU, bigger tiles mean fewer loop steps).
CPU_FULL = {"lengths": (1024, 2048, 4096, 8192), "batch": 1, "n_heads": 4, "d_head": 64, "rounds": 5, "block": 256}
CPU_QUICK = {"lengths": (128, 256), "batch": 1, "n_heads": 2, "d_head": 32, "rounds": 1, "block": 64}
SDPA_BACKENDS = ("flash", "cudnn", "math")
CONTENDERS = ("triton", *(f"sdpa_{b}" for b in SDPA_BACKENDS))
LABELS = {"triton": "tfedu Triton kernel", "sdpa_flash": "SDPA flash backend", "sdpa_cudnn": "SDPA cuDNN backend",
          "sdpa_math": "SDPA math backend", "tiles": "tfedu.flash tiles (PyTorch)", "standard": "standard (N x N)",
          "sdpa": "F.scaled_dot_product_attention"}


def attention_flops(batch: int, n_heads: int, n: int, d_head: int, causal: bool, backward: bool = False) -> float:
    """FLOPs of one attention call (see the module docstring); ``backward=True``: forward and backward.

    >>> attention_flops(4, 16, 4096, 128, causal=False) / 1e12  # 4 * 4 * 16 * 4096^2 * 128
    0.549755813888
    >>> attention_flops(4, 16, 4096, 128, causal=True, backward=True) / attention_flops(4, 16, 4096, 128, causal=False)
    1.75
    """
    forward = 4.0 * batch * n_heads * n * n * d_head / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


# ----------------------------------------------------------------------------- CUDA


def sdpa_with_backend(backend: str) -> Callable:
    """``F.scaled_dot_product_attention`` restricted to one backend ("flash", "cudnn" or "math")."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
    chosen = getattr(SDPBackend, names[backend], None)
    if chosen is None:
        raise RuntimeError(f"this torch has no SDPBackend.{names[backend]}")

    def attend(q, k, v, causal):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attend


def contenders_for_cuda(n: int) -> tuple[dict[str, Callable], dict[str, str]]:
    """The attention functions ``fn(q, k, v, causal)`` to time at length ``n``, and why any are left out."""
    skipped = {}
    fns: dict[str, Callable] = {}
    import tfedu.kernels as kernels

    ok, how = kernels.available()
    if ok and not kernels.INTERPRETED:
        fns["triton"] = lambda q, k, v, causal: kernels.flash_attention(q, k, v, causal=causal)
    else:
        skipped["triton"] = how if not ok else "Triton runs in its CPU interpreter here (TRITON_INTERPRET=1)"
    for backend in SDPA_BACKENDS:
        if backend == "math" and n > MATH_MAX_N:
            skipped[f"sdpa_{backend}"] = f"N > {MATH_MAX_N}: the (N x N) scores would not fit"
            continue
        try:
            fns[f"sdpa_{backend}"] = sdpa_with_backend(backend)
        except RuntimeError as err:
            skipped[f"sdpa_{backend}"] = str(err)
    return fns, skipped


def cuda_seconds(fn: Callable[[], object]) -> float:
    """Seconds of one ``fn()`` on the GPU, by CUDA events (the queue's time, not Python's)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def bench_cuda_shape(n: int, d_head: int, causal: bool, warmup: int, rounds: int, dtype=None) -> dict:
    """One row: agreement, then forward and fwd+bwd times of every contender at one shape."""
    import torch

    dtype = dtype or torch.bfloat16
    batch, n_heads = max(1, TOKENS // n), WIDTH // d_head
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(batch, n_heads, n, d_head, device="cuda", dtype=dtype, generator=generator)
                   for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    fns, skipped = contenders_for_cuda(n)
    row: dict = {"N": n, "d_head": d_head, "causal": causal, "batch": batch, "n_heads": n_heads,
                 "dtype": str(dtype).removeprefix("torch."), "skipped": skipped, "errors": {}, "agreement": {}}

    def forward(fn):
        def call():
            with torch.no_grad():  # inference: nothing kept for a backward pass
                return fn(q, k, v, causal)

        return call

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)

    # Agreement first (this also compiles and autotunes the Triton kernel): outputs and gradients
    # against the flash backend's. A contender that fails here is reported and left out.
    results = {}
    for name, fn in list(fns.items()):
        try:
            out = fn(q, k, v, causal)
            results[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v), do))
        except Exception as err:  # e.g. cuDNN missing for this shape, out of memory
            row["errors"][name] = f"{type(err).__name__}: {err}"
            del fns[name]
        torch.cuda.empty_cache()
    reference = results.get("sdpa_flash")
    for name, tensors in results.items():
        if reference is None:
            break
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(tensors, reference)]
        row["agreement"][name] = {"max_abs_out_diff": diffs[0], "max_abs_grad_diff": max(diffs[1:]),
                                  "agrees": max(diffs) <= AGREE_ATOL}
    del results, reference

    for mode, wrap in (("forward", forward), ("fwd_bwd", fwd_bwd)):
        calls = {name: wrap(fn) for name, fn in fns.items()}
        for call in calls.values():
            for _ in range(warmup):
                call()
        times = interleaved({name: functools.partial(cuda_seconds, call) for name, call in calls.items()}, rounds)
        flops = attention_flops(batch, n_heads, n, d_head, causal, backward=mode == "fwd_bwd")
        row[mode] = {}
        for name, call in calls.items():
            timing = summary(times[name])
            timing["tflops"] = flops / timing["median_s"] / 1e12
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            call()
            torch.cuda.synchronize()
            timing["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before  # beyond q, k, v, dO
            row[mode][name] = timing
    row["ratios"] = cuda_ratios(row)
    return row


def cuda_ratios(row: dict) -> dict:
    """Peer's median time over Triton's, for each mode and peer present (above 1: Triton faster)."""
    ratios = {}
    for mode in ("forward", "fwd_bwd"):
        timings = row.get(mode, {})
        if "triton" not in timings:
            continue
        for peer in ("flash", "cudnn", "math"):
            if f"sdpa_{peer}" in timings:
                ratios[f"{mode}_vs_{peer}"] = timings[f"sdpa_{peer}"]["median_s"] / timings["triton"]["median_s"]
    return ratios


def summarize_cuda(rows: list[dict]) -> dict:
    """The worst ratio over all shapes for each goal, and whether it meets the goal."""
    worst = {}
    for key in GOALS:
        values = [row["ratios"][key] for row in rows if key in row["ratios"]]
        worst[key] = min(values) if values else None
    met = {key: (value >= GOALS[key]) if value is not None else None for key, value in worst.items()}
    agree = all(a["agrees"] for row in rows for a in row["agreement"].values())
    return {"worst": worst, "goals_met": met, "all_agree": agree}


def run_cuda(quick: bool) -> dict:
    import torch

    cfg = CUDA_QUICK if quick else CUDA_FULL
    rows = [bench_cuda_shape(n, d_head, causal, cfg["warmup"], cfg["rounds"])
            for d_head in cfg["head_dims"] for n in cfg["lengths"] for causal in (False, True)]
    return {"dtype": "bfloat16", "tokens_per_call": TOKENS, "width": WIDTH, "warmup": cfg["warmup"],
            "rounds": cfg["rounds"], "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "rows": rows, **summarize_cuda(rows)}


# ----------------------------------------------------------------------------- CPU


def bench_cpu_shape(flash, n: int, batch: int, n_heads: int, d_head: int, causal: bool, rounds: int, block: int) -> dict:
    """One row: tfedu.flash's tiles, standard attention and SDPA at one length: seconds and peak memory."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, n_heads, n, d_head, generator=generator) for _ in range(3))
    fns = {
        "tiles": functools.partial(flash.flash_attention, causal=causal, block_q=block, block_k=block),
        "standard": functools.partial(flash.standard_attention, causal=causal),
        "sdpa": functools.partial(F.scaled_dot_product_attention, is_causal=causal),
    }
    row: dict = {"N": n, "batch": batch, "n_heads": n_heads, "d_head": d_head, "causal": causal, "agreement": {},
                 "peak_bytes": {}}
    with torch.no_grad():
        outputs = {}
        for name, fn in fns.items():
            outputs[name], row["peak_bytes"][name] = flash.peak_memory(fn, q, k, v)
        for name, out in outputs.items():
            row["agreement"][name] = (out - outputs["sdpa"]).abs().max().item()
        del outputs
        times = interleaved({name: (lambda fn=fn: timed(lambda: fn(q, k, v))[0]) for name, fn in fns.items()}, rounds)
    row["timings"] = {name: summary(seconds) for name, seconds in times.items()}
    # Ratios of the best calls, the least disturbed by other work on a shared CPU (as the other benches do).
    tiles = row["timings"]["tiles"]["best_s"]
    row["ratios"] = {f"tiles_vs_{peer}": row["timings"][peer]["best_s"] / tiles for peer in ("standard", "sdpa")}
    row["memory_ratios"] = {f"{peer}_over_tiles": row["peak_bytes"][peer] / max(1, row["peak_bytes"]["tiles"])
                            for peer in ("standard", "sdpa")}
    return row


def run_cpu(quick: bool) -> dict:
    try:
        import tfedu.flash as flash
    except ImportError as err:
        return {"skipped": f"tfedu.flash (the PyTorch tiles) is not importable here: {err}"}
    cfg = CPU_QUICK if quick else CPU_FULL
    rows = [bench_cpu_shape(flash, n, cfg["batch"], cfg["n_heads"], cfg["d_head"], causal, cfg["rounds"], cfg["block"])
            for n in cfg["lengths"] for causal in (False, True)]
    return {"dtype": "float32", "rounds": cfg["rounds"], "block": cfg["block"], "rows": rows,
            "memory": "tfedu.flash.peak_memory: bytes of the tensors torch ops create during one forward call "
                      "(inputs and kernel workspace not counted)",
            "max_abs_diff": max(max(row["agreement"].values()) for row in rows)}


# ----------------------------------------------------------------------------- both


def run(quick: bool = False, device: str | None = None) -> dict:
    """Measure on ``device``: "cpu", "cuda", or None for the CPU and then CUDA when present."""
    import torch

    devices = devices_to_run("attention", device)
    import tfedu.kernels as kernels  # before anything imports triton: it may switch on the interpreter

    result: dict = {
        "quick": quick,
        **machine(),
        "torch": torch.__version__,
        "triton": version("triton"),
        "triton_available": list(kernels.available()),
        "flop_convention": FLOPS,
        "goals": GOALS,
        "devices": {d: device_description(d) for d in devices},
    }
    if "cpu" in devices:
        result["cpu"] = run_cpu(quick)
    if "cuda" in devices:
        result["cuda"] = run_cuda(quick)
    result["load_average_1min_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return result


def _bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_table(r: dict) -> str:
    """The results as a plain-text table (the JSON holds the same numbers)."""
    lines = [f"tfedu bench attention{' (quick: sizes too small to mean anything)' if r['quick'] else ''}",
             f"torch {r['torch']}, triton {r['triton'] or 'not installed'}: "
             f"{'' if r['triton_available'][0] else 'kernel NOT usable: '}{r['triton_available'][1]}",
             f"load average {r['load_average_1min']} at the start, {r['load_average_1min_end']} at the end"]
    lines += device_lines(r["devices"])
    if "cpu" in r:
        lines += ["", *format_cpu(r["cpu"])]
    if "cuda" in r:
        lines += ["", *format_cuda(r["cuda"], r["goals"])]
    return "\n".join(lines)


def format_cpu(c: dict) -> list[str]:
    if "skipped" in c:
        return [f"cpu: skipped: {c['skipped']}"]
    lines = [f"cpu, float32, forward only, best of {c['rounds']} interleaved calls (seconds); tiles of "
             f"{c['block']} x {c['block']}; memory: {c['memory']}",
             f"{'N':>6} {'causal':<7}{'tiles s':>10}{'standard s':>12}{'sdpa s':>10}{'vs std':>8}{'vs sdpa':>8}"
             f"{'tiles mem':>14}{'standard mem':>14}{'sdpa mem':>14}{'max |diff|':>12}"]
    for row in c["rows"]:
        t, m = row["timings"], row["peak_bytes"]
        lines.append(f"{row['N']:>6} {str(row['causal']):<7}{t['tiles']['best_s']:>10.4f}"
                     f"{t['standard']['best_s']:>12.4f}{t['sdpa']['best_s']:>10.4f}"
                     f"{row['ratios']['tiles_vs_standard']:>8.2f}{row['ratios']['tiles_vs_sdpa']:>8.2f}"
                     f"{_bytes(m['tiles']):>14}{_bytes(m['standard']):>14}{_bytes(m['sdpa']):>14}"
                     f"{max(row['agreement'].values()):>12.1e}")
    lines.append(f"(batch {c['rows'][0]['batch']}, {c['rows'][0]['n_heads']} heads, d_head {c['rows'][0]['d_head']}; "
                 "vs: the peer's time over the tiles', above 1: the tiles faster; max |diff| against SDPA)")
    return lines


def format_cuda(c: dict, goals: dict) -> list[str]:
    lines = [f"cuda, {c['dtype']}, {c['tokens_per_call']} tokens per call, width {c['width']}; "
             f"median of {c['rounds']} interleaved rounds (TFLOP/s; {FLOPS})"]
    for row in c["rows"]:
        title = f"N {row['N']}, d_head {row['d_head']}, {'causal' if row['causal'] else 'not causal'} " \
                f"(batch {row['batch']} x {row['n_heads']} heads)"
        lines += ["", f"{title:<52}{'fwd TFLOP/s':>12}{'fwd+bwd':>10}{'fwd mem':>12}{'max |dout|':>12}{'max |dgrad|':>12}"]
        for name in CONTENDERS:
            if name in row.get("forward", {}):
                fwd, both = row["forward"][name], row["fwd_bwd"][name]
                agree = row["agreement"].get(name, {})
                lines.append(f"  {LABELS[name]:<50}{fwd['tflops']:>12.1f}{both['tflops']:>10.1f}"
                             f"{_bytes(fwd['peak_extra_bytes']):>12}"
                             f"{agree.get('max_abs_out_diff', float('nan')):>12.1e}"
                             f"{agree.get('max_abs_grad_diff', float('nan')):>12.1e}")
            elif name in row["errors"]:
                lines.append(f"  {LABELS[name]:<50}failed: {row['errors'][name]}")
            elif name in row["skipped"]:
                lines.append(f"  {LABELS[name]:<50}skipped: {row['skipped'][name]}")
        if row["ratios"]:
            lines.append("  Triton vs: " + ", ".join(f"{key} {value:.2f}" + (f" (goal {goals[key]})" if key in goals else "")
                                                     for key, value in row["ratios"].items()))
    worst = c["worst"]
    lines.append("")
    lines.append("worst over shapes (peer's time / Triton's; above 1: Triton faster): " + "; ".join(
        f"{key} {'n/a' if value is None else f'{value:.2f}'} (goal {goals[key]}: "
        f"{'n/a' if c['goals_met'][key] is None else 'met' if c['goals_met'][key] else 'NOT met'})"
        for key, value in worst.items()))
    if not c["all_agree"]:
        lines.append(f"WARNING: some outputs or gradients differ from the flash backend's by more than {AGREE_ATOL}")
    return lines


if __name__ == "__main__":
    import json

    out = run(quick="--quick" in sys.argv)
    print(format_table(out))
    print(json.dumps(out, sort_keys=True))

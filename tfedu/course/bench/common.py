"""What every ``tfedu bench`` module shares: timing, the machine's description, library versions.

Timings on a shared machine are disturbed by whatever else runs on it, in bursts. Two defences:
*interleave* the contenders (A B C A B C ...) so that a burst hits all of them rather than one,
and report the **best** time (the least disturbed run) beside the **median** (the typical one).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def timed(fn: Callable[[], object], sync: Callable[[], None] | None = None) -> tuple[float, object]:
    """Wall seconds of one call of ``fn()``, and its result.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the clock starts and before it stops,
    so that work queued on an accelerator is counted in full.

    >>> seconds, result = timed(lambda: sum(range(10)))
    >>> result, seconds >= 0
    (45, True)
    """
    if sync is not None:
        sync()
    start = time.perf_counter()
    result = fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start, result


def best_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """The shortest wall time of ``repeats`` calls of ``fn()``, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        seconds, result = timed(fn)
        best = min(best, seconds)
    return best, result


def interleaved(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Call every ``fn`` once per round, in turn (A B C, A B C, ...); each returns its own seconds.

    >>> times = interleaved({"a": lambda: 1.0, "b": lambda: 2.0}, rounds=3)
    >>> times["b"], summary(times["b"])["median_s"]
    ([2.0, 2.0, 2.0], 2.0)
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(fn())
    return times


def summary(seconds: list[float]) -> dict:
    """Best and median of a list of timings, plus the list itself (JSON-ready).

    >>> summary([3.0, 1.0, 2.0])
    {'best_s': 1.0, 'median_s': 2.0, 'all_s': [3.0, 1.0, 2.0]}
    """
    return {"best_s": min(seconds), "median_s": statistics.median(seconds), "all_s": list(seconds)}


def version(module: str) -> str | None:
    """``module.__version__``, or None when it is not installed.

    >>> version("no_such_module_here") is None
    True
    """
    try:
        return __import__(module).__version__
    except Exception:
        return None


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict:
    """The machine a bench ran on: Python, OS, CPU model and count, the load when it started."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def device_description(device: str) -> dict:
    """The CPU (model, cores, torch's threads) or the GPU (name, memory, capability)."""
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        }
    info = machine()
    return {
        "name": info["cpu_model"],
        "cpu_count": info["cpu_count"],
        "torch_threads": torch.get_num_threads(),  # left at torch's default, recorded
        "torch_interop_threads": torch.get_num_interop_threads(),
    }


@contextmanager
def quick_threads(quick: bool) -> Iterator[None]:
    """For a ``--quick`` run, one torch thread inside the block; the count is put back after.

    Tiny sizes on a busy machine: every op of a multi-threaded CPU kernel waits for a thread another
    process holds (a tiny forward pass took 0.15 s on 2 threads of a loaded 2-core machine, 2 ms on one).
    --quick checks the bench runs, not the speed. A full run keeps torch's default.
    """
    import torch

    threads = torch.get_num_threads()
    if quick:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def device_lines(devices: dict[str, dict]) -> list[str]:
    """One line per device of a bench's ``devices`` (``device_description``'s dicts), for its table.

    >>> device_lines({"cpu": {"name": "x86", "cpu_count": 2, "torch_threads": 2}})
    ['cpu: x86, 2 CPUs, torch threads 2']
    """
    lines = []
    for name, d in devices.items():
        if name == "cpu":
            lines.append(f"cpu: {d['name']}, {d['cpu_count']} CPUs, torch threads {d['torch_threads']}")
        else:
            lines.append(f"{name}: {d['name']}, {d['memory_gib']} GiB, capability {d['capability']}, CUDA {d['cuda']}")
    return lines


def devices_to_run(bench: str, device: str | None) -> list[str]:
    """The devices a bench measures: ``device`` alone, or the CPU and then CUDA when present (None or "auto")."""
    import torch

    if device not in (None, "auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or None (both when CUDA is present), got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"tfedu bench {bench} --device cuda: torch sees no CUDA device")
    devices = ["cpu", "cuda"] if device in (None, "auto") else [device]
    return [d for d in devices if d == "cpu" or torch.cuda.is_available()]

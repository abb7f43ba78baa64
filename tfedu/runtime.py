"""Where the course runs: the device to use and the seeds that make runs repeatable.

Built and explained in notebooks/00_start_here.ipynb.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

DEVICE_ENV_VAR = "TFEDU_DEVICE"


def device() -> torch.device:
    """The device the course computes on: CUDA, then Apple's MPS, then the CPU.

    Set the environment variable ``TFEDU_DEVICE`` (for example ``cpu`` or ``cuda:1``)
    to choose by hand.

    >>> device().type in {"cpu", "cuda", "mps"}
    True
    """
    chosen = os.environ.get(DEVICE_ENV_VAR, "").strip()
    if chosen:
        try:
            dev = torch.device(chosen)
        except RuntimeError as err:
            raise ValueError(
                f"{DEVICE_ENV_VAR}={chosen!r} is not a device torch knows; expected e.g. 'cpu', 'cuda', 'cuda:0', 'mps'"
            ) from err
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{DEVICE_ENV_VAR}={chosen!r} asks for CUDA, but torch sees no CUDA GPU here")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise RuntimeError(f"{DEVICE_ENV_VAR}={chosen!r} asks for MPS, but torch sees no Apple GPU here")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def bfloat16_native(dev: torch.device | str) -> bool:
    """Whether ``dev`` computes in bfloat16 in hardware: a CUDA GPU of compute capability 8.0 or newer (Ampere on).

    ``torch.cuda.is_bf16_supported()`` is also true on older GPUs such as Colab's T4 (7.5), where bfloat16 is
    emulated: it runs, far slower than float16. Only CUDA is considered; the CPU and MPS answer False.

    >>> bfloat16_native("cpu")
    False
    """
    dev = torch.device(dev)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 0)


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch (CPU and every GPU) so a notebook gives the same numbers on re-run.

    Returns a fresh CPU ``torch.Generator`` seeded the same way, for code that wants its own stream.

    >>> _ = seed_everything(0); a = torch.rand(2)
    >>> _ = seed_everything(0); b = torch.rand(2)
    >>> bool((a == b).all())
    True
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)

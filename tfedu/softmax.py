"""The numerically stable softmax.

Built by hand in notebooks/00_start_here.ipynb (the warm-up exercise); its online,
one-pass form comes in notebooks/09_efficient_attention.ipynb.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor


def softmax(x: Float[Tensor, "..."], dim: int = -1) -> Float[Tensor, "..."]:
    """softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m), with m = max_j x_j.

    Subtracting the maximum changes nothing mathematically (it cancels between numerator
    and denominator) but keeps every exponent <= 0, so exp never overflows.

    >>> softmax(torch.tensor([1000.0, 1000.0]))
    tensor([0.5000, 0.5000])
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"softmax expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"softmax expects a floating-point tensor, got dtype {x.dtype}")
    shifted = x - x.amax(dim=dim, keepdim=True)
    exps = shifted.exp()
    return exps / exps.sum(dim=dim, keepdim=True)

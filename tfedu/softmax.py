"""Softmax four ways: stable (one line of torch), naive, safe in three passes, online in two.

The stable `softmax` is built by hand in notebooks/00_start_here.ipynb (the warm-up exercise).
notebooks/09_efficient_attention.ipynb follows deck 000's three versions, written as the loops
the deck draws, one position (or one block of positions) at a time along the last dim:

- `naive_softmax`: exp(x_i) / sum_j exp(x_j). Two passes over x; exp overflows for x_i > 88.7 in float32.
- `safe_softmax`: pass 1 finds the max m, pass 2 sums exp(x_j - m), pass 3 divides. Three passes.
- `online_softmax`: pass 1 keeps a running max and a running sum, rescaling the sum by
  exp(m_old - m_new) whenever the max grows (`online_softmax_step`); pass 2 divides. Two passes.
  FlashAttention (tfedu.flash) is this update applied to tiles of the attention scores.

The loops run over the last dim only and are vectorised over every other dim, so they are slow
for long rows (one Python iteration per block): they are here to be read and checked, not used.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor


def _check_scores(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} expects a floating-point tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} expects at least one dim (the scores along the last one), got a 0-d tensor")


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


def naive_softmax(x: Float[Tensor, "... n"]) -> Float[Tensor, "... n"]:
    """exp(x_i) / sum_j exp(x_j) along the last dim, with no shift: two passes over x.

    Exact in real numbers, but float32's exp overflows to inf above about 88.7, and inf / inf is nan.

    >>> naive_softmax(torch.tensor([1.0, 1.0]))
    tensor([0.5000, 0.5000])
    >>> naive_softmax(torch.tensor([1000.0, 1000.0]))
    tensor([nan, nan])
    """
    _check_scores("naive_softmax", x)
    total = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for i in range(x.shape[-1]):  # pass 1: the sum of the exponentials
        total = total + x[..., i].exp()
    return torch.stack([x[..., i].exp() / total for i in range(x.shape[-1])], dim=-1)  # pass 2


def safe_softmax(x: Float[Tensor, "... n"]) -> Float[Tensor, "... n"]:
    """Deck 000's safe softmax along the last dim: max, then sum, then divide: three passes over x.

    >>> safe_softmax(torch.tensor([1000.0, 1000.0]))
    tensor([0.5000, 0.5000])
    """
    _check_scores("safe_softmax", x)
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    for i in range(n):  # pass 1: m_i = max(m_{i-1}, x_i)
        m = torch.maximum(m, x[..., i])
    d = torch.zeros_like(m)
    for i in range(n):  # pass 2: d_i = d_{i-1} + exp(x_i - m_N)
        d = d + (x[..., i] - m).exp()
    return torch.stack([(x[..., i] - m).exp() / d for i in range(n)], dim=-1)  # pass 3: a_i = exp(x_i - m_N) / d_N


def online_softmax_step(
    m: Float[Tensor, "*rows"], l: Float[Tensor, "*rows"], x_block: Float[Tensor, "*rows block"]
) -> tuple[Float[Tensor, "*rows"], Float[Tensor, "*rows"]]:
    """One step of the online softmax: fold a block of scores into the running max ``m`` and sum ``l``.

    ``l`` is the sum of exp(x_j - m) over the scores seen so far. A new block may raise the max to
    m_new; every term already in ``l`` was computed against the old max, so ``l`` is rescaled by
    exp(m - m_new) (which is <= 1) before the block's own exp(x_j - m_new) are added:

        m_new = max(m, max_j x_block_j)
        l_new = l * exp(m - m_new) + sum_j exp(x_block_j - m_new)

    Start from m = -inf and l = 0 (exp(-inf - m_new) = 0 drops the empty start). Deck 000's loop
    takes one score per step; a block of scores per step is what FlashAttention does.

    >>> m, l = online_softmax_step(torch.tensor(float("-inf")), torch.tensor(0.0), torch.tensor([1.0, 3.0]))
    >>> m, l  # 3 and exp(1 - 3) + exp(3 - 3)
    (tensor(3.), tensor(1.1353))
    >>> online_softmax_step(m, l, torch.tensor([5.0]))  # the max grows: the old sum shrinks by exp(3 - 5)
    (tensor(5.), tensor(1.1537))
    """
    m_new = torch.maximum(m, x_block.amax(dim=-1))
    l_new = l * (m - m_new).exp() + (x_block - m_new[..., None]).exp().sum(dim=-1)
    return m_new, l_new


def online_softmax(x: Float[Tensor, "... n"], block: int = 1, step=online_softmax_step) -> Float[Tensor, "... n"]:
    """Deck 000's online softmax along the last dim: running max and sum in one pass, then divide.

    ``block`` scores are folded in per step (deck 000: one). ``step`` is the update, so a learner's
    own ``online_softmax_step`` can be run in its place.

    >>> x = torch.tensor([[1000.0, 1001.0, 999.0], [-3.0, 0.0, 3.0]])
    >>> torch.allclose(online_softmax(x, block=2), torch.softmax(x, dim=-1))
    True
    """
    _check_scores("online_softmax", x)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"online_softmax: block must be a positive int, got {block!r}")
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block):  # pass 1: running max and running sum together
        m, l = step(m, l, x[..., start:start + block])
    return (x - m[..., None]).exp() / l[..., None]  # pass 2: a_i = exp(x_i - m_N) / l_N

"""Attention without the N x N matrix: FlashAttention-2 as tiles in plain PyTorch, and linear attention.

Textbook attention (``standard_attention``) builds the scores S = scale * Q K^T and the weights
P = softmax(S), two (query_pos, key_pos) matrices: at 8192 positions that is 256 MiB each in
float32, per head, and it grows with the square of the length. Yet the output is only
(query_pos, d_head). Two ways out, both here:

* **FlashAttention** (Dao et al. 2022; FlashAttention-2, Dao 2023) computes *exactly* the
  same output one tile of scores at a time. The trick is the online softmax: keep, for every
  query row, a running maximum m and a running sum l of exp(S - m); when a new tile raises the
  maximum, rescale what was summed so far by exp(m_old - m_new). Memory drops from O(N^2) to
  O(N d + block_q * block_k). The backward pass recomputes each tile of P from the saved
  log-sum-exp instead of storing it. On a GPU the tiles live in fast on-chip SRAM and the win
  is speed; on a CPU in Python the loops cost time, but the memory saving is the same, and
  ``peak_memory`` measures it.
* **Linear attention** (Katharopoulos et al. 2020, "Transformers are RNNs") changes the model:
  replace exp(q . k) by phi(q) . phi(k) for a feature map phi. Then (phi(Q) phi(K)^T) V =
  phi(Q) (phi(K)^T V) by associativity, the (d_head, d_v) product is formed first, and the cost
  is linear in N. Causal linear attention is a running sum: an RNN whose state is a matrix.

The algorithm's variables keep the papers' names: m = running row max, l = running row sum,
O = unnormalised output accumulator, lse = log-sum-exp of each score row (m + log l).

Built by hand in notebooks/09_efficient_attention.ipynb (the online softmax of tfedu.softmax
grows into these tiles there).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tfedu.attention import _require_tensor, causal_mask, scaled_dot_product_attention

# ----------------------------------------------------------------------------- checks


def _check_qkv(q: object, k: object, v: object, causal: bool) -> None:
    _require_tensor("q", q, "(..., query_pos, d_head)")
    _require_tensor("k", k, "(..., key_pos, d_head)")
    _require_tensor("v", v, "(..., key_pos, d_v)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q (..., query_pos, d_head) = {tuple(q.shape)} and k (..., key_pos, d_head) = {tuple(k.shape)} "
            f"must share d_head (the last dim): {q.shape[-1]} != {k.shape[-1]}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k (..., key_pos, d_head) = {tuple(k.shape)} and v (..., key_pos, d_v) = {tuple(v.shape)} "
            f"must have the same key_pos (one value per key): {k.shape[-2]} != {v.shape[-2]}"
        )
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"q, k and v must have the same leading (batch, head) dims, got {tuple(q.shape[:-2])}, "
            f"{tuple(k.shape[:-2])} and {tuple(v.shape[:-2])} (no broadcasting here: expand them first)"
        )
    if k.shape[-2] == 0:
        raise ValueError(f"k has key_pos = 0: a softmax over no keys is undefined, give at least one key")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"causal=True needs query_pos == key_pos (query i sees keys 0..i, as with "
            f"F.scaled_dot_product_attention(is_causal=True)), got query_pos = {q.shape[-2]} and key_pos = {k.shape[-2]}"
        )


def _check_scale(scale: object, d_head: int) -> float:
    """The scale applied to q . k: 1/sqrt(d_head) unless given (Vaswani et al. 2017, section 3.2.1)."""
    if scale is None:
        return 1.0 / math.sqrt(d_head)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None (meaning 1/sqrt(d_head)), got {scale!r}")
    return float(scale)


def _check_size(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return n


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, float16 and bfloat16 accumulate in float32.

    A running sum of thousands of exps in float16 (10 bits of mantissa) loses the small terms:
    FlashAttention keeps m, l and O in float32 registers whatever the input's dtype.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- the textbook form


def standard_attention(
    q: Float[Tensor, "*batch query_pos d_head"],
    k: Float[Tensor, "*batch key_pos d_head"],
    v: Float[Tensor, "*batch key_pos d_v"],
    *,
    causal: bool = False,
    scale: float | None = None,
) -> Float[Tensor, "*batch query_pos d_v"]:
    """softmax(scale * q k^T) v the textbook way, materialising the (query_pos, key_pos) scores and weights.

    This is tfedu.attention.scaled_dot_product_attention (notebook 04) with its weights dropped:
    the baseline the tiles below are compared against, in value and in memory.

    >>> q = k = torch.eye(2); v = torch.tensor([[1.0], [3.0]])
    >>> standard_attention(q, k, v, causal=True)  # the first query sees only the first key
    tensor([[1.0000],
            [2.3395]])
    """
    _check_qkv(q, k, v, causal)
    d_head = q.shape[-1]
    scale = _check_scale(scale, d_head)
    mask = causal_mask(q.shape[-2], k.shape[-2], device=q.device) if causal else None
    # tfedu's function divides by sqrt(d_head); another scale is the same thing applied to q.
    q = q if scale == 1.0 / math.sqrt(d_head) else q * (scale * math.sqrt(d_head))
    out, _ = scaled_dot_product_attention(q, k, v, mask)  # the (query_pos, key_pos) weights live until here
    return out


# ----------------------------------------------------------------------------- FlashAttention-2: forward


def tile_update(
    m: Float[Tensor, "*rows"],
    l: Float[Tensor, "*rows"],
    o: Float[Tensor, "*rows d_v"],
    s: Float[Tensor, "*rows block"],
    v: Float[Tensor, "*batch block d_v"],
) -> tuple[Float[Tensor, "*rows"], Float[Tensor, "*rows"], Float[Tensor, "*rows d_v"]]:
    """Fold one tile of scores ``s`` and its values ``v`` into a block of queries' running state.

    ``m`` is each query's running max of the scores seen so far, ``l`` the running sum of
    exp(score - m), and ``o`` the running sum of exp(score - m) * value: an *unnormalised* output,
    divided by ``l`` only after the last tile. When the new tile raises the max, everything summed
    so far was weighted against the old one, so both ``l`` and ``o`` shrink by exp(m - m_new):

        m_new = max(m, rowmax(s));   p = exp(s - m_new)
        l_new = exp(m - m_new) * l + rowsum(p)
        o_new = exp(m - m_new) * o + p @ v

    The ``m`` and ``l`` lines are the online softmax (``tfedu.softmax.online_softmax_step``).

    >>> m, l, o = torch.tensor([-math.inf]), torch.zeros(1), torch.zeros(1, 2)
    >>> s, v = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> m, l, o = tile_update(m, l, o, s, v)
    >>> o / l[..., None]  # two equal scores: the mean of the two values
    tensor([[0.5000, 0.5000]])
    """
    m_new = torch.maximum(m, s.amax(dim=-1))  # (*rows)
    p = torch.exp(s - m_new[..., None])  # this tile's weights, relative to the new max   (*rows, block)
    alpha = torch.exp(m - m_new)[..., None]  # rescales what was summed against the old max; exp(-inf) = 0 at first
    l_new = alpha[..., 0] * l + p.sum(dim=-1)
    o_new = alpha * o + p @ v
    return m_new, l_new, o_new


def flash_forward(
    q: Float[Tensor, "*batch query_pos d_head"],
    k: Float[Tensor, "*batch key_pos d_head"],
    v: Float[Tensor, "*batch key_pos d_v"],
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
    update: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None,
) -> tuple[Float[Tensor, "*batch query_pos d_v"], Float[Tensor, "*batch query_pos"]]:
    """softmax(scale * q k^T) v one (block_q, block_k) tile of scores at a time; returns ``(o, lse)``.

    FlashAttention-2's forward pass (Dao 2023, Algorithm 1). Outer loop over blocks of queries,
    inner loop over blocks of keys; the online softmax keeps a running max m and sum l per query
    and an unnormalised output O, and divides O by l once, at the end. ``lse = m + log(l)`` is
    the log-sum-exp of each row of scores: the backward pass rebuilds P from it. (FlashAttention-1
    ran the key loop outside; with the queries outside, a query block's m, l and O never leave
    the inner loop, and on a GPU the query blocks run in parallel.)

    ``causal=True`` (query_pos == key_pos; query i sees keys 0..i) skips key blocks that lie
    wholly above the diagonal and masks only the blocks the diagonal crosses. ``o`` has q's dtype;
    m, l and O accumulate in float32 (float64 for float64 input), and ``lse`` comes back in that
    accumulation dtype. Called with tensors that require grad, autograd would record every tile:
    use ``flash_attention`` for training. ``update`` replaces ``tile_update`` (notebook 09 runs a
    learner's own per-tile update through this loop).

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = torch.randn(3, 2, 10, 8, generator=g)  # (batch=2, pos=10, d_head=8) each
    >>> o, lse = flash_forward(q, k, v, causal=True, block_q=4, block_k=4)
    >>> torch.allclose(o, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    True
    >>> o.shape, lse.shape
    (torch.Size([2, 10, 8]), torch.Size([2, 10]))
    """
    _check_qkv(q, k, v, causal)
    scale = _check_scale(scale, q.shape[-1])
    block_q, block_k = _check_size("block_q", block_q), _check_size("block_k", block_k)
    acc = _accumulation_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    step = tile_update if update is None else update

    o = q.new_empty((*q.shape[:-1], v.shape[-1]))  # (..., query_pos, d_v), written block by block
    lse = q.new_empty(q.shape[:-1], dtype=acc)  # (..., query_pos)
    for i0 in range(0, n_q, block_q):  # outer loop: one block of queries
        i1 = min(i0 + block_q, n_q)
        q_i = q[..., i0:i1, :].to(acc)  # (..., bq, d_head)
        m = q_i.new_full(q_i.shape[:-1], -math.inf)  # running row max            (..., bq)
        l = q_i.new_zeros(q_i.shape[:-1])  # running row sum of exp(S - m)          (..., bq)
        O = q_i.new_zeros((*q_i.shape[:-1], v.shape[-1]))  # unnormalised output   (..., bq, d_v)
        for j0 in range(0, n_k, block_k):  # inner loop: one block of keys
            if causal and j0 >= i1:
                break  # this key block and every later one come after every query here: skipped, not masked
            j1 = min(j0 + block_k, n_k)
            k_j = k[..., j0:j1, :].to(acc)  # (..., bk, d_head)
            v_j = v[..., j0:j1, :].to(acc)  # (..., bk, d_v)

            S = scale * (q_i @ k_j.transpose(-2, -1))  # one tile of scores   (..., bq, bk)
            if causal and j1 - 1 > i0:  # the diagonal crosses this tile: hide key j from query i < j
                future = torch.arange(j0, j1, device=q.device) > torch.arange(i0, i1, device=q.device)[:, None]
                S = S.masked_fill(future, -math.inf)
            # No row is all -inf: causal key block 0 is never skipped and key 0 is visible to every query,
            # so m is finite after the first tile and exp(-inf - m) = 0 for the hidden keys after it.
            m, l, O = step(m, l, O, S, v_j)

        o[..., i0:i1, :] = (O / l[..., None]).to(q.dtype)  # normalise once, not once per tile (FA2's change to FA1)
        lse[..., i0:i1] = m + torch.log(l)
    return o, lse


# ----------------------------------------------------------------------------- FlashAttention-2: backward


def flash_backward(
    q: Float[Tensor, "*batch query_pos d_head"],
    k: Float[Tensor, "*batch key_pos d_head"],
    v: Float[Tensor, "*batch key_pos d_v"],
    o: Float[Tensor, "*batch query_pos d_v"],
    lse: Float[Tensor, "*batch query_pos"],
    do: Float[Tensor, "*batch query_pos d_v"],
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[Float[Tensor, "*batch query_pos d_head"], Float[Tensor, "*batch key_pos d_head"], Float[Tensor, "*batch key_pos d_v"]]:
    """Gradients ``(dq, dk, dv)`` of the attention output given ``do``, one tile at a time.

    FlashAttention-2's backward pass (Dao 2023, Algorithm 2). ``o`` and ``lse`` come from
    ``flash_forward``; nothing of size (query_pos, key_pos) was kept, so each tile of
    P = exp(S - lse) is recomputed. With D = rowsum(dO * O) (which equals rowsum(P * dP)), the
    softmax's backward is dS = P * (dP - D). Outer loop over key blocks (dK_j and dV_j build up
    in the loop), inner loop over query blocks (dQ_i gathers from every key block: on a GPU these
    are atomic adds).

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v, do = torch.randn(4, 6, 8, generator=g)
    >>> o, lse = flash_forward(q, k, v)
    >>> dq, dk, dv = flash_backward(q, k, v, o, lse, do, block_q=4, block_k=4)
    >>> qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    >>> (F.scaled_dot_product_attention(qa, ka, va) * do).sum().backward()
    >>> all(torch.allclose(ours, ref.grad, atol=1e-5) for ours, ref in ((dq, qa), (dk, ka), (dv, va)))
    True
    """
    _check_qkv(q, k, v, causal)
    scale = _check_scale(scale, q.shape[-1])
    block_q, block_k = _check_size("block_q", block_q), _check_size("block_k", block_k)
    out_shape = (*q.shape[:-1], v.shape[-1])
    for name, t, shape in (("o", o, out_shape), ("do", do, out_shape), ("lse", lse, q.shape[:-1])):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape {tuple(shape)} (from q and v: see flash_forward), got {got}")
    acc = _accumulation_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]

    # D_i = sum_j P_ij dP_ij, the term the softmax's backward subtracts. As o_i = sum_j P_ij v_j and
    # dP_ij = dO_i . v_j, it equals dO_i . o_i: one (query_pos,) vector, no tile needed.
    D = (do.to(acc) * o.to(acc)).sum(dim=-1)  # rowsum(dO * O)   (..., query_pos)
    lse = lse.to(acc)
    dq = q.new_zeros(q.shape, dtype=acc)  # (..., query_pos, d_head), gathers from every key block
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for j0 in range(0, n_k, block_k):  # outer loop: one block of keys
        j1 = min(j0 + block_k, n_k)
        k_j = k[..., j0:j1, :].to(acc)  # (..., bk, d_head)
        v_j = v[..., j0:j1, :].to(acc)  # (..., bk, d_v)
        dk_j = torch.zeros_like(k_j)  # (..., bk, d_head)
        dv_j = torch.zeros_like(v_j)  # (..., bk, d_v)
        for i0 in range(0, n_q, block_q):  # inner loop: one block of queries
            i1 = min(i0 + block_q, n_q)
            if causal and i1 <= j0:
                continue  # every query here comes before every key here: above the diagonal, skipped
            q_i = q[..., i0:i1, :].to(acc)  # (..., bq, d_head)
            do_i = do[..., i0:i1, :].to(acc)  # (..., bq, d_v)

            S = scale * (q_i @ k_j.transpose(-2, -1))  # the forward's tile again   (..., bq, bk)
            if causal and j1 - 1 > i0:
                future = torch.arange(j0, j1, device=q.device) > torch.arange(i0, i1, device=q.device)[:, None]
                S = S.masked_fill(future, -math.inf)
            P = torch.exp(S - lse[..., i0:i1, None])  # the softmax weights, rebuilt from lse   (..., bq, bk)

            dv_j += P.transpose(-2, -1) @ do_i  # o = P v, so dV = P^T dO
            dP = do_i @ v_j.transpose(-2, -1)  # and dP = dO V^T   (..., bq, bk)
            dS = P * (dP - D[..., i0:i1, None])  # the softmax's backward   (..., bq, bk)
            dq[..., i0:i1, :] += scale * (dS @ k_j)  # S = scale * Q K^T
            dk_j += scale * (dS.transpose(-2, -1) @ q_i)

        dk[..., j0:j1, :] = dk_j.to(k.dtype)
        dv[..., j0:j1, :] = dv_j.to(v.dtype)
    return dq.to(q.dtype), dk, dv


# ----------------------------------------------------------------------------- FlashAttention as an autograd op


class FlashAttention(torch.autograd.Function):
    """Attention as one autograd operation: ``flash_forward`` forward, ``flash_backward`` backward.

    It saves only q, k, v, o and lse for the backward pass: O(N d) memory, where autograd through
    ``standard_attention`` keeps several (query_pos, key_pos) tensors alive until backward runs.
    Call it through ``flash_attention``.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, block_q: int, block_k: int) -> Tensor:
        o, lse = flash_forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = dict(causal=causal, scale=scale, block_q=block_q, block_k=block_k)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, do: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None, None]:
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, **ctx.options)
        return dq, dk, dv, None, None, None, None  # no gradient for causal, scale and the block sizes


def flash_attention(
    q: Float[Tensor, "*batch query_pos d_head"],
    k: Float[Tensor, "*batch key_pos d_head"],
    v: Float[Tensor, "*batch key_pos d_v"],
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
) -> Float[Tensor, "*batch query_pos d_v"]:
    """softmax(scale * q k^T) v by FlashAttention-2 tiles, differentiable, in linear memory.

    Equal to ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` up to
    rounding, forward and backward. q: (..., query_pos, d_head), k: (..., key_pos, d_head),
    v: (..., key_pos, d_v), with the same leading dims; ``causal`` needs query_pos == key_pos.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = torch.randn(3, 1, 2, 100, 16, generator=g).unbind(0)  # (batch, n_heads, pos, d_head)
    >>> q.requires_grad_()
    tensor(...)
    >>> flash_attention(q, k, v, block_q=32, block_k=32).sum().backward()
    >>> q.grad.shape
    torch.Size([1, 2, 100, 16])
    """
    _check_qkv(q, k, v, causal)
    scale = _check_scale(scale, q.shape[-1])
    block_q, block_k = _check_size("block_q", block_q), _check_size("block_k", block_k)
    return FlashAttention.apply(q, k, v, causal, scale, block_q, block_k)


def attention_from(forward: Callable[..., tuple[Tensor, Tensor]], backward: Callable[..., tuple[Tensor, Tensor, Tensor]],
                   *, block_q: int = 64, block_k: int = 64) -> Callable[..., Tensor]:
    """``attend(q, k, v, *, causal=False)``: attention as one autograd operation made of a given forward and backward.

    ``forward(q, k, v, causal=..., block_q=..., block_k=...) -> (o, lse)`` and ``backward(q, k, v, o, lse, do,
    causal=..., block_q=..., block_k=...) -> (dq, dk, dv)`` have the signatures of notebook 09's exercises 9.4 and
    9.5 (and of ``flash_forward``, ``flash_backward``); only q, k, v, o and lse are kept for the backward pass. A
    ``tfedu.layers.Attention`` with ``impl="flash"`` runs it when its ``flash_fn`` is set to the result.

    >>> attend = attention_from(flash_forward, flash_backward, block_q=4, block_k=4)
    >>> q, k, v = (torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(s)).requires_grad_() for s in range(3))
    >>> attend(q, k, v, causal=True).sum().backward()
    >>> torch.allclose(q.grad, torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), q)[0],
    ...                atol=1e-5)
    True
    """

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
            o, lse = forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal = causal
            return o

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, do: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = backward(q, k, v, o, lse, do, causal=ctx.causal, block_q=block_q, block_k=block_k)
            return dq, dk, dv, None

    def attend(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False) -> Tensor:
        _check_qkv(q, k, v, causal)
        return Op.apply(q, k, v, causal)

    return attend


# ----------------------------------------------------------------------------- linear attention


def elu_feature_map(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    """phi(x) = elu(x) + 1: positive everywhere, so phi(q) . phi(k) > 0 can stand in for exp(q . k).

    Katharopoulos et al. (2020), eq. 7.

    >>> elu_feature_map(torch.tensor([-100.0, 0.0, 2.0]))
    tensor([0., 1., 3.])
    """
    return F.elu(x) + 1


def linear_attention(
    q: Float[Tensor, "*batch query_pos d_head"],
    k: Float[Tensor, "*batch key_pos d_head"],
    v: Float[Tensor, "*batch key_pos d_v"],
    *,
    causal: bool = False,
    chunk: int = 64,
    eps: float = 1e-6,
) -> Float[Tensor, "*batch query_pos d_v"]:
    """Linear attention, out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i)^T sum_j phi(k_j) + eps).

    Non-causal: phi(Q) (phi(K)^T V) / (phi(Q) (phi(K)^T 1)), the bracket first, so nothing
    of size (query_pos, key_pos) exists: O(N d_head d_v) time and O(N d) memory.

    Causal: query i sums over keys j <= i only. The running sums S_i = sum_{j<=i} phi(k_j) v_j^T
    (d_head, d_v) and z_i = sum_{j<=i} phi(k_j) (d_head) are the state of an RNN (Katharopoulos et
    al. 2020, section 3.4). Stepping through positions one at a time is slow in Python, and keeping
    every S_i is (N, d_head, d_v) of memory; so go chunk by chunk: inside a chunk, the quadratic
    form with a (chunk, chunk) causal mask; from earlier chunks, the carried S and z. Memory
    O(N d + chunk^2 + d^2).

    Sums run in float32 for float16/bfloat16 input (float64 stays float64); the output has q's dtype.
    Equal to ``linear_attention_quadratic`` up to rounding.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = torch.randn(3, 2, 10, 8, generator=g)
    >>> torch.allclose(linear_attention(q, k, v, causal=True, chunk=4),
    ...                linear_attention_quadratic(q, k, v, causal=True), atol=1e-6)
    True
    """
    _check_qkv(q, k, v, causal)
    chunk = _check_size("chunk", chunk)
    eps = _check_eps(eps)
    acc = _accumulation_dtype(q.dtype)
    phi_q = elu_feature_map(q.to(acc))  # (..., query_pos, d_head)
    phi_k = elu_feature_map(k.to(acc))  # (..., key_pos, d_head)
    v = v.to(acc)

    if not causal:
        kv = phi_k.transpose(-2, -1) @ v  # sum_j phi(k_j) v_j^T   (..., d_head, d_v)
        z = phi_k.sum(dim=-2)  # sum_j phi(k_j)   (..., d_head)
        numerator = phi_q @ kv  # (..., query_pos, d_v)
        denominator = phi_q @ z[..., None]  # (..., query_pos, 1)
        return (numerator / (denominator + eps)).to(q.dtype)

    n = q.shape[-2]
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # (..., pos, d_v)
    S = phi_k.new_zeros((*phi_k.shape[:-2], phi_k.shape[-1], v.shape[-1]))  # state: sum phi(k_j) v_j^T   (..., d_head, d_v)
    z = phi_k.new_zeros((*phi_k.shape[:-2], phi_k.shape[-1]))  # state: sum phi(k_j)   (..., d_head)
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        q_c, k_c, v_c = phi_q[..., c0:c1, :], phi_k[..., c0:c1, :], v[..., c0:c1, :]
        # Inside the chunk: the quadratic form, key j <= query i (the diagonal included).
        A = (q_c @ k_c.transpose(-2, -1)).tril()  # (..., c, c)
        # Keys of earlier chunks reach this one through the carried state.
        numerator = q_c @ S + A @ v_c  # (..., c, d_v)
        denominator = q_c @ z[..., None] + A.sum(dim=-1, keepdim=True)  # (..., c, 1)
        out[..., c0:c1, :] = (numerator / (denominator + eps)).to(q.dtype)
        S = S + k_c.transpose(-2, -1) @ v_c  # then this chunk joins the state
        z = z + k_c.sum(dim=-2)
    return out


def linear_attention_quadratic(
    q: Float[Tensor, "*batch query_pos d_head"],
    k: Float[Tensor, "*batch key_pos d_head"],
    v: Float[Tensor, "*batch key_pos d_v"],
    *,
    causal: bool = False,
    eps: float = 1e-6,
) -> Float[Tensor, "*batch query_pos d_v"]:
    """Linear attention computed the quadratic way: A = phi(Q) phi(K)^T, rows normalised, A V.

    The same model as ``linear_attention`` (same feature map, same eps) with the (query_pos,
    key_pos) matrix written out: attention with phi(q) . phi(k) in place of exp(q . k). The oracle
    that ``linear_attention`` is tested against.

    >>> q = k = torch.zeros(2, 1); v = torch.tensor([[1.0], [3.0]])
    >>> linear_attention_quadratic(q, k, v, causal=True)  # phi(0) = 1: running means (eps shifts the 7th digit)
    tensor([[1.0000],
            [2.0000]])
    """
    _check_qkv(q, k, v, causal)
    eps = _check_eps(eps)
    acc = _accumulation_dtype(q.dtype)
    A = elu_feature_map(q.to(acc)) @ elu_feature_map(k.to(acc)).transpose(-2, -1)  # (..., query_pos, key_pos)
    if causal:
        A = A.tril()
    return (A @ v.to(acc) / (A.sum(dim=-1, keepdim=True) + eps)).to(q.dtype)


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite number >= 0 (added to the normaliser), got {eps!r}")
    return float(eps)


# ----------------------------------------------------------------------------- measuring memory


class _StorageCounter(TorchDispatchMode):
    """Watches every torch op and adds up the bytes of the storages the ops allocate, until they are freed."""

    def __init__(self) -> None:
        super().__init__()
        # (device, data_ptr) -> a token for each counted storage alive now. The token lets a late finalizer
        # tell its storage from a newer one that the allocator put at the same address.
        self.live: dict[tuple[torch.device, int], int] = {}
        self.tokens = itertools.count()
        self.bytes = 0  # bytes of counted storages alive now
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = None  # storages of the op's inputs, looked up only when an output might be new
        for t in _tensors(out):
            if t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            key, nbytes = (t.device, storage.data_ptr()), storage.nbytes()
            if nbytes == 0 or key[1] == 0 or key in self.live:
                continue  # empty, or already counted (a view of something made during the call)
            if inputs is None:
                inputs = {(x.device, x.untyped_storage().data_ptr()) for x in _tensors((args, kwargs))}
            if key in inputs:
                continue  # a view or an in-place op returns (part of) an input's storage: no new memory
            token = next(self.tokens)
            self.live[key] = token
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
            # Called when the storage itself is freed, however many tensors or views shared it.
            weakref.finalize(storage, self._release, key, token, nbytes)
        return out

    def _release(self, key: tuple[torch.device, int], token: int, nbytes: int) -> None:
        if self.live.get(key) == token:
            del self.live[key]
            self.bytes -= nbytes


def _tensors(tree: Any) -> Iterator[Tensor]:
    """The tensors in an op's arguments or results (nested tuples, lists and dicts of them)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def peak_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)``; return ``(result, peak)``, peak = the most bytes it held at once.

    What is counted: the storage (``nbytes``) of every tensor a torch operation creates during
    the call, from the op that allocates it until the last tensor or view using it is freed;
    ``peak`` is the largest sum alive at any moment, the result's own storage included. Views,
    reshapes that do not copy and in-place ops allocate nothing and count nothing; tensors that
    existed before the call (the inputs) count nothing. Ops run inside ``.backward()`` count too,
    so do the gradients it stores in ``.grad``. What is not counted: memory torch allocates
    without returning it as a tensor (workspace inside a kernel), the caching allocator's
    rounding and reserve, and Python objects. It works on any device, CPU included, because it
    watches the operations (a ``TorchDispatchMode``), not the allocator.

    >>> x = torch.ones(1024)  # 4 KiB, made before the call: not counted
    >>> result, peak = peak_memory(lambda t: (t * 2).sum(), x)
    >>> peak  # t * 2 (4096 bytes) is alive while .sum() makes its 4-byte result
    4100
    """
    if not callable(fn):
        raise TypeError(f"peak_memory measures a call: fn must be callable, got {type(fn).__name__}")
    counter = _StorageCounter()
    with counter:
        result = fn(*args, **kwargs)
    return result, counter.peak


def memory_vs_n(ns: list[int], d: int = 64, *, causal: bool = False) -> dict[str, list[int]]:
    """Peak bytes of one forward pass at each length in ``ns``: standard vs flash vs linear attention.

    One head, float32, q, k, v of shape (n, d) made before the measurement (so not counted):
    what is counted is what each method allocates on top of its inputs (see ``peak_memory``).
    Standard grows like n^2, flash and linear like n.

    >>> mem = memory_vs_n([128, 256])
    >>> mem["standard"][1] / mem["standard"][0] > 3.5, mem["flash"][1] / mem["flash"][0] < 2.5
    (True, True)
    """
    if not isinstance(ns, (list, tuple)) or not ns:
        raise ValueError(f"ns must be a non-empty list of lengths, got {ns!r}")
    _check_size("d", d)
    methods = {"standard": standard_attention, "flash": flash_attention, "linear": linear_attention}
    peaks: dict[str, list[int]] = {name: [] for name in methods}
    for n in ns:
        _check_size("each n in ns", n)
        g = torch.Generator().manual_seed(0)
        q, k, v = torch.randn(3, n, d, generator=g)
        with torch.no_grad():
            for name, method in methods.items():
                peaks[name].append(peak_memory(method, q, k, v, causal=causal)[1])
    return peaks


# ----------------------------------------------------------------------------- what a matrix multiply reads

MATMULS = frozenset({
    torch.matmul, torch.mm, torch.bmm, torch.einsum, torch.tensordot, torch.inner, torch.mv, torch.dot, torch.addmm,
    torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.bmm,
    torch.Tensor.mv, torch.Tensor.dot, torch.Tensor.inner, torch.Tensor.addmm, F.linear,
})


class MatmulOperands(TorchFunctionMode):
    """While on, records the shape of every tensor handed to a torch matrix multiply.

    ``reads`` adds up their elements: the numbers the multiplies load, one load per operand
    element per call, which is what tiling reduces. ``widest`` is the largest operand shape,
    by its largest dim (a tiled multiply never sees one wider than its tile).

    >>> with MatmulOperands() as seen:
    ...     _ = torch.ones(4, 3) @ torch.ones(3, 2)
    >>> seen.reads, seen.widest
    (18, (4, 3))
    """

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in MATMULS:
            self.shapes += [tuple(a.shape) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))

    @property
    def reads(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def widest(self) -> tuple[int, ...]:
        return max(self.shapes, key=lambda shape: max(shape, default=0), default=())

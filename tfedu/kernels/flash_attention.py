"""FlashAttention-2 as a Triton kernel: exact attention without ever holding the (pos x pos) scores.

Plain attention writes the whole score matrix S = Q K^T to memory, softmaxes it and reads it back:
O(N^2) memory traffic for N = pos. FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023)
cuts Q into blocks of BLOCK_M rows and K, V into blocks of BLOCK_N rows. One *program* (a block
of GPU threads) owns one query block; it walks over the key blocks, computes that tile of scores
in fast on-chip memory, and folds it into a running result with the **online softmax**
(FA2 paper, Algorithm 1). For each query row it keeps, in float32:

    m    the largest score seen so far
    l    the sum of exp(score - m) over the keys seen so far
    acc  the sum of exp(score - m) * v over the keys seen so far

A new tile with a bigger maximum m' rescales the old sums by exp(m - m'), so at the end
O = acc / l is exactly softmax(S) V, and L = m + log(l) is the row's log-sum-exp, the one number
per row the backward pass needs to rebuild any tile of the softmax P = exp(S - L) on the fly.

The backward pass (FA2 paper, Algorithm 2) uses, with D = rowsum(dO * O) computed first:

    dV = P^T dO      dP = dO V^T      dS = P * (dP - D)      dQ = scale * dS K      dK = scale * dS^T Q

It runs as two kernels that only write (no atomics, so the result is the same on every run):
one program per key block accumulates dK and dV over the query blocks, one program per query
block accumulates dQ over the key blocks. Each recomputes P, which costs FLOPs but saves the
N x N memory.

Causal attention skips every key block to the right of the diagonal (about half the work) and
masks only the blocks that straddle it. A sequence length that is not a multiple of the block
size is handled by masked loads and stores (rows past the end read as zeros and are never written).

Shapes: q, k, v are (batch, n_heads, pos, d_head); in the kernels N = pos and D_HEAD = d_head,
the paper's names. Each (batch, head) pair is one independent attention problem, the second axis
of the launch grid.

On a GPU: float16 or bfloat16 inputs, float32 accumulation (float32 inputs work too, but ``tl.dot``
then uses TF32, like torch's matmul with ``allow_tf32``). Without a GPU, ``tfedu.kernels`` turns on
Triton's interpreter (``TRITON_INTERPRET=1``), which runs the very same kernels on CPU tensors
through numpy: slow, but every line can be read, printed and stepped through.

Built up and explained in notebooks/09_efficient_attention.ipynb (after the PyTorch tiles of
``tfedu.flash``); measured by ``tfedu bench attention``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

# Read once, when the kernels below are defined: Triton decides at decoration time whether
# @triton.jit compiles for the GPU or wraps the function for its CPU interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
# Triton's own helpers (tl.max, tl.sum, tl.zeros, ...) are @triton.jit functions too, defined when
# triton is first imported. If that happened before TRITON_INTERPRET=1 was set, they were built for
# the GPU and the interpreter cannot call them ("Cannot call @triton.jit'd outside of the scope of a
# kernel"): the interpreter has to be on before the first `import triton`, not only before our kernels.
TRITON_IMPORTED_BEFORE_INTERPRETER = INTERPRETED and not isinstance(tl.max, InterpretedFunction)
IMPORTED_TOO_EARLY = (
    "triton was imported before TRITON_INTERPRET=1 was set, so its own helpers (tl.max, tl.sum, ...) were built "
    "for the GPU and cannot run in the CPU interpreter: import tfedu.kernels before triton (or start Python with "
    "TRITON_INTERPRET=1 in the environment), then restart the Python process or notebook kernel"
)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)  # tl.dot wants tile sides >= 16; the d_head tile must be a power of 2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# exp(x) = exp2(x * log2(e)). The GPU has a fast exp2 instruction; folding log2(e) into the softmax
# scale once (qk_scale = scale * log2(e)) makes every score "log2 units" for free, so the kernels
# call tl.exp2 and never tl.exp. LN2 converts the stored log-sum-exp back to natural log.
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))
LN2: tl.constexpr = tl.constexpr(math.log(2.0))


# ----------------------------------------------------------------------------- tile sizes
#
# Which tiles run fastest depends on the GPU, d_head and N, so on a GPU each kernel is autotuned:
# the first call for a new (N, d_head, causal, dtype) times every config below and keeps the
# fastest. BLOCK_M: query rows per program; BLOCK_N: key rows per step; num_warps: threads per
# program / 32; num_stages: how many tiles ahead the loads are issued (software pipelining).
# The causal loops need the smaller block to divide the bigger one: every config here keeps that.
# Under the interpreter there is one small config (timing configs there would only multiply the wait).


def _configs(gpu: list[tuple[int, int, int, int]], interpreter: tuple[int, int]) -> list[triton.Config]:
    if INTERPRETED:
        block_m, block_n = interpreter
        return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu]


# (BLOCK_M, BLOCK_N, num_warps, num_stages). Forward and dQ: a query block against key steps (BLOCK_M >= BLOCK_N).
FORWARD_CONFIGS = _configs(
    [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4)],
    interpreter=(32, 16),
)
# dK/dV: a key block against query steps (BLOCK_N >= BLOCK_M), the mirror image.
DKDV_CONFIGS = _configs(
    [(32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (16, 64, 4, 4)],
    interpreter=(16, 32),
)
DQ_CONFIGS = _configs(
    [(128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), (64, 64, 4, 3), (64, 16, 4, 4)],
    interpreter=(32, 16),
)
TUNE_KEY = ["N", "D_HEAD", "CAUSAL"]  # re-tune when these change (the autotuner adds the dtypes itself)


def _tiny_inputs_tune_nothing(configs, named_args, **kwargs):
    """Tuning a tiny problem costs more than it could save: take the smallest tiles and go."""
    if named_args["N"] <= 128:
        return [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_warps, c.num_stages))]
    return configs


PRUNE = {"early_config_prune": _tiny_inputs_tune_nothing}


# ----------------------------------------------------------------------------- forward


@triton.jit
def _forward_step(acc, l_i, m_i, q, K, V, start_n, offs_m, N, qk_scale,
                  D_HEAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """Fold one block of keys and values into the running (acc, l, m) of a query block."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_HEAD)
    kv_offsets = offs_n[:, None] * D_HEAD + offs_d[None, :]
    k = tl.load(K + kv_offsets, mask=offs_n[:, None] < N, other=0.0)  # (BLOCK_N, D_HEAD)
    v = tl.load(V + kv_offsets, mask=offs_n[:, None] < N, other=0.0)  # (BLOCK_N, D_HEAD)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N) scores, in log2 units
    if MASKED:  # only the blocks on the diagonal or past the end of the sequence pay for this
        keep = offs_n[None, :] < N
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])  # query i sees keys j <= i
        s = tl.where(keep, s, float("-inf"))
    # The online softmax (FA2 paper, Algorithm 1, lines 8-10).
    m_new = tl.maximum(m_i, tl.max(s, 1))  # never -inf: every row saw a visible key in its first block
    alpha = tl.exp2(m_i - m_new)  # how much the old sums shrink under the new maximum
    p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N), unnormalised probabilities
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # P in the input dtype for the tensor cores
    return acc, l_i, m_new


@triton.autotune(configs=FORWARD_CONFIGS, key=TUNE_KEY, prune_configs_by=PRUNE)
@triton.jit
def _forward_kernel(Q, K, V, O, LSE, N, qk_scale,
                    D_HEAD: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: one block of BLOCK_M queries of one (batch, head); writes its O rows and L."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # int64: bh * N * D_HEAD overflows int32 on big inputs
    Q, K, V, O = Q + bh * N * D_HEAD, K + bh * N * D_HEAD, V + bh * N * D_HEAD, O + bh * N * D_HEAD
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_HEAD)
    q_offsets = offs_m[:, None] * D_HEAD + offs_d[None, :]
    q = tl.load(Q + q_offsets, mask=offs_m[:, None] < N, other=0.0)  # (BLOCK_M, D_HEAD), read once

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_HEAD], 0.0, tl.float32)

    # Two loops: key blocks that need no mask (the fast path), then the few that do.
    if CAUSAL:  # left of the diagonal: all visible. The diagonal: masked. Right of it: skipped.
        end_unmasked = start_m
        end = tl.minimum(start_m + BLOCK_M, N)
    else:  # everything visible; only a ragged last block (N not a multiple of BLOCK_N) is masked
        end_unmasked = (N // BLOCK_N) * BLOCK_N
        end = N
    for start_n in range(0, end_unmasked, BLOCK_N):
        acc, l_i, m_i = _forward_step(acc, l_i, m_i, q, K, V, start_n, offs_m, N, qk_scale,
                                      D_HEAD, BLOCK_N, CAUSAL, MASKED=False)
    for start_n in range(end_unmasked, end, BLOCK_N):
        acc, l_i, m_i = _forward_step(acc, l_i, m_i, q, K, V, start_n, offs_m, N, qk_scale,
                                      D_HEAD, BLOCK_N, CAUSAL, MASKED=True)

    o = acc / l_i[:, None]  # normalise once, at the end (FA2's change from FA1: fewer divisions)
    tl.store(O + q_offsets, o.to(O.dtype.element_ty), mask=offs_m[:, None] < N)
    lse = (m_i + tl.log2(l_i)) * LN2  # log-sum-exp of the row's scores, natural log
    tl.store(LSE + bh * N + offs_m, lse, mask=offs_m < N)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _backward_preprocess(O, DO, DELTA, N, D_HEAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO * O), one number per query row (FA2 paper, Algorithm 2, line 4)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs = bh * N * D_HEAD + offs_m[:, None] * D_HEAD + tl.arange(0, D_HEAD)[None, :]
    o = tl.load(O + offs, mask=offs_m[:, None] < N, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=offs_m[:, None] < N, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * N + offs_m, tl.sum(o * do, 1), mask=offs_m < N)


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, start_m, offs_n, N, qk_scale,
               D_HEAD: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    """Add one block of queries' contribution to dK and dV of a key block (all tiles transposed: keys x queries)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_offsets = offs_m[:, None] * D_HEAD + tl.arange(0, D_HEAD)[None, :]
    # Query rows past N read as zeros (q = dO = 0, L = D = 0): their P is a finite 1 and their
    # dO and dS are 0, so they add nothing to dV = P^T dO or dK = dS^T Q.
    q = tl.load(Q + q_offsets, mask=offs_m[:, None] < N, other=0.0)  # (BLOCK_M, D_HEAD)
    do = tl.load(DO + q_offsets, mask=offs_m[:, None] < N, other=0.0)  # (BLOCK_M, D_HEAD)
    lse = tl.load(LSE + offs_m, mask=offs_m < N, other=0.0) * LOG2E  # in log2 units, like the scores
    delta = tl.load(DELTA + offs_m, mask=offs_m < N, other=0.0)
    s_t = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M) = S^T
    p_t = tl.exp2(s_t - lse[None, :])  # P^T, the softmax rebuilt from L: no max, no sum needed
    if MASKED:
        p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)  # causal: key j seen by queries i >= j
    dv += tl.dot(p_t.to(do.dtype), do)  # dV = P^T dO
    dp_t = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M) = (dO V^T)^T
    ds_t = p_t * (dp_t - delta[None, :])  # dS^T = P^T * (dP^T - D): the softmax's backward
    dk += tl.dot(ds_t.to(q.dtype), q)  # dK = dS^T Q (times scale, applied once at the end)
    return dk, dv


@triton.autotune(configs=DKDV_CONFIGS, key=TUNE_KEY, prune_configs_by=PRUNE)
@triton.jit
def _backward_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, N, qk_scale, scale,
                          D_HEAD: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: one block of BLOCK_N keys of one (batch, head); loops over the query blocks."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    Q, K, V, DO = Q + bh * N * D_HEAD, K + bh * N * D_HEAD, V + bh * N * D_HEAD, DO + bh * N * D_HEAD
    DK, DV, LSE, DELTA = DK + bh * N * D_HEAD, DV + bh * N * D_HEAD, LSE + bh * N, DELTA + bh * N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kv_offsets = offs_n[:, None] * D_HEAD + tl.arange(0, D_HEAD)[None, :]
    k = tl.load(K + kv_offsets, mask=offs_n[:, None] < N, other=0.0)  # (BLOCK_N, D_HEAD), read once
    v = tl.load(V + kv_offsets, mask=offs_n[:, None] < N, other=0.0)
    dk = tl.full([BLOCK_N, D_HEAD], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, D_HEAD], 0.0, tl.float32)

    if CAUSAL:  # queries above the diagonal never see these keys: start at the diagonal, masked there
        for start_m in range(start_n, tl.minimum(start_n + BLOCK_N, N), BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, start_m, offs_n, N, qk_scale,
                                D_HEAD, BLOCK_M, MASKED=True)
        first_unmasked = start_n + BLOCK_N
    else:
        first_unmasked = 0
    for start_m in range(first_unmasked, N, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, start_m, offs_n, N, qk_scale,
                            D_HEAD, BLOCK_M, MASKED=False)

    tl.store(DK + kv_offsets, (dk * scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < N)
    tl.store(DV + kv_offsets, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < N)


@triton.jit
def _dq_step(dq, q, do, lse, delta, K, V, start_n, offs_m, N, qk_scale,
             D_HEAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """Add one block of keys' contribution to dQ of a query block."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kv_offsets = offs_n[:, None] * D_HEAD + tl.arange(0, D_HEAD)[None, :]
    k = tl.load(K + kv_offsets, mask=offs_n[:, None] < N, other=0.0)  # (BLOCK_N, D_HEAD)
    v = tl.load(V + kv_offsets, mask=offs_n[:, None] < N, other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        keep = offs_n[None, :] < N
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v))  # (BLOCK_M, BLOCK_N) = dO V^T
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k)  # dQ = dS K (times scale, applied once at the end)
    return dq


@triton.autotune(configs=DQ_CONFIGS, key=TUNE_KEY, prune_configs_by=PRUNE)
@triton.jit
def _backward_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, N, qk_scale, scale,
                        D_HEAD: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: one block of BLOCK_M queries of one (batch, head); loops over the key blocks."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    Q, K, V, DO, DQ = Q + bh * N * D_HEAD, K + bh * N * D_HEAD, V + bh * N * D_HEAD, DO + bh * N * D_HEAD, DQ + bh * N * D_HEAD
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_offsets = offs_m[:, None] * D_HEAD + tl.arange(0, D_HEAD)[None, :]
    q = tl.load(Q + q_offsets, mask=offs_m[:, None] < N, other=0.0)
    do = tl.load(DO + q_offsets, mask=offs_m[:, None] < N, other=0.0)
    lse = tl.load(LSE + bh * N + offs_m, mask=offs_m < N, other=0.0) * LOG2E
    delta = tl.load(DELTA + bh * N + offs_m, mask=offs_m < N, other=0.0)
    dq = tl.full([BLOCK_M, D_HEAD], 0.0, tl.float32)

    if CAUSAL:  # the same two loops as the forward pass
        end_unmasked = start_m
        end = tl.minimum(start_m + BLOCK_M, N)
    else:
        end_unmasked = (N // BLOCK_N) * BLOCK_N
        end = N
    for start_n in range(0, end_unmasked, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, start_n, offs_m, N, qk_scale, D_HEAD, BLOCK_N, CAUSAL, MASKED=False)
    for start_n in range(end_unmasked, end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, K, V, start_n, offs_m, N, qk_scale, D_HEAD, BLOCK_N, CAUSAL, MASKED=True)

    tl.store(DQ + q_offsets, (dq * scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < N)


# ----------------------------------------------------------------------------- launching the kernels


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel on contiguous (batch, n_heads, N, d_head) inputs: (O, LSE in float32)."""
    batch, n_heads, n, d_head = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((batch, n_heads, n), device=q.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), batch * n_heads)  # noqa: E731
    _forward_kernel[grid](q, k, v, o, lse, n, scale * math.log2(math.e), D_HEAD=d_head, CAUSAL=causal)
    return o, lse


def _backward(do, q, k, v, o, lse, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    batch, n_heads, n, d_head = q.shape
    delta = torch.empty_like(lse)
    preprocess_block = 64 if not INTERPRETED else 32
    _backward_preprocess[(triton.cdiv(n, preprocess_block), batch * n_heads)](
        o, do, delta, n, D_HEAD=d_head, BLOCK_M=preprocess_block)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qk_scale = scale * math.log2(math.e)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), batch * n_heads)  # noqa: E731
    _backward_dkdv_kernel[grid](q, k, v, do, lse, delta, dk, dv, n, qk_scale, scale, D_HEAD=d_head, CAUSAL=causal)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), batch * n_heads)  # noqa: E731
    _backward_dq_kernel[grid](q, k, v, do, lse, delta, dq, n, qk_scale, scale, D_HEAD=d_head, CAUSAL=causal)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: the forward kernel saves O and L; backward runs the preprocess, dK/dV and dQ kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the kernels index rows of d_head numbers
        o, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)  # O(N) extra memory: L is one float per row, not N x N
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


# ----------------------------------------------------------------------------- public functions


def _check_inputs(q: object, k: object, v: object, scale: float | None) -> float:
    """Name the problem with bad inputs before any kernel sees them; return the softmax scale."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (batch, n_heads, pos, d_head), got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, n_heads, pos, d_head), got shape {tuple(x.shape)}; "
                             "split the heads first, e.g. einops.rearrange(x, 'batch pos (n_heads d_head) -> "
                             "batch n_heads pos d_head', n_heads=...)")
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q, k and v must have the same shape (self-attention of one sequence length), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {q.dtype} is not supported: use torch.float16 or torch.bfloat16 (fast, on a GPU) "
                        "or torch.float32")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    batch, n_heads, pos, d_head = q.shape
    if d_head not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"d_head = {d_head} is not supported: the kernel handles d_head in {SUPPORTED_HEAD_DIMS} "
                         "(pad q, k and v with zeros up to the next one and pass scale=d_head**-0.5 "
                         "of the true d_head)")
    if batch * n_heads * pos == 0:
        raise ValueError(f"q has no rows to attend from: shape {tuple(q.shape)}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("q, k and v are CPU tensors, but Triton is compiling for the GPU here. Either move them to "
                           "the GPU (q.cuda()), or run the kernel on the CPU through Triton's interpreter: set the "
                           "environment variable TRITON_INTERPRET=1 before tfedu.kernels is first imported "
                           "(`TRITON_INTERPRET=1 jupyter lab`, or os.environ['TRITON_INTERPRET'] = '1' in the first "
                           "cell, then restart the kernel)")
    if INTERPRETED and TRITON_IMPORTED_BEFORE_INTERPRETER:
        raise RuntimeError(IMPORTED_TOO_EARLY)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise TypeError("bfloat16 is not supported by Triton's CPU interpreter (its bfloat16 arithmetic gives wrong "
                        "numbers): use torch.float16 or torch.float32 on the CPU, bfloat16 on a GPU")
    if scale is None:
        return 1.0 / math.sqrt(d_head)
    return float(scale)


def flash_attention(
    q: Float[Tensor, "batch n_heads pos d_head"],
    k: Float[Tensor, "batch n_heads pos d_head"],
    v: Float[Tensor, "batch n_heads pos d_head"],
    *,
    causal: bool = False,
    scale: float | None = None,
) -> Float[Tensor, "batch n_heads pos d_head"]:
    """softmax(q k^T * scale [causal mask]) v, by the Triton FlashAttention-2 kernels, with gradients.

    The same result as ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``;
    ``scale`` defaults to 1/sqrt(d_head). Without a GPU it runs in Triton's CPU interpreter (slow:
    keep pos in the hundreds).

    >>> q, k, v = torch.randn(3, 1, 2, 20, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
    >>> out = flash_attention(q, k, v, causal=True)
    >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    True
    """
    scale = _check_inputs(q, k, v, scale)
    return FlashAttentionFunction.apply(q, k, v, bool(causal), scale)


def flash_forward(
    q: Float[Tensor, "batch n_heads pos d_head"],
    k: Float[Tensor, "batch n_heads pos d_head"],
    v: Float[Tensor, "batch n_heads pos d_head"],
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[Float[Tensor, "batch n_heads pos d_head"], Float[Tensor, "batch n_heads pos"]]:
    """The forward kernel alone: the output and each row's log-sum-exp L (float32, natural log), no gradients.

    L = log(sum_j exp(scale * q_i . k_j)) over the keys query i may see: what the kernel keeps
    for the backward pass instead of the (pos x pos) probabilities.

    >>> q, k, v = torch.randn(3, 1, 1, 20, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
    >>> out, lse = flash_forward(q, k, v)
    >>> torch.allclose(lse, torch.logsumexp(q @ k.transpose(-1, -2) / 4, dim=-1), atol=1e-5)
    True
    """
    scale = _check_inputs(q, k, v, scale)
    with torch.no_grad():
        return _forward(q.contiguous(), k.contiguous(), v.contiguous(), bool(causal), scale)

"""Counting floating-point operations (FLOPs) of the matrix multiplies in a Transformer.

One multiply-add is two FLOPs, so a matrix product (m, k) @ (k, n) costs 2 * m * k * n and a
linear layer applied to n vectors costs 2 * n * d_in * d_out (the bias adds are n * d_out,
a lower-order term we leave out, as torch's ``FlopCounterMode`` does). Matrix multiplies are
where almost all of a Transformer's arithmetic goes; the softmax is counted separately.

Built by hand in notebooks/05_masks_and_heads.ipynb (multi-head attention costs about the
same as one full-width head); notebooks/07_transformer_block.ipynb adds the MLP and the
whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

SOFTMAX_OPS_PER_SCORE = 5  # max, subtract, exp, add to the sum, divide: one of each per score


def _count(name: str, value: object, *, allow_zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        least = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {least} int, got {value!r}")
    return value


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of (m, k) @ (k, n): m * n dot products of length k, each k multiplies and k adds.

    >>> matmul_flops(2, 3, 4)
    48
    """
    return 2 * _count("m", m, allow_zero=True) * _count("k", k, allow_zero=True) * _count("n", n, allow_zero=True)


def linear_flops(n: int, d_in: int, d_out: int) -> int:
    """FLOPs of a linear layer ``nn.Linear(d_in, d_out)`` applied to n vectors: 2 * n * d_in * d_out.

    >>> linear_flops(n=10, d_in=768, d_out=768)
    11796480
    """
    return 2 * _count("n", n, allow_zero=True) * _count("d_in", d_in) * _count("d_out", d_out)


@dataclass(frozen=True)
class AttentionFlops:
    """The FLOPs of one multi-head attention layer, term by term.

    Every field but ``softmax`` is a matrix multiply counted as 2 * m * k * n; ``softmax`` is
    ``SOFTMAX_OPS_PER_SCORE`` operations per attention score (an estimate, not a matmul).
    """

    q_proj: int  # x @ W_Q: batch * query_pos rows, d_model -> n_heads * d_head
    k_proj: int  # context @ W_K: batch * key_pos rows, kv_d_model -> n_heads * d_head
    v_proj: int  # context @ W_V, the same shape as k_proj
    scores: int  # q @ k^T per head: (query_pos, d_head) @ (d_head, key_pos)
    mix: int  # pattern @ v per head: (query_pos, key_pos) @ (key_pos, d_head)
    out_proj: int  # concat(heads) @ W_O: n_heads * d_head -> d_model
    softmax: int  # about SOFTMAX_OPS_PER_SCORE per score, batch * n_heads * query_pos * key_pos scores

    @property
    def matmul(self) -> int:
        """All matrix-multiply FLOPs (what torch's FlopCounterMode reports)."""
        return self.q_proj + self.k_proj + self.v_proj + self.scores + self.mix + self.out_proj

    @property
    def total(self) -> int:
        """Matrix multiplies plus the softmax estimate."""
        return self.matmul + self.softmax


def attention_flops(
    batch: int,
    query_pos: int,
    key_pos: int,
    d_model: int,
    n_heads: int,
    *,
    d_head: int | None = None,
    kv_d_model: int | None = None,
) -> AttentionFlops:
    """FLOPs of ``MultiHeadAttention(d_model, n_heads, d_head=..., kv_d_model=...)`` on one batch.

    Self-attention has key_pos == query_pos; cross-attention reads key_pos context vectors of
    width kv_d_model (default d_model). With d_head = d_model / n_heads (the default) the
    matmul count is

        8 * batch * pos * d_model**2  +  4 * batch * pos**2 * d_model

    for self-attention, whatever n_heads is: splitting into heads only cuts the width each
    head works in. Only the softmax term, batch * n_heads * pos**2 scores, grows with n_heads.

    >>> f = attention_flops(batch=1, query_pos=4, key_pos=4, d_model=8, n_heads=2)
    >>> f.matmul == 8 * 4 * 8**2 + 4 * 4**2 * 8
    True
    >>> f.matmul == attention_flops(1, 4, 4, 8, n_heads=1).matmul
    True
    """
    for name, value in (("batch", batch), ("query_pos", query_pos), ("key_pos", key_pos)):
        _count(name, value, allow_zero=True)
    _count("d_model", d_model)
    _count("n_heads", n_heads)
    if d_head is None:
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass d_head explicitly")
        d_head = d_model // n_heads
    _count("d_head", d_head)
    kv_d_model = d_model if kv_d_model is None else _count("kv_d_model", kv_d_model)
    width = n_heads * d_head
    per_head_scores = matmul_flops(query_pos, d_head, key_pos)
    per_head_mix = matmul_flops(query_pos, key_pos, d_head)
    return AttentionFlops(
        q_proj=linear_flops(batch * query_pos, d_model, width),
        k_proj=linear_flops(batch * key_pos, kv_d_model, width),
        v_proj=linear_flops(batch * key_pos, kv_d_model, width),
        scores=batch * n_heads * per_head_scores,
        mix=batch * n_heads * per_head_mix,
        out_proj=linear_flops(batch * query_pos, width, d_model),
        softmax=SOFTMAX_OPS_PER_SCORE * batch * n_heads * query_pos * key_pos,
    )


def multi_head_overhead(batch: int, pos: int, d_model: int, n_heads: int) -> float:
    """Total FLOPs of n_heads heads of width d_model / n_heads over one head of width d_model.

    The matmuls cancel exactly; what is left is the extra softmax work, so the ratio is
    1 + a little (the FLOP widget in notebooks/05_masks_and_heads.ipynb plots it).

    >>> round(multi_head_overhead(batch=1, pos=1024, d_model=768, n_heads=12), 4)
    1.0072
    """
    _count("batch", batch)  # an empty batch or sequence costs nothing: no ratio to speak of
    _count("pos", pos)
    many = attention_flops(batch, pos, pos, d_model, n_heads)
    one = attention_flops(batch, pos, pos, d_model, 1)
    return many.total / one.total


@dataclass(frozen=True)
class LayerCost:
    """One row of Vaswani et al. (2017), Table 1, evaluated for given sizes (constants dropped, as there)."""

    per_layer: int  # complexity per layer: the arithmetic, up to a constant
    sequential: int  # operations that must run one after another
    max_path: int  # longest path a signal travels between any two positions


def layer_costs(n: int, d: int, k: int, r: int) -> dict[str, LayerCost]:
    """Vaswani et al. 2017, Table 1, for sequence length n, width d, kernel size k, neighbourhood r.

    =============================  ==========  ==========  =============
    layer type                     per layer   sequential  maximum path
    =============================  ==========  ==========  =============
    self-attention                 n^2 d       1           1
    recurrent                      n d^2       n           n
    convolutional                  k n d^2     1           log_k(n)
    self-attention (restricted)    r n d       1           n / r
    =============================  ==========  ==========  =============

    The convolutional path is for dilated convolutions (Kalchbrenner et al. 2016); a stack of plain
    (contiguous) kernels needs n / k layers instead. Paths are rounded up to whole layers.

    >>> costs = layer_costs(n=512, d=512, k=3, r=64)
    >>> costs["self-attention"].per_layer == costs["recurrent"].per_layer  # equal when n == d
    True
    >>> costs["convolutional"].max_path, costs["self-attention (restricted)"].max_path
    (6, 8)
    """
    for name, value in (("n", n), ("d", d), ("r", r)):
        _count(name, value)
    if _count("k", k) < 2:
        raise ValueError(f"k must be at least 2 for log_k(n), got {k}")
    log_k_n = 0
    while k**log_k_n < n:  # ceil(log_k n) in integers, free of float rounding
        log_k_n += 1
    return {
        "self-attention": LayerCost(per_layer=n * n * d, sequential=1, max_path=1),
        "recurrent": LayerCost(per_layer=n * d * d, sequential=n, max_path=n),
        "convolutional": LayerCost(per_layer=k * n * d * d, sequential=1, max_path=max(1, log_k_n)),
        "self-attention (restricted)": LayerCost(per_layer=r * n * d, sequential=1, max_path=-(-n // r)),
    }

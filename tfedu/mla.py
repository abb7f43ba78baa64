"""Multi-head latent attention (MLA): cache one small latent per token instead of every head's K and V.

DeepSeek-AI (2024), "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
Model", arXiv:2405.04434, section 2.1. Equation numbers below are the paper's.

**The problem.** While decoding, multi-head attention keeps every earlier token's keys and values:
``2 * n_heads * d_head`` numbers per token per layer (the KV cache). Grouped-query attention shares
each K/V head among several query heads (``2 * n_kv_heads * d_head``); multi-query attention keeps a
single one (``2 * d_head``). Both shrink the cache by giving the heads fewer distinct keys.

**MLA's answer: low-rank joint compression (section 2.1.2).** Project each token's input h_t *down*
to one latent ``c_KV`` of width ``d_c``, shared by keys and values and by all heads (eq. 9), and
cache only that. The per-head keys and values are linear functions of it, made by *up*-projections
(eq. 10-11)::

    c_KV   = W_DKV h        (d_c,)                      eq. 9   <- cached
    k_nope = W_UK  c_KV     (n_heads * d_head_nope,)    eq. 10
    v      = W_UV  c_KV     (n_heads * d_head_v,)       eq. 11

Queries are compressed the same way (eq. 12-13), which saves activation memory in training and
nothing in the cache: ``c_Q = W_DQ h`` (d_c_q,), ``q_nope = W_UQ c_Q``.

**RoPE does not fit through the latent (section 2.1.3).** RoPE rotates keys by their position, so a
rotated key is ``R(j) W_UK c_KV``, and the rotation stands between the query and W_UK: W_UK can no
longer be moved to the query side (below). DeepSeek-V2's fix, *decoupled RoPE*, adds a few extra
dimensions to every head that carry the position, and gives them their own projections::

    q_rope = RoPE(W_QR c_Q)   (n_heads * d_rope,)   eq. 14   one per head
    k_rope = RoPE(W_KR h)     (d_rope,)             eq. 15   ONE for all heads  <- cached
    q_h = [q_nope_h ; q_rope_h],  k_h = [k_nope_h ; k_rope]                 eq. 16-17
    o_h = sum_j softmax_j(q_h . k_{j,h} / sqrt(d_head_nope + d_rope)) v_{j,h}   eq. 18
    u   = W_O [o_1 ; ... ; o_{n_heads}]                                      eq. 19

So the cache holds ``d_c + d_rope`` numbers per token per layer (``MLACache``,
``mla_cache_bytes_per_token``), whatever the number of heads.

**The absorbed form.** Written out, the position-free part of the score is
``q_nope_h . (W_UK_h c_j) = (W_UK_h^T q_nope_h) . c_j``: map the *query* into latent space once, and
compare it with the cached latents directly; no per-head key is ever built. Likewise
``sum_j w_j (W_UV_h c_j) = W_UV_h (sum_j w_j c_j)``: average the latents first, and up-project one
vector per head, which then meets W_O. The paper says W_UK is "absorbed" into W_UQ and W_UV into
W_O. ``forward(..., absorbed=True)`` computes this form; ``absorbed=False`` rebuilds K and V per
head. They are the same function (matrix products re-associated) and agree to rounding; the tests
assert it. Neither is always cheaper: the absorbed form never rebuilds per-head keys and values
for the cached tokens (the plain form must, at every decoding step), but its scores are dot
products over d_c + d_rope numbers per head instead of d_head_nope + d_rope.

Symbols (paper -> here): h_t -> ``x``; d_c -> ``d_c``; d_c' -> ``d_c_q``; d_h -> ``d_head_nope``
(query/key) and ``d_head_v`` (value); d_h^R -> ``d_rope``; n_h -> ``n_heads``; W^{DKV}, W^{UK},
W^{UV}, W^{KR}, W^{DQ}, W^{UQ}, W^{QR}, W^O -> ``W_DKV, W_UK, W_UV, W_KR, W_DQ, W_UQ, W_QR, W_O``
(``nn.Linear`` layers without bias, as in DeepSeek-V2; ``weight`` is (out, in), rows grouped head by head).

Read in notebooks/10_inference_and_kv_cache.ipynb (MLA's cache against GQA's).
"""

from __future__ import annotations

import math

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from tfedu.attention import causal_mask
from tfedu.layers import RMSNorm
from tfedu.positional import LAYOUTS, Layout, apply_rope

# ----------------------------------------------------------------------------- cache size formulas


def _positive(name: str, value: object, *, allow_zero: bool = False, numbers: tuple = (int,)) -> None:
    ok = isinstance(value, numbers) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "an int" if numbers == (int,) else "a number"
        raise ValueError(f"{name} must be {kind} {bound}, got {value!r}")


def mla_cache_bytes_per_token(d_c: int, d_rope: int, dtype_bytes: float, n_layers: int = 1) -> float:
    """Bytes MLA caches per token of one sequence: ``(d_c + d_rope) * dtype_bytes * n_layers``.

    One latent ``c_KV`` (d_c numbers) and one decoupled RoPE key ``k_rope`` (d_rope numbers, shared
    by all heads) per token per layer: DeepSeek-V2's Table 1 writes ``(d_c + d_h^R) l`` elements.

    DeepSeek-V2 has d_c = 512, d_rope = 64, 128 heads of d_head = 128 and 60 layers. In bfloat16
    (2 bytes), against multi-head attention with the same heads and layers:

    >>> mla = mla_cache_bytes_per_token(d_c=512, d_rope=64, dtype_bytes=2, n_layers=60)
    >>> mha = gqa_cache_bytes_per_token(n_kv_heads=128, d_head=128, dtype_bytes=2, n_layers=60)
    >>> mla, mha, round(mha / mla, 1)
    (69120, 3932160, 56.9)

    The paper's "MLA's cache equals GQA with only 2.25 groups": 512 + 64 = 576 = 4.5 * 128, and
    a GQA group caches a key and a value of d_head = 128, 2 * 128 = 256 numbers, so 576 / 256 =
    2.25 groups (per token and layer, for any dtype; no real GQA can have 2.25 groups, it is a
    yardstick):

    >>> mla / gqa_cache_bytes_per_token(n_kv_heads=1, d_head=128, dtype_bytes=2, n_layers=60)
    2.25
    """
    _positive("d_c", d_c)
    _positive("d_rope", d_rope, allow_zero=True)
    _positive("dtype_bytes", dtype_bytes, numbers=(int, float))
    _positive("n_layers", n_layers)
    return (d_c + d_rope) * dtype_bytes * n_layers


def gqa_cache_bytes_per_token(n_kv_heads: int, d_head: int, dtype_bytes: float, n_layers: int = 1) -> float:
    """Bytes grouped-query attention caches per token of one sequence: ``2 * n_kv_heads * d_head * dtype_bytes * n_layers``.

    A key and a value (the 2) for each of the n_kv_heads key/value heads in every layer.
    ``n_kv_heads = n_heads`` is multi-head attention, ``n_kv_heads = 1`` multi-query attention.

    >>> gqa_cache_bytes_per_token(n_kv_heads=12, d_head=64, dtype_bytes=4, n_layers=12)  # GPT-2 small, float32
    73728
    """
    _positive("n_kv_heads", n_kv_heads)
    _positive("d_head", d_head)
    _positive("dtype_bytes", dtype_bytes, numbers=(int, float))
    _positive("n_layers", n_layers)
    return 2 * n_kv_heads * d_head * dtype_bytes * n_layers


# ----------------------------------------------------------------------------- the latent cache


class MLACache:
    """One layer's MLA cache: the latents ``c_KV`` (batch, n_ctx, d_c) and RoPE keys ``k_rope`` (batch, n_ctx, d_rope).

    Preallocated once (zeros), then filled from the left: ``append`` writes new tokens after the
    ``length`` already held and returns views of everything held so far. Past ``n_ctx`` tokens it
    raises; it never wraps around or grows. Made for decoding under ``torch.no_grad()``: it is
    written in place, so do not backpropagate through it.

    >>> cache = MLACache(batch=2, n_ctx=8, d_c=4, d_rope=2)
    >>> c_KV, k_rope = cache.append(torch.ones(2, 3, 4), torch.ones(2, 3, 2))
    >>> cache.length, tuple(c_KV.shape), tuple(k_rope.shape)
    (3, (2, 3, 4), (2, 3, 2))
    >>> cache.nbytes == 2 * 8 * mla_cache_bytes_per_token(d_c=4, d_rope=2, dtype_bytes=4)  # float32: 4 bytes
    True
    """

    def __init__(
        self,
        batch: int,
        n_ctx: int,
        d_c: int,
        d_rope: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (("batch", batch), ("n_ctx", n_ctx), ("d_c", d_c)):
            _positive(name, value)
        _positive("d_rope", d_rope, allow_zero=True)
        self.batch, self.n_ctx, self.d_c, self.d_rope = batch, n_ctx, d_c, d_rope
        self.c_KV = torch.zeros(batch, n_ctx, d_c, dtype=dtype, device=device)  # (batch, n_ctx, d_c)
        self.k_rope = torch.zeros(batch, n_ctx, d_rope, dtype=dtype, device=device)  # (batch, n_ctx, d_rope)
        self.length = 0  # tokens held; rows [0, length) are filled

    @property
    def nbytes(self) -> int:
        """Bytes held by the two preallocated buffers (all n_ctx rows, filled or not)."""
        return self.c_KV.nbytes + self.k_rope.nbytes

    def append(
        self, c_KV: Float[Tensor, "batch pos d_c"], k_rope: Float[Tensor, "batch pos d_rope"]
    ) -> tuple[Float[Tensor, "batch key_pos d_c"], Float[Tensor, "batch key_pos d_rope"]]:
        """Write ``pos`` new tokens after those held; return views of all ``key_pos = length`` tokens."""
        for name, t, width in (("c_KV", c_KV, self.d_c), ("k_rope", k_rope, self.d_rope)):
            if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[0] != self.batch or t.shape[2] != width:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{name} must have shape (batch={self.batch}, pos, {width}) to fit this cache, got {got}")
            if t.dtype != self.c_KV.dtype or t.device != self.c_KV.device:
                raise TypeError(
                    f"{name} is {t.dtype} on {t.device} but the cache holds {self.c_KV.dtype} on {self.c_KV.device}: "
                    f"make the cache with the model's dtype and device"
                )
        if c_KV.shape[1] != k_rope.shape[1]:
            raise ValueError(f"c_KV and k_rope must hold the same tokens: pos {c_KV.shape[1]} != {k_rope.shape[1]}")
        start, end = self.length, self.length + c_KV.shape[1]
        if end > self.n_ctx:
            raise ValueError(
                f"the MLA cache holds at most n_ctx={self.n_ctx} tokens; it has {start} and {c_KV.shape[1]} more "
                f"would make {end}. A preallocated cache does not grow or wrap around: make one with a larger n_ctx"
            )
        self.c_KV[:, start:end] = c_KV
        self.k_rope[:, start:end] = k_rope
        self.length = end
        return self.c_KV[:, :end], self.k_rope[:, :end]

    def reset(self) -> None:
        """Forget every token (the buffers stay allocated)."""
        self.length = 0

    def __repr__(self) -> str:
        return (
            f"MLACache(batch={self.batch}, n_ctx={self.n_ctx}, d_c={self.d_c}, d_rope={self.d_rope}, "
            f"length={self.length}, dtype={self.c_KV.dtype}, nbytes={self.nbytes})"
        )


# ----------------------------------------------------------------------------- the layer


class MultiHeadLatentAttention(nn.Module):
    """Causal self-attention with DeepSeek-V2's low-rank latent K/V and decoupled RoPE (section 2.1).

    Parameters (``nn.Linear``, no bias; weights are (out, in)):

    - key/value path: ``W_DKV`` d_model -> d_c (eq. 9), ``W_UK`` d_c -> n_heads * d_head_nope (eq. 10),
      ``W_UV`` d_c -> n_heads * d_head_v (eq. 11), ``W_KR`` d_model -> d_rope (eq. 15, one key for all heads);
    - query path: ``W_DQ`` d_model -> d_c_q (eq. 12), ``W_UQ`` d_c_q -> n_heads * d_head_nope (eq. 13),
      ``W_QR`` d_c_q -> n_heads * d_rope (eq. 14);
    - ``W_O`` n_heads * d_head_v -> d_model (eq. 19).

    ``norm_latents=True`` (the default) puts an RMSNorm (``norm_KV``, ``norm_Q``) on ``c_KV`` and
    ``c_Q`` right after the down-projections, as DeepSeek-V2's released model does (its
    ``kv_a_layernorm`` and ``q_a_layernorm``; the paper's equations leave it out). The cache then
    holds the *normalised* latent, the one W_UK and W_UV read. ``d_rope = 0`` drops the decoupled
    RoPE part (no W_KR, W_QR): attention with low-rank K/V and no positions at all.
    RoPE uses ``tfedu.positional.apply_rope`` with ``rope_layout`` ("half" by default, Hugging Face
    Llama's; "interleaved" is what DeepSeek's own code and ``transformers``' DeepseekV2 use).

    ``forward(x, cache=..., absorbed=...)``: see the module docstring for the two forms.

    >>> _ = torch.manual_seed(0)
    >>> mla = MultiHeadLatentAttention(d_model=16, n_heads=2, d_c=4, d_c_q=8, d_head_nope=8, d_rope=4)
    >>> x = torch.randn(1, 5, 16)
    >>> mla(x).shape
    torch.Size([1, 5, 16])
    >>> torch.allclose(mla(x), mla(x, absorbed=True), atol=1e-5)
    True
    >>> cache = mla.new_cache(batch=1, n_ctx=8); _ = mla(x, cache=cache); cache
    MLACache(batch=1, n_ctx=8, d_c=4, d_rope=4, length=5, dtype=torch.float32, nbytes=256)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        d_c: int,
        d_c_q: int,
        d_head_nope: int,
        d_rope: int,
        d_head_v: int | None = None,
        norm_latents: bool = True,
        rope_base: float = 10000.0,
        rope_layout: Layout = "half",
    ) -> None:
        super().__init__()
        d_head_v = d_head_nope if d_head_v is None else d_head_v
        for name, value in (
            ("d_model", d_model), ("n_heads", n_heads), ("d_c", d_c), ("d_c_q", d_c_q),
            ("d_head_nope", d_head_nope), ("d_head_v", d_head_v),
        ):  # fmt: skip
            _positive(name, value)
        _positive("d_rope", d_rope, allow_zero=True)
        if d_rope % 2:
            raise ValueError(f"d_rope must be even (RoPE rotates dimensions in pairs), got d_rope={d_rope}")
        if rope_layout not in LAYOUTS:
            raise ValueError(f"rope_layout must be one of {LAYOUTS}, got {rope_layout!r}")
        self.d_model, self.n_heads, self.d_c, self.d_c_q = d_model, n_heads, d_c, d_c_q
        self.d_head_nope, self.d_rope, self.d_head_v = d_head_nope, d_rope, d_head_v
        self.rope_base, self.rope_layout, self.norm_latents = float(rope_base), rope_layout, norm_latents
        # A query and a key are [nope ; rope]: the score is a dot product over both parts (eq. 18).
        self.scale = 1.0 / math.sqrt(d_head_nope + d_rope)

        # Keys and values: down to the cached latent, up to the heads.
        self.W_DKV = nn.Linear(d_model, d_c, bias=False)  # eq. 9
        self.norm_KV = RMSNorm(d_c) if norm_latents else nn.Identity()
        self.W_UK = nn.Linear(d_c, n_heads * d_head_nope, bias=False)  # eq. 10
        self.W_UV = nn.Linear(d_c, n_heads * d_head_v, bias=False)  # eq. 11
        # Queries: the same down/up shape, never cached.
        self.W_DQ = nn.Linear(d_model, d_c_q, bias=False)  # eq. 12
        self.norm_Q = RMSNorm(d_c_q) if norm_latents else nn.Identity()
        self.W_UQ = nn.Linear(d_c_q, n_heads * d_head_nope, bias=False)  # eq. 13
        # The decoupled RoPE part: per-head queries, one shared key read from x itself.
        self.W_QR = nn.Linear(d_c_q, n_heads * d_rope, bias=False) if d_rope else None  # eq. 14
        self.W_KR = nn.Linear(d_model, d_rope, bias=False) if d_rope else None  # eq. 15
        self.W_O = nn.Linear(n_heads * d_head_v, d_model, bias=False)  # eq. 19
        self.hook_pattern = nn.Identity()  # the attention weights pass through here, as in MultiHeadAttention

    def new_cache(
        self, batch: int, n_ctx: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> MLACache:
        """An empty ``MLACache`` for this layer, in the layer's dtype and on its device unless told."""
        weight = self.W_DKV.weight
        return MLACache(
            batch, n_ctx, self.d_c, self.d_rope, dtype=dtype or weight.dtype, device=device or weight.device
        )

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        *,
        cache: MLACache | None = None,
        positions: Int[Tensor, "*#batch pos"] | None = None,
        absorbed: bool = False,
    ) -> Float[Tensor, "batch pos d_model"]:
        """Causal self-attention over the cached tokens (if any) and x's ``pos`` new tokens.

        ``positions`` are the RoPE positions of x's tokens, shape (pos,) or (batch, pos); by
        default ``cache.length, cache.length + 1, ...`` (0, 1, ... without a cache). The causal
        mask follows the order of the tokens, not ``positions``: the new tokens come after the
        cached ones.
        """
        self._check_x(x)
        if cache is not None and not isinstance(cache, MLACache):
            raise TypeError(f"cache must be an MLACache (see new_cache), got {type(cache).__name__}")
        batch, n_new, _ = x.shape
        start = 0 if cache is None else cache.length
        positions = self._positions(positions, batch, n_new, start, x.device)  # (batch or 1, pos)

        # What each new token adds to the cache: the latent and the shared RoPE key.
        c_KV = self.norm_KV(self.W_DKV(x))  # (batch, pos, d_c)                  eq. 9
        if self.d_rope:
            k_rope = self._rope(self.W_KR(x), positions)  # (batch, pos, d_rope)    eq. 15
        else:
            k_rope = x.new_zeros(batch, n_new, 0)  # no position part at all
        if cache is not None:
            c_KV, k_rope = cache.append(c_KV, k_rope)  # (batch, key_pos, d_c), (batch, key_pos, d_rope)

        # Queries for the new tokens only.
        c_Q = self.norm_Q(self.W_DQ(x))  # (batch, query_pos, d_c_q)             eq. 12
        q_nope = self._split_heads(self.W_UQ(c_Q))  # (batch, n_heads, query_pos, d_head_nope)  eq. 13
        if self.d_rope:  # eq. 14; positions gain a head axis: (batch or 1, 1, query_pos)
            q_rope = self._rope(self._split_heads(self.W_QR(c_Q)), positions[:, None, :])  # (batch, n_heads, query_pos, d_rope)
        else:
            q_rope = q_nope.new_zeros(*q_nope.shape[:-1], 0)

        mask = causal_mask(n_new, c_KV.shape[1], device=x.device)  # (query_pos, key_pos), aligned to the end
        attend = self._attend_absorbed if absorbed else self._attend_plain
        z = attend(q_nope, q_rope, c_KV, k_rope, mask)  # (batch, n_heads, query_pos, d_head_v)
        return self.W_O(einops.rearrange(z, "batch n_heads pos d_head_v -> batch pos (n_heads d_head_v)"))  # eq. 19

    # ------------------------------------------------------------------------- the two forms

    def _attend_plain(
        self,
        q_nope: Float[Tensor, "batch n_heads query_pos d_head_nope"],
        q_rope: Float[Tensor, "batch n_heads query_pos d_rope"],
        c_KV: Float[Tensor, "batch key_pos d_c"],
        k_rope: Float[Tensor, "batch key_pos d_rope"],
        mask: Tensor,
    ) -> Float[Tensor, "batch n_heads query_pos d_head_v"]:
        """Rebuild every head's keys and values from the latents, then attend as usual."""
        k_nope = self._split_heads(self.W_UK(c_KV))  # (batch, n_heads, key_pos, d_head_nope)  eq. 10
        v = self._split_heads(self.W_UV(c_KV))  # (batch, n_heads, key_pos, d_head_v)          eq. 11
        k_rope = k_rope[:, None].expand(-1, self.n_heads, -1, -1)  # (batch, n_heads, key_pos, d_rope): shared
        q = torch.cat([q_nope, q_rope], dim=-1)  # (batch, n_heads, query_pos, d_head_nope + d_rope)  eq. 16
        k = torch.cat([k_nope, k_rope], dim=-1)  # (batch, n_heads, key_pos, d_head_nope + d_rope)    eq. 17
        scores = q @ k.transpose(-2, -1)  # (batch, n_heads, query_pos, key_pos)
        weights = self._softmax(scores, mask)
        return weights @ v  # (batch, n_heads, query_pos, d_head_v)                                eq. 18

    def _attend_absorbed(
        self,
        q_nope: Float[Tensor, "batch n_heads query_pos d_head_nope"],
        q_rope: Float[Tensor, "batch n_heads query_pos d_rope"],
        c_KV: Float[Tensor, "batch key_pos d_c"],
        k_rope: Float[Tensor, "batch key_pos d_rope"],
        mask: Tensor,
    ) -> Float[Tensor, "batch n_heads query_pos d_head_v"]:
        """Attend on the latents themselves: W_UK moves to the query, W_UV to after the weighted sum."""
        # Per head, k_nope_h = W_UK_h c with W_UK_h of shape (d_head_nope, d_c) (a block of W_UK's rows).
        W_UK = self.W_UK.weight.view(self.n_heads, self.d_head_nope, self.d_c)  # (n_heads, d_head_nope, d_c)
        W_UV = self.W_UV.weight.view(self.n_heads, self.d_head_v, self.d_c)  # (n_heads, d_head_v, d_c)
        # q_nope_h . (W_UK_h c_j) = (W_UK_h^T q_nope_h) . c_j: the query, moved into latent space.
        q_latent = torch.einsum("bhqn,hnc->bhqc", q_nope, W_UK)  # (batch, n_heads, query_pos, d_c)
        scores = q_latent @ c_KV[:, None].transpose(-2, -1)  # (batch, n_heads, query_pos, key_pos): vs the cache as is
        scores = scores + q_rope @ k_rope[:, None].transpose(-2, -1)  # the position part, one key for all heads
        weights = self._softmax(scores, mask)
        # sum_j w_j (W_UV_h c_j) = W_UV_h (sum_j w_j c_j): average the latents, then up-project once.
        z_latent = weights @ c_KV[:, None]  # (batch, n_heads, query_pos, d_c)
        # (W_UV_h could be multiplied into W_O's columns for head h once, ahead of time; DeepSeek's own
        # inference code keeps the factors, and so do we, to keep W_O the matrix eq. 19 names.)
        return torch.einsum("bhqc,hvc->bhqv", z_latent, W_UV)  # (batch, n_heads, query_pos, d_head_v)

    def _softmax(
        self, scores: Float[Tensor, "batch n_heads query_pos key_pos"], mask: Tensor
    ) -> Float[Tensor, "batch n_heads query_pos key_pos"]:
        """Scale, hide future keys, softmax over keys (in at least float32), through ``hook_pattern``."""
        dtype = scores.dtype
        scores = (scores.to(torch.promote_types(dtype, torch.float32)) * self.scale).masked_fill(~mask, float("-inf"))
        # Every query sees at least itself (the mask is aligned to the end), so no row is all -inf.
        return self.hook_pattern(scores.softmax(dim=-1).to(dtype))

    # ------------------------------------------------------------------------- helpers and checks

    def _split_heads(self, t: Float[Tensor, "batch pos n_heads_d"]) -> Float[Tensor, "batch n_heads pos d"]:
        return einops.rearrange(t, "batch pos (n_heads d) -> batch n_heads pos d", n_heads=self.n_heads)

    def _rope(self, t: Tensor, positions: Tensor) -> Tensor:
        return apply_rope(t, positions, base=self.rope_base, layout=self.rope_layout)

    def _check_x(self, x: object) -> None:
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a floating-point tensor of shape (batch, pos, d_model={self.d_model}), got {got}")
        if x.shape[1] == 0:
            raise ValueError("x holds no tokens (pos = 0)")

    @staticmethod
    def _positions(positions: object, batch: int, n_new: int, start: int, device: torch.device) -> Tensor:
        """The RoPE positions as (batch or 1, pos); by default start, start + 1, ..."""
        if positions is None:
            return torch.arange(start, start + n_new, device=device)[None]  # (1, pos)
        if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
            raise TypeError(f"positions must be an integer tensor of shape (pos,) or (batch, pos), got {got}")
        if positions.dim() not in (1, 2) or positions.shape[-1] != n_new or (
            positions.dim() == 2 and positions.shape[0] not in (1, batch)
        ):
            raise ValueError(
                f"positions of shape {tuple(positions.shape)} do not match x's {n_new} new tokens: give one position "
                f"per token, shape (pos,) = ({n_new},) or (batch, pos) = ({batch}, {n_new})"
            )
        if positions.device != device:
            raise ValueError(f"positions are on {positions.device} but x is on {device}")
        return positions if positions.dim() == 2 else positions[None]

"""Scaled dot-product attention, its masks, and multi-head (self- and cross-) attention.

Attention is a soft dictionary look-up: a query is compared with every key, the scores
become weights through a softmax, and the answer is the weighted average of the values
(Vaswani et al. 2017, eq. 1):

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_head)) V

Built by hand in notebooks/04_attention.ipynb (the formula, why sqrt(d_head), permutation
equivariance) and notebooks/05_masks_and_heads.ipynb (masks, heads, cross-attention).

Mask convention, used everywhere in tfedu: a boolean mask with **True = may attend**, the
same as ``torch.nn.functional.scaled_dot_product_attention``. ``torch.nn.MultiheadAttention``
uses the opposite (True = masked out); pass ``~mask`` to it.

A query whose every key is masked (a "fully masked row") gets all-zero weights and an
all-zero output, never NaN; see ``attention_weights``.
"""

from __future__ import annotations

import math

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

MASK_CONVENTION = (
    "tfedu masks are boolean with True = may attend (the convention of "
    "torch.nn.functional.scaled_dot_product_attention); note that nn.MultiheadAttention's "
    "attn_mask uses the opposite, True = masked out"
)


# ----------------------------------------------------------------------------- checks


def _require_tensor(name: str, x: object, expected: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {expected}, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor of shape {expected}, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape {expected} (at least 2 dims), got shape {tuple(x.shape)}")


def _check_mask(mask: object, scores_shape: torch.Size, device: torch.device) -> None:
    expected = f"broadcastable to (..., query_pos, key_pos) = {tuple(scores_shape)}"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a boolean torch.Tensor {expected}, got {type(mask).__name__}. {MASK_CONVENTION}")
    if mask.dtype != torch.bool:
        hint = (
            " A float mask (0 / -inf added to the scores) is not accepted: turn it into booleans with `mask == 0`."
            if mask.is_floating_point()
            else " Convert it with `.bool()` only if 1 means 'may attend'."
        )
        raise TypeError(f"mask must have dtype torch.bool, got {mask.dtype}. {MASK_CONVENTION}.{hint}")
    if not _broadcasts_to(mask.shape, scores_shape):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
            f"(..., query_pos, key_pos) = {tuple(scores_shape)}; expected e.g. (query_pos, key_pos) = "
            f"{tuple(scores_shape[-2:])} or (batch, 1, 1, key_pos) for a padding mask. {MASK_CONVENTION}"
        )
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but q, k, v are on {device}; build it with device=q.device")


def _broadcasts_to(shape: torch.Size, scores_shape: torch.Size) -> bool:
    """True when a tensor of ``shape`` broadcasts to ``scores_shape`` without growing it."""
    try:
        return torch.broadcast_shapes(shape, scores_shape) == scores_shape
    except RuntimeError:
        return False


def _check_bias(bias: object, scores_shape: torch.Size, device: torch.device) -> None:
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        got = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise TypeError(
            f"bias must be a float tensor added to the scores, got {got}; a boolean keep/hide pattern goes in mask="
        )
    if not _broadcasts_to(bias.shape, scores_shape):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not broadcast to the scores' shape (..., query_pos, key_pos) = "
            f"{tuple(scores_shape)}; expected e.g. (n_heads, query_pos, key_pos) = (n_heads, {scores_shape[-2]}, "
            f"{scores_shape[-1]}) for ALiBi"
        )
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but q, k, v are on {device}; build it with device=q.device")


# ----------------------------------------------------------------------------- attention


def attention_weights(
    q: Float[Tensor, "... query_pos d_head"],
    k: Float[Tensor, "... key_pos d_head"],
    mask: Bool[Tensor, "*#batch #query_pos #key_pos"] | None = None,
    *,
    bias: Float[Tensor, "*#batch #query_pos #key_pos"] | None = None,
) -> Float[Tensor, "... query_pos key_pos"]:
    """softmax(q k^T / sqrt(d_head) + bias) over the key axis, with masked keys given weight 0.

    ``bias`` is an optional float tensor added to the scaled scores before masking, broadcastable
    to ``(..., query_pos, key_pos)``: ALiBi's ``-m * distance`` (``tfedu.positional.alibi_bias``)
    or T5's learned relative bias. It is what ``F.scaled_dot_product_attention`` calls a float
    ``attn_mask``.

    Each row (one query) sums to one over the keys it may attend to. A row whose every key
    is masked has no distribution to normalise: it gets all-zero weights (not NaN), so the
    output for that query is the zero vector.

    The softmax runs in float32 (or float64 for float64 inputs) and the weights are cast back
    to q's dtype, as torch's reference ("math") attention does for float16 and bfloat16.

    >>> q = torch.tensor([[1.0, 0.0]]); k = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> attention_weights(q, k)  # softmax([1, 0] / sqrt(2))
    tensor([[0.6698, 0.3302]])
    """
    _require_tensor("q", q, "(..., query_pos, d_head)")
    _require_tensor("k", k, "(..., key_pos, d_head)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q (..., query_pos, d_head) = {tuple(q.shape)} and k (..., key_pos, d_head) = {tuple(k.shape)} "
            f"must share d_head (the last dim): {q.shape[-1]} != {k.shape[-1]}"
        )
    if q.dtype != k.dtype or q.device != k.device:
        raise TypeError(f"q and k must share dtype and device, got {q.dtype} on {q.device} and {k.dtype} on {k.device}")
    try:
        scores_shape = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + (q.shape[-2], k.shape[-2])
    except RuntimeError:
        raise ValueError(
            f"the leading (batch) dims of q {tuple(q.shape)} and k {tuple(k.shape)} do not broadcast"
        ) from None
    if mask is not None:
        _check_mask(mask, torch.Size(scores_shape), q.device)
    if bias is not None:
        _check_bias(bias, torch.Size(scores_shape), q.device)

    # Dot products of unit-variance vectors have variance d_head; dividing by sqrt(d_head)
    # brings them back to variance 1 so the softmax does not saturate (paper, section 3.2.1).
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., query_pos, key_pos)
    scores = scores.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # The stable softmax of notebook 00, with one change: a fully masked row has max -inf,
    # and -inf - (-inf) is NaN, so such rows subtract 0 instead. Their exps are all 0, the
    # sum is 0, and 0 / 1 gives the documented all-zero weights.
    # The max is only a shift (softmax(s - c) = softmax(s) for any c), so no gradient flows
    # through it: detach() saves the backward pass from computing that zero (about 15% of this
    # function's forward + backward time on a CPU). The forward values are unchanged.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exps = (scores - row_max).exp()
    total = exps.sum(dim=-1, keepdim=True)
    weights = exps / torch.where(total > 0, total, torch.ones_like(total))
    return weights.to(q.dtype)


def scaled_dot_product_attention(
    q: Float[Tensor, "... query_pos d_head"],
    k: Float[Tensor, "... key_pos d_head"],
    v: Float[Tensor, "... key_pos d_v"],
    mask: Bool[Tensor, "*#batch #query_pos #key_pos"] | None = None,
    *,
    bias: Float[Tensor, "*#batch #query_pos #key_pos"] | None = None,
) -> tuple[Float[Tensor, "... query_pos d_v"], Float[Tensor, "... query_pos key_pos"]]:
    """softmax(q k^T / sqrt(d_head) + bias) v, returning ``(output, weights)``.

    ``mask`` is boolean, True = may attend, broadcastable to ``(..., query_pos, key_pos)``
    (for example ``causal_mask(n, n)`` or ``padding_mask(lengths, n)``). A query with no
    visible key gets zero weights and a zero output. Any number of leading batch dims.

    >>> q = k = torch.eye(2); v = torch.tensor([[1.0], [3.0]])
    >>> out, w = scaled_dot_product_attention(q, k, v)
    >>> out  # 0.67 * 1 + 0.33 * 3 for the first query
    tensor([[1.6605],
            [2.3395]])
    >>> scaled_dot_product_attention(q, k, v, mask=torch.tensor([[True, False], [False, False]]))[0]
    tensor([[1.],
            [0.]])
    """
    _require_tensor("q", q, "(..., query_pos, d_head)")
    _require_tensor("k", k, "(..., key_pos, d_head)")
    _require_tensor("v", v, "(..., key_pos, d_v)")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"k (..., key_pos, d_head) = {tuple(k.shape)} and v (..., key_pos, d_v) = {tuple(v.shape)} "
            f"must have the same key_pos (one value per key): {k.shape[-2]} != {v.shape[-2]}"
        )
    weights = attention_weights(q, k, mask, bias=bias)  # (..., query_pos, key_pos)
    if v.dtype != weights.dtype or v.device != weights.device:
        raise TypeError(f"v must share q's dtype and device, got {v.dtype} on {v.device} and {q.dtype} on {q.device}")
    return weights @ v, weights


# ----------------------------------------------------------------------------- masks


def causal_mask(n_query: int, n_key: int, *, device: torch.device | str | None = None) -> Bool[Tensor, "query_pos key_pos"]:
    """True where query i may attend key j: j <= i + (n_key - n_query).

    The diagonal is aligned to the END: the last query sees every key. With n_key == n_query
    this is the usual lower triangle. With n_key > n_query (queries are the newest tokens,
    keys include a cache of earlier ones, as in notebooks/10) query i sits at absolute position
    i + n_key - n_query. Note that ``F.scaled_dot_product_attention(is_causal=True)`` aligns
    to the top-left instead; the two agree when n_query == n_key. With n_key < n_query the
    first n_query - n_key queries see no key and get zero output.

    >>> causal_mask(3, 3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    >>> causal_mask(2, 4).int()
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    for name, n in (("n_query", n_query), ("n_key", n_key)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    ones = torch.ones(n_query, n_key, dtype=torch.bool, device=device)
    return ones.tril(diagonal=n_key - n_query)


def padding_mask(
    lengths: Int[Tensor, "batch"] | list[int], n_key: int
) -> Bool[Tensor, "batch 1 1 key_pos"]:
    """True for real tokens, False for padding, shaped ``(batch, 1, 1, key_pos)``.

    Sequence b holds ``lengths[b]`` real tokens followed by padding. The two singleton axes
    broadcast over heads and queries of the multi-head scores ``(batch, n_heads, query_pos,
    key_pos)``; for single-head scores ``(batch, query_pos, key_pos)`` use ``mask[:, 0]``.
    The mask lives on the device of ``lengths``.

    >>> padding_mask([2, 3], 3)[:, 0, 0]
    tensor([[ True,  True, False],
            [ True,  True,  True]])
    """
    if isinstance(lengths, (list, tuple)):
        lengths = torch.tensor(lengths, dtype=torch.long)
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must be a 1-D integer tensor or list of shape (batch,), got {lengths!r}")
    if not isinstance(n_key, int) or n_key < 0:
        raise ValueError(f"n_key must be a non-negative int, got {n_key!r}")
    if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > n_key):
        raise ValueError(f"every length must lie in [0, n_key={n_key}], got {lengths.tolist()}")
    positions = torch.arange(n_key, device=lengths.device)  # (key_pos,)
    real = positions < lengths[:, None]  # (batch, key_pos)
    return einops.rearrange(real, "batch key_pos -> batch 1 1 key_pos")


def combine_masks(*masks: Bool[Tensor, "..."] | None) -> Bool[Tensor, "..."] | None:
    """A key is visible only if every mask allows it: the broadcast logical AND (None skipped).

    Returns None when no mask is given, so ``combine_masks(causal, None)`` is ``causal``.

    >>> combine_masks(causal_mask(3, 3), padding_mask([2], 3)).int()[0, 0]
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 0]], dtype=torch.int32)
    """
    present = [m for m in masks if m is not None]
    for m in present:
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            got = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
            raise TypeError(f"combine_masks takes boolean masks, got {got}. {MASK_CONVENTION}")
    if not present:
        return None
    try:
        torch.broadcast_shapes(*(m.shape for m in present))
    except RuntimeError:
        shapes = ", ".join(str(tuple(m.shape)) for m in present)
        raise ValueError(f"masks of shapes {shapes} do not broadcast together") from None
    combined = present[0]
    for m in present[1:]:
        combined = combined & m
    return combined


# ----------------------------------------------------------------------------- multi-head


class MultiHeadAttention(nn.Module):
    """n_heads attention heads side by side, each of width d_head, then one output projection.

    Weights are ``nn.Linear`` layers: ``W_Q.weight`` has shape ``(n_heads * d_head, d_model)``
    and its rows are grouped head by head, i.e. the output features are laid out as
    ``(n_heads d_head)``; ``W_K`` and ``W_V`` the same with input width ``kv_d_model``;
    ``W_O.weight`` has shape ``(d_model, n_heads * d_head)``. This matches the packed
    ``in_proj_weight`` of ``nn.MultiheadAttention`` (see ``load_from_torch``).

    ``forward(x)`` is self-attention; ``forward(x, context)`` is cross-attention: queries from
    ``x``, keys and values from ``context``. ``mask`` (True = may attend) broadcasts to
    ``(batch, n_heads, query_pos, key_pos)``: give ``(query_pos, key_pos)``,
    ``(batch, 1, query_pos, key_pos)`` or ``(batch, 1, 1, key_pos)``.

    The attention pattern ``(batch, n_heads, query_pos, key_pos)`` passes through the hook
    point ``hook_pattern`` (an ``nn.Identity``): capture it with
    ``mha.hook_pattern.register_forward_hook(lambda mod, inp, out: saved.append(out))``;
    a hook that returns a tensor replaces the pattern (for ablations).

    ``tfedu.layers.Attention`` extends this class with what a full model needs: grouped key/value
    heads (several query heads sharing one key/value head), RoPE, an additive bias (ALiBi) and
    a switch to torch's fused kernel.

    >>> mha = MultiHeadAttention(d_model=8, n_heads=2)
    >>> mha(torch.randn(3, 5, 8)).shape
    torch.Size([3, 5, 8])
    """

    def __init__(
        self, d_model: int, n_heads: int, *, d_head: int | None = None, bias: bool = True, kv_d_model: int | None = None
    ) -> None:
        super().__init__()
        if d_head is None:
            if d_model % n_heads:
                raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass d_head explicitly")
            d_head = d_model // n_heads
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_head
        self.kv_d_model = d_model if kv_d_model is None else kv_d_model
        width = n_heads * d_head
        self.W_Q = nn.Linear(d_model, width, bias=bias)
        self.W_K = nn.Linear(self.kv_d_model, width, bias=bias)
        self.W_V = nn.Linear(self.kv_d_model, width, bias=bias)
        self.W_O = nn.Linear(width, d_model, bias=bias)
        self.hook_pattern = nn.Identity()

    def split_heads(
        self, x: Float[Tensor, "batch pos n_heads_d_head"], n_heads: int | None = None
    ) -> Float[Tensor, "batch n_heads pos d_head"]:
        """(batch, pos, n_heads * d_head) -> (batch, n_heads, pos, d_head); n_heads defaults to the layer's.

        That is ``einops.rearrange(x, "batch pos (n_heads d_head) -> batch n_heads pos d_head")``, written
        with ``unflatten`` and ``transpose`` (the same view) because a decode step calls it 36 times and
        einops' parsing costs ~4x the two view ops.
        """
        n_heads = self.n_heads if n_heads is None else n_heads
        return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)  # batch n_heads pos d_head

    @staticmethod
    def merge_heads(z: Float[Tensor, "batch n_heads pos d_head"]) -> Float[Tensor, "batch pos n_heads_d_head"]:
        """(batch, n_heads, pos, d_head) -> (batch, pos, n_heads * d_head): the 'concat' of the paper.

        ``einops.rearrange(z, "batch n_heads pos d_head -> batch pos (n_heads d_head)")``, in view ops
        (see ``split_heads``).
        """
        return z.transpose(1, 2).flatten(2)  # batch pos n_heads*d_head

    def forward(
        self,
        x: Float[Tensor, "batch query_pos d_model"],
        context: Float[Tensor, "batch key_pos kv_d_model"] | None = None,
        mask: Bool[Tensor, "..."] | None = None,
    ) -> Float[Tensor, "batch query_pos d_model"]:
        context = self._check_inputs(x, context, mask)
        q = self.split_heads(self.W_Q(x))  # (batch, n_heads, query_pos, d_head)
        k = self.split_heads(self.W_K(context))  # (batch, n_heads, key_pos, d_head)
        v = self.split_heads(self.W_V(context))  # (batch, n_heads, key_pos, d_head)
        pattern = self.hook_pattern(attention_weights(q, k, mask))  # (batch, n_heads, query_pos, key_pos)
        z = pattern @ v  # (batch, n_heads, query_pos, d_head)
        return self.W_O(self.merge_heads(z))  # (batch, query_pos, d_model)

    def _check_inputs(
        self, x: object, context: object, mask: object
    ) -> Float[Tensor, "batch key_pos kv_d_model"]:
        """Clear errors for the wrong shapes; returns the tensor keys and values are read from."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (batch, query_pos, d_model={self.d_model}), got {got}")
        if context is None:
            if self.kv_d_model != self.d_model:
                raise ValueError(
                    f"this layer reads keys of width kv_d_model={self.kv_d_model}: pass context of shape "
                    f"(batch, key_pos, {self.kv_d_model})"
                )
            context = x  # self-attention
        elif not isinstance(context, torch.Tensor) or context.dim() != 3 or context.shape[-1] != self.kv_d_model:
            got = tuple(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
            raise ValueError(f"context must have shape (batch, key_pos, kv_d_model={self.kv_d_model}), got {got}")
        if mask is not None and isinstance(mask, torch.Tensor) and mask.dim() not in (2, 4):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)}: give (query_pos, key_pos) or a 4-D mask broadcastable to "
                f"(batch, n_heads, query_pos, key_pos); a 3-D (batch, query_pos, key_pos) mask would line its batch "
                f"axis up with the heads, so insert the head axis with mask[:, None]"
            )
        return context

    @classmethod
    def load_from_torch(cls, mha: nn.MultiheadAttention) -> MultiHeadAttention:
        """A MultiHeadAttention computing exactly what ``mha`` computes, with its weights copied.

        ``nn.MultiheadAttention`` packs W_Q, W_K, W_V into ``in_proj_weight`` of shape
        ``(3 * embed_dim, embed_dim)`` (or separate ``q/k/v_proj_weight`` when kdim/vdim differ)
        and splits heads the same way. Remember its ``attn_mask`` means True = masked: give it
        ``~mask``.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"expected an nn.MultiheadAttention, got {type(mha).__name__}")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no counterpart in tfedu's MultiHeadAttention")
        if mha.kdim != mha.vdim:
            raise ValueError(f"tfedu's MultiHeadAttention reads keys and values from one context: kdim={mha.kdim} != vdim={mha.vdim}")
        has_bias = mha.in_proj_bias is not None
        ours = cls(mha.embed_dim, mha.num_heads, bias=has_bias, kv_d_model=mha.kdim)
        ours = ours.to(device=mha.out_proj.weight.device, dtype=mha.out_proj.weight.dtype)
        E = mha.embed_dim
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                w_q, w_k, w_v = mha.in_proj_weight.split(E, dim=0)
            else:
                w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
            for linear, w in ((ours.W_Q, w_q), (ours.W_K, w_k), (ours.W_V, w_v)):
                linear.weight.copy_(w)
            ours.W_O.weight.copy_(mha.out_proj.weight)
            if has_bias:
                for linear, b in zip((ours.W_Q, ours.W_K, ours.W_V), mha.in_proj_bias.split(E)):
                    linear.bias.copy_(b)
                ours.W_O.bias.copy_(mha.out_proj.bias)
        return ours


# ----------------------------------------------------------------------------- the look-up picture


def soft_lookup(
    query: Float[Tensor, "d_head"],
    keys: Float[Tensor, "key_pos d_head"],
    values: Float[Tensor, "key_pos d_v"],
    *,
    sharpness: float = 1.0,
) -> tuple[Float[Tensor, "d_v"], Float[Tensor, "key_pos"]]:
    """One query against a small dictionary: ``(answer, weights)``.

    A Python dict returns the value of the one key that equals the query. Attention returns
    a blend of all values, weighted by softmax(sharpness * query . key / sqrt(d_head)).
    sharpness -> infinity recovers the hard look-up (all weight on the best-matching key);
    sharpness = 0 averages all values. The widget in notebooks/04_attention.ipynb moves
    the query around and plots these weights.

    >>> keys = torch.tensor([[1.0, 0.0], [0.0, 1.0]]); values = torch.tensor([[10.0], [20.0]])
    >>> soft_lookup(torch.tensor([4.0, 0.0]), keys, values, sharpness=100.0)[0]
    tensor([10.])
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 1:
        raise ValueError(f"query must be a 1-D tensor (d_head,), got {getattr(query, 'shape', type(query).__name__)}")
    if not isinstance(sharpness, (int, float)) or sharpness < 0 or not math.isfinite(sharpness):
        raise ValueError(f"sharpness must be a finite number >= 0, got {sharpness!r}")
    answer, weights = scaled_dot_product_attention((query * sharpness)[None, :], keys, values)
    return answer[0], weights[0]


# ----------------------------------------------------------------------------- fused projection


class FusedQKV(nn.Module):
    """Queries, keys and values from ONE ``nn.Linear`` of width ``3 * width``, split in three.

    ``W_QKV.weight`` stacks W_Q, W_K and W_V (in ``nn.Linear`` layout, rows = output features)
    on top of each other: shape ``(3 * width, d_model)``. One matrix multiplication then gives
    all three projections, where separate layers need three; x is read once instead of three
    times. This is exactly how ``nn.MultiheadAttention`` stores its ``in_proj_weight`` when
    queries, keys and values share one width (see ``from_torch``). Self-attention only: the
    three projections read the same x.

    >>> fused = FusedQKV(d_model=4, width=2)
    >>> fused.W_QKV.weight.shape
    torch.Size([6, 4])
    >>> [t.shape for t in fused(torch.randn(5, 4))]
    [torch.Size([5, 2]), torch.Size([5, 2]), torch.Size([5, 2])]

    Built by hand in notebooks/04_attention.ipynb.
    """

    def __init__(self, d_model: int, width: int | None = None, *, bias: bool = True) -> None:
        super().__init__()
        width = d_model if width is None else width
        for name, n in (("d_model", d_model), ("width", width)):
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        self.d_model, self.width = d_model, width
        self.W_QKV = nn.Linear(d_model, 3 * width, bias=bias)

    def forward(
        self, x: Float[Tensor, "... pos d_model"]
    ) -> tuple[Float[Tensor, "... pos width"], Float[Tensor, "... pos width"], Float[Tensor, "... pos width"]]:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (..., pos, d_model={self.d_model}), got {got}")
        qkv = self.W_QKV(x)  # (..., pos, 3 * width): one matmul for all three
        q, k, v = qkv.split(self.width, dim=-1)  # views, no copy
        return q, k, v

    @classmethod
    def from_separate(cls, W_Q: nn.Linear, W_K: nn.Linear, W_V: nn.Linear) -> FusedQKV:
        """The fused layer computing exactly what three separate ``nn.Linear`` layers compute.

        >>> W_Q, W_K, W_V = (nn.Linear(4, 2) for _ in range(3))
        >>> q, k, v = FusedQKV.from_separate(W_Q, W_K, W_V)(x := torch.randn(3, 4))
        >>> torch.allclose(q, W_Q(x), atol=1e-6) and torch.allclose(v, W_V(x), atol=1e-6)  # one matmul or three: equal to rounding
        True
        """
        layers = (W_Q, W_K, W_V)
        if not all(isinstance(layer, nn.Linear) for layer in layers):
            raise TypeError(f"expected three nn.Linear layers, got {[type(layer).__name__ for layer in layers]}")
        if len({layer.weight.shape for layer in layers}) != 1:
            raise ValueError(f"W_Q, W_K, W_V must share one shape (width, d_model), got {[tuple(l.weight.shape) for l in layers]}")
        if len({layer.bias is None for layer in layers}) != 1:
            raise ValueError("W_Q, W_K, W_V must all have a bias or all have none")
        width, d_model = W_Q.weight.shape
        fused = cls(d_model, width, bias=W_Q.bias is not None).to(device=W_Q.weight.device, dtype=W_Q.weight.dtype)
        with torch.no_grad():
            fused.W_QKV.weight.copy_(torch.cat([layer.weight for layer in layers], dim=0))
            if W_Q.bias is not None:
                fused.W_QKV.bias.copy_(torch.cat([layer.bias for layer in layers], dim=0))
        return fused

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> FusedQKV:
        """The input projection of ``mha``: its ``in_proj_weight`` (3 * embed_dim, embed_dim), copied as is."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"expected an nn.MultiheadAttention, got {type(mha).__name__}")
        if not mha._qkv_same_embed_dim:
            raise ValueError("this nn.MultiheadAttention has kdim/vdim != embed_dim: it keeps separate q/k/v_proj_weight")
        has_bias = mha.in_proj_bias is not None
        fused = cls(mha.embed_dim, bias=has_bias).to(device=mha.in_proj_weight.device, dtype=mha.in_proj_weight.dtype)
        with torch.no_grad():
            fused.W_QKV.weight.copy_(mha.in_proj_weight)
            if has_bias:
                fused.W_QKV.bias.copy_(mha.in_proj_bias)
        return fused


# ----------------------------------------------------------------------------- attention dropout


def attention_dropout(
    weights: Float[Tensor, "... query_pos key_pos"],
    dropout_p: float,
    *,
    training: bool = True,
    keep: Bool[Tensor, "... query_pos key_pos"] | None = None,
    generator: torch.Generator | None = None,
) -> Float[Tensor, "... query_pos key_pos"]:
    """Inverted dropout on attention weights: zero each with probability dropout_p, scale the rest by 1/(1-p).

    This is what ``F.scaled_dot_product_attention(..., dropout_p=p)`` does to the weights before
    multiplying by v (and what BERT's and GPT-2's attention do, as does the Annotated
    Transformer). In training a row no longer sums to one, but its expected sum, and the
    expected output, are unchanged. ``training=False`` (or p = 0) returns ``weights`` itself.
    ``keep`` (True = keep) fixes the mask, for tests; otherwise it is drawn with ``generator``.

    >>> w = torch.tensor([[0.5, 0.25, 0.25]])
    >>> attention_dropout(w, 0.5, keep=torch.tensor([[True, False, True]]))
    tensor([[1.0000, 0.0000, 0.5000]])
    >>> attention_dropout(w, 0.5, training=False) is w
    True

    Built by hand in notebooks/04_attention.ipynb.
    """
    _require_tensor("weights", weights, "(..., query_pos, key_pos)")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a probability in [0, 1], got {dropout_p!r}")
    if keep is not None:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            raise TypeError(f"keep must be a boolean tensor (True = keep), got {getattr(keep, 'dtype', type(keep).__name__)}")
        try:
            broadcast = torch.broadcast_shapes(keep.shape, weights.shape)
        except RuntimeError:
            broadcast = None
        if broadcast != weights.shape:
            raise ValueError(f"keep of shape {tuple(keep.shape)} does not broadcast to the weights' {tuple(weights.shape)}")
    if not training or dropout_p == 0.0:
        return weights
    if dropout_p == 1.0:
        return torch.zeros_like(weights)  # everything dropped; 1/(1-p) would divide by zero
    if keep is None:
        draws = torch.rand(weights.shape, generator=generator, device=weights.device)
        keep = draws >= dropout_p  # kept with probability 1 - p
    return weights * keep / (1.0 - dropout_p)

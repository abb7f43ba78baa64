"""Checkers for notebooks/05_masks_and_heads.ipynb: the causal mask, masked attention, multi-head attention."""

from __future__ import annotations

import math
from typing import Any

import einops
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tfedu import attention as reference
from tfedu.checks.building_blocks import EINOPS, ELEMENTARY, MODULES, SOFTMAX
from tfedu.checks.core import CheckFailure, Hints, Probe, call_learner, checker, compare, describe, expect, seeded_randn
from tfedu.checks.nb04_attention import PAIR_EXPORT, QKV_LEAVES, compare_pair, exact_large_qk, pair_reference
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, backward, compare_outputs, leaf, upstream_like

# ----------------------------------------------------------------------------- the causal mask

HINT_TRANSPOSED = (
    "your mask is True above the diagonal: query i may attend to the keys after it and not to the ones "
    "before it, so it hides the past and shows the future (a transposed mask). Keep the lower triangle: "
    "key j is visible to query i when j <= i"
)
HINT_NO_DIAGONAL = (
    "the diagonal is False: every token must be able to attend to itself (key j is visible to query i "
    "when j <= i, not j < i): the triangle you keep must include its diagonal"
)
HINT_MASKED_CONVENTION = (
    "you returned True where attention is forbidden (the convention of nn.MultiheadAttention's attn_mask). "
    "In tfedu, as in F.scaled_dot_product_attention, True = may attend: invert your mask with ~"
)
HINT_SHIFTED = (
    "your mask also lets query i see key i + 1, the very token it has to predict (the triangle reaches one "
    "step above the diagonal): key j is visible to query i when j <= i, so keep the diagonal and nothing above it"
)
HINT_ALL_TRUE = "your mask is True everywhere: nothing is hidden, so every token still sees the future"
HINT_NOT_BOOL = (
    "return a boolean tensor (dtype torch.bool), True = may attend: a comparison gives booleans, and so "
    "does a triangle kept from a tensor of booleans"
)
HINT_ADDITIVE = (
    "you returned an additive float mask (0 and -inf, added to the scores). Here the mask is boolean: "
    "True where query i may attend to key j (j <= i); masked_attention turns it into -inf later"
)


def _mask_mistakes(n: int) -> dict[str, torch.Tensor]:
    ones = torch.ones(n, n, dtype=torch.bool)
    return {
        HINT_MASKED_CONVENTION: ones.triu(1),
        HINT_TRANSPOSED: ones.triu(0),
        HINT_NO_DIAGONAL: ones.tril(-1),
        HINT_SHIFTED: ones.tril(1),
        HINT_ALL_TRUE: ones,
    }


@checker("causal mask")
def check_causal_mask(causal_mask) -> None:
    """Check a learner's ``causal_mask(n) -> Bool[Tensor, "query_pos key_pos"]``, True = may attend."""
    for n in (5, 1, 8):
        got = call_learner(causal_mask, n, name="causal_mask")
        expected = reference.causal_mask(n, n)
        what = f"causal_mask({n})"
        expect(isinstance(got, torch.Tensor), f"{what} should return a torch.Tensor, got {describe(got)}")
        if got.dtype != torch.bool:
            if got.is_floating_point() and torch.isinf(got).any():
                raise CheckFailure(HINT_ADDITIVE)
            pattern = "the right pattern but " if got.shape == expected.shape and torch.equal(got != 0, expected) else ""
            raise CheckFailure(f"{what} has {pattern}dtype {got.dtype}: {HINT_NOT_BOOL}")
        compare(got.cpu(), expected, what=what, mistakes=_mask_mistakes(n))


# ----------------------------------------------------------------------------- masked attention

HINT_AFTER_SOFTMAX = (
    "you masked after the softmax: the weights of each row no longer sum to one, and the future still "
    "leaks in through the softmax's denominator. Set the masked scores to minus infinity first, then take "
    "the softmax"
)
HINT_INVERTED = (
    "your mask hides the keys where mask is True; here True = may attend, so the scores to hide are "
    "where the mask is False (the mask's negation)"
)
HINT_INVERTED_FINITE = (
    "your mask hides the keys where mask is True; here True = may attend, so the scores to hide (with your "
    "very negative number) are where the mask is False (the mask's negation)"
)
HINT_IGNORED = "the mask had no effect: fill the scores where mask is False with -inf before the softmax"
HINT_FILL_ZERO = (
    "you filled the masked scores with 0, but exp(0) = 1, so masked keys still get weight; fill with "
    "minus infinity (or a very negative number such as -1e9)"
)
HINT_NO_SCALE = "missing 1/sqrt(d_k) scale: divide the scores by the square root of d_k (the last axis of q) before masking"
HINT_SCALE_NO_SQRT = (
    "you divided the scores by d_k; the scale is 1/sqrt(d_k): divide by its square root"
)
HINT_SWAPPED_PAIR = "you returned (weights, output); return them in the order (output, weights)"
HINT_MIX_TRANSPOSED = (
    "the weights are right but the output is not: the weights are (..., query_pos, key_pos), so the "
    "output is weights @ v, without transposing the weights"
)
HINT_BATCHED_CALL = (
    "the inputs are batched, (..., pos, d): swap only the keys' last two axes (.T reverses every axis of a "
    "batched tensor), and use the mask as given: it broadcasts against the scores (..., query_pos, "
    "key_pos), which an out-of-place masked fill accepts, where assigning through boolean indexing needs a "
    "mask of the scores' full shape"
)
HINT_MUTATED = (
    "your code changed its input `{name}` in place (an in-place op: /=, or a method whose name ends in an "
    "underscore such as masked_fill_ or logical_not_), so the caller's tensor is no longer what it passed "
    "in: build new tensors instead (the out-of-place operator or method, without the underscore)"
)
HINT_QUERY_AXIS = "softmax over the wrong (query) axis: each query's weights sum to one over the keys, dim=-1"
HINT_NAN = (
    "NaN or Inf in the result: fill the masked scores with -inf BEFORE the softmax (after it, the -inf "
    "stays in the weights and turns the output into NaN)"
)
HINT_PAIR = "return a pair (output, weights), as attention did in notebook 04"


def _scores(q: torch.Tensor, k: torch.Tensor, scale: bool = True) -> torch.Tensor:
    raw = q @ k.transpose(-2, -1)
    return raw / math.sqrt(q.shape[-1]) if scale else raw


def _masked_weight_mistakes(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    s = _scores(q, k)
    minus_inf = float("-inf")
    return {
        HINT_AFTER_SOFTMAX: torch.softmax(s, dim=-1) * mask,
        HINT_INVERTED: torch.softmax(s.masked_fill(mask, minus_inf), dim=-1),
        HINT_INVERTED_FINITE: torch.softmax(s.masked_fill(mask, -1e9), dim=-1),
        HINT_IGNORED: torch.softmax(s, dim=-1),
        HINT_FILL_ZERO: torch.softmax(s.masked_fill(~mask, 0.0), dim=-1),
        HINT_NO_SCALE: torch.softmax(_scores(q, k, scale=False).masked_fill(~mask, minus_inf), dim=-1),
        HINT_SCALE_NO_SQRT: torch.softmax((_scores(q, k, scale=False) / q.shape[-1]).masked_fill(~mask, minus_inf), dim=-1),
        HINT_QUERY_AXIS: torch.softmax(s.masked_fill(~mask, minus_inf), dim=-2),
    }


def _check_masked_pair(result: Any, q, k, v, mask, what: str) -> None:
    expected_out, expected_w = reference.scaled_dot_product_attention(q, k, v, mask)
    expect(isinstance(result, (tuple, list)) and len(result) == 2, f"{HINT_PAIR}; you returned {describe(result)}")
    expect(isinstance(result, tuple), f"{HINT_PAIR}; you returned a {type(result).__name__}: make it a tuple, return output, weights")
    output, weights = result
    for name, part in (("output", output), ("weights", weights)):
        expect(isinstance(part, torch.Tensor), f"the {name} of {what} should be a torch.Tensor, got {describe(part)}")
    if (
        isinstance(output, torch.Tensor) and isinstance(weights, torch.Tensor)
        and output.shape == expected_w.shape and weights.shape == expected_out.shape != expected_w.shape
    ):
        raise CheckFailure(HINT_SWAPPED_PAIR)
    mistakes = _masked_weight_mistakes(q, k, mask)
    name_mistake_with_nans(weights, mistakes)
    compare(weights, expected_w, what=f"the weights of {what}", mistakes=mistakes, nan_hint=HINT_NAN)
    output_mistakes = {hint: w @ v for hint, w in mistakes.items()}
    if q.shape[-2] == k.shape[-2]:
        output_mistakes[HINT_MIX_TRANSPOSED] = expected_w.transpose(-2, -1) @ v
    name_mistake_with_nans(output, output_mistakes)
    compare(output, expected_out, what=f"the output of {what}", mistakes=output_mistakes, nan_hint=HINT_NAN)


def name_mistake_with_nans(got: Any, mistakes: dict[str, torch.Tensor]) -> None:
    """Name a known mistake that leaves NaNs (an inverted mask hides every key of some row).

    ``compare`` reports NaN before it looks at mistakes; this runs first and matches the NaN
    pattern and the finite values together.
    """
    if not isinstance(got, torch.Tensor) or not got.is_floating_point() or not torch.isnan(got).any():
        return
    for hint, wrong in mistakes.items():
        if wrong.shape != got.shape or not torch.isnan(wrong).any():
            continue
        finite = ~torch.isnan(wrong)
        if torch.equal(torch.isnan(got), ~finite) and torch.allclose(got[finite].double(), wrong[finite].double(), atol=1e-5, rtol=1e-4):
            raise CheckFailure(hint)


def call_on_copies(fn: Any, named_args: dict[str, Any], *, name: str, error_hint: str = "") -> Any:
    """Call the learner's ``fn`` on copies of the tensors, and name any input it changed in place.

    ``named_args`` maps each argument's name to its value, in call order; a name written
    ``"kw:mask"`` is passed as the keyword ``mask=``. The checker keeps the originals, so a
    learner who mutates an input is told so instead of being compared against a reference
    computed from the mutated tensor.
    """
    copies = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in named_args.items()}
    positional = [value for key, value in copies.items() if not key.startswith("kw:")]
    keywords = {key[3:]: value for key, value in copies.items() if key.startswith("kw:")}
    result = call_learner(fn, *positional, name=name, error_hint=error_hint, **keywords)
    for key, value in named_args.items():
        if isinstance(value, torch.Tensor) and not torch.equal(copies[key], value):
            raise CheckFailure(HINT_MUTATED.format(name=key.removeprefix("kw:")))
    return result


def _visible_mask(seed: int, *shape: int) -> torch.Tensor:
    """A random boolean mask in which every query sees at least one key (its first one)."""
    mask = seeded_randn(seed, *shape) > 0
    mask[..., 0] = True
    return mask


@checker("masked attention")
def check_masked_attention(masked_attention) -> None:
    """Check a learner's ``masked_attention(q, k, v, mask) -> (output, weights)``, True = may attend."""
    q, k, v = seeded_randn(20, 2, 6, 4), seeded_randn(21, 2, 6, 4), seeded_randn(22, 2, 6, 3)
    causal = reference.causal_mask(6, 6)
    result = call_on_copies(masked_attention, {"q": q, "k": k, "v": v, "mask": causal}, name="masked_attention",
                            error_hint=HINT_BATCHED_CALL)
    _check_masked_pair(result, q, k, v, causal, "masked_attention(q, k, v, causal_mask(6)) on (2, 6, 4) inputs")
    # Cross-shaped (query_pos != key_pos), a mask per batch element, and 4-D (batch, heads, ...) inputs.
    q4, k4, v4 = seeded_randn(23, 2, 3, 4, 8), seeded_randn(24, 2, 3, 7, 8), seeded_randn(25, 2, 3, 7, 5)
    mask4 = _visible_mask(26, 2, 1, 4, 7)
    result = call_on_copies(masked_attention, {"q": q4, "k": k4, "v": v4, "mask": mask4}, name="masked_attention",
                            error_hint=HINT_BATCHED_CALL)
    _check_masked_pair(result, q4, k4, v4, mask4, "masked_attention on (2, 3, 4, 8) queries, (2, 3, 7, 8) keys, a (2, 1, 4, 7) mask")


# ----------------------------------------------------------------------------- multi-head attention

HINT_VIEW_SPLIT = (
    "heads split along the wrong axis: a view (or reshape) to (batch, n_heads, pos, d_head) straight from "
    "(batch, pos, d_model) reinterprets memory, so a 'head' mixes features of several positions. Split the "
    "last axis, d_model, into (n_heads, d_head) first, then move the head axis in front of pos"
)
HINT_VIEW_MERGE = (
    "concatenation wrong: a reshape to (batch, pos, n_heads * d_head) straight from (batch, n_heads, pos, "
    "d_head) glues positions together, not heads. Move the head axis next to d_head first (after pos), then "
    "merge the two"
)
HINT_POS_SPLIT = (
    "heads split along the wrong axis: you cut the pos axis into n_heads pieces. Every head sees every "
    "position and a d_head-wide slice of the features: cut the last axis, d_model, not pos"
)
HINT_INTERLEAVED = (
    "concatenation order wrong: you used '(d_head n_heads)', which interleaves the heads' features. Head h "
    "owns the contiguous block of features h*d_head:(h+1)*d_head (the layout of W_Q's rows and of "
    "nn.MultiheadAttention): use '(n_heads d_head)' when splitting and when concatenating"
)
HINT_INTERLEAVED_SPLIT = (
    "heads split along the wrong axis: '(d_head n_heads)' deals the features out to the heads in turn "
    "(feature j goes to head j % n_heads), so each head gets a strided set of features. Head h owns the "
    "contiguous block h*d_head:(h+1)*d_head (the layout of W_Q's rows and of nn.MultiheadAttention): in the "
    "pattern you split with, the head axis is the outer of the two"
)
HINT_INTERLEAVED_BOTH = (
    f"{HINT_INTERLEAVED_SPLIT}, and concatenate with the same '(n_heads d_head)' (you used '(d_head n_heads)' "
    "both times)"
)
HINT_NO_W_O = "missing W_O: after concatenating the heads, apply the output projection self.W_O"
HINT_SCALE_D_MODEL = (
    "you scaled the scores by sqrt(d_model); each head computes dot products of length d_head, so divide "
    "by the square root of d_head"
)
HINT_MHA_NO_SCALE = "missing 1/sqrt(d_head) scale on the scores q @ k^T of each head"
HINT_MHA_SCALE_NO_SQRT = "you divided the scores by d_head; the scale is 1/sqrt(d_head), its square root"
HINT_HEADS_NOT_MOVED = (
    "your attention ran across the heads, not across the positions: after splitting to (batch, pos, n_heads, "
    "d_head) move the head axis next to the batch axis, (batch, n_heads, pos, d_head), so that the scores are "
    "(batch, n_heads, query_pos, key_pos)"
)
HINT_MHA_CALL = (
    "split each projection's last axis into (n_heads, d_head) with the head axis moved in front of pos, and "
    "concatenate with the reverse move (a view after a transpose needs a reshape: the memory is no longer "
    "contiguous)"
)
HINT_MHA_CALL_MASK = (
    "the mask arrives already broadcastable to the scores (batch, n_heads, query_pos, key_pos): a "
    "(query_pos, key_pos) causal mask or a (batch, 1, 1, key_pos) padding mask; use it as it is, no unsqueeze"
)
HINT_MHA_CALL_CONTEXT = "keys and values have the context's length key_pos, not x's query_pos: split them with the context's shape"
HINT_MHA_QUERY_AXIS = "softmax over the wrong (query) axis: take it over the keys, the last dim"
HINT_CONTEXT = (
    "cross-attention: the keys and values come from `context` (it goes through W_K and W_V); only the "
    "queries come from x"
)
HINT_MHA_MASK_AFTER = HINT_AFTER_SOFTMAX
HINT_MHA_MASK_INVERTED = HINT_INVERTED
HINT_MHA_MASK_IGNORED = "the mask had no effect: fill the scores where mask is False with -inf before the softmax"
HINT_RETURNS_TUPLE = "forward should return only the output tensor of shape (batch, query_pos, d_model)"

D_MODEL, N_HEADS = 12, 3  # d_head = 4; pos = 6 is divisible by n_heads, so a pos-split runs and is caught


def make_reference_layer(seed: int, d_model: int = D_MODEL, n_heads: int = N_HEADS) -> reference.MultiHeadAttention:
    """tfedu's MultiHeadAttention with seeded weights (and non-zero biases)."""
    layer = reference.MultiHeadAttention(d_model, n_heads)
    with torch.no_grad():
        for i, (_, param) in enumerate(sorted(layer.named_parameters())):
            param.copy_(seeded_randn(seed + i, *param.shape) / math.sqrt(param.shape[-1]))
    return layer


def copy_weights(layer: reference.MultiHeadAttention, learner: Any) -> None:
    """Copy W_Q, W_K, W_V, W_O (weights and biases) into the learner's module, checking they fit."""
    with torch.no_grad():
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            theirs = getattr(learner, name, None)
            ours = getattr(layer, name)
            expect(
                isinstance(theirs, nn.Linear) and theirs.weight.shape == ours.weight.shape and theirs.bias is not None,
                f"keep the layers made in __init__: self.{name} should be nn.Linear with weight of shape "
                f"{tuple(ours.weight.shape)} and a bias, got {describe(getattr(theirs, 'weight', theirs))}",
            )
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)


def multi_head_variant(
    layer: reference.MultiHeadAttention,
    x: torch.Tensor,
    context: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    split: str = "heads",
    merge: str = "heads",
    scale: str = "d_head",
    softmax_dim: int = -1,
    mask_mode: str = "before",
    use_W_O: bool = True,
    kv_from: str = "context",
) -> torch.Tensor:
    """Multi-head attention with one chosen mistake: what a learner's buggy forward would return.

    With every argument at its default this equals the reference (the tests check so).
    """
    h = layer.n_heads
    kv_source = x if context is None or kv_from == "x" else context
    if split == "not_moved":  # heads split off but left after pos: attention runs across the heads
        q, k, v = (einops.rearrange(W(t), "b p (h d) -> b p h d", h=h) for W, t in
                   ((layer.W_Q, x), (layer.W_K, kv_source), (layer.W_V, kv_source)))
        pattern = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        z = einops.rearrange(pattern @ v, "b p h d -> b p (h d)")
        return layer.W_O(z) if use_W_O else z

    def split_fn(t: torch.Tensor) -> torch.Tensor:  # (batch, pos, width) -> (batch, n_heads, pos', d')
        b, p, w = t.shape
        if split == "heads":
            return einops.rearrange(t, "b p (h d) -> b h p d", h=h)
        if split == "view":
            return t.reshape(b, h, p, w // h)
        if split == "interleaved":
            return einops.rearrange(t, "b p (d h) -> b h p d", h=h)
        if split == "pos":
            return einops.rearrange(t, "b (h p) d -> b h p d", h=h)
        raise ValueError(split)

    def merge_fn(z: torch.Tensor, pos: int) -> torch.Tensor:  # back to (batch, pos, width)
        if merge == "heads":
            return einops.rearrange(z, "b h p d -> b p (h d)")
        if merge == "view":
            return z.reshape(z.shape[0], pos, -1)
        if merge == "interleaved":
            return einops.rearrange(z, "b h p d -> b p (d h)")
        if merge == "pos":
            return einops.rearrange(z, "b h p d -> b (h p) d")
        raise ValueError(merge)

    q, k, v = split_fn(layer.W_Q(x)), split_fn(layer.W_K(kv_source)), split_fn(layer.W_V(kv_source))
    raw = q @ k.transpose(-2, -1)
    divisor = {"d_head": math.sqrt(q.shape[-1]), "d_model": math.sqrt(layer.d_model), "none": 1.0,
               "d_head_no_sqrt": float(q.shape[-1])}[scale]
    scores = raw / divisor
    if mask is not None and mask_mode == "before":
        scores = scores.masked_fill(~mask, float("-inf"))
    if mask is not None and mask_mode == "inverted":
        scores = scores.masked_fill(mask, float("-inf"))
    if mask is not None and mask_mode == "inverted_finite":
        scores = scores.masked_fill(mask, -1e9)
    pattern = torch.softmax(scores, dim=softmax_dim)
    if mask is not None and mask_mode == "after":
        pattern = pattern * mask
    z = merge_fn(pattern @ v, x.shape[1])
    return layer.W_O(z) if use_W_O else z


def _mha_mistakes(layer, x, context=None, mask=None) -> dict[str, torch.Tensor]:
    variant = lambda **kw: multi_head_variant(layer, x, context, mask, **kw)  # noqa: E731
    mistakes = {
        HINT_VIEW_SPLIT: variant(split="view", merge="view"),
        HINT_VIEW_MERGE: variant(merge="view"),
        HINT_INTERLEAVED_BOTH: variant(split="interleaved", merge="interleaved"),
        HINT_INTERLEAVED_SPLIT: variant(split="interleaved"),
        HINT_NO_W_O: variant(use_W_O=False),
        HINT_SCALE_D_MODEL: variant(scale="d_model"),
        HINT_MHA_NO_SCALE: variant(scale="none"),
        HINT_MHA_SCALE_NO_SQRT: variant(scale="d_head_no_sqrt"),
        HINT_MHA_QUERY_AXIS: variant(softmax_dim=-2),
    }
    mistakes[HINT_VIEW_SPLIT + " (and merge back with a transpose)"] = variant(split="view")
    mistakes[HINT_INTERLEAVED] = variant(merge="interleaved")
    q_len = x.shape[1]
    k_len = q_len if context is None else context.shape[1]
    if mask is None and q_len == k_len:
        mistakes[HINT_HEADS_NOT_MOVED] = variant(split="not_moved")
    if mask is None and q_len == k_len and q_len % layer.n_heads == 0:
        mistakes[HINT_POS_SPLIT] = variant(split="pos", merge="pos", scale="d_model")
        mistakes[HINT_POS_SPLIT + " (scaled by sqrt(d_head))"] = variant(split="pos", merge="pos")
    if mask is not None:
        mistakes[HINT_MHA_MASK_AFTER] = variant(mask_mode="after")
        mistakes[HINT_MHA_MASK_INVERTED] = variant(mask_mode="inverted")
        mistakes[HINT_INVERTED_FINITE] = variant(mask_mode="inverted_finite")
        mistakes[HINT_MHA_MASK_IGNORED] = variant(mask_mode="ignored")
    if context is not None and context.shape == x.shape:
        mistakes[HINT_CONTEXT] = variant(kv_from="x")
    return mistakes


def _check_layer(learner: Any, layer, x, context=None, mask=None, *, what: str) -> None:
    named = {"x": x} if context is None else {"x": x, "context": context}
    if mask is not None:
        named["kw:mask"] = mask
    error_hint = HINT_MHA_CALL
    if context is not None and context.shape[1] != x.shape[1]:
        error_hint = HINT_MHA_CALL_CONTEXT + "; " + error_hint
    if mask is not None:
        error_hint += "; " + HINT_MHA_CALL_MASK
    got = call_on_copies(learner, named, name="MultiHeadAttention.forward", error_hint=error_hint)
    if isinstance(got, (tuple, list)):
        raise CheckFailure(f"{HINT_RETURNS_TUPLE}; {what} returned a {type(got).__name__} of {len(got)}")
    expect(isinstance(got, torch.Tensor), f"{HINT_RETURNS_TUPLE}; {what} returned {describe(got)}")
    mistakes = _mha_mistakes(layer, x, context, mask)
    name_mistake_with_nans(got, mistakes)
    compare(got, layer(x, context, mask=mask), what=what, mistakes=mistakes, nan_hint=HINT_NAN)


@checker("multi-head attention")
def check_multi_head_attention(MultiHeadAttention) -> None:
    """Check a learner's ``MultiHeadAttention(d_model, n_heads)`` module (its ``forward(x, context=None, mask=None)``)."""
    learner = call_learner(MultiHeadAttention, D_MODEL, N_HEADS, name="MultiHeadAttention")
    expect(isinstance(learner, nn.Module), f"MultiHeadAttention({D_MODEL}, {N_HEADS}) should be an nn.Module, got {describe(learner)}")
    layer = make_reference_layer(30)
    copy_weights(layer, learner)
    x = seeded_randn(40, 2, 6, D_MODEL)
    with torch.no_grad():
        _check_layer(learner, layer, x, what=f"forward(x) with d_model={D_MODEL}, n_heads={N_HEADS}, x of shape (2, 6, 12)")
        _check_layer(learner, layer, x, mask=reference.causal_mask(6, 6), what="forward(x, mask=causal_mask(6, 6))")
        # Cross-attention with a context as long as x: keys taken from x would go unnoticed otherwise.
        _check_layer(learner, layer, x, seeded_randn(41, 2, 6, D_MODEL), what="forward(x, context) with context of shape (2, 6, 12)")
        # query_pos != key_pos, and a padding mask over the context.
        _check_layer(learner, layer, x, seeded_randn(42, 2, 9, D_MODEL), reference.padding_mask([9, 5], 9),
                     what="forward(x, context, mask) with x (2, 6, 12), context (2, 9, 12) and a (2, 1, 1, 9) padding mask")
    # Other sizes: 8 heads of width 2, and a single head.
    for d_model, n_heads, seed in ((16, 8, 50), (8, 1, 60)):
        learner = call_learner(MultiHeadAttention, d_model, n_heads, name="MultiHeadAttention")
        layer = make_reference_layer(seed, d_model, n_heads)
        copy_weights(layer, learner)
        with torch.no_grad():
            _check_layer(learner, layer, seeded_randn(seed + 9, 3, 5, d_model), what=f"forward(x) with d_model={d_model}, n_heads={n_heads}")
    check_against_torch(MultiHeadAttention)


def check_against_torch(MultiHeadAttention, d_model: int = 16, n_heads: int = 4, seed: int = 70) -> None:
    """The learner's layer against PyTorch's own attention, two independent oracles.

    ``nn.MultiheadAttention`` with the same weights (its boolean attn_mask is True = masked out,
    hence ``~mask``), and the heads attended by ``F.scaled_dot_product_attention`` then ``W_O``.
    """
    torch_layer = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
    learner = call_learner(MultiHeadAttention, d_model, n_heads, name="MultiHeadAttention")
    with torch.no_grad():  # seeded weights, and non-zero biases (torch starts them at zero)
        torch_layer.in_proj_weight.copy_(seeded_randn(seed, 3 * d_model, d_model) / math.sqrt(d_model))
        torch_layer.in_proj_bias.copy_(seeded_randn(seed + 1, 3 * d_model) / 4)
        torch_layer.out_proj.weight.copy_(seeded_randn(seed + 4, d_model, d_model) / math.sqrt(d_model))
        torch_layer.out_proj.bias.copy_(seeded_randn(seed + 2, d_model) / 4)
        mine = reference.MultiHeadAttention.load_from_torch(torch_layer)
        copy_weights(mine, learner)
        x = seeded_randn(seed + 3, 2, 7, d_model)
        causal = reference.causal_mask(7, 7)
        got = call_learner(learner, x, mask=causal, name="MultiHeadAttention.forward", error_hint=HINT_MHA_CALL_MASK)
        expected, _ = torch_layer(x, x, x, attn_mask=~causal, need_weights=False)
        compare(got, expected, what="forward(x, mask=causal_mask(7, 7)) against nn.MultiheadAttention")
        q, k, v = (einops.rearrange(W(x), "b p (h d) -> b h p d", h=n_heads) for W in (mine.W_Q, mine.W_K, mine.W_V))
        fused = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        expected = mine.W_O(einops.rearrange(fused, "b h p d -> b p (h d)"))
        compare(got, expected, what="forward(x, mask=causal_mask(7, 7)) against F.scaled_dot_product_attention per head, then W_O")


# ----------------------------------------------------------------------------- probes

HINT_PROBE_OVERFLOW = (
    "scores around 1e3 overflow exp (exp(89) is already inf in float32): take torch.softmax over the masked "
    "scores, or subtract each row's max before exp if you wrote the softmax yourself"
)
HINT_FIXED_BUFFER = (
    "build the mask for the n you are given: a mask cut from a fixed-size buffer is too small for longer "
    "sequences"
)


def _mask_inputs(rng: np.random.Generator) -> dict:
    # One size the check cell uses, two beyond any fixed buffer a learner might cut masks from.
    return {"n": [int(rng.integers(1, 17)), *(int(n) for n in rng.integers(17, 101, size=2))]}


CAUSAL_MASK_RUN = HELPERS + """\
_results = [causal_mask(_n) for _n in inputs['n']]
outputs = {'returned': [_kind(_r) for _r in _results], 'masks': [_array(_r) for _r in _results]}
del _results
""" + CLEANUP


def _compare_masks(outputs: dict, expected: dict) -> str | None:
    kinds = outputs.get("returned")
    if not isinstance(kinds, list) or kinds != expected["returned"]:
        wrong = next((k for k in kinds if k != "tensor"), kinds) if isinstance(kinds, list) else kinds
        return f"causal_mask should return a torch.Tensor, it returned {wrong}"
    for got, want in zip(outputs.get("masks") or [], expected["masks"]):
        n = want.shape[0]
        if not isinstance(got, np.ndarray):
            return f"causal_mask({n}) should return a torch.Tensor"
        if got.dtype != np.bool_:
            return f"causal_mask should be boolean (True = may attend), got dtype {got.dtype}"
        if got.shape != want.shape:
            hint = f": {HINT_FIXED_BUFFER}" if got.ndim == 2 and got.shape[0] < n else ""
            return f"causal_mask({n}) has shape {got.shape}, expected {want.shape}{hint}"
        if not np.array_equal(got, want):
            return f"causal_mask({n}) differs from the lower-triangular mask (True on and below the diagonal)"
    return None


def _broadcast_mask(rng: np.random.Generator, leading: tuple[int, ...], n_query: int, n_key: int) -> np.ndarray:
    """A random mask of a shape that broadcasts to (*leading, n_query, n_key); every query sees a key."""
    shape = [n if rng.random() < 0.5 else 1 for n in leading] + [n_query if rng.random() < 0.8 else 1, n_key]
    if rng.random() < 0.3:
        shape = shape[len(leading):]  # (query_pos, key_pos) or (1, key_pos): the same for every batch
    mask = rng.random(shape) < rng.uniform(0.3, 0.9)
    mask[..., int(rng.integers(0, n_key))] = True  # a fully masked row has no softmax
    return mask


def _masked_attention_inputs(rng: np.random.Generator) -> dict:
    leading = tuple(int(n) for n in rng.integers(1, 4, size=int(rng.integers(1, 3))))  # (batch,) or (batch, heads)
    n_query, n_key, d_head, d_v = (int(rng.integers(lo, hi)) for lo, hi in ((1, 12), (1, 13), (2, 17), (1, 9)))
    scale = float(rng.uniform(0.5, 3.0))
    # Large scores on a long causal sequence, the shape a decoder sees.
    big_leading = tuple(int(n) for n in rng.integers(1, 4, size=int(rng.integers(1, 3))))
    n_big = int(rng.integers(17, 65))
    q_big, k_big = exact_large_qk(rng, big_leading, n_big, n_big)
    # Query 1 sees keys 0 and 1 only, both anti-aligned with it: every score it may see is about -1200.
    # A mask filled with a moderate number (-100, -1e3) instead of -inf then outweighs them all.
    q_big[..., 1, :] = -k_big[..., 0, :]
    k_big[..., 1, :] = k_big[..., 0, :]
    return {
        "q": (rng.standard_normal((*leading, n_query, d_head)) * scale).astype(np.float32),
        "k": (rng.standard_normal((*leading, n_key, d_head)) * scale).astype(np.float32),
        "v": rng.standard_normal((*leading, n_key, d_v)).astype(np.float32),
        "mask": _broadcast_mask(rng, leading, n_query, n_key),
        "upstream_output": upstream_like(rng, (*leading, n_query, d_v)),
        "upstream_weights": upstream_like(rng, (*leading, n_query, n_key)),
        "q_big": q_big, "k_big": k_big,
        "v_big": rng.standard_normal((*big_leading, n_big, int(rng.integers(1, 9)))).astype(np.float32),
        "mask_big": np.tril(np.ones((n_big, n_big), dtype=bool)),
    }


MASKED_ATTENTION_RUN = HELPERS + QKV_LEAVES + """\
_result = masked_attention(_q.clone(), _k.clone(), _v.clone(), torch.tensor(inputs['mask']))
_big = masked_attention(*(torch.tensor(inputs[_name]) for _name in ('q_big', 'k_big', 'v_big', 'mask_big')))
""" + PAIR_EXPORT + CLEANUP


def _mha_weights(rng: np.random.Generator, d_model: int, *, integer: bool = False) -> dict[str, np.ndarray]:
    weights = {}
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        if integer:
            weights[f"{name}_weight"] = rng.integers(-2, 3, size=(d_model, d_model)).astype(np.float32)
            weights[f"{name}_bias"] = rng.integers(-2, 3, size=d_model).astype(np.float32)
        else:
            weights[f"{name}_weight"] = (rng.standard_normal((d_model, d_model)) / np.sqrt(d_model)).astype(np.float32)
            weights[f"{name}_bias"] = (rng.standard_normal(d_model) * 0.1).astype(np.float32)
    return weights


def _mha_inputs(rng: np.random.Generator) -> dict:
    n_heads = int(rng.integers(1, 5))
    d_model = n_heads * int(rng.integers(1, 7))
    batch, pos, key_pos = int(rng.integers(1, 4)), int(rng.integers(1, 25)), int(rng.integers(1, 25))
    inputs: dict[str, Any] = {"d_model": d_model, "n_heads": n_heads, **_mha_weights(rng, d_model)}
    inputs["x"] = rng.standard_normal((batch, pos, d_model)).astype(np.float32)
    inputs["context"] = rng.standard_normal((batch, key_pos, d_model)).astype(np.float32)
    inputs["causal"] = np.tril(np.ones((pos, pos), dtype=bool))
    lengths = rng.integers(1, key_pos + 1, size=batch)
    inputs["padding"] = (np.arange(key_pos)[None, :] < lengths[:, None])[:, None, None, :]  # (batch, 1, 1, key_pos)
    for name, shape in (("self", (batch, pos, d_model)), ("causal", (batch, pos, d_model)), ("cross", (batch, pos, d_model))):
        inputs[f"upstream_{name}"] = upstream_like(rng, shape)
    # Large scores, exact in float32: integer x and weights, d_head 4 (sqrt 2), a long causal sequence.
    # W_Q = diag(+-2), no bias, W_K = -W_Q: the score of token i with token j is -q_i.q_j / 2. Token 0
    # has entries +-5 (|q_0|^2 = 400 per head) and token 1 = -token 0, so query 1 scores +200 against
    # key 0 (exp overflows unless the row max is subtracted) and query 0, which sees key 0 alone, scores
    # -200 there: a mask filled with -100 instead of -inf outweighs it.
    n_heads_big, pos_big = int(rng.integers(1, 5)), int(rng.integers(17, 49))
    d_big = 4 * n_heads_big
    big = {"d_model": d_big, "n_heads": n_heads_big, **_mha_weights(rng, d_big, integer=True)}
    big["W_Q_weight"] = np.diag(rng.choice([-2.0, 2.0], size=d_big)).astype(np.float32)
    big["W_Q_bias"] = np.zeros(d_big, dtype=np.float32)
    big["W_K_weight"], big["W_K_bias"] = -big["W_Q_weight"], -big["W_Q_bias"]
    big["x"] = rng.integers(-5, 6, size=(int(rng.integers(1, 3)), pos_big, d_big)).astype(np.float32)
    big["x"][:, 0] = rng.choice([-5.0, 5.0], size=d_big)
    big["x"][:, 1] = -big["x"][:, 0]
    big["causal"] = np.tril(np.ones((pos_big, pos_big), dtype=bool))
    inputs["big"] = big
    return inputs


def _load_layer(layer: nn.Module, inputs: dict) -> None:
    with torch.no_grad():
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            getattr(layer, name).weight.copy_(torch.from_numpy(inputs[f"{name}_weight"]))
            getattr(layer, name).bias.copy_(torch.from_numpy(inputs[f"{name}_bias"]))


def _mha_reference(inputs: dict) -> dict:
    layer = reference.MultiHeadAttention(inputs["d_model"], inputs["n_heads"])
    _load_layer(layer, inputs)
    x, context = leaf(inputs["x"]), leaf(inputs["context"])
    results = [layer(x), layer(x, mask=torch.from_numpy(inputs["causal"])),
               layer(x, context, mask=torch.from_numpy(inputs["padding"]))]
    wrt = {"x": x, "context": context, **{f"{name}.{part}": getattr(getattr(layer, name), part)
                                          for name in ("W_Q", "W_K", "W_V", "W_O") for part in ("weight", "bias")}}
    big = reference.MultiHeadAttention(inputs["big"]["d_model"], inputs["big"]["n_heads"])
    _load_layer(big, inputs["big"])
    with torch.no_grad():
        out_big = big(torch.from_numpy(inputs["big"]["x"]), mask=torch.from_numpy(inputs["big"]["causal"]))
    upstreams = [torch.from_numpy(inputs[f"upstream_{name}"]) for name in ("self", "causal", "cross")]
    return {
        "returned": ["tensor"] * 4,
        "self": as_array(results[0]), "causal": as_array(results[1]), "cross": as_array(results[2]),
        "causal_big": as_array(out_big),
        "grad": backward(results, upstreams, wrt),
    }


MHA_RUN = HELPERS + """\
def _layer(spec):
    layer = MultiHeadAttention(spec['d_model'], spec['n_heads'])
    with torch.no_grad():
        for name in ('W_Q', 'W_K', 'W_V', 'W_O'):
            getattr(layer, name).weight.copy_(torch.from_numpy(spec[name + '_weight']))
            getattr(layer, name).bias.copy_(torch.from_numpy(spec[name + '_bias']))
    return layer

_mha, _mha_big = _layer(inputs), _layer(inputs['big'])
_x, _context = torch.tensor(inputs['x'], requires_grad=True), torch.tensor(inputs['context'], requires_grad=True)
_results = [
    _mha(_x.clone()),
    _mha(_x.clone(), mask=torch.tensor(inputs['causal'])),
    _mha(_x.clone(), _context.clone(), mask=torch.tensor(inputs['padding'])),
    _mha_big(torch.tensor(inputs['big']['x']), mask=torch.tensor(inputs['big']['causal'])),
]
_wrt = {'x': _x, 'context': _context}
_wrt.update({_name + '.' + _part: getattr(getattr(_mha, _name), _part) for _name in ('W_Q', 'W_K', 'W_V', 'W_O') for _part in ('weight', 'bias')})
outputs = {
    'returned': [_kind(_r) for _r in _results],
    'self': _array(_results[0]), 'causal': _array(_results[1]), 'cross': _array(_results[2]), 'causal_big': _array(_results[3]),
    'grad': _backward(_results[:3], [torch.from_numpy(inputs['upstream_' + _name]) for _name in ('self', 'causal', 'cross')], _wrt),
}
del _layer, _mha, _mha_big, _x, _context, _results, _wrt
""" + CLEANUP


def _compare_mha(outputs: dict, expected: dict) -> str | None:
    return compare_outputs(
        outputs, expected, function="MultiHeadAttention.forward",
        labels={"self": "forward(x)", "causal": "forward(x, mask=causal_mask)",
                "cross": "forward(x, context, mask=padding_mask)",
                "causal_big": "forward(x, mask=causal_mask) on a long sequence with scores around 1e3"},
        nan_hints={"causal_big": HINT_PROBE_OVERFLOW},
        kind_hints={"a tuple of two tensors": "return only the output tensor (batch, query_pos, d_model), not the weights too"},
    )


PROBES = {
    "check_causal_mask": Probe(
        exercise="ex_causal_mask",
        make_inputs=_mask_inputs,
        run=CAUSAL_MASK_RUN,
        reference=lambda inputs: {"returned": ["tensor"] * len(inputs["n"]),
                                  "masks": [reference.causal_mask(n, n).numpy() for n in inputs["n"]]},
        forbidden=("tfedu.attention",),
        compare=_compare_masks,
    ),
    "check_masked_attention": Probe(
        builds=ELEMENTARY | SOFTMAX,
        exercise="ex_masked_attention",
        make_inputs=_masked_attention_inputs,
        run=MASKED_ATTENTION_RUN,
        reference=lambda inputs: pair_reference(inputs, reference.scaled_dot_product_attention, masked=True),
        compare=lambda outputs, expected: compare_pair(outputs, expected, function="masked_attention",
                                                       call="masked_attention(q, k, v, mask)"),
        forbidden=("tfedu.attention",),
    ),
    "check_multi_head_attention": Probe(
        builds=ELEMENTARY | SOFTMAX | MODULES | EINOPS,
        exercise="ex_multi_head_attention",
        make_inputs=_mha_inputs,
        run=MHA_RUN,
        reference=_mha_reference,
        compare=_compare_mha,
        forbidden=("tfedu.attention",),
    ),
}


# ----------------------------------------------------------------------------- hints, in steps (tfedu.hint)

HINTS = {
    "ex_causal_mask": Hints(
        number="5.1",
        check="check_causal_mask",
        idea=(
            "Entry (i, j) answers one yes/no question: may query i look at key j? It may when key j is not "
            "in query i's future, so the answer depends only on how i and j compare. Drawn with queries as "
            "rows, the True entries fill the lower triangle, and the diagonal is True: a token may look at "
            "itself."
        ),
        approach=(
            "Two routes, both one or two lines. (a) Start from an (n, n) tensor of booleans that are all True "
            "and keep only its lower triangle (torch has a function that keeps a triangle, and its `diagonal` "
            "argument decides whether the diagonal stays). (b) Make a column of query positions, shape (n, 1), "
            "and a row of key positions, shape (1, n), and compare them: broadcasting gives the (n, n) answer, "
            "already boolean."
        ),
        skeleton=(
            "def causal_mask(n):\n"
            "    query = torch.arange(n)[____]  # (n, 1): one row per query\n"
            "    key = torch.arange(n)[____]  # (1, n): one column per key\n"
            "    return ____  # (n, n) booleans: True where key j is not after query i\n"
        ),
    ),
    "ex_masked_attention": Hints(
        number="5.2",
        check="check_masked_attention",
        idea=(
            "A masked key must get weight exactly zero while each query's weights still sum to one. The "
            "softmax does both for you if the masked scores are minus infinity when it runs, because "
            "exp(-inf) = 0 and the denominator then only adds up the visible keys. Zeroing weights after the "
            "softmax breaks the sum; filling scores with 0 does not hide anything, since exp(0) = 1."
        ),
        approach=(
            "Four steps, as in notebook 04 plus one. Scores: q against the keys with the keys' last two axes "
            "swapped (only those two: the inputs may carry batch and head axes in front), divided by the "
            "square root of d_k, shape (..., query_pos, key_pos). Mask: where `mask` is False, replace the "
            "score by -inf with an out-of-place fill, so the caller's tensors are untouched; the mask "
            "broadcasts against the scores. Softmax over the keys, the last axis. Output: the weights times "
            "v, shape (..., query_pos, d_v). Return the output first, then the weights."
        ),
        skeleton=(
            "def masked_attention(q, k, v, mask):\n"
            "    scores = ____ / math.sqrt(____)  # (..., query_pos, key_pos)\n"
            "    scores = scores.masked_fill(____, ____)  # where may NOT a query attend?\n"
            "    weights = ____  # a distribution over the keys, for every query\n"
            "    return ____, weights\n"
        ),
    ),
    "ex_multi_head_attention": Hints(
        number="5.3",
        check="check_multi_head_attention",
        idea=(
            "Multi-head attention is n_heads small attentions side by side. Each head sees its own slice of "
            "d_head = d_model / n_heads features of the queries, keys and values, attends on its own, and "
            "the heads' outputs are laid side by side again and mixed by W_O. Nothing new happens inside a "
            "head: it is exercise 5.2 with d_k = d_head."
        ),
        approach=(
            "Shapes all the way: project x with W_Q and the context with W_K and W_V, each (batch, pos, "
            "d_model). Split the last axis into (n_heads, d_head) and move the head axis in front of the "
            "positions: (batch, n_heads, pos, d_head); one einops pattern does it for all three. Scores per "
            "head: contract d_head, giving (batch, n_heads, query_pos, key_pos), scaled by the square root of "
            "d_head (not of d_model). If a mask is given, fill -inf where it is False. Softmax over key_pos, "
            "then contract key_pos with the values: (batch, n_heads, query_pos, d_head). Merge the heads "
            "back, (batch, query_pos, n_heads * d_head), with the head axis outer (the layout W_O expects), "
            "and apply W_O."
        ),
        skeleton=(
            "def forward(self, x, context=None, mask=None):\n"
            "    context = x if context is None else context\n"
            "    split = ____  # an einops pattern: (batch, pos, d_model) -> (batch, n_heads, pos, d_head)\n"
            "    q = einops.rearrange(____, split, n_heads=self.n_heads)\n"
            "    k = ____\n"
            "    v = ____\n"
            "    scores = einops.einsum(q, k, ____) / ____  # (batch, n_heads, query_pos, key_pos)\n"
            "    if mask is not None:\n"
            "        scores = ____\n"
            "    pattern = ____  # softmax over the keys\n"
            "    z = einops.einsum(pattern, v, ____)  # (batch, n_heads, query_pos, d_head)\n"
            "    concat = einops.rearrange(z, ____)  # (batch, query_pos, d_model), heads outer\n"
            "    return ____\n"
        ),
    ),
}

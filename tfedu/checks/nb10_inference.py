"""Checkers for notebooks/10_inference_and_kv_cache.ipynb: cached decoding (a step, a loop), the cache's size, pooled heads.

Five exercises, each checked against tfedu's reference after first trying the known mistakes:

- 10.1 ``decode_step(q, k_new, v_new, k_cache, v_cache) -> (z, k_cache, v_cache)``: the cache
  overwritten instead of appended (the new key returned as the cache, written over the last
  cached position, or z taken over the new token alone), the new token attending to itself twice
  (appended twice, or attended over cat(grown cache, k_new)), the cache in the wrong layout
  ((batch, pos, n_heads, d_head), or grown along the heads axis), the new key put at the front, no
  1/sqrt(d_head), the softmax over the heads or the query axis, a causal mask (hiding the new token
  from itself, keeping the first key only, or a (pos+1, pos+1) mask that broadcasts the one query
  into pos+1 rows), z attended before the new key is appended, the values' cache built from keys,
  the triple returned in another order, z without its query axis, the inputs changed in place.
  Compared with ``tfedu.kv_cache.decode_step`` step by step from an empty cache (each step from
  the reference's state), then through a tiny GPT decoded greedily with the learner's step.
  ``scaled_dot_product_attention`` is refused: the attention over the cache is the exercise.
- 10.2 ``cached_generate(model, ids, max_new_tokens)``: greedy decoding with a ``KVCache``, its model calls logged
  (tokens fed, tokens cached): no cache, the prompt fed a token at a time, the whole sequence fed at each step, a
  fresh cache each step, the first position's logits after the prefill, dropout left on. Its tokens must be
  those of ``tfedu.generate.generate(..., use_cache=False)``.
- 10.3 ``cache_bytes(cfg, n_tokens, batch, dtype) -> int``: the learner's number at configs with
  grouped heads and a d_head of their own is divided by the reference's, and that ratio is read
  as a product of known mistakes: the 2 forgotten (keys only), n_heads instead of n_kv_heads,
  d_model instead of n_kv_heads * d_head, d_head taken as d_model // n_heads, batch or n_layers
  forgotten, 4 bytes whatever the dtype, bits instead of bytes, n_ctx instead of n_tokens (up to
  three at once are named). A float fails, even with the right value (see :func:`check_cache_bytes` for why). Compared with
  ``tfedu.kv_cache.kv_cache_bytes`` and with the bytes a real ``KVCache`` holds.
- 10.4 ``gqa_attention(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads)``: causal grouped-query attention against a
  locally built ``transformers`` ``LlamaAttention`` (RoPE off) with the same weights; the heads tiled instead of
  interleaved, no mask, no scale, the softmax over the queries.
- 10.5 ``pool_kv_weight(weight, n_heads, n_kv_heads) -> Tensor``: strided groups (heads j,
  j + n_kv_heads, ...), a sum instead of a mean, the first head of each group kept, the rows read
  as (d_head, n_heads), a bias (1-D) or trailing axes not handled, the input axis pooled, the
  input changed in place. Compared with ``tfedu.kv_cache.pool_kv_weight``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tfedu.checks.building_blocks import ELEMENTARY, SOFTMAX
from tfedu.checks.core import (
    CheckFailure,
    Hints,
    Probe,
    call_learner,
    call_on_copies,
    checker,
    compare,
    describe,
    expect,
    global_names,
    is_close,
    seeded_randn,
)
from tfedu.checks.nb04_attention import FUSED_ATTENTION
from tfedu.checks.probes import CLEANUP, GPT_CLEANUP, GPT_FROM_INPUTS, HELPERS, as_array, compare_outputs, gpt_from_inputs
from tfedu.config import ModelConfig
from tfedu.generate import generate
from tfedu.kv_cache import KVCache
from tfedu.model import GPT
from tfedu.kv_cache import decode_step as reference_decode_step
from tfedu.kv_cache import kv_cache_bytes, pool_kv_weight

# ----------------------------------------------------------------------------- 10.1 decode_step

CACHE_LAYOUT = "(batch, n_heads, pos, d_head): heads before positions, the positions on dim 2"
HINT_OVERWRITTEN = (
    "your cache was overwritten instead of appended: the returned {name} holds {held} position(s) where it "
    "should hold pos + 1 = {want}. The cache keeps every earlier token's key and value; each step adds the new "
    "token's after them, on the positions axis, and returns that grown cache"
)
HINT_OVERWROTE_LAST = (
    "your cache was overwritten instead of appended: the new token's {what} replaced the last cached position, "
    "so that earlier token is lost. Keep every cached position and add the new one after them"
)
HINT_ONLY_NEW = (
    "your z is the new token's own value: its query attended to its own key alone, as if the cache had been "
    "overwritten instead of appended. It must attend over every cached key and its own, so take the scores "
    "against the grown cache: every cached key and the new one"
)
HINT_SELF_TWICE = (
    "the new token's query attends to itself twice: its key and value are in the grown cache already, and you "
    "added them once more{how}, so its own key gets double weight. Append k_new once, then attend over that "
    "grown cache alone"
)
HINT_LAYOUT = (
    "the returned {name} is laid out (batch, pos, n_heads, d_head): the cache must stay in the layout it came "
    "in, " + CACHE_LAYOUT + ". Grow it along the positions and do not transpose it"
)
HINT_HEADS_AXIS = (
    "your {name} grew along the heads axis (dim 1): the cache is " + CACHE_LAYOUT + ", so the new token "
    "goes on the positions axis"
)
HINT_FRONT = (
    "you put the new token's {what} at the front of the cache: position order matters to every later step "
    "(and to anything that reads the cache by position), so append it at the end. "
    "This step's z comes out the same, which is why only the returned cache shows it"
)
HINT_CACHE_SHAPE = (
    "the returned {name} has shape {got}, expected {want}: the cache is " + CACHE_LAYOUT + ", one position more "
    "after each step"
)
HINT_V_FROM_K = (
    "your value cache holds keys: the value cache grows with the new token's value, not its key"
)
HINT_Z_FROM_KEYS = (
    "your z is a weighted sum of keys: the attention weights multiply the values, softmax(q K^T / sqrt(d_head)) @ V "
    "with V the grown value cache"
)
HINT_NO_SCALE = (
    "z is off as if the scores were not scaled: divide q @ K^T by sqrt(d_head) before the softmax, as in every "
    "attention (Vaswani et al. 2017, eq. 1); a decoding step computes the same attention as the full pass"
)
HINT_SOFTMAX_HEADS = (
    "your softmax ran over the heads axis (dim 1): each head has its own pattern, and the new query's weights sum "
    "to 1 over the keys, the last axis of the scores (batch, n_heads, 1, pos + 1)"
)
HINT_SOFTMAX_QUERY = (
    "your softmax ran over the query axis (dim -2), which has one entry in a decoding step, so every weight is 1 "
    "and z is the sum of the values: take it over the keys, the last axis of the scores (batch, n_heads, 1, pos + 1)"
)
HINT_MASK_FIRST_KEY = (
    "z attends to the first key alone: a causal mask built for a (1, pos + 1) score matrix (the lower triangle "
    "of a one-row matrix of ones, or its strict upper triangle hidden) treats the one query as position 0 and "
    "hides every later key. A decoding step needs no mask: the new token is the last one, nothing in the cache is in its future"
)
HINT_MASK_SQUARE = (
    "your z has pos + 1 rows: a (pos + 1, pos + 1) causal mask broadcast the one query's scores to pos + 1 rows. "
    "A decoding step needs no mask: the new token is the last one and may see every cached key and its own"
)
HINT_SELF_HIDDEN = (
    "z leaves out the new token's own key: it attends over the cached keys only (attended before appending, or "
    "a mask that hides the diagonal). The new query sees every cached key and its own key, once: append first, "
    "then attend, with no mask"
)
HINT_Z_NAN = (
    "z holds NaN: at the first step the cache is empty and the new token's own key is the only one; a mask that "
    "hides it leaves a softmax over nothing but -inf. A decoding step needs no mask: append first, then attend"
)
HINT_Z_OVERFLOW = (
    "z holds NaN where the attention scores reach about {top:.0f} (queries and keys as large as a trained model's "
    "can be): in float32 e^x overflows once x passes about 88, and inf / inf is NaN. The softmax of a row does "
    "not change when the same number is subtracted from every score in it; subtract the row's largest score "
    "before exponentiating (torch's softmax does this for you)"
)
HINT_Z_SQUEEZED = (
    "z has lost its query axis: return it as (batch, n_heads, 1, d_head), the shape of q, so it goes through "
    "W_O like a one-position sequence"
)
HINT_ORDER = "you returned ({got}): return (z, k_cache, v_cache), the attention output first and the grown caches after"
HINT_TRIPLE = "decode_step should return a triple of tensors (z, k_cache, v_cache), got {got}"
HINT_DECODE_MUTATED = (
    "your decode_step changed the caller's `{name}` in place: return new tensors (a new, longer cache); writing "
    "into the old one would overwrite a position, not add one"
)
HINT_DECODE_CALL = (
    "decode_step(q, k_new, v_new, k_cache, v_cache): q, k_new, v_new are (batch, n_heads, 1, d_head); k_cache and "
    "v_cache are " + CACHE_LAYOUT + ", and pos is 0 at the first step (an empty cache). Append along dim 2, "
    "then attend; return (z, k_cache, v_cache)"
)
HINT_DECODE_SHORTCUT = (
    "your decode_step calls {name}: the exercise is the attention over the cache itself, softmax(q K^T / "
    "sqrt(d_head)) V, written with @ and torch.softmax"
)
DECODE_SHORTCUTS = ("scaled_dot_product_attention", "multi_head_attention_forward", "MultiheadAttention")


# The wrong orders, the likeliest first: at the first step z equals v_cache (one key, weight 1), so two orders match.
ORDERS = ((1, 2, 0), (0, 2, 1), (2, 1, 0), (1, 0, 2), (2, 0, 1))  # got[j] is the reference's result ORDERS[j]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: bool = True, dim: int = -1) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1)  # batch n_heads 1 key_pos
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    return scores.softmax(dim=dim) @ v


def _cache_mistakes(old: torch.Tensor, new: torch.Tensor, name: str, what: str) -> list[tuple[str, torch.Tensor]]:
    """(hint, wrong cache) for one of the two caches, ``old`` the cache passed in, ``new`` the new token's tensor."""
    grown = torch.cat([old, new], dim=2)
    mistakes = [
        (HINT_OVERWRITTEN.format(name=name, held=1, want=grown.shape[2]), new),
        (HINT_SELF_TWICE.format(how=" (appended twice)"), torch.cat([old, new, new], dim=2)),
        (HINT_FRONT.format(what=what), torch.cat([new, old], dim=2)),
        (HINT_LAYOUT.format(name=name), grown.transpose(1, 2)),
    ]
    if old.shape[2] >= 1:
        mistakes.append((HINT_OVERWROTE_LAST.format(what=what), torch.cat([old[:, :, :-1], new], dim=2)))
    if old.shape[2] == 1:  # only then do the sizes let torch.cat(..., dim=1) run
        mistakes.append((HINT_HEADS_AXIS.format(name=name), torch.cat([old, new], dim=1)))
    return mistakes


def _z_mistakes(q, k_new, v_new, k_cache, v_cache) -> list[tuple[str, torch.Tensor]]:
    K, V = torch.cat([k_cache, k_new], dim=2), torch.cat([v_cache, v_new], dim=2)  # batch n_heads pos+1 d_head
    positions = K.shape[2]
    square = torch.ones(positions, positions).triu(diagonal=1).bool()  # a full causal mask, key after query
    scores = (q @ K.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(square, float("-inf"))
    return [
        (HINT_ONLY_NEW, v_new),
        (HINT_SELF_TWICE.format(how=" (attended over cat(grown cache, k_new))"),
         _attend(q, torch.cat([K, k_new], dim=2), torch.cat([V, v_new], dim=2))),
        (HINT_NO_SCALE, _attend(q, K, V, scale=False)),
        (HINT_SOFTMAX_HEADS, _attend(q, K, V, dim=1)),
        (HINT_SOFTMAX_QUERY, _attend(q, K, V, dim=-2)),
        (HINT_MASK_FIRST_KEY, V[:, :, :1]),
        (HINT_SELF_HIDDEN, _attend(q, k_cache, v_cache)),  # zeros at the first step: a softmax over no key
        (HINT_Z_FROM_KEYS, _attend(q, K, K)),
        (HINT_MASK_SQUARE, scores.softmax(dim=-1) @ V),  # batch n_heads pos+1 d_head
    ]


def _triple(got: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailure(HINT_TRIPLE.format(got=describe(got) if not isinstance(got, (tuple, list)) else
                                              f"a {type(got).__name__} of " + ", ".join(describe(t) for t in got)))
    return tuple(t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t for t in got)


def _check_cache(got: torch.Tensor, want: torch.Tensor, mistakes: list[tuple[str, torch.Tensor]], name: str,
                 what: str) -> None:
    for hint, wrong in mistakes:
        if is_close(got, wrong) and not is_close(wrong, want):
            raise CheckFailure(hint)
    if got.shape != want.shape:
        raise CheckFailure(HINT_CACHE_SHAPE.format(name=name, got=tuple(got.shape), want=tuple(want.shape)))
    compare(got, want, what=f"{what}: the returned {name}")


def diagnose_decode_step(got: Any, q, k_new, v_new, k_cache, v_cache, what: str) -> None:
    """Raise CheckFailure naming what is wrong with ``got``, one step's answer; shared with the hidden test."""
    z, k_grown, v_grown = _triple(got)
    want = reference_decode_step(q, k_new, v_new, k_cache, v_cache)
    names = ("z", "k_cache", "v_cache")
    if not all(is_close(g, w) for g, w in zip((z, k_grown, v_grown), want)):
        for order in ORDERS:
            if all(is_close(g, want[i]) for g, i in zip((z, k_grown, v_grown), order)):
                raise CheckFailure(HINT_ORDER.format(got=", ".join(names[i] for i in order)))
    _check_cache(k_grown, want[1], _cache_mistakes(k_cache, k_new, "k_cache", "key"), "k_cache", what)
    v_mistakes = [(HINT_V_FROM_K, want[1]), (HINT_V_FROM_K, torch.cat([v_cache, k_new], dim=2)),
                  *_cache_mistakes(v_cache, v_new, "v_cache", "value")]
    _check_cache(v_grown, want[2], v_mistakes, "v_cache", what)
    mistakes = dict(_z_mistakes(q, k_new, v_new, k_cache, v_cache))  # in order: the first that matches is named
    mistakes[HINT_Z_SQUEEZED] = want[0].squeeze(2)
    keys = torch.cat([k_cache, k_new], dim=2)
    top = float((q @ keys.transpose(-2, -1)).abs().max()) / math.sqrt(q.shape[-1]) if keys.shape[2] else 0.0
    nan_hint = HINT_Z_OVERFLOW.format(top=top) if top > 80 else HINT_Z_NAN
    compare(z, want[0], what=f"{what}: z", mistakes=mistakes, nan_hint=nan_hint)


def _check_decode_call(fn: Any, q, k_new, v_new, k_cache, v_cache, what: str) -> None:
    got = call_on_copies(fn, {"q": q, "k_new": k_new, "v_new": v_new, "k_cache": k_cache, "v_cache": v_cache},
                         name="decode_step", mutated_hint=HINT_DECODE_MUTATED, error_hint=HINT_DECODE_CALL)
    diagnose_decode_step(got, q, k_new, v_new, k_cache, v_cache, what)


def decode_inputs(seed: int, batch: int, n_heads: int, d_head: int, start: int, steps: int, qk_scale: float = 1.0):
    """The new tokens' (q, k_new, v_new) for ``steps`` steps, and the cache of ``start`` earlier tokens.

    Keys and values are scaled so that the scores spread (no-scaling and other mistakes show); ``qk_scale``
    multiplies the queries and keys on top (12: scores past 100, where exp without the max shift overflows).
    """
    g = torch.Generator().manual_seed(seed)
    draw = lambda pos, scale=1.0: scale * 1.5 * torch.randn(batch, n_heads, pos, d_head, generator=g)  # noqa: E731
    tokens = [(draw(1, qk_scale), draw(1, qk_scale), draw(1)) for _ in range(steps)]
    return tokens, (draw(start, qk_scale), draw(start))


def _run_decode(fn: Any, seed: int, batch: int, n_heads: int, d_head: int, start: int, steps: int,
                qk_scale: float = 1.0) -> None:
    tokens, (k_cache, v_cache) = decode_inputs(seed, batch, n_heads, d_head, start, steps, qk_scale)
    for step, (q, k_new, v_new) in enumerate(tokens):
        pos = k_cache.shape[2]
        what = (f"step {step + 1} of {steps} (batch {batch}, {n_heads} heads, d_head {d_head}, "
                f"{pos} cached position{'s' if pos != 1 else ''})")
        _check_decode_call(fn, q, k_new, v_new, k_cache, v_cache, what)
        _, k_cache, v_cache = reference_decode_step(q, k_new, v_new, k_cache, v_cache)  # go on from the reference


@checker("one decoding step with a KV cache")
def check_decode_step(decode_step) -> None:
    """Check a learner's ``decode_step(q, k_new, v_new, k_cache, v_cache) -> (z, k_cache, v_cache)``.

    Step by step from an empty cache (pos = 0) through six steps with batch 2, 3 heads, d_head 5,
    then from a cache of 6 positions with one sequence, 4 heads, d_head 6; each step starts from
    the reference's cache, so one wrong step is one failure. Then a tiny GPT is decoded greedily
    with the learner's step (``tfedu.kv_cache.greedy_by_hand``), against the reference's tokens.
    """
    used = sorted(global_names(decode_step) & set(DECODE_SHORTCUTS))
    expect(not used, HINT_DECODE_SHORTCUT.format(name=", ".join(used)))
    _run_decode(decode_step, 0, batch=2, n_heads=3, d_head=5, start=0, steps=6)
    _run_decode(decode_step, 1, batch=1, n_heads=4, d_head=6, start=6, steps=2)
    _run_decode(decode_step, 2, batch=2, n_heads=2, d_head=8, start=3, steps=2, qk_scale=12.0)  # scores past 100
    from tfedu.config import preset
    from tfedu.kv_cache import greedy_by_hand
    from tfedu.model import GPT

    with torch.random.fork_rng():  # the learner's random state stays as it was
        torch.manual_seed(0)
        model = GPT(preset("tiny").replace(n_layers=1)).eval()
    ids = torch.randint(0, model.cfg.d_vocab, (2, 3), generator=torch.Generator().manual_seed(0))
    want = greedy_by_hand(model, ids, 4)
    got = call_learner(lambda: greedy_by_hand(model, ids, 4, step=decode_step), name="greedy_by_hand",
                       error_hint=HINT_DECODE_CALL)
    expect(torch.equal(got, want), f"a tiny GPT decoded greedily with your decode_step gives {got.tolist()}, with the "
                                   f"reference's {want.tolist()}")


# ----------------------------------------------------------------------------- 10.3 cache_bytes

HINT_KEYS_ONLY = "the 2 is missing: the cache holds a key AND a value vector per layer, key/value head and token"
HINT_N_HEADS = (
    "you counted n_heads heads where the cache holds n_kv_heads: with grouped-query attention several query heads "
    "share one key/value head, and only those are cached (that is the saving)"
)
HINT_D_MODEL = (
    "you used d_model for the width cached per token and layer: that is n_kv_heads * d_head (fewer key/value heads, "
    "and a d_head that need not be d_model / n_heads), read both from cfg"
)
HINT_D_HEAD_DERIVED = (
    "you took d_head as d_model // n_heads: a config may set its own d_head (Gemma's heads are wider than "
    "d_model / n_heads), so read cfg.d_head"
)
HINT_NO_BATCH = "batch is missing: every sequence in the batch keeps its own cache, so multiply by batch"
HINT_NO_LAYERS = "n_layers is missing: every block's attention keeps its own keys and values"
HINT_FOUR_BYTES = (
    "you assumed 4 bytes a number: the size depends on the dtype (float16 and bfloat16 take 2, float64 8); "
    "ask torch: dtype.itemsize, or element_size() of a tensor of that dtype"
)
HINT_BITS = "the count is 8 times too large: bits, not bytes (element_size() and itemsize are already in bytes)"
HINT_NO_BYTES = (
    "you counted numbers, not bytes: multiply by the bytes each number takes in dtype, dtype.itemsize "
    "(or element_size() of a tensor of that dtype): 4 in float32, 2 in float16 and bfloat16"
)
HINT_N_CTX = (
    "you used cfg.n_ctx, the longest context the model accepts, where the question is about n_tokens positions: "
    "the cache grows with the tokens held, use the n_tokens argument"
)
BYTES_MISTAKES = (HINT_KEYS_ONLY, HINT_N_HEADS, HINT_D_MODEL, HINT_D_HEAD_DERIVED, HINT_NO_BATCH, HINT_NO_LAYERS,
                  HINT_FOUR_BYTES, HINT_BITS, HINT_NO_BYTES, HINT_N_CTX)
# Never in one answer: d_model replaces n_kv_heads * d_head; n_heads * (d_model // n_heads) is d_model again.
EXCLUSIVE = (frozenset((HINT_N_HEADS, HINT_D_MODEL)), frozenset((HINT_D_MODEL, HINT_D_HEAD_DERIVED)),
             frozenset((HINT_N_HEADS, HINT_D_HEAD_DERIVED)), frozenset((HINT_NO_BYTES, HINT_FOUR_BYTES)),
             frozenset((HINT_NO_BYTES, HINT_BITS)))
HINT_BYTES_FLOAT_RIGHT = (
    "{call} returned {value!r}, a float with the right value: return an int (a number of bytes is a whole number; "
    "/ makes a float, keep to * and //)"
)
HINT_BYTES_FLOAT = "return an int, not a float ({value!r}): a number of bytes is a whole number"
HINT_BYTES_TYPE = "{call} should return the number of bytes as an int, got {value}"
HINT_BYTES_CALL = (
    "cache_bytes(cfg, n_tokens, batch, dtype): cfg a ModelConfig (cfg.n_layers, cfg.n_kv_heads, cfg.d_head), "
    "n_tokens and batch ints, dtype a torch.dtype (any of them, float64 too); the bytes per number come from "
    "dtype.itemsize, or element_size() of a tensor of that dtype"
)
DTYPES = ("float32", "float16", "bfloat16", "float64")


def _numbers(cfg: ModelConfig | dict) -> dict[str, int]:
    fields = ("n_layers", "n_heads", "n_kv_heads", "d_head", "d_model", "n_ctx")
    return {f: int(cfg[f] if isinstance(cfg, dict) else getattr(cfg, f)) for f in fields}


def _bytes_per_number(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def bytes_reference(cfg: ModelConfig | dict, n_tokens: int, batch: int, dtype: str) -> int:
    """The reference's bytes for a case given as plain data (cfg's numbers, dtype by name).

    >>> bytes_reference({"n_layers": 12, "n_heads": 12, "n_kv_heads": 12, "d_head": 64, "d_model": 768,
    ...                  "n_ctx": 1024}, 1, 1, "float32")  # GPT-2 small: 72 KiB a token
    73728
    """
    numbers = cfg if isinstance(cfg, ModelConfig) else SimpleNamespace(**_numbers(cfg))  # the fields it reads
    return kv_cache_bytes(numbers, n_tokens, batch, getattr(torch, dtype))


def _factors(cfg: ModelConfig | dict, n_tokens: int, batch: int, dtype: str) -> dict[str, Fraction]:
    """What each mistake multiplies the right count by, for one case."""
    c = _numbers(cfg)
    return {
        HINT_KEYS_ONLY: Fraction(1, 2),
        HINT_N_HEADS: Fraction(c["n_heads"], c["n_kv_heads"]),
        HINT_D_MODEL: Fraction(c["d_model"], c["n_kv_heads"] * c["d_head"]),
        HINT_D_HEAD_DERIVED: Fraction(c["d_model"] // c["n_heads"], c["d_head"]),
        HINT_NO_BATCH: Fraction(1, batch),
        HINT_NO_LAYERS: Fraction(1, c["n_layers"]),
        HINT_FOUR_BYTES: Fraction(4, _bytes_per_number(dtype)),
        HINT_BITS: Fraction(8),
        HINT_NO_BYTES: Fraction(1, _bytes_per_number(dtype)),
        HINT_N_CTX: Fraction(c["n_ctx"], n_tokens),
    }


def _mistake_sets(most: int = 3) -> list[tuple[str, ...]]:
    sets = []
    for size in range(1, most + 1):
        sets += [s for s in itertools.combinations(BYTES_MISTAKES, size)
                 if not any(pair <= set(s) for pair in EXCLUSIVE)]
    return sets


def _ratios(cases: Sequence[Sequence[Any]], mistakes: tuple[str, ...]) -> tuple[Fraction, ...]:
    out = []
    for case in cases:
        factors = _factors(*case)
        out.append(math.prod((factors[m] for m in mistakes), start=Fraction(1)))
    return tuple(out)


def separates_mistakes(cases: Sequence[Sequence[Any]]) -> bool:
    """True when every set of up to three mistakes changes the counts at ``cases`` in its own way."""
    seen = {tuple(Fraction(1) for _ in cases)}
    for mistakes in _mistake_sets():
        ratios = _ratios(cases, mistakes)
        if ratios in seen:
            return False
        seen.add(ratios)
    return True


def _call_text(cfg: Any, n_tokens: int, batch: int, dtype: str) -> str:
    c = _numbers(cfg)
    return (f"cache_bytes(cfg with n_layers={c['n_layers']}, n_heads={c['n_heads']}, n_kv_heads={c['n_kv_heads']}, "
            f"d_head={c['d_head']}, d_model={c['d_model']}, n_ctx={c['n_ctx']}; n_tokens={n_tokens}, batch={batch}, "
            f"torch.{dtype})")


def diagnose_bytes(cases: Sequence[Sequence[Any]], counts: Sequence[int | float]) -> str | None:
    """Feedback on the learner's counts at ``cases`` ((cfg, n_tokens, batch, dtype name) each); None when right.

    The ratio to the reference at every case is read as a product of up to three known mistakes.

    >>> gpt2 = {"n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "d_head": 64, "d_model": 768, "n_ctx": 1024}
    >>> cases = [(gpt2, 10, 3, "float16"), ({**gpt2, "n_layers": 5, "d_head": 40}, 7, 2, "float32")]
    >>> diagnose_bytes(cases, [bytes_reference(*c) // 2 for c in cases]).startswith("the 2 is missing")  # keys only
    True
    >>> diagnose_bytes(cases, [bytes_reference(*c) for c in cases]) is None
    True
    """
    wrong = [(case, count) for case, count in zip(cases, counts) if count != bytes_reference(*case)]
    if not wrong:
        return None
    case, count = wrong[0]
    want = bytes_reference(*case)
    detail = (f"{_call_text(*case)} returned {count:,}, expected {want:,} = 2 * n_layers * n_kv_heads * d_head * "
              f"bytes per number ({_bytes_per_number(case[3])}) * n_tokens * batch")
    got = tuple(Fraction(c) / bytes_reference(*k) for k, c in zip(cases, counts))
    for mistakes in _mistake_sets():
        if _ratios(cases, mistakes) == got:
            return f"{'; and '.join(mistakes)}. {detail}"
    return detail


def _as_count(value: Any, case: Sequence[Any]) -> int | float:
    """The learner's count (an int; a float only to diagnose it), or CheckFailure for anything else."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    call = _call_text(*case)
    if isinstance(value, torch.Tensor):
        raise CheckFailure(HINT_BYTES_TYPE.format(call=call, value=describe(value)) + ": count with Python ints, "
                           "not tensors (or return .item() of an integer tensor)")
    if isinstance(value, (float, np.floating)) and math.isfinite(value):
        return float(value)
    raise CheckFailure(HINT_BYTES_TYPE.format(call=call, value=describe(value)))


def judge_counts(cases: Sequence[Sequence[Any]], counts: Sequence[int | float]) -> str | None:
    """Feedback on counts (ints, or floats the learner returned); shared with the hidden test."""
    floats = [(case, c) for case, c in zip(cases, counts) if isinstance(c, float)]
    if floats and all(c == bytes_reference(*case) for case, c in zip(cases, counts)):
        case, value = floats[0]
        return HINT_BYTES_FLOAT_RIGHT.format(call=_call_text(*case), value=value)
    problem = diagnose_bytes(cases, counts)
    if floats:
        case, value = floats[0]
        return f"{problem}. And {HINT_BYTES_FLOAT.format(value=value)}"  # a float with a wrong value: problem is set
    return problem


def _config(n_layers: int, n_heads: int, n_kv_heads: int | None, d_head: int | None, d_model: int, n_ctx: int
            ) -> ModelConfig:
    return ModelConfig(d_vocab=100, n_ctx=n_ctx, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, d_head=d_head, d_mlp=4 * d_model)


# Grouped heads (n_kv_heads < n_heads), d_head given apart from d_model / n_heads, every dtype, batches > 1,
# n_tokens != n_ctx: each mistake (and each pair and triple of them) changes the counts in its own way.
BYTES_CASES = (
    (_config(6, 8, 2, 48, 512, 2048), 100, 3, "float16"),
    (_config(4, 12, 4, 40, 384, 1024), 1000, 2, "float32"),
    (_config(80, 64, 8, None, 8192, 4096), 4096, 1, "bfloat16"),  # Llama 2 70B's attention, 4096 tokens
    (_config(3, 4, None, 24, 64, 16), 7, 5, "float64"),  # multi-head, d_head 24 != 64 / 4
    (_config(12, 12, None, None, 768, 1024), 1024, 1, "float32"),  # GPT-2 small: 72 MiB for its context
    (_config(2, 16, 1, 8, 96, 64), 33, 6, "float16"),  # multi-query: one key/value head
)


@checker("the KV cache's size in bytes")
def check_cache_bytes(cache_bytes) -> None:
    """Check a learner's ``cache_bytes(cfg, n_tokens, batch, dtype) -> int``.

    Six cases: grouped and multi-query heads, a d_head of its own (not d_model / n_heads), float16,
    bfloat16, float32 and float64, batches of 1 to 6, n_tokens below and at n_ctx. Then the count
    must equal what a real ``KVCache.for_model(GPT(cfg), batch, capacity=n_tokens)`` holds, in
    float32 and bfloat16.

    Only an int passes (a NumPy integer too); a float fails even when its value is right. A number of
    bytes is a whole number, and every factor of it is an int (element_size() and itemsize included),
    so a float shows that a / crept in (bits / 8, a per-token size in KiB); it is also what ``nbytes``
    of a tensor or ``KVCache`` returns, and an exact count is what a memory budget is compared with.
    """
    counts = []
    for case in BYTES_CASES:
        cfg, n_tokens, batch, dtype = case
        got = call_learner(cache_bytes, cfg, n_tokens, batch, getattr(torch, dtype), name="cache_bytes",
                           error_hint=HINT_BYTES_CALL)
        counts.append(_as_count(got, case))
    problem = judge_counts(BYTES_CASES, counts)
    if problem:
        raise CheckFailure(problem)
    from tfedu.kv_cache import KVCache
    from tfedu.model import GPT

    cfg = _config(3, 6, 2, 10, 48, 32)
    for dtype in (torch.float32, torch.bfloat16):
        model = GPT(cfg).to(dtype)
        held = KVCache.for_model(model, batch=3, capacity=20).nbytes
        got = call_learner(cache_bytes, cfg, 20, 3, dtype, name="cache_bytes", error_hint=HINT_BYTES_CALL)
        expect(got == held, f"cache_bytes(cfg, 20, 3, {dtype}) = {got!r}, but a real KVCache for that model in "
                            f"{dtype} holds {held:,} bytes (the nbytes of a KVCache made for that model, batch 3, "
                            f"capacity 20)")


# ----------------------------------------------------------------------------- 10.5 pool_kv_weight

HINT_STRIDED = (
    "you pooled strided heads (j, j + n_kv_heads, j + 2 n_kv_heads, ...): key/value head j will serve the query "
    "heads j*g .. j*g + g - 1 (g = n_heads // n_kv_heads, consecutive: repeat_interleave, Llama's repeat_kv), so "
    "it must start as the mean of exactly those heads. Split the rows as (n_kv_heads, g, d_head) and average over g"
)
HINT_SUM = (
    "you summed the heads of each group: take their mean, so the pooled key (value) keeps the scale of one head "
    "(a sum makes the scores g times larger)"
)
HINT_FIRST_HEAD = (
    "you kept the first head of each group: that is selection, one of the alternatives Ainslie et al. 2023 "
    "compare (sec. 2.1, 3.3: mean pooling, the first head, random init); mean pooling works best, so average "
    "the g heads of each group"
)
HINT_ROWS_TRANSPOSED = (
    "you read the rows as (d_head, n_heads): nn.Linear's output features are the heads one after another, "
    "head h in rows h*d_head .. (h+1)*d_head - 1, so unflatten the first axis as (n_heads, d_head), "
    "or (n_kv_heads, g, d_head)"
)
HINT_TRAILING = (
    "keep the trailing axes as they are: the first axis holds the heads, and a weight (out, in) has one more axis "
    "while a bias (out,) has none. Split the first axis alone into (n_kv_heads, g, d_head) and pass the trailing "
    "sizes through as they are, whatever their number (unflatten does this), and it works for both"
)
HINT_INPUT_AXIS = (
    "you pooled the input axis: nn.Linear stores its weight as (out_features, in_features), so the heads are the "
    "rows (the first axis); pool those and keep the columns"
)
HINT_POOL_SHAPE = (
    "pool_kv_weight(weight of shape {shape}, n_heads={n_heads}, n_kv_heads={n_kv}) has shape {got}, expected "
    "{want}: the first axis goes from n_heads * d_head rows to n_kv_heads * d_head, the trailing axes stay"
)
HINT_POOL_MUTATED = "your pool_kv_weight changed the caller's `{name}` in place: return a new tensor"
HINT_POOL_CALL = (
    "pool_kv_weight(weight, n_heads, n_kv_heads): weight has n_heads * d_head rows (a 2-D weight or a 1-D bias); "
    "return n_kv_heads * d_head rows, each group of g = n_heads // n_kv_heads consecutive heads averaged"
)


def _pool_mistakes(weight: torch.Tensor, n_heads: int, n_kv: int) -> list[tuple[str, torch.Tensor]]:
    g, d_head = n_heads // n_kv, weight.shape[0] // n_heads
    rest = weight.shape[1:]
    heads = weight.reshape(n_kv, g, d_head, *rest)
    mistakes = [
        (HINT_STRIDED, weight.reshape(g, n_kv, d_head, *rest).mean(0).flatten(0, 1)),
        (HINT_SUM, heads.sum(1).flatten(0, 1)),
        (HINT_FIRST_HEAD, heads[:, 0].flatten(0, 1)),
        (HINT_ROWS_TRANSPOSED, weight.reshape(d_head, n_kv, g, *rest).mean(2).flatten(0, 1)),
        (HINT_TRAILING, heads.mean(1).reshape(n_kv * d_head, -1)),  # a bias comes back (rows, 1)
    ]
    if weight.dim() == 2 and weight.shape[1] % n_heads == 0:
        mistakes.append((HINT_INPUT_AXIS, weight.unflatten(1, (n_kv, g, -1)).mean(2).flatten(1)))
    return mistakes


def diagnose_pool(got: Any, weight: torch.Tensor, n_heads: int, n_kv: int) -> None:
    """Raise CheckFailure naming what is wrong with ``got``; shared with the hidden test."""
    want = pool_kv_weight(weight, n_heads, n_kv)
    if isinstance(got, torch.Tensor) and not (got.shape == want.shape and is_close(got, want)):
        for hint, wrong in _pool_mistakes(weight, n_heads, n_kv):
            if is_close(got, wrong) and not is_close(wrong, want):
                raise CheckFailure(hint)
        if got.shape != want.shape:
            raise CheckFailure(HINT_POOL_SHAPE.format(shape=tuple(weight.shape), n_heads=n_heads, n_kv=n_kv,
                                                      got=tuple(got.shape), want=tuple(want.shape)))
    what = f"pool_kv_weight(weight of shape {tuple(weight.shape)}, n_heads={n_heads}, n_kv_heads={n_kv})"
    compare(got, want, what=what)


def _check_pool_call(fn: Any, weight: torch.Tensor, n_heads: int, n_kv: int) -> None:
    error_hint = HINT_TRAILING if weight.dim() != 2 else HINT_POOL_CALL
    got = call_on_copies(fn, {"weight": weight, "n_heads": n_heads, "n_kv_heads": n_kv}, name="pool_kv_weight",
                         mutated_hint=HINT_POOL_MUTATED, error_hint=error_hint)
    diagnose_pool(got, weight, n_heads, n_kv)


# (rows as n_heads, d_head; trailing axes; n_heads; n_kv_heads): groups of 3, 2 and 4 heads, multi-query,
# no pooling at all, a bias and a weight with two trailing axes. d_head != n_heads, so a transposed read shows.
POOL_CASES = (((6, 4), (12,), 6, 2), ((8, 3), (16,), 8, 4), ((4, 5), (8,), 4, 1), ((6, 2), (6,), 6, 6),
              ((6, 4), (), 6, 3), ((8, 3), (2, 5), 8, 2), ((12, 2), (12,), 12, 3))


@checker("pooling key/value heads")
def check_pool_kv_weight(pool_kv_weight) -> None:
    """Check a learner's ``pool_kv_weight(weight, n_heads, n_kv_heads) -> Tensor``.

    Weights (n_heads * d_head, d_model) with groups of 2 to 4 heads, multi-query (one key/value head)
    and no pooling (n_kv_heads = n_heads); then a 1-D bias and a weight with two trailing axes.
    """
    for seed, ((n_heads, d_head), rest, _, n_kv) in enumerate(POOL_CASES):
        _check_pool_call(pool_kv_weight, seeded_randn(seed, n_heads * d_head, *rest), n_heads, n_kv)


# ----------------------------------------------------------------------------- 10.2 cached_generate

HINT_CG_NO_CACHE = (
    "the model was called without the cache: pass kv_cache=cache in every call, so that the prompt's keys and values "
    "are kept and each later step feeds only its one new token"
)
HINT_CG_PREFILL_STEPS = (
    "the prompt went in one token at a time ({calls} calls before the first new token): the prefill is one call with "
    "the whole prompt, all its positions in parallel, which also fills the cache"
)
HINT_CG_WHOLE_SEQUENCE = (
    "a decoding step fed {fed} tokens: the cache already holds every earlier token's keys and values, so each step "
    "feeds only the token chosen last, as a (batch, 1) tensor"
)
HINT_CG_FRESH_CACHE = (
    "a step found the cache empty: make the cache once, before the prefill, and pass the same one to every call "
    "(the model appends to it)"
)
HINT_CG_FIRST = (
    "after the prefill you took the logits of the first position: the model returns logits for every position it "
    "was fed, and the next token is predicted at the last one"
)
HINT_CG_EXTRA_CALL = (
    "the model ran {calls} times for {new} new token(s): the last new token needs no forward pass (nothing is "
    "chosen after it), so the calls are the prefill and one for each new token but the last, {new} in all. The "
    "extra call costs a whole step and, when the text reaches n_ctx, overflows the cache"
)
HINT_CG_ARGMAX = (
    "a new token is {got}, outside the vocabulary (0 .. {top}): the argmax ran over more than the vocabulary. Take "
    "it over the last axis of the last position's logits (batch, d_vocab), one token per row"
)
HINT_CG_DROPOUT = (
    "with a model that has dropout and was left in training mode, your tokens differ: call model.eval() first "
    "(torch.no_grad() alone does not turn dropout off)"
)
HINT_CG_RETURN = (
    "cached_generate should return the prompts followed by the new tokens, (batch, pos + max_new_tokens), got {got}"
)
HINT_CG_CALL = (
    "keep the signature cached_generate(model, ids, max_new_tokens). The cache comes from KVCache's for_model, given "
    "the model and the batch size; the model takes it as its kv_cache keyword and returns logits (batch, tokens fed, "
    "d_vocab)"
)
HINT_CG_MUTATED = "your cached_generate changed the caller's `{name}` in place: build a new tensor"

CG_N_CTX = 24


def make_cache_model(seed: int, *, dropout: float = 0.0) -> GPT:
    """A tiny GPT whose greedy continuations keep changing (std 0.5 weights, untied unembedding)."""
    cfg = ModelConfig(d_vocab=48, n_ctx=CG_N_CTX, d_model=32, n_layers=2, n_heads=4, init_std=0.5,
                      tied_embeddings=False, dropout=dropout, positional="rope")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg).eval()


class _CallLog:
    """Records each forward call of a model: how many tokens it was fed and how many its cache already held."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[int, int | None]] = []
        self.hook = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs.get("ids")
        cache = kwargs.get("kv_cache", args[2] if len(args) > 2 else None)
        self.calls.append((int(ids.shape[-1]), None if cache is None else int(cache.length)))


def reference_cached_generate(model: GPT, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding with a cache: tfedu.generate.generate, which equals decoding without one."""
    return generate(model, ids, max_new_tokens, use_cache=True)


def _cg_problem(calls: list[tuple[int, int | None]], prompt_len: int, new: int) -> str | None:
    """What the call log of ``new`` tokens' decoding says is wrong with the cache's use, or None."""
    if any(cached is None for _, cached in calls):
        return HINT_CG_NO_CACHE
    first_new = next((i for i, (fed, cached) in enumerate(calls) if cached + fed > prompt_len), None)
    if calls and calls[0][0] < prompt_len and calls[0][1] == 0:
        return HINT_CG_PREFILL_STEPS.format(calls=first_new + 1 if first_new is not None else len(calls))
    for i, (fed, cached) in enumerate(calls[1:], start=1):
        if cached == 0:
            return HINT_CG_FRESH_CACHE
        if fed != 1:
            return HINT_CG_WHOLE_SEQUENCE.format(fed=fed)
    if new >= 1 and len(calls) > new:
        return HINT_CG_EXTRA_CALL.format(calls=len(calls), new=new)
    return None


def _check_cg(fn: Any, model: GPT, ids: torch.Tensor, new: int, what: str) -> None:
    log = _CallLog(model)
    try:
        with torch.random.fork_rng(devices=[]):
            got = call_on_copies(fn, {"model": model, "ids": ids, "max_new_tokens": new}, name="cached_generate",
                                 mutated_hint=HINT_CG_MUTATED, error_hint=HINT_CG_CALL)
    except CheckFailure:  # the model refused a call (a cache overflowing, say): the calls so far may say why
        problem = _cg_problem(log.calls, ids.shape[1], new)
        if problem:
            raise CheckFailure(problem) from None
        raise
    finally:
        log.hook.remove()
    problem = _cg_problem(log.calls, ids.shape[1], new)
    if problem:
        raise CheckFailure(problem)
    expect(isinstance(got, torch.Tensor) and not got.is_floating_point(), HINT_CG_RETURN.format(got=describe(got)))
    want = generate(model, ids, new, use_cache=False)  # the uncached tokens: what the cache must not change
    problem = _cg_vocab_problem(got, ids.shape[1], model.cfg.d_vocab)
    if problem:
        raise CheckFailure(problem)
    compare(got, want, what=what, mistakes={HINT_CG_FIRST: _cg_variant(model, ids, new, "first")}, check_dtype=False,
            rtol=0, atol=0)


def _cg_vocab_problem(got: Any, prompt_len: int, d_vocab: int) -> str | None:
    """HINT_CG_ARGMAX when a new token lies outside the vocabulary (an argmax over more than the last axis)."""
    if not isinstance(got, (torch.Tensor, np.ndarray)) or got.ndim != 2 or got.shape[-1] <= prompt_len:
        return None
    new = got[:, prompt_len:]
    low, high = int(new.min()), int(new.max())
    if low < 0 or high >= d_vocab:
        return HINT_CG_ARGMAX.format(got=high if high >= d_vocab else low, top=d_vocab - 1)
    return None


def _cg_variant(model: GPT, ids: torch.Tensor, new: int, mistake: str | None = None) -> torch.Tensor:
    """Greedy decoding with a cache, right or with one known mistake."""
    model.eval()
    with torch.no_grad():
        cache = KVCache.for_model(model, batch=ids.shape[0])
        logits, out = model(ids, kv_cache=cache), ids
        for step in range(new):
            token = logits[:, 0 if mistake == "first" and step == 0 else -1].argmax(dim=-1, keepdim=True)
            out = torch.cat([out, token.to(ids.dtype)], dim=1)
            if step < new - 1:
                logits = model(token, kv_cache=cache)
    return out


@checker("generation with a KV cache")
def check_cached_generate(cached_generate) -> None:
    """Check a learner's ``cached_generate(model, ids, max_new_tokens)``: greedy decoding that prefills the prompt in one
    call and then feeds one token per call into one cache, giving exactly the tokens of uncached decoding
    (``tfedu.generate.generate(..., use_cache=False)``) on a tiny RoPE GPT; the calls are recorded (tokens fed, tokens
    cached). Named: no cache, a prefill token by token, the whole sequence fed again, a fresh cache each step, a
    forward pass after the last token, the first position's logits, dropout left on.
    """
    model = make_cache_model(0)
    ids = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    _check_cg(cached_generate, model, ids, 1, "cached_generate(model, ids, 1) with ids of shape (2, 5)")
    _check_cg(cached_generate, model, ids, 12, "cached_generate(model, ids, 12) with ids of shape (2, 5)")
    dropout_model = make_cache_model(0, dropout=0.5).train()
    log = _CallLog(dropout_model)
    try:
        got = call_on_copies(cached_generate, {"model": dropout_model, "ids": ids, "max_new_tokens": 8},
                             name="cached_generate", mutated_hint=HINT_CG_MUTATED, error_hint=HINT_CG_CALL)
    finally:
        log.hook.remove()
    want = generate(dropout_model, ids, 8, use_cache=False)
    if isinstance(got, torch.Tensor) and got.shape == want.shape and not torch.equal(got, want):
        raise CheckFailure(HINT_CG_DROPOUT)


# ----------------------------------------------------------------------------- 10.4 gqa_attention

HINT_GQA_TILED = (
    "the key/value heads were shared in the wrong order: key/value head j serves the g = n_heads / n_kv_heads "
    "consecutive query heads j*g .. j*g + g - 1 (Llama's layout), so each key/value head is repeated g times in a "
    "row (interleaved), not the whole stack of them tiled g times"
)
HINT_GQA_NO_MASK = (
    "every query saw every key: this is a decoder's self-attention, so query i attends to keys 0 .. i only (mask "
    "the later ones with -inf before the softmax)"
)
HINT_GQA_SCALE = "the scores were not divided by sqrt(d_head), the width of one head (not of the whole model)"
HINT_GQA_AXIS = "the softmax ran over the queries: each query's weights over the keys (the last axis) sum to 1"
HINT_GQA_SHAPE = (
    "gqa_attention should return (batch, pos, d_model) after W_O mixes the heads, got {got}: W_Q is "
    "(n_heads * d_head, d_model), W_K and W_V (n_kv_heads * d_head, d_model), W_O (d_model, n_heads * d_head)"
)
HINT_GQA_CALL = (
    "gqa_attention(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads): x (batch, pos, d_model) and the four weight "
    "matrices laid out as nn.Linear's, (out_features, in_features), without biases"
)
HINT_GQA_MUTATED = "your gqa_attention changed the caller's `{name}` in place: build new tensors"

HINT_GQA_SPLIT = (
    "the heads were split by reshaping (batch, pos, heads * d_head) straight to (batch, heads, pos, d_head): that "
    "mixes positions into heads. View it as (batch, pos, heads, d_head) first, then swap the pos and heads axes"
)
HINT_GQA_MERGE = (
    "the heads were merged by reshaping (batch, heads, pos, d_head) straight to (batch, pos, heads * d_head): swap "
    "the heads and pos axes back first, so that each position's row holds its own heads side by side"
)
HINT_GQA_SCALE_MODEL = (
    "the scores were divided by sqrt(d_model): the scale is the square root of one head's width, d_head"
)
HINT_GQA_DIAGONAL = (
    "NaN in the output: the mask hid the diagonal too, so the first query had no key at all (0 / 0). Query i "
    "attends to keys 0 .. i, itself included"
)
HINT_GQA_D_HEAD = (
    "the head width came from d_model: here d_head is {d_head} while d_model / n_heads is {other}. A head's width "
    "is W_Q's rows over n_heads (the weights, not x, say how wide the heads are)"
)

GQA_MISTAKES = {HINT_GQA_TILED: "tiled", HINT_GQA_NO_MASK: "no-mask", HINT_GQA_SCALE: "no-scale", HINT_GQA_AXIS: "axis",
                HINT_GQA_SCALE_MODEL: "scale-d-model", HINT_GQA_SPLIT: "split-no-transpose",
                HINT_GQA_MERGE: "merge-no-transpose"}


def _gqa_variant(x, W_Q, W_K, W_V, W_O, n_heads: int, n_kv_heads: int, mistake: str | None = None) -> torch.Tensor:
    """Grouped-query causal self-attention from its weights, right or with one known mistake."""
    batch, pos, _ = x.shape
    d_head = W_Q.shape[0] // n_heads
    if mistake == "split-no-transpose":  # (batch, pos, n * d_head) read as (batch, n, pos, d_head)
        heads = lambda t, n: t.reshape(batch, n, pos, d_head)  # noqa: E731
    else:
        heads = lambda t, n: t.view(batch, pos, n, d_head).transpose(1, 2)  # noqa: E731
    q, k, v = heads(x @ W_Q.T, n_heads), heads(x @ W_K.T, n_kv_heads), heads(x @ W_V.T, n_kv_heads)
    g = n_heads // n_kv_heads
    if mistake == "tiled":
        k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
    else:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = {"no-scale": 1.0, "scale-d-model": math.sqrt(x.shape[-1])}.get(mistake, math.sqrt(d_head))
    scores = q @ k.transpose(-2, -1) / scale
    if mistake != "no-mask":
        scores = scores.masked_fill(torch.ones(pos, pos, dtype=torch.bool).triu(1), float("-inf"))
    weights = torch.softmax(scores, dim=-2 if mistake == "axis" else -1)
    z = weights @ v  # batch n_heads pos d_head
    z = z.reshape(batch, pos, n_heads * d_head) if mistake == "merge-no-transpose" else \
        z.transpose(1, 2).reshape(batch, pos, n_heads * d_head)
    return z @ W_O.T


def reference_gqa_attention(x, W_Q, W_K, W_V, W_O, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """The exercise's answer."""
    return _gqa_variant(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads)


def llama_attention(seed: int, d_model: int, n_heads: int, n_kv_heads: int, d_head: int) -> torch.nn.Module:
    """A transformers LlamaAttention built locally (eager, no bias) with random weights: the oracle."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(hidden_size=d_model, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                         head_dim=d_head, attention_bias=False)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaAttention(config, layer_idx=0).eval()


def llama_output(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's causal self-attention with RoPE switched off (cos = 1, sin = 0: every rotation the identity)."""
    batch, pos, _ = x.shape
    d_head = layer.head_dim
    mask = torch.full((pos, pos), float("-inf")).triu(1).expand(batch, 1, pos, pos)
    with torch.no_grad():
        return layer(x, position_embeddings=(torch.ones(batch, pos, d_head), torch.zeros(batch, pos, d_head)),
                     attention_mask=mask)[0]


# (seed, batch, pos, d_model, n_heads, n_kv_heads, d_head): grouped, multi-query, and plain multi-head.
# The last: heads wider than d_model / n_heads (Gemma's layout), so that d_head must come from the weights.
GQA_CALLS = ((0, 2, 7, 32, 4, 2, 8), (1, 1, 9, 48, 6, 1, 8), (2, 2, 5, 24, 6, 3, 4), (3, 1, 6, 16, 2, 2, 8),
             (4, 1, 6, 32, 4, 2, 16))


@checker("grouped-query attention")
def check_gqa_attention(gqa_attention) -> None:
    """Check a learner's ``gqa_attention(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads) -> (batch, pos, d_model)``: causal
    self-attention with n_kv_heads key/value heads shared by groups of query heads, against a locally built
    ``transformers`` ``LlamaAttention`` (RoPE switched off) with the same weights: 2 groups of 2, multi-query, 3
    groups of 2, plain multi-head, and heads wider than d_model / n_heads. Named: the heads tiled instead of
    interleaved, no causal mask, no scale or sqrt(d_model), the softmax over the queries, the diagonal hidden (NaN),
    d_head taken from d_model.
    """
    for seed, batch, pos, d, n_heads, n_kv, d_head in GQA_CALLS:
        layer = llama_attention(seed, d, n_heads, n_kv, d_head)
        x = torch.randn(batch, pos, d, generator=torch.Generator().manual_seed(seed + 10))
        weights = [p.detach() for p in (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.o_proj.weight)]
        what = f"gqa_attention with {n_heads} query heads and {n_kv} key/value heads, x of shape {(batch, pos, d)}"
        try:
            got = call_on_copies(gqa_attention, {"x": x, "W_Q": weights[0], "W_K": weights[1], "W_V": weights[2],
                                                 "W_O": weights[3], "n_heads": n_heads, "n_kv_heads": n_kv},
                                 name="gqa_attention", mutated_hint=HINT_GQA_MUTATED, error_hint=HINT_GQA_CALL)
        except CheckFailure:
            if n_heads * d_head != d:  # the only call whose heads are not d_model / n_heads wide
                raise CheckFailure(HINT_GQA_D_HEAD.format(d_head=d_head, other=d // n_heads)) from None
            raise
        expect(isinstance(got, torch.Tensor) and got.shape == x.shape, HINT_GQA_SHAPE.format(got=describe(got)))
        want = llama_output(layer, x)
        mistakes = {hint: _gqa_variant(x, *weights, n_heads, n_kv, variant) for hint, variant in GQA_MISTAKES.items()}
        compare(got, want, what=f"{what} (against transformers' LlamaAttention)", mistakes=mistakes, check_dtype=False,
                nan_hint=HINT_GQA_DIAGONAL)


# ----------------------------------------------------------------------------- probes

# decode_step: from an empty cache through several steps, each from the reference's cache (drawn with the inputs).
DECODE_PROBE_RUN = HELPERS + """\
_results = [_call(decode_step, *(torch.from_numpy(_a) for _a in _step)) for _step in inputs['steps']]
_ok = lambda _r: isinstance(_r, (tuple, list)) and len(_r) == 3 and all(isinstance(_t, torch.Tensor) for _t in _r)
outputs = {'returned': ['a triple' if _ok(_r) else _kind(_r) for _r in _results], 'mutated': _MUTATED,
           'results': [[_array(_t) for _t in _r] if _ok(_r) else None for _r in _results]}
del _results, _ok
""" + CLEANUP


def _decode_probe_inputs(rng: np.random.Generator) -> dict:
    batch, n_heads = int(rng.integers(1, 4)), int(rng.integers(2, 5))
    d_head = int(rng.choice([3, 5, 6, 7, 10, 12]))  # no square: 1/sqrt(d_head) is not a round number
    draw = lambda pos: (1.5 * rng.standard_normal((batch, n_heads, pos, d_head))).astype(np.float32)  # noqa: E731
    k_cache, v_cache = torch.from_numpy(draw(0)), torch.from_numpy(draw(0))
    steps = []
    for _ in range(int(rng.integers(4, 7))):
        q, k_new, v_new = draw(1), draw(1), draw(1)
        steps.append([q, k_new, v_new, as_array(k_cache), as_array(v_cache)])
        _, k_cache, v_cache = reference_decode_step(*(torch.from_numpy(a) for a in (q, k_new, v_new)), k_cache, v_cache)
    pos, scale = int(rng.integers(1, 6)), np.float32(rng.uniform(10.0, 14.0))  # scores past 100: exp must not overflow
    steps.insert(int(rng.integers(0, len(steps) + 1)),
                 [draw(1) * scale, draw(1) * scale, draw(1), draw(pos) * scale, draw(pos)])
    return {"steps": steps}


def _decode_probe_reference(inputs: dict) -> dict:
    results = [[as_array(t) for t in reference_decode_step(*(torch.from_numpy(a) for a in step))]
               for step in inputs["steps"]]
    return {"returned": ["a triple"] * len(results), "results": results, "steps": inputs["steps"]}


def _tensor(value: Any) -> Any:
    return torch.from_numpy(np.array(value)) if isinstance(value, (np.ndarray, list)) else value


def _compare_decode(outputs: dict, expected: dict) -> str | None:
    kinds = {k: HINT_DECODE_CALL for k in ("tensor", "a tuple of two tensors")}
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="decode_step", kind_hints=kinds)
    if problem:
        return problem
    results = outputs.get("results")
    if not isinstance(results, list) or len(results) != len(expected["steps"]):
        return "decode_step's hidden test did not run every step"
    for step, (got, inputs) in enumerate(zip(results, expected["steps"])):
        pos = np.shape(inputs[3])[2]
        try:
            diagnose_decode_step([_tensor(t) for t in got], *(torch.from_numpy(a) for a in inputs),
                                 f"hidden test, step {step + 1} ({pos} cached positions)")
        except CheckFailure as failure:
            return str(failure)
    return None


# cache_bytes: fresh configs (grouped heads, a d_head of their own), drawn until every mistake shows apart.
BYTES_PROBE_RUN = HELPERS + """\
from tfedu.config import ModelConfig as _Config
_results = [cache_bytes(_Config(**_cfg), _n, _b, getattr(torch, _d)) for _cfg, _n, _b, _d in inputs['cases']]
outputs = {'returned': [_kind(_r) for _r in _results],
           'counts': [int(_r) if isinstance(_r, (int, np.integer)) and not isinstance(_r, (bool, np.bool_)) else None
                      for _r in _results],
           'floats': [float(_r) if isinstance(_r, (float, np.floating)) else None for _r in _results]}
del _Config, _results
""" + CLEANUP


def _bytes_probe_inputs(rng: np.random.Generator) -> dict:
    while True:
        cases = []
        for _ in range(6):
            n_heads = int(rng.choice([4, 6, 8, 12, 16, 32, 64]))
            n_kv = int(rng.choice([d for d in range(1, n_heads + 1) if n_heads % d == 0]))
            d_head = int(rng.choice([16, 24, 40, 64, 80, 96, 128]))
            d_model = n_heads * int(rng.choice([16, 24, 32, 48, 64, 80, 96, 128]))  # often != n_heads * d_head
            n_ctx = int(rng.choice([256, 512, 1024, 2048, 4096, 8192]))
            cfg = {"d_vocab": 100, "n_ctx": n_ctx, "d_model": d_model, "n_layers": int(rng.integers(1, 97)),
                   "n_heads": n_heads, "n_kv_heads": n_kv, "d_head": d_head, "d_mlp": 4 * d_model}  # d_mlp given: no
            # derivation inside the grader's watch
            cases.append([cfg, int(rng.integers(1, n_ctx)), int(rng.integers(1, 9)), str(rng.choice(DTYPES))])
        if separates_mistakes(cases):
            return {"cases": cases}


def _bytes_probe_reference(inputs: dict) -> dict:
    return {"cases": inputs["cases"], "counts": [bytes_reference(*case) for case in inputs["cases"]]}


def _compare_bytes(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not all(isinstance(outputs.get(k), list) for k in ("returned", "counts", "floats")):
        return "the hidden test's outputs should be a dict of lists"
    cases = expected["cases"]
    if not len(outputs["counts"]) == len(outputs["floats"]) == len(cases):
        return f"cache_bytes should have been called {len(cases)} times"
    counts = []
    for case, kind, count, value in zip(cases, outputs["returned"], outputs["counts"], outputs["floats"]):
        if count is None and value is None:
            return HINT_BYTES_TYPE.format(call=_call_text(*case), value=kind)
        counts.append(int(count) if count is not None else float(value))
    return judge_counts(cases, counts)


# pool_kv_weight: weights and biases with fresh sizes and groups.
POOL_PROBE_RUN = HELPERS + """\
_results = [_call(pool_kv_weight, torch.from_numpy(_w), _h, _g) for _w, _h, _g in zip(inputs['weights'],
            inputs['n_heads'], inputs['n_kv_heads'])]
outputs = {'returned': [_kind(_r) for _r in _results], 'mutated': _MUTATED, 'pooled': [_array(_r) for _r in _results]}
del _results
""" + CLEANUP


def _pool_probe_inputs(rng: np.random.Generator) -> dict:
    weights, heads, kvs = [], [], []
    for trailing in ("d_model", (), "d_model", (2, int(rng.integers(2, 5)))):  # weights, a bias, two trailing axes
        n_kv = int(rng.integers(1, 4))
        n_heads = n_kv * int(rng.integers(2, 5))
        d_head = int(rng.integers(2, 6))
        if trailing == "d_model":  # the input width of W_K, W_V: d_model, a multiple of n_heads
            trailing = (n_heads * int(rng.integers(1, 4)),)
        weights.append(rng.standard_normal((n_heads * d_head, *trailing)).astype(np.float32))
        heads.append(n_heads)
        kvs.append(n_kv)
    return {"weights": weights, "n_heads": heads, "n_kv_heads": kvs}


def _pool_probe_reference(inputs: dict) -> dict:
    pooled = [as_array(pool_kv_weight(torch.from_numpy(w), h, g))
              for w, h, g in zip(inputs["weights"], inputs["n_heads"], inputs["n_kv_heads"])]
    return {"returned": ["tensor"] * len(pooled), "pooled": pooled, "inputs": inputs}


def _compare_pool(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="pool_kv_weight")
    if problem:
        return problem
    pooled, inputs = outputs.get("pooled"), expected["inputs"]
    if not isinstance(pooled, list) or len(pooled) != len(inputs["weights"]):
        return "pool_kv_weight's hidden test did not run every case"
    for got, weight, n_heads, n_kv in zip(pooled, inputs["weights"], inputs["n_heads"], inputs["n_kv_heads"]):
        try:
            diagnose_pool(_tensor(got), torch.from_numpy(weight), n_heads, n_kv)
        except CheckFailure as failure:
            return str(failure)
    return None


DECODE_FORBIDDEN = ("tfedu.kv_cache", "tfedu.attention", "tfedu.flash", "tfedu.layers", "tfedu.model", "tfedu.generate",
                    "tfedu.mla", *FUSED_ATTENTION)

# cached_generate: a tiny RoPE GPT drawn fresh (weights as arrays, built in the kernel), prompts of a drawn length;
# the calls the answer makes are logged in the kernel (tokens fed, tokens cached) and judged here.

CG_PROBE_RUN = HELPERS + GPT_FROM_INPUTS + """\
_calls = []


def _log(_module, _args, _kwargs):
    _ids = _args[0] if _args else _kwargs.get('ids')
    _cache = _kwargs.get('kv_cache', _args[2] if len(_args) > 2 else None)
    _calls.append([int(_ids.shape[-1]), None if _cache is None else int(_cache.length)])


_hook = _model.register_forward_pre_hook(_log, with_kwargs=True)
try:
    _result = _call(cached_generate, _model, torch.from_numpy(inputs['ids']), inputs['max_new_tokens'])
    _error = None
except Exception as _e:
    _result, _error = None, type(_e).__name__ + ': ' + str(_e)[:200]
_hook.remove()
outputs = {'returned': [_kind(_result)], 'output': _array(_result), 'calls': _calls, 'error': _error,
           'mutated': _MUTATED}
del _calls, _log, _hook, _result, _error
""" + GPT_CLEANUP + CLEANUP


def _cg_probe_inputs(rng: np.random.Generator) -> dict:
    """A fresh model and prompts on which the first-position mistake gives other tokens (drawn again until so)."""
    while True:
        config = {"d_vocab": int(rng.integers(30, 80)), "n_ctx": 32, "d_model": 32, "n_layers": int(rng.integers(1, 3)),
                  "n_heads": 4, "init_std": 0.5, "tied_embeddings": False, "positional": str(rng.choice(["rope", "learned"]))}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(rng.integers(0, 2**31)))
            weights = {name: value.numpy() for name, value in GPT(ModelConfig(**config)).state_dict().items()}
        inputs = {"config": config, "weights": weights, "max_new_tokens": int(rng.integers(6, 14)),
                  "ids": rng.integers(0, config["d_vocab"], (int(rng.integers(1, 4)), int(rng.integers(3, 10)))).astype(np.int64)}
        model, ids = gpt_from_inputs(inputs), torch.from_numpy(inputs["ids"])
        if not torch.equal(_cg_variant(model, ids, inputs["max_new_tokens"], "first"),
                           generate(model, ids, inputs["max_new_tokens"], use_cache=False)):
            return inputs


def _cg_probe_reference(inputs: dict) -> dict:
    model, ids, new = gpt_from_inputs(inputs), torch.from_numpy(inputs["ids"]), inputs["max_new_tokens"]
    return {"returned": ["tensor"], "output": as_array(generate(model, ids, new, use_cache=False)),
            "first": as_array(_cg_variant(model, ids, new, "first")), "prompt_len": ids.shape[1], "new": new,
            "d_vocab": model.cfg.d_vocab}


def _compare_cg(outputs: dict, expected: dict) -> str | None:
    calls = [tuple(call) for call in outputs.get("calls") or []] if isinstance(outputs, dict) else []
    problem = _cg_problem(calls, expected["prompt_len"], expected["new"])
    if problem:
        return problem
    if isinstance(outputs, dict) and outputs.get("error"):
        return f"cached_generate raised {outputs['error']} ({HINT_CG_CALL})"
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="cached_generate")
    if problem:
        return problem
    got, want = outputs.get("output"), expected["output"]
    if isinstance(got, np.ndarray) and got.shape == want.shape and np.array_equal(got, want):
        return None
    problem = _cg_vocab_problem(got, expected["prompt_len"], expected["d_vocab"])
    if problem:
        return problem
    if isinstance(got, np.ndarray) and got.shape == want.shape and np.array_equal(got, expected["first"]):
        return HINT_CG_FIRST
    return "cached_generate's tokens differ from decoding without a cache in the hidden test"


# gqa_attention: fresh weights and shapes (grouped, multi-query, multi-head), drawn until each mistake shows apart.

GQA_PROBE_RUN = HELPERS + """\
_results = [_call(gqa_attention, *(torch.from_numpy(_a) for _a in _arrays), _heads, _kv)
            for _arrays, _heads, _kv in zip(inputs['arrays'], inputs['n_heads'], inputs['n_kv_heads'])]
outputs = {'returned': [_kind(_r) for _r in _results], 'outputs': [_array(_r) for _r in _results], 'mutated': _MUTATED}
del _results
""" + CLEANUP


def _gqa_probe_inputs(rng: np.random.Generator) -> dict:
    arrays, heads, kvs = [], [], []
    for n_heads, n_kv in ((int(rng.choice([4, 6, 8])), None), (int(rng.choice([2, 4])), 1)):
        n_kv = n_kv or int(rng.choice([h for h in range(2, n_heads) if n_heads % h == 0]))
        d_head, pos, batch = int(rng.choice([4, 8])), int(rng.integers(3, 10)), int(rng.integers(1, 3))
        d = n_heads * d_head
        draw = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
        arrays.append([draw(batch, pos, d), draw(n_heads * d_head, d, scale=d ** -0.5),
                       draw(n_kv * d_head, d, scale=d ** -0.5), draw(n_kv * d_head, d, scale=d ** -0.5),
                       draw(d, n_heads * d_head, scale=d ** -0.5)])
        heads.append(n_heads)
        kvs.append(n_kv)
    return {"arrays": arrays, "n_heads": heads, "n_kv_heads": kvs}


def _gqa_probe_reference(inputs: dict) -> dict:
    out = {"returned": [], "outputs": [], "mistakes": []}
    for c, (arrays, n_heads, n_kv) in enumerate(zip(inputs["arrays"], inputs["n_heads"], inputs["n_kv_heads"])):
        tensors = [torch.from_numpy(a) for a in arrays]
        out["returned"].append("tensor")
        out["outputs"].append(as_array(reference_gqa_attention(*tensors, n_heads, n_kv)))
        for hint, variant in GQA_MISTAKES.items():
            out["mistakes"].append([hint, c, as_array(_gqa_variant(*tensors, n_heads, n_kv, variant))])
    return out


def _compare_gqa(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="gqa_attention")
    if problem:
        return problem
    close = lambda a, b: isinstance(a, np.ndarray) and a.shape == b.shape and np.allclose(a, b, rtol=1e-4, atol=1e-5)  # noqa: E731
    for c, want in enumerate(expected["outputs"]):
        got = (outputs.get("outputs") or [None] * (c + 1))[c]
        if close(got, want):
            continue
        for hint, at, wrong in expected["mistakes"]:
            if at == c and close(got, wrong) and not close(wrong, want):
                return hint
        return f"gqa_attention differs from grouped-query attention in the hidden test's call {c + 1}"
    return None


PROBES = {
    "check_decode_step": Probe(
        builds=ELEMENTARY | SOFTMAX,
        exercise="ex_decode_step", make_inputs=_decode_probe_inputs, run=DECODE_PROBE_RUN,
        reference=_decode_probe_reference, compare=_compare_decode, forbidden=DECODE_FORBIDDEN),
    "check_cache_bytes": Probe(
        exercise="ex_cache_bytes", make_inputs=_bytes_probe_inputs, run=BYTES_PROBE_RUN,
        reference=_bytes_probe_reference, compare=_compare_bytes,
        forbidden=("tfedu.kv_cache", "tfedu.mla", "tfedu.model", "tfedu.layers")),
    "check_pool_kv_weight": Probe(
        exercise="ex_pool_kv_weight", make_inputs=_pool_probe_inputs, run=POOL_PROBE_RUN,
        reference=_pool_probe_reference, compare=_compare_pool, forbidden=("tfedu.kv_cache", "tfedu.model")),
    "check_cached_generate": Probe(
        exercise="ex_cached_generate", make_inputs=_cg_probe_inputs, run=CG_PROBE_RUN, reference=_cg_probe_reference,
        compare=_compare_cg, forbidden=("tfedu.generate",), builds=None),  # the model and the cache's own API
    "check_gqa_attention": Probe(
        exercise="ex_gqa_attention", make_inputs=_gqa_probe_inputs, run=GQA_PROBE_RUN, reference=_gqa_probe_reference,
        compare=_compare_gqa, builds=ELEMENTARY | SOFTMAX,
        forbidden=("tfedu.layers", "tfedu.attention", "tfedu.model", "transformers",
                   "torch.nn.functional.scaled_dot_product_attention")),
}


HINTS = {
    "ex_decode_step": Hints(
        number="10.1",
        check="check_decode_step",
        idea=(
            "A decoding step computes attention for one new token. Its key and value join the cache (in a causal "
            "model the earlier tokens' keys and values never change, so they are kept, not recomputed), and its "
            "query attends over every cached key and its own: softmax(q K^T / sqrt(d_head)) V over pos + 1 keys. "
            "No mask is needed, since nothing in the cache lies in the new token's future. The cache keeps its "
            "layout, heads before positions, and grows by one position, at the end."
        ),
        approach=(
            "(1) Append: concatenate k_new after k_cache along the positions axis (dim 2), giving (batch, "
            "n_heads, pos + 1, d_head), and the same for the values; torch.cat makes new tensors and works on an "
            "empty cache (pos = 0) too. (2) Scores: q against the grown keys with their last two axes swapped, "
            "divided by the square root of d_head, shape (batch, n_heads, 1, pos + 1). (3) Softmax over the keys, "
            "the last axis. (4) z: the weights times the grown value cache, (batch, n_heads, 1, d_head), the "
            "shape of q. Return (z, k_cache, v_cache), the caches grown."
        ),
        skeleton=(
            "def decode_step(q, k_new, v_new, k_cache, v_cache):\n"
            "    k_cache = torch.cat([____, ____], dim=____)  # (batch, n_heads, pos + 1, d_head)\n"
            "    v_cache = ____\n"
            "    scores = ____ / math.sqrt(____)  # (batch, n_heads, 1, pos + 1)\n"
            "    z = ____  # (batch, n_heads, 1, d_head)\n"
            "    return z, k_cache, v_cache\n"
        ),
    ),
    "ex_cache_bytes": Hints(
        number="10.3",
        check="check_cache_bytes",
        idea=(
            "A KV cache keeps, for every token it holds, one key vector and one value vector in every layer and "
            "for every key/value head. So its size is a product of counts: 2 (keys and values) times n_layers "
            "times n_kv_heads times d_head numbers per token, times the tokens held, times the sequences in the "
            "batch, times the bytes one number takes in the dtype. The traps: n_heads where grouped heads share "
            "n_kv_heads, d_model for the width, 4 bytes whatever the dtype, n_ctx instead of the tokens held."
        ),
        approach=(
            "Read every factor from the arguments: the config's n_layers, n_kv_heads and d_head (d_head is a "
            "field of its own, it need not be d_model / n_heads); the bytes per number from the dtype, whose "
            "itemsize is 2 for float16 and bfloat16, 4 for float32 and 8 for float64; n_tokens and batch as "
            "given. Multiply them all together with the 2 for keys and values, in integers (only *, no /), and "
            "return that int. A check of your own: GPT-2 small in float32 holds 72 KiB a token."
        ),
        skeleton=(
            "def cache_bytes(cfg, n_tokens, batch, dtype):\n"
            "    per_token = ____ * cfg.n_layers * ____ * ____  # numbers per token: keys and values, every layer\n"
            "    bytes_per_number = ____\n"
            "    return ____ * n_tokens * batch\n"
        ),
    ),
    "ex_pool_kv_weight": Hints(
        number="10.5",
        check="check_pool_kv_weight",
        idea=(
            "In grouped-query attention g = n_heads / n_kv_heads consecutive query heads share one key/value "
            "head, and converting a multi-head checkpoint makes each new head the mean of the old heads of its "
            "group. In a projection's weight the heads lie one after another along the first axis, d_head rows "
            "each, so new head j is the mean of old heads j*g .. j*g + g - 1: consecutive heads, not every "
            "n_kv_heads-th one. A mean, not a sum, keeps one head's scale; and the trailing axes (d_model inputs "
            "for a weight, none for a bias) stay as they are."
        ),
        approach=(
            "(1) d_head is the first axis's length divided by n_heads, and g is n_heads divided by n_kv_heads. "
            "(2) View the first axis as three, (n_kv_heads, g, d_head), and keep the trailing shape whatever it "
            "is: a weight becomes (n_kv_heads, g, d_head, d_model), a bias (n_kv_heads, g, d_head); a reshape "
            "that passes the trailing sizes on, or unflatten on axis 0, does both. (3) Average over the group "
            "axis, axis 1. (4) Merge the two leading axes back into n_kv_heads * d_head rows, trailing axes "
            "unchanged. Return a new tensor and leave the input alone."
        ),
        skeleton=(
            "def pool_kv_weight(weight, n_heads, n_kv_heads):\n"
            "    d_head = ____\n"
            "    groups = weight.reshape(____, ____, ____, *weight.shape[1:])  # (n_kv_heads, g, d_head, ...)\n"
            "    return groups.mean(dim=____).reshape(____, *weight.shape[1:])\n"
        ),
    ),
    "ex_cached_generate": Hints(
        number="10.2",
        check="check_cached_generate",
        idea=(
            "Decoding with a cache has two phases. The prefill runs the whole prompt through the model once, all its "
            "positions in parallel, and leaves every layer's keys and values in the cache; its last position's "
            "logits give the first new token. Then each step feeds only the token chosen last: the model places it "
            "after the tokens the cache holds, adds its keys and values, and returns logits for that one position. "
            "One cache serves the whole call; with the argmax at every step, the tokens are those of decoding "
            "without a cache."
        ),
        approach=(
            "Evaluation mode and no gradients. Make the cache once with KVCache.for_model for the model and the "
            "batch of prompts. Prefill: call the model on the whole ids with kv_cache set to the cache; the logits "
            "are (batch, pos, d_vocab). Then max_new_tokens times: the next token is the argmax over the "
            "vocabulary of the last position's logits, kept as a (batch, 1) column; append it to the output; "
            "unless it was the last one, call the model on that column alone with the same cache, which gives "
            "(batch, 1, d_vocab). Return the prompts followed by the new tokens."
        ),
        skeleton=(
            "@torch.no_grad()\n"
            "def cached_generate(model, ids, max_new_tokens):\n"
            "    model.____()\n"
            "    cache = ____  # one cache for the whole call\n"
            "    last = model(____, kv_cache=cache)[____]  # the prefill: the whole prompt at once\n"
            "    out = ids\n"
            "    for step in range(max_new_tokens):\n"
            "        token = ____  # (batch, 1)\n"
            "        out = torch.cat([out, token], dim=1)\n"
            "        if step < max_new_tokens - 1:\n"
            "            last = ____  # one new token, the same cache\n"
            "    return out\n"
        ),
    ),
    "ex_gqa_attention": Hints(
        number="10.4",
        check="check_gqa_attention",
        idea=(
            "Grouped-query attention is multi-head attention in which the keys and values have fewer heads than the "
            "queries. Each key/value head serves a group of g = n_heads / n_kv_heads consecutive query heads: head "
            "j of the keys and values is used by query heads j*g to j*g + g - 1. Once every key/value head is "
            "repeated for its group, it is ordinary causal multi-head attention: scores scaled by the square root of "
            "the head width, later keys hidden, a softmax over the keys, the weighted values, the heads joined and "
            "mixed by W_O."
        ),
        approach=(
            "d_head is W_Q's rows over n_heads. Project x with each weight matrix transposed; split the queries "
            "into (batch, n_heads, pos, d_head) and the keys and values into (batch, n_kv_heads, pos, d_head) "
            "(a view, then swap the positions and heads axes). Repeat each key and value head g times in a row "
            "along the heads axis (repeat_interleave), giving n_heads heads. Scores: the queries times the keys "
            "transposed over the last two axes, divided by the square root of d_head; fill -inf above the "
            "diagonal; softmax over the last axis; times the values. Swap the axes back, merge the heads into "
            "(batch, pos, n_heads * d_head) and multiply by W_O transposed."
        ),
        skeleton=(
            "def gqa_attention(x, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads):\n"
            "    batch, pos, _ = ____\n"
            "    d_head = ____\n"
            "    q = (x @ W_Q.T).view(____).transpose(1, 2)  # (batch, n_heads, pos, d_head)\n"
            "    k = ____  # (batch, n_kv_heads, pos, d_head)\n"
            "    v = ____\n"
            "    k, v = k.repeat_interleave(____), v.repeat_interleave(____)  # each kv head for its group\n"
            "    scores = ____\n"
            "    scores = scores.masked_fill(____, float(\"-inf\"))\n"
            "    z = ____  # (batch, n_heads, pos, d_head)\n"
            "    return ____ @ W_O.T\n"
        ),
    ),
}

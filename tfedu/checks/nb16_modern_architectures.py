"""Checkers for notebooks/16_modern_architectures.ipynb: QK-norm, the sliding-window mask, the ring-buffer KV cache
and Llama 3.1's RoPE scaling.

Exercise 16.1, ``qk_norm(q, k, v, q_gain, k_gain, rope, eps) -> (q, k, v)``: what Qwen3 and Gemma 3 do to the queries
and keys before the scores. ``q`` is ``(batch, n_heads, pos, d_head)``, ``k`` and ``v`` ``(batch, n_kv_heads, pos,
d_head)``; each head's query and key vectors are RMS-normalised over d_head (``x / sqrt(mean(x^2) + eps)``), times a
gain of shape ``(d_head,)`` shared by every head (``q_gain`` for the queries, ``k_gain`` for the keys), and only then
rotated by ``rope`` (a function of a ``(..., pos, d_head)`` tensor); the values pass unchanged. Named: the norm over
the whole d_model (every head of a position together), over the positions, after RoPE, on the values too (or the
values rotated), LayerNorm (the mean subtracted), no gain, the gain inside the norm, the gains swapped, eps outside
the square root, no RoPE, an L2 norm (F.normalize or the sum of squares), the key gain missing, a write into q or k
in place. ``tfedu.layers`` and ``tfedu.attention`` are refused. See :func:`check_qk_norm`.

Exercise 16.2, ``sliding_window_mask(n_query, n_key, window) -> mask``: a bool ``(n_query, n_key)`` tensor, True where
query i may attend key j: the queries are the newest ``n_query`` of ``n_key`` positions (aligned to the end, as the
causal mask of notebook 05), and each sees ``window`` keys, itself included: ``0 <= (i + n_key - n_query) - j <
window`` (transformers' and Mistral's convention). Named: a window one too wide or one too narrow, not causal (keys
ahead of the query kept), aligned to the start when n_query < n_key, the window at the wrong end (the oldest keys
kept), the window ignored (a plain causal mask), the mask inverted (True where hidden), a mask that is not bool.
``tfedu.layers`` is refused. See :func:`check_sliding_window_mask`.

Exercise 16.3, ``ring_append(ring_k, ring_v, length, k, v) -> (keys, values)``: a local layer's cache, a ring of
``slots = window - 1`` slots holding positions ``length - min(length, slots) .. length - 1``, position p in slot
``p % slots``; returns the kept keys (oldest first) followed by the new ones, and writes the newest ``min(new, slots)``
new positions into the ring in place. Checked over sequences of calls (a prompt, single tokens past several wraps,
chunks longer than the ring, one slot); the keys carry their position in channel 0, so a failure names the positions
returned and expected. Named: the wrong slot, the kept keys in slot order, written before read (one key short), only
the ring returned, nothing written, the keys written into the value ring (and which ring is wrong otherwise), and one
indexed write that repeats a slot when more new positions than slots arrive (undefined in PyTorch; seen through
:class:`WatchedRing`). ``tfedu.kv_cache`` and ``tfedu.layers`` are refused. See :func:`check_ring_append`.

Exercise 16.4, ``llama3_frequencies(d_head, base, scaling) -> inv_freq``: Llama 3.1's RoPE scaling (transformers'
``"llama3"``): pairs with a wavelength below ``L / high_freq_factor`` kept, above ``L / low_freq_factor`` divided by
the factor, blended linearly in ``L / wavelength`` between; equal to ``tfedu.positional.rope_frequencies`` (relative
1e-5). Named: no scaling, every pair divided (linear), slow pairs multiplied, the exponent in steps of 1 / d_head, the
wavelength without 2 pi, the thresholds swapped, the blend reversed, no blend. ``tfedu.positional`` is refused. See
:func:`check_llama3_frequencies`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tfedu.checks.building_blocks import ELEMENTARY
from tfedu.checks.core import (CheckFailure, Hints, Probe, call_learner, checker, describe, expect,
                               globals_from_modules)
from tfedu.checks.probes import CLEANUP, HELPERS, HINT_GRAD_MISSING
from tfedu.positional import apply_rope

QK_FORBIDDEN = ("tfedu.layers", "tfedu.attention")
MASK_FORBIDDEN = ("tfedu.layers",)
HINT_SHORTCUT = "your {function} uses {names} from tfedu: {what} is the exercise, so build it from tensor operations"

# ----------------------------------------------------------------------------- 16.1 QK-norm

HINT_QK_CALL = ("qk_norm(q, k, v, q_gain, k_gain, rope, eps): q (batch, n_heads, pos, d_head), k and v (batch, "
                "n_kv_heads, pos, d_head), the gains (d_head,), rope a function of a (..., pos, d_head) tensor; "
                "return the three tensors (q, k, v)")
HINT_QK_RETURN = "qk_norm should return a tuple (q, k, v) of three tensors, got {got}"
HINT_QK_SHAPE = "your {name} has shape {got}; it should keep the shape of the {name} passed in, {want}"
HINT_QK_DTYPE = "your {name} is {got}, the input {want}: keep the input's dtype"
HINT_QK_D_MODEL = (
    "you normalised each position's vector over every head at once (d_model, as a block's RMSNorm does): QK-norm "
    "normalises each head's query and key on its own, over d_head, so that every head's scores are bounded, one "
    "head's large vector cannot shrink another's. Take the mean of the squares over the last dimension of the "
    "(batch, heads, pos, d_head) tensor"
)
HINT_QK_POSITIONS = ("you took the mean of the squares over the positions (dimension -2): the norm is over each "
                     "vector's own d_head entries, the last dimension")
HINT_QK_AFTER_ROPE = (
    "you rotated first and normalised after: the norm of a vector is the same either way, but the gain is one "
    "number per dimension, and the rotation moves each pair of dimensions into each other, so the order matters. "
    "Qwen3 and Gemma 3 normalise (with the gain) first, then apply RoPE to the result"
)
HINT_QK_VALUES_NORMED = ("you normalised the values too: QK-norm touches the queries and the keys only, whose dot "
                         "products are the scores; the values pass through unchanged")
HINT_QK_VALUES_ROTATED = "you rotated the values: RoPE rotates the queries and keys only; return v unchanged"
HINT_QK_LAYERNORM = ("you subtracted the mean first (LayerNorm): QK-norm in Qwen3 and Gemma 3 is an RMSNorm, "
                     "x / sqrt(mean(x^2) + eps), no centring (and no bias)")
HINT_QK_NO_GAIN = "the gains are missing: multiply each normalised head vector by its gain (q_gain for q, k_gain for k)"
HINT_QK_GAIN_INSIDE = ("you multiplied by the gain before normalising: the norm then divides the gain out again "
                       "(for each vector, by the RMS of gain * x). Normalise x first, then multiply by the gain")
HINT_QK_GAINS_SWAPPED = "the gains are swapped: q_gain scales the queries and k_gain the keys"
HINT_QK_EPS_OUTSIDE = ("eps is outside the square root: with small vectors and eps = {eps} that differs. The RMSNorm "
                       "of the course (and of transformers) divides by sqrt(mean(x^2) + eps)")
HINT_QK_NO_ROPE = "the queries and keys were not rotated: after the norm and the gain, apply rope to each of them"
HINT_QK_CHANGED_V = "your v differs from the v passed in (largest change {err:.3g} in {what}): return v unchanged"
HINT_QK_IN_PLACE = ("qk_norm wrote into its input (an in-place operation such as mul_, /= or *= on q or k): nothing "
                    "may be written into q or k, which the caller still owns and which carry gradients. Build new "
                    "tensors: q divided by its root mean square gives a new tensor")
HINT_QK_L2 = ("your head vectors have length 1 before the gain: that is an L2 norm (F.normalize, or the root of the "
              "*sum* of the squares). RMSNorm divides by the root of the *mean* of the squares over d_head, so a "
              "normalised head vector has length sqrt(d_head), not 1")
HINT_QK_NO_K_GAIN = "the keys lack their gain: multiply each normalised key vector by k_gain, as the queries by q_gain"
HINT_QK_DIFFERS = "your {name} differs from QK-norm then RoPE in {what}: largest error {err:.3g}"
HINT_QK_NAN = "your {name} contains NaN or inf in {what}, which has rows of zeros: eps inside the square root keeps them finite"


def rms(x: torch.Tensor, eps: float, dim: Any = -1) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=dim, keepdim=True) + eps)


def reference_qk_norm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_gain: torch.Tensor, k_gain: torch.Tensor,
                      rope: Any, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QK-norm (per head, over d_head, one gain shared by the heads), then RoPE on q and k; v unchanged."""
    return rope(rms(q, eps) * q_gain), rope(rms(k, eps) * k_gain), v


def _l2(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def _over_d_model(x: torch.Tensor, eps: float) -> torch.Tensor:
    batch, heads, pos, d_head = x.shape
    merged = x.transpose(1, 2).reshape(batch, pos, heads * d_head)
    return rms(merged, eps).reshape(batch, pos, heads, d_head).transpose(1, 2)


def qk_mistakes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, rope: Any,
                eps: float) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """(hint, what the mistake returns) for each named mistake, on these inputs."""

    def layer(x: torch.Tensor) -> torch.Tensor:
        return rms(x - x.mean(dim=-1, keepdim=True), eps)

    def eps_outside(x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps)

    return [
        (HINT_QK_D_MODEL, (rope(_over_d_model(q, eps) * qg), rope(_over_d_model(k, eps) * kg), v)),
        (HINT_QK_POSITIONS, (rope(rms(q, eps, -2) * qg), rope(rms(k, eps, -2) * kg), v)),
        (HINT_QK_AFTER_ROPE, (rms(rope(q), eps) * qg, rms(rope(k), eps) * kg, v)),
        (HINT_QK_AFTER_ROPE, (rope(rms(q, eps)) * qg, rope(rms(k, eps)) * kg, v)),
        (HINT_QK_LAYERNORM, (rope(layer(q) * qg), rope(layer(k) * kg), v)),
        (HINT_QK_NO_GAIN, (rope(rms(q, eps)), rope(rms(k, eps)), v)),
        (HINT_QK_GAIN_INSIDE, (rope(rms(q * qg, eps)), rope(rms(k * kg, eps)), v)),
        (HINT_QK_GAINS_SWAPPED, (rope(rms(q, eps) * kg), rope(rms(k, eps) * qg), v)),
        (HINT_QK_EPS_OUTSIDE.format(eps=eps), (rope(eps_outside(q) * qg), rope(eps_outside(k) * kg), v)),
        (HINT_QK_NO_ROPE, (rms(q, eps) * qg, rms(k, eps) * kg, v)),
        (HINT_QK_L2, (rope(_l2(q, eps) * qg), rope(_l2(k, eps) * kg), v)),
        (HINT_QK_L2, (rope(torch.nn.functional.normalize(q, dim=-1) * qg),
                      rope(torch.nn.functional.normalize(k, dim=-1) * kg), v)),
        (HINT_QK_NO_K_GAIN, (rope(rms(q, eps) * qg), rope(rms(k, eps)), v)),
    ]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.detach().double(), b.detach().double(), rtol=rtol, atol=atol))


def diagnose_qk(got: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor,
                rope: Any, eps: float, *, what: str) -> None:
    """Raise a CheckFailure naming the mistake when ``got`` is not :func:`reference_qk_norm`'s (q, k, v)."""
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailure(HINT_QK_RETURN.format(got=describe(got) if not isinstance(got, (tuple, list)) else
                                                 f"a {type(got).__name__} of " + ", ".join(describe(t) for t in got)))
    want = reference_qk_norm(q, k, v, qg, kg, rope, eps)
    for name, g, w in zip("qkv", got, want):
        expect(tuple(g.shape) == tuple(w.shape), HINT_QK_SHAPE.format(name=name, got=tuple(g.shape), want=tuple(w.shape)))
        expect(g.dtype == w.dtype, HINT_QK_DTYPE.format(name=name, got=g.dtype, want=w.dtype))
    if all(_close(g, w) for g, w in zip(got, want)):
        return
    for hint, wrong in qk_mistakes(q, k, v, qg, kg, rope, eps):
        if all(_close(g, x) for g, x in zip(got, wrong)):
            raise CheckFailure(hint)
    if _close(got[0], want[0]) and _close(got[1], want[1]):
        if _close(got[2], rms(v, eps)) or _close(got[2], rms(v, eps) * kg) or _close(got[2], rms(v, eps) * qg):
            raise CheckFailure(HINT_QK_VALUES_NORMED)
        if _close(got[2], rope(v)) or _close(got[2], rope(rms(v, eps) * kg)):
            raise CheckFailure(HINT_QK_VALUES_ROTATED)
        err = float((got[2].detach().double() - v.double()).abs().max())
        raise CheckFailure(HINT_QK_CHANGED_V.format(err=err, what=what))
    for name, g, w in zip("qk", got, want):
        if not torch.isfinite(g).all():
            raise CheckFailure(HINT_QK_NAN.format(name=name, what=what))
        if not _close(g, w):
            err = float((g.detach().double() - w.double()).abs().max())
            raise CheckFailure(HINT_QK_DIFFERS.format(name=name, what=what, err=err))


def rope_for(pos: int, base: float, offset: int = 0) -> Any:
    """RoPE (half layout, as Llama, Qwen3 and Gemma) at positions offset .. offset + pos - 1."""
    positions = torch.arange(offset, offset + pos)
    return lambda x: apply_rope(x, positions, base=base, layout="half")


def qk_case(seed: int, batch: int, n_heads: int, n_kv_heads: int, pos: int, d_head: int, *, scale: float = 3.0,
            zero_row: bool = False) -> dict[str, torch.Tensor]:
    """Queries, keys, values with rows of different sizes (so that a norm over the wrong axis shows), gains
    spread around 1."""
    g = torch.Generator().manual_seed(seed)
    size = torch.exp(torch.randn(batch, 1, pos, 1, generator=g))  # each position's own size
    q = torch.randn(batch, n_heads, pos, d_head, generator=g) * scale * size
    k = torch.randn(batch, n_kv_heads, pos, d_head, generator=g) * scale * torch.exp(torch.randn(1, n_kv_heads, 1, 1, generator=g))
    v = torch.randn(batch, n_kv_heads, pos, d_head, generator=g)
    if zero_row:
        q[0, 0, 0] = 0.0
        k[0, 0, -1] = 0.0
    q_gain = 1 + 0.5 * torch.randn(d_head, generator=g)
    k_gain = 1 + 0.5 * torch.randn(d_head, generator=g)
    return {"q": q, "k": k, "v": v, "q_gain": q_gain, "k_gain": k_gain}


def qk_cases() -> list[tuple[str, dict[str, torch.Tensor], Any, float]]:
    """(what, tensors, rope, eps)."""
    return [
        ("4 query heads, 2 key/value heads, 5 positions, d_head 8", qk_case(0, 2, 4, 2, 5, 8), rope_for(5, 100.0), 1e-6),
        ("one head each, 7 positions from position 3, d_head 6", qk_case(1, 1, 1, 1, 7, 6), rope_for(7, 10.0, 3), 1e-6),
        ("small vectors (size 0.05) with eps = 0.01", qk_case(2, 2, 2, 1, 4, 8, scale=0.05), rope_for(4, 1000.0), 1e-2),
        ("rows of zeros", qk_case(3, 1, 2, 2, 3, 4, zero_row=True), rope_for(3, 10.0), 1e-6),
    ]


def _refuse(fn: Any, forbidden: tuple[str, ...], function: str, what: str) -> None:
    names = globals_from_modules(fn, forbidden)
    if names:
        raise CheckFailure(HINT_SHORTCUT.format(function=function, names=", ".join(names), what=what))


@checker("QK-norm")
def check_qk_norm(qk_norm) -> None:
    """Check ``qk_norm(q, k, v, q_gain, k_gain, rope, eps) -> (q, k, v)`` against :func:`reference_qk_norm`."""
    _refuse(qk_norm, QK_FORBIDDEN, "qk_norm", "the norm")
    for what, t, rope, eps in qk_cases():
        copies = {name: x.clone().requires_grad_(True) for name, x in t.items()}
        try:
            got = call_learner(qk_norm, copies["q"], copies["k"], copies["v"], copies["q_gain"], copies["k_gain"], rope,
                               eps, name="qk_norm", error_hint=HINT_QK_CALL)
        except CheckFailure as failure:
            if "in-place operation" in str(failure):
                raise CheckFailure(HINT_QK_IN_PLACE) from None
            raise
        for name, x in t.items():
            expect(torch.equal(copies[name].detach(), x), f"qk_norm changed its argument {name} in place: build new tensors")
        diagnose_qk(got, t["q"], t["k"], t["v"], t["q_gain"], t["k_gain"], rope, eps, what=what)
        total = got[0].sum() + got[1].sum()
        expect(total.requires_grad, HINT_GRAD_MISSING.format(function="qk_norm"))
        grads = torch.autograd.grad(total, [copies["q_gain"], copies["k_gain"]], allow_unused=True)
        expect(all(gr is not None for gr in grads), "no gradient reaches the gains: they are trained, so the result "
                                                      "must be computed from them (no .detach(), no .item())")


# ----------------------------------------------------------------------------- 16.1 probe

QK_PROBE_RUN = HELPERS + """\
from tfedu.positional import apply_rope as _apply_rope
_results = []
for _c in inputs['cases']:
    _t = {_n: torch.from_numpy(np.array(_c[_n])) for _n in ('q', 'k', 'v', 'q_gain', 'k_gain')}
    _pos = torch.arange(_c['offset'], _c['offset'] + _t['q'].shape[2])
    _rope = lambda _x, _p=_pos, _b=_c['base']: _apply_rope(_x, _p, base=_b, layout='half')
    _r = qk_norm(_t['q'], _t['k'], _t['v'], _t['q_gain'], _t['k_gain'], _rope, _c['eps'])
    if any(not torch.equal(_t[_n], torch.from_numpy(np.array(_c[_n]))) for _n in _t):
        _results.append('changed its inputs in place')
    elif isinstance(_r, (tuple, list)) and len(_r) == 3 and all(isinstance(_x, torch.Tensor) for _x in _r):
        _results.append([_array(_x) for _x in _r] + [str(_x.dtype) for _x in _r])
    else:
        _results.append(_kind(_r))
outputs = {'results': _results}
del _results, _c, _t, _pos, _rope, _r, _apply_rope
""" + CLEANUP


def _qk_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for i in range(3):
        n_kv = int(rng.integers(1, 3))
        t = qk_case(int(rng.integers(0, 2**31)), int(rng.integers(1, 3)), n_kv * int(rng.integers(1, 3)), n_kv,
                    int(rng.integers(3, 8)), int(rng.choice([4, 6, 8])), scale=0.05 if i == 2 else 3.0, zero_row=i == 1)
        cases.append({**{name: x.numpy() for name, x in t.items()}, "offset": int(rng.integers(0, 20)),
                      "base": float(rng.choice([10.0, 100.0, 10000.0])), "eps": 1e-2 if i == 2 else 1e-6})
    return {"cases": cases}


def _compare_qk(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(expected["cases"]):
        return "qk_norm's hidden test did not run every case"
    for i, (got, c) in enumerate(zip(outputs["results"], expected["cases"])):
        if got == "changed its inputs in place":
            return f"hidden test {i + 1}: " + HINT_QK_IN_PLACE
        if isinstance(got, str):
            return HINT_QK_RETURN.format(got=got)
        t = {name: torch.from_numpy(np.array(c[name])) for name in ("q", "k", "v", "q_gain", "k_gain")}
        dtypes = got[3:]
        tensors = [torch.from_numpy(np.array(x)) for x in got[:3]]
        if any(d != "torch.float32" for d in dtypes):
            return f"hidden test {i + 1}: " + HINT_QK_DTYPE.format(name="result", got=", ".join(dtypes), want="torch.float32")
        try:
            diagnose_qk(tensors, t["q"], t["k"], t["v"], t["q_gain"], t["k_gain"], rope_for(t["q"].shape[2], c["base"], c["offset"]),
                        c["eps"], what=f"hidden test {i + 1}")
        except CheckFailure as failure:
            return f"hidden test {i + 1}: {failure}"
    return None


# ----------------------------------------------------------------------------- 16.2 the sliding-window mask

HINT_SW_CALL = ("sliding_window_mask(n_query, n_key, window): three ints, n_query <= n_key; return a bool tensor "
                "(n_query, n_key), True where the query may attend the key")
HINT_SW_TYPE = ("sliding_window_mask should return a torch tensor of dtype torch.bool (True: may attend), got {got}. "
                "The attention fills the scores where the mask is False; a 0/1 integer or float mask would be read as "
                "numbers, not as a choice")
HINT_SW_SHAPE = "your mask for n_query={nq}, n_key={nk} has shape {got}: it needs one row per query, one column per key, ({nq}, {nk})"
HINT_SW_WIDE = ("each query sees one key too many: a window of w is w keys *itself included*, so query i sees keys "
                "i - w + 1 .. i (transformers' and Mistral's convention), not i - w .. i")
HINT_SW_NARROW = ("each query sees one key too few: a window of w is w keys itself included, so query i sees keys "
                  "i - w + 1 .. i, the query's own key and the w - 1 before it")
HINT_SW_NOT_CAUSAL = ("keys after the query are visible: a sliding window in a decoder is still causal, a band "
                      "reaching back window - 1 keys and never forward")
HINT_SW_START = (
    "with fewer queries than keys (n_query={nq}, n_key={nk}) your window is aligned to the start: the queries are "
    "the newest n_query positions (a decoding step sees every cached key), so query row i is position "
    "i + n_key - n_query, as in the causal mask of notebook 05"
)
HINT_SW_WRONG_END = ("your mask keeps the oldest keys of each row, not the newest: the window is the w keys that end "
                     "at the query's own position")
HINT_SW_CAUSAL_ONLY = ("your mask is the plain causal mask: the window is ignored, so a query sees every earlier key. "
                       "Hide the keys w or more positions behind the query too")
HINT_SW_INVERTED = "your mask is inverted: True must mean the query may attend the key (False: hidden)"
HINT_SW_DIFFERS = ("your mask for n_query={nq}, n_key={nk}, window={w} differs from the sliding window at {n} entries; "
                   "the first at query row {i}, key {j} (should be {want})")


def reference_sliding_window_mask(n_query: int, n_key: int, window: int) -> torch.Tensor:
    """True where 0 <= (i + n_key - n_query) - j < window."""
    i = torch.arange(n_query)[:, None] + (n_key - n_query)
    j = torch.arange(n_key)[None, :]
    return (j <= i) & (i - j < window)


def sw_mistakes(nq: int, nk: int, w: int) -> list[tuple[str, torch.Tensor]]:
    i = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    start = torch.arange(nq)[:, None]
    causal = j <= i
    out = [
        (HINT_SW_WIDE, causal & (i - j <= w)),
        (HINT_SW_NARROW, causal & (i - j < w - 1)),
        (HINT_SW_NOT_CAUSAL, (i - j).abs() < w),
        (HINT_SW_NOT_CAUSAL, i - j < w),
        (HINT_SW_START.format(nq=nq, nk=nk), (j <= start) & (start - j < w)),
        (HINT_SW_WRONG_END, causal & (j < w)),
        (HINT_SW_CAUSAL_ONLY, causal),
        (HINT_SW_INVERTED, ~(causal & (i - j < w))),
    ]
    return out


def sw_cases() -> list[tuple[int, int, int]]:
    """(n_query, n_key, window): square masks, a window of 1, a window wider than the context, fewer queries than keys."""
    return [(6, 6, 2), (9, 9, 3), (5, 5, 1), (4, 4, 10), (7, 7, 7), (3, 10, 4), (1, 12, 5), (2, 9, 9)]


def diagnose_sw(got: Any, nq: int, nk: int, w: int) -> None:
    if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
        raise CheckFailure(HINT_SW_TYPE.format(got=describe(got)))
    expect(tuple(got.shape) == (nq, nk), HINT_SW_SHAPE.format(nq=nq, nk=nk, got=tuple(got.shape)))
    want = reference_sliding_window_mask(nq, nk, w)
    if torch.equal(got.cpu(), want):
        return
    for hint, wrong in sw_mistakes(nq, nk, w):
        if torch.equal(got.cpu(), wrong) and not torch.equal(wrong, want):
            raise CheckFailure(hint)
    bad = (got.cpu() != want).nonzero()
    i, j = (int(x) for x in bad[0])
    raise CheckFailure(HINT_SW_DIFFERS.format(nq=nq, nk=nk, w=w, n=len(bad), i=i, j=j, want=bool(want[i, j])))


@checker("the sliding-window mask")
def check_sliding_window_mask(sliding_window_mask) -> None:
    """Check ``sliding_window_mask(n_query, n_key, window)`` against :func:`reference_sliding_window_mask`."""
    _refuse(sliding_window_mask, MASK_FORBIDDEN, "sliding_window_mask", "the mask")
    for nq, nk, w in sw_cases():
        got = call_learner(sliding_window_mask, nq, nk, w, name="sliding_window_mask", error_hint=HINT_SW_CALL)
        diagnose_sw(got, nq, nk, w)


SW_PROBE_RUN = HELPERS + """\
_results = []
for _nq, _nk, _w in inputs['cases']:
    _r = sliding_window_mask(_nq, _nk, _w)
    _results.append(_array(_r) if isinstance(_r, torch.Tensor) and _r.dtype == torch.bool else _kind(_r) + ' ' + str(getattr(_r, 'dtype', '')))
outputs = {'results': _results}
del _results, _nq, _nk, _w, _r
""" + CLEANUP


def _sw_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(5):
        nk = int(rng.integers(2, 20))
        cases.append([int(rng.integers(1, nk + 1)), nk, int(rng.integers(1, nk + 3))])
    nk = int(rng.integers(8, 20))
    cases += [[nk, nk, int(rng.integers(2, nk - 2))], [int(rng.integers(1, 4)), nk, int(rng.integers(2, nk - 4))]]
    return {"cases": cases}


def _compare_sw(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(expected["cases"]):
        return "sliding_window_mask's hidden test did not run every case"
    for got, (nq, nk, w) in zip(outputs["results"], expected["cases"]):
        try:
            if isinstance(got, str):
                raise CheckFailure(HINT_SW_TYPE.format(got=got))
            diagnose_sw(torch.from_numpy(np.array(got)), nq, nk, w)
        except CheckFailure as failure:
            return f"hidden test, sliding_window_mask({nq}, {nk}, {w}): {failure}"
    return None


# ----------------------------------------------------------------------------- 16.3 the ring-buffer cache

RING_FORBIDDEN = ("tfedu.kv_cache", "tfedu.layers")
HINT_RING_CALL = ("ring_append(ring_k, ring_v, length, k, v): the ring (batch, n_kv_heads, slots, d_head) twice, the "
                  "number of positions written so far, the new keys and values (batch, n_kv_heads, new, d_head); write "
                  "into the ring and return (keys, values)")
HINT_RING_RETURN = "ring_append should return a tuple (keys, values) of two tensors, got {got}"
HINT_RING_SHAPE = ("after {length} positions and {new} new ones (a ring of {slots} slots) your keys have shape {got}; "
                   "expected {want}: the {held} kept positions followed by the {new} new ones")
HINT_RING_SLOT = ("you wrote position p into the wrong slot (one slot further on): position p goes into slot p mod "
                  "slots, so that the slot it overwrites holds the position that just left every future window")
HINT_RING_ORDER = ("you returned the kept keys in slot order, not oldest first: once the ring has wrapped, slot 0 no "
                   "longer holds the oldest position. Read the slots of positions length - held .. length - 1, in that "
                   "order (held = the kept positions), then the new keys")
HINT_RING_WRITE_FIRST = ("you wrote the new keys into the ring before reading the old ones: the slot of the newest "
                         "position held the oldest kept one, which the query still sees (the window counts itself and "
                         "slots = window - 1 keys before it). Read the kept keys first, then write")
HINT_RING_ONLY = ("you returned only what the ring holds after the write: that is one key short of the window once it is "
                  "full (the oldest kept key was just overwritten), and drops new keys when more arrive than the ring "
                  "has slots. Return the kept keys from before the write, followed by all the new ones")
HINT_RING_NO_WRITE = ("nothing was written into the ring: the next call must find the newest positions there (write into "
                      "ring_k and ring_v themselves, in place, at their slots)")
HINT_RING_DIFFERS = ("after {length} positions and {new} new ones (a ring of {slots} slots) your keys are those of "
                     "positions {got}, expected {want}")
HINT_RING_VALUES = ("your keys are right but your values differ after {length} positions and {new} new ones: the values "
                    "are kept and returned exactly as the keys are")
HINT_RING_STATE = ("the key ring (ring_k) after {length} positions and {new} new ones holds positions {got} in its "
                   "slots 0.., expected {want}: the newest min(new, slots) positions, position p in slot p mod slots, "
                   "the rest as before")
HINT_RING_STATE_VALUES = ("the key ring (ring_k) is wrong after {length} positions and {new} new ones: its slots hold "
                          "the right positions but not those positions' keys. Write each new key itself, the newest "
                          "min(new, slots) of them, position p in slot p mod slots")
HINT_RING_KEYS_IN_VALUES = ("you wrote the keys into the value ring: after {length} positions and {new} new ones ring_v "
                            "holds the new keys. ring_k gets the new keys, ring_v the new values")
HINT_RING_VALUE_RING = ("the key ring is right but the value ring (ring_v) is wrong after {length} positions and {new} "
                        "new ones: write the newest min(new, slots) values into the same slots as their keys, "
                        "position p in slot p mod slots, the rest as before")

HINT_RING_REPEATED = ("after {length} positions and {new} new ones (a ring of {slots} slots) one indexed write sent "
                      "several positions to the same slot: PyTorch does not define which of repeated index writes "
                      "wins (this CPU keeps the last, a GPU need not). Write only the newest min(new, slots) positions, "
                      "whose slots all differ")


class WatchedRing(torch.Tensor):
    """A ring that notes an indexed write (``ring[..., idx] = x``, ``index_put_``, ``index_copy_``) whose one index
    tensor repeats a slot: an undefined result in PyTorch, which the CPU happens to resolve as the last write."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = None
        if func is torch.Tensor.__setitem__ and len(args) >= 2:
            index = args[1]
        elif func in (torch.Tensor.index_put_, torch.Tensor.index_put) and len(args) >= 2 \
                and not kwargs.get("accumulate", args[3] if len(args) > 3 else False):
            index = args[1]
        elif func in (torch.Tensor.index_copy_, torch.Tensor.index_copy) and len(args) >= 3:
            index = args[2]
        if index is not None and isinstance(args[0], WatchedRing) and _repeats(index):
            args[0].repeated_write = True
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _repeats(index: Any) -> bool:
    """Whether an index with a single tensor (or list) of integers names one slot twice."""
    parts = index if isinstance(index, tuple) else (index,)
    tensors = [torch.as_tensor(x) for x in parts if isinstance(x, (torch.Tensor, list))]
    if len(tensors) != 1 or tensors[0].dtype == torch.bool or tensors[0].is_floating_point():
        return False
    flat = tensors[0].detach().reshape(-1).cpu()
    return flat.numel() != flat.unique().numel()


def reference_ring_append(ring_k: torch.Tensor, ring_v: torch.Tensor, length: int, k: torch.Tensor,
                          v: torch.Tensor, mistake: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Write the newest min(new, slots) positions into the ring (position p in slot p % slots) and return the kept
    positions (the last min(length, slots), oldest first) followed by the new ones. ``mistake`` names a slip."""
    slots, n_new = ring_k.shape[2], k.shape[2]
    held = min(length, slots)
    order = torch.arange(length - held, length) % slots
    if mistake == "ring order":
        order = torch.arange(held)
    n_write = min(n_new, slots)
    where = torch.arange(length + n_new - n_write, length + n_new) % slots
    if mistake == "slot plus one":
        where = (where + 1) % slots

    def write() -> None:
        if mistake != "no write":
            ring_k[:, :, where] = k[:, :, n_new - n_write:]
            ring_v[:, :, where] = v[:, :, n_new - n_write:]

    if mistake == "write first":
        write()
    keys = torch.cat([ring_k[:, :, order], k], dim=2)
    values = torch.cat([ring_v[:, :, order], v], dim=2)
    if mistake != "write first":
        write()
    if mistake == "ring only":
        kept = min(length + n_new, slots)
        now = torch.arange(length + n_new - kept, length + n_new) % slots
        return ring_k[:, :, now].clone(), ring_v[:, :, now].clone()
    return keys, values


REPEATED = "a write that repeats a slot"
RING_MISTAKES = {"slot plus one": HINT_RING_SLOT, "ring order": HINT_RING_ORDER, "write first": HINT_RING_WRITE_FIRST,
                 "ring only": HINT_RING_ONLY, "no write": HINT_RING_NO_WRITE}


def ring_inputs(seed: int, batch: int, heads: int, d_head: int, chunks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of each call: channel 0 of a key is its position (so a message can name positions)."""
    g = torch.Generator().manual_seed(seed)
    out, start = [], 0
    for n in chunks:
        k = torch.randn(batch, heads, n, d_head, generator=g)
        k[..., 0] = torch.arange(start, start + n, dtype=k.dtype)
        out.append((k, torch.randn(batch, heads, n, d_head, generator=g)))
        start += n
    return out


def ring_trace(fn: Any, slots: int, calls: list[tuple[torch.Tensor, torch.Tensor]], *, learner: bool = False) -> list[Any]:
    """Each call's (keys, values, ring_k, ring_v) for ``fn`` run over ``calls`` from an empty ring (zeros); a learner's
    return that is not two tensors is kept as is, and the trace stops there."""
    batch, heads, _, d_head = calls[0][0].shape
    ring_k, ring_v = (torch.zeros(batch, heads, slots, d_head).as_subclass(WatchedRing) for _ in range(2))
    trace, length = [], 0
    for k, v in calls:
        if learner:
            got = call_learner(fn, ring_k, ring_v, length, k.clone(), v.clone(), name="ring_append", error_hint=HINT_RING_CALL)
        else:
            got = fn(ring_k, ring_v, length, k.clone(), v.clone())
        if getattr(ring_k, "repeated_write", False) or getattr(ring_v, "repeated_write", False):
            trace.append(REPEATED)
            return trace
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            trace.append(got)
            return trace
        trace.append((got[0].detach().clone(), got[1].detach().clone(), ring_k.clone(), ring_v.clone()))
        length += k.shape[2]
    return trace


def _positions(keys: torch.Tensor) -> list[int]:
    return [int(round(float(p))) for p in keys[0, 0, :, 0]]


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, tuple) and isinstance(b, tuple) and all(
        x.shape == y.shape and torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))


def diagnose_ring(got: list[Any], slots: int, calls: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Raise a CheckFailure naming the mistake when the learner's trace ``got`` differs from the reference's."""
    want = ring_trace(reference_ring_append, slots, calls)
    variants = {name: ring_trace(lambda *a, m=name: reference_ring_append(*a, mistake=m), slots, calls) for name in RING_MISTAKES}
    length = 0
    for step, ((k, _), w) in enumerate(zip(calls, want)):
        g = got[step]
        new = k.shape[2]
        held = min(length, slots)
        if isinstance(g, str) and g == REPEATED:
            raise CheckFailure(HINT_RING_REPEATED.format(length=length, new=new, slots=slots))
        if not isinstance(g, tuple):
            raise CheckFailure(HINT_RING_RETURN.format(got=describe(g)))
        if not _same(g, w):
            for name, trace in variants.items():
                if all(_same(a, b) for a, b in zip(got[:step + 1], trace[:step + 1])):
                    raise CheckFailure(RING_MISTAKES[name])
            if g[0].shape != w[0].shape:
                raise CheckFailure(HINT_RING_SHAPE.format(length=length, new=new, slots=slots, got=tuple(g[0].shape),
                                                          want=tuple(w[0].shape), held=held))
            if not torch.allclose(g[0], w[0], atol=1e-6):
                raise CheckFailure(HINT_RING_DIFFERS.format(length=length, new=new, slots=slots, got=_positions(g[0]),
                                                            want=_positions(w[0])))
            if not torch.allclose(g[1], w[1], atol=1e-6):
                raise CheckFailure(HINT_RING_VALUES.format(length=length, new=new))
            if not torch.allclose(g[2], w[2], atol=1e-6):
                got_pos, want_pos = _positions(g[2]), _positions(w[2])
                if got_pos != want_pos:
                    raise CheckFailure(HINT_RING_STATE.format(length=length, new=new, got=got_pos, want=want_pos))
                raise CheckFailure(HINT_RING_STATE_VALUES.format(length=length, new=new))
            if torch.allclose(g[3], w[2], atol=1e-6):
                raise CheckFailure(HINT_RING_KEYS_IN_VALUES.format(length=length, new=new))
            raise CheckFailure(HINT_RING_VALUE_RING.format(length=length, new=new))
        length += new


def ring_cases() -> list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """(slots, calls): a prompt then single tokens past several wraps; chunks longer than the ring; one slot."""
    return [
        (3, ring_inputs(0, 1, 2, 4, [2, 1, 1, 1, 1, 1, 1, 1])),
        (4, ring_inputs(1, 2, 1, 3, [6, 1, 1, 3, 1, 9, 1])),
        (1, ring_inputs(2, 1, 1, 2, [1, 1, 3, 1])),
        (5, ring_inputs(3, 1, 2, 2, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])),
    ]


@checker("the ring-buffer cache")
def check_ring_append(ring_append) -> None:
    """Check ``ring_append(ring_k, ring_v, length, k, v) -> (keys, values)`` over sequences of calls."""
    _refuse(ring_append, RING_FORBIDDEN, "ring_append", "the ring")
    for slots, calls in ring_cases():
        diagnose_ring(ring_trace(ring_append, slots, calls, learner=True), slots, calls)


RING_PROBE_RUN = HELPERS + """\
from tfedu.checks.nb16_modern_architectures import REPEATED as _REPEATED, WatchedRing as _WatchedRing
_results = []
for _c in inputs['cases']:
    _rk = torch.zeros(_c['shape']).as_subclass(_WatchedRing); _rv = torch.zeros(_c['shape']).as_subclass(_WatchedRing)
    _length, _trace = 0, []
    for _k, _v in zip(_c['k'], _c['v']):
        _k, _v = torch.from_numpy(np.array(_k)), torch.from_numpy(np.array(_v))
        _r = ring_append(_rk, _rv, _length, _k.clone(), _v.clone())
        if getattr(_rk, 'repeated_write', False) or getattr(_rv, 'repeated_write', False):
            _trace.append(_REPEATED)
            break
        if not (isinstance(_r, (tuple, list)) and len(_r) == 2 and all(isinstance(_x, torch.Tensor) for _x in _r)):
            _trace.append(_kind(_r))
            break
        _trace.append([_array(_x.clone()) for _x in (_r[0], _r[1], _rk, _rv)])
        _length += _k.shape[2]
    _results.append(_trace)
outputs = {'results': _results}
del _results, _c, _rk, _rv, _length, _trace, _k, _v, _r, _REPEATED, _WatchedRing
""" + CLEANUP


def _ring_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for i in range(3):
        slots = int(rng.integers(1, 6)) if i else int(rng.integers(2, 5))
        chunks = [int(rng.integers(1, 2 * slots + 2))] + [1 if rng.random() < 0.7 else int(rng.integers(2, 2 * slots + 2))
                                                          for _ in range(int(rng.integers(6, 12)))]
        batch, heads, d_head = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(2, 5))
        calls = ring_inputs(int(rng.integers(0, 2**31)), batch, heads, d_head, chunks)
        cases.append({"shape": [batch, heads, slots, d_head], "k": [k.numpy() for k, _ in calls],
                      "v": [v.numpy() for _, v in calls]})
    return {"cases": cases}


def _compare_ring(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(expected["cases"]):
        return "ring_append's hidden test did not run every case"
    for i, (trace, c) in enumerate(zip(outputs["results"], expected["cases"])):
        calls = [(torch.from_numpy(np.array(k)), torch.from_numpy(np.array(v))) for k, v in zip(c["k"], c["v"])]
        got = [t if isinstance(t, str) else tuple(torch.from_numpy(np.array(x)) for x in t) for t in trace]
        if len(got) < len(calls) and (not got or not isinstance(got[-1], str)):
            return "ring_append's hidden test did not run every call"
        try:
            diagnose_ring(got, c["shape"][2], calls)
        except CheckFailure as failure:
            return f"hidden test {i + 1}: {failure}"
    return None


# ----------------------------------------------------------------------------- 16.4 Llama 3.1's RoPE scaling

ROPE_FORBIDDEN = ("tfedu.positional", "tfedu.layers", "transformers.modeling_rope_utils")
HINT_L3_CALL = ("llama3_frequencies(d_head, base, scaling): d_head an even int, base a float, scaling a dict with "
                "factor, low_freq_factor, high_freq_factor and original_max_position_embeddings; return the d_head / 2 "
                "inverse frequencies as a float tensor")
HINT_L3_TYPE = "llama3_frequencies should return a float torch tensor of shape ({half},), got {got}"
HINT_L3_PLAIN = ("your frequencies are RoPE's plain ones: nothing was scaled. Pairs whose wavelength is longer than "
                 "L / low_freq_factor (L the original length) turn factor times slower")
HINT_L3_LINEAR = ("every frequency was divided by the factor (linear interpolation): Llama 3.1 keeps the fast pairs, "
                  "whose wavelength is shorter than L / high_freq_factor, as they are")
HINT_L3_TIMES = "you multiplied the slow frequencies by the factor: to slow a pair down by s, divide its frequency by s"
HINT_L3_EXPONENT = ("your unscaled frequencies are off: pair i turns at base^(-2i / d_head), i = 0 .. d_head / 2 - 1 "
                    "(the exponent goes in steps of 2 / d_head)")
HINT_L3_NO_TWO_PI = ("your wavelengths lack the 2 pi: a pair turning at frequency theta (radians per position) "
                     "completes a turn every 2 pi / theta positions")
HINT_L3_SWAPPED = ("the two thresholds are swapped: pairs with a wavelength below L / high_freq_factor (the fast ones) "
                   "are kept, those above L / low_freq_factor (the slow ones) divided by the factor")
HINT_L3_BLEND = ("the blend between the thresholds runs the wrong way: the weight of the kept frequency is 1 at the "
                 "fast threshold (wavelength L / high_freq_factor) and falls linearly in L / wavelength to 0 at the slow "
                 "one (L / low_freq_factor), where the frequency is divided by the factor")
HINT_L3_NO_BLEND = ("the pairs between the two thresholds were not blended: there the frequency is a mix of the kept "
                    "one and the slowed one, the kept one's weight falling linearly in L / wavelength from 1 at the fast "
                    "threshold to 0 at the slow one")
HINT_L3_DIFFERS = "your frequencies for {what} differ from Llama 3.1's at pair {i} (largest relative error {err:.3g})"


def reference_llama3_frequencies(d_head: int, base: float, scaling: dict, mistake: str = "") -> torch.Tensor:
    """Llama 3.1's scaled inverse frequencies (float64); ``mistake`` names a slip."""
    step = 1 if mistake == "exponent" else 2
    theta = base ** (-torch.arange(0, step * (d_head // 2), step, dtype=torch.float64) / d_head)
    s, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    L = float(scaling["original_max_position_embeddings"])
    if mistake == "plain":
        return theta
    if mistake == "linear":
        return theta / s
    wavelength = (1 / theta) if mistake == "no two pi" else 2 * math.pi / theta
    if mistake == "swapped":
        low, high = high, low
    slowed = theta * s if mistake == "times" else theta / s
    g = (L / wavelength - low) / (high - low)
    if mistake == "blend":
        g = 1 - g
    if mistake == "no blend":
        g = torch.zeros_like(theta) if mistake == "no blend" else g
    g = torch.where(wavelength < L / high, 1.0, torch.where(wavelength > L / low, 0.0, g))
    if mistake == "swapped":
        g = torch.where(wavelength > L / low, 1.0, torch.where(wavelength < L / high, 0.0, g))
    return (1 - g) * slowed + g * theta


L3_MISTAKES = {"plain": HINT_L3_PLAIN, "linear": HINT_L3_LINEAR, "times": HINT_L3_TIMES, "exponent": HINT_L3_EXPONENT,
               "no two pi": HINT_L3_NO_TWO_PI, "swapped": HINT_L3_SWAPPED, "blend": HINT_L3_BLEND,
               "no blend": HINT_L3_NO_BLEND}


def l3_cases() -> list[tuple[str, int, float, dict]]:
    """(what, d_head, base, scaling): Llama 3.1 and 3.2's, and small ones where several pairs fall between the thresholds."""
    def scaling(s: float, low: float, high: float, L: int) -> dict:
        return {"rope_type": "llama3", "factor": s, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": L}

    return [
        ("Llama 3.1 (d_head 128, base 500,000, factor 8, 1 and 4, L = 8192)", 128, 500_000.0, scaling(8.0, 1.0, 4.0, 8192)),
        ("Llama 3.2 (factor 32)", 64, 500_000.0, scaling(32.0, 1.0, 4.0, 8192)),
        ("d_head 32, base 10,000, factor 4, 1 and 4, L = 64", 32, 10_000.0, scaling(4.0, 1.0, 4.0, 64)),
        ("d_head 16, base 100, factor 2, 0.5 and 6, L = 40", 16, 100.0, scaling(2.0, 0.5, 6.0, 40)),
    ]


def diagnose_l3(got: Any, d_head: int, base: float, scaling: dict, *, what: str) -> None:
    half = d_head // 2
    if not isinstance(got, torch.Tensor) or not got.is_floating_point() or tuple(got.shape) != (half,):
        raise CheckFailure(HINT_L3_TYPE.format(half=half, got=describe(got)))
    got = got.detach().double().cpu()
    want = reference_llama3_frequencies(d_head, base, scaling)

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.allclose(a, b, rtol=1e-5, atol=0.0))

    if close(got, want):
        return
    for name, hint in L3_MISTAKES.items():
        wrong = reference_llama3_frequencies(d_head, base, scaling, mistake=name)
        if close(got, wrong) and not close(wrong, want):
            raise CheckFailure(hint)
    error = ((got - want).abs() / want.abs())
    raise CheckFailure(HINT_L3_DIFFERS.format(what=what, i=int(error.argmax()), err=float(error.max())))


@checker("Llama 3.1's RoPE scaling")
def check_llama3_frequencies(llama3_frequencies) -> None:
    """Check ``llama3_frequencies(d_head, base, scaling)`` against :func:`reference_llama3_frequencies`."""
    _refuse(llama3_frequencies, ROPE_FORBIDDEN, "llama3_frequencies", "the scaling")
    for what, d_head, base, scaling in l3_cases():
        got = call_learner(llama3_frequencies, d_head, base, dict(scaling), name="llama3_frequencies",
                           error_hint=HINT_L3_CALL)
        diagnose_l3(got, d_head, base, scaling, what=what)


L3_PROBE_RUN = HELPERS + """\
_results = []
for _d, _b, _s in inputs['cases']:
    _r = llama3_frequencies(_d, _b, dict(_s))
    _results.append(_r.detach().cpu().double().numpy() if isinstance(_r, torch.Tensor) else _kind(_r))
outputs = {'results': _results}
del _results, _d, _b, _s, _r
""" + CLEANUP


def _l3_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(4):
        d_head = int(rng.choice([16, 32, 64, 128]))
        base = float(rng.choice([100.0, 10_000.0, 500_000.0]))
        low = float(rng.choice([0.5, 1.0, 2.0]))
        trained = int(2 * math.pi * base ** (0.5 * rng.random() + 0.25) * low)  # thresholds inside the spectrum
        cases.append([d_head, base, {"rope_type": "llama3", "factor": float(rng.choice([2.0, 4.0, 8.0, 16.0])),
                                     "low_freq_factor": low, "high_freq_factor": low * float(rng.choice([3.0, 4.0, 8.0])),
                                     "original_max_position_embeddings": max(trained, 2)}])
    return {"cases": cases}


def _compare_l3(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(expected["cases"]):
        return "llama3_frequencies's hidden test did not run every case"
    for got, (d_head, base, scaling) in zip(outputs["results"], expected["cases"]):
        what = f"d_head {d_head}, base {base:g}, {scaling}"
        try:
            diagnose_l3(got if isinstance(got, str) else torch.from_numpy(np.array(got)), d_head, base, scaling, what=what)
        except CheckFailure as failure:
            return f"hidden test, {what}: {failure}"
    return None


# ----------------------------------------------------------------------------- probes and hints

PROBES = {
    "check_qk_norm": Probe(
        exercise="ex_qk_norm",
        make_inputs=_qk_probe_inputs,
        run=QK_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_qk,
        forbidden=QK_FORBIDDEN),
    "check_sliding_window_mask": Probe(
        exercise="ex_sliding_window_mask",
        make_inputs=_sw_probe_inputs,
        run=SW_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_sw,
        forbidden=MASK_FORBIDDEN),
    "check_ring_append": Probe(
        exercise="ex_ring_append",
        make_inputs=_ring_probe_inputs,
        run=RING_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_ring,
        forbidden=RING_FORBIDDEN),
    "check_llama3_frequencies": Probe(
        exercise="ex_llama3_frequencies",
        make_inputs=_l3_probe_inputs,
        run=L3_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_l3,
        forbidden=ROPE_FORBIDDEN),
}


HINTS = {
    "ex_qk_norm": Hints(
        number="16.1",
        check="check_qk_norm",
        idea=(
            "A score is the dot product of a query and a key. If W_Q and W_K grow during training, so do the "
            "scores, and the softmax turns one-hot. QK-norm bounds them: each head's query vector and key vector "
            "is divided by its own root mean square over its d_head entries, so it has length sqrt(d_head) "
            "before the gain. A learned gain, one number per dimension of a head and the same for every head, "
            "scales the result. RoPE comes after, on the normalised vectors; the values are not touched."
        ),
        approach=(
            "For q (batch, n_heads, pos, d_head): the mean of the squares over the last dimension, kept as a "
            "dimension of size 1; add eps inside the square root; divide. Multiply by q_gain (d_head,), which "
            "broadcasts over the batch, heads and positions. Then call rope on the result. The same for k with "
            "k_gain. Return the two new tensors and v itself. Write nothing into the inputs."
        ),
        skeleton=(
            "def qk_norm(q, k, v, q_gain, k_gain, rope, eps=1e-6):\n"
            "    q_mean_square = ____  # over d_head, keepdim: (batch, n_heads, pos, 1)\n"
            "    q_hat = ____  # q over the root of (q_mean_square + eps), times q_gain\n"
            "    k_mean_square = ____\n"
            "    k_hat = ____\n"
            "    return ____, ____, v  # the norm first, then rope\n"
        ),
    ),
    "ex_sliding_window_mask": Hints(
        number="16.2",
        check="check_sliding_window_mask",
        idea=(
            "In a local layer query i sees itself and the window - 1 keys before it, never a later one. With "
            "fewer queries than keys (a decoding step with a cache), the queries are the newest positions: query "
            "row i is position i + n_key - n_query. So a key j is visible when the distance from the query's "
            "position back to j is at least 0 and less than the window."
        ),
        approach=(
            "Make a column of query positions, shape (n_query, 1), shifted by n_key - n_query, and a row of key "
            "positions, shape (1, n_key). Their difference broadcasts to (n_query, n_key): the distance back. "
            "Compare it with 0 and with the window and combine the two bool tensors with &."
        ),
        skeleton=(
            "def sliding_window_mask(n_query, n_key, window):\n"
            "    query_pos = ____  # (n_query, 1), the newest positions\n"
            "    key_pos = ____  # (1, n_key)\n"
            "    back = ____  # how far each key lies behind each query\n"
            "    return (____) & (____)\n"
        ),
    ),
    "ex_ring_append": Hints(
        number="16.3",
        check="check_ring_append",
        idea=(
            "A local layer's query sees itself and the slots = window - 1 positions before it, so the cache keeps only "
            "the newest slots positions, position p in slot p mod slots: a new position lands exactly on the one that has "
            "left every future window. The attention needs the kept keys in time order, oldest first, then the new ones; "
            "which slot holds the oldest depends on how far the ring has turned, which length tells."
        ),
        approach=(
            "First read: held is the smaller of length and slots; the kept positions are length - held up to length - 1, "
            "and their slots are those positions mod slots. Index the ring's slot axis (dimension 2) with them and "
            "concatenate the new k after them (and the same for the values). Then write: of the new positions, only the "
            "last min(new, slots) can stay; compute their positions and slots the same way and assign into ring_k and "
            "ring_v in place. Return the two concatenated tensors."
        ),
        skeleton=(
            "def ring_append(ring_k, ring_v, length, k, v):\n"
            "    slots, new = ____, ____  # the ring's slots, the new positions\n"
            "    held = ____\n"
            "    kept_slots = ____  # the slots of positions length - held .. length - 1, in that order\n"
            "    keys = ____  # kept keys, then k\n"
            "    values = ____\n"
            "    n_write = ____\n"
            "    write_slots = ____  # the slots of the last n_write new positions\n"
            "    ring_k[:, :, write_slots] = ____\n"
            "    ring_v[:, :, write_slots] = ____\n"
            "    return keys, values\n"
        ),
    ),
    "ex_llama3_frequencies": Hints(
        number="16.4",
        check="check_llama3_frequencies",
        idea=(
            "RoPE's pair i turns at theta_i = base^(-2i / d_head) radians per position, a wavelength of 2 pi / theta_i "
            "positions. Pairs that turn many times within the original length L are kept: they tell neighbours apart, "
            "and see nothing new at longer lengths. Pairs that never completed a turn in L would meet new angles past "
            "it: they are slowed down by the factor. Llama 3.1 draws the line with two thresholds, L / high_freq_factor "
            "and L / low_freq_factor, and blends linearly (in L / wavelength) between them."
        ),
        approach=(
            "Compute theta for i = 0 .. d_head / 2 - 1 in float64, then the wavelengths. The weight g of the kept "
            "frequency is L / wavelength less low_freq_factor, divided by the gap between the two factors; set it to 1 "
            "where the wavelength is below L / high_freq_factor and to 0 where it is above L / low_freq_factor "
            "(torch.where, twice). The answer weights theta by g and theta divided by the factor by 1 - g."
        ),
        skeleton=(
            "def llama3_frequencies(d_head, base, scaling):\n"
            "    factor, low, high = ____, ____, ____\n"
            "    L = ____\n"
            "    theta = ____  # (d_head / 2,), float64\n"
            "    wavelength = ____\n"
            "    g = ____  # the blend weight between the thresholds\n"
            "    g = torch.where(____, 1.0, torch.where(____, 0.0, g))\n"
            "    return ____\n"
        ),
    ),
}

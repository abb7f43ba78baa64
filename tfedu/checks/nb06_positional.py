"""Checkers for notebooks/06_positional_encoding.ipynb: sinusoids, ALiBi, RoPE, attention with RoPE.

Each checker compares with ``tfedu.positional`` (the reference), after first trying the mistakes
seen in slides, blog posts and learners' answers: sin and cos swapped, frequencies running the
wrong way, another base, positions counted from 1, the half-split ("rotate_half") pairs of
GPT-NeoX and Llama where the paper interleaves them, ALiBi slopes reversed or without the
paper's recipe for head counts that are not a power of two, values rotated along with queries
and keys.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from tfedu import positional as reference
from tfedu.attention import causal_mask, scaled_dot_product_attention
from tfedu.checks.core import (
    call_on_copies,
    global_names,
    name_mistake,
    CheckFailure,
    ExerciseNotDone,
    Hints,
    Probe,
    call_learner,
    checker,
    compare,
    compare_plain,
    describe,
    expect,
    is_close,
    seeded_randn,
    upstream_problem,
)
from tfedu.checks.nb04_attention import exact_large_qk
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, backward, compare_outputs, leaf, upstream_like

F64 = torch.float64


def _expect_tensor(got: Any, what: str, *, numpy_hint: str) -> torch.Tensor:
    if isinstance(got, np.ndarray):
        raise CheckFailure(f"{what} returned a NumPy array: {numpy_hint}")
    expect(isinstance(got, torch.Tensor), f"{what} should return a torch.Tensor, got {describe(got)}")
    return got


# ----------------------------------------------------------------------------- sinusoids

HINT_SIN_COS_SWAPPED = (
    "sin and cos are swapped: even dimensions 2i hold sin(t * omega_i) and odd dimensions 2i + 1 hold "
    "cos(t * omega_i), so row 0 is (0, 1, 0, 1, ...)"
)
HINT_FREQ_FLIPPED = (
    "your frequencies increase along the vector: pair 0 must turn fastest (omega_0 = 1 radian per position) "
    "and the last pair slowest (about 1/base). The exponent of the base is -2i / d_model, which falls as the pair "
    "index i runs from 0 to d_model/2 - 1"
)
HINT_FREQ_POSITIVE = (
    "the exponent's sign is wrong: base ** (+2i / d_model) grows along the vector. The frequency omega_i is "
    "base ** (-2i / d_model), that is 1 / base ** (2i / d_model), which falls from 1 towards 1/base"
)
HINT_OTHER_BASE = (
    "you used base = {base:.6g}; the paper uses 10000 (some slides write N = 100,000). Raise the `base` "
    "argument, whose default is 10000.0, to the power -2i / d_model for the frequency of pair i"
)
HINT_BASE_IGNORED = (
    "sinusoidal(9, 6, base=100.0) gave the table of base {base:.6g}: use the `base` argument instead of a "
    "hard-coded number"
)
HINT_SIN_FROM_ONE = (
    "positions start at 0, not 1: row 0 is (sin 0, cos 0, ...) = (0, 1, 0, 1, ...), and the positions run "
    "from 0 to n_positions - 1"
)
HINT_CONCAT = (
    "you put all the sines in the first half and all the cosines in the second; the paper interleaves them: "
    "sin in the even dimensions, cos in the odd ones, each pair (2i, 2i + 1) sharing one frequency"
)
HINT_EXPONENT_I = (
    "the exponent is 2i / d_model, not i / d_model (i counts the pairs, 0 .. d_model/2 - 1): with i / d_model "
    "the slowest frequency is only 1/sqrt(base), the table of base sqrt(base)"
)
HINT_EXPONENT_J = (
    "the cos dimension 2i + 1 uses the same frequency as the sin dimension 2i before it: exponent 2i / d_model "
    "for both, not the dimension's own index j / d_model"
)
HINT_K_FROM_ONE = (
    "the frequency index starts at 0, so the first pair turns at omega_0 = base ** 0 = 1 radian per position: "
    "i runs over 0 .. d_model/2 - 1 (the exponents 2i / d_model are the even numbers 0, 2, 4, ... below d_model, "
    "divided by d_model), not 1 .. d_model/2"
)
HINT_SIN_TRANSPOSED = "your table is (d_model, pos): return (n_positions, d_model), one row per position"
HINT_SIN_NUMPY = "build it with torch operations (torch.arange, torch.sin, torch.cos) and return a torch.Tensor"
HINT_SIN_DTYPE = (
    "return float32 (the embeddings' dtype), got {dtype}: a float64 table added to float32 embeddings would "
    "turn every activation after it into float64; compute in float64 if you like, and cast once at the end"
)


def _sinusoid_table(
    n: int,
    d: int,
    base: float = 10000.0,
    *,
    omega: torch.Tensor | None = None,
    cos_omega: torch.Tensor | None = None,
    offset: int = 0,
    swap: bool = False,
    concat: bool = False,
) -> torch.Tensor:
    """A sin/cos table built with one of the known mistakes (float64, cast to float32 at the end)."""
    i = torch.arange(d // 2, dtype=F64)
    omega = base ** (-2 * i / d) if omega is None else omega
    t = torch.arange(n, dtype=F64)[:, None] + offset  # (pos, 1)
    sines, cosines = (t * omega).sin(), (t * (omega if cos_omega is None else cos_omega)).cos()  # (pos, d/2)
    first, second = (cosines, sines) if swap else (sines, cosines)
    if concat:
        return torch.cat([first, second], dim=-1).float()
    return torch.stack([first, second], dim=-1).reshape(n, d).float()


def _sinusoid_mistakes(n: int, d: int, base: float) -> dict[str, torch.Tensor]:
    i = torch.arange(d // 2, dtype=F64)
    return {
        HINT_SIN_COS_SWAPPED: _sinusoid_table(n, d, base, swap=True),
        HINT_FREQ_FLIPPED: _sinusoid_table(n, d, omega=(base ** (-2 * i / d)).flip(0)),
        HINT_FREQ_POSITIVE: _sinusoid_table(n, d, omega=base ** (2 * i / d)),
        HINT_SIN_FROM_ONE: _sinusoid_table(n, d, base, offset=1),
        HINT_CONCAT: _sinusoid_table(n, d, base, concat=True),
        HINT_EXPONENT_I: _sinusoid_table(n, d, omega=base ** (-i / d)),
        HINT_EXPONENT_J: _sinusoid_table(n, d, base, cos_omega=base ** (-(2 * i + 1) / d)),
        HINT_K_FROM_ONE: _sinusoid_table(n, d, omega=base ** (-2 * (i + 1) / d)),
        HINT_SIN_TRANSPOSED: reference.sinusoidal(n, d, base).T,
    }


def _fitted_base(got: torch.Tensor, n: int, d: int) -> float | None:
    """The base whose table ``got`` is, when it is a correct table for some base (read off omega_1)."""
    if n < 2 or d < 4 or got.shape != (n, d) or not torch.isfinite(got).all():
        return None
    s = float(got[1, 2])  # sin(omega_1), omega_1 = base ** (-2 / d) in (0, 1)
    if not 0.0 < s < math.sin(1.0):
        return None
    base = math.asin(s) ** (-d / 2)
    if not 1.0 < base < 1e12:
        return None
    return base if is_close(got, reference.sinusoidal(n, d, base), rtol=1e-3, atol=1e-4) else None


def _check_table(got: Any, n: int, d: int, base: float, what: str) -> None:
    got = _expect_tensor(got, what, numpy_hint=HINT_SIN_NUMPY)
    expected = reference.sinusoidal(n, d, base)
    mistakes = _sinusoid_mistakes(n, d, base)
    if got.shape == expected.shape and got.dtype != torch.bool and not got.is_complex():
        name_mistake(got, expected, mistakes.items())
        fitted = _fitted_base(got, n, d)
        if fitted is not None and not math.isclose(fitted, base, rel_tol=1e-2):
            raise CheckFailure((HINT_OTHER_BASE if base == 10000.0 else HINT_BASE_IGNORED).format(base=fitted))
    # float32 angles are off by about t * 6e-8 radians: loose enough for them, far tighter than any mistake.
    compare(got, expected, what=what, mistakes=mistakes, check_dtype=False, rtol=1e-4, atol=1e-4)
    expect(got.dtype == torch.float32, HINT_SIN_DTYPE.format(dtype=got.dtype))


@checker("sinusoidal positions")
def check_sinusoidal(sinusoidal) -> None:
    """Check a learner's ``sinusoidal(n_positions, d_model, base=10000.0) -> Float[Tensor, "pos d_model"]``.

    Called with the default base and with ``base=100.0``, so a hard-coded 10000 shows.
    """
    error_hint = "keep the signature sinusoidal(n_positions, d_model, base=10000.0)"
    got = call_learner(sinusoidal, 20, 16, name="sinusoidal", error_hint=error_hint)
    _check_table(got, 20, 16, 10000.0, "sinusoidal(20, 16)")
    got = call_learner(sinusoidal, 9, 6, name="sinusoidal", error_hint=error_hint, base=100.0)
    _check_table(got, 9, 6, 100.0, "sinusoidal(9, 6, base=100.0)")


# ----------------------------------------------------------------------------- ALiBi

HINT_SLOPES_REVERSED = (
    "your slopes are reversed: head 0 gets the steepest slope, 2 ** (-8 / n_heads) (1/2 for 8 heads), and the "
    "last head the gentlest (1/256 for 8 heads)"
)
HINT_BIAS_SIGN = (
    "the sign is flipped: +m * distance rewards the keys far away. ALiBi penalises distance: bias = -m_h * (i - j)"
)
HINT_NOT_END_ALIGNED = (
    "with fewer queries than keys, the queries are the newest tokens: query i sits at position "
    "i + n_key - n_query (as in causal_mask), so its distance to key j is (i + n_key - n_query) - j"
)
HINT_PLAIN_GEOMETRIC = (
    "for {n} heads (not a power of two) the paper does not use 2 ** (-8 / n_heads): take the slopes of the "
    "power of two below ({below} heads), then every other slope of twice that power ({twice} heads) for the "
    "remaining heads"
)
HINT_SLOPE_START_ONE = (
    "head 0 has slope 1: count from h = 1, m_h = 2 ** (-8 h / n_heads) for h = 1 .. n_heads, so the first "
    "slope is 2 ** (-8 / n_heads) (1/2 for 8 heads)"
)
HINT_SLOPE_HALVES_FROM_ONE = (
    "head 0 has slope 1 (1 / 2 ** h counted from h = 0): the slopes are 2 ** (-8 h / n_heads) for "
    "h = 1 .. n_heads, which for 8 heads is 1/2, 1/4, ..., 1/256"
)
HINT_SLOPES_FIXED_8 = (
    "you used the 8-head slopes 1/2, 1/4, ... for {n} heads: the ratio depends on n_heads, "
    "m_h = 2 ** (-8 h / n_heads) for h = 1 .. n_heads"
)
HINT_SLOPES_FIXED_8_NOT_POWER = (
    "you used the first {n} of the 8-head slopes 1/2, 1/4, ...: {n} is not a power of two, so take the "
    "{below}-head slopes 2 ** (-8 h / {below}) for h = 1 .. {below}, then every other slope of the "
    "{twice}-head sequence (its slopes 1, 3, 5, ...) until there are {n}"
)
HINT_NO_SLOPE = (
    "every head has the same bias, -distance: multiply each head's distances by its own slope m_h (the slopes, "
    "shaped (n_heads, 1, 1), broadcast against the (query_pos, key_pos) distances)"
)
HINT_BLOOM = (
    "you returned m_h * j (the key's position alone), BLOOM's shortcut: it differs from -m_h * (i - j) by a "
    "per-row constant that the softmax ignores, but this exercise asks for the bias itself: subtract the "
    "query's position, -m_h * (i - j)"
)
HINT_BOOL_BIAS = (
    "you returned a boolean mask: ALiBi is a float bias added to the scores, -m_h * distance, "
    "with shape (n_heads, query_pos, key_pos)"
)
HINT_NO_HEAD_AXIS = "one bias per head: return shape (n_heads, query_pos, key_pos), each head with its own slope"
HINT_HEADS_LAST = (
    "put the heads first: shape (n_heads, query_pos, key_pos). Give the slopes shape (n_heads, 1, 1), so that "
    "they broadcast in front of the (query_pos, key_pos) distances"
)
HINT_ALIBI_TRANSPOSED = "queries before keys: shape (n_heads, query_pos, key_pos), entry [h, i, j] for query i and key j"
HINT_ALIBI_DTYPE = (
    "return float32 (the scores' dtype), got {dtype}: build the slopes and distances as float32 tensors"
)
HINT_ALIBI_NUMPY = "build it with torch operations and return a torch.Tensor of shape (n_heads, query_pos, key_pos)"


def _slope_list(n: int, start_exponent: int = 1) -> list[float]:
    return [2.0 ** (-8.0 * h / n) for h in range(start_exponent, start_exponent + n)]


def _alibi(slopes: list[float] | torch.Tensor, n_query: int, n_key: int, *, aligned: bool = True,
           sign: float = -1.0, key_only: bool = False, signed: bool = False) -> torch.Tensor:
    """An ALiBi bias built with one of the known mistakes, float32 (``signed``: i - j for the distance, not |i - j|)."""
    m = torch.as_tensor(slopes, dtype=F64)[:, None, None]  # (n_heads, 1, 1)
    query_at = torch.arange(n_query, dtype=F64) + (n_key - n_query if aligned else 0)  # (query_pos,)
    key_at = torch.arange(n_key, dtype=F64)  # (key_pos,)
    if key_only:
        return (m * key_at.expand(n_query, n_key)).float()
    distance = query_at[:, None] - key_at  # (query_pos, key_pos)
    return (sign * m * (distance if signed else distance.abs())).float()


def _alibi_mistakes(n_heads: int, n_query: int, n_key: int) -> list[tuple[str, torch.Tensor]]:
    slopes = reference.alibi_slopes(n_heads, dtype=F64)
    below = 2 ** math.floor(math.log2(n_heads))
    return [
        (HINT_SLOPES_REVERSED, _alibi(slopes.flip(0), n_query, n_key)),
        (HINT_BIAS_SIGN, _alibi(slopes, n_query, n_key, sign=1.0)),
        # Not aligned, the distance i - j of a query "before" a visible key is negative: with or without abs.
        (HINT_NOT_END_ALIGNED, _alibi(slopes, n_query, n_key, aligned=False)),
        (HINT_NOT_END_ALIGNED, _alibi(slopes, n_query, n_key, aligned=False, signed=True)),
        (HINT_PLAIN_GEOMETRIC.format(n=n_heads, below=below, twice=2 * below), _alibi(_slope_list(n_heads), n_query, n_key)),
        (HINT_SLOPE_START_ONE, _alibi(_slope_list(n_heads, 0), n_query, n_key)),
        (HINT_SLOPE_HALVES_FROM_ONE, _alibi([2.0**-h for h in range(n_heads)], n_query, n_key)),
        ((HINT_SLOPES_FIXED_8 if below == n_heads else HINT_SLOPES_FIXED_8_NOT_POWER).format(
            n=n_heads, below=below, twice=2 * below), _alibi([2.0 ** -(h + 1) for h in range(n_heads)], n_query, n_key)),
        (HINT_NO_SLOPE, _alibi([1.0] * n_heads, n_query, n_key)),
        (HINT_BLOOM, _alibi(slopes, n_query, n_key, key_only=True)),
    ]


def _check_bias(got: Any, n_heads: int, n_query: int, n_key: int) -> None:
    what = f"alibi_bias({n_heads}, {n_query}, {n_key})"
    got = _expect_tensor(got, what, numpy_hint=HINT_ALIBI_NUMPY)
    expect(got.dtype != torch.bool, HINT_BOOL_BIAS)
    shape = tuple(got.shape)
    for wrong, hint in (((n_query, n_key), HINT_NO_HEAD_AXIS), ((n_query, n_key, n_heads), HINT_HEADS_LAST),
                        ((n_heads, n_key, n_query), HINT_ALIBI_TRANSPOSED)):
        if shape == wrong and shape != (n_heads, n_query, n_key):
            raise CheckFailure(f"{what} has shape {shape}: {hint}")
    expected = reference.alibi_bias(n_heads, n_query, n_key)
    expect(shape == tuple(expected.shape), f"{what} has shape {shape}, expected (n_heads, query_pos, key_pos) = {tuple(expected.shape)}")
    # Only what a causal mask leaves visible counts: above it, |i - j|, -inf or anything else is fine.
    visible = causal_mask(n_query, n_key)

    def seen(t: torch.Tensor) -> torch.Tensor:
        return t.to(F64).masked_fill(~visible, 0.0)

    what = f"{what} where the causal mask lets query i see key j"
    if torch.isfinite(seen(got)).all():
        mistakes = [(hint, seen(wrong)) for hint, wrong in _alibi_mistakes(n_heads, n_query, n_key)]
        name_mistake(seen(got), seen(expected), mistakes, rtol=1e-4, atol=1e-5)
    compare(seen(got), seen(expected), what=what, check_dtype=False)
    expect(got.dtype == torch.float32, HINT_ALIBI_DTYPE.format(dtype=got.dtype))


@checker("ALiBi bias")
def check_alibi_bias(alibi_bias) -> None:
    """Check a learner's ``alibi_bias(n_heads, n_query, n_key) -> Float[Tensor, "n_heads query_pos key_pos"]``.

    The bias is ``-m_h * distance``, end-aligned like ``causal_mask``, with the slopes of
    ``tfedu.positional.alibi_slopes`` (the paper's recipe for any number of heads). Only the
    entries that a causal mask leaves visible (key j at or before the query's position) are
    compared: the reference puts the symmetric ``-m_h * |i - j|`` above them, a learner may put
    anything there (the mask hides it).
    """
    error_hint = "keep the signature alibi_bias(n_heads, n_query, n_key)"
    # 8 heads, square; 4 heads with a cache (n_query < n_key); 6 and 12 heads, not powers of two.
    for n_heads, n_query, n_key in ((8, 5, 5), (4, 3, 7), (6, 4, 4), (12, 2, 6), (1, 1, 3)):
        got = call_learner(alibi_bias, n_heads, n_query, n_key, name="alibi_bias", error_hint=error_hint)
        _check_bias(got, n_heads, n_query, n_key)


# ----------------------------------------------------------------------------- RoPE

HINT_HALF_LAYOUT = (
    "you paired dimension i with i + d_head/2 (rotate_half, the layout of GPT-NeoX and Hugging Face Llama); "
    "this exercise uses the paper's interleaved pairs (0, 1), (2, 3), ...: each even dimension with the odd one "
    "right after it"
)
HINT_WRITTEN_AS_HALVES = (
    "you rotated the interleaved pairs but wrote them back as two halves (torch.cat puts every first member "
    "before every second one): put each rotated pair back side by side, its first member in dimension 2i and its "
    "second in 2i + 1 (stack the two on a new last axis, then flatten the last two axes into one)"
)
HINT_WRONG_DIRECTION = (
    "you rotated by -m * theta_i, the wrong direction: (a, b) turned by phi is "
    "(a cos phi - b sin phi, a sin phi + b cos phi)"
)
HINT_NOT_SCALED = (
    "every position is turned by theta_i alone: the angle is position times frequency, an outer product of "
    "the positions (pos,) and the frequencies (d_head/2,) giving (pos, d_head/2), so that the token at position m "
    "turns by m * theta_i"
)
HINT_ROPE_FROM_ONE = (
    "use the positions as given: the token at position m turns by m * theta_i (position 0 is not rotated); "
    "you used m + 1"
)
HINT_IGNORED_POSITIONS = (
    "you ignored `positions` and numbered the rows 0, 1, 2, ...: turn row r by positions[r] * theta_i "
    "(with a KV cache, new tokens sit at later positions)"
)
HINT_ROPE_FREQ_FLIPPED = (
    "your frequencies increase along the vector: pair 0 turns fastest (theta_0 = 1) and the last pair slowest. "
    "The frequency theta_i is 10000 ** (-2i / d_head), falling as i runs from 0 to d_head/2 - 1"
)
HINT_ROPE_FREQ_POSITIVE = (
    "the exponent's sign is wrong: 10000 ** (+2i / d_head) grows along the vector. The frequency theta_i is "
    "10000 ** (-2i / d_head), which falls from 1"
)
HINT_ROPE_EXPONENT_I = "the exponent is 2i / d_head, not i / d_head (i counts the pairs, 0 .. d_head/2 - 1)"
HINT_FIRST_PAIR_ONLY = (
    "only the first pair (dimensions 0 and 1) turned: every pair i turns, by m * theta_i with its own "
    "frequency theta_i = 10000 ** (-2i / d_head)"
)
HINT_LOW_PRECISION = (
    "right for small positions, wrong for positions past 2048: float16 and bfloat16 cannot hold every integer "
    "there (nor the angles, thousands of radians). Keep positions and angles in float32 or float64: convert "
    "the integer positions to one of those before multiplying them by the frequencies"
)
HINT_LARGE_POSITIONS = (
    "your answer is right for positions 0 .. 4 but not for these: are the positions or the angles held in "
    "float16 or bfloat16 (which cannot hold every integer past 2048)? Keep them in float32 or float64"
)
HINT_COMPLEX = (
    "you returned a complex tensor: turn it back into real pairs (torch.view_as_real gives each complex number "
    "as its real and imaginary parts on a new last axis; then flatten the last two axes into one) and return "
    "x's dtype"
)
HINT_ROPE_DTYPE = (
    "return x's dtype ({want}), got {got}: computing the angles in float64 is fine, but cast cos and sin (or "
    "the result) back to x's dtype"
)
HINT_ROPE_NUMPY = "build it with torch operations on x and return a torch.Tensor of x's shape"
HINT_ROPE_MUTATED = (
    "your apply_rope changed the caller's `{name}` in place (an assignment into a slice of x, or an in-place "
    "op such as mul_): build a new tensor from the rotated pairs instead, or work on a clone of x"
)
HINT_ROPE_CALL = (
    "x has leading batch and head dims, (batch, n_heads, pos, d_head), and positions has shape (pos,): slice "
    "the pairs out of the last dim only (an ellipsis stands for any leading dims), and make the angles "
    "(pos, d_head/2) so that they broadcast against the last two dims of x"
)
HINT_ROPE_NO_GRAD = (
    "no gradient flows back to x through apply_rope: was it computed under torch.no_grad(), or with "
    ".detach(), .numpy() or .item()? Keep every step a torch operation on x"
)
HINT_ROPE_GRAD = (
    "the values are right but the gradient with respect to x is wrong: is part of the computation detached "
    "or done in place?"
)


def _rope(x: torch.Tensor, positions: torch.Tensor, *, theta: torch.Tensor | None = None, layout: str = "interleaved",
          out_layout: str | None = None, sign: float = 1.0, scaled: bool = True, offset: int = 0,
          first_pair_only: bool = False) -> torch.Tensor:
    """RoPE built with one of the known mistakes, in float64, returned in x's dtype."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=F64)
    theta = 10000.0 ** (-2 * i / d) if theta is None else theta
    p = positions.to(F64)[..., None] + offset  # (pos, 1)
    angles = sign * (p * theta if scaled else theta.expand(*p.shape[:-1], d // 2))  # (pos, d/2)
    if first_pair_only:
        angles = torch.cat([angles[..., :1], torch.zeros_like(angles[..., 1:])], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    x64 = x.to(F64)
    a, b = (x64[..., 0::2], x64[..., 1::2]) if layout == "interleaved" else (x64[..., : d // 2], x64[..., d // 2 :])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = torch.stack([ra, rb], dim=-1).flatten(-2) if (out_layout or layout) == "interleaved" else torch.cat([ra, rb], -1)
    return out.to(x.dtype)


HINT_ROPE_BASE_100K = (
    "your angles use base 100000 (deck 001's N = 100,000). RoPE's base is 10000, the frequency theta_i is "
    "10000 ** (-2i / d_head), as in the paper and in exercise 6.1's table"
)


def _rope_mistakes(x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=F64)
    return {
        HINT_HALF_LAYOUT: _rope(x, positions, layout="half"),
        HINT_WRITTEN_AS_HALVES: _rope(x, positions, out_layout="half"),
        HINT_WRONG_DIRECTION: _rope(x, positions, sign=-1.0),
        HINT_NOT_SCALED: _rope(x, positions, scaled=False),
        HINT_ROPE_FROM_ONE: _rope(x, positions, offset=1),
        HINT_IGNORED_POSITIONS: _rope(x, torch.arange(x.shape[-2])),
        HINT_ROPE_FREQ_FLIPPED: _rope(x, positions, theta=(10000.0 ** (-2 * i / d)).flip(0)),
        HINT_ROPE_FREQ_POSITIVE: _rope(x, positions, theta=10000.0 ** (2 * i / d)),
        HINT_ROPE_EXPONENT_I: _rope(x, positions, theta=10000.0 ** (-i / d)),
        HINT_ROPE_BASE_100K: _rope(x, positions, theta=100000.0 ** (-2 * i / d)),
        HINT_FIRST_PAIR_ONLY: _rope(x, positions, first_pair_only=True),
        HINT_LOW_PRECISION: _rope(x, positions.half()),  # positions rounded to float16 (bfloat16: nearly the same)
    }


def _check_rotated(got: Any, x: torch.Tensor, positions: torch.Tensor, what: str, *, atol: float = 1e-5) -> torch.Tensor:
    got = _expect_tensor(got, what, numpy_hint=HINT_ROPE_NUMPY)
    expect(not got.is_complex(), HINT_COMPLEX)
    expected = reference.apply_rope(x.detach(), positions)
    mistakes = _rope_mistakes(x.detach(), positions)
    if got.shape == expected.shape:
        name_mistake(got, expected, mistakes.items())
    compare(got, expected, what=what, mistakes=mistakes, check_dtype=False, atol=atol)
    expect(got.dtype == x.dtype, HINT_ROPE_DTYPE.format(want=x.dtype, got=got.dtype))
    return got


def _apply_rope_problems(apply_rope: Any) -> None:
    """Every check of the apply_rope exercise; raises CheckFailure on the first problem."""
    # (batch, n_heads, pos, d_head) with positions 0 .. 4: names the mistakes, and any change to x in place.
    x, positions = seeded_randn(60, 2, 3, 5, 8), torch.arange(5)
    got = call_on_copies(apply_rope, {"x": x, "positions": positions}, name="apply_rope",
                          mutated_hint=HINT_ROPE_MUTATED, error_hint=HINT_ROPE_CALL)
    _check_rotated(got, x, positions, "apply_rope(x, positions) with positions 0 .. 4 and x of shape (2, 3, 5, 8)")
    # Positions given out of order and past 4000. Float32 angles are off by about m * 6e-8 radians there
    # (2.5e-4 on these x); 1e-3 allows that and still fails positions or angles kept in float16 / bfloat16.
    x, positions = seeded_randn(61, 3, 6, 16), torch.tensor([7, 0, 1000, 2049, 3001, 4095])
    got = call_on_copies(apply_rope, {"x": x, "positions": positions}, name="apply_rope",
                          mutated_hint=HINT_ROPE_MUTATED, error_hint=HINT_ROPE_CALL)
    try:
        _check_rotated(got, x, positions, "apply_rope(x, positions) with positions [7, 0, 1000, 2049, 3001, 4095]", atol=1e-3)
    except CheckFailure as failure:
        if " differs from the reference" in str(failure):  # no mistake named, yet right for positions 0 .. 4
            raise CheckFailure(f"{failure}. {HINT_LARGE_POSITIONS}") from None
        raise
    # Gradients reach x: the rotation is linear in x, so the gradient is the upstream turned back.
    x = seeded_randn(62, 2, 4, 6).requires_grad_(True)
    positions = torch.tensor([3, 4, 5, 6])
    got = call_learner(apply_rope, x.clone(), positions, name="apply_rope", error_hint=HINT_ROPE_CALL)
    got = _check_rotated(got, x, positions, "apply_rope(x, positions) with x of shape (2, 4, 6)")
    expect(got.requires_grad, HINT_ROPE_NO_GRAD)
    upstream = seeded_randn(63, 2, 4, 6)
    (grad,) = torch.autograd.grad(got, x, upstream, allow_unused=True)
    expect(grad is not None, HINT_ROPE_NO_GRAD)
    x_ref = x.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(reference.apply_rope(x_ref, positions), x_ref, upstream)
    expect(is_close(grad, expected), HINT_ROPE_GRAD)


@checker("rotary position embedding (RoPE)")
def check_apply_rope(apply_rope) -> None:
    """Check a learner's ``apply_rope(x, positions) -> Float[Tensor, "... pos d_head"]``.

    The paper's interleaved pairs (2i, 2i + 1), base 10000, x with leading batch and head dims,
    positions of shape (pos,) up to 4095, and the gradient with respect to x.
    """
    _apply_rope_problems(apply_rope)


# ----------------------------------------------------------------------------- attention with RoPE

HINT_ROTATED_V = (
    "you rotated the values too: RoPE turns only the queries and keys, so that their dot products depend "
    "on the offset m - n; the values pass through unrotated"
)
HINT_ONLY_K = (
    "you rotated k but not q: RoPE turns both the queries and the keys, each with the same positions, so that "
    "their dot product sees only the offset"
)
HINT_ONLY_Q = (
    "you rotated q but not k: RoPE turns both the queries and the keys, each with the same positions, so that "
    "their dot product sees only the offset"
)
HINT_NO_ROPE = "neither q nor k was rotated: rotate both with your apply_rope before the scores are computed"
HINT_NO_CAUSAL = (
    "no causal mask: every query also saw the keys after it. Give the attention a (pos, pos) causal mask "
    "(True where a query may attend)"
)
HINT_RA_HALF = (
    "you rotated with half-split pairs (i, i + d_head/2), GPT-NeoX and Llama's rotate_half; this exercise "
    "uses the paper's interleaved pairs (2i, 2i + 1): call your apply_rope"
)
HINT_RA_NO_SCALE = "missing 1/sqrt(d_head) scale on the scores (scaled_dot_product_attention does it for you)"
HINT_RA_PAIR = "return only the output tensor (..., pos, d_head), not the (output, weights) pair"
HINT_RA_NO_GRAD = (
    "no gradient flows back through rope_attention to {name}: was part of it computed under torch.no_grad() "
    "or detached?"
)
HINT_RA_GRAD = (
    "the output is right but the gradient with respect to {name} is wrong: is part of the computation detached "
    "or done in place?"
)
HINT_RA_MUTATED = (
    "your rope_attention changed the caller's `{name}` in place (an assignment into a slice of its input, or "
    "an in-place op, inside apply_rope?): build new tensors instead"
)
HINT_RA_CALL = (
    "q, k and v are (batch, n_heads, pos, d_head) and positions is (pos,): rotate q and k with apply_rope, then "
    "attend with scaled_dot_product_attention and a (pos, pos) causal mask"
)
# No "or call the reference instead": the grader refuses tfedu.positional in this exercise too.
_OWN_PART = "(with a right apply_rope in its place, your rope_attention passes)"
HINT_UPSTREAM_NOT_DONE = f"your rope_attention calls your apply_rope, which is not done yet: finish apply_rope first {_OWN_PART}"
HINT_UPSTREAM_WRONG = f"your rope_attention calls your apply_rope, which is wrong: fix apply_rope first {_OWN_PART}. Its check says: "
HINT_UPSTREAM_ALSO = "your rope_attention calls your apply_rope, which is wrong too: fix apply_rope first. Its check says: "


def reference_rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal attention with RoPE on the queries and keys (what the exercise builds), from tfedu's pieces."""
    n = q.shape[-2]
    rotated_q, rotated_k = reference.apply_rope(q, positions), reference.apply_rope(k, positions)
    return scaled_dot_product_attention(rotated_q, rotated_k, v, causal_mask(n, n))[0]


def _rope_attention_mistakes(q, k, v, positions) -> dict[str, torch.Tensor]:
    n, rope = q.shape[-2], reference.apply_rope
    mask = causal_mask(n, n)
    rq, rk = rope(q, positions), rope(k, positions)
    half_q, half_k = (rope(t, positions, layout="half") for t in (q, k))

    def attend(a, b, c, m=mask):
        return scaled_dot_product_attention(a, b, c, m)[0]

    return {
        HINT_ROTATED_V: attend(rq, rk, rope(v, positions)),
        HINT_ONLY_K: attend(q, rk, v),
        HINT_ONLY_Q: attend(rq, k, v),
        HINT_NO_ROPE: attend(q, k, v),
        HINT_NO_CAUSAL: attend(rq, rk, v, None),
        HINT_RA_HALF: attend(half_q, half_k, v),
        HINT_RA_NO_SCALE: scaled_dot_product_attention(rq * math.sqrt(q.shape[-1]), rk, v, mask)[0],
    }


def _check_attended(got: Any, q, k, v, positions, what: str) -> torch.Tensor:
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got):
        raise CheckFailure(HINT_RA_PAIR)
    got = _expect_tensor(got, what, numpy_hint="return a torch.Tensor (..., pos, d_head)")
    compare(got, reference_rope_attention(q.detach(), k.detach(), v.detach(), positions), what=what,
            mistakes=_rope_attention_mistakes(q.detach(), k.detach(), v.detach(), positions), rtol=1e-4, atol=1e-5)
    return got


def _rope_attention_failure(rope_attention: Any) -> CheckFailure | None:
    """The first problem of the rope_attention exercise (None: none). A stub raises ExerciseNotDone."""
    try:
        q, k, v = seeded_randn(70, 2, 3, 6, 8), seeded_randn(71, 2, 3, 6, 8), seeded_randn(72, 2, 3, 6, 8)
        positions = torch.arange(6)
        args = {"q": q, "k": k, "v": v, "positions": positions}
        got = call_on_copies(rope_attention, args, name="rope_attention", mutated_hint=HINT_RA_MUTATED,
                              error_hint=HINT_RA_CALL)
        _check_attended(got, q, k, v, positions, "rope_attention(q, k, v, positions) with positions 0 .. 5 on (2, 3, 6, 8) inputs")
        # Positions with gaps (relative offsets that are not all 1), and the gradients to q, k and v.
        leaves = [seeded_randn(73 + i, 2, 7, 4).requires_grad_(True) for i in range(3)]
        positions = torch.tensor([0, 2, 3, 7, 11, 20, 21])
        got = call_learner(rope_attention, *(t.clone() for t in leaves), positions, name="rope_attention",
                           error_hint=HINT_RA_CALL)
        got = _check_attended(got, *leaves, positions, "rope_attention(q, k, v, positions) with positions [0, 2, 3, 7, 11, 20, 21]")
        upstream = seeded_randn(76, 2, 7, 4)
        expect(got.requires_grad, HINT_RA_NO_GRAD.format(name="q, k and v"))
        grads = torch.autograd.grad(got, leaves, upstream, allow_unused=True)
        ref_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
        ref_grads = torch.autograd.grad(reference_rope_attention(*ref_leaves, positions), ref_leaves, upstream)
        for name, grad, want in zip("qkv", grads, ref_grads):
            expect(grad is not None, HINT_RA_NO_GRAD.format(name=name))
            expect(is_close(grad, want, rtol=1e-3, atol=1e-4), HINT_RA_GRAD.format(name=name))
    except ExerciseNotDone:
        raise
    except CheckFailure as failure:
        return failure
    return None


def _learner_apply_rope(rope_attention: Any) -> Callable[..., Any] | None:
    """The learner's own ``apply_rope`` when ``rope_attention`` refers to it by name."""
    namespace = getattr(rope_attention, "__globals__", None)
    if not isinstance(namespace, dict) or "apply_rope" not in global_names(rope_attention):
        return None
    candidate = namespace.get("apply_rope")
    return candidate if callable(candidate) and candidate is not reference.apply_rope else None


@contextlib.contextmanager
def _reference_apply_rope_in(rope_attention: Any) -> Iterator[None]:
    """Run with the name ``apply_rope`` in the learner's namespace bound to the reference; put back after."""
    namespace = rope_attention.__globals__
    saved = namespace["apply_rope"]
    namespace["apply_rope"] = lambda x, positions: reference.apply_rope(x, positions)
    try:
        yield
    finally:
        namespace["apply_rope"] = saved


@checker("attention with RoPE")
def check_rope_attention(rope_attention) -> None:
    """Check a learner's ``rope_attention(q, k, v, positions) -> Float[Tensor, "... pos d_head"]``.

    Causal attention with RoPE applied to q and k only. The answer may call the learner's
    ``apply_rope``: when that one is unfinished or wrong, and the answer passes with the reference
    in its place, the hint says to fix apply_rope first.
    """
    try:
        failure = _rope_attention_failure(rope_attention)
    except ExerciseNotDone as not_done:
        failure = not_done
    if failure is None:
        return
    upstream_fn = _learner_apply_rope(rope_attention)
    if upstream_fn is not None:
        upstream = upstream_problem(_apply_rope_problems, upstream_fn, not_done=HINT_UPSTREAM_NOT_DONE,
                                    wrong=HINT_UPSTREAM_WRONG)
        if upstream is not None:
            with _reference_apply_rope_in(rope_attention):
                own = _rope_attention_failure(rope_attention)  # a stub of its own still raises ExerciseNotDone
            if own is None:
                raise CheckFailure(upstream)
            also = upstream.replace(HINT_UPSTREAM_WRONG, HINT_UPSTREAM_ALSO).replace(f" {_OWN_PART}", "")
            raise CheckFailure(f"{own}. Also, {also}")
    raise failure


# ----------------------------------------------------------------------------- probes

FLOAT32 = "torch.float32"


def _dtype_of(value: Any) -> str | None:
    return str(value.dtype) if isinstance(value, torch.Tensor) else None


def _kinds_and_dtypes(outputs: Any, expected: dict, *, function: str, dtype_hints: dict[str, str],
                      kind_hints: dict[str, str] | None = None) -> str | None:
    """Changed inputs, what came back, then each result's dtype (``outputs["dtypes"]``), in that order."""
    if not isinstance(outputs, dict):
        return f"the hidden test's outputs should be a dict, got {type(outputs).__name__}"
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function=function, kind_hints=kind_hints)
    if problem:
        return problem
    got = outputs.get("dtypes")
    for i, want in enumerate(expected["dtypes"]):
        have = got[i] if isinstance(got, list) and i < len(got) else None
        if have != want:
            hint = dtype_hints.get(str(have), dtype_hints.get("", ""))
            return f"{function} returned dtype {have}, expected {want}" + (f": {hint}" if hint else "")
    return None


def _without(mapping: dict, *keys: str) -> dict:
    return {key: value for key, value in mapping.items() if key not in keys}


# sinusoidal: a small table, a long one (positions up to 1023), and one with a base of its own.

def _sinusoid_inputs(rng: np.random.Generator) -> dict:
    def even(lo: int, hi: int) -> int:
        return 2 * int(rng.integers(lo // 2, hi // 2 + 1))

    return {"calls": [
        [int(rng.integers(1, 40)), even(2, 32), None],
        [int(rng.integers(500, 1025)), even(16, 64), None],
        [int(rng.integers(2, 40)), even(4, 32), float(rng.choice([50.0, 500.0, 2000.0, 100000.0]))],
    ]}


SINUSOIDAL_RUN = HELPERS + """\
_results = [sinusoidal(_n, _d) if _base is None else sinusoidal(_n, _d, base=_base) for _n, _d, _base in inputs['calls']]
outputs = {'returned': [_kind(_r) for _r in _results],
           'dtypes': [str(_r.dtype) if isinstance(_r, torch.Tensor) else None for _r in _results]}
outputs.update({'table_' + str(_i): _array(_r) for _i, _r in enumerate(_results)})
del _results
""" + CLEANUP


def _call_text(n: int, d: int, base: float | None) -> str:
    return f"sinusoidal({n}, {d})" if base is None else f"sinusoidal({n}, {d}, base={base:g})"


def _sinusoid_reference(inputs: dict) -> dict:
    expected: dict[str, Any] = {"returned": ["tensor"] * 3, "dtypes": [FLOAT32] * 3}
    for i, (n, d, base) in enumerate(inputs["calls"]):
        expected[f"table_{i}"] = reference.sinusoidal(n, d, 10000.0 if base is None else base).numpy()
    expected["labels"] = [_call_text(*call) for call in inputs["calls"]]
    return expected


def _compare_sinusoid(outputs: dict, expected: dict) -> str | None:
    problem = _kinds_and_dtypes(outputs, expected, function="sinusoidal",
                                dtype_hints={"": "build the table in float32, the embeddings' dtype"})
    if problem:
        return problem
    labels = {f"table_{i}": label for i, label in enumerate(expected["labels"])}
    # Positions up to 1023: float32 angles are off by up to 1023 * 6e-8 radians.
    return compare_outputs(outputs, _without(expected, "dtypes", "labels"), function="sinusoidal", labels=labels,
                           rtol=1e-4, atol=2e-4)


# alibi_bias: several head counts (powers of two and not), fewer queries than keys, one long key axis.

def _alibi_inputs(rng: np.random.Generator) -> dict:
    calls = []
    for n_heads in (int(rng.choice([1, 2, 4, 8, 16])), int(rng.choice([3, 5, 6, 7, 12])), int(rng.integers(1, 21))):
        n_key = int(rng.integers(1, 20))
        calls.append([n_heads, int(rng.integers(1, n_key + 1)), n_key])
    n_key = int(rng.integers(1000, 2049))  # distances past 1000: the bias reaches -1000 on steep heads
    calls.append([int(rng.choice([4, 8, 12])), int(rng.integers(1, 9)), n_key])
    return {"calls": calls}


ALIBI_RUN = HELPERS + """\
_results = [alibi_bias(_h, _q, _k) for _h, _q, _k in inputs['calls']]
outputs = {'returned': [_kind(_r) for _r in _results],
           'dtypes': [str(_r.dtype) if isinstance(_r, torch.Tensor) else None for _r in _results],
           'biases': [_array(_r) for _r in _results]}
del _results
""" + CLEANUP


def _alibi_reference(inputs: dict) -> dict:
    biases = [reference.alibi_bias(*call).numpy() for call in inputs["calls"]]
    return {"returned": ["tensor"] * len(biases), "dtypes": [FLOAT32] * len(biases), "biases": biases,
            "calls": [list(call) for call in inputs["calls"]]}


def _compare_alibi(outputs: dict, expected: dict) -> str | None:
    problem = _kinds_and_dtypes(outputs, expected, function="alibi_bias",
                                dtype_hints={"torch.bool": HINT_BOOL_BIAS, "": "build the bias as a float32 tensor"})
    if problem:
        return problem
    got_all = outputs.get("biases")
    if not isinstance(got_all, list) or len(got_all) != len(expected["biases"]):
        return f"alibi_bias should have returned {len(expected['biases'])} tensors"
    for (n_heads, n_query, n_key), got, want in zip(expected["calls"], got_all, expected["biases"]):
        call = f"alibi_bias({n_heads}, {n_query}, {n_key})"
        if not isinstance(got, np.ndarray) or got.shape != want.shape:
            shape = got.shape if isinstance(got, np.ndarray) else None
            return f"{call} has shape {shape}, expected (n_heads, query_pos, key_pos) = {want.shape}"
        # The causal mask hides every key after the query's position: only the visible entries count.
        visible = np.tril(np.ones((n_query, n_key), dtype=bool), n_key - n_query)
        problem = compare_plain(np.where(visible, got, 0.0), np.where(visible, want, 0.0), 1e-4, 1e-5,
                                f"{call} where the causal mask lets query i see key j")
        if problem:
            return problem
    return None


# apply_rope: positions out of order up to 4095 (with gradients), then positions 0 .. pos - 1.

def _rope_inputs(rng: np.random.Generator) -> dict:
    leading = tuple(int(n) for n in rng.integers(1, 4, size=int(rng.integers(0, 3))))
    pos, d_head = int(rng.integers(2, 13)), 2 * int(rng.integers(1, 17))
    positions = rng.integers(0, 4096, size=pos)
    positions[int(rng.integers(0, pos))] = 2 * int(rng.integers(1025, 2048)) + 1  # odd, past 2048: not a float16
    pos_2 = int(rng.integers(1, 40))
    return {
        "x": rng.standard_normal((*leading, pos, d_head)).astype(np.float32),
        "positions": positions.astype(np.int64),
        "upstream": upstream_like(rng, (*leading, pos, d_head)),
        "x_2": rng.standard_normal((int(rng.integers(1, 4)), pos_2, 2 * int(rng.integers(1, 9)))).astype(np.float32),
        "positions_2": np.arange(pos_2, dtype=np.int64),
    }


APPLY_ROPE_RUN = HELPERS + """\
_x = torch.tensor(inputs['x'], requires_grad=True)
_result = _call(apply_rope, _x, torch.tensor(inputs['positions']))
_second = apply_rope(torch.tensor(inputs['x_2']), torch.tensor(inputs['positions_2']))
outputs = {
    'returned': [_kind(_result), _kind(_second)],
    'dtypes': [str(_r.dtype) if isinstance(_r, torch.Tensor) else None for _r in (_result, _second)],
    'output': _array(_result), 'output_2': _array(_second),
    'grad': _backward([_result], [torch.from_numpy(inputs['upstream'])], {'x': _x}),
}
outputs['mutated'] = _MUTATED
del _x, _result, _second
""" + CLEANUP


def _rope_reference(inputs: dict) -> dict:
    x = leaf(inputs["x"])
    output = reference.apply_rope(x, torch.from_numpy(inputs["positions"]))
    second = reference.apply_rope(torch.from_numpy(inputs["x_2"]), torch.from_numpy(inputs["positions_2"]))
    return {
        "returned": ["tensor", "tensor"], "dtypes": [FLOAT32, FLOAT32],
        "output": as_array(output), "output_2": as_array(second),
        "grad": backward([output], [torch.from_numpy(inputs["upstream"])], {"x": x}),
    }


def _compare_rope(outputs: dict, expected: dict) -> str | None:
    problem = _kinds_and_dtypes(outputs, expected, function="apply_rope",
                                dtype_hints={"torch.complex64": HINT_COMPLEX, "torch.complex128": HINT_COMPLEX,
                                             "": "return x's dtype: cast the result back to it at the end"})
    if problem:
        return problem
    # Positions up to 4095: float32 angles are off by about m * 6e-8 radians (2.5e-4 on these x). 1e-3
    # allows that and fails positions or angles kept in float16 / bfloat16 (off by a radian there).
    return compare_outputs(
        outputs, _without(expected, "dtypes"), function="apply_rope",
        labels={"output": "apply_rope(x, positions) with positions up to 4095",
                "output_2": "apply_rope(x, positions) with positions 0 .. pos - 1"},
        rtol=1e-4, atol=1e-3, grad_rtol=1e-3, grad_atol=1e-3,
    )


# rope_attention: positions with gaps and gradients to q, k, v; then scores around 1e3 (exp overflows
# unless the softmax subtracts the row max) at positions 0 .. n - 1. There the float32 rounding of the
# rotated q and k moves the scores by ~1e-4 and a float32 answer by up to ~1e-4 (3000 draws: 7.5e-5
# beyond rtol 1e-3), hence atol 1e-3 for that call; a missing max shift gives NaN, a missing mask O(1).

def _rope_attention_inputs(rng: np.random.Generator) -> dict:
    leading = tuple(int(n) for n in rng.integers(1, 4, size=int(rng.integers(1, 3))))
    pos, d_head = int(rng.integers(1, 17)), 2 * int(rng.integers(1, 9))
    positions = np.sort(rng.choice(200, size=pos, replace=False)).astype(np.int64)
    scale = float(rng.uniform(0.5, 2.0))
    n_big = int(rng.integers(17, 49))
    q_big, k_big = exact_large_qk(rng, (int(rng.integers(1, 3)),), n_big, n_big)
    return {
        "q": (rng.standard_normal((*leading, pos, d_head)) * scale).astype(np.float32),
        "k": (rng.standard_normal((*leading, pos, d_head)) * scale).astype(np.float32),
        "v": rng.standard_normal((*leading, pos, d_head)).astype(np.float32),
        "positions": positions,
        "upstream": upstream_like(rng, (*leading, pos, d_head)),
        "q_big": q_big, "k_big": k_big,
        "v_big": rng.standard_normal(q_big.shape).astype(np.float32),
        "positions_big": np.arange(n_big, dtype=np.int64),
    }


ROPE_ATTENTION_RUN = HELPERS + """\
_leaves = {_name: torch.tensor(inputs[_name], requires_grad=True) for _name in ('q', 'k', 'v')}
_result = _call(rope_attention, *_leaves.values(), torch.tensor(inputs['positions']))
_big = rope_attention(*(torch.tensor(inputs[_name + '_big']) for _name in ('q', 'k', 'v', 'positions')))
outputs = {
    'returned': [_kind(_result), _kind(_big)],
    'dtypes': [str(_r.dtype) if isinstance(_r, torch.Tensor) else None for _r in (_result, _big)],
    'output': _array(_result), 'output_big': _array(_big),
    'grad': _backward([_result], [torch.from_numpy(inputs['upstream'])], _leaves),
}
outputs['mutated'] = _MUTATED
del _leaves, _result, _big
""" + CLEANUP


def _rope_attention_reference(inputs: dict) -> dict:
    q, k, v = (leaf(inputs[name]) for name in ("q", "k", "v"))
    output = reference_rope_attention(q, k, v, torch.from_numpy(inputs["positions"]))
    big = reference_rope_attention(*(torch.from_numpy(inputs[name + "_big"]) for name in ("q", "k", "v", "positions")))
    return {
        "returned": ["tensor", "tensor"], "dtypes": [FLOAT32, FLOAT32],
        "output": as_array(output), "output_big": as_array(big),
        "grad": backward([output], [torch.from_numpy(inputs["upstream"])], {"q": q, "k": k, "v": v}),
    }


HINT_PROBE_OVERFLOW = (
    "scores around 1e3 overflow exp (exp(89) is already inf in float32): use torch.softmax or "
    "scaled_dot_product_attention, or subtract each row's max before exp if you wrote the softmax yourself"
)


def _compare_rope_attention(outputs: dict, expected: dict) -> str | None:
    kind_hints = {"a tuple of two tensors": HINT_RA_PAIR}
    problem = _kinds_and_dtypes(outputs, expected, function="rope_attention", kind_hints=kind_hints,
                                dtype_hints={"": "return q's dtype"})
    if problem:
        return problem
    labels = {"output": "rope_attention(q, k, v, positions)",
              "output_big": "rope_attention(q, k, v, positions) with scores around 1e3"}
    return compare_outputs(
        outputs, _without(expected, "dtypes", "output_big"), function="rope_attention", labels=labels,
        kind_hints=kind_hints, rtol=1e-3, atol=1e-4,
    ) or compare_outputs(
        outputs, {"returned": expected["returned"], "output_big": expected["output_big"]}, function="rope_attention",
        labels=labels, nan_hints={"output_big": HINT_PROBE_OVERFLOW}, kind_hints=kind_hints, rtol=1e-3, atol=1e-3,
    )


# rope_attention may call the learner's apply_rope. While it is graded this stand-in takes its place,
# so a wrong or unfinished apply_rope costs that exercise alone. Primitive ops only (no tfedu).
APPLY_ROPE_STANDIN = """\
def apply_rope(x, positions):
    \"\"\"Stand-in for the apply_rope exercise: pairs (2i, 2i + 1) turned by positions * 10000 ** (-2i / d_head).\"\"\"
    d_head = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    angles = positions.to(torch.float64)[..., None] * theta
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2)
"""

PROBES = {
    "check_sinusoidal": Probe(
        exercise="ex_sinusoidal",
        make_inputs=_sinusoid_inputs,
        run=SINUSOIDAL_RUN,
        reference=_sinusoid_reference,
        compare=_compare_sinusoid,
        forbidden=("tfedu.positional",),
    ),
    "check_alibi_bias": Probe(
        exercise="ex_alibi_bias",
        make_inputs=_alibi_inputs,
        run=ALIBI_RUN,
        reference=_alibi_reference,
        compare=_compare_alibi,
        forbidden=("tfedu.positional",),
    ),
    "check_apply_rope": Probe(
        exercise="ex_apply_rope",
        make_inputs=_rope_inputs,
        run=APPLY_ROPE_RUN,
        reference=_rope_reference,
        compare=_compare_rope,
        forbidden=("tfedu.positional",),
    ),
    "check_rope_attention": Probe(
        exercise="ex_rope_attention",
        make_inputs=_rope_attention_inputs,
        run=ROPE_ATTENTION_RUN,
        reference=_rope_attention_reference,
        compare=_compare_rope_attention,
        # The answer may call tfedu.attention (scaled_dot_product_attention, causal_mask) and the
        # learner's apply_rope (replaced by the stand-in while this is graded), not the reference RoPE.
        forbidden=("tfedu.positional",),
        standins=APPLY_ROPE_STANDIN,
    ),
}


# ----------------------------------------------------------------------------- hints

HINTS = {
    "ex_sinusoidal": Hints(
        number="6.1",
        check="check_sinusoidal",
        idea=(
            "Each row is one position t and each pair of columns (2i, 2i + 1) one frequency omega_i: the pair "
            "holds the sine and the cosine of the same angle, omega_i times t. So the whole table is sin and cos "
            "of one grid of angles, every position times every frequency. The traps: positions start at 0 (the "
            "first row is 0, 1, 0, 1, ...), the frequencies fall along the vector (the first pair turns at 1 "
            "radian per position), and the exponent counts pairs, 2i / d_model, not columns."
        ),
        approach=(
            "Three small tensors, then the table. The positions 0 .. n_positions - 1, shape (pos,). The "
            "frequencies, shape (d_model / 2,): the even numbers 0, 2, 4, ... below d_model, divided by "
            "d_model, negated, as the power of `base` (use the argument, not a hard-coded 10000). The angles, "
            "shape (pos, d_model / 2): an outer product, by giving the positions a trailing axis of size 1 and "
            "the frequencies a leading one so they broadcast. Then a (pos, d_model) table of zeros whose even "
            "columns (a slice with step 2 from 0) get the sines and odd columns (step 2 from 1) the cosines. "
            "Working in float64 and casting to float32 once, at the end, keeps the rounding of the large "
            "angles small."
        ),
        skeleton=(
            "def sinusoidal(n_positions, d_model, base=10000.0):\n"
            "    t = ____  # (pos,): 0, 1, ..., n_positions - 1, in float64\n"
            "    omega = base ** (____ / d_model)  # (d_model / 2,): the exponent -2i / d_model for each pair i\n"
            "    angles = t[____] * omega[____]  # (pos, d_model / 2): every position times every frequency\n"
            "    table = torch.zeros(____, ____, dtype=torch.float64)  # (pos, d_model)\n"
            "    table[:, ____] = ____  # the sines go in the even columns\n"
            "    table[:, ____] = ____  # the cosines in the odd columns\n"
            "    return ____  # float32, the embeddings' dtype\n"
        ),
    ),
    "ex_alibi_bias": Hints(
        number="6.2",
        check="check_alibi_bias",
        idea=(
            "ALiBi adds no vector anywhere: each head h gets one number per (query, key) pair, minus its slope "
            "m_h times how far back the key is. The result is a penalty that grows with distance, steep for "
            "the first heads, gentle for the last. Two things to get right: the slopes (a geometric sequence "
            "that starts at 2 ** (-8 / n_heads), with the paper's recipe when n_heads is not a power of two), "
            "and where the queries sit: they are the last n_query of the n_key tokens, so with fewer queries "
            "than keys query 0 is not at position 0."
        ),
        approach=(
            "First the slopes, shape (n_heads,). Write a helper that gives the n slopes of an n-head model, "
            "2 ** (-8 h / n) for h = 1 .. n. Take below, the largest power of two not above n_heads (a log2 and "
            "a floor), use all the slopes of below heads, and fill the remaining n_heads - below from the slopes "
            "of 2 * below heads, every other one starting with the first (for a power of two nothing is left "
            "to fill). Then the distances, shape (query_pos, key_pos): query i sits at position "
            "i + n_key - n_query, key j at j; subtract with broadcasting (a column of query positions minus a "
            "row of key positions). Finally the slopes, reshaped to (n_heads, 1, 1), times the distances, "
            "negated: (n_heads, query_pos, key_pos), float32. Only the entries a causal mask leaves visible are "
            "checked, so what you put above the diagonal is up to you."
        ),
        skeleton=(
            "def alibi_bias(n_heads, n_query, n_key):\n"
            "    def geometric(n):\n"
            "        return [____ for h in range(n)]  # the n slopes of an n-head model: 2 ** (-8 / n), ..., 2 ** -8\n"
            "\n"
            "    below = ____  # the largest power of two <= n_heads\n"
            "    slopes = torch.tensor(geometric(below) + ____)  # (n_heads,): the rest from geometric(2 * below)\n"
            "    query_at = torch.arange(n_query) + ____  # (query_pos,): the queries are the newest tokens\n"
            "    key_at = torch.arange(n_key)  # (key_pos,)\n"
            "    distance = query_at[____] - key_at[____]  # (query_pos, key_pos)\n"
            "    return ____ * distance  # (n_heads, query_pos, key_pos): minus each head's slope\n"
        ),
    ),
    "ex_apply_rope": Hints(
        number="6.3",
        check="check_apply_rope",
        idea=(
            "RoPE turns each pair of neighbouring dimensions (2i, 2i + 1) of the row at position m, like a "
            "point in the plane, by the angle m * theta_i. Rows at different positions turn by different "
            "angles, pairs at different i at different speeds, and the length of every pair is kept. The traps: "
            "pairs are neighbours here, not dimension i with i + d_head / 2 (that is the other layout); the "
            "angle is the position times the frequency; and the rotated pairs must go back interleaved, in the "
            "places they came from."
        ),
        approach=(
            "Frequencies theta, shape (d_head / 2,): 10000 to the power -2i / d_head, as in exercise 6.1. "
            "Angles, shape (pos, d_head / 2): the positions (converted to float64 first) as a column times "
            "theta as a row. Take cos and sin of the angles and cast them to x's dtype once. Split x into the "
            "first and the second members of every pair, the even and the odd dimensions of the last axis, "
            "each (..., pos, d_head / 2); the (pos, d_head / 2) cos and sin broadcast against them whatever "
            "leading axes x has. Rotate: the new first member is first times cos minus second times sin, the "
            "new second is first times sin plus second times cos. Stack the two on a new last axis, "
            "(..., pos, d_head / 2, 2), and flatten the last two axes back to d_head. Never write into x."
        ),
        skeleton=(
            "def apply_rope(x, positions):\n"
            "    d_head = x.shape[____]\n"
            "    theta = ____  # (d_head / 2,): 10000 ** (-2i / d_head), in float64\n"
            "    angles = ____  # (pos, d_head / 2): the position of each row times each frequency\n"
            "    cos, sin = ____, ____  # cast to x's dtype, once\n"
            "    first, second = x[..., ____], x[..., ____]  # (..., pos, d_head / 2): the two members of every pair\n"
            "    rotated = torch.stack([____, ____], dim=-1)  # (..., pos, d_head / 2, 2): each pair turned\n"
            "    return rotated.flatten(____)  # (..., pos, d_head): the pairs interleaved again\n"
        ),
    ),
    "ex_rope_attention": Hints(
        number="6.4",
        check="check_rope_attention",
        idea=(
            "RoPE changes what enters the scores and nothing else. Rotate the queries and the keys by their "
            "positions, so that each dot product sees only the offset between query and key, then run ordinary "
            "causal attention. The values are what gets mixed: they pass through untouched (rotating them would "
            "stamp absolute positions onto the output). Both q and k must be rotated, with the same positions."
        ),
        approach=(
            "Three steps, all with pieces you have. Rotate q and k with your apply_rope and the given positions; "
            "shapes stay (..., pos, d_head). Build the causal mask for pos queries and pos keys with "
            "tfa.causal_mask, where pos is the length of q's second-to-last axis. Call "
            "tfa.scaled_dot_product_attention on the rotated queries, the rotated keys, the plain values and "
            "the mask; it scales by the square root of d_head and returns the output and the weights. Return "
            "only the output, shape (..., pos, d_head)."
        ),
        skeleton=(
            "def rope_attention(q, k, v, positions):\n"
            "    n = q.shape[____]  # pos\n"
            "    rotated_q, rotated_k = ____, ____  # what enters the scores, turned by position\n"
            "    mask = ____  # (pos, pos): True where a query may attend\n"
            "    out, _ = tfa.scaled_dot_product_attention(____, ____, ____, mask)\n"
            "    return ____\n"
        ),
    ),
}

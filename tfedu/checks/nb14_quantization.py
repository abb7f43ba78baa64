"""Checkers for notebooks/14_quantization.ipynb: the bits of a float, absmax and zero-point quantization by hand, GPTQ.

- 14.1 ``float_fields(x, exponent_bits, mantissa_bits) -> (sign, exponent, mantissa)``: the fields of the float
  nearest to the Python float x with e exponent and M mantissa bits, bias 2^(e-1) - 1, rounded to nearest with ties
  to even, subnormals included, for |x| up to the format's largest finite value (e4m3fn's 448 for e = 4, M = 3,
  the IEEE (2 - 2^-M) 2^bias otherwise: no special case either way). Checked exactly against
  :func:`reference_float_fields` (Fractions; the tests hold it to torch's own bit patterns of float32, bfloat16,
  float16 and float8_e4m3fn) in those four formats and four that torch has no dtype for. Named: the sign of -0.0
  lost, the bias 2^(e-1), no bias, the implicit 1 kept in the mantissa field, truncation, ties rounded away from
  zero, subnormals flushed to 0, given the normal formula (a negative exponent field), scaled by 2^-bias instead
  of 2^(1 - bias) or given an implicit 1, the mantissa's carry kept in the field or dropped instead of moved into
  the exponent, a sign of ±1, floats or fields out of their range.

The quantizers are pairs of functions, checked against the formulas of ``tfedu.quant`` after first trying the
known mistakes:

- 14.2 ``absmax_quantize(x, bits) -> (q, scale)`` and ``absmax_dequantize(q, scale) -> x_hat``:
  ``scale = max|x| / (2^(b-1) - 1)``, ``q = clamp(round(x / scale), -(2^(b-1) - 1), 2^(b-1) - 1)`` as int8,
  ``x_hat = q * scale``. Named: rounding before scaling (``round(x) / scale``), the scale from ``2^(b-1)`` (the
  [-128, 127] range: the largest value clamped), the scale from ``2^b - 1`` (at 8 bits the int8 cast wraps 255 to
  -1), an unsigned clamp ([0, 2^b - 1]: negatives lost), the scale from ``max x`` instead of ``max |x|``, truncation instead of rounding (``.to(torch.int8)`` or ``.int()`` alone),
  float codes (no int8 cast), no guard for an all-zero tensor (scale 0, ``0 / 0``), dividing where dequantize
  multiplies, the input changed in place.
- 14.3 ``zeropoint_quantize(x, bits) -> (q, scale, zero)`` and ``zeropoint_dequantize(q, scale, zero)``:
  ``[lo, hi] = [min(min x, 0), max(max x, 0)]``, ``scale = (hi - lo) / (2^b - 1)``, ``zero = round(-lo / scale)``,
  ``q = clamp(round(x / scale) + zero, 0, 2^b - 1)`` as uint8, ``x_hat = (q - zero) * scale``. Named: a zero
  point with the wrong sign (``round(lo / scale)``), a zero point not rounded (0 not exact), the range not
  widened to hold 0 (all-positive x) or not widened on the positive side (all-negative x: a zero point above
  2^b - 1), no clamp (a code of 2^b, which uint8 wraps to 0 at 8 bits), codes round((x - lo) / scale) with a rounded
  zero point, the scale from ``2^b`` levels, a signed clamp ([-128, 127] or int8 codes), truncation,
  rounding before scaling, no guard for a constant tensor, dequantize as ``q * scale - zero``, adding the zero
  point, dividing, or returning integers, the subtraction done in uint8 (wrapping around), the input changed in
  place. A dequantizer returning integers is named in 14.2 too.

Inputs are built so that no ``x / scale`` lies near a rounding tie (but for :func:`zeropoint_overflow_case`, whose
ties at ±(2^b - 1) / 2 round up under both half-to-even and half-away-from-zero, so that a missing clamp shows) (on a power-of-two grid, at least 0.05 of a step
from one), plus one case of plain random float64 values, where a zero point left unrounded shows (a tie there has
probability about 0): every right answer, whatever its order of operations, gives the reference's codes exactly.
A clamp to [-128, 127] with the right scale is no mistake (max|x| / scale is 127, so -128 is never reached); the
scale from 2^(b-1), which makes that range necessary, is. ``tfedu.quant`` is refused: the formulas are the exercise.

- 14.4 ``gptq_layer(W, H, quantize_column, damp=0.01) -> Q``: GPTQ's column loop on one layer (Frantar et al. 2022,
  Algorithm 1, without the lazy blocks): damp H by ``damp * mean(diag H)``, take the upper Cholesky factor U of its
  inverse, then for each column j left to right quantize it with ``quantize_column(W, j)`` (a :class:`ColumnQuantizer`,
  the grid tfedu.quant uses, or a fixed one), divide its error by ``U_jj`` and subtract the error times ``U[j, j+1:]``
  from the columns after it. Compared with :func:`reference_gptq_layer` (equal to ``tfedu.quant.gptq_quantize``) on
  :data:`GQ_CASES`, float64 and float32, one with a singular H. Named: round-to-nearest (no propagation, or the lower
  factor, whose row j is zero right of the diagonal), the error not divided by ``U_jj`` or divided by ``U_jj^2``, the
  Cholesky factor of H or the inverse of H's factor instead of the factor of H^-1, the current column updated again
  after it was stored, the factor's column (the error spread to the columns already quantized), the sign flipped,
  no damping (and the singular H's failed factorisation), damping not relative to H's mean diagonal, the rows of
  the full H^-1 computed once, the columns taken right to left (from the order quantize_column was asked), W or H
  changed in place. OBQ's update with the inverse of the remaining columns' Hessian recomputed at every step is the
  same loop in exact arithmetic and passes. tfedu.quant and this module are refused.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import torch

import tfedu.quant as _quant
from tfedu.checks.core import (CheckFailure, ExerciseNotDone, Hints, Probe, call_learner, call_on_copies, checker,
                               describe, expect, from_modules, globals_from_modules, watch_calls)
from tfedu.checks.building_blocks import ELEMENTARY
from tfedu.checks.probes import CLEANUP, HELPERS

FORBIDDEN = ("tfedu.quant",)
HINT_RETURNED_NONE = "your {function} returned None: this exercise is not done yet, or the function has no `return`"
HINT_SHORTCUT = "your {function} uses tfedu.quant ({name}): the quantizer is the exercise, so build it from torch operations"
HINT_MUTATED = ("your {function} changed its input `x` in place (an in-place division, round_, ...): the caller's "
                "weights must stay as they were, so build new tensors")


def _refuse_quant(fn: Any, function: str) -> None:
    if from_modules(fn, FORBIDDEN):
        raise CheckFailure(HINT_SHORTCUT.format(function=function, name=f"you passed tfedu.quant's own "
                                                f"{getattr(fn, '__name__', 'object')}"))
    used = globals_from_modules(fn, FORBIDDEN)
    expect(not used, HINT_SHORTCUT.format(function=function, name=", ".join(used)))


def _tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    return value.as_subclass(torch.Tensor) if isinstance(value, torch.Tensor) else None


# ----------------------------------------------------------------------------- 14.1 the bits of a float

# The formats torch has, by name: (exponent bits, mantissa bits) and the integer dtype its bits are viewed as.
TORCH_FORMATS = {"float32": (8, 23), "bfloat16": (8, 7), "float16": (5, 10), "float8_e4m3fn": (4, 3)}
TORCH_VIEWS = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16, "float8_e4m3fn": torch.uint8}
# Formats torch has no dtype for: an answer that casts to a torch dtype cannot do these.
OTHER_FORMATS = ((3, 2), (6, 4), (2, 3), (7, 9))
E4M3FN_MAX = 448.0  # e4m3fn has no infinities: exponent field 15 holds numbers, only 0b1111_111 is NaN

HINT_FF_CALL = ("float_fields(x, exponent_bits, mantissa_bits): x a Python float, the two counts ints; return "
                "(sign, exponent field, mantissa field), three ints")
HINT_FF_KIND = "float_fields should return three integers (sign, exponent field, mantissa field), got {got}"
HINT_FF_NOT_INT = ("float_fields({args}) returned {got}: each field is a whole number of a few bits, so return ints "
                   "(Python's round of a float is already an int)")
HINT_FF_SIGN_PM = ("float_fields({args}) gave sign {got}, expected {want}: the sign field is one bit, 0 for a positive "
                   "number and 1 for a negative one, not a factor of ±1")
HINT_FF_NEG_ZERO = (
    "for x = -0.0 your sign is 0: negative zero is a float of its own, with the sign bit set (it prints as -0.0), "
    "but the comparison x < 0 is False for it. Read the sign bit itself rather than comparing with 0 (the sign "
    "that math.copysign copies, say)"
)
HINT_FF_BIAS_PLUS = (
    "your exponent field is one more than it should be for x = {x!r} ({got} instead of {want}): with e exponent "
    "bits the bias is 2^(e-1) - 1 ({bias} here: 127 for float32, 15 for float16, 7 for e4m3), not 2^(e-1)"
)
HINT_FF_NO_BIAS = (
    "your exponent field for x = {x!r} is {got}, the exponent itself: the field stores it plus the bias, "
    "2^(e-1) - 1 ({bias} here), so that it is never negative ({want} for this x)"
)
HINT_FF_IMPLICIT = (
    "your mantissa field for x = {x!r} is {got}, {top} or more: it holds the implicit leading 1 too. A normal "
    "number's significand is 1.m, and the field stores only the M bits after the binary point, m from 0 to "
    "2^M - 1 (here {want})"
)
HINT_FF_TRUNCATE = (
    "the input {x!r} lies between two neighbouring floats of this format and your fields give the one nearer to zero, "
    "although the other is nearer: the mantissa is truncated (cut off), not rounded. Round |x| / step to the "
    "nearest integer"
)
HINT_FF_TIES_AWAY = (
    "the input {x!r} lies exactly halfway between two neighbouring floats of this format, and your fields give the one "
    "with the odd mantissa field ({got}): a tie goes to the neighbour whose last mantissa bit is 0, the even one "
    "({want}), not away from zero. Python's round and torch.round already round a half to even; rounding by "
    "adding 0.5 and taking the floor does not"
)
HINT_FF_FLUSH = (
    "the input {x!r} is below the smallest normal number of this format, 2^(1 - bias) = {tiny!r}, and your fields are 0: "
    "it is not zero but a subnormal, exponent field 0 and value m / 2^M * 2^(1 - bias), with no implicit 1 "
    "(here the mantissa field is {want})"
)
HINT_FF_SUB_SCALE = (
    "the input {x!r} is a subnormal of this format (exponent field 0), and your mantissa field {got} is off by a factor "
    "of two or an implicit 1 (expected {want}): a subnormal's value is m / 2^M * 2^(1 - bias), the smallest normal "
    "exponent 1 - bias, not 0 - bias, and no leading 1"
)
HINT_FF_SUB_RANGE = (
    "your exponent field for x = {x!r} is {got}: a field is at least 0. This x is below the smallest normal number, "
    "2^(1 - bias) = {tiny!r}: such numbers are subnormal, exponent field 0 and value m / 2^M * 2^(1 - bias), "
    "without the implicit 1"
)
HINT_FF_CARRY = (
    "for x = {x!r} the rounded significand reaches 2 (the mantissa's carry): |x| rounds up to the next power of two, "
    "{up!r}, so the exponent field goes up by one and the mantissa field becomes 0. Your fields are {got}, "
    "expected {want}"
)
HINT_FF_RANGE = ("float_fields({args}) gave {what} {got}, outside the field's range 0 to {top} ({bits} bits): "
                 "expected {want}")
HINT_FF_VALUES = (
    "float_fields({args}) gave (sign, exponent, mantissa) = {got}, which is the float {got_value!r}; the nearest "
    "float of this format to x is {want_value!r}, fields {want}"
)


def format_bias(exponent_bits: int) -> int:
    """The exponent bias of a format with ``exponent_bits`` exponent bits: 2^(e-1) - 1 (127 for float32)."""
    return 2 ** (exponent_bits - 1) - 1


def largest_finite(exponent_bits: int, mantissa_bits: int) -> float:
    """The largest finite value: (2 - 2^-M) 2^bias when the exponent field all ones is kept for inf and NaN (IEEE);
    448 for (4, 3), read as e4m3fn, where only the all-ones pattern is NaN.

    >>> largest_finite(5, 10), largest_finite(4, 3)
    (65504.0, 448.0)
    """
    if (exponent_bits, mantissa_bits) == (4, 3):
        return E4M3FN_MAX
    return (2 - 2.0**-mantissa_bits) * 2.0 ** format_bias(exponent_bits)


def _fields(x: float, e: int, M: int, mistake: str = "") -> tuple[int, int, int]:
    """The fields of the float nearest to x (exact arithmetic on Fractions), or of one named ``mistake``."""
    bias = 2 ** (e - 1) if mistake == "bias plus one" else format_bias(e)
    sign = int(x < 0) if mistake == "negative zero" else int(math.copysign(1.0, x) < 0)
    a = Fraction(abs(x))
    if a == 0:
        return sign, 0, 0
    k = a.numerator.bit_length() - a.denominator.bit_length()  # 2^k <= a < 2^(k + 1), after the correction
    if Fraction(2) ** k > a:
        k -= 1
    subnormal = k < 1 - bias
    if subnormal and mistake == "flush subnormals":
        return sign, 0, 0
    if subnormal and mistake == "negative exponent":  # the normal formula below the normal range
        return sign, k + bias, round((a / Fraction(2) ** k - 1) * 2**M)
    if subnormal and mistake == "subnormal step 2^-bias":
        return sign, 0, round(a / Fraction(2) ** -bias * 2**M)
    if subnormal and mistake == "subnormal with the 1":
        return sign, 0, round((a / Fraction(2) ** -bias - 1) * 2**M)
    k = max(k, 1 - bias)  # a subnormal is counted in steps of the smallest normal binade
    t = a / Fraction(2) ** k * 2**M  # |x| in steps of 2^(k - M): 2^M to 2^(M + 1) for a normal number
    if mistake == "truncate":
        steps = math.floor(t)
    elif mistake == "ties away":
        steps = math.floor(t + Fraction(1, 2))
    else:
        steps = round(t)  # Fraction rounds a half to even
    if steps == (2 ** (M + 1) if t >= 2**M else 2**M) and mistake in ("carry kept", "carry dropped"):
        return sign, (k + bias) if t >= 2**M else 0, (2**M if mistake == "carry kept" else 0)
    if steps == 2 ** (M + 1):  # rounded up to the next power of two
        steps, k = steps // 2, k + 1
    if steps < 2**M:  # subnormal (or 0): exponent field 0, no implicit 1
        return sign, 0, steps
    if mistake == "no bias":
        return sign, k, steps - 2**M
    return sign, k + bias, steps if mistake == "implicit one" else steps - 2**M


def reference_float_fields(x: float, exponent_bits: int, mantissa_bits: int) -> tuple[int, int, int]:
    """(sign, biased exponent field, mantissa field) of the float nearest to ``x`` with ``exponent_bits`` exponent
    and ``mantissa_bits`` mantissa bits (bias 2^(e-1) - 1), rounded to nearest, ties to even, subnormals included.

    Exact (``fractions.Fraction``), so ``x`` is rounded once, straight from float64. For ``|x|`` no larger than
    :func:`largest_finite`; the top exponent field is then a finite number's (e4m3fn) or never reached (IEEE).
    Built by hand in notebooks/14_quantization.ipynb (exercise 14.1).

    >>> reference_float_fields(-2.5, 5, 10), reference_float_fields(448.0, 4, 3), reference_float_fields(-0.0, 8, 7)
    ((1, 16, 256), (0, 15, 6), (1, 0, 0))
    """
    return _fields(float(x), exponent_bits, mantissa_bits)


def pack_fields(fields: tuple[int, int, int], exponent_bits: int, mantissa_bits: int) -> int:
    """The fields as one unsigned integer, sign bit first: what the float's bytes hold.

    >>> hex(pack_fields((0, 127, 0), 8, 23))
    '0x3f800000'
    """
    sign, exponent, mantissa = fields
    return (sign << (exponent_bits + mantissa_bits)) | (exponent << mantissa_bits) | mantissa


def fields_value(fields: tuple[int, int, int], exponent_bits: int, mantissa_bits: int) -> float:
    """The number the fields encode (normal or subnormal).

    >>> fields_value((1, 16, 256), 5, 10)
    -2.5
    """
    sign, exponent, mantissa = fields
    bias = format_bias(exponent_bits)
    if exponent == 0:
        value = math.ldexp(mantissa, 1 - bias - mantissa_bits)
    else:
        value = math.ldexp(2**mantissa_bits + mantissa, exponent - bias - mantissa_bits)
    return -value if sign else value


def torch_bits(x: float, name: str) -> int:
    """torch's own bit pattern of ``x`` in the format ``name`` (a key of :data:`TORCH_FORMATS`), as unsigned.

    torch turns a Python float into a 16- or 8-bit float through float32, two roundings: for an ``x`` that is a
    float32 number (or for float32 itself) that is the nearest float; see the tests for a case where it is not.

    >>> hex(torch_bits(1.0, "bfloat16")), torch_bits(448.0, "float8_e4m3fn")
    ('0x3f80', 126)
    """
    e, M = TORCH_FORMATS[name]
    raw = int(torch.tensor(x, dtype=getattr(torch, name)).view(TORCH_VIEWS[name]).item())
    return raw & (2 ** (1 + e + M) - 1)


def _tie(k: int, j: int, M: int) -> float:
    """Halfway between the mantissa fields j and j + 1 of the binade 2^k."""
    return math.ldexp(2 ** (M + 1) + 2 * j + 1, k - M - 1)


def float_cases(e: int, M: int, rng: np.random.Generator | None = None, n_random: int = 6) -> list[float]:
    """Values that tell the named mistakes apart in the format (e, M), all within its finite range: ±1, powers of
    two, the largest finite value, ±0, ties to even both ways, a carry into the exponent (a tie and not),
    subnormals (a tie, one that rounds up into the normal range, one that rounds to 0), 0.1, and random values."""
    bias, top = format_bias(e), largest_finite(e, M)
    low = 1 - bias  # the smallest normal exponent
    sub = math.ldexp(1.0, low - M)  # the smallest subnormal
    mid = min(bias - 1, 3)
    values = [1.0, -1.0, 2.0 ** mid, 2.0**low, top, -top, 0.0, -0.0, 0.1, -2.5 if top >= 2.5 else -1.5,
              _tie(0, 0, M), -_tie(mid, 1, M), _tie(low, 1, M),  # ties: to even is down, up, up
              math.ldexp(2 ** (M + 2) - 1, -M - 2),  # 1 - 2^-(M+2): rounds up to 1, a carry without a tie
              -_tie(mid, 2**M - 1, M),  # the tie below 2^(mid+1): to even is the carry
              math.ldexp(1 + 2.0**-(M + 1) + 2.0**-(M + 3), mid),  # just past a tie: rounds up, a cut does not
              3 * sub, -sub, 0.5 * sub, 0.75 * sub, 1.5 * sub, 2.5 * sub,  # subnormals and their ties
              math.ldexp(2 ** (M + 2) - 1, low - M - 2),  # a subnormal that rounds up to the smallest normal
              -math.ldexp(2**M - 1, low - M), math.ldexp(1.0, low - M - 3),  # the largest subnormal; one that is 0
              0.9 * top]  # in the top binade (e4m3fn's exponent field 15 holds numbers)
    rng = rng or np.random.default_rng(e * 100 + M)
    for _ in range(n_random):
        k = int(rng.integers(low - M - 1, bias + 1))
        values.append(float(rng.choice([-1, 1]) * math.ldexp(1 + float(rng.random()), k)))
    return [v for v in values if abs(v) <= top]


def _args(x: float, e: int, M: int) -> str:
    return f"{x!r}, {e}, {M}"


def _as_fields(result: Any, x: float, e: int, M: int) -> tuple[int, int, int]:
    """The learner's result as three Python ints, or a CheckFailure saying why it is not."""
    if result is None:
        raise ExerciseNotDone(HINT_RETURNED_NONE.format(function="float_fields"))
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise CheckFailure(HINT_FF_KIND.format(got=describe(result)))
    fields = []
    for value in result:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        elif isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float):
            raise CheckFailure(HINT_FF_NOT_INT.format(args=_args(x, e, M), got=describe(result)))
        if not isinstance(value, int):
            raise CheckFailure(HINT_FF_KIND.format(got=describe(result)))
        fields.append(int(value))
    return tuple(fields)


# In this order: for a subnormal x the bias 2^(e-1) and the step 2^-bias give the same fields, and the second names it.
MISTAKES = ("negative zero", "flush subnormals", "negative exponent", "subnormal step 2^-bias", "subnormal with the 1",
            "bias plus one", "no bias", "implicit one", "truncate", "ties away", "carry kept", "carry dropped")


def diagnose_fields(fields: tuple[int, int, int], x: float, e: int, M: int) -> None:
    """Raise CheckFailure naming what is wrong with ``fields``, the learner's ``float_fields(x, e, M)``."""
    want = _fields(x, e, M)
    if fields == want:
        return
    bias, args = format_bias(e), _args(x, e, M)
    tiny = math.ldexp(1.0, 1 - bias)
    sign, exponent, mantissa = fields
    up = math.copysign(math.ldexp(1.0, (want[1] if want[1] else 1) - bias), x)
    hints = {
        "negative zero": HINT_FF_NEG_ZERO,
        "bias plus one": HINT_FF_BIAS_PLUS.format(x=x, got=exponent, want=want[1], bias=bias),
        "no bias": HINT_FF_NO_BIAS.format(x=x, got=exponent, want=want[1], bias=bias),
        "implicit one": HINT_FF_IMPLICIT.format(x=x, got=mantissa, top=2**M, want=want[2]),
        "truncate": HINT_FF_TRUNCATE.format(x=x),
        "ties away": HINT_FF_TIES_AWAY.format(x=x, got=mantissa, want=want[2]),
        "flush subnormals": HINT_FF_FLUSH.format(x=x, tiny=tiny, want=want[2]),
        "negative exponent": HINT_FF_SUB_RANGE.format(x=x, got=exponent, tiny=tiny),
        "subnormal step 2^-bias": HINT_FF_SUB_SCALE.format(x=x, got=mantissa, want=want[2]),
        "subnormal with the 1": HINT_FF_SUB_SCALE.format(x=x, got=mantissa, want=want[2]),
        "carry kept": HINT_FF_CARRY.format(x=x, up=up, got=fields, want=want),
        "carry dropped": HINT_FF_CARRY.format(x=x, up=up, got=fields, want=want),
    }
    for mistake in MISTAKES:
        if mistake == "negative exponent" and exponent >= 0:
            continue  # (the same fields as a carry kept in the mantissa, for a subnormal that rounds up to normal)
        wrong = _fields(x, e, M, mistake)
        if wrong != want and fields == wrong:
            raise CheckFailure(hints[mistake])
    if sign != want[0] and (sign == -1 or fields[1:] == want[1:]):
        raise CheckFailure(HINT_FF_SIGN_PM.format(args=args, got=sign, want=want[0]))
    expect(sign in (0, 1), HINT_FF_RANGE.format(args=args, what="sign", got=sign, top=1, bits=1, want=want[0]))
    if exponent < 0 and want[1] == 0:
        raise CheckFailure(HINT_FF_SUB_RANGE.format(x=x, got=exponent, tiny=tiny))
    expect(0 <= exponent < 2**e, HINT_FF_RANGE.format(args=args, what="exponent field", got=exponent, top=2**e - 1,
                                                       bits=e, want=want[1]))
    if mantissa >= 2**M and want[1] > 0 and exponent == want[1]:
        raise CheckFailure(HINT_FF_IMPLICIT.format(x=x, got=mantissa, top=2**M, want=want[2]))
    expect(0 <= mantissa < 2**M, HINT_FF_RANGE.format(args=args, what="mantissa field", got=mantissa, top=2**M - 1,
                                                      bits=M, want=want[2]))
    raise CheckFailure(HINT_FF_VALUES.format(args=args, got=fields, got_value=fields_value(fields, e, M),
                                             want_value=fields_value(want, e, M), want=want))


def float_field_formats() -> list[tuple[str, int, int]]:
    """(name, e, M): the four torch formats, then formats torch has no dtype for."""
    return [*((name, e, M) for name, (e, M) in TORCH_FORMATS.items()),
            *((f"{e} exponent and {M} mantissa bits", e, M) for e, M in OTHER_FORMATS)]


@checker("the bits of a float")
def check_float_fields(float_fields) -> None:
    """Check ``float_fields(x, exponent_bits, mantissa_bits) -> (sign, exponent, mantissa)``.

    On :func:`float_cases` in float32, bfloat16, float16, e4m3fn and four formats torch has no dtype for (so an answer
    cannot be a cast), every value within the format's finite range: fields compared exactly with
    :func:`reference_float_fields` after the named mistakes are tried.
    """
    for name, e, M in float_field_formats():
        for x in float_cases(e, M):
            result = call_learner(float_fields, x, e, M, name="float_fields", error_hint=HINT_FF_CALL)
            diagnose_fields(_as_fields(result, x, e, M), x, e, M)


# ----------------------------------------------------------------------------- 14.1 probe

FF_PROBE_RUN = HELPERS + """\
_results = []
for _x, _e, _m in inputs['cases']:
    _r = float_fields(_x, _e, _m)
    if isinstance(_r, (tuple, list)) and len(_r) == 3:
        _r = [_v.item() if isinstance(_v, (torch.Tensor, np.generic)) and np.size(_v) == 1 else _v for _v in _r]
        _r = [_v if isinstance(_v, (int, float)) else type(_v).__name__ for _v in _r]
    else:
        _r = _kind(_r)
    _results.append(_r)
outputs = {'results': _results}
del _results, _x, _e, _m, _r
""" + CLEANUP


def _float_probe_inputs(rng: np.random.Generator) -> dict:
    """The four torch formats and two drawn ones: :func:`float_cases` with fresh random values, plus random ties
    (normal and subnormal) at random places."""
    formats = [*TORCH_FORMATS.values(), (int(rng.integers(2, 9)), int(rng.integers(1, 13))),
               (int(rng.integers(3, 7)), int(rng.integers(1, 6)))]
    cases = []
    for e, M in formats:
        bias = format_bias(e)
        values = float_cases(e, M, rng, n_random=3)
        for _ in range(3):
            values.append(float(rng.choice([-1.0, 1.0])) * _tie(int(rng.integers(1 - bias, bias)), int(rng.integers(0, 2**M)), M))
        values.append(math.ldexp(2 * int(rng.integers(0, 2**M)) + 1, -bias - M))  # a subnormal tie
        cases += [[float(x), e, M] for x in values if abs(x) <= largest_finite(e, M)]
    return {"cases": cases}


def _compare_float_fields(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict):
        return "the hidden test's outputs should be a dict"
    cases, results = expected["cases"], outputs.get("results")
    if not (isinstance(results, list) and len(results) == len(cases)):
        return "float_fields's hidden test did not run every case"
    for got, (x, e, M) in zip(results, cases):
        try:
            if isinstance(got, str):
                _as_fields(None if got == "NoneType" else got, x, e, M)
            fields = _as_fields(tuple(v.item() if isinstance(v, np.generic) else v for v in got), x, e, M)
            diagnose_fields(fields, x, e, M)
        except CheckFailure as failure:
            return f"hidden test, float_fields({_args(x, e, M)}): {failure}"
    return None


# ----------------------------------------------------------------------------- inputs without ties


def absmax_case(seed: int, shape: tuple[int, ...], bits: int, *, negative_max: bool = False,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values whose ``x / scale`` sit at least 0.1 from a rounding tie; ``max|x|`` hit exactly (by a negative value
    when ``negative_max``: then ``max x`` and ``max |x|`` differ)."""
    g = torch.Generator().manual_seed(seed)
    qmax = 2 ** (bits - 1) - 1
    step = 2.0 ** -int(torch.randint(3, 7, (), generator=g))  # a power of two: x / scale is exact
    n = int(np.prod(shape))
    k = torch.randint(-qmax + 1, qmax, (n,), generator=g).double()
    u = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.8  # within 0.4 of the code: no tie
    t = (k + u).clamp(-qmax + 0.45, qmax - 0.45)
    t[0] = -qmax if negative_max else qmax  # the largest magnitude, hit exactly
    t[1] = qmax - 0.7 if negative_max else -(qmax - 0.7)
    return (t * step).reshape(shape).to(dtype)


def zeropoint_case(seed: int, shape: tuple[int, ...], bits: int, *, positive: bool = False, negative: bool = False,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values on a grid of step 2^-k with ``lo``, ``hi`` hit exactly and an integer zero point; no ties. With
    ``positive`` every value is > 0, with ``negative`` every value is < 0 (the range must then be widened to hold 0
    on the low or the high side)."""
    g = torch.Generator().manual_seed(seed)
    levels = 2**bits - 1
    step = 2.0 ** -int(torch.randint(3, 7, (), generator=g))
    n = int(np.prod(shape))
    zero = 0 if positive else levels if negative else int(torch.randint(1, levels, (), generator=g))
    k = torch.randint(0, levels + 1, (n,), generator=g).double()
    u = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.8
    if positive:
        t = (k + u).clamp(levels / 3, levels - 0.45)
    elif negative:
        t = (k + u).clamp(0.45, 2 * levels / 3)
    else:
        t = (k + u).clamp(0.45, levels - 0.45)
    if not negative:
        t[0] = levels
    if not positive:
        t[1] = 0  # lo = -zero * step exactly
    return ((t - zero) * step).reshape(shape).to(dtype)


def zeropoint_overflow_case(bits: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A range centred on 0, [-(L / 2) step, (L / 2) step] with L = 2^b - 1 odd, on an exact binary grid: -lo / scale
    and max x / scale are both exactly L / 2, a half, and round up (round half to even: 127.5 -> 128, 7.5 -> 8), so
    the top value's code is L + 1 before the clamp (256 wraps to 0 in uint8: +max x would come back as -max x).
    Like [-0.3, 0.3, 0.1], without the float noise that makes the tie go either way."""
    levels = 2**bits - 1
    step = 2.0 ** -(bits + 1)
    t = torch.tensor([-levels / 2, levels / 2, 0.3 * levels + 0.2, -0.2 * levels + 0.1, 0.0, 1.2], dtype=torch.float64)
    return (t * step).to(dtype)


# ----------------------------------------------------------------------------- 14.2 absmax

HINT_ABS_CALL = "absmax_quantize(x, bits): x a float tensor, bits an int from 2 to 8; return (q, scale)"
HINT_ABS_PAIR = "absmax_quantize should return a pair (q, scale): the int8 codes and the float scale, got {got}"
HINT_ABS_FLOAT_CODES = (
    "your codes q are {dtype}: the point of quantizing is to store each value in one byte, so cast the rounded "
    "codes to torch.int8 after clamping"
)
HINT_ABS_DTYPE = "your codes q are {dtype}: absmax codes are signed, int8 (torch.int8), from -qmax to qmax"
HINT_ABS_SHAPE = "your codes q have shape {got}, expected the shape of x, {want}"
HINT_SCALE_SHAPE = "your scale has shape {got}: one number for the whole tensor (a 0-d or 1-element float tensor)"
HINT_ROUND_FIRST = (
    "you rounded before scaling (round(x), then divided by the scale): the weights are small numbers, so round(x) "
    "is mostly 0. Divide by the scale first, then round: the code is round(x / scale)"
)
HINT_128 = (
    "your scale is max|x| / 2^(b-1) ({n} for {bits} bits) and the largest value was clamped: the symmetric range is "
    "±(2^(b-1) - 1) = ±{qmax}, so divide max|x| by {qmax} (the code -{n} is never used: it would have no +{n})"
)
HINT_ABS_LEVELS = (
    "your scale is max|x| / (2^b - 1) = max|x| / {top}, the zero-point count of steps: absmax codes are symmetric, "
    "±(2^(b-1) - 1) = ±{qmax}, so divide max|x| by {qmax}{wrap}"
)
HINT_UNSIGNED = (
    "your codes are clamped to [0, {top}]: every negative value became 0. Absmax codes are signed: clamp to "
    "[-{qmax}, {qmax}] and store them as int8"
)
HINT_MAX_NOT_ABS = (
    "your scale comes from max(x), not max(|x|): this tensor's largest magnitude is a negative value ({v:.4g}), "
    "which then clamps. The scale comes from the largest magnitude, positive or negative"
)
HINT_TRUNCATE = (
    "your codes are truncated, not rounded: a cast to an integer dtype cuts off the fraction (2.7 becomes 2), "
    "doubling the error. Round x / scale to the nearest integer first, and cast only the rounded, clamped codes"
)
HINT_ABS_ZERO = (
    "for an all-zero x your scale is {got}: max|x| = 0 gives scale 0, and x / scale is 0 / 0 = NaN (your codes may "
    "still come out 0: casting NaN to an integer is undefined). Guard it: when max|x| is 0 use scale 1 (any positive "
    "number works: every code is 0)"
)
HINT_ABS_CODES = ("absmax_quantize({what}) gave code {got} at index {i}, expected {want}: the code is "
                  "round(x / scale), clamped to [-qmax, qmax]")
HINT_ABS_SCALE = "absmax_quantize({what}) gave scale {got:.6g}, expected max|x| / (2^(b-1) - 1) = {want:.6g}"
HINT_DEQ_DIVIDE = "your absmax_dequantize divides by the scale: quantize divided, so dequantize multiplies, x_hat = q * scale"
HINT_DEQ_INT = (
    "your absmax_dequantize returned {dtype} values, not floats: a dequantized value is a code times a float scale "
    "(2 * 0.0039 is no integer), so convert the codes to the scale's float dtype before multiplying, and return "
    "the float tensor"
)
HINT_DEQ_VALUES = "absmax_dequantize({what}) gave {got:.6g} at index {i}, expected q * scale = {want:.6g}"
HINT_DEQ_KIND = "{function} should return a float tensor shaped like q, got {got}"


def expected_absmax(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (int8) and scale (float64, 0-d) by the formula, in float64."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.double().abs().max()
    scale = amax / qmax if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
    return (x.double() / scale).round().clamp(-qmax, qmax).to(torch.int8), scale


def _int8_wrap(codes: torch.Tensor) -> torch.Tensor:
    """What ``.to(torch.int8)`` makes of integer-valued codes beyond [-128, 127] (two's complement: 255 -> -1)."""
    return torch.remainder(codes + 128, 256) - 128


def _wrap_note(bits: int) -> str:
    top = 2**bits - 1
    return (f" (with {top} the int8 cast wrapped codes above 127 around: {top} came back as {top - 256})"
            if top > 127 else "")


def absmax_mistakes(x: torch.Tensor, bits: int) -> list[tuple[str, torch.Tensor]]:
    """(hint, wrong codes as float64) for each named mistake on ``x``."""
    qmax, n = 2 ** (bits - 1) - 1, 2 ** (bits - 1)
    x = x.double()
    amax = x.abs().max()
    if amax == 0:
        return []
    scale = amax / qmax
    mx = x.max() / qmax if x.max() > 0 else scale
    top_codes = (x / (amax / (2**bits - 1))).round()
    return [
        (HINT_ROUND_FIRST, (x.round() / scale).round().clamp(-qmax, qmax)),
        (HINT_ROUND_FIRST, (x.round() / scale).clamp(-qmax, qmax).trunc()),
        (HINT_128.format(n=n, bits=bits, qmax=qmax), (x / (amax / n)).round().clamp(-n, n - 1)),
        (HINT_UNSIGNED.format(top=2**bits - 1, qmax=qmax), (x / scale).round().clamp(0, 2**bits - 1)),
        (HINT_ABS_LEVELS.format(top=2**bits - 1, qmax=qmax, wrap=_wrap_note(bits)), _int8_wrap(top_codes)),
        (HINT_ABS_LEVELS.format(top=2**bits - 1, qmax=qmax, wrap=_wrap_note(bits)), _int8_wrap(top_codes.clamp(-qmax, qmax))),
        (HINT_MAX_NOT_ABS.format(v=float(x.flatten()[x.abs().flatten().argmax()])),
         (x / mx).round().clamp(-qmax, qmax)),
        (HINT_TRUNCATE, (x / scale).clamp(-qmax, qmax).trunc()),
        (HINT_TRUNCATE, (x / scale).trunc().clamp(-qmax, qmax)),
    ]


def absmax_cases() -> list[tuple[str, torch.Tensor, int]]:
    cases = [(absmax_case(0, (6, 8), 8), 8), (absmax_case(1, (5, 4), 4, negative_max=True), 4),
             (absmax_case(2, (33,), 3), 3), (absmax_case(3, (4, 6), 8, negative_max=True, dtype=torch.float64), 8),
             (absmax_case(4, (2, 3, 4), 2), 2)]
    return [(f"x of shape {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}, bits={b}", x, b) for x, b in cases]


def diagnose_absmax(result: Any, x: torch.Tensor, bits: int, *, what: str) -> None:
    """Raise CheckFailure naming what is wrong with ``result``, the learner's ``absmax_quantize(x, bits)``."""
    if result is None:
        raise ExerciseNotDone(HINT_RETURNED_NONE.format(function="absmax_quantize"))
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise CheckFailure(HINT_ABS_PAIR.format(got=describe(result)))
    q, scale = _tensor(result[0]), result[1]
    expect(q is not None, HINT_ABS_PAIR.format(got=f"({describe(result[0])}, {describe(result[1])})"))
    scale = torch.as_tensor(scale).detach().double() if isinstance(scale, (torch.Tensor, float, int, np.ndarray)) else None
    expect(scale is not None and scale.numel() == 1,
           HINT_SCALE_SHAPE.format(got=tuple(scale.shape) if scale is not None else describe(result[1])))
    scale = scale.reshape(())
    want_q, want_scale = expected_absmax(x, bits)
    expect(tuple(q.shape) == tuple(x.shape), HINT_ABS_SHAPE.format(got=tuple(q.shape), want=tuple(x.shape)))
    if not x.any():
        expect(bool(torch.isfinite(scale)) and float(scale) > 0, HINT_ABS_ZERO.format(got=float(scale)))
    got = q.detach().double()
    if q.is_floating_point() and torch.isfinite(got).all() and torch.equal(got, got.round()) and torch.equal(got, want_q.double()):
        raise CheckFailure(HINT_ABS_FLOAT_CODES.format(dtype=q.dtype))
    if not torch.equal(got, want_q.double()):
        for hint, wrong in absmax_mistakes(x, bits):
            if torch.equal(got, wrong) and not torch.equal(wrong, want_q.double()):
                raise CheckFailure(hint)
    expect(not q.is_floating_point(), HINT_ABS_FLOAT_CODES.format(dtype=q.dtype))
    expect(q.dtype == torch.int8, HINT_ABS_DTYPE.format(dtype=q.dtype))
    if not torch.equal(got, want_q.double()):
        i = int((got != want_q.double()).flatten().nonzero()[0])
        raise CheckFailure(HINT_ABS_CODES.format(what=what, got=int(got.flatten()[i]), i=i, want=int(want_q.flatten()[i])))
    if not torch.isclose(scale, want_scale, rtol=1e-5, atol=0):
        raise CheckFailure(HINT_ABS_SCALE.format(what=what, got=float(scale), want=float(want_scale)))


def diagnose_dequantize(got: Any, want: torch.Tensor, divided: torch.Tensor | None, *, function: str, what: str,
                        extra: list[tuple[str, torch.Tensor]] = ()) -> None:
    """Raise CheckFailure when ``got`` (the learner's dequantized tensor) differs from ``want`` (float64)."""
    if got is None:
        raise ExerciseNotDone(HINT_RETURNED_NONE.format(function=function))
    t = _tensor(got)
    expect(t is not None and tuple(t.shape) == tuple(want.shape),
           HINT_DEQ_KIND.format(function=function, got=describe(got)))
    expect(t.is_floating_point(), HINT_DEQ_INT.replace("absmax_dequantize", function).format(dtype=t.dtype))
    value = t.detach().double()
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-5, atol=1e-7))  # noqa: E731
    if not close(value, want):
        for hint, wrong in [*([(HINT_DEQ_DIVIDE.replace("absmax_dequantize", function), divided)] if divided is not None else []),
                            *extra]:
            if close(value, wrong) and not close(wrong, want):
                raise CheckFailure(hint)
        i = int((value - want).abs().flatten().argmax())
        raise CheckFailure(HINT_DEQ_VALUES.replace("absmax_dequantize", function).replace("q * scale", "the formula")
                           .format(what=what, got=float(value.flatten()[i]), i=i, want=float(want.flatten()[i])))


def _call_quantize(fn: Any, x: torch.Tensor, bits: int, function: str, call_hint: str) -> Any:
    copy = x.clone()
    result = call_learner(fn, copy, bits, name=function, error_hint=call_hint)
    expect(torch.equal(copy, x), HINT_MUTATED.format(function=function))
    return result


@checker("absmax quantization")
def check_absmax(absmax_quantize, absmax_dequantize) -> None:
    """Check ``absmax_quantize(x, bits) -> (q, scale)`` and ``absmax_dequantize(q, scale) -> x_hat``.

    On :func:`absmax_cases` (2 to 8 bits, the largest magnitude positive or negative, float32 and float64) and an
    all-zero tensor, codes compared exactly (no input lies near a tie) after the named mistakes are tried.
    """
    _refuse_quant(absmax_quantize, "absmax_quantize")
    _refuse_quant(absmax_dequantize, "absmax_dequantize")
    for what, x, bits in [*absmax_cases(), ("an all-zero x of shape (3, 4), bits=8", torch.zeros(3, 4), 8)]:
        result = _call_quantize(absmax_quantize, x, bits, "absmax_quantize", HINT_ABS_CALL)
        diagnose_absmax(result, x, bits, what=what)
        q, scale = expected_absmax(x, bits)
        got = call_learner(absmax_dequantize, q, scale.to(x.dtype), name="absmax_dequantize")
        diagnose_dequantize(got, q.double() * scale, q.double() / scale, function="absmax_dequantize",
                            what=f"the codes of {what}")
        assert torch.equal(_quant.absmax_quantize(x, bits)[0], q), "the checker disagrees with tfedu.quant"  # our guard


# ----------------------------------------------------------------------------- 14.3 zero-point

HINT_ZP_CALL = "zeropoint_quantize(x, bits): x a float tensor, bits an int from 2 to 8; return (q, scale, zero)"
HINT_ZP_TRIPLE = "zeropoint_quantize should return a triple (q, scale, zero): uint8 codes, a float scale, the zero point; got {got}"
HINT_ZP_FLOAT_CODES = "your codes q are {dtype}: store them as torch.uint8 (one byte each), cast after clamping"
HINT_ZP_DTYPE = (
    "your codes q are {dtype}: zero-point codes are unsigned, from 0 to 2^b - 1 (0 to 255 for 8 bits), so store them "
    "as torch.uint8"
)
HINT_ZP_SIGN = (
    "your zero point has the wrong sign: it is the code that 0.0 gets, round(-lo / scale), a number in [0, 2^b - 1] "
    "(lo is negative or 0, so -lo / scale >= 0). round(lo / scale) puts the codes below 0, where the clamp cuts them"
)
HINT_ZP_NOT_ROUNDED = (
    "your zero point is not an integer ({z:.4g}): then 0.0 falls between two codes and comes back as a small nonzero "
    "number, but 0 is everywhere in a network (padding, ReLU outputs) and must stay exact. Round it: the zero point "
    "is round(-lo / scale)"
)
HINT_ZP_FROM_LO = (
    "your codes are round((x - lo) / scale), but your zero point {z} is round(-lo / scale) = round({raw:.4g}): the "
    "codes are offset by the unrounded fraction, so (q - zero) * scale shifts values by up to that fraction of a step "
    "on top of the rounding (errors up to a step, not half). Compute the codes from the rounded zero point you "
    "return: round(x / scale) + zero, clamped to [0, 2^b - 1]"
)
HINT_ZP_NO_CLAMP = (
    "your code {got} at index {i} is outside [0, 2^b - 1] = [0, {top}]{wrap}: round(x / scale) + zero can pass the "
    "top code when both round up (here max x / scale is {t:.4g} and the zero point {zero}). Clamp the codes to "
    "[0, {top}] before the uint8 cast"
)
HINT_ZP_HI_NOT_WIDENED = (
    "your zero point is {z}, outside [0, 2^b - 1] = [0, {top}]: this x is all negative (max x = {mx:.4g}) and your "
    "range's top is max x, so 0.0 lies above the range and has no code. Widen the range on the positive side too, "
    "hi = max(max x, 0) (and lo = min(min x, 0))"
)
HINT_ZP_NOT_WIDENED = (
    "your range [lo, hi] is [min x, max x]: for this all-positive x that leaves 0 outside it, so 0.0 has no code. "
    "Widen the range to hold 0, lo = min(min x, 0) and hi = max(max x, 0) (torch's observers do the same)"
)
HINT_ZP_LEVELS = (
    "your scale is (hi - lo) / 2^b: there are 2^b codes but 2^b - 1 steps between the first and the last, so divide "
    "by {levels} (for {bits} bits) or the top of the range is never reached"
)
HINT_ZP_SIGNED = (
    "your codes are clamped to a signed range [{lo}, {hi}]: zero-point codes run from 0 to 2^b - 1 = {top}, with the "
    "zero point somewhere inside; clamp to [0, {top}] and store as uint8"
)
HINT_ZP_TRUNC = (
    "your codes are truncated, not rounded: an integer cast cuts off the fraction. Round x / scale first, then add "
    "the zero point and clamp"
)
HINT_ZP_ROUND_FIRST = "you rounded x before scaling: the code is round(x / scale) + zero, not round(x) / scale + zero"
HINT_ZP_CONSTANT = (
    "for an all-zero x your scale is {got}: hi - lo = 0 gives scale 0 and x / scale = 0 / 0 = NaN. Guard it: when "
    "hi == lo use scale 1"
)
HINT_ZP_CODES = ("zeropoint_quantize({what}) gave code {got} at index {i}, expected {want}: the code is "
                 "round(x / scale) + zero, clamped to [0, 2^b - 1]")
HINT_ZP_SCALE = "zeropoint_quantize({what}) gave scale {got:.6g}, expected (hi - lo) / (2^b - 1) = {want:.6g}"
HINT_ZP_ZERO = "zeropoint_quantize({what}) gave zero point {got}, expected round(-lo / scale) = {want}"
HINT_ZPD_ORDER = (
    "your zeropoint_dequantize computes q * scale - zero: the zero point is a code, so subtract it from the codes "
    "before scaling, (q - zero) * scale"
)
HINT_ZPD_DIVIDE = "your zeropoint_dequantize divides by the scale: dequantize multiplies, (q - zero) * scale"
HINT_ZPD_ADD = (
    "your zeropoint_dequantize adds the zero point: quantize added it (q = round(x / scale) + zero), so dequantize "
    "subtracts it, (q - zero) * scale"
)
HINT_ZPD_WRAP = (
    "your zeropoint_dequantize subtracts in uint8: codes below the zero point wrap around (3 - 5 = 254 in uint8). "
    "Convert the codes to a float dtype before subtracting the zero point"
)


def expected_zeropoint(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    levels = 2**bits - 1
    x = x.double()
    lo, hi = x.min().clamp(max=0), x.max().clamp(min=0)
    scale = (hi - lo) / levels if hi > lo else torch.tensor(1.0, dtype=torch.float64)
    zero = (-lo / scale).round().clamp(0, levels)
    return ((x / scale).round() + zero).clamp(0, levels).to(torch.uint8), scale, zero


def zeropoint_mistakes(x: torch.Tensor, bits: int) -> list[tuple[str, torch.Tensor]]:
    """(hint, wrong codes as float64)."""
    levels = 2**bits - 1
    x = x.double()
    lo, hi = x.min().clamp(max=0), x.max().clamp(min=0)
    if hi == lo:
        return []
    scale = (hi - lo) / levels
    zero = (-lo / scale).round()
    half = 2 ** (bits - 1)
    out = [
        (HINT_ZP_SIGN, ((x / scale).round() + (lo / scale).round()).clamp(0, levels)),
        (HINT_ZP_NOT_ROUNDED.format(z=float(-lo / scale)), (x / scale + (-lo / scale)).round().clamp(0, levels)),
        (HINT_ZP_LEVELS.format(levels=levels, bits=bits), ((x / ((hi - lo) / 2**bits)).round()
                                                          + (-lo / ((hi - lo) / 2**bits)).round()).clamp(0, levels)),
        (HINT_ZP_SIGNED.format(lo=-half, hi=half - 1, top=levels), ((x / scale).round() + zero).clamp(-half, half - 1)),
        (HINT_ZP_SIGNED.format(lo=-half, hi=half - 1, top=levels), ((x / scale).round()).clamp(-half, half - 1)),
        (HINT_ZP_TRUNC, (x / scale + zero).clamp(0, levels).trunc()),
        (HINT_ZP_TRUNC, ((x / scale).trunc() + zero).clamp(0, levels)),
        (HINT_ZP_ROUND_FIRST, (x.round() / scale + zero).round().clamp(0, levels)),
    ]
    if x.min() > 0:  # the range not widened: lo = min x
        s2 = (x.max() - x.min()) / levels
        out.insert(0, (HINT_ZP_NOT_WIDENED, ((x / s2).round() + (-x.min() / s2).round()).clamp(0, levels)))
    if x.max() < 0 and x.max() > x.min():  # hi not widened: hi = max x < 0, the zero point above the top code
        s2 = (x.max() - x.min()) / levels
        z2 = (-x.min() / s2).round()
        out.insert(0, (HINT_ZP_HI_NOT_WIDENED.format(z=int(z2), top=levels, mx=float(x.max())),
                       ((x / s2).round() + z2).clamp(0, levels)))
    return out


def zeropoint_cases() -> list[tuple[str, torch.Tensor, int]]:
    cases = [(zeropoint_case(0, (6, 8), 8), 8), (zeropoint_case(1, (5, 4), 4), 4),
             (zeropoint_case(2, (40,), 3, positive=True), 3), (zeropoint_case(3, (4, 6), 8, dtype=torch.float64), 8),
             (zeropoint_case(4, (3, 8), 8, positive=True), 8), (zeropoint_case(5, (2, 3, 4), 2), 2),
             (zeropoint_overflow_case(8), 8), (zeropoint_overflow_case(4, dtype=torch.float64), 4),
             (zeropoint_case(7, (4, 5), 4, negative=True), 4), (zeropoint_case(8, (3, 6), 8, negative=True), 8),
             (torch.randn(5, 7, generator=torch.Generator().manual_seed(6), dtype=torch.float64) + 0.4, 8)]
    # the last: plain random values, so -lo / scale is no integer (a zero point left unrounded shows)
    return [(f"x of shape {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}, bits={b}", x, b) for x, b in cases]


def diagnose_zeropoint(result: Any, x: torch.Tensor, bits: int, *, what: str) -> None:
    if result is None:
        raise ExerciseNotDone(HINT_RETURNED_NONE.format(function="zeropoint_quantize"))
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise CheckFailure(HINT_ZP_TRIPLE.format(got=describe(result)))
    q = _tensor(result[0])
    numbers = []
    for value in result[1:]:
        t = torch.as_tensor(value).detach().double() if isinstance(value, (torch.Tensor, float, int, np.ndarray)) else None
        expect(t is not None and t.numel() == 1, HINT_ZP_TRIPLE.format(got=", ".join(describe(v) for v in result)))
        numbers.append(t.reshape(()))
    scale, zero = numbers
    expect(q is not None and tuple(q.shape) == tuple(x.shape),
           HINT_ZP_TRIPLE.format(got=", ".join(describe(v) for v in result)))
    want_q, want_scale, want_zero = expected_zeropoint(x, bits)
    if not x.any():
        expect(bool(torch.isfinite(scale)) and float(scale) > 0, HINT_ZP_CONSTANT.format(got=float(scale)))
    got = q.detach().double()
    levels = 2**bits - 1
    # An exact tie (x / scale = k + 1/2, only in zeropoint_overflow_case) may round either way: torch.round's
    # half to even and floor(t + 0.5)'s half up are both rounding. Accept either code there, inside the range.
    t = x.double() / want_scale
    tie = (t - t.floor()) == 0.5
    either = tie & ((got - want_q.double()).abs() == 1) & (got >= 0) & (got <= levels)
    got = torch.where(either, want_q.double(), got)
    zero_is_integer = bool(torch.isfinite(zero)) and float(zero) == round(float(zero))
    if bool(torch.isfinite(zero)) and not zero_is_integer:
        raise CheckFailure(HINT_ZP_NOT_ROUNDED.format(z=float(zero)))
    if not torch.equal(got, want_q.double()):
        for hint, wrong in zeropoint_mistakes(x, bits):
            if torch.equal(got, wrong) and not torch.equal(wrong, want_q.double()):
                if hint.startswith("your zero point is not an integer"):  # the codes of an unrounded zero point ...
                    raw = float(-x.double().min().clamp(max=0) / want_scale)  # ... with a rounded one returned
                    hint = HINT_ZP_FROM_LO.format(z=int(zero), raw=raw)
                raise CheckFailure(hint)
        raw = (x.double() / want_scale).round() + want_zero  # unclamped: uint8 wraps 256 to 0
        if (raw > levels).any() and (torch.equal(got, torch.remainder(raw, 256)) or torch.equal(got, raw)):
            i = int((raw > levels).flatten().nonzero()[0])
            wrapped = torch.equal(got, torch.remainder(raw, 256)) and raw.max() > 255
            raise CheckFailure(HINT_ZP_NO_CLAMP.format(
                got=int(raw.flatten()[i]), i=i, top=levels, zero=int(want_zero),
                t=float((x.double() / want_scale).flatten()[i]),
                wrap=f" (the uint8 cast then wrapped {int(raw.flatten()[i])} to {int(raw.flatten()[i]) % 256}: "
                     f"the value came back as its opposite)" if wrapped else ""))
    if zero_is_integer and not 0 <= float(zero) <= levels and x.max() < 0:
        raise CheckFailure(HINT_ZP_HI_NOT_WIDENED.format(z=int(zero), top=levels, mx=float(x.max())))
    if ((got < 0) | (got > levels)).any():
        i = int(((got < 0) | (got > levels)).flatten().nonzero()[0])
        raise CheckFailure(HINT_ZP_CODES.format(what=what, got=int(got.flatten()[i]), i=i, want=int(want_q.flatten()[i]))
                           + f"; codes must lie in [0, {levels}]")
        if float(zero) < 0 < float(want_zero):
            raise CheckFailure(HINT_ZP_SIGN)
    expect(not q.is_floating_point(), HINT_ZP_FLOAT_CODES.format(dtype=q.dtype))
    expect(q.dtype == torch.uint8, HINT_ZP_DTYPE.format(dtype=q.dtype))
    if not torch.equal(got, want_q.double()):
        i = int((got != want_q.double()).flatten().nonzero()[0])
        raise CheckFailure(HINT_ZP_CODES.format(what=what, got=int(got.flatten()[i]), i=i, want=int(want_q.flatten()[i])))
    if not torch.isclose(scale, want_scale, rtol=1e-5, atol=0):
        raise CheckFailure(HINT_ZP_SCALE.format(what=what, got=float(scale), want=float(want_scale)))
    if float(zero) != float(want_zero):
        if not 0 <= float(zero) <= levels:
            raise CheckFailure(HINT_ZP_ZERO.format(what=what, got=float(zero), want=int(want_zero))
                               + f"; a zero point is a code, in [0, {levels}]")
        if float(zero) == -float(want_zero):
            raise CheckFailure(HINT_ZP_SIGN)
        raise CheckFailure(HINT_ZP_ZERO.format(what=what, got=float(zero), want=int(want_zero)))


def zeropoint_dequantize_mistakes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    wrapped = (q - zero.to(torch.uint8)).double() * scale  # uint8 arithmetic wraps
    return [(HINT_ZPD_ORDER, q.double() * scale - zero), (HINT_ZPD_DIVIDE, (q.double() - zero) / scale),
            (HINT_ZPD_WRAP, wrapped), (HINT_ZPD_ADD, (q.double() + zero) * scale)]


@checker("zero-point quantization")
def check_zeropoint(zeropoint_quantize, zeropoint_dequantize) -> None:
    """Check ``zeropoint_quantize(x, bits) -> (q, scale, zero)`` and ``zeropoint_dequantize(q, scale, zero)``.

    On :func:`zeropoint_cases` (2 to 8 bits, ranges across 0, all-positive and all-negative ones, two where
    round(x / scale) + zero passes the top code before the clamp, float32 and float64) and an all-zero tensor; codes exactly, scale to 1e-5, zero point exactly; the named mistakes first.
    """
    _refuse_quant(zeropoint_quantize, "zeropoint_quantize")
    _refuse_quant(zeropoint_dequantize, "zeropoint_dequantize")
    for what, x, bits in [*zeropoint_cases(), ("an all-zero x of shape (3, 4), bits=8", torch.zeros(3, 4), 8)]:
        result = _call_quantize(zeropoint_quantize, x, bits, "zeropoint_quantize", HINT_ZP_CALL)
        diagnose_zeropoint(result, x, bits, what=what)
        q, scale, zero = expected_zeropoint(x, bits)
        got = call_learner(zeropoint_dequantize, q, scale.to(x.dtype), zero.to(torch.uint8), name="zeropoint_dequantize")
        diagnose_dequantize(got, (q.double() - zero) * scale, None, function="zeropoint_dequantize",
                            what=f"the codes of {what}", extra=zeropoint_dequantize_mistakes(q, scale, zero))
        assert torch.equal(_quant.zeropoint_quantize(x, bits)[0], q), "the checker disagrees with tfedu.quant"


# ----------------------------------------------------------------------------- 14.4 GPTQ's column loop

# The column quantizer gptq_layer is handed: one source, run here (the check, the notebook) and in the learner's
# kernel (the hidden test), so both sides round on the same grid.
QC_HELPERS = '''\
class _ColumnQuantizer:
    """quantize_column(W, j): column j of the matrix W rounded onto its grid, a (d_out,) tensor of W's dtype.

    A zero-point grid of `bits` bits per row, one for each group of `group_size` columns (None: the whole row), taken
    from the group's columns of W as they are when the group's first column is asked for (the errors pushed onto
    them included), exactly as tfedu.quant.gptq_quantize does; or, with `step`, the fixed grid of the multiples of
    step. `calls` records the columns asked for, in order; `closest` the smallest distance, in steps, of a value
    rounded from a tie (the checks use inputs where it is not tiny, so float32 and float64 answers round alike).
    """

    def __init__(self, bits=4, group_size=None, step=None):
        self.bits, self.group_size, self.step = bits, group_size, step
        self.calls, self.closest, self._group, self._grid = [], 0.5, None, None

    def __repr__(self):
        if self.step is not None:
            return "quantize_column(multiples of " + repr(self.step) + ")"
        return ("quantize_column(" + str(self.bits) + " bits, "
                + ("one grid per row" if self.group_size is None else "groups of " + str(self.group_size)) + ")")

    def _round(self, t):
        self.closest = min(self.closest, float(((t - t.floor()) - 0.5).abs().min()) if t.numel() else 0.5)
        return t.round()

    def __call__(self, W, j):
        j = int(j)
        self.calls.append(j)
        column = W[:, j].detach()
        if self.step is not None:
            return self._round(column / self.step) * self.step
        size = self.group_size or W.shape[1]
        group = j // size
        if j % size == 0 or group != self._group:  # a group's first column: its grid from the columns as they are now
            units = W[:, group * size : (group + 1) * size].detach().float()
            levels = 2**self.bits - 1
            lo, hi = units.amin(dim=1).clamp(max=0), units.amax(dim=1).clamp(min=0)
            scale = torch.where(hi > lo, (hi - lo) / levels, torch.ones_like(hi))
            self._group, self._grid = group, (scale, (-lo / scale).round().clamp(0, levels))
        scale, zero = (t.to(column.dtype) for t in self._grid)
        q = (self._round(column / scale) + zero).clamp(0, 2**self.bits - 1)
        return (q - zero) * scale


'''
QC_CLEANUP = "del _ColumnQuantizer\n"

_qc_helpers: dict[str, Any] = {"torch": torch, "__name__": "tfedu_column_quantizer"}
exec(compile(QC_HELPERS, "<column quantizer>", "exec"), _qc_helpers)
ColumnQuantizer = _qc_helpers["_ColumnQuantizer"]
ColumnQuantizer.__name__ = ColumnQuantizer.__qualname__ = "ColumnQuantizer"

HINT_GQ_CALL = ("gptq_layer(W, H, quantize_column, damp): W the weights (d_out, d_in), H the Hessian (d_in, d_in), "
                "quantize_column a function of (W, j) that gives column j of W rounded onto its grid, damp a float; "
                "return the quantized weights, a tensor shaped like W")
HINT_GQ_KIND = "gptq_layer should return the quantized weights, a float tensor of W's shape {want}, got {got}"
HINT_GQ_MUTATED = ("your gptq_layer changed the caller's `{name}` in place: the caller's weights and Hessian must stay "
                   "as they were, so work on a copy of W and build the damped Hessian as a new tensor")
HINT_GQ_SHORTCUT = ("your gptq_layer uses tfedu's own GPTQ ({name}): the column loop is the exercise, so build it "
                    "from torch operations (a Cholesky factorisation and an inverse are allowed)")
HINT_GQ_NAN = ("your quantized weights for {what} contain NaN or inf: is the Hessian damped before it is inverted "
               "and factorised? (A Hessian from fewer inputs than columns is singular without it)")
HINT_GQ_SINGULAR = (
    "your gptq_layer raised {err} on {what}: that Hessian comes from {n} inputs for {d} columns, so its rank is at "
    "most {n} and it is singular, with no inverse and no Cholesky factor. That is what the damping is for: add damp "
    "times the mean of H's diagonal to every diagonal entry, then invert and factorise"
)
HINT_GQ_NO_CALLS = (
    "your gptq_layer never called the quantize_column it is given: round every column with it, passing your working "
    "copy of W and the column's index, so that each column lands on the same grid as the reference's"
)
HINT_GQ_ORDER = (
    "your gptq_layer asked quantize_column for the columns {calls} ({what}): GPTQ quantizes each column once, left "
    "to right, 0, 1, ..., {last}, each asked for with the whole working copy of W and its own index"
)
HINT_GQ_REVERSE = (
    "your gptq_layer took the columns right to left ({calls}): GPTQ goes left to right, and row j of U holds the "
    "update of the columns to the right of j, those not quantized yet. (Another fixed order works too, with the "
    "factor of H's rows and columns put in that order; this exercise, like the reference, goes left to right)"
)
HINT_GQ_RTN = (
    "your weights are round-to-nearest ({what}): every column was rounded as it was, and no error reached the "
    "columns to its right. After quantizing column j, its error divided by U_jj, times row j of U, is subtracted "
    "from the columns right of j. If your loop subtracts something, look at the factor: a Cholesky routine returns "
    "the lower factor unless asked for the upper one, and row j of a lower-triangular factor is zero right of the "
    "diagonal"
)
HINT_GQ_NOT_DIVIDED = (
    "your update spreads the error w_j - q_j itself ({what}): divide it by U_jj, the factor's diagonal entry, first. "
    "OBQ divides by the inverse Hessian's diagonal entry, U_jj^2, and multiplies by its row, U_jj times U's row: one "
    "U_jj is left over"
)
HINT_GQ_SQUARE = (
    "your update divides the error by U_jj twice, by U_jj^2 ({what}): that is OBQ's divisor, the inverse Hessian's "
    "diagonal entry, which goes with the inverse Hessian's row, U_jj times U's row. With U's row, divide once"
)
HINT_GQ_CHOL_H = (
    "your factor is the Cholesky factor of the (damped) H itself ({what}): GPTQ needs the upper Cholesky factor U "
    "of the inverse, H^-1 = U^T U. Invert the damped H, then factorise the inverse"
)
HINT_GQ_INV_FACTOR = (
    "your factor is the inverse of H's upper Cholesky factor ({what}): it is upper triangular and its product with "
    "its transpose, in one order, is H^-1, but not U^T U, so it is not the Cholesky factor of H^-1. Invert the "
    "damped H, then take the upper Cholesky factor of that inverse"
)
HINT_GQ_CURRENT = (
    "your quantized columns are off their grid ({what}): after column j was quantized and stored, the update was "
    "applied to column j too (its own entry of U's row, U_jj, turns q_j into 2 q_j - w_j). A quantized column is "
    "final: spread the error only over the columns after j"
)
HINT_GQ_EARLIER = (
    "columns you had already quantized changed afterwards ({what}): the error of column j went to the columns left "
    "of it (the factor's column j, not its row j?), and none to the right. A quantized column is final; the update "
    "goes to the columns right of j, with row j of U"
)
HINT_GQ_SIGN = (
    "your update has the wrong sign ({what}): it adds the scaled error times U's row to the later columns, which "
    "doubles the error they should absorb. Subtract it: the remaining columns move against the error just made"
)
HINT_GQ_NO_DAMP = (
    "your result is GPTQ without damping ({what}): add damp times the mean of H's diagonal to H's diagonal before "
    "inverting it (damp is an argument; 0.01 is the paper's 1%). Without it a Hessian from few inputs is singular "
    "or nearly so, and its inverse is dominated by rounding"
)
HINT_GQ_DAMP_UNSCALED = (
    "your damping adds damp itself to H's diagonal ({what}): it is relative, damp times the mean of H's diagonal, so "
    "that it means the same at every scale of H (the course's H is 2 X X^T / n, a mean; GPTQ's code uses a sum)"
)
HINT_GQ_STATIC_ROW = (
    "you spread the errors with rows of the full inverse H^-1, computed once ({what}): that is OBQ's update for the "
    "first column only. Once a column is fixed, the inverse Hessian of the columns left changes; OBQ recomputes it, "
    "and the trailing block of U factors the recomputed one at every step (the derivation above). So use row j of "
    "the upper Cholesky factor U of H^-1, the error divided by U_jj"
)
HINT_GQ_DIFFERS = (
    "gptq_layer({what}) agrees with the reference on columns 0 to {before} and differs from column {j} on (largest "
    "difference {diff:.3g}); the reference: quantize column j with quantize_column on the working copy of W, divide "
    "its error by U_jj, subtract the error times U's row j from the columns right of j (U the upper Cholesky factor "
    "of the inverse of the damped H)"
)
HINT_GQ_DIFFERS_FIRST = (
    "gptq_layer({what}) differs from the reference from column 0 on (largest difference {diff:.3g}): the first "
    "column should be quantize_column's rounding of W's first column, unchanged"
)

# The known mistakes, in the order they are tried (the lower factor's row j is zero right of the diagonal: its
# result is round-to-nearest's, and HINT_GQ_RTN names both).
GQ_MISTAKES = ("no propagation", "not divided", "divided by the square", "cholesky of H", "inverse of H's factor",
               "current again", "factor's column", "sign flipped", "no damping", "damping not scaled",
               "static inverse row")
GQ_HINTS = {"no propagation": HINT_GQ_RTN, "not divided": HINT_GQ_NOT_DIVIDED, "divided by the square": HINT_GQ_SQUARE,
            "cholesky of H": HINT_GQ_CHOL_H, "inverse of H's factor": HINT_GQ_INV_FACTOR,
            "current again": HINT_GQ_CURRENT, "factor's column": HINT_GQ_EARLIER, "sign flipped": HINT_GQ_SIGN,
            "no damping": HINT_GQ_NO_DAMP, "damping not scaled": HINT_GQ_DAMP_UNSCALED,
            "static inverse row": HINT_GQ_STATIC_ROW}
GQ_FORBIDDEN = (*FORBIDDEN, "tfedu.checks.nb14_quantization")
# Beyond the elementary operations: what inverting and factorising a symmetric matrix takes.
LINALG = frozenset({
    "torch.linalg.cholesky", "torch.linalg.cholesky_ex", "torch.cholesky", "torch.cholesky_inverse",
    "torch.cholesky_solve", "torch.linalg.inv", "torch.linalg.inv_ex", "torch.inverse", "torch.linalg.solve",
    "torch.linalg.solve_triangular", "torch.triangular_solve", "torch.linalg.pinv", "torch.linalg.eigh",
    "numpy.linalg.cholesky", "numpy.linalg.inv", "numpy.linalg.solve", "numpy.linalg.pinv", "numpy.linalg.eigh",
})


def gptq_variant(W: torch.Tensor, H: torch.Tensor, quantize_column: Any, damp: float = 0.01,
                 mistake: str = "") -> torch.Tensor:
    """GPTQ's column loop on one layer, right or with one named ``mistake`` (:data:`GQ_MISTAKES`, or "lower factor",
    "reverse"): the quantized weights, W's shape, in W's dtype (H is cast to it, as tfedu.quant does)."""
    W = W.detach().clone()
    d_in = W.shape[1]
    H = H.detach().to(W.dtype)
    eye = torch.eye(d_in, dtype=W.dtype)
    if mistake == "no damping":
        H_damped = H
    elif mistake == "damping not scaled":
        H_damped = H + damp * eye
    else:
        H_damped = H + damp * H.diagonal().mean() * eye
    H_inv = torch.cholesky_inverse(torch.linalg.cholesky(H_damped))
    if mistake == "cholesky of H":
        U = torch.linalg.cholesky(H_damped, upper=True)
    elif mistake == "inverse of H's factor":
        U = torch.linalg.inv(torch.linalg.cholesky(H_damped, upper=True))
    else:
        U = torch.linalg.cholesky(H_inv, upper=True)
    if mistake == "lower factor":
        U = U.T
    Q = torch.zeros_like(W)
    in_place = mistake in ("current again", "factor's column")  # these keep the quantized columns in W itself
    for j in reversed(range(d_in)) if mistake == "reverse" else range(d_in):
        q = quantize_column(W, j)
        Q[:, j] = q
        if mistake == "no propagation":
            continue
        err = W[:, j] - q
        if mistake == "static inverse row":
            W[:, j + 1 :] -= torch.outer(err / H_inv[j, j], H_inv[j, j + 1 :])
            continue
        if mistake != "not divided":
            err = err / U[j, j]
        if mistake == "divided by the square":
            err = err / U[j, j]
        if in_place:
            W[:, j] = q
            if mistake == "current again":
                W[:, j:] -= torch.outer(err, U[j, j:])
            else:
                W -= torch.outer(err, U[:, j])
        elif mistake == "sign flipped":
            W[:, j + 1 :] += torch.outer(err, U[j, j + 1 :])
        else:
            W[:, j + 1 :] -= torch.outer(err, U[j, j + 1 :])
    return W if in_place else Q


def reference_gptq_layer(W: torch.Tensor, H: torch.Tensor, quantize_column: Any, damp: float = 0.01) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022, Algorithm 1) on one layer, the plain column loop: the quantized weights.

    ``W`` (d_out, d_in), ``H`` (d_in, d_in), ``quantize_column(W, j)`` column j of W on its grid (a
    :class:`ColumnQuantizer`); damping ``damp * mean(diag H)``. Equal to ``tfedu.quant.gptq_quantize`` (which adds
    the lazy block updates) with the same grid, when no column of H is zero (tests/test_checks_nb14.py). Built by
    hand in notebooks/14_quantization.ipynb (exercise 14.4).

    >>> W, H = gptq_case(0, 3, 8, 32)
    >>> Q = reference_gptq_layer(W, H, ColumnQuantizer(bits=3))
    >>> bool(torch.equal(Q, _quant.gptq_quantize(W, H, 3).weight))
    True
    """
    return gptq_variant(W, H, quantize_column, damp)


def gptq_case(seed: int, d_out: int, d_in: int, n: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights W (d_out, d_in) and H = 2 X X^T / n from n inputs X whose features are correlated (mixed by a random
    matrix), as a layer's are; with n < d_in, H is singular."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    mix = torch.eye(d_in, dtype=torch.float64) + torch.randn(d_in, d_in, generator=g, dtype=torch.float64) / d_in**0.5
    X = mix @ torch.randn(d_in, n, generator=g, dtype=torch.float64)
    return W.to(dtype), (2 * X @ X.T / n).to(dtype)


def _as_weights(got: Any, W: torch.Tensor) -> torch.Tensor:
    if got is None:
        raise ExerciseNotDone(HINT_RETURNED_NONE.format(function="gptq_layer"))
    if isinstance(got, np.ndarray):
        got = torch.from_numpy(got)
    if not isinstance(got, torch.Tensor) or not got.is_floating_point() or tuple(got.shape) != tuple(W.shape):
        raise CheckFailure(HINT_GQ_KIND.format(want=tuple(W.shape), got=describe(got)))
    return got.detach().cpu().double()


def _gq_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    return bool(torch.isfinite(a).all()) and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6 * scale)


def gq_mistakes(W: torch.Tensor, H: torch.Tensor, quantizer: dict, damp: float) -> list[tuple[str, torch.Tensor]]:
    """(name, weights) of each known mistake (:data:`GQ_MISTAKES`) whose result differs from the reference's on
    this input, in order; one that raises (no damping on a singular H) is left out."""
    want = gptq_variant(W, H, ColumnQuantizer(**quantizer), damp)
    found = []
    for mistake in GQ_MISTAKES:
        try:
            wrong = gptq_variant(W, H, ColumnQuantizer(**quantizer), damp, mistake)
        except (RuntimeError, torch.linalg.LinAlgError):
            continue
        if not _gq_close(wrong, want):
            found.append((mistake, wrong.double()))
    return found


def _calls_problem(calls: list[int], d_in: int) -> str | None:
    """What is wrong with the order in which quantize_column was asked for the columns, or None."""
    if not calls:
        return HINT_GQ_NO_CALLS
    shown = ", ".join(map(str, calls[:6])) + (", ..." if len(calls) > 6 else "")
    if calls[0] == d_in - 1 and len(calls) > 1 and all(b <= a for a, b in zip(calls, calls[1:])):
        return HINT_GQ_REVERSE.format(calls=shown)
    if sorted(set(calls)) != list(range(d_in)) or any(b < a for a, b in zip(calls, calls[1:])):
        what = ("some columns never" if len(set(calls)) < d_in else "not in order")
        return HINT_GQ_ORDER.format(calls=shown, what=what, last=d_in - 1)
    return None


def diagnose_gptq(got: Any, calls: list[int], W: torch.Tensor, H: torch.Tensor, quantizer: dict, damp: float, *,
                  what: str) -> None:
    """Raise CheckFailure naming what is wrong with ``got``, the learner's ``gptq_layer`` on this input (``calls``:
    the columns its quantize_column was asked for); shared with the probe."""
    value = _as_weights(got, W)
    want = gptq_variant(W, H, ColumnQuantizer(**quantizer), damp).double()
    if _gq_close(value, want):
        return
    problem = _calls_problem(calls, W.shape[1])
    if problem:
        raise CheckFailure(problem)
    expect(bool(torch.isfinite(value).all()), HINT_GQ_NAN.format(what=what))
    for mistake, wrong in gq_mistakes(W, H, quantizer, damp):
        if _gq_close(value, wrong):
            raise CheckFailure(GQ_HINTS[mistake].format(what=what))
    diff = (value - want).abs()
    scale = max(1.0, float(want.abs().max()))
    bad = (diff > 1e-5 * want.abs() + 1e-6 * scale).any(dim=0).nonzero()
    j = int(bad[0]) if len(bad) else 0
    if j == 0:
        raise CheckFailure(HINT_GQ_DIFFERS_FIRST.format(what=what, diff=float(diff.max())))
    raise CheckFailure(HINT_GQ_DIFFERS.format(what=what, before=j - 1, j=j, diff=float(diff.max())))


def gq_text(W: torch.Tensor, n: int, quantizer: dict, damp: float) -> str:
    """The words a hint uses for one input."""
    grid = repr(ColumnQuantizer(**quantizer))
    return (f"W of shape {tuple(W.shape)} {str(W.dtype).removeprefix('torch.')}, H from {n} inputs, {grid}, "
            f"damp={damp}")


# (seed, d_out, d_in, inputs n, the quantizer, damp, dtype): groups of 8 at 3 bits; a fixed grid with more damping;
# one grid per row at 4 bits in float32; then a singular H (fewer inputs than columns). Chosen so that every named
# mistake gives its own result on the first case where it shows, and no rounding is near a tie
# (tests/test_checks_nb14.py checks both).
GQ_CASES = (
    (0, 6, 16, 64, {"bits": 3, "group_size": 8}, 0.01, torch.float64),
    (1, 5, 12, 48, {"step": 0.5}, 0.1, torch.float64),
    (2, 4, 20, 80, {"bits": 4}, 0.05, torch.float32),
    (3, 5, 16, 6, {"bits": 3}, 0.01, torch.float64),
)


def _refuse_gptq(fn: Any) -> None:
    if from_modules(fn, GQ_FORBIDDEN):
        raise CheckFailure(HINT_GQ_SHORTCUT.format(name=f"you passed {getattr(fn, '__name__', 'an object')}"))
    used = globals_from_modules(fn, GQ_FORBIDDEN)
    expect(not used, HINT_GQ_SHORTCUT.format(name=", ".join(used)))


def _singular_guard(fn: Any, what: str, n: int, d_in: int) -> Any:
    """``fn`` with a failed factorisation of a singular H turned into the damping hint."""
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except (torch.linalg.LinAlgError, np.linalg.LinAlgError) as err:
            if n >= d_in:
                raise
            raise CheckFailure(HINT_GQ_SINGULAR.format(err=type(err).__name__, what=what, n=n, d=d_in)) from None
    return call


@checker("GPTQ's column loop")
def check_gptq_layer(gptq_layer) -> None:
    """Check a learner's ``gptq_layer(W, H, quantize_column, damp) -> Q``.

    On :data:`GQ_CASES`, against :func:`reference_gptq_layer` (itself equal to ``tfedu.quant.gptq_quantize``): the
    quantized weights (rtol 1e-5), the columns asked of quantize_column (each once, left to right), W and H left as
    they were; the known mistakes (:data:`GQ_MISTAKES`) are named, and a failed factorisation of the singular H
    names the damping. tfedu.quant and this module are refused.
    """
    _refuse_gptq(gptq_layer)
    for seed, d_out, d_in, n, quantizer, damp, dtype in GQ_CASES:
        W, H = gptq_case(seed, d_out, d_in, n, dtype)
        what = gq_text(W, n, quantizer, damp)
        column = ColumnQuantizer(**quantizer)
        with watch_calls((_quant, "gptq_quantize")) as called:
            got = call_on_copies(_singular_guard(gptq_layer, what, n, d_in),
                                 {"W": W, "H": H, "quantize_column": column, "damp": damp}, name="gptq_layer",
                                 mutated_hint=HINT_GQ_MUTATED, error_hint=HINT_GQ_CALL)
        expect(not called, HINT_GQ_SHORTCUT.format(name="tfedu.quant.gptq_quantize"))
        diagnose_gptq(got, column.calls, W, H, quantizer, damp, what=what)


# ----------------------------------------------------------------------------- probes

QUANT_PROBE_RUN = HELPERS + """\
_export = lambda _v: (_v.detach().cpu().double().numpy() if isinstance(_v, torch.Tensor) and _v.is_floating_point()
                      else _v.detach().cpu().numpy() if isinstance(_v, torch.Tensor) else _v)
_results, _deqs = [], []
_qf, _df = globals().get('QUANTIZE'), globals().get('DEQUANTIZE')  # a pair: each judged even if the other is missing
for _c in inputs['cases']:
    _x = torch.from_numpy(_c['x'])
    _r = _call(_qf, _x, _c['bits']) if _qf is not None else 'undefined'
    _results.append([_export(_v) for _v in _r] + [str(_v.dtype).replace('torch.', '') if isinstance(_v, torch.Tensor) else type(_v).__name__ for _v in _r]
                    if isinstance(_r, (tuple, list)) else _r if _r == 'undefined' else _kind(_r))
    _args = [torch.from_numpy(_a) if isinstance(_a, np.ndarray) else _a for _a in _c['deq_args']]
    _d = _call(_df, *_args) if _df is not None else 'undefined'
    _deqs.append([_export(_d), str(_d.dtype).replace('torch.', '')] if isinstance(_d, torch.Tensor)
                 else _d if _d == 'undefined' else _kind(_d))
outputs = {'results': _results, 'deqs': _deqs, 'mutated': _MUTATED}
del _export, _results, _deqs, _c, _x, _r, _args, _d, _qf, _df
""" + CLEANUP


_NP_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
              "float32": torch.float32, "float64": torch.float64, "float16": torch.float16}


def _restore(values: Any, dtype: Any) -> Any:
    if isinstance(values, np.ndarray):
        return torch.from_numpy(np.array(values)).to(_NP_DTYPES.get(str(dtype), torch.float64))
    return values


def _probe_inputs(rng: np.random.Generator, case_fn, expected_fn, positive_kw: str) -> dict:
    cases = []
    for i, bits in enumerate((8, int(rng.integers(2, 8)), int(rng.integers(3, 9)), 8)):
        shape = (int(rng.integers(2, 7)), int(rng.integers(3, 9)))
        dtype = torch.float64 if rng.random() < 0.3 else torch.float32
        x = case_fn(int(rng.integers(0, 2**31)), shape, bits, dtype=dtype, **{positive_kw: bool(i == 1)})
        codes = expected_fn(x, bits)
        args = [codes[0].numpy(), np.asarray(codes[1].to(dtype).numpy())] + (
            [np.asarray(codes[2].to(torch.uint8).numpy())] if len(codes) == 3 else [])
        cases.append({"x": x.numpy(), "bits": bits, "deq_args": args})
    zero = np.zeros((2, 3), dtype=np.float32)
    codes = expected_fn(torch.from_numpy(zero), 8)
    cases.append({"x": zero, "bits": 8, "deq_args": [codes[0].numpy(), np.asarray(codes[1].float().numpy())] + (
        [np.asarray(codes[2].to(torch.uint8).numpy())] if len(codes) == 3 else [])})
    return {"cases": cases}


def _case_entry(x: torch.Tensor, bits: int) -> dict:
    q, scale, zero = expected_zeropoint(x, bits)
    return {"x": x.numpy(), "bits": bits,
            "deq_args": [q.numpy(), np.asarray(scale.to(x.dtype).numpy()), np.asarray(zero.to(torch.uint8).numpy())]}


def _zeropoint_probe_inputs(rng: np.random.Generator) -> dict:
    """:func:`_probe_inputs` (one all-positive case) plus an all-negative case and the two overflow cases."""
    inputs = _probe_inputs(rng, zeropoint_case, expected_zeropoint, "positive")
    bits = int(rng.integers(2, 9))
    negative = zeropoint_case(int(rng.integers(0, 2**31)), (int(rng.integers(2, 6)), int(rng.integers(3, 8))), bits,
                              negative=True)
    inputs["cases"][1:1] = [_case_entry(negative, bits), _case_entry(zeropoint_overflow_case(8), 8),
                            _case_entry(zeropoint_overflow_case(4), 4)]
    return inputs


def _compare(outputs: dict, expected: dict, *, quantize: str, dequantize: str, diagnose, deq_want, deq_mistakes) -> str | None:
    if not isinstance(outputs, dict):
        return "the hidden test's outputs should be a dict"
    if outputs.get("mutated"):
        return HINT_MUTATED.format(function=quantize)
    cases = expected["cases"]
    results, deqs = outputs.get("results"), outputs.get("deqs")
    if not (isinstance(results, list) and isinstance(deqs, list) and len(results) == len(deqs) == len(cases)):
        return f"{quantize}'s hidden test did not run every case"
    missing = []
    for i, (got, deq, case) in enumerate(zip(results, deqs, cases)):
        x = torch.from_numpy(np.asarray(case["x"]))
        what = f"hidden test {i + 1}: x of shape {tuple(x.shape)}, bits={case['bits']}"
        try:
            if got == "undefined":
                missing.append(quantize)
            else:
                if isinstance(got, list):
                    n = len(got) // 2
                    got = tuple(_restore(v, d) for v, d in zip(got[:n], got[n:]))
                diagnose(None if got == "NoneType" else got, x, case["bits"], what=what)
            if deq == "undefined":
                missing.append(dequantize)
            else:
                args = [torch.from_numpy(np.array(a)) for a in case["deq_args"]]
                value = _restore(deq[0], deq[1]) if isinstance(deq, list) else None if deq == "NoneType" else deq
                diagnose_dequantize(value, deq_want(*args), None, function=dequantize, what=f"the codes of {what}",
                                    extra=deq_mistakes(*args))
        except CheckFailure as failure:
            return str(failure)
    if missing:
        return f"{missing[0]} is not defined: run the exercise's cell (both functions are part of it)"
    return None


def _absmax_deq_mistakes(q: torch.Tensor, scale: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(HINT_DEQ_DIVIDE, q.double() / scale.double())]


# gptq_layer: fresh W and inputs X, three cases (a zero-point grid per group of 8 at 3 or 4 bits, float64; a fixed
# grid in float32; a singular H, from fewer inputs than columns, one grid per row), drawn again until every known
# mistake shows apart and no rounding of the reference's is within 1e-4 of a step of a tie; the columns asked of
# quantize_column come back too (the order names a loop taken backwards).
GQ_PROBE_RUN = HELPERS + QC_HELPERS + """\
_results, _calls, _errors = [], [], []
for _c in inputs['cases']:
    _q = _ColumnQuantizer(**_c['quantizer'])
    try:
        _r = _call(gptq_layer, torch.from_numpy(_c['W']), torch.from_numpy(_c['H']), _q, _c['damp'])
        _errors.append(None)
    except Exception as _e:
        _r = None
        _errors.append(type(_e).__name__ + ': ' + str(_e)[:200])
    if isinstance(_r, torch.Tensor) and _r.is_floating_point():
        _results.append(_r.detach().cpu().double().numpy())
    elif isinstance(_r, torch.Tensor):
        _results.append('a tensor of ' + str(_r.dtype).replace('torch.', ''))
    else:
        _results.append(None if _r is None else _kind(_r))
    _calls.append([int(_j) for _j in _q.calls])
outputs = {'results': _results, 'calls': _calls, 'errors': _errors, 'mutated': _MUTATED}
del _results, _calls, _errors, _c, _q, _r
""" + QC_CLEANUP + CLEANUP


def gq_mistakes_apart(cases: list[tuple[torch.Tensor, torch.Tensor, dict, float]]) -> bool:
    """True when every known mistake is named by its own hint: on the first case where it changes the result, no
    mistake tried before it gives the same result."""
    named: set[str] = set()
    for W, H, quantizer, damp in cases:
        found = gq_mistakes(W, H, quantizer, damp)
        for i, (name, wrong) in enumerate(found):
            if name in named:
                continue
            named.add(name)
            if any(_gq_close(wrong, earlier) for _, earlier in found[:i]):
                return False
    return named == set(GQ_MISTAKES)


def gq_closest(W: torch.Tensor, H: torch.Tensor, quantizer: dict, damp: float) -> float:
    """The smallest distance from a tie, in steps, of a value the reference rounds on this input."""
    column = ColumnQuantizer(**quantizer)
    gptq_variant(W, H, column, damp)
    return column.closest


def _gq_probe_inputs(rng: np.random.Generator) -> dict:
    for _ in range(50):
        d_in = int(rng.choice([16, 24]))
        specs = [(int(rng.integers(4, 8)), d_in, 4 * d_in, {"bits": int(rng.integers(3, 5)), "group_size": 8}, 0.01,
                  torch.float64),
                 (int(rng.integers(3, 7)), int(rng.integers(10, 17)), 40, {"step": float(rng.choice([0.25, 0.5]))},
                  float(rng.choice([0.05, 0.1])), torch.float32),
                 (int(rng.integers(3, 7)), 16, int(rng.integers(5, 10)), {"bits": 3}, 0.01, torch.float64)]
        drawn, cases = [], []
        for d_out, d, n, quantizer, damp, dtype in specs:
            W, H = gptq_case(int(rng.integers(0, 2**31)), d_out, d, n, dtype)
            drawn.append((W, H, quantizer, damp))
            cases.append({"W": W.numpy(), "H": H.numpy(), "n": n, "quantizer": quantizer, "damp": damp})
        if all(gq_closest(*case) > 1e-4 for case in drawn) and gq_mistakes_apart(drawn):
            return {"cases": cases}
    raise RuntimeError("no gptq_layer inputs that tell every mistake apart in 50 draws")


def _compare_gptq(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict):
        return "the hidden test's outputs should be a dict"
    mutated = outputs.get("mutated") or []
    if mutated:
        return HINT_GQ_MUTATED.format(name="H" if 0 not in mutated else "W")
    cases = expected["cases"]
    results, calls, errors = (outputs.get(name) for name in ("results", "calls", "errors"))
    if not all(isinstance(v, list) and len(v) == len(cases) for v in (results, calls, errors)):
        return "gptq_layer's hidden test did not run every case"
    for i, (got, asked, error, c) in enumerate(zip(results, calls, errors, cases)):
        W, H = torch.from_numpy(np.asarray(c["W"])), torch.from_numpy(np.asarray(c["H"]))
        what = f"hidden test {i + 1}: {gq_text(W, c['n'], c['quantizer'], c['damp'])}"
        if error:
            if error.startswith("NotImplementedError"):
                return HINT_RETURNED_NONE.format(function="gptq_layer")
            if "LinAlgError" in error.split(":")[0] and c["n"] < W.shape[1]:
                return HINT_GQ_SINGULAR.format(err=error.split(":")[0], what=what, n=c["n"], d=W.shape[1])
            return f"gptq_layer raised {error} for {what} ({HINT_GQ_CALL})"
        try:
            diagnose_gptq(torch.from_numpy(np.asarray(got)) if isinstance(got, np.ndarray) else got, list(asked), W,
                          H, c["quantizer"], c["damp"], what=what)
        except CheckFailure as failure:
            return str(failure)
    return None


PROBES = {
    "check_float_fields": Probe(
        exercise="ex_float_fields",
        make_inputs=_float_probe_inputs,
        run=FF_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_float_fields,
        builds=ELEMENTARY | frozenset({"torch.frexp", "numpy.frexp", "torch.ldexp", "numpy.ldexp"})),
    "check_absmax": Probe(
        exercise="ex_absmax",
        make_inputs=lambda rng: _probe_inputs(rng, absmax_case, expected_absmax, "negative_max"),
        run=QUANT_PROBE_RUN.replace("DEQUANTIZE", "absmax_dequantize").replace("QUANTIZE", "absmax_quantize"),
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=lambda out, exp: _compare(out, exp, quantize="absmax_quantize", dequantize="absmax_dequantize",
                                          diagnose=diagnose_absmax, deq_want=lambda q, s: q.double() * s.double(),
                                          deq_mistakes=_absmax_deq_mistakes),
        forbidden=FORBIDDEN),
    "check_zeropoint": Probe(
        exercise="ex_zeropoint",
        make_inputs=_zeropoint_probe_inputs,
        run=QUANT_PROBE_RUN.replace("DEQUANTIZE", "zeropoint_dequantize").replace("QUANTIZE", "zeropoint_quantize"),
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=lambda out, exp: _compare(out, exp, quantize="zeropoint_quantize", dequantize="zeropoint_dequantize",
                                          diagnose=diagnose_zeropoint,
                                          deq_want=lambda q, s, z: (q.double() - z.double()) * s.double(),
                                          deq_mistakes=lambda q, s, z: zeropoint_dequantize_mistakes(q, s.double(), z.double())),
        forbidden=FORBIDDEN),
    "check_gptq_layer": Probe(
        exercise="ex_gptq_layer",
        make_inputs=_gq_probe_inputs,
        run=GQ_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_gptq,
        forbidden=GQ_FORBIDDEN,
        builds=ELEMENTARY | LINALG),
}


HINTS = {
    "ex_float_fields": Hints(
        number="14.1",
        check="check_float_fields",
        idea=(
            "A float is a sign, a power of two and a fraction: |x| lies in one binade, from 2^k up to 2^(k+1), and "
            "inside it the format has 2^M equally spaced numbers, a step of 2^(k - M) apart. The exponent field "
            "stores k plus the bias; the mantissa field stores how many steps |x| is above 2^k, rounded to the "
            "nearest, a tie going to the even count. Rounding can reach 2^(k+1) itself: then the exponent goes up "
            "by one and the mantissa is 0. Below the smallest normal number, 2^(1 - bias), the spacing stays that "
            "of the smallest binade and nothing is implicit: exponent field 0, the mantissa counts steps from 0."
        ),
        approach=(
            "Sign: 1 when the sign bit of x is set, which is also true of -0.0. Work with |x| from then on. Find k, "
            "the exponent of the power of two at or below |x| (the standard library splits a float into a fraction "
            "and a power of two exactly); never let k go below 1 - bias. Divide |x| by the step of that binade, "
            "2^(k - M), and round to the nearest integer, ties to even: a count from 2^M to 2^(M+1) for a normal "
            "number, below 2^M for a subnormal. If the count is 2^(M+1), halve it and add one to k. A count below "
            "2^M gives exponent field 0 and mantissa field the count; otherwise the exponent field is k plus the "
            "bias and the mantissa field the count less 2^M. Return three ints."
        ),
        skeleton=(
            "def float_fields(x, exponent_bits, mantissa_bits):\n"
            "    bias = ____\n"
            "    sign = ____  # 1 for negative numbers and for -0.0\n"
            "    fraction, power = ____  # |x| = fraction * 2**power, fraction in [0.5, 1)\n"
            "    k = max(____, ____)  # the binade's exponent; subnormals use the smallest normal one\n"
            "    count = round(____)  # |x| in steps of 2**(k - mantissa_bits); round() breaks ties to even\n"
            "    if count == ____:  # rounded up to the next power of two\n"
            "        count, k = ____, ____\n"
            "    if count < 2**mantissa_bits:\n"
            "        return ____  # subnormal or zero\n"
            "    return ____\n"
        ),
    ),
    "ex_absmax": Hints(
        number="14.2",
        check="check_absmax",
        idea=(
            "Absmax maps the tensor's largest magnitude to the top code, qmax = 2^(b-1) - 1, and every value to "
            "the nearest multiple of one step, the scale; the codes are small signed integers from -qmax to qmax, "
            "symmetric around 0. Dequantizing undoes the division with a multiplication, and each value comes back "
            "within half a step. The usual slips: rounding before dividing by the scale (small weights all round "
            "to 0), a scale from the largest value instead of the largest magnitude, an integer cast that "
            "truncates instead of rounding, and a tensor of zeros, whose scale would be 0."
        ),
        approach=(
            "Quantize: qmax from bits; the largest magnitude of x over the whole tensor, a 0-d tensor; the scale is "
            "that magnitude divided by qmax, or 1 when it is 0. Divide x by the scale, round to the nearest "
            "integer, clamp to [-qmax, qmax], and only then cast to torch.int8; return the codes, shaped like x, and "
            "the scale. Dequantize: convert the int8 codes to the scale's float dtype, then multiply by the scale. "
            "Neither function writes into its input."
        ),
        skeleton=(
            "def absmax_quantize(x, bits):\n"
            "    qmax = ____  # the top code: 127 for 8 bits, 7 for 4\n"
            "    amax = ____  # the largest magnitude, a 0-d tensor\n"
            "    scale = ____ if amax > 0 else torch.ones((), dtype=x.dtype)\n"
            "    q = (x / scale).____().clamp(____, ____).to(____)  # the same shape as x\n"
            "    return q, scale\n"
            "\n"
            "\n"
            "def absmax_dequantize(q, scale):\n"
            "    return ____  # floats: codes times the scale\n"
        ),
    ),
    "ex_zeropoint": Hints(
        number="14.3",
        check="check_zeropoint",
        idea=(
            "Zero-point quantization maps the range [lo, hi] onto all 2^b unsigned codes, 0 to 2^b - 1, and stores "
            "the code that 0.0 gets, the zero point. The range is widened to hold 0, and the zero point is rounded "
            "to an integer, so that 0.0 comes back exactly (padding, masked positions and ReLU outputs stay exact "
            "zeros). Dequantizing subtracts the zero point from the codes, then multiplies by the scale. The usual "
            "slips: the zero point's sign, a missing clamp (a code one past the top wraps around in uint8), and "
            "subtracting in uint8 arithmetic, which wraps below 0."
        ),
        approach=(
            "Quantize: there are 2^b - 1 steps from the first code to the last. lo is the smaller of min x and 0, "
            "hi the larger of max x and 0 (0-d tensors). The scale is hi - lo divided by the number of steps, or 1 "
            "when hi equals lo. The zero point is -lo / scale, rounded. The codes are x / scale rounded, plus the "
            "zero point, clamped to [0, 2^b - 1], then cast to torch.uint8. Return the codes, the scale and the "
            "zero point. Dequantize: convert the codes to the scale's float dtype before anything else, subtract "
            "the zero point, multiply by the scale."
        ),
        skeleton=(
            "def zeropoint_quantize(x, bits):\n"
            "    levels = ____  # the number of steps between the first code and the last\n"
            "    lo, hi = ____, ____  # the range, widened to hold 0\n"
            "    scale = ____ if hi > lo else torch.ones((), dtype=x.dtype)\n"
            "    zero = ____  # the code of 0.0, an integer\n"
            "    q = ____  # round, shift by the zero point, clamp, cast to uint8\n"
            "    return q, scale, zero\n"
            "\n"
            "\n"
            "def zeropoint_dequantize(q, scale, zero):\n"
            "    return ____  # in float arithmetic: uint8 wraps below 0\n"
        ),
    ),    "ex_gptq_layer": Hints(
        number="14.4",
        check="check_gptq_layer",
        idea=(
            "GPTQ rounds one column at a time, left to right, and after each one it moves the columns not rounded "
            "yet, so that the layer's output on the calibration inputs changes as little as possible. OBQ's best "
            "move for them is the error made on column j, over the inverse Hessian's diagonal entry, times that "
            "inverse's row; the derivation shows that both come from one matrix computed once, the upper Cholesky "
            "factor U of the inverse of the damped Hessian: row j of U is the direction, U_jj the divisor. A rounded "
            "column is final: only the columns after j move. The usual slips: the lower factor (its row j is zero "
            "right of the diagonal), the factor of H instead of its inverse, the error not divided by U_jj, the "
            "update's sign, and changing the caller's W."
        ),
        approach=(
            "Work on a copy of W, and keep a tensor of zeros shaped like W for the quantized weights. Damp H in a new "
            "tensor: add damp times the mean of H's diagonal to its diagonal. Invert the damped H and take the upper "
            "Cholesky factor U of the inverse (torch.linalg.cholesky has an upper option). Then for each column j "
            "from 0 to d_in - 1: ask quantize_column for column j of your working copy, and store the result as "
            "column j of the quantized weights; the error is the working column minus the quantized one, divided by "
            "U_jj, one number per row of W; subtract the outer product of the error and U's row j, from entry j + 1 "
            "on, from the working copy's columns j + 1 on. Return the quantized weights."
        ),
        skeleton=(
            "def gptq_layer(W, H, quantize_column, damp=0.01):\n"
            "    W = ____  # a working copy: the caller's W stays as it was\n"
            "    H = H + ____ * torch.eye(len(H), dtype=H.dtype)  # damped, relative to H's mean diagonal\n"
            "    U = ____  # the upper Cholesky factor of the damped H's inverse\n"
            "    Q = ____  # the quantized weights, filled column by column\n"
            "    for j in ____:\n"
            "        Q[:, j] = ____\n"
            "        err = ____  # column j's error over U's diagonal entry, one number per row\n"
            "        W[:, ____] -= ____  # spread over the columns not quantized yet\n"
            "    return Q\n"
        ),
    ),
}

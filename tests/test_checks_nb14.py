"""Checkers and probes of notebook 14: each passes the reference and right alternatives, and names realistic mistakes."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import tfedu.quant
from checker_helpers import failure_of, not_done, verdict
from tfedu.checks import nb14_quantization as nb14
from tfedu.checks.core import ExerciseNotDone, is_plain_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- 14.1 the bits of a float


def fields(x, e, M, mistake=""):
    """A learner's float_fields in floating point (math.frexp, round), right or with one ``mistake``."""
    bias = 2 ** (e - 1) if mistake == "bias plus one" else 2 ** (e - 1) - 1
    sign = int(x < 0) if mistake == "negative zero" else (-1 if x < 0 else 1) if mistake == "sign ±1" else \
        int(math.copysign(1.0, x) < 0)
    a = abs(x)
    fraction, power = math.frexp(a)
    k = power - 1
    if k < 1 - bias and mistake == "flush subnormals":
        return sign, 0, 0
    if k < 1 - bias and mistake == "negative exponent":
        return sign, k + bias, round((math.ldexp(a, -k) - 1) * 2**M)
    if k < 1 - bias and mistake == "subnormal step 2^-bias" and a:
        return sign, 0, round(math.ldexp(a, bias + M))
    k = max(k, 1 - bias)
    t = math.ldexp(a, M - k)
    count = math.floor(t) if mistake == "truncate" else math.floor(t + 0.5) if mistake == "ties away" else round(t)
    if count == 2 ** (M + 1) and mistake == "carry kept":
        return sign, k + bias, 2**M
    if count == 2 ** (M + 1) and mistake == "carry dropped":
        return sign, k + bias, 0
    if count == 2 ** (M + 1):
        count, k = count // 2, k + 1
    if count < 2**M:
        return sign, 0, float(count) if mistake == "floats" else count
    if mistake == "no bias":
        return sign, k, count - 2**M
    mantissa = count if mistake == "implicit one" else count - 2**M
    return (sign, k + bias, float(mantissa)) if mistake == "floats" else (sign, k + bias, mantissa)


def fields_by_bits(x, e, M):
    """Another right answer: exact integers, the mantissa's bits shifted with round-half-even by hand."""
    sign = 1 if str(x).startswith("-") else 0
    n, d = Fraction(abs(x)).as_integer_ratio()
    bias = (1 << (e - 1)) - 1
    if n == 0:
        return (sign, 0, 0)
    k = n.bit_length() - d.bit_length() - (1 if (n << max(0, d.bit_length() - n.bit_length())) < d << max(0, n.bit_length() - d.bit_length()) else 0)
    k = max(k, 1 - bias)
    shift = M - k  # count = |x| * 2^shift, rounded
    num, den = (n << shift, d) if shift >= 0 else (n, d << -shift)
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2 == 1):
        q += 1
    if q == 1 << (M + 1):
        q, k = q >> 1, k + 1
    return (sign, 0, q) if q < 1 << M else (sign, k + bias, q - (1 << M))


FIELD_MISTAKES = {  # name: a phrase its hint must contain
    "negative zero": "negative zero",
    "sign ±1": "not a factor of ±1",
    "bias plus one": "not 2^(e-1)",
    "no bias": "the exponent itself",
    "implicit one": "implicit leading 1",
    "truncate": "truncated (cut off), not rounded",
    "ties away": "not away from zero",
    "flush subnormals": "not zero but a subnormal",
    "negative exponent": "a field is at least 0",
    "subnormal step 2^-bias": "not 0 - bias",
    "carry kept": "the mantissa's carry",
    "carry dropped": "the mantissa's carry",
    "floats": "so return ints",
}


def test_the_reference_is_torchs_bit_pattern_for_thousands_of_values():
    rng = np.random.default_rng(0)
    for name, (e, M) in nb14.TORCH_FORMATS.items():
        bias, top = nb14.format_bias(e), nb14.largest_finite(e, M)
        k = rng.integers(1 - bias - M - 2, bias + 1, 3000)
        if name == "float32":  # float64 values: torch rounds them to float32 once
            xs = rng.choice([-1.0, 1.0], 3000) * np.ldexp(1 + rng.random(3000), k)
        else:  # float32 values (random bit patterns): float32 -> this format is one rounding, also in torch
            xs = (rng.choice([-1.0, 1.0], 3000) * np.ldexp(1 + rng.random(3000), k)).astype(np.float32).astype(float)
        ties = [nb14._tie(int(j), int(m), M) for j, m in zip(rng.integers(1 - bias, bias, 300), rng.integers(0, 2**M, 300))]
        values = [*xs.tolist(), *ties, *nb14.float_cases(e, M), -0.0, 0.0]
        values = [x for x in values if abs(x) <= top]
        assert len(values) > 2500
        for x in values:
            assert nb14.pack_fields(nb14.reference_float_fields(x, e, M), e, M) == nb14.torch_bits(x, name), (name, x)
            assert nb14.fields_value(nb14.reference_float_fields(x, e, M), e, M) == \
                torch.tensor(x, dtype=getattr(torch, name)).double().item()


def test_torch_rounds_a_python_float_twice_for_16_and_8_bit_formats():
    """Why the test above draws float32 values for the smaller formats: torch goes float64 -> float32 -> bfloat16."""
    x = 1 + 2**-8 + 2**-40  # just above a bfloat16 tie; float32 rounds it onto the tie, which goes to even
    assert nb14.reference_float_fields(x, 8, 7) == (0, 127, 1)
    assert nb14.torch_bits(x, "bfloat16") == nb14.pack_fields((0, 127, 0), 8, 7)
    assert nb14.torch_bits(float(torch.tensor(x, dtype=torch.float32)), "bfloat16") == nb14.torch_bits(x, "bfloat16")


def test_e4m3fn_uses_its_top_exponent_field_for_numbers():
    assert nb14.largest_finite(4, 3) == 448.0 == torch.finfo(torch.float8_e4m3fn).max
    assert nb14.reference_float_fields(448.0, 4, 3) == (0, 15, 6) and nb14.torch_bits(448.0, "float8_e4m3fn") == 0x7E
    assert nb14.reference_float_fields(-300.0, 4, 3) == (1, 15, 1)  # 288 and 320 tie-free: 300 is nearer 288
    for e, M in [(8, 23), (8, 7), (5, 10), *nb14.OTHER_FORMATS]:  # IEEE: the all-ones exponent field is never reached
        assert nb14.reference_float_fields(nb14.largest_finite(e, M), e, M) == (0, 2**e - 2, 2**M - 1)


def test_the_cases_cover_ties_carries_subnormals_and_signed_zero():
    for e, M in [*nb14.TORCH_FORMATS.values(), *nb14.OTHER_FORMATS]:
        cases = nb14.float_cases(e, M)
        got = [nb14.reference_float_fields(x, e, M) for x in cases]
        assert any(x == 0 and math.copysign(1, x) < 0 for x in cases)
        assert any(f[1] == 0 and f[2] > 0 for f in got)  # subnormals
        for mistake in nb14.MISTAKES:  # each named mistake changes some case's fields
            assert any(nb14._fields(x, e, M, mistake) != f for x, f in zip(cases, got)), (e, M, mistake)


@pytest.mark.parametrize("answer", [fields, fields_by_bits, nb14.reference_float_fields], ids=["frexp", "bits", "reference"])
def test_float_fields_passes_right_answers(answer, capsys):
    nb14.check_float_fields(answer)
    assert "all checks passed" in capsys.readouterr().out


def test_the_right_answers_agree_with_the_reference_on_random_formats():
    rng = np.random.default_rng(1)
    for _ in range(20):
        e, M = int(rng.integers(2, 9)), int(rng.integers(1, 24))
        for x in nb14.float_cases(e, M, rng, n_random=20):
            assert fields(x, e, M) == fields_by_bits(x, e, M) == nb14.reference_float_fields(x, e, M), (x, e, M)


@pytest.mark.parametrize("name", FIELD_MISTAKES)
def test_float_fields_names_each_mistake(name):
    message = failure_of(nb14.check_float_fields, lambda x, e, M: fields(x, e, M, name))
    assert FIELD_MISTAKES[name] in message, message


def test_float_fields_says_when_not_done_or_not_three_ints():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb14.check_float_fields(not_done)
    with pytest.raises(ExerciseNotDone, match="returned None"):
        nb14.check_float_fields(lambda x, e, M: None)
    assert "three integers" in failure_of(nb14.check_float_fields, lambda x, e, M: fields(x, e, M)[1:])
    torch_cast = lambda x, e, M: fields(float(torch.tensor(x, dtype={(8, 23): torch.float32, (8, 7): torch.bfloat16,
                                                                     (5, 10): torch.float16}[e, M])), e, M)
    assert "raised KeyError" in failure_of(nb14.check_float_fields, torch_cast)  # a format torch has no dtype for


# ----------------------------------------------------------------------------- 14.2 absmax


def absmax(x, bits, mistake=""):
    """A learner's absmax_quantize, right or with one ``mistake``."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.max() if mistake == "max not abs" else x.abs().max()
    if mistake == "128":
        scale = amax / 2 ** (bits - 1)
    elif mistake == "2^b - 1":
        scale, qmax = amax / (2**bits - 1), 2**bits - 1
    else:
        scale = amax / qmax
    if amax == 0 and mistake != "no zero guard":
        scale = torch.ones((), dtype=x.dtype)
    t = x.round() / scale if mistake == "round first" else x / scale
    lo, hi = {"128": (-qmax - 1, qmax), "unsigned": (0, 2**bits - 1)}.get(mistake, (-qmax, qmax))
    if mistake == "truncate":
        q = t.clamp(lo, hi).to(torch.int8)
    else:
        q = t.round().clamp(lo, hi)
        q = q if mistake == "float codes" else q.to(torch.uint8 if mistake == "unsigned" else torch.int8)
    if mistake == "in place":
        x /= scale
    return q, scale


def absmax_deq(q, scale):
    return q.to(scale.dtype) * scale


def absmax_by_multiplying_the_inverse(x, bits):
    """x * (1 / scale), codes as int16 -> int8, scale a Python float: a right answer."""
    qmax = 2 ** (bits - 1) - 1
    amax = float(x.abs().max())
    scale = amax / qmax if amax else 1.0
    return torch.clamp(torch.round(x * (1 / scale)), -qmax, qmax).to(torch.int16).to(torch.int8), torch.tensor(scale)


RIGHT_ABSMAX = {"by hand": (absmax, absmax_deq), "inverse scale, float scale": (absmax_by_multiplying_the_inverse, absmax_deq),
                "deq via mul": (absmax, lambda q, s: torch.mul(q.double(), s.double()))}

ABSMAX_MISTAKES = {  # name: (quantize, dequantize, a phrase its hint must contain)
    "round first": (lambda x, b: absmax(x, b, "round first"), absmax_deq, "rounded before scaling"),
    "128": (lambda x, b: absmax(x, b, "128"), absmax_deq, "symmetric range"),
    "unsigned": (lambda x, b: absmax(x, b, "unsigned"), absmax_deq, "every negative value became 0"),
    "max not abs": (lambda x, b: absmax(x, b, "max not abs"), absmax_deq, "max(x), not max(|x|)"),
    "truncate": (lambda x, b: absmax(x, b, "truncate"), absmax_deq, "truncated, not rounded"),
    "float codes": (lambda x, b: absmax(x, b, "float codes"), absmax_deq, "cast the rounded codes to torch.int8"),
    "no zero guard": (lambda x, b: absmax(x, b, "no zero guard"), absmax_deq, "Guard it"),
    "divide": (absmax, lambda q, s: q.to(s.dtype) / s, "divides by the scale"),
    "2^b - 1 (int8 wrap)": (lambda x, b: absmax(x, b, "2^b - 1"), absmax_deq, "wrapped codes above 127 around: 255 came back as -1"),
    "integer dequantize": (absmax, lambda q, s: (q.to(s.dtype) * s).round().to(torch.int32), "values, not floats"),
    "in place": (lambda x, b: absmax(x, b, "in place"), absmax_deq, "changed its input `x` in place"),
    "one tensor": (lambda x, b: absmax(x, b)[0], absmax_deq, "should return a pair (q, scale)"),
}


@pytest.mark.parametrize("name", RIGHT_ABSMAX)
def test_absmax_passes_right_answers(name, capsys):
    nb14.check_absmax(*RIGHT_ABSMAX[name])
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", ABSMAX_MISTAKES)
def test_absmax_names_each_mistake(name):
    quantize, dequantize, fragment = ABSMAX_MISTAKES[name]
    message = failure_of(lambda fn: nb14.check_absmax(fn, dequantize), quantize)
    assert fragment in message, message


def test_absmax_refuses_tfedu_quant_and_says_when_not_done():
    assert "uses tfedu.quant" in failure_of(lambda fn: nb14.check_absmax(fn, absmax_deq), tfedu.quant.absmax_quantize)
    namespace = {"quant": tfedu.quant}
    exec("def by_module(x, bits):\n    return quant.absmax_quantize(x, bits)\n", namespace)
    assert "uses tfedu.quant (quant)" in failure_of(lambda fn: nb14.check_absmax(fn, absmax_deq), namespace["by_module"])
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb14.check_absmax(not_done, absmax_deq)
    with pytest.raises(ExerciseNotDone, match="returned None"):
        nb14.check_absmax(lambda x, bits: None, absmax_deq)


def test_absmax_cases_have_no_ties_and_tell_the_mistakes_apart():
    for _, x, bits in nb14.absmax_cases():
        q, scale = nb14.expected_absmax(x, bits)
        t = x.double() / scale
        assert ((t - t.round()).abs() < 0.46).all()  # no value near a tie
        assert torch.equal(tfedu.quant.absmax_quantize(x, bits)[0], q)
    _, x, bits = nb14.absmax_cases()[1]  # the largest magnitude negative
    want = nb14.expected_absmax(x, bits)[0].double()
    for hint, wrong in nb14.absmax_mistakes(x, bits):
        assert not torch.equal(wrong, want), hint


# ----------------------------------------------------------------------------- 14.3 zero-point


def zeropoint(x, bits, mistake=""):
    levels = 2**bits - 1
    lo, hi = (x.min(), x.max()) if mistake == "not widened" else (x.min().clamp(max=0), x.max().clamp(min=0))
    if mistake == "hi not widened":
        lo, hi = x.min().clamp(max=0), x.max()
    scale = (hi - lo) / (2**bits if mistake == "2^b" else levels)
    if hi == lo and mistake != "no guard":
        scale = torch.ones((), dtype=x.dtype)
    zero = -lo / scale if mistake == "zero not rounded" else (-lo / scale).round()
    if mistake == "wrong sign":
        zero = (lo / scale).round()
    t = x.round() / scale if mistake == "round first" else x / scale
    if mistake == "truncate":
        q = (t + zero).clamp(0, levels).to(torch.uint8)
    elif mistake == "zero not rounded":
        q = (t + zero).round().clamp(0, levels).to(torch.uint8)
    elif mistake == "from lo":
        q = ((x - lo) / scale).round().clamp(0, levels).to(torch.uint8)
    elif mistake == "no clamp":
        q = (t.round() + zero).to(torch.int16).to(torch.uint8)  # 256 wraps to 0
    elif mistake == "half up":  # not a mistake: floor(t + 0.5) rounds exact ties up, torch.round to even
        zero = torch.floor(-lo / scale + 0.5)
        q = (torch.floor(t + 0.5) + zero).clamp(0, levels).to(torch.uint8)
    elif mistake == "signed":
        q = (t.round() + zero).clamp(-128, 127).to(torch.int8)
    else:
        q = (t.round() + zero).clamp(0, levels)
        q = q if mistake == "float codes" else q.to(torch.uint8)
    return q, scale, zero


def zeropoint_deq(q, scale, zero):
    return (q.to(scale.dtype) - zero) * scale


RIGHT_ZEROPOINT = {"by hand": (zeropoint, zeropoint_deq),
                   "int zero": (lambda x, b: (lambda q, s, z: (q, s, int(z)))(*zeropoint(x, b)),
                                lambda q, s, z: (q.double() - float(z)) * s.double()),
                   "ties rounded half up": (lambda x, b: zeropoint(x, b, "half up"), zeropoint_deq)}

ZEROPOINT_MISTAKES = {
    "wrong sign": (lambda x, b: zeropoint(x, b, "wrong sign"), zeropoint_deq, "wrong sign"),
    "zero not rounded": (lambda x, b: zeropoint(x, b, "zero not rounded"), zeropoint_deq, "not an integer"),
    "not widened": (lambda x, b: zeropoint(x, b, "not widened"), zeropoint_deq, "Widen the range to hold 0"),
    "2^b": (lambda x, b: zeropoint(x, b, "2^b"), zeropoint_deq, "steps between the first and the last"),
    "signed": (lambda x, b: zeropoint(x, b, "signed"), zeropoint_deq, "signed range"),
    "truncate": (lambda x, b: zeropoint(x, b, "truncate"), zeropoint_deq, "truncated, not rounded"),
    "round first": (lambda x, b: zeropoint(x, b, "round first"), zeropoint_deq, "rounded x before scaling"),
    "float codes": (lambda x, b: zeropoint(x, b, "float codes"), zeropoint_deq, "store them as torch.uint8"),
    "no guard": (lambda x, b: zeropoint(x, b, "no guard"), zeropoint_deq, "Guard it"),
    "order": (zeropoint, lambda q, s, z: q.to(s.dtype) * s - z, "(q - zero) * scale"),
    "divide": (zeropoint, lambda q, s, z: (q.to(s.dtype) - z) / s, "divides by the scale"),
    "uint8 wrap": (zeropoint, lambda q, s, z: (q - z.to(torch.uint8)).to(s.dtype) * s, "wrap around"),
    "no clamp": (lambda x, b: zeropoint(x, b, "no clamp"), zeropoint_deq, "wrapped 256 to 0"),
    "hi not widened": (lambda x, b: zeropoint(x, b, "hi not widened"), zeropoint_deq, "Widen the range on the positive side"),
    "codes from lo, zero rounded": (lambda x, b: zeropoint(x, b, "from lo"), zeropoint_deq,
                                    "your codes are round((x - lo) / scale)"),
    "adds the zero point": (zeropoint, lambda q, s, z: (q.to(s.dtype) + z) * s, "adds the zero point"),
    "integer dequantize": (zeropoint, lambda q, s, z: (q.to(torch.int32) - z.to(torch.int32)), "values, not floats"),
}


@pytest.mark.parametrize("name", RIGHT_ZEROPOINT)
def test_zeropoint_passes_right_answers(name, capsys):
    nb14.check_zeropoint(*RIGHT_ZEROPOINT[name])
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", ZEROPOINT_MISTAKES)
def test_zeropoint_names_each_mistake(name):
    quantize, dequantize, fragment = ZEROPOINT_MISTAKES[name]
    message = failure_of(lambda fn: nb14.check_zeropoint(fn, dequantize), quantize)
    assert fragment in message, message


def test_zeropoint_no_clamp_at_4_bits_is_named_without_a_wrap():
    """At 4 bits the unclamped code 16 fits a uint8 (no wrap) but not a nibble: named as outside [0, 15]."""
    x = nb14.zeropoint_overflow_case(4)
    q, scale, zero = zeropoint(x, 4, "no clamp")
    assert int(q.max()) == 16
    message = failure_of(lambda fn: nb14.check_zeropoint(fn, zeropoint_deq), lambda x, b: zeropoint(x, b, "no clamp"))
    assert "outside [0, 2^b - 1]" in message and "Clamp" in message, message
    with pytest.raises(nb14.CheckFailure, match=r"outside \[0, 2\^b - 1\] = \[0, 15\]"):
        nb14.diagnose_zeropoint((q, scale, zero), x, 4, what="x")


def test_zeropoint_cases_cover_overflow_and_both_one_sided_ranges():
    cases = [(x, b) for _, x, b in nb14.zeropoint_cases()]
    assert any((x > 0).all() for x, _ in cases) and any((x < 0).all() for x, _ in cases)
    for x, b in cases:
        q, scale, zero = nb14.expected_zeropoint(x, b)
        assert 0 <= float(zero) <= 2**b - 1 and int(q.max()) <= 2**b - 1
        assert torch.equal(tfedu.quant.zeropoint_quantize(x, b)[0], q)
    for b in (8, 4):  # round(x / scale) + zero passes the top code before the clamp, for both rounding conventions
        x = nb14.zeropoint_overflow_case(b)
        scale, zero = nb14.expected_zeropoint(x, b)[1:]
        t = x.double() / scale
        assert float(t.max()) == (2**b - 1) / 2 and float(zero) == 2 ** (b - 1)
        assert int((t.round() + zero).max()) == 2**b and int((t.sign() * (t.abs() + 0.5).floor() + zero).max()) == 2**b


def test_zeropoint_refuses_tfedu_quant_and_says_when_not_done():
    assert "uses tfedu.quant" in failure_of(lambda fn: nb14.check_zeropoint(fn, zeropoint_deq),
                                            tfedu.quant.zeropoint_quantize)
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb14.check_zeropoint(not_done, zeropoint_deq)


# ----------------------------------------------------------------------------- 14.4 GPTQ's column loop


def gptq(W, H, quantize_column, damp=0.01, mistake=""):
    """A learner's gptq_layer, right or with one ``mistake`` written as a learner would."""
    if mistake != "mutates W":
        W = W.clone()
    eye = torch.eye(len(H), dtype=H.dtype)
    if mistake == "mutates H":
        H += damp * H.diagonal().mean() * eye
    elif mistake != "no damping":
        H = H + (damp if mistake == "damping not scaled" else damp * H.diagonal().mean()) * eye
    H_inv = torch.linalg.inv(H)
    if mistake == "cholesky of H":
        U = torch.linalg.cholesky(H, upper=True)
    elif mistake == "inverse of H's factor":
        U = torch.linalg.inv(torch.linalg.cholesky(H, upper=True))
    elif mistake == "lower factor":
        U = torch.linalg.cholesky(H_inv)  # the default: lower
    else:
        U = torch.linalg.cholesky(H_inv, upper=True)
    Q = torch.zeros_like(W)
    columns = range(W.shape[1])
    for j in reversed(columns) if mistake == "reverse" else columns:
        q = quantize_column(W, j)
        if mistake in ("current again", "factor's column"):  # the quantized columns kept in W itself
            err = (W[:, j] - q) / U[j, j]
            W[:, j] = q
            if mistake == "current again":
                W[:, j:] -= torch.outer(err, U[j, j:])
            else:
                W -= torch.outer(err, U[:, j])
            Q = W
            continue
        Q[:, j] = q
        if mistake == "no propagation":
            continue
        if mistake == "static inverse row":
            W[:, j + 1 :] -= torch.outer((W[:, j] - q) / H_inv[j, j], H_inv[j, j + 1 :])
            continue
        err = W[:, j] - q
        err = err if mistake == "not divided" else err / U[j, j] ** (2 if mistake == "divided by the square" else 1)
        update = torch.outer(err, U[j, j + 1 :])
        W[:, j + 1 :] += update if mistake == "sign flipped" else -update
    return Q


def gptq_obq(W, H, quantize_column, damp=0.01):
    """Another right answer: OBQ's update, the inverse Hessian of the columns left recomputed at every step."""
    W = W.clone()
    H = H + damp * H.diagonal().mean() * torch.eye(len(H), dtype=H.dtype)
    Q = torch.zeros_like(W)
    for j in range(W.shape[1]):
        H_inv = torch.linalg.inv(H[j:, j:])
        Q[:, j] = quantize_column(W, j)
        W[:, j:] -= torch.outer((W[:, j] - Q[:, j]) / H_inv[0, 0], H_inv[0])
    return Q


def gptq_lower_transposed(W, H, quantize_column, damp=0.01):
    """Another right answer: the lower factor L of H^-1 and its column j (L^T is the upper factor), W updated in place
    on a copy and returned (each column holds its quantized value once its turn is over)."""
    W = W.clone()
    H = H.clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    L = torch.linalg.cholesky(torch.linalg.inv(H))
    for j in range(W.shape[1]):
        q = quantize_column(W, j)
        err = (W[:, j] - q) / L[j, j]
        W[:, j] = q
        W[:, j + 1 :] -= err[:, None] * L[j + 1 :, j][None, :]
    return W


def gptq_float32(W, H, quantize_column, damp=0.01):
    """Another right answer, in float32 throughout (float64 inputs included)."""
    return gptq(W.float(), H.float(), quantize_column, damp).to(W.dtype)


GPTQ_MISTAKES = {  # name: a phrase its hint must contain
    "no propagation": "round-to-nearest",
    "lower factor": "round-to-nearest",
    "not divided": "divide it by U_jj",
    "divided by the square": "divides the error by U_jj twice",
    "cholesky of H": "Cholesky factor of the (damped) H itself",
    "inverse of H's factor": "inverse of H's upper Cholesky factor",
    "current again": "applied to column j too",
    "factor's column": "columns you had already quantized changed",
    "sign flipped": "wrong sign",
    "no damping": "without damping",
    "damping not scaled": "damping adds damp itself",
    "static inverse row": "rows of the full inverse H^-1, computed once",
    "reverse": "right to left",
    "mutates W": "changed the caller's `W` in place",
    "mutates H": "changed the caller's `H` in place",
}


def test_the_reference_is_tfedu_quants_gptq_with_and_without_blocks():
    for seed, (d_out, d_in, n, bits, group, dtype) in enumerate([(6, 16, 64, 3, 8, torch.float64),
                                                               (8, 32, 20, 4, None, torch.float32),
                                                               (5, 48, 200, 4, 16, torch.float32)]):
        W, H = nb14.gptq_case(seed, d_out, d_in, n, dtype)
        want = nb14.reference_gptq_layer(W, H, nb14.ColumnQuantizer(bits, group), damp=0.02)
        for block_size in (128, 5):
            got = tfedu.quant.gptq_quantize(W, H, bits, group, damp=0.02, block_size=block_size).weight
            assert torch.allclose(got, want, atol=1e-6), (seed, block_size)
        assert torch.allclose(want, gptq(W, H, nb14.ColumnQuantizer(bits, group), 0.02), atol=1e-6)


def test_the_column_quantizer_is_tfedu_quants_grid():
    W, _ = nb14.gptq_case(0, 5, 16, 32, torch.float32)
    column = nb14.ColumnQuantizer(4, 8)
    got = torch.stack([column(W, j) for j in range(16)], dim=1)  # no errors pushed: round-to-nearest by groups
    assert torch.equal(got, tfedu.quant.rtn_quantize_weight(W, 4, 8))
    assert column.calls == list(range(16)) and "groups of 8" in repr(column)
    step = nb14.ColumnQuantizer(step=0.25)
    assert torch.equal(step(W, 3), (W[:, 3] * 4).round() / 4)


def test_gptq_cases_tell_every_mistake_apart_and_round_no_tie():
    cases = [(*nb14.gptq_case(seed, d_out, d_in, n, dtype), quantizer, damp)
             for seed, d_out, d_in, n, quantizer, damp, dtype in nb14.GQ_CASES]
    assert nb14.gq_mistakes_apart(cases)
    assert all(nb14.gq_closest(*case) > 1e-4 for case in cases)
    assert any(n < d_in for _, _, d_in, n, *_ in nb14.GQ_CASES)  # a singular H
    assert {dtype for *_, dtype in nb14.GQ_CASES} == {torch.float32, torch.float64}


@pytest.mark.parametrize("answer", [gptq, gptq_obq, gptq_lower_transposed, gptq_float32],
                         ids=["cholesky row", "obq", "lower transposed", "float32"])
def test_gptq_layer_passes_right_answers(answer, capsys):
    nb14.check_gptq_layer(answer)
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", GPTQ_MISTAKES)
def test_gptq_layer_names_each_mistake(name):
    message = failure_of(nb14.check_gptq_layer, lambda W, H, q, damp=0.01: gptq(W, H, q, damp, name))
    assert GPTQ_MISTAKES[name] in message, message


def test_gptq_layer_names_the_damping_when_a_singular_hessian_fails():
    seed, d_out, d_in, n, quantizer, damp, dtype = nb14.GQ_CASES[-1]
    W, H = nb14.gptq_case(seed, d_out, d_in, n, dtype)
    guarded = nb14._singular_guard(lambda W, H, q, damp: gptq(W, H, q, damp, "no damping"), "the singular case", n, d_in)
    with pytest.raises(nb14.CheckFailure, match="what the damping is for"):
        guarded(W, H, nb14.ColumnQuantizer(**quantizer), damp)
    only_full_rank = lambda W, H, q, damp: gptq(W, H, q, damp, "" if torch.linalg.matrix_rank(H) == len(H) else "no damping")
    assert "what the damping is for" in failure_of(nb14.check_gptq_layer, only_full_rank)


def test_gptq_layer_refuses_the_reference_and_says_when_not_done():
    assert "uses tfedu's own GPTQ (you passed reference_gptq_layer)" in failure_of(nb14.check_gptq_layer,
                                                                                   nb14.reference_gptq_layer)
    namespace = {"quant": tfedu.quant}
    exec("def by_module(W, H, q, damp=0.01):\n    return quant.gptq_quantize(W, H, 4).weight\n", namespace)
    assert "uses tfedu's own GPTQ (quant)" in failure_of(nb14.check_gptq_layer, namespace["by_module"])
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb14.check_gptq_layer(not_done)
    with pytest.raises(ExerciseNotDone, match="returned None"):
        nb14.check_gptq_layer(lambda W, H, q, damp=0.01: None)
    assert "never called the quantize_column" in failure_of(
        nb14.check_gptq_layer, lambda W, H, q, damp=0.01: gptq(W, H, lambda M, j: M[:, j].round(), damp))
    assert "of W's shape (6, 16)" in failure_of(nb14.check_gptq_layer, lambda W, H, q, damp=0.01: gptq(W, H, q, damp).T)


# ----------------------------------------------------------------------------- probes


NAMESPACE = {"float_fields": fields, "absmax_quantize": absmax, "absmax_dequantize": absmax_deq, "zeropoint_quantize": zeropoint,
             "zeropoint_dequantize": zeropoint_deq, "gptq_layer": gptq}


@pytest.mark.parametrize("grade_id", nb14.PROBES)
def test_probes_pass_the_reference_and_return_plain_data(grade_id):
    probe = nb14.PROBES[grade_id]
    for seed in range(4):
        assert is_plain_data(probe.make_inputs(np.random.default_rng(seed)))
        assert verdict(probe, dict(NAMESPACE), seed) is None, seed


@pytest.mark.parametrize("grade_id, name, wrong, fragment", [
    ("check_absmax", "absmax_quantize", lambda x, b: absmax(x, b, "max not abs"), "max(x), not max(|x|)"),
    ("check_absmax", "absmax_quantize", lambda x, b: absmax(x, b, "truncate"), "truncated"),
    ("check_absmax", "absmax_dequantize", lambda q, s: q.to(s.dtype) / s, "divides by the scale"),
    ("check_zeropoint", "zeropoint_quantize", lambda x, b: zeropoint(x, b, "wrong sign"), "wrong sign"),
    ("check_zeropoint", "zeropoint_quantize", lambda x, b: zeropoint(x, b, "not widened"), "Widen the range"),
    ("check_zeropoint", "zeropoint_quantize", lambda x, b: zeropoint(x, b, "hi not widened"), "positive side"),
    ("check_zeropoint", "zeropoint_quantize", lambda x, b: zeropoint(x, b, "no clamp"), "Clamp"),
    ("check_zeropoint", "zeropoint_dequantize", lambda q, s, z: (q.to(s.dtype) + z) * s, "adds the zero point"),
    ("check_zeropoint", "zeropoint_dequantize", lambda q, s, z: (q - z.to(torch.uint8)).to(s.dtype) * s, "wrap around"),
])
def test_probes_name_mistakes(grade_id, name, wrong, fragment):
    for seed in range(4):
        feedback = verdict(nb14.PROBES[grade_id], {**NAMESPACE, name: wrong}, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


@pytest.mark.parametrize("name", [*FIELD_MISTAKES])
def test_the_float_fields_probe_names_each_mistake(name):
    for seed in range(2):
        feedback = verdict(nb14.PROBES["check_float_fields"], {**NAMESPACE, "float_fields": lambda x, e, M: fields(x, e, M, name)}, seed)
        assert feedback is not None and FIELD_MISTAKES[name] in feedback, (seed, feedback)


def test_the_float_fields_probe_passes_another_right_answer():
    for seed in range(4):
        assert verdict(nb14.PROBES["check_float_fields"], {**NAMESPACE, "float_fields": fields_by_bits}, seed) is None


def test_a_subnormal_that_rounds_up_to_the_smallest_normal_is_a_carry():
    """Found working 14.1 cold: fields (0, 0, 2^M) for an x just below the smallest normal number were named as a
    negative exponent field; they are the mantissa's carry left in the field (the answer is (0, 1, 0))."""
    e, M = 8, 23
    x = math.ldexp(2**24 - 1, -126 - 24)  # just below 2^-126: rounds up to it
    assert nb14.reference_float_fields(x, e, M) == (0, 1, 0)
    with pytest.raises(nb14.CheckFailure, match="the mantissa.s carry"):
        nb14.diagnose_fields((0, 0, 2**M), x, e, M)


@pytest.mark.parametrize("name", GPTQ_MISTAKES)
def test_the_gptq_probe_names_each_mistake(name):
    for seed in range(2):
        feedback = verdict(nb14.PROBES["check_gptq_layer"],
                           {**NAMESPACE, "gptq_layer": lambda W, H, q, damp=0.01: gptq(W, H, q, damp, name)}, seed)
        assert feedback is not None and GPTQ_MISTAKES[name] in feedback, (seed, feedback)


@pytest.mark.parametrize("answer", [gptq_obq, gptq_lower_transposed, gptq_float32])
def test_the_gptq_probe_passes_other_right_answers(answer):
    for seed in range(4):
        assert verdict(nb14.PROBES["check_gptq_layer"], {**NAMESPACE, "gptq_layer": answer}, seed) is None


def test_the_gptq_probe_names_a_failed_factorisation_of_the_singular_hessian():
    only_full_rank = lambda W, H, q, damp=0.01: gptq(W, H, q, damp, "" if torch.linalg.matrix_rank(H) == len(H) else "no damping")
    feedback = verdict(nb14.PROBES["check_gptq_layer"], {**NAMESPACE, "gptq_layer": only_full_rank}, 0)
    assert feedback is not None and "what the damping is for" in feedback, feedback

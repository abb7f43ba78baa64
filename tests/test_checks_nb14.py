"""Checkers and probes of notebook 14: each passes the reference and right alternatives, and names realistic mistakes."""

import numpy as np
import pytest
import torch

import tfedu.quant
from checker_helpers import failure_of, not_done, verdict
from tfedu.checks import nb14_quantization as nb14
from tfedu.checks.core import ExerciseNotDone, is_plain_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- 14.1 absmax


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


# ----------------------------------------------------------------------------- 14.2 zero-point


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


# ----------------------------------------------------------------------------- probes


NAMESPACE = {"absmax_quantize": absmax, "absmax_dequantize": absmax_deq, "zeropoint_quantize": zeropoint,
             "zeropoint_dequantize": zeropoint_deq}


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

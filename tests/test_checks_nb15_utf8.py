"""Exercise 15.7, utf8_prefix_ok: the check and the hidden test pass right answers and name each realistic mistake.

Oracle for the cases themselves: Python's strict decoder (final=True) on every input finished with continuation
bytes, which the checker's reference must agree with (the incremental decoder with final=False lags after ED).
"""

import codecs
import itertools

import numpy as np
import pytest
import regex

from checker_helpers import failure_of, not_done, verdict
from tfedu.checks import nb15_interp_decoding as nb15
from tfedu.checks.core import ExerciseNotDone, is_plain_data


def prefix_ok(data, mistake=""):
    """A learner's answer in the notebook's style (a state carried byte to byte), right or with one ``mistake``."""
    need, low, high = 0, 0x80, 0xBF
    for b in data:
        if need:
            inside = low <= b <= high
            if mistake == "top bit" and low == 0x80 and high == 0xBF:
                inside = b >= 0x80  # only the top bit tested
            if inside:
                need, low, high = need - 1, 0x80, 0xBF
                continue
            if mistake != "restart" or 0x80 <= b <= 0xBF:
                return False
            need, low, high = 0, 0x80, 0xBF  # the unfinished character forgotten, b read as a new one
        if b <= 0x7F:
            continue
        if mistake == "stray" and b <= 0xBF:
            continue
        if 0xC2 <= b <= 0xDF or mistake == "c0 c1" and b in (0xC0, 0xC1):
            need = 2 if mistake == "length+1" else 1
        elif 0xE0 <= b <= 0xEF:
            need = 3 if mistake == "length+1" else 2
            if b == 0xE0 and mistake != "overlong":
                low = 0xA0
            if b == 0xED and mistake != "surrogate":
                high = 0x9F
        elif 0xF0 <= b <= 0xF4 or mistake == "f5 ff" and 0xF5 <= b <= 0xF7:
            need = 2 if mistake == "f as 3" else 3
            if b == 0xF0 and mistake != "overlong":
                low = 0x90
            if b == 0xF4 and mistake != "above":
                high = 0x8F
        else:
            return False
    return need == 0 if mistake == "incomplete" else True


def by_code_points(data):
    """Another right way: build each character's code point; an unfinished one needs a valid completion in range."""
    i = 0
    while i < len(data):
        b = data[i]
        if b < 0x80:
            i += 1
            continue
        if 0xC0 <= b < 0xE0:
            n, cp = 2, b & 0x1F
        elif 0xE0 <= b < 0xF0:
            n, cp = 3, b & 0x0F
        elif 0xF0 <= b < 0xF8:
            n, cp = 4, b & 0x07
        else:
            return False
        have = data[i + 1:i + n]
        for c in have:
            if c >> 6 != 2:
                return False
            cp = cp << 6 | c & 0x3F
        free = 6 * (n - 1 - len(have))
        lo, hi = max(cp << free, {2: 0x80, 3: 0x800, 4: 0x10000}[n]), min(cp << free | (1 << free) - 1, 0x10FFFF)
        if lo > hi or 0xD800 <= lo and hi <= 0xDFFF:
            return False
        i += 1 + len(have)
    return True


PATTERN = regex.compile(rb"(?:[\x00-\x7f]|[\xc2-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]|[\xe1-\xec\xee\xef]"
                        rb"[\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3]"
                        rb"[\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2})*")


def by_regex(data):
    """Another right way: the table as a byte pattern, with partial matching."""
    return PATTERN.fullmatch(data, partial=True) is not None


def by_decoder(data):
    """Python's incremental decoder: forbidden (and wrong after ED)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
        return True
    except UnicodeDecodeError:
        return False


def by_decode_method(data):
    """bytes.decode with the unfinished tail tried: forbidden."""
    for cut in range(4):
        try:
            data[:len(data) - cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            pass
    return False


RIGHT = {"state": prefix_ok, "code points": by_code_points, "regex": by_regex,
         "reference": nb15.reference_utf8_prefix_ok}

MISTAKES = {  # name: a phrase its hint must contain
    "overlong": "overlong form",
    "surrogate": "the surrogates",
    "above": "the last one Unicode has",
    "c0 c1": "C0 and C1 could only start",
    "f5 ff": "F5..F7 would start",
    "stray": "no character to continue",
    "length+1": "counted a longer one",
    "f as 3": "counted a shorter one",
    "restart": "is unfinished when",
    "top bit": "Testing only the top bit",
    "incomplete": "can still become valid UTF-8",
}


def oracle(data: bytes) -> bool:
    """Some completion by continuation bytes (ends of the table's ranges) decodes strictly."""
    for n in range(4):
        for tail in itertools.product((0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF), repeat=n):
            try:
                (data + bytes(tail)).decode("utf-8", "strict")
                return True
            except UnicodeDecodeError:
                pass
    return False


def test_the_reference_and_the_cases_agree_with_python_s_strict_decoder():
    cases = nb15.u8_closure(nb15.u8_cases() + nb15.u8_random_cases(np.random.default_rng(0), 200))
    assert len(cases) > 500
    for data in cases:
        assert nb15.reference_utf8_prefix_ok(data) == oracle(data), data.hex(" ")
    for a, b in itertools.product(range(256), repeat=2):
        assert nb15.reference_utf8_prefix_ok(bytes([a, b])) == oracle(bytes([a, b]))


@pytest.mark.parametrize("name", RIGHT)
def test_the_check_passes_right_answers(name, capsys):
    nb15.check_utf8_prefix_ok(RIGHT[name])
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", MISTAKES)
def test_the_check_names_each_mistake_with_its_input(name):
    message = failure_of(nb15.check_utf8_prefix_ok, lambda data: prefix_ok(data, name))
    assert MISTAKES[name] in message, message
    assert "utf8_prefix_ok(b'" in message  # the input it was found on


def test_the_check_refuses_the_decoder_and_tfedu_constrained_and_says_when_not_done():
    assert "Python's own UTF-8 decoder" in failure_of(nb15.check_utf8_prefix_ok, by_decode_method)
    assert "codecs" in failure_of(nb15.check_utf8_prefix_ok, by_decoder)
    from tfedu.constrained import utf8_prefix_ok
    assert "tfedu.constrained" in failure_of(nb15.check_utf8_prefix_ok, utf8_prefix_ok)
    with pytest.raises(ExerciseNotDone):
        nb15.check_utf8_prefix_ok(not_done)
    with pytest.raises(ExerciseNotDone):
        nb15.check_utf8_prefix_ok(lambda data: None)
    assert "True or False" in failure_of(nb15.check_utf8_prefix_ok, lambda data: 1)


def test_the_messages_name_the_exact_input():
    assert "utf8_prefix_ok(b'\\xe0\\x80')" in failure_of(nb15.check_utf8_prefix_ok, lambda d: prefix_ok(d, "overlong"))
    assert "utf8_prefix_ok(b'\\xed\\xa0')" in failure_of(nb15.check_utf8_prefix_ok, lambda d: prefix_ok(d, "surrogate"))
    assert "utf8_prefix_ok(b'\\x80')" in failure_of(nb15.check_utf8_prefix_ok, lambda d: prefix_ok(d, "stray"))
    assert "utf8_prefix_ok(b'\\xc2')" in failure_of(nb15.check_utf8_prefix_ok, lambda d: prefix_ok(d, "incomplete"))


PROBE = nb15.PROBES["check_utf8_prefix_ok"]


@pytest.mark.parametrize("name", RIGHT)
def test_the_probe_passes_right_answers(name):
    for seed in range(4):
        assert verdict(PROBE, {"utf8_prefix_ok": RIGHT[name]}, seed) is None, (name, seed)


@pytest.mark.parametrize("name", MISTAKES)
def test_the_probe_names_each_mistake(name):
    for seed in (1, 2):
        feedback = verdict(PROBE, {"utf8_prefix_ok": lambda data, name=name: prefix_ok(data, name)}, seed)
        assert feedback and MISTAKES[name] in feedback, (name, seed, feedback)


def test_the_probe_refuses_the_decoder_and_names_what_is_missing():
    for seed in (1, 2):
        assert "Python's own UTF-8 decoder" in verdict(PROBE, {"utf8_prefix_ok": by_decoder}, seed)
        assert "Python's own UTF-8 decoder" in verdict(PROBE, {"utf8_prefix_ok": by_decode_method}, seed)
    assert "not defined" in verdict(PROBE, {}, 0)
    assert "returned None" in verdict(PROBE, {"utf8_prefix_ok": lambda data: None}, 0)
    assert "raised NotImplementedError" in verdict(PROBE, {"utf8_prefix_ok": not_done}, 0)


def test_the_probe_s_inputs_are_fresh_plain_and_weighted_toward_the_boundaries():
    first, second = PROBE.make_inputs(np.random.default_rng(0)), PROBE.make_inputs(np.random.default_rng(1))
    assert is_plain_data(first) and first != second
    cases = [bytes.fromhex(h) for h in first["cases"]]
    valid = sum(map(nb15.reference_utf8_prefix_ok, cases))
    assert 0.25 < valid / len(cases) < 0.75  # neither almost all valid nor almost all broken
    assert {0xE0, 0xED, 0xF0, 0xF4, 0xC0, 0xF5} <= {b for data in cases for b in data}

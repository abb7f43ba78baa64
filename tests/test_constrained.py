"""tfedu.constrained: masking logits, keeping generation inside a regular expression, and inside valid UTF-8.

Oracles: for finite languages, the allowed set at a state is computed from the list of every
string in the language (a token is allowed when the bytes so far plus its bytes begin some
string's UTF-8 bytes); for infinite patterns, token by token with ``regex`` partial matching on
every character a token's unfinished last character could become (no trie, no pruning, no
representatives). Sampled outputs of the course GPT and of a random byte-level model always
decode as strict UTF-8 and fully match. UTF-8 prefixes: Python's strict decoder, with the completions of an
unfinished last character tried (``oracle_prefix_ok``), on every 1- and 2-byte string and many longer ones.
"""

import codecs
import itertools
import json
import time
from functools import lru_cache

import pytest
import regex
import torch

from tfedu.experiments import course_gpt
from tfedu.config import preset
from tfedu.constrained import (
    JSON_AGE,
    UTF8_START,
    RegexConstraint,
    UTF8Constraint,
    UnsatisfiableConstraint,
    _completions,
    bench,
    generate_matching,
    mask_logits,
    utf8_prefix_ok,
    utf8_state,
)
from tfedu.generate import beam_search, generate
from tfedu.model import GPT
from tfedu.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 256 + 9  # after the byte tokenizer's nine merges


def byte_tokenizer() -> Tokenizer:
    """The 256 bytes, a few merges (some across characters, some ending mid-character) and an end token."""
    merges = [(0xC3, 0xA9), (ord('"'), ord("a")), (ord("y"), ord("e")), (258, ord("s")), (0xF0, 0x9F),
              (0xE6, 0x97), (ord("!"), 0xC3), (ord("1"), ord("2")), (ord("a"), ord("b"))]
    return Tokenizer(merges, special_tokens={"<|endoftext|>": EOS})


@pytest.fixture(scope="module")
def course():
    return course_gpt.load()


# ----------------------------------------------------------------------------- mask_logits


def test_mask_logits_sets_disallowed_to_minus_inf_and_the_softmax_renormalises():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    allowed = torch.rand(3, 7, generator=torch.Generator().manual_seed(1)) < 0.5
    allowed[:, 0] = True
    masked = mask_logits(logits, allowed)
    assert torch.equal(masked, torch.where(allowed, logits, torch.tensor(float("-inf"))))
    probs = masked.softmax(-1)
    assert bool((probs[~allowed] == 0).all())
    expected = logits.exp() * allowed / (logits.exp() * allowed).sum(-1, keepdim=True)
    torch.testing.assert_close(probs, expected)
    assert torch.equal(logits, torch.randn(3, 7, generator=torch.Generator().manual_seed(0)))  # input unchanged


def test_mask_logits_bad_inputs_are_named(typechecked):
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"rows \[1\] allow no token"):
        mask_logits(logits, torch.tensor([[True, False, False, False], [False] * 4]))
    with pytest.raises(TypeError, match="allowed must be a bool tensor"):
        mask_logits(logits, torch.ones(2, 4))
    with pytest.raises(TypeError, match="logits must be a float tensor"):
        mask_logits(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"allowed has shape \(2, 3\), logits \(2, 4\)"):
        mask_logits(logits, torch.ones(2, 3, dtype=torch.bool))
    assert typechecked(mask_logits)(logits, torch.ones(2, 4, dtype=torch.bool)).shape == (2, 4)


# ----------------------------------------------------------------------------- the allowed sets against oracles


def digits(k):
    return ["".join(d) for d in itertools.product("0123456789", repeat=k)]


FINITE = {
    JSON_AGE: ['{"age": ' + n + "}" for k in (1, 2, 3) for n in digits(k) if n == "0" or not n.startswith("0")],
    r"(yes|no|maybe)!?": [w + e for w in ("yes", "no", "maybe") for e in ("", "!")],
    r"[ab]{1,4}": ["".join(p) for k in range(1, 5) for p in itertools.product("ab", repeat=k)],
    r"(é|ö)[a-c]|ü{2}|日本|😀{1,2}!?": [x + y for x in "éö" for y in "abc"] + ["üü", "日本"]
    + ["😀" * k + e for k in (1, 2) for e in ("", "!")],
}


def finite_oracle(language: list[str], vocab: dict[int, bytes], eos: int, state: bytes) -> set[int]:
    encoded = {s.encode() for s in language}
    prefixes = {s[:i] for s in encoded for i in range(1, len(s) + 1)}
    allowed = {i for i, token in vocab.items() if i != eos and state + token in prefixes}
    return allowed | ({eos} if state in encoded else set())


@pytest.mark.parametrize("pattern", list(FINITE))
def test_allowed_sets_equal_the_finite_languages_oracle_at_every_state(pattern):
    tok = byte_tokenizer()
    constraint = RegexConstraint(pattern, tok, eos_token_id=EOS)
    encoded = {s.encode() for s in FINITE[pattern]}
    states = sorted({s[:i] for s in encoded for i in range(len(s) + 1)})  # every reachable state, mid-character ones too
    if len(states) > 60:
        states = [states[i] for i in torch.randperm(len(states), generator=torch.Generator().manual_seed(0))[:60]]
    for state in states:
        assert set(constraint.allowed_ids(state)) == finite_oracle(FINITE[pattern], tok.vocab, EOS, state), state
    with pytest.raises(UnsatisfiableConstraint, match="cannot be continued"):
        constraint.allowed_ids(b"zz")


def test_the_course_tokenizer_on_the_json_pattern_equals_the_oracle(course):
    _, tok = course
    eos = tok.special_tokens["<|endoftext|>"]
    constraint = RegexConstraint(JSON_AGE, tok, eos_token_id=eos)
    for state in [b"", b"{", b'{"', b'{"age":', b'{"age": ', b'{"age": 4', b'{"age": 42', b'{"age": 420', b'{"age": 4}']:
        allowed = constraint.allowed_ids(state)
        assert set(allowed) == finite_oracle(FINITE[JSON_AGE], tok.vocab, eos, state), state
    assert constraint.allowed_ids(b'{"age": 4}') == [eos]  # complete and cannot grow: only the end
    assert len(constraint.allowed_ids(b'{"age": 42')) > 10 and eos not in constraint.allowed_ids(b'{"age": 42')


@lru_cache(maxsize=1)
def non_ascii_characters() -> dict[int, list[str]]:
    """Every character outside ASCII, grouped by the first byte of its UTF-8 encoding."""
    by_lead: dict[int, list[str]] = {}
    for code in itertools.chain(range(0x80, 0xD800), range(0xE000, 0x110000)):
        by_lead.setdefault(chr(code).encode()[0], []).append(chr(code))
    return by_lead


def brute_force_viable(pattern: str, data: bytes) -> bool:
    """Some full match's UTF-8 bytes begin with ``data``: tried on every character an unfinished one could become."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            text = data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        tail = data[cut:]
        if not tail:
            return regex.fullmatch(pattern, text, partial=True) is not None
        candidates = (ch for ch in non_ascii_characters().get(tail[0], []) if ch.encode().startswith(tail))
        return any(regex.fullmatch(pattern, text + ch, partial=True) is not None for ch in candidates)
    return False


@pytest.mark.parametrize("pattern, states", [
    (r'"[^"]{0,3}"', [b'"', b'"\xc3', b'"a\xe6\x97', b'"ab"']),
    (r"\w{1,2}-\d", [b"a", b"ab-", b"\xf0\x9f"]),  # \d takes Unicode digits: 𝟎 starts with F0
])
def test_allowed_sets_equal_a_token_by_token_brute_force(pattern, states):
    tok = byte_tokenizer()
    constraint = RegexConstraint(pattern, tok, eos_token_id=EOS)
    # Every token but the lone lead bytes F1..F4 (a quarter million characters each to try, unassigned
    # almost all: F0, kept, already makes the check walk 200k characters where none can follow).
    checked = {i: token for i, token in tok.vocab.items() if token not in (b"\xf1", b"\xf2", b"\xf3", b"\xf4")}
    for state in states:
        try:
            state.decode()
            complete = regex.fullmatch(pattern, state.decode()) is not None
        except UnicodeDecodeError:
            complete = False
        expected = {i for i, token in checked.items() if i != EOS and brute_force_viable(pattern, state + token)}
        expected |= {EOS} if complete else set()
        assert set(constraint.allowed_ids(state)) & set(checked) == expected, state
    if pattern.startswith(r"\w"):  # the lone lead byte F0 can start a digit (U+1D7CE...), F1 (planes 4-7) cannot
        assert 0xF0 in constraint.allowed_ids(b"ab-") and 0xF1 not in constraint.allowed_ids(b"ab-")


def test_completions_are_exactly_the_characters_that_start_with_the_bytes():
    gen = torch.Generator().manual_seed(0)
    codes = torch.cat([torch.randint(0x80, 0x800, (300,), generator=gen), torch.randint(0x800, 0x10000, (300,), generator=gen),
                       torch.randint(0x10000, 0x110000, (300,), generator=gen)]).tolist()
    for code in codes:
        if 0xD800 <= code <= 0xDFFF:
            continue
        encoded = chr(code).encode()
        for k in range(1, len(encoded)):
            span = _completions(encoded[:k])
            assert code in span
            for end in (span.start, span.stop - 1):
                if not 0xD800 <= end <= 0xDFFF:
                    assert chr(end).encode().startswith(encoded[:k]) and len(chr(end).encode()) == len(encoded)


# ----------------------------------------------------------------------------- generation


def decoded_rows(tok, out, prompt_len, eos):
    """Each row's generated text up to its end token (strict UTF-8), and whether it had one."""
    rows = []
    for row in out[:, prompt_len:].tolist():
        finished = eos in row
        rows.append((tok.decode_bytes(row[:row.index(eos)] if finished else row).decode("utf-8", "strict") if finished
                     else tok.decode_bytes(row), finished))
    return rows


PATTERNS = [JSON_AGE, r"(yes|no|maybe)", r"[a-z]{2,6}( [a-z]{2,6}){0,2}\.", r'"[^"\n]{0,8}"',
            r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?"]


def test_sampled_course_gpt_outputs_always_match_and_end_when_complete(course):
    model, tok = course
    eos = tok.special_tokens["<|endoftext|>"]
    prompt = torch.tensor([tok.encode("The value is ")] * 4)
    for pattern in PATTERNS:
        constraint = RegexConstraint(pattern, tok, eos_token_id=eos)
        for seed in range(4):
            constraint.reset()
            out = generate(model, prompt, 24, do_sample=True, temperature=1.0, eos_token_id=eos,
                           generator=torch.Generator().manual_seed(seed), logits_processors=[constraint])
            for text, finished in decoded_rows(tok, out, prompt.shape[1], eos):
                assert finished, (pattern, text)  # every pattern here is complete within 24 tokens
                assert regex.fullmatch(pattern, text), (pattern, text)
                if pattern == JSON_AGE:  # and it is JSON, by an independent parser
                    assert set(json.loads(text)) == {"age"} and isinstance(json.loads(text)["age"], int), text
    # A complete text that cannot grow leaves only the end token; one that can grow keeps both.
    constraint = RegexConstraint(PATTERNS[4], tok, eos_token_id=eos)
    assert constraint.allowed_ids(b"12.34") == [eos]
    assert eos in constraint.allowed_ids(b"12") and len(constraint.allowed_ids(b"12")) > 1


def test_a_random_byte_level_model_cannot_break_utf8_or_the_pattern():
    torch.manual_seed(0)
    model = GPT(preset("tiny").replace(d_vocab=EOS + 1)).eval()
    tok = byte_tokenizer()
    prompt = torch.tensor([[72, 105]] * 6)
    for pattern in [r"(é|ö)[a-c]|ü{2}|日本|😀{1,2}!?", r"\w{1,3}-\d", r'"[^"]{1,4}"']:
        constraint = RegexConstraint(pattern, tok, eos_token_id=EOS)
        for seed in range(3):
            constraint.reset()
            out = generate(model, prompt, 20, do_sample=True, eos_token_id=EOS,
                           generator=torch.Generator().manual_seed(seed), logits_processors=[constraint])
            for text, finished in decoded_rows(tok, out, 2, EOS):
                assert finished and regex.fullmatch(pattern, text), (pattern, text)


def test_generate_matching_beam_search_and_the_cache(course):
    model, tok = course
    eos = tok.special_tokens["<|endoftext|>"]
    constraint = RegexConstraint(JSON_AGE, tok, eos_token_id=eos)
    first = generate_matching(model, tok, "The person is", constraint, max_new_tokens=16)
    assert regex.fullmatch(JSON_AGE, first)
    calls = constraint.regex_calls
    assert generate_matching(model, tok, "The person is", constraint, max_new_tokens=16) == first
    assert constraint.regex_calls == calls  # the same path again: every allowed set was cached
    assert generate_matching(model, tok, "The person is", JSON_AGE, max_new_tokens=16) == first
    with pytest.raises(ValueError, match="no full match within max_new_tokens=3"):
        generate_matching(model, tok, "The person is", JSON_AGE, max_new_tokens=3)
    ids = torch.tensor([tok.encode("Age:")] * 2)
    constraint.reset()
    beams = beam_search(model, ids, 16, num_beams=3, eos_token_id=eos, logits_processors=[constraint])
    for text, finished in decoded_rows(tok, beams, ids.shape[1], eos):
        assert finished and regex.fullmatch(JSON_AGE, text)


def test_bench_returns_times_per_token(course):
    model, tok = course
    numbers = bench(model, tok, "The person is", JSON_AGE, 4, repeats=1)
    assert set(numbers) == {"plain_ms", "cold_ms", "warm_ms", "build_ms", "constrained_tokens"}
    assert all(v > 0 for v in numbers.values()) and 2 <= numbers["constrained_tokens"] <= 4


# ----------------------------------------------------------------------------- errors


def test_an_unsatisfiable_pattern_fails_at_once_with_the_pattern_in_the_message():
    tok = byte_tokenizer()
    start = time.perf_counter()
    with pytest.raises(UnsatisfiableConstraint, match=r"pattern '\(\?!\)': the text generated so far '' cannot be"):
        RegexConstraint(r"(?!)", tok, eos_token_id=EOS)  # matches nothing at all
    with pytest.raises(UnsatisfiableConstraint, match="has no token of the vocabulary"):
        RegexConstraint(r"a(?<=b)", tok, eos_token_id=EOS)  # "" may begin a match, by regex's partial matching
    with pytest.raises(UnsatisfiableConstraint, match="has no token of the vocabulary"):
        RegexConstraint("\ud800", tok, eos_token_id=EOS)  # a lone surrogate: no UTF-8 bytes encode it
    assert time.perf_counter() - start < 2.0
    assert issubclass(UnsatisfiableConstraint, ValueError)
    constraint = RegexConstraint(r"[0-9]+", tok, eos_token_id=EOS, prompt_len=1)
    with pytest.raises(UnsatisfiableConstraint, match=r"pattern '\[0-9\]\+': the text generated so far 'ab'"):
        constraint(torch.tensor([[1, ord("a"), ord("b")]]), torch.zeros(1, EOS + 1))


def test_bad_arguments_are_named(typechecked):
    tok = byte_tokenizer()
    with pytest.raises(TypeError, match="pattern must be a regular expression as a str"):
        RegexConstraint(b"a", tok, eos_token_id=EOS)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        RegexConstraint("a(", tok, eos_token_id=EOS)
    with pytest.raises(TypeError, match="tokenizer must be a tfedu Tokenizer"):
        RegexConstraint("a", object(), eos_token_id=EOS)
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError, match="eos_token_id must be a token id"):
            RegexConstraint("a", tok, eos_token_id=bad)
    with pytest.raises(ValueError, match="is the ordinary token b'a'"):
        RegexConstraint("a", tok, eos_token_id=ord("a"))
    constraint = RegexConstraint("ab?", tok, eos_token_id=EOS)
    with pytest.raises(ValueError, match=f"d_vocab=256, but the tokenizer and eos_token_id use ids up to {EOS}"):
        constraint(torch.tensor([[1]]), torch.zeros(1, 256))
    with pytest.raises(ValueError, match="the same batch"):
        constraint(torch.tensor([[1]]), torch.zeros(2, EOS + 1))
    out = typechecked(constraint.__call__)(torch.tensor([[1, 2]]), torch.zeros(1, EOS + 1))  # prompt of 2 taken from this call
    assert out.isfinite().nonzero()[:, 1].tolist() == [ord("a"), 264]  # "a" and the merged "ab"
    with pytest.raises(ValueError, match="call reset"):
        constraint(torch.tensor([[1]]), torch.zeros(1, EOS + 1))
    model = GPT(preset("tiny").replace(d_vocab=EOS + 1))
    with pytest.raises(ValueError, match="prompt must be a non-empty str"):
        generate_matching(model, tok, "", "a", max_new_tokens=2)
    with pytest.raises(ValueError, match="pass eos_token_id"):
        generate_matching(model, Tokenizer([]), "x", "a", max_new_tokens=2)


# ----------------------------------------------------------------------------- UTF-8 prefixes

# Oracle: Python's strict incremental decoder. With final=False it raises on bytes no continuation can repair, but
# it lags at one place: after ED it accepts A0..BF (a surrogate's second byte) and raises only at the third byte.
# So a byte string is judged a valid prefix when the decoder takes it (final=False) and some completion of its
# unfinished last character by continuation bytes decodes with final=True; the completions are drawn from the
# ends of the table's ranges (80, 8F, 90, 9F, A0, BF), which stand for every continuation byte.
ENDS = (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)
TABLE_BYTES = (0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xC3, 0xDF, 0xE0, 0xE1, 0xEC,
               0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xF7, 0xF8, 0xFE, 0xFF)


def oracle_prefix_ok(data: bytes) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return False
    tail = decoder.getstate()[0]
    if not tail:
        return True
    for n in range(1, 4):
        for completion in itertools.product(ENDS, repeat=n):
            try:
                (tail + bytes(completion)).decode("utf-8", "strict")
                return True
            except UnicodeDecodeError:
                pass
    return False


def test_the_oracle_is_needed_because_the_incremental_decoder_lags_after_ed():
    lagging = codecs.getincrementaldecoder("utf-8")(errors="strict")
    assert lagging.decode(b"\xed\xa0", final=False) == ""  # no error yet: a surrogate's first two bytes
    assert not oracle_prefix_ok(b"\xed\xa0") and not utf8_prefix_ok(b"\xed\xa0")
    with pytest.raises(UnicodeDecodeError):
        lagging.decode(b"\x80", final=False)


def test_utf8_prefix_ok_equals_the_oracle_on_every_1_and_2_byte_string():
    for a in range(256):
        assert utf8_prefix_ok(bytes([a])) == oracle_prefix_ok(bytes([a])), hex(a)
        for b in range(256):
            data = bytes([a, b])
            assert utf8_prefix_ok(data) == oracle_prefix_ok(data), data.hex(" ")


def test_utf8_prefix_ok_equals_the_oracle_on_boundary_and_random_3_and_4_byte_strings():
    for data in map(bytes, itertools.product(TABLE_BYTES, repeat=3)):
        assert utf8_prefix_ok(data) == oracle_prefix_ok(data), data.hex(" ")
    g = torch.Generator().manual_seed(0)
    table = torch.tensor(TABLE_BYTES)
    for _ in range(20000):
        n = int(torch.randint(3, 5, (), generator=g))
        pick = torch.where(torch.rand(n, generator=g) < 0.6, table[torch.randint(len(TABLE_BYTES), (n,), generator=g)],
                           torch.randint(0, 256, (n,), generator=g))
        data = bytes(pick.tolist())
        assert utf8_prefix_ok(data) == oracle_prefix_ok(data), data.hex(" ")


def test_the_table_s_boundaries_and_every_prefix_of_real_text():
    for code in (0, 0x7F, 0x80, 0x7FF, 0x800, 0xFFF, 0x1000, 0xCFFF, 0xD000, 0xD7FF, 0xE000, 0xFFFF, 0x10000,
                 0x3FFFF, 0x40000, 0xFFFFF, 0x100000, 0x10FFFF):
        encoded = chr(code).encode()
        assert all(utf8_prefix_ok(encoded[:k]) for k in range(len(encoded) + 1)), hex(code)
        assert utf8_state(encoded) == UTF8_START
    for bad in ("c0 80", "c1 bf", "e0 80", "e0 9f bf", "ed a0", "ed bf bf", "f0 80", "f0 8f bf bf", "f4 90",
                "f4 bf bf bf", "f5", "f8 88 80 80 80", "fe", "ff", "80", "61 bf", "c3 a9 80", "c3 41", "e2 82 41",
                "c3 c3", "f0 9f 98 f0"):
        assert not utf8_prefix_ok(bytes.fromhex(bad)), bad
        assert not oracle_prefix_ok(bytes.fromhex(bad)), bad
    text = "Grüße, 世界 🌍 \u07ff\u0800\ud7ff\ue000\uffff\U00010000\U0010ffff".encode()
    assert all(utf8_prefix_ok(text[:k]) for k in range(len(text) + 1))
    assert utf8_state(text[:-1]) == 1 and utf8_state(b"\xe0") == 4 and utf8_state(b"\xf4\x8f") == 2


def brute_force_allowed(tok, generated: bytes, eos: int | None) -> list[int]:
    """Every ordinary token whose bytes after ``generated`` the oracle takes, and the end token after complete text."""
    specials = set(tok.special_tokens.values())
    allowed = [t for t, b in tok.vocab.items() if t not in specials and oracle_prefix_ok(generated + b)]
    if eos is not None and _complete(generated):
        allowed.append(eos)
    return sorted(allowed)


def _complete(data: bytes) -> bool:
    try:
        data.decode("utf-8", "strict")
        return True
    except UnicodeDecodeError:
        return False


def regex_prefix_ok(data: bytes) -> bool:
    """Another predicate: the table as a byte regular expression, with partial matching."""
    return regex.fullmatch(rb"(?:[\x00-\x7f]|[\xc2-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]|[\xe1-\xec\xee\xef]"
                           rb"[\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3]"
                           rb"[\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2})*", data, partial=True) is not None


UTF8_STATES_TEXT = [b"", b"a", "é".encode(), b"\xc3", b"\xe0", b"\xe0\xa0", b"\xed", b"\xed\x9f", b"\xe2\x82",
                    b"\xf0", b"\xf0\x9f", b"\xf0\x9f\x98", b"\xf4", b"\xf4\x8f\xbf", "ab€".encode()[:-1], "日".encode()]


@pytest.mark.parametrize("prefix_ok", [None, utf8_prefix_ok, regex_prefix_ok], ids=["automaton", "predicate", "regex"])
def test_utf8_allowed_sets_equal_the_brute_force_oracle(prefix_ok):
    tok = byte_tokenizer()
    utf8 = UTF8Constraint(tok, eos_token_id=EOS, prefix_ok=prefix_ok)
    for generated in UTF8_STATES_TEXT:
        assert utf8.allowed_ids(generated) == brute_force_allowed(tok, generated, EOS), generated
    assert utf8.allowed_ids(b"\xe0")[:2] == [0xA0, 0xA1] and EOS not in utf8.allowed_ids(b"\xe0")
    without_eos = UTF8Constraint(tok, prefix_ok=prefix_ok)
    assert EOS not in without_eos.allowed_ids(b"a") and len(without_eos.allowed_ids(b"a")) == len(utf8.allowed_ids(b"a")) - 1
    with pytest.raises(ValueError, match="can no longer become valid UTF-8"):
        utf8.allowed_ids(b"\x80")


def test_utf8_the_course_tokenizer_s_sets_equal_the_oracle_and_the_walks_are_cached(course):
    _, tok = course
    eos = tok.special_tokens["<|endoftext|>"]
    automaton, predicate = UTF8Constraint(tok, eos_token_id=eos), UTF8Constraint(tok, eos_token_id=eos, prefix_ok=utf8_prefix_ok)
    for generated in UTF8_STATES_TEXT:
        want = brute_force_allowed(tok, generated, eos)
        assert automaton.allowed_ids(generated) == want == predicate.allowed_ids(generated), generated
    walks = automaton.walks
    assert automaton.allowed_ids(b"xyz") == automaton.allowed_ids(b"") and automaton.walks == walks <= 8


def sampled_bytes(tok, out, prompt_len, eos):
    """Each row's generated bytes up to its end token, and whether it ended."""
    rows = []
    for row in out[:, prompt_len:].tolist():
        rows.append((tok.decode_bytes(row[:row.index(eos)] if eos in row else row), eos in row))
    return rows


def test_sampling_a_random_byte_level_model_with_the_utf8_processor_always_decodes():
    torch.manual_seed(0)
    model = GPT(preset("tiny").replace(d_vocab=EOS + 1)).eval()
    tok = byte_tokenizer()
    prompt = torch.tensor([[72, 105]] * 16)
    broken = 0
    for seed in range(4):
        free = generate(model, prompt, 12, do_sample=True, temperature=2.0, generator=torch.Generator().manual_seed(seed))
        broken += sum(not oracle_prefix_ok(data) for data, _ in sampled_bytes(tok, free, 2, EOS))
        for prefix_ok in (None, utf8_prefix_ok):
            utf8 = UTF8Constraint(tok, eos_token_id=EOS, prefix_ok=prefix_ok)
            out = generate(model, prompt, 12, do_sample=True, temperature=2.0, eos_token_id=EOS,
                           generator=torch.Generator().manual_seed(seed), logits_processors=[utf8])
            for data, ended in sampled_bytes(tok, out, 2, EOS):
                for k in range(len(data) + 1):  # every step's text decodes (final=False) ...
                    codecs.getincrementaldecoder("utf-8")(errors="strict").decode(data[:k], final=False)
                assert oracle_prefix_ok(data), data  # ... and the end is a valid prefix
                if ended:
                    data.decode("utf-8", "strict")  # an ended text is complete
    assert broken > 0  # without the processor, the random model does write invalid UTF-8


def test_utf8_composes_with_a_regex_constraint():
    torch.manual_seed(0)
    model = GPT(preset("tiny").replace(d_vocab=EOS + 1)).eval()
    tok = byte_tokenizer()
    prompt = torch.tensor([[72, 105]] * 4)
    pattern = r"(é|ö)[a-c]|ü{2}|日本|😀{1,2}!?"
    for seed in range(2):
        rule, utf8 = RegexConstraint(pattern, tok, eos_token_id=EOS), UTF8Constraint(tok, eos_token_id=EOS)
        both = generate(model, prompt, 10, do_sample=True, eos_token_id=EOS, generator=torch.Generator().manual_seed(seed),
                        logits_processors=[utf8, rule])
        rule.reset()
        alone = generate(model, prompt, 10, do_sample=True, eos_token_id=EOS, generator=torch.Generator().manual_seed(seed),
                         logits_processors=[rule])
        assert torch.equal(both, alone)  # the pattern's text is UTF-8 already: the intersection changes nothing


def test_utf8_bad_arguments_are_named(typechecked):
    tok = byte_tokenizer()
    with pytest.raises(TypeError, match="data must be bytes"):
        utf8_prefix_ok("é")
    with pytest.raises(ValueError, match="state must be one of"):
        utf8_state(b"", 8)
    with pytest.raises(TypeError, match="tokenizer must be a tfedu Tokenizer"):
        UTF8Constraint(object())
    with pytest.raises(ValueError, match="is the ordinary token b'a'"):
        UTF8Constraint(tok, eos_token_id=ord("a"))
    with pytest.raises(TypeError, match="prefix_ok must be None or a function"):
        UTF8Constraint(tok, prefix_ok="utf-8")
    utf8 = UTF8Constraint(tok, eos_token_id=EOS)
    with pytest.raises(ValueError, match="d_vocab=256"):
        utf8(torch.tensor([[1]]), torch.zeros(1, 256))
    out = typechecked(utf8.__call__)(torch.tensor([[1, 2]]), torch.zeros(1, EOS + 1))
    assert out.isfinite().sum() == len(brute_force_allowed(tok, b"", EOS))
    with pytest.raises(ValueError, match="can no longer become valid UTF-8"):
        utf8(torch.tensor([[1, 2, 0x80]]), torch.zeros(1, EOS + 1))
    with pytest.raises(ValueError, match="call reset"):
        utf8(torch.tensor([[1]]), torch.zeros(1, EOS + 1))

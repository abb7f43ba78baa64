"""Checkers for notebooks/01_tokenization.ipynb.

Six exercises: counting adjacent pairs, merging one pair, the BPE training loop, UTF-8 by
hand, the GPT-2 pre-tokenization regex, and encoding with learned merges. Each checker tries the known mistakes first so
its hint names the mistake.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import regex

from tfedu.checks.core import CheckFailure, Hints, Probe, call_learner, checker, expect
from tfedu.tokenizer import GPT2_PATTERN, GPT4_PATTERN, Tokenizer, get_pair_counts, merge_pair, pretokenize, train_bpe
from tfedu.tokenizer import merge_pair as reference_merge_pair

# The lecture's worked example with a..z = 1..26 (only the 11-letter string fits its numbers).
DECK_TEXT = "aaabdaaabac"
DECK_IDS = [1, 1, 1, 2, 4, 1, 1, 1, 2, 1, 3]
DECK_COUNTS = {"aa": 4, "ab": 2, "bd": 1, "da": 1, "ba": 1, "ac": 1}
DECK_MERGES = [(1, 1), (1, 2), (27, 28)]
DECK_FINAL = [29, 4, 29, 1, 3]
DECK_SENTENCE = "Hello world I've learned to loveee! tokenization, I'M NOW THE #1Fan "


def reference_learn_bpe(ids: Sequence[int], n_merges: int, first_id: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The plain recount-everything loop: merge the most frequent pair (ties: smaller ids) ``n_merges`` times.

    Built from ``tfedu.tokenizer``'s pair counting and merging; tests check it against
    ``tfedu.tokenizer.train_bpe_naive`` on bytes.

    >>> reference_learn_bpe(DECK_IDS, 3, 27)
    ([(1, 1), (1, 2), (27, 28)], [29, 4, 29, 1, 3])
    """
    ids, merges = list(ids), []
    for k in range(n_merges):
        counts = get_pair_counts(ids)
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        ids = merge_pair(ids, pair, first_id + k)
        merges.append(pair)
    return merges, ids


# --- the usual mistakes, written out so the checkers can recognise their outputs -------------


def _pairs_chunked(ids):  # zip(ids[::2], ids[1::2]): pairs that do not overlap
    return dict(Counter(zip(ids[0::2], ids[1::2])))


def _pairs_non_overlapping(ids):  # like str.count: a pair cannot reuse the previous pair's right half
    counts: Counter = Counter()
    for pair in set(zip(ids, ids[1:])):
        i = 0
        while i < len(ids) - 1:
            if (ids[i], ids[i + 1]) == pair:
                counts[pair] += 1
                i += 2
            else:
                i += 1
    return dict(counts)


def _pairs_missing_last(ids):  # range(len(ids) - 2)
    return dict(Counter(zip(ids[:-2], ids[1:-1]))) if len(ids) > 2 else {}


def _pairs_wrapped(ids):  # (last, first) counted as if the list were a circle
    return dict(Counter(zip(ids, list(ids[1:]) + list(ids[:1])))) if ids else {}


def _pairs_presence(ids):  # {pair: 1}: which pairs occur, not how often
    return {pair: 1 for pair in zip(ids, ids[1:])}


def _merge_keeping_right(ids, pair, new_id):  # appends new_id and then the pair's right id too
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == tuple(pair):
            out += [new_id, ids[i + 1]]
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _merge_not_advancing(ids, pair, new_id):  # i += 1 after a merge
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
        else:
            out.append(ids[i])
        i += 1
    return out


def _merge_overlapping(ids, pair, new_id):  # every overlapping occurrence becomes a token
    starts = {i for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) == pair}
    return [new_id if j in starts else ids[j] for j in range(len(ids)) if j in starts or j - 1 not in starts]


def _merge_right_to_left(ids, pair, new_id):
    reversed_out = merge_pair(list(ids)[::-1], (pair[1], pair[0]), new_id)
    return reversed_out[::-1]


def _merge_dropping_last(ids, pair, new_id):  # while i < len(ids) - 1, and nothing after the loop
    out, i = [], 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _merge_first_only(ids, pair, new_id):  # return right after the first replacement
    for i in range(len(ids) - 1):
        if (ids[i], ids[i + 1]) == tuple(pair):
            return list(ids[:i]) + [new_id] + list(ids[i + 2:])
    return list(ids)


def _merge_nothing(ids, pair, new_id):  # e.g. [ids[i], ids[i + 1]] == pair: a list never equals a tuple
    return list(ids)


def _learn_with(choose: Callable[[dict], tuple[int, int]], ids, n_merges, first_id, *, id_offset=0):
    ids, merges = list(ids), []
    for k in range(n_merges):
        counts = get_pair_counts(ids)
        if not counts:
            break
        pair = choose(counts)
        ids = merge_pair(ids, pair, first_id + k + id_offset)
        merges.append(pair)
    return merges, ids


def _learn_same_id(ids, n_merges, first_id):  # every merge gets first_id
    ids, merges = list(ids), []
    for _ in range(n_merges):
        counts = get_pair_counts(ids)
        if not counts:
            break
        pair = _smallest_pair(counts)
        ids = merge_pair(ids, pair, first_id)
        merges.append(pair)
    return merges, ids


def _first_seen(counts):  # max() over a dict keeps the first pair seen among equals
    return max(counts, key=counts.get)


def _largest_pair(counts):
    return max(counts, key=lambda p: (counts[p], p))


def _smallest_pair(counts):
    return min(counts, key=lambda p: (-counts[p], p))


def _learn_stale_counts(ids, n_merges, first_id):  # counted once, then merged in that order
    counts = get_pair_counts(list(ids))
    order = sorted(counts, key=lambda p: (-counts[p], p))[:n_merges]
    merges, out = [], list(ids)
    for k, pair in enumerate(order):
        out = merge_pair(out, pair, first_id + k)
        merges.append(pair)
    return merges, out


# --- helpers ------------------------------------------------------------------------------


def _as_int_list(value: Any, what: str) -> list[int]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if value is None:
        raise CheckFailure(f"{what} returned None: build a new list and `return` it")
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise CheckFailure(f"{what} should return a list of ints, got {type(value).__name__}")
    out = []
    for item in value:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
            raise CheckFailure(f"{what} should return a list of ints, found {item!r} ({type(item).__name__})")
        out.append(int(item))
    return out


def _as_pair_counts(value: Any, what: str) -> dict[tuple[int, int], int]:
    if value is None:
        raise CheckFailure(f"{what} returned None: return the dict of counts")
    if not isinstance(value, Mapping):
        raise CheckFailure(f"{what} should return a dict {{(a, b): count}}, got {type(value).__name__}")
    out = {}
    for key, count in value.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise CheckFailure(f"{what}: keys should be tuples (a, b) of two ids, found {key!r}")
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise CheckFailure(f"{what}: counts should be ints, found {count!r} for {key}")
        if count:
            out[(int(key[0]), int(key[1]))] = int(count)
    return out


def _match(got: Any, expected: Any, what: str, mistakes: Mapping[str, Any]) -> None:
    if got == expected:
        return
    for hint, wrong in mistakes.items():
        if got == wrong and wrong != expected:
            raise CheckFailure(f"{what}: {hint}")
    raise CheckFailure(f"{what} gave {got!r}, expected {expected!r}")


# --- exercise 1.1 ---------------------------------------------------------------------------

PAIR_MISTAKES = {
    "you counted non-overlapping pairs; every adjacent pair counts, so [a, a, a] has ('a','a') twice "
    "(positions 0-1 and 1-2): pair every id with the one right after it, moving one position at a time": (
        _pairs_chunked, _pairs_non_overlapping),
    "the last pair is missing (off by one): a list of n ids has n - 1 adjacent pairs": (_pairs_missing_last,),
    "you counted a pair (last, first) that wraps around; the sequence is not a circle": (_pairs_wrapped,),
    "every count is 1: you recorded which pairs occur, not how many times; add 1 each time a pair is seen":
        (_pairs_presence,),
}


def _pair_cases(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [DECK_IDS, [97, 97, 97], [5, 5, 5, 5, 5], [1, 2, 1, 2, 1], rng.integers(0, 6, 40).tolist(), [7], []]


@checker("adjacent pair counts")
def check_get_pair_counts(get_pair_counts) -> None:
    """Check ``get_pair_counts(ids) -> {(a, b): count}`` on the deck's example and harder cases."""
    for ids in _pair_cases():
        what = f"get_pair_counts({ids if len(ids) <= 12 else '<40 random ids>'})"
        got = _as_pair_counts(call_learner(get_pair_counts, list(ids), name="get_pair_counts"), what)
        expected = dict(Counter(zip(ids, ids[1:])))
        for hint, fns in PAIR_MISTAKES.items():
            for fn in fns:
                if got == fn(ids) and got != expected:
                    raise CheckFailure(f"{what}: {hint}")
        _match(got, expected, what, mistakes={})
    letters = "abcdefghijklmnopqrstuvwxyz"
    deck = _as_pair_counts(call_learner(get_pair_counts, list(DECK_IDS), name="get_pair_counts"), "get_pair_counts")
    named = {letters[a - 1] + letters[b - 1]: n for (a, b), n in deck.items()}
    expect(named == DECK_COUNTS, f"on the deck's ids the counts by letters should be {DECK_COUNTS}, got {named}")


# --- exercise 1.2 ---------------------------------------------------------------------------

MERGE_MISTAKES = {
    "you replaced overlapping pairs: in [a, a, a] only one (a, a) can merge, leaving [Z, a]; after a merge, "
    "skip both of its ids (move on by two positions)": _merge_overlapping,
    "you did not advance past the merged pair: after appending new_id, move i forward by 2, not 1, so the "
    "pair's right half is not used again": _merge_not_advancing,
    "you merged from right to left; BPE merges left to right, so [a, a, a] becomes [Z, a], not [a, Z]": _merge_right_to_left,
    "the last id went missing: when the loop stops at len(ids) - 1, append the final id too": _merge_dropping_last,
    "the new id replaces both ids of the pair; you kept the pair's right id as well": _merge_keeping_right,
    "only the first occurrence was replaced: keep scanning to the end of the list, replacing every "
    "occurrence (do not return inside the loop)": _merge_first_only,
    "nothing was merged, though the pair occurs: check your comparison; `pair` is a tuple, so compare it "
    "with a tuple of the two adjacent ids (a list [x, y] never equals a tuple (x, y))": _merge_nothing,
}


def _merge_cases(seed: int = 0) -> list[tuple[list[int], tuple[int, int], int]]:
    rng = np.random.default_rng(seed)
    random_ids = rng.integers(0, 4, 50).tolist()
    return [
        ([97, 97, 97], (97, 97), 256),
        ([1, 1, 1, 1, 1], (1, 1), 27),
        (DECK_IDS, (1, 1), 27),
        ([27, 1, 2, 4, 27, 1, 2, 1, 3], (1, 2), 28),
        ([3, 1, 2], (1, 2), 9),
        ([1, 2, 3], (1, 2), 9),
        ([5, 6, 7], (7, 5), 9),
        (random_ids, (1, 1), 300),
        (random_ids, (2, 3), 301),
        ([], (1, 2), 9),
        ([4], (4, 4), 9),
    ]


@checker("merge one pair")
def check_merge_pair(merge_pair) -> None:
    """Check ``merge_pair(ids, pair, new_id)``: left to right, non-overlapping, input untouched."""
    for ids, pair, new_id in _merge_cases():
        given = list(ids)
        what = f"merge_pair({ids if len(ids) <= 12 else '<50 random ids>'}, {pair}, {new_id})"
        got = call_learner(merge_pair, given, pair, new_id, name="merge_pair")
        expect(given == ids, f"{what} changed the list you were given; build and return a new list instead")
        got = _as_int_list(got, what)
        expected = reference_merge_pair(list(ids), pair, new_id)
        _match(got, expected, what, {hint: fn(ids, pair, new_id) for hint, fn in MERGE_MISTAKES.items()})


# --- exercise 1.3 ---------------------------------------------------------------------------


def _looks_like_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in value)


def _looks_like_pairs(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value)


TIE_HINT = (
    "wrong tie-break: when two pairs are equally frequent, take the pair with the smaller ids (compare the "
    "pairs themselves, first id first); the deck merges ab=(1, 2) rather than Za=(27, 1) at step 2"
)
LEARN_MISTAKES = {
    TIE_HINT + " (max(counts, key=counts.get) keeps whichever equal pair came first)": (
        lambda ids, n, f: _learn_with(_first_seen, ids, n, f),
        lambda ids, n, f: _learn_with(_largest_pair, ids, n, f),
    ),
    "you counted the pairs once and merged them in that order; recount the pairs of the current ids after "
    "every merge, since each merge creates new pairs (Z, Y) and removes old ones": (_learn_stale_counts,),
    "the new ids are off by one: the k-th merge (k = 0, 1, ...) gets first_id + k": (
        lambda ids, n, f: _learn_with(_smallest_pair, ids, n, f, id_offset=1),
    ),    "every merge got the same new id: each merge makes a new token, so the k-th merge (k = 0, 1, ...) gets "
    "first_id + k": (_learn_same_id,),
}


def _learn_cases(seed: int = 0) -> list[tuple[list[int], int, int]]:
    rng = np.random.default_rng(seed)
    return [
        (DECK_IDS, 3, 27),
        (list(DECK_TEXT.encode()), 3, 256),
        (rng.integers(0, 3, 30).tolist(), 5, 3),
        (list(b"low lower lowest newer wider"), 6, 256),
        ([1, 2], 3, 27),  # runs out of pairs after one merge
        ([1, 3, 9, 1, 2], 1, 10),  # four pairs tie at one: the smaller pair, (1, 2), wins on its second id
    ]


@checker("BPE training loop")
def check_learn_bpe(learn_bpe) -> None:
    """Check ``learn_bpe(ids, n_merges, first_id) -> (merges, final_ids)`` against the deck and more."""
    for ids, n_merges, first_id in _learn_cases():
        what = f"learn_bpe({ids if len(ids) <= 12 else '<' + str(len(ids)) + ' ids>'}, {n_merges}, {first_id})"
        merges, final = reference_learn_bpe(ids, n_merges, first_id)
        runs_out = len(merges) < n_merges
        got = call_learner(
            learn_bpe, list(ids), n_merges, first_id, name="learn_bpe",
            error_hint="this input runs out of pairs before n_merges: stop early, leaving the loop as soon as "
                       "the counts come back empty" if runs_out else "",
        )
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailure(f"{what} should return a tuple (merges, ids), got {type(got).__name__}")
        merges_got, ids_got = got
        if _looks_like_ids(merges_got) and _looks_like_pairs(ids_got) and ids_got:
            raise CheckFailure(f"{what}: you returned (ids, merges); return (merges, ids), in that order")
        if merges_got is None or isinstance(merges_got, (str, bytes)) or not isinstance(merges_got, Sequence):
            raise CheckFailure(f"{what}: merges should be a list of (a, b) tuples, got {type(merges_got).__name__}")
        try:
            merges_got = [(int(a), int(b)) for a, b in merges_got]
        except (TypeError, ValueError):
            raise CheckFailure(f"{what}: merges should be a list of (a, b) pairs of ids") from None
        ids_got = _as_int_list(ids_got, what + "[1]")
        if len(merges_got) != len(merges):
            raise CheckFailure(
                f"{what} made {len(merges_got)} merges, expected {len(merges)} "
                f"(n_merges of them, or fewer only when no pair is left)"
            )
        if (merges_got, ids_got) != (merges, final):
            for hint, fns in LEARN_MISTAKES.items():
                if any((merges_got, ids_got) == fn(ids, n_merges, first_id) for fn in fns):
                    raise CheckFailure(f"{what}: {hint}")
        _match((merges_got, ids_got), (merges, final), what, {})


# --- exercise 1.4 ---------------------------------------------------------------------------

# The last code point of each UTF-8 length and the first of the next (U+007F/0080, U+07FF/0800,
# U+FFFF/10000, U+10FFFF): a hand-written encoder with `<` for `<=` fails exactly there.
UTF8_BOUNDARIES = "\x7f\x80\u07ff\u0800\uffff\U00010000\U0010ffff"
UTF8_TEXTS = ["G", "ü", "Hello", "naïve café", "日本語", "🙂 ok", "ß∑𝄞", "", UTF8_BOUNDARIES]
# Invalid sequences a hand-written decoder must replace, not accept: overlong (E0 80 80, F0 80 80 80,
# C0 AF), a surrogate (ED A0 80), above U+10FFFF (F4 90 80 80), a byte that never starts a
# character (F5), a truncated character (E2 82).
UTF8_INVALID = [[0xE0, 0x80, 0x80], [0xED, 0xA0, 0x80], [0xF0, 0x80, 0x80, 0x80], [0xF4, 0x90, 0x80, 0x80], [0xF5, 0x80],
                [0xE2, 0x82]]
UTF8_BYTES = [[71], [195, 188], [128], [104, 105, 255], [226, 130], [240, 159, 153, 130], [0xC0, 0xAF], [],
              [byte for sequence in UTF8_INVALID for byte in sequence + [65]]]


@checker("UTF-8 by hand")
def check_utf8(utf8_encode, utf8_decode) -> None:
    """Check ``utf8_encode(text) -> list[int]`` and ``utf8_decode(ids) -> str`` (invalid bytes replaced)."""
    for text in UTF8_TEXTS:
        what = f"utf8_encode({text!r})"
        got = _as_int_list(call_learner(utf8_encode, text, name="utf8_encode"), what)
        _match(got, list(text.encode("utf-8")), what, {
            "you returned code points (ord(c)), not UTF-8 bytes: encode the text to bytes first, then list them": [ord(c) for c in text],
            "you encoded with UTF-16; the course's bytes are UTF-8": list(text.encode("utf-16-le")),
            "you encoded with UTF-16 (its first two bytes, 255 254, are a byte-order mark); the course's bytes "
            "are UTF-8": list(text.encode("utf-16")),
        })
    for ids in UTF8_BYTES:
        what = f"utf8_decode({ids})"
        try:
            got = utf8_decode(list(ids))
        except UnicodeDecodeError:
            raise CheckFailure(
                f"{what} raised UnicodeDecodeError: a model can emit any bytes, so decode with "
                "errors='replace' (errors='strict', the default, raises)"
            ) from None
        except NotImplementedError:
            raise
        except Exception as err:
            raise CheckFailure(f"{what} raised {type(err).__name__}: {err}") from None
        expect(isinstance(got, str), f"{what} should return a str, got {type(got).__name__}")
        _match(got, bytes(ids).decode("utf-8", errors="replace"), what, {
            "you decoded as latin-1 (or chr() per byte), which turns each byte into one character ([195, 188] "
            "gives 'Ã¼', not 'ü'); decode as UTF-8 with errors='replace'": bytes(ids).decode("latin-1"),
            "you decoded each byte on its own; a character can take 2 to 4 bytes ([195, 188] is one 'ü'), so "
            "decode the whole bytes(ids) at once": "".join(bytes([i]).decode("utf-8", errors="replace") for i in ids),
            "you dropped the invalid bytes (errors='ignore'); replace them with '\\ufffd' (errors='replace') so "
            "a reader sees that something was there": bytes(ids).decode("utf-8", errors="ignore"),
        })


# --- exercise 1.5 ---------------------------------------------------------------------------

SPLIT_TEXTS = [
    DECK_SENTENCE,
    "I'm here",
    "I'M HERE",
    "we'll see, they'd've",
    "1999 + 12345 = x",
    "a   b\n\n  c",
    "    return x  ",
    "Hello world! Hello world.",
    "Ünïcode ok — 東京 42",
    "x² + H₂O = ½ Ⅻ cafe\u0301",  # numbers that are not digits (\p{N}) and a combining accent
    "!½ #Ⅻ",  # punctuation right before such a number: [^\s\p{L}\d] would take the number too
    "a\tb\nc\t#",  # a tab or newline before a word is its own piece: ` ?` is a space, not any whitespace
    'Wait... what?! print("ok")  # done',
]
_SPLIT_PIECES = {
    "contractions": r"'s|'t|'re|'ve|'m|'ll|'d",
    "letters": r" ?\p{L}+",
    "numbers": r" ?\p{N}+",
    "other": r" ?[^\s\p{L}\p{N}]+",
    "spaces_before": r"\s+(?!\S)",
    "spaces": r"\s+",
}


def _variant(*order: str, flags: int = 0) -> Callable[[str], list[str]]:
    compiled = regex.compile("|".join(_SPLIT_PIECES[name] for name in order), flags)
    return compiled.findall


def _without_plus(branch: str) -> Callable[[str], list[str]]:  # one character where a run belongs
    pieces = {**_SPLIT_PIECES, branch: _SPLIT_PIECES[branch].removesuffix("+")}
    return regex.compile("|".join(pieces.values())).findall


SPLIT_MISTAKES = {
    "you matched case-insensitively: GPT-2's pattern has no ignore-case flag, so \"I'M\" splits as "
    "[' I', \"'\", 'M'] while \"I'm\" gives [' I', \"'m\"]": _variant(*_SPLIT_PIECES, flags=regex.IGNORECASE),
    "the contractions must come first in the alternation: otherwise \"'ve\" is matched by the "
    "punctuation branch as \"'\" + 've'": _variant("letters", "numbers", "other", "contractions", "spaces_before", "spaces"),
    "without \\s+(?!\\S) a run of spaces swallows the space the next word needs: 'a   b' should give "
    "['a', '  ', ' b']": _variant("contractions", "letters", "numbers", "other", "spaces"),
    "letters, numbers and punctuation take one optional leading space ( ?): ' world' is one piece":
        regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+").findall,
    "a `+` is missing: letters, numbers and other symbols each match a run (one or more), so "
    "'loveee' and '...' are one piece each, not one per character": tuple(
        _without_plus(branch) for branch in ("letters", "numbers", "other")),
    "`[^s\\p{L}\\p{N}]` has lost a backslash (a typo in the deck's slide): `s` there is the letter s, so "
    "this branch now also swallows spaces and newlines; write `[^\\s\\p{L}\\p{N}]`, not whitespace, "
    "not a letter, not a number": regex.compile(GPT2_PATTERN.replace(r"[^\s\p{L}", r"[^s\p{L}")).findall,
    "you split on whitespace and dropped it; the pieces, joined with nothing between them, must give back the "
    "exact text":
        str.split,
}


@checker("GPT-2 pre-tokenization")
def check_gpt2_split(gpt2_split) -> None:
    """Check ``gpt2_split(text) -> list[str]`` against GPT-2's split pattern, I'M included."""
    reference = regex.compile(GPT2_PATTERN).findall
    for text in SPLIT_TEXTS:
        what = f"gpt2_split({text!r})"
        try:
            got = gpt2_split(text)
        except NotImplementedError:
            raise
        except Exception as err:
            if "bad escape" in str(err) and "\\p" in str(err):
                raise CheckFailure(
                    "Python's built-in `re` does not know \\p{L} (any letter) or \\p{N} (any number); "
                    "`import regex` and use regex.findall"
                ) from None
            raise CheckFailure(f"{what} raised {type(err).__name__}: {err}") from None
        if not isinstance(got, list) or not all(isinstance(piece, str) for piece in got):
            raise CheckFailure(f"{what} should return a list of str, got {got!r}")
        expected = reference(text)
        if got != expected:
            for hint, fns in SPLIT_MISTAKES.items():
                if any(got == fn(text) for fn in (fns if isinstance(fns, tuple) else (fns,))):
                    raise CheckFailure(f"{what}: {hint}")
        _match(got, expected, what, {})


# --- exercise 1.6: encoding with learned merges -----------------------------------------------


def reference_bpe_encode(text: str, merges: Sequence[tuple[int, int]]) -> list[int]:
    """Encode ``text`` with ``merges`` (merge ``r`` makes id ``256 + r``) after GPT-4's split.

    >>> reference_bpe_encode("abc ab", [(97, 98), (256, 99)])
    [257, 32, 256]
    """
    return Tokenizer([tuple(m) for m in merges], pattern="gpt4").encode_ordinary(text)


def tiktoken_encode(text: str, merges: Sequence[tuple[int, int]]) -> list[int] | None:
    """The same ids from tiktoken, built offline from these merges' ranks; None if tiktoken is missing."""
    try:
        import tiktoken
    except ImportError:
        return None
    ranks = Tokenizer([tuple(m) for m in merges]).mergeable_ranks()
    return tiktoken.Encoding("learner-merges", pat_str=GPT4_PATTERN, mergeable_ranks=ranks, special_tokens={}).encode_ordinary(text)


def _encode_words(text, merges, encode_word, *, split=True, start=lambda w: list(w.encode("utf-8"))):
    words = regex.findall(GPT4_PATTERN, text) if split else ([text] if text else [])
    ranks = {tuple(pair): rank for rank, pair in enumerate(merges)}
    return [i for w in words for i in encode_word(start(w), ranks)]


def _by_rank(ids, ranks, *, offset=256):
    while len(ids) > 1:
        present = [p for p in zip(ids, ids[1:]) if p in ranks]
        if not present:
            break
        pair = min(present, key=ranks.get)
        ids = reference_merge_pair(ids, pair, offset + ranks[pair])
    return ids


def _by_frequency(ids, ranks):  # the most frequent mergeable pair first (ties: lower rank)
    while len(ids) > 1:
        counts = Counter(p for p in zip(ids, ids[1:]) if p in ranks)
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], ranks[p]))
        ids = reference_merge_pair(ids, pair, 256 + ranks[pair])
    return ids


def _left_to_right(ids, ranks):  # passes over the ids merging any known pair as it is met
    while True:
        out, i, changed = [], 0, False
        while i < len(ids):
            if i + 1 < len(ids) and (ids[i], ids[i + 1]) in ranks:
                out.append(256 + ranks[(ids[i], ids[i + 1])])
                i += 2
                changed = True
            else:
                out.append(ids[i])
                i += 1
        ids = out
        if not changed:
            return ids


def _one_merge(ids, ranks):  # the lowest-rank pair merged once, and no loop
    present = [p for p in zip(ids, ids[1:]) if p in ranks]
    return reference_merge_pair(ids, min(present, key=ranks.get), 256 + ranks[min(present, key=ranks.get)]) if present else ids


def _first_occurrence(ids, ranks):  # one scan over the merges in learned order, each merging one occurrence
    for pair, rank in ranks.items():
        pairs = list(zip(ids, ids[1:]))
        if pair in pairs:
            i = pairs.index(pair)
            ids = ids[:i] + [256 + rank] + ids[i + 2:]
    return ids


def in_learned_order(ids: list[int], merges: Sequence[tuple[int, int]]) -> list[int]:
    """Each merge once, in the order learned, on every occurrence: equal to lowest-rank-first.

    Merge ``r`` can only create pairs that hold its new id, and a merge using that id was learned
    after ``r``; so once the merges up to ``r`` are done, no pair of rank ``<= r`` can come back.

    >>> in_learned_order([97, 98, 99], [(98, 99), (97, 98)])
    [97, 256]
    """
    for rank, pair in enumerate(merges):
        ids = reference_merge_pair(ids, tuple(pair), 256 + rank)
    return ids


ENCODE_MISTAKES = {
    "you merged the most frequent pair first; when encoding, frequencies no longer matter: merge the pair "
    "learned earliest (the lowest rank) first, as training did": lambda t, m: _encode_words(t, m, _by_frequency),
    "you merged pairs left to right as you met them; a pair on the left may have been learned later than "
    "one on its right, so always merge the lowest-rank pair present first":
        lambda t, m: _encode_words(t, m, _left_to_right),
    "you made one merge and stopped; keep merging (lowest rank first) until no learned pair is left":
        lambda t, m: _encode_words(t, m, _one_merge),
    "you merged one occurrence per learned pair; a pair can occur several times in a pre-token: replace "
    "every occurrence, as merge_pair does": lambda t, m: _encode_words(t, m, _first_occurrence),
    "you merged across pre-token boundaries; split the text with the GPT-4 pattern first and encode "
    "each pre-token on its own, as training did": lambda t, m: _encode_words(t, m, _by_rank, split=False),
    "you started from code points (ord(c)); start from the UTF-8 bytes, so any character falls back to "
    "its bytes (ü is [195, 188])": lambda t, m: _encode_words(t, m, _by_rank, start=lambda w: [ord(c) for c in w]),
    "the new ids are off: merge number r (counting from 0) makes id 256 + r": lambda t, m: _encode_words(
        t, m, lambda ids, r: _by_rank(ids, r, offset=0)),
}

EMPTY_PAIRS_HINT = (
    "a pre-token that has merged down to one id has no pairs left, and min() of no pairs fails: stop the "
    "loop when no pair is left (fewer than two ids) or when none of the pairs is a learned merge"
)

# Small cases, each made so that one of the mistakes above gives a different answer.
ENCODE_CASES = [
    ("bccc bc", [(98, 99), (99, 99)]),  # cc is more frequent, bc has the lower rank
    ("abc abc", [(98, 99), (97, 98)]),  # bc was learned before ab
    ("abc", [(97, 98), (256, 99)]),  # two merges in a row
    ("bcbc", [(98, 99)]),  # one pair, twice
    ("1234", [(49, 50), (51, 52), (256, 51)]),  # GPT-4 splits 123|4
    ("üü", [(195, 188)]),  # a character of two bytes
]


def _trained_merges() -> list[tuple[int, int]]:
    text = ("the cat sat on the mat; the cat ate the rat. 1234 + 5678 = 6912\n" * 3
            + "Grüße aus Köln, 日本語のテキスト  \n    indented code(x) ")
    return train_bpe(text, 256 + 80, pattern="gpt4").merges


ENCODE_TEXTS = ["the cat sat on the rat", "1234567 + 89 = 99999", "Grüße, 日本語!  \n  code(x)", "", "zzz"]


@checker("encoding with learned merges")
def check_bpe_encode(bpe_encode, my_merges: Sequence[tuple[int, int]] | None = None) -> None:
    """Check ``bpe_encode(text, merges) -> ids`` on small cases, trained merges and ``my_merges``.

    Every answer is compared with tiktoken built from the same merges (and with tfedu's reference
    when tiktoken is not installed): tiktoken is an independent, production BPE encoder.
    """
    cases = list(ENCODE_CASES) + [(text, _trained_merges()) for text in ENCODE_TEXTS]
    if my_merges is not None:
        try:
            merges = [(int(a), int(b)) for a, b in my_merges]
            Tokenizer(merges)
        except (TypeError, ValueError) as err:
            raise CheckFailure(f"my_merges should be a list of (a, b) pairs, each using ids made before it: {err}") from None
        cases += [(text, merges) for text in ENCODE_TEXTS]
    for text, merges in cases:
        short = merges if len(merges) <= 3 else f"<{len(merges)} merges>"
        what = f"bpe_encode({text!r}, {short})"
        try:
            got = call_learner(bpe_encode, text, [tuple(m) for m in merges], name="bpe_encode")
        except CheckFailure as failure:
            if "empty sequence" in str(failure):
                raise CheckFailure(f"{failure} ({EMPTY_PAIRS_HINT})") from None
            raise
        got = _as_int_list(got, what)
        expected = reference_bpe_encode(text, merges)
        oracle = tiktoken_encode(text, merges)
        if oracle is not None and oracle != expected:  # cannot happen for merges BPE learned; guards the checker
            raise CheckFailure(f"{what}: tiktoken and the reference disagree on these merges ({oracle} vs {expected})")
        _match(got, expected, what, {hint: fn(text, merges) for hint, fn in ENCODE_MISTAKES.items()})


# --- probes for the autograder --------------------------------------------------------------


def _equal(outputs: dict, expected: dict) -> str | None:
    for key, value in expected.items():
        if key not in outputs:
            return f"outputs has no {key!r}"
        if outputs[key] != value:
            return f"{key}: got {outputs[key]!r}, expected {value!r}"
    return None


def _ids_inputs(rng: np.random.Generator) -> dict:
    n_symbols = int(rng.integers(2, 6))
    return {"ids": rng.integers(0, n_symbols, int(rng.integers(0, 60))).tolist()}


def _merge_inputs(rng: np.random.Generator) -> dict:
    ids = rng.integers(0, 3, int(rng.integers(0, 60))).tolist()
    first = int(rng.integers(0, 3))
    pair = [first, first if rng.random() < 0.5 else int(rng.integers(0, 3))]  # runs like a a a half the time
    return {"ids": ids, "pair": pair, "new_id": int(rng.integers(3, 500))}


def _learn_inputs(rng: np.random.Generator) -> dict:
    ids = rng.integers(0, int(rng.integers(2, 5)), int(rng.integers(20, 60))).tolist()
    # A tie that only the second id breaks: (a, c) comes first, (a, b) is smaller.
    values = sorted(int(i) for i in rng.choice(np.arange(1, 200), size=4, replace=False))
    rest = [int(i) for i in rng.permutation(values[1:])]
    a, (b, c), x = values[0], sorted(rest[:2]), rest[2]  # a the smallest, so (a, .) pairs are the candidates
    return {"ids": ids, "n_merges": int(rng.integers(1, 8)), "first_id": int(rng.choice([27, 256, 1000])),
            "tie": [a, c, x, a, b]}


_PROBE_ALPHABET = "aZ09 ü日🙂'\n.,"


def _utf8_inputs(rng: np.random.Generator) -> dict:
    letters = list(_PROBE_ALPHABET) + list(UTF8_BOUNDARIES) * 2  # every length's first and last code point, often
    text = "".join(rng.choice(letters, int(rng.integers(8, 40)))) + "".join(rng.permutation(list(UTF8_BOUNDARIES)))
    ids = rng.integers(0, 256, int(rng.integers(0, 20))).tolist()
    invalid = [byte for k in rng.permutation(len(UTF8_INVALID)) for byte in UTF8_INVALID[k] + [65]]
    return {"text": text, "ids": list(text.encode("utf-8")[:5]) + ids + invalid}


_SPLIT_WORDS = ["I", "'m", "'M", "'s", "'ve", "'LL", "Hello", "WORLD", "1999", "7", " ", "  ", "\n", "#", "!?",
                "ü", "東京", "x_1", "\t", "don't", "DON'T", "x²", "H₂O", "½", "Ⅻ", "e\u0301"]


def _split_inputs(rng: np.random.Generator) -> dict:
    # Always a number that is not a digit (\p{N} but not \d), right after punctuation, and a tab or a
    # newline right before a word: a split written for `re`, or with \s? for ` ?`, fails on them.
    words = list(rng.choice(_SPLIT_WORDS, int(rng.integers(1, 25))))
    words += [str(rng.choice(["x²", "H₂O", "½", "Ⅻ"])), str(rng.choice(["!½", "#Ⅻ", "(²"])), str(rng.choice(["\tx", "\n1", "\t!"]))]
    return {"text": "".join(rng.permutation(words))}


def _encode_inputs(rng: np.random.Generator) -> dict:
    words = rng.choice(_SPLIT_WORDS + ["the", " cat", " sat", "123456", "ab", "ba", "abab"], int(rng.integers(5, 40)))
    training = "".join(words)
    merges = train_bpe(training, 256 + int(rng.integers(1, 40)), pattern="gpt4").merges
    text = "".join(rng.choice(words, int(rng.integers(0, 20))))
    return {"text": text, "merges": [[a, b] for a, b in merges]}


# Exercises 1.3 and 1.6 call the learner's get_pair_counts and merge_pair (1.1, 1.2). While they are
# graded, these stand-ins take their place, so a wrong 1.2 costs 1.2 alone. Plain Python, no tfedu.
PAIR_COUNTS_STANDIN = """\
def get_pair_counts(ids):
    \"\"\"Stand-in for exercise 1.1: every adjacent pair of ids, counted (overlapping pairs too).\"\"\"
    counts = {}
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + 1
    return counts
"""
MERGE_PAIR_STANDIN = """\
def merge_pair(ids, pair, new_id):
    \"\"\"Stand-in for exercise 1.2: each occurrence of pair replaced by new_id, left to right, no overlaps.\"\"\"
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == tuple(pair):
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
"""

PROBES = {
    "check_bpe_encode": Probe(
        exercise="ex_bpe_encode",
        make_inputs=_encode_inputs,
        run="outputs = {'ids': [int(i) for i in bpe_encode(inputs['text'], [tuple(m) for m in inputs['merges']])]}",
        reference=lambda inputs: {"ids": reference_bpe_encode(inputs["text"], [tuple(m) for m in inputs["merges"]])},
        forbidden=("tfedu.tokenizer",),
        compare=_equal,
        standins=MERGE_PAIR_STANDIN,
    ),
    "check_get_pair_counts": Probe(
        exercise="ex_get_pair_counts",
        make_inputs=_ids_inputs,
        run="outputs = {'counts': sorted([int(a), int(b), int(n)] for (a, b), n in "
            "get_pair_counts(list(inputs['ids'])).items() if n)}",
        reference=lambda inputs: {
            "counts": sorted([a, b, n] for (a, b), n in get_pair_counts(list(inputs["ids"])).items())
        },
        forbidden=("tfedu.tokenizer",),
        compare=_equal,
    ),
    "check_merge_pair": Probe(
        exercise="ex_merge_pair",
        make_inputs=_merge_inputs,
        run="outputs = {'ids': [int(i) for i in merge_pair(list(inputs['ids']), tuple(inputs['pair']), "
            "inputs['new_id'])]}",
        reference=lambda inputs: {"ids": merge_pair(list(inputs["ids"]), tuple(inputs["pair"]), inputs["new_id"])},
        forbidden=("tfedu.tokenizer",),
        compare=_equal,
    ),
    "check_learn_bpe": Probe(
        exercise="ex_learn_bpe",
        make_inputs=_learn_inputs,
        run="_m, _ids = learn_bpe(list(inputs['ids']), inputs['n_merges'], inputs['first_id'])\n"
            "_tie = learn_bpe(list(inputs['tie']), 1, 1000)[0]\n"
            "outputs = {'merges': [[int(a), int(b)] for a, b in _m], 'ids': [int(i) for i in _ids], "
            "'tie': [[int(a), int(b)] for a, b in _tie]}",
        reference=lambda inputs: (lambda m, f: {"merges": [list(p) for p in m], "ids": f,
                                                "tie": [list(p) for p in reference_learn_bpe(inputs["tie"], 1, 1000)[0]]})(
            *reference_learn_bpe(inputs["ids"], inputs["n_merges"], inputs["first_id"])
        ),
        forbidden=("tfedu.tokenizer",),
        compare=_equal,
        standins=PAIR_COUNTS_STANDIN + "\n\n" + MERGE_PAIR_STANDIN,
    ),
    "check_utf8": Probe(
        exercise="ex_utf8",
        make_inputs=_utf8_inputs,
        run="outputs = {'ids': [int(i) for i in utf8_encode(inputs['text'])], "
            "'text': utf8_decode(list(inputs['ids']))}",
        reference=lambda inputs: {
            "ids": list(inputs["text"].encode("utf-8")),
            "text": bytes(inputs["ids"]).decode("utf-8", errors="replace"),
        },
        forbidden=("tfedu.tokenizer",),
        compare=_equal,
    ),
    "check_gpt2_split": Probe(
        exercise="ex_gpt2_split",
        make_inputs=_split_inputs,
        run="outputs = {'pieces': list(gpt2_split(inputs['text']))}",
        reference=lambda inputs: {"pieces": pretokenize(inputs["text"], GPT2_PATTERN)},
        forbidden=("tfedu.tokenizer",),
        compare=_equal,
    ),
}


# ----------------------------------------------------------------------------- hints, in steps (tfedu.hint)

HINTS = {
    "ex_get_pair_counts": Hints(
        number="1.1",
        check="check_get_pair_counts",
        idea=(
            "Every position i except the last starts one pair: the id at i and the id right after it. Pairs "
            "overlap, so [a, a, a] holds (a, a) twice, and a list of n ids holds n - 1 pairs (none for an empty "
            "list or a single id). The result maps each pair, a tuple of two ids, to how many times it occurs. "
            "The usual traps: stepping two positions at a time, losing the last pair, and recording that a pair "
            "occurs instead of how often."
        ),
        approach=(
            "One pass over the adjacent pairs. The neat way to get them is to walk the list side by side with "
            "itself shifted by one position (zip stops at the shorter of the two, which drops the last id's "
            "missing partner for you); a loop over the positions 0 to n - 2 works as well. For each pair, add "
            "one to its count, starting from 0 the first time it is seen (a dict's get with a default, or "
            "collections.Counter). Keys are tuples (a, b), values are ints."
        ),
        skeleton=(
            "def get_pair_counts(ids):\n"
            "    counts = {}\n"
            "    for pair in ____:  # every adjacent pair (a, b), overlapping ones too\n"
            "        counts[pair] = ____  # one more than before, 0 before the first time\n"
            "    return counts\n"
        ),
    ),
    "ex_merge_pair": Hints(
        number="1.2",
        check="check_merge_pair",
        idea=(
            "Scan left to right and build a new list. Wherever the id at the current position and the next one "
            "form `pair`, write new_id once and jump past both ids, since they are used up; anywhere else copy "
            "the id and move on by one. That is why [a, a, a] merged on (a, a) gives [Z, a], not [Z, Z]. The "
            "list you were given must stay as it was."
        ),
        approach=(
            "Keep an output list and an index i starting at 0, and loop while i is inside the list (up to the "
            "very last id, so it is not dropped). At each step ask two things: is there a next id at all, and do "
            "the id at i and the next one, taken as a tuple, equal the pair (convert the pair to a tuple too; a "
            "list never equals a tuple)? If yes, append new_id and advance i by 2; if not, append the id at i "
            "and advance by 1. Return the output list."
        ),
        skeleton=(
            "def merge_pair(ids, pair, new_id):\n"
            "    out, i = ____, 0\n"
            "    while ____:  # until every id has been used\n"
            "        if ____:  # is there a next id, and do the two make `pair`?\n"
            "            out.append(____)\n"
            "            i += ____\n"
            "        else:\n"
            "            out.append(____)\n"
            "            i += ____\n"
            "    return out\n"
        ),
    ),
    "ex_learn_bpe": Hints(
        number="1.3",
        check="check_learn_bpe",
        idea=(
            "Training is the same step repeated n_merges times: count the pairs of the ids as they are NOW, take "
            "the most frequent pair, and merge it everywhere into a fresh id. Each merge creates new pairs and "
            "destroys old ones, so the counts must be redone after every merge. A tie is broken by the pairs "
            "themselves: the smaller tuple wins, comparing the first id first (ab = (1, 2) beats Za = (27, 1) "
            "at the deck's second step). Merge number k (from 0) gets first_id + k, and the loop stops early "
            "once no pair is left."
        ),
        approach=(
            "Copy ids into a new list and start an empty list of merges. Loop k over 0 to n_merges - 1. Count "
            "the pairs with your get_pair_counts; if there are none, break. Choose the pair with min and a key "
            "function that orders the pairs by count, highest first, and then by the pair itself, "
            "smallest first: a key can return a tuple, and tuples compare element by element (negating the "
            "count turns highest-first into smallest-first). Merge it with your merge_pair into first_id + k, "
            "record the pair, and after the loop return the tuple (merges, ids), in that order."
        ),
        skeleton=(
            "def learn_bpe(ids, n_merges, first_id):\n"
            "    ids, merges = ____, []  # a copy to work on, and no merges yet\n"
            "    for k in ____:\n"
            "        counts = ____  # the pairs of the CURRENT ids\n"
            "        if ____:  # no pair left?\n"
            "            break\n"
            "        pair = min(counts, key=____)  # most frequent first; ties: the smaller pair\n"
            "        ids = ____  # merged into the k-th new id\n"
            "        merges.append(pair)\n"
            "    return ____\n"
        ),
    ),
    "ex_utf8": Hints(
        number="1.4",
        check="check_utf8",
        idea=(
            "A str is a sequence of code points; UTF-8 writes each one as 1 to 4 bytes, so 'ü' is the two bytes "
            "195, 188 and not its code point 252. Encoding turns the text into those bytes, as ints. Decoding "
            "goes back, and must read the bytes as one stream, because a character can span several of them; "
            "since a model can emit any bytes, invalid ones are replaced by U+FFFD instead of raising an error "
            "(and not dropped, and not read as latin-1)."
        ),
        approach=(
            "Both are one line, using Python's own codec rather than writing UTF-8 by hand. Encode: a str's "
            "encode method, with the codec name 'utf-8', gives a bytes object; iterating a bytes object yields "
            "ints 0..255, so turn it into a list. Decode: the built-in bytes turns a list of ints into one bytes "
            "object; its decode method takes the codec name and an errors policy, and the policy you want is "
            "'replace' (the default, 'strict', raises)."
        ),
        skeleton=(
            "def utf8_encode(text):\n"
            "    return list(____)  # the text's UTF-8 bytes\n"
            "\n"
            "\n"
            "def utf8_decode(ids):\n"
            "    return ____.decode(____, errors=____)  # all the bytes at once; invalid ones become U+FFFD\n"
        ),
    ),
    "ex_gpt2_split": Hints(
        number="1.5",
        check="check_gpt2_split",
        idea=(
            "GPT-2's split is one regular expression made of six alternatives, and findall returns every match "
            "from left to right. At each position the FIRST alternative that matches wins, so their order is "
            "part of the answer: the contractions come first, or the apostrophe would be taken as punctuation. "
            "The pattern has no ignore-case flag ('m matches but 'M does not), letters, numbers and other symbols "
            "each take at most one space in front, and the pieces always join back to the exact text."
        ),
        approach=(
            "Write a raw string joining six branches with |, in this order: (1) the seven contractions 's 't "
            "'re 've 'm 'll 'd as literal alternatives; (2) an optional space, then a run of letters, using the "
            "class for any Unicode letter; (3) the same with the class for any number; (4) an optional space, "
            "then a run of characters that are none of whitespace, letter, number (one negated class holding "
            "all three); (5) a run of whitespace that is not followed by a non-space (a negative lookahead); "
            "(6) any run of whitespace. Pass it to the third-party regex module's findall (the built-in re does "
            "not know the letter and number classes), with no flags."
        ),
        skeleton=(
            "def gpt2_split(text):\n"
            "    contractions = ____  # 's, 't, 're, 've, 'm, 'll, 'd, as alternatives\n"
            "    letters = ____  # at most one space, then one or more letters\n"
            "    numbers = ____  # the same for numbers\n"
            "    other = ____  # at most one space, then a run of: not whitespace, not a letter, not a number\n"
            "    spaces = ____  # whitespace, leaving the last space before a word to that word\n"
            "    pattern = '|'.join([contractions, letters, numbers, other, spaces, ____])\n"
            "    return regex.____(pattern, text)\n"
        ),
    ),
    "ex_bpe_encode": Hints(
        number="1.6",
        check="check_bpe_encode",
        idea=(
            "Encoding replays training, in training's order. Split the text with the same pattern, start every "
            "pre-token from its UTF-8 bytes, and inside it keep applying the learned merge that was learned "
            "FIRST (the lowest rank) among the pairs present, on every occurrence, until no present pair is a "
            "learned merge. Frequencies play no part any more, and neither does left-to-right order. Merge r "
            "(counting from 0) makes id 256 + r; the pre-tokens' ids are concatenated."
        ),
        approach=(
            "Before the loop, build one dict from each pair (as a tuple) to the id its merge made, 256 plus its "
            "rank (enumerate the merges): it answers both 'is this pair learned?' and 'which was learned "
            "first?', since a smaller id means an earlier merge. For each piece that regex's findall finds with "
            "GPT4_SPLIT: take the list of its UTF-8 bytes; while it holds at least two ids, collect the "
            "adjacent pairs that are in the dict, stop if there are none, else take the one whose id is "
            "smallest (min with the dict's get as key) and merge it everywhere with your merge_pair. Then "
            "extend the output with the piece's ids."
        ),
        skeleton=(
            "def bpe_encode(text, merges):\n"
            "    new_ids = {____: ____ for rank, pair in enumerate(merges)}  # pair -> the id its merge made\n"
            "    out = []\n"
            "    for piece in ____:  # GPT-4's pre-tokens\n"
            "        ids = ____  # the piece's UTF-8 bytes, as ints\n"
            "        while ____:\n"
            "            learned = [p for p in ____ if p in new_ids]  # the adjacent pairs that are learned merges\n"
            "            if not learned:\n"
            "                break\n"
            "            pair = ____  # the one learned first\n"
            "            ids = merge_pair(ids, pair, ____)\n"
            "        out.extend(ids)\n"
            "    return out\n"
        ),
    ),
}

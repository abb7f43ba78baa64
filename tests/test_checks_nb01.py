"""The checkers of notebooks/01_tokenization.ipynb pass correct answers and name the usual mistakes."""

from collections import Counter

import numpy as np
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from tfedu.checks import nb01_tokenization as nb01
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe
from tfedu.tokenizer import GPT2_PATTERN, letter_ids, train_bpe, train_bpe_naive

# --- answers as a learner would write them (the notebook's solutions) ------------------------


# The plain-Python answers to 1.1 and 1.2 are the grader's stand-ins for them (one text for both):
# the checkers below then also test the stand-ins.
_STANDINS: dict = {}
exec(nb01.PAIR_COUNTS_STANDIN + "\n\n" + nb01.MERGE_PAIR_STANDIN, _STANDINS)
get_pair_counts, merge_pair = _STANDINS["get_pair_counts"], _STANDINS["merge_pair"]


def learn_bpe(ids, n_merges, first_id):
    ids, merges = list(ids), []
    for k in range(n_merges):
        counts = get_pair_counts(ids)
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        ids = merge_pair(ids, pair, first_id + k)
        merges.append(pair)
    return merges, ids


def utf8_encode(text):
    return list(text.encode("utf-8"))


def utf8_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def gpt2_split(text):
    return regex.findall(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""", text)


GPT4_SPLIT = nb01.GPT4_PATTERN


def bpe_encode(text, merges):
    new_ids = {tuple(pair): 256 + rank for rank, pair in enumerate(merges)}  # merge r makes id 256 + r
    out = []
    for word in regex.findall(GPT4_SPLIT, text):
        ids = list(word.encode("utf-8"))
        while len(ids) > 1:
            learned = [p for p in zip(ids, ids[1:]) if p in new_ids]
            if not learned:
                break
            pair = min(learned, key=new_ids.get)  # the pair learned first: the lowest rank
            ids = merge_pair(ids, pair, new_ids[pair])
        out.extend(ids)
    return out


def not_done(*args, **kwargs):
    raise NotImplementedError


def fails_with(check, *impls, hint):
    with pytest.raises(CheckFailure) as info:
        check(*impls)
    assert hint in str(info.value), str(info.value)
    return str(info.value)


# --- the worked example -----------------------------------------------------------------------


def test_deck_example_only_fits_the_eleven_letter_string():
    assert letter_ids(nb01.DECK_TEXT) == nb01.DECK_IDS
    assert nb01.reference_learn_bpe(nb01.DECK_IDS, 3, 27) == (nb01.DECK_MERGES, nb01.DECK_FINAL)
    for typo in ("aaabdaaaabac", "aabdaaabac", "aaabdaaabbac"):
        assert letter_ids(typo) != nb01.DECK_IDS
    with pytest.raises(ValueError, match="lowercase letters"):
        letter_ids("Hello")


@pytest.mark.parametrize("text", ["aaabdaaabac", "low lower lowest newer wider " * 3, "abababcab ab", "🙂🙂🙂 ü ü"])
def test_reference_learn_bpe_agrees_with_train_bpe_naive(text):
    # Independent oracle: tfedu.tokenizer's own naive trainer on bytes.
    merges, final = nb01.reference_learn_bpe(list(text.encode()), 6, 256)
    assert merges == train_bpe_naive(text, 256 + len(merges), pattern=None)
    assert final == train_bpe(text, 256 + len(merges), pattern=None).encode(text)


# --- the checkers pass correct answers --------------------------------------------------------


def test_checkers_pass_correct_answers(capsys):
    nb01.check_get_pair_counts(get_pair_counts)
    nb01.check_merge_pair(merge_pair)
    nb01.check_learn_bpe(learn_bpe)
    nb01.check_utf8(utf8_encode, utf8_decode)
    nb01.check_gpt2_split(gpt2_split)
    out = capsys.readouterr()
    assert out.out.count("\N{CHECK MARK}") == 5
    assert out.err == ""


def test_checkers_accept_counter_and_tuple_variants(capsys):
    nb01.check_get_pair_counts(lambda ids: Counter(zip(ids, ids[1:])))
    nb01.check_learn_bpe(lambda ids, n, f: tuple(learn_bpe(ids, n, f)))
    assert capsys.readouterr().out.count("\N{CHECK MARK}") == 2


def test_unfinished_exercises_say_not_done():
    for check, impls in [
        (nb01.check_get_pair_counts, (not_done,)),
        (nb01.check_merge_pair, (not_done,)),
        (nb01.check_learn_bpe, (not_done,)),
        (nb01.check_utf8, (not_done, not_done)),
        (nb01.check_gpt2_split, (not_done,)),
    ]:
        with pytest.raises(ExerciseNotDone, match="not done yet"):
            check(*impls)


# --- the checkers name the usual mistakes -----------------------------------------------------


def test_pair_count_mistakes():
    fails_with(nb01.check_get_pair_counts, lambda ids: dict(Counter(zip(ids[::2], ids[1::2]))), hint="non-overlapping")

    def str_count_style(ids):  # "aaa".count("aa") == 1
        text = "".join(chr(65 + i) for i in ids)
        return {p: text.count(chr(65 + p[0]) + chr(65 + p[1])) for p in set(zip(ids, ids[1:]))}

    fails_with(nb01.check_get_pair_counts, str_count_style, hint="non-overlapping")
    fails_with(nb01.check_get_pair_counts,
               lambda ids: dict(Counter((ids[i], ids[i + 1]) for i in range(len(ids) - 2))), hint="last pair is missing")
    fails_with(nb01.check_get_pair_counts,
               lambda ids: dict(Counter(zip(ids, ids[1:] + ids[:1]))) if ids else {}, hint="wraps around")
    fails_with(nb01.check_get_pair_counts, lambda ids: list(zip(ids, ids[1:])), hint="should return a dict")
    fails_with(nb01.check_get_pair_counts, lambda ids: {p: 1 for p in zip(ids, ids[1:])}, hint="every count is 1")
    fails_with(nb01.check_get_pair_counts, lambda ids: {f"{a},{b}": 1 for a, b in zip(ids, ids[1:])}, hint="tuples")


def test_merge_mistakes():
    def overlapping(ids, pair, new_id):  # replaces at every position where the pair starts
        starts = [i for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) == pair]
        out = []
        for j, x in enumerate(ids):
            if j in starts:
                out.append(new_id)
            elif j - 1 not in starts:
                out.append(x)
        return out

    def not_advancing(ids, pair, new_id):
        out, i = [], 0
        while i < len(ids):
            if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
                out.append(new_id)
            else:
                out.append(ids[i])
            i += 1
        return out

    def dropping_last(ids, pair, new_id):
        out, i = [], 0
        while i < len(ids) - 1:
            if (ids[i], ids[i + 1]) == pair:
                out.append(new_id)
                i += 2
            else:
                out.append(ids[i])
                i += 1
        return out

    def in_place(ids, pair, new_id):
        ids[:] = merge_pair(ids, pair, new_id)
        return ids

    def returns_nothing(ids, pair, new_id):
        merge_pair(ids, pair, new_id)

    fails_with(nb01.check_merge_pair, overlapping, hint="replaced overlapping pairs")
    fails_with(nb01.check_merge_pair, not_advancing, hint="did not advance past the merged pair")
    fails_with(nb01.check_merge_pair, dropping_last, hint="last id went missing")
    fails_with(nb01.check_merge_pair,
               lambda ids, pair, new_id: merge_pair(ids[::-1], pair[::-1], new_id)[::-1], hint="right to left")
    fails_with(nb01.check_merge_pair, in_place, hint="changed the list you were given")

    def first_only(ids, pair, new_id):
        for i in range(len(ids) - 1):
            if (ids[i], ids[i + 1]) == pair:
                return ids[:i] + [new_id] + ids[i + 2:]
        return list(ids)

    def list_vs_tuple(ids, pair, new_id):  # [x, y] == (x, y) is always False
        out, i = [], 0
        while i < len(ids):
            if i + 1 < len(ids) and [ids[i], ids[i + 1]] == pair:
                out.append(new_id)
                i += 2
            else:
                out.append(ids[i])
                i += 1
        return out

    fails_with(nb01.check_merge_pair, first_only, hint="only the first occurrence was replaced")

    def keeps_right(ids, pair, new_id):
        out, i = [], 0
        while i < len(ids):
            if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
                out += [new_id, ids[i + 1]]
                i += 2
            else:
                out.append(ids[i])
                i += 1
        return out

    fails_with(nb01.check_merge_pair, keeps_right, hint="kept the pair's right id")
    fails_with(nb01.check_merge_pair, list_vs_tuple, hint="a list [x, y] never equals a tuple")
    fails_with(nb01.check_merge_pair, returns_nothing, hint="returned None")


def _learn_with(choose, offset=0):
    def learn(ids, n_merges, first_id):
        ids, merges = list(ids), []
        for k in range(n_merges):
            counts = get_pair_counts(ids)
            if not counts:
                break
            pair = choose(counts)
            ids = merge_pair(ids, pair, first_id + k + offset)
            merges.append(pair)
        return merges, ids

    return learn


def test_learn_bpe_mistakes():
    first_seen = _learn_with(lambda c: max(c, key=c.get))
    message = fails_with(nb01.check_learn_bpe, first_seen, hint="wrong tie-break")
    assert "ab=(1, 2) rather than Za=(27, 1)" in message
    fails_with(nb01.check_learn_bpe, _learn_with(lambda c: max(c, key=lambda p: (c[p], p))), hint="wrong tie-break")
    fails_with(nb01.check_learn_bpe, _learn_with(lambda c: min(c, key=lambda p: (-c[p], p)), offset=1), hint="off by one")

    def stale(ids, n_merges, first_id):
        counts = get_pair_counts(ids)
        merges = sorted(counts, key=lambda p: (-counts[p], p))[:n_merges]
        for k, pair in enumerate(merges):
            ids = merge_pair(ids, pair, first_id + k)
        return merges, ids

    fails_with(nb01.check_learn_bpe, stale, hint="recount the pairs")
    fails_with(nb01.check_learn_bpe, lambda ids, n, f: learn_bpe(ids, n - 1, f), hint="made 2 merges, expected 3")
    fails_with(nb01.check_learn_bpe, lambda ids, n, f: learn_bpe(ids, n, f)[0], hint="tuple (merges, ids)")
    fails_with(nb01.check_learn_bpe, lambda ids, n, f: learn_bpe(ids, n, f)[::-1], hint="you returned (ids, merges)")

    def never_stops(ids, n_merges, first_id):
        ids, merges = list(ids), []
        for k in range(n_merges):
            counts = get_pair_counts(ids)
            pair = min(counts, key=lambda p: (-counts[p], p))  # ValueError once counts is empty
            ids = merge_pair(ids, pair, first_id + k)
            merges.append(pair)
        return merges, ids

    message = fails_with(nb01.check_learn_bpe, never_stops, hint="leaving the loop as soon as the counts come back empty")
    assert "ValueError" in message

    def same_id(ids, n_merges, first_id):
        ids, merges = list(ids), []
        for _ in range(n_merges):
            counts = get_pair_counts(ids)
            if not counts:
                break
            pair = min(counts, key=lambda p: (-counts[p], p))
            ids = merge_pair(ids, pair, first_id)
            merges.append(pair)
        return merges, ids

    fails_with(nb01.check_learn_bpe, same_id, hint="every merge got the same new id")


def test_utf8_mistakes():
    fails_with(nb01.check_utf8, lambda t: [ord(c) for c in t], utf8_decode, hint="code points")
    fails_with(nb01.check_utf8, utf8_encode, lambda ids: bytes(ids).decode("utf-8"), hint="errors='replace'")
    fails_with(nb01.check_utf8, utf8_encode, lambda ids: bytes(ids).decode("latin-1"), hint="latin-1")
    fails_with(nb01.check_utf8, utf8_encode, lambda ids: bytes(ids).decode("utf-8", errors="ignore"), hint="ignore")
    fails_with(nb01.check_utf8, utf8_encode, lambda ids: "".join(map(chr, ids)), hint="chr()")
    fails_with(nb01.check_utf8, lambda t: list(t.encode("utf-16")), utf8_decode, hint="byte-order mark")
    fails_with(nb01.check_utf8, utf8_encode,
               lambda ids: "".join(bytes([i]).decode("utf-8", errors="replace") for i in ids), hint="each byte on its own")


def test_split_mistakes():
    pieces = dict(nb01._SPLIT_PIECES)
    ignore_case = regex.compile("|".join(pieces.values()), regex.IGNORECASE)
    fails_with(nb01.check_gpt2_split, ignore_case.findall, hint="case-insensitively")
    letters_first = regex.compile(r""" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|'s|'t|'re|'ve|'m|'ll|'d|\s+(?!\S)|\s+""")
    fails_with(nb01.check_gpt2_split, letters_first.findall, hint="contractions must come first")
    no_lookahead = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+""")
    fails_with(nb01.check_gpt2_split, no_lookahead.findall, hint="(?!\\S)")
    no_space = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}+|[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    fails_with(nb01.check_gpt2_split, no_space.findall, hint="optional leading space")
    fails_with(nb01.check_gpt2_split, str.split, hint="split on whitespace")
    slide_typo = regex.compile(GPT2_PATTERN.replace(r"[^\s\p{L}", r"[^s\p{L}"))  # the deck's missing backslash
    fails_with(nb01.check_gpt2_split, slide_typo.findall, hint="lost a backslash")
    for run in (r" ?\p{L}+", r" ?\p{N}+", r" ?[^\s\p{L}\p{N}]+"):  # one character where a run belongs
        one_char = regex.compile(GPT2_PATTERN.replace(run, run.removesuffix("+"), 1))
        fails_with(nb01.check_gpt2_split, one_char.findall, hint="a `+` is missing")

    import re

    fails_with(nb01.check_gpt2_split, lambda text: re.findall(GPT2_PATTERN, text), hint="`import regex`")


# --- probes -------------------------------------------------------------------------------------

ANSWERS = {
    "get_pair_counts": get_pair_counts,
    "merge_pair": merge_pair,
    "learn_bpe": learn_bpe,
    "utf8_encode": utf8_encode,
    "utf8_decode": utf8_decode,
    "gpt2_split": gpt2_split,
    "bpe_encode": bpe_encode,
}


def test_every_check_cell_has_a_probe():
    assert set(nb01.PROBES) == {
        "check_get_pair_counts", "check_merge_pair", "check_learn_bpe", "check_utf8", "check_gpt2_split",
        "check_bpe_encode",
    }
    for grade_id, probe in nb01.PROBES.items():
        assert probe.exercise == "ex_" + grade_id.removeprefix("check_")
        assert probe.forbidden == ("tfedu.tokenizer",)


@pytest.mark.parametrize("grade_id", sorted(nb01.PROBES))
def test_probes_accept_correct_answers(grade_id):
    probe = nb01.PROBES[grade_id]
    for seed in range(8):
        outputs, expected = run_probe(probe, ANSWERS, seed)
        assert probe.compare(outputs, expected) is None


BUGGY = {
    "check_get_pair_counts": {"get_pair_counts": lambda ids: dict(Counter(zip(ids[::2], ids[1::2])))},
    "check_merge_pair": {"merge_pair": lambda ids, pair, new_id: merge_pair(ids[::-1], pair[::-1], new_id)[::-1]},
    "check_learn_bpe": {"learn_bpe": _learn_with(lambda c: max(c, key=c.get))},
    "check_utf8": {"utf8_decode": lambda ids: bytes(ids).decode("latin-1")},
    "check_gpt2_split": {"gpt2_split": lambda text: regex.findall(GPT2_PATTERN, text, flags=regex.IGNORECASE)},
    "check_bpe_encode": {"bpe_encode": lambda text, merges: _learner_encoder(loop=False)(text, merges)},
}


@pytest.mark.parametrize("grade_id", sorted(nb01.PROBES))
def test_probes_reject_buggy_answers(grade_id):
    probe = nb01.PROBES[grade_id]
    answers = {**ANSWERS, **BUGGY[grade_id]}
    failures = 0
    for seed in range(8):
        outputs, expected = run_probe(probe, answers, seed)
        failures += probe.compare(outputs, expected) is not None
    assert failures >= 3


def test_probe_inputs_are_plain_data():
    def plain(value):
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return isinstance(value, (int, float, str)) and not isinstance(value, np.generic)

    for probe in nb01.PROBES.values():
        for seed in range(4):
            inputs = probe.make_inputs(np.random.default_rng(seed))
            assert plain(inputs), inputs
            assert plain(probe.reference(inputs))


def test_check_and_probe_agree_on_a_missing_plus():
    """A punctuation branch without `+` once passed the check cell yet lost the probe's marks."""
    one_char = regex.compile(GPT2_PATTERN.replace(r" ?[^\s\p{L}\p{N}]+", r" ?[^\s\p{L}\p{N}]", 1)).findall
    fails_with(nb01.check_gpt2_split, one_char, hint="a `+` is missing")
    probe = nb01.PROBES["check_gpt2_split"]
    rejected = sum(probe.compare(*run_probe(probe, {**ANSWERS, "gpt2_split": one_char}, seed)) is not None
                   for seed in range(8))
    assert rejected >= 1


# --- exercise 1.6: encoding with learned merges ----------------------------------------------


def _learner_encoder(choose=None, *, split=True, start=None, offset=256, loop=True, every=True):
    """bpe_encode as a learner might get it wrong, one switch per mistake."""

    def encode(text, merges):
        new_ids = {tuple(pair): offset + rank for rank, pair in enumerate(merges)}
        out = []
        for word in (regex.findall(GPT4_SPLIT, text) if split else [text] if text else []):
            ids = [ord(c) for c in word] if start == "ord" else list(word.encode("utf-8"))
            if not every:  # each learned pair once, in order, first occurrence only
                for pair, new in new_ids.items():
                    pairs = list(zip(ids, ids[1:]))
                    if pair in pairs:
                        i = pairs.index(pair)
                        ids = ids[:i] + [new] + ids[i + 2:]
                out.extend(ids)
                continue
            while len(ids) > 1:
                learned = [p for p in zip(ids, ids[1:]) if p in new_ids]
                if not learned:
                    break
                pair = (choose or (lambda ps, ids: min(ps, key=new_ids.get)))(learned, ids)
                ids = merge_pair(ids, pair, new_ids[pair])
                if not loop:
                    break
            out.extend(ids)
        return out

    return encode


def _most_frequent(learned, ids):
    counts = Counter(learned)
    return max(counts, key=counts.get)


def _leftmost(learned, ids):
    return learned[0]


def test_bpe_encode_passes_the_solution_and_learned_order(capsys):
    nb01.check_bpe_encode(bpe_encode)
    merges = train_bpe("the cat sat on the mat " * 5 + "12345 Grüße", 300).merges
    nb01.check_bpe_encode(bpe_encode, merges)  # with the learner's own merges

    def learned_order(text, merges):  # each merge once, in learned order: also right
        return [i for w in regex.findall(GPT4_SPLIT, text) for i in nb01.in_learned_order(list(w.encode()), merges)]

    nb01.check_bpe_encode(learned_order)
    assert capsys.readouterr().out.count("all checks passed") == 3


@pytest.mark.parametrize("wrong, hint", [
    (_learner_encoder(_most_frequent), "most frequent pair first"),
    (_learner_encoder(_leftmost), "left to right"),
    (_learner_encoder(loop=False), "one merge and stopped"),
    (_learner_encoder(every=False), "one occurrence per learned pair"),
    (_learner_encoder(split=False), "across pre-token boundaries"),
    (_learner_encoder(start="ord"), "code points"),
    (_learner_encoder(offset=0), "256 + r"),
])
def test_bpe_encode_mistakes(wrong, hint):
    fails_with(nb01.check_bpe_encode, wrong, hint=hint)


def test_bpe_encode_other_failures():
    with pytest.raises(ExerciseNotDone):
        nb01.check_bpe_encode(not_done)
    fails_with(nb01.check_bpe_encode, lambda t, m: [bpe_encode(w, m) for w in regex.findall(GPT4_SPLIT, t)],
               hint="list of ints")
    fails_with(nb01.check_bpe_encode, bpe_encode, [(1, 999)], hint="using ids made before it")


def encode_until_min_fails(text, merges):  # `while True` around min(pairs): a one-id pre-token has no pairs
    ranks = {pair: 256 + rank for rank, pair in enumerate(merges)}
    out = []
    for piece in regex.findall(GPT4_SPLIT, text):
        ids = list(piece.encode("utf-8"))
        while True:
            pair = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, float("inf")))
            if pair not in ranks:
                break
            ids = nb01.reference_merge_pair(ids, pair, ranks[pair])
        out += ids
    return out


def test_bpe_encode_names_a_loop_that_runs_out_of_pairs():
    fails_with(nb01.check_bpe_encode, encode_until_min_fails, hint="no pair is left")


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab c1ü\n", max_size=60), extra=st.integers(1, 40), probe=st.text(alphabet="ab c1ü\n", max_size=30))
def test_learned_order_equals_lowest_rank_first_and_tiktoken(text, extra, probe):
    merges = train_bpe(text, 256 + extra).merges
    expected = nb01.reference_bpe_encode(probe, merges)
    assert bpe_encode(probe, merges) == expected == nb01.tiktoken_encode(probe, merges)
    words = regex.findall(GPT4_SPLIT, probe)
    assert [i for w in words for i in nb01.in_learned_order(list(w.encode()), merges)] == expected


def test_the_switch_path_counts_the_loop_with_the_learners_encoder():
    """Notebook 01 section 5 with USE_MY_ENCODER = True: the solution gives the reference's ids."""
    import inspect
    import textwrap as tw_module

    from tfedu.data import load_corpus

    loop = 'for i in range(10):\n    for j in range(10):\n        print("Hello!")\n'
    grouped = train_bpe(load_corpus()[:150_000] + inspect.getsource(tw_module), 600, pattern="gpt4")
    assert bpe_encode(loop, grouped.merges) == grouped.encode(loop)
    assert bpe_encode(load_corpus()[300_000:305_000], grouped.merges) == grouped.encode(load_corpus()[300_000:305_000])

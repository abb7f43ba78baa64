"""tfedu.wordpiece: the score, the ## prefix, greedy longest-match-first (oracle: HF tokenizers' WordPiece model)."""

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfedu import wordpiece as wp
from tfedu.tokenizer import train_bpe_naive

SENTENCE = "the cat sat on the mat the cat ate the rat"


def test_worked_example_wordpiece_and_bpe_choose_different_first_merges():
    counts = Counter(SENTENCE.split())
    scores = wp.pair_scores({tuple(wp.split_word(w)): n for w, n in counts.items()})
    assert scores[("o", "##n")] == 1  # o and n never occur apart
    assert scores[("t", "##h")] == Fraction(4, 16) and scores[("##a", "##t")] == Fraction(5, 5 * 6)
    vocab = wp.train_wordpiece(counts, 14)
    assert vocab[-2:] == ["on", "th"]
    # BPE on the same words merges the most frequent pair, a+t (6 times), first
    first = train_bpe_naive(" ".join(["the"] * 4 + ["cat"] * 2 + ["sat", "on", "mat", "ate", "rat"]), 257, pattern="gpt4")
    assert first == [(97, 116)]


def test_score_matches_a_brute_force_count():
    words = {("a", "##b", "##a", "##b"): 3, ("b", "##a"): 2}
    symbols = Counter()
    for w, n in words.items():
        for s in w:
            symbols[s] += n
    assert wp.pair_scores(words)[("##a", "##b")] == Fraction(3, symbols["##a"] * symbols["##b"])
    assert wp.pair_scores(words)[("##b", "##a")] == Fraction(3, 6 * 5)


def test_greedy_longest_match_first_and_unknown_words():
    vocab = ["un", "##happy", "##hap", "##py", "happy", "h", "##a"]
    assert wp.encode_word("unhappy", vocab) == ["un", "##happy"]
    assert wp.encode_word("happy", vocab) == ["happy"]
    assert wp.encode_word("unhappyx", vocab) == ["[UNK]"]  # one unknown character: the whole word
    assert wp.encode("happy unhappy", vocab) == ["happy", "un", "##happy"]


def test_training_stops_when_every_word_is_one_symbol():
    vocab = wp.train_wordpiece({"ab": 3}, 100)
    assert vocab == ["##b", "a", "ab"]


@pytest.mark.parametrize("word", ["", "a b", 3])
def test_bad_words_are_rejected(word):
    with pytest.raises(ValueError, match="non-empty str"):
        wp.split_word(word)
    with pytest.raises(ValueError, match="empty"):
        wp.train_wordpiece({}, 10)


tokenizers = pytest.importorskip("tokenizers")


@settings(max_examples=150, deadline=None)
@given(
    corpus=st.lists(st.text(alphabet="abcab", min_size=1, max_size=6), min_size=1, max_size=12),
    size=st.integers(1, 25),
    word=st.text(alphabet="abcd", min_size=1, max_size=8),
)
def test_encoding_agrees_with_hf_tokenizers_wordpiece(corpus, size, word):
    vocab = wp.train_wordpiece(Counter(corpus), size)
    ids = {piece: i for i, piece in enumerate(vocab + ["[UNK]"])}
    model = tokenizers.models.WordPiece(ids, unk_token="[UNK]", max_input_chars_per_word=100)
    expected = [t.value for t in model.tokenize(word)]
    assert wp.encode_word(word, vocab) == expected
    pieces = wp.encode_word(word, vocab)
    if pieces != ["[UNK]"]:
        assert "".join(p.removeprefix("##") for p in pieces) == word

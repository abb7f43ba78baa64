"""WordPiece, BERT's sub-word tokenizer, as a small reference next to byte-level BPE.

Built by hand in notebooks/01_tokenization.ipynb, where it is compared with BPE. Three
differences from ``tfedu.tokenizer``:

1. **Score.** Training merges the pair with the highest ``count(ab) / (count(a) * count(b))``,
   not the most frequent pair: a pair whose parts seldom occur apart wins. (The likelihood
   view: merging ``a, b`` raises the corpus's unigram log-likelihood by roughly that ratio;
   Schuster & Nakajima 2012 introduced WordPiece, BERT, Devlin et al. 2019, uses it.)
2. **"##".** A piece that continues a word is written with a ``##`` prefix (``"##ing"``), so
   ``"at"`` at the start of a word and ``"##at"`` inside one are different tokens. There is no
   pre-token space as in GPT's ``" the"``: words are split on whitespace first.
3. **Encoding** is greedy longest-match-first from the left of each word, with no merge list;
   a word with a character outside the vocabulary becomes ``[UNK]`` as a whole (no byte fallback).

Counts are exact fractions, and ties go to the smallest pair, so results are reproducible.

>>> vocab = train_wordpiece({"the": 4, "cat": 2, "on": 1}, 10)
>>> vocab[-2:]
['on', '##at']
>>> encode_word("cat", vocab), encode_word("at", vocab), encode_word("dog", vocab)
(['c', '##at'], ['[UNK]'], ['[UNK]'])
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from fractions import Fraction

CONTINUATION = "##"
UNKNOWN = "[UNK]"


def split_word(word: str) -> list[str]:
    """A word as WordPiece's starting symbols: the first character, then ``##`` + each other one.

    >>> split_word("cat")
    ['c', '##a', '##t']
    """
    if not isinstance(word, str) or not word or any(c.isspace() for c in word):
        raise ValueError(f"a word is a non-empty str without whitespace, got {word!r}")
    return [word[0]] + [CONTINUATION + c for c in word[1:]]


def join_pieces(a: str, b: str) -> str:
    """The symbol that merging ``a`` and ``b`` makes: ``b`` loses its ``##``.

    >>> join_pieces("c", "##a"), join_pieces("##a", "##t")
    ('ca', '##at')
    """
    return a + b.removeprefix(CONTINUATION)


def pair_scores(words: Mapping[tuple[str, ...], int]) -> dict[tuple[str, str], Fraction]:
    """``count(ab) / (count(a) * count(b))`` for every adjacent pair, counts weighted by word frequency.

    >>> pair_scores({("o", "##n"): 1, ("c", "##a", "##t"): 2, ("s", "##a", "##t"): 1})[("o", "##n")]
    Fraction(1, 1)
    """
    symbols: Counter = Counter()
    pairs: Counter = Counter()
    for word, freq in words.items():
        for symbol in word:
            symbols[symbol] += freq
        for pair in zip(word, word[1:]):
            pairs[pair] += freq
    return {pair: Fraction(n, symbols[pair[0]] * symbols[pair[1]]) for pair, n in pairs.items()}


def train_wordpiece(word_counts: Mapping[str, int], vocab_size: int) -> list[str]:
    """Learn a WordPiece vocabulary from ``{word: count}``: the alphabet, then one symbol per merge.

    Each step merges the pair with the highest score (``pair_scores``; ties: the smallest pair)
    in every word. Stops at ``vocab_size`` symbols or when every word is one symbol.

    >>> train_wordpiece({"the": 4, "cat": 2, "on": 1}, 9)
    ['##a', '##e', '##h', '##n', '##t', 'c', 'o', 't', 'on']
    """
    if not word_counts:
        raise ValueError("word_counts is empty: expected {word: count}")
    words = {tuple(split_word(w)): int(n) for w, n in word_counts.items()}
    vocab = sorted({symbol for word in words for symbol in word})
    while len(vocab) < vocab_size:
        scores = pair_scores(words)
        if not scores:
            break
        best = min(scores, key=lambda p: (-scores[p], p))
        vocab.append(join_pieces(*best))
        words = {_merge(word, best): n for word, n in words.items()}
    return vocab


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(join_pieces(*pair))
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def encode_word(word: str, vocab: list[str] | set[str]) -> list[str]:
    """Greedy longest-match-first: take the longest vocabulary piece at the left, repeat on the rest.

    Pieces after the first are looked up with their ``##``. If some position has no piece at
    all, the whole word is ``[UNK]``.

    >>> encode_word("unhappy", {"un", "##happy", "##h", "happy"})
    ['un', '##happy']
    """
    known = set(vocab)
    split_word(word)  # the same checks on the word
    pieces, start = [], 0
    while start < len(word):
        prefix = "" if start == 0 else CONTINUATION
        for end in range(len(word), start, -1):
            if prefix + word[start:end] in known:
                pieces.append(prefix + word[start:end])
                start = end
                break
        else:
            return [UNKNOWN]
    return pieces


def encode(text: str, vocab: list[str] | set[str]) -> list[str]:
    """Split ``text`` on whitespace and encode each word.

    >>> encode("cat on", ["c", "##a", "##t", "on"])
    ['c', '##a', '##t', 'on']
    """
    return [piece for word in text.split() for piece in encode_word(word, vocab)]

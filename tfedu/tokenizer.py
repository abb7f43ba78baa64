"""Byte-level BPE: the worked example, a fast incremental trainer, and an exact encoder.

Built by hand in notebooks/01_tokenization.ipynb. The pieces, in the order the notebook
builds them:

- ``get_pair_counts`` and ``merge_pair``: one step of BPE on a list of ids.
- ``train_bpe_naive``: the plain trainer that recounts every pair after every merge
  (the notebook's version, kept as the oracle for the fast one).
- ``pretokenize`` with ``GPT2_PATTERN`` / ``GPT4_PATTERN``: split text into words first,
  so merges never cross a word boundary.
- ``train_bpe``: the same merges, found incrementally (see its docstring for how).
- ``Tokenizer``: encode, decode, save/load, tiktoken ranks, GPT-2's published files.

Ids 0-255 are the 256 byte values, merge ``i`` makes id ``256 + i``, special tokens
come after the merges. **Tie-break:** when several pairs share the highest count, the
pair with the smaller ids wins, i.e. the lexicographically smallest ``(a, b)``. With
a = 1, ..., z = 26 this is the rule that makes the lecture's worked example merge
``ab`` rather than ``Za`` at its tied second step.

>>> tok = train_bpe("aaabdaaabac", 259, pattern=None)
>>> tok.merges
[(97, 97), (97, 98), (256, 257)]
>>> tok.encode("aaabdaaabac")
[258, 100, 258, 97, 99]
"""

from __future__ import annotations

import hashlib
import heapq
import json
import operator
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path

import regex

from tfedu.tokenizer_io import FORMAT_NAME, FORMAT_VERSION, parse_tokenizer_file, read_gpt2_files, render_token

# The split patterns as published. GPT-2's is the one in OpenAI's gpt-2 repository
# (src/encoder.py); GPT-4's is cl100k_base as published in tiktoken. They differ in
# ways the notebook measures: GPT-4 matches contractions case-insensitively (GPT-2
# splits "I'M" into "I", "'", "M" but "I'm" into "I", "'m"), groups digits in runs of
# at most three, and keeps newlines apart from other whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT4_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
PATTERNS = {"gpt2": GPT2_PATTERN, "gpt4": GPT4_PATTERN}


def letter_ids(text: str) -> list[int]:
    """a..z -> 1..26, the lecture's toy vocabulary.

    >>> letter_ids("abz")
    [1, 2, 26]
    """
    if not text.isascii() or not text.isalpha() or not text.islower():
        raise ValueError(f"letter_ids takes lowercase letters a-z, got {text!r}")
    return [ord(c) - ord("a") + 1 for c in text]


_CACHE_LIMIT = 200_000  # pre-tokens remembered by an encoder before its cache is emptied
_LONG_WORD = 64  # words longer than this get local count updates (pattern=None makes one huge word)
_LONG_CHUNK = 256  # pre-tokens longer than this are encoded merge by merge in rank order
_STREAM_BLOCK = 1 << 16  # characters encode_iterable gathers before it looks for a safe cut


# ---------------------------------------------------------------------------------------
# The small pieces (the notebook's exercises)
# ---------------------------------------------------------------------------------------


def get_pair_counts(ids: Sequence[int]) -> dict[tuple[int, int], int]:
    """Count every adjacent pair of ids, overlapping ones included.

    >>> get_pair_counts([97, 97, 97, 98])
    {(97, 97): 2, (97, 98): 1}
    """
    return dict(Counter(zip(ids, ids[1:])))


def merge_pair(ids: Sequence[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace each occurrence of ``pair`` by ``new_id``, scanning left to right.

    A replaced pair is consumed, so occurrences never overlap: ``aaa`` becomes ``Za``.

    >>> merge_pair([97, 97, 97], (97, 97), 256)
    [256, 97]
    """
    a, b = pair
    out = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def resolve_pattern(pattern: str | None) -> str | None:
    """``"gpt2"``/``"gpt4"`` give the published pattern, any other string is taken as a regex.

    A string that is neither a known name nor a valid regex raises ``ValueError``.
    """
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a name ({', '.join(PATTERNS)}), a regex string or None; got {type(pattern).__name__}")
    if pattern in PATTERNS:
        return PATTERNS[pattern]
    if pattern.isidentifier():  # looks like a name, not a regex: most likely a typo
        raise ValueError(f"unknown pattern name {pattern!r}; expected one of {sorted(PATTERNS)}, a regex string or None")
    try:
        regex.compile(pattern)
    except regex.error as err:
        raise ValueError(f"pattern {pattern!r} is neither a known name ({', '.join(PATTERNS)}) nor a valid regex: {err}") from None
    return pattern


def pretokenize(text: str, pattern: str | None) -> list[str]:
    """Split ``text`` into the pre-tokens (words) that BPE merges within.

    >>> pretokenize("I'm here, I'M", "gpt2")
    ['I', "'m", ' here', ',', ' I', "'", 'M']
    >>> pretokenize("hello world", None)
    ['hello world']
    """
    _check_text(text)
    pat = resolve_pattern(pattern)
    if pat is None:
        return [text] if text else []
    return regex.findall(pat, text)


def split_on_specials(text: str, special_tokens: Iterable[str]) -> list[str]:
    """The pieces of ``text`` between occurrences of the special tokens (the specials dropped).

    Longer specials win where two could match at the same place. Empty pieces are kept.

    >>> split_on_specials("a<|eot|>b<|eot|>", ["<|eot|>"])
    ['a', 'b', '']
    """
    specials = sorted(special_tokens, key=len, reverse=True)
    if not specials:
        return [text]
    return regex.split("|".join(regex.escape(s) for s in specials), text)


def train_bpe_naive(text: str, vocab_size: int, pattern: str | None = None) -> list[tuple[int, int]]:
    """The plain trainer: count all pairs, merge the most frequent, repeat.

    Every step recounts every pair in every pre-token, so it costs O(corpus) per merge;
    ``train_bpe`` finds the same merges incrementally. Same tie-break (smallest pair
    wins among equal counts). Stops early if no pair is left.

    >>> train_bpe_naive("aaabdaaabac", 259)
    [(97, 97), (97, 98), (256, 257)]
    """
    _check_text(text)
    _check_vocab_size(vocab_size, 0)
    chunks = [list(word.encode("utf-8")) for word in pretokenize(text, pattern)]
    merges = []
    for new_id in range(256, vocab_size):
        counts: Counter = Counter()
        for ids in chunks:
            counts.update(zip(ids, ids[1:]))
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        chunks = [merge_pair(ids, pair, new_id) for ids in chunks]
        merges.append(pair)
    return merges


# ---------------------------------------------------------------------------------------
# The fast trainer
# ---------------------------------------------------------------------------------------


def train_bpe(
    text: str,
    vocab_size: int,
    *,
    pattern: str | None = "gpt4",
    special_tokens: Iterable[str] = (),
) -> Tokenizer:
    """Train byte-level BPE with ``vocab_size - 256 - len(special_tokens)`` merges.

    ``pattern`` is ``"gpt4"`` (default), ``"gpt2"``, a regex string, or ``None`` to treat
    the whole text as one word. Among pairs with equal counts the smallest ``(a, b)``
    wins. Training stops early if no pair is left to merge. The text is first cut at every
    occurrence of a special token and the specials are dropped, so every learned token is a
    piece of the text between them (``"<|"`` is never learned from ``"<|endoftext|>"``).

    How it is fast (same merges as ``train_bpe_naive``, which the tests check):

    1. Each distinct pre-token is stored once, with how often it occurs.
    2. A word is a ``str`` whose characters are token ids (``chr(id)``), so merging a pair
       in it is ``str.replace``: left to right, non-overlapping, exactly BPE's rule, and
       done in C. A pair is the two-character string ``chr(a) + chr(b)``, whose string
       order is the order of ``(a, b)``.
    3. ``counts[pair]`` holds the frequency-weighted count and ``where[pair]`` the words
       that contain it, so a merge touches only those words. In a word merged at one
       place only the two pairs with its neighbours change; in a long word merged at many
       places only the pairs around the merge sites are recounted.
    4. A heap of ``(-count, pair)`` finds the best pair. It is lazy: entries go stale when
       counts drop and are re-pushed with the true count when popped. A pair's count can
       only grow in the step that creates one of its two ids, so pushing the new pairs
       after each step keeps the heap right.

    >>> tok = train_bpe("aaabdaaabac", 259, pattern=None)
    >>> tok.merges, tok.encode("aaabdaaabac")
    ([(97, 97), (97, 98), (256, 257)], [258, 100, 258, 97, 99])
    """
    _check_text(text)
    specials = _check_special_tokens(special_tokens)
    _check_vocab_size(vocab_size, len(specials))
    pat = resolve_pattern(pattern)
    n_merges = vocab_size - 256 - len(specials)

    # 1. distinct pre-tokens and their frequencies, as strings of byte-valued characters. The
    # special tokens are cut out first, so no merge ever sees their bytes: training on text full of
    # "<|endoftext|>" must not learn "<|" or "|>", pieces of a token that never occurs as text.
    words_freq: Counter = Counter()
    for part in split_on_specials(text, specials):
        words_freq.update(regex.findall(pat, part) if pat is not None else ([part] if part else []))
    words: list[str] = []
    freqs: list[int] = []
    for word, freq in words_freq.items():
        try:
            encoded = word.encode("utf-8")
        except UnicodeEncodeError:
            raise _surrogate_error(text) from None
        if len(encoded) > 1:  # a single byte never takes part in a pair
            words.append(encoded.decode("latin-1"))  # byte b -> chr(b), the id as a character
            freqs.append(freq)

    # 2. initial pair counts and the index pair -> words that contain it
    add = operator.add
    counts: defaultdict[str, int] = defaultdict(int)
    where: defaultdict[str, set[int]] = defaultdict(set)
    for i, word in enumerate(words):
        freq = freqs[i]
        for pair in map(add, word, word[1:]):
            counts[pair] += freq
            where[pair].add(i)
    heap = [(-count, pair) for pair, count in counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[int, int]] = []
    for new_id in range(256, 256 + n_merges):
        # 3. the best pair: pop until an entry's count is the true count
        best = None
        while heap:
            neg, pair = heapq.heappop(heap)
            count = counts[pair]
            if count == -neg:
                best = pair
                break
            if count > 0:
                heapq.heappush(heap, (-count, pair))
        if best is None:
            break
        merges.append((ord(best[0]), ord(best[1])))
        new_char = chr(new_id)

        # 4. merge it in every word that holds it, updating counts only for those words
        born: set[str] = set()  # pairs that involve the new id
        first, second = best
        for i in where.pop(best):
            word = words[i]
            site = word.find(best)
            if site < 0:  # stale index entry: an earlier merge removed the pair
                continue
            freq = freqs[i]
            words[i] = merged = word.replace(best, new_char)
            if word.find(best, site + 2) < 0:
                # The common case, one merge site: only the pairs with its two neighbours
                # change. (The count of `best` itself is dropped after the loop.)
                if site:
                    left = word[site - 1]
                    counts[left + first] -= freq
                    pair = left + new_char
                    counts[pair] += freq
                    born.add(pair)
                    where[pair].add(i)
                if site + 2 < len(word):
                    right = word[site + 2]
                    counts[second + right] -= freq
                    pair = new_char + right
                    counts[pair] += freq
                    born.add(pair)
                    where[pair].add(i)
                continue
            if len(word) > _LONG_WORD:
                # Only pairs next to a merge site change. Split at the sites and keep each
                # piece's first and last character: the piece's inside (here one made-up pair)
                # is the same before and after, so it cancels in the difference.
                ends = [piece if len(piece) < 3 else piece[0] + piece[-1] for piece in word.split(best)]
                word, after = best.join(ends), new_char.join(ends)
            else:
                after = merged
            for pair in map(add, word, word[1:]):
                counts[pair] -= freq
            for pair in map(add, after, after[1:]):
                counts[pair] += freq
                if new_char in pair:
                    born.add(pair)
                    where[pair].add(i)
        del counts[best]
        for pair in born:
            heapq.heappush(heap, (-counts[pair], pair))

    special_ids = {token: 256 + len(merges) + k for k, token in enumerate(specials)}
    return Tokenizer(merges, special_tokens=special_ids, pattern=pat)


# ---------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------


class _ChunkCache(dict):
    """pre-token -> its ids; a miss runs BPE on the pre-token and remembers the result."""

    def __init__(self, encode_chunk):
        super().__init__()
        self.encode_chunk = encode_chunk

    def __missing__(self, chunk: str) -> tuple[int, ...]:
        ids = self.encode_chunk(chunk)
        if len(self) >= _CACHE_LIMIT:
            self.clear()
        self[chunk] = ids
        return ids


class Tokenizer:
    """A byte-level BPE tokenizer: merges, special tokens and a split pattern.

    ``merges[i]`` is the pair of ids merged into id ``256 + i``. ``byte_ids[b]`` is the id
    of the single byte ``b``: the identity for tokenizers trained here, a permutation for
    GPT-2's published files. Usually made by ``train_bpe``, ``Tokenizer.load`` or
    ``Tokenizer.from_gpt2_files``.

    >>> tok = Tokenizer([(104, 105)], pattern="gpt4")
    >>> tok.encode("hi hi"), tok.decode([256, 32, 256])
    ([256, 32, 256], 'hi hi')
    """

    def __init__(
        self,
        merges: Sequence[tuple[int, int]],
        *,
        special_tokens: dict[str, int] | None = None,
        pattern: str | None = "gpt4",
        byte_ids: Sequence[int] | None = None,
    ):
        self.pattern: str | None = resolve_pattern(pattern)
        self.byte_ids: list[int] = list(range(256)) if byte_ids is None else [int(i) for i in byte_ids]
        if sorted(self.byte_ids) != list(range(256)):
            raise ValueError("byte_ids must be a permutation of 0..255 (the ids of the 256 single bytes)")
        self.merges: list[tuple[int, int]] = []
        self.vocab: dict[int, bytes] = {self.byte_ids[b]: bytes([b]) for b in range(256)}
        for i, pair in enumerate(merges):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"merge {i} must be a pair of ids, got {pair!r}")
            a, b = int(pair[0]), int(pair[1])
            if a not in self.vocab or b not in self.vocab:
                raise ValueError(f"merge {i} ({a}, {b}) uses an id not defined before it (ids so far: 0..{255 + i})")
            self.merges.append((a, b))
            self.vocab[256 + i] = self.vocab[a] + self.vocab[b]
        self.special_tokens: dict[str, int] = {}
        for token, idx in (special_tokens or {}).items():
            if not isinstance(token, str) or not token:
                raise ValueError(f"special tokens must be non-empty strings, got {token!r}")
            if int(idx) in self.vocab:
                raise ValueError(f"special token {token!r} has id {idx}, which is already taken")
            self.special_tokens[token] = int(idx)
            self.vocab[int(idx)] = token.encode("utf-8")
        if len(set(self.merges)) != len(self.merges):
            raise ValueError("merges must be distinct: the same pair appears twice")
        # The same merges with ids written as characters, for _encode_chunk.
        self._byte_table = bytes(self.byte_ids)  # byte b -> its id, for bytes.translate
        self._char_merges = {chr(a) + chr(b): chr(256 + i) for i, (a, b) in enumerate(self.merges)}
        self._char_pairs = {merged: pair for pair, merged in self._char_merges.items()}
        self._regex = regex.compile(self.pattern) if self.pattern is not None else None
        self._special_regex = {}
        self._cache = _ChunkCache(self._encode_chunk)

    # -- sizes and views --------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    def __repr__(self) -> str:
        pat = next((name for name, p in PATTERNS.items() if p == self.pattern), "custom" if self.pattern else None)
        return f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, special_tokens={len(self.special_tokens)}, pattern={pat!r})"

    def mergeable_ranks(self) -> dict[bytes, int]:
        """Token bytes -> id for every non-special token: the ranks ``tiktoken.Encoding`` takes.

        >>> Tokenizer([(104, 105)]).mergeable_ranks()[b"hi"]
        256
        """
        ranks = {}
        for idx, token in self.vocab.items():
            if idx in self.special_tokens.values():
                continue
            if token in ranks:
                raise ValueError(f"tokens {ranks[token]} and {idx} have the same bytes {token!r}; tiktoken needs them distinct")
            ranks[token] = idx
        return ranks

    # -- encoding ---------------------------------------------------------------------

    def _encode_chunk(self, chunk: str) -> tuple[int, ...]:
        """BPE on one pre-token: apply the lowest-ranked merge present until none applies.

        As in ``train_bpe`` the ids are characters of a string, so a merge is ``str.replace``.
        Merge ``r`` makes id ``256 + r``, so among the merges present the lowest rank is
        simply the smallest merged character.
        """
        ids = chunk.encode("utf-8").translate(self._byte_table).decode("latin-1")
        if len(ids) > _LONG_CHUNK:
            # Long text (pattern=None): go through the merges in rank order. A merge can
            # only create pairs of higher rank than itself, so this equals the loop below.
            for pair, new_char in self._char_merges.items():
                if pair in ids:
                    ids = ids.replace(pair, new_char)
            return tuple(map(ord, ids))
        add, lookup, pair_of = operator.add, self._char_merges.get, self._char_pairs
        while len(ids) > 1:
            present = set(map(lookup, map(add, ids, ids[1:])))
            present.discard(None)
            if not present:
                break
            new_char = min(present)
            ids = ids.replace(pair_of[new_char], new_char)
        return tuple(map(ord, ids))

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode ``text`` treating special-token strings as ordinary text.

        >>> Tokenizer([(104, 105)]).encode_ordinary("hi!")
        [256, 33]
        """
        _check_text(text)
        try:
            if self._regex is None:
                return list(self._encode_chunk(text)) if text else []
            # map + chain keep the per-pre-token loop in C; misses fall through to __missing__
            return list(chain.from_iterable(map(self._cache.__getitem__, self._regex.findall(text))))
        except UnicodeEncodeError:
            raise _surrogate_error(text) from None

    def encode(self, text: str, allowed_special: str | set[str] | frozenset[str] = "all") -> list[int]:
        """Encode ``text``; special tokens in ``allowed_special`` become their single id.

        ``allowed_special`` is ``"all"`` (default), ``"none"`` (specials are plain text) or a
        set of special-token strings.

        >>> tok = train_bpe("ab ab", 258, pattern=None, special_tokens=["<|eot|>"])
        >>> tok.encode("ab<|eot|>"), tok.encode("ab<|eot|>", allowed_special="none")[:2]
        ([256, 257], [256, 60])
        """
        _check_text(text)
        allowed = self._allowed(allowed_special)
        if not allowed:
            return self.encode_ordinary(text)
        splitter = self._special_regex.get(allowed)
        if splitter is None:
            # longest first, so a special token that contains another one wins
            alternatives = "|".join(regex.escape(s) for s in sorted(allowed, key=len, reverse=True))
            splitter = self._special_regex[allowed] = regex.compile(f"({alternatives})")
        out: list[int] = []
        for k, part in enumerate(splitter.split(text)):
            if k % 2:
                out.append(self.special_tokens[part])
            elif part:
                out.extend(self.encode_ordinary(part))
        return out

    def _allowed(self, allowed_special) -> frozenset[str]:
        """The special tokens that ``allowed_special`` ("all", "none" or a set) turns into ids."""
        if allowed_special == "all":
            return frozenset(self.special_tokens)
        if allowed_special == "none":
            return frozenset()
        if isinstance(allowed_special, (set, frozenset)):
            unknown = set(allowed_special) - set(self.special_tokens)
            if unknown:
                raise ValueError(f"allowed_special names tokens that are not special tokens of this tokenizer: {sorted(unknown)}")
            return frozenset(allowed_special)
        raise ValueError(f'allowed_special must be "all", "none" or a set of special tokens, got {allowed_special!r}')

    def encode_iterable(
        self, texts: Iterable[str], allowed_special: str | set[str] | frozenset[str] = "all"
    ) -> Iterator[int]:
        r"""Encode a stream of strings (an open text file, say) lazily, in bounded memory.

        The ids are exactly ``encode("".join(texts))``. Encoding each line on its own would not
        be: GPT-2's pattern makes the ``" \n"`` of ``"a \n"`` one pre-token at the end of a text but
        two (``" "``, ``"\n"``) when a word follows, and a run of blank lines is one pre-token that a
        line-by-line encoder cuts.
        So pieces are gathered into a buffer, and only the text before a *safe cut* is encoded:
        a place between a letter and a non-letter, or between a non-space and a space or tab,
        that no allowed special token straddles, far enough from the buffer's end that a special
        token still arriving could not cover it. At such a place every pre-token of both split
        patterns ends, and none of them looks back or (before it) at the end of the text, so the
        text on either side encodes the same alone as together. Open files with ``newline=""``
        to keep ``"\r\n"`` as it is. Memory holds about ``_STREAM_BLOCK`` characters plus the
        longest stretch without a safe cut (in ordinary text, a line).

        The argument holds for ``"gpt2"``, ``"gpt4"`` and any pattern whose pre-tokens never run
        from a letter into a non-letter or from a non-space into a space or tab. ``pattern=None``
        (the whole text one pre-token) cannot be streamed and raises ``ValueError``.

        >>> tok = Tokenizer([(104, 105)], pattern="gpt2")
        >>> lines = ["hi  \n", "\n", "  hi"]
        >>> list(tok.encode_iterable(lines)) == tok.encode("".join(lines))
        True
        """
        if self._regex is None:
            raise ValueError("encode_iterable needs a split pattern: with pattern=None the whole text is one pre-token")
        if isinstance(texts, (str, bytes)):
            raise TypeError("encode_iterable takes an iterable of strings (lines, chunks); for one string use encode")
        allowed = self._allowed(allowed_special)
        margin = max((len(token) for token in allowed), default=1)
        pending: list[str] = []
        size = 0
        for piece in texts:
            _check_text(piece)
            pending.append(piece)
            size += len(piece)
            if size < _STREAM_BLOCK:
                continue
            buffer = "".join(pending)
            cut = _safe_cut(buffer, len(buffer) - margin, allowed)
            if cut > 0:
                yield from self.encode(buffer[:cut], allowed)
                buffer = buffer[cut:]
            pending, size = [buffer], len(buffer)
        if size:
            yield from self.encode("".join(pending), allowed)

    # -- decoding ---------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes behind ``ids``; an id outside the vocabulary raises ``ValueError``.

        >>> Tokenizer([]).decode_bytes([195, 188])
        b'\\xc3\\xbc'
        """
        vocab = self.vocab
        try:
            return b"".join([vocab[i] for i in ids])
        except (KeyError, TypeError):
            pass
        for position, i in enumerate(ids):  # slow path, only to write a precise message
            if isinstance(i, bool) or not isinstance(i, int) and not hasattr(i, "__index__"):
                raise TypeError(f"ids must be integers; position {position} holds {type(i).__name__} {i!r}")
            if int(i) not in vocab:
                raise ValueError(f"id {int(i)} at position {position} is not in the vocabulary (size {len(vocab)}, ids 0..{max(vocab)})")
        return b"".join(vocab[int(i)] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ``ids`` to text; bytes that are not valid UTF-8 become U+FFFD.

        >>> Tokenizer([]).decode([71, 195, 188]), Tokenizer([]).decode([128])
        ('Gü', '\\ufffd')
        """
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # -- files --------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer as UTF-8 text (format below); returns the path.

        Format ``tfedu-bpe 1``, one record per line::

            tfedu-bpe 1
            pattern gpt4              (or gpt2, or none, or: pattern regex <crc32> "<regex, JSON>")
            bytes identity            (or: bytes <the ids of bytes 0..255>)
            merges <N>
            <256 + i> <a> <b> "<token text, JSON>"        (N lines, i = 0..N-1)
            specials <M>
            <id> <crc32> "<special token, JSON>"           (M lines; the CRC covers the id too)
            sha256 <hex digest of every byte above this line>

        Every line can be checked on its own, so ``load`` names the damaged line: the token
        text on a merge line (for people reading the file; invalid UTF-8 shown as ``\\xNN``)
        must match its ids, and free text carries a CRC-32 of its JSON. The SHA-256 line
        covers the whole file.
        """
        name = next((name for name, regex_ in PATTERNS.items() if regex_ == self.pattern), None)
        if self.pattern is None:
            pattern_line = "pattern none"
        elif name is not None:
            pattern_line = f"pattern {name}"
        else:
            pattern_line = f"pattern regex {_with_crc(json.dumps(self.pattern, ensure_ascii=False))}"
        lines = [f"{FORMAT_NAME} {FORMAT_VERSION}", pattern_line]
        identity = self.byte_ids == list(range(256))
        lines.append("bytes identity" if identity else "bytes " + " ".join(map(str, self.byte_ids)))
        lines.append(f"merges {len(self.merges)}")
        for i, (a, b) in enumerate(self.merges):
            lines.append(f"{256 + i} {a} {b} {render_token(self.vocab[256 + i])}")
        lines.append(f"specials {len(self.special_tokens)}")
        for token, idx in self.special_tokens.items():
            lines.append(f"{idx} {_with_crc(json.dumps(token, ensure_ascii=False), salt=str(idx))}")
        body = ("\n".join(lines) + "\n").encode("utf-8")
        path = Path(path)
        path.write_bytes(body + f"sha256 {hashlib.sha256(body).hexdigest()}\n".encode("ascii"))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a file written by ``save``; any damage raises ``ValueError`` naming the line."""
        fields = parse_tokenizer_file(Path(path).read_bytes(), str(path))
        return cls(fields["merges"], special_tokens=fields["special_tokens"], pattern=fields["pattern"], byte_ids=fields["byte_ids"])

    @classmethod
    def from_gpt2_files(cls, encoder_json_path: str | Path, vocab_bpe_path: str | Path) -> Tokenizer:
        """Load GPT-2's published ``encoder.json`` and ``vocab.bpe`` (ids as GPT-2 numbers them)."""
        merges, byte_ids, specials = read_gpt2_files(encoder_json_path, vocab_bpe_path)
        return cls(merges, special_tokens=specials, pattern=GPT2_PATTERN, byte_ids=byte_ids)


# Where a stream may be cut: after a letter before a non-letter, or after a non-space before a
# space or tab. Searched backwards ((?r)), so the first hit is the last such place.
_CUT = regex.compile(r"(?r)(?<=\p{L})(?=\P{L})|(?<=\S)(?=[ \t])")


def _safe_cut(buffer: str, limit: int, specials: Iterable[str]) -> int:
    """The last safe cut ``c <= limit`` in ``buffer`` that no special token straddles; 0 if none.

    A special token straddles ``c`` when it starts before ``c`` and ends after it. Since
    ``limit`` leaves room for the longest special after ``c``, any straddling one is in the
    buffer already, whatever text comes next.
    """
    end = limit + 1  # the cut regex looks at buffer[c], so c < end
    while end > 1:
        found = _CUT.search(buffer, 0, end)
        if found is None:
            return 0
        c = found.start()
        if not any(buffer.find(token, max(0, c - len(token) + 1), c + len(token) - 1) >= 0 for token in specials):
            return c
        end = c
    return 0


# ---------------------------------------------------------------------------------------
# Argument checks shared by the trainers
# ---------------------------------------------------------------------------------------


def _with_crc(text: str, salt: str = "") -> str:
    """``text`` preceded by the CRC-32 (8 hex digits) of ``salt + " " + text``.

    The salt is the rest of the line (a special token's id), so a change anywhere on the
    line makes the line itself fail to load.
    """
    return f"{zlib.crc32(f'{salt} {text}'.encode('utf-8')):08x} {text}"


def _surrogate_error(text: str) -> ValueError:
    """The error for text that has no UTF-8 form: it holds a lone surrogate code point."""
    position = next(i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF)
    return ValueError(
        f"text holds a lone surrogate {text[position]!r} at index {position}, which has no UTF-8 bytes; "
        "byte-level BPE needs valid Unicode (if it came from bytes, decode them with errors='replace')"
    )


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}" + (" (decode bytes first)" if isinstance(text, bytes) else ""))


def _check_vocab_size(vocab_size, n_special: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < 256 + n_special:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the 256 byte tokens"
            + (f" and {n_special} special tokens" if n_special else "")
            + f" already need {256 + n_special}"
        )


def _check_special_tokens(special_tokens) -> list[str]:
    if isinstance(special_tokens, str):
        raise TypeError("special_tokens must be a list of strings, not one string (wrap it: [token])")
    tokens = list(special_tokens)
    for token in tokens:
        if not isinstance(token, str) or not token:
            raise ValueError(f"special tokens must be non-empty strings, got {token!r}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"special_tokens has duplicates: {tokens}")
    return tokens

"""Constrained decoding: keep a model's output inside a regular expression, one token at a time.

At each step a logits processor (``tfedu.generate.generate(..., logits_processors=[...])``) sets to
-inf the logits of every token that would take the text out of the pattern's language, so the
softmax gives them probability 0 and neither sampling nor the argmax can pick them (the idea behind
Outlines, Willard & Louf 2023, and llama.cpp's grammars). ``RegexConstraint`` decides which tokens
stay with the ``regex`` package's partial matching: ``fullmatch(text, partial=True)`` succeeds when
``text`` is a match or the beginning of one.

A token is allowed when the bytes generated so far plus the token's bytes are the beginning of
(the UTF-8 bytes of) some full match. Tokens sharing a first byte share the test: the vocabulary is
a byte trie, and a prefix that cannot match rules out its whole subtree. A byte-level token can end
in the middle of a character; it stays only if some completion of that character keeps a match
possible. The end-of-text token is allowed exactly when the text is a full match, so a text that is
complete and cannot grow leaves only it. The allowed set depends only on the bytes so far, so it is
cached: a second generation along the same path costs no regex work.

>>> from tfedu.tokenizer import Tokenizer
>>> tok = Tokenizer([], special_tokens={"<|endoftext|>": 256})  # the 256 bytes and an end token
>>> constraint = RegexConstraint(r"(yes|no)!", tok, eos_token_id=256)
>>> sorted(chr(i) for i in constraint.allowed_ids(b""))  # the first byte: y or n
['n', 'y']
>>> constraint.allowed_ids(b"yes!")  # complete and cannot grow: only the end token
[256]

``UTF8Constraint`` is the simplest constraint of all, the one notebook 01 promises: only byte sequences that can
still become valid UTF-8 (``utf8_prefix_ok``, an eight-state automaton read off RFC 3629's table), so a byte-level
model can no longer write a stray continuation byte, an overlong form or a surrogate.

Built by hand in notebooks/15_interpretability_and_decoding.ipynb (exercise 15.7 writes ``utf8_prefix_ok``).
"""

from __future__ import annotations

import abc
import codecs
import time
from collections.abc import Sequence

import regex
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tfedu.generate import _check_count, generate
from tfedu.tokenizer import Tokenizer

# Deck 000's example, {"age": followed by a whole number below 1000 and a closing brace. JSON numbers have no
# leading zeros (RFC 8259, sec. 6), so "007" is refused: 0, or a digit 1-9 followed by up to two digits.
JSON_AGE = r'\{"age": (0|[1-9][0-9]{0,2})\}'


class UnsatisfiableConstraint(ValueError):
    """No token (and not the end token) can continue the text inside the pattern."""


def mask_logits(
    logits: Float[Tensor, "batch d_vocab"], allowed: Bool[Tensor, "batch d_vocab"]
) -> Float[Tensor, "batch d_vocab"]:
    """``logits`` with every entry that ``allowed`` marks False set to -inf (before the softmax).

    After the softmax those tokens have probability exactly 0 and the rest are renormalised among
    themselves: sampling and the argmax both pick only allowed tokens. (Masking after the softmax,
    or with a large negative number, leaves a little mass on forbidden tokens.) A row with no
    allowed token would be all -inf, a softmax of NaNs: that raises ``ValueError`` instead.

    >>> mask_logits(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[True, False, True]]))
    tensor([[1., -inf, 3.]])
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(f"logits must be a float tensor (batch, d_vocab), got {got}")
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
        raise TypeError(f"allowed must be a bool tensor (batch, d_vocab), True where a token may come next, got {got}")
    if allowed.shape != logits.shape:
        raise ValueError(f"allowed has shape {tuple(allowed.shape)}, logits {tuple(logits.shape)}: they must match")
    empty = ~allowed.any(dim=-1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} allow no token: every logit would be -inf and the softmax NaN")
    return logits.masked_fill(~allowed, float("-inf"))


# ----------------------------------------------------------------------------- UTF-8 and the pattern


def _split_utf8(data: bytes) -> tuple[str, bytes] | None:
    """``data`` as (the text of its complete characters, the bytes of an unfinished last one), or
    None when it is not the beginning of any valid UTF-8 (an overlong form, a surrogate, a stray
    continuation byte...): no completion can repair that."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return None
    return text, decoder.getstate()[0]


def _completions(tail: bytes) -> range:
    """The code points whose UTF-8 encoding starts with ``tail``, an unfinished character.

    UTF-8 keeps code point order, so they are one range: the tail fixes the high bits, the missing
    continuation bytes (6 bits each) are free. Clipped to the code points of that encoded length;
    the surrogates (only under the lead byte 0xED, which the decoder already limits) are skipped
    by the caller.
    """
    lead = tail[0]
    n = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    value = lead & (0x7F >> n)
    for b in tail[1:]:
        value = value << 6 | b & 0x3F
    free = 6 * (n - len(tail))
    lo, hi = value << free, (value << free) + (1 << free) - 1
    first, last = {2: (0x80, 0x7FF), 3: (0x800, 0xFFFF), 4: (0x10000, 0x10FFFF)}[n]
    return range(max(lo, first), min(hi, last) + 1)


def _character_atoms(pattern: str) -> tuple[frozenset[int], frozenset[str]] | None:
    """What the pattern can tell characters apart by: (code points where a literal or a range starts
    or stops, ``regex`` classes such as ``\\w``), or None when that cannot be read off safely.

    Between two consecutive such points, characters in the same runs of each class are matched
    alike by every part of the pattern, so one representative per stretch answers for all of them.
    Read from Python's own parse of the pattern (``re._parser``). None for IGNORECASE (``k`` also
    matches the Kelvin sign), back-references (they compare characters themselves), and ``regex``
    syntax that ``re`` reads differently (POSIX classes ``[[:alpha:]]``, fuzzy ``{e<=1}``) or not at all.
    """
    if "[:" in pattern or regex.search(r"(?<!\\)\{(?!\d*(,\d*)?\})", pattern):
        return None
    try:
        import re
        from re import _parser as c  # type: ignore[attr-defined]

        parsed = c.parse(pattern)
    except Exception:  # a pattern only ``regex`` reads, or a Python without re._parser
        return None
    if parsed.state.flags & re.IGNORECASE:
        return None
    classes_of = {c.CATEGORY_DIGIT: r"\d", c.CATEGORY_NOT_DIGIT: r"\d", c.CATEGORY_SPACE: r"\s",
                  c.CATEGORY_NOT_SPACE: r"\s", c.CATEGORY_WORD: r"\w", c.CATEGORY_NOT_WORD: r"\w"}
    repeats = (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT))
    points, classes = {10, 11}, set()  # "." matches all but the newline

    def walk(items) -> bool:
        for op, av in items:
            if op in (c.LITERAL, c.NOT_LITERAL):
                points.update((av, av + 1))
            elif op is c.IN:
                for item_op, item in av:
                    if item_op is c.LITERAL:
                        points.update((item, item + 1))
                    elif item_op is c.RANGE:
                        points.update((item[0], item[1] + 1))
                    elif item_op is c.CATEGORY and item in classes_of:
                        classes.add(classes_of[item])
                    elif item_op is not c.NEGATE:
                        return False
            elif op is c.AT:
                if av in (c.AT_BOUNDARY, c.AT_NON_BOUNDARY):
                    classes.add(r"\w")  # a word boundary looks at whether the neighbours are \w
            elif op in repeats:
                if not walk(av[2]):
                    return False
            elif op is c.SUBPATTERN:
                if av[1] & re.IGNORECASE or not walk(av[3]):
                    return False
            elif op is c.BRANCH:
                if not all(walk(branch) for branch in av[1]):
                    return False
            elif op is getattr(c, "ATOMIC_GROUP", None):
                if not walk(av):
                    return False
            elif op in (c.ASSERT, c.ASSERT_NOT):
                if not walk(av[1]):
                    return False
            elif op is not c.ANY:
                return False
        return True

    return (frozenset(points), frozenset(classes)) if walk(parsed) else None


# ----------------------------------------------------------------------------- the constraint


def _byte_trie(vocab: dict[int, bytes], specials: set[int]) -> tuple[list[int], dict]:
    """The byte trie of the ordinary tokens: node = (ids ending here, {next byte: child})."""
    trie: tuple[list[int], dict] = ([], {})
    for idx, token in vocab.items():
        if idx in specials or not token:
            continue
        node = trie
        for byte in token:
            node = node[1].setdefault(byte, ([], {}))
        node[0].append(idx)
    return trie


class _ByteProcessor(abc.ABC):
    """What the byte-level logits processors share: the tokenizer's byte vocabulary and special tokens checked, the
    prompt length (taken from the first call unless given), finished rows padded with the end token, and the call."""

    def _setup(self, tokenizer: Tokenizer, eos_token_id: int | None, prompt_len: int | None, *,
               eos_required: bool) -> tuple[dict[int, bytes], set[int]]:
        vocab = getattr(tokenizer, "vocab", None)
        if not isinstance(vocab, dict):
            raise TypeError(f"tokenizer must be a tfedu Tokenizer (with .vocab: id -> bytes), got {type(tokenizer).__name__}")
        specials = set(getattr(tokenizer, "special_tokens", {}).values())
        if eos_token_id is not None or eos_required:
            if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int) or eos_token_id < 0:
                either = "" if eos_required else "None or "
                raise ValueError(f"eos_token_id must be {either}a token id (int >= 0), got {eos_token_id!r}")
            if eos_token_id in vocab and eos_token_id not in specials:
                raise ValueError(f"eos_token_id {eos_token_id} is the ordinary token {vocab[eos_token_id]!r}; "
                                 "give the id of a special end-of-text token")
        if prompt_len is not None:
            _check_count("prompt_len", prompt_len, least=0)
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id
        self.prompt_len, self._fixed_prompt_len = prompt_len, prompt_len is not None
        self.d_vocab_needed = max(max(vocab) if vocab else 0, eos_token_id if eos_token_id is not None else 0) + 1
        return vocab, specials

    def reset(self) -> None:
        """Forget the prompt length (taken again from the next call), keep the cache."""
        if not self._fixed_prompt_len:
            self.prompt_len = None

    @abc.abstractmethod
    def _row_mask(self, generated_ids: list[int]) -> Tensor:
        """The bool mask over the first ``d_vocab_needed`` ids that may follow a row's generated tokens."""

    def __call__(self, ids: Int[Tensor, "batch pos"], logits: Float[Tensor, "batch d_vocab"]) -> Float[Tensor, "batch d_vocab"]:
        if not isinstance(ids, Tensor) or ids.dim() != 2 or not isinstance(logits, Tensor) or logits.dim() != 2 \
                or logits.shape[0] != ids.shape[0]:
            raise ValueError("a logits processor takes ids (batch, pos) and logits (batch, d_vocab) with the same batch, "
                             f"got {tuple(getattr(ids, 'shape', ()))} and {tuple(getattr(logits, 'shape', ()))}")
        if logits.shape[1] < self.d_vocab_needed:
            raise ValueError(f"logits have d_vocab={logits.shape[1]}, but the tokenizer and eos_token_id use ids up to "
                             f"{self.d_vocab_needed - 1}")
        if self.prompt_len is None:
            self.prompt_len = ids.shape[1]  # the first call sees the prompt alone
        if ids.shape[1] < self.prompt_len:
            raise ValueError(f"ids have {ids.shape[1]} positions, fewer than the prompt's {self.prompt_len}: "
                             "call reset() before generating from another prompt")
        allowed = torch.zeros(logits.shape, dtype=torch.bool)
        for row, generated_ids in enumerate(ids[:, self.prompt_len:].tolist()):
            if self.eos_token_id is not None and self.eos_token_id in generated_ids:
                allowed[row, self.eos_token_id] = True  # a finished row only pads
                continue
            allowed[row, :self.d_vocab_needed] = self._row_mask(generated_ids)
        return mask_logits(logits, allowed.to(logits.device))


class RegexConstraint(_ByteProcessor):
    """A logits processor that keeps the generated text (after the prompt) inside ``pattern``.

    Call it as ``constraint(ids, logits)`` (``generate(..., logits_processors=[constraint])``): for
    each row it takes the tokens after the prompt, and leaves finite only the logits of tokens whose
    bytes keep a full match of ``pattern`` reachable, plus ``eos_token_id`` when the text already is
    a full match. A row that has emitted ``eos_token_id`` may only repeat it (padding). The prompt
    length is taken from the first call unless given; ``reset()`` before using the constraint for
    another prompt (the cache of allowed sets is kept: it depends only on the generated bytes).

    Raises ``UnsatisfiableConstraint`` (a ``ValueError``) at construction when nothing matches the
    pattern at all, and during generation when a row's text cannot be continued.

    >>> from tfedu.tokenizer import Tokenizer
    >>> tok = Tokenizer([], special_tokens={"<|endoftext|>": 256})
    >>> constraint = RegexConstraint(r"[0-9]{2}", tok, eos_token_id=256)
    >>> out = constraint(torch.tensor([[7, ord("4")]]), torch.zeros(1, 257))  # prompt [7], generated "4"
    >>> [chr(i) for i in out[0].isfinite().nonzero().flatten().tolist()] == list("0123456789")
    True
    """

    def __init__(self, pattern: str, tokenizer: Tokenizer, *, eos_token_id: int, prompt_len: int | None = None):
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a regular expression as a str, got {type(pattern).__name__}")
        try:
            self.regex = regex.compile(pattern)
        except regex.error as error:
            raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {error}") from None
        vocab, specials = self._setup(tokenizer, eos_token_id, prompt_len, eos_required=True)
        self.pattern = pattern
        self._atoms = _character_atoms(pattern)  # None: try every completion of an unfinished character
        self._representatives_of: dict[range, list[int]] = {}
        self._trie = _byte_trie(vocab, specials)
        self._cache: dict[bytes, list[int]] = {}
        self.regex_calls = 0  # how many partial matches were run: the work the cache saves
        self.allowed_ids(b"")  # an empty language fails here, before any generation

    def clear_cache(self) -> None:
        """Forget every allowed set computed so far (to time a cold start)."""
        self._cache.clear()

    # -- which bytes can still lead to a match ------------------------------------------------

    def _viable(self, data: bytes) -> bool:
        """Whether ``data`` is the beginning of the UTF-8 bytes of some full match."""
        split = _split_utf8(data)
        if split is None:
            return False
        text, tail = split
        if not tail:
            self.regex_calls += 1
            return self.regex.fullmatch(text, partial=True) is not None
        for code in self._representatives(_completions(tail)):  # some completion must keep a match possible
            self.regex_calls += 1
            if self.regex.fullmatch(text + chr(code), partial=True) is not None:
                return True
        return False

    def _representatives(self, codes: range) -> list[int]:
        """Code points of ``codes`` (no surrogates) that the pattern matches alike with all the others, one per stretch."""
        if self._atoms is None:
            return [code for code in codes if not 0xD800 <= code <= 0xDFFF]
        if codes not in self._representatives_of:
            points, classes = self._atoms
            cuts = {codes.start, 0xD800, 0xE000} | points  # 0xD800..0xDFFF: the surrogates, never characters
            if classes:
                chars = [code for code in codes if not 0xD800 <= code <= 0xDFFF]
                text = "".join(map(chr, chars))
                for cls in classes:  # where each run of the class starts and stops
                    for run in regex.finditer(cls + "+", text):
                        cuts.add(chars[run.start()])
                        cuts.add(chars[run.end() - 1] + 1)
            self._representatives_of[codes] = sorted(
                cut for cut in cuts if cut in codes and not 0xD800 <= cut <= 0xDFFF)
        return self._representatives_of[codes]

    def allowed_ids(self, generated: bytes) -> list[int]:
        """The ids that may follow the generated bytes (sorted), the end token included when they are a full match.

        Raises ``UnsatisfiableConstraint`` when none may.
        """
        if generated in self._cache:
            return self._cache[generated]
        if not self._viable(generated):
            raise UnsatisfiableConstraint(self._message(generated, "cannot be continued to a match"))
        allowed = []
        stack = [(generated, self._trie)]
        while stack:  # depth first over the trie; a prefix that cannot match drops its whole subtree
            data, (ids, children) = stack.pop()
            for byte, child in children.items():
                longer = data + bytes([byte])
                if self._viable(longer):
                    allowed.extend(child[0])
                    stack.append((longer, child))
        split = _split_utf8(generated)
        if split is not None and not split[1] and self.regex.fullmatch(split[0]) is not None:
            allowed.append(self.eos_token_id)
        if not allowed:
            raise UnsatisfiableConstraint(self._message(generated, "has no token of the vocabulary that continues it"))
        self._cache[generated] = allowed = sorted(allowed)
        return allowed

    def _message(self, generated: bytes, problem: str) -> str:
        return f"pattern {self.pattern!r}: the text generated so far {generated.decode('utf-8', 'replace')!r} {problem}"

    def _row_mask(self, generated_ids: list[int]) -> Tensor:
        mask = torch.zeros(self.d_vocab_needed, dtype=torch.bool)
        mask[self.allowed_ids(self.tokenizer.decode_bytes(generated_ids))] = True
        return mask


# ----------------------------------------------------------------------------- UTF-8 prefixes

# The well-formed UTF-8 byte sequences (RFC 3629, sec. 4; the Unicode Standard, table 3-7):
#
#   U+0000..U+007F      00..7F
#   U+0080..U+07FF      C2..DF  80..BF
#   U+0800..U+0FFF      E0      A0..BF  80..BF
#   U+1000..U+CFFF      E1..EC  80..BF  80..BF
#   U+D000..U+D7FF      ED      80..9F  80..BF
#   U+E000..U+FFFF      EE..EF  80..BF  80..BF
#   U+10000..U+3FFFF    F0      90..BF  80..BF  80..BF
#   U+40000..U+FFFFF    F1..F3  80..BF  80..BF  80..BF
#   U+100000..U+10FFFF  F4      80..8F  80..BF  80..BF
#
# As an automaton: between characters (UTF8_START) a lead byte fixes how many continuation bytes follow; every
# other state is (continuation bytes still missing, the range the next byte must lie in). The narrow ranges after
# E0 and F0 rule out overlong forms, after ED the surrogates D800..DFFF, after F4 code points above U+10FFFF.
# C0, C1 and F5..FF never occur; a continuation byte 80..BF never starts a character.
UTF8_START = 0
UTF8_STATES = (
    (0, 0x00, 0x00),  # 0: between characters (the lead byte decides, see _utf8_lead)
    (1, 0x80, 0xBF),  # 1: one continuation byte missing
    (2, 0x80, 0xBF),  # 2: two missing
    (3, 0x80, 0xBF),  # 3: three missing
    (2, 0xA0, 0xBF),  # 4: after E0: no overlong 3-byte form
    (2, 0x80, 0x9F),  # 5: after ED: no surrogate
    (3, 0x90, 0xBF),  # 6: after F0: no overlong 4-byte form
    (3, 0x80, 0x8F),  # 7: after F4: nothing above U+10FFFF
)


def _utf8_lead(byte: int) -> int | None:
    """The state after ``byte`` read between characters, or None when it cannot start one."""
    if byte <= 0x7F:
        return UTF8_START
    if 0xC2 <= byte <= 0xDF:
        return 1
    if byte in (0xE0, 0xED):
        return 4 if byte == 0xE0 else 5
    if 0xE1 <= byte <= 0xEF:
        return 2
    if byte in (0xF0, 0xF4):
        return 6 if byte == 0xF0 else 7
    if 0xF1 <= byte <= 0xF3:
        return 3
    return None  # 80..BF (a continuation byte), C0 and C1 (only overlong forms), F5..FF (beyond U+10FFFF)


def _utf8_transition(state: int, byte: int) -> int | None:
    if state == UTF8_START:
        return _utf8_lead(byte)
    missing, lo, hi = UTF8_STATES[state]
    return missing - 1 if lo <= byte <= hi else None  # states 4..7 lead to 1 or 2: the rest is unrestricted


# UTF8_TABLE[state][byte]: the next state, or None where the bytes can no longer become valid UTF-8.
UTF8_TABLE: tuple[tuple[int | None, ...], ...] = tuple(
    tuple(_utf8_transition(state, byte) for byte in range(256)) for state in range(len(UTF8_STATES)))


def _check_bytes(data: object) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    return bytes(data)


def utf8_state(data: bytes, state: int = UTF8_START) -> int | None:
    """The automaton's state after reading ``data`` from ``state``, or None once no continuation can be valid UTF-8.

    ``UTF8_START`` (0) means between characters: ``data`` is complete, valid UTF-8.

    >>> utf8_state("é".encode()), utf8_state("€".encode()[:2]), utf8_state(b"\\xed\\xa0")  # U+D800 would follow
    (0, 1, None)
    """
    data = _check_bytes(data)
    if isinstance(state, bool) or not isinstance(state, int) or not 0 <= state < len(UTF8_STATES):
        raise ValueError(f"state must be one of the automaton's states 0..{len(UTF8_STATES) - 1}, got {state!r}")
    table = UTF8_TABLE
    for byte in data:
        state = table[state][byte]
        if state is None:
            return None
    return state


def utf8_prefix_ok(data: bytes) -> bool:
    """Whether ``data`` can still become valid UTF-8: valid UTF-8 followed by the beginning of one more character.

    >>> utf8_prefix_ok("né".encode()[:2]), utf8_prefix_ok(b"\\xe0\\x80"), utf8_prefix_ok(b"\\x80")  # \\xe0\\x80: overlong
    (True, False, False)
    """
    return utf8_state(data) is not None


def _last_character(data: bytes) -> bytes:
    """The bytes of ``data``'s last multi-byte character, finished or not (empty after an ASCII byte or for no bytes).

    When ``data`` can still become valid UTF-8, everything before them is complete characters, so whether more bytes
    keep it so depends on these alone. A character starts at a byte that is no continuation byte (10xxxxxx)."""
    for back in range(1, min(4, len(data)) + 1):
        if not 0x80 <= data[-back] <= 0xBF:
            return b"" if data[-back] < 0x80 else data[-back:]
    return data[-4:]  # no start within 4 bytes: not valid, and the predicate will say so


class UTF8Constraint(_ByteProcessor):
    """A logits processor that keeps the generated bytes (after the prompt) the beginning of valid UTF-8.

    A byte-level model can write any byte after any other; a lone continuation byte, a surrogate or an overlong form
    is not UTF-8 and decodes to U+FFFD (notebook 01). This processor leaves finite only the logits of tokens after
    whose bytes the text can still become valid UTF-8 (:func:`utf8_prefix_ok`), and of ``eos_token_id`` (optional)
    between characters only, so an ended text always decodes; other special tokens never. A row that has emitted
    ``eos_token_id`` may only repeat it (padding). Compose it with other constraints by listing them:
    ``generate(..., logits_processors=[utf8, rule])`` keeps only tokens that both allow (a ``RegexConstraint``
    already implies valid UTF-8, since it matches decoded text).

    ``prefix_ok=None`` uses the automaton (``UTF8_TABLE``). Its allowed set depends only on its state, and there are
    eight: walking the vocabulary's byte trie once per state, carrying the state byte by byte and dropping a subtree
    at the first byte with no transition, gives each state's mask and, for each allowed token, the state after it. A
    step then folds the row's tokens through that table and looks up the mask: no walk, no bytes.

    ``prefix_ok`` a function ``bytes -> bool`` (a learner's ``utf8_prefix_ok``) is asked instead, at every node of
    the walk. Only the last character's bytes matter (before them everything is complete characters), so the walk
    is keyed on them (:func:`_last_character`) and cached; ``eos_token_id`` is allowed when ``prefix_ok(last +
    b"A")``, since an ASCII byte can follow only a finished character. Both ways give the same sets for a correct
    ``prefix_ok`` (tests/test_constrained.py).

    >>> from tfedu.tokenizer import Tokenizer
    >>> tok = Tokenizer([], special_tokens={"<|endoftext|>": 256})
    >>> utf8 = UTF8Constraint(tok, eos_token_id=256)
    >>> [hex(i) for i in utf8.allowed_ids(b"\\xe0")][:2], len(utf8.allowed_ids(b"\\xe0"))  # after E0: A0..BF only
    (['0xa0', '0xa1'], 32)
    >>> 256 in utf8.allowed_ids(b"a"), 256 in utf8.allowed_ids(b"\\xc3")  # the end token between characters only
    (True, False)
    """

    def __init__(self, tokenizer: Tokenizer, *, eos_token_id: int | None = None, prompt_len: int | None = None,
                 prefix_ok=None):
        if prefix_ok is not None and not callable(prefix_ok):
            raise TypeError(f"prefix_ok must be None or a function bytes -> bool, got {type(prefix_ok).__name__}")
        vocab, specials = self._setup(tokenizer, eos_token_id, prompt_len, eos_required=False)
        self.prefix_ok = prefix_ok
        self._trie = _byte_trie(vocab, specials)
        self._masks: dict = {}  # automaton state (or, with prefix_ok, last character) -> bool mask over the ids
        self._after: dict[int, dict[int, int]] = {}  # automaton state -> {allowed id: the state after its bytes}
        self.walks = 0  # how many trie walks were made: the work the cache saves

    # -- the allowed sets ------------------------------------------------------------------------

    def _mask(self, ids: list[int], eos: bool) -> Tensor:
        mask = torch.zeros(self.d_vocab_needed, dtype=torch.bool)
        mask[ids] = True
        if eos and self.eos_token_id is not None:
            mask[self.eos_token_id] = True
        if not bool(mask.any()):
            raise UnsatisfiableConstraint("no token of the vocabulary keeps the text valid UTF-8 here")
        return mask

    def _state_mask(self, state: int) -> Tensor:
        """The mask of automaton state ``state``: one walk of the trie carrying the state."""
        if state not in self._masks:
            self.walks += 1
            after: dict[int, int] = {}
            stack = [(state, self._trie)]
            while stack:
                now, (_, children) = stack.pop()
                for byte, child in children.items():
                    nxt = UTF8_TABLE[now][byte]
                    if nxt is not None:  # else the whole subtree is out
                        after.update(dict.fromkeys(child[0], nxt))
                        stack.append((nxt, child))
            self._after[state] = after
            self._masks[state] = self._mask(list(after), eos=state == UTF8_START)
        return self._masks[state]

    def _key_mask(self, last: bytes) -> Tensor:
        """With ``prefix_ok``: the mask after a text whose last character's bytes are ``last``."""
        if last not in self._masks:
            self.walks += 1
            allowed: list[int] = []
            stack = [(last, self._trie)]
            while stack:
                data, (_, children) = stack.pop()
                for byte, child in children.items():
                    longer = data + bytes([byte])
                    if self.prefix_ok(longer):
                        allowed.extend(child[0])
                        stack.append((longer, child))
            self._masks[last] = self._mask(allowed, eos=bool(self.prefix_ok(last + b"A")))
        return self._masks[last]

    def _not_utf8(self, generated: bytes) -> ValueError:
        return ValueError(f"the text generated so far {generated!r} can no longer become valid UTF-8: was the constraint "
                          "used from the first generated token on (call reset() before another prompt)?")

    def allowed_mask(self, generated: bytes) -> Bool[Tensor, " d_vocab"]:
        """A bool mask over the ids (``d_vocab_needed`` of them), True where a token may follow ``generated``."""
        generated = _check_bytes(generated)
        if self.prefix_ok is None:
            state = utf8_state(generated)
            if state is None:
                raise self._not_utf8(generated)
            return self._state_mask(state)
        if not self.prefix_ok(generated):
            raise self._not_utf8(generated)
        return self._key_mask(_last_character(generated))

    def allowed_ids(self, generated: bytes) -> list[int]:
        """The ids that may follow the bytes ``generated`` (sorted), the end token included between characters."""
        return self.allowed_mask(generated).nonzero().flatten().tolist()

    def _row_mask(self, generated_ids: list[int]) -> Tensor:
        if self.prefix_ok is not None:
            return self.allowed_mask(self.tokenizer.decode_bytes(generated_ids))
        state = UTF8_START
        for idx in generated_ids:  # the state carried token by token through the table of the walks
            self._state_mask(state)
            nxt = self._after[state].get(idx)
            if nxt is None:
                raise self._not_utf8(self.tokenizer.decode_bytes(generated_ids))
            state = nxt
        return self._state_mask(state)


# ----------------------------------------------------------------------------- conveniences


def _prompt_ids(tokenizer: Tokenizer, prompt: str, device: torch.device) -> Tensor:
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty str, got {prompt!r}")
    return torch.tensor([tokenizer.encode(prompt)], device=device)


def generate_matching(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    pattern: str | RegexConstraint,
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> str:
    """The text the model writes after ``prompt`` under ``pattern``: always a full match.

    ``pattern`` is a regular expression or a ``RegexConstraint`` (reuse one to keep its cache).
    ``eos_token_id`` defaults to the tokenizer's ``<|endoftext|>``. Raises ``ValueError`` when the
    match is not finished after ``max_new_tokens`` (the text so far is in the message).

    >>> from tfedu.experiments import course_gpt
    >>> model, tok = course_gpt.load()  # doctest: +SKIP
    >>> generate_matching(model, tok, "The person is", JSON_AGE, max_new_tokens=16)  # doctest: +SKIP
    '{"age": 101}'
    """
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "special_tokens", {}).get("<|endoftext|>")
        if eos_token_id is None:
            raise ValueError("the tokenizer has no <|endoftext|> special token: pass eos_token_id")
    if isinstance(pattern, RegexConstraint):
        constraint = pattern
        constraint.reset()
    else:
        constraint = RegexConstraint(pattern, tokenizer, eos_token_id=eos_token_id)
    device = next(model.parameters()).device
    ids = _prompt_ids(tokenizer, prompt, device)
    out = generate(model, ids, max_new_tokens, do_sample=do_sample, temperature=temperature, generator=generator,
                   eos_token_id=constraint.eos_token_id, logits_processors=[constraint])
    new = out[0, ids.shape[1]:].tolist()
    if constraint.eos_token_id not in new:
        raise ValueError(f"pattern {constraint.pattern!r}: no full match within max_new_tokens={max_new_tokens}, "
                         f"the text so far is {tokenizer.decode(new)!r}; allow more tokens")
    return tokenizer.decode(new[:new.index(constraint.eos_token_id)])


def bench(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    pattern: str,
    n_tokens: int,
    *,
    repeats: int = 3,
    eos_token_id: int | None = None,
) -> dict[str, float]:
    """Milliseconds per generated token, greedy, on one torch thread: without and with the constraint.

    ``plain_ms``: ``n_tokens`` unconstrained tokens. ``cold_ms``: the constrained run with an empty
    cache (each step's allowed set computed by walking the trie). ``warm_ms``: the same run again,
    every allowed set now cached. ``build_ms``: making the constraint (trie, the first allowed set).
    ``constrained_tokens``: how many tokens the constrained run generated (it stops at the end token).
    Each time is the best of ``repeats`` runs (the least disturbed by other work on the machine).

    >>> from tfedu.experiments import course_gpt
    >>> model, tok = course_gpt.load()  # doctest: +SKIP
    >>> bench(model, tok, "The person is", JSON_AGE, 16)["warm_ms"]  # doctest: +SKIP
    """
    _check_count("n_tokens", n_tokens, least=1)
    _check_count("repeats", repeats, least=1)
    if eos_token_id is None:
        eos_token_id = tokenizer.special_tokens.get("<|endoftext|>")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = _prompt_ids(tokenizer, prompt, next(model.parameters()).device)

        def best(run) -> tuple[float, Tensor]:
            times, out = [], None
            for _ in range(repeats):
                start = time.perf_counter()
                out = run()
                times.append(time.perf_counter() - start)
            return min(times), out

        plain_s, _ = best(lambda: generate(model, ids, n_tokens))
        start = time.perf_counter()
        constraint = RegexConstraint(pattern, tokenizer, eos_token_id=eos_token_id)
        build_s = time.perf_counter() - start

        def constrained(clear: bool):
            def run():
                if clear:
                    constraint.clear_cache()
                constraint.reset()
                return generate(model, ids, n_tokens, eos_token_id=eos_token_id, logits_processors=[constraint])
            return run

        cold_s, out = best(constrained(clear=True))
        warm_s, _ = best(constrained(clear=False))
    finally:
        torch.set_num_threads(threads)
    generated = out.shape[1] - ids.shape[1]
    return dict(plain_ms=1e3 * plain_s / n_tokens, cold_ms=1e3 * cold_s / generated,
                warm_ms=1e3 * warm_s / generated, build_ms=1e3 * build_s, constrained_tokens=float(generated))

"""Reading tokenizer files: tfedu's own ``tfedu-bpe`` format and GPT-2's published files.

Kept apart from tfedu/tokenizer.py so that module reads as the algorithm; the format is
documented in ``Tokenizer.save``. Every error names the file and the line.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

FORMAT_NAME = "tfedu-bpe"
FORMAT_VERSION = 1


class TokenizerFileError(ValueError):
    """A tokenizer file that is damaged, truncated or not in the expected format."""


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters.

    GPT-2's ``encoder.json`` and ``vocab.bpe`` store tokens as text, so each byte is
    shown as a visible character: the printable Latin-1 bytes stand for themselves,
    the others (control bytes, space, ...) get 256, 257, ... in byte order. That is why
    a leading space appears as ``Ġ`` (chr(288)) in GPT-2's files.

    >>> m = gpt2_bytes_to_unicode()
    >>> m[ord("a")], m[ord(" ")], m[ord("\\n")]
    ('a', 'Ġ', 'Ċ')
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_gpt2_files(encoder_json_path, vocab_bpe_path) -> tuple[list[tuple[int, int]], list[int], dict[str, int]]:
    """Parse GPT-2's ``encoder.json`` (token text -> id) and ``vocab.bpe`` (merges in rank order).

    Returns ``(merges, byte_ids, special_tokens)`` in tfedu's terms: ``byte_ids[b]`` is
    GPT-2's id for byte ``b``, merge ``i`` produces id ``256 + i``, and encoder entries that
    are neither bytes nor merges (``<|endoftext|>``) become special tokens.
    """
    encoder_json_path, vocab_bpe_path = Path(encoder_json_path), Path(vocab_bpe_path)
    try:
        encoder = json.loads(encoder_json_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerFileError(f"{encoder_json_path}: not a JSON object of token -> id ({err})") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise TokenizerFileError(f"{encoder_json_path}: expected a JSON object mapping token text to integer ids")
    byte_to_char = gpt2_bytes_to_unicode()
    byte_ids = []
    for b in range(256):
        char = byte_to_char[b]
        if char not in encoder:
            raise TokenizerFileError(f"{encoder_json_path}: the single-byte token {char!r} (byte {b}) is missing")
        byte_ids.append(encoder[char])
    if sorted(byte_ids) != list(range(256)):
        raise TokenizerFileError(f"{encoder_json_path}: the 256 single-byte tokens must have ids 0..255")

    lines = vocab_bpe_path.read_text(encoding="utf-8").split("\n")
    merges: list[tuple[int, int]] = []
    for number, line in enumerate(lines, start=1):
        if line.startswith("#version") or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise TokenizerFileError(f"{vocab_bpe_path}, line {number}: expected two tokens separated by one space, got {line!r}")
        left, right = parts
        ids = []
        for part in (left, right):
            if part not in encoder:
                raise TokenizerFileError(f"{vocab_bpe_path}, line {number}: token {part!r} is not in {encoder_json_path.name}")
            ids.append(encoder[part])
        merged = left + right
        want = 256 + len(merges)
        if encoder.get(merged) != want:
            raise TokenizerFileError(
                f"{vocab_bpe_path}, line {number}: the merge {left!r} + {right!r} should produce id {want} "
                f"(merges are numbered from 256 in file order) but {encoder_json_path.name} gives {encoder.get(merged)}"
            )
        merges.append((ids[0], ids[1]))
    known = set(range(256 + len(merges)))
    specials = {}
    for token, idx in encoder.items():
        if idx not in known:
            specials[token] = idx
    return merges, byte_ids, specials


def render_token(token: bytes) -> str:
    """A token's bytes as readable JSON text (invalid UTF-8 as \\xNN), as a merge line of the file shows it."""
    return json.dumps(token.decode("utf-8", errors="backslashreplace"), ensure_ascii=False)


def parse_tokenizer_file(data: bytes, name: str = "<tokenizer file>") -> dict:
    """Parse the ``tfedu-bpe`` format (see ``Tokenizer.save``) into the Tokenizer's fields.

    Checks, in order: each line is UTF-8; the header, counts and records parse; every
    merge line's id and text agree with its pair; the file ends with the checksum line;
    the checksum matches. The first failure raises ``TokenizerFileError`` naming the line.
    """
    def fail(line_no: int, problem: str):
        raise TokenizerFileError(f"{name}, line {line_no}: {problem}")

    if not data:
        raise TokenizerFileError(f"{name}: the file is empty (expected a '{FORMAT_NAME} {FORMAT_VERSION}' header)")
    raw_lines = data.split(b"\n")
    if raw_lines[-1] != b"":
        fail(len(raw_lines), "the last line does not end with a newline: the file is truncated")
    raw_lines = raw_lines[:-1]
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            fail(number, f"not valid UTF-8 at byte {err.start} of the line: the file is damaged")

    position = 0  # index into lines of the next line to read

    def next_line(what: str) -> tuple[int, str]:
        nonlocal position
        if position >= len(lines):
            fail(len(lines) + 1, f"the file ends here, but {what} was expected: the file is truncated")
        position += 1
        return position, lines[position - 1]

    def json_with_crc(field: str, line_no: int, what: str, salt: str = ""):
        crc, _, text = field.partition(" ")
        if len(crc) != 8 or any(c not in "0123456789abcdef" for c in crc):
            fail(line_no, f"expected a CRC-32 (8 hex digits) before {what}, got {crc[:12]!r}")
        if f"{zlib.crc32(f'{salt} {text}'.encode('utf-8')):08x}" != crc:
            fail(line_no, f"{what} does not match its CRC-32 {crc}: the line is damaged")
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            fail(line_no, f"{what} is not valid JSON ({err.msg})")

    def count_line(keyword: str, after: str = "") -> tuple[int, int]:
        number, line = next_line(f"'{keyword} <count>'")
        head, _, rest = line.partition(" ")
        if head != keyword or not rest.isdigit():
            fail(number, f"expected '{keyword} <count>'{after}, got {line[:80]!r}")
        return number, int(rest)

    number, line = next_line("the header")
    if line != f"{FORMAT_NAME} {FORMAT_VERSION}":
        if line.startswith(FORMAT_NAME + " "):
            fail(number, f"format version {line[len(FORMAT_NAME) + 1:]!r} is not supported (this tfedu reads version {FORMAT_VERSION})")
        fail(number, f"expected the header '{FORMAT_NAME} {FORMAT_VERSION}', got {line[:80]!r}: not a tfedu tokenizer file, or damaged")

    number, line = next_line("'pattern ...'")
    pattern = None
    if line in ("pattern gpt2", "pattern gpt4"):
        pattern = line[len("pattern "):]  # a name the Tokenizer resolves (tfedu.tokenizer.PATTERNS)
    elif line.startswith("pattern regex "):
        pattern = json_with_crc(line[len("pattern regex "):], number, "the pattern")
        if not isinstance(pattern, str):
            fail(number, "the pattern must be a JSON string")
    elif line != "pattern none":
        fail(number, f"expected 'pattern gpt2', 'pattern gpt4', 'pattern none' or 'pattern regex <crc32> <JSON>', got {line[:80]!r}")

    number, line = next_line("'bytes ...'")
    if line == "bytes identity":
        byte_ids = list(range(256))
    else:
        parts = line.split(" ")
        if parts[0] != "bytes" or len(parts) != 257 or not all(p.isdigit() for p in parts[1:]):
            fail(number, f"expected 'bytes identity' or 'bytes' followed by 256 ids, got {line[:80]!r}")
        byte_ids = [int(p) for p in parts[1:]]
        if sorted(byte_ids) != list(range(256)):
            fail(number, "the 256 byte ids must be a permutation of 0..255")

    vocab = {byte_ids[b]: bytes([b]) for b in range(256)}
    merges_line, n_merges = count_line("merges")
    merges = []
    for i in range(n_merges):
        number, line = next_line(f"merge {i + 1} of the {n_merges} announced on line {merges_line}")
        parts = line.split(" ", 3)
        if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]):
            fail(number, f"expected merge {i + 1} of the {n_merges} announced on line {merges_line} ('<id> <a> <b> <token text>'), got {line[:80]!r}")
        idx, a, b = (int(p) for p in parts[:3])
        if idx != 256 + i:
            fail(number, f"merge {i + 1} must produce id {256 + i}, the line says {idx}")
        if a not in vocab or b not in vocab:
            fail(number, f"merge ({a}, {b}) uses an id not defined before this line (ids so far: 0..{255 + i})")
        token = vocab[a] + vocab[b]
        if parts[3] != render_token(token):
            fail(number, f"the token text {parts[3][:40]} does not match the pair ({a}, {b}), which gives {render_token(token)}")
        vocab[idx] = token
        merges.append((a, b))

    specials_line, n_specials = count_line("specials", f" after the {n_merges} merges announced on line {merges_line}")
    special_tokens: dict[str, int] = {}
    for k in range(n_specials):
        number, line = next_line(f"special token {k + 1} of the {n_specials} announced on line {specials_line}")
        idx_text, _, field = line.partition(" ")
        if not idx_text.isdigit():
            fail(number, f"expected special token {k + 1} of the {n_specials} announced on line {specials_line} ('<id> <crc32> <JSON string>'), got {line[:80]!r}")
        token = json_with_crc(field, number, "the special token", salt=idx_text)
        if not isinstance(token, str) or not token:
            fail(number, f"a special token must be a non-empty JSON string, got {token!r}")
        if int(idx_text) in vocab or token in special_tokens:
            fail(number, f"special token {token!r} with id {idx_text} clashes with an earlier token")
        special_tokens[token] = int(idx_text)
        vocab[int(idx_text)] = token.encode("utf-8")

    number, line = next_line("the checksum line 'sha256 <hex>'")
    head, _, digest = line.partition(" ")
    if head != "sha256" or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        fail(number, f"expected the checksum line 'sha256 <64 hex digits>' after the {n_specials} special tokens announced on line {specials_line}, got {line[:80]!r}")
    if position != len(lines):
        fail(position + 1, "unexpected text after the checksum line")
    body = b"".join(raw + b"\n" for raw in raw_lines[:-1])
    actual = hashlib.sha256(body).hexdigest()
    if actual != digest:
        fail(
            number,
            f"checksum mismatch: the file records sha256 {digest[:12]}... but lines 1-{number - 1} hash to "
            f"{actual[:12]}...; the file was changed or damaged after it was saved",
        )
    return {"pattern": pattern, "byte_ids": byte_ids, "merges": merges, "special_tokens": special_tokens}

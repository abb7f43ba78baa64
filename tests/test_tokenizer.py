"""tfedu.tokenizer: the worked example, error messages, and oracles (naive trainer, tiktoken)."""

import pytest

from tfedu.tokenizer import (
    GPT2_PATTERN,
    GPT4_PATTERN,
    PATTERNS,
    Tokenizer,
    get_pair_counts,
    merge_pair,
    pretokenize,
    train_bpe,
    train_bpe_naive,
)

WORKED = "aaabdaaabac"


def test_worked_example_merges_and_ids():
    tok = train_bpe(WORKED, 259, pattern=None)
    assert tok.merges == [(97, 97), (97, 98), (256, 257)]
    assert tok.encode(WORKED) == [258, 100, 258, 97, 99]
    assert tok.decode([258, 100, 258, 97, 99]) == WORKED
    assert tok.vocab[258] == b"aaab" and len(tok.vocab) == 259


def test_worked_example_first_counts_and_the_tie():
    ids = list(WORKED.encode())
    assert get_pair_counts(ids) == {(97, 97): 4, (97, 98): 2, (98, 100): 1, (100, 97): 1, (98, 97): 1, (97, 99): 1}
    step1 = merge_pair(ids, (97, 97), 256)
    counts = get_pair_counts(step1)
    # the tie the lecture resolves towards `ab`: (256, 97) "Za" and (97, 98) "ab" both twice
    assert counts[(256, 97)] == counts[(97, 98)] == 2
    assert train_bpe_naive(WORKED, 258)[1] == (97, 98)


def test_pair_counts_overlap_and_merge_does_not():
    assert get_pair_counts([97, 97, 97]) == {(97, 97): 2}
    assert merge_pair([97, 97, 97], (97, 97), 256) == [256, 97]
    assert merge_pair([97, 97, 97, 97], (97, 97), 256) == [256, 256]
    assert merge_pair([], (1, 2), 3) == [] and get_pair_counts([5]) == {}


def test_patterns_are_published_ones():
    assert PATTERNS == {"gpt2": GPT2_PATTERN, "gpt4": GPT4_PATTERN}
    assert pretokenize("I'm I'M", "gpt2") == ["I", "'m", " I", "'", "M"]
    assert pretokenize("I'm I'M", "gpt4") == ["I", "'m", " I", "'M"]
    assert pretokenize("12345", "gpt4") == ["123", "45"]
    assert pretokenize("12345", "gpt2") == ["12345"]
    assert pretokenize("a b", r"\S+") == ["a", "b"]


def test_ids_layout_bytes_then_merges_then_specials():
    tok = train_bpe("hello hello world", 262, special_tokens=["<|endoftext|>", "<|pad|>"])
    assert len(tok.merges) == 4 and tok.vocab_size == 262
    assert tok.special_tokens == {"<|endoftext|>": 260, "<|pad|>": 261}
    assert all(tok.vocab[b] == bytes([b]) for b in range(256))


def test_special_tokens_in_encode():
    tok = train_bpe("hello world " * 5, 270, special_tokens=["<|eot|>"])
    eot = tok.special_tokens["<|eot|>"]
    text = "hello<|eot|>world"
    ids = tok.encode(text)
    assert ids.count(eot) == 1 and tok.decode(ids) == text
    assert eot not in tok.encode(text, allowed_special="none")
    assert tok.encode(text, allowed_special={"<|eot|>"}) == ids
    assert tok.encode_ordinary(text) == tok.encode(text, allowed_special="none")
    assert tok.decode(tok.encode(text, allowed_special="none")) == text
    with pytest.raises(ValueError, match="not special tokens"):
        tok.encode(text, allowed_special={"<|nope|>"})


def test_decode_replaces_invalid_utf8_and_rejects_unknown_ids():
    tok = train_bpe(WORKED, 259, pattern=None)
    assert tok.decode([128]) == "\ufffd"
    assert tok.decode([71]) == "G" and tok.encode("ü") == [195, 188]
    assert tok.decode_bytes([195, 188]) == "ü".encode()
    with pytest.raises(ValueError, match="id 259 at position 1 is not in the vocabulary"):
        tok.decode([97, 259])
    with pytest.raises(TypeError, match="integers"):
        tok.decode([97, "a"])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: train_bpe("abc", 255), ValueError, "vocab_size=255 is too small"),
        (lambda: train_bpe("abc", 256, special_tokens=["<s>"]), ValueError, "1 special tokens already need 257"),
        (lambda: train_bpe(b"abc", 300), TypeError, "text must be a str, got bytes"),
        (lambda: train_bpe("abc", 300, pattern="gpt5"), ValueError, "unknown pattern name 'gpt5'"),
        (lambda: train_bpe("abc", 300, pattern="(unclosed"), ValueError, "neither a known name"),
        (lambda: train_bpe("abc", 300, special_tokens="<s>"), TypeError, "not one string"),
        (lambda: train_bpe("abc", 300, special_tokens=["<s>", "<s>"]), ValueError, "duplicates"),
        (lambda: train_bpe("abc", 300.0), TypeError, "vocab_size must be an int"),
        (lambda: Tokenizer([(97, 300)]), ValueError, "not defined before it"),
    ],
)
def test_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_training_stops_when_no_pair_is_left():
    tok = train_bpe("ab", 1000, pattern=None)
    assert tok.merges == [(97, 98)]
    assert train_bpe_naive("ab", 1000) == [(97, 98)]

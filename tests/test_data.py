import hashlib

import pytest

from tfedu import data


def test_default_corpus_is_offline_pydoc_text():
    text = data.load_corpus()
    assert text == data.load_corpus("pydoc")
    assert 400_000 < len(text) < 600_000
    assert "The assert statement" in text or "assert" in text


def test_default_corpus_is_deterministic():
    assert data.sha256_hex(data.load_corpus().encode()) == data.sha256_hex(data.load_corpus().encode())


def test_unknown_corpus_names_the_choices():
    with pytest.raises(ValueError, match="pydoc, tiny_shakespeare"):
        data.load_corpus("wikipedia")


@pytest.fixture
def local_remote(tmp_path, monkeypatch):
    """A 'remote' corpus served from a local file URL: the download code runs, the network is never used."""
    source = tmp_path / "served" / "corpus.txt"
    source.parent.mkdir()
    payload = "To be, or not to be: that is the question.\n".encode()
    source.write_bytes(payload)
    spec = data.RemoteCorpus(url=source.as_uri(), sha256=hashlib.sha256(payload).hexdigest(), filename="tiny.txt")
    monkeypatch.setitem(data.REMOTE_CORPORA, "tiny_shakespeare", spec)
    monkeypatch.setenv("TFEDU_CACHE", str(tmp_path / "cache"))
    return source, payload


def test_remote_corpus_downloads_once_and_caches(local_remote, tmp_path):
    source, payload = local_remote
    assert data.load_corpus("tiny_shakespeare") == payload.decode()
    assert (tmp_path / "cache" / "tiny.txt").read_bytes() == payload
    source.unlink()  # a second load must come from the cache, not the "network"
    assert data.load_corpus("tiny_shakespeare") == payload.decode()


def test_remote_corpus_with_wrong_checksum_is_not_saved(local_remote, tmp_path, monkeypatch):
    spec = data.REMOTE_CORPORA["tiny_shakespeare"]
    monkeypatch.setitem(data.REMOTE_CORPORA, "tiny_shakespeare", data.RemoteCorpus(spec.url, "0" * 64, spec.filename))
    with pytest.raises(ValueError, match="SHA-256"):
        data.load_corpus("tiny_shakespeare")
    assert not (tmp_path / "cache" / "tiny.txt").exists()
    assert not list((tmp_path / "cache").glob("*.part")) if (tmp_path / "cache").exists() else True


def test_tampered_cache_is_detected(local_remote, tmp_path):
    data.load_corpus("tiny_shakespeare")
    (tmp_path / "cache" / "tiny.txt").write_text("tampered")
    with pytest.raises(ValueError, match="does not match its SHA-256"):
        data.load_corpus("tiny_shakespeare")


def test_offline_failure_names_the_offline_default(local_remote):
    source, _ = local_remote
    source.unlink()
    with pytest.raises(ConnectionError, match="load_corpus\\('pydoc'\\) works offline"):
        data.load_corpus("tiny_shakespeare")


def test_no_download_flag(local_remote):
    with pytest.raises(FileNotFoundError, match="download=True"):
        data.load_corpus("tiny_shakespeare", download=False)


def test_byte_batches_are_shared_with_the_experiments():
    """One helper, not copies: the experiments import the byte batching from tfedu.data."""
    import torch

    from tfedu.experiments import extrapolation

    assert extrapolation.encode_bytes is data.encode_bytes and extrapolation.sample_windows is data.sample_windows
    tokens = data.encode_bytes("naïve")
    assert bytes(tokens.tolist()).decode("utf-8") == "naïve" and tokens.dtype == torch.long
    x, y = data.sample_windows(torch.arange(50), 3, 4, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 4) and bool((y == x + 1).all())


# ----------------------------------------------------------------------------- token datasets

import numpy as np
import torch

from tfedu.tokenizer import train_bpe


@pytest.fixture(scope="module")
def small_tokenizer():
    return train_bpe(data.load_pydoc_text()[:20_000], 300, special_tokens=[data.END_OF_TEXT])


def test_token_dataset_encodes_each_document_followed_by_end_of_text(small_tokenizer):
    docs = ["def f(): pass", "while True: break"]
    ds = data.TokenDataset.from_texts(docs, small_tokenizer)
    eot = small_tokenizer.special_tokens[data.END_OF_TEXT]
    assert ds.ids.dtype == np.uint16
    assert ds.ids.tolist() == small_tokenizer.encode(docs[0]) + [eot] + small_tokenizer.encode(docs[1]) + [eot]


def test_the_cache_is_a_memory_mapped_uint16_file_written_once(small_tokenizer, tmp_path):
    docs = data.pydoc_documents()[:20]
    cache = tmp_path / "ids.bin"
    ds = data.TokenDataset.from_texts(iter(docs), small_tokenizer, cache=cache)
    assert isinstance(ds.ids, np.memmap) and cache.stat().st_size == 2 * len(ds)
    assert not list(tmp_path.glob("*.part"))
    again = data.TokenDataset.from_texts(iter(()), small_tokenizer, cache=cache)  # read back, not re-encoded
    assert np.array_equal(again.ids, ds.ids)
    assert np.array_equal(ds.ids, data.TokenDataset.from_texts(docs, small_tokenizer).ids)


def test_batches_shift_by_one_and_the_split_never_overlaps():
    ds = data.TokenDataset(np.arange(1000, dtype=np.uint16))
    train, val = ds.split(0.1)
    assert (len(train), len(val)) == (900, 100)
    assert int(train.ids.max()) < int(val.ids.min())
    x, y = train.batch(64, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # Y is X moved one token on
    assert int(y.max()) < 900  # no window reaches into the held-out part
    again = train.batch(64, 16, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], x)  # seeded: the same batch again
    starts = val.eval_starts(16)
    assert starts == list(range(0, 84, 16)) and starts[-1] + 17 <= len(val)


def test_bad_token_data_gets_clear_errors(small_tokenizer, tmp_path):
    with pytest.raises(TypeError, match="1-D uint16"):
        data.TokenDataset(np.arange(5))
    with pytest.raises(ValueError, match="0..65535"):
        data.TokenDataset.from_ids([1, 70_000])
    with pytest.raises(ValueError, match="needs 17 tokens"):
        data.TokenDataset.from_ids(range(10)).batch(1, 16, torch.Generator())
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        data.TokenDataset.from_ids(range(10)).split(1.0)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd number"):
        data.TokenDataset.load(odd)
    no_eot = train_bpe("hello world", 260)
    with pytest.raises(ValueError, match="endoftext"):
        data.TokenDataset.from_texts(["x"], no_eot)


def test_the_corpus_is_the_shipped_copy_whatever_this_pythons_help_says(monkeypatch):
    """Python 3.11.2's pydoc topics are not 3.11.7's: on Debian 12's Python the course GPT's tokenizer no longer
    matched its corpus and notebooks 06, 08, 13 and 14 failed their guards. The corpus is the shipped copy."""
    import sys
    import types

    from tfedu.peft import CODE_MODULES, code_documents

    text, docs, code = data.load_pydoc_text(), data.pydoc_documents(), code_documents()
    fake = types.ModuleType("pydoc_data.topics")
    fake.topics = {"assert": "a different Python's help"}
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", fake)
    assert data.load_pydoc_text() == text and data.pydoc_documents() == docs and code_documents() == code
    assert len(code) == len(CODE_MODULES) and data.shipped_text("pydoc_topics.json.gz")["python"] == "3.11.7"


def test_a_damaged_shipped_text_is_named(tmp_path, monkeypatch):
    import gzip

    monkeypatch.setattr(data, "shipped_folder", lambda name: tmp_path)
    with pytest.raises(FileNotFoundError, match="pydoc_topics.json.gz is missing or not gzip"):
        data.shipped_text("pydoc_topics.json.gz")
    (tmp_path / "pydoc_topics.json.gz").write_bytes(gzip.compress(b'{"topics": {}}'))
    with pytest.raises(ValueError, match="expected 128bdb75.*restore it from git"):
        data.shipped_text("pydoc_topics.json.gz")
    with pytest.raises(ValueError, match="unknown shipped text"):
        data.shipped_text("other.json.gz")

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

    from tfedu import extrapolation

    assert extrapolation.encode_bytes is data.encode_bytes and extrapolation.sample_windows is data.sample_windows
    tokens = data.encode_bytes("naïve")
    assert bytes(tokens.tolist()).decode("utf-8") == "naïve" and tokens.dtype == torch.long
    x, y = data.sample_windows(torch.arange(50), 3, 4, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 4) and bool((y == x + 1).all())

"""Text the course trains on, available offline.

The default corpus is CPython's own documentation (``pydoc_data.topics``), about
466 KB of English that ships with every Python. Tiny Shakespeare can be fetched once
when online; it is verified by SHA-256 and cached under ``data/cache/``.
``encode_bytes`` and ``sample_windows`` turn a corpus into byte-level training batches (a fixed
vocabulary of 256 that needs no training), shared by the experiments of ``tfedu.extrapolation``
and ``tfedu.depth``.
Used from notebooks/00_start_here.ipynb onwards.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from jaxtyping import Int
from torch import Tensor

DEFAULT_CORPUS = "pydoc"


@dataclass(frozen=True)
class RemoteCorpus:
    url: str  # where to download it from
    sha256: str  # checksum of the exact bytes we expect
    filename: str  # name of the cached file


REMOTE_CORPORA = {
    "tiny_shakespeare": RemoteCorpus(
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        filename="tiny_shakespeare.txt",
    ),
}


def cache_dir() -> Path:
    """Folder for downloaded corpora: ``$TFEDU_CACHE`` if set, else ``data/cache`` in the checkout."""
    env = os.environ.get("TFEDU_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "data" / "cache"


def load_pydoc_text() -> str:
    """The text of every topic in CPython's interactive help, joined in sorted order.

    >>> "assert" in load_pydoc_text()
    True
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def load_corpus(name: str = DEFAULT_CORPUS, *, download: bool = True) -> str:
    """Return a corpus as one string.

    ``"pydoc"`` (the default) always works offline. Any name in ``REMOTE_CORPORA`` is
    read from the cache, downloaded once if missing (``download=True``), and checked
    against its SHA-256.

    >>> len(load_corpus()) > 400_000
    True
    """
    if name == DEFAULT_CORPUS:
        return load_pydoc_text()
    if name not in REMOTE_CORPORA:
        known = ", ".join([DEFAULT_CORPUS, *REMOTE_CORPORA])
        raise ValueError(f"unknown corpus {name!r}; expected one of: {known}")
    spec = REMOTE_CORPORA[name]
    path = cache_dir() / spec.filename
    if not path.exists():
        if not download:
            raise FileNotFoundError(f"{name} is not cached at {path}; call load_corpus({name!r}, download=True)")
        fetch_verified(spec.url, spec.sha256, path)
    data = path.read_bytes()
    if sha256_hex(data) != spec.sha256:
        raise ValueError(f"cached {path} does not match its SHA-256; delete it and download again")
    return data.decode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_verified(url: str, sha256: str, dest: Path, *, timeout: float = 30.0) -> Path:
    """Download ``url`` to ``dest`` only if its bytes hash to ``sha256``; never leaves a partial file."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = response.read()
    except OSError as err:
        raise ConnectionError(
            f"could not download {url} ({err}). You may be offline: "
            f"load_corpus('{DEFAULT_CORPUS}') works offline and is the course default."
        ) from None
    got = sha256_hex(data)
    if got != sha256:
        raise ValueError(f"download from {url} has SHA-256 {got}, expected {sha256}; not saved")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(dest.suffix + ".part")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return dest


# ----------------------------------------------------------------------------- byte-level batches


def encode_bytes(text: str) -> Int[Tensor, " n_tokens"]:
    """The UTF-8 bytes of ``text`` as a tensor of token ids in 0..255.

    >>> encode_bytes("hé").tolist()  # é is two bytes in UTF-8
    [104, 195, 169]
    """
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def sample_windows(
    tokens: Int[Tensor, " n_tokens"], batch: int, length: int, generator: torch.Generator
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """``batch`` random windows of ``length`` inputs and their targets (the same window shifted by one).

    >>> x, y = sample_windows(torch.arange(100), 2, 5, torch.Generator().manual_seed(0))
    >>> x.shape, bool((y == x + 1).all())
    (torch.Size([2, 5]), True)
    """
    starts = torch.randint(0, len(tokens) - length, (batch,), generator=generator)  # (batch,)
    index = starts[:, None] + torch.arange(length + 1)  # (batch, pos + 1)
    window = tokens[index]  # (batch, pos + 1)
    return window[:, :-1], window[:, 1:]

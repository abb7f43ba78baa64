"""Text the course trains on, available offline.

The default corpus is CPython's own documentation (``pydoc_data.topics``), about
466 KB of English. Its text changes between Python releases (3.11.2's is not 3.11.7's), and the course
GPT, its tokenizer and every notebook's measured claim rest on one text, so the course ships the topics of
the Python it was made with (``data/corpus/pydoc_topics.json.gz``, checked by SHA-256) and reads those
on every Python. Tiny Shakespeare can be fetched once
when online; it is verified by SHA-256 and cached under ``data/cache/``.
``encode_bytes`` and ``sample_windows`` turn a corpus into byte-level training batches (a fixed
vocabulary of 256 that needs no training), shared by the experiments of ``tfedu.experiments.extrapolation``
and ``tfedu.experiments.depth``.
Used from notebooks/00_start_here.ipynb onwards.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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


def shipped_folder(name: str) -> Path:
    """``data/NAME`` in a checkout; ``tfedu/shipped/NAME`` in an installed wheel (Colab), where pyproject puts it.

    A checkout is known by its ``data/`` folder, so a preset run there for the first time writes ``data/NAME``.
    """
    data = Path(__file__).resolve().parent.parent / "data"
    return data / name if (data / "README.md").is_file() else Path(__file__).resolve().parent / "shipped" / name


# The shipped texts: file in data/corpus -> SHA-256 of its uncompressed JSON (written once, from Python 3.11.7).
SHIPPED_TEXTS = {
    "pydoc_topics.json.gz": "128bdb755053fa3beef3c2c2c3f1380d51efcbb6d6256fd7655429deea4b538e",
    "stdlib_code.json.gz": "e0bfc314d02ffb87206947f1bca3efba1bbb17a0d248a103d00a98328d9bd24c",
}


def shipped_text(filename: str) -> dict:
    """The JSON of a shipped text in ``data/corpus`` (see ``SHIPPED_TEXTS``), checked against its SHA-256.

    >>> sorted(shipped_text("pydoc_topics.json.gz"))
    ['python', 'topics']
    """
    import gzip
    import json

    if filename not in SHIPPED_TEXTS:
        raise ValueError(f"unknown shipped text {filename!r}; expected one of: {', '.join(SHIPPED_TEXTS)}")
    path = shipped_folder("corpus") / filename
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as err:
        raise FileNotFoundError(f"{path} is missing or not gzip ({err}); reinstall tfedu or restore it from git") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHIPPED_TEXTS[filename]:
        raise ValueError(f"{path} has SHA-256 {digest}, expected {SHIPPED_TEXTS[filename]}: restore it from git")
    return json.loads(raw.decode("utf-8"))


def _pydoc_topics() -> dict[str, str]:
    return shipped_text("pydoc_topics.json.gz")["topics"]


def load_pydoc_text() -> str:
    """The text of every topic in CPython's interactive help (the shipped copy), joined in sorted order.

    >>> "assert" in load_pydoc_text()
    True
    """
    topics = _pydoc_topics()
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


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary_path)``, then rename the result over ``path``.

    The rename is atomic on POSIX and Windows: a reader (or a crash mid-write) sees the old file or
    the new one, never half of one. Used for downloads, token caches, checkpoints and the course GPT.

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "hello.txt"
    >>> write_atomically(target, lambda p: p.write_text("hi")).read_text()
    'hi'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    write(tmp)
    os.replace(tmp, path)
    return path


class CheckpointFile:
    """Where a training run keeps its checkpoint: ``store(state)`` and ``restore()``.

    ``store`` writes a dict of tensors, numbers, strings and lists atomically (a temporary file, then a
    rename over the old one: a crash halfway through the write leaves the previous checkpoint whole);
    ``restore`` reads it back, tensors only (``weights_only``: loading runs no code). Used by ``tfedu.train``
    and by the training loop a learner writes in notebooks/08_training_and_decoding.ipynb.

    >>> import tempfile
    >>> checkpoints = CheckpointFile(Path(tempfile.mkdtemp()) / "run.pt")
    >>> checkpoints.store({"step": 3, "weights": torch.ones(2)})
    >>> checkpoints.restore()["step"]
    3
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def store(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"a checkpoint is a dict (the model's state, the optimizer's, ...), got {type(state).__name__}")
        write_atomically(self.path, lambda tmp: torch.save(state, tmp))

    def restore(self) -> dict:
        if not self.path.is_file():
            raise FileNotFoundError(f"no checkpoint at {self.path}: nothing has been stored there yet")
        return torch.load(self.path, map_location="cpu", weights_only=True)

    def exists(self) -> bool:
        return self.path.is_file()

    def __repr__(self) -> str:
        return f"CheckpointFile({str(self.path)!r})"


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
    return write_atomically(dest, lambda tmp: tmp.write_bytes(data))


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


# ----------------------------------------------------------------------------- token datasets

END_OF_TEXT = "<|endoftext|>"


def pydoc_documents() -> list[str]:
    """The topics of CPython's interactive help (the shipped copy), one string each, in sorted order.

    ``load_pydoc_text`` is these joined by blank lines; ``TokenDataset`` joins them with an
    end-of-text token instead, so a model learns where a document ends.

    >>> docs = pydoc_documents()
    >>> len(docs) > 50 and "\\n\\n".join(docs) == load_pydoc_text()
    True
    """
    topics = _pydoc_topics()
    return [topics[name].strip() for name in sorted(topics)]


class TokenDataset:
    """A corpus encoded once into token ids, held as a uint16 array (memory-mapped when on disk).

    ``batch`` draws random windows of ``length + 1`` tokens and returns ``X = t[:, :-1]`` and
    ``Y = t[:, 1:]``: the target at each position is the token that follows it. ``split`` cuts
    the ids in two contiguous parts, so a window of one part never contains a token of the
    other. uint16 holds ids below 65,536 in two bytes each (a 1 GB text is about 0.5 GB of ids
    at 4 bytes per token), the format nanoGPT uses for OpenWebText.

    >>> ds = TokenDataset(np.arange(100, dtype=np.uint16))
    >>> train, val = ds.split(0.2)
    >>> len(train), len(val)
    (80, 20)
    >>> x, y = train.batch(2, 5, torch.Generator().manual_seed(0))
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    (torch.Size([2, 5]), True)
    """

    def __init__(self, ids: np.ndarray) -> None:
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype != np.uint16:
            got = f"{ids.dtype} array of shape {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__
            raise TypeError(f"TokenDataset expects a 1-D uint16 numpy array of token ids, got {got}")
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"TokenDataset({len(self):,} tokens)"

    @classmethod
    def from_ids(cls, ids) -> TokenDataset:
        """From any sequence of ids in 0..65535 (a list, a tensor, an array)."""
        array = np.asarray(ids.tolist() if isinstance(ids, Tensor) else ids, dtype=np.int64)
        if array.ndim != 1:
            raise ValueError(f"token ids must be 1-D, got shape {array.shape}")
        if len(array) and (array.min() < 0 or array.max() > UINT16_MAX):
            raise ValueError(f"token ids must lie in 0..{UINT16_MAX} to fit uint16, got {array.min()}..{array.max()}")
        return cls(array.astype(np.uint16))

    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer, *, cache: str | os.PathLike | None = None) -> TokenDataset:
        """Encode documents with ``tokenizer``, an end-of-text token after each.

        With ``cache`` (a ``.bin`` path), the ids are written there once (through a temporary
        file and a rename, so a crash never leaves half a file) and memory-mapped afterwards:
        point ``texts`` at a generator over a large file and memory holds one document at a time.
        A cache written from other texts or another tokenizer is not noticed: name it by both.
        """
        _check_uint16_vocab(tokenizer)
        eot = tokenizer.special_tokens.get(END_OF_TEXT)
        if eot is None:
            raise ValueError(f"the tokenizer needs the special token {END_OF_TEXT!r} to separate documents")
        if cache is not None and Path(cache).is_file():
            return cls.load(cache)

        def stream() -> Iterator[int]:
            for text in texts:
                yield from tokenizer.encode_ordinary(text)
                yield eot

        if cache is None:
            return cls(np.fromiter(stream(), dtype=np.uint16))
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                chunk: list[int] = []
                for i in stream():
                    chunk.append(i)
                    if len(chunk) >= 1 << 20:
                        f.write(np.asarray(chunk, dtype=np.uint16).tobytes())
                        chunk = []
                f.write(np.asarray(chunk, dtype=np.uint16).tobytes())

        return cls.load(write_atomically(cache, write))

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenDataset:
        """Memory-map a ``.bin`` file of uint16 ids (as written by ``from_texts``)."""
        path = Path(path)
        size = path.stat().st_size
        if size % 2:
            raise ValueError(f"{path} has {size} bytes, an odd number: not a file of uint16 token ids")
        return cls(np.memmap(path, dtype=np.uint16, mode="r"))

    def split(self, val_fraction: float = 0.1) -> tuple[TokenDataset, TokenDataset]:
        """The first ``1 - val_fraction`` of the ids for training, the rest held out (no overlap)."""
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
        cut = len(self) - round(len(self) * val_fraction)
        return TokenDataset(self.ids[:cut]), TokenDataset(self.ids[cut:])

    def batch(
        self, batch_size: int, length: int, generator: torch.Generator
    ) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """``batch_size`` random windows: inputs ``t[:, :-1]`` and targets ``t[:, 1:]``, ``length`` each."""
        if len(self) < length + 1:
            raise ValueError(f"a window of {length} inputs needs {length + 1} tokens; this dataset has {len(self)}")
        starts = torch.randint(0, len(self) - length, (batch_size,), generator=generator)  # (batch,)
        return self.windows(starts.tolist(), length)

    def windows(self, starts: Sequence[int], length: int) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """The windows of ``length + 1`` tokens starting at ``starts``, as (inputs, targets)."""
        t = torch.from_numpy(np.stack([self.ids[s : s + length + 1].astype(np.int64) for s in starts]))  # (batch, pos + 1)
        return t[:, :-1], t[:, 1:]

    def eval_starts(self, length: int) -> list[int]:
        """Starts of the non-overlapping windows that cover the dataset: a deterministic evaluation set."""
        return list(range(0, len(self) - length, length))


UINT16_MAX = 65_535


def _check_uint16_vocab(tokenizer) -> None:
    size = max(tokenizer.vocab) + 1
    if size > UINT16_MAX + 1:
        raise ValueError(f"token ids up to {size - 1} do not fit uint16 (at most {UINT16_MAX}); this dataset format cannot hold them")

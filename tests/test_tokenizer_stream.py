"""Tokenizer.encode_iterable on a generated 100 MB file: encode's exact ids, in memory that does not grow.

Encoding the whole file at once to compare would need the file's text and ~40 M ids in memory
(several GB as Python objects), the very thing the streaming encoder avoids. The file is built instead
from a pool of documents, each followed by ``<|endoftext|>``. ``encode`` cuts its input at special
tokens before anything else, so ``encode(file)`` is exactly the concatenation of ``encode(doc) + [eot]``
in file order (checked directly on the file's first megabytes below). The reference ids are therefore
known cheaply, and the test compares their SHA-256 and count with the streamed ids over all 100 MB.
The streaming encoder itself does not know where documents end: it reads the file line by line and
cuts wherever its own rule allows, inside documents, lines and whitespace runs.
"""

import gc
import hashlib
import itertools
import random
import sys
import time
import tracemalloc
from array import array
from contextlib import contextmanager
from pathlib import Path

import pytest

from tfedu.data import load_corpus
from tfedu.tokenizer import train_bpe

EOT = "<|endoftext|>"
FILE_BYTES = 100 * 2**20
RUSSIAN = "Токенизатор превращает текст в последовательность целых чисел.  \n"
CHINESE = "分词器把文本变成一串整数。🙂 ok\r\n"


def make_documents(corpus: str, n: int = 40, seed: int = 0) -> list[str]:
    """Slices of the corpus, each with a twist that a line-by-line encoder gets wrong."""
    rng = random.Random(seed)
    docs = []
    for k in range(n):
        start = rng.randrange(0, len(corpus) - 150_000)
        doc = corpus[start : start + rng.randrange(30_000, 150_000)]
        twist = k % 4
        if twist == 0:
            doc = doc.replace("\n", "\r\n")  # Windows line ends
        elif twist == 1:
            doc = doc.replace("\n\n", "   \n\n\n\t  \n  ")  # trailing spaces, blank-line runs, indentation
        elif twist == 2:
            lines = doc.splitlines(keepends=True)
            doc = "".join(line + (RUSSIAN if i % 7 == 0 else CHINESE if i % 11 == 0 else "") for i, line in enumerate(lines))
        else:
            doc = doc.replace("\n", " ")  # one line of 30-150 K characters, longer than a stream block
        if k % 3 == 0:
            doc = doc.rstrip("\n")  # no newline before the special token
        assert EOT not in doc + EOT[:-1]
        docs.append(doc)
    return docs


@contextmanager
def peak_memory():
    """Yields a dict that gets 'bytes': the peak memory growth while the block ran, and 'how'.

    On Linux the process's peak resident set size (VmHWM) is reset before the block (writing 5 to
    /proc/self/clear_refs), so the number is the real peak, everything included. Elsewhere it falls
    back to tracemalloc's peak of Python allocations (which slows the block down about 2.5x).
    """
    result = {}
    gc.collect()
    status = Path("/proc/self/status")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        use_rss = True
    except OSError:
        use_rss = False

    def kib(field):
        line = next(line for line in status.read_text().splitlines() if line.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    if use_rss:
        before = kib("VmRSS")
        yield result
        result.update(bytes=kib("VmHWM") - before, how="peak RSS growth (VmHWM after reset)")
    else:
        tracemalloc.start()
        try:
            yield result
            result.update(bytes=tracemalloc.get_traced_memory()[1], how="tracemalloc peak")
        finally:
            tracemalloc.stop()


def stream_digest(ids, batch: int = 1 << 16) -> tuple[str, int]:
    """SHA-256 and count of an iterable of ids, consumed in batches so nothing accumulates."""
    digest, count = hashlib.sha256(), 0
    while chunk := array("I", itertools.islice(ids, batch)):
        digest.update(chunk.tobytes())
        count += len(chunk)
    return digest.hexdigest(), count


def test_encode_iterable_on_a_100_mb_file(tmp_path):
    corpus = load_corpus()
    tok = train_bpe(corpus[:100_000], 1000, special_tokens=[EOT])
    eot = tok.special_tokens[EOT]
    docs = make_documents(corpus)
    reference = [array("I", tok.encode(doc) + [eot]) for doc in docs]

    # write the file in chunks, one document at a time, hashing the reference ids as we go
    rng = random.Random(1)
    path = tmp_path / "big.txt"
    expected, n_expected, size, head = hashlib.sha256(), 0, 0, []
    with open(path, "w", encoding="utf-8", newline="") as f:
        while size < FILE_BYTES:
            k = rng.randrange(len(docs))
            f.write(docs[k] + EOT)
            size += len((docs[k] + EOT).encode("utf-8"))
            expected.update(reference[k].tobytes())
            n_expected += len(reference[k])
            if len(head) < 12:
                head.append(k)
    assert path.stat().st_size == size >= FILE_BYTES

    # the argument above, checked directly: encode of the file's first documents is the concatenation
    first = "".join(docs[k] + EOT for k in head)
    assert tok.encode(first) == [i for k in head for i in reference[k]]

    start = time.perf_counter()
    with peak_memory() as memory, open(path, encoding="utf-8", newline="") as f:  # newline="": keep \r\n
        got, n_got = stream_digest(tok.encode_iterable(f))
    seconds = time.perf_counter() - start
    print(f"\n100 MB stream: {size / 2**20:.0f} MiB, {n_got:,} ids in {seconds:.1f} s; "
          f"{memory['how']}: {memory['bytes'] / 2**20:.1f} MiB", file=sys.stderr)

    assert (got, n_got) == (expected.hexdigest(), n_expected)
    assert memory["bytes"] < size / 20  # far below the file: the buffer holds a block and a line, not the file


@pytest.mark.parametrize("twist", range(4))
def test_documents_have_their_twist(twist):
    doc = make_documents(load_corpus(), n=4)[twist]
    assert [("\r\n" in doc), ("   \n\n\n" in doc), (CHINESE in doc), ("\n" not in doc)][twist]

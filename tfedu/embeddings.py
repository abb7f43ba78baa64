"""Word vectors: one-hot ids, the embedding look-up, and word2vec's skip-gram with negative sampling.

- ``one_hot`` / ``embed_via_one_hot``: an embedding layer is a matrix product with a one-hot
  vector, ``one_hot(ids) @ W_E == W_E[ids]``, which is why ``nn.Embedding`` is a look-up.
- ``tokenize_words``, ``build_vocab`` / ``Vocab``: lowercase word tokens and a counted vocabulary.
- Skip-gram with negative sampling (SGNS; Mikolov et al. 2013, "Distributed Representations of
  Words and Phrases", eq. 4): ``keep_probabilities`` (subsampling of frequent words, sec. 2.3),
  ``noise_distribution`` (unigram^0.75, sec. 2.2), ``skipgram_pairs``, ``sample_negatives``,
  ``SkipGram`` (a center vector v and a context vector u per word), ``sgns_loss``, ``sgns_step``
  and ``train_sgns``.
- ``cosine_similarity``, ``nearest_neighbours``, ``analogy``: reading the trained vectors.
- ``split_held_out``, ``cooccurring_pairs``, ``held_out_similarity``: an honest test of trained
  vectors on text they never saw.
- ``full_softmax_flops`` / ``negative_sampling_flops``: why SGNS replaces the softmax over the
  vocabulary.

Built by hand in notebooks/02_embeddings.ipynb.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

# Lowercase words, keeping Python names like `__init__` or `utf8` whole.
WORD_PATTERN = re.compile(r"[a-z_][a-z0-9_]*")


# --------------------------------------------------------------------------- input checks


def _expect_ids(ids: object, name: str = "ids") -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} should be a torch.Tensor of integer ids, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name} should hold integer ids (dtype torch.long), got dtype {ids.dtype}")


def _expect_in_range(ids: Tensor, d_vocab: int, name: str = "ids") -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= d_vocab):
        raise IndexError(
            f"{name} must lie in [0, {d_vocab}) for d_vocab={d_vocab}, got values from {int(ids.min())} to {int(ids.max())}"
        )


def _expect_float(x: object, name: str, dims: int | None, expected: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} should be a torch.Tensor of shape {expected}, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} should be a floating-point tensor, got dtype {x.dtype}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"{name} should have shape {expected}, got shape {tuple(x.shape)}")


def _expect_positive_int(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} should be a positive int, got {value!r}")


# --------------------------------------------------------------------------- one-hot and look-up


def one_hot(ids: Int[Tensor, "*batch"], d_vocab: int) -> Float[Tensor, "*batch d_vocab"]:
    """The one-hot vector of each id: a row of zeros with a single 1.0 at position ``id``.

    Float, so it can multiply a weight matrix. Any two different one-hot vectors are
    orthogonal: their dot product is 0, so they carry no notion of similarity.

    >>> one_hot(torch.tensor([2, 0]), 3)
    tensor([[0., 0., 1.],
            [1., 0., 0.]])

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    _expect_ids(ids)
    _expect_positive_int(d_vocab, "d_vocab")
    _expect_in_range(ids, d_vocab)
    return F.one_hot(ids.long(), d_vocab).float()


def embed_via_one_hot(ids: Int[Tensor, "*batch"], W_E: Float[Tensor, "d_vocab d_model"]) -> Float[Tensor, "*batch d_model"]:
    """Embed ``ids`` as ``one_hot(ids) @ W_E``: the row of ``W_E`` for each id, as a matrix product.

    Equal, values and gradients, to ``W_E[ids]`` and to ``nn.Embedding`` with weight ``W_E``;
    the look-up is what frameworks compute, because it skips multiplying by d_vocab - 1 zeros.

    >>> W_E = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    >>> embed_via_one_hot(torch.tensor([2, 0]), W_E)
    tensor([[5., 6.],
            [1., 2.]])

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    _expect_ids(ids)
    _expect_float(W_E, "W_E", 2, "(d_vocab, d_model)")
    d_vocab = W_E.shape[0]
    _expect_in_range(ids, d_vocab)
    return one_hot(ids, d_vocab).to(W_E.dtype).to(W_E.device) @ W_E  # *batch d_model


def cosine_similarity(a: Float[Tensor, "*batch d_model"], b: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch"]:
    """cos(a, b) = a.b / (|a| |b|) along the last dimension (0 where a vector is zero).

    >>> cosine_similarity(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
    tensor(0.7071)
    """
    _expect_float(a, "a", None, "(..., d_model)")
    _expect_float(b, "b", None, "(..., d_model)")
    if a.dim() == 0 or b.dim() == 0 or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"a and b need the same last dimension, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return F.normalize(a, dim=-1).mul(F.normalize(b, dim=-1)).sum(-1)


# --------------------------------------------------------------------------- words and vocabulary


def tokenize_words(text: str) -> list[str]:
    """Lowercase word tokens: runs of letters, digits and underscores that start with a letter or ``_``.

    >>> tokenize_words("The `__init__` method, called twice!")
    ['the', '__init__', 'method', 'called', 'twice']
    """
    if not isinstance(text, str):
        raise TypeError(f"text should be a str, got {type(text).__name__}")
    return WORD_PATTERN.findall(text.lower())


@dataclass(frozen=True)
class Vocab:
    """Words and their counts, most frequent first; the id of a word is its position."""

    words: tuple[str, ...]  # id -> word
    counts: tuple[int, ...]  # id -> how often the word occurred in the training tokens
    index: dict[str, int] = field(init=False, repr=False, compare=False)  # word -> id

    def __post_init__(self) -> None:
        if len(self.words) != len(self.counts):
            raise ValueError(f"{len(self.words)} words but {len(self.counts)} counts")
        object.__setattr__(self, "index", {w: i for i, w in enumerate(self.words)})
        if len(self.index) != len(self.words):
            raise ValueError("a vocabulary cannot list a word twice")

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: object) -> bool:
        return word in self.index

    def id(self, word: str) -> int:
        """The id of ``word``; a KeyError that says so when it is not in the vocabulary."""
        if word not in self.index:
            raise KeyError(f"{word!r} is not in the vocabulary ({len(self)} words, e.g. {list(self.words[:5])})")
        return self.index[word]

    def encode(self, tokens: Sequence[str]) -> Int[Tensor, " n"]:
        """The ids of the tokens that are in the vocabulary; unknown tokens are dropped, as word2vec does."""
        return torch.tensor([self.index[t] for t in tokens if t in self.index], dtype=torch.long)

    def count_tensor(self) -> Float[Tensor, " d_vocab"]:
        return torch.tensor(self.counts, dtype=torch.float64)


def build_vocab(tokens: Sequence[str], min_count: int = 5) -> Vocab:
    """Every token seen at least ``min_count`` times, most frequent first (ties alphabetical).

    >>> build_vocab("b a b c b a".split(), min_count=2).words
    ('b', 'a')
    """
    if isinstance(tokens, str):
        raise TypeError("tokens should be a list of words, not one str: call tokenize_words(text) first")
    _expect_positive_int(min_count, "min_count")
    counts = Counter(tokens)
    kept = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    if not kept:
        raise ValueError(f"no token occurs {min_count} times; lower min_count or pass more text")
    return Vocab(tuple(kept), tuple(counts[w] for w in kept))


# --------------------------------------------------------------------------- the SGNS data pipeline


def _expect_counts(counts: object) -> None:
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.dtype == torch.bool:
        raise ValueError("counts should be a 1-D tensor of word counts, shape (d_vocab,)")
    if (counts < 0).any() or counts.sum() <= 0:
        raise ValueError("counts must be non-negative with a positive total")


def keep_probabilities(counts: Float[Tensor, " d_vocab"], threshold: float = 1e-3) -> Float[Tensor, " d_vocab"]:
    """P(keep a word occurrence) = min(1, sqrt(t / f)), f the word's frequency (Mikolov et al. 2013, sec. 2.3).

    Words rarer than ``t`` are always kept; "the" at 7% of the text with t = 1e-3 keeps about 1 in 8.
    Dropping copies of frequent words shortens the text and widens every window.

    >>> keep_probabilities(torch.tensor([90.0, 10.0]), threshold=0.1)
    tensor([0.3333, 1.0000], dtype=torch.float64)
    """
    _expect_counts(counts)
    if not threshold > 0:
        raise ValueError(f"threshold should be > 0, got {threshold}")
    freq = counts.double() / counts.double().sum()
    return (threshold / freq).sqrt().clamp(max=1.0)


def noise_distribution(counts: Float[Tensor, " d_vocab"], power: float = 0.75) -> Float[Tensor, " d_vocab"]:
    """Where negatives come from: P_n(w) proportional to count(w)^0.75 (Mikolov et al. 2013, sec. 2.2).

    The power 3/4 flattens the unigram distribution: rare words are drawn more often than
    their frequency, frequent words less often.

    >>> noise_distribution(torch.tensor([16.0, 1.0]), power=0.5)
    tensor([0.8000, 0.2000], dtype=torch.float64)
    """
    _expect_counts(counts)
    weights = counts.double() ** power
    return weights / weights.sum()


def subsample(
    ids: Int[Tensor, " n"], keep: Float[Tensor, " d_vocab"], generator: torch.Generator | None = None
) -> Int[Tensor, " n_kept"]:
    """Drop each occurrence of word w with probability 1 - keep[w]; the survivors keep their order."""
    _expect_ids(ids)
    _expect_in_range(ids, keep.shape[0])
    mask: Bool[Tensor, " n"] = torch.rand(ids.shape, generator=generator, dtype=torch.float64) < keep[ids]
    return ids[mask]


def skipgram_pairs(
    ids: Int[Tensor, " n"], window: int, generator: torch.Generator | None = None, *, dynamic: bool = True
) -> tuple[Int[Tensor, " n_pairs"], Int[Tensor, " n_pairs"]]:
    """Every (center, context) pair with the context at most ``window`` positions from the center.

    With ``dynamic=True`` each center draws its own window b uniformly from 1..window and pairs
    only with words at most b away, as word2vec does: near words count more than far ones.

    >>> centers, contexts = skipgram_pairs(torch.tensor([7, 8, 9]), window=1, dynamic=False)
    >>> sorted(zip(centers.tolist(), contexts.tolist()))
    [(7, 8), (8, 7), (8, 9), (9, 8)]
    """
    _expect_ids(ids)
    if ids.dim() != 1:
        raise ValueError(f"ids should be 1-D, shape (n,), got shape {tuple(ids.shape)}")
    _expect_positive_int(window, "window")
    n = ids.shape[0]
    if dynamic:
        reach = torch.randint(1, window + 1, (n,), generator=generator)  # n
    else:
        reach = torch.full((n,), window)
    centers, contexts = [], []
    for offset in range(1, min(window, n - 1) + 1):
        left, right = torch.arange(n - offset), torch.arange(offset, n)
        forward = reach[left] >= offset  # the center on the left sees the word `offset` to its right
        backward = reach[right] >= offset  # the center on the right sees the word `offset` to its left
        centers += [ids[left[forward]], ids[right[backward]]]
        contexts += [ids[right[forward]], ids[left[backward]]]
    if not centers:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty.clone()
    return torch.cat(centers), torch.cat(contexts)


def sample_negatives(
    noise: Float[Tensor, " d_vocab"], batch: int, k: int, generator: torch.Generator | None = None
) -> Int[Tensor, "batch k"]:
    """``k`` word ids per example, drawn with replacement from the noise distribution.

    Like most re-implementations, a negative may by chance equal the true context word; with a
    vocabulary of hundreds of words this is rare and harmless.
    """
    _expect_positive_int(k, "k")
    if not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch should be a non-negative int, got {batch!r}")
    if batch == 0:
        return torch.zeros(0, k, dtype=torch.long)
    return torch.multinomial(noise.float(), batch * k, replacement=True, generator=generator).view(batch, k)


# --------------------------------------------------------------------------- the model and its loss


def sgns_loss(
    center: Float[Tensor, "batch d_model"],
    context: Float[Tensor, "batch d_model"],
    negatives: Float[Tensor, "batch k d_model"],
) -> Float[Tensor, ""]:
    """The SGNS loss, averaged over the batch and summed over the k negatives.

    For one example with center vector v, true context vector u_o and negative vectors u_1..u_k:

        loss = -log sigma(u_o . v) - sum_i log sigma(-u_i . v)

    (Mikolov et al. 2013, eq. 4, negated to be minimised). ``F.logsigmoid`` computes log sigma
    without overflow. The minus inside the second log sigma is what pushes negatives *away*.

    >>> v, u = torch.zeros(1, 2), torch.zeros(1, 2)
    >>> round(sgns_loss(v, u, torch.zeros(1, 3, 2)).item(), 4)  # 4 log 2: every sigma is 1/2
    2.7726

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    _expect_float(center, "center", 2, "(batch, d_model)")
    _expect_float(context, "context", 2, "(batch, d_model)")
    _expect_float(negatives, "negatives", 3, "(batch, k, d_model)")
    if context.shape != center.shape or negatives.shape[0] != center.shape[0] or negatives.shape[2] != center.shape[1]:
        raise ValueError(
            "center and context should both be (batch, d_model) and negatives (batch, k, d_model), got "
            f"{tuple(center.shape)}, {tuple(context.shape)} and {tuple(negatives.shape)}"
        )
    positive_scores = (center * context).sum(-1)  # batch
    negative_scores = torch.einsum("bkd,bd->bk", negatives, center)  # batch k
    per_example = -F.logsigmoid(positive_scores) - F.logsigmoid(-negative_scores).sum(-1)  # batch
    return per_example.mean()


class SkipGram(nn.Module):
    """Two vectors per word: ``center`` (v_w, the word as a center word; the vectors we keep) and
    ``context`` (u_w, the word as someone else's context).

    ``forward(centers, contexts, negatives)`` looks up the vectors and returns ``sgns_loss``.
    As in word2vec, center vectors start uniform in +-0.5/d_model and context vectors at zero.

    >>> model = SkipGram(10, 4, generator=torch.Generator().manual_seed(0))
    >>> round(model(torch.tensor([1]), torch.tensor([2]), torch.tensor([[3, 4]])).item(), 4)  # u = 0: 3 log 2
    2.0794
    """

    def __init__(self, d_vocab: int, d_model: int, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        _expect_positive_int(d_vocab, "d_vocab")
        _expect_positive_int(d_model, "d_model")
        self.center = nn.Embedding(d_vocab, d_model)
        self.context = nn.Embedding(d_vocab, d_model)
        with torch.no_grad():
            self.center.weight.uniform_(-0.5 / d_model, 0.5 / d_model, generator=generator)
            self.context.weight.zero_()

    @property
    def d_vocab(self) -> int:
        return self.center.num_embeddings

    def forward(
        self, centers: Int[Tensor, " batch"], contexts: Int[Tensor, " batch"], negatives: Int[Tensor, "batch k"]
    ) -> Float[Tensor, ""]:
        for name, ids in (("centers", centers), ("contexts", contexts), ("negatives", negatives)):
            _expect_ids(ids, name)
            _expect_in_range(ids, self.d_vocab, name)
        if centers.dim() != 1 or contexts.shape != centers.shape or negatives.dim() != 2 or negatives.shape[0] != centers.shape[0]:
            raise ValueError(
                "centers and contexts should be (batch,) and negatives (batch, k), got shapes "
                f"{tuple(centers.shape)}, {tuple(contexts.shape)} and {tuple(negatives.shape)}"
            )
        return sgns_loss(self.center(centers), self.context(contexts), self.context(negatives))


def sgns_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    centers: Int[Tensor, " batch"],
    contexts: Int[Tensor, " batch"],
    negatives: Int[Tensor, "batch k"],
) -> float:
    """One optimisation step: clear old gradients, compute the loss, backpropagate, update; return the loss.

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    optimizer.zero_grad()
    loss = model(centers, contexts, negatives)
    loss.backward()
    optimizer.step()
    return loss.item()


@dataclass
class SGNSResult:
    """What ``train_sgns`` returns."""

    vectors: Tensor  # (d_vocab, d_model): the trained center vectors, on the CPU
    vocab: Vocab
    losses: list[float]  # the loss of every step, in order
    model: SkipGram


def train_sgns(
    tokens: Sequence[str],
    *,
    d_model: int = 32,
    window: int = 4,
    k: int = 5,
    epochs: int = 5,
    batch_size: int = 1024,
    lr: float = 0.01,
    min_count: int = 5,
    threshold: float = 1e-3,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> SGNSResult:
    """Train skip-gram with negative sampling on a list of word tokens; return the center vectors.

    Each epoch draws a fresh subsample of the text (``threshold``), makes (center, context)
    pairs with dynamic windows up to ``window``, shuffles them, and for every batch draws ``k``
    negatives per pair from the unigram^0.75 distribution and takes one Adam step on
    ``sgns_loss``. Everything random comes from one generator seeded with ``seed``.

    >>> result = train_sgns("a b a b c d c d".split() * 20, d_model=4, min_count=1, epochs=1)
    >>> result.vectors.shape, len(result.vocab)
    (torch.Size([4, 4]), 4)

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    if isinstance(tokens, str):
        raise TypeError("tokens should be a list of words, not one str: call tokenize_words(text) first")
    for name in ("d_model", "window", "k", "epochs", "batch_size"):
        _expect_positive_int(locals()[name], name)
    if not lr > 0:
        raise ValueError(f"lr should be > 0, got {lr}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(seed)
    vocab = build_vocab(tokens, min_count)
    ids = vocab.encode(tokens)
    counts = vocab.count_tensor()
    keep, noise = keep_probabilities(counts, threshold), noise_distribution(counts)
    model = SkipGram(len(vocab), d_model, generator=generator).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    # The pair count varies a little with each epoch's subsample; estimate it for the progress bar.
    mean_reach = (window + 1) / 2
    expected_steps = epochs * math.ceil(2 * mean_reach * float((keep * counts).sum()) / batch_size)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=expected_steps, desc="SGNS", unit="step")
    losses: list[float] = []
    for _ in range(epochs):
        kept = subsample(ids, keep, generator)
        centers, contexts = skipgram_pairs(kept, window, generator)
        order = torch.randperm(centers.shape[0], generator=generator)
        for start in range(0, order.shape[0], batch_size):
            batch = order[start : start + batch_size]
            negatives = sample_negatives(noise, batch.shape[0], k, generator)
            loss = sgns_step(model, optimizer, centers[batch].to(dev), contexts[batch].to(dev), negatives.to(dev))
            losses.append(loss)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    if bar is not None:
        bar.close()
    return SGNSResult(model.center.weight.detach().cpu().clone(), vocab, losses, model)


# --------------------------------------------------------------------------- reading the vectors


def _word_vectors(vectors: object, vocab: Vocab) -> Tensor:
    _expect_float(vectors, "vectors", 2, "(d_vocab, d_model)")
    assert isinstance(vectors, Tensor)
    if vectors.shape[0] != len(vocab):
        raise ValueError(f"vectors has {vectors.shape[0]} rows but the vocabulary has {len(vocab)} words")
    return F.normalize(vectors.detach().float().cpu(), dim=-1)


def _most_similar(query: Tensor, unit: Tensor, vocab: Vocab, n: int, exclude: set[int]) -> list[tuple[str, float]]:
    _expect_positive_int(n, "n")
    scores = unit @ F.normalize(query, dim=-1)  # d_vocab
    scores[list(exclude)] = -math.inf
    top = scores.topk(min(n, len(vocab) - len(exclude)))
    return [(vocab.words[i], float(s)) for s, i in zip(top.values.tolist(), top.indices.tolist())]


def nearest_neighbours(word: str, vectors: Float[Tensor, "d_vocab d_model"], vocab: Vocab, n: int = 5) -> list[tuple[str, float]]:
    """The ``n`` words whose vectors have the highest cosine similarity with ``word``'s (itself excluded).

    >>> vocab = Vocab(("cat", "dog", "car"), (3, 2, 1))
    >>> [(w, round(s, 3)) for w, s in nearest_neighbours("cat", torch.tensor([[1.0, 0.1], [1.0, 0.0], [0.0, 1.0]]), vocab, n=2)]
    [('dog', 0.995), ('car', 0.1)]
    """
    unit = _word_vectors(vectors, vocab)
    i = vocab.id(word)
    return _most_similar(unit[i], unit, vocab, n, {i})


def analogy(a: str, b: str, c: str, vectors: Float[Tensor, "d_vocab d_model"], vocab: Vocab, n: int = 1) -> list[tuple[str, float]]:
    """"a is to b as c is to ?": the words nearest to b - a + c (unit vectors), leaving out a, b and c.

    This is 3CosAdd (Mikolov, Yih and Zweig 2013). It needs vectors trained on far more text
    than our small corpus to work well.

    >>> vocab = Vocab(("man", "king", "woman", "queen"), (1, 1, 1, 1))
    >>> vectors = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    >>> analogy("man", "king", "woman", vectors, vocab)[0][0]
    'queen'
    """
    unit = _word_vectors(vectors, vocab)
    ia, ib, ic = vocab.id(a), vocab.id(b), vocab.id(c)
    return _most_similar(unit[ib] - unit[ia] + unit[ic], unit, vocab, n, {ia, ib, ic})


# --------------------------------------------------------------------------- a held-out check


def split_held_out(tokens: Sequence[str], *, every: int = 10, chunk: int = 500) -> tuple[list[str], list[str]]:
    """Cut the tokens into chunks of ``chunk``; every ``every``-th chunk (the last of each group) is held out.

    >>> train, held = split_held_out(list("abcdefgh"), every=2, chunk=2)
    >>> "".join(train), "".join(held)
    ('abef', 'cdgh')
    """
    _expect_positive_int(every, "every")
    _expect_positive_int(chunk, "chunk")
    if every < 2:
        raise ValueError("every should be at least 2, or nothing is left to train on")
    train: list[str] = []
    held: list[str] = []
    for n, start in enumerate(range(0, len(tokens), chunk)):
        (held if n % every == every - 1 else train).extend(tokens[start : start + chunk])
    return train, held


def cooccurring_pairs(tokens: Sequence[str], vocab: Vocab, window: int, *, skip_top: int = 0) -> Int[Tensor, "n_pairs 2"]:
    """Distinct pairs (a, b), a < b, of in-vocabulary words at most ``window`` apart in ``tokens``.

    ``skip_top`` leaves out the most frequent words (ids below it: "the", "a", "is", ...), whose
    co-occurrence with everything says little.
    """
    _expect_positive_int(window, "window")
    ids = torch.tensor([vocab.index.get(t, -1) for t in tokens], dtype=torch.long)
    pairs = set()
    for offset in range(1, window + 1):
        a, b = ids[:-offset], ids[offset:]
        ok = (a >= skip_top) & (b >= skip_top) & (a != b)
        lo, hi = torch.minimum(a[ok], b[ok]), torch.maximum(a[ok], b[ok])
        pairs.update(zip(lo.tolist(), hi.tolist()))
    return torch.tensor(sorted(pairs), dtype=torch.long).view(-1, 2)


def held_out_similarity(
    vectors: Float[Tensor, "d_vocab d_model"], pairs: Int[Tensor, "n_pairs 2"], generator: torch.Generator | None = None
) -> float:
    """Mean cosine of word pairs that co-occur in held-out text, minus that of the same words re-paired at random.

    Re-pairing keeps every word's frequency the same on both sides, so the only thing measured
    is whether the vectors know *which* words go together. Random vectors score about 0.
    """
    _expect_float(vectors, "vectors", 2, "(d_vocab, d_model)")
    _expect_ids(pairs, "pairs")
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.shape[0] < 2:
        raise ValueError(f"pairs should have shape (n_pairs, 2) with n_pairs >= 2, got {tuple(pairs.shape)}")
    _expect_in_range(pairs, vectors.shape[0], "pairs")
    unit = F.normalize(vectors.detach().double().cpu(), dim=-1)
    related = (unit[pairs[:, 0]] * unit[pairs[:, 1]]).sum(-1).mean()
    shuffled = pairs[torch.randperm(pairs.shape[0], generator=generator), 1]
    unrelated = (unit[pairs[:, 0]] * unit[shuffled]).sum(-1).mean()
    return float(related - unrelated)


def neighbour_hit_rate(
    vectors: Float[Tensor, "d_vocab d_model"], words: Int[Tensor, " n_words"], pairs: Int[Tensor, "n_pairs 2"], n: int = 10
) -> float:
    """The fraction of the ``n`` nearest neighbours of each of ``words`` that co-occur with it in ``pairs``.

    With ``pairs`` from held-out text, this asks: do a word's neighbours in vector space turn
    up next to it in text the vectors never saw? Random vectors score the base rate.

    >>> vectors = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    >>> neighbour_hit_rate(vectors, torch.tensor([0, 2]), torch.tensor([[0, 1]]), n=1)
    0.5
    """
    _expect_float(vectors, "vectors", 2, "(d_vocab, d_model)")
    _expect_ids(words, "words")
    _expect_ids(pairs, "pairs")
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs should have shape (n_pairs, 2), got {tuple(pairs.shape)}")
    d_vocab = vectors.shape[0]
    _expect_positive_int(n, "n")
    if n >= d_vocab or words.dim() != 1 or words.numel() == 0:
        raise ValueError(f"need 1-D non-empty words and n < d_vocab = {d_vocab}, got {tuple(words.shape)} and n = {n}")
    _expect_in_range(words, d_vocab, "words")
    _expect_in_range(pairs, d_vocab, "pairs")
    together = torch.zeros(d_vocab, d_vocab, dtype=torch.bool)
    together[pairs[:, 0], pairs[:, 1]] = True
    together[pairs[:, 1], pairs[:, 0]] = True
    unit = F.normalize(vectors.detach().float().cpu(), dim=-1)
    sims = unit[words] @ unit.T  # n_words d_vocab
    sims[torch.arange(words.shape[0]), words] = -math.inf  # a word is not its own neighbour
    neighbours = sims.topk(n, dim=-1).indices  # n_words n
    return float(together[words.unsqueeze(-1), neighbours].double().mean())


# --------------------------------------------------------------------------- the cost of the softmax


def full_softmax_flops(d_vocab: int, d_model: int) -> int:
    """FLOPs of the forward pass for one (center, context) pair with P(o|c) = softmax(U v_c)_o.

    Scoring all d_vocab words is a (d_vocab x d_model) matrix times a vector, 2 d_vocab d_model
    FLOPs (one multiply and one add per weight); the softmax adds about 3 per word (exp, sum, divide).

    >>> full_softmax_flops(10, 4)
    110
    """
    _expect_positive_int(d_vocab, "d_vocab")
    _expect_positive_int(d_model, "d_model")
    return 2 * d_vocab * d_model + 3 * d_vocab


def negative_sampling_flops(k: int, d_model: int) -> int:
    """FLOPs of the SGNS forward pass for one pair: k + 1 dot products and k + 1 log-sigmoids (about 4 FLOPs each).

    >>> negative_sampling_flops(5, 4)
    72
    """
    _expect_positive_int(k, "k")
    _expect_positive_int(d_model, "d_model")
    return 2 * (k + 1) * d_model + 4 * (k + 1)

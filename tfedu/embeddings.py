"""Word vectors: one-hot ids, the embedding look-up, and word2vec's skip-gram with negative sampling.

- ``one_hot`` / ``embed_via_one_hot``: an embedding layer is a matrix product with a one-hot
  vector, ``one_hot(ids) @ W_E == W_E[ids]``, which is why ``nn.Embedding`` is a look-up.
- ``tokenize_words``, ``build_vocab`` / ``Vocab``: lowercase word tokens and a counted vocabulary.
- Skip-gram with negative sampling (SGNS; Mikolov et al. 2013, "Distributed Representations of
  Words and Phrases", eq. 4): ``keep_probabilities`` (subsampling of frequent words, sec. 2.3),
  ``noise_distribution`` (unigram^0.75, sec. 2.2), ``skipgram_pairs``, ``sample_negatives``,
  ``SkipGram`` (a center vector v and a context vector u per word), ``sgns_loss``, ``sgns_step``
  and ``train_sgns``.
- CBOW (Mikolov et al. 2013a): ``cbow_windows``, ``cbow_loss``, ``CBOW``, ``train_cbow``.
- Hierarchical softmax (Mikolov et al. 2013b, sec. 2.1): ``huffman_tree``, ``hierarchical_softmax_log_prob``.
- ``TiedEmbedding``: one matrix as W_E and W_U = W_E^T (Press & Wolf 2017; Vaswani et al. 2017, sec. 3.4).
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
from collections.abc import Callable, Sequence
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


def _word2vec_tables(d_vocab: int, d_model: int, generator: torch.Generator | None) -> tuple[nn.Embedding, nn.Embedding]:
    """word2vec's two tables: input vectors uniform in +-0.5/d_model, output vectors at zero."""
    _expect_positive_int(d_vocab, "d_vocab")
    _expect_positive_int(d_model, "d_model")
    inputs, outputs = nn.Embedding(d_vocab, d_model), nn.Embedding(d_vocab, d_model)
    with torch.no_grad():
        inputs.weight.uniform_(-0.5 / d_model, 0.5 / d_model, generator=generator)
        outputs.weight.zero_()
    return inputs, outputs


class SkipGram(nn.Module):
    """Two vectors per word: ``center`` (v_w, the word as a center word; the vectors we keep) and
    ``context`` (u_w, the word as someone else's context).

    ``forward(centers, contexts, negatives)`` looks up the vectors and returns ``loss_fn`` of them
    (``sgns_loss`` unless another function with its signature is given, e.g. a learner's own).
    As in word2vec, center vectors start uniform in +-0.5/d_model and context vectors at zero.

    >>> model = SkipGram(10, 4, generator=torch.Generator().manual_seed(0))
    >>> round(model(torch.tensor([1]), torch.tensor([2]), torch.tensor([[3, 4]])).item(), 4)  # u = 0: 3 log 2
    2.0794
    """

    def __init__(
        self, d_vocab: int, d_model: int, *, generator: torch.Generator | None = None, loss_fn: Callable[..., Tensor] | None = None
    ) -> None:
        super().__init__()
        self.center, self.context = _word2vec_tables(d_vocab, d_model, generator)
        self.loss_fn = loss_fn if loss_fn is not None else sgns_loss

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
        return self.loss_fn(self.center(centers), self.context(contexts), self.context(negatives))


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
    """What ``train_sgns`` and ``train_cbow`` return."""

    vectors: Tensor  # (d_vocab, d_model): the trained input vectors (v), on the CPU
    vocab: Vocab
    losses: list[float]  # the loss of every step, in order
    model: nn.Module  # SkipGram or CBOW


def _run_epochs(
    model: nn.Module,
    make_epoch: Callable[[], tuple[Tensor, Tensor]],
    *,
    epochs: int,
    estimate: float,
    batch_size: int,
    k: int,
    lr: float,
    noise: Tensor,
    generator: torch.Generator,
    dev: torch.device,
    progress: bool,
    desc: str,
) -> list[float]:
    """The loop ``train_sgns`` and ``train_cbow`` share: shuffle each epoch's examples, draw k negatives
    per example for every batch, take one Adam step with ``sgns_step``.

    The number of examples changes with each epoch's random subsample (and window draws), so the
    progress bar's total starts as an estimate and is made exact as each epoch's examples are
    known: at the last epoch it is exact and the bar ends full.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    per_epoch_estimate = max(1, math.ceil(estimate / batch_size))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=epochs * per_epoch_estimate, desc=desc, unit="step")
    losses: list[float] = []
    for epoch in range(epochs):
        inputs, targets = make_epoch()
        order = torch.randperm(targets.shape[0], generator=generator)
        if bar is not None:  # exact steps so far and this epoch, an estimate for the epochs still to come
            bar.total = bar.n + math.ceil(order.shape[0] / batch_size) + (epochs - epoch - 1) * per_epoch_estimate
            bar.refresh()
        for start in range(0, order.shape[0], batch_size):
            batch = order[start : start + batch_size]
            negatives = sample_negatives(noise, batch.shape[0], k, generator)
            loss = sgns_step(model, optimizer, inputs[batch].to(dev), targets[batch].to(dev), negatives.to(dev))
            losses.append(loss)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    if bar is not None:
        bar.close()
    return losses


def _check_training_args(tokens: object, lr: float, **positive: int) -> None:
    if isinstance(tokens, str):
        raise TypeError("tokens should be a list of words, not one str: call tokenize_words(text) first")
    for name, value in positive.items():
        _expect_positive_int(value, name)
    if not lr > 0:
        raise ValueError(f"lr should be > 0, got {lr}")


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
    loss_fn: Callable[..., Tensor] | None = None,
) -> SGNSResult:
    """Train skip-gram with negative sampling on a list of word tokens; return the center vectors.

    Each epoch draws a fresh subsample of the text (``threshold``), makes (center, context)
    pairs with dynamic windows up to ``window``, shuffles them, and for every batch draws ``k``
    negatives per pair from the unigram^0.75 distribution and takes one Adam step on
    ``loss_fn`` (default ``sgns_loss``). Everything random comes from one generator seeded with ``seed``.

    >>> result = train_sgns("a b a b c d c d".split() * 20, d_model=4, min_count=1, epochs=1)
    >>> result.vectors.shape, len(result.vocab)
    (torch.Size([4, 4]), 4)

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    _check_training_args(tokens, lr, d_model=d_model, window=window, k=k, epochs=epochs, batch_size=batch_size)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(seed)
    vocab = build_vocab(tokens, min_count)
    ids = vocab.encode(tokens)
    counts = vocab.count_tensor()
    keep, noise = keep_probabilities(counts, threshold), noise_distribution(counts)
    model = SkipGram(len(vocab), d_model, generator=generator, loss_fn=loss_fn).to(dev)

    def make_epoch() -> tuple[Tensor, Tensor]:
        return skipgram_pairs(subsample(ids, keep, generator), window, generator)

    # A center with window b has up to 2b contexts and b is uniform on 1..window: about (window + 1) pairs per kept word.
    estimate = (window + 1) * float((keep * counts).sum())
    losses = _run_epochs(model, make_epoch, epochs=epochs, estimate=estimate, batch_size=batch_size, k=k, lr=lr,
                         noise=noise, generator=generator, dev=dev, progress=progress, desc="SGNS")
    return SGNSResult(model.center.weight.detach().cpu().clone(), vocab, losses, model)


# --------------------------------------------------------------------------- CBOW


def cbow_windows(ids: Int[Tensor, " n"], window: int) -> tuple[Int[Tensor, "n_examples two_window"], Int[Tensor, " n_examples"]]:
    """CBOW's examples: for every position with ``window`` words on each side, those 2 x window words and the center.

    word2vec also shrinks CBOW's window at random and averages however many words fit at the
    ends of the text; we keep it fixed, so every example averages exactly 2 x window vectors.

    >>> contexts, centers = cbow_windows(torch.tensor([5, 6, 7, 8]), window=1)
    >>> contexts.tolist(), centers.tolist()
    ([[5, 7], [6, 8]], [6, 7])

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    _expect_ids(ids)
    if ids.dim() != 1:
        raise ValueError(f"ids should be 1-D, shape (n,), got shape {tuple(ids.shape)}")
    _expect_positive_int(window, "window")
    n_examples = max(0, ids.shape[0] - 2 * window)
    windows = ids.unfold(0, 2 * window + 1, 1) if n_examples else torch.zeros(0, 2 * window + 1, dtype=ids.dtype)
    contexts = torch.cat([windows[:, :window], windows[:, window + 1 :]], dim=1)  # n_examples two_window
    return contexts.long(), windows[:, window].long()


def cbow_loss(
    context: Float[Tensor, "batch two_window d_model"],
    center: Float[Tensor, "batch d_model"],
    negatives: Float[Tensor, "batch k d_model"],
) -> Float[Tensor, ""]:
    """CBOW with negative sampling: average the context words' vectors into h, then the SGNS loss of h.

    With h = mean_j v_{c_j} over the 2m context words, u_o the center word's output vector and
    u_1..u_k the negatives' output vectors, one example's loss is

        -log sigma(u_o . h) - sum_i log sigma(-u_i . h)

    (Mikolov et al. 2013a, "Efficient Estimation of Word Representations", sec. 3.1; the
    negative-sampling form of 2013b, eq. 4), averaged over the batch.

    >>> context = torch.tensor([[[1.0, 0.0], [3.0, 0.0]]])  # h = (2, 0)
    >>> round(cbow_loss(context, torch.tensor([[1.0, 0.0]]), torch.zeros(1, 1, 2)).item(), 4)  # -log s(2) + log 2
    0.8201

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    _expect_float(context, "context", 3, "(batch, two_window, d_model)")
    _expect_float(center, "center", 2, "(batch, d_model)")
    if context.shape[0] != center.shape[0] or context.shape[2] != center.shape[1]:
        raise ValueError(
            f"context should be (batch, two_window, d_model) and center (batch, d_model), got {tuple(context.shape)} and {tuple(center.shape)}"
        )
    h = context.mean(dim=1)  # batch d_model: the average of the context vectors
    return sgns_loss(h, center, negatives)


class CBOW(nn.Module):
    """Continuous bag of words: ``input`` vectors (v, for context words; the ones we keep) and
    ``output`` vectors (u, for the predicted center word and the negatives).

    ``forward(contexts, centers, negatives)`` takes ids of shapes (batch, 2m), (batch,) and
    (batch, k) and returns ``loss_fn`` (default ``cbow_loss``) of the looked-up vectors. It starts
    like ``SkipGram``: input vectors uniform in +-0.5/d_model, output vectors at zero.

    >>> model = CBOW(10, 4, generator=torch.Generator().manual_seed(0))
    >>> round(model(torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([[4, 5]])).item(), 4)  # u = 0: 3 log 2
    2.0794
    """

    def __init__(
        self, d_vocab: int, d_model: int, *, generator: torch.Generator | None = None, loss_fn: Callable[..., Tensor] | None = None
    ) -> None:
        super().__init__()
        self.input, self.output = _word2vec_tables(d_vocab, d_model, generator)
        self.loss_fn = loss_fn if loss_fn is not None else cbow_loss

    @property
    def d_vocab(self) -> int:
        return self.input.num_embeddings

    def forward(
        self, contexts: Int[Tensor, "batch two_window"], centers: Int[Tensor, " batch"], negatives: Int[Tensor, "batch k"]
    ) -> Float[Tensor, ""]:
        for name, ids in (("contexts", contexts), ("centers", centers), ("negatives", negatives)):
            _expect_ids(ids, name)
            _expect_in_range(ids, self.d_vocab, name)
        if contexts.dim() != 2 or centers.shape != contexts.shape[:1] or negatives.dim() != 2 or negatives.shape[0] != centers.shape[0]:
            raise ValueError(
                "contexts should be (batch, two_window), centers (batch,) and negatives (batch, k), got shapes "
                f"{tuple(contexts.shape)}, {tuple(centers.shape)} and {tuple(negatives.shape)}"
            )
        return self.loss_fn(self.input(contexts), self.output(centers), self.output(negatives))


def train_cbow(
    tokens: Sequence[str],
    *,
    d_model: int = 32,
    window: int = 2,
    k: int = 5,
    epochs: int = 5,
    batch_size: int = 256,
    lr: float = 0.01,
    min_count: int = 5,
    threshold: float = 1e-3,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = False,
    loss_fn: Callable[..., Tensor] | None = None,
) -> SGNSResult:
    """Train CBOW with negative sampling; return the input vectors (one row per word).

    The same pipeline as ``train_sgns`` (a fresh subsample each epoch, unigram^0.75 negatives, Adam),
    but one example per kept position: its 2 x ``window`` neighbours predict it.

    >>> result = train_cbow("a b a b c d c d".split() * 20, d_model=4, min_count=1, epochs=1)
    >>> result.vectors.shape, len(result.losses)
    (torch.Size([4, 4]), 1)

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    _check_training_args(tokens, lr, d_model=d_model, window=window, k=k, epochs=epochs, batch_size=batch_size)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(seed)
    vocab = build_vocab(tokens, min_count)
    ids = vocab.encode(tokens)
    counts = vocab.count_tensor()
    keep, noise = keep_probabilities(counts, threshold), noise_distribution(counts)
    model = CBOW(len(vocab), d_model, generator=generator, loss_fn=loss_fn).to(dev)

    def make_epoch() -> tuple[Tensor, Tensor]:
        return cbow_windows(subsample(ids, keep, generator), window)

    estimate = max(1.0, float((keep * counts).sum()) - 2 * window)
    losses = _run_epochs(model, make_epoch, epochs=epochs, estimate=estimate, batch_size=batch_size, k=k, lr=lr,
                         noise=noise, generator=generator, dev=dev, progress=progress, desc="CBOW")
    return SGNSResult(model.input.weight.detach().cpu().clone(), vocab, losses, model)


# --------------------------------------------------------------------------- hierarchical softmax


@dataclass(frozen=True)
class HuffmanTree:
    """A binary tree over the vocabulary: the words are its leaves, its d_vocab - 1 inner nodes carry vectors.

    Word w's path from the root is ``paths[w, :lengths[w]]`` (inner-node ids) and at each node the
    step goes left (sign +1) or right (sign -1): ``signs[w, :lengths[w]]``. Past ``lengths[w]`` both
    are padding (node 0, sign 0).
    """

    paths: Tensor  # (d_vocab, max_depth) long: inner nodes on each word's path, root first
    signs: Tensor  # (d_vocab, max_depth) float: +1 for a left step, -1 for a right step, 0 for padding
    lengths: Tensor  # (d_vocab,) long: the number of inner nodes on each word's path (its code length)

    @property
    def d_vocab(self) -> int:
        return self.paths.shape[0]


def huffman_tree(counts: Float[Tensor, " d_vocab"]) -> HuffmanTree:
    """Huffman's tree for the word counts: frequent words get short paths (Mikolov et al. 2013b, sec. 2.1).

    Repeatedly join the two least frequent subtrees (ties: the one made first). The expected path
    length, weighted by frequency, is the smallest any binary tree allows: between the entropy H
    of the unigram distribution (in bits) and H + 1.

    >>> tree = huffman_tree(torch.tensor([5.0, 2.0, 1.0, 1.0]))
    >>> tree.lengths.tolist()
    [1, 2, 3, 3]

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.shape[0] < 2:
        raise ValueError("counts should be a 1-D tensor of at least 2 word counts, shape (d_vocab,)")
    _expect_counts(counts)
    import heapq

    d_vocab = counts.shape[0]
    # Heap items: (count, order of creation, node). Nodes 0..d_vocab-1 are words; d_vocab + j is inner node j.
    heap = [(float(c), i, i) for i, c in enumerate(counts.tolist())]
    heapq.heapify(heap)
    children: list[tuple[int, int]] = []  # inner node j -> (left, right)
    while len(heap) > 1:
        c_left, _, left = heapq.heappop(heap)
        c_right, _, right = heapq.heappop(heap)
        children.append((left, right))
        heapq.heappush(heap, (c_left + c_right, d_vocab + len(children) - 1, d_vocab + len(children) - 1))
    # Inner node ids count down from the root: the last node made is the root, id 0.
    n_inner = len(children)
    word_paths: list[list[tuple[int, float]]] = [[] for _ in range(d_vocab)]
    stack = [(d_vocab + n_inner - 1, [])]
    while stack:
        node, path = stack.pop()
        if node < d_vocab:
            word_paths[node] = path
            continue
        inner = n_inner - 1 - (node - d_vocab)
        left, right = children[node - d_vocab]
        stack.append((left, path + [(inner, 1.0)]))
        stack.append((right, path + [(inner, -1.0)]))
    depth = max(len(p) for p in word_paths)
    paths = torch.zeros(d_vocab, depth, dtype=torch.long)
    signs = torch.zeros(d_vocab, depth)
    for w, path in enumerate(word_paths):
        if path:
            paths[w, : len(path)] = torch.tensor([node for node, _ in path])
            signs[w, : len(path)] = torch.tensor([sign for _, sign in path])
    return HuffmanTree(paths, signs, torch.tensor([len(p) for p in word_paths]))


def hierarchical_softmax_log_prob(
    h: Float[Tensor, "batch d_model"], node_vectors: Float[Tensor, "n_inner d_model"], tree: HuffmanTree, words: Int[Tensor, " batch"]
) -> Float[Tensor, " batch"]:
    """log p(word | h) = sum over the word's path of log sigma(sign_j * u_{node_j} . h) (Mikolov et al. 2013b, eq. 3).

    At every inner node n the step goes left with probability sigma(u_n . h) and right with
    sigma(-u_n . h) = 1 - sigma(u_n . h), so the leaves' probabilities sum to 1 with no
    normaliser, and one word costs its path length (about log2 d_vocab) dot products, not d_vocab.

    >>> tree = huffman_tree(torch.tensor([2.0, 1.0, 1.0]))  # word 0 is one left step from the root
    >>> logp = hierarchical_softmax_log_prob(torch.zeros(3, 2), torch.zeros(2, 2), tree, torch.arange(3))
    >>> logp.exp()
    tensor([0.5000, 0.2500, 0.2500])

    Built by hand in notebooks/02_embeddings.ipynb.
    """
    _expect_float(h, "h", 2, "(batch, d_model)")
    _expect_float(node_vectors, "node_vectors", 2, "(d_vocab - 1, d_model)")
    _expect_ids(words, "words")
    if node_vectors.shape[0] != tree.d_vocab - 1 or node_vectors.shape[1] != h.shape[1] or words.shape != h.shape[:1]:
        raise ValueError(
            f"need h (batch, d_model), node_vectors ({tree.d_vocab - 1}, d_model) and words (batch,), got "
            f"{tuple(h.shape)}, {tuple(node_vectors.shape)} and {tuple(words.shape)}"
        )
    _expect_in_range(words, tree.d_vocab, "words")
    paths, signs = tree.paths.to(h.device)[words], tree.signs.to(h.device, h.dtype)[words]  # batch max_depth
    scores = torch.einsum("bjd,bd->bj", node_vectors[paths], h)  # batch max_depth
    return (F.logsigmoid(signs * scores) * (signs != 0)).sum(-1)


# --------------------------------------------------------------------------- embeddings in a Transformer


class TiedEmbedding(nn.Module):
    """One matrix W_E for both ends of a language model: embed ids with W_E, score the vocabulary with W_U = W_E^T.

    Press and Wolf (2017) showed that sharing them works as well as two matrices or better, with
    d_vocab x d_model fewer parameters; Vaswani et al. (2017, sec. 3.4) share them and multiply the
    embeddings by sqrt(d_model). ``W_E`` starts N(0, 1/d_model), so logits ``unembed(x)`` of a
    unit-size x start at unit scale, and the scaled embeddings have entries of about 1, like the
    sinusoidal positional encodings added to them.

    >>> tied = TiedEmbedding(d_vocab=10, d_model=4)
    >>> sum(p.numel() for p in tied.parameters()), tied.unembed(tied.embed(torch.tensor([[1, 2]]))).shape
    (40, torch.Size([1, 2, 10]))

    Built by hand in notebooks/02_embeddings.ipynb.
    """

    def __init__(self, d_vocab: int, d_model: int, *, scale: bool = True, generator: torch.Generator | None = None) -> None:
        super().__init__()
        _expect_positive_int(d_vocab, "d_vocab")
        _expect_positive_int(d_model, "d_model")
        self.W_E = nn.Parameter(torch.randn(d_vocab, d_model, generator=generator) / math.sqrt(d_model))
        self.scale = math.sqrt(d_model) if scale else 1.0

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.W_E.T  # a view: the same numbers, so the same parameter

    def embed(self, ids: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        _expect_ids(ids)
        _expect_in_range(ids, self.W_E.shape[0])
        return self.W_E[ids] * self.scale  # batch pos d_model

    def unembed(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        _expect_float(x, "x", None, "(..., d_model)")
        if x.shape[-1] != self.W_E.shape[1]:
            raise ValueError(f"x should end in d_model = {self.W_E.shape[1]}, got shape {tuple(x.shape)}")
        return x @ self.W_U  # batch pos d_vocab


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

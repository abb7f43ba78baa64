import doctest
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import tfedu.embeddings as E


def test_doctests():
    failures, tried = doctest.testmod(E, raise_on_error=False)
    assert tried > 15 and failures == 0


# --------------------------------------------------------------------------- one-hot and the look-up


def test_one_hot_by_hand():
    got = E.one_hot(torch.tensor([[2, 0], [1, 1]]), 3)
    expected = torch.tensor([[[0.0, 0, 1], [1, 0, 0]], [[0, 1, 0], [0, 1, 0]]])
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


def test_one_hot_vectors_are_orthonormal():
    basis = E.one_hot(torch.arange(7), 7)
    assert torch.equal(basis @ basis.T, torch.eye(7))
    # No similarity at all: every pair of different words has cosine 0.
    cos = E.cosine_similarity(basis.unsqueeze(1), basis.unsqueeze(0))
    assert torch.equal(cos, torch.eye(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_embed_via_one_hot_equals_nn_embedding_values_and_gradients(dtype):
    torch.manual_seed(0)
    embedding = nn.Embedding(11, 5).to(dtype)
    W_E = embedding.weight.detach().clone().requires_grad_(True)
    ids = torch.tensor([[3, 10, 3, 0], [7, 7, 7, 1]])  # repeated ids: their gradients must add up
    ours = E.embed_via_one_hot(ids, W_E)
    theirs = embedding(ids)
    assert ours.dtype == dtype
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, W_E[ids])
    upstream = torch.randn(2, 4, 5, dtype=dtype)
    (ours * upstream).sum().backward()
    (theirs * upstream).sum().backward()
    assert torch.equal(W_E.grad, embedding.weight.grad)
    # Rows of ids that never appear get no gradient; a row used three times gets three contributions.
    assert torch.equal(W_E.grad[2], torch.zeros(5, dtype=dtype))
    assert torch.allclose(W_E.grad[7], upstream[1, :3].sum(0))


def test_embed_via_one_hot_shapes_are_annotated_correctly(typechecked):
    W_E = torch.randn(6, 4)
    assert typechecked(E.embed_via_one_hot)(torch.tensor([[1, 2, 3]]), W_E).shape == (1, 3, 4)
    assert typechecked(E.one_hot)(torch.tensor([1, 2]), 6).shape == (2, 6)
    assert typechecked(E.cosine_similarity)(torch.randn(2, 3, 4), torch.randn(2, 3, 4)).shape == (2, 3)


@pytest.mark.parametrize(
    ("ids", "d_vocab", "error", "match"),
    [
        (torch.tensor([0.0, 1.0]), 3, TypeError, "integer ids"),
        (torch.tensor([True, False]), 3, TypeError, "integer ids"),
        ([0, 1], 3, TypeError, "torch.Tensor"),
        (torch.tensor([0, 3]), 3, IndexError, r"\[0, 3\)"),
        (torch.tensor([-1, 2]), 3, IndexError, r"\[0, 3\)"),
        (torch.tensor([0, 1]), 0, ValueError, "positive int"),
        (torch.tensor([0, 1]), 2.0, ValueError, "positive int"),
    ],
)
def test_one_hot_bad_input(ids, d_vocab, error, match):
    with pytest.raises(error, match=match):
        E.one_hot(ids, d_vocab)


def test_embed_via_one_hot_bad_input():
    W_E = torch.randn(4, 3)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        E.embed_via_one_hot(torch.tensor([4]), W_E)
    with pytest.raises(TypeError, match="integer ids"):
        E.embed_via_one_hot(torch.tensor([1.0]), W_E)
    with pytest.raises(ValueError, match=r"\(d_vocab, d_model\)"):
        E.embed_via_one_hot(torch.tensor([1]), torch.randn(4))
    with pytest.raises(ValueError, match=r"\(d_vocab, d_model\)"):
        E.embed_via_one_hot(torch.tensor([1]), torch.randn(2, 4, 3))
    with pytest.raises(TypeError, match="floating-point"):
        E.embed_via_one_hot(torch.tensor([1]), torch.ones(4, 3, dtype=torch.long))


def test_cosine_similarity_matches_torch():
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(E.cosine_similarity(a, b), F.cosine_similarity(a, b, dim=-1))
    with pytest.raises(ValueError, match="same last dimension"):
        E.cosine_similarity(torch.randn(3, 4), torch.randn(3, 5))


# --------------------------------------------------------------------------- words and vocabulary


def test_tokenize_words():
    assert E.tokenize_words("Use `dict.get()` or __getitem__; UTF8 2x!") == ["use", "dict", "get", "or", "__getitem__", "utf8", "x"]
    with pytest.raises(TypeError, match="str"):
        E.tokenize_words(["a"])


def test_build_vocab_orders_by_count_then_word():
    vocab = E.build_vocab("c b a b c b d".split(), min_count=1)
    assert vocab.words == ("b", "c", "a", "d")
    assert vocab.counts == (3, 2, 1, 1)
    assert vocab.id("c") == 1 and "d" in vocab and "z" not in vocab
    assert vocab.encode("z b d q".split()).tolist() == [0, 3]
    with pytest.raises(KeyError, match="not in the vocabulary"):
        vocab.id("z")
    with pytest.raises(ValueError, match="no token occurs"):
        E.build_vocab(["a"], min_count=2)
    with pytest.raises(TypeError, match="tokenize_words"):
        E.build_vocab("a b c")


# --------------------------------------------------------------------------- the data pipeline


def test_keep_probabilities_by_hand():
    counts = torch.tensor([900.0, 90.0, 10.0])
    t = 0.01
    expected = [min(1.0, math.sqrt(t / (c / 1000))) for c in (900, 90, 10)]
    assert E.keep_probabilities(counts, t).tolist() == pytest.approx(expected)
    assert E.keep_probabilities(counts, t)[2] == 1.0


def test_noise_distribution_by_hand_and_flatter_than_unigram():
    counts = torch.tensor([81.0, 16.0, 1.0])
    weights = [c**0.75 for c in (81, 16, 1)]  # 27, 8, 1
    assert E.noise_distribution(counts).tolist() == pytest.approx([w / 36 for w in weights])
    unigram = counts / counts.sum()
    noise = E.noise_distribution(counts)
    assert noise[0] < unigram[0] and noise[2] > unigram[2]
    with pytest.raises(ValueError, match="non-negative"):
        E.noise_distribution(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="1-D"):
        E.noise_distribution(torch.ones(2, 2))


def test_subsample_keeps_the_expected_fraction_in_order():
    ids = torch.tensor([0, 1] * 20_000)
    keep = torch.tensor([0.25, 1.0], dtype=torch.float64)
    kept = E.subsample(ids, keep, torch.Generator().manual_seed(0))
    assert (kept == 1).sum() == 20_000
    assert abs((kept == 0).sum().item() / 20_000 - 0.25) < 0.02
    again = E.subsample(ids, keep, torch.Generator().manual_seed(0))
    assert torch.equal(kept, again)


def brute_force_pairs(ids, reach):
    pairs = []
    for i in range(len(ids)):
        for j in range(len(ids)):
            if i != j and abs(i - j) <= reach[i]:
                pairs.append((ids[i], ids[j]))
    return sorted(pairs)


def test_skipgram_pairs_fixed_window_matches_brute_force():
    ids = torch.tensor([5, 1, 4, 1, 5, 9, 2, 6])
    centers, contexts = E.skipgram_pairs(ids, 3, dynamic=False)
    assert sorted(zip(centers.tolist(), contexts.tolist())) == brute_force_pairs(ids.tolist(), [3] * 8)


def test_skipgram_pairs_dynamic_window_matches_brute_force_with_the_same_draws():
    ids = torch.randint(0, 20, (40,), generator=torch.Generator().manual_seed(1))
    centers, contexts = E.skipgram_pairs(ids, 4, torch.Generator().manual_seed(7))
    reach = torch.randint(1, 5, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    assert sorted(zip(centers.tolist(), contexts.tolist())) == brute_force_pairs(ids.tolist(), reach)


def test_skipgram_pairs_edge_cases():
    empty_c, empty_o = E.skipgram_pairs(torch.tensor([3]), 2)
    assert empty_c.numel() == 0 and empty_o.numel() == 0
    with pytest.raises(ValueError, match="1-D"):
        E.skipgram_pairs(torch.tensor([[1, 2]]), 2)
    with pytest.raises(TypeError, match="integer ids"):
        E.skipgram_pairs(torch.tensor([1.0, 2.0]), 2)


def test_sample_negatives_follow_the_noise_distribution():
    noise = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    negatives = E.sample_negatives(noise, 20_000, 5, torch.Generator().manual_seed(0))
    assert negatives.shape == (20_000, 5) and negatives.dtype == torch.long
    freq = torch.bincount(negatives.flatten(), minlength=3).double() / negatives.numel()
    torch.testing.assert_close(freq, noise, atol=0.01, rtol=0)
    assert E.sample_negatives(noise, 0, 5).shape == (0, 5)


# --------------------------------------------------------------------------- the loss


def log_sigmoid_by_hand(x: float) -> float:
    return math.log(1.0 / (1.0 + math.exp(-x)))


def test_sgns_loss_matches_a_hand_computation():
    center = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    context = torch.tensor([[0.5, 0.25], [2.0, 0.0]])
    negatives = torch.tensor([[[1.0, 0.0], [0.0, -1.0], [0.0, 0.0]], [[-1.0, -1.0], [1.0, 1.0], [0.0, 2.0]]])
    # Example 1: u_o.v = 1.0; negatives score 1, -2, 0. Example 2: u_o.v = 1.0; negatives score 0.5, -0.5, -2.
    first = -log_sigmoid_by_hand(1.0) - sum(log_sigmoid_by_hand(-s) for s in (1.0, -2.0, 0.0))
    second = -log_sigmoid_by_hand(1.0) - sum(log_sigmoid_by_hand(-s) for s in (0.5, -0.5, -2.0))
    got = E.sgns_loss(center, context, negatives)
    assert got.shape == ()
    assert got.item() == pytest.approx((first + second) / 2, rel=1e-6)


def test_sgns_loss_equals_binary_cross_entropy_and_has_correct_gradients(typechecked):
    g = torch.Generator().manual_seed(3)
    center = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    context = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    negatives = torch.randn(6, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    # SGNS is logistic regression: label 1 for the true context, 0 for each negative.
    pos = (center * context).sum(-1)
    neg = (negatives @ center.unsqueeze(-1)).squeeze(-1)
    bce = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="sum")
    bce = bce + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg), reduction="sum")
    torch.testing.assert_close(typechecked(E.sgns_loss)(center, context, negatives), bce / 6)
    assert torch.autograd.gradcheck(E.sgns_loss, (center, context, negatives))


def test_sgns_loss_is_stable_for_large_scores():
    v = torch.full((1, 2), 100.0)
    loss = E.sgns_loss(v, -v, v.unsqueeze(1))
    assert torch.isfinite(loss) and loss.item() == pytest.approx(2 * 20_000, rel=1e-4)


def test_sgns_loss_bad_shapes():
    with pytest.raises(ValueError, match=r"\(batch, k, d_model\)"):
        E.sgns_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3))
    with pytest.raises(ValueError, match="center and context"):
        E.sgns_loss(torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 5, 3))
    with pytest.raises(TypeError, match="floating-point"):
        E.sgns_loss(torch.ones(2, 3, dtype=torch.long), torch.randn(2, 3), torch.randn(2, 5, 3))


# --------------------------------------------------------------------------- the model and one step


def test_skipgram_initialisation_and_forward():
    model = E.SkipGram(9, 4, generator=torch.Generator().manual_seed(0))
    assert model.center.weight.abs().max() <= 0.5 / 4
    assert torch.equal(model.context.weight, torch.zeros(9, 4))
    with torch.no_grad():
        model.context.weight.normal_()
    centers, contexts, negatives = torch.tensor([1, 2]), torch.tensor([3, 3]), torch.tensor([[4, 5], [6, 7]])
    expected = E.sgns_loss(model.center.weight[centers], model.context.weight[contexts], model.context.weight[negatives])
    assert torch.equal(model(centers, contexts, negatives), expected)
    with pytest.raises(IndexError, match="negatives"):
        model(centers, contexts, torch.tensor([[4, 9], [6, 7]]))
    with pytest.raises(TypeError, match="centers"):
        model(centers.float(), contexts, negatives)
    with pytest.raises(ValueError, match=r"\(batch, k\)"):
        model(centers, contexts, torch.tensor([4, 5]))


def test_sgns_step_is_one_plain_optimiser_step():
    g = torch.Generator().manual_seed(0)
    model = E.SkipGram(8, 3, generator=g)
    with torch.no_grad():
        model.context.weight.normal_(generator=g)
    twin = E.SkipGram(8, 3)
    twin.load_state_dict(model.state_dict())
    batch = (torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5]), torch.tensor([[6, 7], [7, 6], [1, 0]]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):  # twice: stale gradients from the first step must not leak into the second
        before = twin(*batch)
        params = list(twin.parameters())
        grads = torch.autograd.grad(before, params)
        with torch.no_grad():
            for p, grad in zip(params, grads):
                p -= 0.5 * grad
        loss = E.sgns_step(model, optimizer, *batch)
        assert isinstance(loss, float) and loss == pytest.approx(before.item())
        for ours, theirs in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(ours, theirs)
    assert twin(*batch).item() < before.item()


# --------------------------------------------------------------------------- training


def shared_context_corpus(n_sentences: int = 3000, seed: int = 0) -> tuple[list[str], dict[str, list[str]]]:
    """Three groups of words; members of a group never meet each other, only their group's context words."""
    rng = random.Random(seed)
    groups = {
        "animals": (["cat", "dog", "cow", "horse"], ["eats", "sleeps", "barn", "tail", "fur", "vet"]),
        "vehicles": (["car", "bus", "van", "truck"], ["drives", "engine", "road", "wheel", "fuel", "garage"]),
        "fruit": (["apple", "pear", "plum", "peach"], ["ripe", "juice", "tree", "peel", "sweet", "orchard"]),
    }
    fillers = ["the", "a", "and", "then", "so"]
    tokens: list[str] = []
    for _ in range(n_sentences):
        members, contexts = groups[rng.choice(sorted(groups))]
        sentence = rng.sample(contexts, 3)
        sentence.insert(rng.randrange(4), rng.choice(members))
        tokens += sentence + [rng.choice(fillers), rng.choice(fillers)]
    return tokens, {name: members for name, (members, _) in groups.items()}


def test_train_sgns_puts_words_that_share_contexts_nearest_each_other():
    tokens, groups = shared_context_corpus()
    result = E.train_sgns(tokens, d_model=16, window=3, epochs=4, batch_size=256, lr=0.02, min_count=1, threshold=1e-2, seed=0)
    assert len(result.vocab) == 3 * 4 + 3 * 6 + 5
    members = [w for group in groups.values() for w in group]
    group_of = {w: name for name, group in groups.items() for w in group}
    for word in members:
        # Among all 35 words, the closest are the other members of its group: they never occur
        # together, they only share contexts.
        top3 = [w for w, _ in E.nearest_neighbours(word, result.vectors, result.vocab, n=3)]
        assert all(group_of.get(w) == group_of[word] for w in top3), (word, top3)
    first, last = sum(result.losses[:10]) / 10, sum(result.losses[-10:]) / 10
    assert last < 0.7 * first


def test_train_sgns_is_seeded():
    tokens, _ = shared_context_corpus(300)
    kw = dict(d_model=4, epochs=1, min_count=1, batch_size=64)
    a, b, c = E.train_sgns(tokens, seed=1, **kw), E.train_sgns(tokens, seed=1, **kw), E.train_sgns(tokens, seed=2, **kw)
    assert torch.equal(a.vectors, b.vectors) and a.losses == b.losses
    assert not torch.equal(a.vectors, c.vectors)


def test_train_sgns_progress_bar(capsys):
    tokens, _ = shared_context_corpus(200)
    result = E.train_sgns(tokens, d_model=4, epochs=2, min_count=1, batch_size=64, progress=True)
    assert "SGNS" in capsys.readouterr().err
    assert len(result.losses) > 0


def test_train_sgns_bad_input():
    with pytest.raises(TypeError, match="tokenize_words"):
        E.train_sgns("a b c")
    with pytest.raises(ValueError, match="window"):
        E.train_sgns(["a", "b"] * 10, window=0, min_count=1)
    with pytest.raises(ValueError, match="lr"):
        E.train_sgns(["a", "b"] * 10, lr=0.0, min_count=1)


# --------------------------------------------------------------------------- reading the vectors


def test_nearest_neighbours_and_analogy_by_hand():
    vocab = E.Vocab(("a", "b", "c", "d"), (4, 3, 2, 1))
    vectors = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]])
    got = E.nearest_neighbours("a", vectors, vocab, n=3)
    assert [w for w, _ in got] == ["b", "c", "d"]
    assert [s for _, s in got] == pytest.approx([0.8, 0.0, -1.0])
    # Leaving out a, b and c, the only candidate left is d.
    assert [w for w, _ in E.analogy("a", "b", "c", vectors, vocab, n=1)] == ["d"]
    with pytest.raises(KeyError, match="'z' is not in the vocabulary"):
        E.nearest_neighbours("z", vectors, vocab)
    with pytest.raises(ValueError, match="3 rows"):
        E.nearest_neighbours("a", vectors[:3], vocab)


def test_analogy_on_constructed_vectors():
    # Gender along axis 0, royalty along axis 1, plus distractors.
    words = ("man", "woman", "king", "queen", "apple", "car")
    vectors = torch.tensor([[1.0, 0, 0.1], [-1.0, 0, 0.1], [1.0, 1, 0.1], [-1.0, 1, 0.1], [0.0, 0, 1], [0.3, -1, 0]])
    vocab = E.Vocab(words, (1,) * 6)
    assert E.analogy("man", "king", "woman", vectors, vocab)[0][0] == "queen"
    assert E.analogy("king", "man", "queen", vectors, vocab)[0][0] == "woman"


# --------------------------------------------------------------------------- the held-out check


def test_split_held_out():
    tokens = [str(i) for i in range(25)]
    train, held = E.split_held_out(tokens, every=3, chunk=4)
    assert held == ["8", "9", "10", "11", "20", "21", "22", "23"]
    assert sorted(train + held, key=int) == tokens
    with pytest.raises(ValueError, match="at least 2"):
        E.split_held_out(tokens, every=1)


def test_cooccurring_pairs_match_brute_force():
    rng = random.Random(0)
    tokens = [rng.choice("abcdefgh") for _ in range(200)]
    vocab = E.Vocab(tuple("abcdef"), (1,) * 6)  # g and h are out of vocabulary
    got = E.cooccurring_pairs(tokens, vocab, 3, skip_top=1)
    expected = set()
    for i, a in enumerate(tokens):
        for j in range(i + 1, min(i + 4, len(tokens))):
            b = tokens[j]
            if a in "bcdef" and b in "bcdef" and a != b:
                ia, ib = vocab.id(a), vocab.id(b)
                expected.add((min(ia, ib), max(ia, ib)))
    assert sorted(map(tuple, got.tolist())) == sorted(expected)


def test_held_out_similarity_separates_good_and_random_vectors():
    pairs = torch.tensor([[2 * i, 2 * i + 1] for i in range(50)])
    g = torch.Generator().manual_seed(0)
    base = torch.randn(50, 16, generator=g)
    good = base.repeat_interleave(2, dim=0) + 0.1 * torch.randn(100, 16, generator=g)
    assert E.held_out_similarity(good, pairs, torch.Generator().manual_seed(0)) > 0.8
    random_score = E.held_out_similarity(torch.randn(100, 16, generator=g), pairs, torch.Generator().manual_seed(0))
    assert abs(random_score) < 0.15
    with pytest.raises(ValueError, match=r"\(n_pairs, 2\)"):
        E.held_out_similarity(good, torch.tensor([1, 2, 3]))
    with pytest.raises(IndexError, match="pairs"):
        E.held_out_similarity(good, torch.tensor([[0, 100], [1, 2]]))


def test_neighbour_hit_rate_by_hand():
    vectors = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    pairs = torch.tensor([[0, 1], [0, 2]])
    # Neighbours (n=2): 0 -> 1, 3; 2 -> 3, 1. Hits: (0,1) only.
    assert E.neighbour_hit_rate(vectors, torch.tensor([0, 2]), pairs, n=2) == pytest.approx(1 / 4)
    assert E.neighbour_hit_rate(vectors, torch.tensor([0]), pairs, n=1) == 1.0
    with pytest.raises(ValueError, match="n < d_vocab"):
        E.neighbour_hit_rate(vectors, torch.tensor([0]), pairs, n=4)


# --------------------------------------------------------------------------- the cost of the softmax


def test_flop_counts_agree_with_torch_flop_counter():
    d_vocab, d_model, k = 300, 16, 5
    U, v = torch.randn(d_vocab, d_model), torch.randn(d_model, 1)
    with FlopCounterMode(display=False) as counter:
        U @ v
    assert counter.get_total_flops() == E.full_softmax_flops(d_vocab, d_model) - 3 * d_vocab
    neg = torch.randn(1, k + 1, d_model)
    with FlopCounterMode(display=False) as counter:
        torch.bmm(neg, v.unsqueeze(0))
    assert counter.get_total_flops() == E.negative_sampling_flops(k, d_model) - 4 * (k + 1)
    ratio = E.full_softmax_flops(10_000, 100) / E.negative_sampling_flops(5, 100)
    assert 1_500 < ratio < 10_000 / 6 + 1


def test_pipeline_and_reading_shapes_are_annotated_correctly(typechecked):
    counts = torch.tensor([50.0, 20.0, 5.0, 1.0])
    keep = typechecked(E.keep_probabilities)(counts, 0.1)
    noise = typechecked(E.noise_distribution)(counts)
    ids = torch.tensor([0, 1, 2, 3, 0, 1, 0])
    assert typechecked(E.subsample)(ids, keep, torch.Generator().manual_seed(0)).dim() == 1
    centers, contexts = typechecked(E.skipgram_pairs)(ids, 2, torch.Generator().manual_seed(0))
    assert centers.shape == contexts.shape
    assert typechecked(E.sample_negatives)(noise, 3, 2).shape == (3, 2)
    model = E.SkipGram(4, 3)
    assert typechecked(model.forward)(centers[:3], contexts[:3], torch.tensor([[1, 2], [3, 0], [0, 0]])).shape == ()
    vocab = E.Vocab(("a", "b", "c", "d"), (4, 3, 2, 1))
    vectors = torch.randn(4, 3)
    assert len(typechecked(E.nearest_neighbours)("a", vectors, vocab, 2)) == 2
    assert len(typechecked(E.analogy)("a", "b", "c", vectors, vocab, 1)) == 1
    pairs = typechecked(E.cooccurring_pairs)(list("abcdabca"), vocab, 2)
    assert pairs.shape[1] == 2
    assert isinstance(typechecked(E.held_out_similarity)(vectors, pairs), float)
    assert isinstance(typechecked(E.neighbour_hit_rate)(vectors, torch.tensor([0, 1]), pairs, 2), float)


# --------------------------------------------------------------------------- the progress bar and the loss switch


def test_progress_bar_total_is_exact_when_training_ends(monkeypatch):
    # The bar's total starts as an estimate; it must equal the steps taken when the run ends (green, not red).
    import tqdm.auto

    bars = []

    class Recorder:  # stands in for tqdm: what the bar would show when it closes
        def __init__(self, total, **kwargs):
            self.total, self.n, self.total_when_closed = total, 0, None
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def refresh(self):
            pass

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            self.total_when_closed = self.total

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    tokens, _ = shared_context_corpus(400)
    for train in (E.train_sgns, E.train_cbow):
        result = train(tokens, d_model=4, epochs=3, min_count=1, batch_size=64, progress=True)
        assert bars[-1].n == len(result.losses) == bars[-1].total_when_closed


def test_train_sgns_runs_with_a_given_loss_function():
    tokens, _ = shared_context_corpus(300)
    kw = dict(d_model=4, epochs=1, min_count=1, batch_size=64, seed=0)
    default, same = E.train_sgns(tokens, **kw), E.train_sgns(tokens, loss_fn=E.sgns_loss, **kw)
    assert torch.equal(default.vectors, same.vectors) and default.losses == same.losses
    calls = []

    def spy(center, context, negatives):
        calls.append(center.shape)
        return E.sgns_loss(center, context, negatives)

    E.train_sgns(tokens, loss_fn=spy, **kw)
    assert len(calls) == len(default.losses)


# --------------------------------------------------------------------------- CBOW


def test_cbow_windows_match_a_loop():
    ids = torch.tensor([4, 9, 2, 7, 7, 1, 0, 3])
    for window in (1, 2, 3, 4):
        contexts, centers = E.cbow_windows(ids, window)
        expected = [(ids[t - window : t].tolist() + ids[t + 1 : t + window + 1].tolist(), ids[t].item())
                    for t in range(window, len(ids) - window)]
        assert [(c.tolist(), o) for c, o in zip(contexts, centers.tolist())] == expected
    contexts, centers = E.cbow_windows(torch.tensor([1, 2]), 2)
    assert contexts.shape == (0, 4) and centers.shape == (0,)


def naive_cbow_loss(context, center, negatives):
    """One example at a time, with Python floats."""
    total = 0.0
    for b in range(context.shape[0]):
        h = [sum(context[b, j, d].item() for j in range(context.shape[1])) / context.shape[1] for d in range(context.shape[2])]
        dot = lambda u: sum(x * y for x, y in zip(u.tolist(), h))  # noqa: E731
        total += -math.log(1 / (1 + math.exp(-dot(center[b]))))
        total += sum(-math.log(1 / (1 + math.exp(dot(negatives[b, i])))) for i in range(negatives.shape[1]))
    return total / context.shape[0]


def test_cbow_loss_matches_a_loop_and_its_gradient_the_closed_form():
    g = torch.Generator().manual_seed(0)
    context = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    center = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    negatives = torch.randn(3, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    loss = E.cbow_loss(context, center, negatives)
    assert loss.item() == pytest.approx(naive_cbow_loss(context.detach(), center.detach(), negatives.detach()), rel=1e-12)
    loss.backward()
    # dL/dv_cj = (1/batch)(1/2m) [-(1 - s(u_o.h)) u_o + sum_i s(u_i.h) u_i], the same for every context word j.
    with torch.no_grad():
        h = context.mean(1)
        pos = torch.sigmoid((center * h).sum(-1))
        neg = torch.sigmoid(torch.einsum("bkd,bd->bk", negatives, h))
        dh = (-(1 - pos)[:, None] * center + (neg[:, :, None] * negatives).sum(1)) / context.shape[0]
        torch.testing.assert_close(context.grad, (dh / context.shape[1])[:, None, :].expand_as(context))
        torch.testing.assert_close(center.grad, -(1 - pos)[:, None] * h / context.shape[0])
    assert torch.autograd.gradcheck(E.cbow_loss, (context, center, negatives))


def test_cbow_with_one_context_word_is_sgns():
    g = torch.Generator().manual_seed(1)
    v, u, negs = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g), torch.randn(4, 2, 3, generator=g)
    torch.testing.assert_close(E.cbow_loss(v[:, None, :], u, negs), E.sgns_loss(v, u, negs))


def test_cbow_model_and_bad_input():
    model = E.CBOW(10, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.output.weight, torch.zeros(10, 4)) and model.input.weight.abs().max() <= 0.5 / 4
    with pytest.raises(ValueError, match="contexts should be"):
        model(torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([[4]]))
    with pytest.raises(IndexError, match="contexts"):
        model(torch.tensor([[1, 12]]), torch.tensor([3]), torch.tensor([[4]]))
    with pytest.raises(ValueError, match="context should have shape"):
        E.cbow_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 1, 3))
    with pytest.raises(TypeError, match="tokenize_words"):
        E.train_cbow("a b c")


def test_cbow_shapes_are_annotated_correctly(typechecked):
    assert typechecked(E.cbow_loss)(torch.randn(2, 4, 3), torch.randn(2, 3), torch.randn(2, 5, 3)).shape == ()
    contexts, centers = typechecked(E.cbow_windows)(torch.arange(9), 2)
    assert contexts.shape == (5, 4)


def test_train_cbow_puts_words_that_share_contexts_nearest_each_other():
    tokens, groups = shared_context_corpus()
    result = E.train_cbow(tokens, d_model=16, window=2, epochs=6, batch_size=128, lr=0.02, min_count=1, threshold=1e-2, seed=0)
    group_of = {w: name for name, group in groups.items() for w in group}
    for word in group_of:
        top3 = [w for w, _ in E.nearest_neighbours(word, result.vectors, result.vocab, n=3)]
        assert all(group_of.get(w) == group_of[word] for w in top3), (word, top3)
    assert sum(result.losses[-10:]) < 0.7 * sum(result.losses[:10])
    again = E.train_cbow(tokens, d_model=16, window=2, epochs=1, batch_size=128, min_count=1, seed=0)
    assert again.losses == E.train_cbow(tokens, d_model=16, window=2, epochs=1, batch_size=128, min_count=1, seed=0).losses


# --------------------------------------------------------------------------- hierarchical softmax


def code_lengths_by_merging(counts):
    """An independent Huffman: keep a list of (weight, leaves), merge the two lightest, deepen their leaves."""
    groups = [(c, [i]) for i, c in enumerate(counts)]
    depth = [0] * len(counts)
    while len(groups) > 1:
        groups.sort(key=lambda g: g[0])
        (a, la), (b, lb) = groups[0], groups[1]
        for leaf in la + lb:
            depth[leaf] += 1
        groups = groups[2:] + [(a + b, la + lb)]
    return depth


@pytest.mark.parametrize("seed", range(5))
def test_huffman_tree_is_an_optimal_prefix_code(seed):
    rng = random.Random(seed)
    counts = [rng.randint(1, 500) for _ in range(rng.randint(2, 40))]
    tree = E.huffman_tree(torch.tensor(counts, dtype=torch.float64))
    lengths = tree.lengths.tolist()
    freq = torch.tensor(counts, dtype=torch.float64) / sum(counts)
    # A full binary tree: Kraft's sum is exactly 1; and no word's path is a prefix of another's.
    assert sum(2.0 ** -l for l in lengths) == pytest.approx(1.0)
    codes = {tuple(tree.signs[w, :l].tolist()) for w, l in enumerate(lengths)}
    assert len(codes) == len(counts)
    assert not any(a != b and b[: len(a)] == a for a in codes for b in codes)
    # Optimal: the same expected length as an independent Huffman; within [H, H + 1) bits.
    expected = float((freq * tree.lengths).sum())
    assert expected == pytest.approx(float((freq * torch.tensor(code_lengths_by_merging(counts), dtype=torch.float64)).sum()))
    entropy = float(-(freq * freq.log2()).sum())
    assert entropy - 1e-9 <= expected < entropy + 1
    # Inner nodes: d_vocab - 1 of them, ids 0..d_vocab-2, the root (0) first on every path.
    used = set(tree.paths[tree.signs != 0].tolist())
    assert used == set(range(len(counts) - 1)) and (tree.paths[:, 0] == 0).all()


def brute_force_probability(h, node_vectors, tree, word):
    p = 1.0
    for j in range(int(tree.lengths[word])):
        score = float(node_vectors[int(tree.paths[word, j])] @ h)
        p *= 1 / (1 + math.exp(-float(tree.signs[word, j]) * score))
    return p


def test_hierarchical_softmax_sums_to_one_and_matches_a_brute_force_product():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 100, (23,), generator=g).double()
    tree = E.huffman_tree(counts)
    node_vectors = torch.randn(22, 6, generator=g, dtype=torch.float64)
    for h in torch.randn(4, 6, generator=g, dtype=torch.float64):
        logp = E.hierarchical_softmax_log_prob(h.expand(23, 6), node_vectors, tree, torch.arange(23))
        assert logp.exp().sum().item() == pytest.approx(1.0, abs=1e-12)
        for w in range(23):
            assert logp[w].exp().item() == pytest.approx(brute_force_probability(h, node_vectors, tree, w), rel=1e-12)
    # With every node vector zero, each step is a coin flip: p(w) = 2^-length(w).
    flat = E.hierarchical_softmax_log_prob(torch.randn(23, 6, dtype=torch.float64), torch.zeros(22, 6, dtype=torch.float64), tree, torch.arange(23))
    torch.testing.assert_close(flat.exp(), 2.0 ** -tree.lengths.double())


def test_hierarchical_softmax_gradients_and_bad_input():
    tree = E.huffman_tree(torch.tensor([9.0, 5.0, 3.0, 2.0, 1.0]))
    h = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    nodes = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    words = torch.tensor([0, 4, 2])
    assert torch.autograd.gradcheck(lambda a, b: E.hierarchical_softmax_log_prob(a, b, tree, words), (h, nodes))
    with pytest.raises(ValueError, match="node_vectors"):
        E.hierarchical_softmax_log_prob(torch.randn(3, 4), torch.randn(5, 4), tree, words)
    with pytest.raises(IndexError, match="words"):
        E.hierarchical_softmax_log_prob(torch.randn(3, 4), torch.randn(4, 4), tree, torch.tensor([0, 1, 5]))
    with pytest.raises(ValueError, match="at least 2"):
        E.huffman_tree(torch.tensor([3.0]))


def test_hierarchical_softmax_shapes_are_annotated_correctly(typechecked):
    tree = E.huffman_tree(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    got = typechecked(E.hierarchical_softmax_log_prob)(torch.randn(2, 5), torch.randn(3, 5), tree, torch.tensor([1, 3]))
    assert got.shape == (2,)


# --------------------------------------------------------------------------- tied embeddings


def test_tied_embedding_is_one_matrix_and_its_gradient_adds_both_uses():
    tied = E.TiedEmbedding(11, 6, generator=torch.Generator().manual_seed(0))
    assert [name for name, _ in tied.named_parameters()] == ["W_E"]
    assert sum(p.numel() for p in tied.parameters()) == 11 * 6
    assert tied.W_U.data_ptr() == tied.W_E.data_ptr()
    ids = torch.tensor([[3, 1, 3], [0, 10, 2]])
    x = torch.randn(2, 3, 6)
    # Oracle: two untied copies, nn.Embedding and nn.Linear, holding the same numbers.
    embedding, linear = nn.Embedding(11, 6), nn.Linear(6, 11, bias=False)
    with torch.no_grad():
        embedding.weight.copy_(tied.W_E)
        linear.weight.copy_(tied.W_E)
    torch.testing.assert_close(tied.embed(ids), embedding(ids) * math.sqrt(6))
    torch.testing.assert_close(tied.unembed(x), linear(x))
    upstream = torch.randn(2, 3, 11)
    ((tied.unembed(tied.embed(ids)) * upstream).sum()).backward()
    ((linear(embedding(ids) * math.sqrt(6)) * upstream).sum()).backward()
    torch.testing.assert_close(tied.W_E.grad, embedding.weight.grad + linear.weight.grad)


def test_tied_embedding_scale_puts_entries_at_unit_size():
    tied = E.TiedEmbedding(5000, 256, generator=torch.Generator().manual_seed(0))
    assert tied.W_E.std().item() == pytest.approx(256**-0.5, rel=0.02)
    assert tied.embed(torch.arange(5000)[None]).std().item() == pytest.approx(1.0, rel=0.02)
    assert E.TiedEmbedding(5, 4, scale=False).scale == 1.0
    with pytest.raises(ValueError, match="d_model"):
        E.TiedEmbedding(5, 4).unembed(torch.randn(2, 3))

"""tfedu.speculative: greedy tokens identical to the target alone; sampling keeps the target's distribution exactly.

Oracles: ``tfedu.generate.generate`` on the target alone (greedy, every drafter and k); exact
enumeration of the acceptance rule on a 5-token vocabulary (the first emitted token, and the first
three over k = 2 rounds, equal the target's distribution to 1e-12); seeded draws of ``accept_reject``
and of the whole sampler against the target's own next-token distribution, with tolerances derived
below. Plus ``KVCache.crop`` against the uncached model, the stats' bookkeeping, and the errors.
"""

import copy
import itertools
import math

import pytest
import torch

from tfedu.config import preset
from tfedu.generate import generate
from tfedu.kv_cache import KVCache, RingKVCache
from tfedu.model import GPT
from tfedu.speculative import (
    SpeculativeStats, accept_reject, prompt_lookup_draft, residual_distribution, speculative_generate,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

D_VOCAB, N_CTX = 50, 40


def tiny(seed: int, **changes) -> GPT:
    torch.manual_seed(seed)
    # init_std=0.2: peaked next-token distributions, far from argmax ties that float rounding could flip.
    cfg = preset("tiny").replace(d_vocab=D_VOCAB, n_ctx=N_CTX, d_model=32, init_std=0.2, **changes)
    return GPT(cfg).eval()


def noisy_copy(model: GPT, scale: float, seed: int) -> GPT:
    """The model with noise on every weight: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(scale * torch.randn(param.shape, generator=g))
    return draft


# ----------------------------------------------------------------------------- greedy: the target's own tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_tokens_equal_the_target_alone(seed):
    target = tiny(seed)
    drafts = {"noisy": noisy_copy(target, 0.05, seed), "small": tiny(seed + 10, n_layers=1), "itself": target}
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, D_VOCAB, (4,), generator=g)
    ids = torch.cat([pattern, pattern, pattern[:2]])[None]  # repeats: prompt lookup finds something to propose
    n_new = N_CTX - ids.shape[1] + 1  # the whole context
    expected = generate(target, ids, n_new)
    partial = 0
    for k in (1, 2, 4, 7):
        for name, draft in drafts.items():
            tokens, stats = speculative_generate(target, draft, ids, n_new, k=k)
            assert torch.equal(tokens, expected), f"draft {name}, k={k}"
            if name == "itself":  # every draft token accepted, k + 1 tokens per target pass
                assert stats.accepted == stats.drafted and stats.acceptance_rate == 1.0
                assert stats.target_passes == math.ceil(n_new / (k + 1))
            partial += 0 < stats.accepted < stats.drafted
        tokens, stats = speculative_generate(target, None, ids, n_new, k=k, drafter=prompt_lookup_draft)
        assert torch.equal(tokens, expected), f"prompt lookup, k={k}"
        assert stats.drafted > 0 and stats.draft_passes == 0
        partial += 0 < stats.accepted < stats.drafted
    assert partial >= 4, "the test drafts should be partly rejected, so that the roll-back is exercised"


def test_greedy_stops_at_eos_like_generate():
    target = tiny(3)
    ids = torch.tensor([[1, 2, 3]])
    eos = int(generate(target, ids, 8)[0, 7])  # the fifth new token
    expected = generate(target, ids, 20, eos_token_id=eos)
    for k in (1, 3, 6):
        tokens, stats = speculative_generate(target, target, ids, 20, k=k, eos_token_id=eos)
        assert torch.equal(tokens, expected) and int(tokens[0, -1]) == eos
        assert stats.emitted == tokens.shape[1] - ids.shape[1]


def test_stats_add_up():
    target = tiny(4)
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    for draft, drafter in ((noisy_copy(target, 0.1, 4), None), (None, prompt_lookup_draft)):
        for do_sample in (False, True):
            tokens, stats = speculative_generate(target, draft, ids, 25, k=3, do_sample=do_sample, drafter=drafter,
                                                 generator=torch.Generator().manual_seed(0))
            assert isinstance(stats, SpeculativeStats)
            assert stats.emitted == 25 == tokens.shape[1] - ids.shape[1]
            # Each target pass emits its accepted drafts and one token of its own.
            assert stats.emitted == stats.accepted + stats.target_passes
            assert 0 <= stats.accepted <= stats.drafted <= 3 * stats.target_passes
            assert stats.acceptance_rate == (stats.accepted / stats.drafted if stats.drafted else 0.0)
            assert stats.tokens_per_pass == stats.emitted / stats.target_passes
            assert stats.draft_passes == (stats.drafted if draft is not None else 0)


# ----------------------------------------------------------------------------- the acceptance rule, exactly


def first_token_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The law of the first emitted token: a drafted x ~ q accepted w.p. min(1, p(x)/q(x)), else the residual."""
    accept = torch.where(q > 0, torch.minimum(torch.ones_like(p), p / q), torch.zeros_like(p))  # d_vocab
    rejected = (q * (1 - accept)).sum()
    return q * accept + rejected * residual_distribution(p, q)


def random_distributions(n: int, d_vocab: int, g: torch.Generator, *, sparse: bool = False) -> torch.Tensor:
    logits = 2 * torch.randn(n, d_vocab, generator=g, dtype=torch.float64)
    if sparse:  # some tokens impossible: p(x) = 0 or q(x) = 0 must work too
        logits[torch.rand(n, d_vocab, generator=g) < 0.3] = float("-inf")
        logits[:, 0] = 0.0
    return logits.softmax(dim=-1)


def test_first_token_follows_p_by_enumeration():
    g = torch.Generator().manual_seed(0)
    cases = [(random_distributions(1, 5, g, sparse=s)[0], random_distributions(1, 5, g, sparse=t)[0])
             for s, t in itertools.product((False, True), repeat=2) for _ in range(25)]
    p = random_distributions(1, 5, g)[0]
    cases += [(p, p.clone()), (p, torch.eye(5, dtype=torch.float64)[2])]  # p == q; a one-hot q (prompt lookup)
    for p, q in cases:
        torch.testing.assert_close(first_token_distribution(p, q), p, rtol=0, atol=1e-12)
    # p == q: the residual is empty, and rejection never happens (every ratio is exactly 1).
    assert torch.equal(first_token_distribution(p, p.clone()), p * 1.0)


def test_first_three_tokens_follow_p_over_rounds_by_enumeration():
    """k = 2: every draft path, acceptance and residual draw, across rounds, enumerated; P(t1 t2 t3) = p(t1 t2 t3)."""
    d_vocab, k, n = 5, 2, 3
    g = torch.Generator().manual_seed(1)
    tables: dict = {}

    def dist(model: str, context: tuple) -> torch.Tensor:  # a different random distribution per context
        if (model, context) not in tables:
            tables[model, context] = random_distributions(1, d_vocab, g, sparse=len(context) % 2 == 1)[0]
        return tables[model, context]

    def one_round(context: tuple):
        """(tokens emitted, probability) for every outcome of one round of accept_reject's rule."""
        def step(drafted: tuple, prob: float):
            p, here = dist("p", context + drafted), context + drafted
            if len(drafted) == k:  # all accepted: one more from p
                for t in range(d_vocab):
                    yield drafted + (t,), prob * float(p[t])
                return
            q = dist("q", here)
            residual = residual_distribution(p, q)
            for x in range(d_vocab):
                if q[x] == 0:
                    continue
                accept = min(1.0, float(p[x] / q[x]))
                yield from step(drafted + (x,), prob * float(q[x]) * accept)
                for t in range(d_vocab):
                    yield drafted + (t,), prob * float(q[x]) * (1 - accept) * float(residual[t])
        yield from step((), 1.0)

    def emitted(context: tuple, prob: float):
        if len(context) >= n:
            yield context[:n], prob
            return
        for tokens, p_round in one_round(context):
            if p_round:
                yield from emitted(context + tokens, prob * p_round)

    law: dict = {}
    for tokens, prob in emitted((), 1.0):
        law[tokens] = law.get(tokens, 0.0) + prob
    for t in itertools.product(range(d_vocab), repeat=n):
        expected = float(dist("p", ())[t[0]] * dist("p", t[:1])[t[1]] * dist("p", t[:2])[t[2]])
        assert abs(law.get(t, 0.0) - expected) < 1e-12, t
    assert abs(sum(law.values()) - 1) < 1e-12


def test_accept_reject_samples_follow_p():
    """20,000 seeded draws of the first emitted token: total variation from p below 0.02.

    Why 0.02: each frequency f has E|f - p| <= sqrt(p(1-p)/N), so E[TV] <= 0.5 sqrt((d_vocab - 1)/N) = 0.0071
    for N = 20,000 and d_vocab = 5; TV moves by at most 1/N per draw, so (McDiarmid)
    P(TV > E[TV] + 0.013) <= exp(-2 N 0.013^2) = 0.001. The draft's own q is 0.3 from p: sampling
    from q instead would fail by far.
    """
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.35, 0.1, 0.3, 0.1, 0.15]], dtype=torch.float64)
    n = 20_000
    counts = torch.zeros(5, dtype=torch.float64)
    n_accepted = 0
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=g)
        accepted, next_token = accept_reject(p, q, x, g)
        counts[int(x) if accepted else next_token] += 1
        n_accepted += accepted
    tv = 0.5 * (counts / n - p[0]).abs().sum()
    assert tv < 0.02, f"total variation {tv:.4f} from p"
    assert 0.5 * (q[0] - p[0]).abs().sum() > 0.29
    # P(accept) = sum_x min(p(x), q(x)) = 0.5; its standard error at N = 20,000 is 0.0035.
    assert abs(n_accepted / n - 0.5) < 0.02


def test_sampler_first_token_follows_the_target():
    """The whole sampler, 1,500 seeded runs of one round (k = 1), on a 4-token vocabulary: TV below 0.07.

    E[TV] <= 0.5 sqrt(3 / 1500) = 0.022 and P(TV > E[TV] + 0.048) <= exp(-2 * 1500 * 0.048^2) = 0.001
    (as above); the draft's first distribution is more than 0.2 from the target's.
    """
    cfg = preset("tiny").replace(d_vocab=4, n_ctx=8, d_model=16, n_heads=2, n_layers=1, d_mlp=32, init_std=0.5)
    torch.manual_seed(5)
    target, draft = GPT(cfg).eval(), GPT(cfg).eval()
    ids = torch.tensor([[1, 3, 0]])
    with torch.no_grad():
        p = target(ids)[0, -1].double().softmax(dim=-1)
        q = draft(ids)[0, -1].double().softmax(dim=-1)
    assert 0.5 * (p - q).abs().sum() > 0.2
    g = torch.Generator().manual_seed(0)
    n = 1500
    counts = torch.zeros(4, dtype=torch.float64)
    drafted = accepted = 0
    for _ in range(n):
        tokens, stats = speculative_generate(target, draft, ids, 2, k=1, do_sample=True, generator=g)
        counts[int(tokens[0, 3])] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    tv = 0.5 * (counts / n - p).abs().sum()
    assert tv < 0.07, f"total variation {tv:.4f} from the target's next-token distribution"
    assert 0 < accepted < drafted  # both branches of the rule ran


def test_sampling_is_reproducible_and_temperature_reaches_both_models():
    target = tiny(6)
    draft = noisy_copy(target, 0.1, 6)
    ids = torch.tensor([[1, 2, 3]])
    runs = [speculative_generate(target, draft, ids, 12, k=3, do_sample=True, temperature=0.7,
                                 generator=torch.Generator().manual_seed(9))[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    # A very low temperature is nearly greedy: the same tokens as greedy decoding here.
    cold, _ = speculative_generate(target, draft, ids, 12, k=3, do_sample=True, temperature=1e-4,
                                   generator=torch.Generator().manual_seed(9))
    assert torch.equal(cold, generate(target, ids, 12))


def test_a_given_rule_replaces_accept_reject():
    """``rule=``: notebook 18 runs the learner's acceptance step inside the decoder."""
    target = tiny(6)
    draft = noisy_copy(target, 0.1, 6)
    ids = torch.tensor([[1, 2, 3]])
    calls = []

    def rule(p, q, draft_tokens, generator):
        calls.append(len(draft_tokens))
        n, token = accept_reject(p, q, draft_tokens, generator)
        return torch.tensor(n), torch.tensor(token)  # 0-d tensors are ints too

    mine, _ = speculative_generate(target, draft, ids, 12, k=3, do_sample=True, rule=rule,
                                   generator=torch.Generator().manual_seed(9))
    theirs, _ = speculative_generate(target, draft, ids, 12, k=3, do_sample=True,
                                     generator=torch.Generator().manual_seed(9))
    assert calls and torch.equal(mine, theirs)
    for bad in (lambda *a: (4, 0), lambda *a: (0, D_VOCAB), lambda *a: 3, lambda *a: (0.5, 1), lambda *a: (True, 1)):
        with pytest.raises(ValueError, match="must return \\(n_accepted, next_token\\)"):
            speculative_generate(target, draft, ids, 4, k=3, do_sample=True, rule=bad,
                                 generator=torch.Generator().manual_seed(9))
    with pytest.raises(TypeError, match="rule must be a function"):
        speculative_generate(target, draft, ids, 4, rule="accept")


def test_accept_reject_extremes():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    # p(x) = 0: always rejected, and the residual never gives x back.
    assert accept_reject(p, torch.full((2, 3), 1 / 3), torch.tensor([0, 0]), g) == (0, 1)
    # p == q: always accepted, then the bonus token from the last row.
    assert accept_reject(p, p[:2].clone(), torch.tensor([1, 0]), g) == (2, 2)
    # k = 0: a plain draw from p[0].
    assert accept_reject(p[:1], torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), g) == (0, 1)


# ----------------------------------------------------------------------------- prompt lookup


def test_prompt_lookup_draft():
    ids = torch.tensor([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3])
    assert prompt_lookup_draft(ids, 2).tolist() == [9, 1]  # the latest earlier "1 2 3"
    assert prompt_lookup_draft(ids, 10).tolist() == [9, 1, 2, 3]  # stops at the end of the context
    assert prompt_lookup_draft(torch.tensor([7, 8, 5, 6, 8]), 3).tolist() == [5, 6, 8]  # falls back to 1-grams
    assert prompt_lookup_draft(torch.tensor([1, 2, 3]), 3).tolist() == []  # nothing repeats
    assert prompt_lookup_draft(torch.tensor([4]), 3).tolist() == []
    assert prompt_lookup_draft(ids, 0).tolist() == []
    with pytest.raises(ValueError, match="1-D integer tensor"):
        prompt_lookup_draft(ids[None], 2)
    with pytest.raises(ValueError, match="ngram must be an int >= 1"):
        prompt_lookup_draft(ids, 2, ngram=0)


# ----------------------------------------------------------------------------- the cache roll-back


def test_crop_gives_the_uncached_logits():
    for changes in ({}, {"positional": "rope", "n_kv_heads": 2}):
        model = tiny(7, **changes)
        ids = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
        cache = KVCache.for_model(model, batch=2)
        with torch.no_grad():
            model(ids[:, :10], kv_cache=cache)
            cache.crop(6)  # forget 6..9, then go another way
            other = torch.tensor([[3, 4, 5], [6, 7, 8]])
            cached = model(other, kv_cache=cache)
            uncached = model(torch.cat([ids[:, :6], other], dim=1))[:, 6:]
        assert cache.length == 9
        torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"length must be an int in 0\.\.9"):
        cache.crop(10)


def test_ring_cache_crops_only_what_it_still_holds():
    ring = RingKVCache(batch=1, n_kv_heads=1, window=4, d_head=1, capacity=16)
    ring.append(torch.ones(1, 1, 3, 1), torch.ones(1, 1, 3, 1))  # 3 slots, nothing overwritten yet
    ring.crop(1)
    assert ring.length == 1
    ring.append(torch.ones(1, 1, 5, 1), torch.ones(1, 1, 5, 1))
    ring.crop(6)  # no roll-back: fine
    with pytest.raises(ValueError, match="cannot roll back"):
        ring.crop(4)


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_are_refused_clearly():
    target = tiny(8)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="share a vocabulary"):
        speculative_generate(target, GPT(preset("tiny").replace(n_ctx=N_CTX)), ids, 4)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        speculative_generate(target, target, ids, 4, k=0)
    with pytest.raises(ValueError, match="batch 1"):
        speculative_generate(target, target, ids.repeat(2, 1), 4)
    with pytest.raises(ValueError, match="n_ctx=40"):
        speculative_generate(target, target, ids, N_CTX - 1)
    with pytest.raises(ValueError, match="draft model .* or a drafter function"):
        speculative_generate(target, None, ids, 4)
    with pytest.raises(ValueError, match="not both"):
        speculative_generate(target, target, ids, 4, drafter=prompt_lookup_draft)
    with pytest.raises(ValueError, match="at most k="):
        speculative_generate(target, None, ids, 4, k=2, drafter=lambda ids, k: ids[:k + 1])
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, target, ids, 4, do_sample=True, temperature=0)
    with pytest.raises(TypeError, match="KV cache"):
        speculative_generate(target, torch.nn.Linear(2, 2), ids, 4)
    assert torch.equal(speculative_generate(target, target, ids, N_CTX - 2)[0][:, :3], ids)  # just fits
    assert torch.equal(speculative_generate(target, target, ids, 0)[0], ids)
    with pytest.raises(ValueError, match="ring cache cannot roll back"):  # sliding-window layers keep no history
        speculative_generate(tiny(0, sliding_window=4, positional="rope"), tiny(1, n_layers=1), ids, 20, k=3)

    p, q = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match=r"p must be \(k\+1, d_vocab\)"):
        accept_reject(p[:2], q, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="probability distribution"):
        accept_reject(torch.randn(3, 4), q, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="cannot have been drawn from q"):
        accept_reject(p, torch.tensor([[1.0, 0, 0, 0], [0.25] * 4]), torch.tensor([2, 1]))
    with pytest.raises(IndexError, match="0..3"):
        accept_reject(p, q, torch.tensor([0, 4]))


def test_shapes_match_the_annotations(typechecked):
    target = tiny(9)
    tokens, _ = typechecked(speculative_generate)(target, target, torch.tensor([[1, 2]]), 5, k=2)
    assert tokens.shape == (1, 7)
    p, q = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25)
    assert typechecked(accept_reject)(p, q, torch.tensor([0, 1]), torch.Generator().manual_seed(0))[0] == 2
    assert typechecked(residual_distribution)(p[0], q[0]).shape == (4,)
    assert typechecked(prompt_lookup_draft)(torch.tensor([1, 2, 1]), 2).tolist() == [2, 1]

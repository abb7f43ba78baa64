"""tfedu.tuning (issue 44): SFT, DPO and GRPO objectives, pass@k, and the loops, on tiny models.

Each objective is checked against a formula computed here independently (``F.cross_entropy`` with Hugging
Face's ``-100`` labels, float64 closed forms, ``math.comb`` and enumeration of subsets); trl's own losses are
the oracle in tests/test_tuning_oracles.py. The loops get smoke and determinism tests on a 2-layer GPT.
"""

import copy
import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from tfedu.config import preset
from tfedu.model import GPT
from tfedu.post_training import END_OF_TURN, Example, add_chat_tokens, make_tasks, render_ids, verify
from tfedu.tokenizer import Tokenizer
from tfedu.tuning import (
    GROUP_STD_EPS, Pair, answer_logprobs, answer_text, chat_batch, choice_accuracy, choice_logprobs, dpo_loss,
    dpo_train, grow_vocab, grpo_loss, grpo_train, group_advantages, kl_to_reference, multiple_choice, pack,
    pass_at_k, pass_rates, preference_pairs, prompt_ids, rewards_for, sample_answers, sft_loss, sft_train,
    task_accuracy, token_logprobs,
)  # fmt: skip

FAMILIES = ["add", "subtract", "reverse"]  # short prompts: a tiny model's n_ctx holds prompt and answer


@pytest.fixture(scope="module")
def tok():
    return add_chat_tokens(Tokenizer([]))  # bytes only: one token per character, chat specials 256..259


def tiny_chat_gpt(tok, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(preset("tiny"), d_vocab=tok.vocab_size, n_ctx=96, **overrides)
    return GPT(cfg).eval()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_chat_gpt(tok)


@pytest.fixture(scope="module")
def tasks():
    return make_tasks(12, seed=0, families=FAMILIES)


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


# -- token log-probs and the SFT loss ----------------------------------------------------------------------


def test_token_logprobs_is_log_softmax_gather_even_at_huge_logits(typechecked):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (3, 5), generator=g)
    for scale in (1.0, 1e4):
        logits = torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * scale
        got = typechecked(token_logprobs)(logits.float(), ids)
        # independent: log p = z_target - logsumexp(z), in float64, position t scoring token t+1
        want = torch.stack([torch.stack([logits[b, t, ids[b, t + 1]] - torch.logsumexp(logits[b, t], 0)
                                         for t in range(4)]) for b in range(3)])  # fmt: skip
        assert got.shape == (3, 4) and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * scale)


def test_sft_loss_equals_cross_entropy_with_minus_100_labels(typechecked):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, 11, generator=g)
    ids = torch.randint(0, 11, (4, 9), generator=g)
    mask = torch.rand(4, 9, generator=g) > 0.5
    mask[0, 1:] = True
    # Hugging Face's convention: labels are the inputs, -100 where no loss; the model shifts them by one
    labels = ids.masked_fill(~mask, -100)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    got = typechecked(sft_loss)(logits, ids, mask)
    torch.testing.assert_close(got, want)
    # the first position has nothing predicting it: its mask entry never counts
    mask2 = mask.clone()
    mask2[:, 0] = ~mask2[:, 0]
    torch.testing.assert_close(sft_loss(logits, ids, mask2), want)


def test_sft_loss_errors():
    logits, ids, mask = torch.zeros(2, 4, 5), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"sft_loss expects logits \(batch, pos, d_vocab\)"):
        sft_loss(logits[:, :3], ids, mask)
    with pytest.raises(ValueError, match="same batch and pos"):
        sft_loss(logits, ids, mask[:, :3])
    with pytest.raises(ValueError, match="marks no answer token"):
        sft_loss(logits, ids, torch.zeros(2, 4, dtype=torch.bool))
    only_first = torch.zeros(2, 4, dtype=torch.bool)
    only_first[:, 0] = True
    with pytest.raises(ValueError, match="marks no answer token"):
        sft_loss(logits, ids, only_first)
    with pytest.raises(ValueError, match="bool"):
        sft_loss(logits, ids, mask.long())  # an int mask would index the tokens, not select them


# -- the model and its batches -----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_grow_vocab_keeps_old_logits_and_starts_new_rows_at_the_mean(tied):
    torch.manual_seed(0)
    old = GPT(dataclasses.replace(preset("tiny"), tied_embeddings=tied, dropout=0.1)).eval()
    old_W_E, old_W_U = old.embed.weight.detach().clone(), old.unembed.weight.detach().clone()
    grown = grow_vocab(old, 3)
    assert grown.cfg.d_vocab == 259 and grown.cfg.dropout == 0.0 and grown.cfg.tied_embeddings == tied
    assert not grown.training
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        new_logits, old_logits = grown(ids), old(ids)
    assert new_logits.shape == (2, 10, 259)
    torch.testing.assert_close(new_logits[..., :256], old_logits, rtol=0, atol=1e-6)  # every old token's logit
    torch.testing.assert_close(grown.embed.weight[:256], old_W_E, rtol=0, atol=0)
    for new in grown.embed.weight[256:]:
        torch.testing.assert_close(new, old_W_E.mean(0))
    for new in grown.unembed.weight[256:]:
        torch.testing.assert_close(new, old_W_U.mean(0))
    if tied:
        assert grown.unembed.weight is grown.embed.weight  # still tied: one matrix, trained once
    else:
        assert not torch.equal(grown.unembed.weight[:256], grown.embed.weight[:256])
        torch.testing.assert_close(grown.unembed.weight[:256], old_W_U, rtol=0, atol=0)
    torch.testing.assert_close(old.embed.weight, old_W_E, rtol=0, atol=0)  # the original is not touched


def test_grow_vocab_errors():
    with pytest.raises(TypeError, match="tfedu GPT"):
        grow_vocab(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="non-negative int"):
        grow_vocab(GPT(preset("tiny")), -1)


def test_pack_pads_right_and_masks_padding(typechecked):
    masks = [[True, True], [False, True, True, False], [True]]
    ids, mask = typechecked(pack)([[1, 2], [3, 4, 5, 6], [7]], masks, pad_id=9)
    assert ids.tolist() == [[1, 2, 9, 9], [3, 4, 5, 6], [7, 9, 9, 9]]
    assert mask.tolist() == [[True, True, False, False], [False, True, True, False], [True, False, False, False]]
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    with pytest.raises(ValueError, match="one mask per row"):
        pack([[1]], [])
    with pytest.raises(ValueError, match="at least one row"):
        pack([], [])
    with pytest.raises(ValueError, match="row 1 has 2 tokens but its mask has 1"):
        pack([[1], [2, 3]], [[True], [True]])


def test_chat_batch_is_the_template_right_padded(tok, typechecked):
    examples = [Example("add", "What is 1 + 2?", "3"), Example("reverse", "Reverse the word: cat", "tac")]
    ids, mask = typechecked(chat_batch)(examples, tok)
    rows = [render_ids(ex.messages(), tok) for ex in examples]
    assert ids.shape == (2, max(map(len, rows)))
    for row, ex, r, m in zip(rows, examples, ids.tolist(), mask.tolist()):
        assert r[:len(row)] == row and not any(m[len(row):])
        assert tok.decode([i for i, keep in zip(r, m) if keep]) == ex.answer + END_OF_TURN


# -- DPO --------------------------------------------------------------------------------------------------


def test_dpo_loss_equals_the_closed_form_in_float64():
    g = torch.Generator().manual_seed(2)
    pc, pr, rc, rr = (torch.randn(16, generator=g, dtype=torch.float64) * 5 for _ in range(4))
    for beta in (0.01, 0.1, 0.5, 2.0):
        margin = (pc - rc) - (pr - rr)
        want = torch.tensor([-math.log(1 / (1 + math.exp(-beta * m))) for m in margin.tolist()], dtype=torch.float64)
        want = want.mean()
        torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, beta), want, rtol=1e-12, atol=1e-12)


def test_dpo_loss_is_finite_at_huge_margins_and_raises_chosen_lowers_rejected():
    z = torch.zeros(2)
    big = torch.tensor([1e4, -1e4])
    loss = dpo_loss(big, z, z, z, beta=1.0)  # margins +1e4 (loss 0) and -1e4 (loss 1e4)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, torch.tensor(5e3))
    chosen, rejected = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    dpo_loss(chosen, rejected, torch.zeros(3), torch.zeros(3), beta=0.1).backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descent raises chosen, lowers rejected
    torch.testing.assert_close(chosen.grad, torch.full((3,), -0.1 * 0.5 / 3))  # beta * sigmoid(0) / batch


# -- GRPO -------------------------------------------------------------------------------------------------


def test_group_advantages_standardise_each_group(typechecked):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(5, 6, generator=g) * 3 + 2
    adv = typechecked(group_advantages)(rewards)
    torch.testing.assert_close(adv.mean(1), torch.zeros(5), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv.std(1), torch.ones(5), atol=1e-3, rtol=0)  # unbiased std, eps 1e-4
    binary = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(binary)
    assert adv[1:].eq(0).all()  # all right or all wrong: nothing to learn
    std = math.sqrt(((0.75**2) + 3 * 0.25**2) / 3)
    torch.testing.assert_close(adv[0], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + GROUP_STD_EPS))


@pytest.mark.parametrize("shape", [(4,), (3, 1), (2, 2, 2)])
def test_group_advantages_errors(shape):
    with pytest.raises(ValueError, match=r"\(n_prompts, group\) with a group of at least 2"):
        group_advantages(torch.zeros(shape))


def grpo_reference(logp, logp_old, logp_ref, adv, mask, eps, beta):
    """Shao et al. (2024) eq. 3, token by token in float64 Python."""
    per_answer = []
    for b in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            lp, lo, lr, a = float(logp[b, t]), float(logp_old[b, t]), float(logp_ref[b, t]), float(adv[b])
            r = math.exp(lp - lo)
            surrogate = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            kl = math.exp(lr - lp) - (lr - lp) - 1
            terms.append(-surrogate + beta * kl)
        per_answer.append(sum(terms) / max(1, len(terms)))
    return sum(per_answer) / len(per_answer)


def test_grpo_loss_equals_the_per_token_formula(typechecked):
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    logp_old = logp + torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.4  # ratios inside and outside the clip
    logp_ref = logp + torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.4
    adv = torch.tensor([1.5, -0.7, 0.0, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0], [1] * 7]).bool()
    ratio = (logp - logp_old).exp()
    assert ((ratio > 1.2) & mask).any() and ((ratio < 0.8) & mask).any()
    for eps, beta in [(0.2, 0.04), (0.2, 0.0), (0.1, 1.0)]:
        got = typechecked(grpo_loss)(logp, logp_old, logp_ref, adv, mask, clip_eps=eps, beta=beta)
        assert got.dtype == torch.float64
        assert float(got) == pytest.approx(grpo_reference(logp, logp_old, logp_ref, adv, mask, eps, beta), abs=1e-12)
    # padding is ignored whatever it holds
    junk = logp.masked_fill(~mask, 50.0)
    torch.testing.assert_close(grpo_loss(junk, logp_old, logp_ref, adv, mask),
                               grpo_loss(logp, logp_old, logp_ref, adv, mask))


def test_grpo_gradient_on_policy_and_when_clipped():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    base = torch.full((2, 4), -1.0)
    logp = base.clone().requires_grad_(True)
    grpo_loss(logp, base, base, adv, mask, beta=0.04).backward()  # ratio 1, KL 0 and its gradient 0
    lengths = mask.sum(1, keepdim=True).float()
    want = (-adv[:, None] / lengths / 2) * mask  # -A / len per answer token, then the mean over 2 answers
    torch.testing.assert_close(logp.grad, want)
    # ratio beyond 1 + eps with A > 0 (or below 1 - eps with A < 0): the clipped term is a constant
    logp = (base + torch.tensor([[0.5], [-0.5]])).requires_grad_(True)
    grpo_loss(logp, base, base, adv, mask, clip_eps=0.2, beta=0.0).backward()
    assert logp.grad.eq(0).all()
    # ...but beyond 1 + eps with A < 0 the ratio is not clipped (pessimistic bound): gradient flows
    logp = (base + 0.5).requires_grad_(True)
    grpo_loss(logp, base, base, torch.tensor([-1.0, -1.0]), mask, beta=0.0).backward()
    assert (logp.grad[mask] > 0).all()


def test_grpo_k3_kl_is_non_negative_and_errors():
    g = torch.Generator().manual_seed(5)
    logp, logp_ref = -torch.rand(3, 8, generator=g) * 4, -torch.rand(3, 8, generator=g) * 4
    mask = torch.ones(3, 8, dtype=torch.bool)
    kl_only = grpo_loss(logp, logp, logp_ref, torch.zeros(3), mask, beta=1.0)  # A = 0 leaves the KL term alone
    assert kl_only > 0
    assert grpo_loss(logp, logp, logp, torch.zeros(3), mask, beta=1.0) == 0
    with pytest.raises(ValueError, match=r"advantages \(batch,\)"):
        grpo_loss(logp, logp, logp, torch.zeros(2), mask)
    with pytest.raises(ValueError, match="of one shape"):
        grpo_loss(logp, logp[:, :5], logp, torch.zeros(3), mask)


# -- pass@k -----------------------------------------------------------------------------------------------


def test_pass_at_k_equals_the_closed_form_and_subset_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                closed = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12), (n, c, k)
                if n <= 6:  # the definition: the chance that k of the n samples, drawn at random, include a right one
                    samples = [True] * c + [False] * (n - c)
                    subsets = list(itertools.combinations(samples, k))
                    assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)


def test_pass_at_k_large_n_and_errors():
    value = pass_at_k(200, 3, 100)  # math.comb(200, 100) ~ 9e58 would overflow a float ratio done naively
    assert math.isfinite(value)
    assert value == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-12)
    assert pass_at_k(200, 0, 50) == 0.0 and pass_at_k(200, 200, 1) == 1.0
    for bad, match in [((5, 6, 1), "0 <= c <= n"), ((5, 2, 0), "1 <= k <= n"), ((5, 2, 6), "1 <= k <= n"),
                       ((5, -1, 1), "c must be a non-negative int"), ((5.0, 2, 1), "n must be"),
                       ((5, True, 1), "c must be")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            pass_at_k(*bad)


# -- sampling and evaluation ------------------------------------------------------------------------------


def greedy_alone(model, ids, end, max_new_tokens):
    """Greedy decoding of one prompt, no cache, no padding: the reference for batched sample_answers."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(nxt)
            out.append(nxt)
            if nxt == end:
                break
    return out


def test_sample_answers_greedy_batched_equals_each_prompt_alone(model, tok):
    prompts = ["What is 3 + 4?", "Reverse the word: zebra", "What is 12 - 7?", "hi"]  # left padding in the batch
    assert len({len(prompt_ids(p, tok)) for p in prompts}) > 1
    answers = sample_answers(model, tok, prompts, max_new_tokens=10)
    end = tok.special_tokens[END_OF_TURN]
    assert [group[0] for group in answers] == [greedy_alone(model, prompt_ids(p, tok), end, 10) for p in prompts]
    assert prompt_ids("hi", tok) == [257, 104, 105, 259, 258]


def test_sample_answers_sampling_is_seeded_and_cut_at_end(model, tok, tasks):
    prompts = [ex.prompt for ex in tasks[:3]]
    draw = lambda seed: sample_answers(model, tok, prompts, n=4, do_sample=True, max_new_tokens=12,  # noqa: E731
                                       generator=torch.Generator().manual_seed(seed))
    a = draw(0)
    assert a == draw(0) and a != draw(1)
    assert [len(group) for group in a] == [4, 4, 4]
    end = tok.special_tokens[END_OF_TURN]
    for answer in itertools.chain.from_iterable(a):
        assert 1 <= len(answer) <= 12 and end not in answer[:-1]
    assert not model.training


def test_rewards_for_and_answer_text(tok, tasks):
    end = tok.special_tokens[END_OF_TURN]
    ex = tasks[0]
    right = tok.encode_ordinary(ex.answer) + [end]
    answers = [[right, right[:-1], tok.encode_ordinary(ex.answer + "0") + [end], []]]
    assert answer_text(right, tok) == ex.answer and answer_text(right[:-1], tok) == ex.answer
    assert rewards_for([ex], answers, tok).tolist() == [[1.0, 0.0, 0.0, 0.0]]  # unfinished counts as wrong


def test_task_accuracy_and_pass_rates_are_deterministic(model, tok, tasks):
    acc = task_accuracy(model, tok, tasks, batch_size=5)
    assert acc == task_accuracy(model, tok, tasks, batch_size=12)  # greedy: batching changes nothing
    assert set(acc) == {ex.family for ex in tasks} | {"all"} and all(0 <= v <= 1 for v in acc.values())
    rates = pass_rates(model, tok, tasks[:4], n=3, ks=(1, 3), seed=0)
    assert rates == pass_rates(model, tok, tasks[:4], n=3, ks=(1, 3), seed=0)
    assert set(rates) == {1, 3} and 0 <= rates[1] <= rates[3] <= 1


def test_choice_logprobs_equals_a_manual_sum(model, tok):
    prompt, choices = "What is 2 + 2?", ["4", "22", "5"]
    got = choice_logprobs(model, tok, prompt, choices)
    end = tok.special_tokens[END_OF_TURN]
    head = prompt_ids(prompt, tok)
    for score, choice in zip(got, choices):
        ids = head + tok.encode_ordinary(choice) + [end]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)
        want = sum(float(logp[t - 1, ids[t]]) for t in range(len(head), len(ids)))
        assert float(score) == pytest.approx(want, abs=1e-4)
    first = choice_logprobs(model, tok, prompt, ["22", "23"], first_token_only=True)
    assert first[0] == first[1]  # both begin with "2"


def test_multiple_choice_and_choice_accuracy(model, tok):
    examples = make_tasks(20, seed=1, families=["add"])
    items = multiple_choice(examples, n_choices=4, seed=0)
    assert items == multiple_choice(examples, n_choices=4, seed=0) and len(items) == 20
    for ex, choices, correct in items:
        assert len(set(choices)) == 4 and choices[correct] == ex.answer
        assert [verify(ex.family, ex.prompt, c) for c in choices].count(True) == 1
    acc = choice_accuracy(model, tok, items[:6])
    assert 0 <= acc <= 1 and acc == choice_accuracy(model, tok, items[:6])
    # choices that all begin with the same token cannot be told apart by their first token: a tie is a miss
    tie = [(Example("add", "What is 10 + 2?", "12"), ["12", "13", "14", "15"], 0)]
    assert choice_accuracy(model, tok, tie, first_token_only=True) == 0.0


# -- the loops --------------------------------------------------------------------------------------------


def test_sft_train_is_deterministic_and_learns_one_example(tok, tasks):
    a, b = tiny_chat_gpt(tok), tiny_chat_gpt(tok)
    losses = sft_train(a, tok, tasks, steps=2, batch_size=3, seed=0)
    assert losses == sft_train(b, tok, tasks, steps=2, batch_size=3, seed=0) and same_weights(a, b)
    one = tiny_chat_gpt(tok)
    losses = sft_train(one, tok, tasks[:1], steps=12, batch_size=2, lr=3e-3)
    assert losses[-1] < 0.5 * losses[0] and not one.training
    with pytest.raises(ValueError, match="at least one example"):
        sft_train(one, tok, [], steps=1)
    calls = []
    sft_train(tiny_chat_gpt(tok), tok, tasks, steps=1, batch_size=2,
              loss_fn=lambda *args: calls.append(args) or sft_loss(*args))  # the learner's own loss is used
    assert len(calls) == 1


def test_preference_pairs_chosen_is_right_rejected_is_wrong(model, tok, tasks):
    pairs = preference_pairs(model, tok, tasks[:4], n=3, seed=0)
    assert pairs == preference_pairs(model, tok, tasks[:4], n=3, seed=0) and pairs
    end = tok.special_tokens[END_OF_TURN]
    for pair in pairs:
        assert pair.chosen[-1] == end
        assert verify(pair.example.family, pair.example.prompt, answer_text(pair.chosen, tok))
        assert not rewards_for([pair.example], [[list(pair.rejected)]], tok).item()


def test_dpo_train_starts_at_log_2_and_is_deterministic(tok, tasks):
    end = tok.special_tokens[END_OF_TURN]
    pairs = [Pair(ex, tuple(tok.encode_ordinary(ex.answer) + [end]), tuple(tok.encode_ordinary("0") + [end]))
             for ex in tasks[:5]]
    runs = []
    for _ in range(2):
        policy, ref = tiny_chat_gpt(tok), tiny_chat_gpt(tok)
        runs.append((dpo_train(policy, ref, tok, pairs, beta=0.1, steps=3, batch_size=4, lr=1e-3), policy, ref))
    (h1, p1, r1), (h2, p2, r2) = runs
    assert h1 == h2 and same_weights(p1, p2)
    assert h1["loss"][0] == pytest.approx(math.log(2), abs=1e-6)  # policy == ref: every margin is 0
    assert h1["reward_accuracy"][0] == 0.0
    assert same_weights(r1, tiny_chat_gpt(tok)) and not any(p.requires_grad for p in r1.parameters())  # ref frozen
    assert not same_weights(p1, r1)
    with pytest.raises(ValueError, match="at least one pair"):
        dpo_train(p1, r1, tok, [], beta=0.1, steps=1)


def test_kl_to_reference(model, tok, tasks):
    prompts = [ex.prompt for ex in tasks[:3]]
    assert kl_to_reference(model, copy.deepcopy(model), tok, prompts, n=2) == 0.0
    other = tiny_chat_gpt(tok, seed=1)
    kl = kl_to_reference(model, other, tok, prompts, n=2, seed=3)
    assert kl == kl_to_reference(model, other, tok, prompts, n=2, seed=3) and kl != 0.0


def test_grpo_train_is_deterministic_and_keeps_ref_frozen(tok, tasks):
    runs = []
    for _ in range(2):
        policy, ref = tiny_chat_gpt(tok), tiny_chat_gpt(tok)
        history = grpo_train(policy, ref, tok, tasks, steps=2, prompts_per_step=2, group=3, lr=1e-3, seed=0)
        runs.append((history, policy, ref))
    (h1, p1, r1), (h2, p2, _) = runs
    assert h1 == h2 and same_weights(p1, p2)
    assert len(h1["reward"]) == len(h1["loss"]) == 2 and all(0 <= r <= 1 for r in h1["reward"])
    assert same_weights(r1, tiny_chat_gpt(tok)) and not any(p.requires_grad for p in r1.parameters())
    with pytest.raises(ValueError, match="at least one example"):
        grpo_train(p1, r1, tok, [], steps=1)


def test_answer_logprobs_sum_only_the_masked_tokens(model, tok):
    examples = [Example("add", "What is 1 + 2?", "3"), Example("reverse", "Reverse the word: ox", "xo")]
    ids, mask = chat_batch(examples, tok)
    with torch.no_grad():
        got = answer_logprobs(model, ids, mask)
        per_token = token_logprobs(model(ids), ids)
    want = torch.stack([per_token[b][mask[b, 1:]].sum() for b in range(2)])
    torch.testing.assert_close(got, want)

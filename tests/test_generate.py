"""tfedu.generate against Hugging Face transformers on a random GPT-2 built locally (no network).

Greedy and beam search give the same tokens as ``GPT2LMHeadModel.generate`` (beam search over
num_beams, length_penalty, early_stopping, with and without an eos that really ends hypotheses);
the filters equal ``TopKLogitsWarper`` and ``TopPLogitsWarper``; sampling is reproducible and draws
only from the nucleus; eos stops rows and pads them; the context is cropped past n_ctx; prompts of
different lengths, padded on the left, give each row the tokens it gets alone.
"""

import math
import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tfedu.checkpoints import gpt_from_hf
from tfedu.config import ModelConfig, preset
from tfedu.generate import (
    beam_search,
    filter_top_k,
    filter_top_p,
    generate,
    next_token_distribution,
    pad_prompts,
    sequence_logprob,
)
from tfedu.kv_cache import KVCache
from tfedu.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

D_VOCAB, N_POSITIONS, PROMPT_LEN, NEW = 100, 64, 5, 10


def randomised_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A GPT-2 of 2 blocks, width 64, 100 tokens, with weights of a trained model's size (peaked next-token
    distributions, so argmax and beam ranks are far from ties)."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=D_VOCAB, n_positions=N_POSITIONS, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(0.25 * noise if p.dim() >= 2 else (1 + 0.3 * noise if name.endswith("weight") else 0.3 * noise))
    return model.eval()


@pytest.fixture(scope="module")
def models():
    hf = randomised_gpt2()
    return hf, gpt_from_hf(hf)


def prompts(batch: int = 3, pos: int = PROMPT_LEN, seed: int = 1, d_vocab: int = D_VOCAB) -> torch.Tensor:
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


def hf_generate(hf, ids, max_new_tokens, eos=None, **kwargs):
    """transformers' generate on equal-length prompts; eos (if any) also pads, as tfedu does."""
    special = dict(eos_token_id=eos, pad_token_id=eos) if eos is not None else dict(eos_token_id=None, pad_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **special, **kwargs)


def tiny_gpt(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    return GPT(preset("tiny").replace(init_std=0.2, **changes)).eval()  # std 0.2: peaked logits, no near-ties


# ----------------------------------------------------------------------------- greedy


def test_greedy_equals_transformers(models):
    hf, ours = models
    ids = prompts()
    out = generate(ours, ids, NEW)
    assert out.shape == (3, PROMPT_LEN + NEW) and out.dtype == ids.dtype
    assert torch.equal(out, hf_generate(hf, ids, NEW, do_sample=False))


def test_greedy_with_eos_equals_transformers_and_pads_finished_rows(models):
    hf, ours = models
    ids = prompts()
    free = generate(ours, ids, NEW)
    eos = int(free[0, PROMPT_LEN + 3])  # row 0 emits it at its 4th step
    out = generate(ours, ids, NEW, eos_token_id=eos)
    assert torch.equal(out, hf_generate(hf, ids, NEW, eos=eos, do_sample=False))
    first = int((out[0, PROMPT_LEN:] == eos).nonzero()[0])
    assert first <= 3 and bool((out[0, PROMPT_LEN + first:] == eos).all())  # eos, then eos as padding
    # One prompt alone: the loop stops as soon as it is done.
    alone = generate(ours, ids[:1], NEW, eos_token_id=eos)
    assert alone.shape[1] == PROMPT_LEN + first + 1 and int(alone[0, -1]) == eos


def test_generate_runs_in_eval_mode_without_grad_and_restores_the_training_flag():
    model = tiny_gpt(dropout=0.5).train()
    ids = prompts(2, 4, d_vocab=256)
    out = generate(model, ids, 6)
    assert model.training  # put back
    assert torch.equal(out, generate(model, ids, 6))  # no dropout while generating: deterministic
    assert torch.equal(out, generate(model.eval(), ids, 6))
    assert not out.requires_grad
    # Decoding runs under inference_mode, but what it returns is an ordinary tensor: a model can train on it.
    assert not out.is_inference()
    model.train()
    _, loss = model(out[:, :-1], targets=out[:, 1:])
    loss.backward()
    assert model.embed.weight.grad is not None


def test_zero_new_tokens_returns_the_prompt(models):
    _, ours = models
    ids = prompts()
    assert torch.equal(generate(ours, ids, 0), ids)
    assert torch.equal(beam_search(ours, ids, 0, num_beams=3), ids)


# ----------------------------------------------------------------------------- context cropping


def by_hand_greedy(model, ids, max_new_tokens):
    for _ in range(max_new_tokens):
        context = ids[:, -model.cfg.n_ctx:]
        ids = torch.cat([ids, model(context)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_generation_runs_past_n_ctx_on_the_last_n_ctx_tokens():
    model = tiny_gpt(n_ctx=8)
    ids = prompts(2, 6, d_vocab=256)
    with torch.no_grad():
        expected = by_hand_greedy(model, ids, 12)
    out = generate(model, ids, 12)
    assert out.shape == (2, 18) and torch.equal(out, expected)
    long_prompt = prompts(2, 11, seed=3, d_vocab=256)  # already longer than n_ctx
    with torch.no_grad():
        assert torch.equal(generate(model, long_prompt, 3), by_hand_greedy(model, long_prompt, 3))
    assert beam_search(model, long_prompt, 4, num_beams=2).shape == (2, 15)
    sampled = generate(model, long_prompt, 5, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 16)


# ----------------------------------------------------------------------------- prompts of different lengths

LENGTHS = (7, 2, 5, 1)


def ragged_prompts(d_vocab: int = 256, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, d_vocab, (n,), generator=gen) for n in LENGTHS]


@pytest.mark.parametrize("positional", ["learned", "sinusoidal", "rope", "alibi"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_padded_prompts_give_each_row_the_tokens_it_gets_alone(positional, use_cache):
    model = tiny_gpt(n_ctx=16, positional=positional, attention="sdpa")
    rows = ragged_prompts()
    ids, padding_mask = pad_prompts(rows)
    new = 14  # the longest row passes n_ctx = 16: the window crops, and with a cache it restarts
    greedy = generate(model, ids, new, padding_mask=padding_mask, use_cache=use_cache)
    sampled = generate(model, ids, new, padding_mask=padding_mask, use_cache=use_cache, do_sample=True, top_k=20,
                       generator=[torch.Generator().manual_seed(row) for row in range(len(rows))])
    assert greedy.shape == sampled.shape == (len(rows), max(LENGTHS) + new)
    assert torch.equal(greedy[:, :max(LENGTHS)], ids)  # the padding stays in the output
    for row, prompt in enumerate(rows):
        pad = max(LENGTHS) - len(prompt)
        alone = generate(model, prompt[None], new, use_cache=use_cache)
        assert torch.equal(greedy[row, pad:], alone[0]), (row, greedy[row, pad:], alone[0])
        alone = generate(model, prompt[None], new, use_cache=use_cache, do_sample=True, top_k=20,
                         generator=torch.Generator().manual_seed(row))
        assert torch.equal(sampled[row, pad:], alone[0]), (row, sampled[row, pad:], alone[0])


def test_padded_greedy_equals_transformers_left_padded_generate(models):
    hf, ours = models
    rows = ragged_prompts(D_VOCAB, seed=5)
    ids, padding_mask = pad_prompts(rows, pad_id=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = hf.generate(ids, attention_mask=padding_mask.long(), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=1, eos_token_id=None)
    assert torch.equal(generate(ours, ids, NEW, padding_mask=padding_mask), theirs)


def test_padded_rows_stop_at_eos_as_alone(models):
    _, ours = models
    rows = ragged_prompts(D_VOCAB, seed=5)
    ids, padding_mask = pad_prompts(rows)
    free = generate(ours, ids, NEW, padding_mask=padding_mask)
    eos = int(free[1, max(LENGTHS) + 2])  # row 1 emits it at its 3rd step
    out = generate(ours, ids, NEW, padding_mask=padding_mask, eos_token_id=eos)
    for row, prompt in enumerate(rows):
        alone = generate(ours, prompt[None], NEW, eos_token_id=eos)[0]
        mine = out[row, max(LENGTHS) - len(prompt):]
        assert torch.equal(mine[:len(alone)], alone) and bool((mine[len(alone):] == eos).all())


def test_without_the_mask_the_padding_changes_the_short_rows():
    model = tiny_gpt(n_ctx=16)
    rows = ragged_prompts()
    ids, padding_mask = pad_prompts(rows)
    unmasked = generate(model, ids, 8)  # the padding read as tokens, and every row placed from column 0
    changed = [not torch.equal(unmasked[row, max(LENGTHS) - len(prompt):], generate(model, prompt[None], 8)[0])
               for row, prompt in enumerate(rows)]
    assert changed == [False, True, True, True]  # only the row with no padding is right


def test_the_model_takes_left_padding_and_positions_in_one_pass_and_over_a_cache():
    model = tiny_gpt(n_ctx=16, positional="rope")
    rows = ragged_prompts()
    ids, padding_mask = pad_prompts(rows)
    positions = (padding_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(ids, padding_mask=padding_mask, positions=positions)
        cache = KVCache.for_model(model, batch=len(rows))
        model(ids[:, :-2], padding_mask=padding_mask[:, :-2], positions=positions[:, :-2], kv_cache=cache)
        last_two = model(ids[:, -2:], padding_mask=padding_mask, positions=positions[:, -2:], kv_cache=cache)
        assert bool(torch.isfinite(logits).all())  # padded queries see padded keys: no empty softmax row
        for row, prompt in enumerate(rows):
            alone = model(prompt[None])[0]
            torch.testing.assert_close(logits[row, padding_mask[row]], alone, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(last_two[row, -1], alone[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda m, ids, mask: generate(m, ids, 2, padding_mask=mask.flip(1)), r"pad on the left.*row 1 is \[1, 1, 0"),
    (lambda m, ids, mask: generate(m, ids, 2, padding_mask=mask.long()), "padding_mask must be a bool tensor shaped"),
    (lambda m, ids, mask: generate(m, ids, 2, padding_mask=mask[:, 1:]), "padding_mask must be a bool tensor shaped"),
    (lambda m, ids, mask: generate(m, ids, 2, do_sample=True, generator=[torch.Generator()]),
     "a list of 4 torch.Generators .one per row., got a list of 1"),
    (lambda m, ids, mask: m(ids, positions=torch.full_like(ids, 16)), r"positions must lie in 0..15"),
    (lambda m, ids, mask: m(ids, positions=mask), "positions must be an integer tensor shaped like the ids"),
    (lambda m, ids, mask: pad_prompts([[1, 2], []]), "prompt 1 must be a non-empty 1-D"),
    (lambda m, ids, mask: pad_prompts([]), "prompts must be a non-empty list"),
])
def test_bad_padding_says_what_was_expected(call, match):
    model = tiny_gpt(n_ctx=16)
    ids, padding_mask = pad_prompts(ragged_prompts())
    with pytest.raises(ValueError, match=match):
        call(model, ids, padding_mask)


# ----------------------------------------------------------------------------- beam search

BEAM_CASES = [(num_beams, length_penalty, early_stopping)
              for num_beams in (3, 4) for length_penalty in (1.0, 2.0, 0.0) for early_stopping in (False, True, "never")]
BEAM_CASES.append((2, -1.0, False))


def test_beam_search_equals_transformers_with_and_without_eos(models):
    hf, ours = models
    ids = prompts()
    free = generate(ours, ids, NEW)
    eos_choices = [None, int(free[0, PROMPT_LEN + 3]), int(free[2, PROMPT_LEN + 4])]
    ended_early = 0
    for num_beams, length_penalty, early_stopping in BEAM_CASES:
        for eos in eos_choices:
            expected = hf_generate(hf, ids, NEW, eos=eos, do_sample=False, num_beams=num_beams,
                                   length_penalty=length_penalty, early_stopping=early_stopping)
            out = beam_search(ours, ids, NEW, num_beams=num_beams, length_penalty=length_penalty,
                              eos_token_id=eos, early_stopping=early_stopping)
            assert out.shape == expected.shape and torch.equal(out, expected), (num_beams, length_penalty,
                                                                                early_stopping, eos)
            if eos is not None:  # a best hypothesis that ended in eos before the last step
                ended_early += int(((out[:, PROMPT_LEN:-1] == eos).any(dim=1)).sum())
    assert ended_early >= 10  # the eos path (finished hypotheses, their padding) is really exercised


def test_beam_search_pads_hypotheses_that_ended_early_with_eos(models):
    hf, ours = models
    ids = prompts()
    eos = int(generate(ours, ids, NEW)[0, PROMPT_LEN + 1])
    out = beam_search(ours, ids, NEW, num_beams=3, length_penalty=0.0, eos_token_id=eos)  # 0: shorter is likelier
    assert out.shape[1] < PROMPT_LEN + NEW  # every best hypothesis ended early
    for row in out[:, PROMPT_LEN:]:
        ends = (row == eos).nonzero()
        if len(ends):
            assert bool((row[int(ends[0]):] == eos).all())


def test_one_beam_is_greedy(models):
    _, ours = models
    ids = prompts()
    assert torch.equal(beam_search(ours, ids, NEW, num_beams=1), generate(ours, ids, NEW))


def test_beam_search_finds_likelier_continuations_than_greedy_on_these_prompts(models):
    """Not a theorem (the greedy path can fall out of the beam), but true on these seeded prompts."""
    _, ours = models
    ids = prompts(8, 4, seed=5)
    greedy = sequence_logprob(ours, generate(ours, ids, 8), 4)
    beam = sequence_logprob(ours, beam_search(ours, ids, 8, num_beams=4), 4)
    assert bool((beam >= greedy - 1e-5).all()) and bool((beam > greedy + 1e-3).any())


# ----------------------------------------------------------------------------- sequence_logprob


def test_sequence_logprob_sums_the_continuations_log_probs_with_cropped_contexts():
    model = tiny_gpt(n_ctx=8)
    ids = prompts(2, 13, d_vocab=256)
    expected = torch.zeros(2)
    with torch.no_grad():
        for t in range(3, 13):
            log_probs = model(ids[:, max(0, t - 8):t])[:, -1].log_softmax(-1)
            expected += log_probs.gather(-1, ids[:, t, None])[:, 0]
    torch.testing.assert_close(sequence_logprob(model, ids, 3), expected)
    torch.testing.assert_close(sequence_logprob(model, ids[:, :7], 3), sequence_logprob(model, ids[:, :7], 3))
    assert torch.equal(sequence_logprob(model, ids, 13), torch.zeros(2))  # nothing after the prompt


# ----------------------------------------------------------------------------- the filters


def test_top_k_equals_transformers_ties_included():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen)
    tied = torch.randint(0, 4, (64, 50), generator=gen).float()  # many ties at every rank
    for scores in (logits, tied):
        for k in (1, 2, 5, 49, 50, 80):
            expected = TopKLogitsWarper(top_k=k)(None, scores.clone())
            assert torch.equal(filter_top_k(scores, k), expected), k
    row = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0])
    assert torch.isfinite(filter_top_k(row, 2)).tolist() == [False, True, True, True, False]  # the tie is kept


def test_top_k_keeps_shape_and_leaves_the_input_alone():
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    out = filter_top_k(logits, 4)
    assert out.shape == logits.shape and torch.equal(logits, before)
    assert (torch.isfinite(out).sum(-1) == 4).all()


@pytest.mark.parametrize("p", [1.0, 0.999, 0.9, 0.5, 0.1, 1e-6])
def test_top_p_equals_transformers(p):
    gen = torch.Generator().manual_seed(2)
    for scale in (0.5, 2.0, 6.0):  # flat to peaked distributions
        logits = scale * torch.randn(500, 40, generator=gen)
        expected = TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(filter_top_p(logits, p), expected), (p, scale)
    # After top-k: -inf entries already, as in next_token_distribution
    filtered = filter_top_k(logits, 7)
    assert torch.equal(filter_top_p(filtered, p), TopPLogitsWarper(top_p=p)(None, filtered.clone()))


def test_top_p_keeps_the_token_that_crosses_p_and_always_one():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert torch.isfinite(filter_top_p(logits, 0.5)).tolist() == [True, False, False]  # 0.5 reaches 0.5
    assert torch.isfinite(filter_top_p(logits, 0.51)).tolist() == [True, True, False]  # 0.3 crosses
    assert torch.isfinite(filter_top_p(logits, 1e-9)).tolist() == [True, False, False]
    assert torch.isfinite(filter_top_p(logits, 1.0)).all()


def nucleus(probs: list[float], p: float) -> set[int]:
    """The smallest set of most likely tokens with mass >= p, by hand."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            return kept
    return kept


def test_top_p_sampling_draws_exactly_from_the_smallest_set_with_mass_p():
    probs = [0.05, 0.4, 0.1, 0.25, 0.15, 0.05]
    logits = torch.tensor(probs).log()[None].expand(20000, -1)
    for p, size in ((0.75, 3), (0.39, 1), (0.42, 2), (0.9, 4)):  # p away from the sums: float32 rounding
        kept = nucleus(probs, p)
        assert len(kept) == size
        dist = next_token_distribution(logits, top_p=p)
        draws = torch.multinomial(dist, 1, generator=torch.Generator().manual_seed(0))[:, 0]
        assert set(draws.tolist()) == kept, p  # every nucleus token is drawn, nothing else
        mass = sum(probs[i] for i in kept)
        for token in kept:  # renormalised inside the nucleus
            assert abs((draws == token).float().mean().item() - probs[token] / mass) < 0.02


def test_next_token_distribution_applies_temperature_then_top_k_then_top_p_as_transformers():
    logits = 3 * torch.randn(200, 30, generator=torch.Generator().manual_seed(3))
    for temperature, k, p in ((0.7, 10, 0.8), (1.5, 5, 0.5), (0.3, None, 0.9), (2.0, 20, None)):
        processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                         + ([TopKLogitsWarper(top_k=k)] if k else [])
                                         + ([TopPLogitsWarper(top_p=p)] if p else []))
        expected = processors(None, logits.clone()).softmax(-1)
        torch.testing.assert_close(next_token_distribution(logits, temperature=temperature, top_k=k, top_p=p), expected)


def test_the_learners_filters_can_be_switched_in(models):
    _, ours = models
    calls = []

    def my_top_k(logits, k):
        calls.append(("k", k))
        return filter_top_k(logits, k)

    def my_top_p(logits, p):
        calls.append(("p", p))
        return filter_top_p(logits, p)

    ids = prompts()
    seeded = dict(do_sample=True, top_k=8, top_p=0.9)
    out = generate(ours, ids, 3, **seeded, generator=torch.Generator().manual_seed(4), top_k_filter=my_top_k,
                   top_p_filter=my_top_p)
    assert calls == [("k", 8), ("p", 0.9)] * 3
    assert torch.equal(out, generate(ours, ids, 3, **seeded, generator=torch.Generator().manual_seed(4)))


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_reproducible_with_a_seeded_generator(models):
    _, ours = models
    ids = prompts()
    kwargs = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.95)
    first = generate(ours, ids, NEW, **kwargs, generator=torch.Generator().manual_seed(7))
    again = generate(ours, ids, NEW, **kwargs, generator=torch.Generator().manual_seed(7))
    other = generate(ours, ids, NEW, **kwargs, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(first[:, :PROMPT_LEN], ids)


def test_sampling_with_top_k_1_is_greedy(models):
    _, ours = models
    ids = prompts()
    out = generate(ours, ids, NEW, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, generate(ours, ids, NEW))


def test_sampling_stops_at_eos_and_pads(models):
    _, ours = models
    ids = prompts()
    sampled = generate(ours, ids, NEW, do_sample=True, generator=torch.Generator().manual_seed(1))
    eos = int(sampled[1, PROMPT_LEN + 2])
    out = generate(ours, ids, NEW, do_sample=True, eos_token_id=eos, generator=torch.Generator().manual_seed(1))
    first = int((out[1, PROMPT_LEN:] == eos).nonzero()[0])
    assert first <= 2 and bool((out[1, PROMPT_LEN + first:] == eos).all())


# ----------------------------------------------------------------------------- logits processors


def ban_and_penalise(ids, scores):
    """A processor that looks at both arguments: tokens 0..9 banned, tokens already in the sequence lowered by 2."""
    seen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, ids.long(), True)
    return (scores - 2.0 * seen).index_fill(1, torch.arange(10), float("-inf"))


def test_logits_processors_equal_transformers_in_greedy_and_beam_search(models):
    hf, ours = models
    ids = prompts()
    plain = generate(ours, ids, NEW)
    processors = LogitsProcessorList([ban_and_penalise])
    out = generate(ours, ids, NEW, logits_processors=[ban_and_penalise])
    assert not torch.equal(out, plain) and int(out[:, PROMPT_LEN:].min()) >= 10  # the processor changed the tokens
    assert torch.equal(out, hf_generate(hf, ids, NEW, do_sample=False, logits_processor=processors))
    for num_beams in (2, 3):
        beams = beam_search(ours, ids, NEW, num_beams=num_beams, logits_processors=(ban_and_penalise,))
        assert int(beams[:, PROMPT_LEN:].min()) >= 10
        assert torch.equal(beams, hf_generate(hf, ids, NEW, do_sample=False, num_beams=num_beams,
                                              logits_processor=processors))
    # Applied in order, before sampling: a second processor sees the first one's output.
    seen = []
    record = lambda ids, logits: seen.append(bool(logits[:, :10].isinf().all())) or logits  # noqa: E731
    sampled = generate(ours, ids, NEW, do_sample=True, temperature=2.0, top_k=50,
                       generator=torch.Generator().manual_seed(0), logits_processors=[ban_and_penalise, record])
    assert seen == [True] * NEW and int(sampled[:, PROMPT_LEN:].min()) >= 10
    assert torch.equal(generate(ours, ids, NEW, logits_processors=[]), plain)


@pytest.mark.parametrize("processors, error, match", [
    (ban_and_penalise, TypeError, "list/tuple of callables"),
    ([ban_and_penalise, 3], TypeError, r"int \(not callable\)"),
    ([lambda ids, logits: logits[:, :5]], ValueError, r"must return float logits of shape \(3, 100\)"),
    ([lambda ids, logits: logits.argmax(-1)], ValueError, "must return float logits"),
    ([lambda ids, logits: None], ValueError, "got NoneType"),
])
def test_bad_logits_processors_are_named(models, processors, error, match):
    _, ours = models
    with pytest.raises(error, match=match):
        generate(ours, prompts(), 2, logits_processors=processors)
    with pytest.raises(error, match=match if error is TypeError else "must return float logits"):
        beam_search(ours, prompts(), 2, num_beams=2, logits_processors=processors)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call, match", [
    (lambda m, ids: generate(m, ids, 3, do_sample=True, temperature=0.0), "use do_sample=False"),
    (lambda m, ids: generate(m, ids, 3, temperature=-1.0), "temperature must be a positive number"),
    (lambda m, ids: generate(m, ids, 3, do_sample=True, top_p=0.0), r"top_p must be a probability in \(0, 1\]"),
    (lambda m, ids: generate(m, ids, 3, do_sample=True, top_p=1.5), r"top_p must be a probability in \(0, 1\]"),
    (lambda m, ids: generate(m, ids, 3, do_sample=True, top_k=0), "top_k must be an int >= 1"),
    (lambda m, ids: generate(m, ids, 3, do_sample=True, top_k=2.5), "top_k must be an int >= 1"),
    (lambda m, ids: generate(m, ids, -1), "max_new_tokens must be an int >= 0"),
    (lambda m, ids: generate(m, ids, 2.0), "max_new_tokens must be an int >= 0"),
    (lambda m, ids: generate(m, ids[0], 3), r"2-D integer tensor \(batch, pos\).*ids\[None\]"),
    (lambda m, ids: generate(m, ids.float(), 3), r"2-D integer tensor \(batch, pos\)"),
    (lambda m, ids: generate(m, [[1, 2]], 3), r"2-D integer tensor \(batch, pos\)"),
    (lambda m, ids: generate(m, ids[:, :0], 3), "at least one prompt token"),
    (lambda m, ids: generate(m, ids, 3, eos_token_id=D_VOCAB), "eos_token_id must be None or a token id"),
    (lambda m, ids: beam_search(m, ids, 3, num_beams=0), "num_beams must be an int >= 1"),
    (lambda m, ids: beam_search(m, ids, 3, num_beams=2, early_stopping="sometimes"), "early_stopping must be"),
    (lambda m, ids: beam_search(m, ids, 3, num_beams=2, length_penalty=math.inf), "length_penalty must be"),
    (lambda m, ids: beam_search(m, ids.float(), 3, num_beams=2), r"2-D integer tensor"),
    (lambda m, ids: beam_search(m, ids, -2, num_beams=2), "max_new_tokens must be an int >= 0"),
    (lambda m, ids: sequence_logprob(m, ids, 9), "prompt_len=9 is longer"),
    (lambda m, ids: filter_top_k(ids.float(), 0), "top_k must be an int >= 1"),
    (lambda m, ids: filter_top_p(ids.float(), -0.1), r"top_p must be a probability in \(0, 1\]"),
])
def test_bad_arguments_say_what_was_expected(models, call, match):
    _, ours = models
    with pytest.raises(ValueError, match=match):
        call(ours, prompts())


def test_greedy_ignores_sampling_knobs_and_a_cpu_generator_works_for_any_model(models):
    _, ours = models
    ids = prompts()
    assert torch.equal(generate(ours, ids, 4, top_k=3, top_p=0.5, temperature=0.2), generate(ours, ids, 4))
    cfg = ModelConfig(d_vocab=11, n_ctx=4, d_model=8, n_layers=1, n_heads=2)
    model = GPT(cfg)
    out = generate(model, torch.zeros(1, 2, dtype=torch.long), 6, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and int(out.max()) < 11


def test_shapes_match_the_annotations(models, typechecked):
    _, ours = models
    ids = prompts()
    logits = torch.randn(3, D_VOCAB)
    assert typechecked(filter_top_k)(logits, 5).shape == (3, D_VOCAB)
    assert typechecked(filter_top_p)(logits, 0.5).shape == (3, D_VOCAB)
    assert typechecked(next_token_distribution)(logits, top_k=5).shape == (3, D_VOCAB)
    assert typechecked(generate)(ours, ids, 2).shape == (3, PROMPT_LEN + 2)
    assert typechecked(beam_search)(ours, ids, 2, num_beams=2).shape == (3, PROMPT_LEN + 2)
    assert typechecked(sequence_logprob)(ours, ids, 2).shape == (3,)

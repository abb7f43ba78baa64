"""Checkers for notebooks/08_training_and_decoding.ipynb: greedy decoding and the top-k and top-p filters.

Three exercises, each checked against ``tfedu.generate`` after first trying the mistakes seen in
tutorials and learners' answers:

- 8.1 ``greedy_generate(model, ids, max_new_tokens)``: the first position's logits instead of the
  last's, the argmax over the positions instead of the vocabulary, returning only the new tokens or
  only the prompt, feeding the prompt again each step instead of the grown sequence, no cropping to
  ``model.cfg.n_ctx`` (the model refuses) or cropping the start instead of the end, sampling instead
  of the argmax, dropout left on (no ``model.eval()``), the prompt changed in place. Compared with
  ``tfedu.generate.generate(..., do_sample=False)`` on a tiny seeded GPT, with a prompt near n_ctx.
- 8.2 ``top_k_filter(logits, k)``: k + 1 or k - 1 tokens kept, the k smallest kept, probabilities
  returned (softmax applied), 0 or a large negative number instead of -inf, ties at the k-th value
  dropped (transformers keeps every logit >= the k-th largest), the input changed in place, a filter
  that works on one row (d_vocab,) but not on a batch. Compared with ``tfedu.generate.filter_top_k``.
- 8.3 ``top_p_filter(logits, p)``: the nucleus without the token that carries the mass across p,
  the tokens sorted least likely first, probabilities returned (renormalised or not), an empty
  nucleus for a small p (the most likely token is always kept), the mask put back in the wrong
  order (left in sorted order, or gathered where it should be scattered), 0 instead of -inf, the
  input changed in place, one row only, probabilities taken as exp over the sum without subtracting the
  largest logit (NaN on logits near 100: a confident model, or a temperature of 0.1). Compared with
  ``tfedu.generate.filter_top_p``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tfedu.checks.building_blocks import ELEMENTARY, SOFTMAX
from tfedu.checks.core import (
    CheckFailure,
    Hints,
    Probe,
    call_learner,
    call_on_copies,
    checker,
    compare,
    describe,
    expect,
    is_close,
)
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, compare_outputs
from tfedu.config import ModelConfig
from tfedu.generate import filter_top_k, filter_top_p, generate
from tfedu.model import GPT

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- 8.1 greedy_generate

HINT_GREEDY_FIRST = (
    "you took the logits of the first position: the model predicts the token after position t at position t, "
    "so the next token's logits are those of the last position (the last entry of the pos axis), in every row"
)
HINT_GREEDY_AXIS = (
    "you took the argmax over the positions: logits is (batch, pos, d_vocab), and the next token is the "
    "argmax over the vocabulary (the last axis) of the last position's logits, one token per row"
)
HINT_GREEDY_ONLY_NEW = (
    "you returned only the new tokens: return the prompt followed by them, shape (batch, pos + max_new_tokens)"
)
HINT_GREEDY_ONLY_PROMPT = (
    "you returned the prompt unchanged: at every step append the new tokens, one per row as a (batch, 1) "
    "column, to the end of the sequence (torch.cat along the positions), and return the grown sequence"
)
HINT_GREEDY_NOT_FED_BACK = (
    "every step predicted from the prompt alone, so each new token is the same: feed the grown sequence "
    "(prompt plus the tokens so far) back into the model at every step"
)
HINT_GREEDY_CROP_START = (
    "you kept the first n_ctx tokens: the model must see the most recent ones, the last n_ctx of the sequence"
)
HINT_GREEDY_NO_CROP = (
    "the sequence outgrew the model's context: before each forward pass, keep only its last model.cfg.n_ctx "
    "tokens"
)
HINT_GREEDY_RANDOM = (
    "two calls with the same model and prompt gave different tokens: greedy decoding is deterministic, it takes "
    "the argmax of the logits; do not sample (torch.multinomial) here"
)
HINT_GREEDY_DROPOUT = (
    "with a model that has dropout and was left in training mode, your tokens differ from the reference: call "
    "model.eval() first (dropout off while generating); torch.no_grad() alone does not turn dropout off"
)
HINT_GREEDY_MUTATED = (
    "your greedy_generate changed the caller's `{name}` in place: build a new tensor each step with torch.cat "
    "instead of writing into the prompt"
)
HINT_GREEDY_CALL = (
    "greedy_generate(model, ids, max_new_tokens): ids is (batch, pos) of token ids; model(ids) returns logits "
    "(batch, pos, d_vocab); take the last position's logits, their argmax over the last dim, and append it "
    "with torch.cat along dim 1, as a (batch, 1) column. Crop to the last model.cfg.n_ctx tokens before each call"
)
HINT_GREEDY_DTYPE = "return token ids in ids' dtype ({want}), got {got}: the argmax gives int64 already, do not convert to float"

GREEDY_N_CTX = 16


def make_greedy_model(seed: int, *, dropout: float = 0.0, n_ctx: int = GREEDY_N_CTX, d_vocab: int = 64) -> GPT:
    """A tiny GPT whose greedy continuations keep changing; the global random state is left alone.

    Std 0.5 weights spread the logits (no near-ties for the argmax); an untied unembedding keeps a
    random model from repeating its last token forever (tied, the input token's own logit stands out),
    which would hide mistakes such as never feeding the new tokens back.
    """
    cfg = ModelConfig(d_vocab=d_vocab, n_ctx=n_ctx, d_model=32, n_layers=1, n_heads=2, init_std=0.5,
                      tied_embeddings=False, dropout=dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg).eval()


def _greedy_variant(model: GPT, ids: torch.Tensor, max_new_tokens: int, *, position: int = -1, axis: str = "vocab",
                    crop: str = "end", fed_back: bool = True) -> torch.Tensor:
    """Greedy decoding with one of the known mistakes, in eval mode under no_grad."""
    n_ctx, was_training = model.cfg.n_ctx, model.training
    out = ids
    with torch.no_grad():
        model.eval()
        for _ in range(max_new_tokens):
            seq = out if fed_back else ids
            context = seq[:, -n_ctx:] if crop == "end" else seq[:, :n_ctx]
            logits = model(context)  # batch pos d_vocab
            if axis == "vocab":
                next_id = logits[:, position, :].argmax(dim=-1)
            else:  # argmax over the positions, of the last vocabulary entry: a position index
                next_id = logits.argmax(dim=1)[:, -1]
            out = torch.cat([out, next_id[:, None].to(ids.dtype)], dim=1)
    model.train(was_training)
    return out


def _greedy_mistakes(model: GPT, ids: torch.Tensor, max_new_tokens: int) -> dict[str, torch.Tensor]:
    expected = _greedy_variant(model, ids, max_new_tokens)
    return {
        HINT_GREEDY_FIRST: _greedy_variant(model, ids, max_new_tokens, position=0),
        HINT_GREEDY_AXIS: _greedy_variant(model, ids, max_new_tokens, axis="pos"),
        HINT_GREEDY_ONLY_NEW: expected[:, ids.shape[1]:],
        HINT_GREEDY_ONLY_PROMPT: ids,
        HINT_GREEDY_NOT_FED_BACK: _greedy_variant(model, ids, max_new_tokens, fed_back=False),
        HINT_GREEDY_CROP_START: _greedy_variant(model, ids, max_new_tokens, crop="start"),
    }


def _greedy_prompt(seed: int, batch: int, pos: int, d_vocab: int) -> torch.Tensor:
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


def _call_greedy(fn: Any, model: GPT, ids: torch.Tensor, max_new_tokens: int, seed: int = 0) -> Any:
    with torch.random.fork_rng(devices=[]):  # a seed of its own per call: an answer that samples differs
        torch.manual_seed(seed)
        return call_on_copies(fn, {"model": model, "ids": ids, "max_new_tokens": max_new_tokens},
                              name="greedy_generate", mutated_hint=HINT_GREEDY_MUTATED, error_hint=HINT_GREEDY_CALL)


def _check_greedy_output(got: Any, model: GPT, ids: torch.Tensor, max_new_tokens: int, what: str) -> None:
    expected = generate(model, ids, max_new_tokens)
    expect(isinstance(got, torch.Tensor), f"{what} should return a tensor of token ids (batch, pos + max_new_tokens), "
                                          f"got {describe(got)}")
    expect(not got.is_floating_point(), HINT_GREEDY_DTYPE.format(want=ids.dtype, got=got.dtype))
    compare(got, expected, what=what, mistakes=_greedy_mistakes(model, ids, max_new_tokens), check_dtype=False,
            rtol=0, atol=0)


@checker("greedy decoding")
def check_greedy_generate(greedy_generate) -> None:
    """Check a learner's ``greedy_generate(model, ids, max_new_tokens) -> Int[Tensor, "batch pos_out"]``.

    Against ``tfedu.generate.generate(model, ids, max_new_tokens)`` (greedy) on tiny seeded GPTs: a
    short prompt, one whose continuation runs past ``model.cfg.n_ctx`` (so the context must be
    cropped to its last n_ctx tokens), two calls that must agree (no sampling), a model with dropout
    left in training mode (the answer must switch it to eval mode), and the prompt left unchanged.
    """
    model = make_greedy_model(0)
    ids = _greedy_prompt(1, 2, 5, model.cfg.d_vocab)
    got = _call_greedy(greedy_generate, model, ids, 6)
    again = _call_greedy(greedy_generate, model, ids, 6, seed=1)
    if isinstance(got, torch.Tensor) and isinstance(again, torch.Tensor) and not torch.equal(got, again):
        raise CheckFailure(HINT_GREEDY_RANDOM)
    _check_greedy_output(got, model, ids, 6, "greedy_generate(model, ids, 6) with ids of shape (2, 5)")
    # A prompt of 13 tokens and 8 new ones: from the 4th step on the sequence is longer than n_ctx = 16.
    ids = _greedy_prompt(2, 3, 13, model.cfg.d_vocab)
    try:
        got = _call_greedy(greedy_generate, model, ids, 8)
    except CheckFailure as failure:
        if "n_ctx" in str(failure) or "positions" in str(failure):
            raise CheckFailure(f"{HINT_GREEDY_NO_CROP} ({failure})") from None
        raise
    _check_greedy_output(got, model, ids, 8, f"greedy_generate(model, ids, 8) with ids of shape (3, 13) and "
                                             f"model.cfg.n_ctx = {GREEDY_N_CTX}")
    # The same weights with dropout 0.5, left in training mode.
    dropout_model = make_greedy_model(0, dropout=0.5).train()
    ids = _greedy_prompt(3, 2, 6, model.cfg.d_vocab)
    got = _call_greedy(greedy_generate, dropout_model, ids, 6)
    expected = generate(dropout_model, ids, 6)
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and not torch.equal(got, expected):
        raise CheckFailure(HINT_GREEDY_DROPOUT)
    _check_greedy_output(got, dropout_model, ids, 6, "greedy_generate(model, ids, 6) with a dropout model in training mode")


# ----------------------------------------------------------------------------- shared by the filters

HINT_FILTER_ZERO = (
    "you set the removed logits to 0: a logit of 0 is an ordinary score (e^0 = 1 before normalising), so those "
    "tokens can still be drawn. Set them to minus infinity, whose probability after the softmax is exactly 0"
)
HINT_FILTER_BIG_NEGATIVE = (
    "you set the removed logits to a large negative number instead of minus infinity: -inf gives probability "
    "exactly 0 whatever the other logits are (and is what transformers uses)"
)
HINT_FILTER_BATCH = (
    "your filter is right on one row (d_vocab,) but not on a batch of rows {shape}: work along the last dim "
    "(and keep that axis wherever a value per row must broadcast back against the row), so every row is "
    "filtered on its own"
)


def _fill_mistakes(logits: torch.Tensor, expected: torch.Tensor) -> dict[str, torch.Tensor]:
    removed = torch.isinf(expected) & ~torch.isinf(logits)
    return {HINT_FILTER_ZERO: logits.masked_fill(removed, 0.0)}


def _check_fill(got: Any, expected: torch.Tensor) -> None:
    """Name a fill of -1e4, -1e9, torch.finfo.min ... where the reference has -inf."""
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.is_floating_point():
        removed = torch.isinf(expected)
        if bool(removed.any()) and bool(torch.isfinite(got[removed]).all()) and bool((got[removed] <= -1e3).all()) \
                and is_close(got[~removed], expected[~removed]):
            raise CheckFailure(HINT_FILTER_BIG_NEGATIVE)


def _check_rows(fn: Any, logits: torch.Tensor, arg: Any, reference: Callable, name: str, mutated_hint: str,
                error_hint: str, what: str, mistakes: Callable[[torch.Tensor, Any], dict]) -> None:
    """Check ``fn(logits, arg)`` on a batch; when that fails but every row alone passes, blame batch handling."""
    expected = reference(logits, arg)
    try:
        got = call_on_copies(fn, {"logits": logits, "arg": arg}, name=name, mutated_hint=mutated_hint,
                             error_hint=error_hint)
        _check_fill(got, expected)
        compare(got, expected, what=what, mistakes=mistakes(logits, arg))
    except CheckFailure as failure:
        rows = logits.reshape(-1, logits.shape[-1])
        try:
            for row in rows:
                row_got = call_learner(fn, row.clone(), arg, name=name)
                expect(is_close(row_got, reference(row, arg)), "")
        except CheckFailure:
            raise failure from None
        raise CheckFailure(HINT_FILTER_BATCH.format(shape=tuple(logits.shape))) from None


# ----------------------------------------------------------------------------- 8.2 top_k_filter

HINT_TOPK_PLUS_ONE = "you kept k + 1 tokens: keep the k largest logits, those >= the k-th largest"
HINT_TOPK_MINUS_ONE = (
    "you kept k - 1 tokens: the k-th largest logit itself stays; remove only the logits strictly smaller than it "
    "(strictly less, not less or equal)"
)
HINT_TOPK_SMALLEST = (
    "you kept the k smallest logits: top-k keeps the k largest (torch.topk's default largest=True, or a sort "
    "with descending=True)"
)
HINT_TOPK_PROBS = (
    "you returned probabilities (a softmax of the kept logits): the filter returns logits, with -inf for the "
    "removed tokens; the softmax comes later, in next_token_distribution"
)
HINT_TOPK_PROBS_UNNORMALISED = (
    "you returned probabilities with the removed tokens set to 0 (the softmax first, then the filter): the filter "
    "works on logits and returns logits, with -inf for the removed tokens"
)
HINT_TOPK_TIES = (
    "with ties at the k-th largest value you kept exactly k tokens: keep every logit >= the k-th largest "
    "(as transformers' TopKLogitsWarper): compare every logit with the k-th largest value of its row, not with "
    "the positions of the k largest"
)
HINT_TOPK_MUTATED = (
    "your top_k_filter changed the caller's `{name}` in place (logits[...] = -inf or masked_fill_): return a new "
    "tensor and leave the argument as it was"
)
HINT_TOPK_CALL = (
    "top_k_filter(logits, k): logits is (..., d_vocab), k an int; return a tensor of logits' shape with all but the "
    "k largest of each row set to -inf (minus infinity)"
)
HINT_TOPK_TUPLE = "return one tensor of logits' shape (the filtered logits), not torch.topk's (values, indices)"


def _top_k_keeping(logits: torch.Tensor, k: int, *, largest: bool = True) -> torch.Tensor:
    k = min(max(k, 1), logits.shape[-1])
    kth = logits.topk(k, dim=-1, largest=largest).values[..., -1:]
    return logits.masked_fill(logits < kth if largest else logits > kth, NEG_INF)


def _top_k_mistakes(logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    expected = filter_top_k(logits, k)
    mistakes = {
        HINT_TOPK_SMALLEST: _top_k_keeping(logits, k, largest=False),
        HINT_TOPK_PROBS: expected.softmax(dim=-1),
        HINT_TOPK_PROBS_UNNORMALISED: logits.softmax(dim=-1).masked_fill(torch.isinf(expected), 0.0),
        **_fill_mistakes(logits, expected),
    }
    if k + 1 <= logits.shape[-1]:
        mistakes[HINT_TOPK_PLUS_ONE] = _top_k_keeping(logits, k + 1)
    if k > 1:
        mistakes[HINT_TOPK_MINUS_ONE] = _top_k_keeping(logits, k - 1)
    return mistakes


def _ties_logits() -> torch.Tensor:
    """Rows whose k-th (k = 3) largest value is tied with the 4th (and 5th): integers 0..4."""
    return torch.tensor([[4.0, 1.0, 3.0, 2.0, 3.0, 0.0, 3.0, 1.0],
                         [2.0, 2.0, 0.0, 4.0, 2.0, 1.0, 0.0, 2.0]])


def _call_filter(fn: Any, logits: torch.Tensor, arg: Any, *, name: str, mutated_hint: str, error_hint: str,
                 tuple_hint: str | None = None) -> Any:
    got = call_on_copies(fn, {"logits": logits, "arg": arg}, name=name, mutated_hint=mutated_hint, error_hint=error_hint)
    if isinstance(got, (tuple, list)):
        raise CheckFailure(tuple_hint or f"{name} should return one tensor of logits' shape, got a {type(got).__name__}")
    return got


@checker("top-k filter")
def check_top_k_filter(top_k_filter) -> None:
    """Check a learner's ``top_k_filter(logits, k) -> Float[Tensor, "... d_vocab"]``.

    Against ``tfedu.generate.filter_top_k``: one row, a batch, a (2, 3, d_vocab) batch, k = 1,
    k = d_vocab (keeps everything), ties at the k-th value (every tied logit is kept, as
    transformers does), and the input left unchanged.
    """
    kwargs = dict(name="top_k_filter", mutated_hint=HINT_TOPK_MUTATED, error_hint=HINT_TOPK_CALL)
    gen = torch.Generator().manual_seed(0)
    one_row = 2 * torch.randn(20, generator=gen)
    got = _call_filter(top_k_filter, one_row, 5, tuple_hint=HINT_TOPK_TUPLE, **kwargs)
    expected = filter_top_k(one_row, 5)
    _check_fill(got, expected)
    compare(got, expected, what="top_k_filter(logits, 5) with logits of shape (20,)", mistakes=_top_k_mistakes(one_row, 5))
    for shape, k in (((4, 30), 7), ((2, 3, 12), 4), ((3, 10), 1), ((3, 10), 10)):
        logits = 2 * torch.randn(*shape, generator=gen)
        _check_rows(top_k_filter, logits, k, filter_top_k, what=f"top_k_filter(logits, {k}) with logits of shape {shape}",
                    mistakes=_top_k_mistakes, **kwargs)
    ties = _ties_logits()
    got = _call_filter(top_k_filter, ties, 3, **kwargs)
    expected = filter_top_k(ties, 3)
    if isinstance(got, torch.Tensor) and got.shape == ties.shape and not is_close(got, expected):
        kept = torch.isfinite(got).sum(dim=-1)
        if bool((kept == 3).all()) and not bool((torch.isfinite(got) & ~torch.isfinite(expected)).any()):
            raise CheckFailure(HINT_TOPK_TIES)
    compare(got, expected, what="top_k_filter(logits, 3) with ties at the 3rd largest value", mistakes=_top_k_mistakes(ties, 3))


# ----------------------------------------------------------------------------- 8.3 top_p_filter

HINT_TOPP_CROSSING = (
    "your nucleus leaves out the token that carries the mass across p: keep the fewest most likely tokens whose "
    "mass reaches p, that token included. A token stays when the tokens ranked before it hold less than p: "
    "remove a token only when the mass before it, its cumulative sum less its own probability, already "
    "reaches p (or shift the mask of 'cumulative sum past p' one place to the right)"
)
HINT_TOPP_ASCENDING = (
    "you sorted the tokens least likely first: the nucleus collects the MOST likely tokens, "
    "so sort with descending=True"
)
HINT_TOPP_PROBS_UNNORMALISED = (
    "you returned probabilities with the removed tokens set to 0 (so they no longer sum to 1): the filter works "
    "on logits and returns logits, with -inf for the removed tokens; the softmax comes later"
)
HINT_TOPP_PROBS = (
    "you returned probabilities (renormalised over the nucleus): the filter returns logits, with -inf for "
    "the removed tokens; the softmax comes later, in next_token_distribution"
)
HINT_TOPP_OVERFLOW = (
    "{call}: your filter keeps the wrong tokens on logits near {top:.0f} (a confident model, or logits divided by a "
    "temperature of 0.1), though the same logits minus {top:.0f} give the same probabilities: in float32 e^x "
    "overflows once x passes about 88, and inf / inf is NaN. Take the probabilities with a softmax that subtracts "
    "each row's largest logit first (torch's softmax does), not by exponentiating the logits yourself"
)
HINT_TOPP_EMPTY = (
    "with p = {p:g} your filter removed every token of some rows: the token that carries the mass across p "
    "is kept, so the most likely token always stays (nothing comes before it, so the mass before it, 0, is "
    "below p); the old transformers code forced the first sorted token back into the nucleus for this"
)
HINT_TOPP_SORTED_ORDER = (
    "you returned the filtered logits in sorted order: put them back in the tokens' own order (the mask you "
    "built in sorted order says, at place i, what to do with token order[i])"
)
HINT_TOPP_UNSORTED_MASK = (
    "you applied the mask, which is in sorted order, to the unsorted logits: position i of the sorted mask belongs "
    "to token order[i], so move it back to the tokens' order first"
)
HINT_TOPP_GATHER = (
    "you moved the mask back with gather, which applies the permutation the wrong way round: place i of the "
    "sorted mask belongs to token order[..., i], so it must be written to that token's place, not read from it"
)
HINT_TOPP_MUTATED = (
    "your top_p_filter changed the caller's `{name}` in place (logits[...] = -inf or masked_fill_): return a new "
    "tensor and leave the argument as it was"
)
HINT_TOPP_CALL = (
    "top_p_filter(logits, p): logits is (..., d_vocab), p a float in (0, 1]; sort each row's logits descending "
    "(dim=-1), take the softmax and its cumulative sum, and return logits' shape with the tokens outside the "
    "nucleus set to -inf (minus infinity)"
)
HINT_TOPP_P_ONE = "top_p_filter(logits, 1.0) must keep every token (the whole distribution has mass 1)"


def _top_p_variant(logits: torch.Tensor, p: float, *, rule: str = "before", descending: bool = True,
                   back: str = "scatter") -> torch.Tensor:
    """The nucleus filter with one of the known mistakes."""
    sorted_logits, order = logits.sort(dim=-1, descending=descending)
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1)
    remove_sorted = cumulative - probs >= p if rule == "before" else cumulative > p
    if back == "sorted":
        return sorted_logits.masked_fill(remove_sorted, NEG_INF)
    if back == "unsorted":
        return logits.masked_fill(remove_sorted, NEG_INF)
    remove = remove_sorted.gather(-1, order) if back == "gather" else remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def _top_p_mistakes(logits: torch.Tensor, p: float) -> dict[str, torch.Tensor]:
    expected = filter_top_p(logits, p)
    return {
        HINT_TOPP_CROSSING: _top_p_variant(logits, p, rule="within"),
        HINT_TOPP_ASCENDING: _top_p_variant(logits, p, descending=False),
        HINT_TOPP_PROBS: expected.softmax(dim=-1),
        HINT_TOPP_PROBS_UNNORMALISED: logits.softmax(dim=-1).masked_fill(torch.isinf(expected), 0.0),
        HINT_TOPP_SORTED_ORDER: _top_p_variant(logits, p, back="sorted"),
        HINT_TOPP_UNSORTED_MASK: _top_p_variant(logits, p, back="unsorted"),
        HINT_TOPP_GATHER: _top_p_variant(logits, p, back="gather"),
        **_fill_mistakes(logits, expected),
    }


def top_p_margin(logits: torch.Tensor, p: float) -> float:
    """How far p lies from every cumulative sum of the sorted probabilities (float64): rounding cannot flip a token."""
    probs = logits.double().softmax(dim=-1).sort(dim=-1, descending=True).values
    return float((probs.cumsum(dim=-1) - p).abs().min())


def top_p_logits(seed: int, *shape: int, scale: float = 1.5) -> torch.Tensor:
    """Seeded standard-normal logits times ``scale``."""
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# The checker's calls: (seed, shape, p). Each p lies at least 1e-3 from every cumulative sum (tested).
TOP_P_CALLS = ((10, (20,), 0.8), (11, (5, 24), 0.7), (12, (2, 3, 16), 0.9), (13, (4, 30), 0.5))
# The same kind of call on logits near 100: a softmax written as exp over the sum overflows there (issue 37).
TOP_P_CONFIDENT, CONFIDENT_OFFSET = (16, (4, 20), 0.8), 100.0


def same_filter(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether ``got`` removes (-inf) exactly the tokens ``want`` removes and keeps the others' logits."""
    removed = np.isinf(want)
    return bool(np.array_equal(removed, np.isinf(got) & (got < 0)) and np.allclose(got[~removed], want[~removed]))


@checker("top-p (nucleus) filter")
def check_top_p_filter(top_p_filter) -> None:
    """Check a learner's ``top_p_filter(logits, p) -> Float[Tensor, "... d_vocab"]``.

    Against ``tfedu.generate.filter_top_p`` (which equals transformers' ``TopPLogitsWarper``): one
    row, batches of rows, p = 0.5 to 0.9, a tiny p (one token stays), p = 1 (every token stays),
    logits already holding -inf (after top-k), and the input left unchanged.
    """
    kwargs = dict(name="top_p_filter", mutated_hint=HINT_TOPP_MUTATED, error_hint=HINT_TOPP_CALL)
    for seed, shape, p in TOP_P_CALLS:
        logits = top_p_logits(seed, *shape)
        what = f"top_p_filter(logits, {p}) with logits of shape {shape}"
        if len(shape) == 1:
            got = _call_filter(top_p_filter, logits, p, **kwargs)
            expected = filter_top_p(logits, p)
            _check_fill(got, expected)
            compare(got, expected, what=what, mistakes=_top_p_mistakes(logits, p))
        else:
            _check_rows(top_p_filter, logits, p, filter_top_p, what=what, mistakes=_top_p_mistakes, **kwargs)
    logits = top_p_logits(14, 6, 20)
    got = _call_filter(top_p_filter, logits, 1e-4, **kwargs)
    if isinstance(got, torch.Tensor) and got.shape == logits.shape and got.is_floating_point():
        expect(bool(torch.isfinite(got).any(dim=-1).all()), HINT_TOPP_EMPTY.format(p=1e-4))
    compare(got, filter_top_p(logits, 1e-4), what="top_p_filter(logits, 0.0001) (only the most likely token stays)",
            mistakes=_top_p_mistakes(logits, 1e-4))
    got = _call_filter(top_p_filter, logits, 1.0, **kwargs)
    compare(got, logits, what="top_p_filter(logits, 1.0)", mistakes={HINT_TOPP_P_ONE: filter_top_p(logits, 0.99)})
    filtered = filter_top_k(top_p_logits(15, 4, 20), 8)  # -inf already in every row
    got = _call_filter(top_p_filter, filtered, 0.8, **kwargs)
    compare(got, filter_top_p(filtered, 0.8), what="top_p_filter(filter_top_k(logits, 8), 0.8) (logits holding -inf)",
            mistakes=_top_p_mistakes(filtered, 0.8))
    seed, shape, p = TOP_P_CONFIDENT
    logits = top_p_logits(seed, *shape) + CONFIDENT_OFFSET
    got = _call_filter(top_p_filter, logits, p, **kwargs)
    expected = filter_top_p(logits, p)
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape and same_filter(got.detach().numpy(), expected.numpy())):
        raise CheckFailure(HINT_TOPP_OVERFLOW.format(call=f"top_p_filter(logits, {p}) with logits of shape {shape}",
                                                     top=CONFIDENT_OFFSET))


# ----------------------------------------------------------------------------- probes

# greedy_generate: a tiny GPT whose weights travel as arrays, built in the kernel (tfedu.model is not the
# answer); a prompt whose continuation runs past n_ctx; a second call (the same tokens); the same weights
# with dropout, left in training mode.

GREEDY_PROBE_RUN = HELPERS + """\
from tfedu.config import ModelConfig as _ModelConfig
from tfedu.model import GPT as _GPT


def _model(_dropout):
    with torch.random.fork_rng(devices=[]):
        _m = _GPT(_ModelConfig(**inputs['config'], dropout=_dropout))
    _m.load_state_dict({_k: torch.from_numpy(_v) for _k, _v in inputs['weights'].items()})
    return _m.eval() if _dropout == 0 else _m.train()


_ids = torch.from_numpy(inputs['ids'])
_result = _call(greedy_generate, _model(0.0), _ids, inputs['max_new_tokens'])
_again = greedy_generate(_model(0.0), _ids.clone(), inputs['max_new_tokens'])
_dropped = greedy_generate(_model(0.5), torch.from_numpy(inputs['ids_dropout']), inputs['max_new_tokens'])
outputs = {
    'returned': [_kind(_result), _kind(_dropped)],
    'output': _array(_result), 'output_dropout': _array(_dropped),
    'repeatable': bool(isinstance(_result, torch.Tensor) and isinstance(_again, torch.Tensor)
                       and _result.shape == _again.shape and torch.equal(_result, _again)),
    'mutated': _MUTATED,
}
del _ModelConfig, _GPT, _model, _ids, _result, _again, _dropped
""" + CLEANUP


def _greedy_probe_inputs(rng: np.random.Generator) -> dict:
    """A fresh tiny GPT and prompts on which every known mistake gives other tokens (drawn again until so)."""
    while True:
        n_ctx, d_vocab = int(rng.integers(8, 17)), int(rng.integers(20, 80))
        config = {"d_vocab": d_vocab, "n_ctx": n_ctx, "d_model": 16 * int(rng.integers(1, 3)),
                  "n_layers": int(rng.integers(1, 3)), "n_heads": 2, "init_std": 0.5, "tied_embeddings": False}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(rng.integers(0, 2**31)))
            weights = {name: value.numpy() for name, value in GPT(ModelConfig(**config)).state_dict().items()}
        batch, max_new = int(rng.integers(2, 4)), int(rng.integers(5, 9))
        pos = n_ctx - int(rng.integers(1, 4))  # the continuation runs past n_ctx
        inputs = {"config": config, "weights": weights, "max_new_tokens": max_new,
                  "ids": rng.integers(0, d_vocab, (batch, pos)).astype(np.int64),
                  "ids_dropout": rng.integers(0, d_vocab, (batch, int(rng.integers(2, 6)))).astype(np.int64)}
        model, ids = _probe_model(inputs), torch.from_numpy(inputs["ids"])
        expected = generate(model, ids, max_new)
        if not any(wrong.shape == expected.shape and torch.equal(wrong, expected)
                   for wrong in _greedy_mistakes(model, ids, max_new).values()):
            return inputs


def _probe_model(inputs: dict) -> GPT:
    with torch.random.fork_rng(devices=[]):
        model = GPT(ModelConfig(**inputs["config"]))
    model.load_state_dict({name: torch.from_numpy(value) for name, value in inputs["weights"].items()})
    return model.eval()


def _greedy_reference(inputs: dict) -> dict:
    model, ids = _probe_model(inputs), torch.from_numpy(inputs["ids"])
    max_new = inputs["max_new_tokens"]
    return {
        "returned": ["tensor", "tensor"],
        "output": as_array(generate(model, ids, max_new)),
        "output_dropout": as_array(generate(model, torch.from_numpy(inputs["ids_dropout"]), max_new)),
        "mistakes": [[hint, as_array(wrong)] for hint, wrong in _greedy_mistakes(model, ids, max_new).items()],
    }


def _compare_greedy(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="greedy_generate")
    if problem:
        return problem
    got, want = outputs.get("output"), expected["output"]
    if isinstance(got, np.ndarray) and got.dtype.kind == "f":
        return HINT_GREEDY_DTYPE.format(want="int64", got=got.dtype)
    if not outputs.get("repeatable"):
        return HINT_GREEDY_RANDOM
    if isinstance(got, np.ndarray) and not (got.shape == want.shape and np.array_equal(got, want)):
        for hint, wrong in expected["mistakes"]:
            if got.shape == wrong.shape and np.array_equal(got, wrong) and not (
                    wrong.shape == want.shape and np.array_equal(wrong, want)):
                return hint
    labels = {"output": "greedy_generate(model, ids, max_new_tokens) with a prompt near model.cfg.n_ctx",
              "output_dropout": "greedy_generate(model, ids, max_new_tokens) with a dropout model in training mode"}
    problem = compare_outputs(outputs, {k: v for k, v in expected.items() if k in ("returned", "output")},
                              function="greedy_generate", labels=labels, rtol=0, atol=0)
    if problem:
        return f"{problem} ({HINT_GREEDY_NO_CROP}?)" if "shape" in problem else problem
    problem = compare_outputs(outputs, {"returned": expected["returned"], "output_dropout": expected["output_dropout"]},
                              function="greedy_generate", labels=labels, rtol=0, atol=0)
    return f"{problem}: {HINT_GREEDY_DROPOUT}" if problem else None


# The filters: fresh logits of several shapes and scales, k and p drawn; ties for top-k, a tiny p and
# -inf entries for top-p.

FILTER_PROBE_CODE = """\
_results = [_call({name}, torch.from_numpy(_logits), _arg) for _logits, _arg in zip(inputs['logits'], inputs['args'])]
outputs = {{'returned': [_kind(_r) for _r in _results], 'outputs': [_array(_r) for _r in _results], 'mutated': _MUTATED}}
del _results
"""


def _filter_run(name: str) -> str:
    return HELPERS + FILTER_PROBE_CODE.format(name=name) + CLEANUP


def _probe_logits(rng: np.random.Generator) -> list[np.ndarray]:
    shapes = [(int(rng.integers(5, 40)),), (int(rng.integers(1, 6)), int(rng.integers(5, 40))),
              (int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(5, 30)))]
    return [(rng.uniform(0.5, 4.0) * rng.standard_normal(shape)).astype(np.float32) for shape in shapes]


def _top_k_probe_inputs(rng: np.random.Generator) -> dict:
    logits = _probe_logits(rng)
    args = [int(rng.integers(1, x.shape[-1] + 1)) for x in logits]
    ties = rng.integers(0, 4, (int(rng.integers(2, 6)), int(rng.integers(6, 20)))).astype(np.float32)
    logits += [ties, logits[1]]
    args += [int(rng.integers(2, ties.shape[-1])), logits[1].shape[-1]]  # k = d_vocab keeps everything
    return {"logits": logits, "args": args}


def _safe_p(rng: np.random.Generator, logits: np.ndarray) -> float:
    """A p at least 1e-3 from every cumulative sum of the sorted probabilities: rounding cannot flip a token."""
    while True:
        p = float(rng.uniform(0.3, 0.95))
        if top_p_margin(torch.from_numpy(logits), p) > 1e-3:
            return p


def _top_p_probe_inputs(rng: np.random.Generator) -> dict:
    logits = _probe_logits(rng)
    args = [_safe_p(rng, x) for x in logits]
    with_inf = logits[1].copy()
    with_inf[rng.random(with_inf.shape) < 0.3] = -np.inf
    with_inf[..., 0] = 1.0  # every row keeps a finite logit
    confident = (logits[0] + np.float32(rng.uniform(90.0, 300.0))).astype(np.float32)  # exp overflows float32 here
    logits += [logits[1], logits[2], with_inf, confident]
    args += [1e-5, _safe_p(rng, logits[2]), _safe_p(rng, with_inf), _safe_p(rng, confident)]
    return {"logits": logits, "args": args}


def _filter_reference(reference: Callable) -> Callable[[dict], dict]:
    def run(inputs: dict) -> dict:
        results = [reference(torch.from_numpy(x), arg) for x, arg in zip(inputs["logits"], inputs["args"])]
        mistakes = _top_k_mistakes if reference is filter_top_k else _top_p_mistakes
        return {"returned": ["tensor"] * len(results), "outputs": [as_array(r) for r in results],
                "mistakes": [[[hint, as_array(wrong)] for hint, wrong in mistakes(torch.from_numpy(x), arg).items()]
                             for x, arg in zip(inputs["logits"], inputs["args"])],
                "args": list(inputs["args"]),
                "largest": [float(np.max(x[np.isfinite(x)])) for x in inputs["logits"]]}

    return run


def _compare_filter(function: str) -> Callable[[dict, dict], str | None]:
    def judge(outputs: dict, expected: dict) -> str | None:
        problem = compare_outputs(outputs, {"returned": expected["returned"]}, function=function,
                                  kind_hints={"a tuple of two tensors": HINT_TOPK_TUPLE})
        if problem:
            return problem
        got_all = outputs.get("outputs")
        if not isinstance(got_all, list) or len(got_all) != len(expected["outputs"]):
            return f"the hidden test could not read {function}'s results"
        largest = expected.get("largest", [0.0] * len(got_all))
        for got, want, mistakes, arg, large in zip(got_all, expected["outputs"], expected["mistakes"], expected["args"], largest):
            call = f"{function}(logits, {arg:g}) with logits of shape {tuple(want.shape)}"
            if not isinstance(got, np.ndarray) or got.shape != want.shape:
                return f"{call} should return logits' shape {tuple(want.shape)}, got {describe(got)}"
            if same_filter(got, want):
                continue
            if function == "top_p_filter" and large > 80:
                return HINT_TOPP_OVERFLOW.format(call=call, top=large)
            if function == "top_p_filter" and not np.isfinite(got).any(axis=-1).all():
                return HINT_TOPP_EMPTY.format(p=arg)
            for hint, wrong in mistakes:
                if np.allclose(got, wrong, rtol=1e-4, atol=1e-5) and not np.allclose(want, wrong, rtol=1e-4, atol=1e-5):
                    return f"{call}: {hint}"
            removed = np.isinf(want)
            if removed.any() and np.isfinite(got[removed]).all() and (got[removed] <= -1e3).all():
                return HINT_FILTER_BIG_NEGATIVE
            if function == "top_k_filter" and (np.isfinite(got).sum(-1) == min(arg, want.shape[-1])).all():
                return f"{call}: {HINT_TOPK_TIES}"
            return f"{call} differs from the reference (the kept tokens or their logits)"
        return None

    return judge


PROBES = {
    "check_greedy": Probe(
        exercise="ex_greedy",
        make_inputs=_greedy_probe_inputs,
        run=GREEDY_PROBE_RUN,
        reference=_greedy_reference,
        compare=_compare_greedy,
        forbidden=("tfedu.generate",),
    ),
    "check_top_k": Probe(
        exercise="ex_top_k",
        make_inputs=_top_k_probe_inputs,
        run=_filter_run("top_k_filter"),
        reference=_filter_reference(filter_top_k),
        compare=_compare_filter("top_k_filter"),
        forbidden=("tfedu.generate",),
    ),
    "check_top_p": Probe(
        builds=ELEMENTARY | SOFTMAX,
        exercise="ex_top_p",
        make_inputs=_top_p_probe_inputs,
        run=_filter_run("top_p_filter"),
        reference=_filter_reference(filter_top_p),
        compare=_compare_filter("top_p_filter"),
        forbidden=("tfedu.generate",),
    ),
}


HINTS = {
    "ex_greedy": Hints(
        number="8.1",
        check="check_greedy_generate",
        idea=(
            "Greedy decoding is a loop: run the model on the sequence so far, read its prediction for the next "
            "token, append that token, repeat. Only the last position's logits predict the token that comes next "
            "(the other positions predict tokens you already have), and greedy takes their argmax over the "
            "vocabulary, so a prompt always gives the same text. The model knows n_ctx positions only, so each "
            "call sees at most the most recent n_ctx tokens; and dropout must be off, in evaluation mode."
        ),
        approach=(
            "Switch the model to evaluation mode once. Then, max_new_tokens times: crop the sequence to its last "
            "model.cfg.n_ctx tokens (a slice of the positions axis, counted from the end; a shorter sequence "
            "passes whole); call the model, which gives logits (batch, pos, d_vocab); take the last position, "
            "(batch, d_vocab); the argmax over the vocabulary axis gives one id per row, (batch, 1) if you keep "
            "that axis; append it to the whole, uncropped sequence with torch.cat along the positions axis, "
            "(batch, pos + 1). Rebind the name to the new tensor rather than writing into ids, and return the "
            "grown sequence, (batch, pos + max_new_tokens)."
        ),
        skeleton=(
            "@torch.no_grad()\n"
            "def greedy_generate(model, ids, max_new_tokens):\n"
            "    model.____()\n"
            "    for _ in range(max_new_tokens):\n"
            "        context = ids[:, ____]  # the last n_ctx tokens at most\n"
            "        logits = model(context)  # (batch, pos, d_vocab)\n"
            "        next_id = logits[:, ____].argmax(dim=____, keepdim=True)  # (batch, 1)\n"
            "        ids = torch.cat([ids, ____], dim=____)  # (batch, pos + 1)\n"
            "    return ids\n"
        ),
    ),
    "ex_top_k": Hints(
        number="8.2",
        check="check_top_k_filter",
        idea=(
            "Top-k keeps, in every row, the k largest logits and removes the others by setting them to minus "
            "infinity, so that the softmax that comes later gives them probability exactly 0 and the kept tokens "
            "share all the mass. The filter returns logits, not probabilities, in the input's shape. A row's "
            "cut-off is its k-th largest value: every logit at least that large stays, so tokens tied with the "
            "k-th one stay too (that is what transformers does)."
        ),
        approach=(
            "Work along the last axis, so that any leading axes are just more rows. (1) Find each row's k-th "
            "largest value: torch.topk gives the k largest values of each row in descending order, and the last "
            "of them is the threshold; keep it as a (..., 1) column so that it broadcasts against its row. (2) "
            "Compare every logit with its row's threshold: strictly smaller means removed. (3) Return a new "
            "tensor with -inf where removed and the logit itself elsewhere, using an out-of-place fill "
            "(masked_fill, or torch.where), so the caller's logits stay as they were."
        ),
        skeleton=(
            "def top_k_filter(logits, k):\n"
            "    kth_largest = torch.topk(logits, k, dim=____).values[____]  # (..., 1): each row's threshold\n"
            "    return logits.masked_fill(____, ____)  # remove what lies below the threshold\n"
        ),
    ),
    "ex_top_p": Hints(
        number="8.3",
        check="check_top_p_filter",
        idea=(
            "The nucleus is the smallest set of most likely tokens whose probabilities add up to at least p. "
            "Ranked from most to least likely, a token is in it exactly when the tokens ranked above it hold "
            "less than p: so the token that carries the running total past p is in, and the most likely token "
            "is always in (nothing is above it: mass 0). Every other token gets -inf. Sorting is only a means: "
            "the result is logits, not probabilities, in the tokens' own order."
        ),
        approach=(
            "Along the last axis: (1) sort each row's logits in descending order and keep the permutation the "
            "sort returns, both (..., d_vocab). (2) The softmax of the sorted logits gives the sorted "
            "probabilities (torch's softmax subtracts the row's max, so logits near 100 do not overflow); their "
            "running sum along the row, less each token's own probability, is the mass ranked above it. (3) A "
            "token is dropped where that mass already reaches p: a boolean mask, still in sorted order. (4) Put "
            "the mask back in vocabulary order: place i of the sorted mask belongs to the token whose index "
            "stands at place i of the permutation, so write it there (scatter); reading with gather applies the "
            "permutation the wrong way round. (5) Fill -inf where the mask is True, out of place, and return."
        ),
        skeleton=(
            "def top_p_filter(logits, p):\n"
            "    sorted_logits, order = logits.sort(dim=____, descending=____)  # (..., d_vocab)\n"
            "    probs = ____  # the sorted probabilities\n"
            "    mass_before = ____  # the probability of the tokens ranked above each one\n"
            "    drop_sorted = ____  # True where the nucleus is full before this token (sorted order)\n"
            "    drop = drop_sorted.scatter(____, ____, ____)  # back to the tokens' own order\n"
            "    return logits.masked_fill(____, ____)\n"
        ),
    ),
}

"""Checkers for notebooks/08_training_and_decoding.ipynb: the training parts and the decoders.

Each exercise is checked against a reference (PyTorch's own where there is one) after first trying
the mistakes seen in tutorials and learners' answers:

- 8.1 ``get_batch(data, batch_size, seq_len, generator)``: checked by properties, not one draw (each
  row a run of the data, y the next tokens, the first and the last start both drawn, the generator
  used): the last window never drawn (randint's excluded bound), windows past the end, the global
  random state, one start for the whole batch, y equal to x or shifted backwards, x a whole window.
- 8.2 ``cross_entropy(logits, targets, ignore_index=-100)``: against ``F.cross_entropy``; exp
  overflowing on logits around 1000, the log of an underflowed probability, the sum, the sign, the
  mean over the vocabulary, probabilities instead of logs, ignored positions counted or scored, the
  ignore_index argument ignored; the gradient.
- 8.3 ``adamw_step(param, grad, m, v, t, lr, betas, eps, weight_decay)``: six steps against
  ``torch.optim.AdamW``; Adam with L2, the decay without the learning rate or none, no bias
  correction or the wrong step number, eps inside the root, the betas swapped or weighed the wrong
  way, the decay after the update, NaN from a negative v or a zero correction.
- 8.4 ``lr_schedule(step, max_lr, warmup_steps, total_steps, min_lr_ratio=0.1)``: four schedules
  at every step and past the end against ``tfedu.train.learning_rate``'s rule (warm-up lr · (t + 1) /
  W); the lr · t / W convention, the cosine not offset, a floor of 0 or not scaled, a whole period, a
  straight line, the floor a step late, a schedule that moves after its end.
- 8.5 ``clip_grad_norm(parameters, max_norm)``: against ``torch.nn.utils.clip_grad_norm_``; each
  parameter clipped alone, clipping below the threshold, the sum of the norms, gradients not changed
  in place, the clipped norm returned, a parameter without .grad.
- 8.6 ``train_loop(model, optimizer, train_ids, generator, *, steps, ..., resume, until)``: a tiny GPT
  twelve steps against the reference loop, cut after eight and resumed (the last four losses equal),
  the earlier parts bound to the references; gradients piling up or cleared too late, the learning
  rate never set, a step ahead or scheduled over the call, no clipping, the evaluations' steps or
  mode, no checkpoint stored, the optimizer, generator, model or step left out of the resume.
- 8.7 ``greedy_generate(model, ids, max_new_tokens)``: the first position's logits instead of the
  last's, the argmax over the positions instead of the vocabulary, returning only the new tokens or
  only the prompt, feeding the prompt again each step instead of the grown sequence, no cropping to
  ``model.cfg.n_ctx`` (the model refuses) or cropping the start instead of the end, sampling instead
  of the argmax, dropout left on (no ``model.eval()``), the prompt changed in place. Compared with
  ``tfedu.generate.generate(..., do_sample=False)`` on a tiny seeded GPT, with a prompt near n_ctx.
- 8.8 ``sample_next(logits, temperature, generator)``: 4000 draws at three temperatures whose
  frequencies must follow softmax(logits / T); T multiplying the logits, T ignored or applied to the
  probabilities, the argmax at every temperature, a division by zero at T = 0, the global random
  state, overflow on large logits at a low temperature.
- 8.9 ``top_k_filter(logits, k)``: k + 1 or k - 1 tokens kept, the k smallest kept, probabilities
  returned (softmax applied), 0 or a large negative number instead of -inf, ties at the k-th value
  dropped (transformers keeps every logit >= the k-th largest), the input changed in place, a filter
  that works on one row (d_vocab,) but not on a batch. Compared with ``tfedu.generate.filter_top_k``.
- 8.10 ``top_p_filter(logits, p)``: the nucleus without the token that carries the mass across p,
  the tokens sorted least likely first, probabilities returned (renormalised or not), an empty
  nucleus for a small p (the most likely token is always kept), the mask put back in the wrong
  order (left in sorted order, or gathered where it should be scattered), 0 instead of -inf, the
  input changed in place, one row only, probabilities taken as exp over the sum without subtracting the
  largest logit (NaN on logits near 100: a confident model, or a temperature of 0.1). Compared with
  ``tfedu.generate.filter_top_p``.
- 8.11 ``beam_search(model, ids, max_new_tokens, num_beams)``: against ``tfedu.generate.beam_search``
  without end-of-text (equal to transformers' ``generate(num_beams=...)``) on a tiny seeded GPT whose beams
  beat greedy: raw logits or probabilities summed instead of log-probabilities, extensions ranked by
  their newest token alone, the greedy continuation (each beam's own best token, or copies of the
  prompt as the first beams), new tokens appended to the beams in rank order instead of to their
  parents, the worst beam returned, only the new tokens or every beam returned, no cropping or the
  start kept, sampling, dropout left on, the prompt changed in place.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

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
    name_mistake,
    names_bound,
    watch_calls,
)
from tfedu.checks.probes import (CLEANUP, HELPERS, as_array, backward, compare_outputs, gpt_from_inputs, leaf,
                                 named_in_outputs)
from tfedu.config import ModelConfig
from tfedu.data import CheckpointFile
from tfedu.generate import beam_search, filter_top_k, filter_top_p, generate
from tfedu.model import GPT

NEG_INF = float("-inf")
F64 = torch.float64


# ----------------------------------------------------------------------------- 8.1 get_batch

HINT_GB_PAIR = (
    "get_batch should return two tensors, (x, y), each of shape (batch_size, seq_len): the inputs and the targets"
)
HINT_GB_SHAPE = "{name} has shape {got}, expected (batch_size, seq_len) = {want}"
HINT_GB_LONG_X = (
    "x has seq_len + 1 columns: a window holds seq_len + 1 tokens, and x is all of them but the last, y all of them "
    "but the first"
)
HINT_GB_DTYPE = "{name} has dtype {got}: token ids go to the embedding and the loss as integers, torch.long"
HINT_GB_NOT_WINDOW = (
    "row {row} of x is not a run of consecutive tokens of data: each row is one window, the tokens of data from a "
    "random start onwards, in order"
)
HINT_GB_Y_IS_X = "y equals x: the targets are the inputs moved one place on, each position's target is the next token"
HINT_GB_Y_BACKWARDS = (
    "y is x moved one place back (the token before each input): the target of each position is the token after it"
)
HINT_GB_Y_NOT_NEXT = (
    "row {row} of y is not the next tokens after row {row} of x: the window of seq_len + 1 tokens from s gives x = "
    "its first seq_len tokens and y = its last seq_len"
)
HINT_GB_LAST_NEVER = (
    "in {draws} windows from a data tensor of {n} tokens with seq_len = {seq_len}, the last possible start ({last}) "
    "never came up: a window of seq_len + 1 tokens fits at every start from 0 to len(data) - seq_len - 1 inclusive "
    "(remember that torch.randint's upper bound is excluded)"
)
HINT_GB_FIRST_NEVER = (
    "in {draws} windows the start 0 never came up: every start from 0 to len(data) - seq_len - 1 is a window"
)
HINT_GB_SAME_START = (
    "every row of the batch is the same window: draw one random start per row (batch_size of them)"
)
HINT_GB_GENERATOR = (
    "two calls with generators seeded alike gave different batches: draw the starts with the generator you are "
    "given (torch.randint takes it as generator=), not the global random state, so that a run can be repeated"
)
HINT_GB_NOT_RANDOM = (
    "calls with different generator states gave the same windows: the starts must be drawn at random each call"
)
HINT_GB_MUTATED = "your get_batch changed the caller's `{name}` in place: build new tensors"
HINT_GB_CALL = (
    "keep the signature get_batch(data, batch_size, seq_len, generator): data is a 1-D tensor of token ids and "
    "generator a torch.Generator; return x and y, each (batch_size, seq_len)"
)


def reference_get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len + 1`` tokens: inputs and targets (the exercise's answer)."""
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)  # (batch,)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])  # (batch, seq_len + 1)
    return windows[:, :-1], windows[:, 1:]


def batch_problem(data: np.ndarray, batch_size: int, seq_len: int, x: Any, y: Any) -> str | None:
    """What is wrong with one batch drawn from ``data``, whose values are distinct (so a window is found by its first)."""
    want = (batch_size, seq_len)
    for name, value in (("x", x), ("y", y)):
        if not isinstance(value, np.ndarray):
            return HINT_GB_PAIR
        if value.shape != want:
            if name == "x" and value.shape == (batch_size, seq_len + 1):
                return HINT_GB_LONG_X
            return HINT_GB_SHAPE.format(name=name, got=tuple(value.shape), want=want)
        if value.dtype != np.int64:
            return HINT_GB_DTYPE.format(name=name, got=f"torch.{value.dtype}" if value.dtype.kind == "f" else value.dtype)
    where = {int(token): i for i, token in enumerate(data)}
    for row in range(batch_size):
        start = where.get(int(x[row, 0]))
        if start is None or start + seq_len > len(data) or not np.array_equal(x[row], data[start:start + seq_len]):
            return HINT_GB_NOT_WINDOW.format(row=row)
        if np.array_equal(y[row], x[row]):
            return HINT_GB_Y_IS_X
        if start >= 1 and np.array_equal(y[row], data[start - 1:start - 1 + seq_len]):
            return HINT_GB_Y_BACKWARDS
        if start + seq_len + 1 > len(data) or not np.array_equal(y[row], data[start + 1:start + seq_len + 1]):
            return HINT_GB_Y_NOT_NEXT.format(row=row)
    return None


def coverage_problem(data: np.ndarray, seq_len: int, xs: list[np.ndarray]) -> str | None:
    """Whether the starts of many windows reach both ends of the range they may take."""
    starts = {int(np.flatnonzero(data == x[0])[0]) for batch in xs for x in batch}
    draws, last = sum(len(batch) for batch in xs), len(data) - seq_len - 1
    if last not in starts:
        return HINT_GB_LAST_NEVER.format(draws=draws, n=len(data), seq_len=seq_len, last=last)
    if 0 not in starts:
        return HINT_GB_FIRST_NEVER.format(draws=draws)
    return None


def _as_batch(result: Any) -> tuple[Any, Any]:
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise CheckFailure(HINT_GB_PAIR)
    return tuple(r.numpy() if isinstance(r, torch.Tensor) else None for r in result)


def _call_get_batch(get_batch: Any, data: torch.Tensor, batch_size: int, seq_len: int, seed: int,
                    global_seed: int = 0) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(global_seed)  # moved between equal seeds: an answer that draws from it differs
        result = call_on_copies(get_batch, {"data": data, "batch_size": batch_size, "seq_len": seq_len,
                                            "generator": generator},
                                name="get_batch", mutated_hint=HINT_GB_MUTATED, error_hint=HINT_GB_CALL)
    return _as_batch(result)


@checker("get_batch")
def check_get_batch(get_batch) -> None:
    """Check a learner's ``get_batch(data, batch_size, seq_len, generator) -> (x, y)``.

    By properties, not by one random draw: on data of distinct token ids each row of x is a window of
    consecutive tokens and y the same window one token on; many windows from a short tensor reach
    both the first and the last start; the rows of a batch differ; the same generator seed gives the
    same batch whatever the global random state; different generator states give different batches.
    """
    data = torch.arange(1000, 1060)  # distinct ids: a window is found by its first token
    x, y = _call_get_batch(get_batch, data, 16, 8, 0)
    problem = batch_problem(data.numpy(), 16, 8, x, y)
    if problem:
        raise CheckFailure(problem)
    if len({int(v) for v in x[:, 0]}) == 1:
        raise CheckFailure(HINT_GB_SAME_START)
    again = _call_get_batch(get_batch, data, 16, 8, 0, global_seed=1)
    if not (np.array_equal(again[0], x) and np.array_equal(again[1], y)):
        raise CheckFailure(HINT_GB_GENERATOR)
    other = _call_get_batch(get_batch, data, 16, 8, 1)
    if np.array_equal(other[0], x):
        raise CheckFailure(HINT_GB_NOT_RANDOM)
    short = torch.arange(500, 511)  # 11 tokens, seq_len 8: starts 0, 1 and 2
    batches = [_call_get_batch(get_batch, short, 40, 8, seed) for seed in range(5)]
    for bx, by in batches:
        problem = batch_problem(short.numpy(), 40, 8, bx, by)
        if problem:
            raise CheckFailure(f"{problem} (data of 11 tokens, seq_len 8)")
    problem = coverage_problem(short.numpy(), 8, [bx for bx, _ in batches])
    if problem:
        raise CheckFailure(problem)


# ----------------------------------------------------------------------------- 8.2 cross_entropy

HINT_CE_OVERFLOW = (
    "inf or NaN on logits around 1000 (a confident model): exp of a large logit overflows. Subtract each row's "
    "largest logit before exponentiating (the log-sum-exp of the shifted logits, plus the largest logit back)"
)
HINT_CE_LOG_OF_SOFTMAX = (
    "inf where a target's logit sits 1000 below its row's largest: you took the log of a probability that "
    "underflowed to 0. Work in logs throughout: minus the log-probability is the row's log-sum-exp minus the "
    "target's logit, with no exp of that difference in between"
)
HINT_CE_SUM = "you returned the sum over the positions: the loss is their mean (the sum grows with the batch)"
HINT_CE_SIGN = "the loss has the wrong sign: it is minus the mean log-probability of the targets, a positive number"
HINT_CE_ALL_VOCAB = (
    "you averaged over the vocabulary as well: each position contributes one term, minus the log-probability of "
    "its own target, and the mean runs over the positions only"
)
HINT_CE_PROB = (
    "you averaged minus the probabilities of the targets: the loss takes their logarithm, minus log p(target)"
)
HINT_CE_IGNORED_COUNTED = (
    "positions whose target is ignore_index left the loss but still count in the mean: divide by the number of "
    "positions that are not ignored"
)
HINT_CE_IGNORED_USED = (
    "positions whose target is ignore_index were scored (or used as an index): they contribute nothing, "
    "neither to the sum nor to the count"
)
HINT_CE_IGNORE_FIXED = (
    "cross_entropy(logits, targets, ignore_index={given}) ignored the positions of -100 instead: use the "
    "ignore_index argument"
)
HINT_CE_SHAPE = "cross_entropy should return one number, a tensor of shape (), got {got}"
HINT_CE_FUSED = (
    "you called {route}: the exercise is to build the loss yourself from the log-sum-exp (the grader scores a "
    "library loss zero)"
)
HINT_CE_MUTATED = "your cross_entropy changed the caller's `{name}` in place: build new tensors"
HINT_CE_CALL = (
    "keep the signature cross_entropy(logits, targets, ignore_index=-100): logits (..., d_vocab) of floats, "
    "targets (...) of token ids; return the mean loss as a tensor of shape ()"
)
HINT_CE_GRAD = (
    "the loss is right but its gradient with respect to the logits is not PyTorch's: is part of the computation "
    "detached (.detach(), .item(), torch.no_grad()), or the row maximum used without its gradient path?"
)
CE_WATCHED = tuple((owner, name) for owner, names in ((F, ("cross_entropy", "nll_loss", "log_softmax")),
                                                       (torch, ("logsumexp", "log_softmax")))
                   for name in names if hasattr(owner, name))
CE_FORBIDDEN = ("torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss", "torch.nn.functional.log_softmax",
                "torch.log_softmax", "torch.logsumexp", "torch.nn.CrossEntropyLoss", "torch.nn.NLLLoss",
                "torch.special.logsumexp", "torch.special.log_softmax")


def reference_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean of logsumexp(row) - row[target] over the positions whose target is not ignore_index (the answer)."""
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    keep = targets != ignore_index
    logits, targets = logits[keep], targets[keep]
    top = logits.max(dim=-1, keepdim=True).values  # (n, 1)
    lse = top.squeeze(-1) + (logits - top).exp().sum(dim=-1).log()  # (n,)
    return (lse - logits.gather(-1, targets[:, None]).squeeze(-1)).mean()


def _ce_variant(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, mistake: str) -> torch.Tensor:
    """The loss with one of the known mistakes, in float64."""
    flat, t = logits.detach().to(F64).reshape(-1, logits.shape[-1]), targets.reshape(-1)
    keep = t != ignore_index
    logp = flat.log_softmax(-1)
    picked = logp[keep].gather(-1, t[keep][:, None]).squeeze(-1)
    return {"sum": lambda: -picked.sum(), "sign": lambda: picked.mean(), "all-vocab": lambda: -logp[keep].mean(),
            "prob": lambda: -picked.exp().mean(), "ignored-counted": lambda: -picked.sum() / t.numel()}[mistake]()


CE_MISTAKES = (("sum", HINT_CE_SUM), ("sign", HINT_CE_SIGN), ("all-vocab", HINT_CE_ALL_VOCAB), ("prob", HINT_CE_PROB),
               ("ignored-counted", HINT_CE_IGNORED_COUNTED))


def _ce_mistakes(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> list[tuple[str, torch.Tensor]]:
    return [(hint, _ce_variant(logits, targets, ignore_index, mistake)) for mistake, hint in CE_MISTAKES]


def _ce_inputs(seed: int, shape: tuple[int, ...], d_vocab: int, *, scale: float = 2.0, dtype: torch.dtype = F64,
               ignored: float = 0.0, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, d_vocab, generator=gen, dtype=F64)).to(dtype)
    targets = torch.randint(0, d_vocab, shape, generator=gen)
    if ignored:
        drop = torch.rand(shape, generator=gen) < ignored
        drop.view(-1)[0] = True  # at least one
        drop.view(-1)[-1] = False  # and one scored
        targets = targets.masked_fill(drop, ignore_index)
    return logits, targets


def _call_cross_entropy(cross_entropy: Any, logits, targets, ignore_index: int | None = None) -> Any:
    args = {"logits": logits, "targets": targets}
    if ignore_index is not None:
        args["kw:ignore_index"] = ignore_index
    with watch_calls(*CE_WATCHED) as called:
        result = call_on_copies(cross_entropy, args, name="cross_entropy", mutated_hint=HINT_CE_MUTATED,
                                error_hint=HINT_CE_CALL)
    if called:
        raise CheckFailure(HINT_CE_FUSED.format(route=called[0]))
    return result


def _check_loss(got: Any, logits, targets, ignore_index: int, what: str, *, nan_hint: str | None = None) -> torch.Tensor:
    expect(isinstance(got, torch.Tensor), f"{what} should return the loss as a tensor of shape (), got {describe(got)}")
    expect(got.dim() == 0, HINT_CE_SHAPE.format(got=describe(got)))
    want = F.cross_entropy(logits.detach().to(F64).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index)
    if torch.isfinite(got) and not is_close(got, want, rtol=1e-6, atol=1e-8):
        name_mistake(got.reshape(()), want, _ce_mistakes(logits, targets, ignore_index), rtol=1e-6, atol=1e-8)
    compare(got, want.to(got.dtype) if got.is_floating_point() else want, what=what, check_dtype=False, rtol=1e-5,
            atol=1e-6, nan_hint=nan_hint)
    return got


@checker("cross-entropy")
def check_cross_entropy(cross_entropy) -> None:
    """Check a learner's ``cross_entropy(logits, targets, ignore_index=-100) -> Float[Tensor, ""]``.

    Against ``F.cross_entropy``: moderate logits of shape (batch, pos, d_vocab) in float64; logits
    around 1000 in float32 (exp overflows without the shift); a target 1000 below its row's largest
    logit (the log of an underflowed probability); positions ignored by -100 and by a given index;
    the gradient with respect to the logits.
    """
    logits, targets = _ce_inputs(0, (3, 5), 11)
    got = _call_cross_entropy(cross_entropy, logits, targets)
    _check_loss(got, logits, targets, -100, "cross_entropy(logits, targets) with logits (3, 5, 11), float64")
    logits, targets = _ce_inputs(1, (4, 6), 13, scale=1.0, dtype=torch.float32)
    logits = logits + 1000.0
    got = _call_cross_entropy(cross_entropy, logits, targets)
    _check_loss(got, logits, targets, -100, "cross_entropy(logits, targets) with logits around 1000, float32",
                nan_hint=HINT_CE_OVERFLOW)
    logits, targets = _ce_inputs(2, (2, 4), 9, dtype=torch.float32)
    logits = logits.scatter(-1, targets[..., None], -1000.0)  # every target far below its row's largest logit
    got = _call_cross_entropy(cross_entropy, logits, targets)
    _check_loss(got, logits, targets, -100, "cross_entropy(logits, targets) where each target's logit is -1000",
                nan_hint=HINT_CE_LOG_OF_SOFTMAX)
    logits, targets = _ce_inputs(3, (3, 8), 10, ignored=0.4)
    try:
        got = _call_cross_entropy(cross_entropy, logits, targets)
    except CheckFailure as failure:
        if "raised" in str(failure):
            raise CheckFailure(f"{HINT_CE_IGNORED_USED} ({failure})") from None
        raise
    _check_loss(got, logits, targets, -100, "cross_entropy(logits, targets) where some targets are -100 (ignored)",
                nan_hint=HINT_CE_IGNORED_USED)
    logits, targets = _ce_inputs(4, (2, 7), 12, ignored=0.4, ignore_index=0)
    targets = targets.masked_fill(targets == -100, 0)
    got = _call_cross_entropy(cross_entropy, logits, targets, ignore_index=0)
    if isinstance(got, torch.Tensor) and got.dim() == 0 and is_close(
            got, F.cross_entropy(logits.reshape(-1, 12), targets.reshape(-1)), rtol=1e-6, atol=1e-8):
        raise CheckFailure(HINT_CE_IGNORE_FIXED.format(given=0))
    _check_loss(got, logits, targets, 0, "cross_entropy(logits, targets, ignore_index=0)")
    logits, targets = _ce_inputs(5, (2, 3), 7)
    logits.requires_grad_(True)
    got = call_learner(cross_entropy, logits, targets, name="cross_entropy", error_hint=HINT_CE_CALL)
    expect(isinstance(got, torch.Tensor) and got.requires_grad,
           "no gradient flows back through cross_entropy: was it computed under torch.no_grad(), or detached?")
    (grad,) = torch.autograd.grad(got, logits)
    mine = logits.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(F.cross_entropy(mine.reshape(-1, 7), targets.reshape(-1)), mine)
    expect(is_close(grad, want, rtol=1e-6, atol=1e-9), HINT_CE_GRAD)


# ----------------------------------------------------------------------------- 8.3 adamw_step

HINT_AW_L2 = (
    "you added the weight decay to the gradient (Adam with L2): Adam then divides it by sqrt(v) like the rest, so "
    "weights with large gradients are barely decayed. AdamW decays the weights themselves, apart from the "
    "gradient: the weight shrinks by a factor of 1 - lr · weight_decay, and the Adam step uses the gradient alone"
)
HINT_AW_DECAY_NO_LR = (
    "the weights shrank by a factor of 1 - weight_decay: PyTorch's AdamW scales the decay by the learning rate, "
    "1 - lr · weight_decay, so that the schedule lowers both together"
)
HINT_AW_NO_DECAY = "no weight decay: with weight_decay > 0 each step first shrinks the weights by a factor of 1 - lr · weight_decay"
HINT_AW_NO_BIAS_CORRECTION = (
    "no bias correction: m and v start at zero, so in the first steps they are too small by factors of 1 - "
    "beta1^t and 1 - beta2^t (t the step number, from 1); divide each by its factor before the update"
)
HINT_AW_BIAS_T = (
    "the bias correction uses the wrong step number: after the t-th step (t = 1 for the first) the factors are 1 - "
    "beta1^t and 1 - beta2^t"
)
HINT_AW_EPS_INSIDE = (
    "eps is inside the square root: PyTorch divides by sqrt(v_hat) + eps. The two differ wherever v_hat is "
    "comparable to eps², for weights with tiny gradients"
)
HINT_AW_BETA_SWAPPED = (
    "the running means weigh the wrong way: the old value keeps the weight beta (0.9 or 0.95) and the new "
    "gradient gets 1 - beta"
)
HINT_AW_BETAS_SWAPPED = "beta1 and beta2 are swapped: beta1 (0.9) smooths the gradient m, beta2 (0.95) its square v"
HINT_AW_DECAY_AFTER = (
    "the decay came after the Adam update: PyTorch shrinks the weight first, then subtracts the update "
    "(the two orders differ by lr² · weight_decay · update)"
)
HINT_AW_SIGN = "the update goes the wrong way: subtract lr · m_hat / (sqrt(v_hat) + eps) from the weight (a descent step)"
HINT_AW_NONFINITE = (
    "adamw_step returned NaN or inf at step {t}: a square root of a negative v (v is the running mean of the "
    "squared gradient, never negative), or a division by zero in the bias correction (t counts from 1, so "
    "1 - beta^t is never 0)"
)
HINT_AW_RETURN = (
    "adamw_step should return three tensors, (param, m, v): the new weight and the new running means, each of "
    "param's shape"
)
HINT_AW_MUTATED = (
    "your adamw_step changed the caller's `{name}` in place: return new tensors instead (the notebook's optimizer "
    "stores them)"
)
HINT_AW_CALL = (
    "keep the signature adamw_step(param, grad, m, v, t, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1): t "
    "is the step number, 1 for the first; return (param, m, v)"
)


def reference_adamw_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, lr: float,
                         betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of AdamW as torch.optim.AdamW takes it (the exercise's answer)."""
    beta1, beta2 = betas
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad * grad
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
    param = param * (1 - lr * weight_decay)  # decoupled weight decay, first
    return param - lr * m_hat / (v_hat.sqrt() + eps), m, v


def _adamw_variant(param, grad, m, v, t, lr, betas, eps, weight_decay, mistake: str):
    beta1, beta2 = betas
    if mistake == "betas-swapped":
        beta1, beta2 = beta2, beta1
    g = grad + weight_decay * param if mistake == "l2" else grad
    if mistake == "beta-swapped":
        m, v = (1 - beta1) * m + beta1 * g, (1 - beta2) * v + beta2 * g * g
    else:
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
    t_used = t + 1 if mistake == "bias-t" else t
    m_hat, v_hat = (m, v) if mistake == "no-bias-correction" else (m / (1 - beta1**t_used), v / (1 - beta2**t_used))
    denom = (v_hat + eps).sqrt() if mistake == "eps-inside" else v_hat.abs().sqrt() + eps
    update = lr * m_hat / denom * (-1 if mistake == "sign" else 1)
    shrink = {"l2": 1.0, "no-decay": 1.0, "decay-no-lr": 1 - weight_decay}.get(mistake, 1 - lr * weight_decay)
    param = (param - update) * shrink if mistake == "decay-after" else param * shrink - update
    return param, m, v


AW_MISTAKES = (("l2", HINT_AW_L2), ("decay-no-lr", HINT_AW_DECAY_NO_LR), ("no-decay", HINT_AW_NO_DECAY),
               ("no-bias-correction", HINT_AW_NO_BIAS_CORRECTION), ("bias-t", HINT_AW_BIAS_T),
               ("eps-inside", HINT_AW_EPS_INSIDE),
               ("beta-swapped", HINT_AW_BETA_SWAPPED), ("betas-swapped", HINT_AW_BETAS_SWAPPED),
               ("decay-after", HINT_AW_DECAY_AFTER), ("sign", HINT_AW_SIGN))


def adamw_trajectory(step_fn: Callable, param: torch.Tensor, grads: Sequence[torch.Tensor], **options: Any) -> torch.Tensor:
    """The weights after ``len(grads)`` steps of ``step_fn`` (a reference or a mistake), in float64."""
    p, m, v = param.clone(), torch.zeros_like(param), torch.zeros_like(param)
    for t, g in enumerate(grads, start=1):
        p, m, v = step_fn(p, g, m, v, t, **options)
    return p


def torch_adamw_trajectory(param: torch.Tensor, grads: Sequence[torch.Tensor], *, lr: float, betas: tuple[float, float],
                           eps: float, weight_decay: float) -> torch.Tensor:
    """The same steps by torch.optim.AdamW: the oracle."""
    p = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach()


def adamw_case(seed: int, shape: tuple[int, ...] = (4, 6), steps: int = 6) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weights and gradients whose sizes run from 1e-6 to 10 (eps matters for the smallest), float64."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(*shape, generator=gen, dtype=F64)
    scales = 10.0 ** torch.randint(-6, 2, shape, generator=gen).to(F64)  # each weight its own gradient size
    grads = [scales * torch.randn(*shape, generator=gen, dtype=F64) for _ in range(steps)]
    return param, grads


AW_OPTIONS = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.5}


def _learner_adamw(adamw_step: Any) -> Callable:
    def step(p, g, m, v, t, **options):
        result = call_on_copies(adamw_step, {"param": p, "grad": g, "m": m, "v": v, "t": t, **{f"kw:{k}": o for k, o in options.items()}},
                                name="adamw_step", mutated_hint=HINT_AW_MUTATED, error_hint=HINT_AW_CALL)
        if not (isinstance(result, (tuple, list)) and len(result) == 3 and all(isinstance(r, torch.Tensor) for r in result)
                and all(r.shape == p.shape for r in result)):
            raise CheckFailure(HINT_AW_RETURN)
        if not all(torch.isfinite(r).all() for r in result):
            raise CheckFailure(HINT_AW_NONFINITE.format(t=t))
        return tuple(result)
    return step


@checker("AdamW step")
def check_adamw_step(adamw_step) -> None:
    """Check a learner's ``adamw_step(param, grad, m, v, t, lr, betas, eps, weight_decay) -> (param, m, v)``.

    Six steps from zero running means, on float64 weights whose gradients range from 1e-6 to 10,
    compared with ``torch.optim.AdamW`` given the same gradients; then the defaults
    (betas 0.9 and 0.95, eps 1e-8, weight decay 0.1) and weight decay 0.
    """
    for seed, options in ((0, AW_OPTIONS), (1, {**AW_OPTIONS, "weight_decay": 0.0, "lr": 0.01}),
                          (2, {**AW_OPTIONS, "betas": (0.8, 0.99)})):
        param, grads = adamw_case(seed)
        got = adamw_trajectory(_learner_adamw(adamw_step), param, grads, **options)
        want = torch_adamw_trajectory(param, grads, **options)
        what = (f"the weights after {len(grads)} steps of adamw_step with lr={options['lr']}, betas={options['betas']}, "
                f"eps={options['eps']}, weight_decay={options['weight_decay']}")
        if not is_close(got, want, rtol=1e-9, atol=1e-12):
            variants = [(hint, adamw_trajectory(lambda *a, _m=mistake, **o: _adamw_variant(*a, **o, mistake=_m), param, grads,
                                                **options)) for mistake, hint in AW_MISTAKES]
            name_mistake(got, want, variants, rtol=1e-9, atol=1e-12)
        compare(got, want, what=what, check_dtype=False, rtol=1e-9, atol=1e-12)
    # The defaults: called without betas, eps and weight_decay.
    param, grads = adamw_case(3, steps=3)
    learner = _learner_adamw(adamw_step)
    got = adamw_trajectory(lambda p, g, m, v, t: learner(p, g, m, v, t, lr=0.02), param, grads)
    want = torch_adamw_trajectory(param, grads, lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    compare(got, want, what="three steps of adamw_step with lr=0.02 and the other arguments left at their defaults "
            "(betas (0.9, 0.95), eps 1e-8, weight_decay 0.1)", check_dtype=False, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- 8.4 lr_schedule

HINT_LR_ZERO_START = (
    "your first step has learning rate 0: that is the other convention in use, lr · t / W with t from 0 "
    "(nanoGPT's, for instance), which spends its first step on nothing. This course's step t (from 0) gets "
    "lr · (t + 1) / W, so the first step moves and step W - 1 reaches the peak"
)
HINT_LR_NO_OFFSET = (
    "the cosine starts at step 0 instead of at the end of the warm-up: its progress runs from 0 at step "
    "warmup_steps to 1 at the last step, total_steps - 1"
)
HINT_LR_TO_ZERO = (
    "the cosine ends at 0: it ends at min_lr_ratio · max_lr (a tenth of the peak by default, as GPT-3 and Chinchilla decay)"
)
HINT_LR_ABSOLUTE_MIN = "the floor is min_lr_ratio itself: it is a fraction of the peak, min_lr_ratio · max_lr"
HINT_LR_FULL_PERIOD = (
    "the learning rate comes back up: the schedule is half a cosine period, from the peak down to the floor, "
    "not a whole one"
)
HINT_LR_LINEAR = "the decay is a straight line: after the warm-up it follows half a cosine, (1 + cos(π · progress)) / 2"
HINT_LR_LATE = (
    "the floor is reached one step after the end: the last step, total_steps - 1, is the one that gets "
    "min_lr_ratio · max_lr"
)
HINT_LR_PAST_END = (
    "after total_steps the learning rate changes again: past the end of the schedule it stays at the floor "
    "(progress is capped at 1)"
)
HINT_LR_NO_SPAN = (
    "{call} divided by zero: when the warm-up ends on the last step (warmup_steps == total_steps - 1) the decay has "
    "no step to span. Divide by at least 1 there, so that the progress is 0 and that last step keeps the peak"
)
HINT_LR_TYPE = "{call} should return the learning rate as a float, got {got}"
HINT_LR_CALL = (
    "keep the signature lr_schedule(step, max_lr, warmup_steps, total_steps, min_lr_ratio=0.1): step counts from 0 "
    "and the function returns a float"
)


def reference_lr_schedule(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warm-up (lr · (step + 1) / W), then half a cosine to min_lr_ratio · max_lr at the last step."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    low = max_lr * min_lr_ratio
    return low + (max_lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


def _lr_variant(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float, mistake: str) -> float:
    if step < warmup_steps:
        return max_lr * (step if mistake == "zero-start" else step + 1) / warmup_steps
    start, span = warmup_steps, max(1, total_steps - 1 - warmup_steps)
    if mistake == "no-offset":
        start, span = 0, max(1, total_steps - 1)
    elif mistake == "late":
        span = max(1, total_steps - warmup_steps)
    progress = (step - start) / span if mistake == "past-end" else min(1.0, (step - start) / span)
    low = {"to-zero": 0.0, "absolute-min": min_lr_ratio}.get(mistake, max_lr * min_lr_ratio)
    shape = {"full-period": 0.5 * (1 + math.cos(2 * math.pi * progress)), "linear": 1 - progress}.get(
        mistake, 0.5 * (1 + math.cos(math.pi * progress)))
    return low + (max_lr - low) * shape


LR_MISTAKES = (("zero-start", HINT_LR_ZERO_START), ("no-offset", HINT_LR_NO_OFFSET), ("to-zero", HINT_LR_TO_ZERO),
               ("absolute-min", HINT_LR_ABSOLUTE_MIN), ("full-period", HINT_LR_FULL_PERIOD), ("linear", HINT_LR_LINEAR),
               ("late", HINT_LR_LATE), ("past-end", HINT_LR_PAST_END))

# (max_lr, warmup_steps, total_steps, min_lr_ratio), each schedule read at every step and 10 steps past its end
LR_CASES = ((3e-3, 10, 60, 0.1), (1.0, 4, 21, 0.25), (6e-4, 1, 40, 0.0), (0.02, 0, 17, 0.1))
# A warm-up that ends on the last step: no step to decay over, so step W keeps the peak (no division by zero).
LR_NO_SPAN = (1.0, 5, 6, 0.1)


def lr_problem(cases: Sequence[Sequence[float]], curves: Sequence[Sequence[Any]]) -> str | None:
    """Feedback on the learning rates ``curves`` read at steps 0 .. total + 9 of each case; shared with the hidden test."""
    for (max_lr, warmup, total, ratio), curve in zip(cases, curves):
        want = [reference_lr_schedule(s, max_lr, int(warmup), int(total), ratio) for s in range(int(total) + 10)]
        for step, (got, value) in enumerate(zip(curve, want)):
            call = f"lr_schedule({step}, {max_lr}, {int(warmup)}, {int(total)}, {ratio})"
            if not isinstance(got, (float, int)) or isinstance(got, bool):
                return HINT_LR_TYPE.format(call=call, got=describe(got))
        if all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12) for g, w in zip(curve, want)):
            continue
        for mistake, hint in LR_MISTAKES:
            wrong = [_lr_variant(s, max_lr, int(warmup), int(total), ratio, mistake) for s in range(int(total) + 10)]
            if all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12) for g, w in zip(curve, wrong)):
                return hint
        step = next(s for s, (g, w) in enumerate(zip(curve, want)) if not math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12))
        return (f"lr_schedule({step}, {max_lr}, {int(warmup)}, {int(total)}, {ratio}) returned {curve[step]!r}, expected "
                f"{want[step]!r}")
    return None


@checker("learning-rate schedule")
def check_lr_schedule(lr_schedule) -> None:
    """Check a learner's ``lr_schedule(step, max_lr, warmup_steps, total_steps, min_lr_ratio=0.1) -> float``.

    Four schedules read at every step and ten past the end, against ``tfedu.train.learning_rate``'s
    rule (the warm-up convention lr · (t + 1) / W with t from 0): with and without warm-up, floors of
    0, 0.1 and 0.25; then a warm-up that ends on the last step (no span to decay over: a division by
    zero is named). Named: the lr · t / W convention, the cosine not offset by the warm-up, a floor
    of 0 or not scaled by the peak, a whole cosine period, a linear decay, the floor reached a step
    late, a schedule that moves past its end.
    """
    curves = []
    for max_lr, warmup, total, ratio in LR_CASES:
        curves.append([call_learner(lr_schedule, step, max_lr, warmup, total, ratio, name="lr_schedule",
                                    error_hint=HINT_LR_CALL) for step in range(total + 10)])
    problem = lr_problem(LR_CASES, curves)
    if problem:
        raise CheckFailure(problem)
    max_lr, warmup, total, ratio = LR_NO_SPAN
    try:
        curve = [call_learner(lr_schedule, step, max_lr, warmup, total, ratio, name="lr_schedule", error_hint=HINT_LR_CALL)
                 for step in range(total + 10)]
    except CheckFailure as failure:
        if "ZeroDivisionError" in str(failure):
            raise CheckFailure(HINT_LR_NO_SPAN.format(call=f"lr_schedule({warmup}, {max_lr}, {warmup}, {total}, {ratio})")) from None
        raise
    problem = lr_problem([LR_NO_SPAN], [curve])
    if problem:
        raise CheckFailure(f"{problem} (the warm-up ends on the last step: that step keeps the peak)")
    got = call_learner(lr_schedule, 5, 1.0, 10, 100, name="lr_schedule", error_hint=HINT_LR_CALL)  # the default floor
    expect(math.isclose(got, 0.6), f"lr_schedule(5, 1.0, 10, 100) returned {got!r}, expected 0.6 (min_lr_ratio "
                                   "defaults to 0.1; step 5 of a 10-step warm-up)")


# ----------------------------------------------------------------------------- 8.5 clip_grad_norm

HINT_CLIP_PER_PARAM = (
    "you clipped each parameter's gradient on its own: clipping by the global norm treats all the gradients as "
    "one long vector, takes its norm once, and scales every gradient by the same factor"
)
HINT_CLIP_ALWAYS = (
    "you rescaled a gradient whose norm was already below max_norm: clipping only shrinks; below the threshold "
    "the gradients stay as they are"
)
HINT_CLIP_SUM_NORMS = (
    "the total norm is the sum of the parameters' norms: it is the square root of the sum of all the squared "
    "entries (the norm of the gradients put end to end), which is less"
)
HINT_CLIP_NOT_IN_PLACE = (
    "the parameters' .grad did not change: clipping works in place, scaling each p.grad (the optimizer reads "
    "p.grad next)"
)
HINT_CLIP_RETURNS_CLIPPED = (
    "you returned the norm after clipping: return the total norm before it (what clip_grad_norm_ returns, the "
    "number worth logging)"
)
HINT_CLIP_NONE_GRAD = (
    "a parameter without a gradient (p.grad is None: frozen, or unused in this forward pass) broke your function: "
    "skip those"
)
HINT_CLIP_NORM_TYPE = "{what}: return the total norm as a float or a tensor of shape (), got {got}"
HINT_CLIP_CALL = (
    "keep the signature clip_grad_norm(parameters, max_norm): parameters is a list of tensors with .grad, "
    "max_norm a float; scale the gradients in place and return the total norm before clipping"
)
CLIP_WATCHED = tuple((owner, name) for owner, names in ((torch.nn.utils, ("clip_grad_norm_", "clip_grad_norm",
                                                                            "get_total_norm", "clip_grads_with_norm_")),)
                     for name in names if hasattr(owner, name))


def reference_clip_grad_norm(parameters: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale every .grad by max_norm / (total norm + 1e-6) when that is below 1; return the total norm (the answer)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.sqrt(sum(((g.double() ** 2).sum() for g in grads), torch.zeros((), dtype=F64)))
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    for g in grads:
        g.mul_(scale)
    return total


def _clip_case(seed: int, scale: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((4, 3), (5,), (2, 2, 3), (7,))
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen, dtype=F64)) for s in shapes]
    for i, p in enumerate(params):
        p.grad = scale * (1 + 3 * i) * torch.randn(*p.shape, generator=gen, dtype=F64)  # parts of unequal size
    return params


def _clip_variant(grads: Sequence[torch.Tensor], max_norm: float, mistake: str) -> list[torch.Tensor]:
    norms = [g.norm() for g in grads]
    total = torch.sqrt(sum(n**2 for n in norms))
    if mistake == "per-param":
        return [g * min(1.0, max_norm / (float(n) + 1e-6)) for g, n in zip(grads, norms)]
    if mistake == "always":
        return [g * max_norm / (float(total) + 1e-6) for g in grads]
    total = sum(norms)  # "sum-norms"
    return [g * min(1.0, max_norm / (float(total) + 1e-6)) for g in grads]


CLIP_MISTAKES = (("per-param", HINT_CLIP_PER_PARAM), ("always", HINT_CLIP_ALWAYS), ("sum-norms", HINT_CLIP_SUM_NORMS))


def clip_problem(before: Sequence[np.ndarray], after: Sequence[np.ndarray], returned: Any, max_norm: float) -> str | None:
    """Feedback on one clipping: the gradients ``before`` and ``after`` it, and what the function returned."""
    grads = [torch.from_numpy(np.asarray(g, dtype=np.float64)) for g in before]
    total = float(torch.sqrt(sum((g**2).sum() for g in grads)))
    want = [g * min(1.0, max_norm / (total + 1e-6)) for g in grads]
    got = [torch.from_numpy(np.asarray(g, dtype=np.float64)) for g in after]
    if not all(is_close(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(got, want)):
        if all(is_close(a, b, rtol=0, atol=0) for a, b in zip(got, grads)) and total > max_norm:
            return HINT_CLIP_NOT_IN_PLACE
        for mistake, hint in CLIP_MISTAKES:
            if all(is_close(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(got, _clip_variant(grads, max_norm, mistake))):
                return hint
        return (f"after clip_grad_norm(parameters, max_norm={max_norm}) with a total norm of {total:.4g}, the gradients "
                f"differ from clip_grad_norm_'s")
    what = f"clip_grad_norm(parameters, max_norm={max_norm})"
    if isinstance(returned, torch.Tensor) and returned.dim() == 0:
        returned = float(returned)
    if not isinstance(returned, (float, int)) or isinstance(returned, bool):
        return HINT_CLIP_NORM_TYPE.format(what=what, got=describe(returned))
    if total > max_norm and math.isclose(returned, min(total, max_norm), rel_tol=1e-4):
        return HINT_CLIP_RETURNS_CLIPPED
    if not math.isclose(returned, total, rel_tol=1e-5):
        return f"{what} returned {returned:.6g}, expected the total norm before clipping, {total:.6g}"
    return None


@checker("gradient clipping")
def check_clip_grad_norm(clip_grad_norm) -> None:
    """Check a learner's ``clip_grad_norm(parameters, max_norm) -> total norm``, against ``clip_grad_norm_``.

    Parameters of four shapes whose gradients differ in size: a total norm far above max_norm (every
    gradient scaled by one factor), one below (nothing changes), a parameter whose .grad is None among
    them, and float32 gradients.
    """
    for seed, scale, max_norm in ((0, 5.0, 1.0), (1, 0.01, 1.0), (2, 3.0, 2.5)):
        params = _clip_case(seed, scale)
        before = [p.grad.clone().numpy() for p in params]
        with watch_calls(*CLIP_WATCHED) as called:
            returned = call_learner(clip_grad_norm, params, max_norm, name="clip_grad_norm", error_hint=HINT_CLIP_CALL)
        if called:
            raise CheckFailure(f"you called {called[0]}: the exercise is to clip by hand (the grader scores "
                               "torch.nn.utils' clipping zero)")
        problem = clip_problem(before, [p.grad.numpy() for p in params], returned, max_norm)
        if problem:
            raise CheckFailure(problem)
    params = _clip_case(3, 4.0)
    params.insert(2, torch.nn.Parameter(torch.zeros(3, dtype=F64)))  # .grad is None
    before = [p.grad.clone().numpy() for p in params if p.grad is not None]
    try:
        returned = call_learner(clip_grad_norm, params, 1.0, name="clip_grad_norm", error_hint=HINT_CLIP_CALL)
    except CheckFailure as failure:
        raise CheckFailure(f"{HINT_CLIP_NONE_GRAD} ({failure})") from None
    problem = clip_problem(before, [p.grad.numpy() for p in params if p.grad is not None], returned, 1.0)
    if problem:
        raise CheckFailure(f"{problem} (with a parameter whose .grad is None among them)")
    oracle = _clip_case(4, 2.0)
    params = [torch.nn.Parameter(p.detach().float()) for p in oracle]
    for p, q in zip(params, oracle):
        p.grad = q.grad.float()
    returned = call_learner(clip_grad_norm, params, 1.0, name="clip_grad_norm", error_hint=HINT_CLIP_CALL)
    want_norm = torch.nn.utils.clip_grad_norm_(oracle, 1.0)
    for p, q in zip(params, oracle):
        expect(is_close(p.grad, q.grad, rtol=1e-5, atol=1e-7),
               "with float32 gradients, yours differ from torch.nn.utils.clip_grad_norm_'s after clipping")
    got = float(returned) if isinstance(returned, (torch.Tensor, float, int)) else returned
    expect(isinstance(got, float) and math.isclose(got, float(want_norm), rel_tol=1e-5),
           f"with float32 gradients you returned {returned!r}, clip_grad_norm_ returns {float(want_norm):.6g}")


# ----------------------------------------------------------------------------- 8.6 train_loop

HINT_LOOP_NO_ZERO_GRAD = (
    "the gradients pile up from step to step: backward adds into .grad, so clear the gradients (optimizer.zero_grad()) "
    "before each backward pass"
)
HINT_LOOP_ZERO_AFTER_BACKWARD = (
    "the gradients were cleared between backward and the optimizer's step, so each step used zero gradients: clear "
    "them before backward, not after"
)
HINT_LOOP_CONSTANT_LR = (
    "the learning rate never changed: at every step, before the optimizer's step, set the learning rate of every "
    "param group of the optimizer to the schedule's value for that step"
)
HINT_LOOP_SCHEDULE_SHIFT = (
    "the schedule is one step ahead: step t (from 0) uses the schedule's rate for step t, so the first step has the "
    "first warm-up rate"
)
HINT_LOOP_SCHEDULE_TOTAL = (
    "the schedule was given the steps of this call instead of the run's: lr_schedule takes steps, the length of the "
    "whole run, even when until stops the call early or resume starts it late"
)
HINT_LOOP_NO_CLIP = (
    "the gradients were not clipped (or were clipped after the optimizer's step, too late to matter): clip them to a "
    "global norm of 1.0 between backward and the step"
)
HINT_LOOP_EVAL_STEPS = (
    "the evaluations are recorded at the wrong steps: record (steps done, value) after every eval_every-th step, "
    "counting steps done from 1, and once more after the last step of the call"
)
HINT_LOOP_EVAL_TRAIN_MODE = (
    "evaluate ran with the model in training mode, or with gradients on: switch to model.eval() under torch.no_grad() "
    "for the evaluation, and back to model.train() after"
)
HINT_LOOP_EVAL_LEFT = (
    "after an evaluation, the training steps ran with the model still in evaluation mode (dropout, and anything else "
    "that trains differently, off for the rest of the run): switch it back to training mode once evaluate has returned"
)
HINT_LOOP_NO_CHECKPOINT = "no checkpoint was stored after an evaluation: hand the state to checkpoints.store"
HINT_LOOP_RESUME_OPTIMIZER = (
    "after resuming, the losses differ from the uninterrupted run's: the optimizer's state (AdamW's running means "
    "and step counts) was not stored or not restored. Store the optimizer's state dict with the model's"
)
HINT_LOOP_RESUME_GENERATOR = (
    "after resuming, the batches differ from the uninterrupted run's: the generator's state was not stored or not "
    "restored (the generator has get_state and set_state), so the resumed run draws other windows"
)
HINT_LOOP_RESUME_STEP = (
    "after resuming, the run started again from step 0: store the number of steps done in the checkpoint and continue "
    "from it (the schedule and the step count depend on it)"
)
HINT_LOOP_RESUME_MODEL = "after resuming, the model's weights were not those of the checkpoint: restore the model's state too"
HINT_LOOP_RETURN = (
    "train_loop should return (losses, evals): the training loss of each step run, as floats, and a list of (step, "
    "value) pairs from evaluate"
)
HINT_LOOP_CALL = (
    "keep the signature train_loop(model, optimizer, train_ids, generator, *, steps, batch_size, seq_len, max_lr, "
    "warmup_steps, evaluate, eval_every, checkpoints, resume=False, until=None); it calls get_batch, "
    "cross_entropy, lr_schedule and clip_grad_norm, your functions of 8.1, 8.2, 8.4 and 8.5"
)

LOOP_CLIP = 1.0


def _loop(model, optimizer, train_ids, generator, *, steps, batch_size, seq_len, max_lr, warmup_steps, evaluate,
          eval_every, checkpoints, resume=False, until=None, parts: dict | None = None, mistake: str | None = None):
    """The training loop of the exercise, with the reference parts (or ``parts``) and optionally one mistake."""
    parts = parts or REFERENCE_PARTS
    start = 0
    if resume:
        state = checkpoints.restore()
        if mistake != "resume-model":
            model.load_state_dict(state["model"])
        if mistake != "resume-optimizer":
            optimizer.load_state_dict(state["optimizer"])
        if mistake != "resume-generator":
            generator.set_state(state["generator"])
        start = 0 if mistake == "resume-step" else state["step"]
    end = steps if until is None else until
    losses, evals = [], []
    model.train()
    for step in range(start, end):
        if mistake != "constant-lr":
            total = end - start if mistake == "schedule-total" else steps
            at = step + 1 if mistake == "schedule-shift" else step - start if mistake == "schedule-total" else step
            for group in optimizer.param_groups:
                group["lr"] = parts["lr_schedule"](at, max_lr, warmup_steps, total)
        x, y = parts["get_batch"](train_ids, batch_size, seq_len, generator)
        loss = parts["cross_entropy"](model(x), y)
        if mistake != "no-zero-grad":
            optimizer.zero_grad()
        loss.backward()
        if mistake == "zero-after-backward":
            optimizer.zero_grad()
        if mistake != "no-clip":
            parts["clip_grad_norm"](list(model.parameters()), LOOP_CLIP)
        optimizer.step()
        losses.append(loss.item())
        done = step + 1
        if done % eval_every == 0 or (done == end and mistake != "eval-multiples-only"):
            model.eval()
            with torch.no_grad():
                evals.append((done, float(evaluate(model))))
            if mistake != "eval-left":
                model.train()
            checkpoints.store({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "generator": generator.get_state(), "step": done})
    return losses, evals


REFERENCE_PARTS = {"get_batch": reference_get_batch, "cross_entropy": reference_cross_entropy,
                   "lr_schedule": reference_lr_schedule, "clip_grad_norm": reference_clip_grad_norm}
LOOP_PART_NAMES = tuple(REFERENCE_PARTS)


def reference_train_loop(model, optimizer, train_ids, generator, *, steps, batch_size, seq_len, max_lr, warmup_steps,
                         evaluate, eval_every, checkpoints, resume=False, until=None, parts=None):
    """The exercise's answer: ``(losses, evals)`` of the steps run; a checkpoint after each evaluation.

    ``parts`` (a dict like ``REFERENCE_PARTS``) swaps in other get_batch, cross_entropy, lr_schedule and
    clip_grad_norm functions: notebook 08 runs the reference loop with the learner's parts.
    """
    return _loop(model, optimizer, train_ids, generator, steps=steps, batch_size=batch_size, seq_len=seq_len,
                 max_lr=max_lr, warmup_steps=warmup_steps, evaluate=evaluate, eval_every=eval_every,
                 checkpoints=checkpoints, resume=resume, until=until, parts=parts)


# The run the check trains: a tiny GPT with large initial weights (so that clipping acts at every step), 12 steps.
LOOP_CFG = {"d_vocab": 24, "n_ctx": 8, "d_model": 16, "n_layers": 1, "n_heads": 2, "init_std": 0.5}
# Evaluations after steps 5, 10 and 12 (the last, not a multiple of 5); cut at 8, also not a multiple: evaluations
# after 5 and 8, the checkpoint of step 8 resumed.
LOOP_RUN = {"steps": 12, "batch_size": 4, "seq_len": 8, "max_lr": 0.02, "warmup_steps": 3, "eval_every": 5}
LOOP_CUT = 8


class LoopSetup:
    """A model, an optimizer, data, a generator and an evaluation, rebuilt identically for every run."""

    def __init__(self, seed: int, cfg: dict | None = None, run: dict | None = None) -> None:
        self.cfg, self.run = dict(cfg or LOOP_CFG), dict(run or LOOP_RUN)
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.train_ids = torch.randint(0, self.cfg["d_vocab"], (600,), generator=gen)
        self.val_ids = torch.randint(0, self.cfg["d_vocab"], (97,), generator=gen)

    def fresh(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = GPT(ModelConfig(**self.cfg))
        return model, self.optimizer(model), torch.Generator().manual_seed(self.seed + 1)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW with weight decay on the matrices only (as tfedu.train.param_groups, without importing it)."""
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.run["max_lr"], betas=(0.9, 0.95))

    def evaluate(self, model: torch.nn.Module) -> float:
        """Mean loss over the non-overlapping windows of the held-out ids (records the mode it ran in)."""
        self.modes["evaluate"].append((model.training, torch.is_grad_enabled()))
        n = self.run["seq_len"]
        starts = range(0, len(self.val_ids) - n, n)
        windows = torch.stack([self.val_ids[s:s + n + 1] for s in starts])
        return float(F.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten()))

    def train(self, loop: Callable, path: str, **extra: Any) -> tuple[Any, list]:
        """One call of ``loop`` on fresh objects (or, with resume=True, objects restored from ``path``)."""
        model, optimizer, generator = self.fresh()
        if extra.get("resume"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + 99)  # other weights than the checkpoint's: restoring them matters
                model = GPT(ModelConfig(**self.cfg))
            optimizer = self.optimizer(model)
        self.modes = {"evaluate": [], "steps": []}  # (training, grad) of each evaluation; training of each step

        def record(module: torch.nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():  # a training step's forward pass (evaluations run without gradients)
                self.modes["steps"].append(module.training)

        hook = model.register_forward_pre_hook(record)
        try:
            result = loop(model, optimizer, self.train_ids, generator, **self.run, evaluate=self.evaluate,
                          checkpoints=CheckpointFile(path), **extra)
        finally:
            hook.remove()
        return result, self.modes


def _as_run(result: Any) -> tuple[list[float], list[tuple[int, float]]]:
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise CheckFailure(HINT_LOOP_RETURN)
    losses, evals = result
    try:
        losses = [float(v) for v in losses]
        evals = [(int(s), float(v)) for s, v in evals]
    except (TypeError, ValueError):
        raise CheckFailure(HINT_LOOP_RETURN) from None
    return losses, evals


def _eval_steps(end: int, eval_every: int) -> list[int]:
    """The steps after which a call that stops after step ``end`` evaluates: every eval_every-th, and the last."""
    return sorted({*range(eval_every, end + 1, eval_every), end})


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5) for x, y in zip(a, b))


def loop_problem(setup: LoopSetup, learner: Callable, folder: str) -> str | None:
    """Runs the learner's loop (a callable like train_loop) three ways and names what differs; None when right."""
    import os

    path = os.path.join(folder, "run.pt")
    want, want_modes = setup.train(reference_train_loop, os.path.join(folder, "reference.pt"))
    got, modes = setup.train(learner, path)
    losses, evals = _as_run(got)
    if not _same(losses, want[0]):
        for mistake, hint in LOOP_MISTAKES:
            wrong, _ = setup.train(lambda *a, _m=mistake, **k: _loop(*a, **k, mistake=_m), os.path.join(folder, "wrong.pt"))
            if _same(losses, wrong[0]):
                return hint
        step = next((i for i, (a, b) in enumerate(zip(losses, want[0])) if not math.isclose(a, b, rel_tol=1e-4)), len(want[0]))
        return (f"the training losses differ from the reference loop's from step {step} on (you: "
                f"{', '.join(f'{v:.4f}' for v in losses[:step + 2])}; reference: "
                f"{', '.join(f'{v:.4f}' for v in want[0][:step + 2])})")
    if [s for s, _ in evals] != [s for s, _ in want[1]]:
        return f"{HINT_LOOP_EVAL_STEPS} (you recorded steps {[s for s, _ in evals]}, expected {[s for s, _ in want[1]]})"
    if any(mode != (False, False) for mode in modes["evaluate"]) or not _same([v for _, v in evals], [v for _, v in want[1]]):
        return HINT_LOOP_EVAL_TRAIN_MODE
    if not all(modes["steps"]):
        return HINT_LOOP_EVAL_LEFT
    if not os.path.exists(path):
        return HINT_LOOP_NO_CHECKPOINT
    # Interrupted after 8 steps, then resumed: the last 4 losses must be the uninterrupted run's.
    first, _ = setup.train(learner, path, until=LOOP_CUT)
    first_losses, first_evals = _as_run(first)
    if not _same(first_losses, want[0][:LOOP_CUT]):
        return HINT_LOOP_SCHEDULE_TOTAL
    cut_steps = _eval_steps(LOOP_CUT, setup.run["eval_every"])
    if [s for s, _ in first_evals] != cut_steps:
        return (f"{HINT_LOOP_EVAL_STEPS} (with until={LOOP_CUT} you recorded steps {[s for s, _ in first_evals]}, "
                f"expected {cut_steps})")
    second, _ = setup.train(learner, path, resume=True)
    resumed, _ = _as_run(second)
    if not _same(resumed, want[0][LOOP_CUT:]):
        for mistake, hint in RESUME_MISTAKES:
            setup.train(reference_train_loop, os.path.join(folder, "cut.pt"), until=LOOP_CUT)  # each resume ends by overwriting it
            wrong, _ = setup.train(lambda *a, _m=mistake, **k: _loop(*a, **k, mistake=_m), os.path.join(folder, "cut.pt"),
                                   resume=True)
            if _same(resumed, wrong[0]):
                return hint
        return (f"after resuming from the checkpoint written at step {LOOP_CUT}, the losses of steps {LOOP_CUT + 1} to "
                f"{len(want[0])} differ from the uninterrupted run's (you: {', '.join(f'{v:.4f}' for v in resumed)}; "
                f"uninterrupted: {', '.join(f'{v:.4f}' for v in want[0][LOOP_CUT:])})")
    return None


@contextlib.contextmanager
def parts_in(fn: Any, parts: dict[str, Callable] | None = None) -> Iterator[None]:
    """Run with the loop's parts (get_batch, cross_entropy, lr_schedule, clip_grad_norm) in the namespace of the
    learner's ``fn`` bound to ``parts`` (by default the references, so that a wrong earlier exercise costs only
    itself); the learner's own bindings are put back after."""
    namespace = getattr(fn, "__globals__", None)
    if not isinstance(namespace, dict):
        yield
        return
    with names_bound(namespace, parts or REFERENCE_PARTS):
        yield


@checker("training loop")
def check_train_loop(train_loop) -> None:
    """Check a learner's ``train_loop(model, optimizer, train_ids, generator, *, steps, ..., resume, until)``.

    Twelve steps of a tiny GPT against the reference loop (losses to 1e-4; the evaluations after steps 5,
    10 and 12, the last not a multiple of eval_every = 5, in eval mode without gradients, and the training
    steps after them in training mode again; a checkpoint stored), then the same run cut after 8 steps
    (evaluated after 5 and 8) and resumed from its checkpoint, whose last four losses must be the
    uninterrupted run's. The loop's parts are the references here (a wrong earlier exercise is not counted twice).
    Named: gradients piling up or cleared too late, a learning rate never set or a step ahead or
    scheduled over the call instead of the run, no clipping, the evaluation's steps or mode, the model left
    in eval mode after an evaluation, no checkpoint stored, the optimizer, generator, model or step left out
    of the resume.
    """
    import tempfile

    setup = LoopSetup(0)
    with tempfile.TemporaryDirectory() as folder, parts_in(train_loop):
        def learner(*args, **kwargs):
            return call_learner(train_loop, *args, name="train_loop", error_hint=HINT_LOOP_CALL, **kwargs)

        problem = loop_problem(setup, learner, folder)
    if problem:
        raise CheckFailure(problem)


# ----------------------------------------------------------------------------- 8.7 greedy_generate

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


# ----------------------------------------------------------------------------- 8.8 sample_next

HINT_TS_SHAPE = "sample_next should return one token id per row, a tensor of shape (batch,), got {got}"
HINT_TS_DTYPE = "sample_next returned dtype {got}: token ids are integers (torch.long), as torch.multinomial and argmax give them"
HINT_TS_MULTIPLIED = (
    "the draws follow softmax(logits · T): temperature divides the logits, so T < 1 sharpens the distribution and "
    "T > 1 flattens it"
)
HINT_TS_IGNORED = "the draws follow softmax(logits) whatever the temperature: divide the logits by it before the softmax"
HINT_TS_PROBS_DIVIDED = (
    "you divided the probabilities by T after the softmax: renormalised, that is the softmax again, and T does "
    "nothing. Divide the logits, before the softmax"
)
HINT_TS_ARGMAX = (
    "every draw was the most probable token: at a temperature above 0, sample from the distribution "
    "(torch.multinomial) instead of taking its argmax"
)
HINT_TS_ZERO = (
    "at temperature 0 the answer is the argmax of each row (greedy decoding, the limit of T → 0); dividing by 0 "
    "gives inf and NaN"
)
HINT_TS_GENERATOR = (
    "two calls with generators seeded alike drew different tokens: draw with the generator you are given "
    "(torch.multinomial takes it as generator=), not the global random state"
)
HINT_TS_OVERFLOW = (
    "NaN or an error on logits around 1000 at a low temperature: exp overflows. The softmax must subtract each row's "
    "largest value first (torch.softmax does)"
)
HINT_TS_DISTRIBUTION = (
    "over {n} draws from the row {row}, token {token} came up {got:.3f} of the time, but softmax(logits / {T}) gives "
    "it {want:.3f} (more than 5 standard deviations apart)"
)
HINT_TS_CALL = (
    "keep the signature sample_next(logits, temperature, generator): logits (batch, d_vocab), temperature a float "
    ">= 0, generator a torch.Generator; return (batch,) token ids"
)


def reference_sample_next(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row: the argmax at temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)  # (batch, d_vocab)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


TS_ROW = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=F64)


def sampling_problem(row: Sequence[float], temperature: float, draws: np.ndarray) -> str | None:
    """Whether ``draws`` (token ids drawn from copies of ``row`` at ``temperature``) follow softmax(row / T)."""
    z = torch.tensor(list(row), dtype=F64)
    n = len(draws)
    counts = np.bincount(np.asarray(draws, dtype=np.int64), minlength=len(z))[:len(z)] / n

    def fits(probs: torch.Tensor) -> bool:
        p = probs.numpy()
        return bool(np.all(np.abs(counts - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12))

    want = torch.softmax(z / temperature, dim=-1)
    if fits(want):
        return None
    if counts.max() == 1.0 and int(np.argmax(counts)) == int(z.argmax()):
        return HINT_TS_ARGMAX
    if fits(torch.softmax(z * temperature, dim=-1)):
        return HINT_TS_MULTIPLIED
    if fits(torch.softmax(z, dim=-1)):
        return HINT_TS_IGNORED
    token = int(np.argmax(np.abs(counts - want.numpy())))
    return HINT_TS_DISTRIBUTION.format(n=n, row=[round(float(v), 2) for v in z], token=token, got=counts[token],
                                       T=temperature, want=float(want[token]))


def _call_sample(sample_next: Any, logits: torch.Tensor, temperature: float, seed: int, global_seed: int = 0) -> np.ndarray:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(global_seed)
        got = call_on_copies(sample_next, {"logits": logits, "temperature": temperature,
                                           "generator": torch.Generator().manual_seed(seed)},
                             name="sample_next", mutated_hint="your sample_next changed the caller's `{name}` in place",
                             error_hint=HINT_TS_CALL)
    expect(isinstance(got, torch.Tensor) and got.shape == logits.shape[:1],
           HINT_TS_SHAPE.format(got=describe(got)))
    expect(not got.is_floating_point(), HINT_TS_DTYPE.format(got=got.dtype))
    return got.numpy()


@checker("sampling with a temperature")
def check_sample_next(sample_next) -> None:
    """Check a learner's ``sample_next(logits, temperature, generator) -> Int[Tensor, "batch"]``.

    4000 copies of one row of five logits at temperatures 0.5, 1 and 2: the frequencies must follow
    softmax(logits / T) (each within 5 binomial standard deviations); temperature 0 is the argmax; the
    same generator seed gives the same draws whatever the global random state; logits around 1000 at
    T = 0.05 stay finite. Named: T multiplying the logits, T ignored or applied to the probabilities,
    the argmax at every temperature, a division by zero at T = 0, the global random state.
    """
    rows = TS_ROW.float().repeat(4000, 1)  # (4000, 5)
    for seed, temperature in ((0, 0.5), (1, 1.0), (2, 2.0)):
        draws = _call_sample(sample_next, rows, temperature, seed)
        problem = sampling_problem(TS_ROW.tolist(), temperature, draws)
        if problem:
            raise CheckFailure(problem)
    again = _call_sample(sample_next, rows, 1.0, 1, global_seed=1)
    if not np.array_equal(again, _call_sample(sample_next, rows, 1.0, 1)):
        raise CheckFailure(HINT_TS_GENERATOR)
    logits = torch.randn(6, 9, generator=torch.Generator().manual_seed(3))
    try:
        greedy = _call_sample(sample_next, logits, 0.0, 4)
    except CheckFailure as failure:
        raise CheckFailure(f"{HINT_TS_ZERO} ({failure})") from None
    expect(np.array_equal(greedy, logits.argmax(-1).numpy()), HINT_TS_ZERO)
    big = 1000.0 + torch.randn(6, 9, generator=torch.Generator().manual_seed(5))
    try:
        draws = _call_sample(sample_next, big, 0.05, 6)
    except CheckFailure as failure:
        raise CheckFailure(f"{HINT_TS_OVERFLOW} ({failure})") from None
    expect(bool(((draws >= 0) & (draws < 9)).all()), HINT_TS_OVERFLOW)


# ----------------------------------------------------------------------------- 8.9 top_k_filter

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


# ----------------------------------------------------------------------------- 8.10 top_p_filter

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


# ----------------------------------------------------------------------------- 8.11 beam_search

HINT_BEAM_LOGITS = (
    "you added up raw logits: a logit is a log-probability only up to a constant, each beam's own log-sum-exp, "
    "so totals of logits from different beams cannot be compared. Turn each step's logits into "
    "log-probabilities over the vocabulary before adding them to the beam's score"
)
HINT_BEAM_PROBS = (
    "you added up probabilities: a sequence's probability is the product of its tokens' probabilities, so "
    "its score is the sum of their logarithms (log-probabilities), not of the probabilities themselves"
)
HINT_BEAM_NOT_SUMMED = (
    "each extension was ranked by its newest token alone: a beam's score is the total log-probability of all "
    "the tokens it added, so each extension's score is its beam's score plus the new token's log-probability"
)
HINT_BEAM_GREEDY = (
    "your search returned the greedy continuation, though on this model and prompt a wider beam finds a "
    "more probable one. Keep the num_beams best extensions over all beams and all tokens together (not each "
    "beam's single best token); and start from one beam, the prompt: num_beams equal copies of it all pick the "
    "same tokens"
)
HINT_BEAM_PARENT = (
    "a new token went onto the beam of the same rank, not onto the beam it was scored from: the position of a "
    "kept extension among all (beam, token) pairs tells both its parent beam and its token, and each new beam "
    "is its parent's sequence followed by that token"
)
HINT_BEAM_WORST = (
    "you returned the least probable of the final beams: return the one with the highest total log-probability"
)
HINT_BEAM_ONLY_NEW = (
    "you returned only the new tokens: return each prompt followed by its best beam's new tokens, shape "
    "(batch, pos + max_new_tokens)"
)
HINT_BEAM_ALL = (
    "you returned every final beam: return one row per prompt, its most probable beam, shape "
    "(batch, pos + max_new_tokens)"
)
HINT_BEAM_CROP_START = (
    "you kept the first n_ctx tokens: the model must see the most recent ones, the last n_ctx of each beam"
)
HINT_BEAM_NO_CROP = (
    "the beams outgrew the model's context: before each forward pass, keep only the last model.cfg.n_ctx "
    "tokens of each beam"
)
HINT_BEAM_RANDOM = (
    "two calls with the same model and prompt gave different tokens: beam search is deterministic, it keeps "
    "the best extensions; do not sample here"
)
HINT_BEAM_DROPOUT = (
    "with a model that has dropout and was left in training mode, your tokens differ from the reference: call "
    "model.eval() first (dropout off while searching); torch.no_grad() alone does not turn dropout off"
)
HINT_BEAM_MUTATED = (
    "your beam_search changed the caller's `{name}` in place: build new tensors for the beams instead of "
    "writing into the prompt"
)
HINT_BEAM_CALL = (
    "beam_search(model, ids, max_new_tokens, num_beams): ids is (batch, pos) of token ids and each row is "
    "searched on its own; model(x) returns logits (n, pos, d_vocab) for n sequences of equal length, so all "
    "the beams of one prompt go through the model together. Crop each beam to its last model.cfg.n_ctx "
    "tokens before each call"
)
HINT_BEAM_DTYPE = "return token ids in ids' dtype ({want}), got {got}: token ids are integers"

BEAM_MISTAKES = {  # the variant of _beam_variant behind each hint; greedy decoding stands for itself
    HINT_BEAM_LOGITS: "logits", HINT_BEAM_PROBS: "probs", HINT_BEAM_NOT_SUMMED: "not-summed",
    HINT_BEAM_PARENT: "parent", HINT_BEAM_WORST: "worst", HINT_BEAM_ONLY_NEW: "only-new", HINT_BEAM_ALL: "all",
    HINT_BEAM_CROP_START: "crop-start",
}


def _beam_variant(model: GPT, ids: torch.Tensor, max_new_tokens: int, num_beams: int,
                  mistake: str | None = None) -> torch.Tensor:
    """Beam search on each prompt in turn, without a cache, in eval mode: right, or with one known mistake."""
    n_ctx, was_training = model.cfg.n_ctx, model.training
    rows = []
    with torch.no_grad():
        model.eval()
        for prompt in ids:
            if mistake == "parent":  # num_beams rows from the start, only the first live: then rank-aligned appends
                beams = prompt[None, :].expand(num_beams, -1)
                scores = torch.tensor([0.0] + [NEG_INF] * (num_beams - 1))
            else:
                beams, scores = prompt[None, :], torch.zeros(1)
            for _ in range(max_new_tokens):
                context = beams[:, :n_ctx] if mistake == "crop-start" else beams[:, -n_ctx:]
                logits = model(context)[:, -1]  # beams d_vocab
                step = {"logits": logits, "probs": logits.softmax(dim=-1)}.get(mistake, logits.log_softmax(dim=-1))
                totals = step if mistake == "not-summed" else scores[:, None] + step
                scores, flat = totals.flatten().topk(num_beams)
                parent, token = flat // step.shape[-1], flat % step.shape[-1]
                grown_from = beams if mistake == "parent" else beams[parent]
                beams = torch.cat([grown_from, token[:, None].to(ids.dtype)], dim=1)
            rows.append(beams)
    model.train(was_training)
    if mistake == "all":
        return torch.cat(rows)
    chosen = torch.stack([beams[-1] if mistake == "worst" else beams[0] for beams in rows])
    return chosen[:, ids.shape[1]:] if mistake == "only-new" else chosen


def _beam_mistakes(model: GPT, ids: torch.Tensor, max_new_tokens: int, num_beams: int) -> dict[str, torch.Tensor]:
    mistakes = {hint: _beam_variant(model, ids, max_new_tokens, num_beams, variant) for hint, variant in BEAM_MISTAKES.items()}
    return mistakes | {HINT_BEAM_GREEDY: generate(model, ids, max_new_tokens, use_cache=False)}


def reference_beam_search(model: GPT, ids: torch.Tensor, max_new_tokens: int, num_beams: int) -> torch.Tensor:
    """tfedu's beam search without end-of-text, which transformers' ``generate(num_beams=...)`` equals."""
    return beam_search(model, ids, max_new_tokens, num_beams=num_beams, use_cache=False)


def _call_beam(fn: Any, model: GPT, ids: torch.Tensor, max_new_tokens: int, num_beams: int, seed: int = 0) -> Any:
    with torch.random.fork_rng(devices=[]):  # a seed of its own per call: an answer that samples differs
        torch.manual_seed(seed)
        return call_on_copies(fn, {"model": model, "ids": ids, "max_new_tokens": max_new_tokens, "num_beams": num_beams},
                              name="beam_search", mutated_hint=HINT_BEAM_MUTATED, error_hint=HINT_BEAM_CALL)


def _check_beam_output(got: Any, model: GPT, ids: torch.Tensor, max_new_tokens: int, num_beams: int, what: str) -> None:
    expected = reference_beam_search(model, ids, max_new_tokens, num_beams)
    expect(isinstance(got, torch.Tensor), f"{what} should return a tensor of token ids (batch, pos + max_new_tokens), "
                                          f"got {describe(got)}")
    expect(not got.is_floating_point(), HINT_BEAM_DTYPE.format(want=ids.dtype, got=got.dtype))
    compare(got, expected, what=what, mistakes=_beam_mistakes(model, ids, max_new_tokens, num_beams), check_dtype=False,
            rtol=0, atol=0)


# The checker's model and calls, (prompt seed, batch, pos, max_new_tokens, num_beams): chosen so that every known
# mistake gives other tokens than the reference on the first two, and the beam beats greedy there (tested).
BEAM_MODEL_SEED = 0
BEAM_CALLS = ((5, 2, 5, 6, 3), (1, 2, 13, 7, 4))


@checker("beam search")
def check_beam_search(beam_search) -> None:
    """Check a learner's ``beam_search(model, ids, max_new_tokens, num_beams) -> Int[Tensor, "batch pos_out"]``.

    Against ``tfedu.generate.beam_search`` without end-of-text (which equals transformers' ``generate(num_beams=...)``,
    tests/test_generate.py) on a tiny seeded GPT: a short prompt, two calls that must agree, prompts whose beams
    run past ``model.cfg.n_ctx`` (cropped to the last n_ctx tokens), one beam (greedy decoding), a model with
    dropout left in training mode, and the prompt left unchanged.
    """
    model = make_greedy_model(BEAM_MODEL_SEED)
    (seed, batch, pos, new, beams), (seed2, batch2, pos2, new2, beams2) = BEAM_CALLS
    ids = _greedy_prompt(seed, batch, pos, model.cfg.d_vocab)
    got = _call_beam(beam_search, model, ids, new, beams)
    again = _call_beam(beam_search, model, ids, new, beams, seed=1)
    if isinstance(got, torch.Tensor) and isinstance(again, torch.Tensor) and not torch.equal(got, again):
        raise CheckFailure(HINT_BEAM_RANDOM)
    _check_beam_output(got, model, ids, new, beams, f"beam_search(model, ids, {new}, {beams}) with ids of shape ({batch}, {pos})")
    ids = _greedy_prompt(seed2, batch2, pos2, model.cfg.d_vocab)
    try:
        got = _call_beam(beam_search, model, ids, new2, beams2)
    except CheckFailure as failure:
        if "n_ctx" in str(failure) or "positions" in str(failure):
            raise CheckFailure(f"{HINT_BEAM_NO_CROP} ({failure})") from None
        raise
    _check_beam_output(got, model, ids, new2, beams2, f"beam_search(model, ids, {new2}, {beams2}) with ids of shape "
                                                      f"({batch2}, {pos2}) and model.cfg.n_ctx = {GREEDY_N_CTX}")
    got = _call_beam(beam_search, model, ids[:, :6], 5, 1)
    _check_beam_output(got, model, ids[:, :6], 5, 1, "beam_search(model, ids, 5, 1) (one beam: greedy decoding)")
    dropout_model = make_greedy_model(BEAM_MODEL_SEED, dropout=0.5).train()
    ids = _greedy_prompt(seed, batch, pos, model.cfg.d_vocab)
    got = _call_beam(beam_search, dropout_model, ids, new, beams)
    expected = reference_beam_search(dropout_model, ids, new, beams)
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and not torch.equal(got, expected):
        raise CheckFailure(HINT_BEAM_DROPOUT)
    _check_beam_output(got, dropout_model, ids, new, beams, f"beam_search(model, ids, {new}, {beams}) with a dropout "
                                                            "model in training mode")


# ----------------------------------------------------------------------------- probes

# greedy_generate: a tiny GPT whose weights travel as arrays, built in the kernel (tfedu.model is not the
# answer); a prompt whose continuation runs past n_ctx; a second call (the same tokens); the same weights
# with dropout, left in training mode.

# get_batch: a data tensor of distinct ids from a random offset; batches from two seeds (one twice); a short tensor
# whose three starts must all come up.

def _get_batch_probe_inputs(rng: np.random.Generator) -> dict:
    seq_len = int(rng.integers(2, 12))
    offset = int(rng.integers(0, 5000))
    short_seq = int(rng.integers(3, 9))
    return {"data": np.arange(offset, offset + int(rng.integers(seq_len + 20, 200)), dtype=np.int64),
            "batch_size": int(rng.integers(4, 17)), "seq_len": seq_len, "seeds": [int(s) for s in rng.integers(0, 2**31, 2)],
            "short": np.arange(offset + 7000, offset + 7000 + short_seq + 3, dtype=np.int64), "short_seq": short_seq,
            "short_seeds": [int(s) for s in rng.integers(0, 2**31, 5)]}


GET_BATCH_RUN = HELPERS + """\
def _draw(_data, _batch, _seq, _seed):
    _result = get_batch(torch.from_numpy(_data), _batch, _seq, torch.Generator().manual_seed(_seed))
    if not (isinstance(_result, (tuple, list)) and len(_result) == 2):
        return [None, None]
    return [_array(_r) if isinstance(_r, torch.Tensor) and not _r.is_floating_point() else
            (_r.detach().numpy() if isinstance(_r, torch.Tensor) else None) for _r in _result]


_first, _again, _other = (_draw(inputs['data'], inputs['batch_size'], inputs['seq_len'], _s)
                          for _s in (inputs['seeds'][0], inputs['seeds'][0], inputs['seeds'][1]))
torch.manual_seed(inputs['seeds'][1])  # the global state moved between the two equal seeds
_again = _draw(inputs['data'], inputs['batch_size'], inputs['seq_len'], inputs['seeds'][0])
outputs = {'first': _first, 'again': _again, 'other': _other,
           'short': [_draw(inputs['short'], 40, inputs['short_seq'], _s) for _s in inputs['short_seeds']]}
del _draw, _first, _again, _other
""" + CLEANUP


def _get_batch_reference(inputs: dict) -> dict:
    return {key: inputs[key] for key in ("data", "batch_size", "seq_len", "short", "short_seq")}


def _compare_get_batch(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not all(isinstance(outputs.get(k), list) for k in ("first", "again", "other", "short")):
        return "the hidden test's outputs should be a dict of lists"
    data, batch, seq = expected["data"], expected["batch_size"], expected["seq_len"]
    for key in ("first", "other"):
        problem = batch_problem(data, batch, seq, *outputs[key])
        if problem:
            return problem
    x = outputs["first"][0]
    if len({int(v) for v in x[:, 0]}) == 1:
        return HINT_GB_SAME_START
    if not all(isinstance(a, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
               for a, b in zip(outputs["again"], outputs["first"])):
        return HINT_GB_GENERATOR
    if np.array_equal(outputs["other"][0], x):
        return HINT_GB_NOT_RANDOM
    for bx, by in outputs["short"]:
        problem = batch_problem(expected["short"], 40, expected["short_seq"], bx, by)
        if problem:
            return f"{problem} (data of {len(expected['short'])} tokens, seq_len {expected['short_seq']})"
    return coverage_problem(expected["short"], expected["short_seq"], [bx for bx, _ in outputs["short"]])


# cross_entropy: float32 with gradients; logits around 1000; targets 1000 below their row's largest; -100 ignored;
# another ignore_index.

def _cross_entropy_probe_inputs(rng: np.random.Generator) -> dict:
    def case(scale: float, shape: tuple[int, ...], vocab: int) -> tuple[np.ndarray, np.ndarray]:
        return ((scale * rng.standard_normal((*shape, vocab))).astype(np.float32),
                rng.integers(0, vocab, shape).astype(np.int64))

    def size() -> tuple[int, int]:
        return int(rng.integers(1, 4)), int(rng.integers(2, 9))

    inputs: dict[str, Any] = {}
    inputs["logits"], inputs["targets"] = case(2.0, size(), int(rng.integers(3, 40)))
    inputs["logits_big"], inputs["targets_big"] = case(1.0, size(), int(rng.integers(3, 40)))
    inputs["logits_big"] += np.float32(rng.uniform(500, 2000))
    inputs["logits_low"], inputs["targets_low"] = case(2.0, size(), int(rng.integers(3, 40)))
    np.put_along_axis(inputs["logits_low"], inputs["targets_low"][..., None], np.float32(-rng.uniform(500, 2000)), axis=-1)
    for name, index in (("ignored", -100), ("index", int(rng.integers(0, 3)))):
        logits, targets = case(2.0, (int(rng.integers(2, 4)), int(rng.integers(4, 9))), int(rng.integers(4, 40)))
        drop = rng.random(targets.shape) < 0.4
        drop.flat[0], drop.flat[-1] = True, False
        if index >= 0:
            targets[targets == index] = index + 1  # only the dropped positions hold the index
        targets[drop] = index
        inputs[f"logits_{name}"], inputs[f"targets_{name}"] = logits, targets
    inputs["ignore_index"] = int(inputs["targets_index"].flat[0])
    return inputs


CROSS_ENTROPY_RUN = HELPERS + """\
_logits = torch.tensor(inputs['logits'], requires_grad=True)
_result = _call(cross_entropy, _logits, torch.from_numpy(inputs['targets']))
_others = [cross_entropy(torch.from_numpy(inputs['logits_' + _k]), torch.from_numpy(inputs['targets_' + _k]))
           for _k in ('big', 'low', 'ignored')]
_index = cross_entropy(torch.from_numpy(inputs['logits_index']), torch.from_numpy(inputs['targets_index']),
                       ignore_index=inputs['ignore_index'])
_results = [_result, *_others, _index]
outputs = {'returned': [_kind(_r) for _r in _results],
           'shapes': [list(_r.shape) if isinstance(_r, torch.Tensor) else None for _r in _results],
           'output': _array(_result), 'output_big': _array(_others[0]), 'output_low': _array(_others[1]),
           'output_ignored': _array(_others[2]), 'output_index': _array(_index),
           'grad': _backward([_result], [torch.tensor(1.0)], {'logits': _logits}) if isinstance(_result, torch.Tensor)
           and _result.dim() == 0 else 'skipped'}
outputs['mutated'] = _MUTATED
del _logits, _result, _others, _index, _results
""" + CLEANUP

CE_LABELS = {"output": "cross_entropy(logits, targets)", "output_big": "cross_entropy on logits around 1000",
             "output_low": "cross_entropy where each target's logit is about -1000",
             "output_ignored": "cross_entropy where some targets are -100 (ignored)",
             "output_index": "cross_entropy(logits, targets, ignore_index=...) with another ignore_index"}


def _cross_entropy_reference(inputs: dict) -> dict:
    logits = leaf(inputs["logits"])
    output = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(inputs["targets"]).reshape(-1))

    def loss(key: str, ignore_index: int = -100) -> np.ndarray:
        lg, tg = torch.from_numpy(inputs["logits_" + key]).to(F64), torch.from_numpy(inputs["targets_" + key])
        return as_array(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tg.reshape(-1), ignore_index=ignore_index))

    mistakes = {key: [[hint, as_array(_ce_variant(torch.from_numpy(inputs["logits_" + key]),
                                                   torch.from_numpy(inputs["targets_" + key]), index, mistake))]
                      for mistake, hint in CE_MISTAKES]
                for key, index in (("ignored", -100), ("index", inputs["ignore_index"]))}
    return {"returned": ["tensor"] * 5, "output": as_array(output), "output_big": loss("big"), "output_low": loss("low"),
            "output_ignored": loss("ignored"), "output_index": loss("index", inputs["ignore_index"]),
            "grad": backward([output], [torch.tensor(1.0)], {"logits": logits}), "mistakes": mistakes,
            "fixed_index": loss("index")}


def _compare_cross_entropy(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict):
        return f"the hidden test's outputs should be a dict, got {type(outputs).__name__}"
    shapes = outputs.get("shapes")
    if isinstance(shapes, list) and any(isinstance(s, list) and s != [] for s in shapes):
        return HINT_CE_SHAPE.format(got=f"a tensor of shape {tuple(next(s for s in shapes if s))}")
    for key in ("ignored", "index"):
        got = outputs.get(f"output_{key}")
        hint = named_in_outputs(got, expected[f"output_{key}"], expected["mistakes"][key])
        if hint:
            return f"{CE_LABELS['output_' + key]}: {hint}"
    got = outputs.get("output_index")
    if isinstance(got, np.ndarray) and got.shape == () and np.allclose(got, expected["fixed_index"], rtol=1e-5) \
            and not np.allclose(got, expected["output_index"], rtol=1e-5):
        return HINT_CE_IGNORE_FIXED.format(given="...")
    return compare_outputs(outputs, {k: v for k, v in expected.items() if k not in ("mistakes", "fixed_index")},
                           function="cross_entropy", labels=CE_LABELS, rtol=1e-4, atol=1e-5,
                           nan_hints={"output_big": HINT_CE_OVERFLOW, "output_low": HINT_CE_LOG_OF_SOFTMAX,
                                      "output_ignored": HINT_CE_IGNORED_USED, "output_index": HINT_CE_IGNORED_USED})


# adamw_step: float64 weights and gradients from 1e-6 to 10, six steps with drawn hyper-parameters, then the defaults.

def _adamw_probe_inputs(rng: np.random.Generator) -> dict:
    shape = (int(rng.integers(2, 6)), int(rng.integers(2, 7)))
    scales = 10.0 ** rng.integers(-6, 2, shape)
    return {"param": rng.standard_normal(shape), "grads": [scales * rng.standard_normal(shape) for _ in range(6)],
            "options": {"lr": float(rng.choice([0.01, 0.05, 0.1])), "betas": [float(rng.choice([0.8, 0.9])), float(rng.choice([0.95, 0.99]))],
                        "eps": 1e-8, "weight_decay": float(rng.choice([0.1, 0.3, 0.5]))}}


ADAMW_RUN = HELPERS + """\
def _run(_options, _grads):
    _p = torch.tensor(inputs['param'])
    _m, _v = torch.zeros_like(_p), torch.zeros_like(_p)
    for _t, _g in enumerate(_grads, start=1):
        _out = _call(lambda *_a: adamw_step(*_a, **_options), _p, torch.tensor(_g), _m, _v, _t)
        if not (isinstance(_out, (tuple, list)) and len(_out) == 3 and all(isinstance(_o, torch.Tensor) for _o in _out)):
            return None
        _p, _m, _v = _out
    return _array(_p.double()) if _p.is_floating_point() else None


_opts = dict(inputs['options'], betas=tuple(inputs['options']['betas']))
outputs = {'output': _run(_opts, inputs['grads']), 'output_defaults': _run({'lr': 0.02}, inputs['grads'][:3])}
outputs['mutated'] = _MUTATED
del _run, _opts
""" + CLEANUP


def _adamw_reference(inputs: dict) -> dict:
    param = torch.from_numpy(inputs["param"])
    grads = [torch.from_numpy(g) for g in inputs["grads"]]
    options = dict(inputs["options"], betas=tuple(inputs["options"]["betas"]))
    mistakes = [[hint, as_array(adamw_trajectory(lambda *a, _m=mistake, **o: _adamw_variant(*a, **o, mistake=_m), param,
                                                 grads, **options))] for mistake, hint in AW_MISTAKES]
    return {"output": as_array(torch_adamw_trajectory(param, grads, **options)),
            "output_defaults": as_array(torch_adamw_trajectory(param, grads[:3], lr=0.02, betas=(0.9, 0.95), eps=1e-8,
                                                               weight_decay=0.1)),
            "mistakes": mistakes}


AW_LABELS = {"output": "the weights after six steps of adamw_step",
             "output_defaults": "the weights after three steps of adamw_step with lr=0.02 and the defaults"}


def _compare_adamw(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict):
        return f"the hidden test's outputs should be a dict, got {type(outputs).__name__}"
    if outputs.get("output") is None or outputs.get("output_defaults") is None:
        return HINT_AW_RETURN
    hint = named_in_outputs(outputs["output"], expected["output"], expected["mistakes"], rtol=1e-4, atol=1e-6)
    if hint:
        return f"{AW_LABELS['output']}: {hint}"
    return compare_outputs({**outputs, "returned": []}, {"returned": [], "output": expected["output"],
                           "output_defaults": expected["output_defaults"]}, function="adamw_step", labels=AW_LABELS,
                           rtol=1e-4, atol=1e-6)


# lr_schedule: schedules drawn fresh, read at every step and past the end.

def _lr_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for warmup_low in (1, 0):
        total = int(rng.integers(12, 80))
        cases.append([float(rng.choice([1e-3, 3e-3, 0.01, 0.5])), int(rng.integers(warmup_low, max(2, total // 3))), total,
                      float(rng.choice([0.0, 0.1, 0.2]))])
    warmup = int(rng.integers(2, 9))  # and one whose warm-up ends on the last step
    cases.append([float(rng.choice([1e-3, 0.5])), warmup, warmup + 1, float(rng.choice([0.0, 0.1]))])
    return {"cases": cases}


LR_RUN = """\
outputs = {'curves': [[lr_schedule(_s, *_case) for _s in range(_case[2] + 10)] for _case in inputs['cases']]}
outputs['curves'] = [[float(_v) if isinstance(_v, (int, float)) and not isinstance(_v, bool) else repr(_v)[:40]
                      for _v in _curve] for _curve in outputs['curves']]
"""


def _lr_reference(inputs: dict) -> dict:
    return {"cases": inputs["cases"]}


def _compare_lr(outputs: dict, expected: dict) -> str | None:
    curves = outputs.get("curves") if isinstance(outputs, dict) else None
    if not isinstance(curves, list) or len(curves) != len(expected["cases"]):
        return "the hidden test's outputs should hold one curve per schedule"
    return lr_problem(expected["cases"], curves)


# clip_grad_norm: gradients drawn fresh, a total norm above max_norm and one below, a parameter without .grad.

def _clip_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for scale in (float(rng.uniform(2, 20)), float(rng.uniform(0.001, 0.05))):
        shapes = [tuple(int(n) for n in rng.integers(1, 6, size=int(rng.integers(1, 3)))) for _ in range(int(rng.integers(2, 5)))]
        cases.append({"grads": [(scale * (1 + 3 * i) * rng.standard_normal(s)).astype(np.float32) for i, s in enumerate(shapes)],
                      "max_norm": float(rng.choice([0.5, 1.0, 2.0]))})
    return {"cases": cases, "none_at": int(rng.integers(0, len(cases[0]["grads"]) + 1))}


CLIP_RUN = HELPERS + """\
outputs = {'after': [], 'returned': []}
for _i, _case in enumerate(inputs['cases']):
    _params = [torch.nn.Parameter(torch.zeros(_g.shape)) for _g in _case['grads']]
    for _p, _g in zip(_params, _case['grads']):
        _p.grad = torch.tensor(_g)
    if _i == 0:
        _params.insert(inputs['none_at'], torch.nn.Parameter(torch.zeros(3)))  # no .grad
    try:
        _r = clip_grad_norm(_params, _case['max_norm'])
    except Exception as _error:  # named by the comparison: the first case holds a parameter without .grad
        outputs['after'].append(None)
        outputs['returned'].append('raised ' + type(_error).__name__ + ': ' + str(_error)[:150])
        del _error
        continue
    outputs['after'].append([_array(_p.grad) for _p in _params if _p.grad is not None])
    outputs['returned'].append(float(_r) if isinstance(_r, (int, float)) and not isinstance(_r, bool) else
                               float(_r.detach()) if isinstance(_r, torch.Tensor) and _r.numel() == 1 else _kind(_r))
del _i, _case, _params, _p, _g
if '_r' in dir():
    del _r
""" + CLEANUP


def _clip_reference(inputs: dict) -> dict:
    return {"cases": inputs["cases"]}


def _compare_clip(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not all(isinstance(outputs.get(k), list) for k in ("after", "returned")):
        return "the hidden test's outputs should be a dict of lists"
    for i, (case, after, returned) in enumerate(zip(expected["cases"], outputs["after"], outputs["returned"])):
        if after is None:
            return f"{HINT_CLIP_NONE_GRAD} (clip_grad_norm {returned})" if i == 0 else f"clip_grad_norm {returned}"
        if len(after) != len(case["grads"]) or not all(isinstance(a, np.ndarray) for a in after):
            return HINT_CLIP_NONE_GRAD
        problem = clip_problem(case["grads"], after, returned, case["max_norm"])
        if problem:
            return problem
    return None


# train_loop: a tiny GPT drawn fresh, trained three ways in the kernel (whole, cut after 8 steps, resumed); the
# reference runs here, with each named mistake, on the same data.

def _loop_probe_inputs(rng: np.random.Generator) -> dict:
    return {"seed": int(rng.integers(0, 2**31 - 200)), "max_lr": float(rng.choice([0.01, 0.02, 0.03])),
            "warmup_steps": int(rng.integers(1, 5))}


LOOP_PROBE_RUN = """\
import os as _os
import tempfile as _tempfile
from tfedu.checks.nb08_training_decoding import LoopSetup as _LoopSetup

_setup = _LoopSetup(inputs['seed'], run=dict(steps=12, batch_size=4, seq_len=8, max_lr=inputs['max_lr'],
                                           warmup_steps=inputs['warmup_steps'], eval_every=5))


def _run(**_extra):
    try:
        _result, _modes = _setup.train(train_loop, _path, **_extra)
        _losses, _evals = _result
        return {'losses': [float(_v) for _v in _losses], 'evals': [[int(_s), float(_v)] for _s, _v in _evals],
                'modes': {'evaluate': [list(_m) for _m in _modes['evaluate']], 'steps': list(_modes['steps'])}}
    except Exception as _error:
        return {'error': type(_error).__name__ + ': ' + str(_error)[:200]}


with _tempfile.TemporaryDirectory() as _folder:
    _path = _os.path.join(_folder, 'run.pt')
    outputs = {'whole': _run()}
    outputs['exists'] = _os.path.exists(_path)
    outputs['cut'] = _run(until=8)  # LOOP_CUT
    outputs['resumed'] = _run(resume=True)
del _os, _tempfile, _LoopSetup, _setup, _run, _folder, _path
"""


def _loop_probe_setup(inputs: dict) -> LoopSetup:
    return LoopSetup(inputs["seed"], run={**LOOP_RUN, "max_lr": inputs["max_lr"], "warmup_steps": inputs["warmup_steps"]})


def _loop_probe_reference(inputs: dict) -> dict:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        (losses, evals), _ = _loop_probe_setup(inputs).train(reference_train_loop, os.path.join(folder, "run.pt"))
    return {"losses": losses, "evals": [[s, v] for s, v in evals], "inputs": inputs}


def _loop_mistake_runs(inputs: dict, mistakes: Sequence[tuple[str, str]], *, resumed: bool) -> list[tuple[str, list[float]]]:
    """(hint, losses) of the reference loop with each mistake: the whole run, or the resumed end of a cut one.

    Worked out only when an answer's losses are wrong (the comparison calls it), so a right answer costs
    the grader one reference run.
    """
    import os
    import tempfile

    setup, runs = _loop_probe_setup(inputs), []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "run.pt")
        for mistake, hint in mistakes:
            if resumed:
                setup.train(reference_train_loop, path, until=LOOP_CUT)
            (wrong, _), _ = setup.train(lambda *a, _m=mistake, **k: _loop(*a, **k, mistake=_m), path, resume=resumed)
            runs.append((hint, wrong))
    return runs


LOOP_MISTAKES = (("no-zero-grad", HINT_LOOP_NO_ZERO_GRAD), ("zero-after-backward", HINT_LOOP_ZERO_AFTER_BACKWARD),
                 ("constant-lr", HINT_LOOP_CONSTANT_LR), ("schedule-shift", HINT_LOOP_SCHEDULE_SHIFT),
                 ("no-clip", HINT_LOOP_NO_CLIP))
RESUME_MISTAKES = (("resume-step", HINT_LOOP_RESUME_STEP), ("resume-optimizer", HINT_LOOP_RESUME_OPTIMIZER),
                   ("resume-generator", HINT_LOOP_RESUME_GENERATOR), ("resume-model", HINT_LOOP_RESUME_MODEL),
                   ("schedule-total", HINT_LOOP_SCHEDULE_TOTAL))


def _compare_loop(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not all(isinstance(outputs.get(k), dict) for k in ("whole", "cut", "resumed")):
        return "the hidden test's outputs should be a dict of the three runs"
    def raised(key: str) -> str | None:
        return f"train_loop raised {outputs[key]['error']} ({HINT_LOOP_CALL})" if "error" in outputs[key] else None

    if raised("whole"):
        return raised("whole")
    whole, want = outputs["whole"], expected["losses"]
    if not isinstance(whole.get("losses"), list) or not isinstance(whole.get("evals"), list):
        return HINT_LOOP_RETURN
    if not _same(whole["losses"], want):
        return next((hint for hint, wrong in _loop_mistake_runs(expected["inputs"], LOOP_MISTAKES, resumed=False)
                     if _same(whole["losses"], wrong)), "the training losses differ from the reference loop's")
    if [s for s, _ in whole["evals"]] != [s for s, _ in expected["evals"]]:
        return HINT_LOOP_EVAL_STEPS
    modes = whole.get("modes") if isinstance(whole.get("modes"), dict) else {}
    if any(mode != [False, False] for mode in modes.get("evaluate", [])) or \
            not _same([v for _, v in whole["evals"]], [v for _, v in expected["evals"]]):
        return HINT_LOOP_EVAL_TRAIN_MODE
    if not all(modes.get("steps", [])):
        return HINT_LOOP_EVAL_LEFT
    if not outputs.get("exists"):
        return HINT_LOOP_NO_CHECKPOINT
    if raised("cut") or raised("resumed"):
        return raised("cut") or raised("resumed")
    if not _same(outputs["cut"].get("losses", []), want[:LOOP_CUT]):
        return HINT_LOOP_SCHEDULE_TOTAL
    if [s for s, _ in outputs["cut"].get("evals", [])] != _eval_steps(LOOP_CUT, LOOP_RUN["eval_every"]):
        return HINT_LOOP_EVAL_STEPS
    resumed = outputs["resumed"].get("losses", [])
    if not _same(resumed, want[LOOP_CUT:]):
        return next((hint for hint, wrong in _loop_mistake_runs(expected["inputs"], RESUME_MISTAKES, resumed=True)
                     if _same(resumed, wrong)),
                    "after resuming from the checkpoint written at step 8, the losses of steps 9 to 12 differ from the "
                    "uninterrupted run's")
    return None


# The functions of 8.1, 8.2, 8.4 and 8.5, bound in place of the learner's while the loop is graded.
LOOP_STANDINS = """\
def get_batch(data, batch_size, seq_len, generator):
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
    windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def cross_entropy(logits, targets, ignore_index=-100):
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    keep = targets != ignore_index
    logits, targets = logits[keep], targets[keep]
    top = logits.max(dim=-1, keepdim=True).values
    lse = top.squeeze(-1) + (logits - top).exp().sum(dim=-1).log()
    return (lse - logits.gather(-1, targets[:, None]).squeeze(-1)).mean()


def lr_schedule(step, max_lr, warmup_steps, total_steps, min_lr_ratio=0.1):
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    low = max_lr * min_lr_ratio
    return low + (max_lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


def clip_grad_norm(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    for g in grads:
        g.mul_(scale)
    return total
"""


# sample_next: a row of logits and two temperatures drawn fresh (4000 draws each), temperature 0, large logits.

def _sample_probe_inputs(rng: np.random.Generator) -> dict:
    row = np.sort(rng.uniform(-2, 2, int(rng.integers(4, 8))))[::-1].copy()
    return {"row": row.tolist(), "temperatures": [float(rng.uniform(0.3, 0.8)), float(rng.uniform(1.5, 3.0))],
            "seeds": [int(s) for s in rng.integers(0, 2**31, 3)], "logits": rng.standard_normal((5, 11)).astype(np.float32),
            "big": (1000 + rng.standard_normal((5, 11))).astype(np.float32)}


SAMPLE_RUN = HELPERS + """\
def _draw(_logits, _t, _seed):
    try:
        _got = sample_next(_logits, _t, torch.Generator().manual_seed(_seed))
    except Exception as _error:
        return 'raised ' + type(_error).__name__ + ': ' + str(_error)[:150]
    if not isinstance(_got, torch.Tensor) or _got.shape != _logits.shape[:1] or _got.is_floating_point():
        return 'returned ' + (str(tuple(_got.shape)) + ' ' + str(_got.dtype) if isinstance(_got, torch.Tensor) else _kind(_got))
    return _got.numpy()


_rows = torch.tensor(inputs['row'], dtype=torch.float32).repeat(4000, 1)
outputs = {'draws': [_draw(_rows, _t, _s) for _t, _s in zip(inputs['temperatures'], inputs['seeds'])]}
torch.manual_seed(inputs['seeds'][2])
outputs['again'] = _draw(_rows, inputs['temperatures'][0], inputs['seeds'][0])
outputs['zero'] = _draw(torch.from_numpy(inputs['logits']), 0.0, inputs['seeds'][2])
outputs['big'] = _draw(torch.from_numpy(inputs['big']), 0.05, inputs['seeds'][2])
del _draw, _rows
""" + CLEANUP


def _sample_reference(inputs: dict) -> dict:
    return {"row": inputs["row"], "temperatures": inputs["temperatures"],
            "argmax": np.asarray(inputs["logits"]).argmax(-1)}


def _compare_sample(outputs: dict, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("draws"), list):
        return "the hidden test's outputs should be a dict"
    for draws, temperature in zip(outputs["draws"], expected["temperatures"]):
        if not isinstance(draws, np.ndarray):
            return f"sample_next {draws}" if isinstance(draws, str) else HINT_TS_CALL
        problem = sampling_problem(expected["row"], temperature, draws)
        if problem:
            return problem
    again = outputs.get("again")
    if not (isinstance(again, np.ndarray) and np.array_equal(again, outputs["draws"][0])):
        return HINT_TS_GENERATOR
    zero = outputs.get("zero")
    if not (isinstance(zero, np.ndarray) and np.array_equal(zero, expected["argmax"])):
        return f"{HINT_TS_ZERO}" + (f" (sample_next {zero})" if isinstance(zero, str) else "")
    big = outputs.get("big")
    if not (isinstance(big, np.ndarray) and ((big >= 0) & (big < 11)).all()):
        return HINT_TS_OVERFLOW + (f" (sample_next {big})" if isinstance(big, str) else "")
    return None


# The run code of a decoder's probe: ``name(model, ids, max_new_tokens{extra})`` on the drawn GPT, again (the
# same tokens), and on the same weights with dropout left in training mode; ``more`` adds outputs.
DECODER_RUN = """\
from tfedu.config import ModelConfig as _ModelConfig
from tfedu.model import GPT as _GPT


def _model(_dropout):
    with torch.random.fork_rng(devices=[]):
        _m = _GPT(_ModelConfig(**inputs['config'], dropout=_dropout))
    _m.load_state_dict({{_k: torch.from_numpy(_v) for _k, _v in inputs['weights'].items()}})
    return _m.eval() if _dropout == 0 else _m.train()


_ids = torch.from_numpy(inputs['ids'])
_result = _call({name}, _model(0.0), _ids, inputs['max_new_tokens']{extra})
_again = {name}(_model(0.0), _ids.clone(), inputs['max_new_tokens']{extra})
_dropped = {name}(_model(0.5), torch.from_numpy(inputs['ids_dropout']), inputs['max_new_tokens']{extra})
outputs = {{
    'returned': [_kind(_result), _kind(_dropped)],
    'output': _array(_result), 'output_dropout': _array(_dropped),
    'repeatable': bool(isinstance(_result, torch.Tensor) and isinstance(_again, torch.Tensor)
                       and _result.shape == _again.shape and torch.equal(_result, _again)),
    'mutated': _MUTATED,{more}
}}
del _ModelConfig, _GPT, _model, _ids, _result, _again, _dropped
"""


def _decoder_run(name: str, extra: str = "", more: str = "") -> str:
    return HELPERS + DECODER_RUN.format(name=name, extra=extra, more=more) + CLEANUP


GREEDY_PROBE_RUN = _decoder_run("greedy_generate")
# One more call with one beam, which is greedy decoding: on the first 4 tokens of the prompts.
BEAM_PROBE_RUN = _decoder_run("beam_search", extra=", inputs['num_beams']", more="""
    'output_one': _array(beam_search(_model(0.0), _ids[:, :4].clone(), inputs['max_new_tokens'], 1)),""")


def _decoder_probe_inputs(rng: np.random.Generator, *, beams: bool) -> dict:
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
        if beams:
            inputs["num_beams"] = int(rng.integers(2, 5))
        expected, mistakes = _decoder_expected(inputs)
        outputs = [expected, *mistakes.values()] if beams else [expected]  # beams: every mistake told apart too
        wrongs = list(mistakes.values())
        if not any(wrong.shape == other.shape and torch.equal(wrong, other)
                   for i, other in enumerate(outputs) for wrong in wrongs[i:]):
            return inputs


def _greedy_probe_inputs(rng: np.random.Generator) -> dict:
    return _decoder_probe_inputs(rng, beams=False)


def _beam_probe_inputs(rng: np.random.Generator) -> dict:
    return _decoder_probe_inputs(rng, beams=True)


def _decoder_expected(inputs: dict, ids_key: str = "ids") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference's tokens for ``inputs[ids_key]`` (greedy, or beam search with ``num_beams``) and each mistake's."""
    model, ids, max_new = gpt_from_inputs(inputs), torch.from_numpy(inputs[ids_key]), inputs["max_new_tokens"]
    if "num_beams" not in inputs:
        return generate(model, ids, max_new), _greedy_mistakes(model, ids, max_new)
    return (reference_beam_search(model, ids, max_new, inputs["num_beams"]),
            _beam_mistakes(model, ids, max_new, inputs["num_beams"]))


def _decoder_reference(inputs: dict) -> dict:
    expected, mistakes = _decoder_expected(inputs)
    reference = {
        "returned": ["tensor", "tensor"],
        "output": as_array(expected),
        "output_dropout": as_array(_decoder_expected(inputs, "ids_dropout")[0]),
        "mistakes": [[hint, as_array(wrong)] for hint, wrong in mistakes.items()],
    }
    if "num_beams" in inputs:
        reference["output_one"] = as_array(generate(gpt_from_inputs(inputs), torch.from_numpy(inputs["ids"][:, :4]),
                                                    inputs["max_new_tokens"]))
    return reference


def _compare_decoder(outputs: dict, expected: dict, *, function: str, dtype_hint: str, random_hint: str,
                     no_crop_hint: str, dropout_hint: str) -> str | None:
    """A decoder's probe outputs against the reference: the kinds, the dtype, the same tokens twice, a named
    mistake, the tokens near n_ctx, then (beam search) one beam against greedy, then the dropout model's."""
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function=function)
    if problem:
        return problem
    got, want = outputs.get("output"), expected["output"]
    if isinstance(got, np.ndarray) and got.dtype.kind == "f":
        return dtype_hint.format(want="int64", got=got.dtype)
    if not outputs.get("repeatable"):
        return random_hint
    if isinstance(got, np.ndarray) and not (got.shape == want.shape and np.array_equal(got, want)):
        for hint, wrong in expected["mistakes"]:
            if got.shape == wrong.shape and np.array_equal(got, wrong) and not (
                    wrong.shape == want.shape and np.array_equal(wrong, want)):
                return hint
    call = f"{function}(model, ids, max_new_tokens{', num_beams' if 'output_one' in expected else ''})"
    labels = {"output": f"{call} with a prompt near model.cfg.n_ctx",
              "output_one": f"{function}(model, ids, max_new_tokens, 1) (one beam: greedy decoding)",
              "output_dropout": f"{call} with a dropout model in training mode"}
    problem = compare_outputs(outputs, {k: v for k, v in expected.items() if k in ("returned", "output")},
                              function=function, labels=labels, rtol=0, atol=0)
    if problem:
        return f"{problem} ({no_crop_hint}?)" if "shape" in problem else problem
    if "output_one" in expected:
        problem = compare_outputs(outputs, {"returned": expected["returned"], "output_one": expected["output_one"]},
                                  function=function, labels=labels, rtol=0, atol=0)
        if problem:
            return problem
    problem = compare_outputs(outputs, {"returned": expected["returned"], "output_dropout": expected["output_dropout"]},
                              function=function, labels=labels, rtol=0, atol=0)
    return f"{problem}: {dropout_hint}" if problem else None


def _compare_greedy(outputs: dict, expected: dict) -> str | None:
    return _compare_decoder(outputs, expected, function="greedy_generate", dtype_hint=HINT_GREEDY_DTYPE,
                            random_hint=HINT_GREEDY_RANDOM, no_crop_hint=HINT_GREEDY_NO_CROP,
                            dropout_hint=HINT_GREEDY_DROPOUT)


def _compare_beam(outputs: dict, expected: dict) -> str | None:
    return _compare_decoder(outputs, expected, function="beam_search", dtype_hint=HINT_BEAM_DTYPE,
                            random_hint=HINT_BEAM_RANDOM, no_crop_hint=HINT_BEAM_NO_CROP,
                            dropout_hint=HINT_BEAM_DROPOUT)


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
    "check_get_batch": Probe(
        exercise="ex_get_batch",
        make_inputs=_get_batch_probe_inputs,
        run=GET_BATCH_RUN,
        reference=_get_batch_reference,
        compare=_compare_get_batch,
        forbidden=("tfedu.data", "tfedu.train"),
    ),
    "check_cross_entropy": Probe(
        exercise="ex_cross_entropy",
        make_inputs=_cross_entropy_probe_inputs,
        run=CROSS_ENTROPY_RUN,
        reference=_cross_entropy_reference,
        compare=_compare_cross_entropy,
        forbidden=("tfedu.model", "tfedu.train", *CE_FORBIDDEN),
    ),
    "check_adamw_step": Probe(
        exercise="ex_adamw_step",
        make_inputs=_adamw_probe_inputs,
        run=ADAMW_RUN,
        reference=_adamw_reference,
        compare=_compare_adamw,
        forbidden=("tfedu.train", "torch.optim"),
    ),
    "check_lr_schedule": Probe(
        exercise="ex_lr_schedule",
        make_inputs=_lr_probe_inputs,
        run=LR_RUN,
        reference=_lr_reference,
        compare=_compare_lr,
        forbidden=("tfedu.train", "torch.optim"),
    ),
    "check_clip_grad_norm": Probe(
        exercise="ex_clip_grad_norm",
        make_inputs=_clip_probe_inputs,
        run=CLIP_RUN,
        reference=_clip_reference,
        compare=_compare_clip,
        forbidden=("tfedu.train", "torch.nn.utils"),
    ),
    "check_train_loop": Probe(
        exercise="ex_train_loop",
        make_inputs=_loop_probe_inputs,
        run=LOOP_PROBE_RUN,
        reference=_loop_probe_reference,
        compare=_compare_loop,
        forbidden=("tfedu.train",),
        builds=None,  # a loop over library calls: the model, the optimizer, torch.save, os
        standins=LOOP_STANDINS,
    ),
    "check_greedy": Probe(
        exercise="ex_greedy",
        make_inputs=_greedy_probe_inputs,
        run=GREEDY_PROBE_RUN,
        reference=_decoder_reference,
        compare=_compare_greedy,
        forbidden=("tfedu.generate",),
    ),
    "check_sample_next": Probe(
        exercise="ex_sample_next",
        make_inputs=_sample_probe_inputs,
        run=SAMPLE_RUN,
        reference=_sample_reference,
        compare=_compare_sample,
        forbidden=("tfedu.generate",),
        builds=ELEMENTARY | SOFTMAX | frozenset({"torch.multinomial"}),
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
    "check_beam_search": Probe(
        exercise="ex_beam_search",
        make_inputs=_beam_probe_inputs,
        run=BEAM_PROBE_RUN,
        reference=_decoder_reference,
        compare=_compare_beam,
        forbidden=("tfedu.generate", "transformers"),
        builds=ELEMENTARY | SOFTMAX,
    ),
}


HINTS = {
    "ex_get_batch": Hints(
        number="8.1",
        check="check_get_batch",
        idea=(
            "A batch is batch_size windows cut from random places in the long tensor of token ids. Each window "
            "holds seq_len + 1 consecutive tokens: the inputs are its first seq_len, the targets its last seq_len, so "
            "every position's target is the token after it. Every start that leaves room for a whole window must be "
            "possible, the last one included, and the starts come from the generator you are given, so that the "
            "same seed gives the same batch."
        ),
        approach=(
            "(1) Draw batch_size starts at once with torch.randint and generator=generator. The largest start s "
            "must leave seq_len + 1 tokens, so s + seq_len + 1 is at most len(data); mind that randint's upper bound "
            "is excluded. (2) For each start, slice seq_len + 1 tokens of data and stack the slices into a (batch_size, "
            "seq_len + 1) tensor. (3) x is that tensor without its last column, y without its first. Both stay "
            "torch.long, the dtype of the ids."
        ),
        skeleton=(
            "def get_batch(data, batch_size, seq_len, generator):\n"
            "    starts = torch.randint(____, ____, (batch_size,), generator=generator)\n"
            "    windows = torch.stack([data[____] for s in starts.tolist()])  # (batch_size, seq_len + 1)\n"
            "    return ____, ____\n"
        ),
    ),
    "ex_cross_entropy": Hints(
        number="8.2",
        check="check_cross_entropy",
        idea=(
            "At each position the loss is minus the log-probability of the target, and the log-probability of a "
            "token is its logit minus the log of the sum of exp over the row's logits. Computed in that form, no "
            "probability is ever formed, so nothing underflows; and subtracting the row's largest logit inside the "
            "exponentials (then adding it back outside the log) keeps them from overflowing. The loss of the batch "
            "is the mean over the positions whose target is not ignore_index."
        ),
        approach=(
            "(1) Flatten the leading axes: logits to (positions, d_vocab), targets to (positions,). (2) Keep the "
            "positions whose target differs from ignore_index (a boolean mask indexes both). (3) Per row: the "
            "largest logit m, then m plus the log of the sum of exp(logits - m): the log-sum-exp, shape (kept,). (4) "
            "The target's logit per row, with gather or indexing by (row, target). (5) The mean of the log-sum-exp "
            "minus the target's logit, a tensor of shape ()."
        ),
        skeleton=(
            "def cross_entropy(logits, targets, ignore_index=-100):\n"
            "    logits, targets = ____, ____  # (positions, d_vocab) and (positions,)\n"
            "    keep = ____  # the positions that are scored\n"
            "    logits, targets = ____, ____\n"
            "    top = ____  # (kept, 1): each row's largest logit\n"
            "    lse = ____  # (kept,): the log-sum-exp of each row\n"
            "    return (____ - ____).mean()\n"
        ),
    ),
    "ex_adamw_step": Hints(
        number="8.3",
        check="check_adamw_step",
        idea=(
            "AdamW keeps two running means per weight: m of the gradient and v of its square. Both start at zero, "
            "so early on they are too small, and dividing by 1 - beta^t (t the step number, from 1) corrects that. "
            "The step is lr times the corrected m over the root of the corrected v plus eps: each weight moves by "
            "about lr whatever the size of its gradient. Weight decay is separate from all that (decoupled): the "
            "weight first shrinks by a factor of 1 - lr times weight_decay."
        ),
        approach=(
            "(1) Update m: beta1 of the old m plus 1 - beta1 of the gradient. (2) Update v the same way with beta2 and "
            "the squared gradient. (3) Correct both: m_hat is m over 1 - beta1^t, v_hat is v over 1 - beta2^t. (4) "
            "Shrink the weight by 1 - lr times weight_decay. (5) Subtract lr times m_hat over the square root of "
            "v_hat plus eps (eps outside the root, as PyTorch does). Return the new weight, m and v as new tensors, "
            "without changing the ones you were given."
        ),
        skeleton=(
            "def adamw_step(param, grad, m, v, t, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):\n"
            "    beta1, beta2 = betas\n"
            "    m = ____\n"
            "    v = ____\n"
            "    m_hat, v_hat = ____, ____\n"
            "    param = param * ____  # decoupled weight decay, first\n"
            "    return param - ____, m, v\n"
        ),
    ),
    "ex_lr_schedule": Hints(
        number="8.4",
        check="check_lr_schedule",
        idea=(
            "Two pieces joined at step warmup_steps. The warm-up climbs in a straight line to the peak; with steps "
            "counted from 0, this course gives step t the fraction (t + 1) / warmup_steps of it, so that the first "
            "step already moves and the last warm-up step reaches the peak (the other convention in use, t / "
            "warmup_steps, spends its first step at 0). Then half a cosine carries the rate from the peak down to "
            "min_lr_ratio times the peak, reached exactly at the last step, total_steps - 1, and held after it."
        ),
        approach=(
            "(1) If step is below warmup_steps, return the peak times (step + 1) over warmup_steps. (2) Otherwise "
            "the progress through the decay is (step - warmup_steps) over (total_steps - 1 - warmup_steps): 0 at "
            "the first decay step, 1 at the last; cap it at 1, and divide by at least 1, so that a warm-up ending on "
            "the last step (a span of 0) leaves that step at the peak. (3) The "
            "floor is min_lr_ratio times the peak. (4) The rate is the floor plus (peak - floor) times (1 + "
            "cos(pi times progress)) / 2. Return a float."
        ),
        skeleton=(
            "def lr_schedule(step, max_lr, warmup_steps, total_steps, min_lr_ratio=0.1):\n"
            "    if step < warmup_steps:\n"
            "        return ____\n"
            "    progress = min(1.0, ____ / max(1, ____))\n"
            "    low = ____\n"
            "    return low + (max_lr - low) * ____\n"
        ),
    ),
    "ex_clip_grad_norm": Hints(
        number="8.5",
        check="check_clip_grad_norm",
        idea=(
            "Clipping by the global norm treats every parameter's gradient as one piece of one long vector. Its "
            "length is the square root of the sum of every squared entry of every gradient. If that length is "
            "above max_norm, every gradient is multiplied by the same factor, max_norm over the length, so the "
            "direction of the step is kept and only its size shrinks; below max_norm nothing changes. The "
            "function returns the length before clipping, the number worth logging."
        ),
        approach=(
            "(1) Collect the gradients, skipping parameters whose .grad is None. (2) The total norm: the square "
            "root of the sum, over the gradients, of the sum of their squares. (3) The factor: max_norm over the "
            "total norm plus a tiny 1e-6 (as PyTorch does, so a zero gradient divides safely), capped at 1. (4) "
            "Multiply each .grad by the factor in place, under torch.no_grad() or with an in-place method, since "
            "the optimizer reads .grad next. (5) Return the total norm from step 2."
        ),
        skeleton=(
            "def clip_grad_norm(parameters, max_norm):\n"
            "    grads = ____  # the .grad of each parameter that has one\n"
            "    total = ____  # one norm over all of them\n"
            "    factor = min(1.0, ____)\n"
            "    for g in grads:\n"
            "        ____  # in place\n"
            "    return total\n"
        ),
    ),
    "ex_train_loop": Hints(
        number="8.6",
        check="check_train_loop",
        idea=(
            "Each step sets the learning rate from the schedule, draws a batch, computes the loss, clears the old "
            "gradients, backpropagates, clips, and lets the optimizer step; the losses are kept as plain numbers. "
            "Every eval_every steps (and after the call's last step) the model is evaluated in eval mode without "
            "gradients, then a checkpoint stores everything the run needs to go on exactly as if never stopped: "
            "the weights, the optimizer's state, the generator's state and the number of steps done. Resuming reads "
            "that back and continues from the step it names; the schedule always spans the whole run."
        ),
        approach=(
            "(1) If resume, restore the checkpoint and load the model, the optimizer and the generator from it, and "
            "start at its step; else start at 0. The call ends at until when given, else at steps. (2) For each step: "
            "set every param group's lr to the schedule's rate for this step of a run of steps; get_batch; "
            "cross_entropy of the model's logits; zero the gradients, backward, clip_grad_norm to 1.0, optimizer step; append the "
            "loss as a float. (3) When the steps done are a multiple of eval_every, or this is the call's last step: "
            "model.eval() under torch.no_grad(), append (steps done, evaluate(model)), model.train(); then hand a "
            "dict of the four things to checkpoints.store (it writes atomically). (4) Return (losses, evals)."
        ),
        skeleton=(
            "def train_loop(model, optimizer, train_ids, generator, *, steps, batch_size, seq_len, max_lr, warmup_steps,\n"
            "               evaluate, eval_every, checkpoints, resume=False, until=None):\n"
            "    start = 0\n"
            "    if resume:\n"
            "        state = checkpoints.restore()\n"
            "        ____  # restore the model, the optimizer and the generator\n"
            "        start = ____\n"
            "    end = ____  # until, when given\n"
            "    losses, evals = ____\n"
            "    for step in ____:\n"
            "        for group in optimizer.param_groups:\n"
            "            group['lr'] = ____\n"
            "        x, y = ____\n"
            "        loss = ____\n"
            "        ____  # clear, backward, clip, step\n"
            "        losses.append(____)\n"
            "        if (step + 1) % eval_every == 0 or step + 1 == end:\n"
            "            ____  # evaluate in eval mode without gradients, then store the checkpoint\n"
            "    return losses, evals\n"
        ),
    ),
    "ex_greedy": Hints(
        number="8.7",
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
    "ex_sample_next": Hints(
        number="8.8",
        check="check_sample_next",
        idea=(
            "Sampling draws the next token from the model's distribution instead of taking its most probable one. "
            "The temperature reshapes that distribution first: it divides the logits, so below 1 the largest logits "
            "pull further ahead (sharper), above 1 they close up (flatter). At temperature 0 the limit is the argmax "
            "itself, greedy decoding, which must be handled apart since nothing can be divided by 0. The draw uses "
            "the generator it is given, so that the same seed writes the same text."
        ),
        approach=(
            "(1) If the temperature is 0, return the argmax of each row over the vocabulary: (batch,). (2) Otherwise "
            "divide the logits by the temperature and take the softmax over the last axis (torch.softmax subtracts "
            "the row's largest value, so large logits stay finite): (batch, d_vocab) probabilities. (3) Draw one "
            "index per row with torch.multinomial, passing generator=generator: (batch, 1). (4) Drop the last axis "
            "and return the ids as they come, integers."
        ),
        skeleton=(
            "def sample_next(logits, temperature, generator):\n"
            "    if temperature == 0:\n"
            "        return ____\n"
            "    probs = ____  # (batch, d_vocab)\n"
            "    return torch.multinomial(____, 1, generator=generator).____\n"
        ),
    ),
    "ex_top_k": Hints(
        number="8.9",
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
        number="8.10",
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
    "ex_beam_search": Hints(
        number="8.11",
        check="check_beam_search",
        idea=(
            "Beam search keeps, for each prompt, the num_beams partial continuations with the highest total "
            "log-probability so far. At every step each kept beam is extended by every token of the vocabulary, "
            "each extension scored by its beam's total plus the new token's log-probability (log-probabilities "
            "add where probabilities multiply), and the num_beams best extensions over all beams together become "
            "the new beams. It starts from a single beam, the prompt, with score 0; with one beam it is greedy "
            "decoding. At the end the beam with the highest total is the answer."
        ),
        approach=(
            "Evaluation mode first, then one prompt at a time (a loop over the rows of ids). Keep the beams as a "
            "(beams, length) tensor, one row to start, and their scores as a (beams,) tensor. Each step: crop the "
            "beams to their last model.cfg.n_ctx tokens and run them through the model together; the last "
            "position's log-probabilities over the vocabulary are (beams, d_vocab); add each beam's score to its "
            "row. Flatten that table and take its num_beams largest entries with topk: the values are the new "
            "scores, and each flat index splits, by whole division and remainder by the vocabulary size, into "
            "the parent beam's row and the token. New beams: the parents' rows, picked in that order, with the "
            "tokens appended as a column. topk sorts, so row 0 is the best beam at the end; stack the prompts' "
            "best rows into (batch, pos + max_new_tokens)."
        ),
        skeleton=(
            "@torch.no_grad()\n"
            "def beam_search(model, ids, max_new_tokens, num_beams):\n"
            "    model.____()\n"
            "    best = []\n"
            "    for prompt in ids:\n"
            "        beams, scores = ____, ____  # (1, pos) and (1,): one beam, score 0\n"
            "        for _ in range(max_new_tokens):\n"
            "            log_probs = ____  # (beams, d_vocab): the last position, cropped context\n"
            "            totals = ____  # each extension's total score\n"
            "            scores, flat = ____  # the num_beams best over all beams and tokens\n"
            "            parent, token = ____, ____\n"
            "            beams = torch.cat([____, ____], dim=1)\n"
            "        best.append(____)\n"
            "    return torch.stack(best)\n"
        ),
    ),
}

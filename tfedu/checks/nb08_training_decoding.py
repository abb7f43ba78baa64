"""Checkers for notebooks/08_training_and_decoding.ipynb: the training parts, greedy decoding, top-k and top-p.

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
- 8.4 ``greedy_generate(model, ids, max_new_tokens)``: the first position's logits instead of the
  last's, the argmax over the positions instead of the vocabulary, returning only the new tokens or
  only the prompt, feeding the prompt again each step instead of the grown sequence, no cropping to
  ``model.cfg.n_ctx`` (the model refuses) or cropping the start instead of the end, sampling instead
  of the argmax, dropout left on (no ``model.eval()``), the prompt changed in place. Compared with
  ``tfedu.generate.generate(..., do_sample=False)`` on a tiny seeded GPT, with a prompt near n_ctx.
- 8.5 ``top_k_filter(logits, k)``: k + 1 or k - 1 tokens kept, the k smallest kept, probabilities
  returned (softmax applied), 0 or a large negative number instead of -inf, ties at the k-th value
  dropped (transformers keeps every logit >= the k-th largest), the input changed in place, a filter
  that works on one row (d_vocab,) but not on a batch. Compared with ``tfedu.generate.filter_top_k``.
- 8.6 ``top_p_filter(logits, p)``: the nucleus without the token that carries the mass across p,
  the tokens sorted least likely first, probabilities returned (renormalised or not), an empty
  nucleus for a small p (the most likely token is always kept), the mask put back in the wrong
  order (left in sorted order, or gathered where it should be scattered), 0 instead of -inf, the
  input changed in place, one row only, probabilities taken as exp over the sum without subtracting the
  largest logit (NaN on logits near 100: a confident model, or a temperature of 0.1). Compared with
  ``tfedu.generate.filter_top_p``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    watch_calls,
)
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, backward, compare_outputs, leaf
from tfedu.config import ModelConfig
from tfedu.generate import filter_top_k, filter_top_p, generate
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


# ----------------------------------------------------------------------------- 8.4 greedy_generate

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


# ----------------------------------------------------------------------------- 8.5 top_k_filter

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


# ----------------------------------------------------------------------------- 8.6 top_p_filter

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
        hint = _named_in_outputs(got, expected[f"output_{key}"], expected["mistakes"][key])
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


def _named_in_outputs(got: Any, want: np.ndarray, mistakes: list, *, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """The hint of the first mistake (``[hint, array]`` pairs) whose output ``got`` matches and the reference does not."""
    if not isinstance(got, np.ndarray) or got.shape != np.shape(want) or not np.isfinite(got).all():
        return None
    for hint, wrong in mistakes:
        wrong = np.asarray(wrong)
        if wrong.shape == got.shape and np.isfinite(wrong).all() and np.allclose(got, wrong, rtol=rtol, atol=atol) \
                and not np.allclose(want, wrong, rtol=rtol, atol=atol):
            return hint
    return None


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
    hint = _named_in_outputs(outputs["output"], expected["output"], expected["mistakes"], rtol=1e-4, atol=1e-6)
    if hint:
        return f"{AW_LABELS['output']}: {hint}"
    return compare_outputs({**outputs, "returned": []}, {"returned": [], "output": expected["output"],
                           "output_defaults": expected["output_defaults"]}, function="adamw_step", labels=AW_LABELS,
                           rtol=1e-4, atol=1e-6)


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
    "ex_greedy": Hints(
        number="8.4",
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
        number="8.5",
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
        number="8.6",
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

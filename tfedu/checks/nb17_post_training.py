"""Checkers for notebooks/17_post_training.ipynb: the SFT loss mask, DPO's loss, GRPO's advantages and clipped loss,
and the unbiased pass@k.

Exercise 17.1, ``sft_loss(logits, ids, mask) -> loss``: the mean next-token cross-entropy over the answer tokens of
the whole batch; ``mask[b, t]`` marks token ``ids[b, t]`` as an answer token, which the prediction at t - 1 scores.
Named: no shift, the mask not shifted with the targets, the shift the wrong way (position t + 1 scored on token t),
the two masks combined, every position scored, the masked losses averaged over every position, every real token
(``ids != 0``), the mask inverted, the mean per sequence then over sequences, a sum, a softmax then a log (inf or
NaN at logits of 1e3 and 1e4), a Python number, a per-sequence or per-token result, no gradient. See
:func:`check_sft_loss`.

Exercise 17.2, ``dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta) -> loss``: Rafailov et al.
(2023), eq. 7, averaged over the pairs. Named: no reference, chosen and rejected swapped, the reference added, no
beta, beta on one side only, beta outside the log-sigmoid, the outer minus missing, a log of a sigmoid or a log of
one plus an exponential (inf at a margin of -1500), probabilities for log-probabilities, a sum over pairs, the
per-pair losses returned, no gradient. See :func:`check_dpo_loss`.

Exercise 17.3, ``group_advantages(rewards) -> advantages``: per row (one prompt's group), the reward minus the
group's mean over the group's unbiased std plus ``GROUP_STD_EPS = 1e-4`` (trl's). Named: the whole batch's
statistics, the wrong axis, no division (Dr. GRPO's variant), the biased std, no eps (NaN on a constant group), eps
inside the square root, another eps, the std floored at eps, NaNs patched afterwards (no eps), the variance, the max
for the mean, a flattened result. See :func:`check_group_advantages`.

Exercise 17.4, ``grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.04) -> loss``: PPO's
clipped surrogate per token with the k3 KL to the reference, averaged over each answer's tokens then over the
answers. Named: max for min, the clipped term alone, no clipping, the product ratio * A clipped, the ratio as a
quotient or a difference of log-probabilities, the ratio inverted, the ratio to the reference, clip_eps or beta
hard-coded, the k1 or k2 estimator, k3 with the two models swapped, no beta, the KL subtracted, the loss's sign, no
KL, the padding counted (in the mean, or summed with the mask's count), the token mean over the batch (DAPO's
aggregation), the sums per answer, the advantages along the positions or clipped, no gradient. See
:func:`check_grpo_loss`.

Exercise 17.5, ``pass_at_k(n, c, k) -> float``: Chen et al. (2021)'s unbiased estimator ``1 - C(n - c, k) / C(n,
k)``. Named: the plug-in ``1 - (1 - c/n)^k``, c / n, k and c swapped in the product, an off-by-one range, the case
n - c < k (must be 1), 1 returned at n - c == k too, the "1 -" forgotten, C(c, k) for C(n - c, k), integer division,
overflow or NaN at n = 200 and 1000, not a number. An exact ``math.comb`` answer is right. See
:func:`check_pass_at_k`.

``tfedu.tuning`` (the reference library) is refused by every check.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tfedu.checks.building_blocks import ACTIVATIONS, ELEMENTARY, SOFTMAX
from tfedu.checks.core import (CheckFailure, ExerciseNotDone, Hints, Probe, call_learner, checker, describe,
                               globals_from_modules)
from tfedu.checks.probes import CLEANUP, HELPERS, HINT_GRAD_MISSING
from tfedu.tuning import GROUP_STD_EPS, dpo_loss, group_advantages, grpo_loss, pass_at_k, sft_loss

FORBIDDEN = ("tfedu.tuning",)
HINT_SHORTCUT = "your {function} uses {names} from tfedu: {what} is the exercise, so build it from tensor operations"
HINT_GRAD_WRONG = ("your {function} has the right value but a wrong gradient with respect to {name} ({what}): is part "
                   "of it detached (.detach(), .data, torch.no_grad()) or rebuilt from numbers?")
HINT_NOT_SCALAR = ("{function} should return the loss as a single number in a tensor of shape () (0-dimensional, "
                   "with a gradient), got {got}")
HINT_FLOAT = ("{function} returned a Python number: .item() (or float()) cuts the loss off from the computation, so "
              "nothing can be backpropagated. Return the tensor itself, of shape ()")


def _refuse(fn: Any, function: str, what: str) -> None:
    names = globals_from_modules(fn, FORBIDDEN)
    if names:
        raise CheckFailure(HINT_SHORTCUT.format(function=function, names=", ".join(names), what=what))


def _close(got: Any, want: Any, rtol: float, atol: float) -> bool:
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    return got.shape == want.shape and bool(torch.isfinite(got).all()) and bool(
        torch.allclose(got, want, rtol=rtol, atol=atol))


def _judge(gots: list[Any], wants: list[Any], mistakes: list[list[tuple[str, Any]]], *,
           tolerances: list[tuple[float, float]], nonfinite: Any = None, differs: Any) -> None:
    """Judge an answer over all the cases at once; raise a CheckFailure unless every ``gots[i]`` matches ``wants[i]``.

    ``gots[i]`` is None where the answer gave nothing to compare (it raised, or returned the wrong kind; the caller
    reports that). ``mistakes[i]`` lists (hint, the mistake's value or None where it is not defined) in one order
    for every case. A mistake is named only when the answer matches it in *every* case where it is defined, and it
    differs from the reference in at least one: one case alone lets two slips coincide by chance. ``nonfinite(i)``
    gives a hint for a NaN or inf in case i (or None); ``differs(i)`` the message when nothing is named.
    """
    rtol, atol = tolerances[0]
    bad = [i for i, (g, w) in enumerate(zip(gots, wants)) if g is not None and not _close(g, w, rtol, atol)]
    if not bad:
        return
    if nonfinite is not None:
        for i in bad:
            if not torch.isfinite(torch.as_tensor(gots[i])).all() and (hint := nonfinite(i)):
                raise CheckFailure(hint)
    for rtol, atol in tolerances:
        for j in range(len(mistakes[bad[0]])):
            defined = [i for i, g in enumerate(gots) if g is not None and mistakes[i][j][1] is not None]
            differing = [i for i in defined if not _close(mistakes[i][j][1], wants[i], rtol, atol)]
            if differing and all(_close(gots[i], mistakes[i][j][1], rtol, atol) for i in defined):
                raise CheckFailure(mistakes[differing[0]][j][0])
    raise CheckFailure(differs(bad[0]))


def _scalar_result(got: Any, function: str, *, per_rows: int | None = None, per_row_hint: str = "") -> torch.Tensor:
    """``got`` as a 0-dim float tensor, or a CheckFailure that says what it is."""
    if isinstance(got, (float, int)) and not isinstance(got, bool):
        raise CheckFailure(HINT_FLOAT.format(function=function))
    if not isinstance(got, torch.Tensor) or not got.is_floating_point():
        raise CheckFailure(HINT_NOT_SCALAR.format(function=function, got=describe(got)))
    if got.dim() != 0:
        if per_rows is not None and tuple(got.shape) == (per_rows,) and per_row_hint:
            raise CheckFailure(per_row_hint)
        raise CheckFailure(HINT_NOT_SCALAR.format(function=function, got=describe(got)))
    return got


def _grad_of(value: torch.Tensor, wrt: torch.Tensor) -> torch.Tensor | None:
    if not value.requires_grad:
        return None
    (grad,) = torch.autograd.grad(value, [wrt], allow_unused=True)
    return grad


def _grad_problem(got: torch.Tensor | None, want: torch.Tensor, function: str, name: str, what: str) -> str | None:
    """None when the learner's gradient ``got`` matches ``want`` (loosely: it amplifies rounding)."""
    if got is None:
        return HINT_GRAD_MISSING.format(function=function)
    scale = max(1.0, float(want.abs().max()))
    if not _close(got, want, 1e-3, 1e-5 * scale):
        return HINT_GRAD_WRONG.format(function=function, name=name, what=what)
    return None


# ----------------------------------------------------------------------------- 17.1 the SFT loss

HINT_SFT_CALL = ("sft_loss(logits, ids, mask): logits (batch, pos, d_vocab), ids (batch, pos) int64, mask (batch, "
                 "pos) bool, True on the answer tokens; return the mean loss, a tensor of shape ()")
HINT_SFT_NO_SHIFT = (
    "you scored each position's prediction against the token at that same position: the model's output at position "
    "t predicts the *next* token, t + 1. So the logits of positions 0 .. pos - 2 are scored against the tokens at "
    "1 .. pos - 1, and the mask that says which of those targets count is the mask of the targets, from position 1 on"
)
HINT_SFT_WRONG_WAY = (
    "the targets are shifted but the mask is not shifted with them: you kept the mask of positions 0 .. pos - 2, "
    "which marks the *inputs* of the predictions, not their targets. mask[b, t] says whether token t is an answer "
    "token, and token t is predicted at position t - 1: take the mask from position 1 on, as the targets"
)
HINT_SFT_EVERY = ("you scored every position, padding included: the loss of instruction tuning counts only the "
                  "answer tokens (the mask), not the prompt, the role markers or the padding after the answer")
HINT_SFT_ZEROED_MEAN = (
    "you multiplied the token losses by the mask and then averaged over every position: the zeros you put on the "
    "prompt and the padding still count in the denominator, so the loss is divided by batch times (pos - 1) instead "
    "of by the number of answer tokens. Average over the answer tokens only"
)
HINT_SFT_BACKWARD = (
    "you shifted the wrong way: you scored the output at position t + 1 against the token at t, as if the model "
    "predicted the token before. The output at position t predicts the token at t + 1: the logits lose their last "
    "position, the ids and the mask their first"
)
HINT_SFT_BOTH_MASKS = (
    "you kept only the targets whose input is an answer token too (the two masks combined): that drops each "
    "answer's first token, which is predicted from the last token before the answer. The mask of the targets alone "
    "says which predictions count"
)
HINT_SFT_REAL_TOKENS = (
    "you scored every real token (every id that is not padding), the prompt included: that is pretraining's loss on "
    "a chat. Instruction tuning puts its loss on the answer tokens only, the ones the mask marks"
)
HINT_SFT_INVERTED = ("you scored the tokens the mask leaves out (the prompt, the markers, the padding) instead of the "
                     "ones it marks: True in the mask means an answer token, the ones to learn")
HINT_SFT_PER_SEQUENCE = (
    "you averaged over each sequence's answer tokens first, then over the sequences: then a short answer's tokens "
    "weigh more than a long one's. The loss is the mean over all the answer tokens of the batch together, each token "
    "weighing the same (as Hugging Face's and trl's)"
)
HINT_SFT_SUM = ("you summed the token losses instead of averaging them: the loss would grow with the batch and the "
                "answers' lengths. Divide by the number of answer tokens in the batch")
HINT_SFT_SUM_PER_SEQ = ("you summed each answer's token losses and averaged over the sequences: divide by the number "
                        "of answer tokens in the whole batch instead, so that every answer token weighs the same")
HINT_SFT_UNSTABLE = (
    "your loss is {value} on logits of size about {scale:g}, where the right loss is finite: a softmax followed by a "
    "log gives log(0) = -inf for a token whose probability underflows (and exp of a large logit overflows). Take the "
    "log-softmax directly, which subtracts the max and never forms the tiny probability: F.log_softmax, or "
    "F.cross_entropy, which does the same"
)
HINT_SFT_PER_ROW = ("sft_loss returned one number per sequence: the loss is one number, the mean over all the answer "
                    "tokens of the batch")
HINT_SFT_DIFFERS = "your loss is {got:.6g} on {what}; the mean cross-entropy over the answer tokens is {want:.6g}"


def sft_case(rng: np.random.Generator, batch: int, pos: int, d_vocab: int, scale: float = 3.0) -> dict[str, np.ndarray]:
    """Right-padded chats (padding id 0, never a real id) of different lengths: a prompt, an answer the mask marks,
    padding. The first row fills the width, the last is padded. At large scales one answer token's logit is set
    far below its row's max, so that its probability underflows float32."""
    ids = np.zeros((batch, pos), dtype=np.int64)
    mask = np.zeros((batch, pos), dtype=bool)
    for b in range(batch):
        length = pos if b == 0 else int(rng.integers(3, pos)) if b == batch - 1 else int(rng.integers(3, pos + 1))
        prompt = int(rng.integers(1, length - 1))
        ids[b, :length] = rng.integers(1, d_vocab, length)
        mask[b, prompt:length] = True
    logits = (rng.standard_normal((batch, pos, d_vocab)) * scale).astype(np.float32)
    if scale >= 100:
        b, t = 0, int(np.flatnonzero(mask[0])[0])
        logits[b, t - 1, ids[b, t]] = logits[b, t - 1].min() - 5 * scale
    return {"logits": logits, "ids": ids, "mask": mask}


def sft_cases() -> list[tuple[str, dict[str, np.ndarray]]]:
    return [
        ("3 chats of different lengths, 9 positions, 11 tokens", sft_case(np.random.default_rng(0), 3, 9, 11)),
        ("5 chats, 12 positions, 7 tokens", sft_case(np.random.default_rng(1), 5, 12, 7)),
        ("logits of size about 1e3", sft_case(np.random.default_rng(2), 3, 8, 13, scale=1e3)),
        ("logits of size about 1e4", sft_case(np.random.default_rng(3), 2, 10, 9, scale=1e4)),
    ]


def _tensors(case: dict[str, Any], floats: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(np.array(value), requires_grad=name in floats) for name, value in case.items()
            if isinstance(value, np.ndarray) or isinstance(value, list)}


def reference_sft_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return sft_loss(logits, ids, mask)


def sft_mistakes(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    logp_all = F.log_softmax(logits.detach().double(), dim=-1)
    same = logp_all.gather(-1, ids[..., None])[..., 0]  # batch pos: token t at position t
    nxt = logp_all[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # batch pos-1
    target = mask[:, 1:]
    real = ids[:, 1:] != 0
    counts = target.sum(-1).clamp(min=1)
    back = logp_all[:, 1:].gather(-1, ids[:, :-1, None])[..., 0]  # batch pos-1: position t + 1 scored on token t
    return [
        (HINT_SFT_NO_SHIFT, -same[mask].mean()),
        (HINT_SFT_NO_SHIFT, -same[:, :-1][mask[:, 1:]].mean()),
        (HINT_SFT_WRONG_WAY, -nxt[mask[:, :-1]].mean()),
        (HINT_SFT_EVERY, -nxt.mean()),
        (HINT_SFT_ZEROED_MEAN, -(nxt * target).mean()),
        (HINT_SFT_BACKWARD, -back[mask[:, :-1]].mean()),
        (HINT_SFT_BACKWARD, -back[target].mean()),
        (HINT_SFT_BOTH_MASKS, -nxt[target & mask[:, :-1]].mean()),
        (HINT_SFT_REAL_TOKENS, -nxt[real].mean()),
        (HINT_SFT_INVERTED, -nxt[~target].mean()),
        (HINT_SFT_INVERTED, -nxt[~target & real].mean()),
        (HINT_SFT_PER_SEQUENCE, (-(nxt * target).sum(-1) / counts).mean()),
        (HINT_SFT_SUM, -nxt[target].sum()),
        (HINT_SFT_SUM_PER_SEQ, -nxt[target].sum() / ids.shape[0]),
    ]


def judge_sft(values: list[torch.Tensor | None], cases: list[dict], whats: list[str]) -> None:
    """Raise a CheckFailure naming the mistake unless each value is :func:`tfedu.tuning.sft_loss` on its case."""
    tensors = [_tensors(c) for c in cases]
    wants = [reference_sft_loss(t["logits"], t["ids"], t["mask"]) for t in tensors]
    _judge(values, wants, [sft_mistakes(t["logits"], t["ids"], t["mask"]) for t in tensors],
           tolerances=[(1e-4, 1e-5)],
           nonfinite=lambda i: HINT_SFT_UNSTABLE.format(value=float(values[i]), scale=_case_scale(cases[i]["logits"])),
           differs=lambda i: HINT_SFT_DIFFERS.format(got=float(values[i]), what=whats[i], want=float(wants[i])))


def _sft_grad(case: dict) -> torch.Tensor:
    t = _tensors(case, floats=("logits",))
    return torch.autograd.grad(reference_sft_loss(t["logits"], t["ids"], t["mask"]), [t["logits"]])[0]


def _collect(call: Any, items: Any) -> tuple[list[Any], CheckFailure | None]:
    """``call(item)`` for each item until one fails its check: (the results before, that failure or None)."""
    results = []
    for item in items:
        try:
            results.append(call(item))
        except ExerciseNotDone:
            raise
        except CheckFailure as failure:
            return results, failure
    return results, None


def _from_probe(results: list[Any], problem: Any) -> tuple[list[Any], str | None]:
    """A probe's results up to the first that is no value (a dict), and the message for that one (or None)."""
    values = []
    for i, got in enumerate(results):
        if not isinstance(got, dict):
            return values, f"hidden test {i + 1}: {problem(i, got)}"
        values.append(got)
    return values, None


def _judged_probe(outputs: Any, expected: dict, function: str, rows_key: str, per_row_hint: str, judge: Any,
                  raised_hint: str | None = None) -> tuple[list[dict], str | None]:
    """The probe's per-case results once the values pass ``judge``: (values, None), or ([], the message).

    Shared by the loss probes: every case must have run, no input may be changed, each result must be a
    tensor of shape () (a float, a per-row tensor or an error is named), and the values are judged together
    so that a mistake is named only when it explains every case.
    """
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(expected["cases"]):
        return [], f"{function}'s hidden test did not run every case"
    if (problem := _mutated(outputs, function)):
        return [], problem
    cases = expected["cases"]

    def kind_problem(i: int, got: str) -> str:
        if got == "float":
            return HINT_FLOAT.format(function=function)
        if raised_hint is not None and got.startswith("raised "):
            return f"{function} {got} ({raised_hint})"
        return per_row_hint if got == f"tensor of shape ({np.array(cases[i][rows_key]).shape[0]},)" else \
            HINT_NOT_SCALAR.format(function=function, got=got)

    values, problem = _from_probe(outputs["results"], kind_problem)
    try:
        judge([torch.as_tensor(np.array(v["value"])) for v in values], cases[:len(values)],
              [f"hidden test {i + 1}" for i in range(len(cases))])
    except CheckFailure as failure:
        return [], f"hidden test: {failure}"
    return (values, None) if problem is None else ([], problem)


def _case_scale(logits: np.ndarray) -> float:
    return float(10 ** round(math.log10(max(1.0, float(np.abs(logits).std())))))


@checker("the SFT loss")
def check_sft_loss(sft_loss) -> None:
    """Check ``sft_loss(logits, ids, mask)`` against :func:`tfedu.tuning.sft_loss`, value and gradient."""
    _refuse(sft_loss, "sft_loss", "the loss")
    whats, cases = zip(*sft_cases())
    leaves = [_tensors(c, floats=("logits",)) for c in cases]

    def call(t: dict[str, torch.Tensor]) -> torch.Tensor:
        got = call_learner(sft_loss, t["logits"], t["ids"].clone(), t["mask"].clone(), name="sft_loss",
                           error_hint=HINT_SFT_CALL)
        return _scalar_result(got, "sft_loss", per_rows=t["ids"].shape[0], per_row_hint=HINT_SFT_PER_ROW)

    got, failure = _collect(call, leaves)
    judge_sft([g.detach() for g in got], list(cases[:len(got)]), list(whats))
    if failure:
        raise failure
    for g, t, case, what in zip(got, leaves, cases, whats):
        if (problem := _grad_problem(_grad_of(g, t["logits"]), _sft_grad(case), "sft_loss", "the logits", what)):
            raise CheckFailure(problem)


SFT_PROBE_RUN = HELPERS + """\
_results = []
for _c in inputs['cases']:
    _logits = torch.tensor(_c['logits'], requires_grad=True)
    _r = _call(sft_loss, _logits, torch.from_numpy(np.array(_c['ids'])), torch.from_numpy(np.array(_c['mask'])))
    if isinstance(_r, torch.Tensor) and _r.is_floating_point() and _r.dim() == 0:
        _g = _backward([_r], [torch.ones(())], {'logits': _logits})
        _results.append({'value': _array(_r), 'grad': _g if isinstance(_g, str) else _g['logits']})
    else:
        _results.append(_kind(_r) + (' of shape ' + str(tuple(_r.shape)) if isinstance(_r, torch.Tensor) else ''))
outputs = {'results': _results, 'mutated': list(_MUTATED)}
del _results, _c, _logits, _r
""" + CLEANUP


def _sft_probe_inputs(rng: np.random.Generator) -> dict:
    cases = [sft_case(rng, int(rng.integers(2, 6)), int(rng.integers(5, 14)), int(rng.integers(5, 20)))
             for _ in range(2)]
    cases.append(sft_case(rng, int(rng.integers(2, 5)), int(rng.integers(5, 10)), int(rng.integers(5, 15)), scale=1e3))
    cases.append(sft_case(rng, int(rng.integers(2, 5)), int(rng.integers(5, 10)), int(rng.integers(5, 15)), scale=1e4))
    return {"cases": cases}


def _mutated(outputs: dict, function: str) -> str | None:
    if outputs.get("mutated"):
        return f"{function} changed one of its input tensors in place: build new tensors instead"
    return None


def _compare_sft(outputs: Any, expected: dict) -> str | None:
    values, problem = _judged_probe(outputs, expected, "sft_loss", "ids", HINT_SFT_PER_ROW, judge_sft)
    if problem:
        return problem
    cases = expected["cases"]
    for i, (got, case) in enumerate(zip(values, cases)):
        where = f"hidden test {i + 1}: "
        if isinstance(got["grad"], str) and got["grad"] != "missing":
            return where + HINT_GRAD_WRONG.format(function="sft_loss", name="the logits", what=got["grad"])
        grad = None if isinstance(got["grad"], str) else torch.as_tensor(np.array(got["grad"]))
        if (problem := _grad_problem(grad, _sft_grad(case), "sft_loss", "the logits", f"hidden test {i + 1}")):
            return where + problem
    return None


# ----------------------------------------------------------------------------- 17.2 the DPO loss

HINT_DPO_CALL = ("dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta): four tensors (batch,) of "
                 "sequence log-probabilities and a float; return the mean loss, a tensor of shape ()")
HINT_DPO_NO_REF = (
    "the reference model's log-probabilities are missing: the implicit reward of an answer is beta times how much "
    "*more* likely the policy makes it than the reference does, the policy's log-probability minus the reference's. "
    "Without the reference, DPO is no longer tied to where the policy started"
)
HINT_DPO_SWAPPED = ("chosen and rejected are the wrong way round (or the margin's sign is flipped): the loss must "
                    "fall when the chosen answer's reward rises above the rejected one's, so the margin is the "
                    "chosen answer's reward minus the rejected one's")
HINT_DPO_REF_ADDED = ("the reference's log-probabilities are added, not subtracted: each answer's implicit reward is "
                      "the policy's log-probability *minus* the reference's")
HINT_DPO_NO_BETA = "beta is missing: it scales the margin inside the log-sigmoid (with beta = {beta:g} here)"
HINT_DPO_BETA_OUTSIDE = ("beta multiplies the log-sigmoid instead of its argument: beta scales the implicit rewards, "
                         "so it goes inside, on the margin")
HINT_DPO_UNSTABLE = (
    "your loss is {value} on pairs one of which has a scaled margin of about -1500, where the right loss is finite "
    "(that pair's is about 1500): the sigmoid of -1500 underflows to 0 and its log to log(0) = -inf, and written "
    "as the log of one plus an exponential, exp of +1500 overflows to inf just the same. Use a form that never "
    "exponentiates a large positive number: PyTorch's log-sigmoid (F.logsigmoid), or softplus (F.softplus) of "
    "minus the margin, computes the same value and stays finite"
)
HINT_DPO_NO_MINUS = (
    "your loss is negative: you averaged the log-sigmoid itself, the log-likelihood of the preferences, which "
    "training should raise. The loss is *minus* the log-sigmoid (it is at least 0, and falls as the chosen "
    "answer's reward pulls ahead)"
)
HINT_DPO_BETA_ONE_SIDE = ("beta scales one answer's log-ratio but not the other's: each answer's implicit reward "
                          "is beta times its log-ratio, so beta multiplies the whole margin")
HINT_DPO_PROBS = ("you used probabilities (the exponentials of the log-probabilities) in the margin: the implicit "
                  "reward is made of log-probabilities, beta times the log of the ratio policy / reference")
HINT_DPO_SUM = "you summed the loss over the pairs: DPO's loss is their mean, which does not grow with the batch size"
HINT_DPO_PER_PAIR = ("dpo_loss returned one loss per pair: return their mean, one number, so that the training loop "
                     "can backpropagate it")
HINT_DPO_DIFFERS = "your loss is {got:.6g} on {what}; DPO's loss is {want:.6g}"


def dpo_case(rng: np.random.Generator, batch: int, beta: float, *, large: bool = False, small: bool = False) -> dict:
    """Sequence log-probabilities: the reference near the policy, margins of both signs. ``large``: one pair's scaled
    margin about -1500, another's +1500. ``small``: log-probabilities near 0, where their exponentials matter."""
    low, high = (0.2, 3.0) if small else (5.0, 60.0)
    pc, pr = -rng.uniform(low, high, batch), -rng.uniform(low, high, batch)
    rc, rr = pc + rng.normal(0, 1.5, batch), pr + rng.normal(0, 1.5, batch)
    rc, rr = np.minimum(rc, -0.05), np.minimum(rr, -0.05)
    if large:
        pc[0], rc[0], pr[0], rr[0] = -1600.0, -100.0, -120.0, -110.0
        pc[1], rc[1], pr[1], rr[1] = -50.0, -60.0, -1700.0, -200.0
    as32 = {name: x.astype(np.float32) for name, x in
            (("policy_chosen", pc), ("policy_rejected", pr), ("ref_chosen", rc), ("ref_rejected", rr))}
    return {**as32, "beta": float(beta)}


def dpo_cases() -> list[tuple[str, dict]]:
    return [
        ("6 pairs, beta = 0.1", dpo_case(np.random.default_rng(10), 6, 0.1)),
        ("5 pairs of short answers, beta = 0.5", dpo_case(np.random.default_rng(11), 5, 0.5, small=True)),
        ("4 pairs, beta = 2", dpo_case(np.random.default_rng(12), 4, 2.0)),
        ("4 pairs, two with margins of about -1500 and +1500, beta = 1", dpo_case(np.random.default_rng(13), 4, 1.0,
                                                                                   large=True)),
    ]


DPO_ARGS = ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected")


def reference_dpo_loss(pc, pr, rc, rr, beta) -> torch.Tensor:
    return dpo_loss(pc, pr, rc, rr, beta)


def dpo_mistakes(pc, pr, rc, rr, beta) -> list[tuple[str, torch.Tensor]]:
    pc, pr, rc, rr = (x.detach().double() for x in (pc, pr, rc, rr))
    margin = (pc - rc) - (pr - rr)

    def loss(m, b=beta):
        return -F.logsigmoid(b * m).mean()

    return [
        (HINT_DPO_NO_REF, loss(pc - pr)),
        (HINT_DPO_SWAPPED, loss(-margin)),
        (HINT_DPO_REF_ADDED, loss((pc + rc) - (pr + rr))),
        (HINT_DPO_NO_BETA.format(beta=beta), loss(margin, 1.0)),
        (HINT_DPO_BETA_OUTSIDE, -(beta * F.logsigmoid(margin)).mean()),
        (HINT_DPO_PROBS, loss((pc.exp() - rc.exp()) - (pr.exp() - rr.exp()))),
        (HINT_DPO_PROBS, loss(pc.exp() / rc.exp() - pr.exp() / rr.exp())),
        (HINT_DPO_SUM, -F.logsigmoid(beta * margin).sum()),
        (HINT_DPO_NO_MINUS, F.logsigmoid(beta * margin).mean()),
        (HINT_DPO_BETA_ONE_SIDE, loss(beta * (pc - rc) - (pr - rr), 1.0)),
        (HINT_DPO_BETA_ONE_SIDE, loss((pc - rc) - beta * (pr - rr), 1.0)),
    ]


def judge_dpo(values: list[torch.Tensor | None], cases: list[dict], whats: list[str]) -> None:
    """Raise a CheckFailure naming the mistake unless each value is :func:`tfedu.tuning.dpo_loss` on its case."""
    args = [[torch.as_tensor(np.array(c[name])) for name in DPO_ARGS] for c in cases]
    wants = [reference_dpo_loss(*a, c["beta"]) for a, c in zip(args, cases)]
    _judge(values, wants, [dpo_mistakes(*a, c["beta"]) for a, c in zip(args, cases)], tolerances=[(1e-4, 1e-5)],
           nonfinite=lambda i: HINT_DPO_UNSTABLE.format(value=float(values[i])),
           differs=lambda i: HINT_DPO_DIFFERS.format(got=float(values[i]), what=whats[i], want=float(wants[i])))


def _dpo_grads(t: dict[str, torch.Tensor], beta: float) -> list[torch.Tensor]:
    leaves = [t[name].detach().clone().requires_grad_(True) for name in DPO_ARGS[:2]]
    return list(torch.autograd.grad(reference_dpo_loss(*leaves, t["ref_chosen"].detach(), t["ref_rejected"].detach(),
                                                       beta), leaves))


@checker("the DPO loss")
def check_dpo_loss(dpo_loss) -> None:
    """Check ``dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)`` against
    :func:`tfedu.tuning.dpo_loss`, value and gradients with respect to the policy's log-probabilities."""
    _refuse(dpo_loss, "dpo_loss", "the loss")
    whats, cases = zip(*dpo_cases())
    leaves = [_tensors(c, floats=DPO_ARGS[:2]) for c in cases]

    def call(item: tuple[dict, dict]) -> torch.Tensor:
        t, case = item
        got = call_learner(dpo_loss, *(t[name] for name in DPO_ARGS), case["beta"], name="dpo_loss",
                           error_hint=HINT_DPO_CALL)
        return _scalar_result(got, "dpo_loss", per_rows=t["policy_chosen"].shape[0], per_row_hint=HINT_DPO_PER_PAIR)

    got, failure = _collect(call, zip(leaves, cases))
    judge_dpo([g.detach() for g in got], list(cases[:len(got)]), list(whats))
    if failure:
        raise failure
    for g, t, case, what in zip(got, leaves, cases, whats):
        if not g.requires_grad:
            raise CheckFailure(HINT_GRAD_MISSING.format(function="dpo_loss"))
        grads = torch.autograd.grad(g, [t[name] for name in DPO_ARGS[:2]], allow_unused=True)
        for name, mine, want in zip(DPO_ARGS, grads, _dpo_grads(t, case["beta"])):
            if (problem := _grad_problem(mine, want, "dpo_loss", name, what)):
                raise CheckFailure(problem)


DPO_PROBE_RUN = HELPERS + """\
_results = []
for _c in inputs['cases']:
    _t = [torch.tensor(_c[_n], requires_grad=_n.startswith('policy'))
          for _n in ('policy_chosen', 'policy_rejected', 'ref_chosen', 'ref_rejected')]
    _r = _call(dpo_loss, *_t, _c['beta'])
    if isinstance(_r, torch.Tensor) and _r.is_floating_point() and _r.dim() == 0:
        _g = _backward([_r], [torch.ones(())], {'policy_chosen': _t[0], 'policy_rejected': _t[1]})
        _results.append({'value': _array(_r), 'grad': _g})
    else:
        _results.append(_kind(_r) + (' of shape ' + str(tuple(_r.shape)) if isinstance(_r, torch.Tensor) else ''))
outputs = {'results': _results, 'mutated': list(_MUTATED)}
del _results, _c, _t, _r
""" + CLEANUP


def _dpo_probe_inputs(rng: np.random.Generator) -> dict:
    return {"cases": [
        dpo_case(rng, int(rng.integers(3, 9)), float(rng.choice([0.05, 0.1, 0.3]))),
        dpo_case(rng, int(rng.integers(3, 9)), float(rng.choice([0.5, 1.0])), small=True),
        dpo_case(rng, int(rng.integers(3, 9)), float(rng.choice([2.0, 3.0]))),
        dpo_case(rng, int(rng.integers(3, 9)), 1.0, large=True),
    ]}


def _compare_dpo(outputs: Any, expected: dict) -> str | None:
    values, problem = _judged_probe(outputs, expected, "dpo_loss", "policy_chosen", HINT_DPO_PER_PAIR, judge_dpo)
    if problem:
        return problem
    cases = expected["cases"]
    for i, (got, c) in enumerate(zip(values, cases)):
        where = f"hidden test {i + 1}: "
        grads = got["grad"]
        if grads == "missing":
            return where + HINT_GRAD_MISSING.format(function="dpo_loss")
        for name, w in zip(DPO_ARGS, _dpo_grads(_tensors(c), c["beta"])):
            g = grads.get(name) if isinstance(grads, dict) else None
            g = None if g is None or isinstance(g, str) else torch.as_tensor(np.array(g))
            if g is None:
                return where + HINT_GRAD_WRONG.format(function="dpo_loss", name=name, what="no gradient reaches it")
            if (problem := _grad_problem(g, w, "dpo_loss", name, f"hidden test {i + 1}")):
                return where + problem
    return None


# ----------------------------------------------------------------------------- 17.3 group-relative advantages

HINT_ADV_CALL = "group_advantages(rewards): rewards (n_prompts, group) float; return advantages of the same shape"
HINT_ADV_TYPE = "group_advantages should return a float tensor of the rewards' shape {want}, got {got}"
HINT_ADV_FLAT = ("your advantages have shape {got}: keep the rewards' shape {want}, one row per prompt, one column "
                 "per answer (the training loop flattens them itself)")
HINT_ADV_BATCH = (
    "you took the mean and std of the whole batch: GRPO compares each answer with the *other answers to the same "
    "prompt*, so the statistics are per row (per group), over the group dimension. A prompt that is easy for every "
    "answer must not make the answers to a hard prompt look bad"
)
HINT_ADV_AXIS = ("you took the statistics over the prompts (dimension 0), the same answer slot across prompts: each "
                 "row is one prompt's group, so take them along each row, over the group dimension")
HINT_ADV_NO_STD = (
    "you subtracted the group mean but did not divide by the group's std: that is a real variant, Dr. GRPO's (Liu et "
    "al. 2025), which argues the division favours groups that are nearly all right or all wrong. This exercise is "
    "GRPO as DeepSeekMath and trl define it: divide by the std plus {eps:g}"
)
HINT_ADV_BIASED = (
    "you used the biased std (dividing by the group size, unbiased=False): GRPO as trl computes it uses torch.std's "
    "default, the unbiased one, dividing the sum of squares by group - 1. With groups of {group} the two differ by "
    "a factor of about {factor:.3f}"
)
HINT_ADV_NO_EPS = (
    "your advantages are NaN (or inf) in a group whose rewards are all equal ({row}): its std is 0, and 0 / 0 is "
    "NaN. Add eps = {eps:g} to the std, so that such a group (every answer right, or every one wrong) gets "
    "advantages of 0: it has nothing to teach"
)
HINT_ADV_EPS_INSIDE = ("you put eps under the square root (the std of the variance plus eps): this exercise adds "
                       "eps = {eps:g} to the std itself, as trl does; on a group with rewards spread by about 0.01, "
                       "that differs")
HINT_ADV_OTHER_EPS = (
    "your advantages match the formula with eps = {other:g}: this exercise takes trl's eps = {eps:g}, added to the "
    "std. It hardly matters with rewards of 0 and 1, but it does with rewards that differ by about 0.01, as here"
)
HINT_ADV_FLOOR = (
    "your advantages match the std floored at {eps:g} (the std raised to {eps:g} where it is smaller) instead of "
    "the std plus {eps:g}: add eps to the std; a floor is another formula, and it differs on a group whose std is "
    "about 1e-5, as here"
)
HINT_ADV_NAN_PATCHED = (
    "your advantages match the reward minus the mean over the std alone, with the constant groups set to 0 "
    "afterwards (the NaNs patched, or a floor too small to matter): add eps = {eps:g} to the std; patching NaNs "
    "afterwards is another formula, and it differs on a group whose std is about 1e-5, as here"
)
HINT_ADV_VARIANCE = "you divided by the variance: divide by the standard deviation (its square root) plus eps"
HINT_ADV_MAX = ("you subtracted the group's best reward, not its mean: then no answer gets a positive advantage. "
                "The baseline is the group's mean reward")
HINT_ADV_DIFFERS = "your advantages differ from GRPO's on {what}: largest error {err:.3g} (row {row})"


def reference_group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    return group_advantages(rewards)


def adv_case(rng: np.random.Generator, n_prompts: int, group: int, *, binary: bool = True,
             constant_rows: bool = True) -> np.ndarray:
    """Rewards: 0/1 (with a row all right and a row all wrong) or spread by about 0.01 (the row before the last
    spread by about 1e-5, the last row constant)."""
    if binary:
        r = (rng.random((n_prompts, group)) < rng.uniform(0.2, 0.8, (n_prompts, 1))).astype(np.float32)
        for row in range(n_prompts):  # every row has both kinds (the std is not 0), but for the two set below
            if r[row].min() == r[row].max():
                r[row, int(rng.integers(group))] = 1.0 - r[row, 0]
        if constant_rows and n_prompts >= 3:
            r[1] = 1.0
            r[2] = 0.0
        return r
    # near 0 (a small shaping reward, say), where float32 keeps the differences exact to about 1e-9
    r = (0.01 * rng.standard_normal((n_prompts, group))).astype(np.float32)
    if n_prompts >= 3:  # a group whose std (about 1e-5) is below eps: a floor or NaNs patched later show there
        r[-2] = (1e-5 * rng.standard_normal(group)).astype(np.float32)
    r[-1] = 2.0 ** -6  # a constant group here too (a power of 2: its mean is exact, its std exactly 0)
    return r


def adv_cases() -> list[tuple[str, np.ndarray]]:
    return [
        ("3 prompts, groups of 5, rewards spread by about 0.01, 1e-5 and 0 (the last group constant)",
         adv_case(np.random.default_rng(21), 3, 5, binary=False)),
        ("4 prompts, groups of 6, rewards 0 or 1 (one group all right, one all wrong)",
         adv_case(np.random.default_rng(20), 4, 6)),
        ("5 prompts, groups of 2", adv_case(np.random.default_rng(22), 5, 2)),
        ("4 prompts, groups of 4", adv_case(np.random.default_rng(23), 4, 4)),
    ]


def adv_mistakes(r: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    r = r.double()
    mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)
    eps = GROUP_STD_EPS
    group = r.shape[1]
    patched = torch.where(std > 0, (r - mean) / std.clamp(min=1e-300), torch.zeros_like(r))
    out = [
        (HINT_ADV_BATCH, (r - r.mean()) / (r.std() + eps)),
        (HINT_ADV_BATCH, (r - mean) / (r.std() + eps)),
        (HINT_ADV_BATCH, (r - r.mean()) / (std + eps)),
        (HINT_ADV_AXIS, (r - r.mean(0, keepdim=True)) / (r.std(0, keepdim=True) + eps)),
        (HINT_ADV_NO_STD.format(eps=eps), r - mean),
        (HINT_ADV_FLOOR.format(eps=eps), (r - mean) / std.clamp(min=eps)),
        (HINT_ADV_NAN_PATCHED.format(eps=eps), patched),
        (HINT_ADV_BIASED.format(group=group, factor=math.sqrt(group / (group - 1))),
         (r - mean) / (r.std(1, keepdim=True, unbiased=False) + eps)),
        *[(HINT_ADV_OTHER_EPS.format(other=other, eps=eps), (r - mean) / (std + other))
          for other in (1e-8, 1e-6, 1e-5, 1e-3, 1e-2)],
        (HINT_ADV_EPS_INSIDE.format(eps=eps), (r - mean) / torch.sqrt(r.var(1, keepdim=True) + eps)),
        (HINT_ADV_EPS_INSIDE.format(eps=eps), (r - mean) / torch.sqrt(r.var(1, keepdim=True) + 1e-8)),
        (HINT_ADV_VARIANCE, (r - mean) / (r.var(1, keepdim=True) + eps)),
        (HINT_ADV_MAX, r - r.amax(1, keepdim=True)),
        (HINT_ADV_MAX, (r - r.amax(1, keepdim=True)) / (std + eps)),
    ]
    return out


def judge_adv(results: list[Any], cases: list[np.ndarray], whats: list[str]) -> None:
    """Raise a CheckFailure naming the mistake unless each result is :func:`tfedu.tuning.group_advantages` of its
    rewards (relative 1e-5; mistakes are named tightly first, for the eps values, then loosely)."""
    rewards = [torch.from_numpy(np.array(c)) for c in cases]
    wants = [reference_group_advantages(r) for r in rewards]
    values = []
    for got, want, what in zip(results, wants, whats):
        if not isinstance(got, torch.Tensor) or not got.is_floating_point():
            raise CheckFailure(f"{what}: " + HINT_ADV_TYPE.format(want=tuple(want.shape), got=describe(got)))
        if tuple(got.shape) != tuple(want.shape):
            raise CheckFailure(f"{what}: " + HINT_ADV_FLAT.format(got=tuple(got.shape), want=tuple(want.shape)))
        values.append(got.detach().cpu())

    def nonfinite(i: int) -> str | None:
        r = rewards[i]
        constant = (r == r[:, :1]).all(1) & ~torch.isfinite(values[i]).all(1)
        if not constant.any():
            return None
        row = int(constant.nonzero()[0])
        return HINT_ADV_NO_EPS.format(row=f"{whats[i]}, row {row}, rewards {r[row].tolist()}", eps=GROUP_STD_EPS)

    def differs(i: int) -> str:
        err = (values[i].double() - wants[i].double()).abs().nan_to_num(float("inf"))
        return HINT_ADV_DIFFERS.format(what=whats[i], err=float(err.max()), row=int(err.amax(1).argmax()))

    _judge(values, wants, [adv_mistakes(r) for r in rewards], tolerances=[(1e-5, 2e-5), (1e-3, 1e-4)],
           nonfinite=nonfinite, differs=differs)


@checker("GRPO's advantages")
def check_group_advantages(group_advantages) -> None:
    """Check ``group_advantages(rewards)`` against :func:`tfedu.tuning.group_advantages` (relative 1e-5)."""
    _refuse(group_advantages, "group_advantages", "the advantages")
    whats, cases = zip(*adv_cases())
    results = []
    for rewards in cases:
        r = torch.from_numpy(rewards)
        copy = r.clone()
        results.append(call_learner(group_advantages, copy, name="group_advantages", error_hint=HINT_ADV_CALL))
        if not torch.equal(copy, r):
            raise CheckFailure("group_advantages changed the rewards in place: build a new tensor")
    judge_adv(results, list(cases), list(whats))


ADV_PROBE_RUN = HELPERS + """\
_results = []
for _c in inputs['cases']:
    _r = _call(group_advantages, torch.from_numpy(np.array(_c)))
    _results.append(_array(_r) if isinstance(_r, torch.Tensor) and _r.is_floating_point() else _kind(_r))
outputs = {'results': _results, 'mutated': list(_MUTATED)}
del _results, _c, _r
""" + CLEANUP


def _adv_probe_inputs(rng: np.random.Generator) -> dict:
    return {"cases": [  # the small spread first: it tells the eps values apart
        adv_case(rng, int(rng.integers(3, 5)), int(rng.integers(3, 8)), binary=False),
        adv_case(rng, int(rng.integers(3, 7)), int(rng.integers(3, 9))),
        adv_case(rng, int(rng.integers(3, 6)), 2),
    ]}


def _compare_adv(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(expected["cases"]):
        return "group_advantages's hidden test did not run every case"
    if (problem := _mutated(outputs, "group_advantages")):
        return problem
    results = [torch.from_numpy(np.array(got)) if isinstance(got, np.ndarray) else got for got in outputs["results"]]
    try:
        judge_adv(results, expected["cases"], [f"hidden test {i + 1}" for i in range(len(results))])
    except CheckFailure as failure:
        return f"hidden test: {failure}"
    return None


# ----------------------------------------------------------------------------- 17.4 GRPO's clipped loss

HINT_GRPO_CALL = ("grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.04): logp, logp_old, "
                  "logp_ref and mask (batch, pos), advantages (batch,), one per answer: give it a positions axis "
                  "(batch, 1) to broadcast over the tokens; return the mean loss, a tensor of shape ()")
HINT_GRPO_MAX = ("you took the larger of the unclipped and clipped terms: PPO takes the *smaller*, a pessimistic "
                 "bound, so that moving the ratio beyond the clip range never earns more")
HINT_GRPO_CLIPPED_ONLY = (
    "you used the clipped term alone: PPO takes the smaller of the unclipped and the clipped term. With the clipped "
    "term alone, a token whose ratio moved the wrong way past the range (ratio below 1 - eps with A > 0) gets no "
    "gradient to bring it back"
)
HINT_GRPO_NO_CLIP = ("the ratio is not clipped: the surrogate is the smaller of ratio * A and the ratio clipped to "
                     "[1 - eps, 1 + eps] times A")
HINT_GRPO_RATIO_QUOTIENT = ("your ratio divides the log-probabilities: the ratio is of probabilities, pi / pi_old, "
                            "which is the exponential of the difference of their logs")
HINT_GRPO_RATIO_DIFF = ("your ratio is the difference of the log-probabilities, not its exponential: the ratio of the "
                        "probabilities is exp(log pi - log pi_old), 1 where nothing changed")
HINT_GRPO_RATIO_REF = ("your ratio is taken to the reference model: the clipped ratio compares the current policy with "
                       "the policy that *sampled* the answers (logp_old); the reference only enters the KL term")
HINT_GRPO_K1 = (
    "your KL term is the plain difference of the log-probabilities (the k1 estimator, or its negative): per token it "
    "can be negative. GRPO uses k3 (Schulman 2020), exp(d) - d - 1 with d = log ref - log pi, never below 0 and 0 only "
    "where the two agree"
)
HINT_GRPO_K2 = ("your KL term is half the squared difference (the k2 estimator): GRPO uses k3, exp(d) - d - 1 with "
                "d = log ref - log pi")
HINT_GRPO_K3_SWAPPED = ("your KL term is k3 with the two models swapped (d = log pi - log ref): k3 estimates KL(pi || "
                        "ref) from samples of pi when d = log ref - log pi")
HINT_GRPO_NO_BETA = "the KL term is not multiplied by beta (= {beta:g} here)"
HINT_GRPO_KL_SUBTRACTED = ("the KL term is subtracted: it is a penalty, so the loss (minus the surrogate) gets plus "
                           "beta times KL")
HINT_GRPO_SIGN = ("your loss has the wrong sign: the optimiser *minimises* the loss, and the surrogate is to be "
                  "maximised, so the loss is minus the surrogate plus beta times KL")
HINT_GRPO_NO_KL = "the KL term to the reference is missing: add beta times the k3 estimate per token"
HINT_GRPO_MASK_IGNORED = ("you averaged over every position, the padding and prompt included: only the tokens the "
                          "mask marks (the answer's) count, each answer's mean taken over its own tokens")
HINT_GRPO_ZEROED_MEAN = ("you zeroed the masked-out positions but divided by every position: each answer's mean is "
                         "over its own answer tokens, so divide by the number of tokens the mask marks in its row")
HINT_GRPO_TOKEN_MEAN = (
    "you averaged over all the answer tokens of the batch together: that is a real variant, DAPO's token-level mean "
    "(Yu et al. 2025; trl's loss_type \"bnpo\"/\"dapo\"), which weighs long answers more. GRPO as DeepSeekMath defines "
    "it averages each answer over its own tokens first, then over the answers"
)
HINT_GRPO_SUM = ("you summed each answer's token losses instead of averaging them: divide each row's sum by its own "
                 "number of answer tokens, then average over the answers")
HINT_GRPO_BROADCAST = ("the advantages were spread along the positions, not the answers: advantages[b] belongs to "
                       "every token of answer b, so give it a positions axis, shape (batch, 1)")
HINT_GRPO_CLIP_ADV = ("you clipped the advantages: the clip range applies to the probability ratio, "
                      "clip(ratio, 1 - eps, 1 + eps); the advantage multiplies it unchanged")
HINT_GRPO_PADDING_COUNTED = (
    "the positions the mask leaves out (the prompt, the padding) hold arbitrary numbers, and your loss counts them: "
    "you divided by each answer's number of tokens but summed the token losses over every position. Zero the "
    "positions the mask leaves out before summing"
)
HINT_GRPO_HARD_CODED = (
    "your loss matches clip_eps = 0.2 and beta = 0.04 whatever the call passes: use the arguments clip_eps and beta "
    "(the check passes other values, here clip_eps = {eps:g} and beta = {beta:g})"
)
HINT_GRPO_HARD_EPS = ("your loss matches clip_eps = 0.2 whatever the call passes: clip with the argument clip_eps "
                      "(the check passes other values, here {eps:g})")
HINT_GRPO_HARD_BETA = ("your loss matches beta = 0.04 whatever the call passes: weigh the KL term with the argument "
                       "beta (the check passes other values, here {beta:g})")
HINT_GRPO_RATIO_INVERTED = ("your ratio is upside down, the old policy's probability over the current one's: the "
                            "ratio is pi / pi_old, the exponential of log pi minus log pi_old, and it carries the "
                            "gradient of the current policy")
HINT_GRPO_CLIP_PRODUCT = ("you clipped the product of the ratio and the advantage: the clip range applies to the "
                          "ratio alone, which is then multiplied by the advantage")
HINT_GRPO_PER_ROW = "grpo_loss returned one number per answer: return their mean, one number"
HINT_GRPO_DIFFERS = "your loss is {got:.6g} on {what}; GRPO's loss is {want:.6g}"

GRPO_TENSORS = ("logp", "logp_old", "logp_ref", "advantages", "mask")


def grpo_case(rng: np.random.Generator, batch: int, pos: int, clip_eps: float | None = None,
              beta: float | None = None) -> dict:
    """Answers of different lengths after a prompt, right-padded; the old policy off by about 0.4 per token (many
    ratios outside a clip range of 0.2), the reference off too; advantages of both signs; garbage in the padding."""
    mask = np.zeros((batch, pos), dtype=bool)
    for b in range(batch):
        start = int(rng.integers(0, 3))
        end = pos if b == 0 else int(rng.integers(start + 1, pos + 1))
        mask[b, start:end] = True
    logp = -rng.uniform(0.05, 3.0, (batch, pos))
    old = logp + rng.normal(0, 0.4, (batch, pos))
    ref = logp + rng.normal(0, 0.5, (batch, pos))
    old, ref = np.minimum(old, -0.01), np.minimum(ref, -0.01)
    pad = ~mask
    logp[pad], old[pad], ref[pad] = -rng.uniform(4, 9, pad.sum()), -rng.uniform(0.1, 1, pad.sum()), -8.0
    adv = rng.normal(0, 1, batch)
    adv[0], adv[-1] = abs(adv[0]) + 1.5, -abs(adv[-1]) - 0.3  # one above 1 + clip_eps, one negative
    case = {"logp": logp.astype(np.float32), "logp_old": old.astype(np.float32), "logp_ref": ref.astype(np.float32),
            "advantages": adv.astype(np.float32), "mask": mask}
    if clip_eps is not None:
        case["clip_eps"], case["beta"] = float(clip_eps), float(beta)
    return case


def grpo_cases() -> list[tuple[str, dict]]:
    return [
        ("5 answers, 5 positions, clip_eps = 0.3, beta = 0.5", grpo_case(np.random.default_rng(32), 5, 5, 0.3, 0.5)),
        ("4 answers, 7 positions, clip_eps and beta left at their defaults",
         grpo_case(np.random.default_rng(30), 4, 7)),
        ("3 answers, 9 positions, clip_eps = 0.1, beta = 0.1", grpo_case(np.random.default_rng(31), 3, 9, 0.1, 0.1)),
    ]


def _knobs(case: dict) -> tuple[float, float]:
    return case.get("clip_eps", 0.2), case.get("beta", 0.04)


def reference_grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.04) -> torch.Tensor:
    return grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=clip_eps, beta=beta)


def grpo_mistakes(logp, old, ref, adv, mask, eps, beta) -> list[tuple[str, torch.Tensor]]:
    lp, old, ref, adv = (x.detach().double() for x in (logp, old, ref, adv))
    m = mask.double()
    A = adv[:, None]

    def total(ratio=None, surrogate="min", kl="k3", combine="right", aggregate="per answer", A=A, eps=eps, beta=beta):
        r = torch.exp(lp - old) if ratio is None else ratio
        clipped = r.clamp(1 - eps, 1 + eps) * A
        s = {"min": torch.minimum(r * A, clipped), "max": torch.maximum(r * A, clipped), "clipped": clipped,
             "none": r * A, "clip adv": torch.minimum(r * A, r * A.clamp(1 - eps, 1 + eps)),
             "clip product": torch.minimum(r * A, (r * A).clamp(1 - eps, 1 + eps))}[surrogate]
        d = ref - lp
        k = {"k3": torch.exp(d) - d - 1, "k1": -d, "k1 neg": d, "k2": d ** 2 / 2,
             "k3 swapped": torch.exp(-d) + d - 1}[kl]
        per = {"right": -s + beta * k, "no beta": -s + k, "minus": -s - beta * k, "sign": s - beta * k,
               "no kl": -s}[combine]
        if aggregate == "per answer":
            return ((per * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
        return {"all": per.mean(), "zeroed": (per * m).mean(), "token": (per * m).sum() / m.sum(),
                "sum": (per * m).sum(-1).mean(), "padding": (per.sum(-1) / m.sum(-1).clamp(min=1)).mean()}[aggregate]

    out = [
        (HINT_GRPO_MAX, total(surrogate="max")),
        (HINT_GRPO_CLIPPED_ONLY, total(surrogate="clipped")),
        (HINT_GRPO_NO_CLIP, total(surrogate="none")),
        (HINT_GRPO_CLIP_ADV, total(surrogate="clip adv")),
        (HINT_GRPO_RATIO_QUOTIENT, total(ratio=lp / old)),
        (HINT_GRPO_RATIO_QUOTIENT, total(ratio=old / lp)),
        (HINT_GRPO_RATIO_DIFF, total(ratio=lp - old)),
        (HINT_GRPO_RATIO_REF, total(ratio=torch.exp(lp - ref))),
        (HINT_GRPO_RATIO_INVERTED, total(ratio=torch.exp(old - lp))),
        (HINT_GRPO_CLIP_PRODUCT, total(surrogate="clip product")),
        (HINT_GRPO_HARD_CODED.format(eps=eps, beta=beta), total(eps=0.2, beta=0.04)),
        (HINT_GRPO_HARD_EPS.format(eps=eps), total(eps=0.2)),
        (HINT_GRPO_HARD_BETA.format(beta=beta), total(beta=0.04)),
        (HINT_GRPO_K1, total(kl="k1")),
        (HINT_GRPO_K1, total(kl="k1 neg")),
        (HINT_GRPO_K2, total(kl="k2")),
        (HINT_GRPO_K3_SWAPPED, total(kl="k3 swapped")),
        (HINT_GRPO_NO_BETA.format(beta=beta), total(combine="no beta")),
        (HINT_GRPO_KL_SUBTRACTED, total(combine="minus")),
        (HINT_GRPO_SIGN, total(combine="sign")),
        (HINT_GRPO_SIGN, -total()),
        (HINT_GRPO_NO_KL, total(combine="no kl")),
        (HINT_GRPO_MASK_IGNORED, total(aggregate="all")),
        (HINT_GRPO_ZEROED_MEAN, total(aggregate="zeroed")),
        (HINT_GRPO_TOKEN_MEAN, total(aggregate="token")),
        (HINT_GRPO_SUM, total(aggregate="sum")),
        (HINT_GRPO_PADDING_COUNTED, total(aggregate="padding")),
    ]
    # only a square batch lets advantages (batch,) broadcast along the positions; elsewhere that raises
    out.append((HINT_GRPO_BROADCAST, total(A=adv[None, :]) if lp.shape[0] == lp.shape[1] else None))
    return out


def judge_grpo(values: list[torch.Tensor | None], cases: list[dict], whats: list[str]) -> None:
    """Raise a CheckFailure naming the mistake unless each value is :func:`tfedu.tuning.grpo_loss` on its case."""
    args = [[torch.as_tensor(np.array(c[name])) for name in GRPO_TENSORS] for c in cases]
    knobs = [_knobs(c) for c in cases]
    wants = [reference_grpo_loss(*a, clip_eps=eps, beta=beta) for a, (eps, beta) in zip(args, knobs)]
    _judge(values, wants, [grpo_mistakes(*a, eps, beta) for a, (eps, beta) in zip(args, knobs)],
           tolerances=[(1e-4, 1e-5)],
           differs=lambda i: HINT_GRPO_DIFFERS.format(got=float(values[i]), what=whats[i], want=float(wants[i])))


def _grpo_grad(t: dict[str, torch.Tensor], eps: float, beta: float) -> torch.Tensor:
    lp = t["logp"].detach().clone().requires_grad_(True)
    loss = reference_grpo_loss(lp, *(t[name].detach() for name in GRPO_TENSORS[1:]), clip_eps=eps, beta=beta)
    return torch.autograd.grad(loss, [lp])[0]


def _grpo_call(fn: Any, t: dict[str, torch.Tensor], case: dict) -> Any:
    args = [t[name] if name == "logp" else t[name].clone() for name in GRPO_TENSORS]
    if "clip_eps" in case:
        return call_learner(fn, *args, clip_eps=case["clip_eps"], beta=case["beta"], name="grpo_loss",
                            error_hint=HINT_GRPO_CALL)
    return call_learner(fn, *args, name="grpo_loss", error_hint=HINT_GRPO_CALL)


@checker("GRPO's clipped loss")
def check_grpo_loss(grpo_loss) -> None:
    """Check ``grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps, beta)`` against
    :func:`tfedu.tuning.grpo_loss`, value and gradient with respect to ``logp``."""
    _refuse(grpo_loss, "grpo_loss", "the loss")
    whats, cases = zip(*grpo_cases())
    leaves = [_tensors(c, floats=("logp",)) for c in cases]

    def call(item: tuple[dict, dict]) -> torch.Tensor:
        t, case = item
        return _scalar_result(_grpo_call(grpo_loss, t, case), "grpo_loss", per_rows=t["logp"].shape[0],
                              per_row_hint=HINT_GRPO_PER_ROW)

    got, failure = _collect(call, zip(leaves, cases))
    judge_grpo([g.detach() for g in got], list(cases[:len(got)]), list(whats))
    if failure:
        raise failure
    for g, t, case, what in zip(got, leaves, cases, whats):
        eps, beta = _knobs(case)
        if (problem := _grad_problem(_grad_of(g, t["logp"]), _grpo_grad(t, eps, beta), "grpo_loss", "logp", what)):
            raise CheckFailure(problem)


GRPO_PROBE_RUN = HELPERS + """\
_results = []
for _c in inputs['cases']:
    _lp = torch.tensor(_c['logp'], requires_grad=True)
    _rest = [torch.from_numpy(np.array(_c[_n])) for _n in ('logp_old', 'logp_ref', 'advantages', 'mask')]
    try:
        if 'clip_eps' in _c:
            _r = _call(lambda *_a: grpo_loss(*_a, clip_eps=_c['clip_eps'], beta=_c['beta']), _lp, *_rest)
        else:
            _r = _call(grpo_loss, _lp, *_rest)
    except Exception as _e:
        _results.append('raised ' + type(_e).__name__ + ': ' + str(_e)[:120])
        continue
    if isinstance(_r, torch.Tensor) and _r.is_floating_point() and _r.dim() == 0:
        _g = _backward([_r], [torch.ones(())], {'logp': _lp})
        _results.append({'value': _array(_r), 'grad': _g if isinstance(_g, str) else _g['logp']})
    else:
        _results.append(_kind(_r) + (' of shape ' + str(tuple(_r.shape)) if isinstance(_r, torch.Tensor) else ''))
outputs = {'results': _results, 'mutated': list(_MUTATED)}
del _results, _c, _lp, _rest, _r
""" + CLEANUP


def _grpo_probe_inputs(rng: np.random.Generator) -> dict:
    square = int(rng.integers(3, 7))
    return {"cases": [  # the square one first: advantages spread along the positions raise nothing there
        grpo_case(rng, square, square, 0.2, float(rng.choice([0.3, 1.0]))),
        grpo_case(rng, int(rng.integers(3, 7)), int(rng.integers(7, 12))),
        grpo_case(rng, int(rng.integers(2, 6)), int(rng.integers(7, 12)), float(rng.choice([0.1, 0.15, 0.3])),
                  float(rng.choice([0.1, 0.2, 0.5]))),
    ]}


def _compare_grpo(outputs: Any, expected: dict) -> str | None:
    values, problem = _judged_probe(outputs, expected, "grpo_loss", "logp", HINT_GRPO_PER_ROW, judge_grpo,
                                    raised_hint=HINT_GRPO_CALL)
    if problem:
        return problem
    cases = expected["cases"]
    for i, (got, c) in enumerate(zip(values, cases)):
        where = f"hidden test {i + 1}: "
        if isinstance(got["grad"], str) and got["grad"] != "missing":
            return where + HINT_GRAD_WRONG.format(function="grpo_loss", name="logp", what=got["grad"])
        grad = None if isinstance(got["grad"], str) else torch.as_tensor(np.array(got["grad"]))
        eps, beta = _knobs(c)
        want = _grpo_grad(_tensors(c), eps, beta)
        if (problem := _grad_problem(grad, want, "grpo_loss", "logp", f"hidden test {i + 1}")):
            return where + problem
    return None


# ----------------------------------------------------------------------------- 17.5 pass@k

HINT_PK_CALL = "pass_at_k(n, c, k): three ints, 0 <= c <= n and 1 <= k <= n; return a float"
HINT_PK_TYPE = ("pass_at_k({n}, {c}, {k}) returned {got}: return a Python float (a tensor or array would not add up "
                "across problems as the evaluation loop expects)")
HINT_PK_PLUG_IN = (
    "you computed 1 - (1 - c/n)^k, the plug-in estimate: it draws the k samples *with* replacement from the n, so it "
    "is biased (it underestimates pass@k). Chen et al.'s estimator draws k of the n without replacement: the chance "
    "that all k are wrong is C(n - c, k) / C(n, k)"
)
HINT_PK_FRACTION = ("you returned c / n, the fraction correct, whatever k is: that is pass@1. pass@k asks whether at "
                    "least one of k answers is right, which grows with k")
HINT_PK_SWAPPED = ("k and c are swapped in one place: the chance that k draws without replacement miss all c right "
                   "answers is C(n - c, k) / C(n, k); as a product over i from n - c + 1 to n, each factor is "
                   "1 - k / i")
HINT_PK_OFF_BY_ONE = ("your product runs over one index too many or too few: C(n - c, k) / C(n, k) is the product of "
                      "1 - k / i for i from n - c + 1 to n inclusive, exactly c factors")
HINT_PK_EDGE = (
    "pass_at_k({n}, {c}, {k}) should be exactly 1.0 and your answer {got}: when n - c < k every draw of k answers "
    "includes a right one (there are fewer than k wrong ones), and C(n - c, k) is 0"
)
HINT_PK_EDGE_EQUAL = (
    "pass_at_k({n}, {c}, {k}) should be {want!r} and your answer {got}: with exactly k wrong answers an all-wrong "
    "draw is still possible (it is the draw of those k), so pass@k is below 1 there. Only when there are *fewer* "
    "than k wrong answers, n - c < k, is every draw sure to hold a right one"
)
HINT_PK_NO_ONE_MINUS = (
    "your answer is the chance that all k drawn answers are wrong, C(n - c, k) / C(n, k): pass@k is the chance that "
    "at least one is right, one minus that"
)
HINT_PK_COMB_C = (
    "you counted the draws of k among the c right answers, C(c, k), where the estimator counts the draws of k among "
    "the n - c wrong ones, C(n - c, k): the draws that miss every right answer"
)
HINT_PK_INT_DIVISION = (
    "you divided with integer division, which rounds the ratio down to a whole number (0 as soon as the numerator "
    "is smaller): the ratio of the two counts, or k / i in the product, is a fraction between 0 and 1. Use true "
    "division, which gives a float"
)
HINT_PK_OVERFLOW = (
    "pass_at_k({n}, {c}, {k}) {got}: factorials or binomials of n = {n} overflow floats (200! is about 1e375). Keep "
    "the numbers small: a product of c factors each between 0 and 1, or math.comb, which is exact in Python's ints"
)
HINT_PK_DIFFERS = "pass_at_k({n}, {c}, {k}) returned {got!r}; the unbiased estimate is {want!r}"


def reference_pass_at_k(n: int, c: int, k: int) -> float:
    return pass_at_k(n, c, k)


def _product(n: int, c: int, k: int, lo: int, hi: int, num: int) -> float | None:
    try:
        prod = 1.0
        for i in range(lo, hi):
            prod *= 1.0 - num / i
        return 1.0 - prod
    except ZeroDivisionError:
        return None


def pk_mistakes(n: int, c: int, k: int) -> list[tuple[str, float | None]]:
    """Each slip twice: as written, and behind the guard that returns 1.0 when n - c < k (which most answers have)."""
    slips = [
        (HINT_PK_PLUG_IN, 1.0 - (1.0 - c / n) ** k),
        (HINT_PK_FRACTION, c / n),
        (HINT_PK_SWAPPED, _product(n, c, k, n - k + 1, n + 1, k)),
        (HINT_PK_SWAPPED, _product(n, c, k, n - c + 1, n + 1, c)),
        (HINT_PK_OFF_BY_ONE, _product(n, c, k, n - c, n + 1, k)),
        (HINT_PK_OFF_BY_ONE, _product(n, c, k, n - c + 1, n, k)),
        (HINT_PK_OFF_BY_ONE, _product(n, c, k, n - c + 2, n + 1, k)),
        (HINT_PK_OFF_BY_ONE, _product(n, c, k, n - c + 2, n + 2, k)),
    ]
    ratio = math.comb(n - c, k) / math.comb(n, k)
    slips += [
        (HINT_PK_NO_ONE_MINUS, ratio),
        (HINT_PK_COMB_C, 1.0 - math.comb(c, k) / math.comb(n, k)),
        (HINT_PK_INT_DIVISION, float(1 - math.comb(n - c, k) // math.comb(n, k))),
        (HINT_PK_INT_DIVISION, 1.0 - math.prod(1 - k // i for i in range(n - c + 1, n + 1))),
    ]
    want = reference_pass_at_k(n, c, k)
    edge_equal = [(HINT_PK_EDGE_EQUAL.format(n=n, c=c, k=k, want=want, got=1.0), 1.0 if n - c <= k else want)]
    return edge_equal + slips + [(hint, 1.0 if n - c < k else value) for hint, value in slips]


def pk_cases() -> list[tuple[int, int, int]]:
    """(n, c, k): small, k = 1, none right, every one right, n - c < k, n - c == k, and n of 200 and 1000."""
    return [(10, 3, 1), (10, 3, 2), (10, 3, 5), (20, 5, 4), (5, 0, 2), (7, 7, 3), (8, 5, 4), (8, 6, 5), (6, 2, 6),
            (16, 15, 1), (9, 5, 4), (6, 0, 6),
            (200, 13, 10), (200, 1, 100), (200, 150, 30), (1000, 40, 100), (1000, 995, 10), (200, 0, 100)]


def judge_pk(outcomes: list[Any], cases: list[tuple[int, int, int]]) -> None:
    """Raise a CheckFailure naming the mistake unless each outcome is :func:`tfedu.tuning.pass_at_k` of its case
    (relative 1e-6). An outcome is what the answer returned, or a string "raised <Error>: ..." (see _pk_outcome)."""
    wants = [reference_pass_at_k(n, c, k) for n, c, k in cases]
    numbers = [float(g) if isinstance(g, (int, float)) and not isinstance(g, bool) else None for g in outcomes]

    def edge(i: int) -> bool:
        n, c, k = cases[i]
        return n - c < k

    def nonfinite(i: int) -> str | None:
        n, c, k = cases[i]
        return HINT_PK_OVERFLOW.format(n=n, c=c, k=k, got=f"returned {numbers[i]}") if n >= 100 else None

    def differs(_: int) -> str:
        bad = [i for i, (g, w) in enumerate(zip(numbers, wants))
               if g is not None and not math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-9)]
        i = next((i for i in bad if not edge(i)), bad[0])
        n, c, k = cases[i]
        if edge(i):
            return HINT_PK_EDGE.format(n=n, c=c, k=k, got=numbers[i])
        return HINT_PK_DIFFERS.format(n=n, c=c, k=k, got=numbers[i], want=wants[i])

    _judge(numbers, wants, [pk_mistakes(*case) for case in cases], tolerances=[(1e-6, 1e-9)], nonfinite=nonfinite,
           differs=differs)
    for got, number, (n, c, k) in zip(outcomes, numbers, cases):
        if number is not None:
            continue
        if isinstance(got, str) and n >= 100 and "Overflow" in got:
            raise CheckFailure(HINT_PK_OVERFLOW.format(n=n, c=c, k=k, got=got))
        if isinstance(got, str) and n - c < k:
            raise CheckFailure(HINT_PK_EDGE.format(n=n, c=c, k=k, got=got))
        if isinstance(got, str) and got.startswith("raised "):
            raise CheckFailure(f"pass_at_k({n}, {c}, {k}) {got} ({HINT_PK_CALL})")
        raise CheckFailure(HINT_PK_TYPE.format(n=n, c=c, k=k, got=got if isinstance(got, str) else describe(got)))


def _pk_outcome(fn: Any, n: int, c: int, k: int) -> Any:
    """What the learner's pass_at_k gives: its result, or "raised <Error>: ..." (an overflow is a named mistake)."""
    try:
        return fn(n, c, k)
    except NotImplementedError:
        raise
    except Exception as err:
        return f"raised {type(err).__name__}: {err}"


@checker("pass@k")
def check_pass_at_k(pass_at_k) -> None:
    """Check ``pass_at_k(n, c, k)`` against :func:`tfedu.tuning.pass_at_k` (relative 1e-6)."""
    _refuse(pass_at_k, "pass_at_k", "the estimator")
    call_learner(pass_at_k, 10, 3, 2, name="pass_at_k", error_hint=HINT_PK_CALL)
    judge_pk([_pk_outcome(pass_at_k, n, c, k) for n, c, k in pk_cases()], pk_cases())


PK_PROBE_RUN = """\
_results = []
for _n, _c, _k in inputs['cases']:
    try:
        _r = pass_at_k(_n, _c, _k)
        _results.append(float(_r) if isinstance(_r, (int, float)) and not isinstance(_r, bool) else type(_r).__name__)
    except Exception as _e:
        _results.append('raised ' + type(_e).__name__ + ': ' + str(_e)[:80])
outputs = {'results': _results}
del _results, _n, _c, _k
"""


def _pk_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(6):
        n = int(rng.integers(2, 40))
        cases.append([n, int(rng.integers(0, n + 1)), int(rng.integers(1, n + 1))])
    n = int(rng.integers(5, 30))
    c = int(rng.integers(n // 2, n))
    cases.append([n, c, int(rng.integers(n - c + 1, n + 1))])  # n - c < k
    n = int(rng.integers(5, 30))
    k = int(rng.integers(1, n))
    cases.append([n, n - k, k])  # n - c == k: an all-wrong draw is still possible
    n = int(rng.integers(2, 20))
    cases.append([n, 0, n])  # n - c == k with no right answer: exactly 0
    for n in (200, int(rng.integers(500, 1001))):
        cases.append([n, int(rng.integers(1, n // 4)), int(rng.integers(2, n // 2))])
    cases.append([200, int(rng.integers(190, 200)), int(rng.integers(30, 60))])  # n - c < k at n = 200
    return {"cases": cases}


def _compare_pk(outputs: Any, expected: dict) -> str | None:
    if not isinstance(outputs, dict) or not isinstance(outputs.get("results"), list) \
            or len(outputs["results"]) != len(expected["cases"]):
        return "pass_at_k's hidden test did not run every case"
    outcomes = [got if isinstance(got, (float, int)) or str(got).startswith("raised") else f"a {got}"
                for got in outputs["results"]]
    try:
        judge_pk(outcomes, [tuple(case) for case in expected["cases"]])
    except CheckFailure as failure:
        return f"hidden test: {failure}"
    return None


PROBES = {
    "check_sft_loss": Probe(
        exercise="ex_sft_loss",
        make_inputs=_sft_probe_inputs,
        run=SFT_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_sft,
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | SOFTMAX | frozenset({"torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss"})),
    "check_dpo_loss": Probe(
        exercise="ex_dpo_loss",
        make_inputs=_dpo_probe_inputs,
        run=DPO_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_dpo,
        forbidden=FORBIDDEN,
        builds=ELEMENTARY | ACTIVATIONS),
    "check_group_advantages": Probe(
        exercise="ex_group_advantages",
        make_inputs=_adv_probe_inputs,
        run=ADV_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_adv,
        forbidden=FORBIDDEN),
    "check_grpo_loss": Probe(
        exercise="ex_grpo_loss",
        make_inputs=_grpo_probe_inputs,
        run=GRPO_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_grpo,
        forbidden=FORBIDDEN),
    "check_pass_at_k": Probe(
        exercise="ex_pass_at_k",
        make_inputs=_pk_probe_inputs,
        run=PK_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]},
        compare=_compare_pk,
        forbidden=FORBIDDEN),
}


HINTS = {
    "ex_sft_loss": Hints(
        number="17.1",
        check="check_sft_loss",
        idea=(
            "The model's output at position t is a distribution over the token at t + 1. Instruction tuning scores "
            "those predictions only where the *target* is an answer token: the mask belongs to the targets, so it "
            "moves with them. Every answer token of the batch counts once: one mean over all of them, not a mean "
            "per chat. Take logs of probabilities as a log-softmax, which stays finite for logits of any size."
        ),
        approach=(
            "Drop the last position of the logits (it predicts past the end) and the first of the ids and of the "
            "mask: now logits (batch, pos - 1, d_vocab), targets and target mask (batch, pos - 1). Take the "
            "log-softmax over the vocabulary, pick each target's entry (gather on the last dimension), keep the "
            "entries the target mask marks, and average them; minus that is the loss. (F.cross_entropy with the "
            "unmarked targets set to its ignore_index, -100, does the same in one call.)"
        ),
        skeleton=(
            "def sft_loss(logits, ids, mask):\n"
            "    log_probs = ____  # (batch, pos - 1, d_vocab): the predictions of positions 0 .. pos - 2\n"
            "    targets = ____  # (batch, pos - 1)\n"
            "    target_mask = ____  # which targets are answer tokens\n"
            "    picked = ____  # each target's log-probability, (batch, pos - 1)\n"
            "    return ____  # minus the mean over the marked targets\n"
        ),
    ),
    "ex_dpo_loss": Hints(
        number="17.2",
        check="check_dpo_loss",
        idea=(
            "Each answer has an implicit reward: beta times how much more log-probability the policy gives it than "
            "the frozen reference does. The Bradley-Terry model says the chosen answer is preferred with "
            "probability sigmoid(reward of chosen - reward of rejected); the loss is minus its log, averaged over "
            "the pairs. Margins of hundreds happen: the log of a sigmoid must not be formed in two steps."
        ),
        approach=(
            "For each pair: the chosen answer's log-ratio (policy minus reference), the rejected one's, their "
            "difference times beta; then minus F.logsigmoid of that, and the mean over the pairs. All shapes are "
            "(batch,) until the mean."
        ),
        skeleton=(
            "def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):\n"
            "    chosen_reward = ____\n"
            "    rejected_reward = ____\n"
            "    return ____  # minus the mean log-sigmoid of beta times the margin\n"
        ),
    ),
    "ex_group_advantages": Hints(
        number="17.3",
        check="check_group_advantages",
        idea=(
            "GRPO has no value model: an answer's baseline is how the other answers to the same prompt did. So "
            "each reward is compared with its own row: minus the row's mean, over the row's standard deviation "
            "(the unbiased one, torch.std's default) plus eps = 1e-4. A row whose rewards are all equal gets 0."
        ),
        approach=(
            "rewards is (n_prompts, group). Take the mean and the std along dimension 1 with keepdim=True, so both "
            "are (n_prompts, 1) and broadcast back over the row. Subtract, then divide by the std plus the eps. "
            "The result keeps the shape (n_prompts, group)."
        ),
        skeleton=(
            "def group_advantages(rewards):\n"
            "    mean = ____  # (n_prompts, 1)\n"
            "    std = ____  # (n_prompts, 1), unbiased\n"
            "    return ____\n"
        ),
    ),
    "ex_grpo_loss": Hints(
        number="17.4",
        check="check_grpo_loss",
        idea=(
            "Per answer token: the ratio of the current policy's probability to that of the policy that sampled "
            "the answer, r = exp(logp - logp_old). PPO's surrogate is the smaller of r * A and the clipped ratio "
            "times A, so pushing r past the clip range earns nothing. The penalty is the k3 estimate of KL to the "
            "reference, exp(d) - d - 1 with d = logp_ref - logp. The per-token loss is minus the surrogate plus "
            "beta times the penalty; each answer's loss is the mean over its own answer tokens, and the batch's is "
            "the mean over answers."
        ),
        approach=(
            "Everything is (batch, pos) except the advantages, (batch,): index them with a new last axis so they "
            "broadcast over the tokens. Build ratio, the two surrogate terms and their element-wise minimum "
            "(torch.minimum), the k3 term, the per-token loss. Then with the mask as floats: the masked sum along "
            "dimension 1 divided by the mask's count along dimension 1, then the mean over the batch."
        ),
        skeleton=(
            "def grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.04):\n"
            "    ratio = ____\n"
            "    A = ____  # (batch, 1)\n"
            "    surrogate = ____  # the smaller of the unclipped and the clipped term\n"
            "    d = ____\n"
            "    kl = ____  # k3, never below 0\n"
            "    per_token = ____\n"
            "    m = ____  # the mask as floats\n"
            "    per_answer = ____  # (batch,): the mean over each answer's own tokens\n"
            "    return ____\n"
        ),
    ),
    "ex_pass_at_k": Hints(
        number="17.5",
        check="check_pass_at_k",
        idea=(
            "Of n sampled answers c are right. Draw k of the n without replacement: pass@k is the chance that at "
            "least one is right, 1 minus the chance that all k are wrong, C(n - c, k) / C(n, k). When fewer than "
            "k answers are wrong, every draw has a right one: the answer is 1. With exactly k wrong, one draw "
            "(those k) is still all wrong."
        ),
        approach=(
            "Either exactly with math.comb (Python's integers never overflow, and dividing two of them gives a "
            "correctly rounded float), or as Chen et al. do: the ratio of binomials equals a product of c factors, "
            "1 - k / i for i from n - c + 1 to n, each between 0 and 1, so it never overflows either. Handle "
            "n - c < k first."
        ),
        skeleton=(
            "def pass_at_k(n, c, k):\n"
            "    if ____:\n"
            "        return 1.0\n"
            "    all_wrong = ____  # the chance that k draws without replacement are all wrong\n"
            "    return ____\n"
        ),
    ),
}

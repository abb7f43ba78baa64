"""Checkers for notebooks/12_moe_and_scaling.ipynb: a mixture of experts' router, top-k gating, the balance loss, the forward.

Four exercises, each checked against a reference after first trying the known mistakes:

- 12.1 ``top_k_gating(router_logits, k) -> (gates, experts)``, both (tokens, k): the softmax over
  the tokens axis (dim 0) instead of the experts axis, the k gates not renormalised when k > 1
  (rows add to less than 1), the one gate renormalised when k = 1 (every gate exactly 1: the router
  gets no gradient through it), k ignored (2 or all n_experts experts whatever k asks), the k axis
  squeezed away when k = 1 ((tokens,) for (tokens, 1)), the pick made along the tokens axis ((k,
  n_experts)), raw logits as gates (no softmax, or the kept logits divided by their sum), the k
  smallest picked (largest=False, an ascending sort), gates that carry no gradient (detached,
  torch.no_grad(), rebuilt from .tolist()) or a wrong one (a detached renormalising sum), exp
  without subtracting the row max (NaN or inf for logits around 1000), the logits changed in
  place, outputs that are no tensors, float experts (int64 expected), the pair returned as
  (experts, gates), gates in another dtype than the logits. Any order of the k (expert, gate)
  pairs within a row is named once everything else is right: the brief asks for the largest gate first,
  the order exercise 12.3 queues choices in; int32 experts are named too; a softmax over the k kept logits for
  k > 1 (equal to renormalising) passes. Compared with
  ``tfedu.moe.top_k_gating`` on 1 to 9 tokens, 4 and 8 experts, k = 1, 2, 3, float32 and float64,
  logits at least 0.25 apart (no ties), some around +-1000; then the gradient of a random weighting
  of the gates with respect to the logits. ``tfedu.moe`` is refused: the gating is the exercise
  (``torch.softmax``, ``F.softmax`` and ``torch.topk`` are allowed).
- 12.2 ``balance_loss(router_probs, experts) -> scalar tensor``, Switch's ``E * sum_i f_i * P_i``:
  f from the probabilities instead of the counts (``E * sum P_i^2``), the factor E missing or the
  f_i P_i averaged over the experts (both 1/E of the loss), both at once (1/E^2), f as raw counts
  (not divided by the tokens * k assignments), f divided by the tokens only (Hugging Face
  Mixtral's convention, k at balance instead of 1), only each token's first choice counted when
  k > 1, P taken over the chosen experts' probabilities only, the loss per expert not summed
  ((n_experts,)), a one-element tensor that is not 0-d, a Python float (no gradient), no gradient
  reaching router_probs (P detached) or a wrong one, the inputs changed in place. Compared with
  ``tfedu.moe.balance_loss`` (value and gradient) on routers with 1, 2 and 3 picks per token, a
  perfectly balanced one (1) and a collapsed one (E). ``tfedu.moe``'s balance_loss and
  expert_fractions are refused (``torch.bincount``, ``F.one_hot``, scatter and einops are allowed).

- 12.3 ``moe_forward(x, router_weight, experts, k, capacity) -> (out, kept)``, the layer's forward pass with
  capacity (``experts`` a list of functions on rows): no capacity, a capacity off by one, one count shared by all
  experts, queues in another order (a token's k choices together, by gate, latest first), a dropped token given x,
  the residual added, gates left out, applied twice, not renormalised for k > 1 or renormalised after a drop, only
  the first choice run, experts run on more rows than their capacity (recorded), no gradient reaching the router,
  kept inverted, of another shape or not bool, the inputs changed in place. Compared with :func:`moe_variant`
  (itself checked against ``tfedu.moe.MoE`` in training mode) on k = 1, 2, 3 with drops and one without, output,
  kept and the gradients on x and router_weight. A correct top_k_gating is bound in place of the learner's while it
  runs (``names_bound``; the probe's run code does the same), so a slip in 12.1 costs only 12.1. tfedu.moe is
  refused.

- 12.4 ``isoflop_fit(curves, budgets, tokens_per_step) -> (n_opt, loss_min, a, b)``, Hoffmann et al.'s approach 2
  on training curves (N, steps, losses): each budget's IsoFLOP slice read at D = C / 6N (linear interpolation, models
  whose curve does not cover D skipped), a least-squares parabola in ln N with its vertex (NaN for fewer than three
  models or a parabola opening downward), then ln N_opt = a ln C + b (ValueError with fewer than two minima). Named:
  C = 2ND, steps read as tokens, the parabola in N, the best sampled model for the vertex, curves used past their
  ends (np.interp's clamping), budgets of two models kept, a downward parabola's vertex kept, the line fitted the
  wrong way round (about 1 / a), log10 on one axis and ln on the other, b in log10; the inputs changed in place.
  Compared with :func:`reference_isoflop_fit` on curves from a Chinchilla-like L(N, D) = E + A/N^alpha + B/D^beta
  with noise (one with a loss spike, one too short for any line); the probe draws fresh laws, sizes and budgets
  until every mistake shows apart. The reference itself (and tfedu.experiments.scaling) is refused.

A function that returns None is taken for an unfinished exercise (``ExerciseNotDone``), like one
that still raises NotImplementedError.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import tfedu.moe as _moe
from tfedu.checks.building_blocks import EINOPS, ELEMENTARY, SOFTMAX
from tfedu.checks.core import (
    NOT_DONE_MESSAGE,
    CheckFailure,
    ExerciseNotDone,
    Hints,
    Probe,
    call_on_copies,
    checker,
    describe,
    expect,
    from_modules,
    globals_from_modules,
    is_close,
    names_bound,
    watch_calls,
)
from tfedu.checks.probes import CLEANUP, HELPERS, compare_outputs
from tfedu.moe import balance_loss as reference_balance_loss
from tfedu.moe import top_k_gating as reference_top_k_gating

HINT_RETURNED_NONE = (
    "your {function} returned None: this exercise is not done yet (replace the `raise NotImplementedError` with "
    "your code), or the function has no `return`"
)
HINT_SHORTCUT = (
    "your {function} uses tfedu.moe ({name}): {what} is the exercise itself, so build it from torch operations "
    "({how})"
)
FORBIDDEN = ("tfedu.moe", "tfedu.layers", "tfedu.model")  # the MoE layer is to live in tfedu.layers' make_mlp


def _refuse_moe(fn: Any, function: str, what: str, how: str) -> None:
    """Fail when ``fn`` is from tfedu.moe or its code refers to a global that is (found by object, whatever its name)."""
    if from_modules(fn, ["tfedu.moe"]):
        raise CheckFailure(HINT_SHORTCUT.format(function=function, name=f"you passed tfedu.moe's own "
                                                f"{getattr(fn, '__name__', 'object')}", what=what, how=how))
    used = globals_from_modules(fn, ["tfedu.moe"])
    expect(not used, HINT_SHORTCUT.format(function=function, name=", ".join(used), what=what, how=how))


def _not_none(got: Any, function: str) -> Any:
    if got is None:
        raise ExerciseNotDone(HINT_RETURNED_NONE.format(function=function))
    return got


# Run in the student's kernel (in the probes' run code) and, for the checkers, here: one source.
MOE_HELPERS = '''\
def _export(value):
    """A tensor as plain data: its values (float64 for any float dtype) and its dtype's name; None otherwise."""
    if not isinstance(value, torch.Tensor):
        return None
    value = value.detach().cpu()
    values = value.double() if value.is_floating_point() else value
    return {"values": values.numpy(), "dtype": str(value.dtype).replace("torch.", "")}


def _gate_grad(result, logits, weights):
    """The gradient of sum(gates * weights[token, expert]) with respect to logits (a float64 array), or a word.

    The weight of a gate goes with its (token, expert) pair, so any order of a row's k picks gives the same
    gradient. "skipped" when the result is no pair of a float and an integer tensor of one shape (tokens, k) with
    experts in range (the values' check names that), "missing" when the gates do not require grad, "none" when
    they do not reach logits, "failed: ..." when the backward pass raises.
    """
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        return "skipped"
    gates, experts = result
    if (not gates.is_floating_point() or experts.is_floating_point() or experts.dtype == torch.bool
            or gates.shape != experts.shape or gates.dim() != 2 or gates.shape[0] != weights.shape[0]):
        return "skipped"
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= weights.shape[1]):
        return "skipped"
    if not gates.requires_grad:
        return "missing"
    try:
        picked = weights.to(gates.dtype).gather(-1, experts.long())
        (grad,) = torch.autograd.grad((gates * picked).sum(), [logits], allow_unused=True)
    except Exception as err:
        return "failed: " + type(err).__name__ + ": " + str(err)[:200]
    return "none" if grad is None else grad.detach().cpu().double().numpy()


def _loss_grad(result, probs):
    """The gradient of a scalar loss with respect to probs (a float64 array), or a word as in _gate_grad."""
    if not isinstance(result, torch.Tensor) or not result.is_floating_point() or result.numel() != 1:
        return "skipped"
    if not result.requires_grad:
        return "missing"
    try:
        (grad,) = torch.autograd.grad(result.sum(), [probs], allow_unused=True)
    except Exception as err:
        return "failed: " + type(err).__name__ + ": " + str(err)[:200]
    return "none" if grad is None else grad.detach().cpu().double().numpy()


'''
MOE_CLEANUP = "del _export, _gate_grad, _loss_grad\n"

_helpers: dict[str, Any] = {"torch": torch}
exec(compile(MOE_HELPERS, "<moe probe helpers>", "exec"), _helpers)
export = _helpers["_export"]
gate_grad = _helpers["_gate_grad"]
loss_grad = _helpers["_loss_grad"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
           "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
           "bool": torch.bool}


def restore(exported: Any) -> Any:
    """The tensor :func:`export` described (values in their own dtype); anything else as it came."""
    if not (isinstance(exported, dict) and "values" in exported and "dtype" in exported):
        return exported
    values = torch.from_numpy(np.array(exported["values"]))
    dtype = _DTYPES.get(str(exported["dtype"]))
    return values.to(dtype) if dtype is not None else values


# ----------------------------------------------------------------------------- 12.1 top_k_gating

RULE = (
    "the router's probabilities are a softmax over the experts (the last axis: each token's row adds to 1); keep the "
    "k largest; with k = 1 the gate is that probability unchanged, with k > 1 divide the k gates by their sum"
)
HINT_GATING_CALL = (
    "top_k_gating(router_logits, k): router_logits is a float tensor (tokens, n_experts), k an int from 1 to "
    "n_experts; return (gates, experts), both (tokens, k)"
)
HINT_PAIR = "top_k_gating should return a pair (gates, experts), each (tokens, k), got {got}"
HINT_NOT_TENSORS = "top_k_gating should return two torch tensors (gates, experts), each (tokens, k), got ({got})"
HINT_SWAPPED = (
    "you returned (experts, gates): return (gates, experts), the gates first, the order of torch.topk's "
    "(values, indices)"
)
HINT_EXPERTS_DTYPE = (
    "your experts are {dtype}: expert ids pick each token's experts (and index their weights), so they must be "
    "integers. torch.topk's indices are int64: return those (int64 expected), not a float copy"
)
HINT_EXPERTS_INT64 = (
    "your experts are {dtype}: the brief asks for int64 (torch.long) expert ids, PyTorch's index type. one_hot "
    "refuses any other (\"only applicable to index tensor of type LongTensor\"), gather and index_select accept "
    "int32 only in recent PyTorch versions, and the MoE layers later in this notebook route with your function: "
    "keep the int64 indices that topk or argsort give you rather than converting them"
)
HINT_GATES_NOT_FLOAT = "your gates are {dtype}: gates are probabilities, a float tensor in the logits' dtype"
HINT_SQUEEZED = (
    "your {name} are of shape {got} for k = 1: keep the k axis, (tokens, 1) = {want}. The layer treats every k alike, "
    "multiplying each of a token's k experts' outputs by its gate, so both outputs are (tokens, k) for every k "
    "(torch.topk keeps that axis; do not .squeeze() it)"
)
HINT_K_IGNORED = (
    "your {name} are of shape {shape}, {got} expert{s} per token, where k = {k} was asked{every}: the router "
    "keeps exactly k experts per token, so use the k it is given rather than a fixed number"
)
HINT_TOKENS_AXIS = (
    "your {name} are (k, n_experts) = {got}: you picked along the tokens axis (dim 0), the k tokens that rate each "
    "expert highest (that is expert-choice routing, Zhou et al. 2022, a different method). Here each token picks "
    "its own experts: the top k over the experts axis, the last one, giving (tokens, k)"
)
HINT_SHAPE = "top_k_gating({what}) returned {name} of shape {got}, expected (tokens, k) = {want}"
HINT_SHAPES_DIFFER = "your gates {g} and experts {e} differ in shape: both are (tokens, k), gate j going with expert j"
HINT_OVERFLOW = (
    "your gates hold NaN or inf for router logits around {offset:+g}: exp of a logit that large overflows to inf "
    "(exp(1000) in float64 too) and one that small underflows to 0, and inf / inf or 0 / 0 is NaN. Router logits "
    "are not bounded (ST-MoE adds its z-loss because they drift large): subtract each row's max before exp (a "
    "softmax is unchanged by a shift), or use torch.softmax, which does it for you"
)
HINT_NAN = "your gates hold NaN or inf where the reference's are finite (for {what})"
HINT_SOFTMAX_TOKENS = (
    "your probabilities were normalised over the tokens axis (a softmax over dim 0): each expert's column adds to 1, "
    "not each token's row. The router gives every token a distribution over the experts: a softmax over the last "
    "axis, the experts (router_logits is (tokens, n_experts))"
)
HINT_NOT_RENORMALISED = (
    "your {k} gates per token add to less than 1 (token 0's add to {total:.4f}): with k > 1 divide the kept "
    "probabilities by their sum over the token's k experts, so a token's output is a weighted average "
    "of its k experts' (GShard's top-2, Mixtral). Only with k = 1 is the probability kept as it is"
)
HINT_RENORMALISED_K1 = (
    "with k = 1 every one of your gates is exactly 1: you renormalised the single kept probability (divided it by "
    "its own sum, or took a softmax over the one chosen logit). A gate that is always 1 is a constant, so no "
    "gradient reaches the router "
    "through it and the router cannot learn which expert suits a token (only the balance loss would train it). "
    "Switch Transformers keeps the probability itself as the gate when k = 1 (Fedus et al. 2022, eq. 2); "
    "renormalise only when k > 1"
)
HINT_RAW_LOGITS = (
    "your gates are the router's raw logits{how}, not probabilities: picking the experts by their logits is fine (a "
    "softmax keeps their order), but each gate is the expert's probability, a softmax over all the experts, "
    "divided by the sum of the k kept ones when k > 1"
)
HINT_SMALLEST = (
    "you kept the k experts with the smallest probabilities (largest=False, or the first k of an ascending sort): "
    "each token goes to the k experts the router rates highest"
)
HINT_DUPLICATES = "your experts for token {t} are {got}: the same expert twice. Each token's k experts are k different ones"
HINT_EXPERTS_DIFFER = (
    "top_k_gating({what}) picked experts {got} for token {t}, expected {want} (in any order): each token's k "
    "experts are those with the k largest router probabilities"
)
HINT_GATES_DIFFER = (
    "top_k_gating({what}) picked the right experts, but token {t}'s gates are {got}, expected {want} (paired by "
    "expert, in order of expert id): " + RULE
)
HINT_GATES_DTYPE = (
    "your gates are {got} for router_logits in {want}: keep the logits' dtype (a softmax of {want} logits is "
    "{want}; do not convert it)"
)
HINT_NO_GRAD = (
    "your gates carry no gradient back to router_logits{why}: was something computed under torch.no_grad(), cut off "
    "with .detach() or .data, or rebuilt from numbers (.tolist(), .item(), .numpy(), a new torch.tensor)? The "
    "router is trained through the gates (each expert's output is multiplied by its gate), so keep every step a "
    "differentiable torch operation: torch.softmax, torch.topk (its values carry the gradient), gather, division"
)
HINT_GRAD_DIFFERS = (
    "your gates are right, but backpropagating a random weighting of them gives a wrong gradient on router_logits "
    "(largest error {diff:.3g} at token {t}): is part of the computation detached, such as the sum you divide by "
    "when k > 1 (.detach(), .item(), a Python float)? The gradient must flow through every step"
)
HINT_GRAD_FAILED = "backpropagating through your gates failed ({err}): was a tensor the backward pass needs changed in place?"
HINT_GATING_MUTATED = (
    "your top_k_gating changed the caller's `{name}` in place (router_logits -= max, or an in-place op with a "
    "trailing underscore): the router's logits are used again (the z-loss reads them), so build new tensors"
)


def expected_gating(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exercise's (gates, experts) in float64: the rule, written out (checked against tfedu.moe's)."""
    probs = logits.double().softmax(dim=-1)  # tokens n_experts
    gates, experts = probs.topk(k, dim=-1)  # tokens k
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates, experts


def _renormalised(gates: torch.Tensor, k: int) -> torch.Tensor:
    return gates / gates.sum(dim=-1, keepdim=True) if k > 1 else gates


def gating_mistakes(logits: torch.Tensor, k: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(hint, gates, experts) for each known mistake on ``logits`` (float64), in the order they are named."""
    x = logits.double()
    probs = x.softmax(dim=-1)
    right = x.topk(k, dim=-1).indices
    by_tokens = x.softmax(dim=0)  # each expert's column adds to 1
    tokens_top = by_tokens.topk(k, dim=-1)
    raw = x.topk(k, dim=-1).values
    smallest = probs.topk(k, dim=-1, largest=False)
    kept = probs.gather(-1, right)
    mistakes = [
        (HINT_SOFTMAX_TOKENS, _renormalised(tokens_top.values, k), tokens_top.indices),
        (HINT_SOFTMAX_TOKENS, tokens_top.values, tokens_top.indices),
        (HINT_SOFTMAX_TOKENS, _renormalised(by_tokens.gather(-1, right), k), right),
        (HINT_SOFTMAX_TOKENS, by_tokens.gather(-1, right), right),
        (HINT_RAW_LOGITS.format(how=""), raw, right),
        (HINT_RAW_LOGITS.format(how=" divided by their sum"), raw / raw.sum(dim=-1, keepdim=True), right),
        (HINT_SMALLEST, _renormalised(smallest.values, k), smallest.indices),
    ]
    if k > 1:
        mistakes.insert(0, (HINT_NOT_RENORMALISED.format(k=k, total=float(kept[0].sum())), kept, right))
    return mistakes


HINT_ORDER = (
    "your k picks are the right experts with the right gates, but not in order in {what}: token {t} gets experts "
    "{got}, expected {want}, largest gate first. The brief asks for that order because exercise 12.3 queues each "
    "token's first choice (its largest gate) before any second choice, so the order decides which tokens a full "
    "expert drops"
)


def by_expert(gates: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (gate, expert) pairs sorted by expert id: any order of a token's k picks compares equal."""
    order = experts.argsort(dim=-1)
    return gates.gather(-1, order), experts.gather(-1, order)


def _same_pair(gates: torch.Tensor, experts: torch.Tensor, want_gates: torch.Tensor, want_experts: torch.Tensor,
               *, rtol: float = 1e-3, atol: float = 1e-4) -> bool:
    """True when two (gates, experts) pairs pick the same experts with close gates, in any order within a row."""
    if gates.shape != want_gates.shape or experts.shape != want_experts.shape:
        return False
    g, e = by_expert(gates.detach().double().cpu(), experts.detach().long().cpu())
    wg, we = by_expert(want_gates.detach().double().cpu(), want_experts.detach().long().cpu())
    return bool(torch.equal(e, we)) and is_close(g, wg, rtol=rtol, atol=atol)


def _pair(got: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's (gates, experts), once it is a pair of tensors in the right order and dtypes."""
    _not_none(got, "top_k_gating")
    if isinstance(got, torch.Tensor) or not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise CheckFailure(HINT_PAIR.format(got=describe(got) if not isinstance(got, (tuple, list))
                                            else f"a {type(got).__name__} of {len(got)}"))
    if not all(isinstance(t, torch.Tensor) for t in got):
        raise CheckFailure(HINT_NOT_TENSORS.format(got=", ".join(describe(t) for t in got)))
    gates, experts = (t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t for t in got)
    if not gates.is_floating_point() and experts.is_floating_point():
        raise CheckFailure(HINT_SWAPPED)
    return gates, experts


def _check_shapes(gates: torch.Tensor, experts: torch.Tensor, logits: torch.Tensor, k: int, what: str) -> None:
    tokens, n_experts = logits.shape
    want = (tokens, k)
    for name, t in (("gates", gates), ("experts", experts)):
        got = tuple(t.shape)
        if got == want:
            continue
        if k == 1 and got == (tokens,):
            raise CheckFailure(HINT_SQUEEZED.format(name=name, got=got, want=want))
        if got == (k, n_experts):
            raise CheckFailure(HINT_TOKENS_AXIS.format(name=name, got=got))
        if len(got) == 2 and got[0] == tokens and got[1] != k:
            every = f" (all n_experts = {n_experts} of them)" if got[1] == n_experts else ""
            raise CheckFailure(HINT_K_IGNORED.format(name=name, shape=got, got=got[1], s="s" if got[1] != 1 else "",
                                                     k=k, every=every))
        raise CheckFailure(HINT_SHAPE.format(what=what, name=name, got=got, want=want))


def _row(values: torch.Tensor, digits: int = 4) -> list:
    return [round(float(v), digits) if values.is_floating_point() else int(v) for v in values]


def diagnose_gating(got: Any, logits: torch.Tensor, k: int, weights: torch.Tensor, grad: Any, *, what: str,
                    offset: float = 0.0) -> None:
    """Raise CheckFailure naming what is wrong with ``got``, the learner's answer for ``(logits, k)``; shared with the probe.

    ``grad`` is :func:`gate_grad` of that answer with the upstream ``weights`` (tokens, n_experts): an array, or
    a word ("missing", "none", "skipped", "failed: ...").
    """
    gates, experts = _pair(got)
    if gates.is_floating_point() and experts.is_floating_point():  # both float: maybe swapped, maybe float experts
        want_gates, want_experts = expected_gating(logits, k)
        if experts.shape == want_gates.shape and gates.shape == want_experts.shape and _same_pair(
                experts, gates.round().long(), want_gates, want_experts):
            raise CheckFailure(HINT_SWAPPED)
        raise CheckFailure(HINT_EXPERTS_DTYPE.format(dtype=experts.dtype))
    if experts.dtype == torch.bool or experts.is_complex():
        raise CheckFailure(HINT_EXPERTS_DTYPE.format(dtype=experts.dtype))
    expect(gates.is_floating_point(), HINT_GATES_NOT_FLOAT.format(dtype=gates.dtype))
    _check_shapes(gates, experts, logits, k, what)
    expect(gates.shape == experts.shape, HINT_SHAPES_DIFFER.format(g=tuple(gates.shape), e=tuple(experts.shape)))
    want_gates, want_experts = expected_gating(logits, k)
    if not torch.isfinite(gates.detach()).all():
        raise CheckFailure(HINT_OVERFLOW.format(offset=offset) if abs(offset) >= 100 else HINT_NAN.format(what=what))
    tokens, n_experts = logits.shape
    g, e = gates.detach().double().cpu(), experts.detach().long().cpu()
    if e.numel() and (int(e.min()) < 0 or int(e.max()) >= n_experts):
        raise CheckFailure(f"your experts hold {int(e.min())} to {int(e.max())}: expert ids run from 0 to "
                           f"n_experts - 1 = {n_experts - 1}")
    sorted_experts = e.sort(dim=-1).values
    repeated = (sorted_experts[:, 1:] == sorted_experts[:, :-1]).any(dim=-1).nonzero()
    if len(repeated):
        t = int(repeated[0])
        raise CheckFailure(HINT_DUPLICATES.format(t=t, got=_row(e[t])))
    if not _same_pair(g, e, want_gates, want_experts):
        if k == 1 and torch.allclose(g, torch.ones_like(g), rtol=0, atol=1e-6):
            raise CheckFailure(HINT_RENORMALISED_K1)
        for hint, wrong_gates, wrong_experts in gating_mistakes(logits, k):
            if _same_pair(g, e, wrong_gates, wrong_experts) and not _same_pair(wrong_gates, wrong_experts,
                                                                              want_gates, want_experts):
                raise CheckFailure(hint)
        smallest = logits.double().topk(k, dim=-1, largest=False).indices
        if torch.equal(e.sort(dim=-1).values, smallest.sort(dim=-1).values):
            raise CheckFailure(HINT_SMALLEST)
    g, e = by_expert(g, e)
    wg, we = by_expert(want_gates, want_experts)
    wrong_rows = (e != we).any(dim=-1).nonzero()
    if len(wrong_rows):
        t = int(wrong_rows[0])
        raise CheckFailure(HINT_EXPERTS_DIFFER.format(what=what, t=t, got=_row(e[t]), want=_row(we[t])))
    if not is_close(g, wg):
        t = int((g - wg).abs().amax(dim=-1).argmax())
        raise CheckFailure(HINT_GATES_DIFFER.format(what=what, t=t, got=_row(g[t]), want=_row(wg[t])))
    _judge_gate_grad(grad, logits, k, weights)
    expect(gates.dtype == logits.dtype, HINT_GATES_DTYPE.format(got=gates.dtype, want=logits.dtype))
    expect(experts.dtype == torch.int64, HINT_EXPERTS_INT64.format(dtype=experts.dtype))
    in_order = experts.detach().long().cpu()
    out_of_order = (in_order != want_experts.cpu()).any(dim=-1).nonzero()
    if len(out_of_order):
        t = int(out_of_order[0])
        raise CheckFailure(HINT_ORDER.format(what=what, t=t, got=_row(in_order[t]), want=_row(want_experts[t])))


def expected_gate_grad(logits: torch.Tensor, k: int, weights: torch.Tensor) -> torch.Tensor:
    """The gradient :func:`gate_grad` should find, in float64."""
    leaf = logits.detach().double().requires_grad_()
    gates, experts = expected_gating(leaf, k)
    (grad,) = torch.autograd.grad((gates * weights.double().gather(-1, experts)).sum(), [leaf])
    return grad


def _judge_gate_grad(grad: Any, logits: torch.Tensor, k: int, weights: torch.Tensor) -> None:
    if isinstance(grad, str):
        if grad.startswith("failed"):
            raise CheckFailure(HINT_GRAD_FAILED.format(err=grad.removeprefix("failed: ")))
        why = {"missing": " (they do not require grad)", "none": " (they do not depend on it through autograd)"}
        raise CheckFailure(HINT_NO_GRAD.format(why=why.get(grad, "")))
    want = expected_gate_grad(logits, k, weights)
    got = torch.as_tensor(np.asarray(grad, dtype=np.float64))
    if got.shape != want.shape or not torch.isfinite(got).all():
        raise CheckFailure(HINT_GRAD_DIFFERS.format(diff=float("inf"), t=0))
    scale = max(1.0, float(want.abs().max()))
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-4 * scale):
        diff = (got - want).abs()
        raise CheckFailure(HINT_GRAD_DIFFERS.format(diff=float(diff.max()), t=int(diff.amax(dim=-1).argmax())))


def router_logits(seed: int, tokens: int, n_experts: int, dtype: torch.dtype = torch.float32,
                  offset: float = 0.0) -> torch.Tensor:
    """Router logits with no ties: each row a shuffle of values at least 0.25 apart, on a grid of 1/8 (exact in float32)."""
    g = torch.Generator().manual_seed(seed)
    values = (0.25 + 0.5 * torch.rand(tokens, n_experts, generator=g, dtype=torch.float64)).cumsum(dim=-1)
    values = values - values.mean(dim=-1, keepdim=True)
    order = torch.rand(tokens, n_experts, generator=g).argsort(dim=-1)
    return (offset + (values.gather(-1, order) * 8).round() / 8).to(dtype)


def upstream_weights(seed: int, tokens: int, n_experts: int) -> torch.Tensor:
    """A random weight per (token, expert): the upstream gradient of each gate, whatever the order of the picks."""
    return torch.randn(tokens, n_experts, generator=torch.Generator().manual_seed(1000 + seed), dtype=torch.float64)


# (seed, tokens, n_experts, k, dtype, offset): k = 1 first (Switch), then 2 and 3, float64, one token, then logits
# around +-1000, where exp overflows (or underflows) unless the row max is subtracted first. tokens != k throughout,
# so a pick along the tokens axis, (k, n_experts), shows by its shape.
GATING_CASES = (
    (0, 6, 4, 1, torch.float32, 0.0), (1, 6, 4, 2, torch.float32, 0.0), (2, 7, 8, 2, torch.float32, 0.0),
    (3, 5, 8, 3, torch.float32, 0.0), (4, 9, 8, 1, torch.float64, 0.0), (5, 4, 4, 3, torch.float64, 0.0),
    (6, 1, 8, 2, torch.float32, 0.0), (7, 5, 4, 1, torch.float32, 1000.0), (8, 6, 8, 2, torch.float64, -1000.0),
)
GATING_HOW = "torch.softmax over the experts axis, torch.topk, and the division by the kept gates' sum when k > 1"


def _case_text(logits: torch.Tensor, k: int) -> str:
    return f"router_logits of shape {tuple(logits.shape)} {str(logits.dtype).removeprefix('torch.')}, k={k}"


def _check_gating_call(fn: Any, seed: int, tokens: int, n_experts: int, k: int, dtype: torch.dtype,
                       offset: float) -> None:
    logits = router_logits(seed, tokens, n_experts, dtype, offset)
    weights = upstream_weights(seed, tokens, n_experts)
    leaf = logits.clone().requires_grad_()
    with watch_calls((_moe, "top_k_gating")) as called:
        got = call_on_copies(fn, {"router_logits": leaf, "k": k}, name="top_k_gating",
                             mutated_hint=HINT_GATING_MUTATED, error_hint=HINT_GATING_CALL)
    expect(not called, HINT_SHORTCUT.format(function="top_k_gating", name="tfedu.moe.top_k_gating",
                                            what="the gating", how=GATING_HOW))
    diagnose_gating(got, logits, k, weights, gate_grad(got, leaf, weights), what=_case_text(logits, k), offset=offset)


@checker("top-k gating")
def check_top_k_gating(top_k_gating) -> None:
    """Check a learner's ``top_k_gating(router_logits, k) -> (gates, experts)``, both (tokens, k).

    On :data:`GATING_CASES`, against the rule written out in float64 (itself checked against
    ``tfedu.moe.top_k_gating``), after trying the known mistakes (:func:`gating_mistakes`); a token's k
    picks compare in any order first, and their order (largest gate first) is asked last. Each case also backpropagates a random weighting of the gates and
    compares the gradient on the logits. tfedu.moe is refused.
    """
    _refuse_moe(top_k_gating, "top_k_gating", "the gating", GATING_HOW)
    for seed, tokens, n_experts, k, dtype, offset in GATING_CASES:
        _check_gating_call(top_k_gating, seed, tokens, n_experts, k, dtype, offset)
        logits = router_logits(seed, tokens, n_experts, dtype, offset)
        ours, theirs = expected_gating(logits, k), reference_top_k_gating(logits, k)  # our own guard
        assert _same_pair(*ours, *theirs, rtol=1e-5, atol=1e-6), "the checker disagrees with tfedu.moe.top_k_gating"


# ----------------------------------------------------------------------------- 12.2 balance_loss

FORMULA = (
    "E * sum_i f_i * P_i, with f_i the fraction of the tokens * k assignments that went to expert i (counted from "
    "experts, divided by tokens * k) and P_i the router's probability for expert i (column i of router_probs), "
    "averaged over the tokens"
)
HINT_LOSS_CALL = (
    "balance_loss(router_probs, experts): router_probs is a float tensor (tokens, n_experts), each row a softmax; "
    "experts an int64 tensor (tokens, k) of expert ids; return the scalar " + FORMULA
)
HINT_FLOAT = (
    "your balance_loss returned a Python {kind} ({value}): the loss is added to the training loss and minimised "
    "through P, so it must stay a tensor that carries the gradient back to the router; .item() or float() cuts it "
    "off. Return the 0-d tensor"
)
HINT_LOSS_NOT_TENSOR = "balance_loss should return a 0-d torch tensor, the loss, got {got}"
HINT_LOSS_NOT_FLOAT = "your balance_loss returned a {dtype} tensor: the loss is a float, P_i is a mean of probabilities"
HINT_NOT_SUMMED = (
    "your loss has one entry per expert, shape {shape}: those are E * f_i * P_i, so sum them over the experts "
    "for the scalar loss"
)
HINT_NOT_SCALAR = (
    "your loss has shape {shape}: return a 0-d tensor (shape ()), as .sum() gives, so it adds to the training loss "
    "like any other scalar"
)
HINT_LOSS_SHAPE = "balance_loss({what}) returned shape {shape}: the loss is one number, a 0-d tensor"
HINT_LOSS_NAN = "your balance loss is {value} for {what}: a division by zero? f divides by tokens * k, P by tokens"
HINT_F_FROM_PROBS = (
    "your f is the router's probabilities, not the counts: that gives E * sum_i P_i^2. f_i is the fraction of the "
    "assignments actually routed to expert i, counted from experts and divided by the number of assignments: "
    "it is not differentiable, and the gradient reaches the router through P alone (Fedus et al. 2022, eq. 4-6)"
)
HINT_MISSING_E = (
    "your loss is the reference's divided by E = {E}: either the factor E in front is missing, or you averaged "
    "f_i * P_i over the experts with .mean() where the formula sums them. With the factor E and the sum, the loss "
    "is 1 when the tokens are spread evenly (E * E * (1/E)^2), whatever the number of experts"
)
HINT_MEAN_NO_E = (
    "your loss is the reference's divided by E^2 = {E2}: you averaged f_i * P_i over the experts with .mean() "
    "and left out the factor E as well. The formula sums over the experts and multiplies by E: 1 when the tokens "
    "are spread evenly"
)
HINT_RAW_COUNTS = (
    "your f holds raw counts: divide them by the number of assignments, tokens * k = {n} (experts.numel()), so f "
    "is a fraction that adds to 1 and the loss stays 1 at balance whatever the batch size"
)
HINT_P_SUMMED = (
    "your loss is tokens = {tokens} times the reference's: your P sums router_probs over the tokens. P_i is the "
    "mean probability of expert i over the tokens, so the loss does not grow with the batch"
)
HINT_COUNTS_OR_SUM = (
    "your loss is tokens = {n} times the reference's: either your f holds raw counts (divide them by the number of "
    "assignments) or your P sums router_probs over the tokens (it is their mean). "
    "With k = 1 the two slips give the same number; both f and P are averages"
)
HINT_PER_TOKEN = (
    "your loss is k = {k} times the reference's: you divided the counts by the tokens ({tokens}) rather than by the "
    "tokens * k = {n} assignments, so your f adds to k. That is Hugging Face Mixtral's convention (its balanced "
    "loss is k); this course's f adds to 1 for any k, so the loss is 1 at balance however many experts each "
    "token picks: divide by experts.numel()"
)
HINT_FIRST_CHOICE = (
    "your f counts only each token's first choice (the first column of experts): with k = {k} every one of a "
    "token's k picks sends it through an expert and loads it, so count all tokens * k assignments, every entry of "
    "experts"
)
HINT_P_CHOSEN = (
    "your P is taken over the chosen experts' probabilities only: P_i is the mean of expert i's probability "
    "(column i of router_probs) over all the tokens, chosen or not. That full probability is what lets the "
    "gradient lower "
    "an overloaded expert's probability for every token"
)
HINT_LOSS_DIFFERS = "balance_loss({what}) is {got:.6g}, expected {want:.6g}: the loss is " + FORMULA
HINT_P_DETACHED = (
    "your loss carries no gradient back to router_probs{why}: is P detached (.detach(), torch.no_grad(), .item(), "
    "or rebuilt from numbers)? f is counted and has no gradient, so P, the mean of router_probs, is the only way the "
    "loss trains the router: keep it a differentiable torch operation"
)
HINT_LOSS_GRAD_DIFFERS = (
    "your loss has the right value, but its gradient on router_probs is wrong (largest error {diff:.3g}): "
    "d loss / d router_probs[t, i] = E * f_i / tokens. Is part of P detached, or does f carry a gradient it should "
    "not have (f is counted from experts, not computed from the probabilities)? Or is f shorter than E: "
    "torch.bincount without a minimum length of E stops at the last expert that got a token"
)
HINT_LOSS_GRAD_FAILED = (
    "backpropagating through your loss failed ({err}): was a tensor the backward pass needs changed in place?"
)
HINT_LOSS_MUTATED = "your balance_loss changed the caller's `{name}` in place: compute f and P as new tensors"
LOSS_HOW = "f counted from experts (a count per expert, divided by the assignments), P the mean of router_probs"


def fractions(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """f_i in float64: the fraction of the assignments that went to expert i (written out; see tfedu.moe)."""
    return torch.bincount(experts.flatten().long(), minlength=n_experts).double() / experts.numel()


def expected_balance(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The exercise's loss in float64."""
    n_experts = probs.shape[-1]
    return n_experts * (fractions(experts, n_experts) * probs.double().mean(dim=0)).sum()


def balance_mistakes(probs: torch.Tensor, experts: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(hint, wrong loss) for each known mistake, float64, in the order they are named."""
    tokens, n_experts = probs.shape
    k = experts.shape[1]
    p, f = probs.detach().double(), fractions(experts, n_experts)
    P = p.mean(dim=0)
    loss = n_experts * (f * P).sum()
    chosen = torch.zeros_like(p).scatter(-1, experts.long(), 1.0)  # 1 where expert i is one of token t's picks
    counts = chosen.sum(dim=0)
    first = torch.bincount(experts[:, 0].long(), minlength=n_experts).double()
    mistakes = [
        (HINT_F_FROM_PROBS, n_experts * (P * P).sum()),
        (HINT_MISSING_E.format(E=n_experts), loss / n_experts),
        (HINT_MEAN_NO_E.format(E2=n_experts**2), loss / n_experts**2),
        (HINT_COUNTS_OR_SUM.format(n=tokens) if k == 1 else HINT_RAW_COUNTS.format(n=tokens * k), loss * tokens * k),
        (HINT_P_SUMMED.format(tokens=tokens), loss * tokens),
        (HINT_FIRST_CHOICE.format(k=k), n_experts * (first / tokens * P).sum()),
        (HINT_FIRST_CHOICE.format(k=k), n_experts * (first / (tokens * k) * P).sum()),
        (HINT_PER_TOKEN.format(k=k, tokens=tokens, n=tokens * k), loss * k),
        (HINT_P_CHOSEN, n_experts * (f * (p * chosen).mean(dim=0)).sum()),
        (HINT_P_CHOSEN, n_experts * (f * (p * chosen).sum(dim=0) / counts.clamp(min=1)).sum()),
    ]
    return mistakes


def _loss_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.isclose(a.double(), b.double(), rtol=1e-4, atol=1e-6))


def diagnose_balance(got: Any, probs: torch.Tensor, experts: torch.Tensor, grad: Any, *, what: str) -> None:
    """Raise CheckFailure naming what is wrong with ``got``, the learner's loss for these inputs; shared with the probe.

    ``grad`` is :func:`loss_grad` of that answer: an array, or a word ("missing", "none", "skipped", "failed: ...").
    """
    _not_none(got, "balance_loss")
    if isinstance(got, (float, int, np.floating, np.integer)) and not isinstance(got, (bool, np.bool_)):
        raise CheckFailure(HINT_FLOAT.format(kind=type(got).__name__, value=f"{float(got):.6g}"))
    if not isinstance(got, torch.Tensor):
        raise CheckFailure(HINT_LOSS_NOT_TENSOR.format(got=describe(got)))
    got = got.as_subclass(torch.Tensor) if type(got) is not torch.Tensor else got
    expect(got.is_floating_point(), HINT_LOSS_NOT_FLOAT.format(dtype=got.dtype))
    n_experts = probs.shape[-1]
    want = expected_balance(probs, experts)
    value = got.detach().double().cpu()
    if value.shape != ():
        per_expert = n_experts * fractions(experts, n_experts) * probs.double().mean(dim=0)
        if value.shape == per_expert.shape and is_close(value, per_expert, rtol=1e-4, atol=1e-6):
            raise CheckFailure(HINT_NOT_SUMMED.format(shape=tuple(value.shape)))
        if value.numel() == 1:
            raise CheckFailure(HINT_NOT_SCALAR.format(shape=tuple(value.shape)))
        raise CheckFailure(HINT_LOSS_SHAPE.format(what=what, shape=tuple(value.shape)))
    expect(bool(torch.isfinite(value)), HINT_LOSS_NAN.format(value=float(value), what=what))
    if not _loss_close(value, want):
        for hint, wrong in balance_mistakes(probs, experts):
            if _loss_close(value, wrong) and not _loss_close(wrong, want):
                raise CheckFailure(hint)
        raise CheckFailure(HINT_LOSS_DIFFERS.format(what=what, got=float(value), want=float(want)))
    _judge_loss_grad(grad, probs, experts)


def expected_loss_grad(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """d loss / d router_probs in float64: E * f_i / tokens in every row."""
    tokens, n_experts = probs.shape
    return (n_experts * fractions(experts, n_experts) / tokens).expand(tokens, n_experts)


def _judge_loss_grad(grad: Any, probs: torch.Tensor, experts: torch.Tensor) -> None:
    if isinstance(grad, str):
        if grad.startswith("failed"):
            raise CheckFailure(HINT_LOSS_GRAD_FAILED.format(err=grad.removeprefix("failed: ")))
        why = {"missing": " (it does not require grad)", "none": " (it does not depend on router_probs through autograd)"}
        raise CheckFailure(HINT_P_DETACHED.format(why=why.get(grad, "")))
    want = expected_loss_grad(probs, experts)
    got = torch.as_tensor(np.asarray(grad, dtype=np.float64))
    if got.shape != want.shape or not torch.isfinite(got).all():
        raise CheckFailure(HINT_LOSS_GRAD_DIFFERS.format(diff=float("inf")))
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-5):
        if torch.allclose(got, torch.zeros_like(got)):
            raise CheckFailure(HINT_P_DETACHED.format(why=" (its gradient is zero everywhere)"))
        raise CheckFailure(HINT_LOSS_GRAD_DIFFERS.format(diff=float((got - want).abs().max())))


def routed(seed: int, tokens: int, n_experts: int, k: int, dtype: torch.dtype = torch.float32):
    """A router's probabilities (a softmax of logits with no ties) and each token's top k experts, int64."""
    probs = router_logits(seed, tokens, n_experts, torch.float64).softmax(dim=-1)
    return probs.to(dtype), probs.topk(k, dim=-1).indices


def balanced(tokens: int, n_experts: int, k: int, dtype: torch.dtype = torch.float32):
    """Uniform probabilities and round-robin picks: every f_i and P_i is 1/E, the loss 1."""
    experts = (torch.arange(tokens)[:, None] + torch.arange(k)) % n_experts
    return torch.full((tokens, n_experts), 1 / n_experts, dtype=dtype), experts


def collapsed(tokens: int, n_experts: int, dtype: torch.dtype = torch.float32):
    """Every token sent to expert 0 with probability 1: the loss is E."""
    probs = torch.zeros(tokens, n_experts, dtype=dtype)
    probs[:, 0] = 1
    return probs, torch.zeros(tokens, 1, dtype=torch.long)


def balance_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(description, router_probs, experts): k = 1 first, then 2 and 3, float64, then balanced and collapsed routers."""
    cases = [routed(0, 12, 4, 1), routed(1, 16, 4, 2), routed(2, 10, 8, 2, torch.float64), routed(3, 9, 8, 3),
             routed(4, 7, 4, 3, torch.float64), balanced(8, 4, 1), balanced(8, 4, 2), collapsed(6, 4)]
    return [(f"router_probs of shape {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}, experts of shape "
             f"{tuple(e.shape)}", p, e) for p, e in cases]


def _check_balance_call(fn: Any, what: str, probs: torch.Tensor, experts: torch.Tensor) -> None:
    leaf = probs.clone().requires_grad_()
    with watch_calls((_moe, "balance_loss"), (_moe, "expert_fractions")) as called:
        got = call_on_copies(fn, {"router_probs": leaf, "experts": experts}, name="balance_loss",
                             mutated_hint=HINT_LOSS_MUTATED, error_hint=HINT_LOSS_CALL)
    expect(not called, HINT_SHORTCUT.format(function="balance_loss", name=", ".join(sorted(set(called))),
                                            what="the balance loss", how=LOSS_HOW))
    diagnose_balance(got, probs, experts, loss_grad(got, leaf), what=what)


@checker("the load-balancing loss")
def check_balance_loss(balance_loss) -> None:
    """Check a learner's ``balance_loss(router_probs, experts) -> scalar tensor`` (Switch's ``E * sum_i f_i P_i``).

    On :func:`balance_cases`, value and gradient, against the formula written out in float64 (itself
    checked against ``tfedu.moe.balance_loss``), after trying the known mistakes (:func:`balance_mistakes`).
    tfedu.moe's balance_loss and expert_fractions are refused.
    """
    _refuse_moe(balance_loss, "balance_loss", "the balance loss", LOSS_HOW)
    for what, probs, experts in balance_cases():
        _check_balance_call(balance_loss, what, probs, experts)
        assert _loss_close(expected_balance(probs, experts), reference_balance_loss(probs, experts)), (
            "the checker disagrees with tfedu.moe.balance_loss")  # our own guard


# ----------------------------------------------------------------------------- 12.3 moe_forward

QUEUE = (
    "each expert's queue is every token's first choice in position order, then every second choice in position "
    "order, and so on; an assignment that finds its expert holding capacity assignments already is dropped"
)
HINT_MF_CALL = (
    "moe_forward(x, router_weight, experts, k, capacity): x is (tokens, d_model); router_weight is (n_experts, "
    "d_model), the weight of the router's linear layer (d_model in, one logit per expert out, no bias); experts is "
    "a list of n_experts functions, each taking rows (n, d_model) to (n, d_model); k and capacity are ints. Return (out, kept): out "
    "(tokens, d_model), kept a bool tensor (tokens, k)"
)
HINT_MF_PAIR = "moe_forward should return a pair (out, kept), got {got}"
HINT_MF_NOT_TENSORS = "moe_forward should return two torch tensors (out, kept), got ({got})"
HINT_MF_OUT_SHAPE = (
    "moe_forward({what}) returned out of shape {got}, expected (tokens, d_model) = {want}: each token's output is "
    "the sum of its kept experts' outputs, one row per token"
)
HINT_MF_PER_ASSIGNMENT = (
    "your out is (tokens, k, d_model) = {got}: one row per assignment. The layer's output has one row per token, the "
    "gate-weighted sum over the token's kept assignments"
)
HINT_MF_NAN = "your out holds NaN or inf for {what}, where the reference's is finite: a division by zero?"
HINT_MF_NO_CAPACITY = (
    "nothing was dropped: expert {e} was sent {sent} assignments for {what} and your output has all of them, but its "
    "capacity is {capacity}. An expert takes at most capacity assignments: " + QUEUE + ", and a dropped "
    "assignment adds nothing to its token"
)
HINT_MF_PLUS_ONE = (
    "your experts keep one assignment more than their capacity (expert {e} kept {got} with capacity {capacity}, for "
    "{what}): the places in a queue are 0, 1, ..., capacity - 1; is a comparison off by one?"
)
HINT_MF_MINUS_ONE = (
    "your experts keep one assignment fewer than their capacity (expert {e} kept {got} with capacity {capacity}, for "
    "{what}): the places in a queue are 0, 1, ..., capacity - 1, so an expert keeps capacity of them; is a "
    "comparison off by one?"
)
HINT_MF_ONE_COUNTER = (
    "you counted the capacity over all the experts together (the first {capacity} assignments of the whole batch ran, "
    "for {what}): every expert has its own capacity, counted over the assignments sent to it alone"
)
HINT_MF_TOKEN_ORDER = (
    "your queues take each token's k choices together (token 0's first and second choice, then token 1's, ...): "
    "token {t}'s choice {j} (expert {e}) {fate} for {what}. The queues of this layer put all first choices ahead of "
    "any second choice: " + QUEUE + ". So when an expert is full, second choices are dropped before first ones "
    "(GShard serves first choices first too)"
)
HINT_MF_GATE_PRIORITY = (
    "you kept each expert's assignments with the largest gates (token {t}'s choice {j}, expert {e}, {fate} for "
    "{what}). That is batch prioritised routing (Riquelme et al. 2021, V-MoE), another rule; this layer, like Switch "
    "and GShard, keeps them in queue order: " + QUEUE
)
HINT_MF_LATEST = (
    "your experts kept the last tokens of the batch rather than the first (token {t}'s choice {j}, expert {e}, "
    "{fate} for {what}): " + QUEUE + ". The first to arrive are kept; is a loop running backwards, or a later write "
    "overwriting an earlier one?"
)
HINT_MF_DROPPED_IS_X = (
    "a token all of whose assignments were dropped got its input x as its output (token {t} for {what}): the layer "
    "outputs 0 for it. The block adds the residual itself, x + moe(norm(x)), so a dropped token leaves the block "
    "unchanged; returning x here would add it twice"
)
HINT_MF_RESIDUAL = (
    "your out is x plus the experts' weighted sum: the layer returns the weighted sum alone, 0 for a dropped token. "
    "The residual connection belongs to the block around it, x + moe(norm(x))"
)
HINT_MF_NO_GATES = (
    "every kept expert's output went in with weight 1 (for {what}): multiply each one's output by its gate, the "
    "router's probability for it (with k = 1 Switch's gate, not renormalised). A weight of exactly 1, the gate left "
    "out or renormalised over what was kept, gives the router no gradient"
)
HINT_MF_GATES_TWICE = (
    "each expert's output was multiplied by its gate twice (the gate squared, for {what}): scale the expert's rows by "
    "their gates once, either before adding them up or in the sum, not both"
)
HINT_MF_RENORMALISED_AFTER = (
    "where one of a token's assignments was dropped, your remaining gates were renormalised to add to 1 again (token "
    "{t} for {what}): the gates are the ones routing gave, each token's k gates renormalised before anything is "
    "dropped; a dropped assignment adds nothing, and the others keep their gates as they were"
)
HINT_MF_NOT_RENORMALISED = (
    "with k = {k} your gates are the raw top-k probabilities, which add to less than 1: routing gives each token's k "
    "gates divided by their sum (exercise 12.1's rule). Calling your top_k_gating does it"
)
HINT_MF_FIRST_ONLY = (
    "only each token's first choice ran (for {what}, k = {k}): every one of a token's k assignments goes to its "
    "expert's queue (after all the first choices) and, if kept, adds its gate times that expert's output"
)
HINT_MF_DIFFERS = (
    "moe_forward({what}): out differs from the reference at token {t} (largest error {diff:.3g}); that token's "
    "assignments: {assignments}. Route with the gating, keep assignments in queue order (" + QUEUE + "), and add "
    "each kept assignment's gate times its expert's output"
)
HINT_MF_KEPT_SHAPE = (
    "your kept is of shape {got}: it is (tokens, k) = {want}, entry [t, j] True where token t's choice j (the j-th "
    "largest gate) ran"
)
HINT_MF_KEPT_DTYPE = "your kept is {dtype}: return a bool tensor (tokens, k), True where that assignment ran"
HINT_MF_KEPT_INVERTED = (
    "your kept is True where an assignment was dropped and False where it ran: kept marks the assignments that ran"
)
HINT_MF_KEPT_DIFFERS = (
    "your out is right but kept is not: kept[{t}, {j}] is {got} for {what}, expected {want}. Entry [t, j] is True "
    "where token t's choice j (the j-th largest gate, in the order routing returns them) ran"
)
HINT_MF_ROWS = (
    "expert {e} ran on {rows} rows for {what}, more than its capacity {capacity}: an expert runs on the rows of its "
    "kept assignments only, never more than capacity (that is the point of a fixed capacity: a buffer of capacity "
    "rows per expert). Were the experts run on every token, the dropped ones masked out afterwards?"
)
HINT_MF_NO_GRAD = (
    "your out carries no gradient{why}: was something computed under torch.no_grad(), or cut off with .detach(), "
    ".item() or .tolist()? The experts and the router are trained through this output"
)
HINT_MF_ROUTER_GRAD = (
    "no gradient reaches router_weight through your out{why}: the gates must stay tensors in the graph (not "
    ".item(), .tolist(), .detach() or a fresh torch.tensor). The router learns only through them: an expert's output "
    "times its gate is what the loss sees"
)
HINT_MF_GRAD_DIFFERS = (
    "your out is right, but backpropagating a random upstream gradient through it gives a wrong gradient on "
    "{name} (largest error {diff:.3g}): is part of the computation detached, or changed in place?"
)
HINT_MF_GRAD_FAILED = "backpropagating through your out failed ({err}): was a tensor the backward pass needs changed in place?"
HINT_MF_DTYPE = "your out is {got} for x in {want}: keep x's dtype"
HINT_MF_MUTATED = "your moe_forward changed the caller's `{name}` in place: build new tensors"
# What else the forward pass may use: a one-hot for the queues, index_add and friends to add rows back per token.
MF_BUILDS = frozenset({"torch.nn.functional.one_hot", "torch.index_add", "torch.index_copy", "torch.index_put",
                       "torch.scatter_reduce", "torch.segment_reduce"})
MF_HOW = "your top_k_gating, a queue per expert, and the experts' outputs times their gates added up per token"

# Run in the student's kernel (in the probe's run code) and, for the checker, here: one source.
MF_HELPERS = '''\
def _mf_experts(W_in, b_in, W_out, b_out, rows):
    """The experts as functions, each (n, d_model) -> (n, d_model), a GELU MLP; rows[e] counts the rows expert e ran on."""
    def one(e):
        def expert(h):
            rows[e] += int(h.shape[0]) if h.dim() > 1 else 1
            pre = h @ W_in[e].to(h.dtype) + b_in[e].to(h.dtype)
            return torch.nn.functional.gelu(pre) @ W_out[e].to(h.dtype) + b_out[e].to(h.dtype)
        return expert
    return [one(e) for e in range(len(W_in))]


def _mf_standin_gating(router_logits, k):
    """Exercise 12.1's top_k_gating, right: bound in place of the learner's while 12.3 is checked."""
    probs = torch.softmax(router_logits, dim=-1)
    gates, chosen = torch.topk(probs, k, dim=-1)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates, chosen


def _mf_grads(result, x, router_weight, upstream):
    """[d sum(out * upstream) / d x, ... / d router_weight] as float64 arrays ("none" for one not reached), or a word:
    "skipped" (no float out of the upstream's shape), "missing" (out does not require grad), "failed: ..."."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
        return "skipped"
    out = result[0]
    if not out.is_floating_point() or tuple(out.shape) != tuple(upstream.shape):
        return "skipped"
    if not out.requires_grad:
        return "missing"
    try:
        grads = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), [x, router_weight], allow_unused=True)
    except Exception as err:
        return "failed: " + type(err).__name__ + ": " + str(err)[:200]
    return ["none" if g is None else g.detach().cpu().double().numpy() for g in grads]


'''
MF_CLEANUP = "del _mf_experts, _mf_standin_gating, _mf_grads\n"

_mf_helpers: dict[str, Any] = {"torch": torch, "__name__": "tfedu_standins"}
exec(compile(MF_HELPERS, "<moe_forward helpers>", "exec"), _mf_helpers)
make_experts = _mf_helpers["_mf_experts"]
standin_top_k_gating = _mf_helpers["_mf_standin_gating"]
forward_grads = _mf_helpers["_mf_grads"]


@dataclass(frozen=True)
class MoECase:
    """One call of moe_forward: the tokens, the router, the experts' weights, k, the capacity, an upstream gradient."""

    x: torch.Tensor  # (tokens, d_model)
    router_weight: torch.Tensor  # (n_experts, d_model)
    W_in: torch.Tensor  # (n_experts, d_model, d_mlp)
    b_in: torch.Tensor  # (n_experts, d_mlp)
    W_out: torch.Tensor  # (n_experts, d_mlp, d_model)
    b_out: torch.Tensor  # (n_experts, d_model)
    k: int
    capacity: int
    upstream: torch.Tensor  # (tokens, d_model), float64

    def experts(self, rows: list[int] | None = None) -> list:
        return make_experts(self.W_in, self.b_in, self.W_out, self.b_out, [0] * len(self.W_in) if rows is None else rows)

    @property
    def text(self) -> str:
        tokens, d_model = self.x.shape
        return (f"x of shape ({tokens}, {d_model}) {str(self.x.dtype).removeprefix('torch.')}, "
                f"{len(self.W_in)} experts, k={self.k}, capacity={self.capacity}")


def moe_case(seed: int, tokens: int, n_experts: int, k: int, capacity: int, dtype: torch.dtype = torch.float32, *,
             d_model: int = 6, d_mlp: int = 8) -> MoECase:
    """A seeded case: weights on a grid of 1/16 (exact in float32), the router scaled so its probabilities spread."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return ((torch.randn(*shape, generator=g, dtype=torch.float64) * scale * 16).round() / 16).to(dtype)

    return MoECase(x=draw(tokens, d_model), router_weight=draw(n_experts, d_model, scale=0.8),
                   W_in=draw(n_experts, d_model, d_mlp, scale=0.5), b_in=draw(n_experts, d_mlp, scale=0.2),
                   W_out=draw(n_experts, d_mlp, d_model, scale=0.5), b_out=draw(n_experts, d_model, scale=0.2),
                   k=k, capacity=capacity, upstream=torch.randn(tokens, d_model, generator=g, dtype=torch.float64))


# The known mistakes, in the order they are tried. (At k = 1, renormalising after dropping makes every gate 1, the
# same output as leaving the gates out: HINT_MF_NO_GATES names both.)
MF_MISTAKES = ("no capacity", "capacity + 1", "capacity - 1", "one counter", "token order", "gate priority",
               "latest first", "dropped is x", "residual", "no gates", "gates twice", "renormalised after dropping",
               "not renormalised", "first choice only")


def moe_variant(x: torch.Tensor, router_weight: torch.Tensor, experts: list, k: int, capacity: int,
                mistake: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(out, kept) of the forward pass in float64, right (differentiable in x and router_weight) or with one mistake.

    The rule of ``tfedu.moe.MoE`` in training mode, written out as a loop over the queue (checked against the layer).
    """
    x = x.double()
    probs = (x @ router_weight.double().T).softmax(dim=-1)  # tokens n_experts
    gates, chosen = probs.topk(k, dim=-1)  # tokens k, largest first
    if k > 1 and mistake != "not renormalised":
        gates = gates / gates.sum(dim=-1, keepdim=True)
    tokens, n_experts = x.shape[0], len(experts)
    choices = 1 if mistake == "first choice only" else k
    if mistake == "token order":
        queue = [(t, j) for t in range(tokens) for j in range(choices)]
    elif mistake == "latest first":
        queue = [(t, j) for j in range(choices) for t in reversed(range(tokens))]
    else:
        queue = [(t, j) for j in range(choices) for t in range(tokens)]
    if mistake == "gate priority":
        queue.sort(key=lambda tj: -float(gates[tj]))
    limit = {"capacity + 1": capacity + 1, "capacity - 1": capacity - 1, "no capacity": tokens * k}.get(mistake, capacity)
    load = [0] * n_experts
    kept = torch.zeros(tokens, k, dtype=torch.bool)
    for t, j in queue:
        e = 0 if mistake == "one counter" else int(chosen[t, j])
        if load[e] < limit:
            kept[t, j] = True
            load[e] += 1
    weights = torch.where(kept, gates, torch.zeros_like(gates))  # tokens k
    if mistake == "no gates":
        weights = kept.double()
    elif mistake == "gates twice":
        weights = weights * weights
    elif mistake == "renormalised after dropping":
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, choice = torch.where((chosen == e) & kept)
        if len(token):
            out = out.index_add(0, token, weights[token, choice, None] * expert(x[token]))
    if mistake == "dropped is x":
        out = torch.where(kept.any(dim=-1, keepdim=True), out, x)
    if mistake == "residual":
        out = out + x
    return out, kept


def reference_moe_forward(x: torch.Tensor, router_weight: torch.Tensor, experts: list, k: int,
                          capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 12.3 done with tfedu.moe's own parts (its gating and its queue, ``sort_assignments``): ``(out, kept)``.

    >>> case = moe_case(0, tokens=6, n_experts=3, k=1, capacity=2)
    >>> out, kept = reference_moe_forward(case.x, case.router_weight, case.experts(), 1, 2)
    >>> tuple(out.shape), tuple(kept.shape), int(kept.sum()) <= 3 * 2
    ((6, 6), (6, 1), True)
    """
    tokens = x.shape[0]
    gates, chosen = reference_top_k_gating(x @ router_weight.T, k)  # tokens k
    queue = _moe.sort_assignments(chosen, len(experts))
    keep = queue.rank < capacity
    kept = torch.zeros(k * tokens, dtype=torch.bool, device=x.device)
    kept[queue.choice[keep] * tokens + queue.token[keep]] = True
    kept = kept.view(k, tokens).T  # tokens k
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, choice = torch.where((chosen == e) & kept)
        if len(token):
            out = out.index_add(0, token, gates[token, choice, None].to(x.dtype) * expert(x[token]))
    return out, kept


def layer_output(case: MoECase) -> torch.Tensor:
    """``tfedu.moe.MoE``'s own output on ``case`` (training mode, float64, the sorted dispatch): the guard."""
    n_experts, d_model, d_mlp = case.W_in.shape
    tokens = case.x.shape[0]
    factor = (case.capacity * n_experts - 0.5) / (case.k * tokens)  # ceil(factor * k * tokens / E) = capacity
    with torch.random.fork_rng(devices=[]):
        layer = _moe.MoE(d_model, d_mlp, n_experts, top_k=case.k, capacity_factor=factor).double().train()
    with torch.no_grad():
        for name in ("W_in", "b_in", "W_out", "b_out"):
            getattr(layer, name).copy_(getattr(case, name))
        layer.router.weight.copy_(case.router_weight)
        assert layer.capacity(tokens) == case.capacity
        return layer(case.x.double())


def _mf_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, float(b.detach().abs().max())) if b.numel() else 1.0
    return is_close(a, b, rtol=1e-4, atol=1e-5 * scale)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    t, j = (a != b).nonzero()[0].tolist()
    return t, j


def _mistake_hint(mistake: str, case: MoECase, wrong_kept: torch.Tensor, kept: torch.Tensor, chosen: torch.Tensor,
                  what: str) -> str:
    """The hint of one mistake, pointing at the expert or the assignment that shows it in this case."""
    per_expert = [int(((chosen == e) & kept).sum()) for e in range(len(case.W_in))]
    wrong_per_expert = [int(((chosen == e) & wrong_kept).sum()) for e in range(len(case.W_in))]
    sent = [int((chosen == e).sum()) for e in range(len(case.W_in))]
    fill = {"what": what, "capacity": case.capacity, "k": case.k}
    if mistake == "no capacity":
        e = max(range(len(sent)), key=lambda i: sent[i])
        return HINT_MF_NO_CAPACITY.format(e=e, sent=sent[e], **fill)
    if mistake in ("capacity + 1", "capacity - 1"):
        e = next(i for i in range(len(sent)) if wrong_per_expert[i] != per_expert[i])
        hint = HINT_MF_PLUS_ONE if mistake == "capacity + 1" else HINT_MF_MINUS_ONE
        return hint.format(e=e, got=wrong_per_expert[e], **fill)
    if mistake == "one counter":
        return HINT_MF_ONE_COUNTER.format(**fill)
    if mistake in ("token order", "gate priority", "latest first") and not torch.equal(wrong_kept, kept):
        t, j = _first_difference(wrong_kept, kept)
        fate = "ran where it should have been dropped" if wrong_kept[t, j] else "was dropped where it should have run"
        hint = {"token order": HINT_MF_TOKEN_ORDER, "gate priority": HINT_MF_GATE_PRIORITY,
                "latest first": HINT_MF_LATEST}[mistake]
        return hint.format(t=t, j=j, e=int(chosen[t, j]), fate=fate, **fill)
    if mistake == "dropped is x":
        return HINT_MF_DROPPED_IS_X.format(t=int((~kept.any(dim=-1)).nonzero()[0]), **fill)
    if mistake == "renormalised after dropping":
        partly = (kept.any(dim=-1) & ~kept.all(dim=-1)).nonzero()
        return HINT_MF_RENORMALISED_AFTER.format(t=int(partly[0]) if len(partly) else 0, **fill)
    return {"residual": HINT_MF_RESIDUAL, "no gates": HINT_MF_NO_GATES, "gates twice": HINT_MF_GATES_TWICE,
            "not renormalised": HINT_MF_NOT_RENORMALISED, "first choice only": HINT_MF_FIRST_ONLY,
            "token order": HINT_MF_TOKEN_ORDER, "gate priority": HINT_MF_GATE_PRIORITY,
            "latest first": HINT_MF_LATEST}[mistake].format(t=0, j=0, e=0, fate="", **fill)


def mf_mistakes(case: MoECase) -> list[tuple[str, str, tuple[torch.Tensor, torch.Tensor]]]:
    """(name, hint, (out, kept)) of each known mistake on ``case`` whose output differs from the reference's, in order."""
    want_out, want_kept = moe_variant(case.x, case.router_weight, case.experts(), case.k, case.capacity)
    chosen = (case.x.double() @ case.router_weight.double().T).topk(case.k, dim=-1).indices
    found = []
    for mistake in MF_MISTAKES:
        out, kept = moe_variant(case.x, case.router_weight, case.experts(), case.k, case.capacity, mistake)
        if not _mf_close(out.detach(), want_out.detach()):
            found.append((mistake, _mistake_hint(mistake, case, kept, want_kept, chosen, case.text), (out.detach(), kept)))
    return found


def _mf_pair(got: Any) -> tuple[torch.Tensor, torch.Tensor]:
    _not_none(got, "moe_forward")
    if isinstance(got, torch.Tensor) or not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise CheckFailure(HINT_MF_PAIR.format(got=describe(got) if not isinstance(got, (tuple, list))
                                               else f"a {type(got).__name__} of {len(got)}"))
    if not all(isinstance(t, torch.Tensor) for t in got):
        raise CheckFailure(HINT_MF_NOT_TENSORS.format(got=", ".join(describe(t) for t in got)))
    return tuple(t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t for t in got)


def _describe_assignments(case: MoECase, t: int, kept: torch.Tensor) -> str:
    probs = (case.x.double() @ case.router_weight.double().T).softmax(dim=-1)
    gates, chosen = probs.topk(case.k, dim=-1)
    if case.k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return ", ".join(f"expert {int(chosen[t, j])} with gate {float(gates[t, j]):.4f} "
                     f"({'kept' if kept[t, j] else 'dropped'})" for j in range(case.k))


def diagnose_moe_forward(got: Any, rows: list[int] | None, grads: Any, case: MoECase, *, what: str) -> None:
    """Raise CheckFailure naming what is wrong with ``got``, the learner's ``(out, kept)`` for ``case``; shared with the
    probe. ``rows`` counts the rows each expert ran on; ``grads`` is :func:`forward_grads` of the answer."""
    out, kept = _mf_pair(got)
    tokens, d_model = case.x.shape
    want_out, want_kept = moe_variant(case.x, case.router_weight, case.experts(), case.k, case.capacity)
    want_out = want_out.detach()
    if tuple(out.shape) != (tokens, d_model):
        if tuple(out.shape) == (tokens, case.k, d_model):
            raise CheckFailure(HINT_MF_PER_ASSIGNMENT.format(got=tuple(out.shape)))
        raise CheckFailure(HINT_MF_OUT_SHAPE.format(what=what, got=tuple(out.shape), want=(tokens, d_model)))
    expect(out.is_floating_point(), HINT_MF_DTYPE.format(got=out.dtype, want=case.x.dtype))
    value = out.detach().double().cpu()
    expect(bool(torch.isfinite(value).all()), HINT_MF_NAN.format(what=what))
    if not _mf_close(value, want_out):
        for _, hint, (wrong, _) in mf_mistakes(case):
            if _mf_close(value, wrong):
                raise CheckFailure(hint)
        diff = (value - want_out).abs()
        t = int(diff.amax(dim=-1).argmax())
        raise CheckFailure(HINT_MF_DIFFERS.format(what=what, t=t, diff=float(diff.max()),
                                                  assignments=_describe_assignments(case, t, want_kept)))
    if tuple(kept.shape) != (tokens, case.k):
        raise CheckFailure(HINT_MF_KEPT_SHAPE.format(got=tuple(kept.shape), want=(tokens, case.k)))
    if kept.dtype != torch.bool:
        if kept.is_floating_point() or kept.is_complex() or not bool(((kept == 0) | (kept == 1)).all()):
            raise CheckFailure(HINT_MF_KEPT_DTYPE.format(dtype=kept.dtype))
        kept = kept != 0
    kept = kept.cpu()
    if not torch.equal(kept, want_kept):
        if torch.equal(kept, ~want_kept):
            raise CheckFailure(HINT_MF_KEPT_INVERTED)
        t, j = _first_difference(kept, want_kept)
        raise CheckFailure(HINT_MF_KEPT_DIFFERS.format(t=t, j=j, got=bool(kept[t, j]), want=bool(want_kept[t, j]),
                                                       what=what))
    for e, n in enumerate(rows or []):
        if n > case.capacity:
            raise CheckFailure(HINT_MF_ROWS.format(e=e, rows=n, capacity=case.capacity, what=what))
    _judge_forward_grads(grads, case)
    expect(out.dtype == case.x.dtype, HINT_MF_DTYPE.format(got=out.dtype, want=case.x.dtype))


def expected_forward_grads(case: MoECase) -> list[torch.Tensor]:
    """The gradients :func:`forward_grads` should find, float64: on x and on router_weight."""
    x = case.x.detach().double().requires_grad_()
    w = case.router_weight.detach().double().requires_grad_()
    out, _ = moe_variant(x, w, case.experts(), case.k, case.capacity)
    return list(torch.autograd.grad((out * case.upstream).sum(), [x, w]))


def _judge_forward_grads(grads: Any, case: MoECase) -> None:
    if isinstance(grads, str):
        if grads.startswith("failed"):
            raise CheckFailure(HINT_MF_GRAD_FAILED.format(err=grads.removeprefix("failed: ")))
        raise CheckFailure(HINT_MF_NO_GRAD.format(why=" (it does not require grad)" if grads == "missing" else ""))
    router = grads[1] if isinstance(grads, (list, tuple)) and len(grads) == 2 else "none"
    if isinstance(router, str):  # first: a gate cut from the graph also leaves x's gradient wrong
        raise CheckFailure(HINT_MF_ROUTER_GRAD.format(why=" (it does not depend on it through autograd)"))
    if not bool(np.any(np.asarray(router, dtype=np.float64) != 0)):
        raise CheckFailure(HINT_MF_ROUTER_GRAD.format(why=" (its gradient is zero everywhere)"))
    for name, got, want in zip(("router_weight", "x"), grads[::-1], expected_forward_grads(case)[::-1]):
        if isinstance(got, str):
            raise CheckFailure(HINT_MF_GRAD_DIFFERS.format(name=name, diff=float("inf")))
        got = torch.as_tensor(np.asarray(got, dtype=np.float64))
        if got.shape != want.shape or not torch.isfinite(got).all():
            raise CheckFailure(HINT_MF_GRAD_DIFFERS.format(name=name, diff=float("inf")))
        scale = max(1.0, float(want.abs().max()))
        if not torch.allclose(got, want, rtol=1e-3, atol=1e-4 * scale):
            raise CheckFailure(HINT_MF_GRAD_DIFFERS.format(name=name, diff=float((got - want).abs().max())))


# (seed, tokens, n_experts, k, capacity, dtype): k = 1 with experts over capacity, then k = 2 (second choices
# competing with first ones), k = 3 in float64, then a capacity no expert reaches. Chosen so that every mistake
# gives its own output on the first case where it shows (tests/test_checks_nb12.py checks it).
MF_CASES = (
    (0, 12, 4, 1, 3, torch.float32), (2, 10, 4, 2, 4, torch.float32), (0, 8, 4, 3, 5, torch.float64),
    (0, 7, 3, 2, 14, torch.float32),
)


def _check_mf_call(fn: Any, case: MoECase) -> None:
    x, w = case.x.clone().requires_grad_(), case.router_weight.clone().requires_grad_()
    rows = [0] * len(case.W_in)
    with watch_calls((_moe, "top_k_gating"), (_moe, "sort_assignments"), (_moe, "expert_capacity")) as called:
        got = call_on_copies(fn, {"x": x, "router_weight": w, "experts": case.experts(rows), "k": case.k,
                                  "capacity": case.capacity}, name="moe_forward", mutated_hint=HINT_MF_MUTATED,
                             error_hint=HINT_MF_CALL)
    expect(not called, HINT_SHORTCUT.format(function="moe_forward", name=", ".join(sorted(set(called))),
                                            what="the layer's forward pass", how=MF_HOW))
    diagnose_moe_forward(got, rows, forward_grads(got, x, w, case.upstream), case, what=case.text)


@checker("the MoE layer's forward pass")
def check_moe_forward(moe_forward) -> None:
    """Check a learner's ``moe_forward(x, router_weight, experts, k, capacity) -> (out, kept)``.

    On :data:`MF_CASES`, against :func:`moe_variant` (itself checked against ``tfedu.moe.MoE`` in training mode):
    the output, which assignments ran, the rows each expert ran on (at most its capacity) and the gradients on x and
    router_weight of a random weighting of the output; the known mistakes (:data:`MF_MISTAKES`) are named. While it
    runs, a correct top_k_gating stands in for the learner's (exercise 12.1): a slip there costs only 12.1.
    tfedu.moe is refused.
    """
    _refuse_moe(moe_forward, "moe_forward", "the layer's forward pass", MF_HOW)
    namespace = getattr(moe_forward, "__globals__", None)
    standins = {"top_k_gating": standin_top_k_gating} if isinstance(namespace, dict) else {}
    with names_bound(namespace if standins else {}, standins):
        for seed, tokens, n_experts, k, capacity, dtype in MF_CASES:
            case = moe_case(seed, tokens, n_experts, k, capacity, dtype)
            _check_mf_call(moe_forward, case)
            want, _ = moe_variant(case.x, case.router_weight, case.experts(), k, capacity)
            assert is_close(want, layer_output(case), rtol=1e-5, atol=1e-6), "the checker disagrees with tfedu.moe.MoE"


# ----------------------------------------------------------------------------- probes

# top_k_gating: fresh token counts, 4-8 experts, k from 1 to 3, float32 and float64, logits at least 0.25 apart (no
# ties) on a grid exact in float32, one case at 1000 to 3000 from 0 (either sign: exp overflows or underflows there
# in float64 too, so a softmax without the max shift gives NaN); the gradient of a random weighting of the gates.
GATING_PROBE_RUN = HELPERS + MOE_HELPERS + """\
_leaves = [torch.tensor(_c['logits'], requires_grad=True) for _c in inputs['cases']]
_results = [_call(top_k_gating, _l, _c['k']) for _l, _c in zip(_leaves, inputs['cases'])]
_ok = lambda _r: isinstance(_r, (tuple, list)) and len(_r) == 2 and all(isinstance(_t, torch.Tensor) for _t in _r)
outputs = {'returned': ['a pair' if _ok(_r) else _kind(_r) for _r in _results], 'mutated': _MUTATED,
           'results': [[_export(_t) for _t in _r] if _ok(_r) else None for _r in _results],
           'grads': [_gate_grad(_r, _l, torch.from_numpy(_c['weights'])) for _r, _l, _c in zip(_results, _leaves,
                                                                                             inputs['cases'])]}
del _leaves, _results, _ok
""" + MOE_CLEANUP + CLEANUP


def _distinct_logits(rng: np.random.Generator, tokens: int, n_experts: int, offset: float) -> np.ndarray:
    values = np.cumsum(0.25 + 0.5 * rng.random((tokens, n_experts)), axis=-1)
    values = values - values.mean(axis=-1, keepdims=True)
    order = np.argsort(rng.random((tokens, n_experts)), axis=-1)
    return offset + np.round(np.take_along_axis(values, order, axis=-1) * 8) / 8


def _gating_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    far = float(rng.choice([-1, 1]) * rng.integers(1000, 3000))
    for k, offset in ((1, 0.0), (2, 0.0), (3, 0.0), (int(rng.integers(1, 3)), far)):
        n_experts = int(rng.choice([4, 6, 8]))
        tokens = int(rng.integers(4, 12))  # more than k: a pick along the tokens axis runs, and shows by its shape
        dtype = np.float64 if rng.random() < 0.5 else np.float32
        cases.append({"logits": _distinct_logits(rng, tokens, n_experts, offset).astype(dtype), "k": k,
                      "offset": offset, "weights": rng.standard_normal((tokens, n_experts))})
    return {"cases": cases}


def _gating_probe_reference(inputs: dict) -> dict:
    return {"returned": ["a pair"] * len(inputs["cases"]), "cases": inputs["cases"]}


def _compare_gating(outputs: dict, expected: dict) -> str | None:
    kinds = {k: HINT_GATING_CALL for k in ("tensor", "float", "NoneType")}
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="top_k_gating", kind_hints=kinds)
    if problem:
        return problem
    results, grads = outputs.get("results"), outputs.get("grads")
    cases = expected["cases"]
    if not (isinstance(results, list) and isinstance(grads, list) and len(results) == len(grads) == len(cases)):
        return "top_k_gating's hidden test did not run every case"
    for i, (got, grad, case) in enumerate(zip(results, grads, cases)):
        logits = torch.from_numpy(np.asarray(case["logits"]))
        try:
            diagnose_gating([restore(t) for t in got], logits, case["k"], torch.from_numpy(np.asarray(case["weights"])),
                            grad, what=f"hidden test {i + 1}: {_case_text(logits, case['k'])}", offset=case["offset"])
        except CheckFailure as failure:
            return str(failure)
    return None


# balance_loss: fresh routers (top-1 to top-3 of a softmax, float32 and float64) and a balanced one; the gradient.
BALANCE_PROBE_RUN = HELPERS + MOE_HELPERS + """\
_leaves = [torch.tensor(_c['probs'], requires_grad=True) for _c in inputs['cases']]
_results = [_call(balance_loss, _l, torch.from_numpy(_c['experts'])) for _l, _c in zip(_leaves, inputs['cases'])]
outputs = {'returned': [_kind(_r) for _r in _results], 'mutated': _MUTATED,
           'losses': [_export(_r) if isinstance(_r, torch.Tensor) else float(_r) if isinstance(_r, (int, float)) else None
                      for _r in _results],
           'grads': [_loss_grad(_r, _l) for _r, _l in zip(_results, _leaves)]}
del _leaves, _results
""" + MOE_CLEANUP + CLEANUP


def _balance_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for k in (1, 2, 3, int(rng.integers(2, 4))):
        n_experts = int(rng.choice([4, 6, 8]))
        tokens = int(rng.integers(6, 20))
        logits = _distinct_logits(rng, tokens, n_experts, 0.0)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        experts = np.argsort(-probs, axis=-1)[:, :k].astype(np.int64)
        dtype = np.float64 if rng.random() < 0.5 else np.float32
        cases.append({"probs": probs.astype(dtype), "experts": experts})
    n_experts, k = int(rng.choice([4, 8])), int(rng.integers(1, 4))
    probs, experts = balanced(n_experts * int(rng.integers(1, 4)), n_experts, k, torch.float64)
    cases.append({"probs": probs.numpy(), "experts": experts.numpy()})
    return {"cases": cases}


def _balance_probe_reference(inputs: dict) -> dict:
    return {"returned": ["tensor"] * len(inputs["cases"]), "cases": inputs["cases"]}


def _compare_balance(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": expected["returned"]}, function="balance_loss",
                              kind_hints={"float": "a Python float carries no gradient back to the router (.item() or "
                                                   "float() cuts it off): return the 0-d tensor"})
    if problem:
        return problem
    losses, grads = outputs.get("losses"), outputs.get("grads")
    cases = expected["cases"]
    if not (isinstance(losses, list) and isinstance(grads, list) and len(losses) == len(grads) == len(cases)):
        return "balance_loss's hidden test did not run every case"
    for i, (got, grad, case) in enumerate(zip(losses, grads, cases)):
        probs, experts = torch.from_numpy(np.asarray(case["probs"])), torch.from_numpy(np.asarray(case["experts"]))
        what = (f"hidden test {i + 1}: router_probs of shape {tuple(probs.shape)}, experts of shape "
                f"{tuple(experts.shape)}")
        try:
            diagnose_balance(restore(got), probs, experts, grad, what=what)
        except CheckFailure as failure:
            return str(failure)
    return None


# moe_forward: fresh tokens, routers and experts (k = 1, 2, 3, float32 and float64), capacities that drop, drawn again
# until every known mistake shows apart; the rows each expert ran on and the gradients on x and router_weight. A
# correct top_k_gating stands in for the learner's while it runs, as in the check (a slip in 12.1 costs only 12.1).
MF_PROBE_RUN = HELPERS + MOE_HELPERS + MF_HELPERS + """\
_results, _rows, _grads, _errors = [], [], [], []
if True:  # the grader binds the right top_k_gating in the notebook's globals meanwhile (MF_STANDINS)
    for _c in inputs['cases']:
        _x, _w = torch.tensor(_c['x'], requires_grad=True), torch.tensor(_c['router_weight'], requires_grad=True)
        _r = [0] * len(_c['W_in'])
        _experts = _mf_experts(*(torch.from_numpy(_c[_n]) for _n in ('W_in', 'b_in', 'W_out', 'b_out')), _r)
        try:
            _res = _call(moe_forward, _x, _w, _experts, _c['k'], _c['capacity'])
            _errors.append(None)
        except Exception as _e:
            _res = None
            _errors.append(type(_e).__name__ + ': ' + str(_e)[:200])
        _ok = isinstance(_res, (tuple, list)) and len(_res) == 2 and all(isinstance(_t, torch.Tensor) for _t in _res)
        _results.append([_export(_t) for _t in _res] if _ok else None)
        _rows.append(list(_r))
        _grads.append(_mf_grads(_res, _x, _w, torch.from_numpy(_c['upstream'])))
        if _res is not None and not _ok:
            _errors[-1] = 'returned ' + _kind(_res)
outputs = {'results': _results, 'rows': _rows, 'grads': _grads, 'errors': _errors, 'mutated': _MUTATED}
del _results, _rows, _grads, _errors
""" + MF_CLEANUP + MOE_CLEANUP + CLEANUP


def _mf_case_from(c: dict) -> MoECase:
    return MoECase(**{name: torch.from_numpy(np.asarray(c[name])) for name in
                      ("x", "router_weight", "W_in", "b_in", "W_out", "b_out", "upstream")},
                   k=int(c["k"]), capacity=int(c["capacity"]))


def _clear_routing(case: MoECase) -> bool:
    """No two of a token's router probabilities closer than 1e-3 (float32 and float64 answers pick the same experts)."""
    probs = (case.x.double() @ case.router_weight.double().T).softmax(dim=-1)
    return bool((probs.sort(dim=-1).values.diff(dim=-1) > 1e-3).all())


def mistakes_apart(cases: list[MoECase]) -> bool:
    """True when every known mistake is named by its own hint: on the first case where it changes the output, no
    mistake tried before it gives the same output (at k = 1 renormalising after dropping is leaving the gates out)."""
    named: set[str] = set()
    for case in cases:
        found = mf_mistakes(case)
        for i, (name, _, (out, _)) in enumerate(found):
            if name in named:
                continue
            named.add(name)
            same = [earlier for earlier, _, (wrong, _) in found[:i] if _mf_close(out, wrong)]
            if same and not (case.k == 1 and name == "renormalised after dropping" and same == ["no gates"]):
                return False
    return named == set(MF_MISTAKES)


def _mf_probe_inputs(rng: np.random.Generator) -> dict:
    for _ in range(50):
        cases = []
        for k, dtype in ((1, np.float32), (2, np.float32), (int(rng.integers(2, 4)), np.float64)):
            n_experts = int(rng.integers(max(3, k + 1), 6))
            tokens = int(rng.integers(8, 14))
            capacity = max(1, int(np.ceil(float(rng.choice([0.75, 1.0])) * k * tokens / n_experts)))
            case = moe_case(int(rng.integers(0, 2**31)), tokens, n_experts, k, capacity, torch.float64,
                            d_model=int(rng.integers(4, 7)), d_mlp=int(rng.integers(5, 9)))
            cases.append({name: getattr(case, name).numpy().astype(np.float64 if name == "upstream" else dtype)
                          for name in ("x", "router_weight", "W_in", "b_in", "W_out", "b_out", "upstream")}
                         | {"k": k, "capacity": capacity})
        drawn = [_mf_case_from(c) for c in cases]
        if all(_clear_routing(c) for c in drawn) and mistakes_apart(drawn):
            return {"cases": cases}
    raise RuntimeError("no moe_forward inputs that tell every mistake apart in 50 draws")


def _mf_probe_reference(inputs: dict) -> dict:
    return {"cases": inputs["cases"]}


def _compare_mf(outputs: dict, expected: dict) -> str | None:
    problem = compare_outputs(outputs, {"returned": []}, function="moe_forward")
    if problem:
        return problem
    cases = expected["cases"]
    results, rows, grads, errors = (outputs.get(name) for name in ("results", "rows", "grads", "errors"))
    if not all(isinstance(v, list) and len(v) == len(cases) for v in (results, rows, grads, errors)):
        return "moe_forward's hidden test did not run every case"
    for i, (got, n, grad, error, c) in enumerate(zip(results, rows, grads, errors, cases)):
        case = _mf_case_from(c)
        what = f"hidden test {i + 1}: {case.text}"
        if error:
            return (f"moe_forward ({what}) {error}" if error.startswith("returned")
                    else f"moe_forward raised {error} for {what} ({HINT_MF_CALL})")
        try:
            diagnose_moe_forward([restore(t) for t in got], n, grad, case, what=what)
        except CheckFailure as failure:
            return str(failure)
    return None


# Exercise 12.1's top_k_gating, right: the grader binds it in place of the learner's while 12.3's hidden test runs.
MF_STANDINS = """\
def top_k_gating(router_logits, k):
    probs = torch.softmax(router_logits, dim=-1)
    gates, chosen = torch.topk(probs, k, dim=-1)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates, chosen
"""


# ----------------------------------------------------------------------------- 12.4 isoflop_fit

HINT_ISO_CALL = (
    "isoflop_fit(curves, budgets, tokens_per_step): curves a list of (N, steps, losses), N a number, steps and losses "
    "1-D NumPy arrays of one length; budgets a 1-D array of FLOPs; tokens_per_step an int"
)
HINT_ISO_KIND = (
    "isoflop_fit should return four things, (n_opt, loss_min, a, b): two 1-D arrays with one entry per budget (NaN "
    "where a budget is skipped) and two floats, got {got}"
)
HINT_ISO_LENGTH = (
    "your {name} has {got} entries for {n} budgets: one entry per budget, in the budgets' order, NaN for a budget "
    "that gives no minimum"
)
HINT_ISO_NOT_NUMBER = "your {name} is {got}: a and b are two plain numbers, the slope and the intercept of the line"
HINT_ISO_NO_RAISE = (
    "for {what}, fewer than two budgets give a minimum, so there is no line to fit: isoflop_fit should raise a "
    "ValueError there, got {got}"
)
HINT_ISO_RAISED = "isoflop_fit raised {err} for {what}, where the reference finds minima at {count} budgets"
HINT_ISO_2ND = (
    "your n_opt is the reference's for compute C = 2ND, the forward pass alone: training also runs the backward "
    "pass, twice the forward's work, so a model of N parameters that reads D tokens costs 6ND (for {what})"
)
HINT_ISO_STEPS = (
    "your answer is what one gets by reading D, a number of tokens, against the step counts themselves: each step "
    "reads tokens_per_step tokens (batch times sequence length), so a curve's point at step s has seen s times "
    "tokens_per_step tokens (for {what})"
)
HINT_ISO_LINEAR_N = (
    "your n_opt is the vertex of a parabola fitted to loss against N itself: the IsoFLOP profiles are parabolas in "
    "log N (the sizes are spaced by factors), so fit the loss against the natural log of N and take exp of the "
    "vertex (for {what})"
)
HINT_ISO_ARGMIN = (
    "your n_opt and loss_min are the size and loss of the best sampled model at each budget: the minimum lies "
    "between the sampled sizes, at the vertex of the parabola fitted through them, and loss_min is the parabola's "
    "value there (for {what})"
)
HINT_ISO_NO_SKIP = (
    "your answer uses models whose curve does not reach the D a budget asks of them (more tokens than its last "
    "point, or fewer than its first): np.interp then returns the curve's end value, which is no measurement. Skip "
    "such a model at that budget (for {what})"
)
HINT_ISO_FEWER = (
    "your n_opt has a value for budget {i} (C = {C:.3g}), where only {count} of the models' curves reach: a parabola "
    "needs three points, so that budget gives no minimum (NaN). Through two points np.polyfit of degree 2 only "
    "warns (a RankWarning) and returns one of the many parabolas that pass through them, whose vertex means "
    "nothing (for {what})"
)
HINT_ISO_DOWNWARD = (
    "your n_opt has a value for budget {i} (C = {C:.3g}), where the parabola through the points opens downward: its "
    "vertex is a maximum, not a minimum, so that budget gives no minimum (NaN) (for {what})"
)
HINT_ISO_SKIPPED = (
    "your n_opt is NaN at budget {i} (C = {C:.3g}), where {count} models' curves reach D = C / 6N and the parabola "
    "through them opens upward: read each model's loss where its curve covers D, first and last points included "
    "(for {what})"
)
HINT_ISO_IN_RANGE = (
    "your n_opt is NaN at budget {i} (C = {C:.3g}), where the parabola opens upward and its vertex, N_opt = {want:.4g}, "
    "lies outside the sizes that reach that budget ({lo:,.0f} to {hi:,.0f} parameters): the brief does not drop "
    "such a vertex. A minimum a little beyond the sampled sizes, extrapolated by the parabola, is kept; only a "
    "budget with fewer than three models, or whose parabola opens downward, gets NaN (for {what})"
)
HINT_ISO_N_DIFFERS = (
    "your n_opt at budget {i} (C = {C:.3g}) is {got:.6g}, expected {want:.6g}: read each reaching model's loss at "
    "D = C / 6N tokens, linearly between the curve's points (as np.interp does), fit a parabola to loss against "
    "ln N by least squares, and take its vertex (for {what})"
)
HINT_ISO_L_DIFFERS = (
    "your loss_min at budget {i} (C = {C:.3g}) is {got:.6g}, expected {want:.6g}: it is the fitted parabola's value "
    "at its vertex (for {what})"
)
HINT_ISO_INVERTED = (
    "your a is {got:.4g}, the slope of ln C against ln N_opt (about 1 / a): the law is N_opt = e^b C^a, so fit "
    "ln N_opt as the y and ln C as the x (for {what})"
)
HINT_ISO_MIXED_LOGS = (
    "your a is {got:.4g}, expected {want:.4g}, off by a factor of {factor:.4g} (ln 10 = 2.303): one axis in log10, "
    "the other in the natural log. Take the same log of both; the brief asks the natural log (for {what})"
)
HINT_ISO_B_LOG10 = (
    "your a is right but b is {got:.4g}, expected {want:.4g}, off by a factor ln 10: b is the intercept of ln N_opt "
    "against ln C, with natural logs on both axes (for {what})"
)
HINT_ISO_A_DIFFERS = (
    "your a is {got:.6g}, expected {want:.6g}: fit ln N_opt = a ln C + b by least squares over the budgets that gave "
    "a minimum (NaN budgets left out) (for {what})"
)
HINT_ISO_B_DIFFERS = "your b is {got:.6g}, expected {want:.6g}: the intercept of that same least-squares line (for {what})"
ISO_BUILDS = frozenset({"numpy.interp", "numpy.polyfit", "numpy.polyval", "numpy.linalg.lstsq", "numpy.linalg.solve",
                        "numpy.linalg.inv", "numpy.linalg.pinv", "numpy.vander", "numpy.column_stack",
                        "numpy.polynomial.polynomial.polyfit", "numpy.polynomial.Polynomial",
                        "numpy.polynomial.Polynomial.fit", "numpy.full", "numpy.nan", "numpy.isnan", "numpy.errstate"})
ISO_FORBIDDEN = ("tfedu.experiments.scaling", "tfedu.checks")
ISO_REFERENCES = ("tfedu.checks.nb12_moe_and_scaling", "tfedu.experiments.scaling")
HINT_ISO_SHORTCUT = (
    "your isoflop_fit uses the course's own {name}: the fit is the exercise itself, so build it from NumPy ({how})"
)
ISO_HOW = "np.interp for the reading, np.polyfit (or a least-squares solve) for the parabolas and the line"

# The mistakes the variant reproduces: n_opt-changing ones first (tried on the whole answer), then those of a and b.
ISO_MISTAKES = ("2ND", "steps", "parabola in N", "argmin", "no skip", "inverted", "log10 C", "log10 N", "log10 b")


def _refuse_iso(fn: Any) -> None:
    """Fail when ``fn`` is the reference (or tfedu.experiments.scaling's) or its code calls it."""
    if from_modules(fn, ISO_REFERENCES):
        raise CheckFailure(HINT_ISO_SHORTCUT.format(name=getattr(fn, "__name__", "function"), how=ISO_HOW))
    used = globals_from_modules(fn, ISO_REFERENCES)
    expect(not used, HINT_ISO_SHORTCUT.format(name=", ".join(used), how=ISO_HOW))


def iso_slice(curves: list, C: float, tokens_per_step: float, *, flops: float = 6.0,
              everyone: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Budget ``C``'s IsoFLOP slice: the sizes N of the models whose curve covers D = C / (flops N) tokens (first and
    last points included; every model when ``everyone``) and their losses at D, read linearly between the points."""
    sizes, losses = [], []
    for N, steps, curve in curves:
        tokens = np.asarray(steps, dtype=float) * float(tokens_per_step)
        D = C / (flops * float(N))
        if everyone or tokens[0] <= D <= tokens[-1]:
            sizes.append(float(N))
            losses.append(float(np.interp(D, tokens, np.asarray(curve, dtype=float))))
    return np.array(sizes), np.array(losses)


def iso_parabola(x: np.ndarray, losses: np.ndarray) -> np.ndarray | None:
    """The least-squares parabola (c2, c1, c0) of ``losses`` against ``x``; None for fewer than three points."""
    if len(x) < 3:
        return None
    return np.polyfit(x, losses, 2)


def iso_line(budgets: np.ndarray, n_opt: np.ndarray) -> tuple[float, float]:
    """(a, b) of the least-squares line ln n_opt = a ln C + b over the budgets with a minimum (NaN left out)."""
    found = np.isfinite(n_opt) & (n_opt > 0)
    if found.sum() < 2:
        raise ValueError(f"only {int(found.sum())} budget(s) give a minimum: a line needs two")
    a, b = np.polyfit(np.log(budgets[found]), np.log(n_opt[found]), 1)
    return float(a), float(b)


def isoflop_slices(curves: list, budgets: Any, tokens_per_step: int) -> list[tuple]:
    """For the notebook's plot: per budget, the slice's (sizes, losses) and its parabola in ln N, (c2, c1, c0), or
    None when fewer than three models reach the budget. The same code as :func:`reference_isoflop_fit`'s."""
    out = []
    for C in np.asarray(budgets, dtype=float):
        sizes, losses = iso_slice(curves, C, tokens_per_step)
        out.append((sizes, losses, iso_parabola(np.log(sizes), losses)))
    return out


def isoflop_variant(curves: list, budgets: Any, tokens_per_step: int, mistake: str = "") -> tuple:
    """Exercise 12.4 done right (``mistake=""``) or with one named ``mistake`` (:data:`ISO_MISTAKES`, or "two kept":
    budgets of two models fitted too, "in range": NaN where the vertex lies outside the slice's sizes).

    For each budget C, each model (N, steps, losses) whose tokens (steps x tokens_per_step) cover D = C / 6N gives the
    loss at D, linearly interpolated; a budget with three such models or more gets a least-squares parabola in ln N,
    and, if it opens upward, its vertex (n_opt, loss_min); otherwise NaN. Then ln n_opt = a ln C + b by least squares
    over the budgets with a minimum; fewer than two raise ValueError.
    """
    budgets = np.asarray(budgets, dtype=float)
    flops = 2.0 if mistake == "2ND" else 6.0
    per_step = 1.0 if mistake == "steps" else float(tokens_per_step)
    n_opt, loss_min = np.full(len(budgets), np.nan), np.full(len(budgets), np.nan)
    for i, C in enumerate(budgets):
        sizes, losses = iso_slice(curves, C, per_step, flops=flops, everyone=mistake == "no skip")
        x = sizes if mistake == "parabola in N" else np.log(sizes)
        if mistake == "two kept" and len(x) == 2:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # np.polyfit's RankWarning: two points, three coefficients
                fit = np.polyfit(x, losses, 2)
        else:
            fit = iso_parabola(x, losses)
        if fit is None:
            continue
        c2, c1, c0 = fit
        if not c2 > 0:
            continue
        if mistake == "argmin":
            best = int(np.argmin(losses))
            n_opt[i], loss_min[i] = sizes[best], losses[best]
            continue
        vertex = -c1 / (2 * c2)
        if mistake == "in range" and not x.min() <= vertex <= x.max():
            continue
        n_opt[i] = vertex if mistake == "parabola in N" else np.exp(vertex)
        loss_min[i] = c0 - c1**2 / (4 * c2)
    if mistake not in ("inverted", "log10 C", "log10 N", "log10 b"):
        return (n_opt, loss_min, *iso_line(budgets, n_opt))
    found = np.isfinite(n_opt) & (n_opt > 0)
    if found.sum() < 2:
        raise ValueError(f"only {int(found.sum())} budget(s) give a minimum: a line needs two")
    log_c = np.log10(budgets[found]) if mistake == "log10 C" else np.log(budgets[found])
    log_n = np.log10(n_opt[found]) if mistake in ("log10 N", "log10 b") else np.log(n_opt[found])
    if mistake == "log10 b":
        log_c = np.log10(budgets[found])
    if mistake == "inverted":
        a, b = np.polyfit(log_n, log_c, 1)
    else:
        a, b = np.polyfit(log_c, log_n, 1)
    return n_opt, loss_min, float(a), float(b)


def reference_isoflop_fit(curves: list, budgets: Any, tokens_per_step: int) -> tuple:
    """Exercise 12.4's reference: ``(n_opt, loss_min, a, b)``, see :func:`isoflop_variant`."""
    return isoflop_variant(curves, budgets, tokens_per_step)


@dataclass
class IsoCase:
    """One input of exercise 12.4: the curves (N, steps, losses), the budgets, tokens per step, and what they are."""

    sizes: list
    steps: list
    losses: list
    budgets: np.ndarray
    tokens_per_step: int
    text: str

    @property
    def curves(self) -> list:
        return [(n, np.array(s), np.array(l)) for n, s, l in zip(self.sizes, self.steps, self.losses)]

    def counts(self) -> list[int]:
        """How many models' curves reach each budget."""
        return [len(iso_slice(self.curves, C, self.tokens_per_step)[0]) for C in self.budgets]

    def upward(self) -> list[bool | None]:
        """For each budget with three models or more, whether its parabola opens upward (None: fewer than three)."""
        out = []
        for sizes, _, fit in isoflop_slices(self.curves, self.budgets, self.tokens_per_step):
            out.append(None if fit is None else bool(fit[0] > 0))
        return out

    def two_kept(self) -> list[int]:
        """The budgets of exactly two models where fitting a parabola anyway (np.polyfit only warns) gives a finite
        n_opt: the answer that keeps budgets of two models differs there."""
        kept = isoflop_variant(self.curves, self.budgets, self.tokens_per_step, "two kept")[0]
        return [i for i, count in enumerate(self.counts()) if count == 2 and np.isfinite(kept[i])]

    def extrapolated(self) -> list[int]:
        """The budgets whose minimum lies outside the sizes that reach them (the vertex is extrapolated, and kept)."""
        out = []
        for i, (sizes, _, fit) in enumerate(isoflop_slices(self.curves, self.budgets, self.tokens_per_step)):
            if fit is not None and fit[0] > 0:
                vertex = -fit[1] / (2 * fit[0])
                if not math.log(sizes.min()) <= vertex <= math.log(sizes.max()):
                    out.append(i)
        return out


def iso_case(rng: np.random.Generator, *, n_models: int = 6, spike: bool = False, noise: float = 0.004,
             short_first: bool = True, two_top: bool = False, text: str = "") -> IsoCase:
    """Curves from a Chinchilla-like L(N, D) = E + A / N^alpha + B / D^beta plus noise, every model run to the top
    budget (the smallest stopped early when ``short_first``), the lowest budget reached by only two models; with
    ``spike``, one middle model's curve carries a loss spike over part of its run, so some budgets' parabolas open
    downward; with ``two_top``, one budget more above the others, 1.3 times the last, that only the two largest
    models reach (their losses rise with N there, so a parabola forced through the two opens upward)."""
    from tfedu.experiments.scaling import ParametricLoss
    alpha, beta = (float(v) for v in rng.uniform(0.25, 0.45, 2))
    law = ParametricLoss(E=float(rng.uniform(1.5, 2.5)), A=float(rng.uniform(200, 500)),
                         B=float(rng.uniform(200, 2000)), alpha=alpha, beta=beta)
    tokens_per_step = int(rng.choice([256, 512, 1024, 2048]))
    c_lo = 10 ** float(rng.uniform(15, 17))
    c_hi = c_lo * 10 ** float(rng.uniform(1.3, 1.7))
    n_lo, n_hi = float(law.optimal(c_lo)[0]), float(law.optimal(c_hi)[0])
    sizes = [int(round(n)) for n in np.geomspace(n_lo / 3, n_hi * 3, n_models)]
    first = max(1, int(round(c_lo / (6 * tokens_per_step * math.sqrt(sizes[1] * sizes[2])))))  # two reach c_lo
    steps, losses = [], []
    for j, n in enumerate(sizes):
        reach = c_hi * (0.6 if short_first and j == 0 else 1.05)
        if two_top and j >= n_models - 2:
            reach = c_hi * 1.3 * 1.05
        last = int(math.ceil(reach / (6 * n * tokens_per_step)))
        every = max(1, (last - first) // 60)
        s = np.arange(first, last + every, every)
        curve = law.loss(float(n), s * float(tokens_per_step)) + noise * rng.standard_normal(len(s))
        if spike and j == n_models // 2:
            middle = len(s) // 2
            curve[middle - len(s) // 8: middle + len(s) // 8] += 1.0
        steps.append(s.astype(np.int64))
        losses.append(np.asarray(curve, dtype=float))
    budgets = np.geomspace(c_lo, c_hi, int(rng.integers(8, 13)))
    if two_top:
        budgets = np.append(budgets, c_hi * 1.3)
    what = text or (f"{n_models} models from N = {sizes[0]:,} to {sizes[-1]:,}, {len(budgets)} budgets from "
                    f"{budgets[0]:.3g} to {budgets[-1]:.3g} FLOPs, {tokens_per_step} tokens per step"
                    + (", a loss spike in one run" if spike else "")
                    + (", the top budget reached by the two largest models only" if two_top else ""))
    return IsoCase(sizes, steps, losses, budgets, tokens_per_step, what)


def iso_mistakes(case: IsoCase) -> list[tuple[str, Any]]:
    """Each named mistake and what it returns on ``case`` (the string "raises" when it raises ValueError)."""
    found = []
    with np.errstate(all="ignore"):
        for mistake in ISO_MISTAKES:
            try:
                found.append((mistake, isoflop_variant(case.curves, case.budgets, case.tokens_per_step, mistake)))
            except (ValueError, np.linalg.LinAlgError):
                found.append((mistake, "raises"))
    return found


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-6, atol=1e-9, equal_nan=True))


def _same_number(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b))


ISO_N_HINTS = {"2ND": HINT_ISO_2ND, "steps": HINT_ISO_STEPS, "parabola in N": HINT_ISO_LINEAR_N,
               "argmin": HINT_ISO_ARGMIN, "no skip": HINT_ISO_NO_SKIP}


def _as_iso(got: Any, n_budgets: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    if got is None:
        raise ExerciseNotDone(HINT_RETURNED_NONE.format(function="isoflop_fit"))
    if not (isinstance(got, (tuple, list)) and len(got) == 4):
        raise CheckFailure(HINT_ISO_KIND.format(got=describe(got)))
    arrays = []
    for name, value in zip(("n_opt", "loss_min"), got[:2]):
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        try:
            array = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            raise CheckFailure(HINT_ISO_KIND.format(got=describe(got))) from None
        expect(array.ndim == 1 and len(array) == n_budgets,
               HINT_ISO_LENGTH.format(name=name, got=array.size, n=n_budgets))
        arrays.append(array)
    numbers = []
    for name, value in zip(("a", "b"), got[2:]):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise CheckFailure(HINT_ISO_NOT_NUMBER.format(name=name, got=describe(value)))
        numbers.append(float(value))
    return arrays[0], arrays[1], numbers[0], numbers[1]


def diagnose_isoflop(got: Any, case: IsoCase, *, error: str | None = None) -> None:
    """Raise CheckFailure naming what is wrong with the learner's result on ``case`` (``error``: what it raised)."""
    what = case.text
    try:
        want = reference_isoflop_fit(case.curves, case.budgets, case.tokens_per_step)
    except ValueError:
        want = "raises"
    variants = iso_mistakes(case)
    if want == "raises":
        if error is None or not error.startswith("ValueError"):
            raise CheckFailure(HINT_ISO_NO_RAISE.format(what=what, got=error or describe(got)))
        return
    if error is not None:
        for mistake, result in variants:
            if result == "raises" and mistake in ISO_N_HINTS:
                raise CheckFailure(ISO_N_HINTS[mistake].format(what=what))
        count = int(np.isfinite(want[0]).sum())
        raise CheckFailure(HINT_ISO_RAISED.format(err=error, what=what, count=count) + f" ({HINT_ISO_CALL})")
    n_opt, loss_min, a, b = _as_iso(got, len(case.budgets))
    if not (_same_array(n_opt, want[0]) and _same_array(loss_min, want[1])):
        for mistake, result in variants:
            if mistake in ISO_N_HINTS and result != "raises" and _same_array(n_opt, result[0]):
                raise CheckFailure(ISO_N_HINTS[mistake].format(what=what))
        counts, upward = case.counts(), case.upward()
        for i, C in enumerate(case.budgets):
            if np.isfinite(n_opt[i]) and not np.isfinite(want[0][i]):
                if counts[i] < 3:
                    raise CheckFailure(HINT_ISO_FEWER.format(i=i + 1, C=C, count=counts[i], what=what))
                if upward[i] is False:
                    raise CheckFailure(HINT_ISO_DOWNWARD.format(i=i + 1, C=C, what=what))
            if not np.isfinite(n_opt[i]) and np.isfinite(want[0][i]):
                if i in case.extrapolated():
                    sizes = iso_slice(case.curves, C, case.tokens_per_step)[0]
                    raise CheckFailure(HINT_ISO_IN_RANGE.format(i=i + 1, C=C, want=want[0][i], lo=sizes.min(),
                                                                hi=sizes.max(), what=what))
                raise CheckFailure(HINT_ISO_SKIPPED.format(i=i + 1, C=C, count=counts[i], what=what))
        for i, C in enumerate(case.budgets):
            if not _same_number(n_opt[i], want[0][i]):
                raise CheckFailure(HINT_ISO_N_DIFFERS.format(i=i + 1, C=C, got=n_opt[i], want=want[0][i], what=what))
            if not _same_number(loss_min[i], want[1][i]):
                raise CheckFailure(HINT_ISO_L_DIFFERS.format(i=i + 1, C=C, got=loss_min[i], want=want[1][i], what=what))
    if not _same_number(a, want[2]):
        for mistake, result in variants:
            if result == "raises" or not _same_number(a, result[2]):
                continue
            if mistake == "inverted":
                raise CheckFailure(HINT_ISO_INVERTED.format(got=a, what=what))
            if mistake in ("log10 C", "log10 N"):
                raise CheckFailure(HINT_ISO_MIXED_LOGS.format(got=a, want=want[2], factor=a / want[2], what=what))
        raise CheckFailure(HINT_ISO_A_DIFFERS.format(got=a, want=want[2], what=what))
    if not _same_number(b, want[3]):
        if _same_number(b, want[3] / math.log(10)):
            raise CheckFailure(HINT_ISO_B_LOG10.format(got=b, want=want[3], what=what))
        raise CheckFailure(HINT_ISO_B_DIFFERS.format(got=b, want=want[3], what=what))


def iso_cases() -> list[IsoCase]:
    """The check's inputs: two clean sweeps (with a top budget of two models whose forced parabola opens upward, one
    with a vertex outside its slice's sizes), one with a loss spike, and one too short for any line."""
    cases = [iso_case(np.random.default_rng(seed), spike=spike, two_top=two_top)
             for seed, spike, two_top in ((0, False, True), (1, False, True), (4, True, False))]
    short = iso_case(np.random.default_rng(2), n_models=6)
    short.budgets = short.budgets[:1]  # only two models reach the lowest budget: no minimum anywhere
    short.text = "budgets that no three models' curves reach (no minimum anywhere)"
    return cases + [short]


def _check_iso_call(fn: Any, case: IsoCase) -> None:
    curves, budgets = case.curves, case.budgets.copy()
    before = [(s.copy(), l.copy()) for _, s, l in curves]
    try:
        got, error = fn(curves, budgets, case.tokens_per_step), None
    except NotImplementedError:
        raise ExerciseNotDone(NOT_DONE_MESSAGE) from None
    except Exception as err:  # judged below: a ValueError is the answer when no line can be fitted
        got, error = None, f"{type(err).__name__}: {str(err)[:200]}"
    changed = not np.array_equal(budgets, case.budgets) or any(
        not (np.array_equal(s, s0) and np.array_equal(l, l0)) for (_, s, l), (s0, l0) in zip(curves, before))
    expect(not changed, "your isoflop_fit changed its inputs in place: work on copies")
    if got is None and error is None:
        raise ExerciseNotDone(HINT_RETURNED_NONE.format(function="isoflop_fit"))
    diagnose_isoflop(got, case, error=error)


@checker("the compute-optimal fit")
def check_isoflop_fit(isoflop_fit) -> None:
    """Check ``isoflop_fit(curves, budgets, tokens_per_step) -> (n_opt, loss_min, a, b)``.

    On :func:`iso_cases` (curves from a Chinchilla-like law with noise; one with a loss spike so that some budgets'
    parabolas open downward; one where no line can be fitted), against :func:`reference_isoflop_fit`; the known
    mistakes (:data:`ISO_MISTAKES`, budgets of fewer than three models, downward parabolas, an extrapolated vertex
    dropped) are named.
    """
    _refuse_iso(isoflop_fit)
    for case in iso_cases():
        _check_iso_call(isoflop_fit, case)


ISO_PROBE_RUN = HELPERS + """\
_results = []
for _c in inputs['cases']:
    _curves = [(float(_n), np.array(_s), np.array(_l)) for _n, _s, _l in zip(_c['sizes'], _c['steps'], _c['losses'])]
    try:
        _r = isoflop_fit(_curves, np.array(_c['budgets']), int(_c['tokens_per_step']))
        _e = None
    except Exception as _err:
        _r, _e = None, type(_err).__name__ + ': ' + str(_err)[:200]
    if _e is None and isinstance(_r, (tuple, list)) and len(_r) == 4:
        _out = []
        for _v in _r:
            if isinstance(_v, torch.Tensor):
                _v = _v.detach().cpu().numpy()
            try:
                _out.append(np.asarray(_v, dtype=float))
            except Exception:
                _out.append(_kind(_v))
        _results.append({'result': _out, 'error': None})
    else:
        _results.append({'result': None if _r is None else _kind(_r), 'error': _e})
outputs = {'results': _results}
del _results, _c, _curves, _r, _e
""" + CLEANUP


def _iso_case_from(c: dict) -> IsoCase:
    return IsoCase(list(c["sizes"]), [np.asarray(s) for s in c["steps"]], [np.asarray(l) for l in c["losses"]],
                   np.asarray(c["budgets"], dtype=float), int(c["tokens_per_step"]), str(c["text"]))


def isoflop_apart(case: IsoCase) -> bool:
    """True when every n_opt mistake changes n_opt on ``case`` and each differently, and each a mistake changes a."""
    try:
        want = reference_isoflop_fit(case.curves, case.budgets, case.tokens_per_step)
    except ValueError:
        return False
    seen = [want[0]]
    for mistake, result in iso_mistakes(case):
        if mistake in ISO_N_HINTS:
            if result != "raises":
                if any(_same_array(result[0], other) for other in seen):
                    return False
                seen.append(result[0])
        elif result == "raises" or _same_number(result[2], want[2]) != (mistake == "log10 b"):
            return False
    return True


def _iso_probe_inputs(rng: np.random.Generator) -> dict:
    cases = []
    for spike, outside in ((False, False), (True, False), (False, True)):
        for _ in range(50):
            case = iso_case(rng, n_models=int(rng.integers(5, 8)), spike=spike, short_first=bool(rng.random() < 0.7),
                            two_top=True, text=f"hidden test {len(cases) + 1}")
            upward = case.upward()
            if (isoflop_apart(case) and (not spike or False in upward) and None in upward and case.two_kept()
                    and (not outside or case.extrapolated())):
                break
        else:
            raise RuntimeError("no isoflop_fit inputs that tell every mistake apart in 50 draws")
        cases.append({"sizes": [int(n) for n in case.sizes], "steps": case.steps, "losses": case.losses,
                      "budgets": case.budgets, "tokens_per_step": case.tokens_per_step, "text": case.text})
    return {"cases": cases}


def _compare_isoflop(outputs: dict, expected: dict) -> str | None:
    results, cases = outputs.get("results") if isinstance(outputs, dict) else None, expected["cases"]
    if not (isinstance(results, list) and len(results) == len(cases)):
        return "isoflop_fit's hidden test did not run every case"
    for got, c in zip(results, cases):
        case = _iso_case_from(c)
        result = got.get("result") if isinstance(got, dict) else None
        if isinstance(result, list):
            result = tuple(np.asarray(v) if isinstance(v, np.ndarray) and v.ndim else
                           (float(v) if isinstance(v, np.ndarray) else v) for v in result)
        try:
            diagnose_isoflop(result, case, error=got.get("error") if isinstance(got, dict) else None)
        except (CheckFailure, ExerciseNotDone) as failure:
            return str(failure)
    return None


PROBES = {
    "check_top_k_gating": Probe(
        builds=ELEMENTARY | SOFTMAX,
        exercise="ex_top_k_gating", make_inputs=_gating_probe_inputs, run=GATING_PROBE_RUN,
        reference=_gating_probe_reference, compare=_compare_gating, forbidden=FORBIDDEN),
    "check_balance_loss": Probe(
        exercise="ex_balance_loss", make_inputs=_balance_probe_inputs, run=BALANCE_PROBE_RUN,
        reference=_balance_probe_reference, compare=_compare_balance, forbidden=FORBIDDEN),
    "check_moe_forward": Probe(
        builds=ELEMENTARY | SOFTMAX | EINOPS | MF_BUILDS,
        exercise="ex_moe_forward", make_inputs=_mf_probe_inputs, run=MF_PROBE_RUN,
        reference=_mf_probe_reference, compare=_compare_mf, forbidden=FORBIDDEN, standins=MF_STANDINS),
    "check_isoflop_fit": Probe(
        builds=ELEMENTARY | ISO_BUILDS,
        exercise="ex_isoflop_fit", make_inputs=_iso_probe_inputs, run=ISO_PROBE_RUN,
        reference=lambda inputs: {"cases": inputs["cases"]}, compare=_compare_isoflop, forbidden=ISO_FORBIDDEN),
}


HINTS = {
    "ex_top_k_gating": Hints(
        number="12.1",
        check="check_top_k_gating",
        idea=(
            "Each token's row of router logits becomes a probability distribution over the experts, and the token "
            "keeps the k experts it rates highest. Their gates are those probabilities: with k = 1 the probability "
            "itself (Switch), so the router learns through the gate's value; with k > 1 rescaled so that a token's "
            "k gates add to 1. The classic slips: normalising over the tokens instead of the experts, renormalising "
            "the single gate when k = 1 (it becomes the constant 1 and no gradient reaches the router), and any "
            "step that cuts the gradient."
        ),
        approach=(
            "Three steps on router_logits (tokens, n_experts). A softmax over the experts axis, the last one: "
            "probabilities (tokens, n_experts), each row adding to 1 (torch's softmax subtracts the row max, so "
            "logits in the thousands stay finite). A top-k over that same axis: it gives the k largest values and "
            "their indices, both (tokens, k), which are the gates and the expert ids (int64). Only when k > 1, "
            "divide each token's k gates by their sum over the k axis, keeping that axis so the division "
            "broadcasts. Stay with differentiable torch operations (no .item, .detach or .tolist) and return "
            "(gates, experts) in that order."
        ),
        skeleton=(
            "def top_k_gating(router_logits, k):\n"
            "    probs = ____  # (tokens, n_experts): each token's row adds to 1\n"
            "    gates, experts = ____  # (tokens, k) each: the k largest probabilities and their expert ids\n"
            "    if k > 1:\n"
            "        gates = gates / ____  # (tokens, k): now a token's k gates add to 1\n"
            "    return gates, experts\n"
        ),
    ),
    "ex_balance_loss": Hints(
        number="12.2",
        check="check_balance_loss",
        idea=(
            "The loss is E times the sum over the experts of f_i * P_i. f_i is what the router did: the share of "
            "all tokens * k assignments that went to expert i, a count, with no gradient. P_i is what the router "
            "wanted: its mean probability for expert i over the tokens, the only path by which the loss trains it. "
            "Spread evenly, both are 1/E and the loss is 1; with every token on one expert it is E. The usual "
            "slips: f from the probabilities, a mean over the experts where the formula sums, and counts divided "
            "by the tokens rather than by the assignments."
        ),
        approach=(
            "E is the last size of router_probs. f: count how often each expert id occurs among all the entries of "
            "experts (tokens, k), in a vector of length E where an expert that got no token keeps its 0 "
            "(torch.bincount has an argument for that minimum length; a one-hot sum works too), then divide by the "
            "number of assignments, tokens * k, so f adds to 1. P: the mean of router_probs over the tokens axis, "
            "shape (E,), left attached to the graph. The loss: f times P elementwise, summed over the experts, "
            "times E, a 0-d tensor."
        ),
        skeleton=(
            "def balance_loss(router_probs, experts):\n"
            "    n_experts = ____  # E\n"
            "    f = torch.bincount(____, minlength=____) / ____  # (E,): each expert's share of the assignments\n"
            "    P = ____  # (E,): each expert's mean probability; the gradient goes through here\n"
            "    return ____  # a 0-d tensor, 1 when the load is even\n"
        ),
    ),
    "ex_moe_forward": Hints(
        number="12.3",
        check="check_moe_forward",
        idea=(
            "Four steps. Route: the router's logits through the gating give each token's k experts and gates. "
            "Queue: each expert serves its assignments in a fixed order, all first choices in position order, then "
            "all second choices, and an assignment whose expert already holds capacity of them is dropped. Run: each "
            "expert on the rows of its kept assignments, and nothing else. Combine: every output row times its gate, "
            "added to its token's output; a dropped assignment adds nothing, so a token that lost every assignment "
            "gets 0 and the residual connection carries it."
        ),
        approach=(
            "The logits are x times the transpose of router_weight, (tokens, n_experts); the gating turns them into "
            "gates and chosen experts, both (tokens, k). For the queue, read the chosen experts column by column "
            "(transpose, then flatten): that lists the k * tokens assignments in queue order. An assignment's place "
            "in its expert's queue is how many earlier assignments went to the same expert: a running count over a "
            "one-hot of that list (a cumulative sum down the list, read at the assignment's own expert), or a loop "
            "with one counter per expert. Kept is place below capacity, reshaped back to (tokens, k). Then start "
            "from zeros like x and, for each expert, find the (token, choice) pairs where it was chosen and kept, "
            "run it on those tokens' rows, scale the rows by their gates and add them at their tokens (index_add "
            "keeps the gradient)."
        ),
        skeleton=(
            "def moe_forward(x, router_weight, experts, k, capacity):\n"
            "    tokens, n_experts = ____\n"
            "    gates, chosen = top_k_gating(____, k)  # (tokens, k) each, largest gate first\n"
            "    queue = ____  # (k * tokens,): the first choices in position order, then the second ...\n"
            "    one_hot = ____  # (k * tokens, n_experts)\n"
            "    place = ____  # each assignment's place in its expert's queue: 0, 1, 2, ...\n"
            "    kept = ____  # (tokens, k) bool: place below capacity\n"
            "    out = ____  # (tokens, d_model): 0 where nothing ran\n"
            "    for e in range(____):\n"
            "        token, choice = ____  # where expert e was chosen and kept\n"
            "        if len(token):\n"
            "            out = out.index_add(0, token, ____)  # gate times the expert's output rows\n"
            "    return out, kept\n"
        ),
    ),
    "ex_isoflop_fit": Hints(
        number="12.4",
        check="check_isoflop_fit",
        idea=(
            "Hoffmann et al.'s approach 2 in three steps. Slice: a compute budget C fixes N times D, so each model "
            "of N parameters meets the budget at one point of its own training curve, after D = C / 6N tokens; "
            "read its loss there, if its curve covers that many tokens. Minimum: the losses of one budget against "
            "ln N lie on a valley (too small a model on one side, too few tokens on the other), fitted by a "
            "parabola whose vertex is N_opt and whose value there is the lowest loss; a budget with fewer than three "
            "points, or whose parabola opens downward, has no minimum. Line: ln N_opt against ln C is straight, and "
            "its slope is the exponent a."
        ),
        approach=(
            "Start n_opt and loss_min as arrays of NaN, one entry per budget. For each budget C, go over the "
            "curves: a curve's tokens are its steps times tokens_per_step; D is C divided by 6 N; keep the model "
            "only if D lies between the first and the last of its tokens, and then its loss at D, interpolated "
            "linearly (np.interp), with ln N beside it. With three models or more, np.polyfit of degree 2 gives "
            "(c2, c1, c0) for loss against ln N; when c2 is positive the vertex is at ln N = -c1 / (2 c2), and the "
            "parabola's value there is c0 - c1^2 / (4 c2). At the end, take the budgets whose n_opt is a number, "
            "raise ValueError if fewer than two, and fit a straight line (np.polyfit of degree 1) to ln n_opt "
            "against ln C: its slope is a, its intercept b."
        ),
        skeleton=(
            "def isoflop_fit(curves, budgets, tokens_per_step):\n"
            "    budgets = ____  # a float array\n"
            "    n_opt, loss_min = ____  # one NaN per budget each, to be filled in\n"
            "    for i in ____:\n"
            "        C = ____  # budget i\n"
            "        log_n, losses = [], []\n"
            "        for ____ in curves:  # each model: its N, steps and losses\n"
            "            tokens = ____  # the tokens each point of the curve has seen\n"
            "            D = ____  # the tokens this model may read on budget C\n"
            "            if ____:  # the curve covers D\n"
            "                log_n.append(____)\n"
            "                losses.append(____)  # the loss at D, between the curve's points\n"
            "        if ____:  # enough points for a parabola\n"
            "            c2, c1, c0 = ____\n"
            "            if ____:  # a minimum, not a maximum\n"
            "                n_opt[i] = ____\n"
            "                loss_min[i] = ____\n"
            "    found = ____  # the budgets with a minimum\n"
            "    if ____:\n"
            "        raise ValueError(____)\n"
            "    a, b = ____  # the line through (ln C, ln N_opt)\n"
            "    return ____  # four things: two arrays, two floats\n"
        ),
    ),
}

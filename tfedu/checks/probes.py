"""What the hidden tests (``core.Probe``) of notebooks 00-05 share.

A hidden test checks behaviour, not one easy input. Besides fresh random inputs of sizes no
answer could hard-code, each probe

- feeds large inputs to everything with a softmax (scores around 1e3-1e4, where ``exp``
  overflows unless the row max is subtracted first), built so that the scores are exact in
  float32 (integer entries, widths whose square root is a power of two): any correct answer,
  whatever its order of operations, then matches the reference to rounding;
- backpropagates a random upstream gradient (drawn with the inputs) through the learner's
  function and exports the gradients, so an answer computed under ``torch.no_grad()`` or cut
  off with ``.detach()`` fails;
- records, in words, what the answer returned (``"tensor"``, ``"a tuple of two tensors"``,
  ``"float"``), so a tuple where a tensor is asked for fails with a message naming both.

The run code of a probe starts with :data:`HELPERS` (three small functions the kernel needs) and
ends with :data:`CLEANUP`; the grader's side uses the very same functions (:func:`kind_of`,
:func:`as_array`, :func:`backward`) for the reference, and :func:`compare_outputs` to judge.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tfedu.checks.core import compare_plain
from tfedu.config import ModelConfig
from tfedu.model import GPT

# Run in the student's kernel (as part of Probe.run) and, for the reference, here: one source.
HELPERS = '''\
def _kind(value):
    """What an answer returned, in words the feedback can show."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, float):
        return "float"
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(item, torch.Tensor) for item in value):
        return "a tuple of two tensors"
    if isinstance(value, (tuple, list)):
        return type(value).__name__ + " of " + (", ".join(type(item).__name__ for item in value) or "nothing")
    return type(value).__name__


def _array(value):
    """A tensor as a NumPy array (float32 for any float dtype), detached; None for anything else."""
    if not isinstance(value, torch.Tensor):
        return None
    value = value.detach().cpu()
    return (value.float() if value.is_floating_point() else value).numpy()


def _backward(results, upstreams, wrt):
    """The gradient of sum(result * upstream) with respect to each tensor in the dict `wrt`.

    A word instead when there is none to take: "missing" (a result does not require grad:
    torch.no_grad() or .detach()), "skipped" (a result is no float tensor of the upstream's
    shape; the values' comparison names that); "none" for an input the results do not reach.
    """
    pairs = list(zip(results, upstreams))
    if not all(isinstance(r, torch.Tensor) and r.is_floating_point() and tuple(r.shape) == tuple(u.shape) for r, u in pairs):
        return "skipped"
    if not all(r.requires_grad for r, _ in pairs):
        return "missing"
    grads = torch.autograd.grad([r for r, _ in pairs], list(wrt.values()), [u.to(r.dtype) for r, u in pairs], allow_unused=True)
    return {name: "none" if g is None else _array(g) for name, g in zip(wrt, grads)}


_MUTATED = []


def _call(function, *args):
    """function(*args) on copies of the tensor arguments; the positions of those it changed in place go to _MUTATED."""
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    kept = [a.detach().clone() if isinstance(a, torch.Tensor) else None for a in copies]
    result = function(*copies)
    for position, (now, before) in enumerate(zip(copies, kept)):
        if before is not None and not (now.shape == before.shape and torch.equal(now.detach(), before)):
            _MUTATED.append(position)
    return result


'''
CLEANUP = "del _kind, _array, _backward, _call, _MUTATED\n"

_helpers: dict[str, Any] = {"torch": torch}
exec(compile(HELPERS, "<probe helpers>", "exec"), _helpers)
kind_of = _helpers["_kind"]
as_array = _helpers["_array"]
backward = _helpers["_backward"]

# A probe that runs the learner's code on a whole model ships the model as plain data, ``inputs["config"]`` (the
# ModelConfig's fields) and ``inputs["weights"]`` (its state dict as arrays), and rebuilds it on both sides with one
# source: GPT_FROM_INPUTS binds ``_model`` in the kernel (GPT_CLEANUP deletes it), gpt_from_inputs here.
GPT_FROM_INPUTS = """\
from tfedu.config import ModelConfig as _ModelConfig
from tfedu.model import GPT as _GPT

with torch.random.fork_rng(devices=[]):
    _model = _GPT(_ModelConfig(**inputs['config']))
_model.load_state_dict({_k: torch.from_numpy(_v) for _k, _v in inputs['weights'].items()})
_model.eval()
"""
GPT_CLEANUP = "del _ModelConfig, _GPT, _model\n"


def gpt_from_inputs(inputs: Mapping[str, Any]) -> GPT:
    """The GPT a probe's inputs describe (see GPT_FROM_INPUTS), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        model = GPT(ModelConfig(**inputs["config"]))
    model.load_state_dict({name: torch.from_numpy(value) for name, value in inputs["weights"].items()})
    return model.eval()


HINT_MUTATED = (
    "{function} changed its input in place (argument {positions}: an in-place op such as x -= ..., x /= ... or "
    "x.masked_fill_(...)), so the caller's tensor is no longer what it passed in: build new tensors instead "
    "(x = x - ..., masked_fill without the underscore)"
)
HINT_GRAD_MISSING = (
    "no gradient flows back through {function}: its result does not require grad. Was it computed "
    "under torch.no_grad(), or cut off with .detach(), .data, .numpy() or .item()? Training backpropagates "
    "through it, so keep every step a differentiable torch operation"
)
HINT_GRAD_NONE = (
    "no gradient reaches {name} through {function}: the result does not depend on {name} through autograd "
    "(detached, or rebuilt from its numbers?)"
)
HINT_GRAD_DIFFERS = (
    "the values are right but backpropagating a random upstream gradient through {function} gives a wrong "
    "gradient: {problem}. Is part of the computation detached (.detach(), .data, torch.no_grad()) or "
    "changed in place?"
)


def leaf(array: np.ndarray) -> torch.Tensor:
    """A fresh float tensor that requires grad (a copy: the inputs stay as drawn)."""
    return torch.tensor(array, requires_grad=True)


def upstream_like(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    """A random upstream gradient of ``shape``, float32."""
    return rng.standard_normal(tuple(shape)).astype(np.float32)


def magnitude(want: Any) -> float:
    """The largest finite |value| of a reference array of floats, at least 1 (1 for anything else)."""
    if not (isinstance(want, np.ndarray) and want.dtype.kind == "f"):
        return 1.0
    finite = np.abs(want[np.isfinite(want)])
    return max(1.0, float(finite.max())) if finite.size else 1.0


def named_in_outputs(got: Any, want: Any, mistakes: Sequence, *, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """The hint of the first mistake (``[hint, array]`` pairs) whose output ``got`` matches and the reference does not.

    None when ``got`` is not a finite array of the reference's shape, or matches no mistake; a mistake
    whose output equals the reference's on these inputs is passed over, since it is not told apart there.
    """
    if not isinstance(got, np.ndarray) or got.shape != np.shape(want) or not np.isfinite(got).all():
        return None
    for hint, wrong in mistakes:
        wrong = np.asarray(wrong)
        if wrong.shape == got.shape and np.isfinite(wrong).all() and np.allclose(got, wrong, rtol=rtol, atol=atol) \
                and not np.allclose(want, wrong, rtol=rtol, atol=atol):
            return hint
    return None


def compare_outputs(
    outputs: Any,
    expected: Mapping[str, Any],
    *,
    function: str,
    labels: Mapping[str, str] | None = None,
    nan_hints: Mapping[str, str] | None = None,
    kind_hints: Mapping[str, str] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    grad_rtol: float = 1e-3,
    grad_atol: float = 1e-4,
) -> str | None:
    """A hidden test's outputs against the reference: None when they agree, else feedback.

    In order: what each call returned (``expected["returned"]``, a list of kinds, one per call;
    ``kind_hints`` maps a wrong kind to a hint), then every other entry (``labels`` names it in
    the feedback; ``nan_hints`` adds a hint when it holds NaN or Inf where the reference does
    not), then the gradients under ``expected["grad"]`` (a dict of arrays). An absolute tolerance is
    times the largest value of the reference array when that exceeds one (:func:`magnitude`): outputs
    of size 1e3 round at about 1e-4, and an entry near zero among them is allowed that much too.
    Gradients are compared more loosely (``grad_rtol``, ``grad_atol``): they amplify the rounding of
    the values, and a detached path is off by far more.
    """
    labels, nan_hints, kind_hints = labels or {}, nan_hints or {}, kind_hints or {}
    if not isinstance(outputs, dict):
        return f"the hidden test's outputs should be a dict, got {type(outputs).__name__}"
    if outputs.get("mutated"):  # the run code's _call saw an argument change in place
        return HINT_MUTATED.format(function=function, positions=", ".join(str(int(p) + 1) for p in sorted(set(outputs["mutated"]))[:5]))
    got_kinds = outputs.get("returned")
    for i, want in enumerate(expected["returned"]):
        got = got_kinds[i] if isinstance(got_kinds, list) and i < len(got_kinds) else None
        if got != want:
            hint = kind_hints.get(str(got))
            return f"{function} should return {want}, it returned {got}" + (f": {hint}" if hint else "")
    for key, want in expected.items():
        if key in ("returned", "grad"):
            continue
        problem = compare_plain(outputs.get(key), want, rtol, atol * magnitude(want), labels.get(key, f"{function}'s {key}"))
        if problem:
            if "NaN or Inf" in problem and key in nan_hints:
                problem = f"{problem}: {nan_hints[key]}"
            return problem
    if "grad" not in expected:
        return None
    got_grads = outputs.get("grad")
    if got_grads == "missing":
        return HINT_GRAD_MISSING.format(function=function)
    if not isinstance(got_grads, dict):
        return f"the gradients through {function} could not be taken ({got_grads})"
    for name, want in expected["grad"].items():
        got = got_grads.get(name)
        if isinstance(got, str) or got is None:
            return HINT_GRAD_NONE.format(name=name, function=function)
        problem = compare_plain(got, want, grad_rtol, grad_atol * magnitude(want), f"the gradient with respect to {name}")
        if problem:
            return HINT_GRAD_DIFFERS.format(function=function, problem=problem)
    return None

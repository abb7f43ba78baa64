"""Checkers for notebooks/04_attention.ipynb: scaled dot-product attention by hand."""

from __future__ import annotations

import contextlib
import math
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from tfedu.attention import scaled_dot_product_attention as reference_attention
from tfedu.checks.building_blocks import ELEMENTARY, SOFTMAX
from tfedu.checks.core import (
    CheckFailure,
    ExerciseNotDone,
    Hints,
    Probe,
    call_learner,
    checker,
    compare,
    describe,
    expect,
    is_close,
    seeded_randn,
    upstream_problem,
)
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, backward, compare_outputs, leaf, upstream_like

HINT_NO_SCALE = (
    "missing 1/sqrt(d_k) scale: divide the scores by the square root of d_k, the size of each query and key, "
    "before the softmax"
)
HINT_SCALE_BY_D = (
    "you scaled by d_k instead of sqrt(d_k): the dot product's standard deviation is sqrt(d_k), "
    "so divide by the square root of d_k"
)
HINT_MULTIPLIED = "you multiplied the scores by sqrt(d_k); divide by it instead"
HINT_SCALE_QUERY_POS = (
    "you divided by sqrt(query_pos) = sqrt(q.shape[-2]), the number of queries; d_k is the width of "
    "each query and key, q.shape[-1]"
)
HINT_SCALE_KEY_POS = (
    "you divided by sqrt(key_pos) = sqrt(k.shape[-2]), the number of keys; d_k is the width of "
    "each query and key, q.shape[-1] (== k.shape[-1])"
)
HINT_SCALE_D_V = (
    "you divided by sqrt(d_v) = sqrt(v.shape[-1]), the width of the values; the scale is sqrt(d_k), "
    "the width of the queries and keys, q.shape[-1]"
)
HINT_SCALE_AFTER = (
    "you divided by sqrt(d_k) after the softmax: the scale goes on the scores, inside the softmax, "
    "softmax(q @ k^T / sqrt(d_k)); scaled afterwards, each row of weights no longer sums to one"
)
HINT_QUERY_AXIS = (
    "softmax over the wrong (query) axis: each query's weights must sum to one over the keys, "
    "so take the softmax over the last dim (dim=-1), not dim=-2"
)
HINT_BATCH_AXIS = (
    "softmax over dim 0, the batch axis (the axis a softmax picks on 3-D input when you name no dim): "
    "take it over the keys, the last axis"
)
HINT_SOFTMAX_NO_DIM = (
    "a softmax without dim= guesses the axis (dim 0, the batch axis, on 3-D input; dim 1 on "
    "4-D input) and warns that this is deprecated: name the axis of the keys, the last one"
)
HINT_NO_V = (
    "forgot to multiply by V: the output is weights @ v, of shape (..., query_pos, d_v); "
    "you returned the weights themselves"
)
HINT_TIMES_K = "you multiplied the weights by k; the output is the weighted average of the values, weights @ v"
HINT_TUPLE = (
    "return a pair (output, weights): the weights are the softmax of the scaled scores over the keys, and the "
    "output is those weights applied to the values"
)
HINT_SWAPPED_PAIR = (
    "you returned (weights, output); return them the other way round, (output, weights), "
    "the order tfa.scaled_dot_product_attention and the rest of the course use"
)
HINT_DOT_T = (
    "your attention works on 2-D inputs but raises on 3-D ones (batch, pos, d): "
    ".T reverses every dim of a batched tensor; swap only the last two axes of k (the transpose that "
    "takes the two axes, counted from the end, or .mT)"
)
HINT_BATCH = (
    "your attention works on 3-D inputs but not on 4-D ones (batch, heads, pos, d): swap the last two "
    "axes of k, counted from the end (axes 1 and 2 are the last two only on 3-D input, and .T reverses them "
    "all), and take the softmax over the last axis"
)

_NO_DIM_WARNING = "Implicit dimension choice for softmax"
_DOT_T_WARNING = "x.T"


class _Quiet:
    """Run the learner's code with every warning captured, so none reaches the check cell's stderr."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def call(self, fn: Any, *args: Any, name: str) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return call_learner(fn, *args, name=name)
            finally:
                for w in caught:
                    text = f"{w.category.__name__}: {str(w.message).split(' (Triggered internally')[0]}"
                    if text not in self.messages:
                        self.messages.append(text)

    def saw(self, fragment: str) -> bool:
        return any(fragment in m for m in self.messages)

    def suffix(self) -> str:
        return f" (your code also warned: {'; '.join(self.messages)})" if self.messages else ""


def _weight_mistakes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    d_k = q.shape[-1]
    raw = q @ k.transpose(-2, -1)
    mistakes = {
        HINT_NO_SCALE: torch.softmax(raw, dim=-1),
        HINT_SCALE_BY_D: torch.softmax(raw / d_k, dim=-1),
        HINT_MULTIPLIED: torch.softmax(raw * math.sqrt(d_k), dim=-1),
        HINT_SCALE_QUERY_POS: torch.softmax(raw / math.sqrt(q.shape[-2]), dim=-1),
        HINT_SCALE_KEY_POS: torch.softmax(raw / math.sqrt(k.shape[-2]), dim=-1),
        HINT_SCALE_D_V: torch.softmax(raw / math.sqrt(v.shape[-1]), dim=-1),
        HINT_SCALE_AFTER: torch.softmax(raw, dim=-1) / math.sqrt(d_k),
        HINT_QUERY_AXIS: torch.softmax(raw / math.sqrt(d_k), dim=-2),
    }
    if raw.dim() == 3:
        mistakes[HINT_BATCH_AXIS] = torch.softmax(raw / math.sqrt(d_k), dim=0)
    return mistakes


def _check_pair(result: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    expected_out, expected_w = reference_attention(q, k, v)
    if isinstance(result, torch.Tensor):
        if result.shape == expected_w.shape:
            raise CheckFailure(HINT_NO_V)
        raise CheckFailure(f"{HINT_TUPLE}; you returned a single {describe(result)}")
    expect(isinstance(result, (tuple, list)) and len(result) == 2, f"{HINT_TUPLE}; you returned {describe(result)}")
    expect(isinstance(result, tuple), f"{HINT_TUPLE}; you returned a {type(result).__name__}: make it a tuple, return output, weights")
    output, weights = result
    for name, part in (("output", output), ("weights", weights)):
        expect(isinstance(part, torch.Tensor), f"the {name} of {what} should be a torch.Tensor, got {describe(part)}")
    if (
        expected_out.shape != expected_w.shape
        and isinstance(output, torch.Tensor)
        and isinstance(weights, torch.Tensor)
        and output.shape == expected_w.shape
        and weights.shape == expected_out.shape
    ):
        raise CheckFailure(HINT_SWAPPED_PAIR)
    weight_mistakes = _weight_mistakes(q, k, v)
    compare(weights, expected_w, what=f"the weights of {what}", mistakes=weight_mistakes)
    if isinstance(output, torch.Tensor) and output.shape == expected_w.shape and torch.allclose(output, weights):
        raise CheckFailure(HINT_NO_V)
    output_mistakes = {hint: w @ v for hint, w in weight_mistakes.items()}
    output_mistakes[HINT_NO_V] = expected_w
    output_mistakes[HINT_TIMES_K] = expected_w @ k
    compare(output, expected_out, what=f"the output of {what}", mistakes=output_mistakes)


def _works(attention: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when ``attention`` gives the right pair on these inputs (used to locate a failure)."""
    try:
        _check_pair(_Quiet().call(attention, q, k, v, name="attention"), q, k, v, "attention")
    except (CheckFailure, NotImplementedError):
        return False
    return True


def _attention_problems(attention: Any) -> list[str]:
    """Every check of exercise 4.1; raises CheckFailure on the first problem, returns notes otherwise."""
    quiet = _Quiet()
    # query_pos 5, key_pos 7, d_k 6, d_v 3: every wrong size under the sqrt gives a different tensor.
    q, k, v = seeded_randn(0, 2, 5, 6), seeded_randn(1, 2, 7, 6), seeded_randn(2, 2, 7, 3)
    what = "attention(q, k, v) on (2, 5, 6), (2, 7, 6), (2, 7, 3)"
    try:
        result = quiet.call(attention, q, k, v, name="attention")
    except ExerciseNotDone:
        raise
    except CheckFailure as failure:
        if quiet.saw(_DOT_T_WARNING) or _works(attention, q[0], k[0], v[0]):
            raise CheckFailure(f"{HINT_DOT_T}. It raised: {failure}") from None
        raise CheckFailure(f"{failure}{quiet.suffix()}") from None
    if quiet.saw(_NO_DIM_WARNING):
        raise CheckFailure(HINT_SOFTMAX_NO_DIM)
    try:
        _check_pair(result, q, k, v, what)
        # One query and one key: the weight must be exactly 1 whatever the score.
        one = quiet.call(attention, q[:, :1], k[:, :1], v[:, :1], name="attention")
        _check_pair(one, q[:, :1], k[:, :1], v[:, :1], "attention with a single key")
    except ExerciseNotDone:
        raise
    except CheckFailure as failure:
        raise CheckFailure(f"{failure}{quiet.suffix()}") from None
    # Leading dims: (batch, heads, pos, d), as multi-head attention will call it.
    q4, k4, v4 = seeded_randn(3, 2, 3, 4, 8), seeded_randn(4, 2, 3, 5, 8), seeded_randn(5, 2, 3, 5, 2)
    try:
        result = quiet.call(attention, q4, k4, v4, name="attention")
    except ExerciseNotDone:
        raise
    except CheckFailure as failure:
        raise CheckFailure(f"{failure}. Hint: {HINT_BATCH}{quiet.suffix()}") from None
    if quiet.saw(_NO_DIM_WARNING):
        raise CheckFailure(HINT_SOFTMAX_NO_DIM)
    try:
        _check_pair(result, q4, k4, v4, "attention on a 4-D batch (2, 3, 4, 8)")
    except CheckFailure as failure:
        raise CheckFailure(f"{failure}{quiet.suffix()}") from None
    return quiet.messages


@checker("scaled dot-product attention")
def check_attention(attention) -> None:
    """Check a learner's ``attention(q, k, v) -> (output, weights)``."""
    for note in _attention_problems(attention):
        print(f"note: your attention warned, {note}")


# ----------------------------------------------------------------------------- exercise 4.2

HINT_SWAPPED_QK = "queries come from W_Q and keys from W_K; you swapped them (q = x @ W_K?)"
HINT_NO_PROJECTION = (
    "project first: the queries, keys and values are x times W_Q, W_K and W_V; you attended over x itself"
)
HINT_V_FROM_WRONG = "the values are x @ W_V; you took them from another projection"
HINT_V_FROM_K = "your keys and values both come from W_K; the values are x @ W_V"
HINT_SCALE_D_MODEL = (
    "you divided by sqrt(d_model) = sqrt(x.shape[-1]); the scale is sqrt(d_k), the width of the "
    "projected queries and keys (W_Q.shape[-1])"
)
HINT_TRANSPOSED_W = (
    "W_Q, W_K, W_V have shape (d_model, d_k): multiply x @ W_Q (x has shape (batch, pos, d_model)), "
    "not x @ W_Q.T (nn.Linear stores the transpose; these matrices are not nn.Linear weights)"
)
_USE_REFERENCE = "(or call the reference tfa.scaled_dot_product_attention instead)"
HINT_UPSTREAM_NOT_DONE = (
    f"your self_attention calls your attention from exercise 4.1, which is not done yet: fix 4.1 first {_USE_REFERENCE}"
)
HINT_UPSTREAM_WRONG = (
    f"your self_attention calls your attention from exercise 4.1, which is wrong: fix 4.1 first {_USE_REFERENCE}. "
    "Exercise 4.1's check says: "
)


class _UpstreamNotDone(CheckFailure):
    """The learner's 4.2 answer is written, but the 4.1 ``attention`` it calls is not."""


def _raised_in(err: BaseException) -> types.CodeType | None:
    """The code object of the function that raised ``err`` (the innermost traceback frame)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code if tb is not None else None


def _learner_attention(self_attention: Any) -> Callable[..., Any] | None:
    """The learner's own ``attention`` (exercise 4.1) when ``self_attention`` refers to it by name."""
    code, namespace = getattr(self_attention, "__code__", None), getattr(self_attention, "__globals__", None)
    if code is None or not isinstance(namespace, dict):
        return None
    names, pending = set(), [code]
    while pending:  # the function's own global names and those of any function or lambda inside it
        current = pending.pop()
        names.update(current.co_names)
        pending.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    candidate = namespace.get("attention")
    if "attention" not in names or not callable(candidate) or candidate is reference_attention:
        return None
    return candidate


@contextlib.contextmanager
def _reference_in_place_of_attention(self_attention: Any) -> Iterator[None]:
    """Run ``self_attention`` with the name ``attention`` in its module bound to the reference.

    This tells a mistake of exercise 4.2 apart from one it inherits from the learner's 4.1. The
    learner's binding is put back afterwards, whatever happens.
    """
    namespace = self_attention.__globals__
    saved = namespace["attention"]
    namespace["attention"] = lambda q, k, v: reference_attention(q, k, v)
    try:
        yield
    finally:
        namespace["attention"] = saved


def _guarded(self_attention: Any) -> Callable[..., Any]:
    """``self_attention``, except that an unfinished 4.1 ``attention`` inside it is told apart from 4.2's stub."""
    own = getattr(self_attention, "__code__", None)
    upstream = getattr(_learner_attention(self_attention), "__code__", None)

    def run(*args: Any) -> Any:
        try:
            return self_attention(*args)
        except NotImplementedError as err:
            where = _raised_in(err)
            if upstream is not None and where is upstream and where is not own:
                raise _UpstreamNotDone(HINT_UPSTREAM_NOT_DONE) from None
            raise

    return run


def _self_attention_case(seed: int, d_model: int, d_k: int, d_v: int) -> tuple[torch.Tensor, ...]:
    x = seeded_randn(seed, 2, 5, d_model)
    W_Q, W_K, W_V = (seeded_randn(seed + i, d_model, d) / 2 for i, d in ((1, d_k), (2, d_k), (3, d_v)))
    return x, W_Q, W_K, W_V


HINT_RETURNED_PAIR = (
    "you returned the (output, weights) pair from attention; return only the output, a tensor of shape "
    "(batch, pos, d_v)"
)


def _as_output(got: Any) -> torch.Tensor:
    """The learner's answer, which must be exactly one tensor (batch, pos, d_v), or a CheckFailure naming what it is."""
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got):
        raise CheckFailure(HINT_RETURNED_PAIR)
    expect(isinstance(got, torch.Tensor), f"self_attention should return one torch.Tensor (batch, pos, d_v), got {describe(got)}")
    return got


def _transposes_weights(self_attention: Any) -> bool:
    """With square weights x @ W.T runs: does the answer then equal attention over x @ W^T?"""
    x, W_Q, W_K, W_V = _self_attention_case(20, 6, 6, 6)
    try:
        got = _as_output(_Quiet().call(self_attention, x, W_Q, W_K, W_V, name="self_attention"))
    except (CheckFailure, NotImplementedError):
        return False
    transposed = reference_attention(x @ W_Q.T, x @ W_K.T, x @ W_V.T)[0]
    return is_close(got, transposed) and not is_close(got, reference_attention(x @ W_Q, x @ W_K, x @ W_V)[0])


def _self_attention_failure(self_attention: Any, quiet: _Quiet) -> CheckFailure | None:
    """What is wrong with this answer on the fixed inputs (None: nothing). Raises ExerciseNotDone for a stub."""
    # d_model 6, d_k 4, d_v 3: projecting with the wrong matrix or scaling by the wrong width shows.
    x, W_Q, W_K, W_V = _self_attention_case(10, 6, 4, 3)
    q, k, v = x @ W_Q, x @ W_K, x @ W_V
    expected, expected_w = reference_attention(q, k, v)
    raw = q @ k.transpose(-2, -1)
    mistakes = {
        HINT_NO_PROJECTION: reference_attention(x, x, x)[0],
        HINT_SWAPPED_QK: reference_attention(k, q, v)[0],
        HINT_V_FROM_WRONG: reference_attention(q, k, q)[0],
        HINT_V_FROM_K: reference_attention(q, k, k)[0],
        HINT_NO_SCALE: torch.softmax(raw, dim=-1) @ v,
        HINT_SCALE_BY_D: torch.softmax(raw / 4, dim=-1) @ v,
        HINT_SCALE_D_MODEL: torch.softmax(raw / math.sqrt(6), dim=-1) @ v,
        HINT_SCALE_D_V: torch.softmax(raw / math.sqrt(3), dim=-1) @ v,
        HINT_SCALE_AFTER: torch.softmax(raw, dim=-1) @ v / 2,
        HINT_QUERY_AXIS: torch.softmax(raw / 2, dim=-2) @ v,
        HINT_NO_V: expected_w,
    }
    what = "self_attention(x, W_Q, W_K, W_V) with x (2, 5, 6), W_Q and W_K (6, 4), W_V (6, 3)"
    try:
        got = quiet.call(_guarded(self_attention), x, W_Q, W_K, W_V, name="self_attention")
    except (_UpstreamNotDone, ExerciseNotDone):
        raise
    except CheckFailure as failure:
        # Name a transposed weight matrix only when square weights show that is what happened.
        if _transposes_weights(self_attention):
            return CheckFailure(f"{failure}. Hint: {HINT_TRANSPOSED_W}")
        return CheckFailure(f"{failure}{quiet.suffix()}")
    try:
        if quiet.saw(_NO_DIM_WARNING):
            raise CheckFailure(HINT_SOFTMAX_NO_DIM)
        compare(_as_output(got), expected, what=what, mistakes=mistakes)
    except CheckFailure as failure:
        return CheckFailure(f"{failure}{quiet.suffix()}")
    return None


def _self_attention_problems(self_attention: Any) -> list[str]:
    quiet = _Quiet()
    try:
        failure = _self_attention_failure(self_attention, quiet)
    except _UpstreamNotDone as not_done:
        failure = not_done
    if failure is None:
        return quiet.messages
    learner_attention = _learner_attention(self_attention)
    if learner_attention is not None:
        # The answer builds on the learner's 4.1. If that fails its own check, rerun 4.2 on the
        # reference: a pass there means every problem came from 4.1, so 4.1 is named, not 4.2.
        upstream = upstream_problem(_attention_problems, learner_attention, not_done=HINT_UPSTREAM_NOT_DONE,
                                    wrong=HINT_UPSTREAM_WRONG)
        if upstream is not None:
            with _reference_in_place_of_attention(self_attention):
                own = _self_attention_failure(self_attention, _Quiet())
            if own is None:
                raise CheckFailure(upstream)
            raise CheckFailure(f"{own}. Also, {upstream}")
    raise failure


@checker("self-attention with Q, K, V projections")
def check_self_attention(self_attention) -> None:
    """Check a learner's ``self_attention(x, W_Q, W_K, W_V) -> output``.

    The answer may call the learner's ``attention`` from exercise 4.1 or the reference
    ``tfedu.attention.scaled_dot_product_attention``. When it calls the learner's own and that one
    is unfinished or wrong, the hint says to fix 4.1 first instead of blaming 4.2.
    """
    for note in _self_attention_problems(self_attention):
        print(f"note: your self_attention warned, {note}")


# ----------------------------------------------------------------------------- probes

PAIR = "a tuple of two tensors"

# Exercise 4.1 forbids F.scaled_dot_product_attention; nn.MultiheadAttention gets there through
# F.multi_head_attention_forward. The private kernels are refused by the grader's scan already
# (private internals); listed so the run-time tripwire names them too. nn.MultiheadAttention, a
# class, is for the scan: the tripwire sees the function it calls.
FUSED_ATTENTION = (
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.nn.functional.multi_head_attention_forward",
    "torch.nn.MultiheadAttention",
    "torch._scaled_dot_product_attention_math",
    "torch._scaled_dot_product_flash_attention",
    "torch._scaled_dot_product_flash_attention_for_cpu",
    "torch._scaled_dot_product_efficient_attention",
    "torch._fused_sdp_choice",
    # the same kernels reached as operators (the static scan refuses torch.ops too; this is the run-time watch)
    "torch.ops.aten.scaled_dot_product_attention",
    "torch.ops.aten._scaled_dot_product_attention_math",
    "torch.ops.aten._scaled_dot_product_flash_attention",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
    "torch.ops.aten._scaled_dot_product_efficient_attention",
    "torch.ops.aten._native_multi_head_attention",
)

HINT_PROBE_OVERFLOW = (
    "scores around 1e3 overflow exp (exp(89) is already inf in float32): use torch.softmax over the keys, "
    "or subtract each row's max before exp if you wrote the softmax yourself"
)


def _leading(rng: np.random.Generator, most: int = 2) -> tuple[int, ...]:
    """None, one or ``most`` leading (batch, heads) dims of random sizes."""
    return tuple(int(n) for n in rng.integers(1, 4, size=int(rng.integers(0, most + 1))))


def exact_large_qk(rng: np.random.Generator, leading: tuple[int, ...], n_query: int, n_key: int) -> tuple[np.ndarray, np.ndarray]:
    """Queries and keys whose scores q.k / sqrt(d_k) reach about 1e3, exactly representable in float32.

    Integer entries and d_k of 4 or 16 (sqrt(d_k) a power of two) make every score exact whatever
    the order of the sums, so a correct answer matches the reference to rounding. Query 0 and
    key 0 are the same vector of +-R entries: score sqrt(d_k) R^2, about 1200, so exp overflows
    there unless the row max is subtracted first.
    """
    d_k = int(rng.choice([4, 16]))
    q = rng.integers(-30, 31, size=(*leading, n_query, d_k)).astype(np.float32)
    k = rng.integers(-30, 31, size=(*leading, n_key, d_k)).astype(np.float32)
    aligned = rng.choice([-1.0, 1.0], size=d_k) * (24.0 if d_k == 4 else 17.0)
    q[..., 0, :] = aligned
    k[..., 0, :] = aligned
    return q, k


def _attention_inputs(rng: np.random.Generator) -> dict:
    # Four different sizes, so dividing by the sqrt of the wrong one (query_pos, key_pos, d_v) shows;
    # no, one or two leading dims (the exercise allows any number).
    leading = _leading(rng)
    n_query, n_key, d_head, d_v = (int(size) for size in rng.choice(np.arange(2, 13), size=4, replace=False))
    scale = float(rng.uniform(0.5, 3.0))  # varied magnitudes: a missing sqrt(d_k) shows at any size
    q = (rng.standard_normal((*leading, n_query, d_head)) * scale).astype(np.float32)
    k = (rng.standard_normal((*leading, n_key, d_head)) * scale).astype(np.float32)
    v = rng.standard_normal((*leading, n_key, d_v)).astype(np.float32)
    big_leading = _leading(rng)
    n_query_big, n_key_big = int(rng.integers(2, 41)), int(rng.integers(2, 41))
    q_big, k_big = exact_large_qk(rng, big_leading, n_query_big, n_key_big)
    return {
        "q": q, "k": k, "v": v,
        "upstream_output": upstream_like(rng, (*leading, n_query, d_v)),
        "upstream_weights": upstream_like(rng, (*leading, n_query, n_key)),
        "q_big": q_big, "k_big": k_big,
        "v_big": rng.standard_normal((*big_leading, n_key_big, int(rng.integers(1, 9)))).astype(np.float32),
    }


# Exports a pair-returning function's two calls, `_result` (on leaves `_q`, `_k`, `_v`, with
# gradients) and `_big` (large scores), for the probes of exercises 4.1 and 5.2.
PAIR_EXPORT = """\
_pairs = [_r if _kind(_r) == 'a tuple of two tensors' else (None, None) for _r in (_result, _big)]
outputs = {
    'returned': [_kind(_result), _kind(_big)],
    'output': _array(_pairs[0][0]), 'weights': _array(_pairs[0][1]),
    'output_big': _array(_pairs[1][0]), 'weights_big': _array(_pairs[1][1]),
    'grad': _backward(list(_pairs[0]), [torch.from_numpy(inputs['upstream_output']), torch.from_numpy(inputs['upstream_weights'])],
                      {'q': _q, 'k': _k, 'v': _v}),
}
del _q, _k, _v, _result, _big, _pairs
"""
QKV_LEAVES_CODE = "_q, _k, _v = (torch.tensor(inputs[_name], requires_grad=True) for _name in ('q', 'k', 'v'))\n"
QKV_LEAVES = QKV_LEAVES_CODE  # code the probe runs, not a message (the _CODE name says so); notebook 05's checker imports it

ATTENTION_RUN = HELPERS + QKV_LEAVES + """\
_result = _call(attention, _q, _k, _v)
_big = attention(*(torch.tensor(inputs[_name]) for _name in ('q_big', 'k_big', 'v_big')))
""" + PAIR_EXPORT + "outputs['mutated'] = _MUTATED\n" + CLEANUP


def pair_reference(inputs: dict, attend: Callable[..., tuple[torch.Tensor, torch.Tensor]], masked: bool = False) -> dict:
    """What a correct pair-returning attention exports on ``inputs`` (see :data:`PAIR_EXPORT`)."""
    q, k, v = (leaf(inputs[name]) for name in ("q", "k", "v"))
    extra = [torch.from_numpy(inputs["mask"])] if masked else []
    extra_big = [torch.from_numpy(inputs["mask_big"])] if masked else []
    output, weights = attend(q, k, v, *extra)
    output_big, weights_big = attend(*(torch.from_numpy(inputs[name]) for name in ("q_big", "k_big", "v_big")), *extra_big)
    upstreams = [torch.from_numpy(inputs["upstream_output"]), torch.from_numpy(inputs["upstream_weights"])]
    return {
        "returned": [PAIR, PAIR],
        "output": as_array(output), "weights": as_array(weights),
        "output_big": as_array(output_big), "weights_big": as_array(weights_big),
        "grad": backward([output, weights], upstreams, {"q": q, "k": k, "v": v}),
    }


def compare_pair(outputs: dict, expected: dict, *, function: str, call: str) -> str | None:
    """The hidden test of a function returning ``(output, weights)``: kinds, the order of the pair, values, gradients."""
    got_out, got_w = outputs.get("output"), outputs.get("weights")
    if (
        isinstance(got_out, np.ndarray) and isinstance(got_w, np.ndarray)
        and expected["output"].shape != expected["weights"].shape
        and got_out.shape == expected["weights"].shape and got_w.shape == expected["output"].shape
    ):
        return f"{function} returned (weights, output); return them the other way round, (output, weights)"
    return compare_outputs(
        outputs, expected, function=function,
        labels={"output": f"the output of {call}", "weights": f"the weights of {call}",
                "output_big": f"the output of {call} with scores around 1e3",
                "weights_big": f"the weights of {call} with scores around 1e3"},
        nan_hints={"output_big": HINT_PROBE_OVERFLOW, "weights_big": HINT_PROBE_OVERFLOW},
    )


def _self_attention_inputs(rng: np.random.Generator) -> dict:
    batch, pos = int(rng.integers(1, 4)), int(rng.integers(2, 41))
    # Three different widths, so scaling by sqrt(d_model) or sqrt(d_v) instead of sqrt(d_head) shows.
    d_model, d_head, d_v = (int(size) for size in rng.choice(np.arange(2, 13), size=3, replace=False))
    inputs = {
        "x": rng.standard_normal((batch, pos, d_model)).astype(np.float32),
        "W_Q": (rng.standard_normal((d_model, d_head)) / np.sqrt(d_model)).astype(np.float32),
        "W_K": (rng.standard_normal((d_model, d_head)) / np.sqrt(d_model)).astype(np.float32),
        "W_V": (rng.standard_normal((d_model, d_v)) / np.sqrt(d_model)).astype(np.float32),
        "upstream": upstream_like(rng, (batch, pos, d_v)),
    }
    # Large scores, exact in float32: integer x and weights, d_head 4 or 16, and W_K = W_Q, so
    # every token's score with itself is |x W_Q|^2 / sqrt(d_head), in the hundreds or thousands.
    d_model_big, d_head_big = int(rng.integers(4, 9)), int(rng.choice([4, 16]))
    W_big = rng.integers(-4, 5, size=(d_model_big, d_head_big)).astype(np.float32)
    inputs.update(
        x_big=rng.integers(-5, 6, size=(int(rng.integers(1, 3)), int(rng.integers(2, 41)), d_model_big)).astype(np.float32),
        W_Q_big=W_big, W_K_big=W_big.copy(),
        W_V_big=rng.standard_normal((d_model_big, int(rng.integers(1, 7)))).astype(np.float32),
    )
    return inputs


SELF_ATTENTION_RUN = HELPERS + """\
_leaves = {_name: torch.tensor(inputs[_name], requires_grad=True) for _name in ('x', 'W_Q', 'W_K', 'W_V')}
_result = _call(self_attention, *_leaves.values())
_big = self_attention(*(torch.tensor(inputs[_name + '_big']) for _name in ('x', 'W_Q', 'W_K', 'W_V')))
outputs = {
    'returned': [_kind(_result), _kind(_big)],
    'output': _array(_result),
    'output_big': _array(_big),
    'grad': _backward([_result], [torch.from_numpy(inputs['upstream'])], _leaves),
}
outputs['mutated'] = _MUTATED
del _leaves, _result, _big
""" + CLEANUP


def _self_attention_reference(inputs: dict) -> dict:
    x, W_Q, W_K, W_V = (leaf(inputs[name]) for name in ("x", "W_Q", "W_K", "W_V"))
    output = reference_attention(x @ W_Q, x @ W_K, x @ W_V)[0]
    x_big, Q_big, K_big, V_big = (torch.from_numpy(inputs[name + "_big"]) for name in ("x", "W_Q", "W_K", "W_V"))
    return {
        "returned": ["tensor", "tensor"],
        "output": as_array(output),
        "output_big": as_array(reference_attention(x_big @ Q_big, x_big @ K_big, x_big @ V_big)[0]),
        "grad": backward([output], [torch.from_numpy(inputs["upstream"])], {"x": x, "W_Q": W_Q, "W_K": W_K, "W_V": W_V}),
    }


def _compare_self_attention(outputs: dict, expected: dict) -> str | None:
    return compare_outputs(
        outputs, expected, function="self_attention",
        labels={"output": "self_attention(x, W_Q, W_K, W_V)", "output_big": "self_attention(x, W_Q, W_K, W_V) with scores around 1e3"},
        nan_hints={"output_big": HINT_PROBE_OVERFLOW},
        kind_hints={PAIR: "that is the (output, weights) pair from attention; return only the output tensor (batch, pos, d_v)"},
    )


# Exercise 4.2 may call the learner's `attention` from 4.1. While 4.2 is graded, this stand-in takes
# its place, so a wrong or unfinished 4.1 costs 4.1 alone. Primitive ops only (no tfedu).
ATTENTION_STANDIN = """\
def attention(q, k, v):
    \"\"\"Stand-in for exercise 4.1: softmax(q k^T / sqrt(d_k)) v, returning (output, weights).\"\"\"
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    exps = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    weights = exps / exps.sum(dim=-1, keepdim=True)
    return weights @ v, weights
"""

PROBES = {
    "check_attention": Probe(
        builds=ELEMENTARY | SOFTMAX,
        exercise="ex_attention",
        make_inputs=_attention_inputs,
        run=ATTENTION_RUN,
        reference=lambda inputs: pair_reference(inputs, reference_attention),
        compare=lambda outputs, expected: compare_pair(outputs, expected, function="attention", call="attention(q, k, v)"),
        forbidden=("tfedu.attention", *FUSED_ATTENTION),
    ),
    "check_self_attention": Probe(
        exercise="ex_self_attention",
        make_inputs=_self_attention_inputs,
        run=SELF_ATTENTION_RUN,
        reference=_self_attention_reference,
        compare=_compare_self_attention,
        # Exercise 4.2 is about the projections; attention itself was graded in 4.1. The answer may
        # call the learner's attention (replaced by the stand-in while 4.2 is graded) or the
        # reference tfa.scaled_dot_product_attention: nothing in tfedu computes the projections.
        forbidden=(),
        standins=ATTENTION_STANDIN,
    ),
}


# ----------------------------------------------------------------------------- hints

HINTS = {
    "ex_attention": Hints(
        number="4.1",
        check="check_attention",
        idea=(
            "Attention is a soft look-up. Every query is compared with every key by a dot product; the scores are "
            "divided by the square root of d_k, the width of a query and a key, so that their spread does not grow "
            "with the width; a softmax over the keys turns each query's row of scores into weights that are "
            "positive and sum to one; and each query's output is the weighted average of the values. The classic "
            "traps: a softmax over the wrong axis (the queries, or the batch), the scale applied after the "
            "softmax, and .T on a batched tensor, which reverses every axis instead of the last two."
        ),
        approach=(
            "Read d_k from the last axis of q. Scores: q times k with only k's last two axes swapped (torch's "
            "transpose, given the two axes counted from the end, or .mT), shape (..., query_pos, key_pos), "
            "divided by the square root of d_k. Weights: the softmax over the last axis, key_pos, so each row "
            "sums to one. Output: the weights times v, (..., query_pos, d_v). Any leading axes (batch, heads) "
            "ride along untouched, because matrix products broadcast over them. Return the output first, then "
            "the weights."
        ),
        skeleton=(
            "def attention(q, k, v):\n"
            "    d_k = ____  # the width of each query and key\n"
            "    scores = q @ ____ / ____  # (..., query_pos, key_pos)\n"
            "    weights = ____  # a distribution over the keys, for every query\n"
            "    return ____, weights\n"
        ),
    ),
    "ex_self_attention": Hints(
        number="4.2",
        check="check_self_attention",
        idea=(
            "In self-attention the sequence looks things up in itself: the queries, the keys and the values are "
            "three different linear maps of the same token vectors x. Every token is projected with the same "
            "matrix, so one matrix product projects every token of every sequence at once. After the "
            "projections it is exactly exercise 4.1. The classic traps: attending over x itself, swapping W_Q "
            "and W_K (the score matrix is not symmetric, so which is which matters), taking the values from the "
            "wrong matrix, and returning the (output, weights) pair instead of the output."
        ),
        approach=(
            "x is (batch, pos, d_model); W_Q and W_K are (d_model, d_k) and W_V is (d_model, d_v), already in "
            "the layout x multiplies directly (no transpose: these are not nn.Linear weights). x times each "
            "matrix gives the queries and the keys, (batch, pos, d_k), and the values, (batch, pos, d_v); the "
            "product acts on the last axis and keeps batch and pos. Hand the three, in the order queries, keys, "
            "values, to your attention from exercise 4.1 (or to the reference tfa.scaled_dot_product_attention): "
            "it returns the pair (output, weights) and takes care of the scale, the square root of the projected "
            "width d_k. Return only the output, (batch, pos, d_v)."
        ),
        skeleton=(
            "def self_attention(x, W_Q, W_K, W_V):\n"
            "    q = ____  # (batch, pos, d_k): what each token is looking for\n"
            "    k = ____  # (batch, pos, d_k): what each token can be found by\n"
            "    v = ____  # (batch, pos, d_v): what each token hands over\n"
            "    output, _ = ____  # attention over the projections gives (output, weights)\n"
            "    return output\n"
        ),
    ),
}

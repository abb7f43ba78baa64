"""Checkers for notebooks/04_attention.ipynb: scaled dot-product attention by hand."""

from __future__ import annotations

import math

import numpy as np
import torch

from tfedu.attention import scaled_dot_product_attention as reference_attention
from tfedu.checks.core import CheckFailure, Probe, call_learner, checker, compare, describe, expect, seeded_randn

HINT_NO_SCALE = (
    "missing 1/sqrt(d_k) scale: divide the scores q @ k.transpose(-2, -1) by math.sqrt(d_k) "
    "(d_k = q.shape[-1]) before the softmax"
)
HINT_SCALE_BY_D = (
    "you scaled by d_k instead of sqrt(d_k): the dot product's standard deviation is sqrt(d_k), "
    "so divide by math.sqrt(d_k)"
)
HINT_MULTIPLIED = "you multiplied the scores by sqrt(d_k); divide by it instead"
HINT_QUERY_AXIS = (
    "softmax over the wrong (query) axis: each query's weights must sum to one over the keys, "
    "so take the softmax over the last dim (dim=-1), not dim=-2"
)
HINT_NO_V = (
    "forgot to multiply by V: the output is weights @ v, of shape (..., query_pos, d_v); "
    "you returned the weights themselves"
)
HINT_TIMES_K = "you multiplied the weights by k; the output is the weighted average of the values, weights @ v"
HINT_TUPLE = "return a pair (output, weights): output = weights @ v, weights = softmax(q @ k^T / sqrt(d_k))"
HINT_BATCH = (
    "your attention works on 3-D inputs but not on 4-D ones (batch, heads, pos, d): transpose the "
    "last two dims with k.transpose(-2, -1) (not k.T or k.transpose(1, 2)) and softmax over dim=-1"
)


def _weight_mistakes(q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    d_k = q.shape[-1]
    raw = q @ k.transpose(-2, -1)
    return {
        HINT_NO_SCALE: torch.softmax(raw, dim=-1),
        HINT_SCALE_BY_D: torch.softmax(raw / d_k, dim=-1),
        HINT_MULTIPLIED: torch.softmax(raw * math.sqrt(d_k), dim=-1),
        HINT_QUERY_AXIS: torch.softmax(raw / math.sqrt(d_k), dim=-2),
    }


def _check_pair(result, q, k, v, what: str) -> None:
    expected_out, expected_w = reference_attention(q, k, v)
    if isinstance(result, torch.Tensor):
        if result.shape == expected_w.shape:
            raise CheckFailure(HINT_NO_V)
        raise CheckFailure(f"{HINT_TUPLE}; you returned a single {describe(result)}")
    expect(isinstance(result, (tuple, list)) and len(result) == 2,
           f"{HINT_TUPLE}; you returned {describe(result)}")
    output, weights = result
    weight_mistakes = _weight_mistakes(q, k)
    compare(weights, expected_w, what=f"the weights of {what}", mistakes=weight_mistakes)
    if isinstance(output, torch.Tensor) and output.shape == expected_w.shape and torch.allclose(output, weights):
        raise CheckFailure(HINT_NO_V)
    output_mistakes = {hint: w @ v for hint, w in weight_mistakes.items()}
    output_mistakes[HINT_NO_V] = expected_w
    output_mistakes[HINT_TIMES_K] = expected_w @ k
    compare(output, expected_out, what=f"the output of {what}", mistakes=output_mistakes)


@checker("scaled dot-product attention")
def check_attention(attention) -> None:
    """Check a learner's ``attention(q, k, v) -> (output, weights)``."""
    # query_pos != key_pos, d_k not a square and d_v != d_k, so every mistake gives a different tensor.
    q, k, v = seeded_randn(0, 2, 5, 6), seeded_randn(1, 2, 7, 6), seeded_randn(2, 2, 7, 3)
    _check_pair(call_learner(attention, q, k, v, name="attention"), q, k, v, "attention(q, k, v) on (2, 5, 6), (2, 7, 6), (2, 7, 3)")
    # One query and one key: the weight must be exactly 1 whatever the score.
    one = call_learner(attention, q[:, :1], k[:, :1], v[:, :1], name="attention")
    _check_pair(one, q[:, :1], k[:, :1], v[:, :1], "attention with a single key")
    # Leading dims: (batch, heads, pos, d), as multi-head attention will call it.
    q4, k4, v4 = seeded_randn(3, 2, 3, 4, 8), seeded_randn(4, 2, 3, 5, 8), seeded_randn(5, 2, 3, 5, 2)
    try:
        result = call_learner(attention, q4, k4, v4, name="attention")
    except CheckFailure as failure:
        if "not done yet" in str(failure):
            raise
        raise CheckFailure(f"{failure}. Hint: {HINT_BATCH}") from None
    _check_pair(result, q4, k4, v4, "attention on a 4-D batch (2, 3, 4, 8)")


HINT_SWAPPED_QK = "queries come from W_Q and keys from W_K; you swapped them (q = x @ W_K?)"
HINT_NO_PROJECTION = "project first: q = x @ W_Q, k = x @ W_K, v = x @ W_V; you attended over x itself"
HINT_V_FROM_WRONG = "the values are x @ W_V; you took them from another projection"
HINT_TRANSPOSED_W = (
    "W_Q, W_K, W_V have shape (d_model, d_head): multiply x @ W_Q (x has shape (batch, pos, d_model)), "
    "not x @ W_Q.T or W_Q @ x"
)


@checker("self-attention with Q, K, V projections")
def check_self_attention(self_attention) -> None:
    """Check a learner's ``self_attention(x, W_Q, W_K, W_V) -> output``."""
    x = seeded_randn(10, 2, 5, 6)
    W_Q, W_K, W_V = seeded_randn(11, 6, 4) / 2, seeded_randn(12, 6, 4) / 2, seeded_randn(13, 6, 3) / 2
    try:
        got = call_learner(self_attention, x, W_Q, W_K, W_V, name="self_attention")
    except CheckFailure as failure:
        if "not done yet" in str(failure):
            raise
        raise CheckFailure(f"{failure}. If that is a shape error: {HINT_TRANSPOSED_W}") from None
    if isinstance(got, (tuple, list)) and len(got) == 2:
        got = got[0]  # (output, weights) is fine too
    q, k, v = x @ W_Q, x @ W_K, x @ W_V
    expected, _ = reference_attention(q, k, v)
    compare(
        got,
        expected,
        what="self_attention(x, W_Q, W_K, W_V) with x (2, 5, 6), W_Q and W_K (6, 4), W_V (6, 3)",
        mistakes={
            HINT_NO_PROJECTION: reference_attention(x, x, x)[0],
            HINT_SWAPPED_QK: reference_attention(k, q, v)[0],
            HINT_V_FROM_WRONG: reference_attention(q, k, x @ W_Q)[0],
            "your keys and values both come from W_K; the values are x @ W_V": reference_attention(q, k, x @ W_K)[0],
            HINT_NO_SCALE: torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v,
            HINT_SCALE_BY_D: torch.softmax(q @ k.transpose(-2, -1) / 4, dim=-1) @ v,
            HINT_QUERY_AXIS: torch.softmax(q @ k.transpose(-2, -1) / 2, dim=-2) @ v,
            HINT_NO_V: reference_attention(q, k, v)[1],
        },
    )


# ----------------------------------------------------------------------------- probes


def _attention_inputs(rng: np.random.Generator) -> dict:
    batch, n_query, n_key = int(rng.integers(1, 4)), int(rng.integers(1, 8)), int(rng.integers(2, 9))
    d_head, d_v = int(rng.integers(2, 17)), int(rng.integers(1, 9))
    scale = float(rng.uniform(0.5, 3.0))  # varied magnitudes: a missing sqrt(d_k) shows at any size
    return {
        "q": (rng.standard_normal((batch, n_query, d_head)) * scale).astype(np.float32),
        "k": (rng.standard_normal((batch, n_key, d_head)) * scale).astype(np.float32),
        "v": rng.standard_normal((batch, n_key, d_v)).astype(np.float32),
    }


def _attention_reference(inputs: dict) -> dict:
    out, weights = reference_attention(*(torch.from_numpy(inputs[name]) for name in ("q", "k", "v")))
    return {"output": out.numpy(), "weights": weights.numpy()}


def _self_attention_inputs(rng: np.random.Generator) -> dict:
    batch, pos = int(rng.integers(1, 4)), int(rng.integers(2, 8))
    d_model, d_head, d_v = int(rng.integers(2, 13)), int(rng.integers(2, 9)), int(rng.integers(1, 9))
    return {
        "x": rng.standard_normal((batch, pos, d_model)).astype(np.float32),
        "W_Q": (rng.standard_normal((d_model, d_head)) / np.sqrt(d_model)).astype(np.float32),
        "W_K": (rng.standard_normal((d_model, d_head)) / np.sqrt(d_model)).astype(np.float32),
        "W_V": (rng.standard_normal((d_model, d_v)) / np.sqrt(d_model)).astype(np.float32),
    }


def _self_attention_reference(inputs: dict) -> dict:
    x, W_Q, W_K, W_V = (torch.from_numpy(inputs[name]) for name in ("x", "W_Q", "W_K", "W_V"))
    return {"output": reference_attention(x @ W_Q, x @ W_K, x @ W_V)[0].numpy()}


PROBES = {
    "check_attention": Probe(
        exercise="ex_attention",
        make_inputs=_attention_inputs,
        run=(
            "_result = attention(torch.from_numpy(inputs['q']), torch.from_numpy(inputs['k']), torch.from_numpy(inputs['v']))\n"
            "outputs = {'output': _result[0].detach().cpu().float().numpy(), 'weights': _result[1].detach().cpu().float().numpy()}\n"
            "del _result\n"
        ),
        reference=_attention_reference,
        forbidden=("tfedu.attention",),
    ),
    "check_self_attention": Probe(
        exercise="ex_self_attention",
        make_inputs=_self_attention_inputs,
        run=(
            "_result = self_attention(torch.from_numpy(inputs['x']), torch.from_numpy(inputs['W_Q']), "
            "torch.from_numpy(inputs['W_K']), torch.from_numpy(inputs['W_V']))\n"
            "_result = _result[0] if isinstance(_result, (tuple, list)) else _result\n"
            "outputs = {'output': _result.detach().cpu().float().numpy()}\n"
            "del _result\n"
        ),
        reference=_self_attention_reference,
        forbidden=("tfedu.attention",),
    ),
}

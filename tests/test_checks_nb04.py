"""The notebook-04 checkers pass correct answers and name the usual mistakes; the probes agree."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tfedu.attention import scaled_dot_product_attention
from tfedu.checks import nb04_attention as nb04
from tfedu.checks.core import CheckFailure, ExerciseNotDone

# ----------------------------------------------------------------------------- learner versions of attention


def correct(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


def via_torch(q, k, v):  # a different but right route: torch's fused kernel for the output
    weights = torch.softmax(torch.einsum("...qd,...kd->...qk", q, k) / q.shape[-1] ** 0.5, dim=-1)
    return F.scaled_dot_product_attention(q, k, v), weights


def no_scale(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    return weights @ v, weights


def scale_by_d(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1)
    return weights @ v, weights


def times_sqrt_d(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


def query_axis(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2)
    return weights @ v, weights


def forgot_v(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights, weights


def forgot_v_single(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)


def output_only(q, k, v):
    return correct(q, k, v)[0]


def times_k(q, k, v):
    weights = correct(q, k, v)[1]
    return weights @ k, weights


def transpose_1_2(q, k, v):  # right for 3-D inputs only
    weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


def stub(q, k, v):
    raise NotImplementedError


@pytest.mark.parametrize("impl", [correct, via_torch, lambda q, k, v: scaled_dot_product_attention(q, k, v)])
def test_attention_checker_passes_correct_versions(impl, capsys):
    nb04.check_attention(impl)
    assert "\N{CHECK MARK} scaled dot-product attention" in capsys.readouterr().out


@pytest.mark.parametrize(
    "impl, hint",
    [
        (no_scale, "missing 1/sqrt(d_k) scale"),
        (scale_by_d, "scaled by d_k instead of sqrt(d_k)"),
        (times_sqrt_d, "multiplied the scores by sqrt(d_k)"),
        (query_axis, "softmax over the wrong (query) axis"),
        (forgot_v, "forgot to multiply by V"),
        (forgot_v_single, "forgot to multiply by V"),
        (output_only, "return a pair (output, weights)"),
        (times_k, "multiplied the weights by k"),
        (transpose_1_2, "k.transpose(-2, -1)"),
    ],
)
def test_attention_checker_names_the_mistake(impl, hint):
    with pytest.raises(CheckFailure) as info:
        nb04.check_attention(impl)
    assert hint in str(info.value)
    assert not isinstance(info.value, ExerciseNotDone)


def test_attention_checker_says_not_done():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb04.check_attention(stub)


# ----------------------------------------------------------------------------- learner versions of self-attention


def self_attention_right(x, W_Q, W_K, W_V):
    return correct(x @ W_Q, x @ W_K, x @ W_V)[0]


def self_attention_pair(x, W_Q, W_K, W_V):
    return correct(x @ W_Q, x @ W_K, x @ W_V)


def self_attention_unprojected(x, W_Q, W_K, W_V):
    return correct(x, x, x)[0]


def self_attention_swapped(x, W_Q, W_K, W_V):
    return correct(x @ W_K, x @ W_Q, x @ W_V)[0]


def self_attention_v_from_q(x, W_Q, W_K, W_V):
    return correct(x @ W_Q, x @ W_K, x @ W_Q)[0]


def self_attention_transposed(x, W_Q, W_K, W_V):
    return correct(x @ W_Q.T, x @ W_K.T, x @ W_V.T)[0]


def self_attention_unscaled(x, W_Q, W_K, W_V):
    return no_scale(x @ W_Q, x @ W_K, x @ W_V)[0]


def self_attention_query_axis(x, W_Q, W_K, W_V):
    return query_axis(x @ W_Q, x @ W_K, x @ W_V)[0]


def self_attention_stub(x, W_Q, W_K, W_V):
    return stub(x, x, x)  # calls an unfinished attention


@pytest.mark.parametrize("impl", [self_attention_right, self_attention_pair])
def test_self_attention_checker_passes(impl, capsys):
    nb04.check_self_attention(impl)
    assert "\N{CHECK MARK}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "impl, hint",
    [
        (self_attention_unprojected, "project first"),
        (self_attention_swapped, "you swapped them"),
        (self_attention_v_from_q, "the values are x @ W_V"),
        (self_attention_transposed, "multiply x @ W_Q"),
        (self_attention_unscaled, "missing 1/sqrt(d_k) scale"),
        (self_attention_query_axis, "softmax over the wrong (query) axis"),
    ],
)
def test_self_attention_checker_names_the_mistake(impl, hint):
    with pytest.raises(CheckFailure) as info:
        nb04.check_self_attention(impl)
    assert hint in str(info.value)


def test_self_attention_checker_says_not_done():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb04.check_self_attention(self_attention_stub)


# ----------------------------------------------------------------------------- probes


def run_probe(probe, namespace, seed):
    inputs = probe.make_inputs(np.random.default_rng(seed))
    scope = {**namespace, "inputs": inputs, "np": np, "torch": torch}
    exec(probe.run, scope)
    return scope["outputs"], probe.reference(inputs)


def assert_same(outputs, expected, probe):
    assert outputs.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(outputs[key], expected[key], rtol=probe.rtol, atol=probe.atol)


def differs(outputs, expected, probe):
    return any(
        outputs[key].shape != expected[key].shape
        or not np.allclose(outputs[key], expected[key], rtol=probe.rtol, atol=probe.atol)
        for key in expected
    )


def test_every_check_cell_has_a_probe_that_forbids_the_reference():
    assert set(nb04.PROBES) == {"check_attention", "check_self_attention"}
    for grade_id, probe in nb04.PROBES.items():
        assert probe.exercise == "ex_" + grade_id.removeprefix("check_")
        assert probe.forbidden == ("tfedu.attention",)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("impl", [correct, via_torch])
def test_attention_probe_agrees_with_the_reference(seed, impl):
    probe = nb04.PROBES["check_attention"]
    outputs, expected = run_probe(probe, {"attention": impl}, seed)
    assert_same(outputs, expected, probe)
    for key, value in outputs.items():  # plain data only
        assert isinstance(value, np.ndarray), key


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("buggy", [no_scale, scale_by_d, query_axis, times_sqrt_d])
def test_attention_probe_catches_mistakes(seed, buggy):
    probe = nb04.PROBES["check_attention"]
    outputs, expected = run_probe(probe, {"attention": buggy}, seed)
    assert differs(outputs, expected, probe)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("impl", [self_attention_right, self_attention_pair])
def test_self_attention_probe_agrees_with_the_reference(seed, impl):
    probe = nb04.PROBES["check_self_attention"]
    outputs, expected = run_probe(probe, {"self_attention": impl}, seed)
    assert_same(outputs, expected, probe)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("buggy", [self_attention_swapped, self_attention_unscaled, self_attention_query_axis])
def test_self_attention_probe_catches_mistakes(seed, buggy):
    probe = nb04.PROBES["check_self_attention"]
    outputs, expected = run_probe(probe, {"self_attention": buggy}, seed)
    assert differs(outputs, expected, probe)


def test_probe_code_leaves_no_helper_names_behind():
    probe = nb04.PROBES["check_attention"]
    scope = {"attention": correct, "inputs": probe.make_inputs(np.random.default_rng(0)), "np": np, "torch": torch}
    exec(probe.run, scope)
    assert "_result" not in scope

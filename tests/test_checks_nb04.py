"""The notebook-04 checkers pass correct answers and name the usual mistakes; the probes agree."""

import math
import re
from pathlib import Path
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tfedu.attention import scaled_dot_product_attention
from tfedu.checks import nb04_attention as nb04
from tfedu.checks.core import CheckFailure, ExerciseNotDone, is_plain_data, run_probe

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


def dot_T(q, k, v):  # right for 2-D inputs only: .T reverses every dim of a 3-D tensor
    weights = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


def scale_by_query_pos(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-2]), dim=-1)
    return weights @ v, weights


def scale_by_key_pos(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-2]), dim=-1)
    return weights @ v, weights


def scale_by_d_v(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(v.shape[-1]), dim=-1)
    return weights @ v, weights


def scale_after_softmax(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1) / math.sqrt(q.shape[-1])
    return weights @ v, weights


def softmax_no_dim(q, k, v):  # F.softmax guesses dim 0 on 3-D input, and warns
    weights = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
    return weights @ v, weights


def softmax_dim_0(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=0)
    return weights @ v, weights


def swapped_pair(q, k, v):
    output, weights = correct(q, k, v)
    return weights, output


def mT(q, k, v):  # .mT is the right batched transpose
    weights = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


def stub(q, k, v):
    raise NotImplementedError


@pytest.mark.parametrize("impl", [correct, via_torch, mT, lambda q, k, v: scaled_dot_product_attention(q, k, v)])
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
        (transpose_1_2, "swap the last two axes of k, counted from the end"),
        (dot_T, "raises on 3-D ones (batch, pos, d): .T reverses every dim of a batched tensor; swap only the last two axes of k"),
        (scale_by_query_pos, "divided by sqrt(query_pos)"),
        (scale_by_key_pos, "divided by sqrt(key_pos)"),
        (scale_by_d_v, "divided by sqrt(d_v)"),
        (scale_after_softmax, "divided by sqrt(d_k) after the softmax"),
        (softmax_no_dim, "a softmax without dim= guesses the axis"),
        (softmax_dim_0, "softmax over dim 0, the batch axis"),
        (swapped_pair, "you returned (weights, output)"),
    ],
)
def test_attention_checker_names_the_mistake(impl, hint):
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        with pytest.raises(CheckFailure) as info:
            nb04.check_attention(impl)
    assert hint in str(info.value)
    assert not isinstance(info.value, ExerciseNotDone)
    assert not leaked, [str(w.message) for w in leaked]  # the checker keeps the learner's warnings to itself


def test_attention_checker_writes_nothing_to_stderr_in_a_fresh_process():
    # .T on a 3-D tensor warns only once per process, so only a fresh interpreter shows whether it leaks.
    script = textwrap.dedent('''
        import math, torch, torch.nn.functional as F
        from tfedu.checks import nb04_attention as nb04

        def dot_T(q, k, v):
            weights = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1)
            return weights @ v, weights

        def softmax_no_dim(q, k, v):
            weights = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
            return weights @ v, weights

        for impl in (dot_T, softmax_no_dim):
            try:
                nb04.check_attention(impl)
            except AssertionError as failure:
                print(failure)
    ''')
    done = subprocess.run([sys.executable, "-W", "default", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert ".T reverses every dim" in done.stdout and "without dim=" in done.stdout


def test_the_wrong_sizes_under_the_sqrt_are_told_apart():
    # The test shapes make query_pos, key_pos, d_k and d_v all different, so each wrong scale has its own tensor.
    q, k, v = nb04.seeded_randn(0, 2, 5, 6), nb04.seeded_randn(1, 2, 7, 6), nb04.seeded_randn(2, 2, 7, 3)
    tensors = list(nb04._weight_mistakes(q, k, v).values()) + [scaled_dot_product_attention(q, k, v)[1]]
    for i, a in enumerate(tensors):
        for b in tensors[i + 1:]:
            assert not torch.allclose(a, b, atol=1e-3)


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
    return stub(x, x, x)  # calls an unfinished helper that is not the notebook's attention


def self_attention_scaled_by_d_model(x, W_Q, W_K, W_V):
    q, k, v = x @ W_Q, x @ W_K, x @ W_V
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1]), dim=-1) @ v


def self_attention_typo(x, W_Q, W_K, W_V):  # raises, but not because of the weights' layout
    q, k, v = x @ W_Q, x @ W_K, x @ W_V
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])) @ v  # TypeError: no dim


def self_attention_reference(x, W_Q, W_K, W_V):
    return scaled_dot_product_attention(x @ W_Q, x @ W_K, x @ W_V)[0]


# ----------------------------------------------------------------------------- 4.2 on top of the learner's 4.1
# In the notebook, self_attention calls the learner's `attention` from exercise 4.1 (a global of
# the kernel). These helpers rebuild that situation: one namespace, both cells' code run in it.

SELF_ATTENTION_CELL = """
def self_attention(x, W_Q, W_K, W_V):
    q, k, v = x @ W_Q, x @ W_K, x @ W_V
    output, _ = attention(q, k, v)
    return output
"""
SELF_ATTENTION_WITH_REFERENCE = """
def self_attention(x, W_Q, W_K, W_V):
    return tfa.scaled_dot_product_attention(x @ W_Q, x @ W_K, x @ W_V)[0]
"""
SELF_ATTENTION_SWAPPED_CELL = """
def self_attention(x, W_Q, W_K, W_V):
    output, _ = attention(x @ W_K, x @ W_Q, x @ W_V)
    return output
"""
SELF_ATTENTION_STUB_CELL = """
def self_attention(x, W_Q, W_K, W_V):
    raise NotImplementedError
"""
ATTENTION_CELLS = {
    "right": """
def attention(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights
""",
    "stub": """
def attention(q, k, v):
    raise NotImplementedError
""",
    "unscaled": """
def attention(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    return weights @ v, weights
""",
    "dot_T": """
def attention(q, k, v):
    weights = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights
""",
    "transpose_1_2": """
def attention(q, k, v):  # right on 3-D input, wrong on 4-D
    weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights
""",
    "no_dim": """
def attention(q, k, v):
    weights = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
    return weights @ v, weights
""",
}


def notebook_self_attention(attention_cell, self_attention_cell):
    from tfedu import attention as tfa

    kernel = {"torch": torch, "math": math, "F": F, "tfa": tfa}
    exec(ATTENTION_CELLS[attention_cell], kernel)
    exec(self_attention_cell, kernel)
    return kernel["self_attention"]


@pytest.mark.parametrize("impl", [self_attention_right, self_attention_reference])
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
        (self_attention_scaled_by_d_model, "divided by sqrt(d_model)"),
    ],
)
def test_self_attention_checker_names_the_mistake(impl, hint):
    with pytest.raises(CheckFailure) as info:
        nb04.check_self_attention(impl)
    assert hint in str(info.value)
    assert "exercise 4.1" not in str(info.value)


@pytest.mark.parametrize(
    "impl, hint",
    [
        (self_attention_pair, "you returned the (output, weights) pair from attention; return only the output"),
        (lambda x, W_Q, W_K, W_V: list(correct(x @ W_Q, x @ W_K, x @ W_V)), "return only the output"),
        (lambda x, W_Q, W_K, W_V: correct(x @ W_Q, x @ W_K, x @ W_V)[0].numpy(), "should return one torch.Tensor (batch, pos, d_v), got array"),
        (lambda x, W_Q, W_K, W_V: correct(x @ W_Q, x @ W_K, x @ W_V)[0].tolist(), "should return one torch.Tensor"),
    ],
)
def test_self_attention_must_return_exactly_the_output_tensor(impl, hint):
    """The exercise says self_attention returns the output (batch, pos, d_v); a pair or an array is not that."""
    with pytest.raises(CheckFailure, match=re.escape(hint)):
        nb04.check_self_attention(impl)


@pytest.mark.parametrize(
    "impl, hint",
    [
        (lambda q, k, v: list(correct(q, k, v)), "you returned a list: make it a tuple"),
        (lambda q, k, v: tuple(t.detach().numpy() for t in correct(q, k, v)), "should be a torch.Tensor, got array"),
        (lambda q, k, v: (correct(q, k, v)[0], correct(q, k, v)[1].numpy()), "the weights of attention"),
    ],
)
def test_attention_must_return_a_tuple_of_two_tensors(impl, hint):
    with pytest.raises(CheckFailure, match=re.escape(hint)):
        nb04.check_attention(impl)


def test_transposed_weights_hint_only_when_the_shapes_point_to_it():
    with pytest.raises(CheckFailure) as info:
        nb04.check_self_attention(self_attention_transposed)
    assert nb04.HINT_TRANSPOSED_W in str(info.value)
    with pytest.raises(CheckFailure) as info:
        nb04.check_self_attention(self_attention_typo)
    assert "TypeError" in str(info.value)
    assert "x @ W_Q.T" not in str(info.value)


@pytest.mark.parametrize("attention_cell", ["right", "stub", "unscaled", "dot_T"])
def test_self_attention_on_the_reference_passes_whatever_4_1_is(attention_cell, capsys):
    nb04.check_self_attention(notebook_self_attention(attention_cell, SELF_ATTENTION_WITH_REFERENCE))
    assert "\N{CHECK MARK}" in capsys.readouterr().out


def test_self_attention_on_the_learner_attention_passes_when_4_1_is_right(capsys):
    nb04.check_self_attention(notebook_self_attention("right", SELF_ATTENTION_CELL))
    assert "\N{CHECK MARK}" in capsys.readouterr().out


def test_unfinished_4_1_is_blamed_not_4_2():
    with pytest.raises(CheckFailure) as info:
        nb04.check_self_attention(notebook_self_attention("stub", SELF_ATTENTION_CELL))
    assert not isinstance(info.value, ExerciseNotDone)  # 4.2 itself is written
    assert "your attention from exercise 4.1, which is not done yet: fix 4.1 first" in str(info.value)


@pytest.mark.parametrize(
    "attention_cell, hint_4_1",
    [
        ("unscaled", "missing 1/sqrt(d_k) scale"),
        ("dot_T", ".T reverses every dim"),
        ("no_dim", "without dim="),
    ],
)
def test_wrong_4_1_is_blamed_not_4_2(attention_cell, hint_4_1):
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        with pytest.raises(CheckFailure) as info:
            nb04.check_self_attention(notebook_self_attention(attention_cell, SELF_ATTENTION_CELL))
    message = str(info.value)
    assert "your attention from exercise 4.1, which is wrong: fix 4.1 first" in message
    assert hint_4_1 in message
    assert not leaked, [str(w.message) for w in leaked]


def test_a_4_2_mistake_on_a_right_4_1_is_named_as_4_2():
    with pytest.raises(CheckFailure) as info:
        nb04.check_self_attention(notebook_self_attention("right", SELF_ATTENTION_SWAPPED_CELL))
    assert nb04.HINT_SWAPPED_QK in str(info.value) and "4.1" not in str(info.value)


def test_a_4_2_mistake_on_a_wrong_4_1_names_both():
    self_attention = notebook_self_attention("unscaled", SELF_ATTENTION_SWAPPED_CELL)
    learner_attention = self_attention.__globals__["attention"]
    with pytest.raises(CheckFailure) as info:
        nb04.check_self_attention(self_attention)
    message = str(info.value)
    assert message.index(nb04.HINT_SWAPPED_QK) < message.index("Also, your self_attention calls your attention from exercise 4.1")
    assert "missing 1/sqrt(d_k) scale" in message
    assert self_attention.__globals__["attention"] is learner_attention  # the learner's binding is back


def test_a_4_1_bug_that_4_2_never_meets_does_not_fail_4_2(capsys):
    nb04.check_self_attention(notebook_self_attention("transpose_1_2", SELF_ATTENTION_CELL))
    assert "\N{CHECK MARK}" in capsys.readouterr().out


def test_both_unfinished_is_4_2_not_done():
    # The student version: both answers are stubs; 4.2's own stub raises first.
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb04.check_self_attention(notebook_self_attention("stub", SELF_ATTENTION_STUB_CELL))


def test_self_attention_checker_says_not_done():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb04.check_self_attention(self_attention_stub)


# ----------------------------------------------------------------------------- probes



def assert_same(outputs, expected, probe):
    """The grader's verdict: the probe's own comparison (return type, values, gradients)."""
    assert outputs["returned"] == expected["returned"]
    assert probe.compare(outputs, expected) is None


def differs(outputs, expected, probe):
    return probe.compare(outputs, expected) is not None


def test_every_check_cell_has_a_probe():
    assert set(nb04.PROBES) == {"check_attention", "check_self_attention"}
    for grade_id, probe in nb04.PROBES.items():
        assert probe.exercise == "ex_" + grade_id.removeprefix("check_")
    # 4.1 rebuilds the reference, so it may not use it; 4.2 is about the projections and may call
    # either the learner's attention or the reference scaled_dot_product_attention.
    assert nb04.PROBES["check_attention"].forbidden[:3] == (
        "tfedu.attention", "torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward")
    assert nb04.PROBES["check_self_attention"].forbidden == ()


def test_the_grader_scan_lets_4_2_use_the_reference_but_not_4_1():
    from tfedu.checks.scan import scan_answer

    context = ["from tfedu import attention as tfa"]  # the notebook's import cell
    uses_reference = "def self_attention(x, W_Q, W_K, W_V):\n    return tfa.scaled_dot_product_attention(x @ W_Q, x @ W_K, x @ W_V)[0]\n"
    assert scan_answer(uses_reference, context=context, forbidden=nb04.PROBES["check_self_attention"].forbidden) == []
    cheats = "def attention(q, k, v):\n    return tfa.scaled_dot_product_attention(q, k, v)\n"
    assert scan_answer(cheats, context=context, forbidden=nb04.PROBES["check_attention"].forbidden)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("impl", [correct, via_torch])
def test_attention_probe_agrees_with_the_reference(seed, impl):
    probe = nb04.PROBES["check_attention"]
    outputs, expected = run_probe(probe, {"attention": impl}, seed)
    assert_same(outputs, expected, probe)
    assert is_plain_data(outputs)  # plain data only: arrays, gradients, and words for what came back


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "buggy",
    [no_scale, scale_by_d, query_axis, times_sqrt_d, scale_by_query_pos, scale_by_key_pos, scale_by_d_v,
     scale_after_softmax, swapped_pair, softmax_dim_0],
)
def test_attention_probe_catches_mistakes(seed, buggy):
    probe = nb04.PROBES["check_attention"]
    outputs, expected = run_probe(probe, {"attention": buggy}, seed)
    assert differs(outputs, expected, probe)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("impl", [self_attention_right, self_attention_reference])
def test_self_attention_probe_agrees_with_the_reference(seed, impl):
    probe = nb04.PROBES["check_self_attention"]
    outputs, expected = run_probe(probe, {"self_attention": impl}, seed)
    assert_same(outputs, expected, probe)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "buggy", [self_attention_swapped, self_attention_unscaled, self_attention_query_axis, self_attention_scaled_by_d_model]
)
def test_self_attention_probe_catches_mistakes(seed, buggy):
    probe = nb04.PROBES["check_self_attention"]
    outputs, expected = run_probe(probe, {"self_attention": buggy}, seed)
    assert differs(outputs, expected, probe)


@pytest.mark.parametrize(
    "grade_id, namespace, message",
    [
        ("check_self_attention", {"self_attention": self_attention_pair}, "return only the output tensor"),
        ("check_self_attention", {"self_attention": lambda *a: self_attention_right(*a).detach().numpy()},
         "should return tensor, it returned ndarray"),
        ("check_attention", {"attention": lambda q, k, v: list(correct(q, k, v))},
         "should return a tuple of two tensors, it returned list of Tensor, Tensor"),
        ("check_attention", {"attention": lambda q, k, v: tuple(t.detach().numpy() for t in correct(q, k, v))},
         "it returned tuple of ndarray, ndarray"),
    ],
)
def test_probes_demand_the_return_type_the_exercise_states(grade_id, namespace, message):
    probe = nb04.PROBES[grade_id]
    outputs, expected = run_probe(probe, namespace, seed=0)
    assert message in probe.compare(outputs, expected)


def test_probe_code_leaves_no_helper_names_behind():
    probe = nb04.PROBES["check_attention"]
    scope = {"attention": correct, "inputs": probe.make_inputs(np.random.default_rng(0)), "np": np, "torch": torch}
    exec(probe.run, scope)
    assert "_result" not in scope


# ----------------------------------------------------------------------------- the switch in the notebook

NOTEBOOK_04 = Path(__file__).resolve().parents[1] / "notebooks" / "04_attention.ipynb"
SWITCH_OFF, SWITCH_ON = "USE_MY_ATTENTION = False", "USE_MY_ATTENTION = True"


def test_the_switch_runs_sections_5_and_6_with_the_learners_attention():
    """With the switch on, the notebook's solution to exercise 4.1 drives sections 5 and 6, which still pass."""
    import IPython  # noqa: F401  (import the package fully before its input transformer)
    import matplotlib.pyplot as plt
    from IPython.core.inputtransformer2 import TransformerManager

    from tfedu.course import nbtools

    nb = nbtools.read(NOTEBOOK_04)
    assert sum(SWITCH_OFF in cell.source for cell in nb.cells) == 1  # released default: the reference
    namespace: dict = {"__name__": "__main__"}
    calls: list[int] = []
    calls_before_switch = None
    try:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            source = TransformerManager().transform_cell(cell.source.replace(SWITCH_OFF, SWITCH_ON))
            exec(compile(source, f"04_attention.ipynb cell {index}", "exec"), namespace)
            if (nbtools.nbgrader_meta(cell) or {}).get("grade_id") == "ex_attention":
                solution = namespace["attention"]

                def counted(q, k, v, _solution=solution):
                    calls.append(q.dim())
                    return _solution(q, k, v)

                namespace["attention"] = counted
            if SWITCH_OFF in cell.source:
                calls_before_switch = len(calls)
    finally:
        plt.close("all")
    assert namespace["USE_MY_ATTENTION"] is True and namespace["attend"] is namespace["attention"]
    after = calls[calls_before_switch:]
    assert len(after) >= 5 and 3 in after  # permutation, dog/man and the batched (3-D) demo all used it

"""Checkers and probes of notebook 05: each passes the reference and names realistic mistakes."""

import math

import einops
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tfedu import attention as reference
from tfedu.checks import nb05_masks_and_heads as nb05
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe

# ----------------------------------------------------------------------------- causal mask


def good_causal_mask(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_causal_mask_reference_passes(capsys, typechecked):
    checked = typechecked(reference.causal_mask)
    nb05.check_causal_mask(lambda n: checked(n, n))
    nb05.check_causal_mask(good_causal_mask)
    assert "\N{CHECK MARK} causal mask" in capsys.readouterr().out


@pytest.mark.parametrize(
    "buggy, match",
    [
        (lambda n: torch.ones(n, n, dtype=torch.bool).triu(), "hides the past"),
        (lambda n: torch.ones(n, n, dtype=torch.bool).tril(-1), "attend to itself"),
        (lambda n: torch.ones(n, n, dtype=torch.bool).triu(1), "True where attention is forbidden"),
        (lambda n: ~torch.ones(n, n, dtype=torch.bool).tril(), "True where attention is forbidden"),
        (lambda n: torch.ones(n, n).tril(), "the right pattern but dtype torch.float32"),
        (lambda n: torch.full((n, n), float("-inf")).triu(1), "additive float mask"),
        (lambda n: torch.ones(n, n, dtype=torch.bool), "True everywhere"),
        (lambda n: torch.ones(n, n + 1, dtype=torch.bool).tril(), r"shape \(5, 6\), expected \(5, 5\)"),
        (lambda n: torch.ones(n, n, dtype=torch.bool).tril(1), r"lets query i see key i \+ 1.*keep the diagonal and nothing above it"),
    ],
    ids=["transposed", "no-diagonal", "masked-convention", "inverted", "float", "additive", "all-true", "shape",
         "shifted"],
)
def test_causal_mask_mistakes_are_named(buggy, match):
    with pytest.raises(CheckFailure, match=match):
        nb05.check_causal_mask(buggy)


def test_causal_mask_not_done():
    def causal_mask(n):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb05.check_causal_mask(causal_mask)


# ----------------------------------------------------------------------------- masked attention


def make_masked_attention(*, where="before", fill=float("-inf"), invert=False, scale=True, dim=-1, returns="pair"):
    """A learner's masked_attention, with one switch per mistake."""

    def masked_attention(q, k, v, mask):
        scores = (q @ k.T) if returns == "dot-T" else q @ k.transpose(-2, -1)
        if scale == "no-sqrt":
            scores = scores / q.shape[-1]
        elif scale:
            scores = scores / math.sqrt(q.shape[-1])
        hidden = mask if invert else ~mask
        if where == "before":
            scores = scores.masked_fill(hidden, fill)
        weights = torch.softmax(scores, dim=dim)
        if where == "after":
            weights = weights.masked_fill(hidden, 0.0)
        if where == "after-inf":
            weights = weights.masked_fill(hidden, float("-inf"))
        if returns == "swapped":
            return weights, weights @ v
        if returns == "mix-transposed":
            return weights.transpose(-2, -1) @ v, weights
        return weights @ v, weights

    return masked_attention


def test_masked_attention_reference_and_variants_pass(capsys, typechecked):
    nb05.check_masked_attention(typechecked(reference.scaled_dot_product_attention))
    nb05.check_masked_attention(make_masked_attention())
    nb05.check_masked_attention(make_masked_attention(fill=-1e9))
    nb05.check_masked_attention(lambda q, k, v, mask: (F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                                       reference.attention_weights(q, k, mask)))
    assert "\N{CHECK MARK} masked attention" in capsys.readouterr().out


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"where": "after"}, "you masked after the softmax"),
        ({"where": "after-inf"}, "BEFORE the softmax"),
        ({"invert": True}, "True = may attend"),
        ({"invert": True, "fill": -1e9}, "True = may attend"),
        ({"where": "nowhere"}, "the mask had no effect"),
        ({"fill": 0.0}, "exp\\(0\\) = 1"),
        ({"scale": False}, "missing 1/sqrt"),
        ({"dim": -2}, "wrong \\(query\\) axis"),
        ({"scale": "no-sqrt"}, "you divided the scores by d_k; the scale is 1/sqrt\\(d_k\\)"),
        ({"returns": "swapped"}, "return them in the order \\(output, weights\\)"),
        ({"returns": "mix-transposed"}, "the output is weights @ v, without transposing"),
        ({"returns": "dot-T"}, "raised RuntimeError.*swap only the keys' last two axes \\(\\.T reverses every axis"),
    ],
    ids=["after", "after-inf", "inverted", "inverted-finite", "ignored", "fill-zero", "no-scale", "query-axis",
         "scale-no-sqrt", "swapped-pair", "mix-transposed", "dot-T"],
)
@pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")  # the dot-T learner's own deprecation warning
def test_masked_attention_mistakes_are_named(kwargs, match):
    with pytest.raises(CheckFailure, match=match):
        nb05.check_masked_attention(make_masked_attention(**kwargs))


def mutating_masked_attention(q, k, v, mask):
    """Right numbers, but it divides the caller's q in place."""
    q /= math.sqrt(q.shape[-1])
    weights = torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf")), dim=-1)
    return weights @ v, weights


def mask_flipping_masked_attention(q, k, v, mask):
    """Right numbers, but it inverts the caller's mask in place."""
    hidden = mask.logical_not_()
    weights = torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(hidden, float("-inf")), dim=-1)
    return weights @ v, weights


@pytest.mark.parametrize("buggy, name", [(mutating_masked_attention, "q"), (mask_flipping_masked_attention, "mask")])
def test_masked_attention_that_mutates_its_input_is_told_so(buggy, name):
    """Before this hint, these got 'missing 1/sqrt' and 'True = may attend': the reference saw the mutated inputs."""
    with pytest.raises(CheckFailure, match=f"changed its input `{name}` in place"):
        nb05.check_masked_attention(buggy)


def test_masked_attention_indexing_with_a_broadcast_mask_is_pointed_to_masked_fill():
    def indexing(q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores[~mask] = float("-inf")  # IndexError: a (6, 6) mask cannot index (2, 6, 6) scores
        weights = torch.softmax(scores, dim=-1)
        return weights @ v, weights

    with pytest.raises(CheckFailure, match=r"raised IndexError.*which an out-of-place masked fill accepts"):
        nb05.check_masked_attention(indexing)


def test_masked_attention_must_return_a_pair():
    with pytest.raises(CheckFailure, match="return a pair"):
        nb05.check_masked_attention(lambda q, k, v, mask: make_masked_attention()(q, k, v, mask)[0])


@pytest.mark.parametrize(
    "returns, match",
    [
        (lambda pair: list(pair), "you returned a list: make it a tuple"),
        (lambda pair: tuple(t.numpy() for t in pair), "the output of .* should be a torch.Tensor, got array"),
    ],
)
def test_masked_attention_must_return_a_tuple_of_two_tensors(returns, match):
    with pytest.raises(CheckFailure, match=match):
        nb05.check_masked_attention(lambda q, k, v, mask: returns(make_masked_attention()(q, k, v, mask)))


# ----------------------------------------------------------------------------- multi-head attention


def make_mha(bug=None):
    """A learner's MultiHeadAttention written the way the notebook asks, with an optional bug."""

    class MultiHeadAttention(nn.Module):
        def __init__(self, d_model, n_heads):
            super().__init__()
            self.n_heads, self.d_head, self.d_model = n_heads, d_model // n_heads, d_model
            self.W_Q, self.W_K = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
            self.W_V, self.W_O = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

        def split(self, t, pos=None):
            b, p, _ = t.shape
            if bug == "context-len-view":  # every split sized with x's length, as if key_pos == query_pos
                return t.view(b, pos, self.n_heads, self.d_head).transpose(1, 2)
            if bug == "heads-not-moved":
                return einops.rearrange(t, "b p (h d) -> b p h d", h=self.n_heads)
            if bug == "view-split":
                return t.view(b, self.n_heads, p, self.d_head)
            if bug in ("interleaved", "interleaved-split"):
                return einops.rearrange(t, "b p (d h) -> b h p d", h=self.n_heads)
            if bug == "pos-split":
                return einops.rearrange(t, "b (h p) d -> b h p d", h=self.n_heads)
            return t.view(b, p, self.n_heads, self.d_head).transpose(1, 2)

        def merge(self, z):
            b, _, p, _ = z.shape
            if bug == "view-split":
                return z.reshape(b, -1, self.d_model)
            if bug == "view-merge":
                return z.reshape(b, p, self.n_heads * self.d_head)
            if bug in ("interleaved", "interleaved-merge"):
                return einops.rearrange(z, "b h p d -> b p (d h)")
            if bug == "pos-split":
                return einops.rearrange(z, "b h p d -> b (h p) d")
            if bug == "heads-not-moved":
                return einops.rearrange(z, "b p h d -> b p (h d)")
            return einops.rearrange(z, "b h p d -> b p (h d)")

        def forward(self, x, context=None, mask=None):
            context = x if context is None else context
            if bug == "keys-from-x":
                context = x
            pos = x.shape[1]
            q, k, v = (self.split(self.W_Q(x), pos), self.split(self.W_K(context), pos), self.split(self.W_V(context), pos))
            scores = q @ k.transpose(-2, -1)
            if mask is not None and bug == "mask-unsqueeze":
                mask = mask.unsqueeze(1)  # "add a head axis": wrong, the mask already broadcasts
            if bug == "scale-no-sqrt":
                scores = scores / self.d_head
            elif bug == "scale-d-model":
                scores = scores / math.sqrt(self.d_model)
            elif bug != "no-scale":
                scores = scores / math.sqrt(q.shape[-1])
            if mask is not None and bug == "mask-inverted":
                scores = scores.masked_fill(mask, float("-inf"))
            elif mask is not None and bug not in ("mask-after", "mask-ignored"):
                scores = scores.masked_fill(~mask, float("-inf"))
            pattern = scores.softmax(dim=-2 if bug == "query-axis" else -1)
            if mask is not None and bug == "mask-after":
                pattern = pattern * mask
            z = self.merge(pattern @ v)
            if bug == "tuple":
                return self.W_O(z), pattern
            if bug == "ndarray":
                return self.W_O(z).detach().numpy()
            return z if bug == "no-W_O" else self.W_O(z)

    return MultiHeadAttention


def test_mha_reference_and_learner_solution_pass(capsys):
    nb05.check_multi_head_attention(lambda d_model, n_heads: reference.MultiHeadAttention(d_model, n_heads))
    nb05.check_multi_head_attention(make_mha())
    assert "\N{CHECK MARK} multi-head attention" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bug, match",
    [
        ("view-split", r"a view \(or reshape\) to \(batch, n_heads, pos, d_head\) straight from"),
        ("view-merge", "concatenation wrong"),
        ("interleaved", "heads split along the wrong axis: '\\(d_head n_heads\\)'.*both times"),
        ("interleaved-split", "heads split along the wrong axis: '\\(d_head n_heads\\)'"),
        ("interleaved-merge", "concatenation order wrong"),
        ("pos-split", "you cut the pos axis"),
        ("no-W_O", "missing W_O"),
        ("scale-d-model", "sqrt\\(d_model\\)"),
        ("no-scale", "missing 1/sqrt\\(d_head\\)"),
        ("query-axis", "wrong \\(query\\) axis"),
        ("mask-after", "you masked after the softmax"),
        ("mask-inverted", "True = may attend"),
        ("mask-ignored", "the mask had no effect"),
        ("keys-from-x", "come from `context`"),
        ("tuple", "return only the output"),
        ("ndarray", "return only the output tensor.*returned array"),
        ("scale-no-sqrt", "you divided the scores by d_head; the scale is 1/sqrt\\(d_head\\)"),
        ("heads-not-moved", "your attention ran across the heads"),
        ("mask-unsqueeze", "raised RuntimeError.*the mask arrives already broadcastable to the scores"),
        ("context-len-view", r"raised RuntimeError.*keys and values have the context's length key_pos"),
    ],
)
def test_mha_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb05.check_multi_head_attention(make_mha(bug))


def test_mha_against_torch_passes_the_reference_and_catches_a_bug(capsys):
    """check_against_torch compares with nn.MultiheadAttention and F.scaled_dot_product_attention directly."""
    nb05.check_against_torch(lambda d_model, n_heads: reference.MultiHeadAttention(d_model, n_heads))
    nb05.check_against_torch(make_mha())
    for bug in ("mask-after", "no-W_O", "interleaved"):
        with pytest.raises(CheckFailure, match="against nn.MultiheadAttention"):
            nb05.check_against_torch(make_mha(bug))


def test_mha_that_mutates_x_is_told_so():
    class Mutating(make_mha()):
        def forward(self, x, context=None, mask=None):
            out = super().forward(x, context, mask)
            x.zero_()  # "free" the input
            return out

    with pytest.raises(CheckFailure, match="changed its input `x` in place"):
        nb05.check_multi_head_attention(Mutating)


def test_mha_with_renamed_layers_is_told_to_keep_them():
    class Renamed(nn.Module):
        def __init__(self, d_model, n_heads):
            super().__init__()
            self.q = nn.Linear(d_model, d_model)

        def forward(self, x, context=None, mask=None):
            return x

    with pytest.raises(CheckFailure, match="keep the layers made in __init__: self.W_Q"):
        nb05.check_multi_head_attention(Renamed)


def test_mha_not_done():
    class Stub(make_mha()):
        def forward(self, x, context=None, mask=None):
            raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb05.check_multi_head_attention(Stub)


@pytest.mark.parametrize("with_mask", [False, True])
def test_variant_defaults_equal_reference_and_nn_multihead_attention(with_mask):
    """multi_head_variant at its defaults is the reference, and both match torch's layer (the oracle)."""
    layer = nb05.make_reference_layer(3)
    x = torch.randn(2, 6, nb05.D_MODEL, generator=torch.Generator().manual_seed(0))
    mask = reference.causal_mask(6, 6) if with_mask else None
    torch_layer = nn.MultiheadAttention(nb05.D_MODEL, nb05.N_HEADS, batch_first=True)
    with torch.no_grad():
        torch_layer.in_proj_weight.copy_(torch.cat([layer.W_Q.weight, layer.W_K.weight, layer.W_V.weight]))
        torch_layer.in_proj_bias.copy_(torch.cat([layer.W_Q.bias, layer.W_K.bias, layer.W_V.bias]))
        torch_layer.out_proj.weight.copy_(layer.W_O.weight)
        torch_layer.out_proj.bias.copy_(layer.W_O.bias)
        expected, _ = torch_layer(x, x, x, attn_mask=None if mask is None else ~mask)
        torch.testing.assert_close(nb05.multi_head_variant(layer, x, mask=mask), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x, mask=mask), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- probes



def agree(probe, outputs, expected):
    if probe.compare is not None:
        return probe.compare(outputs, expected) is None
    return outputs.keys() == expected.keys() and all(
        np.asarray(outputs[key]).shape == np.asarray(expected[key]).shape
        and np.allclose(outputs[key], expected[key], rtol=probe.rtol, atol=probe.atol)
        for key in expected
    )


GOOD = {
    "check_causal_mask": {"causal_mask": good_causal_mask},
    "check_masked_attention": {"masked_attention": make_masked_attention()},
    "check_multi_head_attention": {"MultiHeadAttention": make_mha()},
}
BAD = {
    "check_causal_mask": [
        {"causal_mask": lambda n: torch.ones(n, n, dtype=torch.bool).triu(1)},
        {"causal_mask": lambda n: torch.ones(n, n).tril()},
        {"causal_mask": lambda n: torch.ones(n, n, dtype=torch.bool).tril(-1)},
    ],
    "check_masked_attention": [
        {"masked_attention": make_masked_attention(where="after")},
        {"masked_attention": make_masked_attention(scale=False)},
        {"masked_attention": make_masked_attention(fill=0.0)},
    ],
    "check_multi_head_attention": [
        {"MultiHeadAttention": make_mha("view-merge")},
        {"MultiHeadAttention": make_mha("no-W_O")},
        {"MultiHeadAttention": make_mha("mask-after")},
        {"MultiHeadAttention": make_mha("keys-from-x")},
    ],
}


def test_every_check_cell_has_a_probe():
    assert set(nb05.PROBES) == set(GOOD) == set(BAD)
    for grade_id, probe in nb05.PROBES.items():
        assert probe.exercise == grade_id.replace("check_", "ex_")
        assert probe.forbidden == ("tfedu.attention",)


@pytest.mark.parametrize("grade_id", sorted(GOOD))
@pytest.mark.parametrize("seed", range(6))
def test_probe_agrees_with_reference(grade_id, seed):
    probe = nb05.PROBES[grade_id]
    outputs, expected = run_probe(probe, GOOD[grade_id], seed)
    assert agree(probe, outputs, expected), grade_id
    assert outputs["returned"] == expected["returned"]


@pytest.mark.parametrize(
    "grade_id, namespace, message",
    [
        ("check_causal_mask", {"causal_mask": lambda n: good_causal_mask(n).numpy()}, "should return a torch.Tensor, it returned ndarray"),
        ("check_masked_attention", {"masked_attention": lambda *a: list(make_masked_attention()(*a))},
         "should return a tuple of two tensors, it returned list of Tensor, Tensor"),
        ("check_multi_head_attention", {"MultiHeadAttention": make_mha("tuple")}, "should return tensor, it returned a tuple"),
        ("check_multi_head_attention", {"MultiHeadAttention": make_mha("ndarray")}, "should return tensor, it returned ndarray"),
    ],
)
def test_probes_demand_the_return_type_the_exercise_states(grade_id, namespace, message):
    probe = nb05.PROBES[grade_id]
    outputs, expected = run_probe(probe, namespace, seed=0)
    assert message in probe.compare(outputs, expected)


def test_probe_inputs_are_plain_data():
    for probe in nb05.PROBES.values():
        inputs = probe.make_inputs(np.random.default_rng(0))
        assert all(isinstance(v, (int, float, str, list, dict, np.ndarray)) for v in inputs.values())


@pytest.mark.parametrize("grade_id", sorted(BAD))
def test_probe_catches_buggy_versions(grade_id):
    probe = nb05.PROBES[grade_id]
    for namespace in BAD[grade_id]:
        caught = 0
        for seed in range(6):
            try:
                outputs, expected = run_probe(probe, namespace, seed)
            except Exception:  # a crash in the student's kernel is a failure too
                caught += 1
                continue
            caught += not agree(probe, outputs, expected)
        assert caught >= 4, (grade_id, namespace)

"""Checkers and probes of notebook 07: each passes the reference and names realistic mistakes."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tfedu import layers
from tfedu.checks import nb07_transformer_block as nb07
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe, standin_objects
from tfedu.config import ModelConfig, preset
from tfedu.flops import flops_per_token, param_count
from tfedu.checks.scan import scan_answer
from tfedu.model import GPT

import checker_helpers

# The solution cells as the notebook will hold them (between ### BEGIN SOLUTION / ### END SOLUTION).
SOLUTIONS = {
    "ex_ffn": '''\
class FFN(nn.Module):
    def __init__(self, d_model, activation="gelu", multiple_of=1):
        super().__init__()
        self.activation = activation
        if activation == "swiglu":
            third = 8 * d_model // 3
            self.d_mlp = (third + multiple_of - 1) // multiple_of * multiple_of
            self.W_gate = nn.Linear(d_model, self.d_mlp, bias=False)
            self.W_in = nn.Linear(d_model, self.d_mlp, bias=False)
            self.W_out = nn.Linear(self.d_mlp, d_model, bias=False)
        else:
            self.d_mlp = 4 * d_model
            self.W_in = nn.Linear(d_model, self.d_mlp)
            self.W_out = nn.Linear(self.d_mlp, d_model)

    def forward(self, x):
        if self.activation == "swiglu":
            return self.W_out(F.silu(self.W_gate(x)) * self.W_in(x))
        approximate = "tanh" if self.activation == "gelu_tanh" else "none"
        return self.W_out(F.gelu(self.W_in(x), approximate=approximate))
''',
    "ex_layer_norm": '''\
def layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(dim=-1, keepdim=True)                    # ... 1
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)     # ... 1, biased: divide by d_model
    x_hat = (x - mean) / torch.sqrt(var + eps)             # ... d_model, eps inside the root
    return x_hat * weight + bias
''',
    "ex_rms_norm": '''\
def rms_norm(x, weight, eps=1e-6):
    mean_square = (x * x).mean(dim=-1, keepdim=True)  # ... 1: no centring
    return x * torch.rsqrt(mean_square + eps) * weight
''',
    "ex_pre_norm_block": '''\
def pre_norm_block(resid, ln1, attn, ln2, mlp):
    resid_mid = resid + attn(ln1(resid))         # tokens gather from earlier tokens
    resid_post = resid_mid + mlp(ln2(resid_mid))  # each position on its own
    return resid_post
''',
    "ex_gpt_forward": '''\
def gpt_forward(ids, W_E, W_pos, blocks, ln_final):
    resid = W_E[ids] + W_pos[: ids.shape[1]]  # batch pos d_model
    for block in blocks:
        resid = block(resid)
    return ln_final(resid) @ W_E.T  # batch pos d_vocab
''',
    "ex_gpt2_param_count": '''\
def gpt2_param_count(d_vocab, n_ctx, d_model, n_layers):
    d_mlp = 4 * d_model
    embedding = d_vocab * d_model                    # W_E; W_U = W_E.T is the same matrix
    positions = n_ctx * d_model                      # one learned vector per position
    attention = 4 * d_model * d_model + 4 * d_model  # W_Q, W_K, W_V, W_O and their biases
    mlp = 2 * d_model * d_mlp + d_mlp + d_model      # W_in, W_out and their biases
    norms = 2 * (2 * d_model)                        # ln1, ln2: a gain and a bias each
    final_norm = 2 * d_model
    return embedding + positions + n_layers * (attention + mlp + norms) + final_norm
''',
}
SOLUTIONS["ex_gpt2_forward_flops"] = '''\
def gpt2_forward_flops(d_vocab, n_ctx, d_model, n_layers):
    d = d_model
    projections = 2 * 4 * d * d      # W_Q, W_K, W_V, W_O
    ffn = 2 * 2 * d * (4 * d)        # W_in and W_out
    mechanism = 2 * 2 * n_ctx * d    # scores and the weighted sum, over n_ctx keys
    return n_layers * (projections + ffn + mechanism) + 2 * d * d_vocab  # + the tied unembedding
'''
NOTEBOOK_CONTEXT = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\nimport math, einops, regex"


def solution(grade_id, **names):
    namespace = {"torch": torch, "F": F, "nn": nn, "math": math, **names}
    exec(SOLUTIONS[grade_id], namespace)
    return namespace


# ----------------------------------------------------------------------------- 7.1 FFN


def make_ffn(bug=None):
    """A learner's FFN class, written the way the notebook asks, with one switch per mistake."""

    class FFN(nn.Module):
        def __init__(self, d_model, activation="gelu", multiple_of=1):
            super().__init__()
            self.activation = activation
            swiglu = activation == "swiglu"
            if swiglu:
                third = 8 * d_model / 3
                width = {"4d": 4 * d_model, "unrounded": math.floor(third), "down": math.floor(third) // multiple_of * multiple_of,
                         "nearest": -(-round(third) // multiple_of) * multiple_of}.get(
                    bug, -(-math.floor(third) // multiple_of) * multiple_of)
            else:
                width = 4 * d_model
            self.d_mlp = width + 1 if bug == "d_mlp" else width
            bias = (bug == "swiglu-bias") if swiglu else bug != "gelu-no-bias"
            if swiglu and bug != "no-gate":
                self.W_gate = nn.Linear(d_model, width, bias=bias)
            self.W_in = nn.Linear(width, d_model, bias=bias) if bug == "transposed" else nn.Linear(d_model, width, bias=bias)
            self.W_out = nn.Linear(width, d_model, bias=bias)

        def forward(self, x):
            if self.activation == "swiglu":
                if bug == "no-gate":
                    return self.W_out(F.silu(self.W_in(x)))
                gate, up = self.W_gate(x), self.W_in(x)
                hidden = {"swapped": lambda: F.silu(up) * gate, "sigmoid": lambda: torch.sigmoid(gate) * up,
                          "silu-of-product": lambda: F.silu(gate * up)}.get(bug, lambda: F.silu(gate) * up)()
                return self.W_out(hidden)
            h = self.W_in(x)
            if bug == "after":
                return F.gelu(self.W_out(h), approximate="tanh" if self.activation == "gelu_tanh" else "none")
            right = lambda t: F.gelu(t, approximate="tanh" if self.activation == "gelu_tanh" else "none")  # noqa: E731
            act = {"relu": F.relu, "no-act": lambda t: t, "always-exact": F.gelu,
                   "no-grad": lambda t: right(t).detach()}.get(bug, right)
            return self.W_out(act(h))

    return FFN


def test_ffn_reference_and_learner_solutions_pass(capsys):
    for cls in (solution("ex_ffn")["FFN"], make_ffn(), nb07.reference_ffn):
        nb07.check_ffn(cls)
    assert capsys.readouterr().out.count("\N{CHECK MARK} feed-forward network: all checks passed") == 3


@pytest.mark.parametrize(
    "bug, match",
    [
        ("4d", r"FFN\(64, 'swiglu', 1\) has a hidden width of 256, four times d_model"),
        ("unrounded", r"FFN\(64, 'swiglu', 32\) has a hidden width of 170, which is 8 d_model / 3 but not a multiple"),
        ("down", r"FFN\(64, 'swiglu', 32\) has a hidden width of 160, a multiple of 32 below 8 d_model / 3"),
        ("nearest", r"FFN\(64, 'swiglu', 1\) has a hidden width of 171: Llama first takes the whole part"),
        ("d_mlp", r"\.d_mlp is 65: store the hidden width as self.d_mlp"),
        ("swiglu-bias", r"FFN\(d_model, 'swiglu'\) has biases \(W_gate.bias, W_in.bias, W_out.bias\)"),
        ("gelu-no-bias", r"FFN\(d_model, 'gelu'\) has no bias in W_in and W_out"),
        ("no-gate", "has no W_gate: SwiGLU has three linear layers"),
        ("transposed", r"W_in.weight has shape \(16, 64\), expected \(64, 16\)"),
        ("relu", "you used ReLU"),
        ("always-exact", "for 'gelu_tanh' you used the exact GELU"),
        ("no-act", "there is no activation between W_in and W_out"),
        ("after", "you applied the activation after W_out"),
        ("swapped", "W_gate and W_in swapped roles"),
        ("sigmoid", "you gated with the sigmoid: that is GLU"),
        ("silu-of-product", "you applied SiLU to the product"),
        ("no-grad", "no gradient reaches W_in.weight"),
    ],
)
def test_ffn_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb07.check_ffn(make_ffn(bug))


def test_ffn_not_done_and_not_a_module():
    class FFN(nn.Module):
        def __init__(self, d_model, activation="gelu", multiple_of=1):
            super().__init__()
            raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb07.check_ffn(FFN)
    with pytest.raises(CheckFailure, match="should build a torch.nn.Module"):
        nb07.check_ffn(lambda d_model, activation="gelu", multiple_of=1: None)


def test_ffn_reference_is_tfedus_mlp_with_llamas_width_and_equals_transformers_llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    assert nb07.reference_ffn(4096, "swiglu", 256).__class__ is layers.MLP
    with torch.device("meta"):
        assert nb07.reference_ffn(4096, "swiglu", 256).d_mlp == 11008  # Llama-7B
    ffn = nb07.reference_ffn(48, "swiglu")
    hf = LlamaMLP(LlamaConfig(hidden_size=48, intermediate_size=ffn.d_mlp, hidden_act="silu", num_attention_heads=4))
    hf.gate_proj.load_state_dict(ffn.W_gate.state_dict())
    hf.up_proj.load_state_dict(ffn.W_in.state_dict())
    hf.down_proj.load_state_dict(ffn.W_out.state_dict())
    x = torch.randn(2, 3, 48)
    torch.testing.assert_close(ffn(x), hf(x))


# ----------------------------------------------------------------------------- 7.2 layer_norm


def make_layer_norm(bug=None):
    """A learner's layer_norm, written the way the notebook asks, with one switch per mistake."""

    def layer_norm(x, weight, bias, eps=1e-5):
        if bug == "eps-ignored":
            eps = 1e-5
        dims = {"dim0": 0, "dim-2": -2, "all": tuple(range(x.dim()))}.get(bug, -1)
        mean = x.mean(dim=dims, keepdim=bug != "no-keepdim")
        if bug == "detached-mean":
            mean = mean.detach()
        if bug in ("unbiased", "annotated"):
            var = torch.var(x, dim=-1, keepdim=True)
        elif bug == "one-pass":
            var = (x * x).mean(dim=-1, keepdim=True) - mean * mean
        else:
            var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
        if bug == "in-place":
            x -= mean
            centred = x
        else:
            centred = x if bug == "not-centred" else x - mean
        if bug == "rms":
            x_hat = x / torch.sqrt((x**2).mean(dim=-1, keepdim=True) + eps)
        elif bug == "no-eps":
            x_hat = centred / torch.sqrt(var)
        elif bug in ("eps-outside", "annotated"):
            x_hat = centred / (torch.sqrt(var) + eps)
        else:
            x_hat = centred / torch.sqrt(var + eps)
        out = {"no-gain": lambda: x_hat + bias, "no-bias": lambda: x_hat * weight, "x-hat": lambda: x_hat,
               "swapped": lambda: x_hat * bias + weight}.get(bug, lambda: x_hat * weight + bias)()
        return {"float64": lambda: out.double(), "float32": lambda: out.float(), "numpy": lambda: out.detach().numpy(),
                "no-grad": lambda: out.detach()}.get(bug, lambda: out)()

    return layer_norm


def var_mean_layer_norm(x, weight, bias, eps=1e-5):
    """torch.var_mean with correction=0 and rsqrt: another right answer."""
    var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
    return (x - mean) * torch.rsqrt(var + eps) * weight + bias


def unbiased_false_layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    std = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    return weight * (x - mean) / std + bias


def module_layer_norm(x, weight, bias, eps=1e-5):
    """The reference module with the given gain and bias."""
    ln = layers.LayerNorm(x.shape[-1], eps=eps)
    del ln.weight, ln.bias  # plain attributes now: the given tensors, so gradients reach them
    ln.weight, ln.bias = weight, bias
    return ln(x)


def test_layer_norm_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_layer_norm")["layer_norm"], make_layer_norm(), var_mean_layer_norm, unbiased_false_layer_norm,
               nb07.reference_layer_norm, layers.layer_norm_by_hand):
        nb07.check_layer_norm(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} layer norm: all checks passed") == 6


def test_layer_norm_handed_to_tfedus_module_is_refused_as_fused():
    # tfedu.layers.LayerNorm runs F.layer_norm (the grader's scan refuses tfedu.layers here anyway).
    with pytest.raises(CheckFailure, match="tfedu.layers.LayerNorm"):
        nb07.check_layer_norm(module_layer_norm)


@pytest.mark.parametrize(
    "bug, match",
    [
        ("dim0", "you normalised over dim 0, across the batch"),
        ("dim-2", "you normalised over dim -2, across the positions"),
        ("all", "one mean and one variance over the whole tensor"),
        ("unbiased", "you used the unbiased variance, which divides by d_model - 1"),
        ("no-eps", "no epsilon: add eps to the variance before the square root"),
        ("eps-outside", "eps is outside the square root"),
        ("annotated", "the Annotated Transformer's LayerNorm"),
        ("no-gain", "the gain is missing"),
        ("no-bias", "the bias is missing"),
        ("x-hat", "you returned the normalised x alone"),
        ("swapped", "gain and bias are swapped"),
        ("not-centred", "did not subtract the mean first"),
        ("rms", "that is RMSNorm"),
        ("eps-ignored", r"eps=0.01\) gave the result for eps = 1e-5: use the eps argument"),
        ("one-pass", r"Right in float64 but not in float32 at mean 1e3: .*mean\(x \*\* 2\) - mean\(x\) \*\* 2"),
        ("in-place", "changed the caller's `x` in place"),
        ("float64", r"return x's dtype \(torch.float32\), got torch.float64"),
        ("float32", r"return x's dtype \(torch.float64\), got torch.float32"),
        ("numpy", "returned a NumPy array"),
        ("no-grad", "no gradient flows back to x, weight and bias through layer_norm"),
        ("detached-mean", "the gradient with respect to x is wrong"),
        ("no-keepdim", r"raised RuntimeError.*keepdim=True"),
    ],
)
def test_layer_norm_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb07.check_layer_norm(make_layer_norm(bug))


def test_layer_norm_without_eps_only_where_the_variance_is_zero_is_told_why_eps_is_there():
    def eps_unless_all_positive(x, weight, bias, eps=1e-5):  # eps everywhere, except when some variance is 0
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        if bool((var > 0).all()):
            return (x - mean) / torch.sqrt(var + eps) * weight + bias
        return (x - mean) / torch.sqrt(var) * weight + bias

    with pytest.raises(CheckFailure, match=r"NaN where all the entries of a position are equal.*0 / 0"):
        nb07.check_layer_norm(eps_unless_all_positive)


def test_layer_norm_with_another_signature_says_keep_it():
    with pytest.raises(CheckFailure, match=r"raised TypeError.*keep the signature layer_norm\(x, weight, bias, eps=1e-5\)"):
        nb07.check_layer_norm(lambda x, weight, bias, epsilon=1e-5: nb07.reference_layer_norm(x, weight, bias, epsilon))


def test_layer_norm_not_done():
    def layer_norm(x, weight, bias, eps=1e-5):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb07.check_layer_norm(layer_norm)


def test_layer_norm_reference_equals_tfedu_and_torch():
    x, weight, bias = nb07._ln_inputs(0, 3, 5, 8, mean=1e3, std=1e-2, dtype=torch.float64)
    ln = layers.LayerNorm(8).double()
    with torch.no_grad():
        ln.weight.copy_(weight)
        ln.bias.copy_(bias)
    torch.testing.assert_close(nb07.reference_layer_norm(x, weight, bias), ln(x).detach())
    torch.testing.assert_close(nb07.reference_layer_norm(x, weight, bias), F.layer_norm(x, (8,), weight, bias))
    # The inputs are what the checker says: means about 1e3, spreads about 1e-2, so eps (1e-5) matters.
    assert x.mean(-1).abs().min() > 400 and 1e-3 < x.std(-1).median() < 5e-2


# ----------------------------------------------------------------------------- 7.3 rms_norm


def make_rms_norm(bug=None):
    """A learner's rms_norm, written the way the notebook asks, with one switch per mistake."""

    def rms_norm(x, weight, eps=1e-6):
        if bug == "eps-ignored":
            eps = 1e-6
        source = x - x.mean(dim=-1, keepdim=True) if bug == "centred" else x
        dims = {"dim0": 0, "dim-2": -2}.get(bug, -1)
        squares = source.pow(2)
        mean_square = squares.sum(dim=dims, keepdim=True) if bug == "sum" else squares.mean(dim=dims, keepdim=bug != "no-keepdim")
        if bug == "detached":
            mean_square = mean_square.detach()
        root = {"no-eps": lambda: torch.sqrt(mean_square), "eps-outside": lambda: torch.sqrt(mean_square) + eps}.get(
            bug, lambda: torch.sqrt(mean_square + eps))()
        if bug == "in-place":
            x /= root
            out = x * weight
        elif bug == "multiplied":
            out = source * root * weight
        else:
            out = source / root if bug == "no-gain" else source / root * weight
        return {"float64": lambda: out.double(), "float32": lambda: out.float(), "numpy": lambda: out.detach().numpy(),
                "no-grad": lambda: out.detach()}.get(bug, lambda: out)()

    return rms_norm


def test_rms_norm_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_rms_norm")["rms_norm"], make_rms_norm(), nb07.reference_rms_norm):
        nb07.check_rms_norm(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} RMS norm: all checks passed") == 3


@pytest.mark.parametrize(
    "bug, match",
    [
        ("centred", "you subtracted the mean first: that is LayerNorm without its bias"),
        ("dim0", "over dim 0, across the batch"),
        ("dim-2", "over dim -2, across the positions"),
        ("sum", "the root of the sum of the squares"),
        ("no-eps", "no epsilon: add eps to the mean of the squares"),
        ("eps-outside", "eps is outside the square root"),
        ("multiplied", "you multiplied by the root mean square instead of dividing"),
        ("no-gain", "the gain is missing"),
        ("eps-ignored", r"eps=0.001\) gave the result for eps = 1e-6: use the eps argument"),
        ("in-place", "changed the caller's `x` in place"),
        ("float64", r"return x's dtype \(torch.float32\), got torch.float64"),
        ("float32", r"return x's dtype \(torch.float64\), got torch.float32"),
        ("numpy", "returned a NumPy array"),
        ("no-grad", "no gradient flows back to x and weight through rms_norm"),
        ("detached", "the gradient with respect to x is wrong"),
        ("no-keepdim", r"raised RuntimeError.*keepdim=True"),
    ],
)
def test_rms_norm_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb07.check_rms_norm(make_rms_norm(bug))


def test_rms_norm_by_torch_is_refused_as_fused():
    with pytest.raises(CheckFailure, match="torch.nn.functional.rms_norm"):
        nb07.check_rms_norm(lambda x, weight, eps=1e-6: F.rms_norm(x, (x.shape[-1],), weight, eps))
    with pytest.raises(CheckFailure, match="build RMSNorm yourself"):
        nb07.check_rms_norm(lambda x, weight, eps=1e-6: nn.RMSNorm(x.shape[-1], eps=eps).to(x.dtype)(x) * weight)


def test_rms_norm_without_eps_only_at_zero_vectors_is_told_why_eps_is_there():
    def eps_unless_zero(x, weight, eps=1e-6):
        mean_square = x.pow(2).mean(-1, keepdim=True)
        return x / torch.sqrt(mean_square + (eps if bool((mean_square > 0).all()) else 0.0)) * weight

    with pytest.raises(CheckFailure, match=r"NaN at a position whose entries are all 0"):
        nb07.check_rms_norm(eps_unless_zero)


def test_rms_norm_not_done():
    def rms_norm(x, weight, eps=1e-6):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb07.check_rms_norm(rms_norm)


def test_rms_norm_reference_equals_tfedu_and_torch():
    x, weight = nb07._rms_inputs(0, 3, 5, 8, scale=1e-3, dtype=torch.float64)
    rms = layers.RMSNorm(8).double()
    with torch.no_grad():
        rms.weight.copy_(weight)
    torch.testing.assert_close(nb07.reference_rms_norm(x, weight), rms(x).detach())
    torch.testing.assert_close(nb07.reference_rms_norm(x, weight), F.rms_norm(x, (8,), weight, 1e-6))
    # The inputs are what the checker says: a mean square near eps, so eps's place shows.
    assert 1e-7 < x.pow(2).mean(-1).median() < 1e-4


# ----------------------------------------------------------------------------- 7.4 pre_norm_block


def make_pre_norm_block(bug=None):
    """A learner's pre_norm_block, with one switch per mistake."""

    def pre_norm_block(resid, ln1, attn, ln2, mlp):
        x = resid
        if bug == "post-norm":
            mid = ln1(x + attn(x))
            return ln2(mid + mlp(mid))
        if bug == "parallel":
            return x + attn(ln1(x)) + mlp(ln2(x))
        if bug == "mlp-first":
            mid = x + mlp(ln2(x))
            return mid + attn(ln1(mid))
        if bug == "mlp-first-norms-by-position":
            mid = x + mlp(ln1(x))
            return mid + attn(ln2(mid))
        if bug == "resid-from-normed":
            h = ln1(x)
            mid = h + attn(h)
            g = ln2(mid)
            return g + mlp(g)
        if bug == "resid-from-normed-attn":
            h = ln1(x)
            mid = h + attn(h)
            return mid + mlp(ln2(mid))
        norm_a = {"attn-raw": lambda t: t, "no-norms": lambda t: t, "ln2-twice": ln2, "swapped-norms": ln2}.get(bug, ln1)
        a = attn(norm_a(x))
        if bug == "attn-twice":
            a = 0.5 * a + 0.5 * attn(norm_a(x))
        mid = a if bug in ("no-attn-resid", "no-resid") else x + a
        if bug == "in-place":
            resid += a
            mid = resid
        if bug == "mid-only":
            return mid
        norm_m = {"mlp-raw": lambda t: t, "no-norms": lambda t: t, "ln1-twice": ln1, "swapped-norms": ln1}.get(bug, ln2)
        m = mlp(norm_m(mid))
        if bug == "mlp-twice":
            m = mlp(norm_m(mid)) * 0.5 + 0.5 * m
        out = m if bug in ("no-mlp-resid", "no-resid") else mid + m
        if bug == "resid-twice":
            out = out + x
        if bug == "final-norm":
            out = ln2(out)
        return {"tuple": lambda: (mid, out), "no-grad": lambda: out.detach(), "float64": lambda: out.double()}.get(bug, lambda: out)()

    return pre_norm_block


def pre_norm_block_with_own_layer_norm(layer_norm):
    """The block as a notebook cell that calls the learner's own layer_norm with the norms' gains and biases."""
    namespace = {"torch": torch, "layer_norm": layer_norm}
    exec("def pre_norm_block(resid, ln1, attn, ln2, mlp):\n"
         "    resid_mid = resid + attn(layer_norm(resid, ln1.weight, ln1.bias))\n"
         "    return resid_mid + mlp(layer_norm(resid_mid, ln2.weight, ln2.bias))\n", namespace)
    return namespace["pre_norm_block"]


def test_pre_norm_block_reference_and_learner_solutions_pass(capsys):
    class Attend(nn.Module):  # Block calls self.attn(x, mask=..., causal=..., ...): attn is causal already
        def __init__(self, attn):
            super().__init__()
            self.fn = attn

        def forward(self, x, **ignored):
            return self.fn(x)

    def block_forward(resid, ln1, attn, ln2, mlp):  # tfedu's Block with the given modules in it
        block = layers.Block(ModelConfig(d_vocab=2, n_ctx=2, d_model=resid.shape[-1], n_layers=1, n_heads=1))
        block.ln1, block.attn, block.ln2, block.mlp = ln1, Attend(attn), ln2, mlp
        return block(resid)

    for fn in (solution("ex_pre_norm_block")["pre_norm_block"], make_pre_norm_block(), block_forward,
               pre_norm_block_with_own_layer_norm(nb07.reference_layer_norm),
               pre_norm_block_with_own_layer_norm(make_layer_norm()),
               lambda resid, ln1, attn, ln2, mlp: (lambda mid: mid + mlp.forward(ln2.forward(mid)))(resid + attn(ln1(resid)))):
        nb07.check_pre_norm_block(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} pre-norm Transformer block: all checks passed") == 6


@pytest.mark.parametrize(
    "bug, match",
    [
        ("post-norm", "post-norm block of the 2017 paper"),
        ("no-attn-resid", "residual connection around attention is missing"),
        ("no-mlp-resid", "residual connection around the MLP is missing"),
        ("no-resid", "both residual connections are missing"),
        ("mlp-raw", "the MLP reads the un-normalised stream"),
        ("attn-raw", "attention reads the un-normalised stream"),
        ("no-norms", "neither sub-layer reads a normalised stream"),
        ("ln1-twice", "you used ln1 for both sub-layers"),
        ("ln2-twice", "you used ln2 for both sub-layers"),
        ("swapped-norms", "ln1 and ln2 are swapped"),
        ("resid-from-normed", "you added the sub-layer's output to the normalised stream"),
        ("resid-from-normed-attn", "you added the sub-layer's output to the normalised stream"),
        ("mlp-first", "the sub-layers are in the wrong order"),
        ("mlp-first-norms-by-position", "the sub-layers are in the wrong order"),
        ("parallel", "GPT-J's parallel block"),
        ("mid-only", "you returned the stream after attention"),
        ("resid-twice", "the block's input is added twice"),
        ("final-norm", "you normalised the block's output"),
        ("attn-twice", "the result is right, but attn was called 2 times"),
        ("mlp-twice", "the result is right, but mlp was called 2 times"),
        ("in-place", "changed the caller's `resid` in place"),
        ("tuple", "return only resid_post"),
        ("no-grad", "no gradient flows back through pre_norm_block"),
        ("float64", r"return resid's dtype \(torch.float32\), got torch.float64"),
    ],
)
def test_pre_norm_block_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb07.check_pre_norm_block(make_pre_norm_block(bug))


def test_pre_norm_block_that_passes_a_mask_to_attn_is_told_attn_is_causal_already():
    with pytest.raises(CheckFailure, match=r"raised TypeError.*attn is causal already: pass no mask"):
        nb07.check_pre_norm_block(lambda resid, ln1, attn, ln2, mlp: resid + attn(ln1(resid), causal=True))


def test_pre_norm_block_with_a_detached_sub_layer_is_told_the_gradient_is_wrong():
    def detached_mlp(resid, ln1, attn, ln2, mlp):
        mid = resid + attn(ln1(resid))
        return mid + mlp(ln2(mid)).detach()

    with pytest.raises(CheckFailure, match="the output is right but the gradient with respect to resid is wrong"):
        nb07.check_pre_norm_block(detached_mlp)


def test_pre_norm_block_blames_a_wrong_layer_norm_it_calls():
    learner = pre_norm_block_with_own_layer_norm(make_layer_norm("unbiased"))
    with pytest.raises(CheckFailure, match=r"calls your layer_norm, which is wrong: fix layer_norm first.*unbiased") as info:
        nb07.check_pre_norm_block(learner)
    assert "Also" not in str(info.value)
    assert learner.__globals__["layer_norm"] is not nb07.reference_layer_norm  # the learner's binding is back


def test_pre_norm_block_names_its_own_mistake_and_the_wrong_layer_norm():
    namespace = {"torch": torch, "layer_norm": make_layer_norm("no-bias")}
    exec("def pre_norm_block(resid, ln1, attn, ln2, mlp):\n"
         "    return resid + attn(layer_norm(resid, ln1.weight, ln1.bias))\n", namespace)
    with pytest.raises(CheckFailure, match=r"you returned the stream after attention.*Also, your pre_norm_block calls your layer_norm"):
        nb07.check_pre_norm_block(namespace["pre_norm_block"])


def test_pre_norm_block_says_when_layer_norm_is_not_done():
    def layer_norm(x, weight, bias, eps=1e-5):
        raise NotImplementedError

    with pytest.raises(CheckFailure, match="calls your layer_norm, which is not done yet") as info:
        nb07.check_pre_norm_block(pre_norm_block_with_own_layer_norm(layer_norm))
    assert not isinstance(info.value, ExerciseNotDone)


def test_pre_norm_block_not_done():
    def pre_norm_block(resid, ln1, attn, ln2, mlp):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb07.check_pre_norm_block(pre_norm_block)


def test_the_checkers_block_is_pre_norm_with_norms_of_their_own():
    block = nb07.make_block(20)
    x = nb07._block_resid(21, 2, 6, 16)
    mid = x + block.attn(block.ln1(x), causal=True)
    torch.testing.assert_close(block(x, causal=True), mid + block.mlp(block.ln2(mid)))
    assert block.norm_position == "pre"
    assert not torch.allclose(block.ln1.weight, block.ln2.weight) and block.ln1.bias.abs().min() > 0
    before = torch.random.get_rng_state()
    nb07.make_block(3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the learner's random state is left alone


# ----------------------------------------------------------------------------- 7.5 gpt_forward


def make_gpt_forward(bug=None):
    """A learner's gpt_forward with one switch per mistake (the mistakes the checker names, written as a learner would)."""

    def gpt_forward(ids, W_E, W_pos, blocks, ln_final):
        n = ids.shape[1]
        if bug == "embedding-module":  # another right answer: F.embedding
            resid = F.embedding(ids, W_E) + F.embedding(torch.arange(n), W_pos)
        else:
            resid = W_E[ids] * (math.sqrt(W_E.shape[1]) if bug == "scaled" else 1.0)
            if bug == "whole-table":
                resid = resid + W_pos
            elif bug == "pos-from-ids":
                resid = resid + W_pos[ids]
            elif bug != "no-pos":
                resid = resid + W_pos[:n]
        if bug == "norm-first":
            resid = ln_final(resid)
        if bug == "last-only":
            for block in blocks:
                out = block(resid)
            resid = out
        else:
            for block in (list(blocks)[::-1] if bug == "reversed" else blocks):
                resid = resid + block(resid) if bug == "extra-resid" else block(resid)
        if bug not in ("no-final", "norm-first"):
            resid = ln_final(resid)
        unembed = W_E.detach().T if bug == "detached-unembed" else (W_E if bug == "untransposed" else W_E.T)
        logits = resid @ unembed
        return {"softmax": lambda: logits.softmax(-1), "log-softmax": lambda: F.log_softmax(logits, -1),
                "last-pos": lambda: logits[:, -1]}.get(bug, lambda: logits)()

    return gpt_forward


def test_gpt_forward_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_gpt_forward")["gpt_forward"], make_gpt_forward(), make_gpt_forward("embedding-module"),
               nb07.reference_gpt_forward):
        nb07.check_gpt_forward(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} the GPT's forward pass: all checks passed") == 4


@pytest.mark.parametrize(
    "bug, match",
    [
        ("no-pos", "the position vectors are missing"),
        ("pos-from-ids", "you looked up W_pos by the token ids"),
        ("whole-table", r"raised RuntimeError.*W_pos is \(n_ctx, d_model\), one row per position"),
        ("scaled", "you multiplied the token embeddings by sqrt\\(d_model\\)"),
        ("no-final", "the final norm is missing"),
        ("norm-first", "you normalised with ln_final before the blocks"),
        ("reversed", "the blocks ran in reverse order"),
        ("last-only", "only the last block reached the logits"),
        ("extra-resid", "you added the stream to each block's output"),
        ("softmax", "you returned probabilities"),
        ("log-softmax", "you returned log-probabilities"),
        ("last-pos", "you returned the logits of the last position only"),
        ("untransposed", r"raised RuntimeError.*unembedding tied to W_E"),
        ("detached-unembed", "the gradient with respect to W_E is wrong. W_E is used twice"),
    ],
)
def test_gpt_forward_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb07.check_gpt_forward(make_gpt_forward(bug))


def test_gpt_forward_not_done():
    def gpt_forward(ids, W_E, W_pos, blocks, ln_final):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb07.check_gpt_forward(gpt_forward)


def test_the_gpt_check_compares_with_transformers_and_every_named_mistake_moves_the_logits():
    hf, ours = nb07.gpt2_from_transformers(0)
    ids = torch.randint(0, nb07.GPT_CHECK_SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))
    W_E, W_pos, blocks, ln_final = nb07._gpt_parts(ours)
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(nb07.reference_gpt_forward(ids, W_E, W_pos, blocks, ln_final), want, rtol=1e-4, atol=1e-4)
        for hint, wrong in nb07._gpt_mistakes(ids, W_E, W_pos, blocks, ln_final):
            assert (wrong - want).abs().max() > 0.5, hint  # far outside the check's tolerance of 1e-4


# ----------------------------------------------------------------------------- 7.6 gpt2_param_count


def make_param_count(*bugs):
    """A learner's gpt2_param_count; each bug leaves out or changes one part."""

    def gpt2_param_count(d_vocab, n_ctx, d_model, n_layers):
        d = d_model
        d_mlp = {"mlp3": 3 * d, "mlp1": d}.get(next((b for b in bugs if b.startswith("mlp")), ""), 4 * d)
        biases = "no-bias" not in bugs
        per_norm = 0 if "no-ln" in bugs else 1 if "ln-gain" in bugs else 2
        n_attn = 3 if "attn3" in bugs else 4
        attention = n_attn * d * d + (n_attn * d if biases else 0)
        mlp = 2 * d * d_mlp + ((d_mlp + d) if biases else 0)
        total = d_vocab * d * (2 if "untied" in bugs else 1)
        total += 0 if "no-pos" in bugs else n_ctx * d
        total += n_layers * (attention + mlp + 2 * per_norm * d)
        total += 0 if "no-final" in bugs else per_norm * d
        if "once" in bugs:  # one block's count, not multiplied by n_layers
            total = d_vocab * d + n_ctx * d + attention + mlp + 4 * d + 2 * d
        if "float" in bugs:
            return round(total / 1e6, 2) * 1e6
        if "float-right" in bugs:
            return total / 1
        if "numpy" in bugs:
            return np.int64(total)
        return total

    return gpt2_param_count


def test_param_count_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_gpt2_param_count")["gpt2_param_count"], make_param_count(), make_param_count("numpy"),
               nb07.gpt2_reference_count,
               lambda v, n, d, L: param_count(ModelConfig(d_vocab=v, n_ctx=n, d_model=d, n_layers=L, n_heads=1)).total):
        nb07.check_gpt2_param_count(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} GPT-2 parameter count: all checks passed") == 5


def test_the_reference_count_is_gpt2_small_built_on_the_meta_device():
    with torch.device("meta"):
        model = GPT(preset("gpt2"))
    assert sum(p.numel() for p in model.parameters()) == nb07.gpt2_reference_count(*nb07.GPT2_SMALL) == 124_439_808
    for shape in ((1000, 64, 32, 3), (101, 17, 24, 5), (257, 33, 8, 1)):
        cfg = ModelConfig(d_vocab=shape[0], n_ctx=shape[1], d_model=shape[2], n_layers=shape[3], n_heads=4 if shape[2] % 4 == 0 else 1)
        with torch.device("meta"):
            model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == nb07.gpt2_reference_count(*shape) == param_count(cfg).total


def test_param_count_shapes_tell_every_term_apart_with_shapes_to_spare():
    counts = [nb07.gpt2_reference_count(*s) for s in nb07.CHECK_SHAPES]
    fit = nb07.fit_count(nb07.CHECK_SHAPES, counts)
    assert fit == nb07.GPT2_COEFFICIENTS
    assert nb07.fit_count(nb07.CHECK_SHAPES[:-2], counts[:-2]) == nb07.GPT2_COEFFICIENTS
    assert nb07.fit_count(nb07.CHECK_SHAPES, [c + (i == 3) for i, c in enumerate(counts)]) is None  # not a polynomial


@pytest.mark.parametrize(
    "bugs, match",
    [
        (("no-bias",), "the biases are missing"),
        (("no-ln",), "the LayerNorms' parameters are missing"),
        (("ln-gain",), "each LayerNorm has a gain AND a bias"),
        (("no-final",), "the final LayerNorm .* is missing"),
        (("no-pos",), "the learned position table .* is missing"),
        (("untied",), "you counted the unembedding W_U as a matrix of its own"),
        (("attn3",), "attention has four d_model x d_model matrices"),
        (("mlp3",), "you used 3 · d_model"),
        (("mlp1",), "d_mlp = 4 · d_model, not d_model"),
        (("no-bias", "no-final"), "the biases are missing.*; the final LayerNorm .* is missing"),
        (("untied", "no-pos", "ln-gain"),
         "W_U as a matrix of its own.*; the learned position table .* missing.*; each LayerNorm has a gain AND"),
        (("attn3", "mlp3"), "attention has four .*: you counted three; the MLP's hidden width .* you used 3 · d_model"),
        (("once",), "part of your count does not grow with n_layers"),
        (("float",), r"returned 124440000.0, a float: return the exact count as an int"),
        (("float-right",), r"returned 124439808.0, a float with the right value: return an int"),
    ],
)
def test_param_count_mistakes_are_named(bugs, match):
    with pytest.raises(CheckFailure, match=match) as info:
        nb07.check_gpt2_param_count(make_param_count(*bugs))
    if "float" not in bugs[0]:  # the right total and the difference come with the hint, never the count's parts
        assert "expected 124,439,808 (" in str(info.value) and "token embedding 38,597,376" not in str(info.value)


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda v, n, d, L: 12 * d * d * L, "12 · d_model² · n_layers, the slides' rule of thumb"),
        (lambda v, n, d, L: 12 * d * d * L + 2 * v * d, "the deck's table"),
        (lambda v, n, d, L: 12 * d * d * L + v * d, "you counted only the weight matrices"),
        (lambda v, n, d, L: nb07.gpt2_reference_count(v, n, d, L) - v * d - n * d, "Kaplan et al.'s non-embedding count"),
        (lambda v, n, d, L: 124_439_808, "returned 124,439,808, GPT-2 small's count, for another shape"),
        (lambda v, n, d, L: nb07.gpt2_reference_count(v, n, d, L) + (d % 7 == 3), r"returned .*, expected .* \(\d+ too many\)"),
        (lambda v, n, d, L: str(nb07.gpt2_reference_count(v, n, d, L)), "should return the count as an int, got '124439808'"),
        (lambda v, n, d, L: True, "should return the count as an int"),
        (lambda v, n, d, L: torch.tensor(nb07.gpt2_reference_count(v, n, d, L)), "should return the count as an int, got tensor"),
    ],
    ids=["deck-12", "deck-table", "matrices-only", "kaplan", "hard-coded", "not-a-polynomial", "string", "bool", "tensor"],
)
def test_param_count_conventions_and_wrong_types_are_named(fn, match):
    with pytest.raises(CheckFailure, match=match):
        nb07.check_gpt2_param_count(fn)


def test_param_count_with_n_heads_says_keep_the_signature():
    with pytest.raises(CheckFailure, match=r"raised TypeError.*keep the signature gpt2_param_count\(d_vocab, n_ctx, d_model, n_layers\)"):
        nb07.check_gpt2_param_count(lambda d_vocab, n_ctx, d_model, n_layers, n_heads: 0)


def test_param_count_not_done():
    def gpt2_param_count(d_vocab, n_ctx, d_model, n_layers):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb07.check_gpt2_param_count(gpt2_param_count)


# ----------------------------------------------------------------------------- 7.7 gpt2_forward_flops


def make_flops(bug=None):
    """A learner's gpt2_forward_flops, one switch per mistake."""

    def gpt2_forward_flops(d_vocab, n_ctx, d_model, n_layers):
        d, per = d_model, (1 if bug == "macs" else 2)
        projections = per * (3 if bug == "three-proj" else 0 if bug == "no-proj" else 4) * d * d
        ffn = 0 if bug == "no-ffn" else per * (1 if bug == "ffn-one" else 2) * d * 4 * d
        keys = n_ctx // 2 if bug == "causal-half" else n_ctx
        mechanism = 0 if bug == "no-mechanism" else per * (1 if bug == "scores-only" else 2) * keys * d
        extra = (9 * d + 4 * d) if bug == "biases-and-norms" else 0
        total = n_layers * (projections + ffn + mechanism + extra)
        total += 0 if bug == "no-unembed" else per * d * d_vocab * (2 if bug == "lookup" else 1)
        total *= 3 if bug == "training" else 1
        return float(total) if bug == "float" else total

    return gpt2_forward_flops


def test_flops_reference_equals_tfedu_flops_and_torchs_counter():
    for shape in nb07.COUNTER_SHAPES:
        assert nb07.gpt2_reference_flops(*shape) == nb07.counted_forward_flops(*shape)
    for v, n, d, L in nb07.FLOP_CHECK_SHAPES:
        cfg = ModelConfig(d_vocab=v, n_ctx=n, d_model=d, n_layers=L, n_heads=1)
        assert nb07.gpt2_reference_flops(v, n, d, L) == flops_per_token(cfg, n).forward
    fit = nb07.fit_count(nb07.FLOP_CHECK_SHAPES, [nb07.gpt2_reference_flops(*s) for s in nb07.FLOP_CHECK_SHAPES],
                         terms=nb07.FLOP_TERMS, values=nb07._flop_values)
    assert fit == nb07.GPT2_FLOP_COEFFICIENTS


def test_flops_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_gpt2_forward_flops")["gpt2_forward_flops"], make_flops(), nb07.gpt2_reference_flops):
        nb07.check_gpt2_forward_flops(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} GPT-2's forward FLOPs: all checks passed") == 3


@pytest.mark.parametrize(
    "bug, match",
    [
        ("macs", "every term is half the right one: you counted one operation per weight"),
        ("training", "that is the cost of training"),
        ("no-unembed", "the unembedding is missing"),
        ("lookup", "you counted the embedding lookup as a product"),
        ("no-mechanism", "the attention mechanism is missing"),
        ("scores-only", "the attention mechanism is counted half"),
        ("causal-half", "the attention mechanism is counted half"),
        ("no-proj", "8 d_model² short per token and layer"),
        ("ffn-one", "8 d_model² short per token and layer"),
        ("three-proj", "you counted three attention projections"),
        ("no-ffn", "the FFN is missing"),
        ("biases-and-norms", "element-wise work"),
        ("float", "a float: return the exact count as an int"),
    ],
)
def test_flops_mistakes_are_named_and_the_counter_disagrees(bug, match):
    with pytest.raises(CheckFailure, match=match) as failure:
        nb07.check_gpt2_forward_flops(make_flops(bug))
    assert bug == "float" or "FlopCounterMode counts" in str(failure.value)


def test_flops_not_done():
    def gpt2_forward_flops(d_vocab, n_ctx, d_model, n_layers):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb07.check_gpt2_forward_flops(gpt2_forward_flops)


# ----------------------------------------------------------------------------- probes


def verdict(probe, namespace, seed, *, standins=False):
    """The grader's verdict on one hidden test: None (pass) or the feedback (an exception counts as a failure)."""
    try:
        outputs, expected = run_probe(probe, namespace, seed, standins=standins)
    except Exception as err:
        return f"raised {type(err).__name__}: {err}"
    return probe.compare(outputs, expected)


GOOD = {
    "check_ffn": [{"FFN": nb07.reference_ffn}, solution("ex_ffn"), {"FFN": make_ffn()}],
    "check_layer_norm": [{"layer_norm": nb07.reference_layer_norm}, solution("ex_layer_norm"), {"layer_norm": var_mean_layer_norm},
                         {"layer_norm": lambda x, weight, bias, eps=1e-5: F.layer_norm(x, (x.shape[-1],), weight, bias, eps)}],
    "check_rms_norm": [{"rms_norm": nb07.reference_rms_norm}, solution("ex_rms_norm"),
                       {"rms_norm": lambda x, weight, eps=1e-6: F.rms_norm(x, (x.shape[-1],), weight, eps)}],
    "check_pre_norm_block": [solution("ex_pre_norm_block"), {"pre_norm_block": make_pre_norm_block()},
                             {"pre_norm_block": pre_norm_block_with_own_layer_norm(var_mean_layer_norm)}],
    "check_gpt_forward": [solution("ex_gpt_forward"), {"gpt_forward": make_gpt_forward("embedding-module")},
                          {"gpt_forward": nb07.reference_gpt_forward}],
    "check_gpt2_forward_flops": [solution("ex_gpt2_forward_flops"), {"gpt2_forward_flops": make_flops()},
                                 {"gpt2_forward_flops": nb07.gpt2_reference_flops}],
    "check_gpt2_param_count": [solution("ex_gpt2_param_count"), {"gpt2_param_count": make_param_count("numpy")},
                               {"gpt2_param_count": nb07.gpt2_reference_count}],
}
BAD = {
    "check_ffn": [{"FFN": make_ffn(bug)} for bug in ("4d", "unrounded", "relu", "swapped", "sigmoid", "swiglu-bias", "no-act")],
    "check_layer_norm": [{"layer_norm": make_layer_norm(bug)} for bug in ("unbiased", "no-eps", "eps-outside", "rms", "dim0", "swapped")],
    "check_rms_norm": [{"rms_norm": make_rms_norm(bug)} for bug in ("centred", "sum", "no-eps", "eps-outside", "dim0", "no-gain")],
    "check_pre_norm_block": [{"pre_norm_block": make_pre_norm_block(bug)}
                             for bug in ("post-norm", "mlp-raw", "ln1-twice", "parallel", "no-resid")],
    "check_gpt_forward": [{"gpt_forward": make_gpt_forward(bug)}
                          for bug in ("no-pos", "scaled", "no-final", "reversed", "extra-resid", "softmax", "detached-unembed")],
    "check_gpt2_forward_flops": [{"gpt2_forward_flops": make_flops(bug)}
                                 for bug in ("macs", "no-unembed", "lookup", "no-mechanism", "causal-half", "no-ffn")],
    "check_gpt2_param_count": [{"gpt2_param_count": make_param_count(bug)}
                               for bug in ("no-bias", "untied", "ln-gain", "no-final", "attn3")],
}


def test_every_check_cell_has_a_probe():
    assert set(nb07.PROBES) == set(GOOD) == set(BAD)
    for grade_id, probe in nb07.PROBES.items():
        assert probe.exercise == grade_id.replace("check_", "ex_")
        assert probe.compare is not None
        assert "tfedu.layers" in probe.forbidden and "tfedu.model" in probe.forbidden


@pytest.mark.parametrize("grade_id", sorted(GOOD))
@pytest.mark.parametrize("seed", range(4))
def test_probe_passes_the_reference_and_learner_solutions(grade_id, seed):
    probe = nb07.PROBES[grade_id]
    for namespace in GOOD[grade_id]:
        assert verdict(probe, namespace, seed) is None, (grade_id, seed, namespace)
        if probe.standins:
            assert verdict(probe, namespace, seed, standins=True) is None, (grade_id, seed, namespace)


@pytest.mark.parametrize("grade_id", sorted(BAD))
def test_probe_catches_buggy_versions(grade_id):
    probe = nb07.PROBES[grade_id]
    for namespace in BAD[grade_id]:
        assert all(verdict(probe, namespace, seed) is not None for seed in range(3)), (grade_id, namespace)


@pytest.mark.parametrize(
    "grade_id, namespace, fragment",
    [
        ("check_ffn", {"FFN": make_ffn("unrounded")}, "8 d_model / 3 but not a multiple"),
        ("check_ffn", {"FFN": make_ffn("4d")}, "four times d_model"),
        ("check_ffn", {"FFN": make_ffn("always-exact")}, "for 'gelu_tanh' you used the exact GELU"),
        ("check_ffn", {"FFN": make_ffn("swapped")}, "W_gate and W_in swapped roles"),
        ("check_ffn", {"FFN": make_ffn("silu-of-product")}, "you applied SiLU to the product"),
        ("check_ffn", {"FFN": make_ffn("no-gate")}, "has no W_gate"),
        ("check_ffn", {"FFN": make_ffn("no-grad")}, "no gradient reaches W_in.weight through FFN"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("unbiased")}, "you used the unbiased variance"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("annotated")}, "the Annotated Transformer's LayerNorm"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("no-eps")}, "no epsilon"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("rms")}, "that is RMSNorm"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("swapped")}, "gain and bias are swapped"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("eps-ignored")}, "use the eps argument"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("one-pass")}, "catastrophic"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("in-place")}, "changed its input in place (argument 1"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("no-grad")}, "no gradient flows back through layer_norm"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("detached-mean")}, "wrong gradient"),
        ("check_layer_norm", {"layer_norm": make_layer_norm("float64")}, "returned dtype torch.float64, expected torch.float32"),
        ("check_rms_norm", {"rms_norm": make_rms_norm("centred")}, "that is LayerNorm without its bias"),
        ("check_rms_norm", {"rms_norm": make_rms_norm("sum")}, "the root of the sum of the squares"),
        ("check_rms_norm", {"rms_norm": make_rms_norm("eps-outside")}, "eps is outside the square root"),
        ("check_rms_norm", {"rms_norm": make_rms_norm("eps-ignored")}, "use the eps argument"),
        ("check_rms_norm", {"rms_norm": make_rms_norm("in-place")}, "changed its input in place (argument 1"),
        ("check_rms_norm", {"rms_norm": make_rms_norm("detached")}, "wrong gradient"),
        ("check_pre_norm_block", {"pre_norm_block": make_pre_norm_block("post-norm")}, "post-norm block of the 2017 paper"),
        ("check_pre_norm_block", {"pre_norm_block": make_pre_norm_block("mlp-raw")}, "the MLP reads the un-normalised stream"),
        ("check_pre_norm_block", {"pre_norm_block": make_pre_norm_block("ln1-twice")}, "you used ln1 for both"),
        ("check_pre_norm_block", {"pre_norm_block": make_pre_norm_block("parallel")}, "GPT-J's parallel block"),
        ("check_pre_norm_block", {"pre_norm_block": make_pre_norm_block("attn-twice")}, "attn was called 2 times"),
        ("check_pre_norm_block", {"pre_norm_block": make_pre_norm_block("tuple")}, "return only resid_post"),
        ("check_pre_norm_block", {"pre_norm_block": make_pre_norm_block("in-place")}, "changed its input in place (argument 1"),
        ("check_pre_norm_block", {"pre_norm_block": make_pre_norm_block("no-grad")}, "no gradient flows back through pre_norm_block"),
        ("check_gpt_forward", {"gpt_forward": make_gpt_forward("no-pos")}, "the position vectors are missing"),
        ("check_gpt_forward", {"gpt_forward": make_gpt_forward("scaled")}, "sqrt(d_model)"),
        ("check_gpt_forward", {"gpt_forward": make_gpt_forward("no-final")}, "the final norm is missing"),
        ("check_gpt_forward", {"gpt_forward": make_gpt_forward("reversed")}, "reverse order"),
        ("check_gpt_forward", {"gpt_forward": make_gpt_forward("extra-resid")}, "you added the stream to each block's output"),
        ("check_gpt_forward", {"gpt_forward": make_gpt_forward("softmax")}, "you returned probabilities"),
        ("check_gpt_forward", {"gpt_forward": make_gpt_forward("last-pos")}, "the last position only"),
        ("check_gpt_forward", {"gpt_forward": make_gpt_forward("detached-unembed")}, "W_E is used twice"),
        ("check_gpt2_forward_flops", {"gpt2_forward_flops": make_flops("macs")}, "multiply-add"),
        ("check_gpt2_forward_flops", {"gpt2_forward_flops": make_flops("lookup")}, "embedding lookup"),
        ("check_gpt2_forward_flops", {"gpt2_forward_flops": make_flops("causal-half")}, "counted half"),
        ("check_gpt2_forward_flops", {"gpt2_forward_flops": make_flops("float")}, "a float"),
        ("check_gpt2_param_count", {"gpt2_param_count": make_param_count("untied")}, "W_U as a matrix of its own"),
        ("check_gpt2_param_count", {"gpt2_param_count": make_param_count("no-bias", "no-ln")}, "9 · d_model per block; the LayerNorms'"),
        ("check_gpt2_param_count", {"gpt2_param_count": make_param_count("float")}, "a float: return the exact count as an int"),
        ("check_gpt2_param_count", {"gpt2_param_count": lambda v, n, d, L: 124_439_808}, "GPT-2 small's count, for another shape"),
        ("check_gpt2_param_count", {"gpt2_param_count": lambda v, n, d, L: 12 * d * d * L}, "the slides' rule of thumb"),
    ],
)
def test_probe_feedback_names_the_mistake(grade_id, namespace, fragment):
    probe = nb07.PROBES[grade_id]
    for seed in range(3):
        feedback = verdict(probe, namespace, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_probe_code_leaves_no_helper_names_behind():
    for grade_id, probe in nb07.PROBES.items():
        scope = {**GOOD[grade_id][1], "inputs": probe.make_inputs(np.random.default_rng(0)), "np": np, "torch": torch}
        exec(probe.run, scope)
        assert not [name for name in scope if name.startswith("_") and name != "__builtins__"], grade_id


def test_param_count_probe_draws_shapes_no_answer_could_hard_code():
    shapes = nb07.PROBES["check_gpt2_param_count"].make_inputs(np.random.default_rng(0))["shapes"]
    assert tuple(shapes[0]) == nb07.GPT2_SMALL and len({tuple(s) for s in shapes}) == len(shapes) >= 12


# ----------------------------------------------------------------------------- stand-in, forbidden routes, the scan


def test_the_layer_norm_stand_in_agrees_with_the_reference_and_passes_its_check(capsys):
    assert sorted(standin_objects(nb07.PROBES["check_pre_norm_block"])) == ["layer_norm"]
    standin = standin_objects(nb07.PROBES["check_pre_norm_block"])["layer_norm"]
    x, weight, bias = nb07._ln_inputs(9, 2, 3, 8, mean=5.0, std=1.0, dtype=torch.float64)
    torch.testing.assert_close(standin(x, weight, bias, eps=1e-3), F.layer_norm(x, (8,), weight, bias, 1e-3))
    nb07.check_layer_norm(standin)
    assert "\N{CHECK MARK}" in capsys.readouterr().out


def test_forbidden_names_exist_and_the_scan_refuses_the_fused_routes():
    import importlib

    for name in nb07.LAYER_NORM_FUSED:
        if name.startswith("torch.ops."):
            assert hasattr(torch.ops.aten, name.rsplit(".", 1)[1]), name
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            owner, attr = name.rsplit(".", 1)
            assert hasattr(importlib.import_module(owner), attr), name
    forbidden = nb07.PROBES["check_layer_norm"].forbidden
    for cell in ("def layer_norm(x, weight, bias, eps=1e-5):\n    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)\n",
                 "def layer_norm(x, weight, bias, eps=1e-5):\n    return torch.layer_norm(x, x.shape[-1:], weight, bias, eps)\n",
                 "def layer_norm(x, weight, bias, eps=1e-5):\n    ln = nn.LayerNorm(x.shape[-1], eps=eps)\n    return ln(x)\n",
                 "def layer_norm(x, weight, bias, eps=1e-5):\n"
                 "    return F.group_norm(x.reshape(-1, 1, x.shape[-1]), 1, eps=eps).reshape(x.shape) * weight + bias\n",
                 "def layer_norm(x, weight, bias, eps=1e-5):\n"
                 "    return F.rms_norm(x - x.mean(-1, keepdim=True), x.shape[-1:], eps=eps) * weight + bias\n",
                 "from tfedu.layers import LayerNorm\n"):
        assert scan_answer(cell, context=[NOTEBOOK_CONTEXT], forbidden=forbidden), cell
    block_forbidden = nb07.PROBES["check_pre_norm_block"].forbidden
    assert scan_answer("from tfedu.layers import Block\n", context=[NOTEBOOK_CONTEXT], forbidden=block_forbidden)
    count_forbidden = nb07.PROBES["check_gpt2_param_count"].forbidden
    assert scan_answer("from tfedu.flops import flops_per_token, param_count\n", context=[NOTEBOOK_CONTEXT], forbidden=count_forbidden)


def test_nothing_the_solutions_use_is_forbidden():
    for grade_id, probe in nb07.PROBES.items():
        assert scan_answer(SOLUTIONS[probe.exercise], context=[NOTEBOOK_CONTEXT], forbidden=probe.forbidden) == [], grade_id
    standins = nb07.PROBES["check_pre_norm_block"].standins
    assert scan_answer(standins, context=["import torch, math\nimport numpy as np\nimport torch.nn.functional as F"],
                       forbidden=nb07.PROBES["check_pre_norm_block"].forbidden) == []
    assert "tfedu" not in standins


def run_under_the_harness(grade_id, answer, *, standins=False):
    """One hidden test of notebook 07 as the grader runs it in the kernel (tests/checker_helpers.py)."""
    return checker_helpers.run_under_the_harness(nb07.PROBES[grade_id], NOTEBOOK_CONTEXT.replace(", einops, regex", ""),
                                                 answer, standins=standins)


@pytest.mark.parametrize("grade_id", sorted(nb07.PROBES))
def test_the_solutions_pass_under_the_grader_harness(grade_id):
    answer = SOLUTIONS[nb07.PROBES[grade_id].exercise]
    assert run_under_the_harness(grade_id, answer) == ([], None)
    if nb07.PROBES[grade_id].standins:
        assert run_under_the_harness(grade_id, answer, standins=True) == ([], None)


@pytest.mark.parametrize(
    "grade_id, answer, hit",
    [
        ("check_layer_norm", "def layer_norm(x, weight, bias, eps=1e-5):\n    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)",
         "torch.layer_norm"),
        ("check_layer_norm", "def layer_norm(x, weight, bias, eps=1e-5):\n"
         "    return torch.ops.aten.native_layer_norm(x, x.shape[-1:], weight, bias, eps)[0]", "torch.ops.aten.native_layer_norm"),
        ("check_layer_norm", "def layer_norm(x, weight, bias, eps=1e-5):\n"
         "    return F.group_norm(x.reshape(-1, 1, x.shape[-1]), 1, eps=eps).reshape(x.shape) * weight + bias", "torch.group_norm"),
        ("check_layer_norm", "def layer_norm(x, weight, bias, eps=1e-5):\n"
         "    return F.rms_norm(x - x.mean(-1, keepdim=True), x.shape[-1:], eps=eps) * weight + bias", "torch.rms_norm"),
        ("check_pre_norm_block", "from tfedu.config import ModelConfig\nfrom tfedu.layers import Block\n"
         "def pre_norm_block(resid, ln1, attn, ln2, mlp):\n"
         "    Block(ModelConfig(d_vocab=2, n_ctx=2, d_model=resid.shape[-1], n_layers=1, n_heads=1))\n    return resid",
         "from layers.py"),
        ("check_gpt2_param_count", "from tfedu.config import ModelConfig\nfrom tfedu.flops import flops_per_token, param_count\n"
         "def gpt2_param_count(v, n, d, L):\n"
         "    return param_count(ModelConfig(d_vocab=v, n_ctx=n, d_model=d, n_layers=L, n_heads=1)).total", "from flops.py"),
    ],
    ids=["F.layer_norm", "aten", "group_norm", "rms_norm", "Block", "flops"],
)
def test_the_tripwire_sees_the_fused_routes_and_the_reference(grade_id, answer, hit):
    hits, _ = run_under_the_harness(grade_id, answer)
    assert any(hit in h for h in hits), hits


@pytest.mark.parametrize("route", [
    "return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)",
    "return torch.layer_norm(x, (x.shape[-1],), weight, bias, eps)",
    "m = torch.nn.LayerNorm(x.shape[-1], eps=eps, dtype=x.dtype)\n    with torch.no_grad():\n        m.weight.copy_(weight); m.bias.copy_(bias)\n    return m(x)",
    "d = x.shape[-1]\n    return F.group_norm(x.reshape(-1, 1, d), 1, eps=eps).reshape(x.shape) * weight + bias",
])
def test_layer_norm_check_cell_refuses_the_fused_routes(route):
    """A learner found that the check cell ticked F.layer_norm while the grader scored it zero."""
    namespace = {"torch": torch, "F": F}
    exec(f"def layer_norm(x, weight, bias, eps=1e-5):\n    {route}\n", namespace)
    with pytest.raises(CheckFailure, match="you called .*build LayerNorm yourself"):
        nb07.check_layer_norm(namespace["layer_norm"])

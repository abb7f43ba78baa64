"""Checker and probe of notebook 13: the reference passes, realistic mistakes fail with their named hint."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from checker_helpers import failure_of, verdict
from tfedu.checks import nb13_peft as nb13
from tfedu.checks.core import ExerciseNotDone, run_probe
from tfedu.peft import Adapter, LoRALinear

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_lora(mistake=""):
    """A learner's LoRA class, right or with one ``mistake``."""

    class LoRA(nn.Module):
        def __init__(self, base, r, alpha):
            super().__init__()
            self.base, self.r, self.alpha = base, r, alpha
            if mistake == "bias trainable":
                base.weight.requires_grad_(False)  # the bias forgotten
            elif mistake != "base trainable":
                for p in base.parameters():
                    p.requires_grad_(False)
            d_in, d_out = base.in_features, base.out_features
            shape_a, shape_b = ((d_in, r), (r, d_out)) if mistake == "A@B shapes" else ((r, d_in), (d_out, r))
            dtype = torch.float32 if mistake == "float32" else base.weight.dtype
            self.A = nn.Parameter(torch.zeros(shape_a, dtype=dtype))
            if mistake != "A zero":
                nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
            self.B = nn.Parameter(torch.zeros(shape_b, dtype=dtype))
            if mistake == "B random":
                nn.init.normal_(self.B)
            if mistake == "plain tensors":  # the red team's LoRA (issue 37): trains nothing under model.parameters()
                A, B = self.A.detach().clone().requires_grad_(), self.B.detach().clone().requires_grad_()
                del self.A, self.B
                self.A, self.B = A, B

        def forward(self, x):
            if mistake == "not done":
                raise NotImplementedError
            scale = {"no scale": 1.0, "alpha only": self.alpha, "floor division": self.alpha // self.r}.get(
                mistake, self.alpha / self.r)
            down = x @ self.A.T
            if mistake == "relu":
                down = torch.relu(down)
            out = self.base(x) + scale * down @ self.B.T
            return out.detach() if mistake == "detached" else out

        def merged_weight(self):
            delta = self.B @ self.A
            if mistake == "merge transposed":
                delta = delta.T
            if mistake != "merge no scale":
                delta = self.alpha / self.r * delta
            if mistake == "merge in place":
                with torch.no_grad():
                    self.base.weight += delta
                return self.base.weight
            return self.base.weight + delta

    return LoRA


MISTAKES = {
    "B random": "B is not zero at initialisation",
    "A zero": "A is zero at initialisation as well",
    "base trainable": "still requires grad",
    "A@B shapes": "A maps the input down to r numbers",
    "no scale": "leaves out the alpha / r scale",
    "alpha only": "by alpha, not alpha / r",
    "floor division": "alpha // r, which rounds down",
    "float32": "are float32 but the base layer's weight is float64",
    "relu": "nonlinearity (ReLU) between A and B",
    "detached": "no gradient reaches",
    "merge transposed": "adds (B @ A).T",
    "merge no scale": "without the alpha / r scale",
    "merge in place": "changed the base layer's weight in place",
    "plain tensors": "not one of its parameters",
    "bias trainable": "the base layer's bias still trains",
}


def test_reference_passes(capsys):
    nb13.check_lora(make_lora())
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistakes_are_named(mistake):
    assert MISTAKES[mistake] in failure_of(nb13.check_lora, make_lora(mistake))


def test_not_done_and_shortcut():
    with pytest.raises(ExerciseNotDone):
        nb13.check_lora(make_lora("not done"))
    with pytest.raises(ExerciseNotDone):
        nb13.check_lora(None)
    assert "tfedu.peft" in failure_of(nb13.check_lora, LoRALinear)


@pytest.mark.parametrize("mistake", ["", *MISTAKES])
def test_probe_agrees_with_the_checker(mistake):
    probe = nb13.PROBES["check_lora"]
    for seed in range(2):
        outputs, expected = run_probe(probe, {"LoRA": make_lora(mistake), "torch": torch}, seed)
        verdict = probe.compare(outputs, expected)
        if mistake:
            assert verdict is not None and MISTAKES[mistake] in verdict, verdict
        else:
            assert verdict is None


# ----------------------------------------------------------------------------- 13.2: a bottleneck adapter


class _InOut(nn.Module):
    """A projection stored (in, out), the Conv1D habit: weight (d_in, d_out), forward x @ weight + bias."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return x @ self.weight + self.bias


def make_adapter(mistake=""):
    """A learner's Adapter class, right or with one ``mistake``."""

    class Adapter(nn.Module):
        def __init__(self, d_model, bottleneck):
            super().__init__()
            if mistake == "plain tensors":  # held, never registered: no optimizer or checkpoint sees them
                self.W_down = (0.1 * torch.randn(bottleneck, d_model)).requires_grad_()
                self.W_up = torch.zeros(d_model, bottleneck, requires_grad=True)
                return
            if mistake == "in-out shapes":
                self.down, self.up = _InOut(d_model, bottleneck), _InOut(bottleneck, d_model)
            else:
                bias = mistake != "no bias"
                self.down = nn.Linear(d_model, bottleneck, bias=bias)
                self.up = nn.Linear(bottleneck, d_model, bias=bias)
            if mistake == "down zero":
                nn.init.zeros_(self.down.weight)
            if mistake != "up random":
                nn.init.zeros_(self.up.weight)
                if mistake != "up bias" and self.up.bias is not None:
                    nn.init.zeros_(self.up.bias)

        def forward(self, h):
            if mistake == "not done":
                raise NotImplementedError
            if mistake == "plain tensors":
                return h + F.gelu(h @ self.W_down.T) @ self.W_up.T
            hidden = self.down(h)
            act = {"no activation": lambda z: z, "activation after": lambda z: z, "relu": torch.relu,
                   "tanh gelu": lambda z: F.gelu(z, approximate="tanh")}.get(mistake, F.gelu)
            out = self.up(act(hidden))
            if mistake == "activation after":
                out = F.gelu(out)
            if mistake == "detached":
                out = out.detach()
            if mistake == "float32":
                return (h + out).float()
            return out if mistake == "no residual" else h + out

    return Adapter


class AdapterAnotherWay(nn.Module):
    """Right, written differently: F.linear by hand, the exact GELU from erf, zeros written under no_grad."""

    def __init__(self, d_model, bottleneck):
        super().__init__()
        self.down = nn.Linear(d_model, bottleneck)
        self.up = nn.Linear(bottleneck, d_model)
        with torch.no_grad():
            self.up.weight.zero_()
            self.up.bias.zero_()

    def forward(self, h):
        z = F.linear(h, self.down.weight, self.down.bias)
        z = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
        return torch.addmm(self.up.bias, z.reshape(-1, z.shape[-1]), self.up.weight.T).reshape(h.shape) + h


ADAPTER_MISTAKES = {
    "no residual": "returns only the bottleneck's output",
    "no activation": "no nonlinearity between down and up",
    "activation after": "applies the GELU after the up-projection",
    "relu": "uses ReLU between down and up",
    "tanh gelu": "tanh approximation of GELU",
    "up random": "up-projection is not zero at the start",
    "up bias": "weight starts at zero but its bias does not",
    "down zero": "down-projection's weight is zero at the start as well",
    "in-out shapes": "down maps d_model features to bottleneck ones",
    "no bias": "has no down.bias or up.bias",
    "plain tensors": "as plain tensors, not as parameters",
    "detached": "changed nothing: the adapter does not learn",
    "float32": "returned float32 for a float64 input",
}


@pytest.mark.parametrize("adapter", [make_adapter(), AdapterAnotherWay], ids=["reference", "another way"])
def test_adapter_right_answers_pass(adapter, capsys):
    nb13.check_adapter(adapter)
    assert "✓" in capsys.readouterr().out


def test_adapter_is_tfedus_adapter():
    """The exercise's reference behaves as tfedu.peft.Adapter, weights copied: the switch can swap them."""
    torch.manual_seed(0)
    mine, theirs = make_adapter()(12, 3).double(), Adapter(12, 3).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    mine.load_state_dict(theirs.state_dict())  # the same parameter names and shapes
    y = torch.randn(2, 5, 12, dtype=torch.float64)
    torch.testing.assert_close(mine(y), theirs(y))


@pytest.mark.parametrize("mistake", list(ADAPTER_MISTAKES))
def test_adapter_mistakes_are_named(mistake):
    assert ADAPTER_MISTAKES[mistake] in failure_of(nb13.check_adapter, make_adapter(mistake))


def test_adapter_not_done_and_shortcut():
    with pytest.raises(ExerciseNotDone):
        nb13.check_adapter(make_adapter("not done"))
    with pytest.raises(ExerciseNotDone):
        nb13.check_adapter(None)
    assert "tfedu.peft" in failure_of(nb13.check_adapter, Adapter)


@pytest.mark.parametrize("mistake", list(ADAPTER_MISTAKES))
def test_adapter_probe_names_the_mistake(mistake):
    probe = nb13.PROBES["check_adapter"]
    for seed in range(2):
        outputs, expected = run_probe(probe, {"Adapter": make_adapter(mistake), "torch": torch}, seed)
        verdict = probe.compare(outputs, expected)
        assert verdict is not None and ADAPTER_MISTAKES[mistake] in verdict, verdict


@pytest.mark.parametrize("adapter", [make_adapter(), AdapterAnotherWay], ids=["reference", "another way"])
def test_adapter_probe_passes_right_answers(adapter):
    probe = nb13.PROBES["check_adapter"]
    for seed in range(4):
        outputs, expected = run_probe(probe, {"Adapter": adapter, "torch": torch}, seed)
        assert probe.compare(outputs, expected) is None


# ----------------------------------------------------------------------------- 13.3: prefix attention

PREFIX_SOURCE = '''
def prefix_attention(x, attn, prefix_k, prefix_v):
    if mistake == "not done":
        raise NotImplementedError
    batch, n, _ = x.shape
    h, p = attn.n_heads, prefix_k.shape[1]
    if mistake == "shared across heads":
        prefix_k, prefix_v = prefix_k[:1].expand(h, -1, -1), prefix_v[:1].expand(h, -1, -1)
    if mistake == "detached":
        prefix_k, prefix_v = prefix_k.detach(), prefix_v.detach()
    if mistake == "heads scrambled":  # concatenated before the heads are split, flattened without moving the head axis
        k = torch.cat([prefix_k.reshape(p, -1).expand(batch, -1, -1), attn.W_K(x)], dim=1)
        v = torch.cat([prefix_v.reshape(p, -1).expand(batch, -1, -1), attn.W_V(x)], dim=1)
        k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (k, v))
    else:
        k, v = (W(x).unflatten(-1, (h, -1)).transpose(1, 2) for W in (attn.W_K, attn.W_V))
    q = attn.W_Q(x).unflatten(-1, (h, -1)).transpose(1, 2)
    if mistake == "queries too":
        q = torch.cat([prefix_k.expand(batch, -1, -1, -1), q], dim=2)
    front_v = prefix_k if mistake == "keys as values" else prefix_v
    if mistake == "no batch axis":
        k = torch.cat([prefix_k, k], dim=2)
    elif mistake.startswith("after"):
        k = torch.cat([k, prefix_k.expand(batch, -1, -1, -1)], dim=2)
    elif mistake not in ("prefix ignored", "heads scrambled", "keys without prefix"):
        k = torch.cat([prefix_k.expand(batch, -1, -1, -1), k], dim=2)
    if mistake.startswith("after"):
        v = torch.cat([v, front_v.expand(batch, -1, -1, -1)], dim=2)
    elif mistake not in ("prefix ignored", "values without prefix", "heads scrambled"):
        v = torch.cat([front_v.expand(batch, -1, -1, -1), v], dim=2)
    n_query = q.shape[2]
    causal = torch.ones(n_query, n_query, dtype=torch.bool).tril()
    if mistake in ("mask not extended", "prefix ignored"):
        mask = causal
    elif mistake == "prefix masked":
        mask = torch.ones(n, p + n, dtype=torch.bool).tril()
    elif mistake == "no causal":
        mask = torch.ones(n, p + n, dtype=torch.bool)
    elif mistake == "after, end-aligned mask":
        mask = torch.ones(n, n + p, dtype=torch.bool).tril(diagonal=p)
    elif mistake == "queries too":
        mask = torch.ones(n + p, n + p, dtype=torch.bool).tril()
    else:
        mask = torch.cat([torch.ones(n, p, dtype=torch.bool), causal], dim=1)
    if mistake in ("scale d_model", "no scale"):  # their own softmax, scaled by the wrong width
        scale = {"scale d_model": math.sqrt(attn.d_model), "no scale": 1.0}[mistake]
        scores = (q @ k.transpose(-2, -1) / scale).masked_fill(~mask, float("-inf"))
        z = torch.softmax(scores, dim=-1) @ v
    else:
        z, _ = masked_attention(q, k, v, mask)
    out = attn.W_O(z.transpose(1, 2).flatten(2))
    return out.float() if mistake == "float32" else out
'''

ANOTHER_PREFIX_SOURCE = '''
def prefix_attention(x, attn, prefix_k, prefix_v):
    """Right, written differently: einops, its own softmax, the prefix appended after the tokens with the mask to match."""
    batch, n, _ = x.shape
    p = prefix_k.shape[1]
    split = "b n (h d) -> b h n d"
    q, k, v = (einops.rearrange(W(x), split, h=attn.n_heads) for W in (attn.W_Q, attn.W_K, attn.W_V))
    k = torch.cat([k, einops.repeat(prefix_k, "h p d -> b h p d", b=batch)], dim=2)
    v = torch.cat([v, einops.repeat(prefix_v, "h p d -> b h p d", b=batch)], dim=2)
    allowed = torch.cat([torch.arange(n)[None, :] <= torch.arange(n)[:, None], torch.ones(n, p, dtype=torch.bool)], dim=1)
    scores = einops.einsum(q, k, "b h i d, b h j d -> b h i j") / attn.d_head ** 0.5
    weights = torch.where(allowed, scores, torch.tensor(float("-inf"), dtype=scores.dtype)).softmax(-1)
    return attn.W_O(einops.rearrange(weights @ v, "b h n d -> b n (h d)"))
'''


def make_prefix_namespace(mistake="", source=PREFIX_SOURCE):
    """A notebook's globals holding a learner's prefix_attention (right or with one ``mistake``) and masked_attention."""
    import einops

    from tfedu.attention import scaled_dot_product_attention

    namespace = {"torch": torch, "math": math, "einops": einops, "mistake": mistake,
                 "masked_attention": scaled_dot_product_attention}  # the reference, as use_mine gives it
    exec(compile(source, "<learner's prefix_attention>", "exec"), namespace)
    return namespace


def make_prefix(mistake="", source=PREFIX_SOURCE):
    return make_prefix_namespace(mistake, source)["prefix_attention"]


PREFIX_MISTAKES = {
    "prefix masked": "the causal mask hides the prefix",
    "mask not extended": "the mask was not extended for the prefix",
    "no causal": "your tokens see later tokens",
    "prefix ignored": "plain causal attention with no prefix at all",
    "queries too": "the prefix went in front of the queries",
    "values without prefix": "in front of the keys but not of the values",
    "keys without prefix": "in front of the values but not of the keys",
    "keys as values": "the values' prefix is prefix_k",
    "after, end-aligned mask": "your prefix sits after the tokens",
    "after, front mask": "your prefix sits after the tokens",
    "shared across heads": "every head reads the same prefix",
    "heads scrambled": "the prefix's heads are scrambled",
    "scale d_model": "divided by sqrt(d_model)",
    "no scale": "the scores are not scaled",
    "detached": "no gradient reaches prefix_k and prefix_v",
    "float32": "your output is float32 for a float64 input",
    "no batch axis": "the prefix has no batch axis of its own",
}


@pytest.mark.parametrize("source", [PREFIX_SOURCE, ANOTHER_PREFIX_SOURCE], ids=["reference", "another way"])
def test_prefix_right_answers_pass(source, capsys):
    nb13.check_prefix_attention(make_prefix(source=source))
    assert "✓" in capsys.readouterr().out


def test_the_checkers_formula_is_tfedus_prefix():
    """prefix_variant's right answer (by hand) is tfedu.layers.Attention with the prefix set, in float64."""
    for case in nb13.make_prefix_cases(np.random.default_rng(5)):
        torch.testing.assert_close(nb13.prefix_variant(case), torch.from_numpy(nb13.prefix_reference(case)["out"]))


def test_the_stand_in_passes_exercise_5_2s_check():
    from tfedu.checks import nb05_masks_and_heads as nb05

    nb05.check_masked_attention(nb13.standin_masked_attention)


@pytest.mark.parametrize("mistake", list(PREFIX_MISTAKES))
def test_prefix_mistakes_are_named(mistake):
    assert PREFIX_MISTAKES[mistake] in failure_of(nb13.check_prefix_attention, make_prefix(mistake))


def test_prefix_not_done_and_shortcut():
    with pytest.raises(ExerciseNotDone):
        nb13.check_prefix_attention(make_prefix("not done"))
    with pytest.raises(ExerciseNotDone):
        nb13.check_prefix_attention(None)
    through_tfedu = make_prefix(source=(
        "from tfedu import layers\n\n"
        "def prefix_attention(x, attn, prefix_k, prefix_v):\n"
        "    layer = layers.Attention(attn.d_model, attn.n_heads).to(x.dtype)\n"
        "    layer.load_state_dict(attn.state_dict())\n"
        "    layer.prefix = lambda: (prefix_k, prefix_v)\n"
        "    return layer(x, causal=True)\n"))
    assert "tfedu's attention layers already run a prefix" in failure_of(nb13.check_prefix_attention, through_tfedu)


def test_the_checker_puts_the_learners_masked_attention_back():
    namespace = make_prefix_namespace()
    mine = namespace["masked_attention"]
    nb13.check_prefix_attention(namespace["prefix_attention"])
    assert namespace["masked_attention"] is mine


@pytest.mark.parametrize("mistake", list(PREFIX_MISTAKES))
def test_prefix_probe_names_the_mistake(mistake):
    probe = nb13.PROBES["check_prefix_attention"]
    namespace = make_prefix_namespace(mistake)
    for seed in range(2):
        found = verdict(probe, namespace, seed, standins=True)
        assert found is not None and PREFIX_MISTAKES[mistake] in found, found


@pytest.mark.parametrize("source", [PREFIX_SOURCE, ANOTHER_PREFIX_SOURCE], ids=["reference", "another way"])
def test_prefix_probe_passes_right_answers(source):
    probe = nb13.PROBES["check_prefix_attention"]
    namespace = make_prefix_namespace(source=source)
    for seed in range(4):
        assert verdict(probe, namespace, seed, standins=True) is None
        assert verdict(probe, namespace, seed) is None  # with the reference masked_attention too


def test_a_wrong_masked_attention_costs_only_5_2():
    """Graded with the stand-in, a prefix_attention that calls a wrong masked_attention still passes 13.3."""
    namespace = make_prefix_namespace()
    namespace["masked_attention"] = lambda q, k, v, mask: (v[..., : q.shape[-2], :], None)
    probe = nb13.PROBES["check_prefix_attention"]
    assert verdict(probe, namespace, 0) is not None
    assert verdict(probe, namespace, 0, standins=True) is None
    nb13.check_prefix_attention(namespace["prefix_attention"])  # the check cell binds the stand-in too


def test_the_learners_prefix_trains_the_course_gpts_prefix_as_tfedu_does():
    """The switch's wiring: each prefixed layer's forward answered by the learner's function with the layer's own
    prefix gives apply_prefix_tuning's logits, and a few Adam steps the same loss (the sdpa path against a softmax)."""
    import copy
    import types

    from tfedu.config import preset
    from tfedu.model import GPT
    from tfedu.peft import apply_prefix_tuning

    mine = make_prefix()
    torch.manual_seed(0)
    base = GPT(preset("tiny").replace(attention="sdpa", dropout=0.0)).eval()
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    apply_prefix_tuning(reference, n_prefix=4)
    apply_prefix_tuning(model, n_prefix=4)

    def forward(attn, x, mask=None, *, causal=False, positions=None, bias=None, kv_cache=None):
        assert causal and mask is None and bias is None and kv_cache is None
        return mine(x, attn, *attn.prefix())

    for block in model.blocks:
        block.attn.forward = types.MethodType(forward, block.attn)
    ids = torch.randint(0, base.cfg.d_vocab, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
    losses = []
    for m in (reference, model):
        opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(5):
            _, loss = m(ids[:, :-1], ids[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-4

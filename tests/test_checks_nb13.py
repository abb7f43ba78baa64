"""Checker and probe of notebook 13: the reference passes, realistic mistakes fail with their named hint."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from checker_helpers import failure_of
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

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
from tfedu.peft import LoRALinear

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

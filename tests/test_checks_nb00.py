import numpy as np
import pytest
import torch

from tfedu.checks import nb00_start_here as nb00
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe
from tfedu.softmax import softmax


def test_reference_passes(capsys):
    nb00.check_softmax(softmax)
    assert "\N{CHECK MARK} stable softmax" in capsys.readouterr().out


def test_a_different_correct_implementation_passes():
    def logsumexp_softmax(x):
        return (x - torch.logsumexp(x, dim=-1, keepdim=True)).exp()

    nb00.check_softmax(logsumexp_softmax)


def test_overflowing_softmax_is_told_to_subtract_the_max():
    with pytest.raises(CheckFailure, match="Subtract the row max") as info:
        nb00.check_softmax(nb00.naive_softmax)
    assert "overflows" in str(info.value)


def test_wrong_axis_is_named():
    def column_softmax(x):
        shifted = x - x.max(dim=0, keepdim=True).values
        return shifted.exp() / shifted.exp().sum(dim=0, keepdim=True)

    with pytest.raises(CheckFailure, match="dim 0"):
        nb00.check_softmax(column_softmax)


def test_dim_1_on_a_3d_batch_is_named():
    def dim1_softmax(x):
        shifted = x - x.max(dim=1, keepdim=True).values
        return shifted.exp() / shifted.exp().sum(dim=1, keepdim=True)

    with pytest.raises(CheckFailure, match="wrong axis on a 3-D batch"):
        nb00.check_softmax(dim1_softmax)


def test_global_normalisation_is_named():
    with pytest.raises(CheckFailure, match="rows do not sum to one"):
        nb00.check_softmax(lambda x: x.exp() / x.exp().sum())


def test_unfinished_exercise():
    def softmax_stub(x):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb00.check_softmax(softmax_stub)



@pytest.mark.parametrize("seed", range(5))
def test_probe_agrees_with_reference(seed):
    outputs, expected = run_probe(nb00.PROBES["check_softmax"], {"softmax": softmax}, seed)
    np.testing.assert_allclose(outputs["y"], expected["y"], rtol=1e-5, atol=1e-6)


def test_probe_catches_the_naive_softmax():
    outputs, expected = run_probe(nb00.PROBES["check_softmax"], {"softmax": nb00.naive_softmax}, 0)
    assert not np.allclose(outputs["y"], expected["y"], equal_nan=False)


@pytest.mark.parametrize("shift", ["min", "mean", "first"])
def test_shifting_by_anything_but_the_max_is_caught(shift):
    def shifted_softmax(x):
        m = {"min": x.amin(-1, keepdim=True), "mean": x.mean(-1, keepdim=True), "first": x[..., :1]}[shift]
        e = (x - m).exp()
        return e / e.sum(-1, keepdim=True)

    with pytest.raises(CheckFailure, match="not the min, the mean or the first entry"):
        nb00.check_softmax(shifted_softmax)
    outputs, expected = run_probe(nb00.PROBES["check_softmax"], {"softmax": shifted_softmax}, 0)
    assert not np.allclose(outputs["y"], expected["y"])


def test_max_shift_then_global_sum_is_named():
    def global_sum(x):
        e = (x - x.max(dim=-1, keepdim=True).values).exp()
        return e / e.sum()

    with pytest.raises(CheckFailure, match="not the sum of everything"):
        nb00.check_softmax(global_sum)


def test_max_shift_without_division_is_named():
    with pytest.raises(CheckFailure, match="exp\\(x - max\\) without dividing"):
        nb00.check_softmax(lambda x: (x - x.max(dim=-1, keepdim=True).values).exp())


def test_forgotten_values_or_keepdim_gets_a_shape_hint():
    def no_values(x):
        e = (x - x.max(dim=-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)

    with pytest.raises(CheckFailure, match="take .values"):
        nb00.check_softmax(no_values)

    def no_keepdim(x):
        e = (x - x.max(dim=-1).values).exp()
        return e / e.sum(-1)

    with pytest.raises(CheckFailure, match="keepdim=True"):
        nb00.check_softmax(no_keepdim)


@pytest.mark.parametrize("shortcut", [lambda x: torch.softmax(x, -1), lambda x: x.softmax(-1),
                                      lambda x: torch.nn.functional.softmax(x, dim=-1)])
def test_calling_torch_softmax_is_refused(shortcut):
    with pytest.raises(CheckFailure, match="build the softmax yourself"):
        nb00.check_softmax(shortcut)
    assert torch.softmax(torch.zeros(2), -1).tolist() == [0.5, 0.5]  # the originals are restored


@pytest.mark.parametrize("shortcut", [lambda x: torch.log_softmax(x, -1).exp(), lambda x: x.log_softmax(-1).exp(),
                                      lambda x: torch.special.log_softmax(x, -1).exp(),
                                      lambda x: torch.special.softmax(x, -1)])
def test_log_softmax_and_special_shortcuts_are_refused(shortcut):
    with pytest.raises(CheckFailure, match="build the softmax yourself"):
        nb00.check_softmax(shortcut)

import numpy as np
import pytest
import torch

from tfedu.checks import nb00_start_here as nb00
from tfedu.checks.core import CheckFailure, ExerciseNotDone
from tfedu.softmax import softmax


def test_reference_passes(capsys):
    nb00.check_softmax(softmax)
    assert "\N{CHECK MARK} stable softmax" in capsys.readouterr().out


def test_torch_softmax_passes():
    nb00.check_softmax(lambda x: torch.softmax(x, dim=-1))


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


def run_probe(probe, namespace, seed):
    inputs = probe.make_inputs(np.random.default_rng(seed))
    scope = {**namespace, "inputs": inputs, "np": np, "torch": torch}
    exec(probe.run, scope)
    return scope["outputs"], probe.reference(inputs)


@pytest.mark.parametrize("seed", range(5))
def test_probe_agrees_with_reference(seed):
    outputs, expected = run_probe(nb00.PROBES["check_softmax"], {"softmax": softmax}, seed)
    np.testing.assert_allclose(outputs["y"], expected["y"], rtol=1e-5, atol=1e-6)


def test_probe_catches_the_naive_softmax():
    outputs, expected = run_probe(nb00.PROBES["check_softmax"], {"softmax": nb00.naive_softmax}, 0)
    assert not np.allclose(outputs["y"], expected["y"], equal_nan=False)

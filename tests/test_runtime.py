import pytest
import torch

import tfedu
from tfedu.runtime import DEVICE_ENV_VAR


def test_device_defaults_to_an_available_device(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)
    dev = tfedu.device()
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert dev.type == expected


def test_device_override_by_environment(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "cpu")
    assert tfedu.device() == torch.device("cpu")


def test_device_override_rejects_nonsense(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "banana")
    with pytest.raises(ValueError, match="not a device torch knows"):
        tfedu.device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_device_override_asking_for_missing_cuda(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        tfedu.device()


def test_seed_everything_repeats_torch_numpy_and_python():
    import random

    import numpy as np

    def draw():
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()

    tfedu.seed_everything(123)
    first = draw()
    tfedu.seed_everything(123)
    assert draw() == first
    tfedu.seed_everything(124)
    assert draw() != first


def test_seed_everything_returns_a_seeded_generator():
    a = torch.rand(2, generator=tfedu.seed_everything(7))
    b = torch.rand(2, generator=tfedu.seed_everything(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [1.5, "0", None, True])
def test_seed_everything_rejects_non_integers(bad):
    with pytest.raises(TypeError, match="seed must be an int"):
        tfedu.seed_everything(bad)

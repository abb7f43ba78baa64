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


@pytest.mark.parametrize("capability, native", [((7, 5), False), ((7, 0), False), ((8, 0), True), ((8, 9), True),
                                                ((9, 0), True)], ids=["Tesla T4", "Tesla V100", "A100", "L4", "H100"])
def test_bfloat16_is_chosen_by_compute_capability_not_by_is_bf16_supported(monkeypatch, capability, native):
    """torch.cuda.is_bf16_supported() says True on a T4, which only emulates bfloat16; training and notebook 09
    choose by compute capability instead (8.0 on)."""
    from tfedu.train import autocast_for
    from tfedu.runtime import bfloat16_native

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert bfloat16_native("cuda") is native and bfloat16_native(torch.device("cuda", 0)) is native
    assert bfloat16_native("cpu") is False and bfloat16_native("mps") is False
    if not native:  # training's autocast (tfedu.train and the bench's peer loop): none, float32
        assert not isinstance(autocast_for(torch.device("cuda")), torch.autocast)


def test_bfloat16_is_not_native_without_a_gpu(monkeypatch):
    from tfedu.runtime import bfloat16_native

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bfloat16_native("cuda") is False

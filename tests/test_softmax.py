"""The four softmaxes of tfedu.softmax equal torch.softmax, and the naive one overflows where deck 000 says."""

import pytest
import torch

from tfedu.softmax import naive_softmax, online_softmax, online_softmax_step, safe_softmax, softmax

STABLE = [softmax, safe_softmax, online_softmax, lambda x: online_softmax(x, block=3)]


@pytest.mark.parametrize("fn", STABLE + [naive_softmax])
def test_every_softmax_equals_torch_on_moderate_scores(fn):
    x = 3 * torch.randn(4, 5, 17, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fn(x), torch.softmax(x, dim=-1))


@pytest.mark.parametrize("fn", STABLE)
def test_the_stable_ones_survive_scores_where_exp_overflows(fn):
    x = torch.tensor([[1000.0, 1001.0, 999.0, -5.0], [88.0, 89.0, 90.0, 100.0]])
    assert torch.isinf(x.exp()).any()
    torch.testing.assert_close(fn(x), torch.softmax(x, dim=-1))


def test_naive_overflows_just_above_float32s_exp_limit():
    assert torch.isfinite(naive_softmax(torch.tensor([88.0, 0.0]))).all()
    assert torch.isnan(naive_softmax(torch.tensor([89.0, 0.0]))).any()  # exp(89) = inf in float32
    assert torch.isfinite(naive_softmax(torch.tensor([89.0, 0.0], dtype=torch.float64))).all()


@pytest.mark.parametrize("block", [1, 2, 5, 16, 100])
def test_online_softmax_any_block_size_and_running_state(block):
    x = 50 * torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(online_softmax(x, block=block), torch.softmax(x, dim=-1))
    m = torch.full((3,), float("-inf"))
    l = torch.zeros(3)
    for start in range(0, 16, block):
        m, l = online_softmax_step(m, l, x[:, start:start + block])
    torch.testing.assert_close(m, x.amax(dim=-1))
    torch.testing.assert_close(l, (x - m[:, None]).exp().sum(dim=-1))


def test_online_softmax_runs_a_given_step():
    calls = []

    def counting_step(m, l, block):
        calls.append(block.shape[-1])
        return online_softmax_step(m, l, block)

    online_softmax(torch.randn(2, 10), block=4, step=counting_step)
    assert calls == [4, 4, 2]


@pytest.mark.parametrize("fn", [naive_softmax, safe_softmax, online_softmax])
def test_bad_inputs_are_named(fn):
    with pytest.raises(TypeError, match="floating-point"):
        fn(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        fn([1.0, 2.0])
    with pytest.raises(ValueError, match="0-d"):
        fn(torch.tensor(1.0))


def test_online_softmax_block_must_be_positive():
    with pytest.raises(ValueError, match="positive int"):
        online_softmax(torch.randn(3), block=0)

"""tfedu.flops against torch's own FLOP counter (the oracle) on real layers."""

import doctest

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tfedu import flops
from tfedu.flops import SOFTMAX_OPS_PER_SCORE, attention_flops, linear_flops, matmul_flops, multi_head_overhead


def counted(fn, *args, **kwargs) -> int:
    """The matmul FLOPs torch counts while running ``fn``."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def test_docstring_examples():
    failures, tried = doctest.testmod(flops, raise_on_error=False)
    assert tried >= 5 and failures == 0


def test_matmul_flops_matches_torch():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    assert matmul_flops(3, 5, 7) == counted(torch.matmul, a, b) == 2 * 3 * 5 * 7


@pytest.mark.parametrize("bias", [True, False])
def test_linear_flops_matches_torch(bias):
    layer = nn.Linear(6, 10, bias=bias)
    x = torch.randn(4, 3, 6)  # 12 vectors
    assert linear_flops(12, 6, 10) == counted(layer, x) == 2 * 12 * 6 * 10


@pytest.mark.parametrize(
    "batch, query_pos, key_pos, d_model, n_heads, d_head, kv_d_model",
    [(2, 6, 6, 12, 3, None, None), (1, 5, 5, 8, 1, None, None), (3, 4, 7, 8, 2, None, 5), (2, 3, 3, 6, 2, 5, None)],
)
def test_attention_flops_matches_torch_on_the_reference_layer(batch, query_pos, key_pos, d_model, n_heads, d_head, kv_d_model):
    from tfedu.attention import MultiHeadAttention

    layer = MultiHeadAttention(d_model, n_heads, d_head=d_head, kv_d_model=kv_d_model)
    x = torch.randn(batch, query_pos, d_model)
    context = None if kv_d_model is None and key_pos == query_pos else torch.randn(batch, key_pos, kv_d_model or d_model)
    expected = attention_flops(batch, query_pos, key_pos, d_model, n_heads, d_head=d_head, kv_d_model=kv_d_model)
    assert expected.matmul == counted(layer, x, context)


def test_attention_flops_matches_torch_multihead_attention():
    layer = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        assert attention_flops(2, 9, 9, 16, 4).matmul == counted(layer, x, x, x, need_weights=True)  # the path whose matmuls torch counts


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16])
def test_matmul_flops_do_not_depend_on_the_number_of_heads(n_heads):
    b, n, d = 3, 10, 64
    f = attention_flops(b, n, n, d, n_heads)
    assert f.matmul == 8 * b * n * d**2 + 4 * b * n**2 * d
    assert f.softmax == SOFTMAX_OPS_PER_SCORE * b * n_heads * n * n


def test_cross_attention_terms():
    f = attention_flops(batch=2, query_pos=3, key_pos=5, d_model=4, n_heads=2, kv_d_model=6)
    assert (f.q_proj, f.k_proj, f.v_proj, f.out_proj) == (2 * 6 * 4 * 4, 2 * 10 * 6 * 4, 2 * 10 * 6 * 4, 2 * 6 * 4 * 4)
    assert f.scores == f.mix == 2 * 2 * 3 * 5 * 4  # 2 * batch * query_pos * key_pos * (n_heads * d_head)
    assert f.total == f.matmul + f.softmax


def test_overhead_is_small_and_grows_with_heads():
    ratios = [multi_head_overhead(1, 512, 512, h) for h in (1, 2, 8, 32)]
    assert ratios[0] == 1.0
    assert ratios == sorted(ratios) and ratios[-1] < 1.1


@pytest.mark.parametrize("pos, d_model, n_heads", [(1024, 768, 12), (4096, 96, 32), (16, 96, 32), (7, 8, 8), (4096, 2304, 1)])
def test_overhead_has_the_closed_form_of_notebook_05(pos, d_model, n_heads):
    """h heads / 1 head = 1 + 5(h-1) / (8 d^2/n + 4d + 5), below its long-sequence limit 1 + 5(h-1)/(4d+5)."""
    ratio = multi_head_overhead(1, pos, d_model, n_heads)
    assert ratio == pytest.approx(1 + 5 * (n_heads - 1) / (8 * d_model**2 / pos + 4 * d_model + 5), rel=1e-12)
    assert ratio <= 1 + 5 * (n_heads - 1) / (4 * d_model + 5)


def test_the_widget_corner_and_gpt2_small():
    assert round(multi_head_overhead(1, 4096, 96, 32), 3) == 1.381  # the 1.38x learners saw in notebook 05's widget
    assert round(multi_head_overhead(1, 1024, 768, 12), 4) == 1.0072


@pytest.mark.parametrize("d_model, n_heads", [(768, 12), (96, 32), (64, 4)])
def test_n_by_n_products_overtake_the_projections_at_twice_d_model(d_model, n_heads):
    def n_by_n(n):
        f = attention_flops(1, n, n, d_model, n_heads)
        return f.scores + f.mix, f.q_proj + f.k_proj + f.v_proj + f.out_proj

    assert n_by_n(2 * d_model)[0] == n_by_n(2 * d_model)[1]
    assert n_by_n(2 * d_model - 1)[0] < n_by_n(2 * d_model - 1)[1] and n_by_n(2 * d_model + 1)[0] > n_by_n(2 * d_model + 1)[1]
    f = attention_flops(1, 4096, 4096, d_model, n_heads)
    assert f.softmax / (f.scores + f.mix) == pytest.approx(SOFTMAX_OPS_PER_SCORE / (4 * (d_model // n_heads)))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: matmul_flops(-1, 2, 3), "m must be a non-negative int"),
        (lambda: linear_flops(2, 3.0, 4), "d_in must be a positive int"),
        (lambda: attention_flops(1, 4, 4, 10, 3), "not divisible by n_heads=3"),
        (lambda: attention_flops(1, 4, 4, 8, 0), "n_heads must be a positive int"),
        (lambda: attention_flops(1, 4, 4, 8, 2, d_head=0), "d_head must be a positive int"),
        (lambda: attention_flops(True, 4, 4, 8, 2), "batch must be a non-negative int"),
        (lambda: multi_head_overhead(0, 4, 8, 2), "batch must be a positive int"),
        (lambda: multi_head_overhead(1, 0, 8, 2), "pos must be a positive int"),
    ],
)
def test_bad_input_says_what_was_expected(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layer_costs_follow_vaswani_table_1():
    from tfedu.flops import layer_costs

    n, d, k, r = 1000, 64, 4, 100
    costs = layer_costs(n, d, k, r)
    assert costs["self-attention"] == flops.LayerCost(n**2 * d, 1, 1)
    assert costs["recurrent"] == flops.LayerCost(n * d**2, n, n)
    assert costs["convolutional"] == flops.LayerCost(k * n * d**2, 1, 5)  # 4**5 = 1024 >= 1000 > 4**4
    assert costs["self-attention (restricted)"] == flops.LayerCost(r * n * d, 1, 10)
    # Vaswani sec. 4: self-attention is cheaper than recurrence exactly when n < d
    for n_pos in (32, 64, 128):
        c = layer_costs(n_pos, 64, 3, 8)
        assert (c["self-attention"].per_layer < c["recurrent"].per_layer) == (n_pos < 64)
    assert layer_costs(1, 8, 2, 1)["convolutional"].max_path == 1
    for bad in (dict(k=1), dict(n=0)):
        with pytest.raises(ValueError):
            layer_costs(**{**dict(n=4, d=4, k=2, r=2), **bad})

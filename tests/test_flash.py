"""tfedu.flash against torch's attention (the oracle), the quadratic form of linear attention, and measured memory."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tfedu.flash import (
    FlashAttention,
    elu_feature_map,
    flash_attention,
    flash_backward,
    flash_forward,
    linear_attention,
    linear_attention_quadratic,
    memory_vs_n,
    peak_memory,
    standard_attention,
)

MiB = 2**20


def randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(seed=0, batch=(2, 3), n_q=100, n_k=100, d=16, d_v=None, dtype=torch.float32):
    return (randn(seed, *batch, n_q, d, dtype=dtype), randn(seed + 1, *batch, n_k, d, dtype=dtype),
            randn(seed + 2, *batch, n_k, d if d_v is None else d_v, dtype=dtype))


def sdpa_grads(q, k, v, do, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kw)
    out.backward(do)
    return out.detach(), [t.grad for t in leaves]


# ----------------------------------------------------------------------------- forward


CASES = [  # (batch, n_q, n_k, d, d_v, block_q, block_k)
    ((2, 3), 100, 100, 16, None, 32, 32),  # 100 is not a multiple of the block size
    ((2,), 100, 100, 64, None, 32, 32),
    ((), 100, 100, 16, 8, 32, 16),  # blocks of different sizes: the diagonal crosses tiles off-centre
    ((1, 2), 70, 70, 16, None, 16, 48),
    ((3,), 10, 10, 16, None, 64, 64),  # one block bigger than the sequence
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, n_q, n_k, d, d_v, block_q, block_k", CASES)
def test_forward_matches_sdpa_and_lse_is_the_logsumexp(causal, batch, n_q, n_k, d, d_v, block_q, block_k, typechecked):
    q, k, v = qkv(batch=batch, n_q=n_q, n_k=n_k, d=d, d_v=d_v)
    o, lse = typechecked(flash_forward)(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=causal), atol=1e-5, rtol=1e-5)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-5)
    assert o.dtype == q.dtype and lse.dtype == torch.float32


def test_forward_with_fewer_queries_than_keys_and_a_given_scale():
    q, k, v = qkv(3, n_q=37, n_k=100, d=64)
    o, _ = flash_forward(q, k, v, scale=0.3, block_q=16, block_k=32)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, scale=0.3), atol=1e-5, rtol=1e-5)


def test_standard_attention_is_the_same_function_materialised(typechecked):
    q, k, v = qkv(4, batch=(2,), n_q=20, n_k=20, d=16)
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5)
        torch.testing.assert_close(typechecked(standard_attention)(q, k, v, causal=causal, scale=0.5), expected)


def matmul_flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_causal_skips_the_tiles_above_the_diagonal_forward_and_backward():
    # 4 x 4 tiles of 64: causal computes the 10 on or below the diagonal, not all 16 with 6 masked.
    q, k, v = qkv(5, batch=(), n_q=256, n_k=256, d=16)
    o, lse = flash_forward(q, k, v)
    forward = [matmul_flops(lambda: flash_forward(q, k, v, causal=c)) for c in (False, True)]
    backward = [matmul_flops(lambda: flash_backward(q, k, v, o, lse, o, causal=c)) for c in (False, True)]
    assert forward[1] / forward[0] == pytest.approx(10 / 16)
    assert backward[1] / backward[0] == pytest.approx(10 / 16)


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, d_v, block_q, block_k", [(16, None, 32, 32), (64, 8, 16, 48)])
def test_gradients_match_sdpa(causal, d, d_v, block_q, block_k):
    q, k, v = qkv(6, batch=(2, 2), d=d, d_v=d_v)
    do = randn(9, *q.shape[:-1], v.shape[-1])
    expected_out, expected = sdpa_grads(q, k, v, do, is_causal=causal)

    o, lse = flash_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    grads = flash_backward(q, k, v, o, lse, do, causal=causal, block_q=block_q, block_k=block_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal, block_q=block_q, block_k=block_k)
    out.backward(do)
    torch.testing.assert_close(out.detach(), expected_out, atol=1e-5, rtol=1e-5)
    for name, ours, through_autograd, theirs in zip("qkv", grads, leaves, expected):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, msg=f"d{name}")
        torch.testing.assert_close(through_autograd.grad, theirs, atol=1e-5, rtol=1e-5, msg=f"d{name} (autograd)")


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_in_float64(causal):
    q, k, v = (t.requires_grad_() for t in qkv(7, batch=(2,), n_q=7, n_k=7, d=4, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal=causal, block_q=3, block_k=2), (q, k, v))


def test_only_q_k_v_o_and_lse_are_saved_for_backward():
    q, k, v = (t.requires_grad_() for t in qkv(8, batch=(1,), n_q=50, n_k=50, d=16))
    out = flash_attention(q, k, v)
    assert [tuple(t.shape) for t in out.grad_fn.saved_tensors] == [(1, 50, 16)] * 4 + [(1, 50)]
    assert out.grad_fn.__class__.__name__ == f"{FlashAttention.__name__}Backward"


# ----------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_keeps_its_dtype_and_accumulates_in_float32(dtype, tol):
    q, k, v = qkv(10, batch=(2,), n_q=100, n_k=100, d=64, dtype=dtype)
    do = randn(11, 2, 100, 64, dtype=dtype)
    expected_out, expected = sdpa_grads(q.float(), k.float(), v.float(), do.float(), is_causal=True)

    o, lse = flash_forward(q, k, v, causal=True, block_q=32, block_k=32)
    assert o.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), expected_out, atol=tol, rtol=tol)
    for ours, theirs in zip(flash_backward(q, k, v, o, lse, do, causal=True, block_q=32, block_k=32), expected):
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.float(), theirs, atol=4 * tol, rtol=4 * tol)


# ----------------------------------------------------------------------------- linear attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [32, 7, 500])  # 100 = 3 * 32 + 4; one chunk bigger than the sequence
def test_linear_attention_equals_its_quadratic_form(causal, chunk, typechecked):
    q, k, v = (t.requires_grad_() for t in qkv(12, batch=(2, 2), d=16, d_v=8))
    ours = typechecked(linear_attention)(q, k, v, causal=causal, chunk=chunk)
    oracle = typechecked(linear_attention_quadratic)(q, k, v, causal=causal)
    torch.testing.assert_close(ours, oracle, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(ours.sum(), (q, k, v))
    for ours_grad, oracle_grad in zip(grads, torch.autograd.grad(oracle.sum(), (q, k, v))):
        torch.testing.assert_close(ours_grad, oracle_grad, atol=1e-5, rtol=1e-5)


def test_linear_attention_by_hand_and_its_causal_invariant():
    q, k, v = qkv(13, batch=(), n_q=12, n_k=12, d=4)
    weights = elu_feature_map(q) @ elu_feature_map(k).T  # positive: phi(q) . phi(k) stands in for exp(q . k)
    assert (weights > 0).all()
    torch.testing.assert_close(linear_attention(q, k, v, eps=0.0), weights @ v / weights.sum(-1, keepdim=True))
    # Causal: changing the last key and value changes no earlier output.
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 5.0, -5.0
    before, after = (linear_attention(q, kk, vv, causal=True, chunk=5) for kk, vv in ((k, v), (k2, v2)))
    torch.testing.assert_close(before[:-1], after[:-1])
    assert not torch.allclose(before[-1], after[-1])


def test_linear_attention_in_half_precision_keeps_its_dtype():
    q, k, v = qkv(14, batch=(1,), n_q=64, n_k=64, d=16, dtype=torch.float16)
    out = linear_attention(q, k, v, causal=True, chunk=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), linear_attention_quadratic(q.float(), k.float(), v.float(), causal=True),
                               atol=2e-3, rtol=2e-3)


# ----------------------------------------------------------------------------- measuring memory


def test_peak_memory_counts_what_the_call_allocates_while_it_lives():
    x = torch.ones(1024)  # 4096 bytes, allocated before: not counted

    def two_temporaries(t):
        a = t * 2  # 4096 bytes
        b = a[:512].view(2, 256).T  # views: nothing new
        a.mul_(3)  # in place: nothing new
        del a, b
        c = t + 1  # a was freed first: the peak does not add them up
        return c.sum()  # 4 more bytes, alive with c

    result, peak = peak_memory(two_temporaries, x)
    assert result.item() == 2048 and peak == 4096 + 4
    assert peak_memory(torch.zeros, 10, dtype=torch.float64)[1] == 80
    assert peak_memory(lambda: None)[1] == 0


def test_peak_memory_sees_inside_backward():
    w = torch.ones(256, requires_grad=True)  # made before: not counted, but its .grad is

    def loss_and_backward(w):
        (w * w).sum().backward()

    _, peak = peak_memory(loss_and_backward, w)
    assert peak >= 2 * 256 * 4  # w * w, then the gradient 2 * w stored in w.grad
    torch.testing.assert_close(w.grad, 2 * torch.ones(256))


@pytest.fixture(scope="module")
def standard_peak_at_8192():
    """One measurement of textbook attention at 8192 positions (about 1 s, 768 MiB of scores and weights)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    q, k, v = qkv(15, batch=(), n_q=8192, n_k=8192, d=64)
    with torch.no_grad():
        _, peak = peak_memory(standard_attention, q, k, v)
    torch.set_num_threads(threads)
    return (q, k, v), peak


def test_flash_forward_at_8192_needs_at_most_a_tenth_of_the_memory(standard_peak_at_8192, one_torch_thread):
    (q, k, v), standard = standard_peak_at_8192
    assert standard >= 3 * 8192**2 * 4  # scores, their exps and the weights: 256 MiB each
    # Blocks of 128 rather than the default 64: four times fewer Python iterations, the same linear memory.
    with torch.no_grad():
        o, flash = peak_memory(flash_attention, q, k, v, block_q=128, block_k=128)
    assert flash <= standard / 10, f"flash {flash / MiB:.1f} MiB vs standard {standard / MiB:.1f} MiB"
    assert flash < 4 * MiB  # o is 2 MiB; the rest is one query block's state and a few tiles
    torch.testing.assert_close(o[:256], F.scaled_dot_product_attention(q[:256], k, v), atol=1e-5, rtol=1e-5)


def test_linear_attention_at_8192_needs_linear_memory(standard_peak_at_8192):
    (q, k, v), standard = standard_peak_at_8192
    for causal in (False, True):
        _, linear = peak_memory(linear_attention, q, k, v, causal=causal)
        assert linear <= standard / 50 and linear < 16 * MiB


def test_memory_grows_linearly_for_flash_and_linear_but_quadratically_for_standard(one_torch_thread):
    mem = memory_vs_n([1024, 2048])
    assert set(mem) == {"standard", "flash", "linear"}
    growth = {name: peaks[1] / peaks[0] for name, peaks in mem.items()}
    assert 3.5 <= growth["standard"] <= 4.5, growth
    assert 1.5 <= growth["flash"] <= 2.5, growth
    assert 1.5 <= growth["linear"] <= 2.5, growth


def test_flash_backward_needs_a_fraction_of_standard_attentions_memory(one_torch_thread):
    q, k, v = qkv(16, batch=(), n_q=1024, n_k=1024, d=64)

    def forward_backward(attention, causal):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, causal=causal).sum().backward()

    for causal in (False, True):
        _, standard = peak_memory(forward_backward, standard_attention, causal)
        _, flash = peak_memory(forward_backward, flash_attention, causal)
        assert standard >= 4 * 1024**2 * 4  # autograd keeps (pos, pos) tensors alive for backward
        assert flash <= standard / 10, f"causal={causal}: flash {flash / MiB:.2f} MiB vs standard {standard / MiB:.2f} MiB"


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(q=torch.ones(2, 4, 8, dtype=torch.long)), TypeError, "q must be a floating-point tensor"),
        (dict(k=[[1.0] * 8] * 4), TypeError, "k must be a torch.Tensor"),
        (dict(k=torch.randn(2, 4, 6)), ValueError, "must share d_head"),
        (dict(v=torch.randn(2, 5, 8)), ValueError, "one value per key"),
        (dict(v=torch.randn(2, 4, 8, dtype=torch.float64)), TypeError, "share one dtype"),
        (dict(k=torch.randn(3, 4, 8), v=torch.randn(3, 4, 8)), ValueError, "same leading"),
        (dict(k=torch.randn(2, 0, 8), v=torch.randn(2, 0, 8)), ValueError, "at least one key"),
        (dict(q=torch.randn(2, 3, 8), causal=True), ValueError, r"causal=True needs query_pos == key_pos"),
        (dict(block_q=0), ValueError, "block_q must be a positive int"),
        (dict(block_k=16.0), ValueError, "block_k must be a positive int"),
        (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    ],
)
def test_bad_input_is_named(change, error, message):
    args = dict(q=torch.randn(2, 4, 8), k=torch.randn(2, 4, 8), v=torch.randn(2, 4, 8))
    args.update(change)
    for fn in (flash_attention, flash_forward):
        with pytest.raises(error, match=message):
            fn(**args)


def test_bad_input_to_the_other_entry_points():
    q = k = v = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"causal=True needs query_pos == key_pos"):
        linear_attention(q[:3], k, v, causal=True)
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        linear_attention(q, k, v, causal=True, chunk=0)
    with pytest.raises(ValueError, match="eps must be"):
        linear_attention_quadratic(q, k, v, eps=-1.0)
    with pytest.raises(TypeError, match="floating-point"):
        standard_attention(q.int(), k, v)
    o, lse = flash_forward(q, k, v)
    with pytest.raises(ValueError, match=r"lse must have shape \(4,\)"):
        flash_backward(q, k, v, o, lse[None], o)
    with pytest.raises(TypeError, match="fn must be callable"):
        peak_memory(q)

"""tfedu.attention against torch's attention (the oracle) and the invariants attention must keep."""

import doctest
import math

import einops
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tfedu import attention as tfa
from tfedu.attention import (
    MultiHeadAttention,
    attention_weights,
    causal_mask,
    combine_masks,
    padding_mask,
    scaled_dot_product_attention,
    soft_lookup,
)


def randn(seed, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def qkv(seed=0, batch=(2, 3), n_query=5, n_key=7, d_head=8, d_v=6, **kw):
    return (randn(seed, *batch, n_query, d_head, **kw), randn(seed + 1, *batch, n_key, d_head, **kw),
            randn(seed + 2, *batch, n_key, d_v, **kw))


def test_docstring_examples():
    failures, tried = doctest.testmod(tfa, raise_on_error=False)
    assert tried > 5 and failures == 0


# ----------------------------------------------------------------------------- oracle: SDPA


@pytest.mark.parametrize("batch", [(), (4,), (2, 3)])
def test_matches_torch_sdpa_without_mask(batch, typechecked):
    q, k, v = qkv(batch=batch)
    out, weights = typechecked(scaled_dot_product_attention)(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert weights.shape == (*batch, 5, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(*batch, 5))


def test_matches_torch_sdpa_with_a_boolean_mask(typechecked):
    q, k, v = qkv(1)
    mask = randn(9, 2, 1, 5, 7) > -0.5
    mask[..., 0] = True  # every query sees at least one key (SDPA gives NaN otherwise)
    out, weights = typechecked(scaled_dot_product_attention)(q, k, v, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert (weights[~mask.expand_as(weights)] == 0).all()


def test_causal_mask_matches_is_causal(typechecked):
    q, k, v = qkv(2, n_query=6, n_key=6)
    out, _ = scaled_dot_product_attention(q, k, v, typechecked(causal_mask)(6, 6))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_causal_mask_is_aligned_to_the_end_unlike_is_causal():
    mask = causal_mask(2, 5)
    assert mask[-1].all()  # the last query sees every key
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    # The same queries as the last two rows of the square mask: what a KV cache needs.
    assert torch.equal(mask, causal_mask(5, 5)[-2:])
    # torch's is_causal aligns to the top-left instead; say so, do not pretend they agree.
    top_left = torch.ones(2, 5, dtype=torch.bool).tril()
    assert not torch.equal(mask, top_left)
    assert causal_mask(3, 2).tolist() == [[False, False], [True, False], [True, True]]
    assert causal_mask(0, 3).shape == (0, 3)


def test_padding_mask_matches_sdpa_and_per_sequence_attention():
    lengths = torch.tensor([3, 5, 1])
    mask = padding_mask(lengths, 5)
    assert mask.shape == (3, 1, 1, 5) and mask.dtype == torch.bool
    q, k, v = qkv(3, batch=(3, 2), n_query=4, n_key=5)
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    for b, n in enumerate(lengths.tolist()):  # padding is as if those keys were never there
        alone, _ = scaled_dot_product_attention(q[b], k[b, :, :n], v[b, :, :n])
        torch.testing.assert_close(out[b], alone)


def test_combine_masks():
    both = combine_masks(causal_mask(4, 4), padding_mask([2, 4], 4))
    assert both.shape == (2, 1, 4, 4)
    assert both[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert torch.equal(both[1, 0], causal_mask(4, 4))
    assert combine_masks(None, None) is None
    assert combine_masks(causal_mask(2, 2), None) is not None
    with pytest.raises(TypeError, match="boolean"):
        combine_masks(causal_mask(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="do not broadcast"):
        combine_masks(causal_mask(2, 2), causal_mask(3, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_match_torch_softmax(dtype):
    # The row max is detached (the softmax does not depend on it): the gradients must still be
    # exactly those of the softmax, here against torch's fused one under the same causal mask.
    q, k, _ = qkv(11, n_query=6, n_key=6, dtype=dtype)
    mask = causal_mask(6, 6)
    grad_out = randn(12, 2, 3, 6, 6, dtype=dtype)
    q_ours, k_ours = q.clone().requires_grad_(), k.clone().requires_grad_()
    attention_weights(q_ours, k_ours, mask).backward(grad_out)
    q_ref, k_ref = q.clone().requires_grad_(), k.clone().requires_grad_()
    scores = (q_ref @ k_ref.transpose(-2, -1) / math.sqrt(8)).masked_fill(~mask, float("-inf"))
    torch.softmax(scores, dim=-1).backward(grad_out)
    torch.testing.assert_close(q_ours.grad, q_ref.grad)
    torch.testing.assert_close(k_ours.grad, k_ref.grad)


# ----------------------------------------------------------------------------- fully masked rows


def test_fully_masked_row_gives_zero_weights_and_zero_output_not_nan():
    q, k, v = qkv(4, batch=(2,), n_query=3, n_key=4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False
    q.requires_grad_(True)
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert (weights[:, 1] == 0).all() and (out[:, 1] == 0).all()
    torch.testing.assert_close(weights[:, [0, 2]].sum(-1), torch.ones(2, 2))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, 1] == 0).all()
    # A sequence of length 0 under a padding mask: every query of it is fully masked.
    out, _ = scaled_dot_product_attention(q.detach(), k, v, padding_mask([0, 4], 4)[:, 0])
    assert (out[0] == 0).all() and torch.isfinite(out).all()


# ----------------------------------------------------------------------------- invariants


def test_permuting_keys_and_values_together_changes_nothing():
    q, k, v = qkv(5)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    out, weights = scaled_dot_product_attention(q, k, v)
    out_p, weights_p = scaled_dot_product_attention(q, k[..., perm, :], v[..., perm, :])
    torch.testing.assert_close(out_p, out)
    torch.testing.assert_close(weights_p, weights[..., perm])


def test_self_attention_is_permutation_equivariant():
    mha = MultiHeadAttention(16, 4)
    x = randn(6, 2, 9, 16)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(mha(x[:, perm]), mha(x)[:, perm])


def test_future_tokens_never_change_earlier_outputs_under_the_causal_mask():
    mha = MultiHeadAttention(16, 4)
    x = randn(7, 2, 8, 16)
    changed = x.clone()
    changed[:, 5:] = randn(8, 2, 3, 16) * 10
    mask = causal_mask(8, 8)
    with torch.no_grad():
        before, after = mha(x, mask=mask), mha(changed, mask=mask)
        torch.testing.assert_close(after[:, :5], before[:, :5], rtol=0, atol=0)
        assert not torch.allclose(after[:, 5:], before[:, 5:])
        # Without the mask the future leaks into every position.
        assert not torch.allclose(mha(changed)[:, :5], mha(x)[:, :5])


def test_batching_equals_one_sequence_at_a_time():
    q, k, v = qkv(10, batch=(4,))
    out, _ = scaled_dot_product_attention(q, k, v)
    for b in range(4):
        torch.testing.assert_close(out[b], scaled_dot_product_attention(q[b], k[b], v[b])[0])


def test_the_scale_is_one_over_sqrt_d_head():
    q, k, v = qkv(11)
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1)
    torch.testing.assert_close(attention_weights(q, k), expected)


# ----------------------------------------------------------------------------- bad input


def test_float_and_int_masks_are_refused_with_the_convention():
    q, k, v = qkv(12)
    additive = torch.zeros(5, 7).masked_fill(~causal_mask(5, 7), float("-inf"))
    with pytest.raises(TypeError, match=r"torch.bool.*True = may attend.*MultiheadAttention.*opposite.*mask == 0"):
        scaled_dot_product_attention(q, k, v, additive)
    with pytest.raises(TypeError, match=r"torch.bool, got torch.int64.*True = may attend"):
        scaled_dot_product_attention(q, k, v, causal_mask(5, 7).long())
    with pytest.raises(TypeError, match="boolean torch.Tensor"):
        scaled_dot_product_attention(q, k, v, [[True]])


def test_mask_that_does_not_broadcast_names_the_expected_shape():
    q, k, v = qkv(13)
    with pytest.raises(ValueError, match=r"mask of shape \(7, 5\).*\(2, 3, 5, 7\).*\(query_pos, key_pos\) = \(5, 7\)"):
        scaled_dot_product_attention(q, k, v, causal_mask(7, 5))
    with pytest.raises(ValueError, match="does not broadcast"):  # would enlarge the output: refused
        scaled_dot_product_attention(q, k, v, torch.ones(4, 2, 3, 5, 7, dtype=torch.bool))


def test_bad_shapes_name_the_expected_shapes():
    q, k, v = qkv(14)
    with pytest.raises(ValueError, match=r"must share d_head.*8 != 4"):
        scaled_dot_product_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match=r"same key_pos.*7 != 3"):
        scaled_dot_product_attention(q, k, v[..., :3, :])
    with pytest.raises(ValueError, match=r"\(\.\.\., query_pos, d_head\)"):
        scaled_dot_product_attention(q[0, 0, 0], k, v)
    with pytest.raises(TypeError, match="floating-point"):
        scaled_dot_product_attention(q.long(), k, v)
    with pytest.raises(TypeError, match="torch.Tensor"):
        scaled_dot_product_attention(q.numpy(), k, v)
    with pytest.raises(ValueError, match="do not broadcast"):
        scaled_dot_product_attention(q, k[:1].expand(4, 3, 7, 8), v[:1].expand(4, 3, 7, 6))
    with pytest.raises(ValueError, match="n_query must be a non-negative int"):
        causal_mask(-1, 3)
    with pytest.raises(ValueError, match=r"\[0, n_key=3\]"):
        padding_mask([1, 4], 3)
    with pytest.raises(TypeError, match="1-D integer"):
        padding_mask(torch.tensor([1.0, 2.0]), 3)


# ----------------------------------------------------------------------------- multi-head: oracle


@pytest.mark.parametrize("bias", [True, False])
def test_multi_head_matches_nn_multihead_attention(bias, typechecked):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(24, 4, bias=bias, batch_first=True).eval()
    ours = MultiHeadAttention.load_from_torch(theirs)
    x = randn(20, 3, 6, 24)
    with torch.no_grad():
        expected, expected_pattern = theirs(x, x, x, average_attn_weights=False)
        patterns = []
        handle = ours.hook_pattern.register_forward_hook(lambda module, args, out: patterns.append(out))
        got = typechecked(ours.forward)(x)
        handle.remove()
    torch.testing.assert_close(got, expected)
    assert len(patterns) == 1 and patterns[0].shape == (3, 4, 6, 6)
    torch.testing.assert_close(patterns[0], expected_pattern)


def test_multi_head_with_masks_matches_nn_multihead_attention_given_the_inverted_mask():
    torch.manual_seed(1)
    theirs = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    ours = MultiHeadAttention.load_from_torch(theirs)
    x = randn(21, 2, 5, 16)
    lengths = torch.tensor([5, 3])
    mask = combine_masks(causal_mask(5, 5), padding_mask(lengths, 5))  # True = may attend
    with torch.no_grad():
        got = ours(x, mask=mask)
        # nn.MultiheadAttention: True = masked out, hence the ~.
        expected, _ = theirs(x, x, x, attn_mask=~causal_mask(5, 5), key_padding_mask=~padding_mask(lengths, 5)[:, 0, 0])
    torch.testing.assert_close(got, expected)


def test_cross_attention_matches_nn_multihead_attention_with_kdim():
    torch.manual_seed(2)
    theirs = nn.MultiheadAttention(16, 4, kdim=10, vdim=10, batch_first=True).eval()
    ours = MultiHeadAttention.load_from_torch(theirs)
    assert ours.kv_d_model == 10
    x, context = randn(22, 2, 3, 16), randn(23, 2, 7, 10)
    with torch.no_grad():
        expected, _ = theirs(x, context, context)
        torch.testing.assert_close(ours(x, context), expected)
    with pytest.raises(ValueError, match=r"pass context of shape \(batch, key_pos, 10\)"):
        ours(x)


def test_cross_attention_output_follows_the_queries():
    mha = MultiHeadAttention(8, 2, kv_d_model=5)
    out = mha(randn(24, 3, 4, 8), randn(25, 3, 9, 5), mask=padding_mask([9, 2, 5], 9))
    assert out.shape == (3, 4, 8)


def test_multi_head_equals_heads_run_one_by_one():
    mha = MultiHeadAttention(12, 3, d_head=5)  # d_head need not be d_model / n_heads
    x = randn(26, 2, 4, 12)
    with torch.no_grad():
        q, k, v = mha.W_Q(x), mha.W_K(x), mha.W_V(x)  # (batch, pos, n_heads * d_head)
        heads = [scaled_dot_product_attention(q[..., h * 5:(h + 1) * 5], k[..., h * 5:(h + 1) * 5],
                                              v[..., h * 5:(h + 1) * 5])[0] for h in range(3)]
        torch.testing.assert_close(mha(x), mha.W_O(torch.cat(heads, dim=-1)))


def test_hook_can_replace_the_pattern():
    mha = MultiHeadAttention(8, 2)
    x = randn(27, 1, 3, 8)
    uniform = torch.full((1, 2, 3, 3), 1 / 3)
    mha.hook_pattern.register_forward_hook(lambda module, args, out: uniform)
    with torch.no_grad():
        v = mha.split_heads(mha.W_V(x))
        expected = mha.W_O(mha.merge_heads(uniform @ v))
        torch.testing.assert_close(mha(x), expected)
    assert not any("pattern" in name for name in vars(mha) if not name.startswith("_"))


def test_multi_head_bad_input():
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(10, 3)
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"\(batch, query_pos, d_model=8\), got \(3, 4\)"):
        mha(torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"mask\[:, None\]"):
        mha(torch.randn(2, 3, 8), mask=torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="True = may attend"):
        mha(torch.randn(2, 3, 8), mask=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.load_from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))


# ----------------------------------------------------------------------------- soft look-up (the widget)


KEYS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
VALUES = torch.tensor([[10.0], [20.0], [30.0]])


def test_soft_lookup_is_attention_for_one_query(typechecked):
    query = torch.tensor([0.6, 0.8])
    answer, weights = typechecked(soft_lookup)(query, KEYS, VALUES, sharpness=3.0)
    expected = F.scaled_dot_product_attention(3.0 * query[None], KEYS, VALUES)[0]
    torch.testing.assert_close(answer, expected)
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))


def test_soft_lookup_limits_hard_lookup_and_average():
    answer, weights = soft_lookup(torch.tensor([0.0, 2.0]), KEYS, VALUES, sharpness=1000.0)
    torch.testing.assert_close(answer, torch.tensor([20.0]))  # the dict look-up of the matching key
    assert weights.argmax() == 1
    answer, weights = soft_lookup(torch.tensor([0.0, 2.0]), KEYS, VALUES, sharpness=0.0)
    torch.testing.assert_close(weights, torch.full((3,), 1 / 3))
    torch.testing.assert_close(answer, torch.tensor([20.0]))


def test_moving_the_query_towards_a_key_raises_its_weight():
    angles = torch.linspace(0, math.pi, 9)  # from key 0 (angle 0) round to key 2 (angle pi)
    w = torch.stack([soft_lookup(torch.stack([a.cos(), a.sin()]) * 2, KEYS, VALUES)[1] for a in angles])
    assert (w[1:, 0] < w[:-1, 0]).all() and (w[1:, 2] > w[:-1, 2]).all()
    assert w[4].argmax() == 1  # straight up: key 1 wins


def test_soft_lookup_bad_input():
    with pytest.raises(ValueError, match="1-D"):
        soft_lookup(KEYS, KEYS, VALUES)
    with pytest.raises(ValueError, match="sharpness"):
        soft_lookup(KEYS[0], KEYS, VALUES, sharpness=-1.0)


# ----------------------------------------------------------------------------- dtypes and devices


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_on_cpu(dtype):
    q, k, v = qkv(30, dtype=dtype)
    mask = causal_mask(5, 7)
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert out.dtype == weights.dtype == dtype
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float64: 1e-10}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none); CPU paths are tested above")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_torch_sdpa_and_multihead(dtype):
    q, k, v = qkv(31, dtype=dtype, device="cuda")
    mask = combine_masks(causal_mask(5, 7, device="cuda"), padding_mask(torch.tensor([7, 4], device="cuda"), 7))
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert out.device.type == weights.device.type == "cuda" and out.dtype == dtype
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=tol, atol=tol)
    torch.manual_seed(3)
    theirs = nn.MultiheadAttention(16, 4, batch_first=True).to("cuda", dtype).eval()
    ours = MultiHeadAttention.load_from_torch(theirs)
    assert ours.W_Q.weight.device.type == "cuda" and ours.W_Q.weight.dtype == dtype
    x = randn(32, 2, 6, 16, dtype=dtype, device="cuda")
    with torch.no_grad():
        expected, _ = theirs(x, x, x, attn_mask=~causal_mask(6, 6, device="cuda"))
        torch.testing.assert_close(ours(x, mask=causal_mask(6, 6, device="cuda")), expected, rtol=tol, atol=tol)


def test_mask_on_another_device_is_refused_clearly():
    q, k, v = qkv(33)
    mask = causal_mask(5, 7, device="meta")
    with pytest.raises(ValueError, match="device=q.device"):
        scaled_dot_product_attention(q, k, v, mask)


# ----------------------------------------------------------------------------- fused QKV projection


@pytest.mark.parametrize("bias", [True, False])
def test_fused_qkv_equals_three_separate_projections(bias):
    torch.manual_seed(0)
    W_Q, W_K, W_V = (nn.Linear(12, 8, bias=bias) for _ in range(3))
    fused = tfa.FusedQKV.from_separate(W_Q, W_K, W_V)
    assert fused.W_QKV.weight.shape == (24, 12) and (fused.W_QKV.bias is not None) == bias
    x = randn(1, 2, 5, 12)
    for got, layer in zip(fused(x), (W_Q, W_K, W_V)):
        torch.testing.assert_close(got, layer(x))


def test_fused_qkv_is_how_torch_multihead_attention_stores_in_proj_weight():
    torch.manual_seed(1)
    d_model, n_heads = 12, 3
    mha = nn.MultiheadAttention(d_model, n_heads, batch_first=True).eval()
    fused = tfa.FusedQKV.from_torch(mha)
    assert torch.equal(fused.W_QKV.weight, mha.in_proj_weight) and torch.equal(fused.W_QKV.bias, mha.in_proj_bias)
    # The same rows, split in three, are tfedu's separate W_Q, W_K, W_V.
    ours = MultiHeadAttention.load_from_torch(mha)
    x = randn(2, 2, 6, d_model)
    for got, layer in zip(fused(x), (ours.W_Q, ours.W_K, ours.W_V)):
        torch.testing.assert_close(got, layer(x))
    # Oracle: the fused projection, heads, attention and out_proj give nn.MultiheadAttention's output.
    q, k, v = (ours.split_heads(t) for t in fused(x))
    z, _ = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(mha.out_proj(ours.merge_heads(z)), mha(x, x, x, need_weights=False)[0])


def test_fused_qkv_bad_input():
    with pytest.raises(ValueError, match="share one shape"):
        tfa.FusedQKV.from_separate(nn.Linear(4, 2), nn.Linear(4, 3), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="all have a bias"):
        tfa.FusedQKV.from_separate(nn.Linear(4, 2), nn.Linear(4, 2, bias=False), nn.Linear(4, 2))
    with pytest.raises(TypeError, match="three nn.Linear"):
        tfa.FusedQKV.from_separate(nn.Linear(4, 2), torch.randn(2, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"d_model=4"):
        tfa.FusedQKV(4)(torch.randn(3, 5))
    with pytest.raises(ValueError, match="positive int"):
        tfa.FusedQKV(0)
    with pytest.raises(ValueError, match="kdim"):
        tfa.FusedQKV.from_torch(nn.MultiheadAttention(4, 2, kdim=3, vdim=3))


# ----------------------------------------------------------------------------- attention dropout


def test_attention_dropout_with_a_fixed_mask_matches_torch_math_attention():
    math_attention = getattr(torch.ops.aten, "_scaled_dot_product_attention_math", None)
    if math_attention is None:
        pytest.skip("this torch has no aten._scaled_dot_product_attention_math to take a fixed dropout mask")
    q, k, v = qkv(3)
    p = 0.3
    keep = torch.rand(2, 3, 5, 7, generator=torch.Generator().manual_seed(4)) >= p
    with torch.no_grad():
        expected, _ = math_attention(q, k, v, None, p, False, keep)
    ours = tfa.attention_dropout(attention_weights(q, k), p, keep=keep) @ v
    torch.testing.assert_close(ours, expected)


def test_attention_dropout_has_the_distribution_of_torch_sdpa_dropout():
    # Same mean (unbiased: the 1/(1-p) scaling) and same spread, over many independent masks.
    q, k, v = qkv(5, batch=(), n_query=3, n_key=4, d_v=2)
    p, draws = 0.25, 4000
    clean = scaled_dot_product_attention(q, k, v)[0]
    gen = torch.Generator().manual_seed(6)
    weights = attention_weights(q, k)
    # A batch of `draws` copies: each copy gets its own independent mask.
    ours = tfa.attention_dropout(weights.expand(draws, 3, 4), p, generator=gen) @ v
    torch.manual_seed(7)
    theirs = F.scaled_dot_product_attention(*(t.expand(draws, *t.shape) for t in (q, k, v)), dropout_p=p)
    for sample in (ours, theirs):
        torch.testing.assert_close(sample.mean(0), clean, atol=0.06, rtol=0)
    # Per entry, var = p/(1-p) * sum_j w_j^2 v_j^2 for independent masks.
    exact_var = p / (1 - p) * (weights**2) @ (v**2)
    torch.testing.assert_close(ours.var(0), exact_var, rtol=0.12, atol=1e-3)
    torch.testing.assert_close(theirs.var(0), exact_var, rtol=0.12, atol=1e-3)


def test_attention_dropout_rows_no_longer_sum_to_one_kept_entries_are_rescaled_and_eval_is_identity():
    weights = attention_weights(*qkv(8)[:2])
    p = 0.2
    dropped = tfa.attention_dropout(weights, p, generator=torch.Generator().manual_seed(9))
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], weights[kept] / (1 - p))
    assert abs((~kept).float().mean().item() - p) < 0.1  # 210 weights, about a fifth dropped
    assert not torch.allclose(dropped.sum(-1), torch.ones(2, 3, 5))
    assert tfa.attention_dropout(weights, p, training=False) is weights
    assert tfa.attention_dropout(weights, 0.0) is weights
    assert torch.equal(tfa.attention_dropout(weights, 1.0), torch.zeros_like(weights))


def test_attention_dropout_bad_input():
    w = torch.full((2, 3), 1 / 3)
    for p in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=r"in \[0, 1\]"):
            tfa.attention_dropout(w, p)
    with pytest.raises(TypeError, match="boolean"):
        tfa.attention_dropout(w, 0.5, keep=torch.ones(2, 3))
    with pytest.raises(ValueError, match="does not broadcast"):
        tfa.attention_dropout(w, 0.5, keep=torch.ones(4, 3, dtype=torch.bool))


def test_bias_is_sdpa_float_mask():
    """A float bias is added to the scaled scores, as SDPA's float attn_mask is; the boolean mask still applies."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=gen) for _ in range(3))
    bias = torch.randn(3, 6, 6, generator=gen)
    out, _ = scaled_dot_product_attention(q, k, v, bias=bias)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    causal = causal_mask(6, 6)
    out, weights = scaled_dot_product_attention(q, k, v, causal, bias=bias)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")))
    torch.testing.assert_close(out, expected)
    assert (weights[..., ~causal] == 0).all()


@pytest.mark.parametrize(
    "bias, error, words",
    [
        (torch.zeros(6, 6, dtype=torch.bool), TypeError, "float tensor"),
        (torch.zeros(4, 6, 6), ValueError, "does not broadcast"),
    ],
)
def test_bad_bias_is_named(bias, error, words):
    q = k = v = torch.randn(3, 6, 8)
    with pytest.raises(error, match=words):
        scaled_dot_product_attention(q, k, v, bias=bias)


@pytest.mark.parametrize("n_heads", [None, 2])
def test_split_and_merge_heads_are_the_einops_rearranges_and_inverse(n_heads):
    mha = MultiHeadAttention(d_model=12, n_heads=4)
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(0))
    heads = mha.split_heads(x, n_heads)
    expected = einops.rearrange(x, "batch pos (n_heads d_head) -> batch n_heads pos d_head", n_heads=n_heads or 4)
    assert torch.equal(heads, expected) and heads.data_ptr() == x.data_ptr()  # a view, no copy
    assert torch.equal(mha.merge_heads(heads), x)

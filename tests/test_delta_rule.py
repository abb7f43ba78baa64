"""The delta rule and Gated DeltaNet: recurrent = chunked, both = transformers' Qwen3-Next torch path."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tfedu.delta_rule import (
    GatedDeltaNet,
    delta_rule_chunked,
    delta_rule_recurrent,
    delta_rule_step,
    l2_normalize,
)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def inputs(batch=2, n_heads=3, pos=10, d_head=4, d_v=5, gated=True, dtype=torch.float64, seed=0):
    """Seeded q, k (unit keys), v, beta in (0, 1), g in (-1, 0) or None, and an initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, pos, d_head, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(batch, n_heads, pos, d_head, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(batch, n_heads, pos, d_v, generator=gen, dtype=dtype)
    beta = torch.rand(batch, n_heads, pos, generator=gen, dtype=dtype)
    g = -torch.rand(batch, n_heads, pos, generator=gen, dtype=dtype) if gated else None
    state = torch.randn(batch, n_heads, d_head, d_v, generator=gen, dtype=dtype)
    return q, k, v, beta, g, state


def test_the_delta_rule_replaces_the_value_under_a_key_where_linear_attention_adds():
    keys = torch.eye(3)[None, None]  # three orthogonal unit keys   (1, 1, 3, d_head=3)
    values = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]]])
    beta = torch.ones(1, 1, 3)
    _, S = delta_rule_recurrent(keys, keys, values, beta)
    torch.testing.assert_close(keys[0, 0] @ S[0, 0], values[0, 0])  # each key reads back its own value
    new = torch.tensor([[[5.0, -1.0]]])
    o, S2 = delta_rule_step(S, keys[:, :, 1], keys[:, :, 1], new, torch.ones(1, 1))
    torch.testing.assert_close(o, new)  # replaced, not 0 + 1 added to 5
    torch.testing.assert_close(S2[0, 0, 0], S[0, 0, 0])  # the other keys are untouched
    torch.testing.assert_close(S2[0, 0, 2], S[0, 0, 2])
    half, _ = delta_rule_step(S, keys[:, :, 1], keys[:, :, 1], new, torch.full((1, 1), 0.5))
    torch.testing.assert_close(half, 0.5 * values[:, :, 1] + 0.5 * new)  # beta interpolates old and new


def test_a_gate_fades_the_state_before_the_write():
    q, k, v, beta, _, state = inputs(pos=1)
    g = torch.full(beta.shape, -0.7, dtype=beta.dtype)
    o, S = delta_rule_step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], g[:, :, 0])
    faded = torch.exp(torch.tensor(-0.7, dtype=state.dtype)) * state  # alpha S, then the ungated step
    o_ref, S_ref = delta_rule_step(faded, q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0])
    torch.testing.assert_close(S, S_ref)
    torch.testing.assert_close(o, o_ref)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_in_float64(gated, chunk, with_state, typechecked):
    q, k, v, beta, g, state = inputs(pos=10, gated=gated)  # 10 is no multiple of 3, 4 or 16
    state = state if with_state else None
    o_ref, S_ref = typechecked(delta_rule_recurrent)(q, k, v, beta, g, state)
    o, S = typechecked(delta_rule_chunked)(q, k, v, beta, g, chunk=chunk, state=state)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("gated", [False, True])
def test_chunked_equals_recurrent_in_float32_with_beta_up_to_two(gated):
    q, k, v, beta, g, state = inputs(pos=37, gated=gated, dtype=torch.float32, seed=1)
    beta = 2 * beta  # [0, 2]: the whole allowed range
    o_ref, S_ref = delta_rule_recurrent(q, k, v, beta, g, state)
    o, S = delta_rule_chunked(q, k, v, beta, g, chunk=8, state=state)
    assert o.dtype == S.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-4)


def test_the_recurrent_form_is_its_steps_and_half_precision_runs_in_float32():
    q, k, v, beta, g, state = inputs(pos=4, dtype=torch.float32)
    o, S = delta_rule_recurrent(q, k, v, beta, g, state)
    S_step = state
    for t in range(4):
        o_t, S_step = delta_rule_step(S_step, q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], g[:, :, t])
        torch.testing.assert_close(o[:, :, t], o_t)
    torch.testing.assert_close(S, S_step)
    o_half, S_half = delta_rule_chunked(*(x.bfloat16() for x in (q, k, v, beta, g)), chunk=2)
    assert o_half.dtype == torch.bfloat16 and S_half.dtype == torch.float32


def hf_layout(x):
    """(batch, n_heads, pos, ...) -> transformers' (batch, pos, n_heads, ...)."""
    return x.transpose(1, 2)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("l2norm_in_kernel", [False, True])
def test_both_forms_equal_transformers_qwen3_next_torch_functions(gated, l2norm_in_kernel):
    # The torch reference functions themselves (``__wrapped__`` skips any fla / hub kernel dispatch). They take
    # (batch, pos, heads, d), g as log-gates (zeros = no gate), beta as given; they scale q by d_head**-0.5 inside,
    # and with use_qk_l2norm_in_kernel=True l2-normalise q and k first (eps 1e-6 inside the root).
    q, k, v, beta, g, state = inputs(pos=11, gated=gated, d_head=4, d_v=6)
    k = k * 1.3 if l2norm_in_kernel else k  # not unit: the kernel normalises it
    log_gates = torch.zeros_like(beta) if g is None else g
    hf_args = dict(g=hf_layout(log_gates), beta=hf_layout(beta), initial_state=state, output_final_state=True,
                   use_qk_l2norm_in_kernel=l2norm_in_kernel)  # fmt: skip
    hf_o_rec, hf_S_rec = qwen3_next.torch_recurrent_gated_delta_rule.__wrapped__(
        hf_layout(q), hf_layout(k), hf_layout(v), **hf_args
    )
    hf_o_chunk, hf_S_chunk = qwen3_next.torch_chunk_gated_delta_rule.__wrapped__(
        hf_layout(q), hf_layout(k), hf_layout(v), chunk_size=4, **hf_args
    )
    if l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    o_rec, S_rec = delta_rule_recurrent(q.float(), k.float(), v.float(), beta.float(),
                                        None if g is None else g.float(), state.float())  # fmt: skip
    o_chunk, S_chunk = delta_rule_chunked(q.float(), k.float(), v.float(), beta.float(),
                                          None if g is None else g.float(), chunk=4, state=state.float())  # fmt: skip
    # transformers computes in float32 whatever the input: compare in float32.
    for mine, theirs in ((o_rec, hf_o_rec), (o_chunk, hf_o_chunk)):
        torch.testing.assert_close(mine, hf_layout(theirs).float(), rtol=0, atol=1e-5)
    for mine, theirs in ((S_rec, hf_S_rec), (S_chunk, hf_S_chunk)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def small_hf_layer(n_heads=4, n_key_heads=2, conv_kernel=4, seed=0):
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(hidden_size=16, linear_num_value_heads=n_heads, linear_num_key_heads=n_key_heads,
                          linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=conv_kernel,
                          num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)  # fmt: skip
    torch.manual_seed(seed)
    hf = qwen3_next.Qwen3NextGatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():  # nothing left at ones or zeros, so a swapped weight shows
            p.copy_(torch.randn_like(p) * 0.3)
    return hf


@pytest.fixture
def torch_path_only(monkeypatch):
    """Pin transformers' Qwen3-Next to its plain torch functions, whatever kernels are installed."""
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):  # fmt: skip
        monkeypatch.setattr(qwen3_next, name, getattr(qwen3_next, name).__wrapped__)


def test_no_fast_kernel_package_is_installed():
    # transformers picks fla / causal-conv1d / hub kernels over the torch path when present; the tests above pin the
    # torch path anyway (``torch_path_only``), and this records that the oracle here is the torch path.
    assert [p for p in ("fla", "causal_conv1d", "kernels") if importlib.util.find_spec(p)] == []


@pytest.mark.parametrize("n_heads, n_key_heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("chunk", [4, 64])
def test_gated_deltanet_equals_transformers_qwen3_next_layer(n_heads, n_key_heads, chunk, torch_path_only):
    hf = small_hf_layer(n_heads, n_key_heads)
    layer = GatedDeltaNet.from_hf(hf, chunk=chunk)
    assert set(layer.state_dict()) == set(hf.state_dict())
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), hf(x), rtol=0, atol=1e-5)


def test_gated_deltanet_state_dict_loads_into_a_layer_built_by_hand(torch_path_only):
    hf = small_hf_layer(conv_kernel=2)
    layer = GatedDeltaNet(d_model=16, n_heads=4, d_head_k=8, d_head_v=6, n_key_heads=2, conv_kernel=2)
    layer.load_state_dict(hf.state_dict())
    x = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), hf(x), rtol=0, atol=1e-5)


def test_decoding_step_by_step_equals_the_full_forward_in_constant_memory(typechecked):
    torch.manual_seed(0)
    layer = GatedDeltaNet(d_model=16, n_heads=4, d_head_k=8, d_head_v=6, n_key_heads=2, chunk=4)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        full = layer(x)
        prefix, cache = typechecked(layer.prefill)(x[:, :3])
        shapes = (cache.conv_state.shape, cache.state.shape)
        outs = [prefix]
        for t in range(3, 9):
            y_t, cache = typechecked(layer.step)(x[:, t], cache)
            assert (cache.conv_state.shape, cache.state.shape) == shapes  # nothing grows with the length
            outs.append(y_t[:, None])
        first, _ = layer.step(x[:, 0], layer.empty_cache(2))  # decoding from nothing at all
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-5)
    torch.testing.assert_close(first, full[:, 0], rtol=0, atol=1e-5)
    assert shapes == ((2, layer.conv_dim, 3), (2, 4, 8, 6))


def test_gated_deltanet_is_causal_and_trains():
    torch.manual_seed(0)
    layer = GatedDeltaNet(d_model=8, n_heads=2, d_head_k=4, d_head_v=4, chunk=4)
    x = torch.randn(1, 7, 8, requires_grad=True)
    layer(x)[0, 3].sum().backward()
    assert x.grad[0, 4:].abs().max() == 0 and x.grad[0, :4].abs().max() > 0
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in layer.parameters())


def test_bad_input_gets_a_clear_error():
    q, k, v, beta, g, state = inputs(pos=5)
    with pytest.raises(ValueError, match=r"q should be a floating-point tensor of shape \(batch, n_heads, pos"):
        delta_rule_recurrent(q[0], k, v, beta)
    with pytest.raises(ValueError, match="k should have q's shape"):
        delta_rule_chunked(q, k[..., :3], v, beta)
    with pytest.raises(ValueError, match="v should have shape"):
        delta_rule_chunked(q, k, v[:, :, :4], beta)
    with pytest.raises(ValueError, match=r"beta should be a floating-point tensor of shape \(2, 3, 5\)"):
        delta_rule_recurrent(q, k, v, beta[..., :4])
    with pytest.raises(ValueError, match=r"beta should lie in \[0.0, 2.0\]"):
        delta_rule_chunked(q, k, v, beta + 1.5)
    with pytest.raises(ValueError, match=r"beta should lie"):
        delta_rule_recurrent(q, k, v, beta - 0.5)
    with pytest.raises(ValueError, match="g should hold finite log-gates <= 0"):
        delta_rule_chunked(q, k, v, beta, -g)
    with pytest.raises(ValueError, match="g should hold finite log-gates"):
        delta_rule_chunked(q, k, v, beta, torch.full_like(g, -torch.inf))
    with pytest.raises(ValueError, match=r"state should be a floating-point tensor of shape \(2, 3, 4, 5\)"):
        delta_rule_chunked(q, k, v, beta, g, state=state.mT)
    with pytest.raises(ValueError, match="chunk should be a positive int"):
        delta_rule_chunked(q, k, v, beta, chunk=0)
    with pytest.raises(ValueError, match=r"q should be a floating-point tensor of shape \(batch, n_heads, d_head\)"):
        delta_rule_step(state, q, k[:, :, 0], v[:, :, 0], beta[:, :, 0])
    with pytest.raises(ValueError, match="n_heads .3. should be a multiple of n_key_heads .2."):
        GatedDeltaNet(d_model=8, n_heads=3, d_head_k=4, d_head_v=4, n_key_heads=2)
    layer = GatedDeltaNet(d_model=8, n_heads=2, d_head_k=4, d_head_v=4)
    with pytest.raises(ValueError, match=r"x should have shape \(batch, pos, 8\)"):
        layer(torch.randn(1, 3, 7))
    with pytest.raises(ValueError, match=r"x_t should have shape \(batch, 8\)"):
        layer.step(torch.randn(1, 3, 8), layer.empty_cache(1))

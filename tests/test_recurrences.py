"""Gated linear attention and Mamba's selective scan: recurrent = parallel, and equal to independent oracles.

Oracles: a direct quadratic formula (causal linear attention without normaliser) for g = 1; the
(pos, pos) decay-masked form for any g; transformers' Mamba mixer and its torch selective scan, built
locally from a small MambaConfig with seeded random weights.
"""

import pytest
import torch
from transformers import MambaConfig
from transformers.models.mamba import modeling_mamba

from tfedu import recurrences as rec

F64 = dict(atol=1e-10, rtol=1e-10)
F32 = dict(atol=1e-5, rtol=1e-5)


def gla_inputs(seed, dtype=torch.float64, batch=2, n_heads=3, pos=11, d_head=4, d_v=5, low=0.5):
    g0 = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, pos, d_head, generator=g0, dtype=dtype)
    k = torch.randn(batch, n_heads, pos, d_head, generator=g0, dtype=dtype)
    v = torch.randn(batch, n_heads, pos, d_v, generator=g0, dtype=dtype)
    g = low + (1 - low) * torch.rand(batch, n_heads, pos, generator=g0, dtype=dtype)
    return q, k, v, g


# ----------------------------------------------------------------------------- gated linear attention


def test_gla_with_gate_one_is_causal_linear_attention_without_normaliser(typechecked):
    q, k, v, _ = gla_inputs(0)
    g = torch.ones(q.shape[:3], dtype=q.dtype)
    # out_t = sum_{s <= t} (q_t . k_s) v_s, written as a sum over positions (an independent formula).
    rows = [torch.einsum("bhd,bhsd,bhse->bhe", q[:, :, t], k[:, :, : t + 1], v[:, :, : t + 1]) for t in range(q.shape[2])]
    want = torch.stack(rows, dim=2)
    torch.testing.assert_close(typechecked(rec.gated_linear_attention_quadratic)(q, k, v, g), want, **F64)
    torch.testing.assert_close(typechecked(rec.gated_linear_attention_recurrent)(q, k, v, g)[0], want, **F64)
    torch.testing.assert_close(typechecked(rec.gated_linear_attention_chunked)(q, k, v, g, chunk=4)[0], want, **F64)


def test_gla_quadratic_decay_is_the_product_of_the_gates_since():
    q, k, v, g = gla_inputs(1, pos=6)
    want = torch.zeros_like(v)
    for t in range(6):
        for s in range(t + 1):
            decay = g[:, :, s + 1 : t + 1].prod(dim=-1)  # (batch, n_heads)
            want[:, :, t] += (decay * (q[:, :, t] * k[:, :, s]).sum(-1))[..., None] * v[:, :, s]
    torch.testing.assert_close(rec.gated_linear_attention_quadratic(q, k, v, g), want, **F64)


@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 64])
def test_gla_recurrent_chunked_and_quadratic_agree_float64(chunk):
    q, k, v, g = gla_inputs(2, low=0.05)  # strong decay too
    quad = rec.gated_linear_attention_quadratic(q, k, v, g)
    rec_out, rec_state = rec.gated_linear_attention_recurrent(q, k, v, g)
    ch_out, ch_state = rec.gated_linear_attention_chunked(q, k, v, g, chunk=chunk)  # 11 positions: not a multiple
    torch.testing.assert_close(rec_out, quad, **F64)
    torch.testing.assert_close(ch_out, quad, **F64)
    torch.testing.assert_close(ch_state, rec_state, **F64)


def test_gla_chunked_equals_recurrent_float32_and_carries_a_given_state():
    q, k, v, g = gla_inputs(3, dtype=torch.float32, pos=37)
    S0 = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(9))
    a, Sa = rec.gated_linear_attention_chunked(q, k, v, g, chunk=8, state=S0)
    b, Sb = rec.gated_linear_attention_recurrent(q, k, v, g, state=S0)
    torch.testing.assert_close(a, b, **F32)
    torch.testing.assert_close(Sa, Sb, **F32)
    # Two halves with the state handed over = the whole.
    head, tail = (t[:, :, :20] for t in (q, k, v, g)), (t[:, :, 20:] for t in (q, k, v, g))
    first, S_mid = rec.gated_linear_attention_chunked(*head, chunk=8, state=S0)
    second, S_end = rec.gated_linear_attention_chunked(*tail, chunk=8, state=S_mid)
    torch.testing.assert_close(torch.cat([first, second], dim=2), b, **F32)
    torch.testing.assert_close(S_end, Sb, **F32)


def test_gla_step_is_one_position_of_the_recurrence(typechecked):
    q, k, v, g = gla_inputs(4, pos=3)
    S = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    o, S1 = typechecked(rec.gated_linear_attention_step)(S, q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0])
    want_S = g[:, :, 0, None, None] * S + torch.einsum("bhd,bhe->bhde", k[:, :, 0], v[:, :, 0])
    torch.testing.assert_close(S1, want_S, **F64)
    torch.testing.assert_close(o, torch.einsum("bhd,bhde->bhe", q[:, :, 0], want_S), **F64)


def test_gla_rejects_bad_shapes_and_gates():
    q, k, v, g = gla_inputs(5, pos=4)
    with pytest.raises(ValueError, match=r"g should have shape \(2, 3, 4\)"):
        rec.gated_linear_attention_chunked(q, k, v, g[..., None])
    with pytest.raises(ValueError, match=r"k should have shape"):
        rec.gated_linear_attention_recurrent(q, k[:, :, :3], v, g)
    with pytest.raises(ValueError, match=r"q should have shape \(batch, n_heads, pos, d_head\)"):
        rec.gated_linear_attention_quadratic(q[0], k, v, g)
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            rec.gated_linear_attention_chunked(q, k, v, g.clone().fill_(bad))
    with pytest.raises(ValueError, match=r"chunk must be a positive int"):
        rec.gated_linear_attention_chunked(q, k, v, g, chunk=0)
    with pytest.raises(ValueError, match=r"state should have shape \(2, 3, 4, 5\)"):
        rec.gated_linear_attention_chunked(q, k, v, g, state=torch.zeros(2, 3, 5, 4, dtype=q.dtype))
    with pytest.raises(TypeError, match="floating-point"):
        rec.gated_linear_attention_step(torch.zeros(2, 3, 4, 5), q[:, :, 0].long(), k[:, :, 0], v[:, :, 0], g[:, :, 0])


# ----------------------------------------------------------------------------- selective scan


def scan_inputs(seed, dtype=torch.float64, batch=2, d_inner=3, pos=9, d_state=4):
    g0 = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_inner, pos, generator=g0, dtype=dtype)
    delta = torch.rand(batch, d_inner, pos, generator=g0, dtype=dtype) + 0.01
    A = -torch.rand(d_inner, d_state, generator=g0, dtype=dtype) * 3
    B = torch.randn(batch, pos, d_state, generator=g0, dtype=dtype)
    C = torch.randn(batch, pos, d_state, generator=g0, dtype=dtype)
    D = torch.randn(d_inner, generator=g0, dtype=dtype)
    return x, delta, A, B, C, D


@pytest.mark.parametrize("pos", [1, 2, 9, 16])
def test_selective_scan_equals_transformers_torch_scan_float64(pos, typechecked):
    x, delta, A, B, C, D = scan_inputs(0, pos=pos)
    # transformers' torch scan casts x and B to float32 (then works in float64 with a float64 step): give it
    # values that float32 holds exactly, so the comparison is float64's.
    x, B = x.float().double(), B.float().double()
    # It takes B and C as (batch, d_state, pos) and returns the last state on request.
    want, want_h = modeling_mamba.mamba_selective_scan.__wrapped__(
        x, delta, A, B.transpose(1, 2), C.transpose(1, 2), D=D, return_last_state=True
    )
    for scan in (rec.selective_scan_sequential, rec.selective_scan_parallel):
        y, h = typechecked(scan)(x, delta, A, B, C, D)
        torch.testing.assert_close(y, want, **F64)
        torch.testing.assert_close(h, want_h, **F64)


def test_selective_scan_parallel_equals_sequential_float32_with_initial_state():
    x, delta, A, B, C, D = scan_inputs(1, dtype=torch.float32, pos=23)
    h0 = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(3))
    a, ha = rec.selective_scan_parallel(x, delta, A, B, C, D, h0=h0)
    b, hb = rec.selective_scan_sequential(x, delta, A, B, C, D, h0=h0)
    torch.testing.assert_close(a, b, **F32)
    torch.testing.assert_close(ha, hb, **F32)


def test_selective_scan_step_is_zoh_for_a_and_euler_for_b(typechecked):
    x, delta, A, B, C, D = scan_inputs(2, pos=1)
    h = torch.randn(2, 3, 4, dtype=torch.float64)
    y, h1 = typechecked(rec.selective_scan_step)(h, x[..., 0], delta[..., 0], A, B[:, 0], C[:, 0], D)
    for b in range(2):
        for i in range(3):
            dt = delta[b, i, 0]
            want_h = torch.exp(dt * A[i]) * h[b, i] + dt * B[b, 0] * x[b, i, 0]
            torch.testing.assert_close(h1[b, i], want_h, **F64)
            torch.testing.assert_close(y[b, i], want_h @ C[b, 0] + D[i] * x[b, i, 0], **F64)


def test_selective_scan_rejects_bad_shapes_and_steps():
    x, delta, A, B, C, D = scan_inputs(3)
    with pytest.raises(ValueError, match=r"B should have shape \(2, 9, 4\)"):
        rec.selective_scan_parallel(x, delta, A, B.transpose(1, 2), C, D)
    with pytest.raises(ValueError, match=r"A should have shape \(3, d_state\)"):
        rec.selective_scan_sequential(x, delta, A.T, B, C, D)
    with pytest.raises(ValueError, match=r"delta .* >= 0"):
        rec.selective_scan_parallel(x, -delta, A, B, C, D)
    with pytest.raises(ValueError, match=r"h0 should have shape \(2, 3, 4\)"):
        rec.selective_scan_sequential(x, delta, A, B, C, D, h0=torch.zeros(2, 4, 3, dtype=x.dtype))


# ----------------------------------------------------------------------------- the Mamba layer


def hf_mixer(seed, dtype=torch.float32, use_bias=False):
    cfg = MambaConfig(
        hidden_size=8, state_size=4, intermediate_size=12, conv_kernel=3, time_step_rank=2,
        use_bias=use_bias, use_conv_bias=True, num_hidden_layers=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    mixer = modeling_mamba.MambaMixer(cfg, layer_idx=0)
    with torch.no_grad():  # every parameter random, so a swapped or dropped one shows
        for name, p in mixer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name != "A_log" else 0.5) + (0.5 if name == "A_log" else 0.0))
    return mixer.to(dtype).eval()


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("scan", rec.SCANS)
def test_mamba_layer_equals_transformers_mamba_mixer(scan, use_bias, typechecked):
    mixer = hf_mixer(0, use_bias=use_bias)
    layer = rec.MambaLayer.from_hf(mixer)
    assert layer.state_dict().keys() == mixer.state_dict().keys()
    u = torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(typechecked(layer.forward)(u, scan=scan), mixer(u), **F32)


def test_mamba_layer_float64_equals_transformers_up_to_its_float32_a():
    # transformers computes A = -exp(A_log.float()) and casts the scan's x and B to float32 even in a float64
    # module, so the float64 layer agrees only to float32's rounding; the scan itself is checked to 1e-10 above.
    mixer = hf_mixer(1, dtype=torch.float64)
    layer = rec.MambaLayer.from_hf(mixer)
    theirs = mixer.state_dict()
    for name, ours in layer.state_dict().items():
        assert ours.dtype == torch.float64 and torch.equal(ours, theirs[name]), name
    u = torch.randn(2, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(layer(u, scan="sequential"), mixer(u), atol=1e-7, rtol=1e-7)
        torch.testing.assert_close(layer(u, scan="parallel"), layer(u, scan="sequential"), **F64)


def test_mamba_layer_steps_equal_the_full_forward_with_constant_state():
    layer = rec.MambaLayer.from_hf(hf_mixer(2, dtype=torch.float64))
    u = torch.randn(2, 10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = layer(u)
        state = layer.empty_state(2)
        sizes = {(state.conv_state.shape, state.ssm_state.shape)}
        outs = []
        for t in range(10):
            out, state = layer.step(u[:, t], state)
            outs.append(out)
            sizes.add((state.conv_state.shape, state.ssm_state.shape))
        torch.testing.assert_close(torch.stack(outs, dim=1), want, **F64)
        assert sizes == {(torch.Size([2, 12, 2]), torch.Size([2, 12, 4]))}  # the same at every position
        # Prefill 6 positions with the parallel form, then decode the rest.
        first, state = layer(u[:, :6], return_state=True)
        outs = [first]
        for t in range(6, 10):
            out, state = layer.step(u[:, t], state)
            outs.append(out[:, None])
        torch.testing.assert_close(torch.cat(outs, dim=1), want, **F64)


def test_mamba_layer_rejects_bad_input():
    layer = rec.MambaLayer(d_model=8, d_inner=12, d_state=4, d_conv=3)
    with pytest.raises(ValueError, match=r"u should have shape \(batch, pos, 8\)"):
        layer(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="scan must be one of"):
        layer(torch.randn(2, 5, 8), scan="blelloch")
    with pytest.raises(ValueError, match=r"state.conv_state should have shape \(2, 12, 2\)"):
        layer.step(torch.randn(2, 8), rec.MambaState(torch.zeros(2, 12, 3), torch.zeros(2, 12, 4)))
    with pytest.raises(TypeError, match="expects a transformers MambaMixer"):
        rec.MambaLayer.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="d_state must be a positive int"):
        rec.MambaLayer(d_model=8, d_inner=12, d_state=0)

"""Hybrid course GPTs: recurrent mixers (linear attention, GLA, Mamba, Gated DeltaNet) in attention's place.

Each mixer type, in a tiny GPT: builds, is causal, trains on a copy task, every parameter gets a gradient, the
layer inside the model is the standalone module (same weights, same output), parameters counted by hand. A 3:1
hybrid generates greedily (without a KV cache). An all-attention ``layer_types`` is the plain GPT bit for bit.
Oracles: hand-counted parameter formulas; ``tfedu.flash.linear_attention_quadratic`` and
``tfedu.recurrences.gated_linear_attention_quadratic`` for the two attention-shaped layers.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from tfedu.config import ModelConfig, RECURRENT_LAYER_TYPES, hybrid_layer_types
from tfedu.delta_rule import GatedDeltaNet
from tfedu.flash import linear_attention_quadratic
from tfedu.generate import generate, pad_prompts
from tfedu.kv_cache import KVCache
from tfedu.model import GPT, Encoder, EncoderDecoder
from tfedu.recurrences import (GatedLinearAttentionLayer, LinearAttentionLayer, MambaLayer,
                               gated_linear_attention_quadratic)

D_VOCAB, D_MODEL, N_HEADS = 8, 32, 4
STANDALONE = {
    "linear": lambda: LinearAttentionLayer(D_MODEL, N_HEADS),
    "gla": lambda: GatedLinearAttentionLayer(D_MODEL, N_HEADS),
    "mamba": lambda: MambaLayer(D_MODEL, 2 * D_MODEL, d_state=16),
    "gated_deltanet": lambda: GatedDeltaNet(D_MODEL, N_HEADS, D_MODEL // N_HEADS, D_MODEL // N_HEADS),
}


def tiny(layer_types, **changes):
    return ModelConfig(d_vocab=D_VOCAB, n_ctx=16, d_model=D_MODEL, n_layers=len(layer_types), n_heads=N_HEADS,
                       layer_types=tuple(layer_types), **changes)


def build(cfg, seed=0):
    torch.manual_seed(seed)
    return GPT(cfg)


def mixer_params(kind, d=D_MODEL, h=N_HEADS, d_state=16):
    """The parameters of one mixer, counted by hand from the papers' layer definitions."""
    d_head = d // h
    if kind == "linear":  # W_Q, W_K, W_V, W_O with biases
        return 4 * (d * d + d)
    if kind == "gla":  # + W_gate (one gate per head, bias), W_G (output gate), the norm's gain over d_head
        return 4 * (d * d + d) + (d * h + h) + (d * d + d) + d_head
    if kind == "mamba":
        d_inner, dt_rank = 2 * d, math.ceil(d / 16)
        return (d * 2 * d_inner + d_inner * 4 + d_inner + d_inner * (dt_rank + 2 * d_state) + dt_rank * d_inner
                + d_inner + d_inner * d_state + d_inner + d_inner * d)
    if kind == "gated_deltanet":  # in_proj_qkvz, in_proj_ba, conv over q k v, A_log, dt_bias, norm, out_proj
        return d * 4 * d + d * 2 * h + 3 * d * 4 + h + h + d_head + d * d
    raise AssertionError(kind)


def attention_params(d=D_MODEL):
    return 4 * (d * d + d)


def copy_batch(generator, n=32, half=4):
    """Random tokens, then the same again: the second half is predictable only by copying."""
    a = torch.randint(0, D_VOCAB, (n, half), generator=generator)
    ids = torch.cat([a, a], dim=1)
    targets = ids[:, 1:].clone()
    targets[:, : half - 1] = -100  # the first half is random: nothing to learn there
    return ids[:, :-1], targets


# ----------------------------------------------------------------------------- each mixer in a GPT


@pytest.mark.parametrize("kind", RECURRENT_LAYER_TYPES)
def test_mixer_builds_where_attention_was_and_counts_its_parameters(kind):
    model = build(tiny([kind, "full_attention"]))
    assert type(model.blocks[0].attn) is type(STANDALONE[kind]()) and model.blocks[0].recurrent == kind
    assert model.blocks[1].recurrent is None and not model.supports_kv_cache
    plain = build(tiny(["full_attention"] * 2))
    n = sum(p.numel() for p in model.parameters())
    assert n == sum(p.numel() for p in plain.parameters()) - attention_params() + mixer_params(kind)
    assert sum(p.numel() for p in model.blocks[0].attn.parameters()) == mixer_params(kind)
    logits = model(torch.randint(0, D_VOCAB, (2, 9)))
    assert logits.shape == (2, 9, D_VOCAB) and logits.isfinite().all()


@pytest.mark.parametrize("kind", RECURRENT_LAYER_TYPES)
def test_mixer_is_causal(kind):
    model = build(tiny([kind, kind])).eval()
    ids = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % D_VOCAB
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("kind", RECURRENT_LAYER_TYPES)
def test_mixer_trains_on_a_copy_task_and_every_parameter_gets_a_gradient(kind):
    model = build(tiny([kind, kind]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train, held_out = torch.Generator().manual_seed(0), copy_batch(torch.Generator().manual_seed(1), n=64)
    with torch.no_grad():
        before = model(*held_out)[1].item()
    assert abs(before - math.log(D_VOCAB)) < 0.1  # chance at the start
    for step in range(20):
        _, loss = model(*copy_batch(train))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                if name == "pos_embed.W_pos":
                    continue  # (rows for positions past the 7 used get no gradient, as in any GPT)
                assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0, name
        opt.step()
    with torch.no_grad():
        after = model(*held_out)[1].item()
    assert after < before - 0.05, (before, after)


@pytest.mark.parametrize("kind", RECURRENT_LAYER_TYPES)
def test_mixer_in_the_model_is_the_standalone_module(kind):
    model = build(tiny([kind, "full_attention"])).eval()
    seen = {}
    model.blocks[0].attn.register_forward_hook(lambda module, inputs, output: seen.update(x=inputs[0], out=output))
    with model.hooks(blocks__0__hook_attn_out=lambda t: seen.update(hooked=t)):
        model(torch.randint(0, D_VOCAB, (2, 10)))
    alone = STANDALONE[kind]()
    alone.load_state_dict(model.blocks[0].attn.state_dict())  # strict: the same parameter names and shapes
    torch.testing.assert_close(alone(seen["x"]), seen["out"], atol=0, rtol=0)
    torch.testing.assert_close(seen["hooked"], seen["out"], atol=0, rtol=0)  # hook_attn_out carries the mixer's output
    points = model.hook_points()
    assert "blocks.0.attn.hook_pattern" not in points and "blocks.1.attn.hook_pattern" in points
    assert ("blocks.0.attn.hook_z" in points) == (kind in ("linear", "gla"))


def test_initialisation_is_gpt2s_with_the_mixers_own_special_parameters_kept():
    model = build(tiny(["mamba", "gated_deltanet", "gla", "full_attention"]))
    mamba, gdn, gla = (model.blocks[i].attn for i in range(3))
    dt = F.softplus(mamba.dt_proj.bias)  # Mamba's steps, log-uniform in [1e-3, 1e-1] (not softplus(0) = 0.69)
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 1e-1 + 1e-7
    resid_std = 0.02 / math.sqrt(2 * 4)  # GPT-2's scaled init of every layer that writes to the stream
    for out in (mamba.out_proj.weight, gdn.out_proj.weight, gla.W_O.weight, model.blocks[3].attn.W_O.weight):
        assert abs(out.std().item() - resid_std) < 0.3 * resid_std
    assert abs(gla.W_Q.weight.std().item() - 0.02) < 0.005


# ----------------------------------------------------------------------------- the two attention-shaped layers


def test_linear_attention_layer_is_notebook_09s_function_per_head():
    torch.manual_seed(0)
    layer = LinearAttentionLayer(D_MODEL, N_HEADS, chunk=3).double()
    x = torch.randn(2, 10, D_MODEL, dtype=torch.float64)
    q, k, v = (W(x).unflatten(-1, (N_HEADS, -1)).transpose(1, 2) for W in (layer.W_Q, layer.W_K, layer.W_V))
    z = linear_attention_quadratic(q, k, v, causal=True)  # (batch, n_heads, pos, d_head)
    torch.testing.assert_close(layer(x), layer.W_O(z.transpose(1, 2).flatten(2)), atol=1e-10, rtol=1e-10)


def test_gla_layer_chunked_equals_recurrent_and_the_quadratic_form():
    torch.manual_seed(0)
    layer = GatedLinearAttentionLayer(D_MODEL, N_HEADS, chunk=3).double()
    x = torch.randn(2, 10, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(layer(x), layer(x, form="recurrent"), atol=1e-10, rtol=1e-10)
    g = torch.sigmoid(layer.W_gate(x)).pow(1 / 16).transpose(1, 2)  # the gate as GLA writes it, sigma ** (1/tau)
    torch.testing.assert_close(layer.gates(x), g, atol=1e-12, rtol=1e-12)
    q, k, v = (W(x).unflatten(-1, (N_HEADS, -1)).transpose(1, 2) for W in (layer.W_Q, layer.W_K, layer.W_V))
    o = gated_linear_attention_quadratic(q / math.sqrt(D_MODEL // N_HEADS), k, v, g).transpose(1, 2)
    gate = layer.W_G(x).unflatten(-1, (N_HEADS, -1))
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.norm.weight * F.silu(gate)
    torch.testing.assert_close(layer(x), layer.W_O(normed.flatten(2)), atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="form must be one of"):
        layer(x, form="parallel")


# ----------------------------------------------------------------------------- hybrids


def test_hybrid_layer_types_is_three_to_one_with_attention_last():
    assert hybrid_layer_types(4, "gated_deltanet") == ("gated_deltanet",) * 3 + ("full_attention",)
    assert hybrid_layer_types(3, "mamba", every=8) == ("mamba", "mamba", "full_attention")
    assert hybrid_layer_types(2, "gla", every=1) == ("full_attention",) * 2
    for bad, match in (((4, "attention"), "mixer='attention'.*'gla'"), ((4, "full_attention"), "other than"),
                       ((4, "gla", 0), "every must be a positive int"), ((0, "gla"), "n_layers")):
        with pytest.raises(ValueError, match=match):
            hybrid_layer_types(*bad)


def test_three_to_one_hybrid_generates_greedily_without_a_cache():
    model = build(tiny(hybrid_layer_types(4, "gated_deltanet"))).eval()
    ids = torch.randint(0, D_VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it says nothing: no cache is the expected path, not a fallback to warn about
        out = generate(model, ids, max_new_tokens=14)  # past n_ctx=16: the context is cropped
    want = ids
    with torch.no_grad():
        for _ in range(14):
            want = torch.cat([want, model(want[:, -16:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, want)
    assert torch.equal(generate(model, ids, max_new_tokens=3, use_cache=False), out[:, :8])


def test_all_attention_layer_types_is_the_plain_gpt_bit_for_bit():
    cfg = ModelConfig(d_vocab=D_VOCAB, n_ctx=16, d_model=D_MODEL, n_layers=2, n_heads=N_HEADS)
    plain, typed = build(cfg), build(cfg.replace(layer_types=("full_attention",) * 2))
    assert plain.state_dict().keys() == typed.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), typed.state_dict().values()))
    ids = torch.randint(0, D_VOCAB, (2, 9))
    assert torch.equal(plain(ids), typed(ids)) and typed.supports_kv_cache


def test_hybrid_runs_with_rope_and_right_padding():
    model = build(tiny(hybrid_layer_types(4, "gla"), positional="rope", norm="rms", activation="swiglu",
                       bias=False)).eval()
    ids = torch.randint(0, D_VOCAB, (2, 6))
    right = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])  # padding after the tokens never reaches them
    torch.testing.assert_close(model(ids, padding_mask=right)[1, :4], model(ids[1:, :4])[0], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- clear errors


def test_bad_hybrid_configs_and_calls_raise_clear_errors():
    with pytest.raises(ValueError, match="'attention' is not a layer type.*|one of .*'gated_deltanet'"):
        tiny(["attention", "gla"])
    with pytest.raises(ValueError, match="one of .* per layer"):
        ModelConfig(d_model=D_MODEL, n_heads=N_HEADS, n_layers=3, layer_types=("gla", "gla"))
    with pytest.raises(ValueError, match="d_state must be a positive int"):
        tiny(["mamba"], d_state=0)
    for cls in (Encoder, EncoderDecoder):
        with pytest.raises(ValueError, match="recurrent layers.*causal decoder"):
            cls(tiny(["gla", "full_attention"]))
    model = build(tiny(["mamba", "full_attention"]))
    ids = torch.randint(0, D_VOCAB, (2, 4))
    with pytest.raises(TypeError, match="has recurrent layers .* so it keeps no KV cache"):
        KVCache.for_model(model, batch=2)
    from tfedu.checkpoints import hf_from_gpt
    from tfedu.flops import param_count

    for types in (["gla", "full_attention"], ["linear", "full_attention"], ["mamba", "full_attention"]):
        with pytest.raises(ValueError, match="hf_from_gpt: layer_types .* has recurrent layers"):
            hf_from_gpt(build(tiny(types)))
    with pytest.raises(ValueError, match="param_count counts attention blocks"):
        param_count(tiny(["gated_deltanet", "full_attention"]))
    other = KVCache.for_model(build(tiny(["full_attention"] * 2)), batch=2)
    with pytest.raises(ValueError, match="recurrent layers: they keep a state"):
        model(ids, kv_cache=other)
    with pytest.raises(ValueError, match="left padding.*'mamba' layer cannot skip positions"):
        model(ids, padding_mask=torch.tensor([[False, True, True, True], [True] * 4]))
    left, mask = pad_prompts([[1, 2, 3], [4]])
    with pytest.raises(ValueError, match="left padding"):
        generate(model, left, padding_mask=mask, max_new_tokens=2)

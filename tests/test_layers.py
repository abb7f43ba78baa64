"""tfedu.layers against independent oracles: torch's norms, HF Llama's RMSNorm, MLP and attention, GPT-2's MLP,
nn.MultiheadAttention for grouped heads, and nn.TransformerEncoderLayer / nn.TransformerDecoderLayer for Block."""

import pytest
import torch
from transformers import GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from tfedu.attention import causal_mask
from tfedu.config import ModelConfig
from tfedu.layers import (
    ACTIVATIONS, MLP, Attention, Block, LayerNorm, RMSNorm, dropout, layer_norm_by_hand, swiglu_hidden,
)
from tfedu.positional import alibi_bias

D_MODEL = 16


def _randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial gains and biases, so a swapped or missing parameter shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))


def _x(*shape, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=gen, dtype=torch.float64) + 0.5).to(dtype)


# ----------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(D_MODEL,), (5, D_MODEL), (2, 5, D_MODEL), (2, 3, 4, D_MODEL)])
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_torch_forward_and_gradients(dtype, shape, bias, typechecked):
    ref = torch.nn.LayerNorm(D_MODEL, bias=bias, dtype=dtype)
    _randomise(ref)
    ours = LayerNorm(D_MODEL, bias=bias).to(dtype)
    ours.load_state_dict(ref.state_dict())  # same parameter names: loads as is

    x_ref = _x(*shape, dtype=dtype).requires_grad_()
    x_ours = x_ref.detach().clone().requires_grad_()
    out_ref, out_ours = ref(x_ref), typechecked(ours.forward)(x_ours)
    torch.testing.assert_close(out_ours, out_ref)

    grad_out = _x(*shape, dtype=dtype, seed=2)
    out_ref.backward(grad_out)
    out_ours.backward(grad_out)
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    if bias:
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_layernorm_fused_forward_equals_the_formula_by_hand(dtype, bias, scale, typechecked):
    # forward calls F.layer_norm; layer_norm_by_hand is the formula it stands for, step by step.
    ours = LayerNorm(D_MODEL, bias=bias).to(dtype)
    _randomise(ours)
    x = _x(2, 5, D_MODEL, dtype=dtype) * scale + 7 * scale  # large and off-centre too
    with torch.no_grad():
        torch.testing.assert_close(ours(x), typechecked(layer_norm_by_hand)(x, ours.weight, ours.bias, ours.eps))
    assert torch.equal(layer_norm_by_hand(torch.full((1, 4), 7.0), torch.ones(4), None), torch.zeros(1, 4))


def test_layernorm_state_dict_and_names():
    assert set(LayerNorm(4).state_dict()) == {"weight", "bias"}
    assert set(LayerNorm(4, bias=False).state_dict()) == {"weight"}
    assert LayerNorm(4, bias=False).bias is None
    # Strict loading both ways: the keys and shapes are torch's.
    torch.nn.LayerNorm(4).load_state_dict(LayerNorm(4).state_dict())
    LayerNorm(4, bias=False).load_state_dict(torch.nn.LayerNorm(4, bias=False).state_dict())


def test_layernorm_uses_biased_variance_and_eps_inside_sqrt():
    # A constant vector has variance 0: eps inside the sqrt gives 0, not nan.
    out = LayerNorm(4)(torch.full((1, 4), 7.0))
    assert torch.equal(out, torch.zeros(1, 4))
    # With big eps the scale is 1/sqrt(var + eps), var biased (1/d): for [-1, 1] var = 1.
    out = LayerNorm(2, eps=3.0)(torch.tensor([-1.0, 1.0]))
    torch.testing.assert_close(out, torch.tensor([-0.5, 0.5]))


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.skipif(not hasattr(torch.nn, "RMSNorm"), reason="torch.nn.RMSNorm needs torch >= 2.4")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(D_MODEL,), (2, 5, D_MODEL), (2, 3, 4, D_MODEL)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.5])
def test_rmsnorm_matches_torch_forward_and_gradients(dtype, shape, eps, typechecked):
    ref = torch.nn.RMSNorm(D_MODEL, eps=eps, dtype=dtype)
    _randomise(ref)
    ours = RMSNorm(D_MODEL, eps=eps).to(dtype)
    ours.load_state_dict(ref.state_dict())

    x_ref = _x(*shape, dtype=dtype).requires_grad_()
    x_ours = x_ref.detach().clone().requires_grad_()
    out_ref, out_ours = ref(x_ref), typechecked(ours.forward)(x_ours)
    torch.testing.assert_close(out_ours, out_ref)
    assert out_ours.dtype == dtype

    grad_out = _x(*shape, dtype=dtype, seed=2)
    out_ref.backward(grad_out)
    out_ours.backward(grad_out)
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_llama_rmsnorm(dtype):
    ref = LlamaRMSNorm(D_MODEL, eps=1e-6).to(dtype)
    _randomise(ref)
    ours = RMSNorm(D_MODEL, eps=1e-6).to(dtype)
    ours.load_state_dict(ref.state_dict())
    x = _x(2, 7, D_MODEL, dtype=dtype)
    out = ours(x)
    assert out.dtype == dtype
    # Same order of operations (float32 statistics, cast back, then the gain): bit for bit.
    assert torch.equal(out, ref(x))


def test_rmsnorm_bfloat16_keeps_float32_statistics():
    # Computing the statistics in bfloat16 itself is visibly worse than Llama's float32 route.
    x = _x(4, 64, dtype=torch.bfloat16)
    exact = RMSNorm(64)(x.double()).to(torch.bfloat16)
    ours = RMSNorm(64).to(torch.bfloat16)(x)
    naive = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # all in bfloat16
    assert (ours.float() - exact.float()).abs().max() <= (naive.float() - exact.float()).abs().max()


# ----------------------------------------------------------------------------- MLP


def _llama_config(d_model: int, d_mlp: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=d_model,
        intermediate_size=d_mlp,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        hidden_act="silu",
        mlp_bias=False,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swiglu_mlp_matches_llama_mlp(dtype, typechecked):
    d_mlp = swiglu_hidden(D_MODEL, multiple_of=8)
    ref = LlamaMLP(_llama_config(D_MODEL, d_mlp)).to(dtype)
    _randomise(ref)
    ours = MLP(D_MODEL, d_mlp, activation="swiglu", bias=False).to(dtype)
    with torch.no_grad():
        ours.W_gate.weight.copy_(ref.gate_proj.weight)
        ours.W_in.weight.copy_(ref.up_proj.weight)
        ours.W_out.weight.copy_(ref.down_proj.weight)

    x_ref = _x(2, 5, D_MODEL, dtype=dtype).requires_grad_()
    x_ours = x_ref.detach().clone().requires_grad_()
    out_ref, out_ours = ref(x_ref), typechecked(ours.forward)(x_ours)
    torch.testing.assert_close(out_ours, out_ref)
    out_ref.sum().backward()
    out_ours.sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    torch.testing.assert_close(ours.W_gate.weight.grad, ref.gate_proj.weight.grad)
    torch.testing.assert_close(ours.W_in.weight.grad, ref.up_proj.weight.grad)
    torch.testing.assert_close(ours.W_out.weight.grad, ref.down_proj.weight.grad)


def test_gelu_tanh_mlp_matches_gpt2_mlp(typechecked):
    d_mlp = 4 * D_MODEL
    cfg = GPT2Config(n_embd=D_MODEL, n_head=2, n_layer=1, n_positions=8, vocab_size=32, resid_pdrop=0.0)
    assert cfg.activation_function == "gelu_new"  # GPT-2's tanh approximation
    ref = GPT2MLP(d_mlp, cfg).eval()
    _randomise(ref)
    ours = MLP(D_MODEL, activation="gelu_tanh")
    with torch.no_grad():
        # GPT-2's Conv1D stores its weight as [in, out]; nn.Linear as [out, in].
        ours.W_in.weight.copy_(ref.c_fc.weight.T)
        ours.W_in.bias.copy_(ref.c_fc.bias)
        ours.W_out.weight.copy_(ref.c_proj.weight.T)
        ours.W_out.bias.copy_(ref.c_proj.bias)
    x = _x(2, 5, D_MODEL)
    torch.testing.assert_close(typechecked(ours.forward)(x), ref(x))
    # The exact GELU is a different function: it must not pass the same test.
    ours.activation = "gelu"
    assert not torch.allclose(ours(x), ref(x), atol=1e-5)


@pytest.mark.parametrize(
    "activation, act",
    [
        ("relu", torch.nn.ReLU()),
        ("gelu", torch.nn.GELU()),
        ("gelu_tanh", torch.nn.GELU(approximate="tanh")),
    ],
)
def test_mlp_is_linear_act_linear(activation, act):
    mlp = MLP(D_MODEL, 24, activation=activation)
    _randomise(mlp)
    ref = torch.nn.Sequential(mlp.W_in, act, mlp.W_out)
    x = _x(3, D_MODEL)
    torch.testing.assert_close(mlp(x), ref(x))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_shapes_and_defaults(activation, typechecked):
    mlp = MLP(D_MODEL, activation=activation)
    gated = activation in ("swiglu", "geglu")  # a third matrix W_gate (Shazeer 2020)
    expected = swiglu_hidden(D_MODEL) if gated else 4 * D_MODEL
    assert mlp.d_mlp == expected
    assert tuple(mlp.W_in.weight.shape) == (expected, D_MODEL)
    assert tuple(mlp.W_out.weight.shape) == (D_MODEL, expected)
    assert hasattr(mlp, "W_gate") == gated
    out = typechecked(mlp.forward)(_x(2, 5, D_MODEL))
    assert out.shape == (2, 5, D_MODEL)
    linears = [m for m in MLP(D_MODEL, activation=activation, bias=False).modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.bias is None for m in linears)


# ----------------------------------------------------------------------------- swiglu_hidden


def test_swiglu_hidden_llama_7b():
    assert swiglu_hidden(4096, multiple_of=256) == 11008


@pytest.mark.parametrize("d_model", [256, 512, 768, 1024, 2048, 4096, 5120, 8192])
def test_swiglu_hidden_keeps_the_parameter_count(d_model):
    with torch.device("meta"):  # count parameters without allocating or initialising them
        swiglu = MLP(d_model, activation="swiglu", bias=False)
        plain = MLP(d_model, activation="gelu", bias=False)
    n_swiglu = sum(p.numel() for p in swiglu.parameters())
    assert n_swiglu == 3 * d_model * swiglu_hidden(d_model)
    assert sum(p.numel() for p in plain.parameters()) == 8 * d_model**2
    assert abs(n_swiglu - 8 * d_model**2) / (8 * d_model**2) < 0.01


@pytest.mark.parametrize(
    "d_model, multiple_of, expected", [(768, 1, 2048), (100, 1, 266), (100, 64, 320), (64, 32, 192)]
)
def test_swiglu_hidden_rounds_floor_then_up_to_multiple(d_model, multiple_of, expected):
    h = swiglu_hidden(d_model, multiple_of)
    assert h == expected and h % multiple_of == 0 and h >= (8 * d_model) // 3


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("layer", [LayerNorm(D_MODEL), RMSNorm(D_MODEL), MLP(D_MODEL)])
def test_wrong_last_dim_names_d_model(layer):
    with pytest.raises(ValueError, match=rf"d_model = {D_MODEL}.*\(2, 5, 15\)"):
        layer(torch.zeros(2, 5, D_MODEL - 1))


@pytest.mark.parametrize("layer", [LayerNorm(D_MODEL), RMSNorm(D_MODEL), MLP(D_MODEL)])
def test_non_float_input_is_refused(layer):
    with pytest.raises(TypeError, match="floating-point.*torch.int64"):
        layer(torch.zeros(2, D_MODEL, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([0.0] * D_MODEL)


def test_unknown_activation_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'silu'.*'relu', 'gelu', 'gelu_tanh', 'swiglu'"):
        MLP(D_MODEL, activation="silu")


@pytest.mark.parametrize("eps", [0, 0.0, -1e-5, float("nan")])
@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_eps_must_be_positive(cls, eps):
    with pytest.raises(ValueError, match="eps must be a positive number"):
        cls(D_MODEL, eps=eps)


@pytest.mark.parametrize("bad", [0, -3, 2.0, None])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        LayerNorm(bad)
    with pytest.raises(ValueError, match="d_mlp must be a positive int"):
        MLP(D_MODEL, bad if bad is not None else -1)
    with pytest.raises(ValueError, match="multiple_of must be a positive int"):
        swiglu_hidden(64, bad)


# ----------------------------------------------------------------------------- Attention


def _randomise_scaled(module: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of a trained model's size: matrices N(0, 1/fan_in), gains 1 + N(0, 0.3^2), biases N(0, 0.3^2).

    Unit-scale matrices (``_randomise``) would blow activations up by sqrt(d) per layer and leave
    float32 too few digits for a 1e-5 comparison.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            elif name.endswith("weight"):
                p.copy_(1 + 0.3 * noise)
            else:
                p.copy_(0.3 * noise)


def _copy_linear(ours: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    with torch.no_grad():
        ours.weight.copy_(weight)
        if bias is not None:
            ours.bias.copy_(bias)


def _copy_mha(ours: Attention, mha: torch.nn.MultiheadAttention) -> None:
    """nn.MultiheadAttention packs W_Q, W_K, W_V row-wise into in_proj_weight, head by head, as we do."""
    weights = mha.in_proj_weight.detach().chunk(3)
    biases = mha.in_proj_bias.detach().chunk(3)
    for linear, w, b in zip((ours.W_Q, ours.W_K, ours.W_V), weights, biases):
        _copy_linear(linear, w, b)
    _copy_linear(ours.W_O, mha.out_proj.weight, mha.out_proj.bias)


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_grouped_heads_equal_multihead_attention_with_repeated_key_value_heads(n_kv_heads, impl, typechecked):
    """GQA is MHA whose key/value head j is copied to query heads j*g .. j*g + g - 1 (Ainslie et al. 2023)."""
    n_heads, d_head = 4, 4
    d_model, group = n_heads * d_head, n_heads // n_kv_heads
    torch.manual_seed(0)
    ours = Attention(d_model, n_heads, n_kv_heads=n_kv_heads, impl=impl).eval()
    _randomise_scaled(ours)
    ref = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True).eval()

    def repeat_heads(t: torch.Tensor) -> torch.Tensor:  # (n_kv_heads d_head ...) -> (n_heads d_head ...)
        return t.unflatten(0, (n_kv_heads, d_head)).repeat_interleave(group, dim=0).flatten(0, 1)

    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.W_Q.weight, repeat_heads(ours.W_K.weight), repeat_heads(ours.W_V.weight)]))
        ref.in_proj_bias.copy_(torch.cat([ours.W_Q.bias, repeat_heads(ours.W_K.bias), repeat_heads(ours.W_V.bias)]))
        ref.out_proj.weight.copy_(ours.W_O.weight)
        ref.out_proj.bias.copy_(ours.W_O.bias)
    assert ours.W_K.weight.shape == (n_kv_heads * d_head, d_model)

    x = _x(2, 6, d_model)
    keep = causal_mask(6, 6)
    with torch.no_grad():
        torch.testing.assert_close(typechecked(ours.forward)(x), ref(x, x, x, need_weights=False)[0])
        # torch's attn_mask means True = hidden: the opposite of ours.
        torch.testing.assert_close(ours(x, causal=True), ref(x, x, x, attn_mask=~keep, need_weights=False)[0])
        torch.testing.assert_close(ours(x, mask=keep), ours(x, causal=True))


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
@pytest.mark.parametrize("n_kv_heads, d_head, rope_theta", [(4, 8, 10000.0), (2, 6, 500000.0), (1, 10, 10000.0)])
def test_attention_matches_llama_attention(n_kv_heads, d_head, rope_theta, impl):
    """RoPE in the half layout, grouped heads, biases and head_dim != d_model / n_heads, against HF's LlamaAttention."""
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=n_kv_heads, head_dim=d_head,
                         rope_theta=rope_theta, attention_bias=True, vocab_size=8, max_position_embeddings=16)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = LlamaAttention(config, layer_idx=0).eval()
    _randomise_scaled(ref)
    ours = Attention(32, 4, n_kv_heads=n_kv_heads, d_head=d_head, rope_base=rope_theta, rope_layout="half", impl=impl)
    for name, theirs in (("W_Q", ref.q_proj), ("W_K", ref.k_proj), ("W_V", ref.v_proj), ("W_O", ref.o_proj)):
        _copy_linear(getattr(ours, name), theirs.weight, theirs.bias)

    n = 7
    x = _x(2, n, 32)
    cos_sin = LlamaRotaryEmbedding(config)(x, torch.arange(n)[None])
    hidden = torch.zeros(n, n).masked_fill(~causal_mask(n, n), float("-inf"))[None, None]  # HF: additive mask
    with torch.no_grad():
        expected, _ = ref(x, position_embeddings=cos_sin, attention_mask=hidden)
        torch.testing.assert_close(ours(x, causal=True), expected, atol=1e-5, rtol=1e-5)
        # Positions are relative: shifting every position by the same amount changes nothing.
        torch.testing.assert_close(ours(x, causal=True, positions=torch.arange(n) + 5), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_attention_manual_equals_sdpa_with_bias_masks_and_cross_attention(n_kv_heads):
    torch.manual_seed(0)
    manual = Attention(16, 4, n_kv_heads=n_kv_heads)
    _randomise_scaled(manual)
    sdpa = Attention(16, 4, n_kv_heads=n_kv_heads, impl="sdpa")
    sdpa.load_state_dict(manual.state_dict())
    x, context = _x(3, 5, 16), _x(3, 7, 16, seed=3)
    pad = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [False] * 2 + [True] * 3])[:, None, None, :]
    bias = alibi_bias(4, 5, 5)
    with torch.no_grad():
        for kwargs in (dict(), dict(causal=True), dict(mask=pad), dict(mask=pad, causal=True),
                       dict(bias=bias), dict(bias=bias, causal=True), dict(bias=bias, mask=pad, causal=True)):
            torch.testing.assert_close(manual(x, **kwargs), sdpa(x, **kwargs), msg=str(kwargs))
        torch.testing.assert_close(manual(x, context), sdpa(x, context))
        # The bias does something (so the comparison above is not vacuous).
        assert not torch.allclose(manual(x, bias=bias), manual(x), atol=1e-3)


def test_attention_dropout_only_in_training():
    torch.manual_seed(0)
    attn = Attention(16, 4, dropout=0.5)
    x = _x(2, 5, 16)
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x))
    attn.train()
    assert not torch.allclose(attn(x), attn(x))


def test_attention_bad_head_counts():
    with pytest.raises(ValueError, match="n_kv_heads must be a positive int dividing n_heads=4"):
        Attention(16, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="impl must be one of 'manual', 'sdpa', 'flash', 'triton'"):
        Attention(16, 4, impl="fast")


# ----------------------------------------------------------------------------- Block


def _block_config(**changes) -> ModelConfig:
    base = ModelConfig(d_vocab=8, n_ctx=8, d_model=16, n_layers=1, n_heads=4, d_mlp=24, activation="relu")
    return base.replace(**changes)


def _copy_encoder_layer(block: Block, layer: torch.nn.TransformerEncoderLayer) -> None:
    _copy_mha(block.attn, layer.self_attn)
    _copy_linear(block.mlp.W_in, layer.linear1.weight, layer.linear1.bias)
    _copy_linear(block.mlp.W_out, layer.linear2.weight, layer.linear2.bias)
    for ours, theirs in ((block.ln1, layer.norm1), (block.ln2, layer.norm2)):
        _copy_linear(ours, theirs.weight, theirs.bias)


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_block_matches_torch_encoder_layer(norm_position, activation, impl, typechecked):
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, activation=activation, batch_first=True,
                                           norm_first=norm_position == "pre").eval()
    _randomise_scaled(ref)
    block = Block(_block_config(activation=activation, norm_position=norm_position, attention=impl)).eval()
    _copy_encoder_layer(block, ref)

    x = _x(2, 6, 16)
    keep = causal_mask(6, 6)
    pad = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        full = typechecked(block.forward)(x)
        torch.testing.assert_close(full, ref(x))
        causal = block(x, causal=True)
        torch.testing.assert_close(causal, ref(x, src_mask=~keep, is_causal=True))  # torch: True = hidden
        assert not torch.allclose(causal, full, atol=1e-3)
        padded = block(x, pad[:, None, None, :])
        expected = ref(x, src_key_padding_mask=~pad)
        torch.testing.assert_close(padded[pad], expected[pad])  # torch's fast path may zero padded rows


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_cross_attention_block_matches_torch_decoder_layer(activation, impl):
    torch.manual_seed(0)
    ref = torch.nn.TransformerDecoderLayer(16, 4, 24, dropout=0.0, activation=activation, batch_first=True).eval()
    _randomise_scaled(ref)
    block = Block(_block_config(activation=activation, norm_position="post", attention=impl),
                  cross_attention=True).eval()
    _copy_mha(block.attn, ref.self_attn)
    _copy_mha(block.cross_attn, ref.multihead_attn)
    _copy_linear(block.mlp.W_in, ref.linear1.weight, ref.linear1.bias)
    _copy_linear(block.mlp.W_out, ref.linear2.weight, ref.linear2.bias)
    for ours, theirs in ((block.ln1, ref.norm1), (block.ln_cross, ref.norm2), (block.ln2, ref.norm3)):
        _copy_linear(ours, theirs.weight, theirs.bias)

    tgt, memory = _x(2, 6, 16), _x(2, 5, 16, seed=4)
    memory_keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with torch.no_grad():
        out = block(tgt, causal=True, context=memory, context_mask=memory_keep[:, None, None, :])
        expected = ref(tgt, memory, tgt_mask=~causal_mask(6, 6), tgt_is_causal=True, memory_key_padding_mask=~memory_keep)
        torch.testing.assert_close(out, expected)


def test_pre_norm_block_is_two_residual_additions():
    torch.manual_seed(0)
    block = Block(_block_config(norm="rms", activation="swiglu", bias=False, positional="rope")).eval()
    _randomise_scaled(block)
    x = _x(2, 5, 16)
    with torch.no_grad():
        mid = x + block.attn(block.ln1(x), causal=True)
        torch.testing.assert_close(block(x, causal=True), mid + block.mlp(block.ln2(mid)))


def test_block_hook_points():
    names = {name for name, _ in Block(_block_config(), cross_attention=True).named_modules() if "hook_" in name}
    assert names == {"hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_cross_attn_out",
                     "hook_resid_mid_cross", "hook_mlp_out", "hook_resid_post", "attn.hook_pattern",
                     "cross_attn.hook_pattern", "attn.hook_z", "cross_attn.hook_z"}


def test_block_context_errors():
    x = _x(1, 3, 16)
    with pytest.raises(ValueError, match="has cross-attention: pass context="):
        Block(_block_config(), cross_attention=True)(x)
    with pytest.raises(ValueError, match="has no cross-attention.*cross_attention=True"):
        Block(_block_config())(x, context=x)


def test_dropout_skips_only_a_no_op_dropout_module():
    x = torch.ones(1000)
    assert dropout(torch.nn.Dropout(0.5).eval(), x) is x  # eval: the identity, no call
    assert dropout(torch.nn.Dropout(0.0), x) is x  # p = 0: the identity too
    dropped = dropout(torch.nn.Dropout(0.5).train(), x)
    assert (dropped == 0).any() and torch.equal(dropped[dropped != 0], torch.full_like(dropped[dropped != 0], 2.0))
    doubled = dropout(_Double().eval(), x)  # not an nn.Dropout: always called, even in eval
    assert torch.equal(doubled, 2 * x)


class _Double(torch.nn.Module):
    def forward(self, x):
        return 2 * x

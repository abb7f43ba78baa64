"""tfedu.layers against independent oracles: torch's norms, HF Llama's RMSNorm and MLP, GPT-2's MLP."""

import pytest
import torch
from transformers import GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from tfedu.layers import ACTIVATIONS, MLP, LayerNorm, RMSNorm, swiglu_hidden

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
    expected = swiglu_hidden(D_MODEL) if activation == "swiglu" else 4 * D_MODEL
    assert mlp.d_mlp == expected
    assert tuple(mlp.W_in.weight.shape) == (expected, D_MODEL)
    assert tuple(mlp.W_out.weight.shape) == (D_MODEL, expected)
    assert hasattr(mlp, "W_gate") == (activation == "swiglu")
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

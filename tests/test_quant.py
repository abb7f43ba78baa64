"""tfedu.quant against independent oracles: torch's own quantizers, a naive optimal-brain-quantizer, hand counts."""

import math

import pytest
import torch
from torch import nn

import tfedu.quant as quant
from tfedu.config import ModelConfig
from tfedu.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------- absmax and zero-point, by formula


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("granularity, group_size", [("tensor", None), ("row", None), ("group", 8)])
def test_absmax_round_trip_is_within_half_a_step(bits, granularity, group_size):
    x = randn(bits, 6, 32) * 3
    q, scale = quant.absmax_quantize(x, bits, granularity=granularity, group_size=group_size)
    qmax = 2 ** (bits - 1) - 1
    assert q.dtype == torch.int8 and q.abs().max() <= qmax and q.abs().max() == qmax  # the largest |x| maps to qmax
    x_hat = quant.absmax_dequantize(q, scale, granularity=granularity, group_size=group_size)
    step = quant._units(torch.ones_like(x), granularity, group_size) * scale.reshape(-1, 1)
    assert ((x - x_hat).abs() <= step.reshape(x.shape) / 2 * (1 + 1e-6)).all()
    assert torch.equal(quant.absmax_quantize(-x, bits, granularity=granularity, group_size=group_size)[0], -q)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("granularity, group_size", [("tensor", None), ("row", None), ("group", 16)])
def test_zeropoint_round_trip_is_within_half_a_step_and_zero_is_exact(bits, granularity, group_size):
    x = randn(10 + bits, 5, 32) + 0.7  # shifted: an asymmetric range
    x[0, 3] = 0.0
    q, scale, zero = quant.zeropoint_quantize(x, bits, granularity=granularity, group_size=group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 2**bits - 1
    x_hat = quant.zeropoint_dequantize(q, scale, zero, granularity=granularity, group_size=group_size)
    step = (quant._units(torch.ones_like(x), granularity, group_size) * scale.reshape(-1, 1).float()).reshape(x.shape)
    unclamped = (q > 0) & (q < 2**bits - 1)  # where the clamp did not bite, the error is the rounding alone
    assert ((x - x_hat).abs() <= step / 2 * (1 + 1e-5))[unclamped].all()
    assert ((x - x_hat).abs() <= step * (1 + 1e-5)).all()
    assert x_hat[0, 3] == 0.0  # exact zero comes back exactly


def test_zero_point_range_holds_zero_even_for_positive_tensors():
    x = torch.tensor([2.0, 3.0, 4.0])
    q, scale, zero = quant.zeropoint_quantize(x, 8)
    assert zero.item() == 0 and math.isclose(scale.item(), 4 / 255, rel_tol=1e-6)
    assert quant.zeropoint_dequantize(torch.tensor([0], dtype=torch.uint8), scale, zero).item() == 0.0


def test_all_zero_tensors_get_scale_one_and_no_nan():
    x = torch.zeros(3, 8)
    q, s = quant.absmax_quantize(x, 4, granularity="row")
    assert torch.equal(s, torch.ones(3, 1)) and not q.any()
    q, s, z = quant.zeropoint_quantize(x, 4, granularity="group", group_size=4)
    assert torch.equal(quant.zeropoint_dequantize(q, s, z, granularity="group", group_size=4), x)


def test_scales_stored_in_float16_are_rounded_up_so_the_range_still_fits():
    x = randn(3, 16, 64)
    for granularity in ("tensor", "row"):
        q, s = quant.absmax_quantize(x, 4, granularity=granularity, scale_dtype=torch.float16)
        assert s.dtype == torch.float16
        amax = quant._units(x, granularity, None).abs().amax(dim=1)
        assert (s.float().flatten() * 7 >= amax).all()


# ----------------------------------------------------------------------------- torch's quantizers as the oracle


QUANTIZED_TENSORS_DEPRECATED = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")


@QUANTIZED_TENSORS_DEPRECATED
def test_absmax_int8_equals_torch_quantize_per_tensor():
    x = randn(0, 64, 48)
    q, scale = quant.absmax_quantize(x, 8)
    ref = torch.quantize_per_tensor(x, scale.item(), 0, torch.qint8)
    assert torch.equal(q, ref.int_repr())
    assert torch.allclose(quant.absmax_dequantize(q, scale), ref.dequantize())


@QUANTIZED_TENSORS_DEPRECATED
def test_zeropoint_uint8_equals_torch_quantize_per_tensor():
    x = randn(1, 64, 48) + 0.5
    q, scale, zero = quant.zeropoint_quantize(x, 8)
    ref = torch.quantize_per_tensor(x, scale.item(), int(zero), torch.quint8)
    assert torch.equal(q, ref.int_repr())
    assert torch.allclose(quant.zeropoint_dequantize(q, scale, zero), ref.dequantize())


@QUANTIZED_TENSORS_DEPRECATED
def test_per_row_equals_torch_quantize_per_channel_both_conventions():
    x = randn(2, 16, 40)
    q, scale = quant.absmax_quantize(x, 8, granularity="row")
    ref = torch.quantize_per_channel(x, scale.flatten().double(), torch.zeros(16, dtype=torch.long), 0, torch.qint8)
    assert torch.equal(q, ref.int_repr())
    q, scale, zero = quant.zeropoint_quantize(x, 8, granularity="row")
    ref = torch.quantize_per_channel(x, scale.flatten().double(), zero.flatten().long(), 0, torch.quint8)
    assert torch.equal(q, ref.int_repr())
    assert torch.allclose(quant.zeropoint_dequantize(q, scale, zero, granularity="row"), ref.dequantize())


def test_torch_ao_observer_agrees_on_the_symmetric_int8_scale():
    from torch.ao.quantization.observer import PerChannelMinMaxObserver

    x = randn(3, 8, 32)
    observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                        quant_min=-127, quant_max=127)
    observer(x)
    scale, zero = observer.calculate_qparams()
    _, ours = quant.absmax_quantize(x, 8, granularity="row")
    # torch.ao divides max|x| by (quant_max - quant_min) / 2 = 127: our convention
    assert torch.allclose(scale.float(), ours.flatten(), rtol=1e-6) and not zero.any()


# ----------------------------------------------------------------------------- packing


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 33])
def test_int4_packing_round_trips_odd_sizes_too(n):
    codes = torch.randint(0, 16, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = quant.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 1) // 2
    assert torch.equal(quant.unpack_int4(packed, n), codes)


def test_int4_packing_layout_and_errors():
    assert quant.pack_int4(torch.tensor([[1, 2], [15, 0]])).tolist() == [0x21, 0x0F]
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        quant.pack_int4(torch.tensor([16]))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        quant.pack_int4(torch.tensor([-1]))
    with pytest.raises(TypeError, match="integer codes"):
        quant.pack_int4(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="hold"):
        quant.unpack_int4(torch.tensor([1, 2], dtype=torch.uint8), 5)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    x = randn(0, 4, 12)
    for bits in (1, 9, 16, 4.0, True):
        with pytest.raises(ValueError, match="bits must be an int"):
            quant.absmax_quantize(x, bits)
    with pytest.raises(ValueError, match="does not divide the row width 12"):
        quant.zeropoint_quantize(x, 4, granularity="group", group_size=5)
    with pytest.raises(TypeError, match="float tensor"):
        quant.absmax_quantize(torch.arange(6), 8)
    with pytest.raises(ValueError, match="NaN or inf"):
        quant.absmax_quantize(torch.tensor([1.0, math.inf]), 8)
    with pytest.raises(ValueError, match="granularity must be"):
        quant.absmax_quantize(x, 8, granularity="column")
    with pytest.raises(ValueError, match="2-d weight"):
        quant.absmax_quantize(randn(0, 2, 3, 4), 8, granularity="row")
    with pytest.raises(ValueError, match="H must be"):
        quant.gptq_quantize(x, torch.eye(5), 4)


# ----------------------------------------------------------------------------- GPTQ


def naive_obq_row(w, H, bits, damp=0.0):
    """The optimal brain quantizer on one row, left to right, with the explicit inverse (float64, by hand).

    Quantize w_j to the row's zero-point grid; the remaining weights move by
    delta = -(w_j - q_j) / [H^-1]_jj * H^-1[:, j] (Frantar & Alistarh 2022, eq. 3);
    then column j leaves the inverse: H^-1 <- H^-1 - H^-1[:, j] H^-1[j, :] / [H^-1]_jj.
    """
    w, H = w.double().clone(), H.double().clone()
    H += damp * H.diag().mean() * torch.eye(len(w), dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    scale, zero = quant.zeropoint_params(w[None].float(), bits)
    scale, zero = scale.double().item(), zero.double().item()
    levels = 2**bits - 1
    out = torch.zeros_like(w)
    for j in range(len(w)):
        q = (min(max(round(w[j].item() / scale) + zero, 0), levels) - zero) * scale
        out[j] = q
        w = w - (w[j] - q) / Hinv[j, j] * Hinv[:, j]
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    return out


@pytest.mark.parametrize("seed", range(3))
def test_gptq_on_one_row_equals_the_optimal_brain_quantizer_by_hand(seed):
    X = randn(seed, 4, 20, dtype=torch.float64)
    X[1] += 0.8 * X[0]  # correlated inputs: errors are worth passing on
    H = 2 * X @ X.T
    w = randn(100 + seed, 1, 4, dtype=torch.float64)
    got = quant.gptq_quantize(w, H, bits=3, damp=0.0).weight
    want = naive_obq_row(w[0], H, bits=3)
    assert torch.allclose(got[0], want, atol=1e-12)


def test_gptq_with_the_identity_hessian_is_round_to_nearest():
    W = randn(0, 16, 64)
    for group_size in (None, 16):
        found = quant.gptq_quantize(W, torch.eye(64), 4, group_size)
        assert torch.equal(found.weight, quant.rtn_quantize_weight(W, 4, group_size))


def test_gptq_lazy_blocks_do_not_change_the_result():
    X = randn(1, 200, 48)
    H = 2 * X.T @ X
    W = randn(2, 8, 48, dtype=torch.float64)
    a = quant.gptq_quantize(W, H.double(), 4, 16, block_size=48).weight
    b = quant.gptq_quantize(W, H.double(), 4, 16, block_size=5).weight
    assert torch.allclose(a, b, atol=1e-10)


def _course_like_inputs(seed, n, d):
    """Correlated inputs with a few large channels, as a transformer's activations have."""
    mix = randn(seed, d, d) / math.sqrt(d) + torch.eye(d)
    X = randn(seed + 1, n, d) @ mix
    X[:, :3] *= 6
    return X


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bits, group_size", [(4, None), (3, 16), (4, 32)])
def test_gptq_beats_round_to_nearest_on_layer_error(seed, bits, group_size):
    d_in = 64
    X = _course_like_inputs(seed, 512, d_in)
    W = randn(50 + seed, 32, d_in) * 0.1
    H = 2 * X.T @ X / len(X)
    gptq = quant.gptq_quantize(W, H, bits, group_size).weight
    rtn = quant.rtn_quantize_weight(W, bits, group_size)
    assert quant.layer_error(W, gptq, X) < 0.9 * quant.layer_error(W, rtn, X)


def test_gptq_beats_round_to_nearest_on_the_course_models_own_layers():
    model = GPT(ModelConfig(d_vocab=64, n_ctx=32, d_model=32, n_layers=2, n_heads=2))
    ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(0))
    layers = dict(quant.block_linears(model))
    H = quant.collect_hessians(model, layers, ids)
    inputs = {}

    def keep(name):
        def hook(module, args, output):
            inputs[name] = args[0].reshape(-1, args[0].shape[-1])  # (a hook returning a value would replace the output)
        return hook

    handles = [layer.register_forward_hook(keep(name)) for name, layer in layers.items()]
    with torch.no_grad():
        model.eval()(ids)
    for handle in handles:
        handle.remove()
    for name, layer in layers.items():
        X = inputs[name]  # tokens d_in: the same inputs the Hessian was built from
        assert torch.allclose(H[name], 2 * X.double().T @ X.double() / len(X), atol=1e-4)
        gptq = quant.gptq_quantize(layer.weight, H[name], 4).weight
        rtn = quant.rtn_quantize_weight(layer.weight.detach(), 4)
        assert quant.layer_error(layer.weight, gptq, X) < quant.layer_error(layer.weight, rtn, X), name


# ----------------------------------------------------------------------------- the layer and the model


def test_quantized_linear_stores_exactly_its_codes_and_dequantizes_in_its_forward():
    linear = nn.Linear(64, 24)
    for bits, group_size, code_bytes in [(4, 16, 64 * 24 // 2), (8, None, 64 * 24), (3, 32, 64 * 24)]:
        layer = quant.QuantizedLinear.from_weight(linear.weight, linear.bias, bits=bits, group_size=group_size)
        groups = 24 * (64 // (group_size or 64))
        assert layer.nbytes == code_bytes + 2 * groups + groups + 4 * 24  # codes, fp16 scales, uint8 zeros, fp32 bias
        assert layer.scale.dtype == torch.float16 and layer.codes.dtype == torch.uint8
        x = randn(0, 5, 64)
        assert torch.allclose(layer(x), x @ layer.dequantized_weight().T + linear.bias, atol=1e-6)
        err = (layer.dequantized_weight() - linear.weight).abs().max()
        assert err <= layer.scale.float().max() * (1 + 1e-3)


def test_quantize_model_leaves_the_original_untouched_and_counts_bytes_by_hand():
    cfg = ModelConfig(d_vocab=64, n_ctx=16, d_model=32, n_layers=2, n_heads=2)
    model = GPT(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fp32 = quant.model_nbytes(model)
    n_params = sum(p.numel() for p in model.parameters())
    assert fp32 == 4 * n_params
    q16 = quant.quantize_model(model, 16)
    assert quant.model_nbytes(q16) == 2 * n_params
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    for method in ("rtn", "gptq"):
        q4 = quant.quantize_model(model, 4, 16, method, calibration=ids)
        linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
        w = sum(m.weight.numel() for m in linears)
        b = sum(m.bias.numel() for m in linears)
        groups = w // 16
        rest = n_params - w - b  # embeddings, positions, norms: float32
        assert quant.model_nbytes(q4) == w // 2 + 2 * groups + groups + 4 * b + 4 * rest
        assert sum(isinstance(m, quant.QuantizedLinear) for m in q4.modules()) == len(linears) == 12
        logits = q4(ids)[0] if isinstance(q4(ids), tuple) else q4(ids)
        assert torch.isfinite(logits).all()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="calibration"):
        quant.quantize_model(model, 4, method="gptq")
    with pytest.raises(ValueError, match="does not divide"):
        quant.quantize_model(model, 4, group_size=5)
    with pytest.raises(ValueError, match="method must be"):
        quant.quantize_model(model, 4, method="awq")


def test_a_gptq_quantized_layer_stores_exactly_what_gptq_found():
    X = _course_like_inputs(7, 256, 64)
    H = 2 * X.T @ X / len(X)
    linear = nn.Linear(64, 16)
    found = quant.gptq_quantize(linear.weight, H, 4, 16, scale_dtype=torch.float16)
    layer = quant.QuantizedLinear.from_weight(linear.weight, linear.bias, bits=4, group_size=16, codes=found.codes,
                                              scale=found.scale, zero=found.zero)
    assert torch.equal(layer.weight_codes(), found.codes)
    assert torch.allclose(layer.dequantized_weight(), found.weight, atol=1e-6)
    with pytest.raises(ValueError, match="block_size"):
        quant.gptq_quantize(linear.weight, H, 4, block_size=0)

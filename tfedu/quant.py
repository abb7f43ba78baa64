"""Weight quantization: absmax and zero-point integers, group-wise int4 packed two to a byte, and GPTQ.

A weight matrix holds floats in a narrow range. Quantization stores each one as a b-bit integer code
and keeps, per tensor, row or group of columns, the float *scale* (and *zero point*) that maps the
codes back. The conventions here, used everywhere in tfedu (``qmax = 2^(b-1) - 1``):

- **absmax (symmetric)**: ``scale = max|x| / qmax``, ``q = clamp(round(x / scale), -qmax, qmax)``,
  ``x_hat = q * scale``. The range is symmetric, ``[-127, 127]`` for 8 bits: -128 is never used, so
  0 maps to 0 and ``-x`` to ``-q`` (as in LLM.int8(), Dettmers et al. 2022). Codes are int8.
- **zero-point (asymmetric)**: the range ``[lo, hi] = [min(min x, 0), max(max x, 0)]`` (widened to
  hold 0, so that 0 is exactly representable), ``scale = (hi - lo) / (2^b - 1)``,
  ``zero = round(-lo / scale)``, ``q = clamp(round(x / scale) + zero, 0, 2^b - 1)``,
  ``x_hat = (q - zero) * scale``. Codes are uint8, zero points integers in ``[0, 2^b - 1]``.
- ``round`` is ``torch.round``, half to even (as ``torch.quantize_per_tensor`` rounds). A tensor,
  row or group of all zeros gets ``scale = 1`` (any positive scale would do: every code is 0, or
  ``zero``), never a division by zero.
- Granularity: ``"tensor"`` (one scale), ``"row"`` (one per output channel: a row of an
  ``nn.Linear`` weight of shape (d_out, d_in)) or ``"group"`` (one per ``group_size`` consecutive
  columns of a row; ``group_size`` must divide the row's width).

Within the range every value is off by at most ``scale / 2`` (the rounding); outside it is clamped.

``QuantizedLinear`` stores what a quantized checkpoint stores, nothing more: the zero-point codes as
uint8 (two 4-bit codes packed per byte when ``bits == 4``), one float16 scale and one uint8 zero
point per group (GPTQ's checkpoints keep fp16 scales too), and the bias in float32. Its forward
dequantizes the weight to float32 and multiplies: the arithmetic is float32, only the storage is
small (weight-only quantization, as GPTQ's).

``quantize_model(model, bits, group_size, method="rtn" | "gptq", calibration)`` returns a quantized
copy. bits 16 is ``float16`` storage of every parameter (float16 rather than bfloat16: the weights
are small numbers, far inside float16's range, where its 10 mantissa bits beat bfloat16's 7).
bits 2..8 replace every ``nn.Linear`` inside the blocks by a ``QuantizedLinear``; the embedding,
the (tied) unembedding, the positions and the LayerNorms stay float32 (GPTQ keeps them in float16,
the paper quantizes the blocks only) and are counted in :func:`model_nbytes` at 4 bytes each.

GPTQ (Frantar, Ashkboos, Hoefler & Alistarh 2022, Algorithm 1): for a layer with inputs X
(d_in x n), minimise ``||W X - W_hat X||^2``. Its Hessian with respect to a row is ``H = 2 X X^T``
(the same for every row). Quantize the columns left to right; after rounding column j, the error
``(w_j - q_j) / [H^-1]_jj`` times row j of the upper Cholesky factor of ``H^-1`` is subtracted from
the columns not yet quantized, which is the optimal-brain-quantizer update (Frantar & Alistarh 2022)
done with a factor computed once. With ``H = I`` no error is passed on, and GPTQ is round-to-nearest.

Built by hand in notebooks/14_quantization.ipynb.

>>> q, scale = absmax_quantize(torch.tensor([0.5, -1.0, 0.25]), bits=8)
>>> q.tolist(), round(scale.item() * 127, 6)
([64, -127, 32], 1.0)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor, nn

from tfedu.train import evaluate

GRANULARITIES = ("tensor", "row", "group")
METHODS = ("rtn", "gptq")


# ----------------------------------------------------------------------------- input checks


def _check_bits(bits: object, allowed: tuple[int, ...] = tuple(range(2, 9))) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise ValueError(f"bits must be an int in {allowed[0]}..{allowed[-1]}, got {bits!r}")
    return bits


def _check_float(x: object, name: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a float tensor (the values to quantize), got {x.dtype}: integer tensors are "
                        "already codes")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds NaN or inf: no finite scale covers it")
    return x


def _units(x: Tensor, granularity: str, group_size: int | None) -> Tensor:
    """``x`` viewed as (units, values per unit): one scale per unit (a tensor, a row, or a group of a row)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        return x.reshape(1, -1)
    if x.dim() != 2:
        raise ValueError(f"granularity {granularity!r} needs a 2-d weight (d_out, d_in), got shape {tuple(x.shape)}")
    if granularity == "row":
        return x
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if x.shape[1] % group_size:
        raise ValueError(f"group_size {group_size} does not divide the row width {x.shape[1]}")
    return x.reshape(-1, group_size)  # each row's groups, one after another


def _round_up_to(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``scale`` stored in ``dtype``, rounded up where rounding went down (so the range still fits in the codes)."""
    stored = scale.to(dtype)
    low = stored.float() < scale.float()
    return torch.where(low, torch.nextafter(stored, torch.full_like(stored, math.inf)), stored)


# ----------------------------------------------------------------------------- absmax (symmetric)


def absmax_quantize(x: Tensor, bits: int = 8, *, granularity: str = "tensor", group_size: int | None = None,
                    scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Symmetric codes ``q`` (int8, the shape of ``x``) and scales: ``scale = max|x| / (2^(b-1) - 1)``.

    ``q = clamp(round(x / scale), -qmax, qmax)``; the scales have shape () for ``"tensor"``, (d_out, 1)
    for ``"row"`` and (d_out, d_in // group_size) for ``"group"``.

    >>> q, s = absmax_quantize(torch.tensor([[1.0, -2.0], [0.0, 0.0]]), 8, granularity="row")
    >>> q.tolist(), s.flatten().tolist()
    ([[64, -127], [0, 0]], [0.015748031437397003, 1.0])
    """
    _check_float(x)
    qmax = 2 ** (_check_bits(bits) - 1) - 1
    units = _units(x.float(), granularity, group_size)  # units values
    amax = units.abs().amax(dim=1, keepdim=True)  # units 1
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # an all-zero unit: any scale, 1
    scale = _round_up_to(scale, scale_dtype).float()
    q = (units / scale).round().clamp(-qmax, qmax).to(torch.int8).reshape(x.shape)
    return q, _shape_scales(scale.to(scale_dtype), x, granularity)


def absmax_dequantize(q: Tensor, scale: Tensor, *, granularity: str = "tensor", group_size: int | None = None) -> Tensor:
    """``q * scale``, float32, the shape of ``q`` (scales as :func:`absmax_quantize` returns them).

    >>> absmax_dequantize(torch.tensor([64, -127], dtype=torch.int8), torch.tensor(2 / 127)).tolist()
    [1.0078740119934082, -2.0]
    """
    return (_units(q.float(), granularity, group_size) * scale.float().reshape(-1, 1)).reshape(q.shape)


def _shape_scales(per_unit: Tensor, x: Tensor, granularity: str) -> Tensor:
    if granularity == "tensor":
        return per_unit.reshape(())
    return per_unit.reshape(x.shape[0], -1)  # (d_out, 1) per row, (d_out, n_groups) per group


# ----------------------------------------------------------------------------- zero-point (asymmetric)


def zeropoint_params(units: Tensor, bits: int, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Per unit (row of ``units``): the scale and the zero point (float tensors, (units, 1), zero integer-valued)."""
    levels = 2**bits - 1
    lo = units.amin(dim=1, keepdim=True).clamp(max=0)  # the range holds 0, so 0 has a code of its own
    hi = units.amax(dim=1, keepdim=True).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / levels, torch.ones_like(hi))
    scale = _round_up_to(scale, scale_dtype).float()
    zero = (-lo / scale).round().clamp(0, levels)
    return scale, zero


def zeropoint_quantize(x: Tensor, bits: int = 8, *, granularity: str = "tensor", group_size: int | None = None,
                       scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric codes ``q`` (uint8, in [0, 2^b - 1]), scales and zero points (uint8), shaped as absmax's scales.

    ``scale = (hi - lo) / (2^b - 1)`` with ``[lo, hi]`` the range widened to hold 0, ``zero = round(-lo / scale)``,
    ``q = clamp(round(x / scale) + zero, 0, 2^b - 1)``.

    >>> q, s, z = zeropoint_quantize(torch.tensor([0.0, 1.0, 3.0]), 2)
    >>> q.tolist(), s.item(), z.item()
    ([0, 1, 3], 1.0, 0)
    """
    _check_float(x)
    levels = 2 ** _check_bits(bits) - 1
    units = _units(x.float(), granularity, group_size)
    scale, zero = zeropoint_params(units, bits, scale_dtype)
    q = ((units / scale).round() + zero).clamp(0, levels).to(torch.uint8).reshape(x.shape)
    return q, _shape_scales(scale.to(scale_dtype), x, granularity), _shape_scales(zero.to(torch.uint8), x, granularity)


def zeropoint_dequantize(q: Tensor, scale: Tensor, zero: Tensor, *, granularity: str = "tensor",
                         group_size: int | None = None) -> Tensor:
    """``(q - zero) * scale``, float32. Exact zero comes back exactly: its code is ``zero``.

    >>> zeropoint_dequantize(torch.tensor([0, 1, 3], dtype=torch.uint8), torch.tensor(1.0), torch.tensor(1)).tolist()
    [-1.0, 0.0, 2.0]
    """
    units = _units(q.float(), granularity, group_size)
    return ((units - zero.float().reshape(-1, 1)) * scale.float().reshape(-1, 1)).reshape(q.shape)


# ----------------------------------------------------------------------------- int4 packing


def pack_int4(codes: Tensor) -> Tensor:
    """Codes in [0, 15] (any integer dtype, any shape) packed two per byte: a flat uint8 tensor of ceil(n / 2).

    Code ``2i`` goes to the low nibble of byte i, code ``2i + 1`` to the high one; an odd count leaves the last
    high nibble 0 (:func:`unpack_int4` needs the count back).

    >>> pack_int4(torch.tensor([1, 2, 15])).tolist()  # 1 + 16 * 2, then 15
    [33, 15]
    """
    if not isinstance(codes, Tensor) or codes.is_floating_point() or codes.dtype == torch.bool:
        raise TypeError(f"pack_int4 packs integer codes, got {codes.dtype if isinstance(codes, Tensor) else type(codes).__name__}")
    flat = codes.flatten().to(torch.int16)
    if flat.numel() and (flat.min() < 0 or flat.max() > 15):
        raise ValueError(f"int4 codes must lie in [0, 15], got values from {int(flat.min())} to {int(flat.max())}")
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack_int4(packed: Tensor, numel: int) -> Tensor:
    """The first ``numel`` codes packed by :func:`pack_int4`, as a flat uint8 tensor.

    >>> unpack_int4(torch.tensor([33, 15], dtype=torch.uint8), 3).tolist()
    [1, 2, 15]
    """
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 reads uint8 bytes, got {packed.dtype if isinstance(packed, Tensor) else type(packed).__name__}")
    if not 0 <= numel <= 2 * packed.numel() or numel < 2 * packed.numel() - 1:
        raise ValueError(f"{packed.numel()} bytes hold {2 * packed.numel() - 1} or {2 * packed.numel()} codes, not {numel}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=1).flatten()[:numel]


# ----------------------------------------------------------------------------- the quantized layer


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` stored as zero-point codes per group: uint8 codes (packed two per byte at 4 bits),
    float16 scales, uint8 zero points, float32 bias. ``nbytes`` counts exactly those buffers.

    >>> layer = QuantizedLinear.from_weight(torch.randn(4, 8), None, bits=4, group_size=4)
    >>> layer.nbytes  # 16 bytes of packed codes + 8 fp16 scales (16 bytes) + 8 zero points
    40
    >>> layer(torch.zeros(2, 8)).shape
    torch.Size([2, 4])
    """

    def __init__(self, d_in: int, d_out: int, *, bits: int, group_size: int | None, codes: Tensor, scale: Tensor,
                 zero: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = d_in, d_out
        self.bits = _check_bits(bits)
        self.group_size = group_size or d_in
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("bias", bias)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, *, bits: int, group_size: int | None,
                    codes: Tensor | None = None, scale: Tensor | None = None, zero: Tensor | None = None) -> QuantizedLinear:
        """Round-to-nearest quantization of ``weight`` (d_out, d_in); or the given codes (uint8, unpacked) and params."""
        d_out, d_in = weight.shape
        if codes is None:
            codes, scale, zero = zeropoint_quantize(weight.detach(), bits, granularity="group",
                                                    group_size=group_size or d_in, scale_dtype=torch.float16)
        stored = pack_int4(codes) if bits == 4 else codes.to(torch.uint8).contiguous()
        return cls(d_in, d_out, bits=bits, group_size=group_size, codes=stored, scale=scale.to(torch.float16),
                   zero=zero.to(torch.uint8), bias=None if bias is None else bias.detach().float().clone())

    def weight_codes(self) -> Tensor:
        """The (d_out, d_in) uint8 codes, unpacked."""
        n = self.out_features * self.in_features
        flat = unpack_int4(self.codes, n) if self.bits == 4 else self.codes
        return flat.reshape(self.out_features, self.in_features)

    def dequantized_weight(self) -> Float[Tensor, "d_out d_in"]:
        return zeropoint_dequantize(self.weight_codes(), self.scale, self.zero, granularity="group",
                                    group_size=self.group_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero, self.bias) if t is not None)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        return nn.functional.linear(x, self.dequantized_weight().to(x.dtype),
                                    None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, group_size={self.group_size}"


# ----------------------------------------------------------------------------- GPTQ


def rtn_quantize_weight(weight: Tensor, bits: int, group_size: int | None = None) -> Tensor:
    """Round-to-nearest: zero-point quantize-dequantize per row (or per group), float32."""
    gran, gs = ("group", group_size) if group_size else ("row", None)
    q, s, z = zeropoint_quantize(weight, bits, granularity=gran, group_size=gs)
    return zeropoint_dequantize(q, s, z, granularity=gran, group_size=gs)


@dataclass
class GPTQResult:
    """What :func:`gptq_quantize` found: codes (uint8, d_out d_in), scales and zeros (d_out, n_groups), and
    the dequantized weight (the input's dtype, float32 or float64)."""

    codes: Tensor
    scale: Tensor
    zero: Tensor
    weight: Tensor


def gptq_quantize(weight: Tensor, H: Tensor, bits: int, group_size: int | None = None, *, damp: float = 0.01,
                  block_size: int = 128, scale_dtype: torch.dtype = torch.float32) -> GPTQResult:
    """GPTQ (Frantar et al. 2022, Algorithm 1) on one layer's ``weight`` (d_out, d_in) with Hessian ``H`` (d_in, d_in).

    ``H = 2 X X^T`` (any positive multiple gives the same result) from the layer's inputs X. Dampening adds
    ``damp * mean(diag H)`` to the diagonal; a column no input ever reaches (``H_jj = 0``) is set to zero. The
    zero-point grid of a group (or, without groups, of the whole row) is computed from the columns as they are
    when the group's first column is reached, so it sees the errors pushed onto them. ``block_size``: the lazy
    batch updates of section 4 (the result is the same for any block size, up to rounding).
    """
    W = _check_float(weight, "weight").detach().clone()
    dtype = W.dtype if W.dtype == torch.float64 else torch.float32
    W = W.to(dtype)
    d_out, d_in = W.shape
    levels = 2 ** _check_bits(bits) - 1
    g = group_size or d_in
    _units(W, "group", g)  # group_size must divide d_in
    if not isinstance(H, Tensor) or H.shape != (d_in, d_in):
        raise ValueError(f"H must be a (d_in, d_in) = ({d_in}, {d_in}) tensor, got {getattr(H, 'shape', type(H).__name__)}")
    if not 0 <= damp:
        raise ValueError(f"damp must be >= 0, got {damp}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    H = H.detach().to(dtype).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(d_in, dtype=dtype)
    # Upper Cholesky factor of H^-1: row j holds [H^-1]_jj-scaled updates of the columns after j (section 4, step 3).
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros(d_out, d_in, dtype=torch.uint8)
    Q = torch.zeros_like(W)
    scales, zeros = [], []
    scale = zero = None
    for i1 in range(0, d_in, block_size):
        i2 = min(i1 + block_size, d_in)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            if j % g == 0:  # a new group: its grid from the columns as they are now (errors pushed on them included)
                later = W[:, i2 : j + g] - Err1[:, :i] @ Hinv[i1:j, i2 : j + g]  # with this block's pending updates
                ahead = torch.cat([W1[:, i:], later], dim=1)[:, :g]
                scale, zero = zeropoint_params(ahead.float(), bits, scale_dtype)
                scale, zero = scale.to(dtype), zero.to(dtype)
                scales.append(scale)
                zeros.append(zero)
            w = W1[:, i : i + 1]  # d_out 1
            q = ((w / scale).round() + zero).clamp(0, levels)
            codes[:, j] = q[:, 0].to(torch.uint8)
            Q[:, j : j + 1] = (q - zero) * scale
            err = (w - Q[:, j : j + 1]) / Hinv[j, j]  # d_out 1
            W1[:, i:] -= err @ Hinv[j : j + 1, j:i2]  # spread over this block's later columns
            Err1[:, i : i + 1] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # and, once per block, over the columns after it
    scale = torch.cat(scales, dim=1).to(scale_dtype)
    zero = torch.cat(zeros, dim=1).to(torch.uint8)
    return GPTQResult(codes=codes, scale=scale, zero=zero, weight=Q)


def layer_error(weight: Tensor, quantized: Tensor, X: Tensor) -> float:
    """``||W X - W_hat X||_F`` for inputs X of shape (n, d_in) (rows are tokens), in float64."""
    diff = (weight.detach().double() - quantized.detach().double()) @ X.detach().double().T
    return float(diff.norm())


# ----------------------------------------------------------------------------- whole models


def block_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(qualified name, layer) of every ``nn.Linear`` inside ``model.blocks`` (embeddings and unembedding excluded)."""
    for b, block in enumerate(model.blocks):
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                yield f"blocks.{b}.{name}", module


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name), child, new)


@torch.no_grad()
def collect_hessians(model: nn.Module, layers: dict[str, nn.Linear], calibration: Tensor,
                     batch_size: int = 8) -> dict[str, Tensor]:
    """``H = 2 X X^T / n`` (float64) of each layer's inputs while ``model`` runs on ``calibration`` (batch, pos) ids.

    The inputs are collected with forward hooks (``register_forward_hook`` sees each call's input).
    """
    sums = {name: torch.zeros(layer.in_features, layer.in_features, dtype=torch.float64) for name, layer in layers.items()}
    counts = dict.fromkeys(layers, 0)

    def hook(name: str):
        def record(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()  # tokens d_in
            sums[name] += (x.T @ x).double()  # float32 products, summed across batches in float64
            counts[name] += x.shape[0]

        return record

    handles = [layer.register_forward_hook(hook(name)) for name, layer in layers.items()]
    try:
        was_training = model.training
        model.eval()
        for i in range(0, len(calibration), batch_size):
            model(calibration[i : i + batch_size])
        model.train(was_training)
    finally:
        for handle in handles:
            handle.remove()
    return {name: 2 * sums[name] / max(counts[name], 1) for name in layers}


@torch.no_grad()
def quantize_model(model: nn.Module, bits: int, group_size: int | None = None, method: str = "rtn",
                   calibration: Tensor | None = None, *, damp: float = 0.01) -> nn.Module:
    """A quantized copy of ``model`` (the original untouched).

    ``bits``: 32 (a plain copy), 16 (every parameter stored in float16) or 2..8 (every ``nn.Linear`` in the
    blocks becomes a :class:`QuantizedLinear` with zero-point codes per row, or per ``group_size`` columns).
    ``method="gptq"`` needs ``calibration`` token ids (batch, pos); the blocks are quantized in order, each one's
    Hessians collected with the blocks before it already quantized (as GPTQ's reference code does).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_bits(bits, (*range(2, 9), 16, 32))
    quantized = copy.deepcopy(model)
    if bits == 32:
        return quantized
    if bits == 16:
        return quantized.to(torch.float16)
    if method == "gptq" and (not isinstance(calibration, Tensor) or calibration.dim() != 2 or calibration.is_floating_point()):
        raise ValueError("method='gptq' needs calibration token ids, an integer tensor of shape (batch, pos)")
    if method == "gptq":
        calibration = calibration.long()
    for b, block in enumerate(quantized.blocks):
        layers = {f"blocks.{b}.{name}": m for name, m in block.named_modules() if isinstance(m, nn.Linear)}
        hessians = collect_hessians(quantized, layers, calibration) if method == "gptq" else {}
        for name, layer in layers.items():
            if group_size is not None:
                _units(layer.weight, "group", group_size)  # a clear error when it does not divide d_in
            if method == "gptq":
                found = gptq_quantize(layer.weight, hessians[name], bits, group_size, damp=damp,
                                      scale_dtype=torch.float16)
                new = QuantizedLinear.from_weight(layer.weight, layer.bias, bits=bits, group_size=group_size,
                                                  codes=found.codes, scale=found.scale, zero=found.zero)
            else:
                new = QuantizedLinear.from_weight(layer.weight, layer.bias, bits=bits, group_size=group_size)
            _set_module(quantized, name, new)
    return quantized


def model_nbytes(model: nn.Module) -> int:
    """Bytes actually stored: every parameter and buffer once (a tied weight counted once), at its dtype's size.

    >>> model_nbytes(nn.Linear(4, 2))  # 8 + 2 float32 numbers
    40
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = (tensor.untyped_storage().data_ptr(), tensor.numel())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


@torch.no_grad()
def window_losses(model: nn.Module, data, seq_len: int, batch_size: int = 64) -> Tensor:
    """Each held-out window's mean next-token loss (float64, ``data.eval_starts(seq_len)``'s windows, in order).

    ``exp(window_losses(...).mean())`` is ``tfedu.train.evaluate``'s perplexity. A float16 model runs on a float32
    copy of its stored values, so every row of a comparison differs in how its weights are stored, nothing else.
    """
    if any(p.dtype == torch.float16 for p in model.parameters()):
        model = copy.deepcopy(model).float()
    was_training = model.training
    model.eval()
    starts = data.eval_starts(seq_len)
    losses = []
    for i in range(0, len(starts), batch_size):
        x, y = data.windows(starts[i : i + batch_size], seq_len)
        logits = model(x.long())
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.long().flatten(), reduction="none")
        losses.append(loss.reshape(len(x), -1).mean(dim=1).double())
    model.train(was_training)
    return torch.cat(losses)


@torch.no_grad()
def perplexity(model: nn.Module, data, seq_len: int, max_batches: int | None = None, batch_size: int = 32) -> float:
    """exp(mean next-token loss) on ``data`` (``tfedu.train.evaluate``'s windows). A float16 model runs on a
    float32 copy of its stored values: every row of a comparison then differs in the weights' storage alone."""
    if any(p.dtype == torch.float16 for p in model.parameters()):
        model = copy.deepcopy(model).float()
    return math.exp(evaluate(model, data, seq_len, batch_size=batch_size, max_batches=max_batches))

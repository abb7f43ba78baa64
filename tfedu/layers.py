"""The per-position layers of a Transformer block: LayerNorm, RMSNorm and the feed-forward MLP.

Everything here acts on the last axis (``d_model``) and treats every other axis (``batch``,
``pos``, ...) alike: a position never sees another position. Mixing across positions is
attention's job (``tfedu.attention``); these layers rescale and transform what each position
holds.

- ``LayerNorm`` (Ba et al. 2016, eq. 4): centre, divide by the standard deviation, then a
  learned gain and bias. The original Transformer and GPT-2 use it.
- ``RMSNorm`` (Zhang & Sennrich 2019, eq. 4): only divide by the root mean square; no
  centring, no bias. Llama and most later models use it.
- ``MLP``: the position-wise feed-forward network (Vaswani et al. 2017, eq. 2),
  ``W_out(act(W_in x))``, with ReLU, GELU (Hendrycks & Gimpel 2016), GPT-2's tanh
  approximation of GELU, or SwiGLU (Shazeer 2020, eq. 6).

Built by hand in notebooks/07_transformer_block.ipynb. ``tfedu.model`` builds its blocks from
these classes, so their attribute names (``weight``, ``bias``, ``W_in``, ``W_gate``,
``W_out``) are part of the interface.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")


# ----------------------------------------------------------------------------- checks


def _check_d_model(d_model: object) -> None:
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model <= 0:
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")


def _check_eps(eps: object) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        # eps keeps the division finite when a position's vector is (nearly) constant/zero.
        raise ValueError(f"eps must be a positive number (it keeps the sqrt away from 0), got {eps!r}")


def _check_input(layer: str, x: object, d_model: int) -> None:
    expected = f"(..., d_model) with d_model = {d_model}"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer} expects a torch.Tensor of shape {expected}, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{layer} expects a floating-point tensor, got dtype {x.dtype}; "
            "token ids must go through the embedding first (or call .float())"
        )
    if x.dim() == 0 or x.shape[-1] != d_model:
        raise ValueError(f"{layer} expects shape {expected}, got shape {tuple(x.shape)} (last dim must be d_model)")


# ----------------------------------------------------------------------------- norms


class LayerNorm(nn.Module):
    """Layer normalisation over the last axis, by hand (Ba et al. 2016).

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, with the mean and the *biased*
    variance (divide by d_model, not d_model - 1) taken over ``d_model``. Same maths and the
    same parameter names as ``torch.nn.LayerNorm(d_model)``, so its state dict loads here.
    ``bias=False`` drops the additive term (as GPT configs with ``bias=False`` do).

    >>> ln = LayerNorm(4)
    >>> ln(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    tensor([[-1.3416, -0.4472,  0.4472,  1.3416]], grad_fn=<AddBackward0>)
    >>> sorted(name for name, _ in ln.named_parameters())
    ['bias', 'weight']

    Built by hand in notebooks/07_transformer_block.ipynb.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        _check_d_model(d_model)
        _check_eps(eps)
        self.d_model = d_model
        self.eps = float(eps)
        # Gain starts at 1 and bias at 0: at initialisation the layer only normalises.
        self.weight = nn.Parameter(torch.ones(d_model))
        if bias:
            self.bias = nn.Parameter(torch.zeros(d_model))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        _check_input("LayerNorm", x, self.d_model)
        mean = x.mean(dim=-1, keepdim=True)  # ... 1
        # Biased variance (1/d_model), as in Ba et al. 2016 eq. 4 and torch.nn.LayerNorm.
        var = (x - mean).pow(2).mean(dim=-1, keepdim=True)  # ... 1
        # eps inside the sqrt: a constant vector gives 0 / sqrt(eps) = 0, not 0 / 0.
        x_hat = (x - mean) / torch.sqrt(var + self.eps)  # ... d_model
        out = x_hat * self.weight
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last axis, by hand (Zhang & Sennrich 2019).

    ``y = x / sqrt(mean(x**2) + eps) * weight``: LayerNorm without the centring and without
    a bias. Like Hugging Face's ``LlamaRMSNorm`` it computes in (at least) float32 and casts
    back to the input's dtype before the gain, so bfloat16 inputs give the same numbers as Llama.
    Equal to ``torch.nn.RMSNorm(d_model, eps=eps)``.

    >>> rms = RMSNorm(2)
    >>> rms(torch.tensor([[3.0, 4.0]]))  # rms = sqrt((9 + 16) / 2) = 3.5355
    tensor([[0.8485, 1.1314]], grad_fn=<MulBackward0>)

    Built by hand in notebooks/07_transformer_block.ipynb.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        _check_d_model(d_model)
        _check_eps(eps)
        self.d_model = d_model
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        _check_input("RMSNorm", x, self.d_model)
        in_dtype = x.dtype
        # Squares of bfloat16/float16 values lose precision fast; do the statistics in float32
        # (float64 stays float64), as LlamaRMSNorm does.
        x32 = x.to(torch.promote_types(in_dtype, torch.float32))
        mean_sq = x32.pow(2).mean(dim=-1, keepdim=True)  # ... 1
        x_hat = x32 * torch.rsqrt(mean_sq + self.eps)  # ... d_model
        # Cast back *before* the gain: the same order as LlamaRMSNorm, so results match bit for bit.
        return self.weight * x_hat.to(in_dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}"


# ----------------------------------------------------------------------------- MLP


def swiglu_hidden(d_model: int, multiple_of: int = 1) -> int:
    """Hidden width of a SwiGLU MLP with (about) the parameters of a 4·d_model MLP.

    A plain MLP has 2 matrices of d_model x 4·d_model: 8·d_model² weights. SwiGLU has three
    (W_gate, W_in, W_out), so 3·d_model·h = 8·d_model² gives h = 8·d_model/3 (Shazeer 2020,
    sec. 2). Exact rule, Llama's: ``h = floor(8 * d_model / 3)``, then rounded UP to the next
    multiple of ``multiple_of`` (hardware likes widths that are multiples of 64 or 256).
    Llama uses ``multiple_of=256``: for Llama-7B, d_model 4096 gives floor(32768 / 3) = 10922,
    rounded up to 43 · 256 = 11008.

    >>> swiglu_hidden(4096, multiple_of=256)  # Llama-7B
    11008
    >>> swiglu_hidden(768)  # 8 * 768 / 3 = 2048 exactly
    2048
    >>> swiglu_hidden(64, multiple_of=32)  # floor(170.67) = 170 -> 192
    192

    Built by hand in notebooks/07_transformer_block.ipynb.
    """
    _check_d_model(d_model)
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of <= 0:
        raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
    hidden = (8 * d_model) // 3  # integer floor: no float rounding for big d_model
    return multiple_of * math.ceil(hidden / multiple_of)


class MLP(nn.Module):
    """The position-wise feed-forward network: ``W_out(act(W_in x))`` (Vaswani et al. 2017, eq. 2).

    ``activation`` is one of ``"relu"`` (the original Transformer), ``"gelu"`` (exact, with erf;
    BERT), ``"gelu_tanh"`` (GPT-2's tanh approximation, HF's ``gelu_new``) or ``"swiglu"``
    (Shazeer 2020, Llama): ``W_out(silu(W_gate x) * W_in x)``, a third matrix ``W_gate``
    whose SiLU output gates ``W_in x`` elementwise. ``d_mlp`` defaults to 4·d_model, or to
    ``swiglu_hidden(d_model)`` for SwiGLU so that both have about 8·d_model² weights.

    >>> mlp = MLP(8)
    >>> mlp.W_in, mlp.W_out
    (Linear(in_features=8, out_features=32, bias=True), Linear(in_features=32, out_features=8, bias=True))
    >>> mlp(torch.zeros(2, 5, 8)).shape  # batch pos d_model in, the same out
    torch.Size([2, 5, 8])
    >>> MLP(12, activation="swiglu", bias=False).W_gate  # 8 * 12 / 3 = 32
    Linear(in_features=12, out_features=32, bias=False)

    Built by hand in notebooks/07_transformer_block.ipynb.
    """

    def __init__(self, d_model: int, d_mlp: int | None = None, *, activation: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        _check_d_model(d_model)
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid ones are {', '.join(map(repr, ACTIVATIONS))}")
        if d_mlp is None:
            d_mlp = swiglu_hidden(d_model) if activation == "swiglu" else 4 * d_model
        if isinstance(d_mlp, bool) or not isinstance(d_mlp, int) or d_mlp <= 0:
            raise ValueError(f"d_mlp must be a positive int (or None for the default), got {d_mlp!r}")
        self.d_model = d_model
        self.d_mlp = d_mlp
        self.activation = activation
        self.W_in = nn.Linear(d_model, d_mlp, bias=bias)
        if activation == "swiglu":
            self.W_gate = nn.Linear(d_model, d_mlp, bias=bias)
        self.W_out = nn.Linear(d_mlp, d_model, bias=bias)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        _check_input("MLP", x, self.d_model)
        pre = self.W_in(x)  # ... d_mlp
        if self.activation == "swiglu":
            # Shazeer 2020 eq. 6: FFN_SwiGLU(x) = (Swish(x W) ⊗ x V) W_2, Swish_1 = SiLU.
            hidden = F.silu(self.W_gate(x)) * pre
        elif self.activation == "relu":
            hidden = F.relu(pre)
        elif self.activation == "gelu":
            hidden = F.gelu(pre)  # x Φ(x), exact with erf (Hendrycks & Gimpel 2016)
        else:
            # GPT-2's 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), HF's "gelu_new".
            hidden = F.gelu(pre, approximate="tanh")
        return self.W_out(hidden)  # ... d_model

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_mlp={self.d_mlp}, activation={self.activation!r}"

"""The MLP's nonlinearities, shared by ``tfedu.layers.MLP``, the experts of ``tfedu.moe.MoE`` and ``ModelConfig``.

ReLU; GELU (Hendrycks & Gimpel 2016) exact and in GPT-2's tanh approximation; SwiGLU (Shazeer 2020,
eq. 6), whose extra gate matrix changes the hidden width that keeps a 4·d_model MLP's parameter count
(``swiglu_hidden``). Built by hand in notebooks/07_transformer_block.ipynb.
"""

from __future__ import annotations

import math

import torch  # noqa: F401  (the doctests use it)
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")
GATED = ("swiglu", "geglu")  # the gated ones: a third matrix W_gate (Shazeer 2020)


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

    Built by hand in notebooks/07_transformer_block.ipynb; ``ModelConfig`` sizes a SwiGLU MLP with it.
    """
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model <= 0:
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of <= 0:
        raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
    hidden = (8 * d_model) // 3  # integer floor: no float rounding for big d_model
    return multiple_of * math.ceil(hidden / multiple_of)


def activate(pre: Tensor, activation: str, gate: Tensor | None = None) -> Tensor:
    """The MLP's nonlinearity on ``pre = W_in x``; SwiGLU also takes ``gate = W_gate x``.

    Shared by ``tfedu.layers.MLP`` and the experts of ``tfedu.moe.MoE``.

    >>> activate(torch.tensor([-1.0, 2.0]), "relu").tolist()
    [0.0, 2.0]
    """
    if activation == "swiglu":
        # Shazeer 2020 eq. 6: FFN_SwiGLU(x) = (Swish(x W) ⊗ x V) W_2, Swish_1 = SiLU.
        return F.silu(gate) * pre
    if activation == "geglu":
        # Shazeer 2020 eq. 5 with GELU's tanh approximation, as Gemma (HF's gelu_pytorch_tanh) uses it.
        return F.gelu(gate, approximate="tanh") * pre
    if activation == "relu":
        return F.relu(pre)
    if activation == "gelu":
        return F.gelu(pre)  # x Φ(x), exact with erf (Hendrycks & Gimpel 2016)
    # GPT-2's 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), HF's "gelu_new".
    return F.gelu(pre, approximate="tanh")

"""Convolutions as sequence models: a stack of causal 1-D convolutions and its receptive field.

A causal convolution at position t reads only positions t-k+1 .. t (left padding, no future).
Stacking L layers of kernel size k lets the last output see 1 + L(k-1) positions; with the
dilation multiplied by k at every layer (WaveNet, van den Oord et al. 2016; ByteNet, Kalchbrenner
et al. 2016) it sees k^L, so log_k(n) layers cover n positions: Vaswani et al. (2017), Table 1.
Unlike a recurrence, every position of a layer is computed at once.

Built by hand in notebooks/03_rnns_to_attention.ipynb.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn


def receptive_field(kernel_size: int, n_layers: int, dilated: bool) -> int:
    """How many input positions the last output of a causal stack can see.

    Plain: 1 + n_layers * (kernel_size - 1). Dilated (dilation kernel_size**layer): kernel_size**n_layers.

    >>> receptive_field(3, 4, dilated=False), receptive_field(3, 4, dilated=True)
    (9, 81)
    """
    if not all(isinstance(v, int) and v >= 1 for v in (kernel_size, n_layers)):
        raise ValueError(f"kernel_size and n_layers must be positive ints, got {kernel_size!r}, {n_layers!r}")
    if dilated:
        return kernel_size**n_layers
    return 1 + n_layers * (kernel_size - 1)


class CausalConvStack(nn.Module):
    """n_layers causal Conv1d layers of width d_model, tanh between them, optionally dilated.

    >>> stack = CausalConvStack(d_model=4, kernel_size=2, n_layers=3, dilated=True)
    >>> stack(torch.randn(1, 10, 4)).shape
    torch.Size([1, 10, 4])
    """

    def __init__(self, d_model: int, kernel_size: int, n_layers: int, dilated: bool = True) -> None:
        super().__init__()
        receptive_field(kernel_size, n_layers, dilated)  # validates the sizes
        self.kernel_size = kernel_size
        self.dilations = [kernel_size**layer if dilated else 1 for layer in range(n_layers)]
        self.convs = nn.ModuleList(nn.Conv1d(d_model, d_model, kernel_size, dilation=d) for d in self.dilations)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        h = x.transpose(1, 2)  # batch d_model pos: Conv1d wants channels first
        for conv, dilation in zip(self.convs, self.dilations):
            h = torch.tanh(conv(F.pad(h, ((self.kernel_size - 1) * dilation, 0))))  # pad the past only
        return h.transpose(1, 2)


def measured_receptive_field(model: nn.Module, n_pos: int, d_model: int) -> int:
    """Count the input positions with a non-zero gradient on the model's last output.

    >>> torch.manual_seed(0) and None
    >>> measured_receptive_field(CausalConvStack(4, 2, 3, dilated=False), n_pos=16, d_model=4)
    4
    """
    x = torch.randn(1, n_pos, d_model, requires_grad=True)
    model(x)[0, -1].sum().backward()
    return int((x.grad[0].abs().sum(dim=-1) > 0).sum())

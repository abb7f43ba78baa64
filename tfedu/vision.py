"""Images as sequences of patches: the Vision Transformer (Dosovitskiy et al. 2021) and a small CNN.

An image of ``height x width`` pixels and ``channels`` channels is cut into non-overlapping
``P x P`` patches; each patch, flattened, is one token. A linear map of the flattened patch and a
``Conv2d`` with kernel = stride = P are the same computation (``patchify`` + ``nn.Linear`` vs
``PatchEmbedding``), which is why every ViT implementation uses the convolution.

The ViT's encoder blocks are ``tfedu.layers.Block`` (pre-norm, bidirectional: no causal mask), so
the model is the course GPT's body with patches in place of tokens, a class token in front and a
classification head on it.

Built by hand in notebooks/11_beyond_text.ipynb.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from tfedu.config import ModelConfig
from tfedu.layers import Block, LayerNorm

__all__ = [
    "LinearPatchEmbedding",
    "PatchEmbedding",
    "ViTConfig",
    "ViT",
    "SmallCNN",
    "Digits",
    "accuracy",
    "attention_distance",
    "data_efficiency",
    "fit_classifier",
    "load_digits",
    "patch_linear",
    "patchify",
    "stratified_subset",
    "vit_from_hf",
]


def _pair(value: object, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in pair)):
        raise ValueError(f"{name} must be a positive int or a pair of them (height, width), got {value!r}")
    return int(pair[0]), int(pair[1])


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _check_images(images: object, patch: tuple[int, int], channels: int | None = None) -> None:
    if not isinstance(images, Tensor) or images.dim() != 4 or not images.is_floating_point():
        got = f"{type(images).__name__} {getattr(images, 'dtype', '')} {tuple(getattr(images, 'shape', ()))}"
        raise ValueError(f"expected a float tensor of images (batch, channels, height, width), got {got}")
    if channels is not None and images.shape[1] != channels:
        raise ValueError(f"expected {channels} channel(s) in dimension 1 (channels first), got shape "
                         f"{tuple(images.shape)}; channels-last images need .permute(0, 3, 1, 2)")
    height, width = images.shape[-2:]
    if height % patch[0] or width % patch[1]:
        raise ValueError(f"a {height}x{width} image does not split into {patch[0]}x{patch[1]} patches: "
                         "each side must be a multiple of the patch's")


def patchify(
    images: Float[Tensor, "batch channels height width"], patch_size: int | tuple[int, int]
) -> Float[Tensor, "batch n_patches patch_dim"]:
    """Cut images into non-overlapping patches, one flattened patch per row.

    Patches come row by row (left to right, then top to bottom); each is flattened channel first,
    then its rows, then its columns: ``patch_dim = channels * P_h * P_w``, the layout of a
    ``Conv2d`` weight ``(d_model, channels, P_h, P_w)``. ``F.unfold`` with stride = kernel does the cut.

    >>> x = torch.arange(16.).reshape(1, 1, 4, 4)
    >>> patchify(x, 2)[0]  # four 2x2 patches: top-left, top-right, bottom-left, bottom-right
    tensor([[ 0.,  1.,  4.,  5.],
            [ 2.,  3.,  6.,  7.],
            [ 8.,  9., 12., 13.],
            [10., 11., 14., 15.]])

    Built by hand in notebooks/11_beyond_text.ipynb.
    """
    patch = _pair(patch_size, "patch_size")
    _check_images(images, patch)
    return F.unfold(images, kernel_size=patch, stride=patch).transpose(1, 2)  # batch n_patches patch_dim


class PatchEmbedding(nn.Module):
    """Patches to ``d_model``-wide tokens with a ``Conv2d`` whose kernel and stride are the patch size.

    Each output pixel of the convolution sees exactly one patch, and sees all of it: it is
    ``W · flatten(patch) + b``, one linear map shared by every patch (``patch_linear`` builds that
    ``nn.Linear``; the two agree to rounding, tested).

    >>> embed = PatchEmbedding(in_channels=1, d_model=16, patch_size=2)
    >>> embed(torch.randn(3, 1, 8, 8)).shape  # (8 / 2)^2 = 16 patches
    torch.Size([3, 16, 16])

    Built by hand in notebooks/11_beyond_text.ipynb.
    """

    def __init__(self, in_channels: int, d_model: int, patch_size: int | tuple[int, int]) -> None:
        super().__init__()
        self.patch_size = _pair(patch_size, "patch_size")
        self.proj = nn.Conv2d(in_channels, d_model, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, images: Float[Tensor, "batch channels height width"]) -> Float[Tensor, "batch n_patches d_model"]:
        _check_images(images, self.patch_size, self.proj.in_channels)
        grid = self.proj(images)  # batch d_model rows cols
        return grid.flatten(2).transpose(1, 2)  # batch n_patches d_model (row by row, like patchify)


def patch_linear(embed: PatchEmbedding) -> nn.Linear:
    """The ``nn.Linear`` on ``patchify``'s rows that computes what ``embed``'s convolution computes.

    >>> embed = PatchEmbedding(1, 4, 2)
    >>> x = torch.randn(2, 1, 4, 4)
    >>> torch.allclose(patch_linear(embed)(patchify(x, 2)), embed(x), atol=1e-6)
    True
    """
    conv = embed.proj
    linear = nn.Linear(conv.weight[0].numel(), conv.out_channels, bias=conv.bias is not None,
                       device=conv.weight.device, dtype=conv.weight.dtype)  # (float32 first would round float64)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.reshape(conv.out_channels, -1))  # (channels, P_h, P_w) flattened
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    return linear


class LinearPatchEmbedding(nn.Module):
    """``PatchEmbedding`` computed the other way: ``patchify`` (or any function with its signature), then ``nn.Linear``.

    ``LinearPatchEmbedding.from_conv(vit.patch_embed, patchify=my_patchify)`` swaps a ViT's
    convolution for this with the same weights, so the ViT then cuts its images with ``my_patchify``
    (called with an int P for square patches, as exercise 11.1's takes it, else with (P_h, P_w)).

    >>> conv = PatchEmbedding(1, 8, 2)
    >>> x = torch.randn(2, 1, 4, 4)
    >>> torch.allclose(LinearPatchEmbedding.from_conv(conv)(x), conv(x), atol=1e-6)
    True
    """

    def __init__(self, in_channels: int, d_model: int, patch_size: int | tuple[int, int], *,
                 patchify: Callable[[Tensor, tuple[int, int]], Tensor] = patchify) -> None:
        super().__init__()
        self.patch_size = _pair(patch_size, "patch_size")
        self.in_channels = in_channels
        self.patchify = patchify
        self.proj = nn.Linear(in_channels * self.patch_size[0] * self.patch_size[1], d_model)

    @classmethod
    def from_conv(cls, embed: PatchEmbedding, *, patchify: Callable[[Tensor, tuple[int, int]], Tensor] = patchify
                  ) -> "LinearPatchEmbedding":
        out = cls(embed.proj.in_channels, embed.proj.out_channels, embed.patch_size, patchify=patchify)
        out.proj = patch_linear(embed)
        return out

    def forward(self, images: Float[Tensor, "batch channels height width"]) -> Float[Tensor, "batch n_patches d_model"]:
        _check_images(images, self.patch_size, self.in_channels)
        ph, pw = self.patch_size
        patches = self.patchify(images, ph if ph == pw else self.patch_size)  # batch n_patches patch_dim
        expected = (images.shape[0], (images.shape[2] // self.patch_size[0]) * (images.shape[3] // self.patch_size[1]),
                    self.proj.in_features)
        if not isinstance(patches, Tensor) or tuple(patches.shape) != expected:
            raise ValueError(f"patchify returned {tuple(getattr(patches, 'shape', ()))}, expected (batch, n_patches, "
                             f"patch_dim) = {expected}")
        return self.proj(patches)  # batch n_patches d_model


# ----------------------------------------------------------------------------- the Vision Transformer


@dataclass(frozen=True)
class ViTConfig:
    """The shape of a ``ViT``. Defaults: a small model for scikit-learn's 8x8 digits."""

    image_size: tuple[int, int] | int = 8  # height, width of the input (an int: square)
    patch_size: tuple[int, int] | int = 2  # height, width of one patch; must divide the image's
    in_channels: int = 1  # 1 grey, 3 RGB
    n_classes: int = 10  # outputs of the classification head
    d_model: int = 64  # width of the residual stream
    n_layers: int = 4  # encoder blocks
    n_heads: int = 4  # attention heads per block
    d_mlp: int | None = None  # MLP hidden width; None = 4 d_model
    dropout: float = 0.0  # on the embeddings, attention pattern and block outputs
    norm_eps: float = 1e-5  # LayerNorm's epsilon (Hugging Face's ViT: 1e-12)
    attention: str = "sdpa"  # sdpa: torch's fused kernel (faster) | manual: by hand, the pattern passes hook_pattern
    init_std: float = 0.02  # std of the truncated-normal init (the ViT paper's and timm's)
    block: ModelConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        image, patch = _pair(self.image_size, "image_size"), _pair(self.patch_size, "patch_size")
        if image[0] % patch[0] or image[1] % patch[1]:
            raise ValueError(f"patch_size {patch} must divide image_size {image}")
        object.__setattr__(self, "image_size", image)
        object.__setattr__(self, "patch_size", patch)
        block = ModelConfig(d_vocab=1, n_ctx=self.n_patches + 1, d_model=self.d_model, n_layers=self.n_layers,
                            n_heads=self.n_heads, d_mlp=self.d_mlp, positional="none", activation="gelu",
                            norm_eps=self.norm_eps, dropout=self.dropout, attention=self.attention)
        object.__setattr__(self, "block", block)

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row."""
        return self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1]

    @property
    def n_patches(self) -> int:
        rows, cols = self.grid
        return rows * cols


class ViT(nn.Module):
    """A Vision Transformer: patches, a class token, learned positions, pre-norm blocks, a head.

    Dosovitskiy et al. 2021, eq. 1-4::

        z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos
        z_l = Block(z_{l-1})                  (pre-norm: x + MSA(LN(x)), x + MLP(LN(x)))
        y   = head(LN(z_L^0))                 (the class token's final state)

    The blocks are ``tfedu.layers.Block`` without a causal mask: every patch sees every patch.

    >>> vit = ViT(ViTConfig(d_model=32, n_layers=2, n_heads=2))
    >>> vit(torch.randn(5, 1, 8, 8)).shape
    torch.Size([5, 10])

    Built by hand in notebooks/11_beyond_text.ipynb.
    """

    def __init__(self, cfg: ViTConfig = ViTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbedding(cfg.in_channels, cfg.d_model, cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.n_patches + 1, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.block) for _ in range(cfg.n_layers))
        self.ln_final = LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated-normal weights (std ``cfg.init_std``), zero biases, LayerNorms at identity."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(module.weight, std=self.cfg.init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.trunc_normal_(self.pos_embed, std=self.cfg.init_std)
        nn.init.trunc_normal_(self.cls_token, std=self.cfg.init_std)

    def embed(self, images: Float[Tensor, "batch channels height width"]) -> Float[Tensor, "batch pos d_model"]:
        """z_0: the class token followed by the patch embeddings, positions added (pos = n_patches + 1)."""
        patches = self.patch_embed(images)  # batch n_patches d_model
        cls = self.cls_token.expand(patches.shape[0], -1, -1)  # batch 1 d_model
        return self.drop(torch.cat([cls, patches], dim=1) + self.pos_embed)  # batch pos d_model

    def features(self, images: Float[Tensor, "batch channels height width"]) -> Float[Tensor, "batch pos d_model"]:
        """The final residual stream after the last LayerNorm; row 0 is the class token."""
        resid = self.embed(images)
        for block in self.blocks:
            resid = block(resid)
        return self.ln_final(resid)

    def forward(self, images: Float[Tensor, "batch channels height width"]) -> Float[Tensor, "batch n_classes"]:
        return self.head(self.features(images)[:, 0])  # the class token's state


def vit_from_hf(hf_model: nn.Module) -> ViT:
    """A ``ViT`` computing what a ``transformers`` ``ViTForImageClassification`` computes, weights copied.

    Hugging Face's ViT is the same architecture (pre-norm blocks, exact GELU, class-token head); only
    the names differ. Its ``layer_norm_eps`` (default 1e-12) is carried over.
    """
    hc = hf_model.config
    if getattr(hc, "hidden_act", "gelu") != "gelu" or not getattr(hc, "qkv_bias", True):
        raise ValueError("only ViTs with hidden_act='gelu' and qkv_bias=True map onto tfedu's ViT")
    cfg = ViTConfig(image_size=hc.image_size, patch_size=hc.patch_size, in_channels=hc.num_channels,
                    n_classes=hc.num_labels, d_model=hc.hidden_size, n_layers=hc.num_hidden_layers,
                    n_heads=hc.num_attention_heads, d_mlp=hc.intermediate_size, norm_eps=hc.layer_norm_eps)
    sd = hf_model.state_dict()
    out = {
        "patch_embed.proj.weight": sd["vit.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["vit.embeddings.patch_embeddings.projection.bias"],
        "cls_token": sd["vit.embeddings.cls_token"],
        "pos_embed": sd["vit.embeddings.position_embeddings"],
        "ln_final.weight": sd["vit.layernorm.weight"],
        "ln_final.bias": sd["vit.layernorm.bias"],
        "head.weight": sd["classifier.weight"],
        "head.bias": sd["classifier.bias"],
    }
    # transformers 5 renamed the layers (vit.layers.i.attention.q_proj, mlp.fc1); 4.x used the BERT names.
    names = {"ln1": ("layernorm_before", "layernorm_before"), "ln2": ("layernorm_after", "layernorm_after"),
             "attn.W_Q": ("attention.q_proj", "attention.attention.query"),
             "attn.W_K": ("attention.k_proj", "attention.attention.key"),
             "attn.W_V": ("attention.v_proj", "attention.attention.value"),
             "attn.W_O": ("attention.o_proj", "attention.output.dense"),
             "mlp.W_in": ("mlp.fc1", "intermediate.dense"), "mlp.W_out": ("mlp.fc2", "output.dense")}
    new_names = "vit.layers.0.attention.q_proj.weight" in sd
    for i in range(cfg.n_layers):
        for ours, (v5, v4) in names.items():
            theirs = f"vit.layers.{i}.{v5}" if new_names else f"vit.encoder.layer.{i}.{v4}"
            for kind in ("weight", "bias"):  # nn.Linear on both sides: no transpose
                out[f"blocks.{i}.{ours}.{kind}"] = sd[f"{theirs}.{kind}"]
    model = ViT(cfg)
    model.load_state_dict(out)
    return model.to(next(hf_model.parameters()).dtype)


class SmallCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and a linear head: the baseline with locality built in.

    A convolution assumes that nearby pixels belong together and that a pattern means the same
    wherever it appears (translation equivariance); a ViT has to learn both from data.

    >>> SmallCNN()(torch.randn(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    """

    def __init__(self, in_channels: int = 1, n_classes: int = 10, width: int = 16, image_size: int = 8) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * (image_size // 2) ** 2, n_classes)

    def forward(self, images: Float[Tensor, "batch channels height width"]) -> Float[Tensor, "batch n_classes"]:
        _check_images(images, (1, 1), self.in_channels)
        return self.head(self.features(images).flatten(1))


# ----------------------------------------------------------------------------- data, training, probing


@dataclass
class Digits:
    """scikit-learn's 8x8 handwritten digits as tensors, split once into train and test."""

    train_images: Float[Tensor, "n_train 1 8 8"]
    train_labels: Int[Tensor, "n_train"]
    test_images: Float[Tensor, "n_test 1 8 8"]
    test_labels: Int[Tensor, "n_test"]


def load_digits(*, n_test: int = 497, seed: int = 0) -> Digits:
    """The 1,797 digits (ships with scikit-learn, no download), pixels scaled to [0, 1], split by ``seed``.

    The test set is stratified: ``n_test`` images, in the classes' proportions (to within one).

    >>> d = load_digits()
    >>> d.train_images.shape, d.test_images.shape
    (torch.Size([1300, 1, 8, 8]), torch.Size([497, 1, 8, 8]))
    """
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    labels = torch.tensor(bunch.target, dtype=torch.long)
    train, test = train_test_split(torch.arange(len(labels)).numpy(), test_size=n_test, random_state=seed,
                                   stratify=labels.numpy())
    train, test = torch.as_tensor(train), torch.as_tensor(test)
    return Digits(images[train], labels[train], images[test], labels[test])


def _device_of(model: nn.Module, x: Tensor) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else x.device


def fit_classifier(
    model: nn.Module, x: Float[Tensor, "n *features"], y: Int[Tensor, "n"], *, steps: int, batch_size: int,
    lr: int | float, seed: int, weight_decay: int | float = 0.0,
) -> list[float]:
    """Train ``model`` (inputs -> logits) with AdamW on cross-entropy; returns the loss of each step.

    Batches are drawn by shuffling the examples each epoch with a private ``torch.Generator``
    seeded by ``seed``, so the same model, data and seed give the same run. Each batch is moved to
    the model's device, so the data can stay on the CPU while a GPU trains. The model is put in
    training mode for the loop and left in eval mode. (Seed the model's *initial weights* yourself,
    e.g. ``torch.manual_seed`` before building it.)

    >>> _ = torch.manual_seed(0)
    >>> model = nn.Linear(2, 2)
    >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0]]); y = torch.tensor([0, 1])
    >>> losses = fit_classifier(model, x, y, steps=50, batch_size=2, lr=0.1, seed=0)
    >>> losses[-1] < losses[0], accuracy(model, x, y)
    (True, 1.0)

    Used in notebooks/11_beyond_text.ipynb for the CNN, the ViT and the audio models.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or y.dim() != 1 or len(x) != len(y):
        raise ValueError("x and y must be tensors with the same first axis: x (n, ...), y (n,) of class indices")
    if y.is_floating_point():
        raise ValueError(f"y must hold integer class indices, got dtype {y.dtype}")
    _positive_int("steps", steps)
    _positive_int("batch_size", batch_size)
    _positive_number("lr", lr)
    device = _device_of(model, x)  # batches go to the model's device (a GPU), the data set can stay on the CPU
    gen = torch.Generator().manual_seed(seed)
    # foreach: one batched update for all parameters (a third faster for small models on the CPU).
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)
    model.train()
    losses, order = [], torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if len(order) < min(batch_size, len(x)):
            order = torch.randperm(len(x), generator=gen)  # a new epoch
        idx, order = order[:batch_size], order[batch_size:]
        loss = F.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, x: Float[Tensor, "n *features"], y: Int[Tensor, "n"], *, batch_size: int = 256) -> float:
    """The fraction of ``x`` whose argmax logit is ``y``, in eval mode (the model's mode is put back after).

    >>> accuracy(nn.Identity(), torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.tensor([0, 0]))
    0.5

    Used in notebooks/11_beyond_text.ipynb for the CNN, the ViT and the audio models.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or y.dim() != 1 or len(x) != len(y):
        raise ValueError("x and y must be tensors with the same first axis: x (n, ...), y (n,) of class indices")
    was_training = model.training
    model.eval()
    device = _device_of(model, x)
    correct = sum(int((model(x[i:i + batch_size].to(device)).argmax(dim=-1) == y[i:i + batch_size].to(device)).sum())
                  for i in range(0, len(x), batch_size))
    model.train(was_training)
    return correct / max(len(x), 1)


@torch.no_grad()
def attention_distance(model: ViT, images: Float[Tensor, "batch channels height width"]) -> Float[Tensor, "n_layers n_heads"]:
    """Each head's mean attention distance in pixels, over patch queries and ``images``.

    Dosovitskiy et al. 2021, Figure 7 (right): the distance in the image between a query patch and
    each key patch (their centres, in pixels), weighted by the attention. The class token is left
    out on both sides and each query's weights on the patches are renormalised to sum to one. Low
    means the head looks at neighbours, like a convolution; high means it mixes the whole image.

    A ViT trained with the fused kernel (``attention="sdpa"``) is probed with the by-hand one, which
    forms the pattern: the blocks are switched to ``"manual"`` for this call and back after it.
    """
    rows, cols = model.cfg.grid
    ph, pw = model.cfg.patch_size
    r, c = torch.meshgrid(torch.arange(rows) * ph, torch.arange(cols) * pw, indexing="ij")
    centres = torch.stack([r.flatten(), c.flatten()], dim=-1).float()  # n_patches 2 (pixels)
    dist = torch.cdist(centres, centres)  # query_pos key_pos

    patterns = []
    handles = [block.attn.hook_pattern.register_forward_hook(lambda _m, _i, out: patterns.append(out))
               for block in model.blocks]
    was_training, impls = model.training, [block.attn.impl for block in model.blocks]
    try:
        model.eval()
        for block in model.blocks:
            block.attn.impl = "manual"
        model(images)
    finally:
        model.train(was_training)
        for block, impl, handle in zip(model.blocks, impls, handles):
            block.attn.impl = impl
            handle.remove()
    out = []
    for pattern in patterns:  # batch n_heads pos pos
        on_patches = pattern[:, :, 1:, 1:]  # the class token left out
        on_patches = on_patches / on_patches.sum(-1, keepdim=True)
        out.append((on_patches * dist.to(pattern)).sum(-1).mean(dim=(0, 2)))  # n_heads
    return torch.stack(out)


def stratified_subset(labels: Int[Tensor, "n"], size: int, *, seed: int = 0) -> Int[Tensor, "size"]:
    """Indices of ``size`` examples drawn by ``seed`` with the classes in their proportions (to within one).

    >>> labels = torch.arange(10).repeat(10)
    >>> torch.bincount(labels[stratified_subset(labels, 30)]).tolist()
    [3, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    """
    from sklearn.model_selection import train_test_split

    n_classes = int(labels.max()) + 1
    if not n_classes <= size <= len(labels):
        raise ValueError(f"size must be between the number of classes ({n_classes}) and {len(labels)}, got {size}")
    if size == len(labels):
        return torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    chosen, _ = train_test_split(torch.arange(len(labels)).numpy(), train_size=size, random_state=seed,
                                 stratify=labels.numpy())
    return torch.as_tensor(chosen)


def data_efficiency(
    digits: Digits,
    sizes: list[int],
    models: dict[str, object],
    *,
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Test accuracy of each model trained on the first ``size`` training images, for each size.

    ``models`` maps a name to a function that builds a fresh model (called with the torch seed set,
    so every size starts from the same weights). Every run takes the same number of ``steps``: a
    small set is seen many more times, which is what a practitioner would do with little data.

    >>> digits = load_digits()
    >>> acc = data_efficiency(digits, [20], {"cnn": SmallCNN}, steps=5)
    >>> list(acc), len(acc["cnn"])
    (['cnn'], 1)
    """
    out: dict[str, list[float]] = {name: [] for name in models}
    for size in sizes:
        chosen = stratified_subset(digits.train_labels, size, seed=seed)
        for name, build in models.items():
            torch.manual_seed(seed)
            model = build()
            fit_classifier(model, digits.train_images[chosen], digits.train_labels[chosen], steps=steps,
                           batch_size=min(64, size), lr=lr, seed=seed)
            out[name].append(accuracy(model, digits.test_images, digits.test_labels))
    return out

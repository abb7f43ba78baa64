"""Parameter-efficient fine-tuning: LoRA, bottleneck adapters, prefix tuning and prompt tuning.

Full fine-tuning updates every weight of a pretrained model. The methods here freeze the model and
train a few new parameters instead (deck 000, "Parameter Efficient Tuning"):

- ``LoRALinear`` / ``apply_lora`` (Hu et al. 2021, eq. 3): ``h = W_0 x + (alpha / r) B A x`` beside a
  frozen ``nn.Linear``. ``A`` (r x d_in) starts like Hugging Face peft's (Kaiming-uniform), ``B``
  (d_out x r) at zero, so training starts exactly at the base model; no activation between A and B, so
  ``merge`` folds ``(alpha / r) B @ A`` into ``W_0`` and inference costs nothing extra. By default on
  ``W_Q`` and ``W_V`` of every attention layer (the paper's sec. 7.1; deck: "By default, only W_Q and
  W_V have the AB pairs").
- ``Adapter`` / ``apply_adapters`` (Houlsby et al. 2019, fig. 2): ``y + up(act(down(y)))`` after each
  feed-forward sub-layer, ``up`` zero-initialised: again exactly the base model at step 0.
- ``apply_prefix_tuning`` (Li & Liang 2021): learned keys and values placed before the sequence's in
  every self-attention layer (``tfedu.layers.Attention.prefix``), optionally produced by a small MLP
  during training (their sec. 4.3 reparameterisation) and then folded into plain tensors.
- ``PromptTuned`` (Lester et al. 2021): n learned input vectors in front of the token embeddings.
- ``trainable_fraction``: trainable parameters, all parameters and the fraction, for any of them.
- ``restyle`` and ``code_documents``: the notebook's new style (the standard library's Python source).

>>> from tfedu.config import preset
>>> from tfedu.model import GPT
>>> _ = torch.manual_seed(0); model = GPT(preset("tiny"))
>>> lora = apply_lora(model, r=4, alpha=8)
>>> sorted(lora)[:2]
['blocks.0.attn.W_Q', 'blocks.0.attn.W_V']
>>> count = trainable_fraction(model)
>>> count.trainable == 2 * 2 * 4 * (64 + 64)  # 2 layers x (W_Q, W_V) x r (d_in + d_out)
True

Built by hand in notebooks/13_peft.ipynb.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from tfedu.data import shipped_text
from tfedu.layers import Attention
from tfedu.inputs import check_ids
from tfedu.model import LanguageModel, next_token_loss

LORA_TARGETS = ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out")  # the nn.Linear names of tfedu.layers


# ----------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class ParamCount:
    """Trainable parameters, all parameters (each shared tensor once) and their ratio."""

    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / self.total

    def __str__(self) -> str:
        return f"{self.trainable:,} of {self.total:,} parameters trainable ({self.fraction:.3%})"


def trainable_fraction(model: nn.Module) -> ParamCount:
    """How many of ``model``'s parameters require grad, out of all of them (a tied matrix counts once).

    >>> layer = nn.Linear(4, 2); _ = layer.bias.requires_grad_(False)
    >>> trainable_fraction(layer).trainable, trainable_fraction(layer).total
    (8, 10)
    """
    params = list(model.parameters())  # .parameters() yields a shared tensor once
    return ParamCount(sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))


def freeze(model: nn.Module) -> None:
    """Stop gradients to every parameter of ``model``."""
    for p in model.parameters():
        p.requires_grad_(False)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# ----------------------------------------------------------------------------- LoRA

class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + (alpha / r) * B(A(dropout(x)))``.

    ``A`` is (r, d_in), Kaiming-uniform as in Hugging Face peft (``a = sqrt(5)``, the default of
    ``nn.Linear``); ``B`` is (d_out, r) and starts at zero, so the layer starts equal to ``base``
    (Hu et al. 2021, sec. 4.1). ``merge()`` adds ``(alpha / r) B @ A`` to the base weight (then the
    forward is ``base(x)`` alone: no extra inference cost); ``unmerge()`` subtracts it again.

    >>> layer = LoRALinear(nn.Linear(8, 4), r=2, alpha=4)
    >>> layer.A.shape, layer.B.shape, layer.scale
    (torch.Size([2, 8]), torch.Size([4, 2]), 2.0)
    >>> x = torch.randn(3, 8); torch.equal(layer(x), layer.base(x))  # B = 0: the base layer exactly
    True
    """

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear, got {type(base).__name__}")
        _check_positive_int("r (the rank)", r)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise ValueError(f"alpha must be a positive number, got {alpha!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout!r}")
        self.base = base
        freeze(base)
        self.r, self.alpha = r, float(alpha)
        self.scale = self.alpha / r  # alpha / r: changing r needs no new learning rate (Hu et al. 2021, sec. 4.1)
        w = base.weight
        self.A = nn.Parameter(torch.empty(r, base.in_features, dtype=w.dtype, device=w.device))
        self.B = nn.Parameter(torch.zeros(base.out_features, r, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # as peft's reset_lora_parameters
        self.drop = nn.Dropout(dropout)
        self.merged = False

    def delta_weight(self) -> Float[Tensor, "d_out d_in"]:
        """``(alpha / r) B @ A``: what LoRA adds to ``W_0`` (the same (d_out, d_in) shape)."""
        return self.scale * (self.B @ self.A)

    def merged_weight(self) -> Float[Tensor, "d_out d_in"]:
        """``W_0 + (alpha / r) B @ A`` as a new tensor (the base weight itself once merged)."""
        return self.base.weight if self.merged else self.base.weight + self.delta_weight()

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        if self.merged:
            return self.base(x)
        # No activation between A and B: the update is linear, so it can be merged into W_0.
        return self.base(x) + self.scale * F.linear(F.linear(self.drop(x), self.A), self.B)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into the base weight: ``W_0 += (alpha / r) B @ A``."""
        if self.merged:
            raise RuntimeError("this LoRA layer is merged already: merging twice would add B @ A twice")
        self.base.weight += self.delta_weight()
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the update out of the base weight again: ``W_0 -= (alpha / r) B @ A``."""
        if not self.merged:
            raise RuntimeError("this LoRA layer is not merged")
        self.base.weight -= self.delta_weight()
        self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha:g}, merged={self.merged}"


def _lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def apply_lora(model: nn.Module, targets: Iterable[str] = ("W_Q", "W_V"), *, r: int = 8, alpha: float = 16.0,
               dropout: float = 0.0, layer_class: Callable[..., nn.Module] | None = None) -> dict[str, nn.Module]:
    """Freeze ``model`` and wrap every ``nn.Linear`` named one of ``targets`` in a ``LoRALinear``, in place.

    ``targets`` are the attribute names of tfedu's linear layers (``LORA_TARGETS``): ``W_Q``, ``W_K``,
    ``W_V``, ``W_O`` in attention, ``W_in``, ``W_gate``, ``W_out`` in the MLP. Returns the new layers by
    their full names. Only the LoRA matrices are trainable afterwards. ``layer_class`` (the learner's
    ``LoRA`` of notebook 13, called as ``layer_class(base, r, alpha)``) replaces ``LoRALinear``.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> len(apply_lora(GPT(preset("tiny")), targets=("W_in", "W_out"), r=2))  # 2 blocks x 2 MLP layers
    4
    """
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets:
        raise ValueError(f"targets is empty: name at least one of {', '.join(LORA_TARGETS)}")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}: tfedu's linear layers are named {', '.join(LORA_TARGETS)}")
    _check_positive_int("r (the rank)", r)
    if _lora_layers(model) or any(hasattr(m, "B") and hasattr(m, "base") for m in model.modules()):
        raise ValueError("this model has LoRA layers already; apply LoRA to a fresh copy of the base model")
    freeze(model)
    found = [(name, parent, child) for name, parent in model.named_modules()
             for child in targets if isinstance(getattr(parent, child, None), nn.Linear) and child in parent._modules]
    missing = sorted(set(targets) - {child for _, _, child in found})
    if missing:
        raise ValueError(f"LoRA target(s) {missing} match no nn.Linear in this model")
    layers = {}
    for name, parent, child in found:
        base = getattr(parent, child)
        layer = LoRALinear(base, r=r, alpha=alpha, dropout=dropout) if layer_class is None else layer_class(base, r, alpha)
        setattr(parent, child, layer)
        layers[f"{name}.{child}" if name else child] = layer
    return layers


def merge_lora(model: nn.Module) -> int:
    """Merge every LoRA layer of ``model`` into its base weight; returns how many were merged."""
    layers = _lora_layers(model)
    for layer in layers:
        layer.merge()
    return len(layers)


def merged_model(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``model`` whose LoRA layers are plain ``nn.Linear`` layers holding ``W_0 + (alpha / r) B @ A``.

    A LoRA layer is any module with an ``nn.Linear`` ``base`` and a ``merged_weight()`` method: tfedu's
    ``LoRALinear`` or a learner's ``LoRA`` (notebook 13). The copy has the base model's layers, parameter
    count and cost; A and B are gone. Returns the copy and how many layers were merged.

    >>> layer = nn.Sequential(LoRALinear(nn.Linear(8, 4), r=2))
    >>> merged, n = merged_model(layer)
    >>> n, type(merged[0]).__name__
    (1, 'Linear')
    """
    model = copy.deepcopy(model)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            base = getattr(child, "base", None)
            if isinstance(base, nn.Linear) and callable(getattr(child, "merged_weight", None)):
                linear = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                                   device=base.weight.device, dtype=base.weight.dtype)
                with torch.no_grad():
                    linear.weight.copy_(child.merged_weight())
                    if base.bias is not None:
                        linear.bias.copy_(base.bias)
                linear.requires_grad_(False)
                setattr(parent, name, linear)
                count += 1
    return model, count


def unmerge_lora(model: nn.Module) -> int:
    """Undo ``merge_lora``; returns how many layers were unmerged."""
    layers = _lora_layers(model)
    for layer in layers:
        layer.unmerge()
    return len(layers)


# ----------------------------------------------------------------------------- adapters


class Adapter(nn.Module):
    """A bottleneck adapter (Houlsby et al. 2019, fig. 2): ``y + up(gelu(down(y)))``.

    ``down`` maps d_model to ``bottleneck``, ``up`` back; ``up`` starts at zero (weight and bias), so an
    adapter starts as the identity and the adapted model as the base model, exactly.

    >>> adapter = Adapter(16, 4)
    >>> y = torch.randn(2, 16); torch.equal(adapter(y), y)
    True
    """

    def __init__(self, d_model: int, bottleneck: int) -> None:
        super().__init__()
        _check_positive_int("d_model", d_model)
        _check_positive_int("bottleneck", bottleneck)
        self.down = nn.Linear(d_model, bottleneck)
        self.up = nn.Linear(bottleneck, d_model)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, y: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return y + self.up(F.gelu(self.down(y)))  # the adapter's own skip connection


class AdaptedMLP(nn.Module):
    """A block's feed-forward layer followed by an ``Adapter``, before the block's residual addition."""

    def __init__(self, mlp: nn.Module, adapter: Adapter) -> None:
        super().__init__()
        self.mlp, self.adapter = mlp, adapter

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.adapter(self.mlp(x))


def apply_adapters(model: LanguageModel, bottleneck: int = 16) -> list[Adapter]:
    """Freeze ``model`` and put an ``Adapter`` after the feed-forward layer of every block, in place.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> len(apply_adapters(GPT(preset("tiny")), bottleneck=8))
    2
    """
    _check_positive_int("bottleneck", bottleneck)
    if not model.cfg.has_mlp:
        raise ValueError("adapters sit after each block's MLP, and this model is attention-only (d_mlp=0): "
                         "use LoRA (apply_lora) on its attention projections instead")
    if any(isinstance(m, Adapter) for m in model.modules()):
        raise ValueError("this model has adapters already; apply them to a fresh copy of the base model")
    freeze(model)
    adapters = []
    for block in model.blocks:
        w = next(block.mlp.parameters())
        adapter = Adapter(model.cfg.d_model, bottleneck).to(dtype=w.dtype, device=w.device)
        block.mlp = AdaptedMLP(block.mlp, adapter)
        adapters.append(adapter)
    return adapters


# ----------------------------------------------------------------------------- prefix tuning


class Prefix(nn.Module):
    """One attention layer's learned prefix: keys and values ``(n_kv_heads, n_prefix, d_head)``.

    Plain: the keys and values are the parameters. With ``hidden`` set (Li & Liang 2021, sec. 4.3, who
    found optimising them directly unstable) they are computed from a smaller table by an MLP,
    ``Linear -> tanh -> Linear``, during training; ``fold()`` then stores the result as plain tensors and
    drops the MLP. (Li & Liang share one MLP across layers; here each layer has its own.)
    """

    def __init__(self, n_kv_heads: int, n_prefix: int, d_head: int, *, hidden: int | None = None,
                 init: Tensor | None = None) -> None:
        super().__init__()
        self.shape = (n_kv_heads, n_prefix, d_head)
        if hidden is None:
            kv = init if init is not None else 0.02 * torch.randn(2, *self.shape)
            self.kv = nn.Parameter(kv.clone())  # 2 n_kv_heads n_prefix d_head: keys, then values
            self.table = self.mlp = None
        else:
            _check_positive_int("hidden", hidden)
            self.kv = None
            self.table = nn.Parameter(torch.randn(n_prefix, hidden) / math.sqrt(hidden))
            self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2 * n_kv_heads * d_head))

    def forward(self) -> tuple[Tensor, Tensor]:
        if self.kv is not None:
            return self.kv[0], self.kv[1]
        n_kv_heads, n_prefix, d_head = self.shape
        kv = self.mlp(self.table).view(n_prefix, 2, n_kv_heads, d_head).permute(1, 2, 0, 3)  # 2 heads n_prefix d_head
        return kv[0], kv[1]

    @torch.no_grad()
    def fold(self) -> None:
        """Replace the MLP by the keys and values it computes now (a no-op for a plain prefix)."""
        if self.kv is None:
            keys, values = self()
            self.kv = nn.Parameter(torch.stack([keys, values]).detach().clone())
            self.table = self.mlp = None


def prefix_layers(model: nn.Module) -> list[Attention]:
    """The self-attention layers of ``model`` that carry a prefix."""
    return [m for m in model.modules() if isinstance(m, Attention) and m.prefix is not None]


def apply_prefix_tuning(model: LanguageModel, n_prefix: int = 8, *, hidden: int | None = None,
                        seed: int = 0) -> list[Prefix]:
    """Freeze ``model`` and give every block's self-attention ``n_prefix`` learned keys and values.

    The plain prefix starts as small random keys and values (N(0, 0.02^2), seeded by ``seed``): unlike
    LoRA and adapters, the model's output changes at once, since every query now spends some of its
    attention on the prefix (its weight on the tokens' values shrinks by that share). ``hidden`` turns
    on the MLP reparameterisation (``Prefix``).

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> model = GPT(preset("tiny"))
    >>> len(apply_prefix_tuning(model, n_prefix=4)), trainable_fraction(model).trainable  # 2 x 2 x 4 heads x 4 x 16
    (2, 1024)
    """
    _check_positive_int("n_prefix", n_prefix)
    if prefix_layers(model):
        raise ValueError("this model has prefixes already; apply prefix tuning to a fresh copy of the base model")
    freeze(model)
    generator = torch.Generator().manual_seed(seed)
    prefixes = []
    for block in model.blocks:
        attn = block.attn
        w = attn.W_Q.weight
        shape = (2, attn.n_kv_heads, n_prefix, attn.d_head)
        init = 0.02 * torch.randn(shape, generator=generator)
        with torch.random.fork_rng():
            torch.manual_seed(seed + 1 + len(prefixes))
            prefix = Prefix(attn.n_kv_heads, n_prefix, attn.d_head, hidden=hidden, init=init)
        attn.prefix = prefix.to(dtype=w.dtype, device=w.device)
        prefixes.append(attn.prefix)
    return prefixes


def fold_prefixes(model: nn.Module) -> None:
    """Fold every reparameterised prefix of ``model`` into plain keys and values (``Prefix.fold``)."""
    for attn in prefix_layers(model):
        attn.prefix.fold()


# ----------------------------------------------------------------------------- prompt tuning


class PromptTuned(nn.Module):
    """A frozen language model with ``n_prompt`` learned input vectors before the tokens (Lester et al. 2021).

    The soft prompt is ``(n_prompt, d_model)``, started from the embeddings of ``n_prompt`` tokens drawn
    from the vocabulary (their sec. 3's "sampled vocab" initialisation). It enters the residual stream
    with no position vector and the tokens keep their positions 0, 1, ... (the model's learned position
    table is read as in pre-training); with RoPE the blocks number the whole stream, so the tokens would
    sit at n_prompt, n_prompt + 1, ... The logits and loss cover the real tokens only.

    >>> from tfedu.config import preset
    >>> from tfedu.model import GPT
    >>> tuned = PromptTuned(GPT(preset("tiny")), n_prompt=5)
    >>> tuned(torch.zeros(2, 7, dtype=torch.long)).shape, trainable_fraction(tuned).trainable  # 5 x d_model 64
    (torch.Size([2, 7, 256]), 320)
    """

    def __init__(self, model: LanguageModel, n_prompt: int = 8, *, seed: int = 0) -> None:
        super().__init__()
        _check_positive_int("n_prompt", n_prompt)
        if not isinstance(model, LanguageModel):
            raise TypeError(f"PromptTuned wraps a tfedu LanguageModel (a GPT), got {type(model).__name__}")
        self.model = model
        freeze(model)
        self.n_prompt = n_prompt
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.cfg.d_vocab, (n_prompt,), generator=generator)
        self.prompt = nn.Parameter(model.embed.weight[ids.to(model.embed.weight.device)].detach().clone())

    def forward(self, ids: Int[Tensor, "batch pos"], targets: Int[Tensor, "batch pos"] | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        model = self.model
        check_ids(ids, model.cfg)
        tokens = model.embed_tokens(ids)  # batch pos d_model, at positions 0 .. pos-1
        prompt = self.prompt.to(tokens.dtype).expand(ids.shape[0], -1, -1)  # batch n_prompt d_model
        resid = model.run_blocks(model.blocks, torch.cat([prompt, tokens], dim=1), causal=model.causal)
        logits = model.unembed(model.ln_final(resid[:, self.n_prompt:]))  # the real tokens only
        if targets is None:
            return logits
        if not isinstance(targets, Tensor) or targets.shape != ids.shape:
            raise ValueError(f"targets must have the shape of ids {tuple(ids.shape)}")
        return logits, next_token_loss(logits, targets)


# ----------------------------------------------------------------------------- the new style


CODE_MODULES = ("textwrap", "shlex", "fnmatch", "heapq", "bisect", "colorsys", "sched", "getopt", "reprlib",
                "queue", "netrc", "copy")


def code_documents(modules: Iterable[str] = CODE_MODULES) -> list[str]:
    """The source code of some pure-Python standard-library modules, one string each, in the given order.

    The notebook's "new style": Python code, where the course GPT was trained on the English of Python's
    help pages (``tfedu.data.pydoc_documents``). The modules of ``CODE_MODULES`` come from the course's
    shipped copy (``data/corpus/stdlib_code.json.gz``, Python 3.11.7's files: the source changes between
    Python releases, and the notebook's measured numbers rest on one text); any other module is read from
    this Python with ``inspect.getsource``, and skipped when its source is missing.

    >>> docs = code_documents(["textwrap"])
    >>> docs[0].count("def ") > 5
    True
    """
    import importlib
    import inspect

    shipped = shipped_text("stdlib_code.json.gz")["modules"]
    docs = []
    for name in modules:
        if name in shipped:
            docs.append(shipped[name].strip())
            continue
        try:
            docs.append(inspect.getsource(importlib.import_module(name)).strip())
        except (OSError, TypeError, ImportError):
            continue
    if not docs:
        raise FileNotFoundError("no standard-library source found (is this Python installed without its .py files?)")
    return docs


# ----------------------------------------------------------------------------- fine-tuning on a budget


def finetune(model: nn.Module, data, *, steps: int, batch_size: int, length: int, lr: float,
             seed: int = 0) -> list[float]:
    """Adam on ``model``'s trainable parameters for ``steps`` batches of ``data`` (a ``TokenDataset``).

    The batches depend on ``seed`` only, so every method sees the same windows in the same order.
    Returns the training loss of every step. Dropout is off (``model.eval()``): the comparison is of
    the methods, not of regularisation.
    """
    _check_positive_int("steps", steps)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    optimizer = torch.optim.Adam(params, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    losses = []
    for _ in range(steps):
        x, y = data.batch(batch_size, length, generator)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def held_out_loss(model: nn.Module, data, *, length: int, n_windows: int | None = None) -> float:
    """Mean next-token loss over the first ``n_windows`` non-overlapping windows of ``data`` (all by default)."""
    starts = data.eval_starts(length)[:n_windows]
    x, y = data.windows(starts, length)
    return model(x, y)[1].item()


def training_bytes(model: nn.Module, *, optimizer_floats: int = 2) -> int:
    """Bytes that training adds per trainable parameter: the gradient and Adam's two moments (activations not counted).

    >>> training_bytes(nn.Linear(10, 10))  # 110 parameters x 4 bytes x (1 gradient + 2 moments)
    1320
    """
    return sum(p.numel() * p.element_size() * (1 + optimizer_floats) for p in model.parameters() if p.requires_grad)

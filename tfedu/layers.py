"""The per-position layers of a Transformer block: LayerNorm, RMSNorm and the feed-forward MLP.

Everything here acts on the last axis (``d_model``) and treats every other axis (``batch``,
``pos``, ...) alike: a position never sees another position. Mixing across positions is
attention's job (``tfedu.attention``); these layers rescale and transform what each position
holds.

- ``LayerNorm`` (Ba et al. 2016, eq. 4): centre, divide by the standard deviation, then a
  learned gain and bias. The original Transformer and GPT-2 use it. ``layer_norm_by_hand``
  spells the steps out; the module runs the same formula fused (``F.layer_norm``).
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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from tfedu.activations import ACTIVATIONS, GATED, activate, swiglu_hidden
from tfedu.attention import MultiHeadAttention, attention_weights, causal_mask, combine_masks
from tfedu.config import ATTENTION_IMPLS, ModelConfig
from tfedu.delta_rule import GatedDeltaNet
from tfedu.flash import flash_attention
from tfedu.inputs import check_d_model, check_features
from tfedu.kv_cache import LayerKVCache, RingKVCache
from tfedu.moe import MoE
from tfedu.positional import apply_rope, validate_rope_scaling
from tfedu.recurrences import GatedLinearAttentionLayer, LinearAttentionLayer, MambaLayer


# ----------------------------------------------------------------------------- checks


def _check_eps(eps: object) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        # eps keeps the division finite when a position's vector is (nearly) constant/zero.
        raise ValueError(f"eps must be a positive number (it keeps the sqrt away from 0), got {eps!r}")


def dropout(drop: nn.Module, x: Tensor) -> Tensor:
    """``drop(x)``, or ``x`` itself without the module call when ``drop`` is an ``nn.Dropout`` that would return it.

    In eval mode, or with ``p = 0``, dropout is the identity; skipping the call saves a few
    microseconds per sub-layer, which count when a decode step runs one position through 12 blocks.

    >>> x = torch.ones(3)
    >>> dropout(nn.Dropout(0.5).eval(), x) is x, dropout(nn.Dropout(0.0), x) is x
    (True, True)
    """
    if isinstance(drop, nn.Dropout) and (not drop.training or drop.p == 0):
        return x
    return drop(x)


# ----------------------------------------------------------------------------- norms


def layer_norm_by_hand(
    x: Float[Tensor, "... d_model"], weight: Float[Tensor, "d_model"], bias: Float[Tensor, "d_model"] | None,
    eps: float = 1e-5,
) -> Float[Tensor, "... d_model"]:
    """LayerNorm's formula step by step (Ba et al. 2016, eq. 4): what ``LayerNorm.forward`` computes.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, mean and *biased* variance over the last
    axis. ``LayerNorm`` runs the same formula through the fused ``F.layer_norm`` (one kernel instead
    of eight: a decode step of GPT-2 small calls it 25 times); tests/test_layers.py checks the two
    agree to float rounding. Built by hand in notebooks/07_transformer_block.ipynb (exercise 7.2).

    >>> layer_norm_by_hand(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(4), torch.zeros(4))
    tensor([[-1.3416, -0.4472,  0.4472,  1.3416]])
    """
    mean = x.mean(dim=-1, keepdim=True)  # ... 1
    centred = x - mean  # ... d_model
    # Biased variance (1/d_model), as in Ba et al. 2016 eq. 4 and torch.nn.LayerNorm.
    var = centred.pow(2).mean(dim=-1, keepdim=True)  # ... 1
    # eps inside the sqrt: a constant vector gives 0 / sqrt(eps) = 0, not 0 / 0.
    x_hat = centred / torch.sqrt(var + eps)  # ... d_model
    out = x_hat * weight
    return out if bias is None else out + bias


class LayerNorm(nn.Module):
    """Layer normalisation over the last axis (Ba et al. 2016), the formula of ``layer_norm_by_hand``.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, with the mean and the *biased*
    variance (divide by d_model, not d_model - 1) taken over ``d_model``. Same maths and the
    same parameter names as ``torch.nn.LayerNorm(d_model)``, so its state dict loads here.
    ``bias=False`` drops the additive term (as GPT configs with ``bias=False`` do). ``forward``
    calls the fused ``F.layer_norm``: the same numbers as ``layer_norm_by_hand`` (tested), in one
    kernel.

    >>> ln = LayerNorm(4)
    >>> ln(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).detach()
    tensor([[-1.3416, -0.4472,  0.4472,  1.3416]])
    >>> sorted(name for name, _ in ln.named_parameters())
    ['bias', 'weight']

    Built by hand in notebooks/07_transformer_block.ipynb.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        check_d_model(d_model)
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
        check_features("LayerNorm", x, self.d_model)
        # layer_norm_by_hand's formula in one fused kernel (its eight element-wise steps cost ~10x more).
        return F.layer_norm(x, (self.d_model,), self.weight, self.bias, self.eps)

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

    ``unit_offset=True`` is Gemma's variant (HF ``Gemma3RMSNorm``): the gain is ``1 + weight``, ``weight``
    starts at zero, and the gain multiplies in float32 *before* the cast back (Gemma's order, not Llama's).

    >>> RMSNorm(2, unit_offset=True).weight
    Parameter containing:
    tensor([0., 0.], requires_grad=True)

    Built by hand in notebooks/07_transformer_block.ipynb.
    """

    def __init__(self, d_model: int, *, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        check_d_model(d_model)
        _check_eps(eps)
        self.d_model = d_model
        self.eps = float(eps)
        self.unit_offset = unit_offset
        # Gemma stores the gain minus one, so that weight decay pulls the gain towards 1, not 0.
        self.weight = nn.Parameter(torch.zeros(d_model) if unit_offset else torch.ones(d_model))

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        check_features("RMSNorm", x, self.d_model)
        in_dtype = x.dtype
        # Squares of bfloat16/float16 values lose precision fast; do the statistics in float32
        # (float64 stays float64), as LlamaRMSNorm does.
        x32 = x.to(torch.promote_types(in_dtype, torch.float32))
        mean_sq = x32.pow(2).mean(dim=-1, keepdim=True)  # ... 1
        x_hat = x32 * torch.rsqrt(mean_sq + self.eps)  # ... d_model
        if self.unit_offset:  # Gemma: (x_hat * (1 + w)) in float32, then cast
            return (x_hat * (1.0 + self.weight.to(x32.dtype))).to(in_dtype)
        # Cast back *before* the gain: the same order as LlamaRMSNorm, so results match bit for bit.
        return self.weight * x_hat.to(in_dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}" + (", unit_offset=True" if self.unit_offset else "")


# ----------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """The position-wise feed-forward network: ``W_out(act(W_in x))`` (Vaswani et al. 2017, eq. 2).

    ``activation`` is one of ``"relu"`` (the original Transformer), ``"gelu"`` (exact, with erf;
    BERT), ``"gelu_tanh"`` (GPT-2's tanh approximation, HF's ``gelu_new``) or ``"swiglu"``
    (Shazeer 2020, Llama): ``W_out(silu(W_gate x) * W_in x)``, a third matrix ``W_gate``
    whose SiLU output gates ``W_in x`` elementwise, or ``"geglu"`` (the same gate through GELU's tanh
    form: Gemma). ``d_mlp`` defaults to 4·d_model, or to ``swiglu_hidden(d_model)`` for the gated ones
    so that both have about 8·d_model² weights.

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
        check_d_model(d_model)
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid ones are {', '.join(map(repr, ACTIVATIONS))}")
        if d_mlp is None:
            d_mlp = swiglu_hidden(d_model) if activation in GATED else 4 * d_model
        if isinstance(d_mlp, bool) or not isinstance(d_mlp, int) or d_mlp <= 0:
            raise ValueError(f"d_mlp must be a positive int (or None for the default), got {d_mlp!r}")
        self.d_model = d_model
        self.d_mlp = d_mlp
        self.activation = activation
        self.W_in = nn.Linear(d_model, d_mlp, bias=bias)
        if activation in GATED:
            self.W_gate = nn.Linear(d_model, d_mlp, bias=bias)
        self.W_out = nn.Linear(d_mlp, d_model, bias=bias)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        check_features("MLP", x, self.d_model)
        gate = self.W_gate(x) if self.activation in GATED else None
        return self.W_out(activate(self.W_in(x), self.activation, gate))  # ... d_model

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_mlp={self.d_mlp}, activation={self.activation!r}"


# ----------------------------------------------------------------------------- attention for the model


def sliding_window_mask(n_query: int, n_key: int, window: int, *, device: torch.device | str | None = None
                        ) -> Bool[Tensor, "query_pos key_pos"]:
    """True where query i may attend key j in causal sliding-window attention: ``0 <= (i + n_key - n_query) - j < window``.

    Each query sees ``window`` keys, itself included: itself and the ``window - 1`` before it. That is the
    convention of HF transformers (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``)
    and so of Mistral's and Gemma's configs (Jiang et al. 2023, sec. 2; Beltagy et al. 2020 for the idea).
    Aligned to the end like ``causal_mask``: the queries are the newest ``n_query`` of ``n_key`` positions.
    Stacking L local layers lets information travel ``L * (window - 1)`` positions.

    >>> sliding_window_mask(4, 4, 2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)

    Built by hand in notebooks/16_modern_architectures.ipynb.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive int (keys each query sees, itself included), got {window!r}")
    # causal_mask keeps j <= i + offset; triu drops the keys window or more behind: j < i + offset - window + 1.
    return causal_mask(n_query, n_key, device=device).triu(diagonal=n_key - n_query - window + 1)


class Attention(MultiHeadAttention):
    """``tfedu.attention.MultiHeadAttention`` plus what a full model needs.

    - **Grouped key/value heads** (Ainslie et al. 2023): ``n_kv_heads`` key/value heads, each
      shared by ``n_heads // n_kv_heads`` consecutive query heads (``W_K``, ``W_V`` are
      ``n_kv_heads * d_head`` wide). ``n_kv_heads == n_heads`` is plain multi-head attention.
    - **RoPE** (Su et al. 2021): with ``rope_base`` set, self-attention rotates queries and keys
      by their positions (``tfedu.positional.apply_rope``); values are never rotated. ``rope_scaling``
      (transformers' ``rope_parameters`` dict, ``tfedu.positional.rope_frequencies``) scales the
      frequencies for contexts longer than the trained one (linear, NTK, Llama 3.1, YaRN).
    - **An additive bias** on the scores (ALiBi's ``-m * distance``), and ``causal=True`` to hide
      later keys (aligned to the end, like ``causal_mask``).
    - ``impl="sdpa"`` runs ``F.scaled_dot_product_attention`` instead of the by-hand softmax:
      the same numbers (tested), faster, but the pattern is never materialised, so
      ``hook_pattern`` does not fire. ``impl="flash"`` runs the course's FlashAttention-2 in PyTorch tiles
      (``tfedu.flash.flash_attention``, or ``flash_fn`` when set), ``impl="triton"`` its Triton kernel
      (``tfedu.kernels``), for plain and causal self-attention without dropout; with a mask, a bias, a
      prefix or a cached decoding step they fall back to SDPA.
    - **Per-head outputs** pass through the hook point ``hook_z`` as ``(batch, query_pos, n_heads, d_head)``
      (TransformerLens's ``z``), just before ``W_O`` mixes the heads, with either ``impl``: head h writes
      ``z[:, :, h] @ W_O.weight[:, h * d_head:(h + 1) * d_head].T`` to the residual stream
      (``tfedu.interp.per_head_W_O``). A hook returning a tensor replaces ``z`` (head ablation).
    - **A KV cache** (``kv_cache=``, a ``tfedu.kv_cache.LayerKVCache``): the new positions' keys and
      values (after RoPE, before the grouped heads are repeated: only ``n_kv_heads`` are kept) are
      appended to it and the queries attend over everything it holds. ``positions`` then default
      to ``cache.length, cache.length + 1, ...``; ``new_kv_cache`` makes an empty one for this layer.
    - **A learned prefix** (prefix tuning, Li & Liang 2021; ``tfedu.peft.apply_prefix_tuning``): when
      ``prefix`` is set (a module whose call returns keys and values ``(n_kv_heads, n_prefix, d_head)``),
      they are placed before the sequence's keys and values in self-attention. The causal mask is aligned
      to the end, so every query sees them; the tokens' positions do not change. ``None`` by default.

    >>> attn = Attention(d_model=16, n_heads=4, n_kv_heads=2)
    >>> attn.W_K.weight.shape  # 2 key heads of width 4
    torch.Size([8, 16])
    >>> attn(torch.randn(1, 5, 16), causal=True).shape
    torch.Size([1, 5, 16])

    Built by hand in notebooks/07_transformer_block.ipynb (the grouped heads in notebooks/10).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        bias: bool = True,
        kv_d_model: int | None = None,
        rope_base: float | None = None,
        rope_layout: str = "half",
        rope_scaling: dict | None = None,
        impl: str = "manual",
        dropout: float = 0.0,
        qk_norm: str | None = None,
        norm_eps: float = 1e-6,
        sliding_window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, d_head=d_head, bias=bias, kv_d_model=kv_d_model)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads must be a positive int dividing n_heads={n_heads}, got {n_kv_heads!r}")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"impl must be one of {', '.join(map(repr, ATTENTION_IMPLS))}, got {impl!r}")
        if impl in ("flash", "triton") and dropout:
            raise ValueError(f"impl={impl!r}: the course's FlashAttention kernels have no dropout; set dropout=0 "
                             "(or use impl='sdpa', which has)")
        self.n_kv_heads = n_kv_heads
        if n_kv_heads != n_heads:
            self.W_K = nn.Linear(self.kv_d_model, n_kv_heads * self.d_head, bias=bias)
            self.W_V = nn.Linear(self.kv_d_model, n_kv_heads * self.d_head, bias=bias)
        self.rope_base = rope_base
        self.rope_layout = rope_layout
        if rope_scaling is not None:
            validate_rope_scaling(rope_scaling, base=rope_base)
        self.rope_scaling = rope_scaling
        self.impl = impl
        self.dropout = float(dropout)
        self.prefix: nn.Module | None = None  # learned prefix keys/values (tfedu.peft, notebooks/13)
        # impl="flash": attend(q, k, v, causal=...) to run instead of tfedu.flash.flash_attention (notebook 09 plugs
        # in the learner's forward and backward with tfedu.flash.attention_from)
        self.flash_fn: Callable[..., Tensor] | None = None
        self.hook_z = nn.Identity()  # per-head outputs before W_O (tfedu.interp, notebooks/15)
        self._init_modern(qk_norm, norm_eps, sliding_window, scale, softcap)

    def _init_modern(self, qk_norm: str | None, norm_eps: float, sliding_window: int | None, scale: float | None,
                     softcap: float | None) -> None:
        """QK-norm, the sliding window, the score scale and soft-capping (notebooks/16); all off by default."""
        if qk_norm not in (None, "rms", "gemma_rms"):
            raise ValueError(f"qk_norm must be None, 'rms' (Qwen3) or 'gemma_rms' (Gemma 3), got {qk_norm!r}")
        self.qk_norm = qk_norm
        # One gain per dimension of a head, shared by every head (HF Qwen3's and Gemma 3's q_norm/k_norm).
        self.q_norm = None if qk_norm is None else RMSNorm(self.d_head, eps=norm_eps, unit_offset=qk_norm == "gemma_rms")
        self.k_norm = None if qk_norm is None else RMSNorm(self.d_head, eps=norm_eps, unit_offset=qk_norm == "gemma_rms")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive int (keys each query sees) or None, got {sliding_window!r}")
        self.sliding_window = sliding_window
        for name, value in (("scale", scale), ("softcap", softcap)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        self.scale = None if scale is None else float(scale)  # None: 1 / sqrt(d_head)
        self.softcap = None if softcap is None else float(softcap)

    def forward(
        self,
        x: Float[Tensor, "batch query_pos d_model"],
        context: Float[Tensor, "batch key_pos kv_d_model"] | None = None,
        mask: Bool[Tensor, "..."] | None = None,
        *,
        causal: bool = False,
        positions: Int[Tensor, "query_pos"] | None = None,
        bias: Float[Tensor, "*#batch #query_pos #key_pos"] | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> Float[Tensor, "batch query_pos d_model"]:
        self_attention = context is None
        context = self._check_inputs(x, context, mask)
        if kv_cache is not None and not self_attention:
            raise ValueError("a KV cache holds self-attention's keys and values; cross-attention reads them from context")
        n_query = x.shape[1]
        start = 0 if kv_cache is None else kv_cache.length  # positions already cached
        q = self.split_heads(self.W_Q(x))  # batch n_heads query_pos d_head
        k = self.split_heads(self.W_K(context), self.n_kv_heads)  # batch n_kv_heads new_pos d_head
        v = self.split_heads(self.W_V(context), self.n_kv_heads)  # batch n_kv_heads new_pos d_head
        if self.q_norm is not None:
            # QK-norm before RoPE (HF Qwen3 and Gemma 3): each head's vector normalised over d_head, so no score
            # can grow past |q_norm.weight| |k_norm.weight| d_head however large W_Q, W_K become (Dehghani et al. 2023).
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_base is not None and self_attention:
            if positions is None:
                positions = torch.arange(start, start + n_query, device=x.device)
            # scaling= only when set: a learner's apply_rope (notebook 06, carried in by tfedu.use_mine) has no such
            # argument, and plain RoPE must keep running through it
            scaled = {} if self.rope_scaling is None else {"scaling": self.rope_scaling}
            q = apply_rope(q, positions, base=self.rope_base, layout=self.rope_layout, **scaled)
            k = apply_rope(k, positions, base=self.rope_base, layout=self.rope_layout, **scaled)
        if kv_cache is not None:
            # The cache keeps the rotated keys of the n_kv_heads heads; the query sees the cached keys
            # and its own (just appended) exactly once.
            k, v = kv_cache.append(k, v)  # batch n_kv_heads key_pos d_head
            if mask is not None and mask.shape[-1] > k.shape[2]:
                # A ring cache (RingKVCache) returns only the newest keys: they are the mask's last columns.
                mask = mask[..., -k.shape[2]:]
        own_mask = mask  # the caller's: the course's kernels take no mask but the causal one
        if self.prefix is not None and self_attention:
            k, v, mask = self._with_prefix(k, v, mask, bias)
        n_key = k.shape[2]
        if self.n_kv_heads != self.n_heads:
            # Key/value head j serves query heads j*g .. j*g + g - 1 (Llama's repeat_kv).
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # batch n_heads key_pos d_head
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        if causal and n_query > 1:  # (a single query is the newest position: every key is visible to it)
            mask = combine_masks(mask, causal_mask(n_query, n_key, device=x.device))
        windowed = self._window_applies(causal, n_key, self_attention)
        if windowed:
            mask = combine_masks(mask, sliding_window_mask(n_query, n_key, self.sliding_window, device=x.device))
        dropout = self.dropout if self.training else 0.0
        plain = not windowed and self.scale is None and self.softcap is None
        if self.impl in ("flash", "triton") and bias is None and own_mask is None and self.prefix is None \
                and n_query == n_key and plain:  # training and prefill; a cached decoding step (one query) runs on SDPA
            z = self._kernel(q, k, v, causal=causal and n_query > 1)
        elif self.impl in ("sdpa", "flash", "triton") and self.softcap is None:
            z = self._fused(q, k, v, mask, bias, causal and mask is not None and n_query == n_key and not windowed,
                            dropout, self.scale)
        else:
            pattern = self.hook_pattern(self._pattern(q, k, mask, bias))  # batch n_heads query_pos key_pos
            z = F.dropout(pattern, dropout) @ v  # batch n_heads query_pos d_head
        # merge_heads in two steps, so that the hook sees the heads apart (TransformerLens's layout).
        z = self.hook_z(z.transpose(1, 2))  # batch query_pos n_heads d_head
        return self.W_O(z.flatten(2))  # batch query_pos d_model

    def _window_applies(self, causal: bool, n_key: int, self_attention: bool) -> bool:
        """Whether this call needs the sliding-window mask: a local layer with keys further back than its window."""
        if self.sliding_window is None or not self_attention:
            return False
        if not causal:
            raise ValueError("sliding-window attention here is a causal decoder's (Mistral, Gemma): call it with "
                             "causal=True, or build the layer without sliding_window")
        if self.prefix is not None:
            raise ValueError("a learned prefix sits outside every window: prefix tuning with sliding_window is not supported")
        return n_key > self.sliding_window

    def _pattern(self, q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor | None) -> Tensor:
        """The attention pattern by hand: ``attention_weights``, or with ``scale`` / ``softcap`` the same steps here.

        Soft-capping (Gemma 2, Team Gemma 2024, sec. 2) bends the scaled scores through ``cap * tanh(s / cap)``
        before the mask and the softmax, as HF's ``eager_attention_forward`` does; softmax in float32 (at least).
        """
        if self.scale is None and self.softcap is None:
            return attention_weights(q, k, mask, bias=bias)
        scale = self.d_head ** -0.5 if self.scale is None else self.scale
        scores = (q @ k.transpose(-2, -1)) * scale  # batch n_heads query_pos key_pos
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.to(torch.promote_types(q.dtype, torch.float32)).softmax(dim=-1).to(q.dtype)

    def _with_prefix(self, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys and values with the learned prefix in front, and ``mask`` widened to let every query see it."""
        if bias is not None:
            raise ValueError("a learned prefix has no distance to the queries: prefix tuning with an attention bias "
                             "(ALiBi) is not supported")
        prefix_k, prefix_v = self.prefix()  # n_kv_heads n_prefix d_head
        batch = k.shape[0]
        k = torch.cat([prefix_k.to(k.dtype).expand(batch, -1, -1, -1), k], dim=2)  # batch n_kv_heads n_prefix+key_pos d_head
        v = torch.cat([prefix_v.to(v.dtype).expand(batch, -1, -1, -1), v], dim=2)
        if mask is not None and mask.shape[-1] != 1:  # (a key axis of 1 broadcasts over the prefix too)
            mask = torch.cat([mask.new_ones(*mask.shape[:-1], prefix_k.shape[1]), mask], dim=-1)
        return k, v, mask

    def _kernel(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
        """The course's FlashAttention: the PyTorch tiles (or ``flash_fn``), or the Triton kernel."""
        if self.impl == "flash":
            return (self.flash_fn or flash_attention)(q, k, v, causal=causal)
        from tfedu import kernels  # Triton loads only when asked for (and sets its interpreter up first)

        usable, why = kernels.available()
        if not usable:
            raise RuntimeError(f"attention='triton' needs Triton: {why}; use attention='flash' (the same tiles in PyTorch)")
        return kernels.flash_attention(q, k, v, causal=causal)

    @staticmethod
    def _fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, plain_causal: bool,
               dropout: float, scale: float | None = None) -> Tensor:
        if bias is None and plain_causal and mask.dim() == 2:
            # Only the causal mask: let the kernel skip the masked half itself.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale)
        if bias is not None:
            scores_bias = bias.to(q.dtype)
            if mask is not None:
                scores_bias = scores_bias.masked_fill(~mask, float("-inf"))
            mask = scores_bias
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)

    def new_kv_cache(self, batch: int, capacity: int, *, dtype: torch.dtype = torch.float32,
                     device: torch.device | str | None = None) -> LayerKVCache | RingKVCache:
        """An empty cache for this layer: keys and values ``(batch, n_kv_heads, capacity, d_head)``.

        A local layer (``sliding_window`` set) gets a ``RingKVCache`` of ``sliding_window - 1`` slots instead: its
        queries never see further back, so nothing older is kept, however many positions it runs.
        """
        if self.sliding_window is not None:
            return RingKVCache(batch, self.n_kv_heads, self.sliding_window, self.d_head, capacity=capacity,
                               dtype=dtype, device=device)
        return LayerKVCache(batch, self.n_kv_heads, capacity, self.d_head, dtype=dtype, device=device)

    def extra_repr(self) -> str:
        rope = f", rope_base={self.rope_base}, rope_layout={self.rope_layout!r}" if self.rope_base is not None else ""
        extra = "".join(f", {name}={getattr(self, name)!r}" for name in ("qk_norm", "sliding_window", "scale", "softcap")
                        if getattr(self, name) is not None)
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, d_head={self.d_head}, impl={self.impl!r}{rope}{extra}"


# ----------------------------------------------------------------------------- the block


def make_norm(cfg: ModelConfig) -> LayerNorm | RMSNorm:
    """The norm layer ``cfg.norm`` names, of width d_model (``gemma_rms``: RMSNorm with gain 1 + weight)."""
    if cfg.norm in ("rms", "gemma_rms"):
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps, unit_offset=cfg.norm == "gemma_rms")
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def make_attention(cfg: ModelConfig, *, cross: bool = False, layer: int = 0) -> Attention:
    """Self-attention (or, with ``cross=True``, cross-attention reading d_model-wide context) for ``cfg``.

    ``layer`` picks the kind of block ``layer`` (``cfg.is_local``): a local one attends within
    ``cfg.sliding_window`` and rotates with ``cfg.rope_local_base`` when that is set (Gemma 3).
    """
    if cfg.qk_norm and cfg.norm == "layer":
        raise ValueError("qk_norm normalises each head with RMSNorm (Qwen3, Gemma 3): set norm='rms' or 'gemma_rms'")
    local = cfg.is_local(layer) and not cross
    return Attention(
        cfg.d_model,
        cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        d_head=cfg.d_head,
        bias=cfg.bias,
        # (Gemma 3: local layers keep a short-range base of their own, 10,000)
        rope_base=None if cfg.positional != "rope" or cross else
        cfg.rope_local_base if local and cfg.rope_local_base is not None else cfg.rope_base,
        rope_layout=cfg.rope_layout,
        # (Gemma 3 scales only its global layers: local ones with their own base keep plain RoPE)
        rope_scaling=None if cross or (local and cfg.rope_local_base is not None) else cfg.rope_scaling,
        impl=cfg.attention,
        dropout=cfg.dropout,
        qk_norm=cfg.norm if cfg.qk_norm else None,
        norm_eps=cfg.norm_eps,
        sliding_window=cfg.sliding_window if local else None,
        scale=None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5,
        softcap=cfg.attn_logit_softcap,
    )


def make_mixer(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    """What mixes positions in block ``layer``: ``make_attention``'s layer, or the recurrence ``cfg.layer_types`` names.

    - ``"linear"``: ``tfedu.recurrences.LinearAttentionLayer`` (notebook 09's causal linear attention), n_heads
      heads of d_head;
    - ``"gla"``: ``tfedu.recurrences.GatedLinearAttentionLayer`` (a per-head gate, the chunked form), the same heads;
    - ``"mamba"``: ``tfedu.recurrences.MambaLayer`` with d_inner = 2 d_model (Mamba's expansion, Gu & Dao 2023)
      and ``cfg.d_state``, Mamba's own defaults otherwise (no bias in its projections, conv width 4);
    - ``"gated_deltanet"``: ``tfedu.delta_rule.GatedDeltaNet`` with n_heads heads of d_head for keys and values
      (one key head per value head).

    A recurrent mixer takes the block's input alone: no mask, positions, bias or KV cache (``Block.forward``).
    """
    kind = "full_attention" if cfg.layer_types is None else cfg.layer_types[layer]
    if kind == "linear":
        return LinearAttentionLayer(cfg.d_model, cfg.n_heads, cfg.d_head, bias=cfg.bias)
    if kind == "gla":
        return GatedLinearAttentionLayer(cfg.d_model, cfg.n_heads, cfg.d_head, bias=cfg.bias)
    if kind == "mamba":
        return MambaLayer(cfg.d_model, 2 * cfg.d_model, d_state=cfg.d_state)
    if kind == "gated_deltanet":
        return GatedDeltaNet(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_head)
    return make_attention(cfg, layer=layer)


def _check_recurrent_call(kind: str, mask: Tensor | None, causal: bool, kv_cache: object) -> None:
    """Clear errors for what a recurrent mixer cannot do: look both ways, keep a KV cache, skip masked keys."""
    if not causal:
        raise ValueError(f"a {kind!r} layer is a recurrence that runs forward: it is causal only (use it in a GPT)")
    if kv_cache is not None:
        raise ValueError(f"a {kind!r} layer keeps a recurrent state, not keys and values: decode without a KV cache")
    if mask is not None:
        n_query, n_key = mask.shape[-2], mask.shape[-1]
        if not bool((mask | ~causal_mask(n_query, n_key, device=mask.device)).all()):
            raise ValueError(f"the mask hides earlier positions from some query (left padding?), but a {kind!r} layer "
                             "cannot skip positions: its state takes in every one. Pad on the right, or run the "
                             "prompts one at a time")


def make_mlp(cfg: ModelConfig) -> nn.Module:
    """The feed-forward layer for ``cfg``: an ``MLP``, or a ``tfedu.moe.MoE`` of them when ``cfg.n_experts`` is set."""
    if cfg.n_experts is not None:
        return MoE.from_config(cfg)
    return MLP(cfg.d_model, cfg.d_mlp, activation=cfg.activation, bias=cfg.bias)


class Block(nn.Module):
    """One Transformer block: attention, then the MLP, each added to the residual stream.

    ``norm_position="pre"`` (GPT-2, Llama; Xiong et al. 2020)::

        resid_mid  = resid_pre + attn(ln1(resid_pre))
        resid_post = resid_mid + mlp(ln2(resid_mid))

    With ``cfg.sandwich_norm`` (Gemma 2/3) each pre-norm sub-layer's output is normalised again before the
    add, by ``ln1_post`` and ``ln2_post``: ``resid_mid = resid_pre + ln1_post(attn(ln1(resid_pre)))``.
    ``layer`` (the block's index) says whether its attention is local or global (``cfg.is_local``).

    ``norm_position="post"`` (the 2017 paper's "Add & Norm")::

        resid_mid  = ln1(resid_pre + attn(resid_pre))
        resid_post = ln2(resid_mid + mlp(resid_mid))

    With ``cross_attention=True`` (the decoder of an encoder-decoder) a third sub-layer sits in
    between: cross-attention from the residual stream to ``context`` (the encoder's output),
    with its own norm ``ln_cross`` and hook points ``hook_cross_attn_out``/``hook_resid_mid_cross``.
    With ``cfg.d_mlp == 0`` the block is attention-only: no ``ln2``, ``mlp`` or ``hook_mlp_out``, and
    ``resid_post = resid_mid`` (Elhage et al. 2021's toy models; notebook 15's induction model).

    The residual stream passes through named hook points (``nn.Identity`` modules, TransformerLens's
    names): ``hook_resid_pre``, ``hook_attn_out``, ``hook_resid_mid``, ``hook_mlp_out``,
    ``hook_resid_post``, and the pattern at ``attn.hook_pattern``. A forward hook on one of them
    sees the tensor; one that returns a tensor replaces it.

    ``kv_cache`` (this block's ``tfedu.kv_cache.LayerKVCache``) goes to the self-attention; everything
    else works per position, so a cached step runs the block on the new positions alone.

    When ``cfg.layer_types[layer]`` names a recurrent mixer (``"linear"``, ``"gla"``, ``"mamba"``,
    ``"gated_deltanet"``; notebooks/19), ``attn`` is that layer (``make_mixer``) and ``recurrent`` its name
    (None for attention). It is called with the normed stream alone, causal only, without a KV cache or a mask
    that hides earlier positions; ``hook_attn_out`` carries its output. It has no ``hook_pattern`` (no pattern
    is ever formed); the linear ones have ``attn.hook_z``.

    >>> from tfedu.config import ModelConfig
    >>> block = Block(ModelConfig(d_vocab=10, n_ctx=8, d_model=16, n_layers=1, n_heads=2))
    >>> block(torch.randn(2, 5, 16), causal=True).shape
    torch.Size([2, 5, 16])

    Built by hand in notebooks/07_transformer_block.ipynb.
    """

    def __init__(self, cfg: ModelConfig, *, cross_attention: bool = False, layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm_position = cfg.norm_position
        self.ln1 = make_norm(cfg)
        # a recurrent mixer's kind ("gla", "mamba", ...; cfg.layer_types) sits where attention would, or None
        self.recurrent = cfg.layer_types[layer] if cfg.is_recurrent(layer) else None
        self.attn = make_mixer(cfg, layer) if self.recurrent else make_attention(cfg, layer=layer)
        if cfg.sandwich_norm:
            if cfg.norm_position != "pre" or cross_attention:
                raise ValueError("sandwich_norm adds a norm after each pre-norm sub-layer (Gemma 2/3): it needs "
                                 "norm_position='pre' and a decoder without cross-attention")
            self.ln1_post = make_norm(cfg)  # HF Gemma's post_attention_layernorm
            if cfg.has_mlp:
                self.ln2_post = make_norm(cfg)  # HF Gemma's post_feedforward_layernorm
        if cross_attention:
            self.ln_cross = make_norm(cfg)
            self.cross_attn = make_attention(cfg, cross=True)
            self.hook_cross_attn_out = nn.Identity()
            self.hook_resid_mid_cross = nn.Identity()
        if cfg.has_mlp:  # d_mlp=0: attention-only, no ln2, mlp or hook_mlp_out
            self.ln2 = make_norm(cfg)
            self.mlp = make_mlp(cfg)
            self.hook_mlp_out = nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_resid_post"):
            setattr(self, name, nn.Identity())

    @property
    def has_cross_attention(self) -> bool:
        return "cross_attn" in self._modules  # (hasattr goes through nn.Module.__getattr__'s AttributeError: slow)

    def _sublayer(self, resid: Tensor, norm: nn.Module, layer: Callable[[Tensor], Tensor], hook: nn.Module,
                  post: nn.Module | None = None) -> Tensor:
        """One residual sub-layer, pre- or post-norm; ``hook`` sees the sub-layer's output.

        ``post`` (sandwich norm, Gemma 2/3) normalises the sub-layer's output before it is added: x + post(F(norm(x))).
        """
        if self.norm_position == "pre":
            out = layer(norm(resid))
            if post is not None:
                out = post(out)
            return resid + hook(dropout(self.drop, out))  # x + F(norm(x))
        return norm(resid + hook(dropout(self.drop, layer(resid))))  # norm(x + F(x))

    def forward(
        self,
        resid: Float[Tensor, "batch pos d_model"],
        mask: Bool[Tensor, "..."] | None = None,
        *,
        causal: bool = False,
        positions: Int[Tensor, "pos"] | None = None,
        attn_bias: Float[Tensor, "*#batch #query_pos #key_pos"] | None = None,
        context: Float[Tensor, "batch key_pos d_model"] | None = None,
        context_mask: Bool[Tensor, "..."] | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)

        def self_attention(x: Tensor) -> Tensor:
            if self.recurrent:  # (the recurrence knows the order by itself: positions and ALiBi's bias are attention's)
                _check_recurrent_call(self.recurrent, mask, causal, kv_cache)
                return self.attn(x)
            return self.attn(x, mask=mask, causal=causal, positions=positions, bias=attn_bias, kv_cache=kv_cache)

        resid = self.hook_resid_mid(self._sublayer(resid, self.ln1, self_attention, self.hook_attn_out,
                                                   self._modules.get("ln1_post")))
        if self.has_cross_attention:
            if context is None:
                raise ValueError("this block has cross-attention: pass context=(the encoder's output)")

            def cross_attention(x: Tensor) -> Tensor:
                return self.cross_attn(x, context, mask=context_mask)

            resid = self.hook_resid_mid_cross(
                self._sublayer(resid, self.ln_cross, cross_attention, self.hook_cross_attn_out)
            )
        elif context is not None:
            raise ValueError("this block has no cross-attention; build it with cross_attention=True to read context")
        if not self.cfg.has_mlp:
            return self.hook_resid_post(resid)
        return self.hook_resid_post(self._sublayer(resid, self.ln2, self.mlp, self.hook_mlp_out,
                                                   self._modules.get("ln2_post")))

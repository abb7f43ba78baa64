"""``ModelConfig``: every shape and switch of a tfedu Transformer, in one frozen dataclass.

The same config builds the decoder-only ``GPT``, the ``Encoder`` and the ``EncoderDecoder`` of
``tfedu.model``, and ``tfedu.flops.param_count`` / ``flops_per_token`` read their counts off it
without building anything. Later notebooks add fields here (experts, LoRA rank, ...) rather than
new flags on the classes.

Three fields are *derived* when left as ``None``: ``d_head`` (``d_model // n_heads``),
``n_kv_heads`` (``n_heads``: plain multi-head attention) and ``d_mlp`` (``4 * d_model``, or
``swiglu_hidden(d_model)`` for SwiGLU). Make variants with ``cfg.replace(...)``: it derives them
again from the new shapes unless you pass them (``dataclasses.replace`` would keep the old
derived numbers).

>>> cfg = ModelConfig(d_vocab=100, n_ctx=16, d_model=32, n_layers=2, n_heads=4)
>>> cfg.d_head, cfg.n_kv_heads, cfg.d_mlp
(8, 4, 128)
>>> cfg.replace(d_model=64).d_head  # derived again
16
>>> preset("gpt2").d_model, preset("gpt2").n_layers
(768, 12)

Built up in notebooks/07_transformer_block.ipynb.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tfedu.activations import ACTIVATIONS, GATED, swiglu_hidden
from tfedu.positional import rope_frequencies

POSITIONALS = ("learned", "sinusoidal", "rope", "alibi", "none")
NORMS = ("layer", "rms", "gemma_rms")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names for global and local layers
# The token mixers of notebooks/19 that rival attention, each a recurrence with a state of fixed size: notebook 09's
# causal linear attention, gated linear attention (tfedu.recurrences), Mamba (S6) and Gated DeltaNet (tfedu.delta_rule)
RECURRENT_LAYER_TYPES = ("linear", "gla", "mamba", "gated_deltanet")
LAYER_TYPES = ATTENTION_LAYER_TYPES + RECURRENT_LAYER_TYPES
NORM_POSITIONS = ("pre", "post")
ATTENTION_IMPLS = ("manual", "sdpa", "flash", "triton")
ROPE_LAYOUTS = ("interleaved", "half")
_DERIVED = ("d_head", "n_kv_heads", "d_mlp")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"ModelConfig.{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a Transformer. Defaults are GPT-2 small (124M parameters)."""

    d_vocab: int = 50257  # rows of the token embedding W_E (GPT-2's byte-level BPE)
    n_ctx: int = 1024  # longest sequence the model accepts (rows of a learned position table)
    d_model: int = 768  # width of the residual stream
    n_layers: int = 12  # number of blocks
    n_heads: int = 12  # query heads per attention layer
    n_kv_heads: int | None = None  # key/value heads; None = n_heads; fewer = grouped-query (Llama 2 70B)
    d_head: int | None = None  # width of one head; None = d_model // n_heads
    d_mlp: int | None = None  # MLP hidden width; None = 4 d_model (SwiGLU: 8 d_model / 3); 0 = attention-only blocks
    positional: str = "learned"  # learned | sinusoidal (added to the embeddings) | rope | alibi | none
    norm: str = "layer"  # layer (LayerNorm) | rms (RMSNorm)
    norm_position: str = "pre"  # pre: x + F(norm(x)) (GPT-2, Llama) | post: norm(x + F(x)) (2017 paper)
    norm_eps: float = 1e-5  # added to the variance inside the sqrt
    activation: str = "gelu_tanh"  # relu | gelu | gelu_tanh (GPT-2) | swiglu (Llama)
    bias: bool = True  # biases in every linear layer and LayerNorm (Llama: False)
    tied_embeddings: bool = True  # the unembedding W_U is W_E transposed (GPT-2) or its own matrix (Llama)
    dropout: float = 0.0  # on the embeddings, the attention pattern and each block's two outputs
    rope_base: float = 10000.0  # RoPE's theta base (Llama 3: 500000)
    rope_layout: str = "half"  # which dimensions RoPE pairs: half (HF Llama) | interleaved (the paper)
    # manual (tfedu.attention, by hand) | sdpa (torch's fused kernel) | flash (tfedu.flash's PyTorch tiles) |
    # triton (tfedu.kernels' Triton kernel); flash and triton take plain and causal self-attention, SDPA the rest
    attention: str = "manual"
    init_std: float | None = None  # std of the normal init of every weight matrix; None: the model's default
    #   (0.02 for GPT and Encoder, as GPT-2 and BERT; d_model ** -0.5 for EncoderDecoder, see there)
    n_experts: int | None = None  # None: one MLP per block; E: a mixture of E experts (tfedu.moe.MoE)
    top_k: int = 1  # experts each token runs through (Switch: 1; Mixtral: 2)
    capacity_factor: float | None = None  # None: no token dropped; c: an expert takes ceil(c k tokens / E) in training
    balance_loss_coef: float = 0.01  # weight of Switch's load-balancing loss (Fedus et al. 2022: 1e-2)
    z_loss_coef: float = 0.001  # weight of the router z-loss (Zoph et al. 2022: 1e-3)
    # What separates Llama 3, Qwen3 and Gemma 2/3 from GPT-2 (notebooks/16); every one is off by default.
    qk_norm: bool = False  # RMSNorm (cfg.norm) over d_head on each query and key head, before RoPE (Qwen3, Gemma 3)
    sliding_window: int | None = None  # a local layer's query sees this many keys, itself included (Mistral, Gemma)
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" | "sliding_attention" (transformers'
    #   names); None: every layer local when sliding_window is set, else every layer global. Or a recurrent
    #   mixer in place of attention (notebooks/19): "linear" | "gla" | "mamba" | "gated_deltanet"; a pattern of
    #   them and attention is a hybrid (hybrid_layer_types)
    d_state: int = 16  # state per channel of a "mamba" layer (Gu & Dao 2023: 16); unused without one
    rope_local_base: float | None = None  # RoPE base of the local layers (Gemma 3: 10,000); None: rope_base
    # RoPE scaling for longer contexts, transformers' rope_parameters dict ({"rope_type": "yarn", "factor": 4.0, ...};
    #   tfedu.positional.rope_frequencies); None: plain RoPE. Not on local layers that use rope_local_base (Gemma 3)
    rope_scaling: dict | None = field(default=None, hash=False)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2: 50)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2: 30)
    scale_embeddings: bool = False  # token embeddings times sqrt(d_model) (Gemma)
    sandwich_norm: bool = False  # also a norm on each sub-layer's output before the residual add (Gemma 2/3)
    query_pre_attn_scalar: float | None = None  # scores scaled by this ** -0.5 instead of d_head ** -0.5 (Gemma)
    _explicit: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("d_vocab", "n_ctx", "d_model", "n_layers", "n_heads"):
            _positive_int(name, getattr(self, name))
        _one_of("positional", self.positional, POSITIONALS)
        _one_of("norm", self.norm, NORMS)
        _one_of("norm_position", self.norm_position, NORM_POSITIONS)
        _one_of("activation", self.activation, ACTIVATIONS)
        _one_of("attention", self.attention, ATTENTION_IMPLS)
        _one_of("rope_layout", self.rope_layout, ROPE_LAYOUTS)
        if not isinstance(self.norm_eps, (int, float)) or isinstance(self.norm_eps, bool) or not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be a positive number, got {self.norm_eps!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be a probability in [0, 1), got {self.dropout!r}")
        if self.init_std is not None and (isinstance(self.init_std, bool) or not isinstance(self.init_std, (int, float))
                                          or not 0 < self.init_std < math.inf):
            raise ValueError(f"ModelConfig.init_std must be a positive number or None, got {self.init_std!r}")
        if not isinstance(self.rope_base, (int, float)) or not (self.rope_base > 1 and math.isfinite(self.rope_base)):
            raise ValueError(f"ModelConfig.rope_base must be a finite number > 1, got {self.rope_base!r}")
        self._check_experts()
        self._check_modern()
        explicit = frozenset(name for name in _DERIVED if getattr(self, name) is not None)
        object.__setattr__(self, "_explicit", explicit)
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: pass d_head explicitly"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_mlp is None:
            hidden = swiglu_hidden(self.d_model) if self.activation in GATED else 4 * self.d_model
            object.__setattr__(self, "d_mlp", hidden)
        for name in ("d_head", "n_kv_heads"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.d_mlp, bool) or not isinstance(self.d_mlp, int) or self.d_mlp < 0:
            raise ValueError(f"ModelConfig.d_mlp must be an int >= 0 (0: attention-only blocks, no MLP), got {self.d_mlp!r}")
        if self.d_mlp == 0 and self.n_experts is not None:
            raise ValueError(f"d_mlp=0 means no MLP, so there is nothing for n_experts={self.n_experts} experts to be "
                             "made of: give the experts a hidden width d_mlp > 0")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}: "
                "each key/value head serves the same number of query heads"
            )
        if self.positional == "rope" and self.d_head % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions: d_head={self.d_head} must be even")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions pair sin and cos: d_model={self.d_model} must be even")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        if self.positional != "rope":
            raise ValueError(f"ModelConfig.rope_scaling scales RoPE's frequencies, but positional={self.positional!r}: "
                             "set positional='rope' or rope_scaling=None")
        try:  # computing the frequencies once checks the dict against d_head and rope_base too
            rope_frequencies(self.d_head, self.rope_base, self.rope_scaling)
        except ValueError as error:
            raise ValueError(f"ModelConfig.rope_scaling: {error}") from None
        object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))  # a copy: the caller's dict may change later

    def _check_experts(self) -> None:
        for name in ("balance_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"ModelConfig.{name} must be a number >= 0, got {value!r}")
        if self.n_experts is None:
            if self.top_k != 1 or self.capacity_factor is not None:
                raise ValueError("top_k and capacity_factor belong to a mixture of experts: set n_experts as well "
                                 f"(got n_experts=None, top_k={self.top_k!r}, capacity_factor={self.capacity_factor!r})")
            return
        _positive_int("n_experts", self.n_experts)
        _positive_int("top_k", self.top_k)
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} is more than n_experts={self.n_experts}: a token cannot run "
                             "through more experts than there are")
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < math.inf):
            raise ValueError(f"ModelConfig.capacity_factor must be a positive number or None (no dropping), got {c!r}")

    def _check_modern(self) -> None:
        for name in ("qk_norm", "scale_embeddings", "sandwich_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        for name in ("rope_local_base", "attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < math.inf):
                raise ValueError(f"ModelConfig.{name} must be a positive number or None (off), got {value!r}")
        if self.rope_local_base is not None and (not self.rope_local_base > 1 or self.positional != "rope"):
            raise ValueError(f"ModelConfig.rope_local_base is the local layers' RoPE base: it needs positional='rope' "
                             f"and a number > 1, got {self.rope_local_base!r} with positional={self.positional!r}")
        if self.layer_types is not None:
            if isinstance(self.layer_types, list):  # config.json and transformers give lists
                object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.n_layers \
                    or any(kind not in LAYER_TYPES for kind in self.layer_types):
                unknown = [kind for kind in self.layer_types if kind not in LAYER_TYPES] \
                    if isinstance(self.layer_types, tuple) else []
                raise ValueError(f"ModelConfig.layer_types must hold one of {LAYER_TYPES} per layer "
                                 f"(n_layers={self.n_layers}), got {self.layer_types!r}"
                                 + (f": {unknown[0]!r} is not a layer type" if unknown else ""))
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types names sliding_attention layers but sliding_window is None: "
                                 "give the window (keys each local query sees)")
        _positive_int("d_state", self.d_state)
        if self.activation == "geglu" and self.n_experts is not None:
            raise ValueError("the experts of tfedu.moe gate with SwiGLU only: activation='geglu' needs n_experts=None")

    def is_local(self, layer: int) -> bool:
        """Whether block ``layer`` attends within ``sliding_window`` (True) or to every earlier key (False).

        >>> cfg = ModelConfig(d_model=64, n_heads=4, n_layers=2, sliding_window=8,
        ...                   layer_types=("sliding_attention", "full_attention"))
        >>> cfg.is_local(0), cfg.is_local(1), ModelConfig().is_local(0)
        (True, False, False)
        """
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def is_recurrent(self, layer: int) -> bool:
        """Whether block ``layer`` mixes positions with a recurrence (``RECURRENT_LAYER_TYPES``) instead of attention.

        >>> cfg = ModelConfig(d_model=64, n_heads=4, n_layers=2, layer_types=("gla", "full_attention"))
        >>> cfg.is_recurrent(0), cfg.is_recurrent(1), cfg.has_recurrent_layers
        (True, False, True)
        """
        return self.layer_types is not None and self.layer_types[layer] in RECURRENT_LAYER_TYPES

    @property
    def has_recurrent_layers(self) -> bool:
        """True when any block is a recurrent mixer: such a model is causal only and keeps no KV cache."""
        return self.layer_types is not None and any(kind in RECURRENT_LAYER_TYPES for kind in self.layer_types)

    def as_dict(self) -> dict:
        """The fields as given, for JSON: derived ones (d_head, n_kv_heads, d_mlp) only if they were given.

        ``ModelConfig(**cfg.as_dict()) == cfg``, and it derives them again the same way.

        >>> ModelConfig(d_model=64, n_heads=4, n_layers=1).as_dict()["d_head"] is None
        True
        """
        return {f.name: (None if f.name in _DERIVED and f.name not in self._explicit else getattr(self, f.name))
                for f in dataclasses.fields(self) if f.init}

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with ``changes``; ``d_head``, ``n_kv_heads`` and ``d_mlp`` are derived again unless given.

        >>> ModelConfig(d_model=64, n_heads=4, n_layers=1).replace(activation="swiglu").d_mlp
        170
        """
        unknown = set(changes) - {f.name for f in dataclasses.fields(self) if f.init}
        if unknown:
            raise TypeError(f"ModelConfig has no field(s) {', '.join(sorted(unknown))}")
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name in _DERIVED:
            if name not in self._explicit:
                values[name] = None
        values.update(changes)
        return ModelConfig(**values)

    @property
    def has_mlp(self) -> bool:
        """False for attention-only blocks (``d_mlp=0``), the toy models of Elhage et al. (2021).

        >>> ModelConfig(d_model=64, n_heads=4, n_layers=1, d_mlp=0).has_mlp
        False
        """
        return self.d_mlp > 0

    @property
    def n_groups(self) -> int:
        """Query heads per key/value head: 1 for multi-head attention, n_heads for multi-query."""
        return self.n_heads // self.n_kv_heads


# ----------------------------------------------------------------------------- presets

# Sizes from the papers: GPT-2 (Radford et al. 2019, table 2 and the released configs),
# GPT-3 (Brown et al. 2020, table 2.1), the original Transformer (Vaswani et al. 2017, table 3;
# its shared English-German BPE vocabulary has about 37,000 tokens, sec. 5.1) and Llama (Touvron
# et al. 2023, table 2 and the released configs).
_GPT2 = dict(d_vocab=50257, n_ctx=1024, activation="gelu_tanh", positional="learned")
PRESETS: dict[str, ModelConfig] = {
    "gpt2": ModelConfig(**_GPT2, d_model=768, n_layers=12, n_heads=12),
    "gpt2-medium": ModelConfig(**_GPT2, d_model=1024, n_layers=24, n_heads=16),
    "gpt2-large": ModelConfig(**_GPT2, d_model=1280, n_layers=36, n_heads=20),
    "gpt2-xl": ModelConfig(**_GPT2, d_model=1600, n_layers=48, n_heads=25),
    # GPT-3 is GPT-2's architecture scaled up (Brown et al. 2020, sec. 2.1), tied embeddings included:
    # counted that way it has 174,604,259,328 parameters, the 174,600M of their table D.1.
    "gpt3": ModelConfig(d_vocab=50257, n_ctx=2048, d_model=12288, n_layers=96, n_heads=96, activation="gelu"),
    "transformer-base": ModelConfig(d_vocab=37000, n_ctx=512, d_model=512, n_layers=6, n_heads=8, d_mlp=2048,
                                    positional="sinusoidal", norm_position="post", activation="relu",
                                    norm_eps=1e-6, dropout=0.1),
    "transformer-big": ModelConfig(d_vocab=37000, n_ctx=512, d_model=1024, n_layers=6, n_heads=16, d_mlp=4096,
                                   positional="sinusoidal", norm_position="post", activation="relu",
                                   norm_eps=1e-6, dropout=0.3),
    "llama-7b": ModelConfig(d_vocab=32000, n_ctx=2048, d_model=4096, n_layers=32, n_heads=32, d_mlp=11008,
                            positional="rope", norm="rms", norm_eps=1e-6, activation="swiglu", bias=False,
                            tied_embeddings=False),
    # Small enough to train in seconds on a laptop CPU: the notebooks' default.
    "tiny": ModelConfig(d_vocab=256, n_ctx=64, d_model=64, n_layers=2, n_heads=4),
    # Today's small open models (notebooks/16). Every number is the released config.json's (hidden_size, layers,
    # heads, kv heads, head_dim, intermediate_size, vocab_size, tie_word_embeddings, rope_theta, rms_norm_eps,
    # max_position_embeddings, sliding_window, layer_types); tests/test_presets.py counts their parameters.
    # meta-llama/Llama-3.2-1B config.json (Meta 2024): 1,235,814,400 parameters, "1.24B" on the model page.
    "llama-3.2-1b": ModelConfig(d_vocab=128256, n_ctx=131072, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                d_head=64, d_mlp=8192, positional="rope", rope_base=500000.0, norm="rms",
                                norm_eps=1e-5, activation="swiglu", bias=False, tied_embeddings=True,
                                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen/Qwen3-0.6B config.json (Yang et al. 2025, table 1): 596,049,920 parameters, 440,467,456 without the
    # (tied) embedding: the model card's "0.6B" and "0.44B non-embedding".
    "qwen3-0.6b": ModelConfig(d_vocab=151936, n_ctx=40960, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                              d_head=128, d_mlp=3072, positional="rope", rope_base=1_000_000.0, norm="rms",
                              norm_eps=1e-6, activation="swiglu", bias=False, tied_embeddings=True, qk_norm=True),
    # google/gemma-3-270m config.json (Team Gemma 2025): 268,098,176 parameters, Google's "270M" (170M of them
    # the embedding, 100M the blocks). Five local layers (window 512, RoPE base 10,000) to one global (1,000,000).
    "gemma-3-270m": ModelConfig(d_vocab=262144, n_ctx=32768, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1,
                                d_head=256, d_mlp=2048, positional="rope", rope_base=1_000_000.0,
                                rope_local_base=10_000.0, norm="gemma_rms", norm_eps=1e-6, activation="geglu",
                                bias=False, tied_embeddings=True, qk_norm=True, sandwich_norm=True,
                                scale_embeddings=True, query_pre_attn_scalar=256, sliding_window=512,
                                layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                  for i in range(18))),
}


def hybrid_layer_types(n_layers: int, mixer: str, every: int = 4) -> tuple[str, ...]:
    """``layer_types`` for a hybrid: ``mixer`` layers with full attention every ``every``-th layer and in the last.

    Today's hybrids keep a few attention layers for exact recall and make the rest linear-time:
    Qwen3-Next has three Gated DeltaNet layers to one attention layer (``every=4``; Qwen team 2025), Kimi Linear
    the same 3:1 (Kimi team 2025), Jamba one attention layer in eight (``every=8``, Lieber et al. 2024). The last
    layer is always attention, so the last read of the sequence before the unembedding is exact.

    >>> hybrid_layer_types(4, "gated_deltanet")
    ('gated_deltanet', 'gated_deltanet', 'gated_deltanet', 'full_attention')
    >>> hybrid_layer_types(6, "mamba")  # every 4th layer and the last
    ('mamba', 'mamba', 'mamba', 'full_attention', 'mamba', 'full_attention')
    >>> cfg = ModelConfig(d_vocab=64, n_ctx=16, d_model=32, n_layers=4, n_heads=4,
    ...                   layer_types=hybrid_layer_types(4, "gla"))

    Built up in notebooks/19_beyond_attention.ipynb.
    """
    for name, value in (("n_layers", n_layers), ("every", every)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"hybrid_layer_types: {name} must be a positive int, got {value!r}")
    if mixer not in LAYER_TYPES or mixer == "full_attention":
        raise ValueError(f"mixer={mixer!r} must be a layer type other than 'full_attention': one of "
                         f"{', '.join(map(repr, LAYER_TYPES[1:]))}")
    return tuple("full_attention" if (i + 1) % every == 0 or i == n_layers - 1 else mixer for i in range(n_layers))


def preset(name: str) -> ModelConfig:
    """The named configuration; ``tfedu.config.PRESETS`` lists them.

    >>> preset("llama-7b").d_mlp, preset("llama-7b").d_head
    (11008, 128)
    """
    if name not in PRESETS:
        raise KeyError(f"no preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]

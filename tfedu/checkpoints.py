"""Real checkpoints in tfedu's ``GPT``: GPT-2, Llama, Qwen3 and Gemma 3 weights from ``transformers`` or safetensors.

The course builds every layer by hand; this module is the proof that the hand-built model *is* GPT-2
(or Llama): load the released weights and get the same logits. What has to be translated:

- **GPT-2** (Radford et al. 2019) stores its linear layers as ``Conv1D`` with weights ``[d_in, d_out]``
  (transposed from ``nn.Linear``'s ``[d_out, d_in]``), packs W_Q, W_K, W_V into one ``c_attn``
  matrix, uses the tanh approximation of GELU, learned positions, and ties W_U to W_E.
- **Llama** (Touvron et al. 2023) uses RMSNorm, SwiGLU (``gate_proj``, ``up_proj``, ``down_proj``
  are our ``W_gate``, ``W_in``, ``W_out``), no biases, RoPE on pairs (i, i + d_head/2) (the "half"
  layout of ``tfedu.positional.apply_rope``) and possibly fewer key/value heads than query heads.
- **Qwen3** (Yang et al. 2025) is Llama plus QK-norm; **Gemma 3** (Team Gemma 2025, text-only
  ``Gemma3ForCausalLM``) adds Gemma's RMSNorm (gain 1 + w), GeGLU, sandwich norms, embeddings times
  sqrt(d_model), its query scale, final-logit soft-capping and 5:1 local/global layers with two RoPE bases.
  All three share one weight layout and one table of names (``_decoder_keys``), used both ways:
  ``gpt_from_hf`` reads them, ``hf_from_gpt`` writes a tfedu model back into the family ``hf_kind`` names.

``pretrained("gpt2")`` reads real GPT-2 weights from disk only (a Hugging Face cache or a folder):
tfedu never downloads anything itself. The course's own models (``course-gpt``, ``induction-gpt``) are folders
written and read by ``tfedu.shipped_models``.

Built up in notebooks/07_transformer_block.ipynb.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from tfedu.config import ModelConfig, preset
from tfedu.model import GPT
from tfedu.shipped_models import SHIPPED, load_shipped

DECODERS = ("llama", "qwen3", "gemma3_text")  # one layout of weights: model.layers.i.self_attn.q_proj, ...
SUPPORTED = ("gpt2", *DECODERS)


def _get(config: object, name: str, default: object = None) -> object:
    return config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)


def config_from_hf(hf_config: object, **overrides: object) -> tuple[ModelConfig, str]:
    """``(ModelConfig, model_type)`` for a ``transformers`` config object or a config.json dict.

    >>> cfg, kind = config_from_hf({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
    ...                             "n_positions": 32, "vocab_size": 100})
    >>> kind, cfg.d_model, cfg.activation, cfg.tied_embeddings
    ('gpt2', 64, 'gelu_tanh', True)
    """
    kind = _get(hf_config, "model_type")
    if kind == "gpt2":
        activation = _get(hf_config, "activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 with activation {activation!r}: tfedu's GPT-2 uses the tanh GELU (gelu_new)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if _get(hf_config, flag, False):
                raise ValueError(f"GPT-2 with {flag}=True has no counterpart in tfedu's attention")
        if not _get(hf_config, "scale_attn_weights", True):
            raise ValueError("GPT-2 with scale_attn_weights=False skips the 1/sqrt(d_head); tfedu's attention always scales")
        fields = dict(
            d_vocab=_get(hf_config, "vocab_size"), n_ctx=_get(hf_config, "n_positions"), d_model=_get(hf_config, "n_embd"),
            n_layers=_get(hf_config, "n_layer"), n_heads=_get(hf_config, "n_head"), d_mlp=_get(hf_config, "n_inner"),
            positional="learned", norm="layer", norm_eps=_get(hf_config, "layer_norm_epsilon", 1e-5),
            activation="gelu_tanh", bias=True,
            # Released GPT-2s tie W_U to W_E, but the config may untie them (then lm_head is its own matrix).
            tied_embeddings=bool(_get(hf_config, "tie_word_embeddings", True)),
        )
    elif kind in DECODERS:
        fields = _decoder_fields(hf_config, kind)
    else:
        raise ValueError(f"model_type {kind!r} is not supported; tfedu loads {', '.join(SUPPORTED)}")
    fields.update(overrides)
    return ModelConfig(**fields), kind


def _rope_fields(hf_config: object, kind: str) -> dict:
    """RoPE's base, scaling and (Gemma 3) local base, from transformers 5's ``rope_parameters`` or 4.x's fields."""
    params = dict(_get(hf_config, "rope_parameters") or {})
    local = None
    if kind == "gemma3_text":
        # transformers 5: one dict per layer type; 4.x configs (the released config.json): rope_theta for the global
        # layers, rope_local_base_freq for the local ones, rope_scaling for the global ones only.
        if "full_attention" in params or "sliding_attention" in params:
            local, params = dict(params.get("sliding_attention") or {}), dict(params.get("full_attention") or {})
        else:
            params = dict(params or _get(hf_config, "rope_scaling") or {})
        params.setdefault("rope_theta", _get(hf_config, "rope_theta", 1_000_000.0))
        local = local or {"rope_theta": _get(hf_config, "rope_local_base_freq", 10_000.0)}
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(f"Gemma 3 with RoPE scaling on its local layers ({local}): tfedu scales the global ones only")
    else:
        params = dict(params or _get(hf_config, "rope_scaling") or {})
    base = float(params.pop("rope_theta", None) or _get(hf_config, "rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **params}
    return dict(positional="rope", rope_layout="half", rope_base=base, rope_scaling=scaling,
                rope_local_base=None if local is None else float(local.get("rope_theta", 10_000.0)))


def _decoder_fields(hf_config: object, kind: str) -> dict:
    """ModelConfig fields for a Llama, Qwen3 or Gemma 3 (text) config: Llama's parts plus what each adds.

    Qwen3 (Yang et al. 2025) adds QK-norm. Gemma 3 (Team Gemma 2025) adds QK-norm, RMSNorm with gain 1 + w,
    GeGLU, sandwich norms, embeddings times sqrt(d_model), a query scale of query_pre_attn_scalar ** -0.5, final
    logit soft-capping and five local (sliding-window) layers to one global with their own RoPE base.
    """
    gemma = kind == "gemma3_text"
    act_key, act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    if _get(hf_config, act_key, act) != act:
        raise ValueError(f"{kind} with {act_key}={_get(hf_config, act_key)!r}: tfedu's "
                         f"{'GeGLU needs gelu_pytorch_tanh' if gemma else 'SwiGLU needs silu'}")
    attention_bias = bool(_get(hf_config, "attention_bias", False))
    mlp_bias = bool(_get(hf_config, "mlp_bias", False)) if kind == "llama" else False  # (no MLP bias in Qwen3, Gemma)
    if attention_bias != mlp_bias:
        raise ValueError(f"tfedu's cfg.bias covers attention and MLP together; this {kind} has bias in only one")
    fields = dict(
        d_vocab=_get(hf_config, "vocab_size"), n_ctx=_get(hf_config, "max_position_embeddings"),
        d_model=_get(hf_config, "hidden_size"), n_layers=_get(hf_config, "num_hidden_layers"),
        n_heads=_get(hf_config, "num_attention_heads"), n_kv_heads=_get(hf_config, "num_key_value_heads"),
        d_head=_get(hf_config, "head_dim"), d_mlp=_get(hf_config, "intermediate_size"),
        norm="gemma_rms" if gemma else "rms", norm_eps=_get(hf_config, "rms_norm_eps", 1e-6),
        activation="geglu" if gemma else "swiglu", bias=attention_bias, qk_norm=kind != "llama",
        tied_embeddings=bool(_get(hf_config, "tie_word_embeddings", gemma)), **_rope_fields(hf_config, kind),
    )
    layer_types = _get(hf_config, "layer_types")
    window = _get(hf_config, "sliding_window")
    if kind == "qwen3" and (_get(hf_config, "use_sliding_window", False) or "sliding_attention" in (layer_types or ())):
        raise ValueError("Qwen3 with sliding-window layers (use_sliding_window=True) is not supported; the released "
                         "Qwen3 models attend globally everywhere")
    if gemma:
        if _get(hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True is an encoder; tfedu's GPT is causal")
        if layer_types is None:  # 4.x config.json: every sliding_window_pattern-th layer global
            every = _get(hf_config, "sliding_window_pattern", None) or _get(hf_config, "_sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                           for i in range(fields["n_layers"])]
        fields |= dict(
            sandwich_norm=True, scale_embeddings=True, sliding_window=window, layer_types=tuple(layer_types),
            query_pre_attn_scalar=_get(hf_config, "query_pre_attn_scalar", 256),
            final_logit_softcap=_get(hf_config, "final_logit_softcapping"),
            # Gemma 3 dropped Gemma 2's attention soft-capping for QK-norm: transformers' Gemma3Attention never applies
            # attn_logit_softcapping (it is not passed to the attention function), so neither does the copy.
            attn_logit_softcap=None,
        )
    return fields


def _decoder_keys(cfg: ModelConfig) -> dict[str, str]:
    """transformers' name -> tfedu's for every weight of a Llama / Qwen3 / Gemma 3 model (``model.`` prefix left off).

    One table for both directions (``gpt_from_hf`` and ``hf_from_gpt``). Note the one name that moves: with
    sandwich norms (Gemma) ``post_attention_layernorm`` normalises the attention's output (our ``ln1_post``) and
    ``pre_feedforward_layernorm`` is the MLP's input norm (``ln2``); in Llama and Qwen3 ``post_attention_layernorm``
    is that input norm.
    """
    keys = {"embed_tokens.weight": "embed.weight", "norm.weight": "ln_final.weight"}
    linear = {"self_attn.q_proj": "attn.W_Q", "self_attn.k_proj": "attn.W_K", "self_attn.v_proj": "attn.W_V",
              "self_attn.o_proj": "attn.W_O", "mlp.gate_proj": "mlp.W_gate", "mlp.up_proj": "mlp.W_in",
              "mlp.down_proj": "mlp.W_out"}
    norms = {"input_layernorm": "ln1"}
    if cfg.sandwich_norm:
        norms |= {"post_attention_layernorm": "ln1_post", "pre_feedforward_layernorm": "ln2",
                  "post_feedforward_layernorm": "ln2_post"}
    else:
        norms["post_attention_layernorm"] = "ln2"
    if cfg.qk_norm:
        norms |= {"self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
    for i in range(cfg.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        for theirs, ours in linear.items():
            keys[h + theirs + ".weight"] = b + ours + ".weight"  # nn.Linear on both sides: no transpose
            if cfg.bias:
                keys[h + theirs + ".bias"] = b + ours + ".bias"
        for theirs, ours in norms.items():
            keys[h + theirs + ".weight"] = b + ours + ".weight"
    return keys


def _strip_prefix(state_dict: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {(key[len(prefix):] if key.startswith(prefix) else key): value for key, value in state_dict.items()}


def _gpt2_state_dict(sd: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    lm_head = sd.get("lm_head.weight")
    sd = _strip_prefix(sd, "transformer.")
    out = {"embed.weight": sd["wte.weight"], "pos_embed.W_pos": sd["wpe.weight"],
           "ln_final.weight": sd["ln_f.weight"], "ln_final.bias": sd["ln_f.bias"]}
    if not cfg.tied_embeddings:
        if lm_head is None:
            raise KeyError("lm_head.weight")
        out["unembed.weight"] = lm_head
    for i in range(cfg.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        c_attn = sd[h + "attn.c_attn.weight"]
        if c_attn.shape != (cfg.d_model, 3 * cfg.d_model):
            raise ValueError(
                f"{h}attn.c_attn.weight has shape {tuple(c_attn.shape)}, but d_model={cfg.d_model} needs "
                f"(d_model, 3 * d_model) = ({cfg.d_model}, {3 * cfg.d_model}): do config and weights belong together?"
            )
        # Conv1D keeps weights as [d_in, d_out]: nn.Linear wants the transpose.
        w_q, w_k, w_v = c_attn.T.split(cfg.d_model, dim=0)
        b_q, b_k, b_v = sd[h + "attn.c_attn.bias"].split(cfg.d_model)
        out |= {
            b + "ln1.weight": sd[h + "ln_1.weight"], b + "ln1.bias": sd[h + "ln_1.bias"],
            b + "attn.W_Q.weight": w_q, b + "attn.W_K.weight": w_k, b + "attn.W_V.weight": w_v,
            b + "attn.W_Q.bias": b_q, b + "attn.W_K.bias": b_k, b + "attn.W_V.bias": b_v,
            b + "attn.W_O.weight": sd[h + "attn.c_proj.weight"].T, b + "attn.W_O.bias": sd[h + "attn.c_proj.bias"],
            b + "ln2.weight": sd[h + "ln_2.weight"], b + "ln2.bias": sd[h + "ln_2.bias"],
            b + "mlp.W_in.weight": sd[h + "mlp.c_fc.weight"].T, b + "mlp.W_in.bias": sd[h + "mlp.c_fc.bias"],
            b + "mlp.W_out.weight": sd[h + "mlp.c_proj.weight"].T, b + "mlp.W_out.bias": sd[h + "mlp.c_proj.bias"],
        }
    return out


def _decoder_state_dict(sd: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    lm_head = sd.get("lm_head.weight")
    sd = _strip_prefix(sd, "model.")
    out = {ours: sd[theirs] for theirs, ours in _decoder_keys(cfg).items()}
    if not cfg.tied_embeddings:
        if lm_head is None:
            raise KeyError("lm_head.weight")
        out["unembed.weight"] = lm_head
    return out


def gpt_from_hf(source: object, config: object = None, **overrides: object) -> GPT:
    """A tfedu ``GPT`` computing what a ``transformers`` GPT-2, Llama, Qwen3 or Gemma 3 computes, its weights copied.

    ``source`` is a model (``GPT2LMHeadModel``, ``GPT2Model``, ``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
    ``Gemma3ForCausalLM``, ...) or a state
    dict; with a state dict, ``config`` (the ``transformers`` config or the config.json dict) is
    required, since head counts cannot be read off weight shapes. ``overrides`` change fields of
    the resulting ``ModelConfig`` (``attention="sdpa"``, ``dropout=0.1``). The new model has the
    source's dtype and device.
    """
    if isinstance(source, nn.Module):
        config = getattr(source, "config", None) if config is None else config
        state_dict = source.state_dict()
    elif isinstance(source, Mapping):
        state_dict = source
    else:
        raise TypeError(f"expected a transformers model or a state dict, got {type(source).__name__}")
    if config is None:
        raise ValueError(
            "a state dict alone does not say how many heads the model has: pass config= "
            "(the transformers config, or the dict in the checkpoint's config.json)"
        )
    cfg, kind = config_from_hf(config, **overrides)
    convert = _gpt2_state_dict if kind == "gpt2" else _decoder_state_dict
    layers = {int(m.group(1)) for key in state_dict if (m := re.search(r"(?:^|\.)(?:h|layers)\.(\d+)\.", key))}
    if layers and max(layers) + 1 != cfg.n_layers:
        # More blocks in the weights than in the config would otherwise be dropped without a word.
        raise ValueError(f"the {kind} state dict has {max(layers) + 1} blocks but the config says n_layers={cfg.n_layers}")
    try:
        ours = convert(state_dict, cfg)
    except KeyError as missing:
        untied = " (untied embeddings need their own lm_head.weight)" if "lm_head" in str(missing) else ""
        raise KeyError(f"the {kind} state dict has no entry {missing}{untied}; is it a {kind} checkpoint?") from None
    if cfg.tied_embeddings:
        ours["unembed.weight"] = ours["embed.weight"]
    # Copies, contiguous: training the tfedu model must never change the source model's weights.
    ours = {key: value.detach().clone().contiguous() for key, value in ours.items()}
    with torch.device("meta"):
        model = GPT(cfg)  # shapes only, no memory: every weight comes from the checkpoint
    try:
        model.load_state_dict(ours, strict=True, assign=True)
    except RuntimeError as error:
        raise ValueError(f"the {kind} weights do not fit the config {cfg}: {error}") from None
    if cfg.tied_embeddings:
        model.unembed.weight = model.embed.weight  # one Parameter again after assign=True
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{', '.join(left)} were not in the checkpoint (did an override add them?)")
    return model.eval()


def hf_kind(cfg: ModelConfig) -> str:
    """The ``transformers`` family whose parts ``cfg`` has: ``"gpt2"``, ``"llama"``, ``"qwen3"`` or ``"gemma3_text"``.

    Told apart by what each adds: RoPE + RMSNorm + SwiGLU is Llama, plus QK-norm Qwen3, Gemma's RMSNorm (gain
    1 + w) Gemma 3; anything else is taken for GPT-2 (``hf_from_gpt`` then says what does not fit).

    >>> [hf_kind(preset(name)) for name in ("gpt2", "llama-3.2-1b", "qwen3-0.6b", "gemma-3-270m")]
    ['gpt2', 'llama', 'qwen3', 'gemma3_text']
    """
    if cfg.norm == "gemma_rms":
        return "gemma3_text"
    if cfg.positional == "rope" and cfg.norm == "rms" and cfg.activation == "swiglu":
        return "qwen3" if cfg.qk_norm else "llama"
    return "gpt2"


def _hf_decoder_config(cfg: ModelConfig, kind: str) -> object:
    """The ``transformers`` config of family ``kind`` for ``cfg``; an error naming each field it cannot hold."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": cfg.rope_base} if cfg.rope_scaling is None else \
        {**cfg.rope_scaling, "rope_theta": cfg.rope_base}
    common = dict(vocab_size=cfg.d_vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_mlp,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.d_head, max_position_embeddings=cfg.n_ctx, rms_norm_eps=cfg.norm_eps,
                  tie_word_embeddings=cfg.tied_embeddings, attention_bias=cfg.bias, attention_dropout=cfg.dropout,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, mlp_bias=cfg.bias, hidden_act="silu", rope_parameters=rope)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**common, hidden_act="silu", rope_parameters=rope)
    else:
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_base or cfg.rope_base}
        layer_types = list(cfg.layer_types or ["sliding_attention" if cfg.is_local(i) else "full_attention"
                                               for i in range(cfg.n_layers)])
        config = transformers.Gemma3TextConfig(
            **common, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg.query_pre_attn_scalar,
            sliding_window=cfg.sliding_window, layer_types=layer_types, final_logit_softcapping=cfg.final_logit_softcap,
            attn_logit_softcapping=None, rope_parameters={"full_attention": rope, "sliding_attention": local})
    # Whatever the family cannot hold shows up as a field that does not come back.
    back, _ = config_from_hf(config)
    ignored = ("attention", "dropout", "init_std", "_explicit")
    if kind == "gemma3_text" and cfg.layer_types is None:
        ignored += ("layer_types",)  # (None and the list it stands for are the same model)
    differs = [f"{f.name}={getattr(cfg, f.name)!r} ({kind}: {getattr(back, f.name)!r})"
               for f in dataclasses.fields(cfg) if f.name not in ignored and getattr(cfg, f.name) != getattr(back, f.name)]
    if differs:
        raise ValueError(f"transformers' {kind} cannot hold this model: {', '.join(differs)}")
    return config


def hf_from_gpt(model: GPT) -> nn.Module:
    """A ``transformers`` model computing what a tfedu ``GPT`` computes: the inverse of :func:`gpt_from_hf`, so
    that ``transformers``' own generation (beam search, say) can run on tfedu's models.

    The family is ``hf_kind(model.cfg)``: a ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or ``Gemma3ForCausalLM``
    for a model with their parts (an error names any field the family cannot hold), else a ``GPT2LMHeadModel``,
    for which the model must have GPT-2's parts: learned positions, pre-norm LayerNorm, the tanh GELU, biases,
    one key and value head per query head. The weights are copied (GPT-2's ``Conv1D`` layers hold them
    transposed); dropout is taken from ``cfg.dropout``; the result is in evaluation mode, on the CPU in float32.

    >>> from tfedu.config import preset
    >>> _ = torch.manual_seed(0); ours = GPT(preset("tiny")).eval()
    >>> ids = torch.tensor([[5, 17, 99]])
    >>> torch.allclose(hf_from_gpt(ours)(ids).logits, ours(ids), atol=1e-5)
    True
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.cfg
    if cfg.has_recurrent_layers:
        raise ValueError(f"hf_from_gpt: layer_types {cfg.layer_types} has recurrent layers, which no transformers "
                         "GPT-2, Llama, Qwen3 or Gemma 3 model holds")
    kind = hf_kind(cfg)
    if kind != "gpt2":
        return _hf_decoder(model, kind)
    wanted = {"positional": "learned", "norm": "layer", "norm_position": "pre", "activation": "gelu_tanh", "bias": True,
              "n_kv_heads": cfg.n_heads, "d_head": cfg.d_model // cfg.n_heads, "n_experts": None}
    differs = [f"{name}={getattr(cfg, name)!r} (GPT-2: {value!r})" for name, value in wanted.items() if getattr(cfg, name) != value]
    if differs:
        raise ValueError(f"hf_from_gpt converts GPT-2-shaped models only; this one has {', '.join(differs)}")
    config = GPT2Config(vocab_size=cfg.d_vocab, n_positions=cfg.n_ctx, n_embd=cfg.d_model, n_layer=cfg.n_layers,
                        n_head=cfg.n_heads, n_inner=cfg.d_mlp, activation_function="gelu_new",
                        layer_norm_epsilon=cfg.norm_eps, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                        attn_pdrop=cfg.dropout, tie_word_embeddings=cfg.tied_embeddings,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    sd = {key: value.detach().float().cpu() for key, value in model.state_dict().items()}
    theirs = {"transformer.wte.weight": sd["embed.weight"], "transformer.wpe.weight": sd["pos_embed.W_pos"],
              "transformer.ln_f.weight": sd["ln_final.weight"], "transformer.ln_f.bias": sd["ln_final.bias"],
              "lm_head.weight": sd["embed.weight" if cfg.tied_embeddings else "unembed.weight"]}
    for i in range(cfg.n_layers):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        theirs |= {
            h + "ln_1.weight": sd[b + "ln1.weight"], h + "ln_1.bias": sd[b + "ln1.bias"],
            h + "attn.c_attn.weight": torch.cat([sd[b + f"attn.W_{x}.weight"] for x in "QKV"]).T,
            h + "attn.c_attn.bias": torch.cat([sd[b + f"attn.W_{x}.bias"] for x in "QKV"]),
            h + "attn.c_proj.weight": sd[b + "attn.W_O.weight"].T, h + "attn.c_proj.bias": sd[b + "attn.W_O.bias"],
            h + "ln_2.weight": sd[b + "ln2.weight"], h + "ln_2.bias": sd[b + "ln2.bias"],
            h + "mlp.c_fc.weight": sd[b + "mlp.W_in.weight"].T, h + "mlp.c_fc.bias": sd[b + "mlp.W_in.bias"],
            h + "mlp.c_proj.weight": sd[b + "mlp.W_out.weight"].T, h + "mlp.c_proj.bias": sd[b + "mlp.W_out.bias"],
        }
    hf = GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict({key: value.contiguous() for key, value in theirs.items()}, strict=False)
    left = [key for key in missing if not key.endswith((".attn.bias", ".attn.masked_bias"))]  # buffers
    if left or unexpected:
        raise ValueError(f"the GPT-2 weights did not fit: missing {left}, unexpected {unexpected}")
    return hf.eval()


def _hf_decoder(model: GPT, kind: str) -> nn.Module:
    import transformers

    cfg = model.cfg
    config = _hf_decoder_config(cfg, kind)
    sd = {key: value.detach().float().cpu() for key, value in model.state_dict().items()}
    theirs = {"model." + name: sd[ours] for name, ours in _decoder_keys(cfg).items()}
    theirs["lm_head.weight"] = sd["embed.weight" if cfg.tied_embeddings else "unembed.weight"]
    family = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
              "gemma3_text": transformers.Gemma3ForCausalLM}[kind]
    hf = family(config)
    missing, unexpected = hf.load_state_dict({key: value.contiguous() for key, value in theirs.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"the {kind} weights did not fit: missing {missing}, unexpected {unexpected}")
    if cfg.tied_embeddings:
        hf.tie_weights()
    return hf.eval()


# ----------------------------------------------------------------------------- weights on disk


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def candidate_folders(name: str) -> list[Path]:
    """Where ``pretrained(name)`` looks: the Hugging Face cache's snapshots of ``name`` (and ``openai-community/name``)."""
    repos = [name] if "/" in name else [name, f"openai-community/{name}"]
    folders = []
    for repo in repos:
        snapshots = _hub_cache() / f"models--{repo.replace('/', '--')}" / "snapshots"
        folders += sorted(snapshots.glob("*")) if snapshots.is_dir() else [snapshots / "<revision>"]
    return folders


def pretrained(name: str = "gpt2", *, path: str | os.PathLike | None = None, **overrides: object) -> GPT:
    """Real GPT-2 (or Llama, Qwen3, Gemma 3) weights in a tfedu ``GPT``, read from local files only.

    ``path`` is a folder holding ``model.safetensors`` (and ``config.json``); without it, the
    Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``)
    is searched for ``name``. If nothing is found this fails at once, saying where it looked and
    how to fetch the files while online. ``pretrained("course-gpt")`` is the course's own model,
    shipped in ``data/course-gpt`` (see ``tfedu.experiments.course_gpt``; its tokenizer: ``course_gpt.load()``);
    ``pretrained("induction-gpt")`` is notebook 15's two-layer attention-only model (``tfedu.experiments.induction``).
    Both come through ``tfedu.shipped_models``.
    """
    if name in SHIPPED:
        return load_shipped(name, path)[0]
    folders = [Path(path)] if path is not None else candidate_folders(name)
    for folder in folders:
        weights = folder / "model.safetensors"
        if weights.is_file():
            from safetensors.torch import load_file

            config_file = folder / "config.json"
            if config_file.is_file():
                config = json.loads(config_file.read_text())
            elif name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
                config = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
                          **dict(zip(("n_embd", "n_layer", "n_head"), _gpt2_shape(name)))}
            else:
                raise FileNotFoundError(f"{folder} has model.safetensors but no config.json")
            try:
                state_dict = load_file(str(weights))
            except Exception as error:  # safetensors raises its own error types for a damaged file
                raise ValueError(f"{weights} is not a readable safetensors file: {error}") from None
            return gpt_from_hf(state_dict, config, **overrides)
    looked = "\n  ".join(str(folder / "model.safetensors") for folder in folders)
    raise FileNotFoundError(
        f"no local weights for {name!r}. Looked in:\n  {looked}\n"
        f"tfedu never downloads. While online, fetch them into the cache with\n"
        f"  huggingface-cli download openai-community/{name} config.json model.safetensors\n"
        f"or put config.json and model.safetensors in a folder and call pretrained({name!r}, path=folder)."
    )


def _gpt2_shape(name: str) -> tuple[int, int, int]:
    cfg = preset(name)
    return cfg.d_model, cfg.n_layers, cfg.n_heads

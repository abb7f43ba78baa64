"""The presets of today's small open models have the published parameter counts, computed from their shapes."""

from __future__ import annotations

import pytest
import torch

from tfedu.checkpoints import config_from_hf, hf_kind
from tfedu.config import preset
from tfedu.flops import param_count
from tfedu.model import GPT

# Tiny tensors: a second torch thread only adds hand-off cost on a busy 2-core box (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# name: (exact count of the shapes, the published total it rounds to, its unit, non-embedding or None)
# Sources: the model pages / cards. Llama 3.2 1B: "1.24B params" (Hugging Face model page of meta-llama/Llama-3.2-1B);
# Qwen3-0.6B model card: "Number of Parameters: 0.6B; Number of Parameters (Non-Embedding): 0.44B";
# Gemma 3 270M: Google's announcement (2025-08-14): "270 million parameters: 170 million embedding parameters ...
# and 100 million for our transformer blocks"; 268,098,176 is the "268M" of its model page.
PUBLISHED = {
    "llama-3.2-1b": (1_235_814_400, 1.24, 1e9, None),
    "qwen3-0.6b": (596_049_920, 0.6, 1e9, 0.44),
    "gemma-3-270m": (268_098_176, 268, 1e6, 100),
}


def count(cfg):
    """Parameters of the tfedu GPT built from ``cfg`` on the meta device (shapes only): (total, non-embedding)."""
    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())  # a tied W_U is W_E: counted once
    return total, total - model.embed.weight.numel() - (0 if cfg.tied_embeddings else model.unembed.weight.numel())


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_parameter_counts_equal_the_published_ones(name):
    exact, published, unit, non_embedding = PUBLISHED[name]
    total, body = count(preset(name))
    assert total == exact
    assert (param_count(preset(name)).total, param_count(preset(name)).non_embedding) == (total, body)  # the formula
    digits = len(str(published).split(".")[1]) if "." in str(published) else 0
    assert round(total / unit, digits) == published
    if non_embedding is not None:
        assert round(body / unit, 2 if unit == 1e9 else 0) == non_embedding
    if name == "gemma-3-270m":
        assert (round((total - body) / 1e6), round(body / 1e6)) == (168, 100)  # "170M embedding, 100M blocks"


def test_preset_shapes():
    llama, qwen, gemma = (preset(name) for name in PUBLISHED)
    assert (llama.d_model, llama.n_layers, llama.n_heads, llama.n_kv_heads, llama.d_head, llama.d_mlp, llama.d_vocab,
            llama.tied_embeddings, llama.rope_base, llama.rope_scaling["factor"]) == \
        (2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 32.0)
    assert (qwen.d_model, qwen.n_layers, qwen.n_heads, qwen.n_kv_heads, qwen.d_head, qwen.d_mlp, qwen.d_vocab,
            qwen.tied_embeddings, qwen.qk_norm, qwen.rope_base) == (1024, 28, 16, 8, 128, 3072, 151936, True, True, 1e6)
    assert (gemma.d_model, gemma.n_layers, gemma.n_heads, gemma.n_kv_heads, gemma.d_head, gemma.d_mlp, gemma.d_vocab,
            gemma.sliding_window, gemma.rope_local_base, gemma.rope_base, gemma.query_pre_attn_scalar) == \
        (640, 18, 4, 1, 256, 2048, 262144, 512, 10000.0, 1e6, 256)
    assert [i for i in range(18) if not gemma.is_local(i)] == [5, 11, 17]  # five local to one global


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_survive_a_trip_through_transformers_config(name):
    """Each preset is a config its family holds: converting to transformers' config and back changes nothing."""
    pytest.importorskip("transformers")
    from tfedu.checkpoints import _hf_decoder_config

    cfg = preset(name)
    back, kind = config_from_hf(_hf_decoder_config(cfg, hf_kind(cfg)))
    assert kind == hf_kind(cfg) and back == cfg

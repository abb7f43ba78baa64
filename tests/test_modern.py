"""What separates Llama 3, Qwen3 and Gemma 3 from GPT-2 (notebooks/16), each against transformers built locally.

QK-norm, sliding-window attention and its ring-buffer cache, RoPE base per layer kind, soft-capping, Gemma's
norm, GeGLU, sandwich norms and embedding scale; then whole models converted both ways (``gpt_from_hf`` /
``hf_from_gpt``) for ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` and ``Gemma3ForCausalLM``: the same logits within
1e-5 in float32 on random weights (norm weights moved off their init, so a missing or misplaced norm shows), the
same greedy tokens with the cache, and the same code reading a checkpoint written with ``save_pretrained``.
"""

from __future__ import annotations

import pytest
import torch

from tfedu.checkpoints import config_from_hf, gpt_from_hf, hf_from_gpt, pretrained
from tfedu.config import ModelConfig
from tfedu.generate import generate
from tfedu.kv_cache import KVCache, RingKVCache, kv_cache_bytes
from tfedu.layers import MLP, Attention, RMSNorm, sliding_window_mask
from tfedu.model import GPT

transformers = pytest.importorskip("transformers")

# Tiny tensors: a second torch thread only adds hand-off cost on a busy 2-core box (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

D_VOCAB = 97
COMMON = dict(vocab_size=D_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
WINDOW = 4  # Gemma's tiny models below: 5 local layers of window 4, then one global


def perturbed(model):
    """``model`` with every norm gain moved off its init (1, or 0 for Gemma's 1 + w), so a skipped norm changes logits."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    return model.eval()


def llama(**changes):
    torch.manual_seed(0)
    rope = changes.pop("rope_parameters", {"rope_type": "default", "rope_theta": 5000.0})
    return perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON | changes, rope_parameters=rope)))


def qwen3(**changes):
    torch.manual_seed(0)
    return perturbed(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON | changes)))


def gemma3(**changes):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        **COMMON | dict(sliding_window=WINDOW, query_pre_attn_scalar=12, final_logit_softcapping=3.0) | changes,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    return perturbed(transformers.Gemma3ForCausalLM(config))


FAMILIES = {"llama": llama, "qwen3": qwen3, "gemma3": gemma3}


def ids_like(batch=2, pos=21, seed=0):
    return torch.randint(0, D_VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the pieces


def test_sliding_window_mask_is_transformers_mask():
    """A window of w lets a query see w keys, itself included: transformers' kv_idx > q_idx - w, on a causal mask."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    for window in (1, 2, 3, 7):
        theirs = sliding_window_causal_mask_function(window)
        q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
        expected = theirs(torch.tensor(0), torch.tensor(0), q, k).expand(9, 9)
        assert torch.equal(sliding_window_mask(9, 9, window), expected), window
        # Each query sees min(its position + 1, window) keys: the window counts the query itself.
        assert torch.equal(sliding_window_mask(9, 9, window).sum(-1), torch.clamp(torch.arange(9) + 1, max=window))
    # Aligned to the end, like causal_mask: the last 2 queries of 9 positions.
    assert torch.equal(sliding_window_mask(2, 9, 3), sliding_window_mask(9, 9, 3)[-2:])
    with pytest.raises(ValueError, match="window must be a positive int"):
        sliding_window_mask(3, 3, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rmsnorm_geglu_and_embedding_scale_equal_transformers(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

    torch.manual_seed(0)
    theirs = Gemma3RMSNorm(16, eps=1e-6)
    torch.nn.init.normal_(theirs.weight)
    ours = RMSNorm(16, eps=1e-6, unit_offset=True)
    ours.load_state_dict(theirs.state_dict())
    x = 3 * torch.randn(2, 5, 16)
    assert torch.equal(ours.to(dtype)(x.to(dtype)), theirs.to(dtype)(x.to(dtype)))  # (1 + w), multiplied before the cast

    config = transformers.Gemma3TextConfig(**COMMON)
    their_mlp = Gemma3MLP(config)
    our_mlp = MLP(32, 48, activation="geglu", bias=False)
    our_mlp.load_state_dict({"W_gate.weight": their_mlp.gate_proj.weight, "W_in.weight": their_mlp.up_proj.weight,
                             "W_out.weight": their_mlp.down_proj.weight})
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(our_mlp.to(dtype)(x.to(dtype)), their_mlp.to(dtype)(x.to(dtype)), rtol=0, atol=0)

    # sqrt(d_model) is rounded to the weights' dtype before the product, as in transformers (bf16: 25.298 -> 25.25).
    cfg = ModelConfig(d_vocab=D_VOCAB, n_ctx=16, d_model=640, n_layers=1, n_heads=4, scale_embeddings=True,
                      positional="none")
    model = GPT(cfg).to(dtype)
    embedding = Gemma3TextScaledWordEmbedding(D_VOCAB, 640, None, embed_scale=640**0.5).to(dtype)
    embedding.weight.data.copy_(model.embed.weight.data)
    ids = ids_like(pos=5)
    assert torch.equal(model.embed_tokens(ids), embedding(ids))


def test_attention_soft_capping_and_query_scale_equal_gemma2_eager_attention():
    """Gemma 2's cap * tanh(scores / cap) before the mask, and scores scaled by query_pre_attn_scalar ** -0.5."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    torch.manual_seed(0)
    attn = Attention(16, 4, n_kv_heads=2, d_head=8, bias=False, scale=12 ** -0.5, softcap=1.5).eval()
    x = 4 * torch.randn(2, 7, 16)  # big enough that the cap bends the scores
    q = attn.split_heads(attn.W_Q(x))
    k, v = (attn.split_heads(W(x), 2) for W in (attn.W_K, attn.W_V))
    mask = torch.zeros(7, 7).masked_fill(~sliding_window_mask(7, 7, 7), float("-inf"))
    module = torch.nn.Module().eval()
    module.num_key_value_groups = 2
    z, _ = eager_attention_forward(module, q, k, v, mask, scaling=12 ** -0.5, softcap=1.5)
    torch.testing.assert_close(attn(x, causal=True), attn.W_O(z.flatten(2)), rtol=0, atol=1e-6)
    uncapped = Attention(16, 4, n_kv_heads=2, d_head=8, bias=False, scale=12 ** -0.5)
    uncapped.load_state_dict(attn.state_dict())
    assert not torch.allclose(uncapped(x, causal=True), attn(x, causal=True), atol=1e-3)  # the cap mattered
    sdpa = Attention(16, 4, n_kv_heads=2, d_head=8, bias=False, scale=12 ** -0.5, impl="sdpa")
    sdpa.load_state_dict(attn.state_dict())
    torch.testing.assert_close(sdpa(x, causal=True), uncapped(x, causal=True), rtol=0, atol=1e-6)


def test_config_fields_default_off_and_refuse_bad_values():
    cfg = ModelConfig()
    assert (cfg.qk_norm, cfg.sliding_window, cfg.layer_types, cfg.rope_local_base, cfg.attn_logit_softcap,
            cfg.final_logit_softcap, cfg.scale_embeddings, cfg.sandwich_norm, cfg.query_pre_attn_scalar) == \
        (False, None, None, None, None, None, False, False, None)
    tiny = dict(d_vocab=10, n_ctx=8, d_model=16, n_layers=2, n_heads=2)
    assert ModelConfig(**tiny, sliding_window=3, layer_types=["full_attention", "sliding_attention"]).layer_types == \
        ("full_attention", "sliding_attention")  # a config.json list becomes a tuple
    assert [ModelConfig(**tiny, sliding_window=3).is_local(i) for i in (0, 1)] == [True, True]  # None: all local
    for bad, match in ((dict(layer_types=("full_attention",)), "one of .* per layer"),
                       (dict(layer_types=("sliding_attention", "full_attention")), "sliding_window is None"),
                       (dict(sliding_window=0), "sliding_window must be a positive int"),
                       (dict(attn_logit_softcap=-1.0), "attn_logit_softcap must be a positive number"),
                       (dict(qk_norm=1), "qk_norm must be True or False"),
                       (dict(activation="geglu", n_experts=2), "SwiGLU only")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**tiny, **bad)
    with pytest.raises(ValueError, match="qk_norm normalises each head with RMSNorm"):
        GPT(ModelConfig(**tiny, qk_norm=True))
    with pytest.raises(ValueError, match="sliding-window attention here is a causal decoder's"):
        Attention(16, 2, sliding_window=2)(torch.randn(1, 5, 16))


# ----------------------------------------------------------------------------- the ring-buffer cache


def windowed_model(**changes):
    torch.manual_seed(0)
    cfg = ModelConfig(d_vocab=D_VOCAB, n_ctx=64, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2, positional="rope",
                      norm="rms", activation="swiglu", bias=False, sliding_window=WINDOW, rope_local_base=100.0,
                      layer_types=("sliding_attention",) * 5 + ("full_attention",), **changes)
    return GPT(cfg).eval()


def test_ring_cache_keeps_window_minus_one_positions_oldest_first():
    ring = RingKVCache(1, 1, 4, 1, capacity=32)
    seen = []
    for chunk in (5, 1, 2, 1, 7):  # a prompt, single steps, and chunks longer than the ring
        new = torch.arange(len(seen), len(seen) + chunk, dtype=torch.float32).view(1, 1, chunk, 1)
        keys, values = ring.append(new, -new)
        assert keys.flatten().tolist() == seen[-3:] + new.flatten().tolist()  # the last window - 1, then the new ones
        assert torch.equal(values, -keys)
        seen += new.flatten().tolist()
    assert ring.length == 16 and ring.nbytes == 2 * 3 * 4
    ring.reorder(torch.tensor([0]))
    ring.reset()
    assert ring.length == 0
    with pytest.raises(ValueError, match=r"\(batch, n_kv_heads, pos, d_head\)"):
        ring.append(torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1))


def test_windowed_model_cached_equals_uncached_over_several_windows():
    model = windowed_model()
    ids = ids_like(pos=40)
    full = model(ids)
    cache = KVCache.for_model(model, batch=2)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["RingKVCache"] * 5 + ["LayerKVCache"]
    pieces, start = [], 0
    for chunk in (6, 1, 1, 9, 1, 3, *[1] * 19):  # prompts longer than the window, chunks, single steps
        pieces.append(model(ids[:, start:start + chunk], kv_cache=cache))
        start += chunk
    assert start == 40
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)
    # Five local layers hold window - 1 = 3 positions each, the global one all 64.
    assert cache.nbytes == kv_cache_bytes(model.cfg, 64, batch=2) == 2 * 2 * 2 * 8 * 4 * (5 * 3 + 64)
    global_only = KVCache.for_model(GPT(model.cfg.replace(sliding_window=None, layer_types=None)), batch=2)
    assert cache.nbytes < global_only.nbytes / 4


def test_windowed_model_greedy_tokens_with_cache_equal_uncached_and_padding():
    model = windowed_model()
    prompt = ids_like(pos=5)
    cached = generate(model, prompt, 30)  # 35 positions: several windows of 4
    assert torch.equal(cached, generate(model, prompt, 30, use_cache=False))
    # Left-padded prompts of different lengths: each row as it decodes alone.
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt[1:, :2]], dim=1)
    ids, mask = torch.cat([prompt[:1], padded]), torch.tensor([[True] * 5, [False] * 3 + [True] * 2])
    out = generate(model, ids, 12, padding_mask=mask)
    assert torch.equal(out[0], generate(model, prompt[:1], 12)[0])
    assert torch.equal(out[1, 3:], generate(model, prompt[1:, :2], 12)[0])


def test_windowed_beam_search_reorders_the_rings():
    from tfedu.generate import beam_search

    model = windowed_model()
    prompt = ids_like(pos=5)
    cached = beam_search(model, prompt, 14, num_beams=3)
    assert torch.equal(cached, beam_search(model, prompt, 14, num_beams=3, use_cache=False))


def test_only_local_layers_get_the_local_rope_base():
    model = windowed_model()
    assert [block.attn.rope_base for block in model.blocks] == [100.0] * 5 + [10000.0]
    assert [block.attn.sliding_window for block in model.blocks] == [WINDOW] * 5 + [None]


# ----------------------------------------------------------------------------- whole models, both ways


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_models_give_transformers_logits_both_ways(family):
    hf = FAMILIES[family]()
    ids = ids_like()
    ours = gpt_from_hf(hf)
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=0, atol=1e-5)
        back = hf_from_gpt(ours)
        torch.testing.assert_close(back(ids).logits, expected, rtol=0, atol=1e-5)
    assert type(back) is type(hf) and back.config.tie_word_embeddings == hf.config.tie_word_embeddings
    theirs = hf.state_dict()
    for name, value in back.state_dict().items():  # every weight back where it came from
        assert torch.equal(value, theirs[name]), name


def test_gemma3_conversion_reads_every_gemma_switch():
    cfg = gpt_from_hf(gemma3()).cfg
    assert (cfg.norm, cfg.activation, cfg.qk_norm, cfg.sandwich_norm, cfg.scale_embeddings) == \
        ("gemma_rms", "geglu", True, True, True)
    assert (cfg.sliding_window, cfg.layer_types.count("sliding_attention"), cfg.layer_types[5]) == \
        (WINDOW, 5, "full_attention")
    assert (cfg.rope_base, cfg.rope_local_base, cfg.query_pre_attn_scalar, cfg.final_logit_softcap) == \
        (100_000.0, 100.0, 12, 3.0)
    assert (gpt_from_hf(qwen3()).cfg.qk_norm, gpt_from_hf(llama()).cfg.qk_norm) == (True, False)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_with_the_cache_equal_transformers_generate(family):
    hf = FAMILIES[family]()
    ours = gpt_from_hf(hf)
    prompt = ids_like(batch=1, pos=6, seed=3)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert torch.equal(generate(ours, prompt, 20), theirs)


def test_llama3_rope_scaling_converts_both_ways():
    rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf = llama(rope_parameters=rope)
    ours = gpt_from_hf(hf)
    assert ours.cfg.rope_scaling["rope_type"] == "llama3" and ours.cfg.rope_base == 5000.0
    ids = ids_like(pos=40)  # past original_max_position_embeddings
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(hf_from_gpt(ours)(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_reads_a_save_pretrained_folder(family, tmp_path):
    hf = FAMILIES[family](tie_word_embeddings=family != "llama")
    hf.save_pretrained(tmp_path)
    ours = pretrained(family, path=tmp_path)
    ids = ids_like()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-5)
    assert ours.cfg.tied_embeddings == (family != "llama")


def test_old_style_gemma3_config_json_is_read_like_transformers():
    """Released config.json files (transformers 4.x) give rope_theta and rope_local_base_freq, no layer_types."""
    config = {"model_type": "gemma3_text", "vocab_size": D_VOCAB, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
              "max_position_embeddings": 64, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
              "sliding_window": 512, "sliding_window_pattern": 6, "rope_scaling": None,
              "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256}
    cfg, kind = config_from_hf(config)
    reference = transformers.Gemma3TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert kind == "gemma3_text" and list(cfg.layer_types) == reference.layer_types
    assert (cfg.rope_base, cfg.rope_local_base, cfg.tied_embeddings) == (1_000_000.0, 10_000.0, True)


@pytest.mark.parametrize("config, match", [
    (transformers.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=2),
     "Qwen3 with sliding-window layers"),
    (transformers.Gemma3TextConfig(**COMMON, use_bidirectional_attention=True), "use_bidirectional_attention"),
    (transformers.Gemma3TextConfig(**COMMON, hidden_activation="silu"), "GeGLU needs gelu_pytorch_tanh"),
    (transformers.Qwen3Config(**COMMON, attention_bias=True), "bias in only one"),
])
def test_configs_tfedu_cannot_reproduce_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(config)


def test_hf_from_gpt_names_what_the_family_cannot_hold():
    ours = gpt_from_hf(gemma3())
    with pytest.raises(ValueError, match=r"gemma3_text cannot hold this model: attn_logit_softcap=50.0"):
        hf_from_gpt(GPT(ours.cfg.replace(attn_logit_softcap=50.0)))
    with pytest.raises(ValueError, match=r"llama cannot hold this model: sliding_window=4"):
        hf_from_gpt(GPT(gpt_from_hf(llama()).cfg.replace(sliding_window=4)))

"""tfedu.kv_cache: cached decoding gives the uncached path's logits and tokens, and transformers' tokens.

Oracles: a GPT-2 and a grouped-query Llama built locally by ``transformers`` (random weights, no
network), whose ``generate(use_cache=True)`` gives the same greedy and beam tokens; and tfedu's own
uncached forward pass, which every cached forward must equal (learned positions, RoPE, ALiBi,
sinusoidal; MHA, GQA, MQA; manual and sdpa attention). Plus the overflow error, the cache's bytes
against the formula, beam reordering, hooks, and models that cannot keep a cache.
"""

import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tfedu.checkpoints import gpt_from_hf
from tfedu.config import preset
from tfedu.generate import beam_search, generate
from tfedu.kv_cache import (
    KVCache, LayerKVCache, decode_step, greedy_by_hand, kv_cache_bytes, pool_kv_heads, pool_kv_weight,
)
from tfedu.model import GPT, Encoder

# Weights of a trained model's size (peaked next-token distributions, far from ties); pytest puts tests/ on sys.path.
from test_checkpoints import randomise  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py

D_VOCAB, N_CTX = 50, 24


def hf_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=D_VOCAB, n_positions=N_CTX, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return randomise(GPT2LMHeadModel(config))


def hf_llama(n_kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=D_VOCAB, max_position_embeddings=N_CTX, hidden_size=32, intermediate_size=40,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=n_kv_heads,
                         bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return randomise(LlamaForCausalLM(config))


def tiny(**changes) -> GPT:
    torch.manual_seed(0)
    cfg = preset("tiny").replace(d_vocab=D_VOCAB, n_ctx=N_CTX, d_model=32, init_std=0.2, **changes)
    return GPT(cfg).eval()


# Every way positions and key/value heads enter attention, with both attention kernels.
VARIANTS = {
    "gpt2-learned": lambda attention: gpt_from_hf(hf_gpt2(), attention=attention),
    "llama-rope-gqa": lambda attention: gpt_from_hf(hf_llama(2), attention=attention),
    "llama-rope-mqa": lambda attention: gpt_from_hf(hf_llama(1), attention=attention),
    "alibi-gqa": lambda attention: tiny(positional="alibi", n_kv_heads=2, attention=attention),
    "sinusoidal-postnorm": lambda attention: tiny(positional="sinusoidal", norm_position="post", attention=attention),
}
MODELS = [(variant, attention) for variant in VARIANTS for attention in ("manual", "sdpa")]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{v}-{a}" for v, a in MODELS])
def model(request):
    variant, attention = request.param
    return VARIANTS[variant](attention)


def prompts(batch: int = 2, pos: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


def hf_generate(hf, ids, max_new_tokens, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, use_cache=True,
                           eos_token_id=None, pad_token_id=None, **kwargs)


# ----------------------------------------------------------------------------- the forward pass


def test_token_by_token_logits_equal_the_full_forward(model):
    ids = prompts(pos=N_CTX)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, batch=2)
        # A prompt of 7, a chunk of 3, then one token at a time: every split sees the same keys.
        pieces = [model(ids[:, :7], kv_cache=cache), model(ids[:, 7:10], kv_cache=cache)]
        pieces += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(10, N_CTX)]
    assert cache.length == N_CTX and all(layer.length == N_CTX for layer in cache.layers)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_cache_holds_n_kv_heads_and_its_bytes_are_the_formula():
    model = gpt_from_hf(hf_llama(1))  # multi-query: one key/value head for 4 query heads
    cache = KVCache.for_model(model, batch=3, capacity=10)
    assert cache.layers[0].keys.shape == (3, 1, 10, 8) and cache.layers[0].keys.dtype == torch.float32
    assert cache.nbytes == kv_cache_bytes(model.cfg, 10, batch=3) == 2 * 2 * 1 * 8 * 4 * 10 * 3
    half = gpt_from_hf(hf_llama(2)).to(torch.bfloat16)
    cache = KVCache.for_model(half, batch=1)
    assert cache.layers[1].values.dtype == torch.bfloat16
    assert cache.nbytes == kv_cache_bytes(half.cfg, N_CTX, dtype=torch.bfloat16) == 2 * 2 * 2 * 8 * 2 * N_CTX


def test_exceeding_n_ctx_is_a_clear_error_and_changes_nothing():
    model = tiny()
    cache = KVCache.for_model(model, batch=1)
    ids = prompts(batch=1, pos=N_CTX)
    with torch.no_grad():
        model(ids[:, :20], kv_cache=cache)
        with pytest.raises(ValueError, match=r"5 new token\(s\) after the 20 already cached make 25 positions, "
                                             r"more than n_ctx=24.*cannot slide"):
            model(ids[:, :5], kv_cache=cache)
        assert cache.length == 20  # nothing appended
        small = KVCache.for_model(model, batch=1, capacity=4)
        with pytest.raises(ValueError, match=r"more than its capacity=4 \(n_ctx=24\)"):
            model(ids[:, :5], kv_cache=small)
    with pytest.raises(ValueError, match="capacity must be an int in 1..n_ctx=24"):
        KVCache.for_model(model, batch=1, capacity=25)


def test_misuse_says_what_was_expected():
    model = tiny()
    ids = prompts()
    with pytest.raises(TypeError, match="kv_cache must be a tfedu.kv_cache.KVCache"):
        model(ids, kv_cache={})
    with pytest.raises(ValueError, match="ids has batch 2 but the KV cache holds 3 sequences"):
        model(ids, kv_cache=KVCache.for_model(model, batch=3))
    with pytest.raises(ValueError, match="the KV cache holds torch.float32 on cpu but the model computes in torch.float64"):
        tiny().double()(ids, kv_cache=KVCache.for_model(model, batch=2))
    cache = KVCache.for_model(model, batch=2)
    with torch.no_grad():
        model(ids, kv_cache=cache)
        with pytest.raises(ValueError, match=r"padding_mask must be a bool tensor \(batch, cached \+ pos\) = \(2, 6\): "
                                             r"the 5 positions the KV cache holds, then the ids'"):
            model(ids[:, :1], kv_cache=cache, padding_mask=torch.ones_like(ids[:, :1], dtype=torch.bool))
    layer = LayerKVCache(batch=1, n_kv_heads=2, capacity=4, d_head=3)
    with pytest.raises(ValueError, match=r"\(batch, n_kv_heads, pos, d_head\) = \(1, 2, pos, 3\).*heads before positions"):
        layer.append(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3))  # (batch, pos, heads, d_head)
    layer.append(torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="KV cache full: it holds 3 of its 4 positions and 2 more"):
        layer.append(torch.zeros(1, 2, 2, 3), torch.zeros(1, 2, 2, 3))


def test_append_matches_its_annotations(typechecked):
    layer = LayerKVCache(batch=2, n_kv_heads=1, capacity=5, d_head=4, d_value=6)
    append = typechecked(LayerKVCache.append)
    append(layer, torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 6))
    keys, values = append(layer, torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 6))  # the query's own, once
    assert keys.shape == (2, 1, 4, 4) and values.shape == (2, 1, 4, 6) and keys[:, :, :3].eq(1).all()
    layer.keys[1] += 1  # tell the rows apart
    layer.reorder(torch.tensor([1, 1]))  # both rows now hold row 1's past (beam search: two children of beam 1)
    assert layer.keys[0, :, :4].equal(layer.keys[1, :, :4]) and layer.keys[0, 0, 0, 0] == 2
    assert layer.length == 4 and layer.nbytes == 2 * 5 * (4 + 6) * 4


def test_an_encoder_keeps_no_cache_and_generate_runs_it_uncached():
    torch.manual_seed(0)
    encoder = Encoder(preset("tiny").replace(d_vocab=D_VOCAB, n_ctx=N_CTX)).eval()
    assert not encoder.supports_kv_cache and tiny().supports_kv_cache
    with pytest.raises(TypeError, match="Encoder cannot keep a KV cache: only a causal decoder"):
        KVCache.for_model(encoder, batch=1)
    cache = KVCache.for_model(tiny(), batch=2)  # a cache of the right shape, handed to the wrong model
    with pytest.raises(ValueError, match="Encoder attends both ways"):
        encoder(prompts(), kv_cache=cache)
    ids = prompts()
    assert torch.equal(generate(encoder, ids, 4), generate(encoder, ids, 4, use_cache=False))


def test_hooks_see_the_new_positions_and_can_still_edit_them():
    model = tiny()
    ids = prompts(pos=6)
    cache = KVCache.for_model(model, batch=2)
    with torch.no_grad():
        model(ids[:, :5], kv_cache=cache)
        logits, acts = model.run_with_cache(ids[:, 5:], kv_cache=cache)
        assert acts["blocks.0.attn.hook_pattern"].shape == (2, 4, 1, 6)  # one query over all six keys
        assert acts["blocks.1.hook_resid_post"].shape == (2, 1, 32)
        cache.reset()
        model(ids[:, :5], kv_cache=cache)
        with model.hooks(blocks__1__hook_mlp_out=torch.zeros_like):
            ablated = model(ids[:, 5:], kv_cache=cache)
            expected = model(ids)[:, -1:]
    torch.testing.assert_close(ablated, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ablated, logits, atol=1e-3)


# ----------------------------------------------------------------------------- decoding


def test_cached_tokens_equal_uncached_greedy_and_seeded_sampling(model):
    ids = prompts()
    assert torch.equal(generate(model, ids, 12), generate(model, ids, 12, use_cache=False))
    sampling = dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.9)
    cached = generate(model, ids, 12, **sampling, generator=torch.Generator().manual_seed(3))
    uncached = generate(model, ids, 12, **sampling, generator=torch.Generator().manual_seed(3), use_cache=False)
    assert torch.equal(cached, uncached)


def test_cached_beam_search_equals_uncached(model):
    ids = prompts()
    kwargs = dict(num_beams=3, length_penalty=0.7, eos_token_id=int(generate(model, ids, 3)[0, -1]))
    assert torch.equal(beam_search(model, ids, 8, **kwargs), beam_search(model, ids, 8, **kwargs, use_cache=False))


def test_generating_past_n_ctx_refills_the_cache_from_the_last_n_ctx_tokens():
    model = tiny(positional="rope", n_kv_heads=2)
    ids = prompts(pos=N_CTX - 3)
    out = generate(model, ids, 10)  # 7 steps beyond the context: each one re-reads the last n_ctx tokens
    assert out.shape == (2, N_CTX + 7) and torch.equal(out, generate(model, ids, 10, use_cache=False))
    beams = beam_search(model, ids, 6, num_beams=2)
    assert torch.equal(beams, beam_search(model, ids, 6, num_beams=2, use_cache=False))


@pytest.mark.parametrize("make", [hf_gpt2, lambda: hf_llama(2)], ids=["gpt2", "llama-gqa"])
def test_greedy_and_beam_tokens_equal_transformers_with_its_cache(make):
    hf = make()
    ours = gpt_from_hf(hf)
    ids = prompts(batch=3)
    assert torch.equal(generate(ours, ids, 15, use_cache=True), hf_generate(hf, ids, 15, do_sample=False))
    expected = hf_generate(hf, ids, 10, do_sample=False, num_beams=3, length_penalty=1.0, early_stopping=False)
    assert torch.equal(beam_search(ours, ids, 10, num_beams=3, use_cache=True), expected)


# ----------------------------------------------------------------------------- decode_step and greedy_by_hand


def test_decode_step_equals_sdpa_over_the_grown_cache_and_leaves_its_inputs_alone():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    q, k_new, v_new = (torch.randn(2, 3, 1, 4, generator=g) for _ in range(3))
    before = k_cache.clone()
    z, k_grown, v_grown = decode_step(q, k_new, v_new, k_cache, v_cache)
    assert torch.equal(k_cache, before) and k_grown.shape == (2, 3, 6, 4)
    assert torch.equal(k_grown[:, :, -1:], k_new) and torch.equal(v_grown[:, :, :5], v_cache)
    want = torch.nn.functional.scaled_dot_product_attention(q, k_grown, v_grown)  # one query: nothing to mask
    torch.testing.assert_close(z, want)


@pytest.mark.parametrize("changes", [{}, {"positional": "rope"}, {"positional": "sinusoidal"}, {"positional": "none"}])
def test_greedy_by_hand_gives_generates_tokens(changes):
    model = tiny(**changes)
    ids = prompts()
    assert torch.equal(greedy_by_hand(model, ids, 12), generate(model, ids, 12))
    assert torch.equal(greedy_by_hand(model, ids, 0), ids)


def test_greedy_by_hand_refuses_what_it_does_not_write_out():
    for changes, words in (({"norm_position": "post"}, "norm_position='post'"), ({"positional": "alibi"}, "alibi"),
                           ({"n_kv_heads": 2}, "grouped heads")):
        with pytest.raises(ValueError, match=words):
            greedy_by_hand(tiny(**changes), prompts(), 3)
    with pytest.raises(ValueError, match="never crops"):
        greedy_by_hand(tiny(), prompts(pos=20), 6)
    with pytest.raises(TypeError, match="causal tfedu GPT"):
        greedy_by_hand(Encoder(preset("tiny")), prompts(), 3)


# ----------------------------------------------------------------------------- fewer key/value heads


def test_pool_kv_weight_averages_consecutive_heads_of_weights_and_biases():
    heads = torch.arange(6.0).repeat_interleave(2)  # 6 heads of width 2: rows 0,0,1,1,...,5,5
    pooled = pool_kv_weight(heads[:, None].expand(12, 3), 6, 2)  # groups (0,1,2) and (3,4,5)
    assert torch.equal(pooled[:, 0], torch.tensor([1.0, 1.0, 4.0, 4.0]))
    assert torch.equal(pool_kv_weight(heads, 6, 3), torch.tensor([0.5, 0.5, 2.5, 2.5, 4.5, 4.5]))
    assert torch.equal(pool_kv_weight(heads, 6, 6), heads)
    with pytest.raises(ValueError, match="n_kv_heads must divide n_heads"):
        pool_kv_weight(heads, 6, 4)


def test_pooling_heads_that_are_already_equal_within_groups_changes_no_output():
    model = tiny(n_heads=4)
    with torch.no_grad():
        for block in model.blocks:
            for W in (block.attn.W_K, block.attn.W_V):  # make heads (0, 1) and (2, 3) equal
                for p in (W.weight, W.bias):
                    heads = p.unflatten(0, (2, 2, -1))
                    heads[:, 1] = heads[:, 0]
    ids = prompts()
    gqa = pool_kv_heads(model, 2)
    assert gqa.cfg.n_kv_heads == 2 and model.cfg.n_kv_heads == 4
    torch.testing.assert_close(gqa(ids), model(ids))
    assert torch.equal(generate(gqa, ids, 8), generate(model, ids, 8))


def test_pool_kv_heads_copies_everything_else_and_takes_another_pooling():
    model = tiny(n_heads=4)
    mqa = pool_kv_heads(model, 1, pool=lambda w, n_heads, n_kv: w.unflatten(0, (n_heads, -1))[0].clone())
    assert mqa.cfg.n_kv_heads == 1 and not mqa.training and mqa is not model
    block, source = mqa.blocks[0].attn, model.blocks[0].attn
    assert torch.equal(block.W_K.weight, source.W_K.weight[:source.d_head])  # the first head, as asked
    assert torch.equal(block.W_Q.weight, source.W_Q.weight) and block.W_Q.weight is not source.W_Q.weight
    with pytest.raises(ValueError, match="dividing the model's n_kv_heads=4"):
        pool_kv_heads(model, 3)


# ----------------------------------------------------------------------------- on a GPU (skipped without one)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_cache_lives_on_the_gpu_and_gives_the_uncached_tokens(dtype):
    model = tiny(positional="rope", n_kv_heads=2, attention="sdpa").to("cuda", dtype)
    cache = KVCache.for_model(model, batch=2)
    assert cache.layers[0].keys.device.type == "cuda" and cache.layers[0].keys.dtype == dtype
    ids = prompts().cuda()
    assert torch.equal(generate(model, ids, 15), generate(model, ids, 15, use_cache=False))

    def sample(use_cache):
        return generate(model, ids, 15, do_sample=True, top_k=10, use_cache=use_cache,
                        generator=torch.Generator(device="cuda").manual_seed(0))

    assert torch.equal(sample(True), sample(False))
    assert torch.equal(beam_search(model, ids, 8, num_beams=3), beam_search(model, ids, 8, num_beams=3, use_cache=False))

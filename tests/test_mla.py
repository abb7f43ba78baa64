"""tfedu.mla: multi-head latent attention (DeepSeek-V2, section 2.1), its latent cache and its cache size."""

import dataclasses

import pytest
import torch

from tfedu.attention import MultiHeadAttention, causal_mask
from tfedu.mla import MLACache, MultiHeadLatentAttention, gqa_cache_bytes_per_token, mla_cache_bytes_per_token

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


@dataclasses.dataclass(frozen=True)
class Sizes:
    d_model: int = 24
    n_heads: int = 3
    d_c: int = 6
    d_c_q: int = 10
    d_head_nope: int = 8
    d_rope: int = 4
    d_head_v: int = 5


def make(dtype=torch.float64, seed=0, **changes):
    """A small layer; ``changes`` may alter any size or pass other constructor arguments."""
    torch.manual_seed(seed)
    sizes = {**dataclasses.asdict(Sizes()), **changes}
    mla = MultiHeadLatentAttention(**sizes).to(dtype)
    # Give the RMSNorm gains values other than 1, so a missing or misplaced norm shows.
    with torch.no_grad():
        for norm in (mla.norm_KV, mla.norm_Q):
            if hasattr(norm, "weight"):
                norm.weight.uniform_(0.5, 1.5)
    return mla


def inputs(batch=2, pos=7, dtype=torch.float64, seed=1):
    return torch.randn(batch, pos, Sizes.d_model, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def test_shapes_and_the_papers_parameter_names(typechecked):
    mla = make(torch.float32)
    out = typechecked(mla.forward)(inputs(dtype=torch.float32))
    assert out.shape == (2, 7, Sizes.d_model) and out.dtype == torch.float32
    shapes = {name: tuple(p.shape) for name, p in mla.named_parameters()}
    s = Sizes()
    assert shapes == {
        "W_DKV.weight": (s.d_c, s.d_model),
        "norm_KV.weight": (s.d_c,),
        "W_UK.weight": (s.n_heads * s.d_head_nope, s.d_c),
        "W_UV.weight": (s.n_heads * s.d_head_v, s.d_c),
        "W_DQ.weight": (s.d_c_q, s.d_model),
        "norm_Q.weight": (s.d_c_q,),
        "W_UQ.weight": (s.n_heads * s.d_head_nope, s.d_c_q),
        "W_QR.weight": (s.n_heads * s.d_rope, s.d_c_q),
        "W_KR.weight": (s.d_rope, s.d_model),
        "W_O.weight": (s.d_model, s.n_heads * s.d_head_v),
    }
    assert mla.scale == pytest.approx((s.d_head_nope + s.d_rope) ** -0.5)


@pytest.mark.parametrize("norm_latents", [True, False])
def test_absorbed_form_equals_plain_form_float64(norm_latents):
    mla, x = make(norm_latents=norm_latents), inputs()
    torch.testing.assert_close(mla(x, absorbed=True), mla(x), rtol=1e-12, atol=1e-12)


def test_absorbed_form_equals_plain_form_float32():
    mla, x = make(torch.float32), inputs(dtype=torch.float32)
    torch.testing.assert_close(mla(x, absorbed=True), mla(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("absorbed", [False, True], ids=["plain", "absorbed"])
@torch.no_grad()
def test_cached_decoding_one_token_at_a_time_equals_the_full_sequence(absorbed):
    mla, x = make(), inputs(batch=2, pos=9)
    full = mla(x)  # uncached, plain: the reference for both forms
    cache = mla.new_cache(batch=2, n_ctx=12)
    prompt = mla(x[:, :5], cache=cache, absorbed=absorbed)  # prefill
    steps = [mla(x[:, t : t + 1], cache=cache, absorbed=absorbed) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat([prompt, *steps], dim=1), full, rtol=1e-12, atol=1e-12)
    assert cache.length == 9
    # The cache holds only the (normalised) latent and the rotated shared key, nothing per head.
    # (to rounding: a BLAS may sum a 1-row and a 9-row product in different orders; seen on a 16-core host)
    torch.testing.assert_close(cache.c_KV[:, :9], mla.norm_KV(mla.W_DKV(x)), rtol=1e-12, atol=1e-12)
    assert cache.k_rope.shape == (2, 12, Sizes.d_rope)


@torch.no_grad()
def test_one_cache_serves_both_forms():
    mla, x = make(), inputs(pos=6)
    cache = mla.new_cache(batch=2, n_ctx=6)
    first = mla(x[:, :4], cache=cache)  # prefill in the plain form
    rest = mla(x[:, 4:], cache=cache, absorbed=True)  # decode in the absorbed form
    torch.testing.assert_close(torch.cat([first, rest], dim=1), mla(x), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_on_cuda_cached_equals_uncached_and_equals_the_cpu():
    mla, x = make(torch.float32), inputs(dtype=torch.float32)
    on_cpu = mla(x)
    mla, x = mla.cuda(), x.cuda()
    cache = mla.new_cache(batch=2, n_ctx=7)
    assert cache.c_KV.device.type == "cuda"
    steps = [mla(x[:, :3], cache=cache, absorbed=True)] + [mla(x[:, t : t + 1], cache=cache, absorbed=True) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), mla(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mla(x).cpu(), on_cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("absorbed", [False, True], ids=["plain", "absorbed"])
def test_a_later_token_never_changes_earlier_outputs(absorbed):
    mla, x = make(), inputs()
    changed = x.clone()
    changed[:, 4] += 1.0
    before, after = mla(x, absorbed=absorbed), mla(changed, absorbed=absorbed)
    torch.testing.assert_close(after[:, :4], before[:, :4], rtol=0, atol=1e-14)
    assert (after[:, 4:] - before[:, 4:]).abs().amin(dim=-1).gt(1e-6).all(), "the changed token and later ones must move"


@pytest.mark.parametrize("absorbed", [False, True], ids=["plain", "absorbed"])
def test_rope_sees_only_relative_positions(absorbed):
    mla, x = make(), inputs()
    at_zero = mla(x, absorbed=absorbed)
    shifted = mla(x, positions=torch.arange(7) + 1000, absorbed=absorbed)
    torch.testing.assert_close(shifted, at_zero, rtol=1e-9, atol=1e-10)
    per_sequence = mla(x, positions=torch.arange(7) + torch.tensor([[3], [50]]), absorbed=absorbed)  # (batch, pos)
    torch.testing.assert_close(per_sequence, at_zero, rtol=1e-9, atol=1e-10)
    # ... and positions do matter: stretching the gaps changes the output.
    stretched = mla(x, positions=torch.arange(7) * 3, absorbed=absorbed)
    assert not torch.allclose(stretched[:, 1:], at_zero[:, 1:], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cache_bytes_held_equal_the_formula(dtype):
    mla = make(dtype)
    cache = mla.new_cache(batch=3, n_ctx=10)
    per_token = mla_cache_bytes_per_token(Sizes.d_c, Sizes.d_rope, dtype_bytes=dtype.itemsize)
    assert cache.nbytes == 3 * 10 * per_token == 3 * 10 * (6 + 4) * dtype.itemsize
    # The same layer's heads as multi-head attention would cache keys of d_head_nope + d_rope and
    # values of d_head_v for each of the 3 heads: 3 * (12 + 5) = 51 numbers per token, against MLA's 10.
    mha_numbers = Sizes.n_heads * (Sizes.d_head_nope + Sizes.d_rope + Sizes.d_head_v)
    assert per_token / dtype.itemsize == 10 and mha_numbers == 51


def test_deepseek_v2_cache_equals_gqa_with_2_25_groups():
    # DeepSeek-V2 (section 2.1.4, Table 1): d_c = 4 d_h = 512, d_h^R = d_h / 2 = 64, 128 heads of d_h = 128, 60 layers.
    # Compared: numbers cached per token of one sequence, summed over the 60 layers (bytes = numbers x dtype_bytes).
    mla = mla_cache_bytes_per_token(d_c=512, d_rope=64, dtype_bytes=2, n_layers=60)
    one_group = gqa_cache_bytes_per_token(n_kv_heads=1, d_head=128, dtype_bytes=2, n_layers=60)  # = MQA
    mha = gqa_cache_bytes_per_token(n_kv_heads=128, d_head=128, dtype_bytes=2, n_layers=60)
    assert (512 + 64) == 4.5 * 128 == 2.25 * 2 * 128
    assert mla / one_group == 2.25
    assert mla == 69_120 and mha == 3_932_160 and mha / mla == pytest.approx(56.89, abs=0.01)
    # The abstract's "reduces the KV cache by 93.3%" is against DeepSeek 67B (95 layers, GQA with 8 KV heads
    # of 128), with DeepSeek-V2's cache quantised to 6 bits (0.75 bytes) per number on average (section 3.2.3),
    # the 67B's in 16 bits: not the same comparison as the 2.25 groups above.
    v2 = mla_cache_bytes_per_token(d_c=512, d_rope=64, dtype_bytes=0.75, n_layers=60)
    llm_67b = gqa_cache_bytes_per_token(n_kv_heads=8, d_head=128, dtype_bytes=2, n_layers=95)
    assert round(1 - v2 / llm_67b, 3) == 0.933


def test_cache_size_formulas_refuse_nonsense():
    with pytest.raises(ValueError, match="d_c"):
        mla_cache_bytes_per_token(0, 64, 2)
    with pytest.raises(ValueError, match="d_rope"):
        mla_cache_bytes_per_token(512, -2, 2)
    with pytest.raises(ValueError, match="dtype_bytes"):
        gqa_cache_bytes_per_token(8, 128, 0)
    with pytest.raises(ValueError, match="n_layers"):
        gqa_cache_bytes_per_token(8, 128, 2, n_layers=1.5)


@torch.no_grad()
def test_bad_input_gets_a_clear_error():
    mla = make()
    with pytest.raises(ValueError, match="d_rope must be even"):
        make(d_rope=3)
    with pytest.raises(ValueError, match="d_c must be an int > 0"):
        make(d_c=0)
    with pytest.raises(ValueError, match="rope_layout"):
        make(rope_layout="sideways")
    with pytest.raises(ValueError, match=r"shape \(batch, pos, d_model=24\)"):
        mla(torch.randn(2, 7, 23, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shape \(batch, pos, d_model=24\)"):
        mla(torch.randn(7, 24, dtype=torch.float64))
    with pytest.raises(ValueError, match="positions of shape"):
        mla(inputs(), positions=torch.arange(6))
    with pytest.raises(ValueError, match="positions of shape"):
        mla(inputs(batch=2), positions=torch.zeros(3, 7, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        mla(inputs(), positions=torch.arange(7.0))
    with pytest.raises(TypeError, match="cache must be an MLACache"):
        mla(inputs(), cache={})
    cache = mla.new_cache(batch=2, n_ctx=8)
    mla(inputs(pos=6), cache=cache)
    with pytest.raises(ValueError, match=r"at most n_ctx=8 tokens; it has 6 and 3 more"):
        mla(inputs(pos=3), cache=cache)
    assert cache.length == 6, "a refused append must leave the cache as it was"
    with pytest.raises(TypeError, match="cache holds torch.float32"):
        mla(inputs(), cache=MLACache(2, 8, Sizes.d_c, Sizes.d_rope))
    with pytest.raises(ValueError, match="to fit this cache"):
        mla(inputs(), cache=MLACache(2, 8, Sizes.d_c + 1, Sizes.d_rope, dtype=torch.float64))
    with pytest.raises(ValueError, match="to fit this cache"):
        mla(inputs(batch=3), cache=mla.new_cache(batch=2, n_ctx=8))
    cache.reset()
    assert cache.length == 0 and mla(inputs(pos=8), cache=cache).shape == (2, 8, 24)


@pytest.mark.parametrize("absorbed", [False, True], ids=["plain", "absorbed"])
def test_gradients_reach_every_parameter(absorbed):
    mla = make(torch.float32)
    mla(inputs(dtype=torch.float32), absorbed=absorbed).pow(2).mean().backward()
    for name, p in mla.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("absorbed", [False, True], ids=["plain", "absorbed"])
def test_without_rope_it_is_multi_head_attention_with_low_rank_keys_and_values(absorbed):
    # d_rope = 0 and no latent norms: queries, keys and values are then plain linear maps of x,
    # W_Q = W_UQ W_DQ, W_K = W_UK W_DKV, W_V = W_UV W_DKV, each of rank at most d_c (or d_c_q).
    mla = make(d_rope=0, norm_latents=False, d_head_v=8)  # d_head = d_model / n_heads = 8
    mha = MultiHeadAttention(Sizes.d_model, Sizes.n_heads, bias=False).to(torch.float64)
    with torch.no_grad():
        mha.W_Q.weight.copy_(mla.W_UQ.weight @ mla.W_DQ.weight)
        mha.W_K.weight.copy_(mla.W_UK.weight @ mla.W_DKV.weight)
        mha.W_V.weight.copy_(mla.W_UV.weight @ mla.W_DKV.weight)
        mha.W_O.weight.copy_(mla.W_O.weight)
    assert torch.linalg.matrix_rank(mha.W_K.weight) == Sizes.d_c
    x = inputs()
    torch.testing.assert_close(mla(x, absorbed=absorbed), mha(x, mask=causal_mask(7, 7)), rtol=1e-12, atol=1e-12)


@torch.no_grad()
def test_equals_transformers_deepseek_v2_attention():
    """An independent oracle: Hugging Face's DeepseekV2Attention, built locally with random weights."""
    # (transformers is a test dependency; its native DeepseekV2 arrived in the 4.5x releases)
    modeling = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")
    from transformers import DeepseekV2Config

    s = Sizes(d_head_v=5)
    config = DeepseekV2Config(
        hidden_size=s.d_model, num_attention_heads=s.n_heads, num_key_value_heads=s.n_heads, q_lora_rank=s.d_c_q,
        kv_lora_rank=s.d_c, qk_nope_head_dim=s.d_head_nope, qk_rope_head_dim=s.d_rope, v_head_dim=s.d_head_v,
        num_hidden_layers=1, vocab_size=8, intermediate_size=8, rms_norm_eps=1e-6,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = modeling.DeepseekV2Attention(config, layer_idx=0).eval()
    for norm in (theirs.q_a_layernorm, theirs.kv_a_layernorm):
        norm.weight.uniform_(0.5, 1.5)
    # transformers' DeepseekV2 rotates interleaved pairs (as DeepSeek's code does): match that layout.
    ours = MultiHeadLatentAttention(**dataclasses.asdict(s), rope_layout="interleaved")
    h, nope, rope, v = s.n_heads, s.d_head_nope, s.d_rope, s.d_head_v
    q_b = theirs.q_b_proj.weight.view(h, nope + rope, s.d_c_q)  # rows per head: [q_nope ; q_rope]
    kv_b = theirs.kv_b_proj.weight.view(h, nope + v, s.d_c)  # rows per head: [k_nope ; v]
    kv_a = theirs.kv_a_proj_with_mqa.weight  # rows: [c_KV ; k_rope]
    for mine, weight in (
        (ours.W_DQ, theirs.q_a_proj.weight), (ours.norm_Q, theirs.q_a_layernorm.weight),
        (ours.W_UQ, q_b[:, :nope].reshape(-1, s.d_c_q)), (ours.W_QR, q_b[:, nope:].reshape(-1, s.d_c_q)),
        (ours.W_DKV, kv_a[: s.d_c]), (ours.W_KR, kv_a[s.d_c :]), (ours.norm_KV, theirs.kv_a_layernorm.weight),
        (ours.W_UK, kv_b[:, :nope].reshape(-1, s.d_c)), (ours.W_UV, kv_b[:, nope:].reshape(-1, s.d_c)),
        (ours.W_O, theirs.o_proj.weight),
    ):  # fmt: skip
        mine.weight.copy_(weight)
    x = inputs(dtype=torch.float32)
    position_ids = torch.arange(7)[None].expand(2, -1)
    freqs = modeling.DeepseekV2RotaryEmbedding(config)(x, position_ids)
    additive_mask = torch.zeros(7, 7).masked_fill(~causal_mask(7, 7), float("-inf"))[None, None]
    expected, _ = theirs(x, attention_mask=additive_mask, position_embeddings=freqs)
    for absorbed in (False, True):
        torch.testing.assert_close(ours(x, absorbed=absorbed), expected, rtol=1e-4, atol=1e-5)

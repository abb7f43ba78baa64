"""RoPE scaling (tfedu.positional.rope_frequencies and its use in apply_rope, Attention, ModelConfig) against
transformers built locally from small configs: the inverse frequencies and attention scale of
``ROPE_INIT_FUNCTIONS``, the cos/sin of ``LlamaRotaryEmbedding``, a ``LlamaAttention`` layer and a whole
``LlamaForCausalLM`` (logits and greedy tokens with the cache). Plus the identities each method promises,
that no scaling is bit for bit the old RoPE, and clear errors for bad dicts.

transformers keeps frequencies and angles in float32, tfedu in float64: frequencies agree to 1e-6
relative, cos/sin to 1e-6 plus the float32 rounding of the angle (about 2.5e-7 of it)."""

import json
import math

import pytest
import torch

from tfedu.config import ModelConfig
from tfedu.generate import generate
from tfedu.layers import Attention
from tfedu.positional import (
    ROPE_TYPES,
    apply_rope,
    frequencies,
    rope_angles,
    rope_frequencies,
    validate_rope_scaling,
    yarn_ramp,
)

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


def randn(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# (head_dim, rope_theta, transformers' rope_parameters, the trained length L). Real ones from the released configs:
# Llama 3.1 8B (head_dim 128, theta 500000, llama3 factor 8, L 8192), Llama 3.2 1B (head_dim 64, factor 32),
# DeepSeek-V3's YaRN (rope head 64, factor 40, mscale 1 / mscale_all_dim 1), Qwen2.5's YaRN (factor 4, L 32768).
CASES = {
    "linear-2": (16, 10000.0, {"rope_type": "linear", "factor": 2.0}, 32),
    "linear-8-theta": (64, 500000.0, {"rope_type": "linear", "factor": 8}, 32),
    "dynamic-2": (16, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 32),
    "dynamic-4-theta": (64, 500000.0, {"rope_type": "dynamic", "factor": 4.0}, 64),
    "llama3-small": (16, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, 32),
    "llama3.1-8b": (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 8192),
    "llama3.2-1b": (64, 500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 8192),
    "yarn-4": (16, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 32),
    "yarn-qwen2.5": (128, 1000000.0, {"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32768}, 32768),
    "yarn-betas-untruncated": (32, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                             "beta_fast": 16, "beta_slow": 2, "truncate": False}, 64),
    "yarn-deepseek-mscale": (64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                           "mscale": 0.707, "mscale_all_dim": 1.0}, 4096),
    "yarn-attention_factor": (16, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                            "attention_factor": 1.5}, 32),
}


def hf_config(head_dim, theta, params, trained, **changes):
    """A small LlamaConfig with these rope_parameters; max_position_embeddings is the new length (the trained one
    for "dynamic", which transformers reads as its L)."""
    longer = trained if params["rope_type"] == "dynamic" else int(trained * params["factor"])
    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, intermediate_size=64,
                  num_hidden_layers=1, vocab_size=32, max_position_embeddings=longer, attention_bias=False,
                  attn_implementation="eager", rope_parameters={**params, "rope_theta": theta})
    return LlamaConfig(**(fields | changes))


def ours_from_hf(config):
    """tfedu's dict from transformers' (standardised) rope_parameters: the same dict, plus, for "dynamic", the
    trained length that transformers reads from max_position_embeddings."""
    params = dict(config.rope_parameters)
    if params["rope_type"] == "dynamic":
        params["original_max_position_embeddings"] = config.max_position_embeddings
    return params


# ----------------------------------------------------------------------------- no scaling: nothing changes


@pytest.mark.parametrize(("d_head", "base"), [(2, 10000.0), (8, 10000.0), (64, 500000.0), (6, 1.5)])
@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_scaling_is_bit_for_bit_the_old_rope(d_head, base, layout, dtype, typechecked):
    inv_freq, scale = typechecked(rope_frequencies)(d_head, base)
    assert torch.equal(inv_freq, frequencies(d_head, base)) and inv_freq.dtype == torch.float64 and scale == 1.0
    assert torch.equal(rope_frequencies(d_head, base, {"rope_type": "default", "rope_theta": base})[0], inv_freq)
    positions = torch.tensor([0, 1, 5, 100, 4095])
    assert torch.equal(typechecked(rope_angles)(positions, d_head, base, inv_freq=inv_freq),
                       rope_angles(positions, d_head, base))
    x = randn(0, 2, 3, len(positions), d_head, dtype=dtype)
    old = apply_rope(x, positions, base=base, layout=layout)
    for same in (apply_rope(x, positions, base=base, layout=layout, scaling=None),
                 apply_rope(x, positions, base=base, layout=layout, scaling={"rope_type": "default"}),
                 typechecked(apply_rope)(x, positions, base=base, layout=layout, inv_freq=inv_freq, attention_scale=1.0),
                 typechecked(apply_rope)(x, positions, base=base, layout=layout, scaling={"rope_type": "default"})):
        assert torch.equal(same, old)


def test_attention_and_config_without_scaling_are_unchanged():
    assert ModelConfig().rope_scaling is None and "rope_scaling" in ModelConfig().as_dict()
    torch.manual_seed(0)
    plain = Attention(16, 4, rope_base=10000.0)
    scaled = Attention(16, 4, rope_base=10000.0, rope_scaling={"rope_type": "default"})
    scaled.load_state_dict(plain.state_dict())
    x = randn(1, 2, 7, 16)
    assert torch.equal(plain(x, causal=True), scaled(x, causal=True))


# ----------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_attention_scale_match_transformers(case):
    head_dim, theta, params, trained = CASES[case]
    config = hf_config(head_dim, theta, params, trained)
    ours_params = ours_from_hf(config)
    lengths = [None, trained // 2, trained, trained + 1, 3 * trained] if params["rope_type"] == "dynamic" else [None]
    for seq_len in lengths:
        expected, expected_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len)
        inv_freq, scale = rope_frequencies(head_dim, theta, ours_params, seq_len=seq_len)
        assert inv_freq.dtype == torch.float64 and inv_freq.shape == (head_dim // 2,)
        torch.testing.assert_close(inv_freq, expected.double(), rtol=1e-6, atol=0)  # theirs are float32
        assert math.isclose(scale, expected_scale, rel_tol=1e-15)
        if params["rope_type"] == "yarn" and "attention_factor" not in params and "mscale" not in params:
            assert scale == 0.1 * math.log(params["factor"]) + 1  # YaRN's sqrt(1/t), Peng et al. 2023 sec. 3.4
    if params["rope_type"] != "dynamic":  # (dynamic at the trained length is plain RoPE: tested below)
        assert not torch.allclose(inv_freq, frequencies(head_dim, theta), rtol=1e-3)  # it does scale something


@pytest.mark.parametrize(("alpha", "d_head", "theta"), [(2, 16, 10000.0), (4, 64, 500000.0), (8, 8, 10000.0)])
def test_static_ntk_is_transformers_dynamic_where_its_bracket_equals_the_factor(alpha, d_head, theta):
    """"ntk" (bloc97) with factor alpha = "dynamic" with factor 1 at seq_len alpha * L (bracket 1 * n / L - 0)."""
    trained = 16
    config = hf_config(d_head, theta, {"rope_type": "dynamic", "factor": 1.0}, trained)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=alpha * trained)
    inv_freq, scale = rope_frequencies(d_head, theta, {"rope_type": "ntk", "factor": alpha})
    torch.testing.assert_close(inv_freq, expected.double(), rtol=1e-6, atol=0)
    assert scale == 1.0
    # and tfedu's own dynamic, with any factor s, at the length n where s n / L - (s - 1) == alpha
    s = 3.0
    n = int((alpha + s - 1) * trained / s) if (alpha + s - 1) * trained % s == 0 else None
    if n is not None:
        dynamic, _ = rope_frequencies(d_head, theta, {"rope_type": "dynamic", "factor": s,
                                                      "original_max_position_embeddings": trained}, seq_len=n)
        torch.testing.assert_close(dynamic, inv_freq, rtol=1e-14, atol=0)


def rotary_cos_sin(inv_freq, scale, positions):
    """tfedu's angles as HF's rotary module lays them out: (batch, pos, head_dim), each frequency twice."""
    angles = rope_angles(positions, 2 * len(inv_freq), inv_freq=inv_freq)  # (batch, pos, d_head / 2), float64
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale, angles


@pytest.mark.parametrize("case", ["linear-2", "linear-8-theta", "dynamic-2", "dynamic-4-theta", "llama3-small",
                                  "yarn-4", "yarn-betas-untruncated", "yarn-attention_factor"])
def test_cos_sin_and_rotation_match_transformers_rotary_embedding(case):
    head_dim, theta, params, trained = CASES[case]
    config = hf_config(head_dim, theta, params, trained)
    ours_params = ours_from_hf(config)
    longest = int(trained * params["factor"])
    row = torch.tensor([0, 1, 2, 7, trained - 1, trained, trained + 3, longest // 2, longest - 1])
    position_ids = torch.stack([row, row.flip(0)])  # (batch, pos)
    q, k = randn(1, 2, 4, len(row), head_dim), randn(2, 2, 4, len(row), head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(q, position_ids)  # (batch, pos, head_dim), float32
    # "dynamic" reads the length so far: the last position + 1, as apply_rope(scaling=...) does
    seq_len = longest if params["rope_type"] == "dynamic" else None
    inv_freq, scale = rope_frequencies(head_dim, theta, ours_params, seq_len=seq_len)
    our_cos, our_sin, angles = rotary_cos_sin(inv_freq, scale, position_ids)
    # float32 angles are off by about 2.5e-7 of themselves; within 1e-6 beyond that
    bound = 1e-6 + 2.5e-7 * angles.abs() * scale
    assert ((our_cos - cos.double()).abs() <= bound).all() and ((our_sin - sin.double()).abs() <= bound).all()
    assert bound.max() < 4e-4  # (the angles stay below 1600 rad: the bound is not vacuous)
    # apply_rope with the dict rotates as HF's apply_rotary_pos_emb does
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    positions = position_ids[:, None, :]  # (batch, 1, pos)
    for x, expected in ((q, q_hf), (k, k_hf)):
        got = apply_rope(x, positions, base=theta, layout="half", scaling=ours_params)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-4 * scale)
        same = apply_rope(x, positions, base=theta, layout="half", inv_freq=inv_freq, attention_scale=scale)
        assert torch.equal(same, got)


def llama_attention(config, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = LlamaAttention(config, layer_idx=0).eval()
        for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            torch.nn.init.normal_(linear.weight, std=0.3)  # big enough that positions change the output visibly
    return layer


@pytest.mark.parametrize("case", ["linear-2", "dynamic-2", "llama3-small", "yarn-4", "yarn-attention_factor"])
def test_attention_layer_with_rope_scaling_matches_llama_attention(case):
    head_dim, theta, params, _ = CASES[case]
    trained = 8  # short, so that 3 * 8 positions run well past the trained length
    if "original_max_position_embeddings" in params:
        params = {**params, "original_max_position_embeddings": trained}
    config = hf_config(head_dim, theta, params, trained)
    layer = llama_attention(config)
    batch, pos = 2, 3 * trained
    x = randn(3, batch, pos, config.hidden_size)
    position_ids = torch.arange(pos).expand(batch, pos)
    hide = torch.ones(pos, pos, dtype=torch.bool).triu(1)
    hf_mask = torch.zeros(pos, pos).masked_fill(hide, float("-inf"))[None, None].expand(batch, 1, pos, pos)
    ours = Attention(config.hidden_size, config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
                     d_head=head_dim, bias=False, rope_base=theta, rope_layout="half", rope_scaling=ours_from_hf(config))
    plain = Attention(config.hidden_size, config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
                      d_head=head_dim, bias=False, rope_base=theta, rope_layout="half")
    with torch.no_grad():
        for name, theirs in (("W_Q", "q_proj"), ("W_K", "k_proj"), ("W_V", "v_proj"), ("W_O", "o_proj")):
            for attn in (ours, plain):
                getattr(attn, name).weight.copy_(getattr(layer, theirs).weight)
        expected, _ = layer(x, position_embeddings=LlamaRotaryEmbedding(config)(x, position_ids), attention_mask=hf_mask)
        got = ours(x, causal=True)
        unscaled = plain(x, causal=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=5e-5)
    assert not torch.allclose(unscaled, expected, rtol=1e-3, atol=1e-3)  # the scaling matters here


def llama_model(params, trained, seed=0):
    config = hf_config(8, 10000.0, {**params, **({"original_max_position_embeddings": trained}
                                                 if "original_max_position_embeddings" in params else {})}, trained,
                       hidden_size=32, num_hidden_layers=2, vocab_size=61, bos_token_id=0,
                       eos_token_id=None, pad_token_id=None)  # (no end token: both decode every step)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # trained-looking weights: gains away from 1 (HF initialises them to 1)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(0.25 * noise if p.dim() >= 2 else 1 + 0.3 * noise)
    return model


@pytest.mark.parametrize("case", ["linear-2", "dynamic-2", "llama3-small", "yarn-4"])
def test_whole_llama_logits_and_cached_greedy_tokens_match(case):
    from tfedu.checkpoints import gpt_from_hf

    _, _, params, _ = CASES[case]
    trained = 8
    hf = llama_model(params, trained)
    # a plain copy of the config converted, and rope_scaling set here: this checks the scaling, not the conversion
    plain = json.loads(hf.config.to_json_string())
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    plain["max_position_embeddings"] = 4 * trained
    ours = gpt_from_hf(hf.state_dict(), plain, rope_scaling=ours_from_hf(hf.config))
    ids = torch.randint(0, 61, (2, 3 * trained), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        logits = ours(ids)
        unscaled = gpt_from_hf(hf.state_dict(), plain)(ids)
    assert expected.abs().max() > 1
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unscaled, expected, rtol=1e-3, atol=1e-3)
    # greedy decoding past the trained length, tfedu's KV cache against transformers' (for "dynamic" each step's
    # new key is rotated with the frequencies of the length so far, in both)
    prompt = ids[:, :trained - 2]
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=2 * trained, do_sample=False)
        mine = generate(ours, prompt, max_new_tokens=2 * trained, use_cache=True)
        uncached = generate(ours, prompt, max_new_tokens=2 * trained, use_cache=False)
    assert torch.equal(mine, theirs)
    # static scalings: the cache changes nothing; dynamic: cached keys keep the rotation of their step (so does HF's)
    assert torch.equal(uncached, mine) == (params["rope_type"] != "dynamic")


# ----------------------------------------------------------------------------- what each method promises


@pytest.mark.parametrize(("factor", "d_head", "base"), [(2, 8, 10000.0), (4.0, 16, 10000.0), (8, 64, 500000.0)])
def test_linear_at_s_times_m_is_plain_rope_at_m(factor, d_head, base):
    scaling = {"rope_type": "linear", "factor": factor}
    m = torch.arange(0, 50)
    x = randn(4, 3, len(m), d_head, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, (factor * m).long(), base=base, scaling=scaling), apply_rope(x, m, base=base),
                               rtol=0, atol=1e-12)
    # so every angle before s * L stays below the angles of position L, the first one the model never saw
    trained = 32
    unseen = rope_angles(torch.tensor([trained]), d_head, base)
    inv_freq, _ = rope_frequencies(d_head, base, scaling)
    assert (rope_angles(torch.tensor([int(factor * trained) - 1]), d_head, base, inv_freq=inv_freq) < unseen).all()


@pytest.mark.parametrize(("factor", "d_head", "base"), [(2, 8, 10000.0), (4.0, 32, 10000.0), (16, 128, 500000.0)])
def test_ntk_keeps_the_fastest_pair_and_divides_the_slowest_by_the_factor(factor, d_head, base):
    inv_freq, _ = rope_frequencies(d_head, base, {"rope_type": "ntk", "factor": factor})
    theta = frequencies(d_head, base)
    assert inv_freq[0] == theta[0] == 1.0
    torch.testing.assert_close(inv_freq[-1], theta[-1] / factor, rtol=1e-12, atol=0)
    ratio = inv_freq / theta  # a geometric blend in between: s ** (-2i / (d - 2))
    torch.testing.assert_close(ratio, factor ** (-2 * torch.arange(d_head // 2, dtype=torch.float64) / (d_head - 2)),
                               rtol=1e-12, atol=0)


def test_dynamic_is_plain_rope_up_to_the_trained_length_and_grows_after():
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32}
    for seq_len in (None, 1, 31, 32):
        assert torch.equal(rope_frequencies(16, 10000.0, scaling, seq_len=seq_len)[0], frequencies(16, 10000.0))
    slowest = [rope_frequencies(16, 10000.0, scaling, seq_len=n)[0][-1] for n in (33, 64, 128)]
    assert slowest[0] > slowest[1] > slowest[2]
    # apply_rope reads the length from the positions: the last + 1
    x, positions = randn(5, 2, 40, 16, dtype=torch.float64), torch.arange(40)
    inv_freq, _ = rope_frequencies(16, 10000.0, scaling, seq_len=40)
    assert torch.equal(apply_rope(x, positions, scaling=scaling), apply_rope(x, positions, inv_freq=inv_freq))


@pytest.mark.parametrize("case", ["llama3-small", "llama3.1-8b", "llama3.2-1b"])
def test_llama3_keeps_high_frequencies_and_divides_low_ones(case):
    head_dim, theta, params, trained = CASES[case]
    inv_freq, scale = rope_frequencies(head_dim, theta, params)
    base_freq = frequencies(head_dim, theta)
    wavelength = 2 * math.pi / base_freq
    high = wavelength < trained / params["high_freq_factor"]
    low = wavelength > trained / params["low_freq_factor"]
    middle = ~high & ~low
    assert high.any() and low.any() and middle.any() and scale == 1.0
    assert torch.equal(inv_freq[high], base_freq[high])
    assert torch.equal(inv_freq[low], base_freq[low] / params["factor"])
    between = inv_freq[middle]
    assert ((between < base_freq[middle]) & (between > base_freq[middle] / params["factor"])).all()
    assert (inv_freq.diff() < 0).all()  # still falling along the vector: the smooth blend joins both ends


@pytest.mark.parametrize("case", ["yarn-4", "yarn-qwen2.5", "yarn-betas-untruncated", "yarn-deepseek-mscale"])
def test_yarn_ramp_ends_are_extrapolation_and_interpolation(case):
    head_dim, theta, params, trained = CASES[case]
    inv_freq, scale = rope_frequencies(head_dim, theta, params)
    ramp = yarn_ramp(head_dim, theta, trained, beta_fast=params.get("beta_fast", 32),
                     beta_slow=params.get("beta_slow", 1), truncate=params.get("truncate", True))
    base_freq = frequencies(head_dim, theta)
    kept, interpolated = ramp == 0, ramp == 1
    assert kept.any() and interpolated.any()
    assert torch.equal(inv_freq[kept], base_freq[kept])  # fast pairs: extrapolated, as trained
    assert torch.equal(inv_freq[interpolated], base_freq[interpolated] / params["factor"])  # slow pairs: interpolated
    # the ramp's ends lie where a pair turns beta_fast (32) and beta_slow (1) times in the trained context
    turns = trained * base_freq / (2 * math.pi)
    assert (turns[kept] > params.get("beta_slow", 1)).all() and (turns[interpolated] < params.get("beta_fast", 32)).all()
    assert (ramp.diff() >= 0).all()
    # the temperature: every rotated vector is longer by the attention scale, so scores grow by its square
    x = randn(6, 3, 5, head_dim, dtype=torch.float64)
    rotated = apply_rope(x, torch.arange(5), base=theta, scaling=params)
    torch.testing.assert_close(rotated.norm(dim=-1), scale * x.norm(dim=-1), rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- config, layer, model


def test_model_config_takes_a_copy_and_round_trips():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    cfg = ModelConfig(d_vocab=50, n_ctx=64, d_model=32, n_layers=1, n_heads=4, positional="rope", rope_scaling=scaling)
    scaling["factor"] = 8.0  # the caller's dict changes later: the config keeps what it was given
    assert cfg.rope_scaling["factor"] == 4.0
    again = ModelConfig(**json.loads(json.dumps(cfg.as_dict())))
    assert again == cfg and hash(again) == hash(cfg)
    assert cfg.replace(n_layers=2).rope_scaling == cfg.rope_scaling
    assert cfg != cfg.replace(rope_scaling=None)


def test_gemma3_style_local_layers_keep_plain_rope():
    scaling = {"rope_type": "linear", "factor": 8.0}
    cfg = ModelConfig(d_vocab=50, n_ctx=64, d_model=32, n_layers=2, n_heads=4, positional="rope", rope_base=1e6,
                      rope_scaling=scaling, sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                      rope_local_base=10000.0)
    from tfedu.model import GPT

    model = GPT(cfg)
    local, full = (block.attn for block in model.blocks)
    assert (local.rope_base, local.rope_scaling) == (10000.0, None)
    assert (full.rope_base, full.rope_scaling) == (1e6, scaling)


# ----------------------------------------------------------------------------- bad input


LINEAR = {"rope_type": "linear", "factor": 2.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LLAMA3 = CASES["llama3-small"][2]


@pytest.mark.parametrize(("scaling", "match"), [
    ("linear", "must be a dict"),
    ({"factor": 2.0}, "needs a 'rope_type'"),
    ({"type": "linear", "factor": 2.0}, "transformers 4.x called it 'type'"),
    ({"rope_type": "longrope", "factor": 2.0}, "unknown rope_type 'longrope'.*'linear', 'ntk'"),
    ({"rope_type": "Linear", "factor": 2.0}, "unknown rope_type"),
    ({"rope_type": "linear"}, r"needs 'factor' \(how many times longer"),
    ({"rope_type": "ntk"}, "needs 'factor'"),
    ({"rope_type": "dynamic", "factor": 2.0}, "needs 'original_max_position_embeddings'.*max_position_embeddings"),
    ({**LLAMA3, "low_freq_factor": None} | {"rope_type": "llama3"}, "low_freq_factor"),
    ({k: v for k, v in LLAMA3.items() if k != "high_freq_factor"}, "needs 'high_freq_factor'"),
    ({"rope_type": "yarn", "factor": 4.0}, "needs 'original_max_position_embeddings'"),
    ({**LINEAR, "factor": 0}, "factor must be a finite number >= 1"),
    ({**LINEAR, "factor": -2.0}, "factor must be"),
    ({**LINEAR, "factor": 0.5}, "factor must be"),
    ({**LINEAR, "factor": float("nan")}, "factor must be"),
    ({**LINEAR, "factor": float("inf")}, "factor must be"),
    ({**LINEAR, "factor": True}, "factor must be"),
    ({**LINEAR, "factor": "2"}, "factor must be"),
    ({**LINEAR, "factr": 2.0}, "unknown key.*'factr'"),
    ({**LINEAR, "beta_fast": 32}, "unknown key.*'beta_fast'"),
    ({**LINEAR, "rope_theta": 500000.0}, "rope_theta=500000.0 differs from the RoPE base 10000.0"),
    ({**LINEAR, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "low_freq_factor < high_freq_factor"),
    ({**LLAMA3, "low_freq_factor": 0.0}, "0 < low_freq_factor"),
    ({**LLAMA3, "original_max_position_embeddings": 0}, "original_max_position_embeddings must be an int >= 1"),
    ({**YARN, "original_max_position_embeddings": 32.5}, "original_max_position_embeddings must be an int"),
    ({**YARN, "beta_fast": 1, "beta_slow": 32}, "beta_fast > beta_slow"),
    ({**YARN, "beta_slow": -1}, "beta_slow must be a finite number > 0"),
    ({**YARN, "attention_factor": 0.0}, "attention_factor must be"),
    ({**YARN, "mscale": "big"}, "mscale must be"),
    ({**YARN, "truncate": "yes"}, "truncate must be True or False"),
])
def test_bad_scaling_dicts_are_refused_with_what_was_expected(scaling, match):
    with pytest.raises(ValueError, match=match):
        validate_rope_scaling(scaling, base=10000.0)
    with pytest.raises(ValueError, match=match):
        rope_frequencies(16, 10000.0, scaling)
    with pytest.raises(ValueError, match=match):
        apply_rope(torch.zeros(2, 16), torch.arange(2), scaling=scaling)
    with pytest.raises(ValueError, match="ModelConfig.rope_scaling: .*" + match):
        ModelConfig(positional="rope", rope_scaling=scaling)
    with pytest.raises(ValueError, match=match):
        Attention(16, 2, rope_base=10000.0, rope_scaling=scaling)


def test_every_rope_type_has_its_keys_and_a_valid_example():
    examples = {"default": {"rope_type": "default"}, "linear": LINEAR, "ntk": {"rope_type": "ntk", "factor": 2.0},
                "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32},
                "llama3": LLAMA3, "yarn": YARN}
    assert tuple(examples) == ROPE_TYPES
    for scaling in examples.values():
        validate_rope_scaling(scaling, base=10000.0)
        ModelConfig(positional="rope", rope_scaling=scaling)


def test_other_bad_uses_are_refused():
    with pytest.raises(ValueError, match="scales RoPE's frequencies, but positional='learned'"):
        ModelConfig(rope_scaling=LINEAR)
    with pytest.raises(ValueError, match="needs d_head >= 4"):
        ModelConfig(d_model=8, n_heads=4, positional="rope", rope_scaling={"rope_type": "ntk", "factor": 2.0})
    x, positions = torch.zeros(3, 8), torch.arange(3)
    with pytest.raises(ValueError, match="either scaling .* or inv_freq and attention_scale"):
        apply_rope(x, positions, scaling=LINEAR, inv_freq=frequencies(8))
    with pytest.raises(ValueError, match="either scaling"):
        apply_rope(x, positions, scaling=LINEAR, attention_scale=2.0)
    with pytest.raises(ValueError, match=r"inv_freq must be a floating-point tensor of shape \(d_head / 2,\) = \(4,\)"):
        apply_rope(x, positions, inv_freq=frequencies(16))
    with pytest.raises(ValueError, match="inv_freq must be"):
        rope_angles(positions, 8, inv_freq=[1.0, 0.1, 0.01, 0.001])
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="attention_scale must be a finite number > 0"):
            apply_rope(x, positions, attention_scale=bad)
    with pytest.raises(ValueError, match="seq_len must be an int"):
        rope_frequencies(8, 10000.0, LINEAR, seq_len=3.5)
    with pytest.raises(ValueError, match="0 < beta_slow < beta_fast"):
        yarn_ramp(16, 10000.0, 32, beta_fast=1.0, beta_slow=2.0)

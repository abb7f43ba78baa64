"""tfedu.flops against torch's own FLOP counter (the oracle) on real layers."""

import dataclasses
import doctest

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tfedu import flops
from tfedu.flops import SOFTMAX_OPS_PER_SCORE, attention_flops, linear_flops, matmul_flops, multi_head_overhead


def counted(fn, *args, **kwargs) -> int:
    """The matmul FLOPs torch counts while running ``fn``."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def test_docstring_examples():
    failures, tried = doctest.testmod(flops, raise_on_error=False)
    assert tried >= 5 and failures == 0


def test_matmul_flops_matches_torch():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    assert matmul_flops(3, 5, 7) == counted(torch.matmul, a, b) == 2 * 3 * 5 * 7


@pytest.mark.parametrize("bias", [True, False])
def test_linear_flops_matches_torch(bias):
    layer = nn.Linear(6, 10, bias=bias)
    x = torch.randn(4, 3, 6)  # 12 vectors
    assert linear_flops(12, 6, 10) == counted(layer, x) == 2 * 12 * 6 * 10


@pytest.mark.parametrize(
    "batch, query_pos, key_pos, d_model, n_heads, d_head, kv_d_model",
    [(2, 6, 6, 12, 3, None, None), (1, 5, 5, 8, 1, None, None), (3, 4, 7, 8, 2, None, 5), (2, 3, 3, 6, 2, 5, None)],
)
def test_attention_flops_matches_torch_on_the_reference_layer(batch, query_pos, key_pos, d_model, n_heads, d_head, kv_d_model):
    from tfedu.attention import MultiHeadAttention

    layer = MultiHeadAttention(d_model, n_heads, d_head=d_head, kv_d_model=kv_d_model)
    x = torch.randn(batch, query_pos, d_model)
    context = None if kv_d_model is None and key_pos == query_pos else torch.randn(batch, key_pos, kv_d_model or d_model)
    expected = attention_flops(batch, query_pos, key_pos, d_model, n_heads, d_head=d_head, kv_d_model=kv_d_model)
    assert expected.matmul == counted(layer, x, context)


def test_attention_flops_matches_torch_multihead_attention():
    layer = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        assert attention_flops(2, 9, 9, 16, 4).matmul == counted(layer, x, x, x, need_weights=True)  # the path whose matmuls torch counts


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16])
def test_matmul_flops_do_not_depend_on_the_number_of_heads(n_heads):
    b, n, d = 3, 10, 64
    f = attention_flops(b, n, n, d, n_heads)
    assert f.matmul == 8 * b * n * d**2 + 4 * b * n**2 * d
    assert f.softmax == SOFTMAX_OPS_PER_SCORE * b * n_heads * n * n


def test_cross_attention_terms():
    f = attention_flops(batch=2, query_pos=3, key_pos=5, d_model=4, n_heads=2, kv_d_model=6)
    assert (f.q_proj, f.k_proj, f.v_proj, f.out_proj) == (2 * 6 * 4 * 4, 2 * 10 * 6 * 4, 2 * 10 * 6 * 4, 2 * 6 * 4 * 4)
    assert f.scores == f.mix == 2 * 2 * 3 * 5 * 4  # 2 * batch * query_pos * key_pos * (n_heads * d_head)
    assert f.total == f.matmul + f.softmax


def test_overhead_is_small_and_grows_with_heads():
    ratios = [multi_head_overhead(1, 512, 512, h) for h in (1, 2, 8, 32)]
    assert ratios[0] == 1.0
    assert ratios == sorted(ratios) and ratios[-1] < 1.1


@pytest.mark.parametrize("pos, d_model, n_heads", [(1024, 768, 12), (4096, 96, 32), (16, 96, 32), (7, 8, 8), (4096, 2304, 1)])
def test_overhead_has_the_closed_form_of_notebook_05(pos, d_model, n_heads):
    """h heads / 1 head = 1 + 5(h-1) / (8 d^2/n + 4d + 5), below its long-sequence limit 1 + 5(h-1)/(4d+5)."""
    ratio = multi_head_overhead(1, pos, d_model, n_heads)
    assert ratio == pytest.approx(1 + 5 * (n_heads - 1) / (8 * d_model**2 / pos + 4 * d_model + 5), rel=1e-12)
    assert ratio <= 1 + 5 * (n_heads - 1) / (4 * d_model + 5)


def test_the_widget_corner_and_gpt2_small():
    assert round(multi_head_overhead(1, 4096, 96, 32), 3) == 1.381  # the 1.38x learners saw in notebook 05's widget
    assert round(multi_head_overhead(1, 1024, 768, 12), 4) == 1.0072


@pytest.mark.parametrize("d_model, n_heads", [(768, 12), (96, 32), (64, 4)])
def test_n_by_n_products_overtake_the_projections_at_twice_d_model(d_model, n_heads):
    def n_by_n(n):
        f = attention_flops(1, n, n, d_model, n_heads)
        return f.scores + f.mix, f.q_proj + f.k_proj + f.v_proj + f.out_proj

    assert n_by_n(2 * d_model)[0] == n_by_n(2 * d_model)[1]
    assert n_by_n(2 * d_model - 1)[0] < n_by_n(2 * d_model - 1)[1] and n_by_n(2 * d_model + 1)[0] > n_by_n(2 * d_model + 1)[1]
    f = attention_flops(1, 4096, 4096, d_model, n_heads)
    assert f.softmax / (f.scores + f.mix) == pytest.approx(SOFTMAX_OPS_PER_SCORE / (4 * (d_model // n_heads)))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: matmul_flops(-1, 2, 3), "m must be a non-negative int"),
        (lambda: linear_flops(2, 3.0, 4), "d_in must be a positive int"),
        (lambda: attention_flops(1, 4, 4, 10, 3), "not divisible by n_heads=3"),
        (lambda: attention_flops(1, 4, 4, 8, 0), "n_heads must be a positive int"),
        (lambda: attention_flops(1, 4, 4, 8, 2, d_head=0), "d_head must be a positive int"),
        (lambda: attention_flops(True, 4, 4, 8, 2), "batch must be a non-negative int"),
        (lambda: multi_head_overhead(0, 4, 8, 2), "batch must be a positive int"),
        (lambda: multi_head_overhead(1, 0, 8, 2), "pos must be a positive int"),
    ],
)
def test_bad_input_says_what_was_expected(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layer_costs_follow_vaswani_table_1():
    from tfedu.flops import layer_costs

    n, d, k, r = 1000, 64, 4, 100
    costs = layer_costs(n, d, k, r)
    assert costs["self-attention"] == flops.LayerCost(n**2 * d, 1, 1)
    assert costs["recurrent"] == flops.LayerCost(n * d**2, n, n)
    assert costs["convolutional"] == flops.LayerCost(k * n * d**2, 1, 5)  # 4**5 = 1024 >= 1000 > 4**4
    assert costs["self-attention (restricted)"] == flops.LayerCost(r * n * d, 1, 10)
    # Vaswani sec. 4: self-attention is cheaper than recurrence exactly when n < d
    for n_pos in (32, 64, 128):
        c = layer_costs(n_pos, 64, 3, 8)
        assert (c["self-attention"].per_layer < c["recurrent"].per_layer) == (n_pos < 64)
    assert layer_costs(1, 8, 2, 1)["convolutional"].max_path == 1
    for bad in (dict(k=1), dict(n=0)):
        with pytest.raises(ValueError):
            layer_costs(**{**dict(n=4, d=4, k=2, r=2), **bad})


# ----------------------------------------------------------------------------- whole models from a ModelConfig

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tfedu.config import ModelConfig, preset  # noqa: E402
from tfedu.flops import (  # noqa: E402
    ParamCount,
    deck_param_count,
    flops_per_token,
    param_count,
    training_compute,
)


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied matrix once


def tiny_llama(n_kv_heads=4, tied=False, **kwargs):
    """A small Llama (HF names) and the ModelConfig describing it."""
    hf = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=n_kv_heads, vocab_size=100, max_position_embeddings=16,
                     tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, **kwargs)
    cfg = ModelConfig(d_vocab=100, n_ctx=16, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, d_mlp=96,
                      activation="swiglu", norm="rms", bias=False, positional="rope", tied_embeddings=tied)
    return hf, cfg


@pytest.mark.parametrize(
    "name, n_embd, n_layer, n_head, expected",
    [
        ("gpt2", 768, 12, 12, 124_439_808),
        ("gpt2-medium", 1024, 24, 16, 354_823_168),
        ("gpt2-large", 1280, 36, 20, 774_030_080),
        ("gpt2-xl", 1600, 48, 25, 1_557_611_200),
    ],
)
def test_gpt2_sizes_match_hugging_face(name, n_embd, n_layer, n_head, expected):
    with torch.device("meta"):  # shapes only: no memory, no download
        model = GPT2LMHeadModel(GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head))
    assert param_count(preset(name)).total == expected == n_params(model)


def test_llama_7b_matches_hugging_face():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                             tie_word_embeddings=False))
    p = param_count(preset("llama-7b"))
    assert p.total == 6_738_415_616 == n_params(model)
    assert p.positions == 0 and p.unembedding == p.embedding == 32000 * 4096  # RoPE: no table; W_U its own


@pytest.mark.parametrize("n_kv_heads, tied", [(4, False), (2, False), (1, True), (2, True)])
def test_small_llama_grouped_query_and_tied(n_kv_heads, tied):
    hf, cfg = tiny_llama(n_kv_heads, tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    p = param_count(cfg)
    assert p.total == n_params(model)
    d_head = 64 // 4
    assert p.attention == 2 * (2 * 64 * 64 + 2 * 64 * n_kv_heads * d_head)  # K and V shrink with n_kv_heads
    assert (p.unembedding == 0) == tied
    # the deck's convention: every block matrix, no norms, W_E and W_U twice even when tied
    block_matrices = sum(q.numel() for q in model.model.layers.parameters() if q.ndim == 2)
    assert deck_param_count(cfg) == block_matrices + 2 * 100 * 64


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
@pytest.mark.parametrize(
    "name, nhead, expected, paper",
    [("transformer-base", 8, 63_082_496, 65e6), ("transformer-big", 16, 214_245_376, 213e6)],
)
def test_original_transformer_against_torch_and_table_3(name, nhead, expected, paper):
    cfg = preset(name)
    with torch.device("meta"):
        model = nn.Transformer(cfg.d_model, nhead, 6, 6, cfg.d_mlp)
        shared = nn.Embedding(cfg.d_vocab, cfg.d_model)  # source, target and W_U: one matrix (Vaswani sec. 3.4)
    # nn.Transformer ends the encoder and the decoder in a LayerNorm (weight + bias); the post-norm
    # paper has none (each block already ends in one), so those 2 * 2 * d_model come off.
    torch_count = n_params(model) + n_params(shared) - 2 * 2 * cfg.d_model
    p = param_count(cfg, kind="encoder-decoder")
    assert p.total == expected == torch_count
    # Vaswani et al. 2017, table 3: base 65M, big 213M. With a 37,000-token shared vocabulary we get
    # 63.1M (about 2M under the paper) and 214.2M (1.2M over); the paper does not say which vocabulary
    # size its counts used, so the gap stays unexplained.
    assert abs(p.total - paper) < 2e6
    assert p.cross_attention == p.attention // 2 and p.unembedding == 0 and p.positions == 0


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_pre_norm_encoder_decoder_has_a_final_norm_per_stack():
    cfg = preset("transformer-base").replace(norm_position="pre")
    with torch.device("meta"):
        model = nn.Transformer(cfg.d_model, 8, 6, 6, cfg.d_mlp, norm_first=True)  # its final norms belong here
    assert param_count(cfg, kind="encoder-decoder").total == n_params(model) + cfg.d_vocab * cfg.d_model


def test_kinds_and_untied_encoder_decoder():
    cfg = preset("tiny")
    assert param_count(cfg, kind="encoder") == param_count(cfg, kind="gpt")  # BERT-style: same parameters
    untied = param_count(cfg.replace(tied_embeddings=False), kind="encoder-decoder")
    table = cfg.d_vocab * cfg.d_model
    assert (untied.embedding, untied.unembedding) == (2 * table, table)  # source, target, W_U
    assert untied.positions == cfg.n_ctx * cfg.d_model  # learned: one table, shared by both stacks
    block_norms = (2 * 2 + 3 * 2) * 2 * cfg.d_model  # 2 norms per encoder block, 3 per decoder block
    assert untied.norms == block_norms + 2 * 2 * cfg.d_model  # plus the final norm of each pre-norm stack
    assert untied.non_embedding == untied.attention + untied.cross_attention + untied.mlp + untied.norms
    with pytest.raises(dataclasses.FrozenInstanceError):
        untied.mlp = 0


def test_gpt3_deck_count_and_exact_count():
    cfg = preset("gpt3")
    d, L, V = 12288, 96, 50257
    assert deck_param_count(cfg) == 12 * d**2 * L + 2 * V * d == 175_181_291_520  # the lecture deck's total
    # W_E and W_U tied, as in GPT-2 (which GPT-3 follows): Brown et al. 2020, table D.1, say 174,600M
    p = param_count(cfg)
    assert p.total == 174_604_259_328
    biases, norms, positions, second_table = L * 9 * d, L * 4 * d + 2 * d, 2048 * d, V * d
    assert p.total - deck_param_count(cfg) == biases + norms + positions - second_table
    untied = param_count(cfg.replace(tied_embeddings=False)).total
    assert untied == 175_221_817_344 and untied - deck_param_count(cfg) == biases + norms + positions == 40_525_824
    assert deck_param_count(preset("gpt2")) == 12 * 768**2 * 12 + 2 * 50257 * 768  # tied, still counted twice


def flops_counted_by_torch(model, n_ctx):
    x = torch.randint(0, 100, (1, n_ctx), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return counted(model, x)


def test_forward_flops_equal_torch_flop_counter_on_gpt2():
    torch.manual_seed(0)
    # eager attention: torch's counter has no formula for the CPU SDPA kernel and would count no
    # attention products at all. Eager computes the full 16 x 16 scores (masked half included),
    # as flops_per_token counts them; GPT-2's Conv1D is an addmm, counted without its bias add.
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=16,
                                       bos_token_id=0, eos_token_id=0, attn_implementation="eager")).eval()
    cfg = ModelConfig(d_vocab=100, n_ctx=16, d_model=64, n_layers=2, n_heads=4)
    assert param_count(cfg).total == n_params(model)
    f = flops_per_token(cfg, 16)
    assert f.forward * 16 == flops_counted_by_torch(model, 16)  # the lm_head (unembedding) included
    assert flops_per_token(cfg, 10).forward * 10 == flops_counted_by_torch(model, 10)  # a shorter sequence


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_forward_flops_equal_torch_flop_counter_on_grouped_query_llama(n_kv_heads):
    torch.manual_seed(0)
    hf, cfg = tiny_llama(n_kv_heads, attn_implementation="eager")
    model = LlamaForCausalLM(hf).eval()
    assert flops_per_token(cfg, 16).forward * 16 == flops_counted_by_torch(model, 16)


@pytest.mark.parametrize("name", ["gpt2", "gpt2-xl", "gpt3", "llama-7b"])
def test_forward_flops_against_kaplan(name):
    cfg = preset(name)
    n_ctx, d_attn = cfg.n_ctx, cfg.n_heads * cfg.d_head
    f = flops_per_token(cfg, n_ctx)
    kaplan = 2 * param_count(cfg).non_embedding + 2 * cfg.n_layers * n_ctx * cfg.d_model  # Kaplan 2020, eq. 2.2
    assert f.attention_scores == f.attention_mix == 2 * cfg.n_layers * n_ctx * d_attn  # Kaplan table 1, "mask"
    assert f.attention_proj + f.mlp == 2 * (deck_param_count(cfg) - 2 * cfg.d_vocab * cfg.d_model)  # 2 per weight
    # Kaplan's C_forward has one n_ctx term and no unembedding; without those two we differ only by
    # the biases and norms inside Kaplan's N, which do no matmul (0.13% of GPT-2 small's N)
    assert f.forward - f.attention_mix - f.unembedding == pytest.approx(kaplan, rel=2e-3)
    if name == "gpt3":
        assert f.forward == pytest.approx(kaplan, rel=0.02)  # big models: within a few percent
        assert f.training == pytest.approx(6 * param_count(cfg).non_embedding, rel=0.035)  # C = 6N per token
    if name == "gpt2":
        assert f.unembedding / f.forward > 0.25  # small models: the 50257-way unembedding is a quarter


def test_training_multiples_and_six_n_d():
    f = flops_per_token(preset("tiny"), 64)
    assert (f.training, f.training_with_recompute) == (3 * f.forward, 4 * f.forward)
    assert f.embedding == 0
    assert training_compute(175e9, 300e9) == pytest.approx(3.15e23)
    assert f"{training_compute(174.6e9, 300e9):.2e}" == "3.14e+23"  # Brown et al. 2020, table D.1
    assert training_compute(10, 20) == 1200
    assert flops_per_token(preset("tiny").replace(positional="rope"), 1000).forward > 0  # no table to outgrow


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: param_count(preset("tiny"), kind="decoder"), "kind='decoder' is not one of 'gpt', 'encoder'"),
        (lambda: param_count({"d_model": 64}), "expected a tfedu.config.ModelConfig.*got dict"),
        (lambda: deck_param_count("gpt3"), "expected a tfedu.config.ModelConfig.*got str"),
        (lambda: flops_per_token(None, 16), "expected a tfedu.config.ModelConfig.*got NoneType"),
        (lambda: flops_per_token(preset("tiny"), 0), "n_ctx_used must be a positive int"),
        (lambda: flops_per_token(preset("tiny"), 65), "longer than the learned position table"),
        (lambda: training_compute(0, 1e9), "n_params must be a positive number"),
        (lambda: training_compute(1e9, "300B"), "n_tokens must be a positive number"),
    ],
)
def test_model_level_bad_input_says_what_was_expected(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("kind", ["gpt", "encoder", "encoder-decoder"])
@pytest.mark.parametrize("changes", [{}, {"tied_embeddings": False}, {"norm_position": "post"},
                                     {"positional": "rope", "norm": "rms", "activation": "swiglu", "bias": False,
                                      "n_kv_heads": 2}, {"positional": "sinusoidal"}])
def test_param_count_equals_tfedu_models(kind, changes):
    from tfedu.model import GPT, Encoder, EncoderDecoder

    cfg = preset("tiny").replace(**changes)
    with torch.device("meta"):
        model = {"gpt": GPT, "encoder": Encoder, "encoder-decoder": EncoderDecoder}[kind](cfg)
    assert param_count(cfg, kind=kind).total == n_params(model)

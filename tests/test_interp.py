"""tfedu.interp: hook_z, cached activations, attention plots, the logit lens, head scores, direct logit attribution.

Oracles: attention written out by hand (pattern @ v with repeated key/value heads), the model's own
logits (bit for bit for the lens), the model's mean loss, hand-built patterns with known scores, the
closed form mean(1 / (q + 1)) for uniform attention, and path patching (a head's output removed with
every later sub-layer and the final norm's scale held at their clean values) for the attribution.
"""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch

from tfedu.experiments import course_gpt
from tfedu.config import ModelConfig, preset
from tfedu.interp import (
    attention_patterns,
    chance_scores,
    direct_logit_attribution,
    induction_score,
    logit_lens,
    logit_lens_probs,
    per_head_W_O,
    plot_attention_heads,
    plot_attention_mean,
    plot_logit_lens,
    previous_token_score,
    repeated_random_tokens,
    repeated_sequence_losses,
    residual_names,
    run_with_cache,
    score_heads,
    token_labels,
    top_tokens_table,
)
from tfedu.kv_cache import KVCache
from tfedu.layers import Attention
from tfedu.model import GPT
from tfedu.peft import apply_prefix_tuning
from tfedu.tokenizer import Tokenizer

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

torch.set_num_threads(1)


def tiny_gpt(dtype: torch.dtype = torch.float32, **overrides: object) -> GPT:
    """The tiny preset with random (non-zero) biases and norm gains, so no term of the sum is trivially zero."""
    torch.manual_seed(0)
    model = GPT(preset("tiny").replace(**overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or name.endswith("weight") and param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def ids_for(model: GPT, batch: int = 2, pos: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def course():
    return course_gpt.load()


# ----------------------------------------------------------------------------- hook_z


def _z_of(attn: Attention, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    seen = []
    handle = attn.hook_z.register_forward_hook(lambda module, inputs, output: seen.append(output))
    try:
        out = attn(*args, **kwargs)
    finally:
        handle.remove()
    assert len(seen) == 1
    return out, seen[0]


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_hook_z_is_pattern_times_values_per_head_for_both_impls(n_kv_heads):
    torch.manual_seed(0)
    attn = Attention(16, 4, n_kv_heads=n_kv_heads, impl="manual")
    x = torch.randn(2, 5, 16)
    patterns = []
    attn.hook_pattern.register_forward_hook(lambda module, inputs, output: patterns.append(output))
    out, z = _z_of(attn, x, causal=True)
    assert z.shape == (2, 5, 4, 4)  # batch query_pos n_heads d_head
    v = attn.W_V(x).unflatten(-1, (n_kv_heads, 4)).transpose(1, 2).repeat_interleave(4 // n_kv_heads, dim=1)
    torch.testing.assert_close(z, (patterns[0] @ v).transpose(1, 2))
    # Head h writes z_h @ W_O[h]; the heads' sum plus the bias is the layer's output.
    by_head = torch.einsum("bqhd,hdm->bqm", z, per_head_W_O(attn)) + attn.W_O.bias
    torch.testing.assert_close(by_head, out)
    attn.impl = "sdpa"
    out_sdpa, z_sdpa = _z_of(attn, x, causal=True)
    assert len(patterns) == 1  # the fused kernel has no pattern to show
    torch.testing.assert_close(z_sdpa, z, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out_sdpa, out, atol=1e-6, rtol=1e-5)


def test_hook_z_replacing_a_head_removes_its_share():
    torch.manual_seed(0)
    attn = Attention(16, 4, impl="sdpa")
    x = torch.randn(1, 6, 16)
    out, z = _z_of(attn, x, causal=True)

    def drop_head_2(z):
        z = z.clone()
        z[:, :, 2] = 0.0
        return z

    attn.hook_z.register_forward_hook(lambda module, inputs, output: drop_head_2(output))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, causal=True), out - z[:, :, 2] @ per_head_W_O(attn)[2])


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_hook_z_with_kv_cache_and_prefix(attention):
    model = tiny_gpt(attention=attention, n_kv_heads=2)
    ids = ids_for(model, pos=7)
    _, full = run_with_cache(model, ids, ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"])
    cache = KVCache.for_model(model, 2)
    with torch.no_grad():
        model(ids[:, :6], kv_cache=cache)
        _, step = model.run_with_cache(ids[:, 6:], kv_cache=cache)
    assert step["blocks.1.attn.hook_z"].shape == (2, 1, 4, 16)
    torch.testing.assert_close(step["blocks.1.attn.hook_z"], full["blocks.1.attn.hook_z"][:, 6:], atol=1e-5, rtol=1e-4)
    # A learned prefix: the hook still sees one z per token (the prefix keys change what it holds).
    apply_prefix_tuning(model, n_prefix=3)
    _, with_prefix = run_with_cache(model, ids, ["blocks.0.attn.hook_z"])
    assert with_prefix["blocks.0.attn.hook_z"].shape == (2, 7, 4, 16)
    assert not torch.allclose(with_prefix["blocks.0.attn.hook_z"], full["blocks.0.attn.hook_z"], atol=1e-4)


def test_per_head_W_O_error():
    with pytest.raises(TypeError, match=r"model\.blocks\[i\]\.attn"):
        per_head_W_O(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- run_with_cache


def test_run_with_cache_all_names_on_a_fused_model_includes_the_pattern():
    model = tiny_gpt(attention="sdpa").train()
    ids = ids_for(model)
    with torch.no_grad():
        expected = model.eval()(ids)
    model.train()
    logits, cache = run_with_cache(model, ids)
    assert set(cache) == set(model.hook_points())
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert cache["blocks.1.attn.hook_pattern"].shape == (2, 4, 12, 12)
    assert cache["blocks.0.attn.hook_z"].shape == (2, 12, 4, 16)
    assert cache["blocks.1.hook_resid_post"].shape == (2, 12, 64)
    assert not any(t.requires_grad for t in cache.values())
    assert model.training and all(block.attn.impl == "sdpa" for block in model.blocks)  # restored
    assert not any(module._forward_hooks for module in model.hook_points().values())


def test_run_with_cache_selects_names():
    model = tiny_gpt()
    ids = ids_for(model)
    _, cache = run_with_cache(model, ids, ["hook_embed", "blocks.1.hook_mlp_out"])
    assert list(cache) == ["hook_embed", "blocks.1.hook_mlp_out"]
    _, cache = run_with_cache(model, ids, lambda name: name.endswith("hook_pattern"))
    assert list(cache) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    _, cache = run_with_cache(model, ids, "blocks.0.hook_resid_pre")
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], model.embed(ids) + model.pos_embed.W_pos[:12])


def test_run_with_cache_errors():
    model = tiny_gpt()
    with pytest.raises(KeyError, match=r"'blocks\.0\.hook_attn_output'.*blocks\.0\.hook_attn_out"):
        run_with_cache(model, ids_for(model), ["blocks.0.hook_attn_output"])
    with pytest.raises(TypeError, match="predicate"):
        run_with_cache(model, ids_for(model), [1])
    with pytest.raises(TypeError, match="LanguageModel"):
        run_with_cache(torch.nn.Linear(2, 2), ids_for(model))


def test_attention_patterns_matches_fused_and_restores_on_error():
    model = tiny_gpt(attention="sdpa")
    ids = ids_for(model)
    with torch.no_grad():
        fused = model(ids)
        with attention_patterns(model):
            assert all(block.attn.impl == "manual" for block in model.blocks)
            manual = model(ids)
    torch.testing.assert_close(manual, fused, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="boom"):
        with attention_patterns(model):
            raise RuntimeError("boom")
    assert all(block.attn.impl == "sdpa" for block in model.blocks)


# ----------------------------------------------------------------------------- plots


def test_plot_attention_heads_and_mean():
    pattern = torch.softmax(torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0)), -1).tril()
    tokens = ["a", "b", "c", "d"]
    fig = plot_attention_heads(pattern, tokens, title="layer 0")
    heads = [ax for ax in fig.axes if ax.get_title().startswith("head")]
    assert [ax.get_title() for ax in heads] == ["head 0", "head 1", "head 2"]
    assert len(fig.axes) == 4  # and one colour bar
    assert [t.get_text() for t in heads[1].get_xticklabels()] == tokens
    assert [t.get_text() for t in heads[0].get_yticklabels()] == tokens
    assert heads[0].get_ylabel().startswith("query") and heads[2].get_xlabel().startswith("key")
    assert fig._suptitle.get_text() == "layer 0"
    plt.close(fig)
    # A KV-cache step: one query, the last token.
    fig = plot_attention_mean(pattern[:, -1:], tokens)
    assert len(fig.axes) == 2 and [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["d"]
    torch.testing.assert_close(torch.tensor(fig.axes[0].images[0].get_array()), pattern[:, -1:].mean(0))
    plt.close(fig)


def test_plot_attention_errors():
    with pytest.raises(ValueError, match=r"take pattern\[0\]"):
        plot_attention_heads(torch.rand(1, 2, 3, 3), list("abc"))
    with pytest.raises(ValueError, match="tokens must label the 3 keys"):
        plot_attention_mean(torch.rand(2, 3, 3), list("ab"))
    with pytest.raises(TypeError, match="float tensor"):
        plot_attention_mean(torch.ones(2, 3, 3, dtype=torch.long), list("abc"))


def test_token_labels():
    tok = Tokenizer([(32, 116)])  # " t" is id 256
    assert token_labels(tok, torch.tensor([256, 10, 9, 0xE2])) == ["·t", "\\n", "\\t", "\\xe2"]


# ----------------------------------------------------------------------------- the logit lens


def test_logit_lens_last_row_is_the_model_bit_for_bit_course_gpt(course):
    model, tok = course
    ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n")])
    lens = logit_lens(model, ids)
    assert lens.shape == (5, 1, ids.shape[1], 1024)
    with torch.no_grad():
        assert torch.equal(lens[-1], model(ids))


@pytest.mark.parametrize("overrides", [{}, {"norm": "rms", "bias": False, "positional": "rope"}])
def test_logit_lens_rows(overrides):
    model = tiny_gpt(**overrides)
    ids = ids_for(model)
    lens = logit_lens(model, ids)
    assert lens.shape == (3, 2, 12, 256)
    with torch.no_grad():
        assert torch.equal(lens[-1], model(ids))
        # Row 0 by hand: the embeddings alone through the final norm and W_E^T (tied).
        resid = model.embed(ids) + (model.pos_embed.W_pos[:12] if model.pos_embed is not None else 0.0)
        norm = model.ln_final
        if overrides:
            normed = resid / torch.sqrt(resid.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
        else:
            centred = resid - resid.mean(-1, keepdim=True)
            normed = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias
        torch.testing.assert_close(lens[0], normed @ model.embed.weight.T)
    assert residual_names(model) == ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]


def test_logit_lens_probs_tables_and_plot():
    model = tiny_gpt()
    ids = ids_for(model, batch=1, pos=5)
    lens = logit_lens(model, ids)
    probs = logit_lens_probs(lens)
    assert probs.shape == (3, 1, 5)
    final = lens[-1].softmax(-1).amax(-1)
    torch.testing.assert_close(probs[-1], final)
    targets = ids.roll(-1, dims=1)
    torch.testing.assert_close(logit_lens_probs(lens, targets)[1], lens[1].softmax(-1).gather(-1, targets[..., None])[..., 0])
    tok = Tokenizer([])
    table = top_tokens_table(lens, tok, k=2)
    assert len(table) == 3 and all(len(row) == 5 for row in table)
    best = lens[2, 0, 4].topk(2).indices.tolist()
    assert table[2][4] == " / ".join(token_labels(tok, best))
    fig = plot_logit_lens(probs[:, 0], token_labels(tok, ids[0]), cell_labels=top_tokens_table(lens, tok))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["embed", "block 0", "block 1"]
    assert [t.get_text() for t in ax.get_xticklabels()] == token_labels(tok, ids[0])
    assert len(ax.texts) == 15 and len(fig.axes) == 2  # a label per cell, and a colour bar
    plt.close(fig)
    with pytest.raises(ValueError, match="3 layers and 5 positions, but 3 layer labels and 4 tokens"):
        plot_logit_lens(probs[:, 0], ["a"] * 4)
    with pytest.raises(ValueError, match=r"targets must be integer ids of shape \(batch, pos\) = \(1, 5\)"):
        logit_lens_probs(lens, ids[:, :3])
    with pytest.raises(ValueError, match="logit_lens"):
        top_tokens_table(lens[0], tok)


# ----------------------------------------------------------------------------- induction and previous-token heads


def test_repeated_random_tokens():
    ids = repeated_random_tokens(4, 6, 11, generator=torch.Generator().manual_seed(0), bos=3)
    assert ids.shape == (4, 13) and ids.dtype == torch.long
    assert (ids[:, 0] == 3).all() and (ids[:, 1:] != 3).all() and (ids < 11).all()
    assert torch.equal(ids[:, 1:7], ids[:, 7:])
    again = repeated_random_tokens(4, 6, 11, generator=torch.Generator().manual_seed(0), bos=3)
    assert torch.equal(ids, again)
    plain = repeated_random_tokens(2, 5, 11, generator=torch.Generator().manual_seed(0))
    assert plain.shape == (2, 10) and torch.equal(plain[:, :5], plain[:, 5:])
    with pytest.raises(TypeError, match="torch.Generator"):
        repeated_random_tokens(2, 5, 11, generator=0)
    with pytest.raises(ValueError, match=r"bos must be a token id in 0\.\.10"):
        repeated_random_tokens(2, 5, 11, generator=torch.Generator(), bos=11)
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"):
        repeated_random_tokens(2, 0, 11, generator=torch.Generator())


def _uniform_causal(n: int) -> torch.Tensor:
    visible = torch.ones(n, n, dtype=torch.float64).tril()
    return visible / visible.sum(-1, keepdim=True)


@pytest.mark.parametrize("offset", [0, 1])
def test_scores_of_hand_built_patterns(offset):
    seq_len = 5
    n = offset + 2 * seq_len
    query = torch.arange(n)
    previous = torch.zeros(n, n, dtype=torch.float64)
    previous[query[1:], query[1:] - 1] = 1.0
    previous[0, 0] = 1.0
    induction = _uniform_causal(n)
    second = query[offset + seq_len:]
    induction[second] = 0.0
    induction[second, second - seq_len + 1] = 1.0
    uniform = _uniform_causal(n)
    assert float(previous_token_score(previous)) == 1.0
    assert float(induction_score(induction, seq_len, offset)) == 1.0
    assert float(induction_score(previous, seq_len, offset)) == 0.0
    # Uniform causal attention: the mean of 1 / (q + 1) over the scored queries, and chance_scores says so.
    chance = chance_scores(seq_len, offset=offset)
    expected_previous = sum(1 / (q + 1) for q in range(1, n)) / (n - 1)
    expected_induction = sum(1 / (q + 1) for q in range(offset + seq_len, n)) / seq_len
    assert math.isclose(float(previous_token_score(uniform)), expected_previous, rel_tol=1e-12)
    assert math.isclose(chance["previous_token"], expected_previous, rel_tol=1e-12)
    assert math.isclose(float(induction_score(uniform, seq_len, offset)), expected_induction, rel_tol=1e-12)
    assert math.isclose(chance["induction"], expected_induction, rel_tol=1e-12)
    # Leading axes are kept: (batch, n_heads) in, (batch, n_heads) out.
    stacked = torch.stack([previous, induction, uniform])[None].expand(2, 3, n, n)
    assert previous_token_score(stacked).shape == (2, 3)
    torch.testing.assert_close(induction_score(stacked, seq_len, offset)[1],
                               torch.tensor([0.0, 1.0, expected_induction], dtype=torch.float64))


def test_score_errors():
    with pytest.raises(ValueError, match=r"pos = offset \+ 2 \* seq_len = 11"):
        induction_score(torch.rand(10, 10), 5, 1)
    with pytest.raises(ValueError, match="square"):
        previous_token_score(torch.rand(2, 3))
    with pytest.raises(ValueError, match="seq_len must be an int >= 2"):
        chance_scores(1)
    model = tiny_gpt()
    with pytest.raises(ValueError, match="repeated twice"):
        score_heads(model, ids_for(model, pos=10), 5)
    with pytest.raises(ValueError, match="fewer than 2 \\* seq_len"):
        repeated_sequence_losses(model, ids_for(model, pos=8), 5)


def test_score_heads_reads_the_patterns():
    """Force layer 1's pattern to an exact induction pattern (and layer 0's to previous-token): scores of 1."""
    model = tiny_gpt()
    seq_len, batch = 5, 3
    ids = repeated_random_tokens(batch, seq_len, 256, generator=torch.Generator().manual_seed(0), bos=0)
    n = ids.shape[1]
    query = torch.arange(n)
    previous = torch.zeros(n, n)
    previous[0, 0] = 1.0
    previous[query[1:], query[1:] - 1] = 1.0
    induction = torch.zeros(n, n)
    induction[query, (query - seq_len + 1).clamp(min=0)] = 1.0
    with model.hooks(blocks__0__attn__hook_pattern=lambda t: previous.expand_as(t),
                     blocks__1__attn__hook_pattern=lambda t: induction.expand_as(t)):
        scores = score_heads(model, ids, seq_len)
    torch.testing.assert_close(scores["previous_token"][0], torch.ones(4))
    torch.testing.assert_close(scores["induction"][1], torch.ones(4))
    assert scores["previous_token"].shape == scores["induction"].shape == (2, 4)
    # Unhooked, an untrained model's heads sit near chance (its patterns are nearly uniform).
    plain = score_heads(model, ids, seq_len)
    chance = chance_scores(seq_len, offset=1)
    torch.testing.assert_close(plain["induction"], torch.full((2, 4), chance["induction"]), atol=0.05, rtol=0)


def test_repeated_sequence_losses_agree_with_the_model_loss():
    model = tiny_gpt()
    seq_len = 6
    ids = repeated_random_tokens(3, seq_len, 256, generator=torch.Generator().manual_seed(2), bos=1)
    losses = repeated_sequence_losses(model, ids, seq_len)
    with torch.no_grad():
        logits, loss = model(ids[:, :-1], targets=ids[:, 1:])
    assert losses["per_position"].shape == (2 * seq_len,)
    torch.testing.assert_close(losses["per_position"].mean(), loss)
    by_hand = [[-logits[b, t - 1].log_softmax(-1)[ids[b, t]] for b in range(3)] for t in range(1, 2 * seq_len + 1)]
    by_hand = torch.tensor(by_hand).mean(1)  # target position t = 1 .. 2 * seq_len
    assert math.isclose(losses["first"], float(by_hand[1:seq_len].mean()), rel_tol=1e-5)  # targets 2..6
    assert math.isclose(losses["second"], float(by_hand[seq_len + 1:].mean()), rel_tol=1e-5)  # targets 8..12


def test_course_gpt_has_no_induction_heads(course):
    """Measured, not assumed: on repeated random tokens the course GPT's best induction head is at chance.

    Its best previous-token head (L2H3) is well above chance; the second copy costs as much as the first.
    """
    model, tok = course
    seq_len = 30
    ids = repeated_random_tokens(8, seq_len, 1024, generator=torch.Generator().manual_seed(0),
                                 bos=tok.special_tokens["<|endoftext|>"])
    scores = score_heads(model, ids, seq_len)
    chance = chance_scores(seq_len, offset=1)
    assert float(scores["induction"].max()) < 1.2 * chance["induction"]
    assert float(scores["previous_token"].max()) > 1.3 * chance["previous_token"]
    assert int(scores["previous_token"].argmax()) == 2 * 4 + 3  # L2H3
    losses = repeated_sequence_losses(model, ids, seq_len)
    assert losses["second"] > losses["first"] - 0.5 > math.log(1024)


# ----------------------------------------------------------------------------- direct logit attribution


def _frozen_logit(model: GPT, resid: torch.Tensor, clean: torch.Tensor, token: int) -> torch.Tensor:
    """The final norm with its scale taken from ``clean``, then W_U's column: linear in ``resid``."""
    norm = model.ln_final
    if getattr(norm, "bias", None) is None:  # RMSNorm
        return (resid / torch.sqrt(clean.pow(2).mean() + norm.eps) * norm.weight) @ model.W_U[:, token]
    std = torch.sqrt((clean - clean.mean()).pow(2).mean() + norm.eps)
    return ((resid - resid.mean()) / std * norm.weight + norm.bias) @ model.W_U[:, token]


@pytest.mark.parametrize("overrides", [{}, {"norm": "rms", "bias": False, "positional": "rope", "n_kv_heads": 2,
                                           "attention": "sdpa"}])
def test_attribution_sums_to_the_logit_and_heads_match_path_patching(overrides):
    model = tiny_gpt(torch.float64, **overrides)
    ids = ids_for(model, batch=2, pos=9)
    pos, token, b = 6, 42, 1
    parts = direct_logit_attribution(model, ids, pos, token, batch_index=b)
    with torch.no_grad():
        logit = model(ids)[b, pos, token].item()
    assert math.isclose(sum(parts.values()), logit, rel_tol=0, abs_tol=1e-10)
    heads = [f"L{i}H{h}" for i in range(2) for h in range(4)]
    expected = (["embed"] + (["pos_embed"] if not overrides else [])
                + [label for i in range(2) for label in [f"L{i}H{h}" for h in range(4)]
                   + ([f"L{i} attn bias"] if not overrides else []) + [f"L{i} MLP"]]
                + (["ln_final bias"] if not overrides else []))
    assert list(parts) == expected
    _, clean = run_with_cache(model, ids)
    last = clean["blocks.1.hook_resid_post"][b, pos]
    with torch.no_grad():
        clean_logit = _frozen_logit(model, last, last, token)
    assert math.isclose(float(clean_logit), logit, abs_tol=1e-10)
    for label in heads + ["L0 MLP"]:
        layer, what = int(label[1]), label[2:]
        hooks = {}
        if what.startswith("H"):
            head = int(what[1:])

            def ablate(z, head=head):
                z = z.clone()
                z[:, :, head] = 0.0
                return z

            hooks[f"blocks__{layer}__attn__hook_z"] = ablate
            frozen = [f"blocks.{layer}.hook_mlp_out"]
        else:
            hooks[f"blocks__{layer}__hook_mlp_out"] = torch.zeros_like
            frozen = []
        # Path patching: every later sub-layer keeps its clean output, so only the direct path changes.
        frozen += [f"blocks.{i}.{point}" for i in range(layer + 1, 2) for point in ("hook_attn_out", "hook_mlp_out")]
        for name in frozen:
            hooks[name.replace(".", "__")] = lambda t, name=name: clean[name]
        with torch.no_grad(), model.hooks(**hooks):
            _, ablated = model.run_with_cache(ids)
            removed = _frozen_logit(model, ablated["blocks.1.hook_resid_post"][b, pos], last, token)
        assert math.isclose(float(clean_logit - removed), parts[label], rel_tol=1e-9, abs_tol=1e-10), label


def test_attribution_of_an_attention_only_model_has_no_mlp_parts():
    model = tiny_gpt(torch.float64, d_mlp=0, positional="rope")
    ids = ids_for(model, batch=1, pos=9)
    parts = direct_logit_attribution(model, ids, 8, 5)
    with torch.no_grad():
        logit = model(ids)[0, 8, 5].item()
    assert math.isclose(sum(parts.values()), logit, rel_tol=0, abs_tol=1e-10)
    assert not any("MLP" in label for label in parts) and "L1H3" in parts


def test_attribution_course_gpt_sums_to_the_logit(course):
    model, tok = course
    ids = torch.tensor([tok.encode("import os\nimport sys\nprint(os.path.join(")])
    pos = ids.shape[1] - 1
    with torch.no_grad():
        logits = model(ids)
    token = int(logits[0, pos].argmax())
    parts = direct_logit_attribution(model, ids, pos, token)
    assert len(parts) == 2 + 4 * (4 + 2) + 1  # embed, pos_embed, 4 x (4 heads, bias, MLP), ln_final bias
    assert math.isclose(sum(parts.values()), float(logits[0, pos, token]), abs_tol=1e-4)
    assert isinstance(model.ln_final.bias, torch.nn.Parameter) and model.unembed.weight is model.embed.weight


def test_attribution_errors():
    model = tiny_gpt()
    ids = ids_for(model)
    with pytest.raises(IndexError, match=r"pos must be an int in -12\.\.11"):
        direct_logit_attribution(model, ids, 12, 0)
    with pytest.raises(ValueError, match=r"token must be an id in 0\.\.255"):
        direct_logit_attribution(model, ids, 0, 256)
    with pytest.raises(IndexError, match="batch_index"):
        direct_logit_attribution(model, ids, 0, 0, batch_index=2)
    with pytest.raises(ValueError, match="pre-norm"):
        direct_logit_attribution(tiny_gpt(norm_position="post"), ids, 0, 0)


def test_public_signatures_carry_shapes(typechecked):
    """The jaxtyping shapes of the public functions hold at run time (beartype checks them)."""
    model = tiny_gpt()
    ids = ids_for(model, batch=1, pos=10)
    lens = typechecked(logit_lens)(model, ids)
    assert typechecked(logit_lens_probs)(lens).shape == (3, 1, 10)
    assert typechecked(previous_token_score)(torch.rand(2, 3, 5, 5)).shape == (2, 3)
    assert typechecked(induction_score)(torch.rand(2, 3, 6, 6), 3).shape == (2, 3)
    assert typechecked(per_head_W_O)(model.blocks[0].attn).shape == (4, 16, 64)
    ids = typechecked(repeated_random_tokens)(1, 5, 256, generator=torch.Generator().manual_seed(0))
    assert typechecked(score_heads)(model, ids, 5)["induction"].shape == (2, 4)
    logits, _ = typechecked(run_with_cache)(model, ids, [])
    assert logits.shape == (1, 10, 256)

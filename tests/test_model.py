"""tfedu.model: GPT, Encoder and EncoderDecoder on tiny configs.

Oracles: nn.Transformer (the 2017 encoder-decoder, block for block), F.cross_entropy by hand for the
loss. Invariants: causality for every positional kind and both attention kernels, the encoder's
two-sided view, padding that changes nothing it should not, manual == sdpa, tied embeddings as one
Parameter, BERT's 80/10/10 masking. Hook points and every input error. (The HF GPT-2 / Llama
oracles live in test_checkpoints.py.)
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tfedu.config import ATTENTION_IMPLS, POSITIONALS, ModelConfig, preset
from tfedu.layers import Block
from tfedu.model import GPT, IGNORE_INDEX, Encoder, EncoderDecoder, LanguageModel, mask_tokens
from tfedu.positional import sinusoidal

D_VOCAB, N_CTX = 23, 8

# The Triton kernel wants d_head >= 16, wider than these tiny models: tests/test_flash_in_gpt.py runs it.
IMPLS = [impl for impl in ATTENTION_IMPLS if impl != "triton"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


def tiny(**changes) -> ModelConfig:
    """Two blocks of width 16 with 4 heads over a vocabulary of 23: milliseconds per forward pass."""
    return ModelConfig(d_vocab=D_VOCAB, n_ctx=N_CTX, d_model=16, n_layers=2, n_heads=4).replace(**changes)


def build(cls, cfg: ModelConfig, seed: int = 0):
    """A seeded model with non-trivial norm gains and biases (1 and 0 would hide a swapped norm)."""
    torch.manual_seed(seed)
    model = cls(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name and isinstance(model, LanguageModel):
                p.mul_(20)  # GPT-2's std 0.02 embeddings give near-uniform logits; make positions matter
    return model.eval()


def ids_like(batch: int = 3, pos: int = N_CTX, seed: int = 0, d_vocab: int = D_VOCAB) -> torch.Tensor:
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


def right_padding(lengths: list[int], pos: int = N_CTX) -> torch.Tensor:
    return torch.arange(pos)[None, :] < torch.tensor(lengths)[:, None]  # True = real token


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("cls", [GPT, Encoder])
def test_shapes_and_loss_at_initialisation(cls, positional, typechecked):
    torch.manual_seed(0)
    model = cls(tiny(positional=positional))
    ids = ids_like(4, N_CTX)
    logits, loss = typechecked(model.forward)(ids, ids_like(4, N_CTX, seed=1))
    assert logits.shape == (4, N_CTX, D_VOCAB) and logits.dtype == torch.float32
    assert loss.shape == () and abs(loss.item() - math.log(D_VOCAB)) < 0.1  # small init: near-uniform
    assert model(ids[:, :1]).shape == (4, 1, D_VOCAB)  # one token is a sequence too


def test_encoder_decoder_shapes_and_loss():
    torch.manual_seed(0)
    model = EncoderDecoder(tiny(norm_position="post", positional="sinusoidal", activation="relu"))
    src, tgt = ids_like(2, 5), ids_like(2, N_CTX, seed=1)
    logits, loss = model(src, tgt[:, :-1], tgt[:, 1:])
    assert logits.shape == (2, N_CTX - 1, D_VOCAB) and loss.shape == ()
    assert model.encode(src).shape == (2, 5, 16)


def test_float64_model():
    model = build(GPT, tiny()).double()
    assert model(ids_like()).dtype == torch.float64


# ----------------------------------------------------------------------------- EncoderDecoder vs nn.Transformer


def _copy_linear(ours: nn.Module, theirs: nn.Module) -> None:
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        ours.bias.copy_(theirs.bias)


def _copy_mha(ours: nn.Module, mha: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        for linear, w, b in zip((ours.W_Q, ours.W_K, ours.W_V), mha.in_proj_weight.chunk(3), mha.in_proj_bias.chunk(3)):
            linear.weight.copy_(w)
            linear.bias.copy_(b)
    _copy_linear(ours.W_O, mha.out_proj)


def _copy_nn_transformer(model: EncoderDecoder, ref: nn.Transformer) -> None:
    for block, layer in zip(model.encoder_blocks, ref.encoder.layers, strict=True):
        _copy_mha(block.attn, layer.self_attn)
        pairs = ((block.mlp.W_in, layer.linear1), (block.mlp.W_out, layer.linear2),
                 (block.ln1, layer.norm1), (block.ln2, layer.norm2))
        for ours, theirs in pairs:
            _copy_linear(ours, theirs)
    for block, layer in zip(model.decoder_blocks, ref.decoder.layers, strict=True):
        _copy_mha(block.attn, layer.self_attn)
        _copy_mha(block.cross_attn, layer.multihead_attn)
        pairs = ((block.mlp.W_in, layer.linear1), (block.mlp.W_out, layer.linear2),
                 (block.ln1, layer.norm1), (block.ln_cross, layer.norm2), (block.ln2, layer.norm3))
        for ours, theirs in pairs:
            _copy_linear(ours, theirs)


@pytest.mark.parametrize("attention", IMPLS)
@pytest.mark.parametrize("tied", [True, False])
def test_encoder_decoder_matches_nn_transformer(tied, attention):
    """The 2017 model: post-norm stacks, embeddings times sqrt(d_model) plus sinusoids (Vaswani et al., sec. 3.4-3.5)."""
    cfg = tiny(norm_position="post", positional="sinusoidal", activation="relu", d_mlp=24, n_layers=2,
               tied_embeddings=tied, attention=attention)
    model = build(EncoderDecoder, cfg)
    torch.manual_seed(1)
    ref = nn.Transformer(16, 4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=24, dropout=0.0,
                         batch_first=True).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn_like(p))  # gains and biases away from 1 and 0
    # nn.Transformer puts one more LayerNorm after each stack; the 2017 post-norm blocks already end in one.
    ref.encoder.norm, ref.decoder.norm = nn.Identity(), nn.Identity()
    ref.encoder.use_nested_tensor = False  # keep padded rows (the nested fast path zeroes them)
    _copy_nn_transformer(model, ref)

    src, tgt = ids_like(3, 6, seed=1), ids_like(3, N_CTX, seed=2)
    src_keep = right_padding([6, 4, 5], 6)
    tgt_keep = right_padding([8, 8, 5])
    tgt_table = model.embed if tied else model.tgt_embed

    def embed(ids: torch.Tensor, table: nn.Embedding) -> torch.Tensor:  # written here, not borrowed from tfedu
        return table(ids) * math.sqrt(16) + sinusoidal(ids.shape[1], 16)

    with torch.no_grad():
        memory = model.encode(src, src_keep)
        expected_memory = ref.encoder(embed(src, model.embed), src_key_padding_mask=~src_keep)
        torch.testing.assert_close(memory, expected_memory)

        logits = model(src, tgt, src_padding_mask=src_keep, tgt_padding_mask=tgt_keep)
        later = torch.ones(N_CTX, N_CTX, dtype=torch.bool).triu(1)  # torch: True = hidden
        hidden = ref(embed(src, model.embed), embed(tgt, tgt_table), tgt_mask=later, tgt_is_causal=True,
                     src_key_padding_mask=~src_keep, memory_key_padding_mask=~src_keep, tgt_key_padding_mask=~tgt_keep)
        expected = hidden @ model.unembed.weight.T
        torch.testing.assert_close(logits[tgt_keep], expected[tgt_keep], atol=1e-5, rtol=1e-5)
        # The source matters (cross-attention is wired in) and its padding is hidden.
        other_src = src.clone()
        other_src[1, 4:] = (src[1, 4:] + 1) % D_VOCAB  # only padded source positions of row 1 change
        other_src[0, 0] = (src[0, 0] + 1) % D_VOCAB
        changed = model(other_src, tgt, src_padding_mask=src_keep, tgt_padding_mask=tgt_keep)
        torch.testing.assert_close(changed[1:], logits[1:])
        assert not torch.allclose(changed[0], logits[0], atol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_encoder_decoder_tied_and_untied(tied):
    torch.manual_seed(0)
    model = EncoderDecoder(tiny(tied_embeddings=tied))
    n_embedding = D_VOCAB * 16
    assert (model.unembed.weight is model.embed.weight) == tied
    assert hasattr(model, "tgt_embed") != tied
    n_params = sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    other = EncoderDecoder(tiny(tied_embeddings=not tied))
    n_other = sum(p.numel() for p in other.parameters())
    # Untied: separate target embedding and unembedding, two more d_vocab x d_model matrices.
    assert n_params - n_other == (-2 if tied else 2) * n_embedding
    # sqrt(d_model) * N(0, 1/d_model): embeddings of about unit size, like the sinusoids.
    assert 0.7 < model.embed(ids_like()).std() * model.embed_scale < 1.3


# ----------------------------------------------------------------------------- causality


@pytest.mark.parametrize("attention", IMPLS)
@pytest.mark.parametrize("positional", POSITIONALS)
def test_gpt_is_causal(positional, attention):
    model = build(GPT, tiny(positional=positional, attention=attention, n_kv_heads=2))
    ids = ids_like()
    with torch.no_grad():
        logits = model(ids)
        for t in range(1, N_CTX):
            later = ids.clone()
            later[:, t:] = ids_like(seed=t)[:, t:]
            changed = model(later)
            torch.testing.assert_close(changed[:, :t], logits[:, :t])  # earlier logits never move
            assert not torch.allclose(changed[:, t:], logits[:, t:], atol=1e-4)


def test_gpt_is_causal_in_its_gradients():
    model = build(GPT, tiny(positional="rope"))
    resid = model.embed(ids_like(1)).detach().requires_grad_()
    out = model.run_blocks(model.blocks, resid, causal=True)
    out[0, 3].sum().backward()
    assert resid.grad[0, 4:].abs().max() == 0
    assert (resid.grad[0, :4].abs().amax(-1) > 0).all()


@pytest.mark.parametrize("attention", IMPLS)
@pytest.mark.parametrize("positional", POSITIONALS)
def test_encoder_sees_both_ways(positional, attention):
    model = build(Encoder, tiny(positional=positional, attention=attention))
    ids = ids_like()
    later = ids.clone()
    later[:, -1] = (ids[:, -1] + 1) % D_VOCAB
    with torch.no_grad():
        assert not torch.allclose(model(later)[:, 0], model(ids)[:, 0], atol=1e-4)


# ----------------------------------------------------------------------------- padding


@pytest.mark.parametrize("attention", IMPLS)
@pytest.mark.parametrize("positional", POSITIONALS)
def test_gpt_right_padding(positional, attention):
    """Real tokens neither see the pads nor care what they are; each row equals the unpadded sequence alone."""
    model = build(GPT, tiny(positional=positional, attention=attention))
    lengths = [8, 5, 2]
    keep = right_padding(lengths)
    ids = ids_like()
    other = torch.where(keep, ids, ids_like(seed=9))
    with torch.no_grad():
        logits = model(ids, padding_mask=keep)
        torch.testing.assert_close(model(other, padding_mask=keep)[keep], logits[keep])
        for row, n in enumerate(lengths):
            torch.testing.assert_close(logits[row, :n], model(ids[row:row + 1, :n])[0])


@pytest.mark.parametrize("attention", IMPLS)
@pytest.mark.parametrize("positional", ["rope", "alibi", "none"])
def test_gpt_left_padding_with_relative_positions(positional, attention):
    """With relative (or no) positions and masked pads, left padding changes nothing at all.

    The first pad queries see no key: they must come out finite (not NaN), or NaN would leak
    into real tokens in the next block (0 weight times NaN is NaN).
    """
    model = build(GPT, tiny(positional=positional, attention=attention))
    lengths = [8, 5, 2]
    keep = torch.arange(N_CTX)[None, :] >= N_CTX - torch.tensor(lengths)[:, None]
    ids = ids_like()
    with torch.no_grad():
        logits = model(ids, padding_mask=keep)
        assert torch.isfinite(logits).all()
        for row, n in enumerate(lengths):
            torch.testing.assert_close(logits[row, N_CTX - n:], model(ids[row:row + 1, N_CTX - n:])[0])


@pytest.mark.parametrize("attention", IMPLS)
@pytest.mark.parametrize("positional", POSITIONALS)
def test_encoder_padding_anywhere(positional, attention):
    model = build(Encoder, tiny(positional=positional, attention=attention))
    keep = torch.tensor([[True] * 8, [True, False, True, True, False, True, True, True], [False] * 3 + [True] * 5])
    ids = ids_like()
    with torch.no_grad():
        logits = model(ids, padding_mask=keep)
        torch.testing.assert_close(model(torch.where(keep, ids, ids_like(seed=9)), padding_mask=keep)[keep], logits[keep])
        assert not torch.allclose(model(ids)[1:][keep[1:]], logits[1:][keep[1:]], atol=1e-4)  # the mask acts
        # Right padding is the unpadded sequence, whatever the positions.
        right = right_padding([8, 5, 3])
        logits = model(ids, padding_mask=right)
        torch.testing.assert_close(logits[1, :5], model(ids[1:2, :5])[0])


# ----------------------------------------------------------------------------- manual == sdpa


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("cls", [GPT, Encoder])
def test_manual_equals_sdpa(cls, positional, padded):
    """Same weights, the two kernels: same logits and gradients, in train mode (dropout 0), with GQA."""
    cfg = tiny(positional=positional, n_kv_heads=2)
    manual = build(cls, cfg).train()
    sdpa = cls(cfg.replace(attention="sdpa"))
    sdpa.load_state_dict(manual.state_dict())
    sdpa.train()
    ids = ids_like()
    keep = right_padding([8, 6, 3]) if padded else None
    logits, loss = manual(ids, ids, padding_mask=keep)
    logits_sdpa, loss_sdpa = sdpa(ids, ids, padding_mask=keep)
    torch.testing.assert_close(logits_sdpa, logits)
    loss.backward()
    loss_sdpa.backward()
    for (name, p), q in zip(manual.named_parameters(), sdpa.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name, atol=1e-6, rtol=1e-4)


def test_encoder_decoder_manual_equals_sdpa():
    cfg = tiny(n_kv_heads=2, positional="rope")
    manual = build(EncoderDecoder, cfg)
    sdpa = EncoderDecoder(cfg.replace(attention="sdpa")).eval()
    sdpa.load_state_dict(manual.state_dict())
    src, tgt = ids_like(3, 6), ids_like(3, N_CTX, seed=1)
    kwargs = dict(src_padding_mask=right_padding([6, 4, 2], 6), tgt_padding_mask=right_padding([8, 7, 3]))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(src, tgt, **kwargs), manual(src, tgt, **kwargs))


def test_dropout_only_in_training():
    model = build(GPT, tiny(dropout=0.3))
    ids = ids_like()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids))
        model.train()
        assert not torch.allclose(model(ids), model(ids))


# ----------------------------------------------------------------------------- tied embeddings, config


def test_tied_embeddings_are_one_parameter():
    torch.manual_seed(0)
    tied, untied = GPT(tiny()), GPT(tiny(tied_embeddings=False))
    assert tied.unembed.weight is tied.embed.weight
    assert untied.unembed.weight is not untied.embed.weight
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == D_VOCAB * 16  # the shared matrix is counted once
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1
    torch.testing.assert_close(tied.W_U, tied.W_E.T)
    # Still one Parameter after a dtype change and a state-dict round trip; a step moves both.
    tied = tied.double()
    assert tied.unembed.weight is tied.embed.weight
    copy = GPT(tiny())
    copy.load_state_dict(tied.state_dict())
    assert copy.unembed.weight is copy.embed.weight
    before = tied.embed.weight.detach().clone()
    _, loss = tied(ids_like(), ids_like(seed=1))
    loss.backward()
    torch.optim.SGD(tied.parameters(), lr=1.0).step()
    assert not torch.equal(tied.embed.weight, before)
    assert tied.unembed.weight is tied.embed.weight


def test_config_replace_derives_again():
    cfg = ModelConfig(d_vocab=10, n_ctx=4, d_model=32, n_layers=1, n_heads=4)
    assert (cfg.d_head, cfg.n_kv_heads, cfg.d_mlp) == (8, 4, 128)
    wider = cfg.replace(d_model=64, n_heads=8)
    assert (wider.d_head, wider.n_kv_heads, wider.d_mlp) == (8, 8, 256)
    assert cfg.replace(activation="swiglu").d_mlp == 85  # floor(8 * 32 / 3)
    explicit = ModelConfig(d_vocab=10, n_ctx=4, d_model=32, n_layers=1, n_heads=4, d_head=6, n_kv_heads=2, d_mlp=50)
    kept = explicit.replace(d_model=64)
    assert (kept.d_head, kept.n_kv_heads, kept.d_mlp) == (6, 2, 50)
    assert cfg.replace() == cfg
    with pytest.raises(TypeError, match="no field.*d_hidden"):
        cfg.replace(d_hidden=3)


@pytest.mark.parametrize(
    "changes, error",
    [
        (dict(positional="absolute"), r"positional='absolute' is not one of 'learned', 'sinusoidal', 'rope'"),
        (dict(d_model=30, n_heads=4), r"d_model=30 is not divisible by n_heads=4: pass d_head"),
        (dict(n_kv_heads=3), r"n_heads=4 must be a multiple of n_kv_heads=3"),
        (dict(positional="rope", d_head=5), r"RoPE rotates pairs.*d_head=5 must be even"),
        (dict(norm="batch"), r"norm='batch' is not one of 'layer', 'rms'"),
        (dict(attention="fast"), r"attention='fast' is not one of 'manual', 'sdpa', 'flash', 'triton'"),
        (dict(n_layers=0), r"n_layers must be a positive int, got 0"),
        (dict(dropout=1.0), r"dropout must be a probability in \[0, 1\)"),
        (dict(d_mlp=-1), r"d_mlp must be an int >= 0 \(0: attention-only"),
        (dict(d_mlp=0, n_experts=4), r"d_mlp=0 means no MLP.*n_experts=4"),
    ],
)
def test_bad_config_fields(changes, error):
    with pytest.raises(ValueError, match=error):
        tiny(**changes)


def test_model_wants_a_model_config():
    with pytest.raises(TypeError, match="ModelConfig, got dict"):
        GPT(dict(d_model=16))


# ----------------------------------------------------------------------------- loss and masking


def test_loss_is_cross_entropy_over_kept_positions():
    model = build(GPT, tiny())
    ids = ids_like()
    targets = ids_like(seed=1)
    targets[0, :5] = IGNORE_INDEX
    targets[2, 3] = IGNORE_INDEX
    logits, loss = model(ids, targets)
    kept = targets != IGNORE_INDEX
    log_probs = logits.log_softmax(-1)[kept]  # written out: -mean log p(target) over kept positions
    expected = -log_probs.gather(-1, targets[kept][:, None]).mean()
    torch.testing.assert_close(loss, expected)
    # What an ignored position's target is does not matter; int32 targets work like int64.
    other = torch.where(kept, targets, torch.full_like(targets, IGNORE_INDEX))
    torch.testing.assert_close(model(ids, other.int())[1], loss)


def test_mask_tokens_frequencies():
    d_vocab, mask_id = 1000, 0
    ids = torch.randint(1, d_vocab, (100, 1000), generator=torch.Generator().manual_seed(0))
    inputs, targets = mask_tokens(ids, mask_id=mask_id, d_vocab=d_vocab, p=0.15,
                                  generator=torch.Generator().manual_seed(1))
    chosen = targets != IGNORE_INDEX
    assert abs(chosen.float().mean().item() - 0.15) < 0.005
    assert torch.equal(targets[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])  # unchosen positions are untouched and skipped
    masked = (inputs[chosen] == mask_id).float().mean().item()
    kept = (inputs[chosen] == ids[chosen]).float().mean().item()
    random = 1 - masked - kept
    # 80 / 10 / 10; a random token equals the original 1 time in 1000.
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(random - 0.1) < 0.01
    assert inputs.dtype == ids.dtype and inputs.shape == ids.shape
    # Seeded: the same generator seed gives the same masking.
    again = mask_tokens(ids, mask_id=mask_id, d_vocab=d_vocab, p=0.15, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], targets)


def test_mask_tokens_keeps_device_and_dtype():
    """A CPU generator with ids elsewhere (the seeded GPU set-up; "meta" stands in for the GPU here)."""
    ids = ids_like().int()
    inputs, targets = mask_tokens(ids, mask_id=0, d_vocab=D_VOCAB, generator=torch.Generator().manual_seed(0))
    assert inputs.dtype == targets.dtype == torch.int32
    inputs, targets = mask_tokens(ids.to("meta"), mask_id=0, d_vocab=D_VOCAB, generator=torch.Generator().manual_seed(0))
    assert inputs.device.type == targets.device.type == "meta"


def test_mask_tokens_trains_the_encoder():
    model = build(Encoder, tiny())
    inputs, targets = mask_tokens(ids_like(), mask_id=0, d_vocab=D_VOCAB, p=0.5, generator=torch.Generator().manual_seed(0))
    logits, loss = model(inputs, targets)
    kept = targets != IGNORE_INDEX
    torch.testing.assert_close(loss, F.cross_entropy(logits[kept], targets[kept]))


@pytest.mark.parametrize("kwargs, error", [(dict(p=0.0), "p must be a probability"), (dict(mask_id=23), "mask_id=23")])
def test_mask_tokens_errors(kwargs, error):
    with pytest.raises(ValueError, match=error):
        mask_tokens(ids_like(), **(dict(mask_id=0, d_vocab=D_VOCAB) | kwargs))


# ----------------------------------------------------------------------------- hooks


def test_hook_point_names():
    model = GPT(tiny())
    names = set(model.hook_points())
    per_block = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post", "attn.hook_pattern",
                 "attn.hook_z")
    expected = {"hook_embed", "hook_pos_embed"} | {f"blocks.{i}.{name}" for i in range(2) for name in per_block}
    assert names == expected


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_run_with_cache(norm_position):
    model = build(GPT, tiny(norm_position=norm_position))
    ids = ids_like()
    logits, cache = model.run_with_cache(ids)
    assert set(cache) == set(model.hook_points())
    torch.testing.assert_close(logits, model(ids))
    torch.testing.assert_close(model.unembed(model.ln_final(cache["blocks.1.hook_resid_post"])), logits)
    if norm_position == "post":  # the last block already ends in a norm: no second one before the unembedding
        torch.testing.assert_close(model.unembed(cache["blocks.1.hook_resid_post"]), logits)
    torch.testing.assert_close(cache["hook_embed"], model.embed(ids))
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], cache["hook_embed"] + cache["hook_pos_embed"])
    for i in range(2):
        pre, attn_out = cache[f"blocks.{i}.hook_resid_pre"], cache[f"blocks.{i}.hook_attn_out"]
        mid, mlp_out = cache[f"blocks.{i}.hook_resid_mid"], cache[f"blocks.{i}.hook_mlp_out"]
        post = cache[f"blocks.{i}.hook_resid_post"]
        block = model.blocks[i]
        with torch.no_grad():
            if norm_position == "pre":  # x + F(norm(x)): the stream is a running sum
                torch.testing.assert_close(mid, pre + attn_out)
                torch.testing.assert_close(post, mid + mlp_out)
            else:  # norm(x + F(x))
                torch.testing.assert_close(mid, block.ln1(pre + attn_out))
                torch.testing.assert_close(post, block.ln2(mid + mlp_out))
        if i:
            torch.testing.assert_close(pre, cache[f"blocks.{i - 1}.hook_resid_post"])
        pattern = cache[f"blocks.{i}.attn.hook_pattern"]
        assert pattern.shape == (3, 4, N_CTX, N_CTX)
        torch.testing.assert_close(pattern.sum(-1), torch.ones(3, 4, N_CTX))
        assert (pattern.triu(1) == 0).all()  # no weight on later keys
    assert not any(module._forward_hooks for module in model.hook_points().values())  # cleaned up


@pytest.mark.parametrize("positional", ["learned", "none", "alibi"])
def test_pattern_is_the_softmax_of_the_scores_written_out(positional):
    """Block 0's pattern from its cached input: softmax(q k^T / sqrt(d_head) - m_h (i - j)) under the causal mask.

    ALiBi's slopes for 4 heads are 2^-2, 2^-4, 2^-6, 2^-8 (Press et al. 2022, sec. 3); other kinds add no bias.
    """
    model = build(GPT, tiny(positional=positional))
    _, cache = model.run_with_cache(ids_like())
    attn = model.blocks[0].attn
    with torch.no_grad():
        x = model.blocks[0].ln1(cache["blocks.0.hook_resid_pre"])
        q = attn.W_Q(x).unflatten(-1, (4, 4)).transpose(1, 2)  # batch n_heads pos d_head
        k = attn.W_K(x).unflatten(-1, (4, 4)).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / 2.0
        if positional == "alibi":
            slopes = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
            distance = torch.arange(N_CTX)[:, None] - torch.arange(N_CTX)[None, :]
            scores = scores - slopes[:, None, None] * distance
        later = torch.ones(N_CTX, N_CTX, dtype=torch.bool).triu(1)
        expected = scores.masked_fill(later, float("-inf")).softmax(-1)
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"], expected)


def test_run_with_cache_sdpa_has_no_pattern():
    model = build(GPT, tiny(attention="sdpa"))
    _, cache = model.run_with_cache(ids_like())
    assert "blocks.0.hook_resid_post" in cache and "blocks.0.attn.hook_pattern" not in cache


def test_hooks_ablate_and_are_removed():
    model = build(GPT, tiny())
    ids = ids_like()
    with torch.no_grad():
        clean = model(ids)
        with model.hooks(blocks__0__hook_attn_out=torch.zeros_like):
            ablated = model(ids)
        assert not torch.allclose(ablated, clean, atol=1e-3)
        torch.testing.assert_close(model(ids), clean)  # the hook is gone
        # A hook returning None only looks; an exception inside the block still removes the hooks.
        seen = []
        with model.hooks(blocks__1__attn__hook_pattern=seen.append):
            torch.testing.assert_close(model(ids), clean)
        assert len(seen) == 1 and seen[0].shape == (3, 4, N_CTX, N_CTX)
        with pytest.raises(RuntimeError, match="boom"):
            with model.hooks(hook_embed=torch.zeros_like):
                raise RuntimeError("boom")
        assert not any(module._forward_hooks for module in model.hook_points().values())
        # Zeroing the pattern of every head of block 0 equals zeroing its attention output minus W_O's bias.
        zero = lambda t: torch.zeros_like(t)  # noqa: E731
        with model.hooks(blocks__0__attn__hook_pattern=zero):
            by_pattern = model(ids)
        bias = model.blocks[0].attn.W_O.bias
        with model.hooks(blocks__0__hook_attn_out=lambda t: bias.expand_as(t)):
            torch.testing.assert_close(model(ids), by_pattern)


def test_unknown_hook_name():
    model = GPT(tiny())
    with pytest.raises(KeyError, match=r"blocks\.0\.hook_attn_output.*model\.hook_points\(\)"):
        with model.hooks(blocks__0__hook_attn_output=torch.zeros_like):
            pass
    assert not any(module._forward_hooks for module in model.hook_points().values())


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (torch.zeros(2, 4), TypeError, r"integer tensor of shape \(batch, pos\).*torch.float32.*\.long\(\)"),
        (torch.zeros(2, 4, dtype=torch.bool), TypeError, r"integer tensor.*torch.bool"),
        (torch.zeros(4, dtype=torch.long), ValueError, r"shape \(4,\).*ids\[None\]"),
        (torch.zeros(1, 2, 4, dtype=torch.long), ValueError, r"\(batch, pos\).*\(1, 2, 4\)"),
        (torch.tensor([[0, -1, 3]]), IndexError, r"0\.\.22 \(d_vocab=23\), got values from -1 to 3"),
        (torch.tensor([[0, 23]]), IndexError, r"0\.\.22 \(d_vocab=23\), got values from 0 to 23"),
        (torch.zeros(1, 9, dtype=torch.long), ValueError, r"9 positions.*n_ctx=8.*ids\[:, -8:\]"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, r"no positions: give at least one token"),
        ([[1, 2]], TypeError, r"integer tensor.*got list"),
    ],
)
@pytest.mark.parametrize("positional", ["learned", "rope"])
def test_bad_ids(ids, error, match, positional):
    model = GPT(tiny(positional=positional))
    with pytest.raises(error, match=match):
        model(ids)


@pytest.mark.parametrize(
    "targets, error, match",
    [
        (torch.zeros(2, 3, dtype=torch.long), ValueError, r"shaped like the ids \(2, 4\).*got torch.int64 \(2, 3\)"),
        (torch.zeros(2, 4), ValueError, r"integer tensor shaped like the ids.*torch.float32"),
        (torch.zeros(2, 4, dtype=torch.bool), ValueError, r"integer tensor.*torch.bool"),
        (torch.full((2, 4), 23), IndexError, r"0\.\.22 or be -100"),
        (torch.full((2, 4), -1), IndexError, r"0\.\.22 or be -100"),
    ],
)
def test_bad_targets(targets, error, match):
    with pytest.raises(error, match=match):
        GPT(tiny())(torch.zeros(2, 4, dtype=torch.long), targets)


@pytest.mark.parametrize(
    "padding_mask", [torch.ones(2, 4), torch.ones(2, 4, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)]
)
def test_bad_padding_mask(padding_mask):
    with pytest.raises(ValueError, match=r"padding_mask must be a bool tensor shaped like the ids \(2, 4\), True = real"):
        GPT(tiny())(torch.zeros(2, 4, dtype=torch.long), padding_mask=padding_mask)


def test_encoder_decoder_errors_name_the_argument():
    model = EncoderDecoder(tiny(tied_embeddings=False))
    src, tgt = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(IndexError, match="src must lie in"):
        model(src - 1, tgt)
    with pytest.raises(ValueError, match=r"tgt has 9 positions.*n_ctx=8"):
        model(src, torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="tgt_padding_mask must be a bool tensor"):
        model(src, tgt, tgt_padding_mask=torch.ones(1, 4))


def test_cross_attention_block_without_context():
    block = Block(tiny(), cross_attention=True)
    with pytest.raises(ValueError, match=r"cross-attention: pass context=\(the encoder's output\)"):
        block(torch.zeros(1, 3, 16))


@pytest.mark.parametrize("tied", [True, False])
def test_encoder_decoder_target_embeddings_have_their_own_hook(tied):
    cfg = preset("tiny").replace(d_vocab=12, n_ctx=8, tied_embeddings=tied)
    torch.manual_seed(0)
    model = EncoderDecoder(cfg).eval()
    src, tgt = torch.randint(0, 12, (2, 8)), torch.randint(0, 12, (2, 5))
    with torch.no_grad():
        _, cache = model.run_with_cache(src, tgt)
    table = model.embed if tied else model.tgt_embed
    torch.testing.assert_close(cache["hook_embed"], model.embed(src) * cfg.d_model**0.5)  # the source only
    torch.testing.assert_close(cache["hook_tgt_embed"], table(tgt) * cfg.d_model**0.5)


def test_language_model_itself_cannot_be_built():
    with pytest.raises(TypeError, match="use GPT or Encoder"):
        LanguageModel(preset("tiny"))


def test_default_init_std_per_family():
    cfg = preset("tiny")
    torch.manual_seed(0)
    gpt, seq2seq = GPT(cfg), EncoderDecoder(cfg)
    assert abs(gpt.blocks[0].attn.W_Q.weight.std().item() - 0.02) < 0.003  # GPT-2's 0.02
    assert abs(seq2seq.encoder_blocks[0].attn.W_Q.weight.std().item() - cfg.d_model**-0.5) < 0.01
    assert abs(GPT(cfg.replace(init_std=0.1)).blocks[0].attn.W_Q.weight.std().item() - 0.1) < 0.01
    with pytest.raises(ValueError, match="init_std"):
        cfg.replace(init_std=-1.0)


def test_encoder_decoder_learns_digit_reversal():
    """The regression behind default_init_std: with GPT-2's 0.02 this sat at ln(10) for 300 steps."""
    from tfedu.toy_tasks import D_VOCAB, make_digit_batch, teacher_forcing_inputs

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = EncoderDecoder(preset("tiny").replace(d_vocab=D_VOCAB, n_ctx=16))
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(120):
        src, tgt = make_digit_batch(32, 8, generator)
        _, loss = model(src, teacher_forcing_inputs(tgt), targets=tgt)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    assert loss.item() < 0.2  # far below ln(10) = 2.30, the loss of guessing digits


# ----------------------------------------------------------------------------- attention-only (d_mlp=0)


@pytest.mark.parametrize("positional", ["learned", "rope"])
def test_attention_only_equals_a_model_whose_mlps_write_nothing(positional):
    """Oracle (pre-norm): the same weights in a model with MLPs, each MLP's output replaced by zeros through its hook."""
    with_mlp = build(GPT, tiny(positional=positional))
    attn_only = GPT(with_mlp.cfg.replace(d_mlp=0)).eval()
    missing, unexpected = attn_only.load_state_dict(with_mlp.state_dict(), strict=False)
    assert not missing and all(".ln2." in name or ".mlp." in name for name in unexpected)
    ids = ids_like()
    zeros = {f"blocks__{i}__hook_mlp_out": torch.zeros_like for i in range(len(with_mlp.blocks))}
    with with_mlp.hooks(**zeros):
        expected = with_mlp(ids)
    torch.testing.assert_close(attn_only(ids), expected, rtol=0, atol=1e-6)
    assert attn_only.cfg.has_mlp is False and with_mlp.cfg.has_mlp is True
    assert not any("mlp" in name or "ln2" in name for name in attn_only.hook_points() | dict(attn_only.named_parameters()))


def test_attention_only_post_norm_block_is_one_add_and_norm():
    block = Block(tiny(norm_position="post", d_mlp=0)).eval()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(block(x, causal=True), block.ln1(x + block.attn(x, causal=True)), rtol=0, atol=0)


def test_attention_only_counts_and_cache():
    from tfedu.flops import flops_per_token, param_count
    from tfedu.generate import generate

    cfg = tiny(d_mlp=0)
    model = build(GPT, cfg)
    p = param_count(cfg)
    assert p.mlp == 0 and p.total == sum(q.numel() for q in model.parameters())
    assert flops_per_token(cfg, N_CTX).mlp == 0
    assert flops_per_token(cfg, N_CTX).forward == flops_per_token(tiny(), N_CTX).forward - flops_per_token(tiny(), N_CTX).mlp
    ids = ids_like(batch=2, pos=3)
    cached = generate(model, ids, max_new_tokens=4, use_cache=True)
    assert torch.equal(cached, generate(model, ids, max_new_tokens=4, use_cache=False))
    assert ModelConfig(**cfg.as_dict()) == cfg


def test_attention_only_has_no_adapters_to_add():
    from tfedu.peft import apply_adapters

    with pytest.raises(ValueError, match="attention-only \\(d_mlp=0\\).*LoRA"):
        apply_adapters(build(GPT, tiny(d_mlp=0)), bottleneck=4)

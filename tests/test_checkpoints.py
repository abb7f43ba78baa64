"""tfedu.checkpoints against Hugging Face models built locally from small configs (random weights, no network).

GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``) and Llama (MHA, GQA, MQA, tied and untied, head_dim !=
d_model / n_heads, rope_theta 500000, biases) must give the same logits to 1e-5 in float32 and the
same loss, with both attention kernels, loaded from the model, from its state dict plus config, from
a config.json dict and from safetensors files on disk (``pretrained``).
"""

import json
import re
import time

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model, LlamaConfig, LlamaForCausalLM

from tfedu.checkpoints import candidate_folders, config_from_hf, gpt_from_hf, hf_from_gpt, pretrained
from tfedu.model import GPT

D_VOCAB, N_CTX = 61, 12
ATOL = RTOL = 1e-5  # float32 logits of size ~1-10: agreement to the last few digits


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see tests/conftest.py


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights of a trained model's size, gains away from 1 and biases away from 0 (HF initialises them to 1 and 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(0.25 * noise)
            elif name.endswith("weight"):  # LayerNorm / RMSNorm gains
                p.copy_(1 + 0.3 * noise)
            else:
                p.copy_(0.3 * noise)
    return model.eval()


def gpt2_config(**changes) -> GPT2Config:
    fields = dict(vocab_size=D_VOCAB, n_positions=N_CTX, n_embd=24, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2Config(**(fields | changes))


def llama_config(**changes) -> LlamaConfig:
    fields = dict(vocab_size=D_VOCAB, max_position_embeddings=N_CTX, hidden_size=32, intermediate_size=40,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, bos_token_id=0, eos_token_id=0,
                  pad_token_id=None)
    return LlamaConfig(**(fields | changes))


def gpt2(seed: int = 0, **changes) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return randomise(GPT2LMHeadModel(gpt2_config(**changes)), seed)


def llama(seed: int = 0, **changes) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return randomise(LlamaForCausalLM(llama_config(**changes)), seed)


def ids_like(batch: int = 3, pos: int = N_CTX, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(ours: GPT, hf: torch.nn.Module, ids: torch.Tensor, **hf_kwargs) -> torch.Tensor:
    with torch.no_grad():
        expected = hf(ids, **hf_kwargs).logits
        logits = ours(ids)
    assert expected.abs().max() > 1  # not vanishingly small logits that would agree anyway
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
    return logits


LLAMAS = {
    "mha-untied": dict(),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "mqa-untied": dict(num_key_value_heads=1),
    "gqa-head_dim-theta-bias": dict(num_key_value_heads=2, head_dim=12, rope_theta=500000.0,
                                    attention_bias=True, mlp_bias=True),
    "mqa-tied-head_dim-bias": dict(num_key_value_heads=1, head_dim=6, attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5),
}


# ----------------------------------------------------------------------------- GPT-2


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_gpt2_logits_from_the_model_its_state_dict_and_a_config_dict(attention):
    hf = gpt2()
    ids = ids_like()
    config_json = json.loads(hf.config.to_json_string())  # what config.json holds on disk
    for source, config in ((hf, None), (hf.state_dict(), hf.config), (hf.state_dict(), config_json)):
        ours = gpt_from_hf(source, config, attention=attention)
        assert ours.cfg.attention == attention and not ours.training
        assert ours.unembed.weight is ours.embed.weight  # GPT-2 ties W_U to W_E
        assert_same_logits(ours, hf, ids)


def test_gpt2_untied_and_with_d_mlp():
    hf = gpt2(tie_word_embeddings=False, n_inner=40)
    assert hf.lm_head.weight is not hf.transformer.wte.weight
    ours = gpt_from_hf(hf)
    assert ours.cfg.d_mlp == 40 and ours.unembed.weight is not ours.embed.weight
    assert_same_logits(ours, hf, ids_like())


@pytest.mark.parametrize("changes", [dict(), dict(tie_word_embeddings=False, n_inner=40)], ids=["tied", "untied-d_mlp"])
def test_hf_from_gpt_is_the_inverse_of_gpt_from_hf(changes):
    hf = gpt2(**changes)
    back = hf_from_gpt(gpt_from_hf(hf))
    assert back.config.tie_word_embeddings == hf.config.tie_word_embeddings and not back.training
    theirs = hf.state_dict()
    for name, value in back.state_dict().items():  # every weight where it came from, transposes and all
        assert torch.equal(value, theirs[name]), name
    assert_same_logits(gpt_from_hf(back), back, ids_like())


def test_hf_from_gpt_runs_tfedu_models_and_refuses_what_gpt2_cannot_hold():
    torch.manual_seed(0)
    ours = GPT(gpt_from_hf(gpt2()).cfg.replace(d_mlp=36, init_std=0.5)).eval()  # a model transformers never saw
    assert_same_logits(ours, hf_from_gpt(ours), ids_like())
    for change, named in ((dict(norm="rms"), "norm='rms'"), (dict(positional="rope"), "positional='rope'"),
                          (dict(n_kv_heads=2), "n_kv_heads=2")):
        with pytest.raises(ValueError, match=f"GPT-2-shaped models only; .*{re.escape(named)}"):
            hf_from_gpt(GPT(ours.cfg.replace(**change)))


def test_gpt2_model_without_lm_head():
    """GPT2Model: no lm_head, no "transformer." prefix. Its output is ln_final of the last residual stream."""
    torch.manual_seed(0)
    hf = randomise(GPT2Model(gpt2_config()))
    ours = gpt_from_hf(hf)
    ids = ids_like()
    with torch.no_grad():
        logits, cache = ours.run_with_cache(ids)
        hidden = hf(ids).last_hidden_state
        torch.testing.assert_close(ours.ln_final(cache["blocks.1.hook_resid_post"]), hidden, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(logits, hidden @ hf.wte.weight.T, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_gpt2_right_padding_matches_hf_attention_mask(attention):
    hf = gpt2()
    ours = gpt_from_hf(hf, attention=attention)
    ids = ids_like()
    keep = torch.arange(N_CTX)[None, :] < torch.tensor([[12], [7], [3]])
    with torch.no_grad():
        expected = hf(ids, attention_mask=keep.long()).logits
        torch.testing.assert_close(ours(ids, padding_mask=keep)[keep], expected[keep], atol=ATOL, rtol=RTOL)


def test_gpt2_float64():
    hf = gpt2().double()
    ours = gpt_from_hf(hf)
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    with torch.no_grad():
        torch.testing.assert_close(ours(ids_like()), hf(ids_like()).logits, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- Llama


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
@pytest.mark.parametrize("variant", LLAMAS)
def test_llama_logits(variant, attention):
    changes = LLAMAS[variant]
    hf = llama(**changes)
    ours = gpt_from_hf(hf, attention=attention)
    cfg = ours.cfg
    assert cfg.n_kv_heads == changes.get("num_key_value_heads", 4)
    assert cfg.d_head == changes.get("head_dim", 8) and cfg.rope_base == changes.get("rope_theta", 10000.0)
    assert cfg.bias == changes.get("attention_bias", False)
    assert (ours.unembed.weight is ours.embed.weight) == changes.get("tie_word_embeddings", False)
    assert ours.blocks[0].attn.W_K.weight.shape == (cfg.n_kv_heads * cfg.d_head, 32)
    assert_same_logits(ours, hf, ids_like())
    # The same from the state dict and the dict of its config.json.
    from_dict = gpt_from_hf(hf.state_dict(), json.loads(hf.config.to_json_string()), attention=attention)
    assert_same_logits(from_dict, hf, ids_like(seed=1))


def test_llama_config_dict_in_the_transformers_4_layout():
    """transformers 4.x config.json files keep rope_theta at the top level and rope_scaling: null."""
    hf = llama(num_key_value_heads=2, rope_theta=500000.0)
    config = json.loads(hf.config.to_json_string())
    del config["rope_parameters"]
    config |= {"rope_theta": 500000.0, "rope_scaling": None}
    del config["head_dim"]  # old configs have no head_dim either: d_model / n_heads
    ours = gpt_from_hf(hf.state_dict(), config)
    assert ours.cfg.rope_base == 500000.0
    assert_same_logits(ours, hf, ids_like())


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_llama_left_padding_matches_hf_attention_mask(attention):
    """RoPE is relative: left-padded rows give the same real-token logits as HF with an attention mask."""
    hf = llama(num_key_value_heads=2)
    ours = gpt_from_hf(hf, attention=attention)
    ids = ids_like()
    keep = torch.arange(N_CTX)[None, :] >= torch.tensor([[0], [5], [9]])
    with torch.no_grad():
        expected = hf(ids, attention_mask=keep.long()).logits
        torch.testing.assert_close(ours(ids, padding_mask=keep)[keep], expected[keep], atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- loss


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_loss_matches_hf_labels(make):
    """HF shifts the labels inside the model; ours takes targets already shifted by one."""
    hf = make()
    ours = gpt_from_hf(hf)
    ids = ids_like()
    labels = ids.clone()
    labels[1, 8:] = -100  # HF and tfedu both skip -100
    with torch.no_grad():
        expected = hf(ids, labels=labels).loss
        _, loss = ours(ids[:, :-1], labels[:, 1:])
    torch.testing.assert_close(loss, expected, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- no aliasing


@pytest.mark.parametrize("from_state_dict", [False, True])
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_training_the_copy_leaves_the_source_alone(make, from_state_dict):
    hf = make()
    before = {name: t.clone() for name, t in hf.state_dict().items()}
    ours = gpt_from_hf(hf.state_dict(), hf.config) if from_state_dict else gpt_from_hf(hf)
    assert not any(p.data_ptr() == q.data_ptr() for p in ours.parameters() for q in hf.parameters())
    ours.train()
    ids = ids_like()
    _, loss = ours(ids[:, :-1], ids[:, 1:])
    loss.backward()
    torch.optim.SGD(ours.parameters(), lr=0.1).step()
    with torch.no_grad():
        ours.blocks[0].ln1.weight.fill_(3.0)
    for name, t in hf.state_dict().items():
        assert torch.equal(t, before[name]), name
    # And the other way round: changing the source does not reach the copy.
    snapshot = ours.embed.weight.detach().clone()
    with torch.no_grad():
        hf.get_input_embeddings().weight.zero_()
    assert torch.equal(ours.embed.weight, snapshot)


# ----------------------------------------------------------------------------- errors


def test_state_dict_without_config():
    with pytest.raises(ValueError, match=r"state dict alone does not say how many heads.*pass config="):
        gpt_from_hf(gpt2().state_dict())


def test_unsupported_model_type():
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported; tfedu loads gpt2, llama"):
        gpt_from_hf({}, {"model_type": "bert", "hidden_size": 32})
    with pytest.raises(TypeError, match="transformers model or a state dict, got str"):
        gpt_from_hf("gpt2")


@pytest.mark.parametrize(
    "make, config, match",
    [
        (gpt2, gpt2_config(n_embd=16), r"c_attn.weight has shape \(24, 72\).*d_model=16 needs.*\(16, 48\)"),
        (gpt2, gpt2_config(vocab_size=60), r"(?s)gpt2 weights do not fit the config.*size mismatch for embed.weight"),
        (gpt2, gpt2_config(n_layer=1), r"state dict has 2 blocks but the config says n_layers=1"),
        (llama, llama_config(num_key_value_heads=2), r"(?s)llama weights do not fit.*blocks.0.attn.W_K.weight"),
        (llama, llama_config(intermediate_size=48), r"(?s)llama weights do not fit.*mlp.W_gate.weight"),
        (llama, llama_config(num_hidden_layers=3), r"state dict has 2 blocks but the config says n_layers=3"),
    ],
    ids=["gpt2-width", "gpt2-vocab", "gpt2-layers", "llama-kv-heads", "llama-d_mlp", "llama-layers"],
)
def test_weights_that_do_not_fit_the_config(make, config, match):
    with pytest.raises(ValueError, match=match):
        gpt_from_hf(make().state_dict(), config)


def test_missing_entries_name_the_key():
    state_dict = gpt2().state_dict()
    del state_dict["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(KeyError, match=r"gpt2 state dict has no entry 'h.1.mlp.c_fc.bias'"):
        gpt_from_hf(state_dict, gpt2_config())
    state_dict = llama().state_dict()
    del state_dict["lm_head.weight"]
    with pytest.raises(KeyError, match=r"no entry 'lm_head.weight' \(untied embeddings need their own"):
        gpt_from_hf(state_dict, llama_config())
    with pytest.raises(KeyError, match=r"gpt2 state dict has no entry 'wte.weight'; is it a gpt2 checkpoint\?"):
        gpt_from_hf(llama().state_dict(), gpt2_config(n_layer=2))


@pytest.mark.parametrize(
    "config, match",
    [
        (gpt2_config(scale_attn_weights=False), "scale_attn_weights=False"),
        (gpt2_config(activation_function="relu"), "activation 'relu'"),
        (gpt2_config(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        ({**llama_config().to_dict(), "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
         "rope_scaling.*longrope"),
        (llama_config(attention_bias=True, mlp_bias=False), "bias in only one"),
        (llama_config(hidden_act="gelu"), "SwiGLU needs silu"),
    ],
)
def test_configs_tfedu_cannot_reproduce_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(config)


# ----------------------------------------------------------------------------- pretrained: files on disk


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_pretrained_without_files_fails_fast_and_says_where_it_looked(empty_cache):
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as caught:
        pretrained("gpt2")
    assert time.perf_counter() - start < 1.0  # no download attempt, no waiting on a network
    message = str(caught.value)
    assert str(empty_cache / "models--gpt2" / "snapshots") in message
    assert str(empty_cache / "models--openai-community--gpt2" / "snapshots") in message
    assert "huggingface-cli download openai-community/gpt2" in message and "path=" in message


def test_candidate_folders_follow_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert candidate_folders("gpt2")[0].parent == tmp_path / "hub" / "models--gpt2" / "snapshots"
    assert candidate_folders("meta-llama/Llama-3.2-1B")[0].parent.parent.name == "models--meta-llama--Llama-3.2-1B"


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_pretrained_from_a_folder(make, tmp_path):
    hf = make(tie_word_embeddings=False) if make is llama else make()
    hf.save_pretrained(tmp_path)  # config.json + model.safetensors, as on the Hub
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    assert_same_logits(pretrained("gpt2", path=tmp_path), hf, ids_like())
    assert pretrained("gpt2", path=tmp_path, attention="sdpa").cfg.attention == "sdpa"


def test_pretrained_from_the_hub_cache_layout(empty_cache):
    hf = gpt2()
    snapshot = empty_cache / "models--gpt2" / "snapshots" / "abc123"
    hf.save_pretrained(snapshot)
    assert candidate_folders("gpt2")[0] == snapshot
    assert_same_logits(pretrained("gpt2"), hf, ids_like())


def test_pretrained_corrupt_weights_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(gpt2_config().to_json_string())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'model.safetensors'} is not a readable safetensors")):
        pretrained("gpt2", path=tmp_path)


def test_pretrained_unknown_name_without_config(tmp_path):
    gpt2().save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has model.safetensors but no config.json"):
        pretrained("my-model", path=tmp_path)

"""tfedu.peft: LoRA against Hugging Face peft, adapters, prefix and prompt tuning, the counts and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.test_checkpoints import gpt2, ids_like, llama
from tfedu import peft
from tfedu.checkpoints import gpt_from_hf
from tfedu.config import ModelConfig, preset
from tfedu.kv_cache import KVCache
from tfedu.model import GPT

hf_peft = pytest.importorskip("peft")


def tiny(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    return GPT(preset("tiny").replace(**changes)).eval()


def randomise_lora(layers, seed: int = 1) -> None:
    """B non-zero (it starts at 0, which would hide a transposed or missing B)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            layer.B.copy_(0.3 * torch.randn(layer.B.shape, generator=g))


# ----------------------------------------------------------------------------- LoRA


def test_lora_linear_starts_at_base_and_merge_unmerge_round_trip():
    torch.manual_seed(0)
    base = nn.Linear(12, 7)
    layer = peft.LoRALinear(copy.deepcopy(base), r=3, alpha=6)
    x = torch.randn(4, 5, 12)
    assert torch.equal(layer(x), base(x))  # B = 0
    assert not layer.base.weight.requires_grad and layer.A.requires_grad and layer.B.requires_grad
    randomise_lora([layer])
    expected = base(x) + 2.0 * x @ layer.A.T @ layer.B.T  # alpha / r = 2, no activation
    torch.testing.assert_close(layer(x), expected)
    layer.merge()
    torch.testing.assert_close(layer(x), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(layer.base.weight, base.weight + 2.0 * layer.B @ layer.A)
    with pytest.raises(RuntimeError, match="merged already"):
        layer.merge()
    layer.unmerge()
    torch.testing.assert_close(layer.base.weight, base.weight, atol=1e-6, rtol=0)


def test_lora_a_is_kaiming_uniform_like_peft():
    torch.manual_seed(0)
    layer = peft.LoRALinear(nn.Linear(256, 8), r=64)
    bound = 1 / 256**0.5  # kaiming_uniform with a = sqrt(5): bound = sqrt(6 / ((1 + 5) fan_in))
    assert layer.A.abs().max() <= bound and layer.A.abs().max() > 0.95 * bound
    assert torch.equal(layer.B, torch.zeros(8, 64))


def test_apply_lora_defaults_to_w_q_and_w_v_and_freezes_the_rest():
    model = tiny()
    layers = peft.apply_lora(model, r=4, alpha=8)
    assert sorted(layers) == [f"blocks.{i}.attn.{w}" for i in range(2) for w in ("W_Q", "W_V")]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{name}.{m}" for name in layers for m in ("A", "B"))
    count = peft.trainable_fraction(model)
    base_total = sum(p.numel() for p in tiny().parameters())
    assert count.trainable == 2 * 2 * 4 * (64 + 64)  # layers x targets x r (d_in + d_out), by hand
    assert count.total == base_total + count.trainable


def test_gradients_reach_only_the_trainable_parameters():
    ids = ids_like(2, 16)
    for make in (lambda m: peft.apply_lora(m, ("W_Q", "W_V", "W_in"), r=2),
                 lambda m: peft.apply_adapters(m, 4),
                 lambda m: peft.apply_prefix_tuning(m, 3),
                 lambda m: peft.apply_prefix_tuning(m, 3, hidden=8)):
        model = tiny(d_vocab=512)
        make(model)
        for layer in model.modules():
            if isinstance(layer, peft.LoRALinear):
                randomise_lora([layer])
            if isinstance(layer, peft.Adapter):  # up = 0 at init stops the gradient to down, as B = 0 does to A
                nn.init.normal_(layer.up.weight, std=0.1)
        model(ids[:, :-1], ids[:, 1:])[1].backward()
        for name, p in model.named_parameters():
            assert (p.grad is not None and p.grad.abs().sum() > 0) == p.requires_grad, name
    tuned = peft.PromptTuned(tiny(d_vocab=512), 4)
    tuned(ids[:, :-1], ids[:, 1:])[1].backward()
    assert [n for n, p in tuned.named_parameters() if p.grad is not None] == ["prompt"]


@pytest.mark.parametrize("targets", [("W_Q", "W_V"), ("W_K", "W_O", "W_in", "W_out")])
def test_merged_model_equals_unmerged(targets):
    model = tiny()
    randomise_lora(peft.apply_lora(model, targets, r=3, alpha=5).values())
    ids = ids_like(2, 20)
    with torch.no_grad():
        before = model(ids)
        assert peft.merge_lora(model) == 2 * len(targets)
        torch.testing.assert_close(model(ids), before, atol=1e-5, rtol=1e-5)
        peft.unmerge_lora(model)
        torch.testing.assert_close(model(ids), before, atol=1e-5, rtol=1e-5)
        merged, count = peft.merged_model(model)  # plain nn.Linear layers: A and B gone
        torch.testing.assert_close(merged(ids), before, atol=1e-5, rtol=1e-5)
    assert count == 2 * len(targets) and not any(isinstance(m, peft.LoRALinear) for m in merged.modules())
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in tiny().parameters())


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="r \\(the rank\\) must be a positive int"):
        peft.apply_lora(tiny(), r=0)
    with pytest.raises(ValueError, match="unknown LoRA target"):
        peft.apply_lora(tiny(), targets=("q_proj",))
    with pytest.raises(ValueError, match="match no nn.Linear"):
        peft.apply_lora(tiny(), targets=("W_gate",))  # a GELU MLP has no W_gate
    model = tiny()
    peft.apply_lora(model)
    with pytest.raises(ValueError, match="LoRA layers already"):
        peft.apply_lora(model)
    with pytest.raises(TypeError, match="wraps an nn.Linear"):
        peft.LoRALinear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="alpha"):
        peft.LoRALinear(nn.Linear(2, 2), alpha=0)
    with pytest.raises(ValueError, match="bottleneck"):
        peft.apply_adapters(tiny(), bottleneck=0)
    with pytest.raises(ValueError, match="n_prefix"):
        peft.apply_prefix_tuning(tiny(), n_prefix=-1)
    with pytest.raises(ValueError, match="n_prompt"):
        peft.PromptTuned(tiny(), n_prompt=0)


# ----------------------------------------------------------------------------- the Hugging Face peft oracle


def _hf_lora(hf_model, targets, r=4, alpha=8, seed=1):
    config = hf_peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets))
    wrapped = hf_peft.get_peft_model(hf_model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return wrapped.eval()


def _copy_lora(wrapped, ours: GPT, names: dict[str, str], block_path: str) -> int:
    """Copy every lora_A/lora_B of the peft model into the matching LoRALinear of ours; returns how many."""
    copied = 0
    layers = dict(ours.named_modules())
    for name, module in wrapped.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        index = int(name.split(f"{block_path}.")[1].split(".")[0])
        ours_name = f"blocks.{index}.{names[name.rsplit('.', 2)[-2] + '.' + name.rsplit('.', 1)[-1]]}"
        layer = layers[ours_name]
        with torch.no_grad():
            # peft keeps lora_A (r, in) and lora_B (out, r) as nn.Linear weights even for GPT-2's Conv1D:
            # only the merged delta is transposed there (fan_in_fan_out), never A and B themselves.
            layer.A.copy_(module.lora_A["default"].weight)
            layer.B.copy_(module.lora_B["default"].weight)
        copied += 1
    return copied


def test_lora_equals_hf_peft_on_a_tiny_llama_q_and_v():
    hf = llama()
    ours = gpt_from_hf(hf)
    wrapped = _hf_lora(copy.deepcopy(hf), ["q_proj", "v_proj"])
    peft.apply_lora(ours, ("W_Q", "W_V"), r=4, alpha=8)
    names = {"self_attn.q_proj": "attn.W_Q", "self_attn.v_proj": "attn.W_V"}
    assert _copy_lora(wrapped, ours, names, "layers") == 4
    ids = ids_like()
    with torch.no_grad():
        expected = wrapped(input_ids=ids).logits
        assert (expected - hf(ids).logits).abs().max() > 1e-2  # the LoRA update changes the output
        torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)
        merged_hf = wrapped.merge_and_unload()(input_ids=ids).logits
        peft.merge_lora(ours)
        torch.testing.assert_close(ours(ids), merged_hf, atol=1e-4, rtol=1e-4)


def test_lora_equals_hf_peft_on_gpt2_conv1d_mlp():
    hf = gpt2()
    ours = gpt_from_hf(hf)
    wrapped = _hf_lora(copy.deepcopy(hf), ["mlp.c_fc", "mlp.c_proj"])
    peft.apply_lora(ours, ("W_in", "W_out"), r=4, alpha=8)
    names = {"mlp.c_fc": "mlp.W_in", "mlp.c_proj": "mlp.W_out"}
    assert _copy_lora(wrapped, ours, names, "h") == 4
    ids = ids_like()
    with torch.no_grad():
        expected = wrapped(input_ids=ids).logits
        assert (expected - hf(ids).logits).abs().max() > 1e-2
        torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)
        merged = wrapped.merge_and_unload()
        # The trap: the Conv1D weight is [in, out], so peft merges (B @ A).T into it.
        lora_in = ours.blocks[0].mlp.W_in
        torch.testing.assert_close(merged.transformer.h[0].mlp.c_fc.weight,
                                   (lora_in.base.weight + lora_in.delta_weight()).T, atol=1e-6, rtol=1e-6)
        peft.merge_lora(ours)
        torch.testing.assert_close(ours(ids), merged(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- adapters, prefixes, prompts


def test_adapters_start_exactly_at_the_base_model():
    model, base = tiny(), tiny()
    adapters = peft.apply_adapters(model, bottleneck=8)
    ids = ids_like(2, 20)
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))
    count = peft.trainable_fraction(model)
    assert count.trainable == len(adapters) * (64 * 8 + 8 + 8 * 64 + 64)  # down and up, weights and biases


def test_prefix_equals_attention_over_a_prefilled_cache():
    """Without position vectors, a prefix is exactly a KV cache holding those keys and values."""
    model = tiny(positional="none")
    prefixes = peft.apply_prefix_tuning(model, n_prefix=5)
    ids = ids_like(2, 12)
    cache = KVCache.for_model(model, batch=2)
    for layer_cache, prefix in zip(cache.layers, prefixes, strict=True):
        keys, values = prefix()
        layer_cache.append(keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1))
    plain = tiny(positional="none")
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids, kv_cache=cache), atol=1e-5, rtol=1e-5)


def test_prefix_changes_the_output_at_init_and_folding_keeps_it():
    model, base = tiny(), tiny()
    peft.apply_prefix_tuning(model, n_prefix=4, hidden=16)
    ids = ids_like(2, 20)
    with torch.no_grad():
        before = model(ids)
        assert (before - base(ids)).abs().max() > 1e-3  # not the base model: queries now also attend to the prefix
        total = peft.trainable_fraction(model).trainable
        peft.fold_prefixes(model)
        torch.testing.assert_close(model(ids), before)
    assert peft.trainable_fraction(model).trainable == 2 * 2 * 4 * 4 * 16 < total  # keys + values only
    sdpa = tiny(attention="sdpa")
    peft.apply_prefix_tuning(sdpa, n_prefix=4, hidden=16)
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids), before, atol=1e-5, rtol=1e-5)


def test_prefix_with_a_padding_mask_and_a_cache():
    model = tiny()
    peft.apply_prefix_tuning(model, n_prefix=3)
    ids = ids_like(1, 10)
    with torch.no_grad():
        full = model(ids)
        padded = model(ids, padding_mask=torch.ones(1, 10, dtype=torch.bool))
        cache = KVCache.for_model(model, batch=1)
        model(ids[:, :9], kv_cache=cache)
        step = model(ids[:, 9:], kv_cache=cache)
    torch.testing.assert_close(padded, full)
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="ALiBi"):
        alibi = tiny(positional="alibi")
        peft.apply_prefix_tuning(alibi, 2)
        alibi(ids)


def test_prompt_tuning_loss_on_real_tokens_only():
    model = tiny()
    tuned = peft.PromptTuned(copy.deepcopy(model), n_prompt=6)
    ids = ids_like(2, 17)
    logits, loss = tuned(ids[:, :-1], ids[:, 1:])
    assert logits.shape == (2, 16, 256)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1)))
    assert peft.trainable_fraction(tuned).trainable == 6 * 64


def test_code_documents_ship_with_python():
    docs = peft.code_documents()
    assert len(docs) == len(peft.CODE_MODULES) and all("def " in d for d in docs)
    with pytest.raises(FileNotFoundError):
        peft.code_documents(["no_such_module_here"])

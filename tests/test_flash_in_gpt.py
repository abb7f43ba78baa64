"""The course's FlashAttention inside tfedu's GPT (issue 41, item 2): cfg.attention = "flash" or "triton".

The same logits, loss and gradients as the by-hand attention for plain and causal self-attention, with grouped
heads and RoPE too; with a padding mask, or a cached decoding step, the layer falls back to SDPA (same numbers);
a learner's forward and backward plug in through ``tfedu.flash.attention_from``; dropout is refused.
"""

import pytest
import torch

from tfedu.config import preset
from tfedu.flash import attention_from, flash_backward, flash_forward
from tfedu.generate import generate
from tfedu.layers import Attention
from tfedu.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = {"learned": dict(), "rope-gqa": dict(positional="rope", n_kv_heads=2)}


def pair(impl, **changes):
    cfg = preset("tiny").replace(n_ctx=48, init_std=0.2, **changes)
    torch.manual_seed(0)
    manual = GPT(cfg)
    other = GPT(cfg.replace(attention=impl))
    other.load_state_dict(manual.state_dict())
    return manual, other


def same_loss_and_grads(a, b, ids, atol=1e-5):
    la, lb = a(ids, targets=ids)[1], b(ids, targets=ids)[1]
    assert torch.allclose(la, lb, atol=atol), (la.item(), lb.item())
    la.backward()
    lb.backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=atol), name


@pytest.mark.parametrize("changes", CONFIGS.values(), ids=CONFIGS)
def test_flash_attention_in_the_gpt_gives_the_manual_loss_and_gradients(changes):
    manual, flash = pair("flash", **changes)
    ids = torch.randint(0, manual.cfg.d_vocab, (2, 45), generator=torch.Generator().manual_seed(1))
    same_loss_and_grads(manual, flash, ids)


def test_the_triton_kernel_in_the_gpt_gives_the_manual_loss_and_gradients():
    kernels = pytest.importorskip("tfedu.kernels")
    if not kernels.available()[0]:
        pytest.skip(kernels.available()[1])
    manual, triton = pair("triton")
    ids = torch.randint(0, manual.cfg.d_vocab, (1, 40), generator=torch.Generator().manual_seed(2))
    same_loss_and_grads(manual, triton, ids, atol=1e-4)


def test_a_padding_mask_and_cached_decoding_fall_back_to_sdpa_with_the_same_numbers():
    torch.manual_seed(0)
    by_hand, tiled = Attention(32, 4), Attention(32, 4, impl="flash")
    tiled.load_state_dict(by_hand.state_dict())
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[1, ..., :5] = False  # row 1's first five positions are padding
    with torch.no_grad():
        assert torch.allclose(by_hand(x, mask=mask, causal=True), tiled(x, mask=mask, causal=True), atol=1e-5)
    manual, flash = pair("flash")
    ids = torch.randint(0, manual.cfg.d_vocab, (2, 20), generator=torch.Generator().manual_seed(3))
    assert torch.equal(generate(manual, ids[:, :6], 10), generate(flash, ids[:, :6], 10))  # cache on: one query a step


def test_a_learners_forward_and_backward_plug_in_through_flash_fn():
    manual, flash = pair("flash")
    calls = []

    def forward(q, k, v, causal=False, block_q=64, block_k=64):
        calls.append("forward")
        return flash_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)

    def backward(q, k, v, o, lse, do, causal=False, block_q=64, block_k=64):
        calls.append("backward")
        return flash_backward(q, k, v, o, lse, do, causal=causal, block_q=block_q, block_k=block_k)

    for block in flash.blocks:
        block.attn.flash_fn = attention_from(forward, backward, block_q=16, block_k=8)
    ids = torch.randint(0, manual.cfg.d_vocab, (2, 30), generator=torch.Generator().manual_seed(4))
    same_loss_and_grads(manual, flash, ids)
    assert calls.count("forward") == calls.count("backward") == len(flash.blocks)


def test_dropout_and_unknown_implementations_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="have no dropout"):
        Attention(16, 2, impl="flash", dropout=0.1)
    with pytest.raises(ValueError, match="impl must be one of 'manual', 'sdpa', 'flash', 'triton'"):
        Attention(16, 2, impl="cudnn")
    with pytest.raises(ValueError, match="attention"):
        preset("tiny").replace(attention="fast")

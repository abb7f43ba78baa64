"""tfedu.moe: gating, capacity, the balance and z-losses, the two dispatches, and the MoE inside tfedu.model.

Oracles: Hugging Face's Mixtral sparse-MoE block and its load-balancing loss, built locally from a config
(no download), and torch's FlopCounterMode for the FLOPs.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tfedu.config import ModelConfig
from tfedu.flops import flops_per_token, param_count
from tfedu.model import GPT
from tfedu.moe import (
    MoE,
    balance_loss,
    expert_capacity,
    expert_fractions,
    moe_layers,
    router_losses,
    router_z_loss,
    sort_assignments,
    top_k_gating,
    use_router,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def seeded(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------- gating


def test_top1_gate_is_the_probability_and_carries_the_router_gradient():
    logits = seeded(6, 4).requires_grad_()
    gates, experts = top_k_gating(logits, 1)
    probs = logits.softmax(-1)
    assert torch.equal(experts[:, 0], probs.argmax(-1))
    torch.testing.assert_close(gates[:, 0], probs.max(-1).values)
    gates.sum().backward()
    assert logits.grad.abs().sum() > 0  # renormalising one gate to 1 would leave this 0


def test_topk_gates_renormalised_equal_softmax_over_the_chosen_logits():
    logits = seeded(10, 8)
    gates, experts = top_k_gating(logits, 3)
    torch.testing.assert_close(gates.sum(-1), torch.ones(10))
    torch.testing.assert_close(gates, logits.gather(-1, experts).softmax(-1))


@pytest.mark.parametrize("bad, k, message", [
    (torch.zeros(4), 1, "shape (tokens, n_experts)"),
    (torch.zeros(4, 3, dtype=torch.long), 1, "float tensor"),
    (torch.zeros(4, 3), 4, "from 1 to n_experts=3"),
    (torch.zeros(4, 3), 0, "from 1 to n_experts=3"),
])
def test_gating_bad_input(bad, k, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        top_k_gating(bad, k)


# ----------------------------------------------------------------------------- losses


def test_balance_loss_is_one_when_even_and_E_when_collapsed():
    E = 4
    even = balance_loss(torch.full((8, E), 1 / E), (torch.arange(8) % E)[:, None])
    collapsed = balance_loss(F.one_hot(torch.zeros(8, dtype=torch.long), E).float(), torch.zeros(8, 1, dtype=torch.long))
    assert even.item() == pytest.approx(1.0) and collapsed.item() == pytest.approx(E)


def test_balance_loss_trains_the_router_through_P_only():
    logits = seeded(16, 4).requires_grad_()
    probs = logits.softmax(-1)
    _, experts = top_k_gating(logits, 2)
    balance_loss(probs, experts).backward()
    f = expert_fractions(experts, 4)
    # d/dP_i of E sum_i f_i P_i is E f_i; P_i = mean_t probs[t, i]
    expected = torch.autograd.grad((4 * f * logits.softmax(-1).mean(0)).sum(), logits)[0]
    torch.testing.assert_close(logits.grad, expected)


def test_balance_loss_matches_hugging_face_mixtral_times_k():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = seeded(32, 8, seed=3)
    for k in (1, 2):
        _, experts = top_k_gating(logits, k)
        ours = balance_loss(logits.softmax(-1), experts)
        theirs = mixtral.load_balancing_loss_func((logits,), num_experts=8, top_k=k)
        # HF's token fractions add to k (each token counted once per pick); ours add to 1.
        torch.testing.assert_close(theirs, k * ours)


def test_z_loss_is_mean_squared_logsumexp_and_shift_sensitive():
    logits = seeded(5, 4)
    torch.testing.assert_close(router_z_loss(logits), torch.logsumexp(logits, -1).pow(2).mean())
    assert router_z_loss(logits + 10) > router_z_loss(logits)  # the softmax is unchanged, the loss is not


# ----------------------------------------------------------------------------- capacity and dispatch


def test_capacity_formula_and_errors():
    assert expert_capacity(512, 8, 1, 1.25) == 80
    assert expert_capacity(100, 8, 2, 1.0) == 25  # ceil(200 / 8)
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(10, 2, 1, 0)


def test_first_choices_are_queued_before_second_choices():
    experts = torch.tensor([[0, 1], [1, 0], [0, 1]])
    a = sort_assignments(experts, 2)
    # expert 0's queue: token 0 (1st), token 2 (1st), token 1 (2nd)
    queue0 = [(int(t), int(c)) for t, c, e in zip(a.token, a.choice, a.expert) if e == 0]
    assert queue0 == [(0, 0), (2, 0), (1, 1)]
    assert a.rank.tolist() == [0, 1, 2, 0, 1, 2]


def make_moe(dispatch, *, activation="gelu", bias=True, k=2, capacity_factor=None, seed=0):
    torch.manual_seed(seed)
    return MoE(16, 24, 4, top_k=k, capacity_factor=capacity_factor, activation=activation, bias=bias,
               dispatch=dispatch)


@pytest.mark.parametrize("activation, bias", [("gelu", True), ("swiglu", False), ("relu", True)])
@pytest.mark.parametrize("k, capacity_factor", [(1, None), (2, None), (1, 1.0), (2, 0.75)])
def test_loop_and_sorted_dispatch_give_equal_outputs_and_gradients(activation, bias, k, capacity_factor):
    loop, fast = (make_moe(d, activation=activation, bias=bias, k=k, capacity_factor=capacity_factor)
                  for d in ("loop", "sorted"))
    fast.load_state_dict(loop.state_dict())
    x = seeded(3, 20, 16, seed=1, dtype=torch.float64)
    loop.double(), fast.double()
    outs, grads = [], []
    for layer in (loop, fast):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        (out.pow(2).sum() + layer.aux_loss).backward()
        outs.append(out)
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert torch.equal(loop.stats.kept, fast.stats.kept) and loop.stats.dropped == fast.stats.dropped
    if capacity_factor is not None:
        assert fast.stats.dropped > 0  # the capacity path was exercised


def test_dropped_tokens_are_counted_and_get_zero():
    moe = make_moe("sorted", k=1, capacity_factor=0.5)
    x = seeded(64, 16, seed=2)
    out = moe(x)
    s = moe.stats
    assert s.capacity == 8  # ceil(0.5 * 64 / 4)
    assert int(s.kept.max()) <= 8 and s.dropped == 64 - int(s.kept.sum()) > 0
    assert s.dropped_tokens == s.dropped  # k = 1: a dropped assignment is a dropped token
    zero_rows = (out == 0).all(-1)
    assert int(zero_rows.sum()) == s.dropped_tokens


def test_eval_mode_drops_nothing():
    moe = make_moe("sorted", k=1, capacity_factor=0.5).eval()
    moe(seeded(64, 16, seed=2))
    assert moe.stats.capacity is None and moe.stats.dropped == 0


def test_dropped_token_passes_through_the_block_residual():
    cfg = ModelConfig(d_vocab=32, n_ctx=16, d_model=16, n_layers=1, n_heads=2, n_experts=4, capacity_factor=0.25)
    torch.manual_seed(0)
    model = GPT(cfg).train()
    seen = {}
    block = model.blocks[0]
    block.hook_resid_mid.register_forward_hook(lambda m, i, o: seen.__setitem__("mid", o))
    block.hook_resid_post.register_forward_hook(lambda m, i, o: seen.__setitem__("post", o))
    model(torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0)))
    assert block.mlp.stats.dropped_tokens > 0
    same = (seen["mid"] == seen["post"]).all(-1).flatten()
    assert int(same.sum()) == block.mlp.stats.dropped_tokens


def test_matches_hugging_face_mixtral_sparse_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2, hidden_act="silu")
    torch.manual_seed(0)
    theirs = MixtralSparseMoeBlock(hf_cfg).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MoE(16, 24, 4, top_k=2, activation="swiglu", bias=False)
    gate_up = theirs.experts.gate_up_proj.detach()
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.W_gate.copy_(gate_up[:, :24].transpose(1, 2))
        ours.W_in.copy_(gate_up[:, 24:].transpose(1, 2))
        ours.W_out.copy_(theirs.experts.down_proj.transpose(1, 2))
    x = seeded(2, 7, 16, seed=4)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_flop_counter_sees_k_experts_per_token_and_the_router():
    d, d_mlp, E, n = 16, 24, 8, 40
    x = seeded(n, d, seed=5)
    measured = {}
    for k in (1, 2, 4):
        torch.manual_seed(0)
        moe = MoE(d, d_mlp, E, top_k=k, dispatch="loop").eval()
        with FlopCounterMode(display=False) as counter:
            moe(x)
        measured[k] = counter.get_total_flops()
        assert measured[k] == n * (k * 2 * (2 * d * d_mlp) + 2 * d * E)


def test_param_and_flop_count_of_a_moe_gpt():
    dense = ModelConfig(d_vocab=64, n_ctx=16, d_model=32, n_layers=2, n_heads=4)
    for E, k, act, bias in ((4, 1, "gelu_tanh", True), (8, 2, "swiglu", False)):
        cfg = dense.replace(n_experts=E, top_k=k, activation=act, bias=bias)
        counted = param_count(cfg)
        assert counted.total == sum(p.numel() for p in GPT(cfg).parameters())
        one = param_count(cfg.replace(n_experts=None, top_k=1))
        assert counted.mlp == E * one.mlp and counted.router == 2 * 32 * E
        assert counted.active == counted.total - (E - k) * one.mlp // 1
        f, f_dense = flops_per_token(cfg, 16), flops_per_token(cfg.replace(n_experts=None, top_k=1), 16)
        assert f.mlp == k * f_dense.mlp and f.router == 2 * 2 * 32 * E


def test_config_rejects_inconsistent_expert_settings():
    base = dict(d_vocab=8, n_ctx=4, d_model=8, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match="set n_experts"):
        ModelConfig(**base, top_k=2)
    with pytest.raises(ValueError, match="more than n_experts"):
        ModelConfig(**base, n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        ModelConfig(**base, n_experts=2, capacity_factor=0)
    cfg = ModelConfig(**base, n_experts=4, top_k=2, capacity_factor=1.25)
    assert ModelConfig(**cfg.as_dict()) == cfg


def test_gating_that_returns_the_wrong_shape_is_named():
    moe = make_moe("sorted", k=2)
    moe.gating = lambda logits, k: top_k_gating(logits, 1)
    with pytest.raises(ValueError, match=r"gating must return \(gates, experts\)"):
        moe(seeded(5, 16))


# ----------------------------------------------------------------------------- in a model


def test_moe_gpt_trains_with_router_losses_and_cached_decoding_matches():
    from tfedu.data import TokenDataset
    from tfedu.generate import generate
    from tfedu.train import TrainConfig, train

    cfg = ModelConfig(d_vocab=16, n_ctx=16, d_model=32, n_layers=2, n_heads=4, n_experts=4, top_k=2,
                      capacity_factor=1.25)
    torch.manual_seed(0)
    model = GPT(cfg)
    assert len(moe_layers(model)) == 2
    ids = (torch.arange(2000) % 7).numpy()  # a period-7 pattern
    result = train(model, TokenDataset.from_ids(ids), TrainConfig(steps=60, batch_size=8, seq_len=16, lr=3e-3,
                                                                  warmup_steps=5, eval_every=1000), progress=False)
    assert result.losses[-1] < 0.5 * result.losses[0]
    assert isinstance(router_losses(model), torch.Tensor)
    model.eval()
    prompt = torch.tensor([[0, 1, 2]])
    cached = generate(model, prompt, 8, use_cache=True)
    plain = generate(model, prompt, 8, use_cache=False)
    assert torch.equal(cached, plain)


def test_use_router_swaps_every_layer():
    cfg = ModelConfig(d_vocab=16, n_ctx=8, d_model=16, n_layers=3, n_heads=2, n_experts=4)
    model = GPT(cfg)
    calls = []

    def spy(logits, k):
        calls.append(k)
        return top_k_gating(logits, k)

    assert use_router(model, gating=spy) == 3
    model(torch.zeros(1, 4, dtype=torch.long))
    assert calls == [1, 1, 1]
    assert use_router(model, balance=lambda probs, experts: probs.sum() * 0) == 3
    model(torch.zeros(1, 4, dtype=torch.long))
    assert all(layer.stats.balance == 0 for layer in moe_layers(model))
    assert router_losses(GPT(cfg.replace(n_experts=None))) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balance_loss_spreads_the_tokens_over_experts(seed):
    """Notebook 12's claim, over three seeds: trained with Switch's balance loss (weight 0.01), the router spreads
    held-out tokens more evenly over its 8 experts than the same model trained without it."""
    from tfedu.data import TokenDataset, encode_bytes, load_pydoc_text
    from tfedu.train import TrainConfig, train

    corpus = TokenDataset.from_ids(encode_bytes(load_pydoc_text()).numpy())
    train_data, val_data = corpus.split(0.1)
    cfg = ModelConfig(d_vocab=256, n_ctx=32, d_model=32, n_layers=2, n_heads=4, n_experts=8, capacity_factor=1.25)
    held_out, _ = val_data.batch(16, 32, torch.Generator().manual_seed(0))
    spread = {}
    for coef in (0.01, 0.0):
        torch.manual_seed(seed)
        model = GPT(cfg.replace(balance_loss_coef=coef))
        train(model, train_data, TrainConfig(steps=80, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=8,
                                             eval_every=10**6, seed=seed), progress=False)
        model.eval()
        with torch.no_grad():
            model(held_out)
        shares = torch.stack([layer.stats.utilisation for layer in moe_layers(model)])
        spread[coef] = shares.std(dim=1).mean().item()
    assert spread[0.01] < 0.5 * spread[0.0], spread

"""Checkers and probes of notebook 12: each passes the reference and right alternatives, and names realistic mistakes."""

import math
import warnings

import einops
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tfedu.moe
from checker_helpers import failure_of, not_done, verdict
from tfedu.checks import nb12_moe_and_scaling as nb12
from tfedu.checks.core import ExerciseNotDone, is_plain_data, run_probe
from tfedu.checks.scan import scan_answer
from tfedu.moe import balance_loss, expert_fractions, top_k_gating

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- 12.1 top_k_gating


def gating(router_logits, k, mistake=""):
    """A learner's top_k_gating, written by hand, right or with one ``mistake``."""
    dim = 0 if mistake == "softmax dim 0" else -1
    if mistake == "naive exp":
        exps = router_logits.exp()
        probs = exps / exps.sum(dim=-1, keepdim=True)
    else:
        probs = torch.softmax(router_logits, dim=dim)  # tokens n_experts
    if mistake == "raw logits":
        probs = router_logits
    kept = {"k = 2 always": 2, "all experts": router_logits.shape[-1]}.get(mistake, k)
    gates, experts = torch.topk(probs, kept, dim=-1, largest=mistake != "smallest")  # tokens k
    if mistake == "tokens axis":
        gates, experts = torch.topk(probs, k, dim=0)
    if (k > 1 and mistake != "not renormalised") or mistake == "renormalised at k = 1":
        total = gates.sum(dim=-1, keepdim=True)
        gates = gates / (total.detach() if mistake == "detached sum" else total)
    if mistake == "squeezed" and k == 1:
        gates, experts = gates.squeeze(-1), experts.squeeze(-1)
    if mistake == "detached":
        gates = gates.detach()
    if mistake == "tolist":
        gates = torch.tensor(gates.tolist(), dtype=router_logits.dtype)
    if mistake == "float experts":
        experts = experts.float()
    if mistake == "int32 experts":
        experts = experts.int()
    if mistake == "lists":
        return gates.tolist(), experts.tolist()
    if mistake == "swapped":
        return experts, gates
    if mistake == "float32 gates":
        gates = gates.float()
    return gates, experts


def gating_under_no_grad(router_logits, k):
    with torch.no_grad():
        return gating(router_logits, k)


def gating_in_place(router_logits, k):
    router_logits -= router_logits.max(dim=-1, keepdim=True).values  # the stable shift, on the caller's tensor
    return gating(router_logits, k)


def gating_top_k_logits_softmax(router_logits, k):
    """Pick by the logits, then a softmax over the k kept logits when k > 1 (equal to renormalising)."""
    logits, experts = router_logits.topk(k, dim=-1)
    if k == 1:
        return torch.softmax(router_logits, dim=-1).gather(-1, experts), experts
    return F.softmax(logits, dim=-1), experts


def gating_softmax_over_kept(router_logits, k):
    """A softmax over the k kept logits for every k: right for k > 1, but a gate of exactly 1 when k = 1."""
    logits, experts = router_logits.topk(k, dim=-1)
    return F.softmax(logits, dim=-1), experts


def gating_by_argsort_any_order(router_logits, k, dtype=torch.int64):
    """Stable softmax by hand, argsort, and the k picks handed back in increasing expert id: out of order."""
    shifted = router_logits - router_logits.amax(dim=-1, keepdim=True)
    probs = shifted.exp() / shifted.exp().sum(dim=-1, keepdim=True)
    experts = probs.argsort(dim=-1, descending=True)[:, :k].sort(dim=-1).values.to(dtype)
    gates = probs.gather(-1, experts.long())
    return gates / gates.sum(dim=-1, keepdim=True) if k > 1 else gates, experts


def gating_unsorted(router_logits, k):
    """torch.topk(..., sorted=False): on CPU out of order for k = 3; the brief asks for the largest gate first."""
    gates, experts = torch.softmax(router_logits, dim=-1).topk(k, dim=-1, sorted=False)
    return (gates / gates.sum(dim=-1, keepdim=True) if k > 1 else gates), experts


def gating_einops(router_logits, k):
    probs = router_logits.softmax(dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    total = einops.reduce(gates, "tokens k -> tokens 1", "sum")
    return (gates / total if k > 1 else gates), experts


def gating_by_argsort(router_logits, k):
    """Stable softmax by hand and a descending argsort: the largest gate first, as asked."""
    shifted = router_logits - router_logits.amax(dim=-1, keepdim=True)
    probs = shifted.exp() / shifted.exp().sum(dim=-1, keepdim=True)
    experts = probs.argsort(dim=-1, descending=True)[:, :k]
    gates = probs.gather(-1, experts)
    return gates / gates.sum(dim=-1, keepdim=True) if k > 1 else gates, experts


RIGHT_GATING = {"by hand": gating, "softmax over the top-k logits": gating_top_k_logits_softmax,
                "argsort": gating_by_argsort, "einops": gating_einops}

GATING_MISTAKES = {  # name: (wrong top_k_gating, a phrase its hint must contain)
    "softmax dim 0": (lambda x, k: gating(x, k, "softmax dim 0"), "normalised over the tokens axis"),
    "not renormalised": (lambda x, k: gating(x, k, "not renormalised"), "add to less than 1"),
    "renormalised at k = 1": (lambda x, k: gating(x, k, "renormalised at k = 1"), "every one of your gates is exactly 1"),
    "softmax over the kept logits, k = 1 too": (gating_softmax_over_kept, "no gradient reaches the router"),
    "k = 2 always": (lambda x, k: gating(x, k, "k = 2 always"), "2 experts per token, where k = 1 was asked"),
    "all experts": (lambda x, k: gating(x, k, "all experts"), "(all n_experts = "),
    "squeezed": (lambda x, k: gating(x, k, "squeezed"), "keep the k axis"),
    "tokens axis": (lambda x, k: gating(x, k, "tokens axis"), "picked along the tokens axis"),
    "raw logits": (lambda x, k: gating(x, k, "raw logits"), "raw logits"),
    "smallest": (lambda x, k: gating(x, k, "smallest"), "smallest probabilities"),
    "detached": (lambda x, k: gating(x, k, "detached"), "carry no gradient back to router_logits"),
    "no_grad": (gating_under_no_grad, "carry no gradient back to router_logits"),
    "tolist": (lambda x, k: gating(x, k, "tolist"), "carry no gradient back to router_logits"),
    "detached sum": (lambda x, k: gating(x, k, "detached sum"), "the sum you divide by"),
    "naive exp": (lambda x, k: gating(x, k, "naive exp"), "subtract each row's max"),
    "in place": (gating_in_place, "changed the caller's `router_logits` in place"),
    "lists": (lambda x, k: gating(x, k, "lists"), "should return two torch tensors"),
    "float experts": (lambda x, k: gating(x, k, "float experts"), "int64 expected"),
    "int32 experts": (lambda x, k: gating(x, k, "int32 experts"), "the brief asks for int64 (torch.long)"),
    "argsort, int32": (lambda x, k: gating_by_argsort_any_order(x, k, torch.int32), "the brief asks for int64"),
    "increasing expert id": (gating_by_argsort_any_order, "but not in order"),
    "topk unsorted": (gating_unsorted, "but not in order"),
    "swapped": (lambda x, k: gating(x, k, "swapped"), "you returned (experts, gates)"),
    "float32 gates": (lambda x, k: gating(x, k, "float32 gates"), "keep the logits' dtype"),
    "one tensor": (lambda x, k: gating(x, k)[0], "should return a pair (gates, experts)"),
}


@pytest.mark.parametrize("name", RIGHT_GATING)
def test_top_k_gating_passes_right_answers(name, capsys):
    nb12.check_top_k_gating(RIGHT_GATING[name])
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", GATING_MISTAKES)
def test_top_k_gating_names_each_mistake(name):
    wrong, fragment = GATING_MISTAKES[name]
    message = failure_of(nb12.check_top_k_gating, wrong)
    assert fragment in message, message


def test_top_k_gating_refuses_tfedu_moe_and_says_when_not_done():
    assert "uses tfedu.moe (you passed tfedu.moe's own top_k_gating)" in failure_of(nb12.check_top_k_gating, top_k_gating)
    namespace = {"moe": tfedu.moe, "pick": top_k_gating}
    exec("def by_module(router_logits, k):\n    return moe.top_k_gating(router_logits, k)\n"
         "def by_name(router_logits, k):\n    return pick(router_logits, k)\n", namespace)
    assert "uses tfedu.moe (moe)" in failure_of(nb12.check_top_k_gating, namespace["by_module"])
    assert "uses tfedu.moe (pick)" in failure_of(nb12.check_top_k_gating, namespace["by_name"])
    hidden = {"tfedu": tfedu}  # the package is no shortcut itself: the call is caught while it runs
    exec("def through_package(router_logits, k):\n    return tfedu.moe.top_k_gating(router_logits, k)\n", hidden)
    assert "tfedu.moe.top_k_gating" in failure_of(nb12.check_top_k_gating, hidden["through_package"])
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb12.check_top_k_gating(not_done)
    with pytest.raises(ExerciseNotDone, match="returned None"):
        nb12.check_top_k_gating(lambda router_logits, k: None)


def test_the_gating_cases_have_no_ties_and_tell_the_mistakes_apart():
    for seed, tokens, n_experts, k, dtype, offset in nb12.GATING_CASES:
        logits = nb12.router_logits(seed, tokens, n_experts, dtype, offset)
        gaps = logits.double().sort(dim=-1).values.diff(dim=-1)
        assert (gaps >= 0.25 - 1e-9).all() and torch.equal(logits.double(), (logits.double() * 8).round() / 8)
    logits = nb12.router_logits(*nb12.GATING_CASES[1][:3])  # 6 tokens, 4 experts, k = 2
    want = nb12.expected_gating(logits, 2)
    for hint, gates, experts in nb12.gating_mistakes(logits, 2):
        assert not nb12._same_pair(gates, experts, *want), hint


# ----------------------------------------------------------------------------- 12.2 balance_loss


def loss_by_bincount(router_probs, experts):
    n_experts = router_probs.shape[-1]
    f = torch.bincount(experts.flatten(), minlength=n_experts) / experts.numel()  # n_experts
    P = router_probs.mean(dim=0)  # n_experts
    return n_experts * (f * P).sum()


def loss_by_one_hot(router_probs, experts):
    n_experts = router_probs.shape[1]
    f = F.one_hot(experts, n_experts).float().sum(dim=(0, 1)) / experts.numel()
    return n_experts * torch.dot(f.to(router_probs.dtype), router_probs.mean(dim=0))


def loss_by_scatter_and_einops(router_probs, experts):
    tokens, n_experts = router_probs.shape
    counts = torch.zeros(n_experts, dtype=router_probs.dtype).scatter_add(
        0, experts.flatten(), torch.ones(experts.numel(), dtype=router_probs.dtype))
    P = einops.reduce(router_probs, "tokens n_experts -> n_experts", "mean")
    return n_experts * einops.einsum(counts / experts.numel(), P, "e, e ->")


def balance_variant(router_probs, experts, mistake):
    tokens, n_experts = router_probs.shape
    counts = torch.bincount(experts.flatten(), minlength=n_experts).to(router_probs.dtype)
    f = counts / experts.numel()
    P = router_probs.mean(dim=0)
    if mistake == "f from probs":
        f = P
    if mistake == "raw counts":
        f = counts
    if mistake == "P summed":
        P = router_probs.sum(dim=0)
    if mistake == "bincount without minlength":
        f = torch.bincount(experts.flatten()).to(router_probs.dtype) / experts.numel()
        if len(f) not in (1, n_experts):  # (1,) broadcasts over P; other lengths fail loudly, as in the notebook
            raise RuntimeError(f"The size of tensor a ({len(f)}) must match the size of tensor b ({n_experts})")
    if mistake == "per token":
        f = counts / tokens
    if mistake == "first choice":
        f = torch.bincount(experts[:, 0], minlength=n_experts).to(router_probs.dtype) / tokens
    if mistake == "P detached":
        P = P.detach()
    if mistake == "P chosen":
        P = (router_probs * F.one_hot(experts, n_experts).sum(dim=1)).mean(dim=0)
    if mistake == "no E":
        return (f * P).sum()
    if mistake == "mean":
        return n_experts * (f * P).mean()
    if mistake == "mean, no E":
        return (f * P).mean()
    if mistake == "not summed":
        return n_experts * f * P
    if mistake == "shape (1,)":
        return (n_experts * (f * P).sum()).reshape(1)
    if mistake == "float":
        return (n_experts * (f * P).sum()).item()
    return n_experts * (f * P).sum()


def loss_under_no_grad(router_probs, experts):
    with torch.no_grad():
        return loss_by_bincount(router_probs, experts)


def loss_in_place(router_probs, experts):
    router_probs *= router_probs.shape[-1]  # "rescale" the caller's probabilities
    return loss_by_bincount(router_probs / router_probs.shape[-1], experts)


RIGHT_BALANCE = {"bincount": loss_by_bincount, "one_hot": loss_by_one_hot, "scatter and einops": loss_by_scatter_and_einops}

BALANCE_MISTAKES = {  # name: (wrong balance_loss, a phrase its hint must contain)
    "f from probs": (lambda p, e: balance_variant(p, e, "f from probs"), "E * sum_i P_i^2"),
    "no E": (lambda p, e: balance_variant(p, e, "no E"), "the factor E in front is missing"),
    "mean": (lambda p, e: balance_variant(p, e, "mean"), "averaged f_i * P_i over the experts with .mean()"),
    "mean, no E": (lambda p, e: balance_variant(p, e, "mean, no E"), "divided by E^2"),
    "raw counts": (lambda p, e: balance_variant(p, e, "raw counts"), "raw counts"),
    "per token": (lambda p, e: balance_variant(p, e, "per token"), "Hugging Face Mixtral's convention"),
    "P summed": (lambda p, e: balance_variant(p, e, "P summed"), "sums router_probs over the tokens"),
    "first choice": (lambda p, e: balance_variant(p, e, "first choice"), "only each token's first choice"),
    "P detached": (lambda p, e: balance_variant(p, e, "P detached"), "is P detached"),
    "no_grad": (loss_under_no_grad, "is P detached"),
    "P chosen": (lambda p, e: balance_variant(p, e, "P chosen"), "chosen experts' probabilities only"),
    "not summed": (lambda p, e: balance_variant(p, e, "not summed"), "one entry per expert"),
    "shape (1,)": (lambda p, e: balance_variant(p, e, "shape (1,)"), "return a 0-d tensor"),
    "float": (lambda p, e: balance_variant(p, e, "float"), "returned a Python float"),
    "in place": (loss_in_place, "changed the caller's `router_probs` in place"),
}


@pytest.mark.parametrize("name", RIGHT_BALANCE)
def test_balance_loss_passes_right_answers(name, capsys):
    nb12.check_balance_loss(RIGHT_BALANCE[name])
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", BALANCE_MISTAKES)
def test_balance_loss_names_each_mistake(name):
    wrong, fragment = BALANCE_MISTAKES[name]
    message = failure_of(nb12.check_balance_loss, wrong)
    assert fragment in message, message


def test_balance_loss_refuses_tfedu_moe_and_says_when_not_done():
    assert "tfedu.moe's own balance_loss" in failure_of(nb12.check_balance_loss, balance_loss)
    namespace = {"fractions": expert_fractions}
    exec("def with_fractions(router_probs, experts):\n"
         "    E = router_probs.shape[-1]\n"
         "    return E * (fractions(experts, E).to(router_probs.dtype) * router_probs.mean(0)).sum()\n", namespace)
    assert "uses tfedu.moe (fractions)" in failure_of(nb12.check_balance_loss, namespace["with_fractions"])
    hidden = {"tfedu": tfedu}
    exec("def through_package(router_probs, experts):\n    return tfedu.moe.balance_loss(router_probs, experts)\n", hidden)
    assert "tfedu.moe.balance_loss" in failure_of(nb12.check_balance_loss, hidden["through_package"])
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb12.check_balance_loss(not_done)
    with pytest.raises(ExerciseNotDone, match="returned None"):
        nb12.check_balance_loss(lambda router_probs, experts: None)


def test_balanced_and_collapsed_routers_give_1_and_E():
    assert nb12.expected_balance(*nb12.balanced(8, 4, 2)).item() == pytest.approx(1.0)
    assert balance_variant(*nb12.balanced(8, 4, 2), "per token").item() == pytest.approx(2.0)  # Mixtral's k at balance
    assert nb12.expected_balance(*nb12.collapsed(6, 4)).item() == pytest.approx(4.0)


# ----------------------------------------------------------------------------- probes

GATING_PROBE = nb12.PROBES["check_top_k_gating"]
BALANCE_PROBE = nb12.PROBES["check_balance_loss"]
PROBE_GATING_MISTAKES = {  # the probe's own wording where the kernel's checks speak first
    "in place": "changed its input in place", "lists": "should return a pair", "one tensor": "should return a pair",
}
PROBE_BALANCE_MISTAKES = {"in place": "changed its input in place", "float": "should return tensor, it returned float"}


@pytest.mark.parametrize("name", [*RIGHT_GATING, "reference"])
def test_gating_probe_passes_right_answers(name):  # the probe judges outputs only: the grader's scan refuses tfedu.moe
    for seed in range(4):
        assert verdict(GATING_PROBE, {"top_k_gating": RIGHT_GATING.get(name, top_k_gating)}, seed) is None, seed


@pytest.mark.parametrize("name", [*RIGHT_BALANCE, "reference"])
def test_balance_probe_passes_right_answers(name):
    for seed in range(4):
        assert verdict(BALANCE_PROBE, {"balance_loss": RIGHT_BALANCE.get(name, balance_loss)}, seed) is None, seed


@pytest.mark.parametrize("name", [n for n in GATING_MISTAKES if n != "float32 gates"])
def test_gating_probe_names_mistakes(name):
    wrong, fragment = GATING_MISTAKES[name]
    for seed in range(2):
        feedback = verdict(GATING_PROBE, {"top_k_gating": wrong}, seed)
        assert feedback is not None and PROBE_GATING_MISTAKES.get(name, fragment) in feedback, (seed, feedback)


@pytest.mark.parametrize("name", BALANCE_MISTAKES)
def test_balance_probe_names_mistakes(name):
    wrong, fragment = BALANCE_MISTAKES[name]
    for seed in range(2):
        feedback = verdict(BALANCE_PROBE, {"balance_loss": wrong}, seed)
        assert feedback is not None and PROBE_BALANCE_MISTAKES.get(name, fragment) in feedback, (seed, feedback)


def test_probes_keep_the_gates_dtype_and_use_plain_data():
    """The kernel exports float64 gates as float64 (not float32, as the shared helper would), so a cast shows."""
    for seed in range(4):
        inputs = GATING_PROBE.make_inputs(np.random.default_rng(seed))
        if any(case["logits"].dtype == np.float64 for case in inputs["cases"]):
            feedback = verdict(GATING_PROBE, {"top_k_gating": GATING_MISTAKES["float32 gates"][0]}, seed)
            assert feedback is not None and "keep the logits' dtype" in feedback, feedback
        for probe, name, fn in ((GATING_PROBE, "top_k_gating", gating), (BALANCE_PROBE, "balance_loss", loss_by_bincount)):
            outputs, expected = run_probe(probe, {name: fn}, seed)
            assert is_plain_data(outputs) and is_plain_data(expected)
            assert set(outputs) >= {"returned", "mutated", "grads"}


def test_probe_names_the_grader_can_check():
    assert GATING_PROBE.exercise == "ex_top_k_gating" and BALANCE_PROBE.exercise == "ex_balance_loss"
    context = ["import torch\nimport torch.nn.functional as F\nfrom torch import nn\nimport math, einops"]
    for probe in (GATING_PROBE, BALANCE_PROBE):
        assert "tfedu.moe" in probe.forbidden
        assert scan_answer("from tfedu.moe import top_k_gating as pick\n", context=context, forbidden=probe.forbidden)
        assert scan_answer("import tfedu.moe\n", context=context, forbidden=probe.forbidden)
    allowed = ("def top_k_gating(router_logits, k):\n    probs = torch.softmax(router_logits, dim=-1)\n"
               "    gates, experts = torch.topk(F.softmax(router_logits, -1), k, dim=-1)\n    return gates, experts\n")
    assert scan_answer(allowed, context=context, forbidden=GATING_PROBE.forbidden) == []


# ----------------------------------------------------------------------------- 12.3 moe_forward


def top_k_gating_by_hand(router_logits, k):
    """Exercise 12.1's answer, as the learner's notebook defines it (the check binds its own in its place)."""
    gates, experts = torch.softmax(router_logits, dim=-1).topk(k, dim=-1)
    return (gates / gates.sum(dim=-1, keepdim=True) if k > 1 else gates), experts


def forward(x, router_weight, experts, k, capacity, mistake=""):
    """A learner's moe_forward with a Python loop over the queue, right or with one ``mistake``."""
    tokens = x.shape[0]
    if mistake == "not renormalised":
        gates, chosen = torch.softmax(x @ router_weight.T, dim=-1).topk(k, dim=-1)
    else:
        gates, chosen = top_k_gating(x @ router_weight.T, k)  # noqa: F821 (bound by the check, or by the test below)
    if mistake == "detached gates":
        gates = gates.detach()
    choices = 1 if mistake == "first choice only" else k
    order = {"token order": [(t, j) for t in range(tokens) for j in range(choices)],
             "latest first": [(t, j) for j in range(choices) for t in reversed(range(tokens))]}.get(
        mistake, [(t, j) for j in range(choices) for t in range(tokens)])
    if mistake == "gate priority":
        order = sorted(order, key=lambda tj: -gates[tj].item())
    limit = {"capacity + 1": capacity + 1, "capacity - 1": capacity - 1, "no capacity": 10**9}.get(mistake, capacity)
    kept, load, total = torch.zeros(tokens, k, dtype=torch.bool), [0] * len(experts), 0
    for t, j in order:
        e = int(chosen[t, j])
        full = total >= capacity if mistake == "one counter" else load[e] >= limit
        if not full:
            kept[t, j] = True
            load[e] += 1
            total += 1
    weights = gates * kept
    if mistake == "no gates":
        weights = kept.to(x.dtype)
    if mistake == "gates twice":
        weights = weights * gates
    if mistake == "renormalised after dropping":
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        if mistake == "all tokens":
            y = expert(x)  # every token through every expert, the dropped ones masked out after
            mask = ((chosen == e) & kept).to(x.dtype)
            out = out + ((weights * mask).sum(dim=-1, keepdim=True)) * y
            continue
        for t, j in zip(*torch.where((chosen == e) & kept)):
            out = out.index_add(0, t[None], weights[t, j] * expert(x[t][None]))
    if mistake == "dropped is x":
        out = torch.where(kept.any(dim=-1, keepdim=True), out, x)
    if mistake == "residual":
        out = out + x
    if mistake == "kept inverted":
        kept = ~kept
    if mistake == "kept transposed":
        kept = kept.T
    if mistake == "kept as gates":
        kept = weights
    return out, kept


def forward_sorted(x, router_weight, experts, k, capacity):
    """Sort-and-gather with a one-hot queue: each expert runs once on a zero-padded buffer of capacity rows."""
    tokens, n_experts = x.shape[0], len(experts)
    gates, chosen = top_k_gating(x @ router_weight.T, k)  # noqa: F821
    one_hot = F.one_hot(einops.rearrange(chosen, "tokens k -> (k tokens)"), n_experts)
    place = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1)
    keep = place < capacity
    kept = einops.rearrange(keep, "(k tokens) -> tokens k", k=k)
    token = torch.arange(tokens).repeat(k)
    expert_of = chosen.T.reshape(-1)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        rows = (expert_of == e) & keep
        buffer = torch.zeros(capacity, x.shape[1], dtype=x.dtype)
        buffer = buffer.index_copy(0, place[rows], x[token[rows]])
        y = expert(buffer)[place[rows]]
        out = out.index_add(0, token[rows], gates.T.reshape(-1)[rows, None] * y)
    return out, kept


def forward_in_place(x, router_weight, experts, k, capacity):
    x -= 0  # harmless, but in place: then the "normalised" input
    x /= x.norm(dim=-1, keepdim=True)
    return forward(x, router_weight, experts, k, capacity)


def notebook_solution():
    from tfedu.course import nbtools
    from pathlib import Path

    nb = nbtools.read(Path(__file__).resolve().parents[1] / "notebooks" / "12_moe_and_scaling.ipynb")
    source = next(c.source for c in nb.cells if (nbtools.nbgrader_meta(c) or {}).get("grade_id") == "ex_moe_forward")
    namespace = {"torch": torch, "F": F, "einops": einops}
    exec(source, namespace)
    return namespace["moe_forward"]


def with_globals(fn, **names):
    """``fn`` with its own globals (this module's plus ``names``): the check binds top_k_gating in them."""
    import types

    return types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__)


def learner(fn):
    """``fn`` as in a learner's notebook, which defines top_k_gating itself (the check puts its stand-in in place)."""
    return with_globals(fn, top_k_gating=top_k_gating_by_hand)


def learner_with_mistake(mistake):
    """A learner's moe_forward with one known ``mistake`` ("" for none)."""
    body = learner(forward)

    def moe_forward(x, router_weight, experts, k, capacity):
        return body(x, router_weight, experts, k, capacity, mistake)

    return moe_forward


RIGHT_FORWARD = {"python loop": lambda: learner_with_mistake(""), "sorted buffer": lambda: learner(forward_sorted),
                 "notebook": notebook_solution}

FORWARD_MISTAKES = {  # name: a phrase its hint must contain
    "no capacity": "nothing was dropped", "capacity + 1": "one assignment more than their capacity",
    "capacity - 1": "one assignment fewer than their capacity", "one counter": "over all the experts together",
    "token order": "take each token's k choices together", "gate priority": "batch prioritised routing",
    "latest first": "kept the last tokens", "dropped is x": "got its input x as its output",
    "residual": "x plus the experts' weighted sum", "no gates": "went in with weight 1",
    "gates twice": "multiplied by its gate twice", "renormalised after dropping": "renormalised",
    "not renormalised": "raw top-k probabilities", "first choice only": "only each token's first choice ran",
    "all tokens": "more than its capacity", "detached gates": "no gradient reaches router_weight",
    "kept inverted": "True where an assignment was dropped", "kept transposed": "your kept is of shape",
    "kept as gates": "return a bool tensor",
}


@pytest.mark.parametrize("name", RIGHT_FORWARD)
def test_moe_forward_passes_right_answers(name, capsys):
    nb12.check_moe_forward(RIGHT_FORWARD[name]())
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", FORWARD_MISTAKES)
def test_moe_forward_names_each_mistake(name):
    message = failure_of(nb12.check_moe_forward, learner_with_mistake(name))
    assert FORWARD_MISTAKES[name] in message, message


def test_moe_forward_stands_in_for_a_wrong_top_k_gating_and_puts_it_back():
    wrong = lambda router_logits, k: (torch.ones(router_logits.shape[0], k), router_logits.topk(k, dim=-1).indices)
    fn = learner(forward_sorted)
    fn.__globals__["top_k_gating"] = wrong
    nb12.check_moe_forward(fn)  # a wrong 12.1 costs only 12.1
    assert fn.__globals__["top_k_gating"] is wrong
    del fn.__globals__["top_k_gating"]
    nb12.check_moe_forward(fn)  # 12.1 not done at all: the stand-in serves too
    assert "top_k_gating" not in fn.__globals__


def test_moe_forward_refuses_tfedu_moe_in_place_changes_and_says_when_not_done():
    assert "uses tfedu.moe" in failure_of(nb12.check_moe_forward, nb12.reference_moe_forward)
    hidden = {"tfedu": tfedu, "torch": torch}
    exec("def through_package(x, router_weight, experts, k, capacity):\n"
         "    gates, chosen = tfedu.moe.top_k_gating(x @ router_weight.T, k)\n"
         "    return x, chosen\n", hidden)
    assert "tfedu.moe.top_k_gating" in failure_of(nb12.check_moe_forward, hidden["through_package"])
    assert "changed the caller's `x` in place" in failure_of(nb12.check_moe_forward, learner(forward_in_place))
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb12.check_moe_forward(not_done)
    with pytest.raises(ExerciseNotDone, match="returned None"):
        nb12.check_moe_forward(lambda x, router_weight, experts, k, capacity: None)


def test_the_forward_cases_drop_tokens_and_tell_every_mistake_apart():
    cases = [nb12.moe_case(*spec) for spec in nb12.MF_CASES]
    assert all(nb12._clear_routing(case) for case in cases)
    assert nb12.mistakes_apart(cases)
    for case in cases[:3]:  # the capacity bites: some assignments are dropped
        _, kept = nb12.moe_variant(case.x, case.router_weight, case.experts(), case.k, case.capacity)
        assert not kept.all()
        torch.testing.assert_close(nb12.moe_variant(case.x, case.router_weight, case.experts(), case.k,
                                                    case.capacity)[0], nb12.layer_output(case), rtol=1e-5, atol=1e-6)


def test_the_reference_forward_matches_the_layer_with_both_dispatches():
    torch.manual_seed(0)
    for dispatch in ("loop", "sorted"):
        layer = tfedu.moe.MoE(8, 16, 4, top_k=2, capacity_factor=0.75, dispatch=dispatch).double().train()
        x = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        experts = [lambda rows, e=e: layer.expert(e, rows) for e in range(4)]
        out, kept = nb12.reference_moe_forward(x, layer.router.weight, experts, 2, layer.capacity(20))
        torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)
        assert int((~kept).sum()) == layer.stats.dropped > 0


MF_PROBE = nb12.PROBES["check_moe_forward"]
PROBE_FORWARD_MISTAKES = {"in place": "changed its input in place"}


@pytest.mark.parametrize("name", RIGHT_FORWARD)
def test_forward_probe_passes_right_answers(name):
    fn = RIGHT_FORWARD[name]()
    namespace = fn.__globals__  # as the notebook's globals: the grader binds the stand-in for 12.1 there
    namespace["moe_forward"] = fn
    for seed in range(4):
        assert verdict(MF_PROBE, namespace, seed, standins=True) is None, seed


@pytest.mark.parametrize("name", FORWARD_MISTAKES)
def test_forward_probe_names_each_mistake(name):
    for seed in range(2):
        feedback = verdict(MF_PROBE, {"moe_forward": learner_with_mistake(name)}, seed)
        assert feedback is not None and FORWARD_MISTAKES[name] in feedback, (seed, feedback)


def test_forward_probe_stands_in_for_top_k_gating_and_names_in_place_changes():
    fn = learner(forward_sorted)
    wrong = lambda router_logits, k: (torch.ones(router_logits.shape[0], k), router_logits.topk(k, dim=-1).indices)
    fn.__globals__["top_k_gating"] = wrong
    fn.__globals__["moe_forward"] = fn
    assert verdict(MF_PROBE, fn.__globals__, 0, standins=True) is None  # the grader's stand-in for exercise 12.1
    assert fn.__globals__["top_k_gating"] is wrong
    feedback = verdict(MF_PROBE, {"moe_forward": learner(forward_in_place)}, 0)
    assert feedback is not None and "changed its input in place" in feedback, feedback
    outputs, expected = run_probe(MF_PROBE, {"moe_forward": fn}, 1)
    assert is_plain_data(outputs) and is_plain_data(expected)


# ----------------------------------------------------------------------------- 12.4 isoflop_fit


def isoflop_learner(curves, budgets, tokens_per_step, mistake=""):
    """A learner's isoflop_fit, written by hand, right or with one ``mistake``."""
    budgets = np.asarray(budgets, dtype=float)
    n_opt, loss_min = [], []
    for C in budgets:
        points = []
        for N, steps, losses in curves:
            tokens = np.asarray(steps) * (1 if mistake == "steps" else tokens_per_step)
            D = C / ((2 if mistake == "2ND" else 6) * N)
            if mistake == "no skip" or tokens[0] <= D <= tokens[-1]:
                points.append((N, np.interp(D, tokens, losses)))
        if mistake == "best of two" and len(points) == 2:  # two models: take the better one
            better = min(points, key=lambda point: point[1])
            n_opt.append(better[0])
            loss_min.append(better[1])
            continue
        if len(points) < (2 if mistake in ("two points", "two kept") else 3):
            n_opt.append(np.nan)
            loss_min.append(np.nan)
            continue
        sizes, losses = np.array(points, dtype=float).T
        x = sizes if mistake == "parabola in N" else np.log(sizes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # np.polyfit's RankWarning for two points
            c2, c1, c0 = np.polyfit(x, losses, 2)
        if c2 <= 0 and mistake not in ("downward", "two points"):
            n_opt.append(np.nan)
            loss_min.append(np.nan)
        elif mistake == "argmin":
            n_opt.append(sizes[losses.argmin()])
            loss_min.append(losses.min())
        elif mistake == "in range" and not x.min() <= -c1 / (2 * c2) <= x.max():  # an extrapolated vertex dropped
            n_opt.append(np.nan)
            loss_min.append(np.nan)
        else:
            vertex = -c1 / (2 * c2)
            n_opt.append(vertex if mistake == "parabola in N" else np.exp(vertex))
            loss_min.append(c0 - c1**2 / (4 * c2))
    n_opt, loss_min = np.array(n_opt), np.array(loss_min)
    found = np.isfinite(n_opt) & (n_opt > 0)
    if found.sum() < 2:
        raise ValueError("no line through fewer than two points")
    x = {"log10 C": np.log10, "log10 b": np.log10}.get(mistake, np.log)(budgets[found])
    y = {"log10 N": np.log10, "log10 b": np.log10}.get(mistake, np.log)(n_opt[found])
    a, b = np.polyfit(y, x, 1) if mistake == "inverted" else np.polyfit(x, y, 1)
    return n_opt, loss_min, a, b


def isoflop_lstsq(curves, budgets, tokens_per_step):
    """Right another way: a least-squares solve for the parabolas and the line, lists for the results."""
    n_opt, loss_min = [], []
    for C in budgets:
        rows = [(math.log(N), float(np.interp(C / 6 / N, s * tokens_per_step, l))) for N, s, l in curves
                if s[0] * tokens_per_step <= C / 6 / N <= s[-1] * tokens_per_step]
        vertex = (math.nan, math.nan)
        if len(rows) >= 3:
            x, y = np.array(rows).T
            (c0, c1, c2), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x, x**2], axis=1), y, rcond=None)
            if c2 > 0:
                vertex = (math.exp(-c1 / (2 * c2)), c0 - c1 * c1 / (4 * c2))
        n_opt.append(vertex[0])
        loss_min.append(vertex[1])
    keep = [i for i, n in enumerate(n_opt) if not math.isnan(n)]
    if len(keep) < 2:
        raise ValueError("fewer than two minima")
    X = np.stack([np.log([budgets[i] for i in keep]), np.ones(len(keep))], axis=1)
    (a, b), *_ = np.linalg.lstsq(X, np.log([n_opt[i] for i in keep]), rcond=None)
    return np.array(n_opt), np.array(loss_min), a, b


def isoflop_polynomial(curves, budgets, tokens_per_step):
    """Right a third way: numpy.polynomial's Polynomial.fit, curves read in log-steps order, torch scalars out."""
    n_opt, loss_min = np.full(len(budgets), np.nan), np.full(len(budgets), np.nan)
    for i, C in enumerate(budgets):
        pick = [(N, s, l) for N, s, l in curves if s[0] <= C / (6 * N * tokens_per_step) <= s[-1]]
        if len(pick) < 3:
            continue
        x = np.log([N for N, _, _ in pick])
        y = [np.interp(C / (6 * N * tokens_per_step), s, l) for N, s, l in pick]
        c0, c1, c2 = np.polynomial.Polynomial.fit(x, y, 2).convert().coef
        if c2 > 0:
            n_opt[i], loss_min[i] = np.exp(-c1 / (2 * c2)), c0 - c1**2 / (4 * c2)
    ok = ~np.isnan(n_opt)
    if ok.sum() < 2:
        raise ValueError("a line needs two minima")
    b, a = np.polynomial.Polynomial.fit(np.log(budgets[ok]), np.log(n_opt[ok]), 1).convert().coef
    return n_opt, loss_min, torch.tensor(a), torch.tensor(b)


def isoflop_continue(curves, budgets, tokens_per_step, fewest=3):
    """The learner's shape of it, skipping a budget with `continue` below ``fewest`` models (2: the slip that keeps
    budgets of two models, where np.polyfit only warns)."""
    budgets = np.asarray(budgets, dtype=float)
    n_opt, loss_min = np.full(len(budgets), np.nan), np.full(len(budgets), np.nan)
    for i, C in enumerate(budgets):
        ns, ls = [], []
        for N, steps, curve in curves:
            tokens = steps * tokens_per_step
            D = C / (6 * N)
            if tokens[0] <= D <= tokens[-1]:
                ns.append(N)
                ls.append(np.interp(D, tokens, curve))
        if len(ns) < fewest:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # np.polyfit's RankWarning for two points
            c2, c1, c0 = np.polyfit(np.log(ns), ls, 2)
        if c2 > 0:
            n_opt[i] = np.exp(-c1 / (2 * c2))
            loss_min[i] = c0 - c1**2 / (4 * c2)
    ok = np.isfinite(n_opt)
    if ok.sum() < 2:
        raise ValueError("fewer than two minima")
    a, b = np.polyfit(np.log(budgets[ok]), np.log(n_opt[ok]), 1)
    return n_opt, loss_min, a, b


RIGHT_ISOFLOP = {"polyfit": isoflop_learner, "lstsq": isoflop_lstsq, "Polynomial.fit": isoflop_polynomial,
                 "continue below three": isoflop_continue}
ISOFLOP_MISTAKES = {
    "2ND": "C = 2ND", "steps": "against the step counts themselves", "parabola in N": "loss against N itself",
    "argmin": "best sampled model", "no skip": "whose curve does not reach", "two points": "a parabola needs three",
    "two kept": "a parabola needs three", "best of two": "a parabola needs three",
    "in range": "lies outside the sizes that reach that budget", "continue below two": "a parabola needs three",
    "downward": "opens downward", "inverted": "slope of ln C against ln N_opt", "log10 C": "one axis in log10",
    "log10 N": "one axis in log10", "log10 b": "off by a factor ln 10",
}


def isoflop_with(mistake):
    if mistake == "continue below two":
        return lambda curves, budgets, tokens_per_step: isoflop_continue(curves, budgets, tokens_per_step, fewest=2)
    return lambda curves, budgets, tokens_per_step: isoflop_learner(curves, budgets, tokens_per_step, mistake)


@pytest.mark.parametrize("name", RIGHT_ISOFLOP)
def test_isoflop_fit_passes_right_answers(name, capsys):
    nb12.check_isoflop_fit(RIGHT_ISOFLOP[name])
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", ISOFLOP_MISTAKES)
def test_isoflop_fit_names_each_mistake(name):
    message = failure_of(nb12.check_isoflop_fit, isoflop_with(name))
    assert ISOFLOP_MISTAKES[name] in message, message


def test_isoflop_fit_refuses_the_reference_in_place_changes_and_says_when_not_done():
    assert "uses the course's own" in failure_of(nb12.check_isoflop_fit, nb12.reference_isoflop_fit)

    def in_place(curves, budgets, tokens_per_step):
        budgets *= 1.0 + 1e-9
        return isoflop_learner(curves, budgets, tokens_per_step)

    assert "changed its inputs in place" in failure_of(nb12.check_isoflop_fit, in_place)

    def no_raise(curves, budgets, tokens_per_step):  # right, but NaN and a = b = 0 where no line can be fitted
        try:
            return isoflop_learner(curves, budgets, tokens_per_step)
        except ValueError:
            return np.full(len(budgets), np.nan), np.full(len(budgets), np.nan), 0.0, 0.0

    assert "raise a ValueError" in failure_of(nb12.check_isoflop_fit, no_raise)
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb12.check_isoflop_fit(not_done)
    with pytest.raises(ExerciseNotDone, match="returned None"):
        nb12.check_isoflop_fit(lambda curves, budgets, tokens_per_step: None)


def test_the_isoflop_cases_tell_the_mistakes_apart_and_recover_the_true_exponent():
    cases = nb12.iso_cases()
    assert all(nb12.isoflop_apart(case) for case in cases[:3])
    assert all(None in case.upward() for case in cases[:3])  # a budget of two models in each
    assert False in cases[2].upward()  # the loss spike turns one profile upside down
    assert cases[0].two_kept() and cases[1].extrapolated()  # a two-model parabola opening upward; a vertex outside
    for case in cases[:2]:  # keeping the two-model budgets changes n_opt there, and a
        if case.two_kept():
            wrong, want = (nb12.isoflop_variant(case.curves, case.budgets, case.tokens_per_step, mistake)
                           for mistake in ("two kept", ""))
            assert np.isfinite(wrong[0][case.two_kept()]).all() and np.isnan(want[0][case.two_kept()]).all()
            assert not math.isclose(wrong[2], want[2], rel_tol=1e-6)
    for seed in range(4):  # without noise the fitted exponent is the law's beta / (alpha + beta)
        case = nb12.iso_case(np.random.default_rng(seed), noise=0.0)
        alpha, beta = np.random.default_rng(seed).uniform(0.25, 0.45, 2)
        _, _, a, _ = nb12.reference_isoflop_fit(case.curves, case.budgets, case.tokens_per_step)
        assert abs(a - beta / (alpha + beta)) < 0.03, (seed, a, beta / (alpha + beta))


ISO_PROBE = nb12.PROBES["check_isoflop_fit"]


@pytest.mark.parametrize("name", RIGHT_ISOFLOP)
def test_isoflop_probe_passes_right_answers(name):
    for seed in range(4):
        assert verdict(ISO_PROBE, {"isoflop_fit": RIGHT_ISOFLOP[name], "np": np}, seed) is None, seed


@pytest.mark.parametrize("name", ISOFLOP_MISTAKES)
def test_isoflop_probe_names_each_mistake(name):
    for seed in range(2):
        feedback = verdict(ISO_PROBE, {"isoflop_fit": isoflop_with(name), "np": np}, seed)
        assert feedback is not None and ISOFLOP_MISTAKES[name] in feedback, (seed, feedback)


def test_isoflop_probe_inputs_keep_two_model_budgets_and_extrapolated_vertices():
    for seed in range(4):
        cases = [nb12._iso_case_from(c) for c in ISO_PROBE.make_inputs(np.random.default_rng(seed))["cases"]]
        assert all(case.two_kept() for case in cases) and cases[-1].extrapolated(), seed


def test_isoflop_slices_are_the_references_slices():
    """The notebook's plot draws nb12.isoflop_slices: its parabolas' vertices are the reference's minima."""
    case = nb12.iso_cases()[1]
    n_opt, loss_min, _, _ = nb12.reference_isoflop_fit(case.curves, case.budgets, case.tokens_per_step)
    slices = nb12.isoflop_slices(case.curves, case.budgets, case.tokens_per_step)
    assert [len(sizes) for sizes, _, _ in slices] == case.counts()
    for (sizes, losses, parabola), n, l in zip(slices, n_opt, loss_min):
        assert len(sizes) == len(losses)
        if parabola is None:
            assert len(sizes) < 3 and math.isnan(n)
        elif parabola[0] > 0:
            assert math.isclose(math.exp(-parabola[1] / (2 * parabola[0])), n, rel_tol=1e-12)
            assert math.isclose(np.polyval(parabola, math.log(n)), l, rel_tol=1e-9)


def test_isoflop_probe_inputs_are_plain_data():
    outputs, expected = run_probe(ISO_PROBE, {"isoflop_fit": isoflop_learner, "np": np}, 0)
    assert is_plain_data(outputs) and is_plain_data(expected)

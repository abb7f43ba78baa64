"""Checkers and probes of notebook 17: each passes right answers and names realistic mistakes."""

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tfedu import tuning as library
import checker_helpers as helpers
from checker_helpers import failure_of, not_done
from tfedu.checks import nb17_post_training as nb17
from tfedu.checks.core import ExerciseNotDone

pytestmark = pytest.mark.usefixtures("one_torch_thread")

names_everywhere = functools.partial(helpers.names_everywhere, nb17.PROBES)
passes_everywhere = functools.partial(helpers.passes_everywhere, nb17.PROBES)


# ----------------------------------------------------------------------------- 17.1 the SFT loss


def sft_loss(logits, ids, mask, mistake=""):
    """A learner's answer, right or with one ``mistake``."""
    if mistake == "softmax log":
        probs = torch.softmax(logits[:, :-1], dim=-1)
        picked = probs.gather(-1, ids[:, 1:, None])[..., 0].log()
        return -picked[mask[:, 1:]].mean()
    if mistake == "naive exp":
        e = logits[:, :-1].exp()
        picked = (e / e.sum(-1, keepdim=True)).gather(-1, ids[:, 1:, None])[..., 0].log()
        return -picked[mask[:, 1:]].mean()
    log_probs = F.log_softmax(logits, dim=-1)
    if mistake == "no shift":
        return -log_probs.gather(-1, ids[..., None])[..., 0][mask].mean()
    if mistake == "backward":
        return -log_probs[:, 1:].gather(-1, ids[:, :-1, None])[..., 0][mask[:, 1:]].mean()
    picked = log_probs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    target = mask[:, 1:]
    if mistake == "wrong way":
        return -picked[mask[:, :-1]].mean()
    if mistake == "every":
        return -picked.mean()
    if mistake == "zeroed mean":
        return -(picked * target.float()).mean()
    if mistake == "both masks":
        return -picked[mask[:, :-1] & mask[:, 1:]].mean()
    if mistake == "ids":
        return -picked[ids[:, 1:] != 0].mean()
    if mistake == "inverted":
        return -picked[~target].mean()
    if mistake == "per sequence":
        return (-(picked * target).sum(-1) / target.sum(-1)).mean()
    if mistake == "sum":
        return -picked[target].sum()
    if mistake == "sum per seq":
        return -(picked * target).sum() / ids.shape[0]
    if mistake == "item":
        return -picked[target].mean().item()
    if mistake == "detached":
        return -picked[target].mean().detach()
    if mistake == "per row":
        return -(picked * target).sum(-1) / target.sum(-1)
    return -picked[target].mean()


def sft_by_cross_entropy(logits, ids, mask):
    """Another right way: F.cross_entropy with -100 on the targets that do not count."""
    targets = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def sft_in_float64(logits, ids, mask):
    """Another right way: in float64 (the result is float64)."""
    return sft_loss(logits.double(), ids, mask)


SFT_MISTAKES = {
    "no shift": "the *next* token",
    "wrong way": "mask is not shifted with them",
    "every": "padding included",
    "zeroed mean": "still count in the denominator",
    "backward": "shifted the wrong way",
    "both masks": "whose input is an answer token too",
    "ids": "every real token",
    "inverted": "mask leaves out",
    "per sequence": "averaged over each sequence's answer tokens first",
    "sum": "summed the token losses",
    "sum per seq": "summed each answer's token losses",
    "softmax log": "log-softmax directly",
    "naive exp": "log-softmax directly",
    "item": "Python number",
    "detached": "no gradient flows back",
    "per row": "one number per sequence",
}


def test_sft_loss_passes_right_answers():
    for fn in (sft_loss, sft_by_cross_entropy, sft_in_float64):
        passes_everywhere(nb17.check_sft_loss, "check_sft_loss", "sft_loss", fn)


@pytest.mark.parametrize("mistake", SFT_MISTAKES)
def test_sft_loss_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb17.check_sft_loss, "check_sft_loss", "sft_loss",
                     lambda *args, m=mistake: sft_loss(*args, mistake=m), SFT_MISTAKES[mistake])


def test_sft_loss_check_refuses_the_library_and_waits_for_an_answer():
    assert "tfedu" in failure_of(nb17.check_sft_loss, lambda *a: library.sft_loss(*a))
    with pytest.raises(ExerciseNotDone):
        nb17.check_sft_loss(not_done)


def test_the_sft_cases_underflow_a_softmax_then_log():
    for _, case in nb17.sft_cases()[2:]:
        t = {k: torch.from_numpy(v) for k, v in case.items()}
        assert torch.isfinite(nb17.reference_sft_loss(t["logits"], t["ids"], t["mask"]))
        assert not torch.isfinite(sft_loss(t["logits"], t["ids"], t["mask"], mistake="softmax log"))


# ----------------------------------------------------------------------------- 17.2 the DPO loss


def dpo_loss(pc, pr, rc, rr, beta, mistake=""):
    margin = (pc - rc) - (pr - rr)
    if mistake == "no ref":
        margin = pc - pr
    elif mistake == "swapped":
        margin = (pr - rr) - (pc - rc)
    elif mistake == "ref added":
        margin = (pc + rc) - (pr + rr)
    elif mistake == "probs":
        margin = (pc.exp() - rc.exp()) - (pr.exp() - rr.exp())
    if mistake == "no beta":
        return -F.logsigmoid(margin).mean()
    if mistake == "beta outside":
        return -(beta * F.logsigmoid(margin)).mean()
    if mistake == "naive":
        return -torch.log(torch.sigmoid(beta * margin)).mean()
    if mistake == "log1p exp":
        return torch.log1p(torch.exp(-beta * margin)).mean()
    if mistake == "no minus":
        return F.logsigmoid(beta * margin).mean()
    if mistake == "beta chosen only":
        return -F.logsigmoid(beta * (pc - rc) - (pr - rr)).mean()
    if mistake == "beta rejected only":
        return -F.logsigmoid((pc - rc) - beta * (pr - rr)).mean()
    if mistake == "sum":
        return -F.logsigmoid(beta * margin).sum()
    if mistake == "per pair":
        return -F.logsigmoid(beta * margin)
    if mistake == "item":
        return -F.logsigmoid(beta * margin).mean().item()
    if mistake == "detached":
        return -F.logsigmoid(beta * margin.detach()).mean()
    return -F.logsigmoid(beta * margin).mean()


def dpo_by_softplus(pc, pr, rc, rr, beta):
    """Another right way: softplus(-x) = -log sigmoid(x)."""
    return F.softplus(-beta * ((pc - pr) - (rc - rr))).mean()


DPO_MISTAKES = {
    "no ref": "reference model's log-probabilities are missing",
    "swapped": "wrong way round",
    "ref added": "added, not subtracted",
    "probs": "used probabilities",
    "no beta": "beta is missing",
    "beta outside": "beta multiplies the log-sigmoid",
    "naive": "underflows to 0 and its log",
    "log1p exp": "overflows to inf just the same",
    "no minus": "your loss is negative",
    "beta chosen only": "beta scales one answer's log-ratio",
    "beta rejected only": "beta scales one answer's log-ratio",
    "sum": "summed the loss over the pairs",
    "per pair": "one loss per pair",
    "item": "Python number",
    "detached": "no gradient flows back",
}


def test_dpo_loss_passes_right_answers():
    for fn in (dpo_loss, dpo_by_softplus):
        passes_everywhere(nb17.check_dpo_loss, "check_dpo_loss", "dpo_loss", fn)


@pytest.mark.parametrize("mistake", DPO_MISTAKES)
def test_dpo_loss_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb17.check_dpo_loss, "check_dpo_loss", "dpo_loss",
                     lambda *args, m=mistake: dpo_loss(*args, mistake=m), DPO_MISTAKES[mistake])


def test_dpo_loss_check_refuses_the_library():
    assert "tfedu" in failure_of(nb17.check_dpo_loss, lambda *a: library.dpo_loss(*a))
    with pytest.raises(ExerciseNotDone):
        nb17.check_dpo_loss(not_done)


# ----------------------------------------------------------------------------- 17.3 group-relative advantages


def group_advantages(rewards, mistake=""):
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    eps = 1e-4
    if mistake == "batch":
        return (rewards - rewards.mean()) / (rewards.std() + eps)
    if mistake == "axis":
        return (rewards - rewards.mean(0, keepdim=True)) / (rewards.std(0, keepdim=True) + eps)
    if mistake == "no std":
        return rewards - mean
    if mistake == "biased":
        return (rewards - mean) / (rewards.std(1, keepdim=True, unbiased=False) + eps)
    if mistake == "no eps":
        return (rewards - mean) / std
    if mistake == "eps inside":
        return (rewards - mean) / torch.sqrt(rewards.var(1, keepdim=True) + eps)
    if mistake == "eps 1e-8":
        return (rewards - mean) / (std + 1e-8)
    if mistake == "eps 1e-6":
        return (rewards - mean) / (std + 1e-6)
    if mistake == "max":
        return rewards - rewards.amax(1, keepdim=True)
    if mistake == "floor":
        return (rewards - mean) / std.clamp_min(1e-4)
    if mistake == "nan patched":
        return torch.nan_to_num((rewards - mean) / std)
    if mistake == "where std 0":
        return torch.where(std == 0, torch.zeros_like(rewards), (rewards - mean) / std)
    if mistake == "flat":
        return ((rewards - mean) / (std + eps)).reshape(-1)
    if mistake == "variance":
        return (rewards - mean) / (rewards.var(1, keepdim=True) + eps)
    return (rewards - mean) / (std + eps)


def adv_by_hand(rewards):
    """Another right way: the unbiased std written out, in float64."""
    r = rewards.double()
    centred = r - r.sum(1, keepdim=True) / r.shape[1]
    std = (centred.pow(2).sum(1, keepdim=True) / (r.shape[1] - 1)).sqrt()
    return centred / (std + 1e-4)


ADV_MISTAKES = {
    "batch": "whole batch",
    "axis": "over the prompts",
    "no std": "Dr. GRPO",
    "biased": "biased std",
    "no eps": "all equal",
    "eps inside": "under the square root",
    "eps 1e-8": "eps = 1e-08",
    "eps 1e-6": "eps = 1e-06",
    "max": "best reward",
    "floor": "std floored at",
    "nan patched": "patching NaNs",
    "where std 0": "patching NaNs",
    "flat": "keep the rewards' shape",
    "variance": "divided by the variance",
}


def test_group_advantages_passes_right_answers():
    for fn in (group_advantages, adv_by_hand):
        passes_everywhere(nb17.check_group_advantages, "check_group_advantages", "group_advantages", fn)


@pytest.mark.parametrize("mistake", ADV_MISTAKES)
def test_group_advantages_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb17.check_group_advantages, "check_group_advantages", "group_advantages",
                     lambda r, m=mistake: group_advantages(r, mistake=m), ADV_MISTAKES[mistake])


def test_group_advantages_refuses_the_library_and_cases_hold_constant_groups():
    assert "tfedu" in failure_of(nb17.check_group_advantages, lambda r: library.group_advantages(r))
    rewards = torch.from_numpy(nb17.adv_cases()[1][1])
    assert (rewards[1] == 1).all() and (rewards[2] == 0).all()
    assert (nb17.reference_group_advantages(rewards)[1:3] == 0).all()


# ----------------------------------------------------------------------------- 17.4 GRPO's clipped loss


def grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.04, mistake=""):
    ratio = torch.exp(logp - logp_old)
    if mistake == "quotient":
        ratio = logp / logp_old
    elif mistake == "difference":
        ratio = logp - logp_old
    elif mistake == "to ref":
        ratio = torch.exp(logp - logp_ref)
    elif mistake == "inverted":
        ratio = torch.exp(logp_old - logp)
    if mistake in ("hard-coded", "hard-coded eps"):
        clip_eps = 0.2
    if mistake in ("hard-coded", "hard-coded beta"):
        beta = 0.04
    A = advantages[:, None] if mistake != "broadcast" else advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * A
    surrogate = torch.minimum(ratio * A, clipped)
    if mistake == "max":
        surrogate = torch.maximum(ratio * A, clipped)
    elif mistake == "clipped only":
        surrogate = clipped
    elif mistake == "no clip":
        surrogate = ratio * A
    elif mistake == "clip adv":
        surrogate = torch.minimum(ratio * A, ratio * A.clamp(1 - clip_eps, 1 + clip_eps))
    elif mistake == "clip product":
        surrogate = torch.minimum(ratio * A, (ratio * A).clamp(1 - clip_eps, 1 + clip_eps))
    d = logp_ref - logp
    kl = torch.exp(d) - d - 1
    if mistake == "k1":
        kl = logp - logp_ref
    elif mistake == "k3 swapped":
        kl = torch.exp(-d) + d - 1
    elif mistake == "k2":
        kl = d ** 2 / 2
    per_token = -surrogate + beta * kl
    if mistake == "no beta":
        per_token = -surrogate + kl
    elif mistake == "kl subtracted":
        per_token = -surrogate - beta * kl
    elif mistake == "sign":
        per_token = surrogate - beta * kl
    elif mistake == "no kl":
        per_token = -surrogate
    m = mask.float()
    if mistake == "mask ignored":
        return per_token.mean()
    if mistake == "zeroed":
        return (per_token * m).mean()
    if mistake == "token mean":
        return (per_token * m).sum() / m.sum()
    if mistake == "sum":
        return (per_token * m).sum(-1).mean()
    if mistake == "padding":
        return (per_token.sum(-1) / m.sum(-1)).mean()
    if mistake == "per row":
        return (per_token * m).sum(-1) / m.sum(-1)
    if mistake == "detached":
        return ((per_token * m).sum(-1) / m.sum(-1)).mean().detach()
    if mistake == "item":
        return ((per_token * m).sum(-1) / m.sum(-1)).mean().item()
    return ((per_token * m).sum(-1) / m.sum(-1)).mean()


def grpo_with_where(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.04):
    """Another right way: masked_select per row, in a loop, and the clip by where."""
    ratio = (logp - logp_old).exp()
    A = advantages.unsqueeze(-1).expand_as(ratio)
    clipped = torch.where(ratio > 1 + clip_eps, 1 + clip_eps, torch.where(ratio < 1 - clip_eps, 1 - clip_eps, ratio))
    per_token = -torch.min(ratio * A, clipped * A) + beta * ((logp_ref - logp).exp() - (logp_ref - logp) - 1)
    return torch.stack([row[row_mask].mean() for row, row_mask in zip(per_token, mask)]).mean()


GRPO_MISTAKES = {
    "quotient": "divides the log-probabilities",
    "difference": "not its exponential",
    "to ref": "taken to the reference model",
    "broadcast": "spread along the positions",
    "max": "the larger of",
    "clipped only": "clipped term alone",
    "no clip": "not clipped",
    "clip adv": "clipped the advantages",
    "clip product": "clipped the product",
    "inverted": "upside down",
    "hard-coded": "clip_eps = 0.2 and beta = 0.04 whatever",
    "hard-coded eps": "clip_eps = 0.2 whatever",
    "hard-coded beta": "beta = 0.04 whatever",
    "padding": "hold arbitrary numbers",
    "k1": "k1 estimator",
    "k3 swapped": "two models swapped",
    "k2": "k2 estimator",
    "no beta": "not multiplied by beta",
    "kl subtracted": "KL term is subtracted",
    "sign": "wrong sign",
    "no kl": "KL term to the reference is missing",
    "mask ignored": "padding and prompt included",
    "zeroed": "divided by every position",
    "token mean": "DAPO",
    "sum": "summed each answer's token losses",
    "per row": "one number per answer",
    "detached": "no gradient flows back",
    "item": "Python number",
}


def test_grpo_loss_passes_right_answers():
    for fn in (grpo_loss, grpo_with_where):
        passes_everywhere(nb17.check_grpo_loss, "check_grpo_loss", "grpo_loss", fn)


@pytest.mark.parametrize("mistake", GRPO_MISTAKES)
def test_grpo_loss_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb17.check_grpo_loss, "check_grpo_loss", "grpo_loss",
                     lambda *args, m=mistake, **kw: grpo_loss(*args, mistake=m, **kw), GRPO_MISTAKES[mistake])


def test_grpo_cases_clip_both_ways_with_both_signs():
    for _, case in nb17.grpo_cases():
        ratio = np.exp(case["logp"] - case["logp_old"])[case["mask"]]
        assert (ratio > 1.2).any() and (ratio < 0.8).any()
        assert (case["advantages"] > 0).any() and (case["advantages"] < 0).any()
        assert len(set(case["mask"].sum(1).tolist())) > 1  # answers of different lengths
        assert (~case["mask"]).any()  # padding
    assert "tfedu" in failure_of(nb17.check_grpo_loss, lambda *a, **k: library.grpo_loss(*a, **k))


# ----------------------------------------------------------------------------- 17.5 pass@k


def pass_at_k(n, c, k, mistake=""):
    if mistake == "plug-in":
        return 1.0 - (1.0 - c / n) ** k
    if mistake == "fraction":
        return c / n
    if mistake == "factorials":
        f = lambda x: float(math.factorial(x))  # noqa: E731
        return 1.0 - f(n - c) / (f(k) * f(n - c - k)) / (f(n) / (f(k) * f(n - k))) if n - c >= k else 1.0
    if mistake == "lgamma":
        lg = math.lgamma
        return 1.0 - math.exp(lg(n - c + 1) - lg(n - c - k + 1) - lg(n + 1) + lg(n - k + 1))
    if mistake == "edge zero" and n - c < k:
        return 0.0
    if mistake == "edge equal":
        return 1.0 if n - c <= k else 1.0 - math.comb(n - c, k) / math.comb(n, k)
    if mistake == "no one minus":
        return 1.0 if n - c < k else math.comb(n - c, k) / math.comb(n, k)
    if mistake == "no one minus product":
        return math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    if mistake == "comb c":
        return 1.0 - math.comb(c, k) / math.comb(n, k)
    if mistake == "int division":
        return 1 - math.comb(n - c, k) // math.comb(n, k)
    if mistake == "int division product":
        return 1.0 if n - c < k else 1.0 - math.prod(1 - k // i for i in range(n - c + 1, n + 1))
    lo, hi, num = n - c + 1, n + 1, k
    if mistake == "swapped":
        lo = n - k + 1
    elif mistake == "off by one":
        lo = n - c
    elif mistake == "one short":
        hi = n
    if n - c < k and mistake not in ("swapped",):
        return 1.0
    prod = 1.0
    for i in range(lo, hi):
        prod *= 1.0 - num / i
    return 1.0 - prod


def pass_at_k_comb(n, c, k):
    """Another right way: exact, with math.comb (Python's ints do not overflow)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_numpy(n, c, k):
    """Chen et al.'s own numpy form."""
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


PK_MISTAKES = {
    "plug-in": "plug-in estimate",
    "fraction": "that is pass@1",
    "factorials": "overflow floats",
    "lgamma": "should be exactly 1.0",
    "edge zero": "should be exactly 1.0",
    "swapped": "k and c are swapped",
    "off by one": "one index too many or too few",
    "one short": "one index too many or too few",
    "edge equal": "with exactly k wrong answers an all-wrong draw is still possible",
    "no one minus": "chance that all k drawn answers are wrong",
    "no one minus product": "chance that all k drawn answers are wrong",
    "comb c": "among the c right answers",
    "int division": "integer division",
    "int division product": "integer division",
}


def test_pass_at_k_passes_right_answers():
    for fn in (pass_at_k, pass_at_k_comb, pass_at_k_numpy):
        passes_everywhere(nb17.check_pass_at_k, "check_pass_at_k", "pass_at_k", fn)


@pytest.mark.parametrize("mistake", PK_MISTAKES)
def test_pass_at_k_check_and_probe_name_each_mistake(mistake):
    names_everywhere(nb17.check_pass_at_k, "check_pass_at_k", "pass_at_k",
                     lambda n, c, k, m=mistake: pass_at_k(n, c, k, mistake=m), PK_MISTAKES[mistake])


def test_pass_at_k_closed_form_and_library():
    assert pass_at_k_comb(4, 2, 2) == pytest.approx(5 / 6)
    assert nb17.reference_pass_at_k(16, 15, 1) == pytest.approx(0.9375) and nb17.reference_pass_at_k(6, 0, 6) == 0
    for seed in range(4):  # the probe holds n - c == k, with and without right answers
        cases = nb17.PROBES["check_pass_at_k"].make_inputs(np.random.default_rng(seed))["cases"]
        assert any(n - c == k and c > 0 for n, c, k in cases) and any(n - c == k and c == 0 for n, c, k in cases)
    assert "tfedu" in failure_of(nb17.check_pass_at_k, lambda n, c, k: library.pass_at_k(n, c, k))
    assert "return a Python float" in failure_of(nb17.check_pass_at_k, lambda n, c, k: torch.tensor(0.5))
    with pytest.raises(ExerciseNotDone):
        nb17.check_pass_at_k(not_done)


def test_every_exercise_has_hints_and_a_probe():
    assert sorted(nb17.HINTS) == sorted(p.exercise for p in nb17.PROBES.values())
    for hints in nb17.HINTS.values():
        assert "____" in hints.skeleton and hints.check in nb17.PROBES

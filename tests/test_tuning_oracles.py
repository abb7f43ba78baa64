"""tfedu.tuning's DPO and GRPO losses against trl's own code, on the same per-token log-probabilities (issue 44).

trl computes these losses only inside trainer methods (``DPOTrainer._compute_loss``, ``GRPOTrainer._compute_loss``)
that read a handful of attributes of the trainer and call its model. The tests call those methods unbound, with a
minimal fake trainer (only the attributes the method reads, each commented) and a fake model that hands back the
log-probabilities we chose, so trl's arithmetic runs untouched on exactly what tfedu gets. GRPO's advantages are
computed in ``_generate_and_score_completions``, which also samples and scores: there the test uses trl's formula
with trl's own ``nanstd``. Read against trl 1.16.0 (trl/trainer/dpo_trainer.py, grpo_trainer.py).
"""

import collections
import types

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is the test extra's oracle for tfedu.tuning's DPO and GRPO losses")
from trl.trainer.utils import nanstd  # noqa: E402

from tfedu.tuning import GROUP_STD_EPS, dpo_loss, group_advantages, grpo_loss  # noqa: E402


class FakeAccelerator:
    """What the loss methods ask of accelerate: the device, and collectives that are identities on one process."""

    device = torch.device("cpu")

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


def fake_trainer(**attributes):
    """A stand-in for ``self``: eval mode (``model.training`` False) so no gradient-accumulation scaling or
    token counting for training applies; ``_metrics`` is where the method logs, as in the trainers."""
    return types.SimpleNamespace(
        accelerator=FakeAccelerator(),
        model=types.SimpleNamespace(training=False),
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        aux_loss_enabled=False,  # no MoE router loss
        **attributes,
    )


# -- DPO --------------------------------------------------------------------------------------------------


def random_pairs(seed, batch=6, pos=9):
    """Per-token log-probs for ``2 * batch`` rows (chosen then rejected, trl's order), completion masks with a
    prompt of 2..4 tokens and right padding, and the reference's sequence log-probs."""
    g = torch.Generator().manual_seed(seed)
    per_token = -torch.rand(2 * batch, pos - 1, generator=g, dtype=torch.float64) * 4  # position t scores token t+1
    completion_mask = torch.zeros(2 * batch, pos, dtype=torch.long)
    for row in range(2 * batch):
        start = int(torch.randint(2, 5, (1,), generator=g))
        end = int(torch.randint(start + 1, pos + 1, (1,), generator=g))
        completion_mask[row, start:end] = 1
    ref = -torch.rand(2 * batch, generator=g, dtype=torch.float64) * 20
    return per_token, completion_mask, ref


def trl_dpo_loss(per_token, completion_mask, ref_logps, beta):
    batch = per_token.shape[0] // 2
    shift_mask = completion_mask[:, 1:]

    def model(**kwargs):
        # trl's fused LM head returns each label's log-prob, 0 where the label is -100 (not a completion token),
        # plus metrics (entropy, mean logits, top-1 hits) that do not enter the loss
        assert torch.equal(kwargs["labels"][:, 1:] != -100, shift_mask.bool())
        zeros = torch.zeros_like(per_token)
        return types.SimpleNamespace(log_probs=per_token * shift_mask, entropy=zeros, mean_logits=zeros,
                                     is_top1=zeros.bool())  # fmt: skip

    self = fake_trainer(
        beta=beta,
        loss_types=["sigmoid"], loss_weights=[1.0],  # the original DPO loss, alone
        f_divergence_type="reverse_kl",  # standard DPO: scores are the log-ratios themselves
        ld_alpha=None,  # no length-desensitisation: a sequence's log-prob is the plain sum
        precompute_ref_logps=True,  # the reference's log-probs come in the inputs, no reference model
        use_weighting=False,  # no WPO weights
        _total_train_tokens=0,  # the tokens-seen metric, logged in eval too
    )  # fmt: skip
    inputs = {
        "input_ids": torch.zeros_like(completion_mask),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_logps[:batch],
        "ref_rejected_logps": ref_logps[batch:],
    }
    return trl.DPOTrainer._compute_loss(self, model, inputs, return_outputs=False)


@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5, 2.0])
def test_dpo_loss_equals_trls_sigmoid_loss(beta):
    for seed in range(3):
        per_token, completion_mask, ref = random_pairs(seed)
        want = trl_dpo_loss(per_token, completion_mask, ref, beta)
        logps = (per_token * completion_mask[:, 1:]).sum(-1)  # what tfedu.tuning.answer_logprobs sums
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = ref.chunk(2)
        got = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta)
        assert want.dtype == got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# -- GRPO -------------------------------------------------------------------------------------------------


def trl_grpo_loss(logp, logp_old, logp_ref, advantages, mask, beta, eps=0.2):
    batch, pos = logp.shape

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        # the policy's per-token log-probs of the completion tokens, as the real method computes from logits
        assert logits_to_keep == pos
        return logp, torch.zeros_like(logp), None  # (log-probs, entropies, MoE aux loss)

    self = fake_trainer(
        beta=beta,
        loss_type="grpo",  # per-answer token mean, then the mean over answers (Shao et al. 2024)
        importance_sampling_level="token",  # PPO's per-token ratio (not GSPO's sequence ratio)
        epsilon_low=eps, epsilon_high=eps,  # symmetric clip 1 +- eps
        args=types.SimpleNamespace(delta=None,  # no two-sided clip of the ratio
                                   use_bias_correction_kl=False),  # the plain k3 KL, not weighted by the ratio
        top_entropy_quantile=1.0,  # every token trains, not only high-entropy ones
        off_policy_mask_threshold=None,  # no off-policy sequence masking
        use_vllm=False,  # no importance correction for a separate sampler
        _entropy_bonus_enabled=False,  # no entropy bonus
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies,
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(batch, 3, dtype=torch.long), "prompt_mask": torch.ones(batch, 3, dtype=torch.long),
        "completion_ids": torch.zeros(batch, pos, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": advantages, "old_per_token_logps": logp_old, "ref_per_token_logps": logp_ref,
    }  # fmt: skip
    return trl.GRPOTrainer._compute_loss(self, None, inputs)


@pytest.mark.parametrize("beta", [0.0, 0.04, 1.0])
@pytest.mark.parametrize("eps", [0.2, 0.1])
def test_grpo_loss_equals_trls_grpo_loss(beta, eps):
    g = torch.Generator().manual_seed(7)
    batch, pos = 6, 8
    logp = -torch.rand(batch, pos, generator=g, dtype=torch.float64) * 3
    logp_old = logp + torch.randn(batch, pos, generator=g, dtype=torch.float64) * 0.4  # some ratios get clipped
    logp_ref = logp + torch.randn(batch, pos, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(batch, generator=g, dtype=torch.float64)
    lengths = torch.tensor([8, 5, 1, 3, 7, 0])  # right padding; the last answer is all padding
    mask = torch.arange(pos)[None] < lengths[:, None]
    ratio = (logp - logp_old).exp()
    assert ((ratio > 1 + eps) & mask).any() and ((ratio < 1 - eps) & mask).any()
    want = trl_grpo_loss(logp, logp_old, logp_ref, advantages, mask, beta, eps)
    got = grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=eps, beta=beta)
    assert want.dtype == got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # and the same gradient with respect to the policy's log-probs
    logp_a, logp_b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    grpo_loss(logp_a, logp_old, logp_ref, advantages, mask, clip_eps=eps, beta=beta).backward()
    trl_grpo_loss(logp_b, logp_old, logp_ref, advantages, mask, beta, eps).backward()
    torch.testing.assert_close(logp_a.grad, logp_b.grad, rtol=1e-9, atol=1e-12)


def test_group_advantages_equal_trls_formula():
    """trl's GRPOTrainer._generate_and_score_completions, scale_rewards="group" (its default): rewards minus the
    group mean, over trl's nanstd of the group (Bessel-corrected) plus 1e-4."""
    g = torch.Generator().manual_seed(8)
    rewards = torch.cat([torch.randint(0, 2, (4, 6), generator=g).float(), torch.rand(3, 6, generator=g) * 5])
    n_generations = rewards.shape[1]
    flat = rewards.reshape(-1)  # trl keeps one flat vector, the group's answers next to each other
    mean = torch.nanmean(flat.view(-1, n_generations), dim=1).repeat_interleave(n_generations)
    std = nanstd(flat.view(-1, n_generations), dim=1).repeat_interleave(n_generations)
    want = ((flat - mean) / (std + 1e-4)).view(-1, n_generations)
    assert GROUP_STD_EPS == 1e-4
    torch.testing.assert_close(group_advantages(rewards), want, rtol=1e-6, atol=1e-6)

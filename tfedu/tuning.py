"""After pretraining: instruction tuning (SFT), preference tuning (DPO) and RL with verifiable rewards (GRPO).

Built by hand in notebooks/17_post_training.ipynb (issue 44). The data and the chat template are in
``tfedu.post_training``; this module holds the objectives and the loops that use them on a course GPT:

* **SFT** (Ouyang et al. 2022): next-token cross-entropy on the answer tokens only (``sft_loss``).
* **DPO** (Rafailov et al. 2023, eq. 7): ``-log sigmoid(beta * ((log pi(y_w|x) - log ref(y_w|x))
  - (log pi(y_l|x) - log ref(y_l|x))))`` on pairs of a better and a worse answer (``dpo_loss``), the
  reference model frozen. Equal to trl's ``DPOTrainer`` sigmoid loss (tests/test_tuning_oracles.py).
* **GRPO** (Shao et al. 2024, "DeepSeekMath", eq. 3): a group of answers per prompt, rewards from the
  verifier, advantages standardised within the group (``group_advantages``), PPO's clipped ratio per
  token with the k3 estimate of KL to the reference (``grpo_loss``); equal to trl's ``GRPOTrainer``
  with ``loss_type="grpo"``.
* **Evaluation**: greedy task accuracy; pass@k with Chen et al. (2021)'s unbiased estimator
  (``pass_at_k``); multiple-choice scoring by log-likelihood, as evaluation harnesses do
  (``choice_logprobs``).

Every loop takes the loss it uses as an argument, so a notebook can run the learner's own.

>>> round(pass_at_k(n=10, c=3, k=1), 6)
0.3
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tfedu.generate import generate, pad_prompts
from tfedu.model import GPT, IGNORE_INDEX, next_token_loss
from tfedu.post_training import END_OF_TURN, Example, answer_mask, render_ids, verify
from tfedu.tokenizer import Tokenizer

# ---------------------------------------------------------------------------------------------------------
# The model and its batches
# ---------------------------------------------------------------------------------------------------------


def grow_vocab(model: GPT, n_new: int) -> GPT:
    """A copy of ``model`` whose ``d_vocab`` is ``n_new`` larger, for new special tokens at the end.

    The old rows of ``W_E`` (and columns of ``W_U``) are copied unchanged, so every old token means what
    it meant; each new row starts at the mean of the old rows, a neutral point the model has seen
    nothing special about (Hewitt 2021, "Initializing new word embeddings"). Dropout is set to 0: the
    fine-tuning runs here are short and repeat exactly without it.

    >>> from tfedu.config import preset
    >>> grow_vocab(GPT(preset("tiny")), 4).cfg.d_vocab - preset("tiny").d_vocab
    4
    """
    if not isinstance(model, GPT):
        raise TypeError(f"grow_vocab takes a tfedu GPT, got {type(model).__name__}")
    if not isinstance(n_new, int) or n_new < 0:
        raise ValueError(f"n_new must be a non-negative int, got {n_new!r}")
    cfg = dataclasses.replace(model.cfg, d_vocab=model.cfg.d_vocab + n_new, dropout=0.0)
    grown = GPT(cfg)
    state = model.state_dict()
    W_E = state["embed.weight"]  # d_vocab d_model
    state["embed.weight"] = torch.cat([W_E, W_E.mean(0, keepdim=True).expand(n_new, -1)])
    W_U = state["unembed.weight"]  # d_vocab d_model (a Linear's weight)
    state["unembed.weight"] = (state["embed.weight"] if cfg.tied_embeddings
                               else torch.cat([W_U, W_U.mean(0, keepdim=True).expand(n_new, -1)]))
    grown.load_state_dict(state)
    return grown.train(model.training)


def pack(rows: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]], pad_id: int = 0
         ) -> tuple[Int[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
    """Token rows of different lengths as one right-padded batch ``(ids, mask)``; padding is masked out.

    Right padding is harmless to a causal model: every real token comes before the padding, so no real
    token attends to it, and the mask keeps it out of every loss.

    >>> ids, mask = pack([[5, 6, 7], [8]], [[False, True, True], [True]])
    >>> ids.tolist(), mask.tolist()
    ([[5, 6, 7], [8, 0, 0]], [[False, True, True], [True, False, False]])
    """
    if not rows or len(rows) != len(masks):
        raise ValueError(f"pack needs one mask per row and at least one row, got {len(rows)} rows, {len(masks)} masks")
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, (row, row_mask) in enumerate(zip(rows, masks)):
        if len(row) != len(row_mask):
            raise ValueError(f"row {i} has {len(row)} tokens but its mask has {len(row_mask)} entries")
        ids[i, :len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[i, :len(row)] = torch.tensor(list(row_mask), dtype=torch.bool)
    return ids, mask


def answer_batch(prompts: Sequence[str], answers: Sequence[Sequence[int]], tok: Tokenizer
                 ) -> tuple[Int[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
    """Each prompt's user turn and ``<|assistant|>`` followed by its answer ids, right-padded; the mask marks the
    answers. The batch every objective below scores: one row per (prompt, answer)."""
    rows, masks = [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        head = prompt_ids(prompt, tok)
        rows.append(head + list(answer))
        masks.append([False] * len(head) + [True] * len(answer))
    return pack(rows, masks)


def chat_batch(examples: Sequence[Example], tok: Tokenizer) -> tuple[Int[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
    """Examples rendered with the chat template, right-padded: ``(ids, answer_mask)``.

    >>> from tfedu.post_training import add_chat_tokens
    >>> tok = add_chat_tokens(Tokenizer([]))
    >>> ids, mask = chat_batch([Example("add", "1+1", "2")], tok)
    >>> mask[0].tolist()
    [False, False, False, False, False, False, True, True]
    """
    rows = [render_ids(ex.messages(), tok) for ex in examples]
    return pack(rows, [answer_mask(row, tok) for row in rows])


# ---------------------------------------------------------------------------------------------------------
# Objectives
# ---------------------------------------------------------------------------------------------------------


def _check_shapes(logits: Tensor, ids: Tensor, mask: Tensor, name: str) -> None:
    if logits.dim() != 3 or ids.dim() != 2 or logits.shape[:2] != ids.shape or mask.shape != ids.shape:
        raise ValueError(f"{name} expects logits (batch, pos, d_vocab) with ids and mask (batch, pos) of the same "
                         f"batch and pos; got {tuple(logits.shape)}, {tuple(ids.shape)}, {tuple(mask.shape)}")
    if mask.dtype != torch.bool:  # an int mask would index the tokens (positions 0 and 1), not select them
        raise ValueError(f"{name} expects a bool mask (True = answer token), got {mask.dtype}")


def token_logprobs(logits: Float[Tensor, "batch pos d_vocab"], ids: Int[Tensor, "batch pos"]
                   ) -> Float[Tensor, "batch pos_1"]:
    """``log p(ids[:, t+1] | ids[:, :t+1])`` for each t: the log-probability of each next token.

    ``logits`` are the model's output on ``ids`` (position t predicts token t+1), so the result has one
    column fewer than ``ids``. Computed as a log-softmax in float32 (stable for any logit size).

    >>> token_logprobs(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]])).exp()
    tensor([[0.2500, 0.2500]])
    """
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)  # batch pos-1 d_vocab
    return log_probs.gather(-1, ids[:, 1:, None])[..., 0]


def sft_loss(logits: Float[Tensor, "batch pos d_vocab"], ids: Int[Tensor, "batch pos"],
             mask: Bool[Tensor, "batch pos"]) -> Float[Tensor, ""]:
    """Instruction tuning's loss: the mean next-token cross-entropy over the tokens ``mask`` marks.

    ``mask[b, t]`` says whether token ``ids[b, t]`` is an answer token (``answer_mask``); it is predicted
    at position t-1, so the prediction at t is scored when ``mask[b, t+1]``. The mean is over answer
    tokens of the whole batch, not per sequence: every answer token weighs the same (as Hugging Face's
    and trl's SFT losses do). Built by hand in notebooks/17_post_training.ipynb.

    >>> ids = torch.tensor([[0, 1, 2]]); mask = torch.tensor([[False, False, True]])
    >>> round(float(sft_loss(torch.zeros(1, 3, 4), ids, mask)), 4), round(math.log(4), 4)
    (1.3863, 1.3863)
    """
    _check_shapes(logits, ids, mask, "sft_loss")
    target_mask = mask[:, 1:]
    if not target_mask.any():
        raise ValueError("sft_loss: the mask marks no answer token after the first position")
    # Pretraining's loss with every target outside the answers set to IGNORE_INDEX (Hugging Face's -100 labels).
    return next_token_loss(logits[:, :-1], ids[:, 1:].masked_fill(~target_mask, IGNORE_INDEX))


def answer_logprobs(model: torch.nn.Module, ids: Int[Tensor, "batch pos"], mask: Bool[Tensor, "batch pos"]
                    ) -> Float[Tensor, "batch"]:
    """Each row's total log-probability of the tokens ``mask`` marks (gradients flow if enabled)."""
    return (token_logprobs(model(ids), ids) * mask[:, 1:]).sum(-1)


def dpo_loss(policy_chosen: Float[Tensor, "batch"], policy_rejected: Float[Tensor, "batch"],
             ref_chosen: Float[Tensor, "batch"], ref_rejected: Float[Tensor, "batch"], beta: float
             ) -> Float[Tensor, ""]:
    """Direct preference optimisation's loss (Rafailov et al. 2023, eq. 7), averaged over the pairs.

    Each argument is a sequence log-probability (summed over the answer's tokens) of the chosen or the
    rejected answer under the policy or the frozen reference. The implicit reward of an answer is
    ``beta * (log pi - log ref)``; the loss is ``-log sigmoid`` of the chosen answer's reward minus the
    rejected one's (Bradley-Terry). ``F.logsigmoid`` keeps it finite at any margin. Built by hand in
    notebooks/17_post_training.ipynb.

    >>> z = torch.zeros(2)
    >>> round(float(dpo_loss(z, z, z, z, beta=0.1)), 4) == round(math.log(2), 4)
    True
    """
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # batch
    return -F.logsigmoid(beta * margin).mean()


GROUP_STD_EPS = 1e-4  # trl's, so that a group whose rewards are all equal gets advantages of 0, not NaN


def group_advantages(rewards: Float[Tensor, "n_prompts group"]) -> Float[Tensor, "n_prompts group"]:
    """GRPO's advantages: each reward minus its group's mean, over the group's standard deviation.

    One row per prompt, one column per sampled answer. The std is the unbiased one (``torch.std``, as
    trl), plus ``GROUP_STD_EPS``: a group where every answer is right (or every one wrong) teaches
    nothing and gets zeros. Built by hand in notebooks/17_post_training.ipynb.

    >>> [round(a, 3) for a in group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))[0].tolist()]
    [0.866, -0.866, -0.866, 0.866]
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (n_prompts, group) with a group of at least 2, got {tuple(rewards.shape)}")
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + GROUP_STD_EPS)


def grpo_loss(logp: Float[Tensor, "batch pos"], logp_old: Float[Tensor, "batch pos"],
              logp_ref: Float[Tensor, "batch pos"], advantages: Float[Tensor, "batch"],
              mask: Bool[Tensor, "batch pos"], clip_eps: float = 0.2, beta: float = 0.04) -> Float[Tensor, ""]:
    """GRPO's loss (Shao et al. 2024, eq. 3): PPO's clipped surrogate per token plus ``beta`` times KL.

    Per answer token: the ratio ``r = exp(logp - logp_old)`` to the policy that sampled the answer; the
    surrogate ``min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` with the answer's advantage A; the k3
    estimate of KL to the reference, ``exp(logp_ref - logp) - (logp_ref - logp) - 1`` (Schulman 2020,
    always >= 0). The loss is minus the surrogate plus ``beta`` times KL, averaged over each answer's
    tokens, then over the answers. Built by hand in notebooks/17_post_training.ipynb.

    >>> z = torch.zeros(1, 3); m = torch.ones(1, 3, dtype=torch.bool)
    >>> float(grpo_loss(z, z, z, torch.tensor([2.0]), m))
    -2.0
    """
    if not (logp.shape == logp_old.shape == logp_ref.shape == mask.shape) or advantages.shape != logp.shape[:1]:
        raise ValueError(f"grpo_loss expects logp, logp_old, logp_ref and mask of one shape (batch, pos) and "
                         f"advantages (batch,); got {tuple(logp.shape)}, {tuple(logp_old.shape)}, "
                         f"{tuple(logp_ref.shape)}, {tuple(mask.shape)}, {tuple(advantages.shape)}")
    ratio = torch.exp(logp - logp_old)  # batch pos
    A = advantages[:, None]
    surrogate = torch.minimum(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A)
    kl = torch.exp(logp_ref - logp) - (logp_ref - logp) - 1
    per_token = -surrogate + beta * kl
    mask = mask.float()
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021).

    ``1 - C(n - c, k) / C(n, k)``: the chance that k answers drawn without replacement from the n
    include a correct one. Computed as a product, ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, so large n
    never overflows. Built by hand in notebooks/17_post_training.ipynb.

    >>> pass_at_k(5, 0, 2), pass_at_k(5, 4, 2), round(pass_at_k(4, 2, 2), 4)
    (0.0, 1.0, 0.8333)
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if c > n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


# ---------------------------------------------------------------------------------------------------------
# Sampling and evaluation
# ---------------------------------------------------------------------------------------------------------


def prompt_ids(prompt: str, tok: Tokenizer) -> list[int]:
    """A user turn followed by ``<|assistant|>``: what the model continues with its answer."""
    return render_ids([{"role": "user", "content": prompt}], tok, add_generation_prompt=True)


@torch.no_grad()
def sample_answers(model: GPT, tok: Tokenizer, prompts: Sequence[str], *, n: int = 1, do_sample: bool = False,
                   temperature: float = 1.0, max_new_tokens: int = 16, generator: torch.Generator | None = None,
                   ) -> list[list[list[int]]]:
    """For each prompt, ``n`` answers as token ids, each cut after its ``<|end|>`` (kept) if it has one.

    Greedy unless ``do_sample``. Prompts are decoded together, left-padded (``tfedu.generate``).
    """
    end = tok.special_tokens[END_OF_TURN]
    rows = [prompt_ids(p, tok) for p in prompts for _ in range(n)]
    was_training = model.training
    model.eval()
    try:
        ids, padding_mask = pad_prompts(rows)
        out = generate(model, ids, max_new_tokens, do_sample=do_sample, temperature=temperature,
                       eos_token_id=end, generator=generator, padding_mask=padding_mask)
    finally:
        model.train(was_training)
    answers = []
    for row in out[:, ids.shape[1]:].tolist():
        answers.append(row[:row.index(end) + 1] if end in row else row)
    return [answers[i * n:(i + 1) * n] for i in range(len(prompts))]


def answer_text(answer: Sequence[int], tok: Tokenizer) -> str:
    """An answer's text, without its closing ``<|end|>``."""
    end = tok.special_tokens[END_OF_TURN]
    answer = list(answer)
    return tok.decode(answer[:-1] if answer and answer[-1] == end else answer)


def rewards_for(examples: Sequence[Example], answers: Sequence[Sequence[Sequence[int]]], tok: Tokenizer) -> Tensor:
    """1.0 for each answer the verifier accepts, else 0.0: ``(n_prompts, n)``. An answer without ``<|end|>``
    (cut off by the length limit) gets 0: it never finished."""
    end = tok.special_tokens[END_OF_TURN]
    return torch.tensor([[float(bool(a) and a[-1] == end and verify(ex.family, ex.prompt, answer_text(a, tok)))
                          for a in group] for ex, group in zip(examples, answers)])


def task_accuracy(model: GPT, tok: Tokenizer, examples: Sequence[Example], batch_size: int = 64) -> dict[str, float]:
    """Greedy accuracy per family and overall (key ``"all"``), graded by the verifier."""
    correct: dict[str, list[float]] = {}
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        rewards = rewards_for(chunk, sample_answers(model, tok, [ex.prompt for ex in chunk]), tok)
        for ex, r in zip(chunk, rewards[:, 0].tolist()):
            correct.setdefault(ex.family, []).append(r)
    scores = {f: sum(v) / len(v) for f, v in sorted(correct.items())}
    scores["all"] = sum(sum(v) for v in correct.values()) / max(1, len(examples))
    return scores


@torch.no_grad()
def choice_logprobs(model: GPT, tok: Tokenizer, prompt: str, choices: Sequence[str], first_token_only: bool = False
                    ) -> Float[Tensor, "n_choices"]:
    """The log-probability of each choice as the assistant's answer (its tokens and ``<|end|>``).

    How evaluation harnesses score multiple choice: the choice the model finds likeliest is its answer.
    ``first_token_only`` scores only each choice's first token, which cannot tell apart choices that
    begin alike.
    """
    end = tok.special_tokens[END_OF_TURN]
    tails = [(tok.encode_ordinary(choice) + [end])[:1 if first_token_only else None] for choice in choices]
    ids, mask = answer_batch([prompt] * len(choices), tails, tok)
    model.eval()
    return answer_logprobs(model, ids, mask)


# ---------------------------------------------------------------------------------------------------------
# Loops
# ---------------------------------------------------------------------------------------------------------

SFTLoss = Callable[[Tensor, Tensor, Tensor], Tensor]


def sft_train(model: GPT, tok: Tokenizer, examples: Sequence[Example], *, steps: int, batch_size: int = 32,
              lr: float = 1e-3, min_lr_ratio: float = 0.1, seed: int = 0, loss_fn: SFTLoss = sft_loss,
              stop_after: int | None = None) -> list[float]:
    """Instruction-tune ``model`` in place with AdamW on batches drawn from ``examples``; the losses.

    Batches are drawn with replacement by ``random.Random(seed)``; no weight decay; the learning rate
    decays from ``lr`` to ``min_lr_ratio * lr`` on a cosine (no warm-up: the model is trained already).
    ``stop_after`` ends the run early with the schedule of the full ``steps`` (so its first steps are the
    full run's).
    """
    if not examples:
        raise ValueError("sft_train needs at least one example")
    draw = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps if stop_after is None else min(steps, stop_after)):
        for group in opt.param_groups:
            group["lr"] = lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * step / max(1, steps))))
        ids, mask = chat_batch([examples[draw.randrange(len(examples))] for _ in range(batch_size)], tok)
        loss = loss_fn(model(ids), ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


@dataclasses.dataclass(frozen=True)
class Pair:
    """A preference: for one prompt, an answer the verifier accepts and one it rejects (token ids, with <|end|>)."""

    example: Example
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


def preference_pairs(model: GPT, tok: Tokenizer, examples: Sequence[Example], *, n: int = 8, temperature: float = 1.0,
                     seed: int = 0) -> list[Pair]:
    """Pairs built by the verifier from ``n`` sampled answers per prompt: a wrong sample is rejected; the
    chosen answer is a right sample, or the verifier's own answer when no sample was right.

    Prompts whose samples are all right give no pair (there is nothing to prefer).
    """
    generator = torch.Generator().manual_seed(seed)
    end = tok.special_tokens[END_OF_TURN]
    pairs = []
    for i in range(0, len(examples), 32):
        chunk = examples[i:i + 32]
        answers = sample_answers(model, tok, [ex.prompt for ex in chunk], n=n, do_sample=True,
                                 temperature=temperature, generator=generator)
        rewards = rewards_for(chunk, answers, tok)
        for ex, group, r in zip(chunk, answers, rewards.tolist()):
            wrong = [a for a, ok in zip(group, r) if not ok]
            right = [a for a, ok in zip(group, r) if ok]
            if wrong:
                chosen = right[0] if right else tok.encode_ordinary(ex.answer) + [end]
                pairs.append(Pair(ex, tuple(chosen), tuple(wrong[0])))
    return pairs


def _pair_batch(pairs: Sequence[Pair], tok: Tokenizer) -> tuple[Tensor, Tensor]:
    """Chosen rows then rejected rows, right-padded, with masks on the answers: ``(2 * batch, pos)``."""
    prompts = [pair.example.prompt for pair in pairs]
    return answer_batch(prompts * 2, [p.chosen for p in pairs] + [p.rejected for p in pairs], tok)


def _freeze(ref: GPT) -> None:
    """The reference model: no gradients, eval mode (it is only ever read)."""
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.eval()


DPOLoss = Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]


def dpo_train(policy: GPT, ref: GPT, tok: Tokenizer, pairs: Sequence[Pair], *, beta: float, steps: int,
              batch_size: int = 16, lr: float = 1e-4, seed: int = 0, loss_fn: DPOLoss = dpo_loss) -> dict[str, list[float]]:
    """Preference-tune ``policy`` in place with DPO against the frozen ``ref``; per step the loss and the
    fraction of pairs whose implicit reward ranks the chosen answer first."""
    if not pairs:
        raise ValueError("dpo_train needs at least one pair")
    _freeze(ref)
    draw = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    policy.train()
    history: dict[str, list[float]] = {"loss": [], "reward_accuracy": []}
    for _ in range(steps):
        batch = [pairs[draw.randrange(len(pairs))] for _ in range(batch_size)]
        ids, mask = _pair_batch(batch, tok)
        with torch.no_grad():
            ref_chosen, ref_rejected = answer_logprobs(ref, ids, mask).chunk(2)
        chosen, rejected = answer_logprobs(policy, ids, mask).chunk(2)
        loss = loss_fn(chosen, rejected, ref_chosen, ref_rejected, beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history["loss"].append(loss.item())
        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        history["reward_accuracy"].append((margin > 0).float().mean().item())
    policy.eval()
    return history


@torch.no_grad()
def kl_to_reference(policy: GPT, ref: GPT, tok: Tokenizer, prompts: Sequence[str], *, n: int = 4,
                    temperature: float = 1.0, seed: int = 0) -> float:
    """A Monte Carlo estimate of KL(policy || ref) per answer, in nats: the mean over answers sampled from
    the policy of ``log policy(y|x) - log ref(y|x)``. (Sampled at ``temperature``; 1 is the true KL.)"""
    generator = torch.Generator().manual_seed(seed)
    answers = sample_answers(policy, tok, prompts, n=n, do_sample=True, temperature=temperature, generator=generator)
    ids, mask = answer_batch([p for p in prompts for _ in range(n)], [a for group in answers for a in group], tok)
    policy.eval()
    ref.eval()
    return (answer_logprobs(policy, ids, mask) - answer_logprobs(ref, ids, mask)).mean().item()


GRPOLoss = Callable[..., Tensor]


def grpo_train(policy: GPT, ref: GPT, tok: Tokenizer, examples: Sequence[Example], *, steps: int,
               prompts_per_step: int = 8, group: int = 8, lr: float = 2e-5, beta: float = 0.04,
               clip_eps: float = 0.2, temperature: float = 1.0, updates_per_batch: int = 2, seed: int = 0,
               advantages_fn: Callable[[Tensor], Tensor] = group_advantages, loss_fn: GRPOLoss = grpo_loss,
               ) -> dict[str, list[float]]:
    """RL with verifiable rewards: GRPO on ``policy`` in place, ``ref`` frozen; per step the mean reward.

    Each step samples ``group`` answers to each of ``prompts_per_step`` prompts from the current policy,
    rewards them with the verifier (1 right, 0 wrong), and takes ``updates_per_batch`` gradient steps on
    the same samples (the clipped ratio is what keeps the later ones near the sampling policy).
    """
    if not examples:
        raise ValueError("grpo_train needs at least one example")
    _freeze(ref)
    draw = random.Random(seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    history: dict[str, list[float]] = {"reward": [], "loss": []}
    for _ in range(steps):
        batch = [examples[draw.randrange(len(examples))] for _ in range(prompts_per_step)]
        answers = sample_answers(policy, tok, [ex.prompt for ex in batch], n=group, do_sample=True,
                                 temperature=temperature, generator=generator)
        rewards = rewards_for(batch, answers, tok)  # n_prompts group
        advantages = advantages_fn(rewards).reshape(-1)
        ids, mask = answer_batch([ex.prompt for ex in batch for _ in range(group)],
                                 [a for answer_group in answers for a in answer_group], tok)
        policy.eval()  # dropout is 0 after grow_vocab; eval keeps old and new log-probs comparable anyway
        with torch.no_grad():
            logp_old = token_logprobs(policy(ids), ids)
            logp_ref = token_logprobs(ref(ids), ids)
        for _ in range(updates_per_batch):
            logp = token_logprobs(policy(ids), ids)
            loss = loss_fn(logp, logp_old, logp_ref, advantages, mask[:, 1:], clip_eps=clip_eps, beta=beta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        history["reward"].append(rewards.mean().item())
        history["loss"].append(loss.item())
    return history


@torch.no_grad()
def sample_counts(model: GPT, tok: Tokenizer, examples: Sequence[Example], *, n: int, temperature: float = 1.0,
                  seed: int = 0) -> list[int]:
    """For each example, how many of ``n`` answers sampled at ``temperature`` the verifier accepts."""
    generator = torch.Generator().manual_seed(seed)
    correct = []
    for i in range(0, len(examples), 32):
        chunk = examples[i:i + 32]
        answers = sample_answers(model, tok, [ex.prompt for ex in chunk], n=n, do_sample=True,
                                 temperature=temperature, generator=generator)
        correct += [int(c) for c in rewards_for(chunk, answers, tok).sum(1).tolist()]
    return correct


def pass_rates(model: GPT, tok: Tokenizer, examples: Sequence[Example], *, n: int, ks: Sequence[int] = (1,),
               temperature: float = 1.0, seed: int = 0) -> dict[int, float]:
    """pass@k for each k in ``ks``, averaged over ``examples``, from ``n`` sampled answers per prompt."""
    correct = sample_counts(model, tok, examples, n=n, temperature=temperature, seed=seed)
    return {k: sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks}


def multiple_choice(examples: Sequence[Example], n_choices: int = 4, seed: int = 0
                    ) -> list[tuple[Example, list[str], int]]:
    """Each example as a multiple-choice item: its answer among ``n_choices - 1`` wrong answers of the same
    family (other prompts' answers the verifier rejects here), shuffled; ``(example, choices, correct)``."""
    draw = random.Random(seed)
    by_family: dict[str, list[str]] = {}
    for ex in examples:
        by_family.setdefault(ex.family, []).append(ex.answer)
    items = []
    for ex in examples:
        pool = sorted({a for a in by_family[ex.family] if not verify(ex.family, ex.prompt, a)})
        if len(pool) < n_choices - 1:
            continue
        choices = draw.sample(pool, n_choices - 1) + [ex.answer]
        draw.shuffle(choices)
        items.append((ex, choices, choices.index(ex.answer)))
    return items


def choice_accuracy(model: GPT, tok: Tokenizer, items: Sequence[tuple[Example, list[str], int]],
                    first_token_only: bool = False) -> float:
    """The fraction of items whose likeliest choice is the right one; a tie counts as a miss (no choice
    stands out), which is how scoring only first tokens that begin alike fails."""
    hits = 0
    for ex, choices, correct in items:
        scores = choice_logprobs(model, tok, ex.prompt, choices, first_token_only)
        best = scores.max()
        hits += int(scores[correct] == best and int((scores == best).sum()) == 1)
    return hits / max(1, len(items))

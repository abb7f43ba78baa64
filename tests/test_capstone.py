"""Notebook 08's capstone (tfedu.checks.capstone): a GPT of the learner's parts, trained by the learner's loop.

Issue 40, item 2: with every part from a solved notebook set, the held-out loss lands within 2% of the reference
parts' run with the same seed; so does a set of parts written differently (other operation orders, other draws of
the batches); with parts missing or wrong, the table says which reference parts stood in and why.
"""

import json
import math

import einops
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tfedu.checks import capstone
from tfedu.course.hints import SOLUTIONS

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the runs are timed and compared on one thread

HEADER = {"torch": torch, "nn": nn, "F": F, "math": math, "einops": einops, "np": np}


def solved_namespace() -> dict:
    """Every capstone part as the course's solution cells define it, in one namespace (a solved notebook set)."""
    solutions = json.loads(SOLUTIONS.read_text())
    namespace = dict(HEADER)
    for number in capstone.PARTS:
        exec(solutions[number]["code"], namespace)
    return namespace


def earlier_of(namespace: dict) -> dict:
    return {number: namespace[name] for number, (name, _) in capstone.PARTS.items() if not number.startswith("8.")}


# Right parts written another way than the solutions: other operation orders, and starts drawn from torch.rand
# (another use of the generator's stream, so other batches than the reference run's).
OTHER_WAYS = '''
class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.W_Q, self.W_K, self.W_V, self.W_O = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        b, n, d = x.shape
        heads = lambda t: t.view(b, -1, self.n_heads, d // self.n_heads).transpose(1, 2)
        q, k, v = heads(self.W_Q(x)), heads(self.W_K(context)), heads(self.W_V(context))
        scores = q @ k.transpose(-1, -2) * (d // self.n_heads) ** -0.5
        if mask is not None:
            scores = torch.where(mask, scores, torch.tensor(float("-inf")))
        return self.W_O((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


def layer_norm(x, weight, bias, eps=1e-5):
    centred = x - x.mean(-1, keepdim=True)
    return centred * torch.rsqrt((centred * centred).mean(-1, keepdim=True) + eps) * weight + bias


def get_batch(data, batch_size, seq_len, generator):
    starts = (torch.rand(batch_size, generator=generator) * (len(data) - seq_len)).long()  # uniform over the starts
    windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def cross_entropy(logits, targets, ignore_index=-100):
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    keep = targets != ignore_index
    kept = logits[keep]
    top = kept.max(dim=-1).values
    log_z = top + (kept - top[:, None]).exp().sum(dim=-1).log()
    return (log_z - kept.gather(1, targets[keep][:, None])[:, 0]).sum() / keep.sum()


def adamw_step(param, grad, m, v, t, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    b1, b2 = betas
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    step = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    return param - lr * (weight_decay * param + step), m, v


def clip_grad_norm(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = sum((g.double() ** 2).sum() for g in grads).sqrt().float()
    if total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total
'''


@pytest.fixture(scope="module")
def data():
    return capstone.course_data()


@pytest.fixture(scope="module")
def reference_run(data):
    return capstone.train_run(capstone.reference_parts(), *data)


def test_the_reference_run_is_the_stored_seed_0(reference_run):
    stored = capstone.stored_seeds()
    assert stored["recipe"] == json.loads(json.dumps(capstone.Recipe().__dict__))  # the recipe it was measured with
    assert reference_run.final == pytest.approx(stored["final_val_loss"]["0"], abs=2e-3)
    assert [step for step, _ in reference_run.evals] == list(range(50, 401, 50))
    assert reference_run.final < 4.6 < 6.0 < reference_run.losses[0]  # it learns well past the unigram loss (~6.0)


def test_the_stored_spread_across_seeds_is_about_one_percent():
    finals = np.array(list(capstone.stored_seeds()["final_val_loss"].values()))
    assert len(finals) == 5 and (finals.max() - finals.min()) / finals.mean() < capstone.TOLERANCE / 1.5


def test_a_solved_set_of_parts_lands_within_two_percent(data, reference_run):
    namespace = solved_namespace()
    parts = capstone.gather(namespace, earlier_of(namespace))
    assert parts.all_yours, parts.table()
    yours = capstone.train_run(parts, *data)
    assert capstone.relative_gap(yours, reference_run) < capstone.TOLERANCE


def test_parts_written_another_way_land_within_two_percent_too(data, reference_run):
    namespace = solved_namespace()
    exec(OTHER_WAYS, namespace)  # replaces attention, LayerNorm, the batches, the loss, AdamW and clipping
    parts = capstone.gather(namespace, earlier_of(namespace))
    assert parts.all_yours, parts.table()
    yours = capstone.train_run(parts, *data)
    assert yours.losses[0] != reference_run.losses[0]  # other batches: really another run
    assert capstone.relative_gap(yours, reference_run) < capstone.TOLERANCE, (yours.final, reference_run.final)


def test_missing_and_wrong_parts_are_replaced_and_named():
    namespace = solved_namespace()
    earlier = earlier_of(namespace)
    del namespace["train_loop"]
    namespace["cross_entropy"] = lambda logits, targets, ignore_index=-100: F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="sum")
    del earlier["6.1"]
    parts = capstone.gather(namespace, earlier)
    assert not parts.all_yours
    assert parts.whose["8.6"] == "the reference (no train_loop in this notebook)"
    assert parts.whose["8.2"].startswith("the reference (") and "sum" in parts.whose["8.2"]
    assert parts.whose["6.1"] == "the reference (none given for exercise 6.1)"
    assert parts.objects["8.6"] is capstone.REFERENCES["8.6"] and parts.objects["8.2"] is capstone.REFERENCES["8.2"]
    assert parts.whose["8.1"] == parts.whose["5.3"] == "yours"
    table = parts.table()
    assert "8.6 train_loop" in table and "no train_loop in this notebook" in table


def test_earlier_parts_come_from_the_learners_kept_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TFEDU_MY_PARTS", str(tmp_path))
    parts = capstone.gather(solved_namespace())
    assert parts.whose["5.3"].startswith(f"the reference ({tmp_path / 'nb05.py'} does not exist")
    assert parts.whose["8.8"] == "yours"


def test_sampling_uses_the_parts_sampler_and_crops_to_the_context(reference_run):
    model = reference_run.model
    calls = []

    def sample_next(logits, temperature, generator):
        calls.append((tuple(logits.shape), temperature))
        return capstone.REFERENCES["8.8"](logits, temperature, generator)

    ids = capstone.sample(model, [5, 6], sample_next, new_tokens=70, temperature=0.8, seed=1)
    assert len(ids) == 72 and ids[:2] == [5, 6] and len(calls) == 70 and calls[0] == ((1, 1024), 0.8)
    again = capstone.sample(model, [5, 6], capstone.REFERENCES["8.8"], new_tokens=70, temperature=0.8, seed=1)
    assert again == ids  # seeded: the same text again


def test_flashattention_runs_inside_the_gpt_of_parts_with_its_projections():
    """Issue 41, item 2: notebook 09 switches FlashAttention into the learner's GPT of notebook 08."""
    from tfedu.flash import attention_from, flash_backward, flash_forward

    namespace = solved_namespace()
    exec(OTHER_WAYS, namespace)  # attention written another way than the reference: its projections still serve
    every_part = {number: namespace[name] for number, (name, _) in capstone.PARTS.items()}  # all kept, as in 09
    parts = capstone.gather({}, every_part, here="09")
    assert parts.all_yours, parts.table()
    tiles = attention_from(flash_forward, flash_backward, block_q=16, block_k=16)
    weights = capstone.initial_weights(300, capstone.Recipe(), seed=0)
    models = []
    for flash_fn in (None, tiles):
        model = capstone.GPTOfParts(300, 64, 64, 2, 4, "gelu_tanh", parts.objects, flash_fn=flash_fn)
        model.load_state_dict(weights)
        models.append(model)
    ids = torch.randint(0, 300, (3, 57), generator=torch.Generator().manual_seed(0))  # not a multiple of the tiles
    grads = []
    for model in models:
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        grads.append(torch.autograd.grad(loss, list(model.parameters())) + (loss,))
    for plain, tiled in zip(*grads, strict=True):
        torch.testing.assert_close(tiled, plain, atol=1e-5, rtol=1e-4)
    # Trained a few steps by the parts' loop, the two runs give the same losses to rounding.
    data = capstone.course_data()
    few = capstone.Recipe(steps=4, warmup_steps=1, eval_every=4, eval_windows=4)
    plain, tiled = (capstone.train_run(parts, *data, few, flash_fn=fn) for fn in (None, tiles))
    assert max(abs(a - b) for a, b in zip(plain.losses + [plain.final], tiled.losses + [tiled.final])) < 1e-4

"""Checkers and probes of notebook 08: each passes the reference and names realistic mistakes."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tfedu.checks import nb08_training_decoding as nb08
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe
from tfedu.generate import filter_top_k, filter_top_p, generate, sequence_logprob
from tfedu.checks.scan import scan_answer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: see tests/conftest.py

NEG_INF = float("-inf")

# The solution cells as the notebook will hold them (between ### BEGIN SOLUTION / ### END SOLUTION).
SOLUTIONS = {
    "ex_get_batch": '''\
def get_batch(data, batch_size, seq_len, generator):
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    rows = starts[:, None] + torch.arange(seq_len + 1)  # batch seq_len+1: the index of every token of every window
    windows = data[rows]
    return windows[:, :-1], windows[:, 1:]
''',
    "ex_cross_entropy": '''\
def cross_entropy(logits, targets, ignore_index=-100):
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    scored = targets != ignore_index
    logits, targets = logits[scored], targets[scored]
    m = logits.max(dim=-1).values
    lse = m + torch.log(torch.exp(logits - m[:, None]).sum(dim=-1))
    return (lse - logits[torch.arange(len(targets)), targets]).mean()
''',
    "ex_adamw_step": '''\
def adamw_step(param, grad, m, v, t, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    beta1, beta2 = betas
    param = param - lr * weight_decay * param
    m = m * beta1 + grad * (1 - beta1)
    v = v * beta2 + grad ** 2 * (1 - beta2)
    step = lr * (m / (1 - beta1 ** t)) / (torch.sqrt(v / (1 - beta2 ** t)) + eps)
    return param - step, m, v
''',
    "ex_lr_schedule": '''\
def lr_schedule(step, max_lr, warmup_steps, total_steps, min_lr_ratio=0.1):
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    span = total_steps - 1 - warmup_steps
    progress = min(1.0, (step - warmup_steps) / span) if span > 0 else float(step > warmup_steps)
    lowest = max_lr * min_lr_ratio
    return lowest + 0.5 * (max_lr - lowest) * (1.0 + math.cos(math.pi * progress))
''',
    "ex_clip_grad_norm": '''\
def clip_grad_norm(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if total > max_norm:
        with torch.no_grad():
            for g in grads:
                g *= max_norm / (total + 1e-6)
    return total
''',
    "ex_train_loop": '''\
def train_loop(model, optimizer, train_ids, generator, *, steps, batch_size, seq_len, max_lr, warmup_steps,
               evaluate, eval_every, checkpoints, resume=False, until=None):
    step = 0
    if resume:
        saved = checkpoints.restore()
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        step = saved["step"]
    losses, evals = [], []
    last = until if until is not None else steps
    while step < last:
        lr = lr_schedule(step, max_lr, warmup_steps, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = get_batch(train_ids, batch_size, seq_len, generator)
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % eval_every == 0 or step == last:
            model.eval()
            with torch.no_grad():
                evals.append((step, evaluate(model)))
            model.train()
            checkpoints.store(dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                                   generator=generator.get_state(), step=step))
    return losses, evals
''',
    "ex_greedy": '''\
def greedy_generate(model, ids, max_new_tokens):
    model.eval()                                           # no dropout while generating
    with torch.no_grad():
        for _ in range(max_new_tokens):
            context = ids[:, -model.cfg.n_ctx:]            # the model sees at most n_ctx tokens
            logits = model(context)                        # batch pos d_vocab
            next_id = logits[:, -1, :].argmax(dim=-1)      # batch: the last position predicts what comes next
            ids = torch.cat([ids, next_id[:, None]], dim=1)
    return ids
''',
    "ex_sample_next": '''\
def sample_next(logits, temperature, generator):
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    scaled = logits / temperature
    probs = torch.exp(scaled - scaled.max(dim=-1, keepdim=True).values)
    return torch.multinomial(probs / probs.sum(dim=-1, keepdim=True), 1, generator=generator).squeeze(1)
''',
    "ex_top_k": '''\
def top_k_filter(logits, k):
    if k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # ... 1: the k-th largest of each row
    return logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th largest stay
''',
    "ex_top_p": '''\
def top_p_filter(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs             # what the more likely tokens already hold
    remove_sorted = mass_before >= p                       # the nucleus reached p without this token
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to the vocabulary's order
    return logits.masked_fill(remove, float("-inf"))
''',
    "ex_beam_search": '''\
def beam_search(model, ids, max_new_tokens, num_beams):
    model.eval()
    out = []
    with torch.no_grad():
        for row in range(ids.shape[0]):
            seqs = ids[row:row + 1]                        # 1 pos: a single beam to start
            score = torch.zeros(1)
            for _ in range(max_new_tokens):
                logp = torch.log_softmax(model(seqs[:, -model.cfg.n_ctx:])[:, -1, :], dim=-1)
                cand = (score[:, None] + logp).reshape(-1)  # every (beam, token) pair
                score, idx = torch.topk(cand, num_beams)
                beam, tok = idx // logp.shape[-1], idx % logp.shape[-1]
                seqs = torch.cat([seqs[beam], tok[:, None]], dim=1)
            out.append(seqs[0])
    return torch.stack(out)
''',
}
NOTEBOOK_CONTEXT = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\nimport math, einops, regex"


def solution(grade_id, **names):
    namespace = {"torch": torch, "F": F, "nn": nn, "math": math, **names}
    exec(SOLUTIONS[grade_id], namespace)
    return namespace


# ----------------------------------------------------------------------------- 8.1 get_batch


def make_get_batch(bug=None):
    """A learner's get_batch, one switch per mistake."""

    def get_batch(data, batch_size, seq_len, generator):
        high = {"no-last": len(data) - seq_len - 1, "past-end": len(data) - seq_len + 1}.get(bug, len(data) - seq_len)
        if bug == "global":
            starts = torch.randint(0, high, (batch_size,))
        elif bug == "one-start":
            starts = torch.randint(0, high, (1,), generator=generator).repeat(batch_size)
        elif bug == "no-first":
            starts = torch.randint(1, high, (batch_size,), generator=generator)
        else:
            starts = torch.randint(0, high, (batch_size,), generator=generator)
        width = seq_len if bug in ("same", "backwards") else seq_len + 1
        windows = torch.stack([data[s : s + width] for s in starts.tolist()])
        if bug == "same":
            return windows, windows.clone()
        if bug == "backwards":
            return windows, torch.stack([data[max(s - 1, 0) : max(s - 1, 0) + seq_len] for s in starts.tolist()])
        if bug == "whole-window":
            return windows, windows[:, 1:]
        if bug == "float":
            return windows[:, :-1].float(), windows[:, 1:].float()
        if bug == "shuffled":
            return windows[:, :-1].flip(-1), windows[:, 1:].flip(-1)
        return windows[:, :-1], windows[:, 1:]

    return get_batch


def test_get_batch_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_get_batch")["get_batch"], make_get_batch(), nb08.reference_get_batch):
        nb08.check_get_batch(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} get_batch: all checks passed") == 3


@pytest.mark.parametrize("bug, match", [
    ("no-last", r"the last possible start \(2\) never came up.*randint's upper bound is excluded"),
    ("no-first", "the start 0 never came up"),
    ("past-end", r"raised|is not a run of consecutive tokens|not the next tokens"),
    ("global", "two calls with generators seeded alike gave different batches"),
    ("one-start", "every row of the batch is the same window"),
    ("same", "y equals x"),
    ("backwards", "y is x moved one place back"),
    ("whole-window", "x has seq_len \\+ 1 columns"),
    ("float", "x has dtype torch.float32: token ids go to the embedding and the loss as integers"),
    ("shuffled", "row 0 of x is not a run of consecutive tokens of data"),
])
def test_get_batch_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_get_batch(make_get_batch(bug))


def test_get_batch_not_done():
    def get_batch(data, batch_size, seq_len, generator):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb08.check_get_batch(get_batch)


def test_get_batch_reference_draws_the_windows_of_tfedus_dataset():
    from tfedu.data import TokenDataset

    ids = np.arange(100, 400, dtype=np.uint16)
    dataset = TokenDataset(ids)
    want = dataset.batch(6, 10, torch.Generator().manual_seed(4))
    got = nb08.reference_get_batch(torch.from_numpy(ids.astype(np.int64)), 6, 10, torch.Generator().manual_seed(4))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ----------------------------------------------------------------------------- 8.2 cross_entropy


def make_cross_entropy(bug=None):
    """A learner's cross_entropy, one switch per mistake."""

    def cross_entropy(logits, targets, ignore_index=-100):
        if bug == "fixed-index":
            ignore_index = -100
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        keep = targets != ignore_index
        n_all = len(targets)
        if bug != "index-used":
            logits, targets = logits[keep], targets[keep]
        if bug == "no-shift":
            logp = logits - logits.exp().sum(-1, keepdim=True).log()
        elif bug == "log-softmax-naive":
            logp = torch.softmax(logits, -1).log()
        else:
            top = logits.max(-1, keepdim=True).values
            logp = logits - top - (logits - top).exp().sum(-1, keepdim=True).log()
        if bug == "all-vocab":
            return -logp.mean()
        picked = logp.gather(-1, targets[:, None]).squeeze(-1)
        if bug == "prob":
            return -picked.exp().mean()
        if bug == "detached":
            picked = picked.detach()
        loss = {"sum": lambda: -picked.sum(), "sign": lambda: picked.mean(), "ignored-counted": lambda: -picked.sum() / n_all,
                "not-scalar": lambda: -picked}.get(bug, lambda: -picked.mean())()
        return loss

    return cross_entropy


def test_cross_entropy_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_cross_entropy")["cross_entropy"], make_cross_entropy(), nb08.reference_cross_entropy):
        nb08.check_cross_entropy(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} cross-entropy: all checks passed") == 3


@pytest.mark.parametrize("bug, match", [
    ("no-shift", "inf or NaN on logits around 1000"),
    ("log-softmax-naive", "you took the log of a probability that underflowed to 0"),
    ("sum", "you returned the sum over the positions"),
    ("sign", "the loss has the wrong sign"),
    ("all-vocab", "you averaged over the vocabulary as well"),
    ("prob", "you averaged minus the probabilities of the targets"),
    ("ignored-counted", "still count in the mean"),
    ("index-used", "positions whose target is ignore_index were scored"),
    ("fixed-index", r"ignore_index=0\) ignored the positions of -100 instead"),
    ("not-scalar", "should return one number"),
    ("detached", "no gradient flows back through cross_entropy"),
])
def test_cross_entropy_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_cross_entropy(make_cross_entropy(bug))


def test_cross_entropy_by_torch_is_refused():
    for fn, route in ((lambda logits, targets, ignore_index=-100: F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index), "cross_entropy"),
                      (lambda logits, targets, ignore_index=-100: nb08.reference_cross_entropy(
                          torch.log_softmax(logits, -1), targets, ignore_index), "log_softmax")):
        with pytest.raises(CheckFailure, match=f"you called .*{route}"):
            nb08.check_cross_entropy(fn)


def test_cross_entropy_not_done():
    def cross_entropy(logits, targets, ignore_index=-100):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb08.check_cross_entropy(cross_entropy)


# ----------------------------------------------------------------------------- 8.3 adamw_step


def make_adamw(bug=None):
    """A learner's adamw_step, one switch per mistake (the checker's named mistakes, written as a learner would)."""

    def adamw_step(param, grad, m, v, t, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        beta1, beta2 = (betas[1], betas[0]) if bug == "betas-swapped" else betas
        if bug == "l2":
            grad = grad + weight_decay * param
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * (grad if bug == "v-grad" else grad**2)
        if bug == "in-place":
            param.mul_(1 - lr * weight_decay)
        t_c = t - 1 if bug == "t-zero" else t
        m_hat, v_hat = (m, v) if bug == "no-correction" else (m / (1 - beta1**t_c), v / (1 - beta2**t_c))
        denom = torch.sqrt(v_hat + eps) if bug == "eps-inside" else torch.sqrt(v_hat) + eps
        if bug not in ("l2", "in-place"):
            param = param * (1 - (weight_decay if bug == "no-lr" else lr * weight_decay))
        new = param - lr * m_hat / denom
        if bug == "tuple2":
            return new, m
        return new, m, v

    return adamw_step


def test_adamw_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_adamw_step")["adamw_step"], make_adamw(), nb08.reference_adamw_step):
        nb08.check_adamw_step(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} AdamW step: all checks passed") == 3


@pytest.mark.parametrize("bug, match", [
    ("l2", "you added the weight decay to the gradient"),
    ("no-lr", "the weights shrank by a factor of 1 - weight_decay"),
    ("no-correction", "no bias correction"),
    ("eps-inside", "eps is inside the square root"),
    ("v-grad", "a square root of a negative v"),
    ("betas-swapped", "beta1 and beta2 are swapped"),
    ("t-zero", "returned NaN or inf at step 1"),
    ("in-place", "changed the caller's `param` in place"),
    ("tuple2", "should return three tensors"),
])
def test_adamw_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_adamw_step(make_adamw(bug))


def test_adamw_not_done_and_the_oracle_is_torch():
    def adamw_step(param, grad, m, v, t, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb08.check_adamw_step(adamw_step)
    param, grads = nb08.adamw_case(7)
    ours = nb08.adamw_trajectory(nb08.reference_adamw_step, param, grads, **nb08.AW_OPTIONS)
    torch.testing.assert_close(ours, nb08.torch_adamw_trajectory(param, grads, **nb08.AW_OPTIONS), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- 8.4 lr_schedule


def make_lr(bug=None):
    def lr_schedule(step, max_lr, warmup_steps, total_steps, min_lr_ratio=0.1):
        mistake = {"zero-start": "zero-start", "no-offset": "no-offset", "to-zero": "to-zero", "absolute-min": "absolute-min",
                   "full-period": "full-period", "linear": "linear", "late": "late", "past-end": "past-end"}.get(bug)
        if step < warmup_steps:
            return max_lr * (step if mistake == "zero-start" else step + 1) / warmup_steps
        start, span = (0, total_steps - 1) if mistake == "no-offset" else (warmup_steps, total_steps - 1 - warmup_steps)
        span += 1 if mistake == "late" else 0
        progress = (step - start) / (span if bug == "zero-span" else max(1, span))
        progress = progress if mistake == "past-end" else min(1.0, progress)
        low = 0.0 if mistake == "to-zero" else min_lr_ratio if mistake == "absolute-min" else max_lr * min_lr_ratio
        if mistake == "linear":
            return low + (max_lr - low) * (1 - progress)
        angle = (2 if mistake == "full-period" else 1) * math.pi * progress
        value = low + (max_lr - low) * (1 + math.cos(angle)) / 2
        return torch.tensor(value) if bug == "tensor" else value

    return lr_schedule


def test_lr_schedule_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_lr_schedule")["lr_schedule"], make_lr(), nb08.reference_lr_schedule):
        nb08.check_lr_schedule(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} learning-rate schedule: all checks passed") == 3


def test_lr_schedule_reference_is_tfedus_training_schedule():
    from tfedu.train import TrainConfig, learning_rate

    for max_lr, warmup, total, ratio in (*nb08.LR_CASES, nb08.LR_NO_SPAN):
        cfg = TrainConfig(steps=total, lr=max_lr, warmup_steps=warmup, min_lr_ratio=ratio)
        assert all(math.isclose(nb08.reference_lr_schedule(s, max_lr, warmup, total, ratio), learning_rate(s, cfg),
                                rel_tol=1e-12, abs_tol=1e-15) for s in range(total + 10))


@pytest.mark.parametrize("bug, match", [
    ("zero-start", "the other convention in use, lr · t / W"),
    ("no-offset", "the cosine starts at step 0 instead of at the end of the warm-up"),
    ("to-zero", "the cosine ends at 0"),
    ("absolute-min", "the floor is min_lr_ratio itself"),
    ("full-period", "the learning rate comes back up"),
    ("linear", "the decay is a straight line"),
    ("late", "the floor is reached one step after the end"),
    ("past-end", "after total_steps the learning rate changes again"),
    ("tensor", "should return the learning rate as a float"),
    ("zero-span", r"lr_schedule\(5, 1.0, 5, 6, 0.1\) divided by zero"),
])
def test_lr_schedule_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_lr_schedule(make_lr(bug))


# ----------------------------------------------------------------------------- 8.5 clip_grad_norm


def make_clip(bug=None):
    def clip_grad_norm(parameters, max_norm):
        grads = [p.grad for p in parameters] if bug == "none-grad" else [p.grad for p in parameters if p.grad is not None]
        norms = [g.norm() for g in grads]
        total = sum(norms) if bug == "sum-norms" else torch.sqrt(sum(n**2 for n in norms))
        for g, n in zip(grads, norms):
            if bug == "per-param":
                factor = min(1.0, max_norm / (float(n) + 1e-6))
            elif bug == "always":
                factor = max_norm / (float(total) + 1e-6)
            else:
                factor = min(1.0, max_norm / (float(total) + 1e-6))
            if bug == "not-in-place":
                g = g * factor
            else:
                g.mul_(factor)
        if bug == "returns-clipped":
            return torch.sqrt(sum((g**2).sum() for g in grads))
        return None if bug == "returns-none" else total

    return clip_grad_norm


def test_clip_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_clip_grad_norm")["clip_grad_norm"], make_clip(), nb08.reference_clip_grad_norm):
        nb08.check_clip_grad_norm(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} gradient clipping: all checks passed") == 3


@pytest.mark.parametrize("bug, match", [
    ("per-param", "you clipped each parameter's gradient on its own"),
    ("always", "you rescaled a gradient whose norm was already below max_norm"),
    ("sum-norms", "the total norm is the sum of the parameters' norms"),
    ("not-in-place", "the parameters' .grad did not change"),
    ("returns-clipped", "you returned the norm after clipping"),
    ("returns-none", "return the total norm as a float or a tensor"),
    ("none-grad", "a parameter without a gradient"),
])
def test_clip_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_clip_grad_norm(make_clip(bug))


def test_clip_by_torch_is_refused():
    with pytest.raises(CheckFailure, match="you called .*clip_grad_norm_"):
        nb08.check_clip_grad_norm(lambda parameters, max_norm: torch.nn.utils.clip_grad_norm_(parameters, max_norm))


# ----------------------------------------------------------------------------- 8.6 train_loop


def make_loop(bug=None):
    """The reference loop with one mistake, called as a learner's train_loop would be."""

    def train_loop(model, optimizer, train_ids, generator, *, steps, batch_size, seq_len, max_lr, warmup_steps,
                   evaluate, eval_every, checkpoints, resume=False, until=None):
        options = dict(steps=steps, batch_size=batch_size, seq_len=seq_len, max_lr=max_lr, warmup_steps=warmup_steps,
                       evaluate=evaluate, eval_every=eval_every, checkpoints=checkpoints, resume=resume, until=until)
        if bug == "eval-steps":
            losses, evals = nb08._loop(model, optimizer, train_ids, generator, **options)
            return losses, [(s - 1, v) for s, v in evals]
        if bug == "train-mode-eval":
            def evaluate_in_training(m):
                m.train()
                return evaluate(m)
            options["evaluate"] = evaluate_in_training
            return nb08._loop(model, optimizer, train_ids, generator, **options)
        if bug == "no-checkpoint":
            class Nowhere:
                def store(self, state):
                    pass

                def restore(self):
                    return checkpoints.restore()

            options["checkpoints"] = Nowhere()
            return nb08._loop(model, optimizer, train_ids, generator, **options)
        if bug == "tensor-losses":
            nb08._loop(model, optimizer, train_ids, generator, **options)
            return None
        return nb08._loop(model, optimizer, train_ids, generator, **options, mistake=bug)

    return train_loop


def test_train_loop_reference_and_learner_solutions_pass(capsys):
    learner = solution("ex_train_loop", get_batch=nb08.reference_get_batch, cross_entropy=nb08.reference_cross_entropy,
                       lr_schedule=nb08.reference_lr_schedule, clip_grad_norm=nb08.reference_clip_grad_norm)["train_loop"]
    for fn in (learner, make_loop(), nb08.reference_train_loop):
        nb08.check_train_loop(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} training loop: all checks passed") == 3


@pytest.mark.parametrize("bug, match", [
    ("no-zero-grad", "the gradients pile up from step to step"),
    ("zero-after-backward", "cleared between backward and the optimizer's step"),
    ("constant-lr", "the learning rate never changed"),
    ("schedule-shift", "the schedule is one step ahead"),
    ("schedule-total", "the schedule was given the steps of this call instead of the run's"),
    ("no-clip", "the gradients were not clipped"),
    ("eval-steps", "the evaluations are recorded at the wrong steps"),
    ("train-mode-eval", "evaluate ran with the model in training mode"),
    ("eval-left", "still in evaluation mode"),
    ("eval-multiples-only", "the evaluations are recorded at the wrong steps"),
    ("no-checkpoint", "no checkpoint was stored"),
    ("resume-optimizer", "the optimizer's state"),
    ("resume-generator", "the generator's state was not stored or not restored"),
    ("resume-step", "the run started again from step 0"),
    ("resume-model", "the model's weights were not those of the checkpoint"),
    ("tensor-losses", "train_loop should return \\(losses, evals\\)"),
])
def test_train_loop_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_train_loop(make_loop(bug))


def test_the_loop_check_binds_the_reference_parts_and_puts_the_learners_back():
    def wrong_cross_entropy(logits, targets, ignore_index=-100):
        raise NotImplementedError

    namespace = {"cross_entropy": wrong_cross_entropy, "torch": torch}
    exec("def uses(): return cross_entropy", namespace)
    with nb08.parts_in(namespace["uses"]):
        assert namespace["uses"]() is nb08.reference_cross_entropy
    assert namespace["cross_entropy"] is wrong_cross_entropy and "get_batch" not in namespace


# ----------------------------------------------------------------------------- 8.7 greedy_generate


def make_greedy(bug=None):
    """A learner's greedy_generate, written the way the notebook asks, with one switch per mistake."""

    def greedy_generate(model, ids, max_new_tokens):
        if bug != "no-eval":
            model.eval()
        n_ctx = model.cfg.n_ctx
        out = ids
        for _ in range(max_new_tokens):
            source = ids if bug == "not-fed-back" else out
            context = {"no-crop": source, "crop-start": source[:, :n_ctx]}.get(bug, source[:, -n_ctx:])
            with torch.no_grad():
                logits = model(context)
            if bug == "first":
                next_id = logits[:, 0, :].argmax(dim=-1)
            elif bug == "axis":
                next_id = logits.argmax(dim=1)[:, -1]
            elif bug == "axis-batch":
                next_id = logits[:, -1, :].argmax(dim=0)
            elif bug == "sample":
                next_id = torch.multinomial(logits[:, -1, :].softmax(dim=-1), 1)[:, 0]
            else:
                next_id = logits[:, -1, :].argmax(dim=-1)
            if bug == "only-prompt":
                torch.cat([out, next_id[:, None]], dim=1)  # the result is dropped
            else:
                out = torch.cat([out, next_id[:, None]], dim=1)
        if bug == "only-new":
            return out[:, ids.shape[1]:]
        if bug == "float":
            return out.float()
        return out

    return greedy_generate


def rolling_window_greedy(model, ids, max_new_tokens):
    """A fixed-size context window updated in place: a view of the caller's prompt."""
    model.eval()
    window = ids[:, -model.cfg.n_ctx:]
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = model(window)[:, -1].argmax(dim=-1)
            window[:, :-1] = window[:, 1:].clone()  # slide left...
            window[:, -1] = next_id  # ... and write the new token into the prompt's memory
            new.append(next_id)
    return torch.cat([ids, torch.stack(new, dim=1)], dim=1)


def greedy_cropping_when_needed(model, ids, max_new_tokens):
    model.eval()
    for _ in range(max_new_tokens):
        context = ids if ids.shape[1] <= model.cfg.n_ctx else ids[:, ids.shape[1] - model.cfg.n_ctx:]
        with torch.no_grad():
            next_id = model(context)[:, -1:, :].argmax(dim=-1)  # batch 1
        ids = torch.cat((ids, next_id), dim=-1)
    return ids


def test_greedy_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_greedy")["greedy_generate"], make_greedy(), greedy_cropping_when_needed,
               lambda model, ids, n: generate(model, ids, n)):
        nb08.check_greedy_generate(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} greedy decoding: all checks passed") == 4


@pytest.mark.parametrize("bug, match", [
    ("first", "logits of the first position"),
    ("axis", "argmax over the positions"),
    ("axis-batch", "argmax over the last dim"),
    ("only-new", "only the new tokens"),
    ("only-prompt", "returned the prompt unchanged"),
    ("not-fed-back", "predicted from the prompt alone"),
    ("no-crop", "keep only its last model.cfg.n_ctx"),
    ("crop-start", "kept the first n_ctx tokens"),
    ("sample", "do not sample"),
    ("no-eval", "call model.eval\\(\\) first"),
    ("float", "do not convert to float"),
])
def test_greedy_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_greedy_generate(make_greedy(bug))


def test_greedy_that_writes_into_the_prompt_is_told():
    with pytest.raises(CheckFailure, match="changed the caller's `ids` in place"):
        nb08.check_greedy_generate(rolling_window_greedy)


def test_greedy_not_done():
    def greedy_generate(model, ids, max_new_tokens):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb08.check_greedy_generate(greedy_generate)


def test_the_greedy_checks_model_leaves_the_global_random_state_alone():
    before = torch.random.get_rng_state()
    nb08.make_greedy_model(0, dropout=0.5)
    assert torch.equal(torch.random.get_rng_state(), before)


# ----------------------------------------------------------------------------- 8.8 sample_next


def make_sample(bug=None):
    def sample_next(logits, temperature, generator):
        if temperature == 0 and bug != "divide-by-zero":
            return logits.argmax(-1)
        if bug == "argmax":
            return logits.argmax(-1)
        scaled = {"multiplied": lambda: logits * temperature, "ignored": lambda: logits}.get(bug, lambda: logits / temperature)()
        probs = torch.softmax(scaled, -1)
        if bug == "probs-divided":
            probs = torch.softmax(logits, -1) / temperature
            probs = probs / probs.sum(-1, keepdim=True)
        if bug == "naive-exp":
            probs = scaled.exp() / scaled.exp().sum(-1, keepdim=True)
        if bug == "global":
            return torch.multinomial(probs, 1).squeeze(-1)
        draws = torch.multinomial(probs, 1, generator=generator)
        return {"float": lambda: draws.squeeze(-1).float(), "column": lambda: draws}.get(bug, lambda: draws.squeeze(-1))()

    return sample_next


def test_sample_next_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_sample_next")["sample_next"], make_sample(), nb08.reference_sample_next):
        nb08.check_sample_next(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} sampling with a temperature: all checks passed") == 3


@pytest.mark.parametrize("bug, match", [
    ("multiplied", "the draws follow softmax\\(logits · T\\)"),
    ("ignored", "the draws follow softmax\\(logits\\) whatever the temperature"),
    ("probs-divided", "whatever the temperature"),
    ("argmax", "every draw was the most probable token"),
    ("divide-by-zero", "at temperature 0 the answer is the argmax"),
    ("global", "two calls with generators seeded alike drew different tokens"),
    ("naive-exp", "NaN or an error on logits around 1000"),
    ("float", "token ids are integers"),
    ("column", "one token id per row, a tensor of shape \\(batch,\\)"),
])
def test_sample_next_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_sample_next(make_sample(bug))


def test_the_sampling_check_tells_the_distributions_apart():
    rows = nb08.TS_ROW.float().repeat(4000, 1)
    for temperature in (0.5, 2.0):
        right = nb08.reference_sample_next(rows, temperature, torch.Generator().manual_seed(0)).numpy()
        assert nb08.sampling_problem(nb08.TS_ROW.tolist(), temperature, right) is None
        for wrong_t in (temperature * 1.5, temperature / 1.5):  # 50% off: caught
            wrong = nb08.reference_sample_next(rows, wrong_t, torch.Generator().manual_seed(0)).numpy()
            assert nb08.sampling_problem(nb08.TS_ROW.tolist(), temperature, wrong) is not None


# ----------------------------------------------------------------------------- 8.9 top_k_filter


def make_top_k(bug=None):
    def top_k_filter(logits, k):
        if bug == "plus-one":
            kth = torch.topk(logits, k + 1).values[..., -1:]
        elif bug == "smallest":
            kth = torch.topk(logits, k, largest=False).values[..., -1:]
            return logits.masked_fill(logits > kth, NEG_INF)
        elif bug == "one-row":
            kth = torch.topk(logits, k).values[-1]  # the k-th largest of a 1-D row; a batch's last row otherwise
        else:
            kth = torch.topk(logits, k).values[..., -1:]
        remove = logits <= kth if bug == "minus-one" else logits < kth
        if bug == "zero":
            return logits.masked_fill(remove, 0.0)
        if bug == "big-negative":
            return logits.masked_fill(remove, -1e9)
        if bug == "in-place":
            logits[remove] = NEG_INF
            return logits
        if bug == "probs-first":
            return logits.softmax(dim=-1).masked_fill(remove, 0.0)
        out = logits.masked_fill(remove, NEG_INF)
        return out.softmax(dim=-1) if bug == "softmax" else out

    return top_k_filter


def top_k_by_scatter(logits, k):
    """Exactly k tokens: ties at the k-th value are broken by torch.topk's order."""
    values, indices = torch.topk(logits, min(k, logits.shape[-1]))
    return torch.full_like(logits, NEG_INF).scatter(-1, indices, values)


def top_k_by_sort(logits, k):
    kth = logits.sort(dim=-1, descending=True).values[..., min(k, logits.shape[-1]) - 1, None]
    return torch.where(logits < kth, torch.tensor(NEG_INF), logits)


def test_top_k_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_top_k")["top_k_filter"], make_top_k(), top_k_by_sort, filter_top_k):
        nb08.check_top_k_filter(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} top-k filter: all checks passed") == 4


@pytest.mark.parametrize("fn, match", [
    (make_top_k("plus-one"), "kept k \\+ 1 tokens"),
    (make_top_k("minus-one"), "kept k - 1 tokens"),
    (make_top_k("smallest"), "kept the k smallest"),
    (make_top_k("softmax"), "returned probabilities \\(a softmax"),
    (make_top_k("probs-first"), "probabilities with the removed tokens set to 0"),
    (make_top_k("zero"), "set the removed logits to 0"),
    (make_top_k("big-negative"), "large negative number"),
    (make_top_k("in-place"), "changed the caller's `logits` in place"),
    (make_top_k("one-row"), "right on one row"),
    (top_k_by_scatter, "ties at the k-th largest"),
    (lambda logits, k: torch.topk(logits, k), "not torch.topk's \\(values, indices\\)"),
], ids=["plus-one", "minus-one", "smallest", "softmax", "probs-first", "zero", "big-negative", "in-place", "one-row",
        "ties", "tuple"])
def test_top_k_mistakes_are_named(fn, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_top_k_filter(fn)


def test_top_k_not_done():
    def top_k_filter(logits, k):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone):
        nb08.check_top_k_filter(top_k_filter)


# ----------------------------------------------------------------------------- 8.10 top_p_filter


def make_top_p(bug=None):
    def top_p_filter(logits, p):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=bug != "ascending")
        if bug == "exp-sum":  # the red team's softmax (issue 37): no max subtracted, NaN once a logit passes 88
            probs = sorted_logits.exp() / sorted_logits.exp().sum(dim=-1, keepdim=True)
        else:
            probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        if bug == "crossing":
            remove = cumulative > p
        elif bug == "no-keep-first":
            remove = cumulative > p
            remove[..., 1:] = remove[..., :-1].clone()  # shift right, but index 0 is never set back to False
        else:
            remove = cumulative - probs >= p
        if bug == "sorted-order":
            return sorted_logits.masked_fill(remove, NEG_INF)
        if bug == "unsorted-mask":
            return logits.masked_fill(remove, NEG_INF)
        if bug == "gather":
            back = remove.gather(-1, order)
        elif bug == "one-row":
            back = remove.scatter(0, order, remove)
        else:
            back = remove.scatter(-1, order, remove)
        if bug == "probs-no-renorm":
            return logits.softmax(dim=-1).masked_fill(back, 0.0)
        if bug == "in-place":
            return logits.masked_fill_(back, NEG_INF)
        if bug == "zero":
            return logits.masked_fill(back, 0.0)
        out = logits.masked_fill(back, NEG_INF)
        return out.softmax(dim=-1) if bug == "softmax" else out

    return top_p_filter


def top_p_transformers_style(logits, p):
    """transformers' TopPLogitsWarper: ascending sort, remove what the least likely tokens hold up to 1 - p."""
    sorted_logits, order = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= 1 - p
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


def top_p_old_transformers_style(logits, p):
    """transformers 4's descending version: remove past p, shifted right by one, the first always kept."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


def test_top_p_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_top_p")["top_p_filter"], make_top_p(), top_p_transformers_style,
               top_p_old_transformers_style, filter_top_p):
        nb08.check_top_p_filter(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} top-p (nucleus) filter: all checks passed") == 5


@pytest.mark.parametrize("bug, match", [
    ("crossing", "leaves out the token that carries the mass across p"),
    ("ascending", "sorted the tokens least likely first"),
    ("probs-no-renorm", "no longer sum to 1"),
    ("softmax", "returned probabilities \\(renormalised"),
    ("no-keep-first", "removed every token"),
    ("sorted-order", "in sorted order"),
    ("unsorted-mask", "applied the mask, which is in sorted order"),
    ("gather", "moved the mask back with gather"),
    ("zero", "set the removed logits to 0"),
    ("in-place", "changed the caller's `logits` in place"),
    ("one-row", "right on one row"),
    ("exp-sum", "overflows once x passes about 88"),
])
def test_top_p_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_top_p_filter(make_top_p(bug))


def test_top_p_not_done():
    def top_p_filter(logits, p):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone):
        nb08.check_top_p_filter(top_p_filter)


def test_the_checkers_p_values_lie_clear_of_every_cumulative_sum():
    for seed, shape, p in nb08.TOP_P_CALLS:
        assert nb08.top_p_margin(nb08.top_p_logits(seed, *shape), p) > 5e-4, (seed, p)
    seed, shape, p = nb08.TOP_P_CONFIDENT
    logits = nb08.top_p_logits(seed, *shape) + nb08.CONFIDENT_OFFSET
    assert nb08.top_p_margin(logits, p) > 5e-4 and (nb08.filter_top_p(logits, p).isinf().sum(-1) > 0).all()
    assert (nb08.filter_top_p(logits, p).isfinite().sum(-1) > 1).any()  # a nucleus of several tokens, not only the top one


# ----------------------------------------------------------------------------- 8.11 beam_search


def make_beam(bug=None):
    """A learner's beam_search, beams kept as a list of (score, tokens) pairs, one switch per mistake."""

    def beam_search(model, ids, max_new_tokens, num_beams):
        if bug != "no-eval":
            model.eval()
        n_ctx, rows = model.cfg.n_ctx, []
        for prompt in ids.tolist():
            width = num_beams if bug in ("copies", "parent") else 1
            beams = [(0.0 if bug == "copies" or i == 0 else NEG_INF, list(prompt)) for i in range(width)]
            for _ in range(max_new_tokens):
                seqs = torch.tensor([tokens for _, tokens in beams])
                context = {"no-crop": seqs, "crop-start": seqs[:, :n_ctx]}.get(bug, seqs[:, -n_ctx:])
                with torch.no_grad():
                    logits = model(context)[:, -1]
                step = {"logits": logits, "probs": logits.softmax(-1)}.get(bug, logits.log_softmax(-1))
                scores = torch.tensor([score for score, _ in beams])
                if bug == "per-beam-best":  # each beam's own best token
                    values, tokens = step.max(dim=-1)
                    totals = scores + values
                    order = totals.argsort(descending=True)[:num_beams]
                    beams = [(float(totals[i]), beams[i][1] + [int(tokens[i])]) for i in order]
                    continue
                if bug == "sample":
                    flat = torch.multinomial(step.flatten().softmax(-1), num_beams)
                    values = (scores[:, None] + step).flatten()[flat]
                else:
                    totals = step if bug == "not-summed" else scores[:, None] + step
                    values, flat = totals.flatten().topk(num_beams)
                parents, tokens = (flat // step.shape[-1]).tolist(), (flat % step.shape[-1]).tolist()
                if bug == "parent":
                    beams = [(float(v), beams[i][1] + [t]) for i, (v, t) in enumerate(zip(values, tokens))]
                else:
                    beams = [(float(v), beams[b][1] + [t]) for v, b, t in zip(values, parents, tokens)]
            if bug == "all":
                rows.extend(tokens for _, tokens in beams)
            else:
                rows.append(beams[-1 if bug == "worst" else 0][1])
        out = torch.tensor(rows, dtype=ids.dtype)
        if bug == "only-new":
            return out[:, ids.shape[1]:]
        return out.float() if bug == "float" else out

    return beam_search


def beam_growing_the_prompt(model, ids, max_new_tokens, num_beams):
    """One beam, kept by writing the last tokens into the caller's prompt as it goes."""
    model.eval()
    out = ids
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = torch.cat([out, model(out[:, -model.cfg.n_ctx:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    ids[:] = out[:, -ids.shape[1]:]  # the window slid over the prompt's own memory
    return out


def test_beam_reference_and_learner_solutions_pass(capsys):
    for fn in (solution("ex_beam_search")["beam_search"], make_beam(), nb08.reference_beam_search):
        nb08.check_beam_search(fn)
    assert capsys.readouterr().out.count("\N{CHECK MARK} beam search: all checks passed") == 3


@pytest.mark.parametrize("bug, match", [
    ("logits", "added up raw logits"),
    ("probs", "added up probabilities"),
    ("not-summed", "by its newest token alone"),
    ("per-beam-best", "returned the greedy continuation"),
    ("copies", "returned the greedy continuation"),
    ("parent", "not onto the beam it was scored from"),
    ("worst", "least probable of the final beams"),
    ("only-new", "only the new tokens"),
    ("all", "every final beam"),
    ("no-crop", "outgrew the model's context"),
    ("crop-start", "kept the first n_ctx tokens"),
    ("sample", "do not sample"),
    ("no-eval", "call model.eval\\(\\) first"),
    ("float", "token ids are integers"),
])
def test_beam_mistakes_are_named(bug, match):
    with pytest.raises(CheckFailure, match=match):
        nb08.check_beam_search(make_beam(bug))


def test_beam_that_writes_into_the_prompt_is_told():
    with pytest.raises(CheckFailure, match="changed the caller's `ids` in place"):
        nb08.check_beam_search(beam_growing_the_prompt)


def test_beam_not_done():
    def beam_search(model, ids, max_new_tokens, num_beams):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb08.check_beam_search(beam_search)


def test_the_beam_checks_calls_tell_every_mistake_from_the_reference_and_beat_greedy():
    model = nb08.make_greedy_model(nb08.BEAM_MODEL_SEED)
    for seed, batch, pos, new, beams in nb08.BEAM_CALLS:
        ids = nb08._greedy_prompt(seed, batch, pos, model.cfg.d_vocab)
        expected = nb08.reference_beam_search(model, ids, new, beams)
        assert torch.equal(nb08._beam_variant(model, ids, new, beams), expected)  # the variants' common path is right
        same = [hint for hint, wrong in nb08._beam_mistakes(model, ids, new, beams).items()
                if wrong.shape == expected.shape and torch.equal(wrong, expected)]
        assert same == ([nb08.HINT_BEAM_CROP_START] if pos + new <= nb08.GREEDY_N_CTX else []), (seed, same)
        outputs = list(nb08._beam_mistakes(model, ids, new, beams).values())
        assert not any(a.shape == b.shape and torch.equal(a, b) for i, a in enumerate(outputs) for b in outputs[i + 1:])
        assert (sequence_logprob(model, expected, pos) > sequence_logprob(model, generate(model, ids, new), pos)).any()


def test_the_solutions_beam_search_is_transformers_beam_search_on_the_course_gpt():
    """Issue 40: the learner's beam search (the notebook's solution) writes what transformers' generate writes."""
    from tfedu.checkpoints import hf_from_gpt
    from tfedu.experiments import course_gpt

    course, tok = course_gpt.load()
    hf = hf_from_gpt(course)
    mine = solution("ex_beam_search")["beam_search"]
    for text, num_beams in (("The for statement", 4), ("A class definition", 3), ("If the value of", 5)):
        ids = torch.tensor([tok.encode(text)])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, num_beams=num_beams,
                             do_sample=False)
        assert torch.equal(mine(course, ids, 12, num_beams), theirs), text


# ----------------------------------------------------------------------------- probes

GOOD = {
    "check_get_batch": [solution("ex_get_batch"), {"get_batch": make_get_batch()}, {"get_batch": nb08.reference_get_batch}],
    "check_cross_entropy": [solution("ex_cross_entropy"), {"cross_entropy": make_cross_entropy()}],
    "check_adamw_step": [solution("ex_adamw_step"), {"adamw_step": make_adamw()}],
    "check_lr_schedule": [solution("ex_lr_schedule"), {"lr_schedule": make_lr()}],
    "check_clip_grad_norm": [solution("ex_clip_grad_norm"), {"clip_grad_norm": make_clip()}],
    "check_train_loop": [{"train_loop": make_loop()}],
    "check_greedy": [solution("ex_greedy"), {"greedy_generate": greedy_cropping_when_needed}],
    "check_sample_next": [solution("ex_sample_next"), {"sample_next": make_sample()}],
    "check_top_k": [solution("ex_top_k"), {"top_k_filter": top_k_by_sort}],
    "check_top_p": [solution("ex_top_p"), {"top_p_filter": top_p_transformers_style},
                    {"top_p_filter": top_p_old_transformers_style}],
    "check_beam_search": [solution("ex_beam_search"), {"beam_search": make_beam()}],
}
BAD = [  # (probe, namespace, a fragment of the feedback)
    ("check_get_batch", {"get_batch": make_get_batch("no-last")}, "never came up"),
    ("check_get_batch", {"get_batch": make_get_batch("global")}, "generators seeded alike"),
    ("check_get_batch", {"get_batch": make_get_batch("same")}, "y equals x"),
    ("check_get_batch", {"get_batch": make_get_batch("whole-window")}, "seq_len + 1 columns"),
    ("check_get_batch", {"get_batch": make_get_batch("one-start")}, "the same window"),
    ("check_cross_entropy", {"cross_entropy": make_cross_entropy("no-shift")}, "overflows"),
    ("check_cross_entropy", {"cross_entropy": make_cross_entropy("log-softmax-naive")}, "underflowed"),
    ("check_cross_entropy", {"cross_entropy": make_cross_entropy("ignored-counted")}, "still count in the mean"),
    ("check_cross_entropy", {"cross_entropy": make_cross_entropy("sum")}, "the sum over the positions"),
    ("check_cross_entropy", {"cross_entropy": make_cross_entropy("fixed-index")}, "use the ignore_index argument"),
    ("check_cross_entropy", {"cross_entropy": make_cross_entropy("not-scalar")}, "one number"),
    ("check_cross_entropy", {"cross_entropy": make_cross_entropy("detached")}, "no gradient flows back"),
    ("check_adamw_step", {"adamw_step": make_adamw("l2")}, "weight decay to the gradient"),
    ("check_adamw_step", {"adamw_step": make_adamw("no-correction")}, "no bias correction"),
    ("check_adamw_step", {"adamw_step": make_adamw("eps-inside")}, "eps is inside"),
    ("check_adamw_step", {"adamw_step": make_adamw("in-place")}, "changed its input in place"),
    ("check_adamw_step", {"adamw_step": make_adamw("tuple2")}, "three tensors"),
    ("check_lr_schedule", {"lr_schedule": make_lr("zero-start")}, "lr · t / W"),
    ("check_lr_schedule", {"lr_schedule": make_lr("no-offset")}, "end of the warm-up"),
    ("check_lr_schedule", {"lr_schedule": make_lr("past-end")}, "after total_steps"),
    ("check_lr_schedule", {"lr_schedule": make_lr("tensor")}, "as a float"),
    ("check_clip_grad_norm", {"clip_grad_norm": make_clip("per-param")}, "on its own"),
    ("check_clip_grad_norm", {"clip_grad_norm": make_clip("always")}, "already below max_norm"),
    ("check_clip_grad_norm", {"clip_grad_norm": make_clip("not-in-place")}, "did not change"),
    ("check_clip_grad_norm", {"clip_grad_norm": make_clip("none-grad")}, "without a gradient"),
    ("check_train_loop", {"train_loop": make_loop("no-zero-grad")}, "pile up"),
    ("check_train_loop", {"train_loop": make_loop("schedule-total")}, "instead of the run's"),
    ("check_train_loop", {"train_loop": make_loop("no-checkpoint")}, "no checkpoint was stored"),
    ("check_train_loop", {"train_loop": make_loop("eval-left")}, "still in evaluation mode"),
    ("check_train_loop", {"train_loop": make_loop("eval-multiples-only")}, "recorded at the wrong steps"),
    ("check_train_loop", {"train_loop": make_loop("resume-optimizer")}, "the optimizer's state"),
    ("check_train_loop", {"train_loop": make_loop("resume-generator")}, "the generator's state"),
    ("check_greedy", {"greedy_generate": make_greedy("first")}, "first position"),
    ("check_greedy", {"greedy_generate": make_greedy("no-crop")}, "raised"),
    ("check_greedy", {"greedy_generate": make_greedy("crop-start")}, "kept the first n_ctx"),
    ("check_greedy", {"greedy_generate": make_greedy("only-new")}, "only the new tokens"),
    ("check_greedy", {"greedy_generate": make_greedy("not-fed-back")}, "prompt alone"),
    ("check_greedy", {"greedy_generate": make_greedy("sample")}, "do not sample"),
    ("check_greedy", {"greedy_generate": make_greedy("no-eval")}, "model.eval()"),
    ("check_greedy", {"greedy_generate": rolling_window_greedy}, "changed its input in place"),
    ("check_sample_next", {"sample_next": make_sample("multiplied")}, "softmax(logits · T)"),
    ("check_sample_next", {"sample_next": make_sample("argmax")}, "every draw was the most probable"),
    ("check_sample_next", {"sample_next": make_sample("divide-by-zero")}, "temperature 0"),
    ("check_sample_next", {"sample_next": make_sample("global")}, "seeded alike"),
    ("check_sample_next", {"sample_next": make_sample("naive-exp")}, "around 1000"),
    # k + 1 tokens: torch.topk(logits, k + 1) fails outright at k = d_vocab, one of the hidden test's calls
    ("check_top_k", {"top_k_filter": make_top_k("plus-one")}, "out of range"),
    ("check_top_k", {"top_k_filter": make_top_k("minus-one")}, "k - 1"),
    ("check_top_k", {"top_k_filter": make_top_k("smallest")}, "k smallest"),
    ("check_top_k", {"top_k_filter": make_top_k("zero")}, "to 0"),
    ("check_top_k", {"top_k_filter": make_top_k("in-place")}, "changed its input in place"),
    ("check_top_k", {"top_k_filter": top_k_by_scatter}, "ties"),
    ("check_top_p", {"top_p_filter": make_top_p("crossing")}, "across p"),
    ("check_top_p", {"top_p_filter": make_top_p("exp-sum")}, "overflows once x passes about 88"),
    ("check_top_p", {"top_p_filter": make_top_p("ascending")}, "least likely first"),
    ("check_top_p", {"top_p_filter": make_top_p("no-keep-first")}, "removed every token"),
    ("check_top_p", {"top_p_filter": make_top_p("gather")}, "gather"),
    ("check_top_p", {"top_p_filter": make_top_p("softmax")}, "probabilities"),
    ("check_beam_search", {"beam_search": make_beam("logits")}, "raw logits"),
    ("check_beam_search", {"beam_search": make_beam("not-summed")}, "newest token alone"),
    ("check_beam_search", {"beam_search": make_beam("copies")}, "greedy continuation"),
    ("check_beam_search", {"beam_search": make_beam("parent")}, "same rank"),
    ("check_beam_search", {"beam_search": make_beam("worst")}, "least probable"),
    ("check_beam_search", {"beam_search": make_beam("no-crop")}, "raised"),
    ("check_beam_search", {"beam_search": make_beam("crop-start")}, "kept the first n_ctx"),
    ("check_beam_search", {"beam_search": make_beam("no-eval")}, "model.eval()"),
    ("check_beam_search", {"beam_search": make_beam("sample")}, "do not sample"),
    ("check_beam_search", {"beam_search": beam_growing_the_prompt}, "changed its input in place"),
]


def verdict(probe, namespace, seed):
    try:
        outputs, expected = run_probe(probe, namespace, seed)
    except Exception as err:  # in the grader, an exception in the kernel scores zero too
        return f"raised {type(err).__name__}: {err}"
    return probe.compare(outputs, expected)


def test_every_check_cell_has_a_probe():
    assert set(nb08.PROBES) == set(GOOD) == {"check_get_batch", "check_cross_entropy", "check_adamw_step", "check_lr_schedule",
                                             "check_clip_grad_norm", "check_train_loop", "check_greedy",
                                             "check_sample_next", "check_top_k", "check_top_p",
                                             "check_beam_search"}
    for grade_id, probe in nb08.PROBES.items():
        assert probe.exercise == grade_id.replace("check_", "ex_")
        assert probe.compare is not None
        assert "tfedu.generate" in probe.forbidden or "tfedu.train" in probe.forbidden


@pytest.mark.parametrize("grade_id", sorted(GOOD))
def test_probe_passes_the_reference_and_learner_solutions(grade_id):
    probe = nb08.PROBES[grade_id]
    for namespace in GOOD[grade_id]:
        for seed in range(4):
            assert verdict(probe, namespace, seed) is None, (grade_id, seed, namespace)


@pytest.mark.parametrize("grade_id, namespace, fragment", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_probe_feedback_names_the_mistake(grade_id, namespace, fragment):
    probe = nb08.PROBES[grade_id]
    for seed in range(3):
        feedback = verdict(probe, namespace, seed)
        assert feedback is not None and fragment in feedback, (seed, feedback)


def test_probe_code_leaves_no_helper_names_behind():
    for grade_id, probe in nb08.PROBES.items():
        namespace = GOOD[grade_id][0]
        scope = {**namespace, "inputs": probe.make_inputs(np.random.default_rng(0)), "np": np, "torch": torch}
        exec(probe.run, scope)
        assert {name for name in scope if name.startswith("_") and name != "__builtins__"} == set(), grade_id


def test_nothing_the_solutions_use_is_forbidden():
    for probe in nb08.PROBES.values():
        assert scan_answer(SOLUTIONS[probe.exercise], context=[NOTEBOOK_CONTEXT], forbidden=probe.forbidden) == []

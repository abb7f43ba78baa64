"""Checkers for notebooks/02_embeddings.ipynb.

Four exercises: the embedding look-up as a one-hot matrix product, the skip-gram
negative-sampling loss, one optimisation step of the training loop, and the CBOW loss. Each checker tries
the known mistakes first so its hint names the mistake.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tfedu.checks.building_blocks import ACTIVATIONS, ELEMENTARY
from tfedu.checks.core import CheckFailure, Hints, Probe, call_learner, checker, compare, expect, is_close, seeded_randn
from tfedu.checks.probes import CLEANUP, HELPERS, as_array, backward, compare_outputs, leaf, upstream_like
from tfedu.embeddings import SkipGram, cbow_loss, sgns_loss, sgns_step

# --------------------------------------------------------------------------- exercise 2.1: one-hot @ W_E

DTYPE_HINT = (
    "F.one_hot returns integers (torch.long) and a matrix product needs one dtype on both sides: "
    "convert the one-hot vectors to W_E's dtype (the tensor method .to takes a dtype) before multiplying"
)
D_VOCAB_HINT = (
    "your one-hot vectors have the wrong length: d_vocab is the number of rows of W_E, "
    "not one more than the largest id in the input; F.one_hot without num_classes guesses it from the ids, "
    "so pass the number of rows of W_E as num_classes"
)
TRANSPOSED_HINT = (
    "you picked columns of W_E instead of rows: W_E has shape (d_vocab, d_model), one row per word, "
    "so multiply the one-hot vectors by W_E as it is, with no transpose"
)
NUM_CLASSES_HINT = (
    "an id was not smaller than num_classes: one-hot vectors have d_vocab entries (the rows of W_E), not "
    "d_model (its columns)"
)
FLATTENED_HINT = (
    "keep the shape of ids: the result has the shape of ids with one more axis, d_model, at the end; "
    "F.one_hot works on ids of any shape, so there is no need to flatten them"
)
TENSOR_HINT = (
    "return a torch.Tensor, not a NumPy array: .numpy() leaves autograd, so no gradient could reach W_E"
)
LOOKUP_HINT = (
    "you indexed W_E directly (indexing it with the ids, or nn.Embedding); the values are right, but the "
    "exercise is to get them as a matrix product of the one-hot vectors with W_E"
)


def _call_embed(embed_via_one_hot: Any, ids: torch.Tensor, W_E: torch.Tensor) -> Any:
    try:
        return call_learner(embed_via_one_hot, ids, W_E, name="embed_via_one_hot")
    except CheckFailure as failure:
        text = str(failure)
        if "dtype" in text or "Long" in text or "same type" in text:
            raise CheckFailure(DTYPE_HINT) from None
        if "smaller than num_classes" in text:
            raise CheckFailure(NUM_CLASSES_HINT) from None
        if "shape" in text or "size" in text or "dimension" in text:
            # Does it work once the largest id is among the ids? Then it sized the one-hot from the ids.
            full = torch.cat([ids.flatten(), torch.tensor([W_E.shape[0] - 1])])
            try:
                fn_out = embed_via_one_hot(full, W_E)
            except Exception:
                raise failure from None
            if isinstance(fn_out, torch.Tensor) and fn_out.shape == (full.shape[0], W_E.shape[1]):
                raise CheckFailure(D_VOCAB_HINT) from None
        raise


def compare_loss_gradients(got: Any, expected: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
    """The learner's loss keeps its graph, and its gradient for each named input equals the reference's."""
    expect(isinstance(got, torch.Tensor) and got.requires_grad,
           "no gradient flows through your loss: keep it a torch tensor (no .item(), .detach() or numpy)")
    mine = torch.autograd.grad(got, tuple(inputs.values()))
    theirs = torch.autograd.grad(expected, tuple(inputs.values()))
    for name, a, b in zip(inputs, mine, theirs):
        compare(a, b, what=f"the gradient of the loss with respect to {name}")


@checker("embedding look-up as one_hot(ids) @ W_E")
def check_embed_via_one_hot(embed_via_one_hot) -> None:
    """Check ``embed_via_one_hot(ids, W_E)``: values, shapes, gradients, and that it is a product."""
    # A square W_E first, so reading columns instead of rows gives a same-shaped, wrong answer;
    # the ids leave out the largest id, so a one-hot sized from the ids is too short.
    W_sq = seeded_randn(0, 6, 6)
    ids = torch.tensor([[2, 0, 4], [4, 1, 3]])
    got = _call_embed(embed_via_one_hot, ids, W_sq)
    expect(not isinstance(got, np.ndarray), TENSOR_HINT)
    compare(got, W_sq[ids], what="embed_via_one_hot(ids, W_E) with ids of shape (2, 3) and W_E of shape (6, 6)",
            mistakes={TRANSPOSED_HINT: W_sq.T[ids], FLATTENED_HINT: W_sq[ids.flatten()]})
    # A tall W_E: more words than dimensions, the usual case.
    W_E = seeded_randn(1, 9, 4).requires_grad_(True)
    ids = torch.tensor([0, 8, 3, 3, 5])
    got = _call_embed(embed_via_one_hot, ids, W_E)
    compare(got, W_E.detach()[ids], what="embed_via_one_hot(ids, W_E) with W_E of shape (9, 4)")
    grad_fn = type(got.grad_fn).__name__ if got.grad_fn is not None else ""
    expect("Index" not in grad_fn and "Embedding" not in grad_fn, LOOKUP_HINT)
    expect(got.requires_grad, "no gradient can reach W_E through your result: do not detach W_E or use torch.no_grad()")
    upstream = seeded_randn(2, 5, 4)
    (got * upstream).sum().backward()
    expected_grad = torch.zeros(9, 4).index_add_(0, ids, upstream)
    compare(W_E.grad, expected_grad, what="the gradient of W_E (id 3 appears twice, so its row gets two contributions)")


# --------------------------------------------------------------------------- exercise 2.2: the SGNS loss

MISSING_MINUS_HINT = (
    "the negatives are pulled towards the center word instead of pushed away: their term is "
    "log sigma(-u_neg . v), with a minus inside the log-sigmoid"
)
SIGMOID_HINT = "you used sigma where the loss has log sigma: take F.logsigmoid of the scores"
BATCH_SUM_HINT = "the loss should be the mean over the batch (as the docstring says), not the sum"
NEG_MEAN_HINT = (
    "sum the k negative terms of each example; you averaged them "
    "(F.binary_cross_entropy_with_logits averages unless you pass reduction='sum')"
)
MEAN_OF_TERMS_HINT = (
    "you averaged over the k+1 terms of each example as well: add the positive term and the k negative "
    "terms, then take the mean over the batch only"
)
MINUS_OUTSIDE_HINT = (
    "log(1 - sigma(x)) equals log sigma(-x), not -log sigma(x): the minus goes inside the log-sigmoid "
    "of each negative score, and every term of the loss is a -log sigma(...)"
)
NEG_AXIS_HINT = (
    "each negative score u_wi . v_c is a dot product over d_model, the last axis of negatives, giving "
    "scores of shape (batch, k); you summed over the k axis instead"
)
NEG_CONTEXT_HINT = (
    "score each negative against the center vector v_c (u_wi . v_c), not against the context vector u_o"
)
SIGN_HINT = "you returned the log-likelihood, which training maximises; the loss to minimise is its negative"
NO_NEG_HINT = "your loss ignores the negatives: add - sum_i log sigma(-u_i . v) for the k negative samples"
LOSS_NUMBER_HINT = (
    "return the loss as a 0-d torch tensor, not a Python number (no .item() or float()): "
    "training needs to call .backward() on it"
)
STABILITY_HINT = (
    "NaN or Inf for large scores: the log of a sigmoid computed in two steps, log(sigma(x)), underflows "
    "to log(0) = -inf once x is below about -100 (float32); F.logsigmoid computes the same thing in one "
    "step, without underflow"
)
ONE_MINUS_HINT = (
    "NaN or Inf for large scores: you wrote log(1 - sigma(x)) for a negative's term; that is log sigma(-x), "
    "but in float32 sigma(x) rounds to exactly 1 once x is above about 17, so 1 - sigma(x) is 0 and its log "
    "is -inf; F.logsigmoid of the negated score computes the same thing without that rounding"
)
OUTER_PRODUCT_HINT = (
    "center @ context.T is a (batch, batch) matrix that scores every center against every context; the "
    "positive score is one dot product per pair, u_o . v_c for row i of each: multiply elementwise and "
    "sum over d_model, giving shape (batch,)"
)


def _sgns_parts(center: torch.Tensor, context: torch.Tensor, negatives: torch.Tensor):
    pos = (center * context).sum(-1)  # batch
    neg = torch.einsum("bkd,bd->bk", negatives, center)  # batch k
    return pos, neg


def sgns_loss_mistakes(center: torch.Tensor, context: torch.Tensor, negatives: torch.Tensor) -> dict[str, torch.Tensor]:
    """What each known mistake returns on these inputs, keyed by its hint."""
    pos, neg = _sgns_parts(center, context, negatives)
    ls = F.logsigmoid
    mistakes: dict[str, Any] = {
        MISSING_MINUS_HINT: (-ls(pos) - ls(neg).sum(-1)).mean(),
        SIGMOID_HINT: (-torch.sigmoid(pos) - torch.sigmoid(-neg).sum(-1)).mean(),
        BATCH_SUM_HINT: (-ls(pos) - ls(-neg).sum(-1)).sum(),
        NEG_MEAN_HINT: (-ls(pos) - ls(-neg).mean(-1)).mean(),
        SIGN_HINT: (ls(pos) + ls(-neg).sum(-1)).mean(),
        NO_NEG_HINT: (-ls(pos)).mean(),
        MEAN_OF_TERMS_HINT: ((-ls(pos) - ls(-neg).sum(-1)) / (neg.shape[-1] + 1)).mean(),
        MINUS_OUTSIDE_HINT: (-ls(pos) + ls(neg).sum(-1)).mean(),
        NEG_AXIS_HINT: (-ls(pos) - ls(-(negatives * center[:, None, :]).sum(1)).sum(-1)).mean(),
        NEG_CONTEXT_HINT: (-ls(pos) - ls(-_sgns_parts(context, context, negatives)[1]).sum(-1)).mean(),
    }
    return mistakes


def outer_product_variants(center: torch.Tensor, context: torch.Tensor, negatives: torch.Tensor) -> list[torch.Tensor]:
    """Losses made with center @ context.T, a (batch, batch) matrix, as the positive score."""
    _, neg = _sgns_parts(center, context, negatives)
    outer, neg_term = F.logsigmoid(center @ context.T), F.logsigmoid(-neg).sum(-1)  # batch batch; batch
    return [(-outer.mean(-1) - neg_term).mean(), (-outer.sum(-1) - neg_term).mean(),
            (-outer - neg_term).mean(), (-outer - neg_term[:, None]).mean()]


def _name_variants(got: Any, variants: list[torch.Tensor], expected: torch.Tensor, hint: str) -> None:
    """Fail with ``hint`` when ``got`` matches one of several outputs of one mistake."""
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and not is_close(got, expected):
        if any(is_close(got, wrong) and not is_close(wrong, expected) for wrong in variants):
            raise CheckFailure(hint)


def _stability_hint(loss_at: Any) -> str:
    """Which two-step log-sigmoid the learner wrote; ``loss_at(s)`` is their loss with scores of +-144 s."""
    try:
        moderate = loss_at(25.0 / 144.0)
    except Exception:
        return STABILITY_HINT
    if isinstance(moderate, torch.Tensor) and not torch.isfinite(moderate).all():
        return ONE_MINUS_HINT  # log(sigma(x)) is still finite at x = -25; log(1 - sigma(25)) is not
    return STABILITY_HINT


def _sgns_inputs(seed: int, batch: int = 4, k: int = 5, d_model: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (seeded_randn(seed, batch, d_model), seeded_randn(seed + 1, batch, d_model), seeded_randn(seed + 2, batch, k, d_model))


@checker("skip-gram negative-sampling loss")
def check_sgns_loss(sgns_loss_fn) -> None:
    """Check ``sgns_loss(center, context, negatives)``: value, reduction, gradients, stability."""
    center, context, negatives = _sgns_inputs(0)
    got = call_learner(sgns_loss_fn, center, context, negatives, name="sgns_loss")
    if isinstance(got, (float, int, np.floating)):
        raise CheckFailure(LOSS_NUMBER_HINT)
    if isinstance(got, torch.Tensor) and got.shape == (center.shape[0],):
        raise CheckFailure("return one number, a 0-d tensor: the mean over the batch of the per-example losses")
    expected = sgns_loss(center, context, negatives)
    _name_variants(got, outer_product_variants(center, context, negatives), expected, OUTER_PRODUCT_HINT)
    compare(got, expected, what="sgns_loss on a batch of 4 (k 5, d_model 3)",
            mistakes=sgns_loss_mistakes(center, context, negatives))
    # Another batch size, k and d_model, with gradients.
    center, context, negatives = (t.double().requires_grad_(True) for t in _sgns_inputs(10, batch=3, k=2, d_model=5))
    got = call_learner(sgns_loss_fn, center, context, negatives, name="sgns_loss")
    expected = sgns_loss(center, context, negatives)
    compare(got, expected, what="sgns_loss with batch 3, k 2, d_model 5 (float64)", mistakes=sgns_loss_mistakes(center, context, negatives))
    compare_loss_gradients(got, expected, {"center": center, "context": context, "negatives": negatives})
    # Large scores: one confident right answer and one confident wrong one.
    v = torch.tensor([[12.0, 0.0], [0.0, 12.0]])
    u = torch.tensor([[12.0, 0.0], [0.0, -12.0]])
    negs = torch.stack([-u, u], dim=1)  # 2 2 2
    got = call_learner(sgns_loss_fn, v, u, negs, name="sgns_loss")
    hint = None
    if isinstance(got, torch.Tensor) and got.is_floating_point() and not torch.isfinite(got).all():
        hint = _stability_hint(lambda scale: sgns_loss_fn(v, u * scale, negs * scale))
    compare(got, sgns_loss(v, u, negs), what="sgns_loss with scores of +-144", nan_hint=hint, rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------------- exercise 2.3: one training step

NO_ZERO_GRAD_HINT = (
    "the second step used the first step's gradients as well: PyTorch adds new gradients to old ones, "
    "so clear the optimizer's gradients (zero_grad) before you backpropagate the new loss"
)
NO_UPDATE_HINT = (
    "the parameters did not change: the optimizer's step uses the gradients that backward has just "
    "filled in, so the order is clear the old gradients, compute the loss, backpropagate it, and only "
    "then step"
)
FLOAT_HINT = (
    "return the loss as a plain Python float (the tensor's .item() gives it), not a tensor: a tensor would "
    "keep the whole graph of the step alive"
)
LOSS_AFTER_HINT = "return the loss computed before the update (the one you called backward on), not a fresh one"


def _step_setup(seed: int) -> tuple[SkipGram, tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    model = SkipGram(10, 4, generator=g)
    with torch.no_grad():
        model.context.weight.normal_(generator=g)  # so both tables get gradients at the first step
    first = (torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7]), torch.randint(0, 10, (4, 3), generator=g))
    second = (torch.tensor([4, 1, 8]), torch.tensor([9, 2, 1]), torch.randint(0, 10, (3, 3), generator=g))
    return model, first, second


def _clone(model: SkipGram) -> SkipGram:
    twin = SkipGram(model.d_vocab, model.center.embedding_dim)
    twin.load_state_dict(model.state_dict())
    return twin


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@checker("one SGNS training step")
def check_sgns_step(sgns_step_fn) -> None:
    """Check ``sgns_step(model, optimizer, centers, contexts, negatives)`` over two plain-SGD steps."""
    lr = 0.5
    learner_model, first, second = _step_setup(0)
    reference_model = _clone(learner_model)
    stale_model = _clone(learner_model)  # what forgetting zero_grad produces
    start = _params(learner_model)
    learner_opt = torch.optim.SGD(learner_model.parameters(), lr=lr)
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=lr)
    stale_opt = torch.optim.SGD(stale_model.parameters(), lr=lr)

    got = call_learner(sgns_step_fn, learner_model, learner_opt, *first, name="sgns_step")
    expected = sgns_step(reference_model, reference_opt, *first)
    stale_model(*first).backward()
    stale_opt.step()
    expect(not torch.equal(_params(learner_model), start), NO_UPDATE_HINT)
    expect(isinstance(got, float), FLOAT_HINT + f" (got {type(got).__name__})")
    if abs(got - expected) > 1e-5 and abs(got - reference_model(*first).item()) < 1e-5:
        raise CheckFailure(LOSS_AFTER_HINT)
    compare(torch.tensor(got), torch.tensor(expected), what="the loss returned by the first step", check_dtype=False)
    compare(_params(learner_model), _params(reference_model), what="the parameters after one step")

    got = call_learner(sgns_step_fn, learner_model, learner_opt, *second, name="sgns_step")
    expected = sgns_step(reference_model, reference_opt, *second)
    stale_model(*second).backward()  # no zero_grad: the first step's gradients are still there
    stale_opt.step()
    compare(_params(learner_model), _params(reference_model), what="the parameters after two steps",
            mistakes={NO_ZERO_GRAD_HINT: _params(stale_model)})
    compare(torch.tensor(got), torch.tensor(expected), what="the loss returned by the second step", check_dtype=False)


# --------------------------------------------------------------------------- exercise 2.4: the CBOW loss

CBOW_SUM_HINT = (
    "CBOW averages the context vectors: h is their mean, not their sum (a sum grows with the window, "
    "so the scores would too)"
)
CBOW_BATCH_AXIS_HINT = (
    "you averaged over the batch axis: h should be one vector per example, the mean over that "
    "example's context words (the middle axis of context)"
)
CBOW_AXIS_HINT = (
    "h should have shape (batch, d_model): average over the context words, the middle axis of context "
    "(dim 1); averaging over dim 0 (the batch) gives shape (2m, d_model) and over dim -1 (d_model) "
    "gives shape (batch, 2m)"
)
CBOW_DMODEL_AXIS_HINT = (
    "you averaged over d_model, the last axis of context: that turns each context vector into one number; "
    "average over the context words instead (dim 1), which keeps d_model"
)
CBOW_ALL_AXES_HINT = (
    "you averaged over every axis of context at once (context.mean() with no dim): h should be one "
    "vector per example, the mean over that example's context words (dim 1)"
)
CBOW_FIRST_WORD_HINT = (
    "h used only the first context word of each example; average all 2m context words (dim 1)"
)
CBOW_LOSS_PER_WORD_HINT = (
    "you averaged the losses of the context words, each scored on its own (that is skip-gram); CBOW first "
    "averages their vectors into one h, then scores h once"
)
CBOW_SUM_OF_LOSSES_HINT = (
    "you added up one skip-gram loss per context word; CBOW averages the context vectors into one h and "
    "computes a single loss from it"
)
CBOW_NEG_CENTER_HINT = (
    "score the negatives against h, the average of the context vectors; you scored them against the "
    "center word's vector"
)
CBOW_PER_EXAMPLE_HINT = "return one number, a 0-d tensor: the mean over the batch of the per-example losses"


def cbow_loss_mistakes(context: torch.Tensor, center: torch.Tensor, negatives: torch.Tensor) -> dict[str, torch.Tensor]:
    """What each known CBOW mistake returns on these inputs, keyed by its hint."""
    h = context.mean(1)
    per_word = [sgns_loss(context[:, j], center, negatives) for j in range(context.shape[1])]
    mistakes = {
        CBOW_SUM_HINT: sgns_loss(context.sum(1), center, negatives),
        CBOW_LOSS_PER_WORD_HINT: torch.stack(per_word).mean(),
        CBOW_SUM_OF_LOSSES_HINT: torch.stack(per_word).sum(),
        CBOW_NEG_CENTER_HINT: (-F.logsigmoid((h * center).sum(-1))
                               - F.logsigmoid(-torch.einsum("bkd,bd->bk", negatives, center)).sum(-1)).mean(),
    }
    if context.shape[0] == context.shape[1]:  # averaging over the batch axis gives a same-shaped h
        mistakes[CBOW_BATCH_AXIS_HINT] = sgns_loss(context.mean(0), center, negatives)
    if context.shape[1] == context.shape[2]:  # so does averaging over d_model
        mistakes[CBOW_DMODEL_AXIS_HINT] = sgns_loss(context.mean(-1), center, negatives)
    mistakes[CBOW_ALL_AXES_HINT] = sgns_loss(context.mean().expand_as(center), center, negatives)
    mistakes[CBOW_FIRST_WORD_HINT] = sgns_loss(context[:, 0], center, negatives)
    for hint, wrong in sgns_loss_mistakes(h, center, negatives).items():
        mistakes.setdefault(hint, wrong)  # the SGNS slips, made after a correct average
    return mistakes


def cbow_axis_variants(context: torch.Tensor, center: torch.Tensor, negatives: torch.Tensor) -> list[torch.Tensor]:
    """Losses whose h averaged over d_model and was then broadcast back to shape (batch, d_model)."""
    per_word = context.mean(-1, keepdim=True)  # batch 2m 1: one number per context vector
    return [sgns_loss(per_word.mean(1).expand_as(center), center, negatives),
            sgns_loss(per_word[:, 0].expand_as(center), center, negatives)]


@checker("CBOW loss")
def check_cbow_loss(cbow_loss_fn) -> None:
    """Check ``cbow_loss(context, center, negatives)``: the average, the loss, gradients, stability."""
    # batch = 2m = 4 and d_model = 3: averaging over the wrong axis gives a same-shaped or a failing h.
    context, center, negatives = seeded_randn(20, 4, 4, 3), seeded_randn(21, 4, 3), seeded_randn(22, 4, 5, 3)
    got = call_learner(cbow_loss_fn, context, center, negatives, name="cbow_loss", error_hint=CBOW_AXIS_HINT)
    if isinstance(got, (float, int, np.floating)):
        raise CheckFailure(LOSS_NUMBER_HINT)
    if isinstance(got, torch.Tensor) and got.shape == (context.shape[0],):
        raise CheckFailure(CBOW_PER_EXAMPLE_HINT)
    expected = cbow_loss(context, center, negatives)
    _name_variants(got, cbow_axis_variants(context, center, negatives), expected, CBOW_DMODEL_AXIS_HINT)
    compare(got, expected, what="cbow_loss on a batch of 4 (2m 4, k 5, d_model 3)",
            mistakes=cbow_loss_mistakes(context, center, negatives))
    # Another shape, float64, with gradients.
    context, center, negatives = (t.double().requires_grad_(True)
                                  for t in (seeded_randn(30, 3, 2, 5), seeded_randn(31, 3, 5), seeded_randn(32, 3, 2, 5)))
    got = call_learner(cbow_loss_fn, context, center, negatives, name="cbow_loss", error_hint=CBOW_AXIS_HINT)
    expected = cbow_loss(context, center, negatives)
    compare(got, expected, what="cbow_loss with batch 3, 2m = 2, k 2, d_model 5 (float64)",
            mistakes=cbow_loss_mistakes(context, center, negatives))
    compare_loss_gradients(got, expected, {"context": context, "center": center, "negatives": negatives})
    # Large scores stay finite.
    context = torch.tensor([[[12.0, 0.0], [12.0, 0.0]], [[0.0, 12.0], [0.0, 12.0]]])
    center = torch.tensor([[12.0, 0.0], [0.0, -12.0]])
    negatives = torch.stack([-center, center], dim=1)
    got = call_learner(cbow_loss_fn, context, center, negatives, name="cbow_loss")
    hint = None
    if isinstance(got, torch.Tensor) and got.is_floating_point() and not torch.isfinite(got).all():
        hint = _stability_hint(lambda scale: cbow_loss_fn(context, center * scale, negatives * scale))
    compare(got, cbow_loss(context, center, negatives), what="cbow_loss with scores of +-144", nan_hint=hint,
            rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------------- probes for the autograder


def _embed_inputs(rng: np.random.Generator) -> dict:
    d_vocab, d_model = int(rng.integers(3, 12)), int(rng.integers(2, 7))
    ids = rng.integers(0, d_vocab, size=tuple(int(n) for n in rng.integers(1, 6, size=int(rng.integers(1, 4))))).astype(np.int64)
    return {"ids": ids, "W_E": rng.standard_normal((d_vocab, d_model)).astype(np.float32),
            "upstream": upstream_like(rng, (*ids.shape, d_model))}


EMBED_RUN = HELPERS + """\
_W_E = torch.tensor(inputs['W_E'], requires_grad=True)
_result = embed_via_one_hot(torch.tensor(inputs['ids']), _W_E.clone())
outputs = {
    'returned': [_kind(_result)], 'y': _array(_result),
    'graph': type(_result.grad_fn).__name__ if isinstance(_result, torch.Tensor) and _result.grad_fn is not None else '',
    'grad': _backward([_result], [torch.from_numpy(inputs['upstream'])], {'W_E': _W_E}),
}
del _W_E, _result
""" + CLEANUP


def _embed_reference(inputs: dict) -> dict:
    W_E = leaf(inputs["W_E"])
    y = W_E[torch.from_numpy(inputs["ids"])]
    return {"returned": ["tensor"], "y": as_array(y), "grad": backward([y], [torch.from_numpy(inputs["upstream"])], {"W_E": W_E})}


def _compare_embed(outputs: dict, expected: dict) -> str | None:
    graph = str(outputs.get("graph", "")) if isinstance(outputs, dict) else ""
    if "Index" in graph or "Embedding" in graph:
        return LOOKUP_HINT
    return compare_outputs(outputs, expected, function="embed_via_one_hot", labels={"y": "embed_via_one_hot(ids, W_E)"},
                           kind_hints={"ndarray": TENSOR_HINT})


def _large_scores(rng: np.random.Generator, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A positive vector and a negative one scoring about -+(200 to 1000) against ``h``.

    log(sigma(x)) in two steps is -inf there (sigma rounds to 0, or 1 - sigma to 0); F.logsigmoid is finite.
    """
    norm = float(h @ h) or 1.0
    positive = -h * np.float32(rng.uniform(200.0, 1000.0) / norm)
    negative = h * np.float32(rng.uniform(200.0, 1000.0) / norm)
    return positive.astype(np.float32), negative.astype(np.float32)


def _loss_inputs(rng: np.random.Generator) -> dict:
    batch, k, d_model = int(rng.integers(1, 7)), int(rng.integers(1, 8)), int(rng.integers(2, 9))
    def draw(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 1.5).astype(np.float32)
    center, context, negatives = draw(batch, d_model), draw(batch, d_model), draw(batch, k, d_model)
    context[0], negatives[0, 0] = _large_scores(rng, center[0])  # example 0: confident and wrong
    return {"center": center, "context": context, "negatives": negatives, "upstream": float(rng.standard_normal())}


LOSS_NAMES = ("center", "context", "negatives")


# The loss goes out as a Python float when it is one number (a 0-d array does not survive every
# exchange format: np.ascontiguousarray makes it 1-d); anything else as an array, whose shape the
# comparison then names. The upstream gradient is a float too, for the same reason. $function and
# $names stand for the learner's function and the names of its inputs.
LOSS_RUN_CODE = """\
_leaves = {_name: torch.tensor(inputs[_name], requires_grad=True) for _name in $names}
_result = $function(*(_t.clone() for _t in _leaves.values()))
_scalar = isinstance(_result, torch.Tensor) and _result.dim() == 0 and _result.is_floating_point()
outputs = {'returned': [_kind(_result)], 'loss': float(_result.detach()) if _scalar else _array(_result),
           'grad': _backward([_result], [torch.tensor(float(inputs['upstream']))], _leaves)}
del _leaves, _result, _scalar
"""


def _loss_run(function: str, names: tuple[str, ...]) -> str:
    return HELPERS + LOSS_RUN_CODE.replace("$names", repr(names)).replace("$function", function) + CLEANUP


def _loss_reference(inputs: dict, loss_fn: Any = sgns_loss, names: tuple[str, ...] = LOSS_NAMES) -> dict:
    leaves = {name: leaf(inputs[name]) for name in names}
    loss = loss_fn(*leaves.values())
    return {"returned": ["tensor"], "loss": loss.item(),
            "grad": backward([loss], [torch.tensor(float(inputs["upstream"]))], leaves)}


def _compare_loss(outputs: dict, expected: dict, *, function: str) -> str | None:
    return compare_outputs(
        outputs, expected, function=function,
        labels={"loss": f"the loss of {function} (one number, a 0-d tensor: the mean over the batch)"},
        nan_hints={"loss": "the hidden test scores some pairs at about +-1e3, where log(sigmoid(x)) in two steps is "
                           "log(0) = -inf; F.logsigmoid is finite there"},
        kind_hints={"float": LOSS_NUMBER_HINT},
    )


def _step_inputs(rng: np.random.Generator) -> dict:
    d_vocab, d_model, k = int(rng.integers(4, 12)), int(rng.integers(2, 6)), int(rng.integers(1, 5))
    batches = [int(rng.integers(1, 6)) for _ in range(2)]
    return {
        "center": (rng.standard_normal((d_vocab, d_model)) * 0.5).astype(np.float32),
        "context": (rng.standard_normal((d_vocab, d_model)) * 0.5).astype(np.float32),
        "lr": float(rng.uniform(0.05, 1.0)),
        "batches": [
            {
                "centers": rng.integers(0, d_vocab, size=b).astype(np.int64),
                "contexts": rng.integers(0, d_vocab, size=b).astype(np.int64),
                "negatives": rng.integers(0, d_vocab, size=(b, k)).astype(np.int64),
            }
            for b in batches
        ],
    }


def _step_reference(inputs: dict) -> dict:
    center, context = torch.from_numpy(inputs["center"]), torch.from_numpy(inputs["context"])
    model = SkipGram(*center.shape, generator=torch.Generator())  # weights overwritten below
    with torch.no_grad():
        model.center.weight.copy_(center)
        model.context.weight.copy_(context)
    optimizer = torch.optim.SGD(model.parameters(), lr=inputs["lr"])
    losses = [
        sgns_step(model, optimizer, *(torch.from_numpy(batch[name]) for name in ("centers", "contexts", "negatives")))
        for batch in inputs["batches"]
    ]
    return {"returned": ["float"] * len(losses), "losses": losses,
            "center": model.center.weight.detach().numpy(), "context": model.context.weight.detach().numpy()}


# The step probe builds its own two-table model in plain torch, so nothing from tfedu.embeddings runs
# while the learner's code does (the grader's tripwire watches that module).
STEP_PROBE_RUN = HELPERS + """
class _ProbeSkipGram(torch.nn.Module):
    def __init__(self, center, context):
        super().__init__()
        self.center = torch.nn.Embedding.from_pretrained(torch.from_numpy(center).clone(), freeze=False)
        self.context = torch.nn.Embedding.from_pretrained(torch.from_numpy(context).clone(), freeze=False)

    def forward(self, centers, contexts, negatives):
        v = self.center(centers)
        pos = (v * self.context(contexts)).sum(-1)
        neg = (self.context(negatives) @ v.unsqueeze(-1)).squeeze(-1)
        logsig = torch.nn.functional.logsigmoid
        return -(logsig(pos) + logsig(-neg).sum(-1)).mean()

_probe_model = _ProbeSkipGram(inputs["center"], inputs["context"])
_probe_opt = torch.optim.SGD(_probe_model.parameters(), lr=float(inputs["lr"]))
_probe_losses, _probe_kinds = [], []
for _probe_batch in inputs["batches"]:
    _probe_ids = [torch.from_numpy(np.asarray(_probe_batch[name], dtype=np.int64)) for name in ("centers", "contexts", "negatives")]
    _probe_loss = sgns_step(_probe_model, _probe_opt, *_probe_ids)
    _probe_kinds.append(_kind(_probe_loss))
    _probe_losses.append(float(_probe_loss.detach() if isinstance(_probe_loss, torch.Tensor) else _probe_loss))
outputs = {
    "returned": _probe_kinds,
    "losses": _probe_losses,
    "center": _probe_model.center.weight.detach().numpy(),
    "context": _probe_model.context.weight.detach().numpy(),
}
""" + CLEANUP

def _cbow_inputs(rng: np.random.Generator) -> dict:
    batch, two_window, k, d_model = int(rng.integers(1, 6)), 2 * int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(2, 7))
    def draw(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 1.5).astype(np.float32)
    context, center, negatives = draw(batch, two_window, d_model), draw(batch, d_model), draw(batch, k, d_model)
    center[0], negatives[0, 0] = _large_scores(rng, context[0].mean(axis=0))  # example 0: confident and wrong
    return {"context": context, "center": center, "negatives": negatives, "upstream": float(rng.standard_normal())}


CBOW_NAMES = ("context", "center", "negatives")

# Exercise 2.4 may call the learner's sgns_loss from 2.2 ("your sgns_loss may do the second half").
# While 2.4 is graded this stand-in takes its place, so a wrong 2.2 costs 2.2 alone.
SGNS_STANDIN = """\
def sgns_loss(center, context, negatives):
    \"\"\"Stand-in for exercise 2.2: mean over the batch of -log sigma(u_o . v_c) - sum_i log sigma(-u_wi . v_c).\"\"\"
    positive = (center * context).sum(-1)
    negative = (negatives @ center.unsqueeze(-1)).squeeze(-1)
    return -(F.logsigmoid(positive) + F.logsigmoid(-negative).sum(-1)).mean()
"""

PROBES = {
    "check_embed_via_one_hot": Probe(
        builds=ELEMENTARY | {"torch.nn.functional.one_hot"},
        exercise="ex_embed_via_one_hot",
        make_inputs=_embed_inputs,
        run=EMBED_RUN,
        reference=_embed_reference,
        compare=_compare_embed,
        # The exercise rules out the look-up itself (W_E[ids] shows in the autograd graph, see
        # _compare_embed): F.embedding, and nn.Embedding, a class, through the module it lives in.
        forbidden=("tfedu.embeddings", "torch.nn.functional.embedding", "torch.embedding", "torch.nn.Embedding",
                   "torch.nn.modules.sparse"),
    ),
    "check_sgns_loss": Probe(
        builds=ELEMENTARY | ACTIVATIONS,
        exercise="ex_sgns_loss",
        make_inputs=_loss_inputs,
        run=_loss_run("sgns_loss", LOSS_NAMES),
        reference=_loss_reference,
        compare=lambda outputs, expected: _compare_loss(outputs, expected, function="sgns_loss"),
        forbidden=("tfedu.embeddings",),
    ),
    "check_sgns_step": Probe(
        exercise="ex_sgns_step",
        make_inputs=_step_inputs,
        run=STEP_PROBE_RUN,
        reference=_step_reference,
        compare=lambda outputs, expected: compare_outputs(
            outputs, expected, function="sgns_step", labels={"losses": "the losses sgns_step returned",
                                                              "center": "the center table after the steps",
                                                              "context": "the context table after the steps"},
            kind_hints={"tensor": FLOAT_HINT}),
        forbidden=("tfedu.embeddings",),
    ),
    "check_cbow_loss": Probe(
        builds=ELEMENTARY | ACTIVATIONS,
        exercise="ex_cbow_loss",
        make_inputs=_cbow_inputs,
        run=_loss_run("cbow_loss", CBOW_NAMES),
        reference=lambda inputs: _loss_reference(inputs, cbow_loss, CBOW_NAMES),
        compare=lambda outputs, expected: _compare_loss(outputs, expected, function="cbow_loss"),
        forbidden=("tfedu.embeddings",),
        standins=SGNS_STANDIN,
    ),
}


# ----------------------------------------------------------------------------- hints, in steps (tfedu.hint)

HINTS = {
    "ex_embed_via_one_hot": Hints(
        number="2.1",
        check="check_embed_via_one_hot",
        idea=(
            "A one-hot vector for word i is all zeros but a 1 at position i, and multiplying it by W_E keeps "
            "exactly row i of W_E: the product IS the look-up. The one-hot vectors must be d_vocab long, the "
            "number of rows of W_E (not worked out from the ids, which may not include the largest word), and "
            "W_E is used as it is, one row per word, with no transpose. Because it is a product, the gradient "
            "reaches W_E row by row: words that were not in the input get zero."
        ),
        approach=(
            "Three steps. (1) d_vocab is the first dimension of W_E's shape. (2) F.one_hot with num_classes set "
            "to d_vocab turns ids of any shape into one-hot vectors of shape (*ids, d_vocab); they come out as "
            "integers, so convert them to W_E's dtype. (3) Matrix-multiply them by W_E, shape (d_vocab, "
            "d_model): the product contracts the d_vocab axis and keeps every leading axis of ids, giving "
            "(*ids, d_model) with no flattening. Never index W_E with the ids yourself."
        ),
        skeleton=(
            "def embed_via_one_hot(ids, W_E):\n"
            "    d_vocab = ____  # how many words W_E has a row for\n"
            "    one_hots = F.one_hot(ids, num_classes=____).____  # (*ids, d_vocab), in W_E's dtype\n"
            "    return ____  # (*ids, d_model)\n"
        ),
    ),
    "ex_sgns_loss": Hints(
        number="2.2",
        check="check_sgns_loss",
        idea=(
            "Each example is a small logistic regression: the observed pair's score u_o . v_c should be high, "
            "and each negative's score u_wi . v_c low. The loss is -log sigma of the positive score minus, for "
            "every negative, log sigma of MINUS its score (the minus sits inside, since log(1 - sigma(s)) = "
            "log sigma(-s)). Add the k negative terms (sum, not mean), then average over the batch. Compute each "
            "log sigma in one step with F.logsigmoid: taking the log of a sigmoid gives log(0) = -inf once the "
            "scores are large."
        ),
        approach=(
            "Shapes: center and context are (batch, d_model), negatives is (batch, k, d_model). Positive scores: "
            "multiply center and context elementwise and sum over d_model, giving (batch,); a matrix product of "
            "the two would score every center against every context instead. Negative scores: dot each of the "
            "k negatives of an example with that example's center, summing over d_model, giving (batch, k); "
            "an einsum over the d axis does it, or a batched matrix product with the center as a column. Then "
            "F.logsigmoid of the positive scores plus F.logsigmoid of the negated negative scores summed over "
            "k, both (batch,); negate, and take the mean over the batch: a 0-d tensor."
        ),
        skeleton=(
            "def sgns_loss(center: torch.Tensor, context: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:\n"
            "    positive = ____  # (batch,): u_o . v_c for each example\n"
            "    negative = torch.einsum(\"____\", negatives, center)  # (batch, k): u_wi . v_c for each negative\n"
            "    per_example = ____  # (batch,): -log sigma(positive) - the k negative terms, summed over k\n"
            "    return ____  # 0-d: the mean over the batch\n"
        ),
    ),
    "ex_sgns_step": Hints(
        number="2.3",
        check="check_sgns_step",
        idea=(
            "One optimisation step is four moves in a fixed order. PyTorch ADDS each new gradient to the one "
            "already stored in a parameter, so the previous step's gradients must be cleared first; then the "
            "forward pass gives the loss; backward fills every parameter's gradient; and only then does the "
            "optimizer update the parameters from those gradients. Return the loss of this batch, computed "
            "before the update, as a plain Python number."
        ),
        approach=(
            "All the pieces are methods. The optimizer has one that zeroes the gradients of the parameters it "
            "was given, and one that takes the step. The model is called like a function on the three id "
            "tensors, in the order centers, contexts, negatives (shapes (batch,), (batch,), (batch, k)), and "
            "returns the SGNS loss as a 0-d tensor. The loss has a method that backpropagates, and one that "
            "turns a 0-d tensor into a Python float: return that, so no graph is kept alive."
        ),
        skeleton=(
            "def sgns_step(model, optimizer, centers, contexts, negatives) -> float:\n"
            "    ____  # forget the previous step's gradients\n"
            "    loss = ____  # the model's SGNS loss on this batch, a 0-d tensor\n"
            "    ____  # fill every parameter's gradient\n"
            "    ____  # update the parameters\n"
            "    return ____  # a plain Python float\n"
        ),
    ),
    "ex_cbow_loss": Hints(
        number="2.4",
        check="check_cbow_loss",
        idea=(
            "CBOW first turns each example's 2m context vectors into ONE vector h, their average, and then asks "
            "the same yes/no question as SGNS with h in place of v_c: the center word's score u_o . h should be "
            "high and each negative's u_wi . h low. So the loss is exactly the SGNS loss with h as the center "
            "vector and the center word's output vector u_o as the context. Average the vectors (not the "
            "losses, and not their sum), over the context words only."
        ),
        approach=(
            "Shapes: context is (batch, 2m, d_model), center is (batch, d_model), negatives is (batch, k, d_model). "
            "(1) h: the mean of context over its middle axis, the 2m context words, giving (batch, d_model); "
            "the mean over the first axis would mix the examples and over the last would collapse each vector "
            "to one number. (2) From here it is exercise 2.2: the positive score of h with center, (batch,); "
            "the negative scores of h against each negative, (batch, k); F.logsigmoid terms with the minus "
            "inside for the negatives, summed over k, negated and averaged over the batch. Your sgns_loss can "
            "do step (2) if you pass h where it expects the center and u_o where it expects the context."
        ),
        skeleton=(
            "def cbow_loss(context: torch.Tensor, center: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:\n"
            "    h = ____  # (batch, d_model): the average of each example's 2m context vectors\n"
            "    positive = ____  # (batch,): u_o . h\n"
            "    negative = ____  # (batch, k): u_wi . h for each negative\n"
            "    return ____  # 0-d: as in sgns_loss, with h in place of v_c\n"
        ),
    ),
}

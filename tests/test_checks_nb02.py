"""The notebook-02 checkers pass correct answers and name the usual mistakes; the probes agree."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tfedu import embeddings as E
from tfedu.checks import nb02_embeddings as nb02
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe

# --------------------------------------------------------------------------- learner versions of embed_via_one_hot


def embed_correct(ids, W_E):
    return F.one_hot(ids, num_classes=W_E.shape[0]).to(W_E.dtype) @ W_E


def embed_einsum(ids, W_E):  # a different but right route
    return torch.einsum("...v,vd->...d", F.one_hot(ids, W_E.shape[0]).float(), W_E)


def embed_transposed(ids, W_E):  # thinks W_E is (d_model, d_vocab), like nn.Linear's weight
    return F.one_hot(ids, W_E.shape[1]).float() @ W_E.T


def embed_d_vocab_from_ids(ids, W_E):
    return F.one_hot(ids).float() @ W_E


def embed_d_vocab_from_ids_explicit(ids, W_E):
    return F.one_hot(ids, int(ids.max()) + 1).float() @ W_E


def embed_integer_one_hot(ids, W_E):
    return F.one_hot(ids, W_E.shape[0]) @ W_E


def embed_lookup(ids, W_E):
    return W_E[ids]


def embed_detached(ids, W_E):
    return F.one_hot(ids, W_E.shape[0]).float() @ W_E.detach()


def embed_flattened(ids, W_E):
    return F.one_hot(ids.flatten(), W_E.shape[0]).float() @ W_E


def embed_numpy(ids, W_E):
    return (F.one_hot(ids, W_E.shape[0]).float() @ W_E).detach().numpy()


def embed_stub(ids, W_E):
    raise NotImplementedError


@pytest.mark.parametrize("impl", [embed_correct, embed_einsum, E.embed_via_one_hot])
def test_embed_checker_passes_correct_versions(impl, capsys):
    nb02.check_embed_via_one_hot(impl)
    assert "\N{CHECK MARK} embedding look-up" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("impl", "hint"),
    [
        (embed_transposed, nb02.TRANSPOSED_HINT),
        (embed_d_vocab_from_ids, nb02.D_VOCAB_HINT),
        (embed_d_vocab_from_ids_explicit, nb02.D_VOCAB_HINT),
        (embed_integer_one_hot, nb02.DTYPE_HINT),
        (embed_lookup, nb02.LOOKUP_HINT),
        (embed_detached, "no gradient can reach W_E"),
        (embed_flattened, nb02.FLATTENED_HINT),
        (embed_numpy, nb02.TENSOR_HINT),
    ],
)
def test_embed_checker_names_the_mistake(impl, hint):
    with pytest.raises(CheckFailure) as info:
        nb02.check_embed_via_one_hot(impl)
    assert hint in str(info.value)


def test_embed_transposed_on_a_tall_matrix_is_told_about_num_classes():
    # On the square matrix the transposition is caught by value; alone on a tall one it is the
    # num_classes error. Check that hint directly.
    def tall_only(ids, W_E):
        return F.one_hot(ids, W_E.shape[1]).float() @ W_E.T if W_E.shape[0] != W_E.shape[1] else embed_correct(ids, W_E)

    with pytest.raises(CheckFailure, match="not d_model \\(its columns\\)"):
        nb02.check_embed_via_one_hot(tall_only)


def test_embed_unfinished():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb02.check_embed_via_one_hot(embed_stub)


# --------------------------------------------------------------------------- learner versions of sgns_loss


def scores(center, context, negatives):
    return (center * context).sum(-1), (negatives @ center.unsqueeze(-1)).squeeze(-1)


def loss_correct(center, context, negatives):
    pos, neg = scores(center, context, negatives)
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).mean()


def loss_bce(center, context, negatives):  # a different but right route: logistic regression
    pos, neg = scores(center, context, negatives)
    return (F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="sum")
            + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg), reduction="sum")) / pos.shape[0]


def loss_missing_minus(center, context, negatives):
    pos, neg = scores(center, context, negatives)
    return -(F.logsigmoid(pos) + F.logsigmoid(neg).sum(-1)).mean()


def loss_sigmoid(center, context, negatives):
    pos, neg = scores(center, context, negatives)
    return -(torch.sigmoid(pos) + torch.sigmoid(-neg).sum(-1)).mean()


def loss_summed_over_batch(center, context, negatives):
    pos, neg = scores(center, context, negatives)
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).sum()


def loss_mean_over_negatives(center, context, negatives):
    pos, neg = scores(center, context, negatives)
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).mean(-1)).mean()


def loss_log_likelihood(center, context, negatives):
    pos, neg = scores(center, context, negatives)
    return (F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).mean()


def loss_no_negatives(center, context, negatives):
    return -F.logsigmoid((center * context).sum(-1)).mean()


def loss_per_example(center, context, negatives):
    pos, neg = scores(center, context, negatives)
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1))


def loss_log_of_sigmoid(center, context, negatives):  # right maths, underflows for large scores
    pos, neg = scores(center, context, negatives)
    return -(torch.log(torch.sigmoid(pos)) + torch.log(torch.sigmoid(-neg)).sum(-1)).mean()


def loss_log_one_minus_sigmoid(center, context, negatives):  # right maths, 1 - sigma(x) rounds to 0 above x ~ 17
    pos, neg = scores(center, context, negatives)
    return -(F.logsigmoid(pos) + torch.log(1 - torch.sigmoid(neg)).sum(-1)).mean()


def loss_outer_product(center, context, negatives):  # every center against every context, then a mean
    pos = F.logsigmoid(center @ context.T).mean(-1)
    neg = F.logsigmoid(-(negatives @ center.unsqueeze(-1)).squeeze(-1)).sum(-1)
    return -(pos + neg).mean()


def loss_outer_product_broadcast(center, context, negatives):  # (batch, batch) + (batch,), then one mean
    pos, neg = center @ context.T, scores(center, context, negatives)[1]
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).mean()


def loss_item(center, context, negatives):
    return torch.tensor(loss_correct(center, context, negatives).item(), dtype=center.dtype)


def loss_bce_default_mean(center, context, negatives):  # reduction="mean" averages over the k negatives too
    pos, neg = scores(center, context, negatives)
    return (F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos))
            + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg)))


def loss_mean_of_all_terms(center, context, negatives):
    pos, neg = scores(center, context, negatives)
    return -torch.cat([F.logsigmoid(pos)[:, None], F.logsigmoid(-neg)], dim=1).mean()


def loss_minus_outside(center, context, negatives):  # log(1 - sigma(x)) mistaken for -log sigma(x)
    pos, neg = scores(center, context, negatives)
    return -(F.logsigmoid(pos) - F.logsigmoid(neg).sum(-1)).mean()


def loss_negatives_summed_over_k(center, context, negatives):
    pos = (center * context).sum(-1)
    neg = (negatives * center[:, None, :]).sum(1)  # batch d_model: summed over k, not d_model
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).mean()


def loss_negatives_against_context(center, context, negatives):
    pos = (center * context).sum(-1)
    neg = torch.einsum("bkd,bd->bk", negatives, context)
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).mean()


def loss_python_float(center, context, negatives):
    return loss_correct(center, context, negatives).item()


def loss_stub(center, context, negatives):
    raise NotImplementedError


@pytest.mark.parametrize("impl", [loss_correct, loss_bce, E.sgns_loss])
def test_loss_checker_passes_correct_versions(impl, capsys):
    nb02.check_sgns_loss(impl)
    assert "\N{CHECK MARK} skip-gram negative-sampling loss" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("impl", "hint"),
    [
        (loss_missing_minus, nb02.MISSING_MINUS_HINT),
        (loss_sigmoid, nb02.SIGMOID_HINT),
        (loss_summed_over_batch, nb02.BATCH_SUM_HINT),
        (loss_mean_over_negatives, nb02.NEG_MEAN_HINT),
        (loss_log_likelihood, nb02.SIGN_HINT),
        (loss_no_negatives, nb02.NO_NEG_HINT),
        (loss_per_example, "return one number"),
        (loss_log_of_sigmoid, nb02.STABILITY_HINT),
        (loss_log_one_minus_sigmoid, nb02.ONE_MINUS_HINT),
        (loss_outer_product, nb02.OUTER_PRODUCT_HINT),
        (loss_outer_product_broadcast, nb02.OUTER_PRODUCT_HINT),
        (loss_item, "no gradient flows"),
        (loss_bce_default_mean, "reduction='sum'"),
        (loss_mean_of_all_terms, nb02.MEAN_OF_TERMS_HINT),
        (loss_minus_outside, nb02.MINUS_OUTSIDE_HINT),
        (loss_negatives_summed_over_k, nb02.NEG_AXIS_HINT),
        (loss_negatives_against_context, nb02.NEG_CONTEXT_HINT),
        (loss_python_float, nb02.LOSS_NUMBER_HINT),
    ],
)
def test_loss_checker_names_the_mistake(impl, hint):
    with pytest.raises(CheckFailure) as info:
        nb02.check_sgns_loss(impl)
    assert hint in str(info.value)


def test_one_minus_sigmoid_hint_quotes_what_the_learner_wrote():
    with pytest.raises(CheckFailure) as info:
        nb02.check_sgns_loss(loss_log_one_minus_sigmoid)
    assert "log(1 - sigma(x))" in str(info.value) and "log(sigma(x))" not in str(info.value)


def test_loss_unfinished():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb02.check_sgns_loss(loss_stub)


def test_each_loss_mistake_differs_from_the_reference():
    center, context, negatives = nb02._sgns_inputs(0)
    expected = E.sgns_loss(center, context, negatives)
    for hint, wrong in nb02.sgns_loss_mistakes(center, context, negatives).items():
        assert not torch.allclose(wrong, expected, rtol=1e-3), hint


# --------------------------------------------------------------------------- learner versions of sgns_step


def step_correct(model, optimizer, centers, contexts, negatives):
    optimizer.zero_grad()
    loss = model(centers, contexts, negatives)
    loss.backward()
    optimizer.step()
    return loss.item()


def step_zero_grad_last(model, optimizer, centers, contexts, negatives):  # also right
    loss = model(centers, contexts, negatives)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def step_no_zero_grad(model, optimizer, centers, contexts, negatives):
    loss = model(centers, contexts, negatives)
    loss.backward()
    optimizer.step()
    return loss.item()


def step_before_backward(model, optimizer, centers, contexts, negatives):
    optimizer.zero_grad()
    loss = model(centers, contexts, negatives)
    optimizer.step()
    loss.backward()
    return loss.item()


def step_zero_grad_before_step(model, optimizer, centers, contexts, negatives):
    loss = model(centers, contexts, negatives)
    loss.backward()
    optimizer.zero_grad()
    optimizer.step()
    return loss.item()


def step_returns_tensor(model, optimizer, centers, contexts, negatives):
    optimizer.zero_grad()
    loss = model(centers, contexts, negatives)
    loss.backward()
    optimizer.step()
    return loss


def step_returns_loss_after(model, optimizer, centers, contexts, negatives):
    optimizer.zero_grad()
    model(centers, contexts, negatives).backward()
    optimizer.step()
    with torch.no_grad():
        return model(centers, contexts, negatives).item()


def step_stub(model, optimizer, centers, contexts, negatives):
    raise NotImplementedError


@pytest.mark.parametrize("impl", [step_correct, step_zero_grad_last, E.sgns_step])
def test_step_checker_passes_correct_versions(impl, capsys):
    nb02.check_sgns_step(impl)
    assert "\N{CHECK MARK} one SGNS training step" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("impl", "hint"),
    [
        (step_no_zero_grad, nb02.NO_ZERO_GRAD_HINT),
        (step_before_backward, nb02.NO_UPDATE_HINT),
        (step_zero_grad_before_step, nb02.NO_UPDATE_HINT),
        (step_returns_tensor, nb02.FLOAT_HINT),
        (step_returns_loss_after, nb02.LOSS_AFTER_HINT),
    ],
)
def test_step_checker_names_the_mistake(impl, hint):
    with pytest.raises(CheckFailure) as info:
        nb02.check_sgns_step(impl)
    assert hint in str(info.value)


def test_step_unfinished():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb02.check_sgns_step(step_stub)


# --------------------------------------------------------------------------- learner versions of cbow_loss


def cbow_correct(context, center, negatives):
    return loss_correct(context.mean(1), center, negatives)


def cbow_by_hand(context, center, negatives):  # a different but right route: sum then divide, bce
    h = context.sum(dim=1) / context.shape[1]
    return loss_bce(h, center, negatives)


def cbow_sum(context, center, negatives):
    return loss_correct(context.sum(1), center, negatives)


def cbow_mean_over_batch(context, center, negatives):
    return loss_correct(context.mean(0), center, negatives)


def cbow_mean_over_d_model(context, center, negatives):
    return loss_correct(context.mean(-1), center, negatives)


def cbow_mean_over_d_model_broadcast(context, center, negatives):  # one number per word, first word, broadcast
    return loss_correct(context.mean(-1, keepdim=True).expand_as(context)[:, 0], center, negatives)


def cbow_mean_over_d_model_then_words(context, center, negatives):
    return loss_correct(context.mean(-1, keepdim=True).mean(1).expand_as(center), center, negatives)


def cbow_mean_over_everything(context, center, negatives):
    return loss_correct(context.mean().expand_as(center), center, negatives)


def cbow_first_word_only(context, center, negatives):
    return loss_correct(context[:, 0], center, negatives)


def cbow_average_of_losses(context, center, negatives):  # skip-gram with the roles swapped
    return torch.stack([loss_correct(context[:, j], center, negatives) for j in range(context.shape[1])]).mean()


def cbow_sum_of_losses(context, center, negatives):
    return sum(loss_correct(context[:, j], center, negatives) for j in range(context.shape[1]))


def cbow_negatives_against_center(context, center, negatives):
    h = context.mean(1)
    pos = (h * center).sum(-1)
    neg = torch.einsum("bkd,bd->bk", negatives, center)
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).mean()


def cbow_missing_minus(context, center, negatives):
    return loss_missing_minus(context.mean(1), center, negatives)


def cbow_per_example(context, center, negatives):
    return loss_per_example(context.mean(1), center, negatives)


def cbow_log_of_sigmoid(context, center, negatives):
    return loss_log_of_sigmoid(context.mean(1), center, negatives)


def cbow_log_one_minus_sigmoid(context, center, negatives):
    return loss_log_one_minus_sigmoid(context.mean(1), center, negatives)


def cbow_python_float(context, center, negatives):
    return cbow_correct(context, center, negatives).item()


def cbow_stub(context, center, negatives):
    raise NotImplementedError


@pytest.mark.parametrize("impl", [cbow_correct, cbow_by_hand, E.cbow_loss])
def test_cbow_checker_passes_correct_versions(impl, capsys):
    nb02.check_cbow_loss(impl)
    assert "\N{CHECK MARK} CBOW loss" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("impl", "hint"),
    [
        (cbow_sum, nb02.CBOW_SUM_HINT),
        (cbow_mean_over_batch, nb02.CBOW_BATCH_AXIS_HINT),
        (cbow_mean_over_d_model, "over dim -1 (d_model) gives shape (batch, 2m)"),
        (cbow_mean_over_d_model_broadcast, nb02.CBOW_DMODEL_AXIS_HINT),
        (cbow_mean_over_d_model_then_words, nb02.CBOW_DMODEL_AXIS_HINT),
        (cbow_mean_over_everything, nb02.CBOW_ALL_AXES_HINT),
        (cbow_first_word_only, nb02.CBOW_FIRST_WORD_HINT),
        (cbow_average_of_losses, nb02.CBOW_LOSS_PER_WORD_HINT),
        (cbow_sum_of_losses, nb02.CBOW_SUM_OF_LOSSES_HINT),
        (cbow_negatives_against_center, nb02.CBOW_NEG_CENTER_HINT),
        (cbow_missing_minus, nb02.MISSING_MINUS_HINT),
        (cbow_per_example, nb02.CBOW_PER_EXAMPLE_HINT),
        (cbow_log_of_sigmoid, nb02.STABILITY_HINT),
        (cbow_log_one_minus_sigmoid, nb02.ONE_MINUS_HINT),
        (cbow_python_float, nb02.LOSS_NUMBER_HINT),
    ],
)
def test_cbow_checker_names_the_mistake(impl, hint):
    with pytest.raises(CheckFailure) as info:
        nb02.check_cbow_loss(impl)
    assert hint in str(info.value)


def test_cbow_unfinished():
    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb02.check_cbow_loss(cbow_stub)


def test_each_cbow_mistake_differs_from_the_reference():
    context, center, negatives = torch.randn(4, 4, 3), torch.randn(4, 3), torch.randn(4, 5, 3)
    expected = E.cbow_loss(context, center, negatives)
    for hint, wrong in nb02.cbow_loss_mistakes(context, center, negatives).items():
        assert not torch.allclose(wrong, expected, rtol=1e-3), hint


# --------------------------------------------------------------------------- probes



def same(outputs, expected, probe):
    """The grader's verdict: the probe's own comparison (return type, values, gradients)."""
    return probe.compare(outputs, expected) is None


PROBE_CASES = {
    # W_E[ids] gives the right values, but the exercise is the product: the probe names the look-up.
    "check_embed_via_one_hot": ("embed_via_one_hot", [embed_correct, E.embed_via_one_hot], [], [embed_transposed, embed_lookup]),
    "check_sgns_loss": ("sgns_loss", [loss_correct, loss_bce, E.sgns_loss], [], [loss_missing_minus, loss_sigmoid, loss_summed_over_batch]),
    "check_sgns_step": ("sgns_step", [step_correct, step_zero_grad_last, E.sgns_step], [], [step_no_zero_grad, step_before_backward]),
    "check_cbow_loss": ("cbow_loss", [cbow_correct, cbow_by_hand, E.cbow_loss], [], [cbow_sum, cbow_average_of_losses, cbow_missing_minus]),
}


def test_every_check_cell_has_a_probe_for_its_exercise():
    assert set(nb02.PROBES) == set(PROBE_CASES)
    for grade_id, probe in nb02.PROBES.items():
        assert probe.exercise == "ex_" + grade_id.removeprefix("check_")
        assert probe.forbidden[0] == "tfedu.embeddings"


@pytest.mark.parametrize("grade_id", sorted(PROBE_CASES))
@pytest.mark.parametrize("seed", range(4))
def test_probes_agree_with_reference_and_reject_bugs(grade_id, seed):
    probe = nb02.PROBES[grade_id]
    name, right, value_equal, wrong = PROBE_CASES[grade_id]
    for impl in right + value_equal:  # value_equal: wrong for the checker, but equal values
        outputs, expected = run_probe(probe, {name: impl}, seed)
        assert same(outputs, expected, probe), impl.__name__
    for impl in wrong:
        try:
            outputs, expected = run_probe(probe, {name: impl}, seed)
        except Exception:
            continue  # raising on the hidden inputs also scores zero
        assert not same(outputs, expected, probe), impl.__name__


def test_probe_inputs_are_plain_data():
    for probe in nb02.PROBES.values():
        inputs = probe.make_inputs(np.random.default_rng(0))

        def plain(node):
            if isinstance(node, dict):
                return all(isinstance(k, str) and plain(v) for k, v in node.items())
            if isinstance(node, list):
                return all(plain(v) for v in node)
            if isinstance(node, np.ndarray):
                return node.dtype.kind in "biuf"
            return isinstance(node, (int, float, str, bool))

        assert plain(inputs)


def test_step_probe_does_not_run_tfedu_embeddings_code():
    # The grader's tripwire flags any call into tfedu/embeddings.py while the probe runs.
    probe = nb02.PROBES["check_sgns_step"]
    inputs = probe.make_inputs(np.random.default_rng(0))
    calls = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == E.__file__:
            calls.append(frame.f_code.co_name)

    import sys

    scope = {"sgns_step": step_correct, "inputs": inputs, "np": np, "torch": torch}
    sys.setprofile(watch)
    try:
        exec(probe.run, scope)
    finally:
        sys.setprofile(None)
    assert calls == []


# --------------------------------------------------------------------------- the switches: the learner's losses drive training


def test_learner_losses_can_drive_the_notebook_training_runs():
    # USE_MY_SGNS_LOSS / USE_MY_CBOW_LOSS = True pass these as loss_fn; a correct solution trains like the reference.
    tokens = ("the cat sat on the mat while the dog sat on the rug and a cow ate grass " * 60).split()
    kw = dict(d_model=8, epochs=2, min_count=1, batch_size=64, seed=0)
    for train, mine, reference in [(E.train_sgns, loss_correct, E.sgns_loss), (E.train_cbow, cbow_correct, E.cbow_loss)]:
        ours, theirs = train(tokens, loss_fn=mine, **kw), train(tokens, loss_fn=reference, **kw)
        assert len(ours.losses) == len(theirs.losses)
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.vectors, theirs.vectors, rtol=1e-3, atol=1e-4)


def test_switch_falls_back_to_the_reference_and_names_the_cause(capsys):
    """A wrong sgns_loss with USE_MY_SGNS_LOSS = True: the training cell runs the reference, and says why."""
    from tfedu.checks.switch import pick

    chosen = pick("USE_MY_SGNS_LOSS", True, loss_mean_over_negatives, E.sgns_loss, nb02.check_sgns_loss, exercise="2.2")
    out = capsys.readouterr().out
    assert chosen is E.sgns_loss
    assert "USE_MY_SGNS_LOSS = True, but your sgns_loss does not pass exercise 2.2" in out and nb02.NEG_MEAN_HINT in out
    assert pick("USE_MY_SGNS_LOSS", True, loss_correct, E.sgns_loss, nb02.check_sgns_loss, exercise="2.2") is loss_correct
    assert pick("USE_MY_CBOW_LOSS", True, cbow_sum, E.cbow_loss, nb02.check_cbow_loss, exercise="2.4") is E.cbow_loss

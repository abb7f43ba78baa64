import numpy as np
import pytest
import torch

from tfedu.checks import nb00_start_here as nb00
from tfedu.checks.core import CheckFailure, ExerciseNotDone, run_probe
from tfedu.softmax import softmax


def test_reference_passes(capsys):
    nb00.check_softmax(softmax)
    assert "\N{CHECK MARK} stable softmax" in capsys.readouterr().out


def test_a_different_correct_implementation_passes():
    def logsumexp_softmax(x):
        return (x - torch.logsumexp(x, dim=-1, keepdim=True)).exp()

    nb00.check_softmax(logsumexp_softmax)


def test_overflowing_softmax_is_told_to_subtract_the_max():
    with pytest.raises(CheckFailure, match="Subtract each row.s own max") as info:
        nb00.check_softmax(nb00.naive_softmax)
    assert "overflows" in str(info.value)


def test_wrong_axis_is_named():
    def column_softmax(x):
        shifted = x - x.max(dim=0, keepdim=True).values
        return shifted.exp() / shifted.exp().sum(dim=0, keepdim=True)

    with pytest.raises(CheckFailure, match="dim 0"):
        nb00.check_softmax(column_softmax)


def test_dim_1_on_a_3d_batch_is_named():
    def dim1_softmax(x):
        shifted = x - x.max(dim=1, keepdim=True).values
        return shifted.exp() / shifted.exp().sum(dim=1, keepdim=True)

    with pytest.raises(CheckFailure, match="on a \\(2, 3, 5\\) batch: you normalised over dim 1"):
        nb00.check_softmax(dim1_softmax)


def test_global_normalisation_is_named():
    with pytest.raises(CheckFailure, match="rows do not sum to one"):
        nb00.check_softmax(lambda x: x.exp() / x.exp().sum())


def test_unfinished_exercise():
    def softmax_stub(x):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="not done yet"):
        nb00.check_softmax(softmax_stub)



@pytest.mark.parametrize("seed", range(5))
def test_probe_agrees_with_reference(seed):
    outputs, expected = run_probe(nb00.PROBES["check_softmax"], {"softmax": softmax}, seed)
    np.testing.assert_allclose(outputs["y"], expected["y"], rtol=1e-5, atol=1e-6)


def test_probe_catches_the_naive_softmax():
    outputs, expected = run_probe(nb00.PROBES["check_softmax"], {"softmax": nb00.naive_softmax}, 0)
    assert not np.allclose(outputs["y"], expected["y"], equal_nan=False)


@pytest.mark.parametrize("shift", ["min", "mean", "first", "global max"])
def test_shifting_by_anything_but_the_max_is_caught(shift):
    def shifted_softmax(x):
        m = {"min": x.amin(-1, keepdim=True), "mean": x.mean(-1, keepdim=True), "first": x[..., :1],
             "global max": x.max()}[shift]
        e = (x - m).exp()
        return e / e.sum(-1, keepdim=True)

    with pytest.raises(CheckFailure, match="not the min, the mean, the first entry or the max of the whole tensor"):
        nb00.check_softmax(shifted_softmax)
    outputs, expected = run_probe(nb00.PROBES["check_softmax"], {"softmax": shifted_softmax}, 0)
    assert not np.allclose(outputs["y"], expected["y"])


def test_max_shift_then_global_sum_is_named():
    def global_sum(x):
        e = (x - x.max(dim=-1, keepdim=True).values).exp()
        return e / e.sum()

    with pytest.raises(CheckFailure, match="not the sum of everything"):
        nb00.check_softmax(global_sum)


def test_max_shift_without_division_is_named():
    with pytest.raises(CheckFailure, match="exp\\(x - max\\) without dividing"):
        nb00.check_softmax(lambda x: (x - x.max(dim=-1, keepdim=True).values).exp())


def test_forgotten_values_or_keepdim_gets_a_shape_hint():
    def no_values(x):
        e = (x - x.max(dim=-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)

    with pytest.raises(CheckFailure, match="take .values"):
        nb00.check_softmax(no_values)

    def no_keepdim(x):
        e = (x - x.max(dim=-1).values).exp()
        return e / e.sum(-1)

    with pytest.raises(CheckFailure, match="keepdim=True"):
        nb00.check_softmax(no_keepdim)


@pytest.mark.parametrize("shortcut", [lambda x: torch.softmax(x, -1), lambda x: x.softmax(-1),
                                      lambda x: torch.nn.functional.softmax(x, dim=-1)])
def test_calling_torch_softmax_is_refused(shortcut):
    with pytest.raises(CheckFailure, match="build the softmax yourself"):
        nb00.check_softmax(shortcut)
    assert torch.softmax(torch.zeros(2), -1).tolist() == [0.5, 0.5]  # the originals are restored


@pytest.mark.parametrize("shortcut", [lambda x: torch.log_softmax(x, -1).exp(), lambda x: x.log_softmax(-1).exp(),
                                      lambda x: torch.special.log_softmax(x, -1).exp(),
                                      lambda x: torch.special.softmax(x, -1)])
def test_log_softmax_and_special_shortcuts_are_refused(shortcut):
    with pytest.raises(CheckFailure, match="build the softmax yourself"):
        nb00.check_softmax(shortcut)


# Mixed slips: each part is a listed mistake, together they used to get only "differs from the reference".
def softmax_from(shift, total):
    """A learner's softmax: exp(x - shift(x)), divided by total(e)."""
    def learner(x):
        e = (x - shift(x)).exp()
        return e / total(e)

    return learner


ROW_MAX = lambda x: x.max(dim=-1, keepdim=True).values  # noqa: E731
COL_MAX = lambda x: x.max(dim=0, keepdim=True).values  # noqa: E731
ROW_MIN = lambda x: x.min(dim=-1, keepdim=True).values  # noqa: E731
COL_MIN = lambda x: x.min(dim=0, keepdim=True).values  # noqa: E731
ROW_SUM = lambda e: e.sum(dim=-1, keepdim=True)  # noqa: E731
COL_SUM = lambda e: e.sum(dim=0, keepdim=True)  # noqa: E731


@pytest.mark.parametrize("learner, hint", [
    (softmax_from(ROW_MAX, COL_SUM), "you subtracted each row's max but summed over dim 0 (down the columns): "
                                     "the sum must run along the same dim as the max, the last one (dim=-1)"),
    (softmax_from(COL_MAX, ROW_SUM), "you subtracted the max over dim 0 (one per column) but summed over the last dim"),
    (softmax_from(COL_MIN, ROW_SUM), "you subtracted the min over dim 0 (one per column) but summed over the last dim"),
    (softmax_from(ROW_MIN, COL_SUM), "you subtracted each row's min but summed over dim 0 (down the columns): the sum "
                                     "must run along the same dim as the max, the last one (dim=-1); and subtract "
                                     "each row's max, not each row's min"),
    (softmax_from(lambda x: x.mean(dim=-1, keepdim=True), COL_SUM), "each row's mean but summed over dim 0"),
    (softmax_from(lambda x: x[0], ROW_SUM), "you subtracted the first row (one number per column)"),
    (softmax_from(lambda x: x[..., :1], lambda e: e.sum()), "not the sum of everything; and subtract each row's max, "
                                                            "not each row's first entry"),
    (softmax_from(COL_MAX, lambda e: e.sum()), "not the sum of everything; and subtract each row's max, not the max over dim 0"),
    (softmax_from(COL_MIN, lambda e: 1), "you returned exp(x - the min over dim 0 (one per column)) without dividing"),
    (softmax_from(lambda x: x.max(), lambda e: 1), "you returned exp(x - the max of the whole tensor) without dividing"),
    (softmax_from(COL_MAX, COL_SUM), "you normalised over dim 0"),  # the same numbers as the column softmax
    # Right on 2-D, where dim 1 is the last dim; only the 3-D batch tells.
    (softmax_from(lambda x: x.max(dim=1, keepdim=True).values, ROW_SUM),
     "on a (2, 3, 5) batch: you subtracted the max over dim 1 but summed over the last dim"),
    (softmax_from(ROW_MAX, lambda e: e.sum(dim=1, keepdim=True)),
     "on a (2, 3, 5) batch: you subtracted each row's max but summed over dim 1"),
    (softmax_from(lambda x: x.amin(dim=-1, keepdim=True), lambda e: e.sum(dim=1, keepdim=True)),
     "Subtract each row's own max"),  # the large logits come before the batch
    (lambda x: (x - ROW_MAX(x)).exp() / (x - ROW_MAX(x)).sum(-1, keepdim=True), "sum of the exponentials"),
    (lambda x: (x - ROW_MAX(x)).exp() / (x - ROW_MAX(x)).sum(-1, keepdim=True).exp(), "exp of a sum is not a sum of exps"),
])
def test_mixed_slips_are_named(learner, hint):
    with pytest.raises(CheckFailure) as info:
        nb00.check_softmax(learner)
    assert hint in str(info.value)
    assert "differs from the reference" not in str(info.value)


@pytest.mark.parametrize("shape", [(4, 7), (2, 3, 5)])
def test_every_listed_slip_differs_from_the_softmax_and_distinct_hints_mean_distinct_numbers(shape):
    from tfedu.checks.core import is_close, seeded_randn

    x = seeded_randn(0, *shape)
    slips = list(nb00.softmax_slips(x).items())
    assert len(slips) >= 30
    for i, (hint, wrong) in enumerate(slips):
        assert not is_close(wrong, softmax(x)), hint
        for other_hint, other in slips[i + 1:]:
            assert not is_close(wrong, other), (hint, other_hint)

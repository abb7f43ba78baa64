import pytest
import torch

from tfedu.checks.core import (
    CheckFailure,
    ExerciseNotDone,
    call_learner,
    checker,
    compare,
    expect,
    is_close,
    seeded_randn,
)


def test_seeded_randn_repeats():
    assert torch.equal(seeded_randn(3, 2, 2), seeded_randn(3, 2, 2))
    assert not torch.equal(seeded_randn(3, 2, 2), seeded_randn(4, 2, 2))


@checker("double")
def check_double(fn):
    x = seeded_randn(0, 5)
    compare(call_learner(fn, x, name="double"), 2 * x, what="double(x)", mistakes={"you squared instead of doubling": x * x})


def test_checker_passes_and_prints_one_tick_line(capsys):
    check_double(lambda x: x + x)
    assert capsys.readouterr().out == "\N{CHECK MARK} double: all checks passed\n"


def test_not_implemented_becomes_not_done():
    def todo(x):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="double: this exercise is not done yet"):
        check_double(todo)


def test_known_mistake_is_named_before_values():
    with pytest.raises(CheckFailure, match="you squared instead of doubling"):
        check_double(lambda x: x * x)


def test_learner_exception_becomes_a_hint_without_chained_traceback():
    def broken(x):
        return x @ x  # a dot product: a scalar, not the (5,) tensor asked for

    with pytest.raises(CheckFailure, match="shape \\(\\), expected \\(5,\\)") as info:
        check_double(broken)
    assert info.value.__cause__ is None and info.value.__suppress_context__

    def raises(x):
        raise KeyError("oops")

    with pytest.raises(CheckFailure, match="`double\\(tensor\\(5,\\) float32\\)` raised KeyError"):
        check_double(raises)


def test_not_callable_is_reported():
    with pytest.raises(CheckFailure, match="expected a function"):
        check_double(42)


def test_compare_reports_type_shape_dtype_nan_and_values():
    ref = torch.ones(2, 3)
    with pytest.raises(CheckFailure, match="should be a torch.Tensor, got list"):
        compare([1.0], ref, what="y")
    with pytest.raises(CheckFailure, match="shape \\(3, 2\\), expected \\(2, 3\\)"):
        compare(torch.ones(3, 2), ref, what="y")
    with pytest.raises(CheckFailure, match="dtype torch.float64"):
        compare(torch.ones(2, 3, dtype=torch.float64), ref, what="y")
    with pytest.raises(CheckFailure, match="subtract the max"):
        compare(torch.full((2, 3), float("nan")), ref, what="y", nan_hint="subtract the max")
    wrong = ref.clone()
    wrong[1, 2] = 5
    with pytest.raises(CheckFailure, match="largest error 4 at index \\(1, 2\\)"):
        compare(wrong, ref, what="y")


def test_compare_sees_through_tensor_subclasses_that_lie():
    class AlwaysEqual(torch.Tensor):
        def __eq__(self, other):
            return True

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.allclose:
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    liar = torch.zeros(2, 3).as_subclass(AlwaysEqual)
    with pytest.raises(CheckFailure, match="differs from the reference"):
        compare(liar, torch.ones(2, 3), what="y")


def test_mistake_matching_the_reference_is_not_reported():
    x = torch.ones(3)
    compare(x.clone(), x, what="y", mistakes={"never shown": x.clone()})


def test_mistake_with_a_different_shape_is_named_on_shape_mismatch():
    x = seeded_randn(1, 2, 3)
    with pytest.raises(CheckFailure, match="transposed"):
        compare(x.T.clone(), x, what="y", mistakes={"transposed": x.T})


def test_expect_and_is_close():
    expect(True, "unused")
    with pytest.raises(CheckFailure, match="the hint"):
        expect(False, "the hint")
    assert is_close(torch.ones(2), torch.ones(2) + 1e-7)
    assert not is_close(torch.ones(2), torch.ones(3))
    assert not is_close(torch.tensor([float("nan")]), torch.tensor([float("nan")]))


def test_unexpected_error_inside_a_checker_is_still_a_hint():
    @checker("fragile")
    def check_fragile(fn):
        {}["missing"]

    with pytest.raises(CheckFailure, match="fragile: checking failed with KeyError"):
        check_fragile(lambda: None)

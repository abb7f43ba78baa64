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
    without_hidden_tail,
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


def test_compare_of_one_number_names_no_index():
    with pytest.raises(CheckFailure, match=r"^loss differs from the reference: got 2, expected 1\.5$") as info:
        compare(torch.tensor(2.0), torch.tensor(1.5), what="loss")
    assert "index" not in str(info.value)


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


def test_outside_ipython_the_failure_is_a_plain_assertion_with_the_whole_hint():
    with pytest.raises(AssertionError) as info:
        check_double(lambda x: x * x)
    assert str(info.value) == "double: you squared instead of doubling"
    # With no IPython shell, the IPython rendering falls back to the hint alone.
    assert info.value._render_traceback_() == ["CheckFailure: double: you squared instead of doubling"]


def test_without_hidden_tail_cuts_only_trailing_hidden_frames():
    def hidden():
        __tracebackhide__ = True
        raise CheckFailure("hint")

    def visible():
        hidden()

    try:
        visible()
    except CheckFailure as err:
        tb = err.__traceback__
    names = []
    entry = without_hidden_tail(tb)
    while entry is not None:
        names.append(entry.tb_frame.f_code.co_name)
        entry = entry.tb_next
    assert names == ["test_without_hidden_tail_cuts_only_trailing_hidden_frames", "visible"]


def test_in_a_kernel_a_failing_check_shows_the_cell_and_the_hint_not_the_checker(tmp_path):
    """Run a tiny notebook in a real IPython kernel, as Jupyter does, and read the tracebacks."""
    import re

    import nbformat
    from nbclient import NotebookClient

    setup = (
        "from tfedu.checks.core import call_learner, checker, compare, seeded_randn\n"
        "@checker('double')\n"
        "def check_double(fn):\n"
        "    x = seeded_randn(0, 5)\n"
        "    compare(call_learner(fn, x, name='double'), 2 * x, what='double(x)',\n"
        "            mistakes={'you squared instead of doubling': x * x})\n"
    )
    run_on = {"tags": ["raises-exception"]}
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(setup),
        nbformat.v4.new_code_cell("check_double(lambda x: x * x)", metadata=run_on),
        nbformat.v4.new_code_cell("def todo(x):\n    raise NotImplementedError\ncheck_double(todo)", metadata=run_on),
        nbformat.v4.new_code_cell("check_double(lambda x: x + x)"),
    ])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    expected = [("CheckFailure", "double: you squared instead of doubling"),
                ("ExerciseNotDone", "double: this exercise is not done yet")]
    for cell, (ename, hint) in zip(nb.cells[1:3], expected):
        [error] = [o for o in cell.outputs if o.output_type == "error"]
        shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
        assert error.ename == ename and hint in shown
        assert "core.py" not in shown and "skipping hidden" not in shown, shown
        assert "Cell In[" in shown  # the learner's own line is still pointed at
    assert nb.cells[3].outputs[0].text == "\N{CHECK MARK} double: all checks passed\n"

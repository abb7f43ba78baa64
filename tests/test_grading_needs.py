"""Which cells a graded run executes (tfedu.course.grading.needs): the analysis on small cells and on
every notebook of the course.

That the fast run grades every real notebook exactly as a full run would is shown where the suites
grade them: tests/test_notebooks.py (every source full marks, every release zero, and a toy notebook
graded both ways), the honest-mistake and tamper suites (their expected scores were set with full
runs and did not change)."""

import pytest

from tfedu.course.grading.grade import Limits, Run, graded_steps, load_assignment, static_phase
from tfedu.course.grading.needs import analyse, dynamic, needed

from per_notebook import NOTEBOOKS


def kept(*cells, answer=None):
    """The indices of ``cells`` (trusted demo cells) that run when ``answer`` (a required cell, appended) needs them."""
    plan = [(source, False, True) for source in cells] + [(answer, True, False)]
    return sorted(needed(plan) - {len(cells)})


def test_a_chain_of_bindings_is_followed_and_unrelated_cells_are_skipped():
    assert kept("x = 1", "print(x)", "y = x + 1", "z = 3", answer="def f():\n    return y") == [0, 2]


def test_changes_in_place_count_as_touching_the_name():
    cells = ["model = make()", "model.train()", "train(model, steps=10)", "model.weight[0] = 1.0",
             "model.head.bias = None", "model.blocks[0].attn.reset()", "print(model)", "other = 2"]
    assert kept(*cells, answer="def f():\n    return model(1)") == [0, 1, 2, 3, 4, 5]


def test_calls_on_libraries_are_not_changes_but_setting_their_attributes_is():
    cells = ["import torch\nimport numpy as np", "torch.manual_seed(0)\nnp.random.seed(0)", "torch.backends.flag = True"]
    assert kept(*cells, answer="def f():\n    return torch.zeros(1)") == [0, 2]


def test_a_call_of_a_notebook_function_touches_the_globals_it_changes():
    cells = ["opt = make()", "def step():\n    opt.step()\n    return 1", "def pure(a):\n    return a + 1",
             "for _ in range(3):\n    step()", "pure(2)"]
    assert kept(*cells, answer="def f():\n    return opt") == [0, 1, 3]


def test_names_a_cell_binds_before_reading_are_not_needs():
    cells = ["name = 'demo'\np = 0.5\nax = None", "for name in ['a', 'b']:\n    print(name)",
             "p = 0.1\nprint(p)", "ax = 1\nax += 1"]
    # the answer binds its own loop variable and parameter: none of the cells that bind them run
    assert kept(*cells, answer="def f(p):\n    return [name for name in p]") == []
    assert kept(*cells, answer="def f():\n    return p") == [0, 2]


def test_function_bodies_read_globals_and_comprehensions_read_their_first_iterable():
    assert kept("xs = [1, 2]", "helper = abs", answer="def f():\n    return [helper(x) for x in xs]") == [0, 1]
    assert kept("xs = [1, 2]", answer="total = sum(x for x in xs)") == [0]
    assert kept("k = 2", answer="g = lambda x, k=k: x * k") == [0]


def test_globals_lookups_by_name_are_reads_and_other_dynamic_reads_keep_everything():
    assert kept("a = 1", "b = 2", answer="f = globals().get('b')") == [1]
    assert kept("a = 1", "b = 2", answer="f = globals()['b']") == [1]
    trusted_dynamic = [("a = 1", False, True), ("b = 2", False, True), ("c = eval('a')", False, True),
                       ("def f():\n    return c", True, False)]
    assert needed(trusted_dynamic) == {0, 1, 2, 3}


@pytest.mark.parametrize("answer", [
    "def f():\n    return globals()['x' + 'y']", "def f():\n    return eval('x')", "import __main__\nf = __main__.x",
    "import sys\nf = sys.modules['__main__']", "def f():\n    return f.__globals__", "def f():\n    return vars()",
    "f = get_ipython().user_ns",
])
def test_an_answer_that_reads_names_dynamically_asks_for_the_whole_notebook(answer):
    assert dynamic(answer)


@pytest.mark.parametrize("answer", ["def f(x):\n    return x.eval()", "def f():\n    return globals().get('g')",
                                    "def f(x:\n    return", "import torch\nf = torch.softmax"])
def test_ordinary_answers_are_not_dynamic(answer):
    assert not dynamic(answer)


def test_cells_the_analysis_cannot_read_always_run():
    cells = ["%%time\nx = 1", "%time y = 2", "from os.path import *", "def broken(:", "%matplotlib inline", "z = 3"]
    assert kept(*cells, answer="def f():\n    return 0") == [0, 1, 2, 3]


def test_magics_and_shell_escapes_are_read_as_ipython_runs_them():
    cell = analyse("import sys\nif 'google.colab' in sys.modules:\n    %pip install x\nwidth = 3", set(), {})
    assert not cell.opaque and {"sys", "width"} <= cell.touches


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_is_readable_by_the_analysis_and_grading_skips_its_demonstrations(path):
    """No cell of a course notebook is opaque (the analysis would quietly run it always), and grading the
    source runs fewer cells than the notebook has."""
    assignment = load_assignment(path)
    libraries, functions = set(), {}
    for step in assignment.steps:
        if step.kind == "code":
            cell = analyse(step.source, libraries, functions)
            assert not cell.opaque, f"{path.name} cell {step.cell} cannot be analysed"
    solved = {step.grade_id: step.source for step in assignment.steps if step.kind == "answer"}
    run = Run(assignment, solved, Limits())
    static_phase(run)
    steps = graded_steps(run)
    code = [s for s in assignment.steps if s.kind == "code"]
    assert {s.kind for s in assignment.steps if s not in steps} <= {"code"}
    assert len([s for s in steps if s.kind == "code"]) < len(code)


def test_an_answer_nested_past_the_visitors_depth_asks_for_the_whole_notebook():
    """A cell that parses but is nested deeper than the recursive visitors follow never crashes the grader: an
    answer gets the whole notebook (the full run grades it as before), a trusted cell always runs."""
    chain = "f = x" + ".a" * 2000
    assert dynamic(chain) and analyse(chain, set(), {}, trusted=True).opaque
    assert analyse("f = x" + ".a" * 50, set(), {}, trusted=False).reads == {"x"}

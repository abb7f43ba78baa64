"""Test-wide set-up: a headless plot backend and run-time shape checking on request.

How tests are spread over pytest-xdist's workers is xdist's own `--dist loadscope` rule
(pyproject.toml; tests/per_notebook.py, checked by tests/test_scheduling.py), not a hook here."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
# Notebooks and checks run by the tests keep no learner's parts (tfedu.checks.carry): a passing check on the
# source notebooks' solutions would otherwise write notebooks/my_tfedu/. tests/test_carry.py turns it on.
os.environ["TFEDU_MY_PARTS"] = "off"

# Before any test imports triton (torch's FlopCounterMode does): without a GPU, tfedu.kernels switches
# on Triton's CPU interpreter, which only works when it happens before triton's first import.
import tfedu.kernels  # noqa: E402, F401

import pytest  # noqa: E402
import torch  # noqa: E402
from beartype import beartype  # noqa: E402
from jaxtyping import jaxtyped  # noqa: E402

# pytest-xdist runs a worker per core (`-n auto`): torch's default of a thread per core in every worker puts two
# threads on each core, which wait on each other and spin (measured: 5% more CPU on the model tests, 2 cores).
# Each worker gets its share of the cores; tests that need another count set it themselves. Subprocesses
# (kernels, graders, torchrun) are untouched.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def shape_checked(fn):
    """Wrap a tfedu function so its jaxtyping annotations are enforced (STYLE.md: Shapes).

    Applied in tests rather than globally, so the functions' own clear error messages for bad
    input stay testable.
    """
    return jaxtyped(typechecker=beartype)(fn)


@pytest.fixture
def typechecked():
    return shape_checked


@pytest.fixture
def one_torch_thread():
    """Run a test on one torch thread, then put the count back.

    The tensors in most tests are tiny: a second thread only adds hand-off cost (5 ms per matmul on a
    busy 2-core box), and its spin-waiting counts as CPU time where a test measures CPU time.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The costliest units first (measured: grading a notebook, the tamper and honest-grading fixtures, a whole
# notebook's run), then everything else in its usual order. xdist's loadscope hands units out in
# collection order, so with the long ones first the short tests fill in around them instead of one
# worker grading notebook 08 alone at the end. Order only: no test is added, dropped or regrouped.
FIRST = ("test_notebooks.py", "test_grading_tamper.py", "test_grading_honest.py",
         "test_grading_sandbox_attacks.py", "test_release.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: within a file the order stays as written


@pytest.fixture(scope="session", autouse=True)
def warm_kernel_servers():
    """Each worker keeps its warm-kernel servers (tfedu.course.grading.warm) for the whole session instead of
    starting one per grading call: the suite grades in some hundred calls, and each new server imports torch
    again. Tests that check grading leaves nothing behind grade inside ``warm.scope(fresh=True)``."""
    from tfedu.course.grading import warm

    with warm.scope():
        yield

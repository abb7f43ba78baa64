"""Test-wide set-up: a headless plot backend and run-time shape checking on request."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")

# Before any test imports triton (torch's FlopCounterMode does): without a GPU, tfedu.kernels switches
# on Triton's CPU interpreter, which only works when it happens before triton's first import.
import tfedu.kernels  # noqa: E402, F401

import pytest  # noqa: E402
from beartype import beartype  # noqa: E402
from jaxtyping import jaxtyped  # noqa: E402


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


# Test files whose tests each run one notebook and share no set-up: xdist may hand their tests to different
# workers. Every other file (and every notebook's nbval cells) stays on one worker, as --dist loadscope keeps
# them: their module fixtures are built once, and a notebook's cells run in order in one kernel.
SPREAD_FILES = {"test_release.py", "test_grading_notebooks.py"}


# tryfirst: xdist's own collection hook turns these markers into node-id suffixes, and a plugin registered
# after this conftest (as xdist's worker plugin is) runs first unless this one asks to: without it no test had
# a group, and a notebook's cells went to different workers (NameError in the later cells).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = item.nodeid if item.path.name in SPREAD_FILES else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))

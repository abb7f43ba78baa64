"""Test-wide set-up: a headless plot backend and run-time shape checking on request."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")

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

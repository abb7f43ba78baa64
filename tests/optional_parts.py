"""Marks for tests that need an optional part of the machine: the grading sandbox (bubblewrap),
Chromium, a GPU. Without the part such a test skips and says why and how to get it.

Where the environment variable ``TFEDU_REQUIRE`` names the part (``.ci/run`` sets
``TFEDU_REQUIRE="bwrap chromium"``), the mark does not skip: the test runs and fails with the
part's own error, so a CI machine that lost the part cannot pass by skipping.
"""

import functools
import os
import shutil

import pytest

REQUIRED = set(os.environ.get("TFEDU_REQUIRE", "").split())


def needs(part: str, available: bool, reason: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not available and part not in REQUIRED, reason=reason)


@functools.lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """Why this machine cannot make the grading sandbox, or None when it can."""
    from tfedu.course.grading import sandbox

    try:
        sandbox.find()
    except sandbox.SandboxUnavailable as err:
        return str(err)
    return None


SANDBOX_REASON = f"needs the grading sandbox ({sandbox_problem()}): apt-get install bubblewrap"
needs_sandbox = needs("bwrap", sandbox_problem() is None, SANDBOX_REASON)


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


needs_chromium = needs("chromium", chromium_path() is not None,
                       "needs Chromium for the browser test: apt-get install chromium")


def sandbox_or_skip():
    """The grading sandbox; without one, skip the test (or fail it where TFEDU_REQUIRE names bwrap).

    For fixtures that grade: every test that uses the fixture skips with the reason."""
    from tfedu.course.grading import sandbox

    problem = sandbox_problem()
    if problem is not None:
        if "bwrap" in REQUIRED:
            pytest.fail(f"no grading sandbox on this machine ({problem}), and TFEDU_REQUIRE names bwrap")
        pytest.skip(SANDBOX_REASON)
    return sandbox.find()

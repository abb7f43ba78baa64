"""Every docstring example in tfedu runs and prints what it shows (STYLE.md: worked examples)."""

import doctest
import importlib
import pkgutil

import pytest

import tfedu

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(tfedu.__path__, prefix="tfedu.") if not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"

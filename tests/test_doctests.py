"""Every `>>>` example in the packages' docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import disagg
import transfer_core


def _modules() -> list[str]:
    names = []
    for package in (disagg, transfer_core):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", [n for n in _modules() if ">>>" in (
    importlib.util.find_spec(n).loader.get_source(n) or "")])  # type: ignore[union-attr]
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    failed, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert tried > 0
    assert failed == 0, f"{failed} of {tried} examples in {name} failed (see the output)"

"""Every name xlaunch.llm and xlaunch.llm.api declare in ``__all__`` resolves from the package."""
from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module", ["xlaunch.llm", "xlaunch.llm.api"])
def test_every_declared_name_resolves_from_the_package(module):
    declared = importlib.import_module(module).__all__
    package = importlib.import_module("xlaunch.llm")
    missing = [name for name in declared if not hasattr(package, name)]
    assert not missing, f"{module}.__all__ names what xlaunch.llm does not give: {missing}"


def test_is_optimized_says_no_for_a_plain_module():
    import torch

    from xlaunch.llm import is_optimized

    assert is_optimized(torch.nn.Linear(2, 2)) is False

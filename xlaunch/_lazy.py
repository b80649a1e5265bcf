"""Packages whose public names live in submodules loaded on first use (``import xlaunch`` stays
light: nothing here imports more than the standard library's ``importlib``)."""
from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Callable


def load_export(module: str, name: str, what: str) -> object:
    """``module.name``; torch missing is one ImportError naming ``what`` and the extra."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        from xlaunch._torch import needs_torch

        with needs_torch(what):   # torch missing: the one message naming the extra
            raise


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps each exported name to the module
    that defines it. Torch missing is one ImportError naming ``package.name`` and the extra."""

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = load_export(module, name, f"{package}.{name}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__


def make_callable(package: str, function: str, module: str) -> None:
    """Calling ``package`` calls ``module.function``. Once ``xlaunch.kernels.optimize`` (the package)
    is imported it shadows the lazy function of the same name on ``xlaunch.kernels``, so
    ``from xlaunch.kernels import optimize; optimize(model)`` must still work."""

    class CallablePackage(type(sys)):
        def __call__(self, *args: object, **kwargs: object) -> object:
            return getattr(importlib.import_module(module), function)(*args, **kwargs)

    sys.modules[package].__class__ = CallablePackage

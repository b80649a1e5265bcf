"""What every route is: a name, what it needs installed, how to build it from the model and a
sample call, and how to load it again from the artifacts it left in the cache."""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    from torch import nn

from xlaunch.kernels.optimize.engines.report import PIP_LINES
from xlaunch.kernels.optimize.engines.sample import Sample


def missing_module(modules: tuple[str, ...], pip_line: Optional[str] = None) -> Optional[str]:
    """``"<module> is not installed: <pip line>"`` for the first of ``modules`` that cannot be
    imported here (found without importing it), or None."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{module} is not installed: {pip_line or 'pip install ' + module}"
    return None


class Built:
    """One built route: ``runner(*args)`` answers a call as the model would (same structure)."""

    def __init__(self, runner: Callable[..., Any], *, files: Optional[dict[str, bytes]] = None,
                 state: Optional[dict[str, Any]] = None, module: Optional[nn.Module] = None,
                 serves_any_batch: bool = True) -> None:
        self.runner = runner
        self.files = files or {}          # artifacts to cache (name -> content)
        self.state = state or {}          # small JSON facts to cache (e.g. what the torch route kept)
        self.module = module              # the module to return, when the route makes one itself
        self.serves_any_batch = serves_any_batch


class Context:
    """What routes share: the thread count engines get, the torch route's ``optimize``, its level
    and flags, and the precision the routes compute in (``dtype``: None is fp32; see :mod:`.lowp`)."""

    def __init__(self, threads: int, torch_optimize: Callable[..., nn.Module], level: str = "O1",
                 flags: Optional[dict[str, Any]] = None, dtype: Any = None) -> None:
        self.threads = threads
        self.torch_optimize = torch_optimize
        self.level = level
        self.flags = flags or {}
        self.dtype = dtype


class Route:
    """A way to run the model. Subclasses set ``name`` and ``needs`` and implement ``build``."""

    name = ""
    needs: tuple[str, ...] = ()           # modules that must be importable
    cached_files = False                  # True: its artifacts are worth caching (an export)

    def missing(self) -> Optional[str]:
        """Why the route cannot be built here (a library not installed, naming the pip line)."""
        return missing_module(self.needs, PIP_LINES.get(self.name))

    def build(self, model: nn.Module, sample: Sample, context: Context) -> Built:
        raise NotImplementedError

    def load(self, model: nn.Module, sample: Sample, context: Context, files: dict[str, bytes],
             state: dict[str, Any]) -> Built:
        """Again from the cache (by default: built again; routes with artifacts override this)."""
        return self.build(model, sample, context)

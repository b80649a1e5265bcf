"""Ranks of an existing engine, each on its own cores: torchrun's agent behind ``--nproc-per-node``
and ``--per-rank`` inside any engine's ranks (:mod:`.launch`); the front that supervises that
agent and its ranks (:mod:`.front`); where a rank sits on its node, from the engine's variables
(:mod:`.ranks`). The engine stays theirs."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports

_LAZY = {
    "launch_distributed": "xlaunch.launcher.distributed.launch",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

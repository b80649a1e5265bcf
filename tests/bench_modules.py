"""``load(name)``: bench/<name>.py imported as module ``bench_<name>`` (once per process), for the
tests of the benches' own logic."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str):
    if f"bench_{name}" in sys.modules:
        return sys.modules[f"bench_{name}"]
    if str(BENCH) not in sys.path:        # bench modules import their siblings (_llamacpp, _procmem, ...)
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses look their module up
    spec.loader.exec_module(module)
    return module

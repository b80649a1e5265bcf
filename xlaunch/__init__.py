"""xlaunch: CPU performance launcher and runtime-tuning toolkit for stock PyTorch.

``import xlaunch`` is light: the runtime and kernel APIs are loaded on first use, and
nothing here imports torch. This module's body is kept to a few statements and imports no other
module: ``python -m xlaunch`` runs it before its Ctrl-C handling can start.
"""
__version__ = "0.1.0"

_LAZY = {
    "CPUPool": "xlaunch.runtime_ext",
    "pin": "xlaunch.runtime_ext",
    "Task": "xlaunch.runtime_ext",
    "MultiStreamModule": "xlaunch.runtime_ext",
    "MultiStreamModuleHint": "xlaunch.runtime_ext",
    "get_default_num_streams": "xlaunch.runtime_ext",
    "get_core_list_of_node_id": "xlaunch.runtime_ext",
    "is_runtime_ext_enabled": "xlaunch.runtime_ext",
    "optimize": "xlaunch.kernels",
    "quantize": "xlaunch.kernels",
    "load_quantized": "xlaunch.kernels",
}

__all__ = ["__version__", *_LAZY]

# Names of modules that moved into rooms (the 0.1 layout): xlaunch/_moved.py maps them, loaded
# only when one of them is imported.
_MOVED_TOP = frozenset((
    "machine", "report", "cli_click", "cli_parse", "cli_spec", "compat", "options", "environment", "which",
    "binding", "runner", "spawning", "watchdog", "logfiles", "output", "summary", "probe", "ranks",
    "autooptimize", "_inject", "splitbf16", "splitstate", "quantize_routes", "quantize_policy",
    "compare", "dispatch", "fold", "freeze", "layout", "measure", "notes", "precision", "arch",
))


class _MovedModules:
    """First on ``sys.meta_path``: hands an old module path to :mod:`xlaunch._moved`."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        parts = name.split(".", 3)
        if len(parts) < 3 or parts[0] != "xlaunch" or parts[1] not in ("launcher", "kernels", "llm") \
                or parts[2] not in _MOVED_TOP:
            return None
        from xlaunch._moved import find_spec

        return find_spec(name)


def __getattr__(name):
    if name == "nn":   # `import xlaunch as ipex; ipex.nn.modules.MergedEmbeddingBag` (loads torch on use)
        from importlib import import_module

        return import_module("xlaunch.nn")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xlaunch' has no attribute {name!r}")
    from xlaunch._lazy import load_export

    value = globals()[name] = load_export(module, name, f"xlaunch.{name}")
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__import__("sys").meta_path.insert(0, _MovedModules)

"""One answer to "torch is not installed": an ImportError that names the extra to install.

The lazy exports of :mod:`xlaunch`, :mod:`xlaunch.runtime_ext` and :mod:`xlaunch.kernels` load
their modules through :func:`load_attribute`, and every module that needs torch imports it inside
``with needs_torch(__name__):``, so ``xlaunch.optimize``, ``xlaunch.MultiStreamModule`` or
``import xlaunch.kernels.optimize.fold`` without torch says what to do instead of
``ModuleNotFoundError: No module named 'torch'``. Imports nothing heavy.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

INSTALL = 'pip install "xlaunch[torch]"'


def missing_torch_message(what: str) -> str:
    """The one message: ``what`` needs torch, and how to get it."""
    return f"{what} needs PyTorch, which is not installed here: {INSTALL}"


def torch_installed() -> bool:
    """Whether ``import torch`` can find a torch (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def _is_torch(name: object) -> bool:
    return isinstance(name, str) and (name == "torch" or name.startswith("torch."))


@contextlib.contextmanager
def needs_torch(what: str) -> Iterator[None]:
    """Around a module's torch imports (``with needs_torch(__name__): import torch``): torch
    missing becomes one ImportError naming ``what`` and the extra to install, with
    ``name == "torch"`` (also when a nested torch-needing import raised it first).

    Any other missing module (a bug, or another optional dependency) propagates unchanged.
    """
    try:
        yield
    except ImportError as exc:
        if not _is_torch(exc.name):
            raise
        raise ImportError(missing_torch_message(what), name="torch") from None


def load_attribute(module: str, name: str, what: str) -> object:
    """``getattr(import_module(module), name)``, torch missing reported as :func:`needs_torch`
    does for ``what``."""
    with needs_torch(what):
        return getattr(importlib.import_module(module), name)




def tensor_version(tensor: object) -> int:
    """``tensor``'s version counter (in-place changes move it), or -1 for an inference tensor (a model made or
    copied under ``torch.inference_mode``), which keeps none (asking raises). No cost beyond the attribute
    read otherwise: weights checks run it on every call."""
    try:
        return tensor._version  # type: ignore[attr-defined]
    except RuntimeError:
        return -1


NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_import_logs() -> Iterator[None]:
    """Within the block, torchao's import-time log lines are silenced (its loggers and torch's
    pytree at ERROR, restored after): torchao logs one warning per CUDA-only library it cannot
    load and, through torch's pytree, one deprecation line per Enum it registers."""
    import logging

    loggers = [logging.getLogger(name) for name in NOISY_IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic collector passes inside (the state before is restored after): while a large library
    imports (transformers' model modules pull in torch._dynamo, torchao...), each full pass traverses every
    object imported so far: importing Llama's modeling made 6 of them. Cycles made inside wait for the next
    pass after it. ``from_pretrained`` of a packed 168M file, whole process: 2.68 -> 2.55 s (Zen 5 VM)."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def import_quietly(*modules: str, chain: bool = False) -> None:
    """Import each of ``modules`` that is installed, within :func:`quiet_import_logs`.

    transformers imports torchao when it is installed (its torchao quantizer, on the first model
    built): importing those modules first keeps a decoding run's output free of torchao's lines.
    A module that fails to import is left for its own caller to report; with ``chain``, the ones
    after it are not imported either (torchao costs seconds, and is only noise through transformers).
    """
    import importlib.util

    with quiet_import_logs(), paused_gc():
        for module in modules:
            try:
                if importlib.util.find_spec(module.partition(".")[0]) is not None:
                    importlib.import_module(module)
                    continue
            except Exception:   # noqa: BLE001  (a broken optional package is its importer's to report)
                pass
            if chain:
                return

"""Runtime extension: pin torch's OpenMP threads, run pinned tasks and multi-stream models.

Works with whichever OpenMP runtime the process loaded (GNU libgomp, Intel libiomp5, LLVM
libomp), found in ``/proc/self/maps`` and driven with ctypes. Importing this package is light:
each name loads its module on first use, and only ``MultiStreamModule`` imports torch. IPEX's
runtime names (``ipex.cpu.runtime``) are all here, so ported code runs with only the import
changed.
"""
from __future__ import annotations


from xlaunch._lazy import lazy_exports
from xlaunch.runtime_ext import topology as _topology  # noqa: F401 - notes the affinity at import

_LAZY = {
    "CPUPool": "xlaunch.runtime_ext.pool",
    "pin": "xlaunch.runtime_ext.pool",
    "Task": "xlaunch.runtime_ext.task",
    "MultiStreamModule": "xlaunch.runtime_ext.streams",
    "StreamHint": "xlaunch.runtime_ext.batching",
    "MultiStreamModuleHint": "xlaunch.runtime_ext.batching",
    "get_default_num_streams": "xlaunch.runtime_ext.batching",
    "TaskFuture": "xlaunch.runtime_ext.task",
    "get_core_list_of_node_id": "xlaunch.runtime_ext.pool",
    "is_runtime_ext_enabled": "xlaunch.runtime_ext.openmp",
    "threadpool_info": "xlaunch.runtime_ext.threadpool",
    "set_num_threads": "xlaunch.runtime_ext.threadpool",
    "get_num_threads": "xlaunch.runtime_ext.threadpool",
    "threads": "xlaunch.runtime_ext.threadpool",
    "pinning_supported": "xlaunch.runtime_ext.openmp",
    "OpenMPNotFoundError": "xlaunch.runtime_ext.openmp",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

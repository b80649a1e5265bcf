"""Native pinning without numactl: CPU affinity, NUMA memory policy, parent-death signal.

CPU affinity (``sched_setaffinity``) and the memory policy (``set_mempolicy``) are attributes
of a *thread*, and a new process inherits them from the thread that forks it. The runner
therefore pins its own spawning thread to an instance's CPUs and nodes, starts the instance,
and restores the thread (:func:`pinned_thread`). No code runs in the child between fork and
exec for pinning, so it is safe even when the launcher has other threads, and a refusal is
an ordinary Python exception in the launcher rather than a silent failure in a child.

Only ``prctl(PR_SET_PDEATHSIG)`` must run in the child itself (:func:`die_with_parent`).

Linux only; memory-policy syscalls are known for x86_64 and aarch64, elsewhere they raise
``OSError(ENOSYS)`` and callers fall back to CPU binding.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
from contextlib import contextmanager

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Iterator, Sequence

# <linux/mempolicy.h>
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_LOCAL = 4
MEMBIND_MODES = {"preferred": MPOL_PREFERRED, "bind": MPOL_BIND, "interleave": MPOL_INTERLEAVE}
MODE_NAMES = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind",
              MPOL_INTERLEAVE: "interleave", MPOL_LOCAL: "local"}
_MODE_FLAGS_MASK = 0xFFFF  # MPOL_F_STATIC_NODES / RELATIVE_NODES / NUMA_BALANCING live above

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

# (set_mempolicy, get_mempolicy) syscall numbers
_SYSCALLS = {"x86_64": (238, 239), "amd64": (238, 239), "aarch64": (237, 236), "arm64": (237, 236)}
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_GET_MASK_WORDS = 1024 // _ULONG_BITS  # enough for MAX_NUMNODES on every distro kernel

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_prctl = _libc.prctl
_prctl.restype = ctypes.c_int
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _syscall_numbers() -> tuple[int, int] | None:
    return _SYSCALLS.get(os.uname().machine.lower())


def _raise_errno(what: str) -> None:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


def _nodemask(nodes: Sequence[int]) -> tuple[ctypes.Array, int]:
    """An ``unsigned long[]`` bitmask of ``nodes`` and the kernel's ``maxnode`` (bits + 1)."""
    words = max(nodes, default=0) // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    for node in nodes:
        if node < 0:
            raise ValueError(f"negative NUMA node {node}")
        mask[node // _ULONG_BITS] |= 1 << (node % _ULONG_BITS)
    return mask, words * _ULONG_BITS + 1


def set_mempolicy(mode: int, nodes: Sequence[int] = ()) -> None:
    """Set the calling thread's NUMA memory policy (``mode`` may carry MPOL_F_* flags)."""
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(errno.ENOSYS, f"set_mempolicy: unknown syscall number on {os.uname().machine}")
    if (mode & _MODE_FLAGS_MASK) in (MPOL_DEFAULT, MPOL_LOCAL) or not nodes:
        result = _syscall(ctypes.c_long(numbers[0]), ctypes.c_int(mode), None, ctypes.c_ulong(0))
    else:
        mask, maxnode = _nodemask(nodes)
        result = _syscall(ctypes.c_long(numbers[0]), ctypes.c_int(mode), mask, ctypes.c_ulong(maxnode))
    if result != 0:
        _raise_errno(f"set_mempolicy({MODE_NAMES.get(mode & _MODE_FLAGS_MASK, mode)}, {list(nodes)})")


def get_mempolicy() -> tuple[int, tuple[int, ...]]:
    """The calling thread's memory policy: ``(mode including MPOL_F_* flags, nodes)``."""
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(errno.ENOSYS, f"get_mempolicy: unknown syscall number on {os.uname().machine}")
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * _GET_MASK_WORDS)()
    result = _syscall(ctypes.c_long(numbers[1]), ctypes.byref(mode), mask,
                      ctypes.c_ulong(_GET_MASK_WORDS * _ULONG_BITS + 1), None, ctypes.c_ulong(0))
    if result != 0:
        _raise_errno("get_mempolicy")
    nodes = tuple(w * _ULONG_BITS + b for w in range(_GET_MASK_WORDS) for b in range(_ULONG_BITS)
                  if mask[w] >> b & 1)
    return mode.value, nodes


def mempolicy_for(membind: str, mem_nodes: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
    """The ``(mode, nodes)`` to apply for an instance's ``membind`` choice, or None for no policy.

    ``preferred`` names one node (the kernel's MPOL_PREFERRED): the instance's first node.
    """
    if membind == "none" or not mem_nodes:
        return None
    if membind not in MEMBIND_MODES:
        raise ValueError(f"unknown membind {membind!r} (expected bind, preferred, interleave or none)")
    nodes = tuple(sorted(set(mem_nodes)))
    if membind == "preferred":
        nodes = nodes[:1]
    return MEMBIND_MODES[membind], nodes


class MemoryPolicyRefused(OSError):
    """``set_mempolicy`` was refused (EPERM/ENOSYS/EINVAL, typical in containers)."""


@contextmanager
def pinned_thread(cpus: Sequence[int], policy: tuple[int, tuple[int, ...]] | None) -> Iterator[None]:
    """Pin the calling thread to ``cpus`` (and ``policy``) for the block, then restore it.

    Processes forked inside the block inherit the pinning. Raises :class:`OSError` when the
    CPUs cannot be used; raises :class:`MemoryPolicyRefused` (before changing anything) when
    the memory policy is refused, so the caller can retry with ``policy=None``.
    """
    saved_cpus = os.sched_getaffinity(0)
    saved_policy = None
    if policy is not None:
        try:
            saved_policy = get_mempolicy()
            set_mempolicy(*policy)
        except OSError as refused:
            raise MemoryPolicyRefused(refused.errno, str(refused)) from None
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        yield
    finally:
        os.sched_setaffinity(0, saved_cpus)
        if saved_policy is not None:
            set_mempolicy(*saved_policy)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child: ask the kernel to send ``sig`` when the forking thread dies (PR_SET_PDEATHSIG)."""
    if _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        _raise_errno("prctl(PR_SET_PDEATHSIG)")


def set_child_subreaper(enabled: bool) -> bool:
    """Adopt orphaned descendants (PR_SET_CHILD_SUBREAPER); returns the previous setting."""
    previous = ctypes.c_int(0)
    _prctl(PR_GET_CHILD_SUBREAPER, ctypes.addressof(previous), 0, 0, 0)
    if _prctl(PR_SET_CHILD_SUBREAPER, int(enabled), 0, 0, 0) != 0:
        _raise_errno("prctl(PR_SET_CHILD_SUBREAPER)")
    return bool(previous.value)

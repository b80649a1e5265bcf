"""The machine model: read once from ``XLAUNCH_FSROOT`` (default ``/``), then frozen.

``load_machine()`` reads topology (:mod:`.topology`), this process's limits (:mod:`.limits`),
the ISA (:mod:`.isa`), the preloadable libraries (:mod:`.libraries`) and the host settings
(:mod:`.host`). Nothing here runs a
subprocess or imports torch; missing or odd files become :attr:`Machine.notes`.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional

from xlaunch.machine._files import Notes, decimal, join, read_text, status_fields
from xlaunch.machine.host import read_host
from xlaunch.machine.isa import ISA_FLAGS, read_isa
from xlaunch.machine.libraries import find_libraries
from xlaunch.machine.limits import fallback_cpus, read_limits
from xlaunch.machine.model import (
    EFFICIENCY,
    PERFORMANCE,
    UNKNOWN_KIND,
    CacheDomain,
    Core,
    Cpu,
    Host,
    Isa,
    Library,
    Machine,
    Node,
)
from xlaunch.machine.topology import read_topology

FSROOT_ENV = "XLAUNCH_FSROOT"

__all__ = [
    "EFFICIENCY", "FSROOT_ENV", "ISA_FLAGS", "PERFORMANCE", "UNKNOWN_KIND",
    "CacheDomain", "Core", "Cpu", "Host", "Isa", "Library", "Machine", "MachineRootError", "Node",
    "current_machine", "load_machine", "memory_available", "recorded_root_problem", "resolve_root",
]


class MachineRootError(ValueError):
    """The machine root (``XLAUNCH_FSROOT``) is missing, not a directory, or a bad archive."""


def resolve_root(root: Optional[str] = None) -> str:
    """``root``, else ``$XLAUNCH_FSROOT``, else ``/``; checked to be a directory.

    A recorded machine archive (``.tar.xz``, see :mod:`.archive`) resolves to its unpacked copy.
    """
    if root is None:
        root = os.environ.get(FSROOT_ENV) or "/"
    if os.path.isfile(root):
        from xlaunch.machine import archive   # tarfile/lzma only for a file root

        if archive.is_archive(root):
            try:
                return archive.unpacked_root(root)
            except archive.UNREADABLE as exc:
                raise MachineRootError(f"machine archive {root!r} cannot be unpacked: {exc}") from None
    if not os.path.isdir(root):
        problem = "does not exist" if not os.path.exists(root) else "is not a directory"
        raise MachineRootError(
            f"machine root {root!r} {problem}: {FSROOT_ENV} must name a directory holding a "
            f"recorded sys/ and proc/, or its .tar.xz (unset it to read this machine)"
        )
    return root


def memory_available(root: Optional[str] = None) -> Optional[int]:
    """``MemAvailable`` of ``<root>/proc/meminfo`` in bytes (root as :func:`resolve_root`), read now
    (a live value, not a fact of the model); None when the root or the field cannot be read."""
    try:
        text = read_text(join(resolve_root(root), "proc/meminfo"))
    except MachineRootError:
        return None
    number = decimal((status_fields(text or "").get("MemAvailable", "").split() or [""])[0])
    return None if number is None else number * 1024


def recorded_root_problem(root: str) -> Optional[str]:
    """Why ``root`` is not a recorded machine, or None when it holds one.

    The library reads whatever is there (missing files become notes), but a root with no CPU
    directory at all would silently describe an invented 1-CPU machine; the CLI refuses it.
    """
    cpu_dir = os.path.join(root, "sys", "devices", "system", "cpu")
    try:
        names = os.listdir(cpu_dir)
    except OSError:
        return f"{root!r} has no sys/devices/system/cpu: not a recorded machine tree"
    if not any(n in ("online", "possible", "present") or (n.startswith("cpu") and n[3:].isdigit())
               for n in names):
        return f"{cpu_dir!r} lists no CPUs (no cpuN directories, no online/possible lists)"
    return None


def load_machine(root: Optional[str] = None, *, live: Optional[bool] = None) -> Machine:
    """Read the machine under ``root`` (default ``$XLAUNCH_FSROOT`` or ``/``).

    ``live`` (default: the root is ``/``) also asks the running kernel about this process:
    ``sched_getaffinity`` for the allowed CPUs and ``arch_prctl`` for AMX permission.
    Raises :class:`MachineRootError` when the root is not a directory.
    """
    root = resolve_root(root)
    if live is None:
        live = os.path.realpath(root) == "/"
    notes = Notes()
    topology = read_topology(root, notes, fallback_cpus=fallback_cpus(root, live))
    memory_nodes = [n.id for n in topology.nodes if n.memory_kib is None or n.memory_kib > 0]
    limits = read_limits(root, live, topology.online_cpus, memory_nodes, notes)
    return Machine(
        root=root,
        cpus=topology.cpus,
        cores=topology.cores,
        nodes=topology.nodes,
        l3_domains=topology.l3_domains,
        allowed_cpus=limits.allowed_cpus,
        allowed_mems=limits.allowed_mems,
        cpu_budget=limits.cpu_budget,
        isolated_cpus=limits.isolated_cpus,
        isa=read_isa(root, live, notes),
        libraries=find_libraries(),
        notes=notes.as_tuple(),
        host=read_host(root, topology.online_cpus),
    )


_CURRENT: dict[str, Machine] = {}


def current_machine() -> Machine:
    """The machine of this process, read on first use and cached per ``XLAUNCH_FSROOT``.

    For in-process users (CPU pools, runtime tuning); call :func:`load_machine` for a fresh read.
    """
    key = os.environ.get(FSROOT_ENV) or "/"
    machine = _CURRENT.get(key)
    if machine is None:
        machine = _CURRENT[key] = load_machine()
    return machine


def clear_cache() -> None:
    """Forget the cached :func:`current_machine` (e.g. after changing affinity)."""
    _CURRENT.clear()

"""``--share-imports``: which processes import the modules once, and which instances each forks (pure).

A forked instance shares, copy-on-write, every page its server filled while importing: with torch,
about 220 MiB a process that would otherwise be each instance's own (docs/launcher.md, "Shared
imports"). Instances are grouped by memory placement (policy and nodes), and each group's server
imports on its instances' CPUs under their policy, so the pages they share lie on their node.

A server starts with what its instances' environments have in common, less the variables that
place one instance's OpenMP threads: an OpenMP runtime reads those once, when it is loaded, so
the forked instance pins its own team instead (the runner's fork server does it). With
``--auto-optimize`` the server's ``PYTHONPATH`` also leaves out the hooks' ``sitecustomize`` folder:
the server runs the user's own ``sitecustomize`` as a plain interpreter would, and each forked
instance installs the hooks itself, from its own environment (settings, record file, messages).
"""
from __future__ import annotations

import os

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Sequence

from xlaunch.launcher.errors import OptionError
from xlaunch.launcher.plan.records import ImportServer, Instance

# Read by the OpenMP runtime at load (libgomp) or first use (libiomp5), or naming one instance.
PER_INSTANCE = frozenset({"OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY",
                          "XLAUNCH_INSTANCE_INDEX", "XLAUNCH_CPUS"})


def import_servers(instances: Sequence[Instance], modules: Sequence[str],
                   hooks_dir: str = "") -> tuple[ImportServer, ...]:
    """One server per (memory policy, memory nodes) among ``instances``, in instance order. ``hooks_dir``:
    the ``--auto-optimize`` folder the servers' ``PYTHONPATH`` leaves out ("": none)."""
    groups: dict[tuple[str, tuple[int, ...]], list[Instance]] = {}
    for instance in instances:
        groups.setdefault((instance.membind, instance.mem_nodes), []).append(instance)
    servers = []
    for (membind, mem_nodes), members in groups.items():
        first, rest = members[0], members[1:]
        env = {name: value for name, value in first.env.items()
               if name not in PER_INSTANCE and all(other.env.get(name) == value for other in rest)}
        if hooks_dir and "PYTHONPATH" in env:
            entries = [entry for entry in env["PYTHONPATH"].split(os.pathsep) if entry and entry != hooks_dir]
            env["PYTHONPATH"] = os.pathsep.join(entries)
            if not entries:
                del env["PYTHONPATH"]
        servers.append(ImportServer(
            modules=tuple(modules),
            indices=tuple(m.index for m in members),
            cpus=tuple(sorted({cpu for m in members for cpu in m.cpus})),
            mem_nodes=mem_nodes,
            membind=membind,
            env=env,
        ))
    return tuple(servers)


def server_of(servers: Sequence[ImportServer], index: int) -> int:
    """The position in ``servers`` of the one that forks instance ``index`` (-1: none)."""
    return next((n for n, server in enumerate(servers) if index in server.indices), -1)


# a dotted module name as ``import`` takes it (ASCII: a name from a command line, never a path)
_MODULE_NAME = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
MAX_SHARED_MODULES = 32


def module_names(option: str, value: Any, where: str) -> tuple[str, ...]:
    """``torch,transformers`` (CLI or TOML string) or a TOML list -> the module names, checked."""
    import re

    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        items = [item.strip() for item in value]
    else:
        raise OptionError(option, f"expected module names like torch,transformers, got {value!r}{where}")
    names: list[str] = []
    for item in items:
        if len(item) > 200 or not re.fullmatch(_MODULE_NAME, item):
            raise OptionError(option, f"{item[:60]!r} is not a module name (expected names like torch or "
                                      f"transformers.models.llama){where}")
        if item not in names:
            names.append(item)
    if not names:
        raise OptionError(option, f"empty list{where}")
    if len(names) > MAX_SHARED_MODULES:
        raise OptionError(option, f"{len(names)} modules: at most {MAX_SHARED_MODULES}{where}")
    return tuple(names)


def validate_shared_imports(o: Any) -> None:
    """``--share-imports`` among the other options (``o``: the Options): a Python program, pinned natively
    (a numactl/taskset prefix execs a new process, which shares nothing), started by xlaunch's own runner."""
    if not o.share_imports:
        return
    if o.no_python:
        raise OptionError("--share-imports", "needs a Python program (conflicts with --no-python)")
    if o.bind_with in ("numactl", "taskset"):
        raise OptionError("--share-imports", f"conflicts with --bind-with {o.bind_with} (the tool execs a new "
                                             "process, which shares nothing): use --bind-with native")
    for flag, given in (("--nproc-per-node", o.nproc_per_node is not None), ("--per-rank", o.per_rank)):
        if given:
            raise OptionError("--share-imports", f"conflicts with {flag} (torch's agent starts the ranks)")

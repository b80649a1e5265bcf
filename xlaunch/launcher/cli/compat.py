"""Command lines of IPEX's ``ipexrun`` and torch's ``run_cpu`` that users type from habit.

Spellings that only differ in dashes/underscores or in an old name live in
:data:`xlaunch.launcher.plan.options.ALIASES`. Here are the ones whose *meaning* must be translated
(``--enable-jemalloc`` is ``--memory-allocator jemalloc``) and the ones that cannot carry over,
refused with one line naming what to do instead. The CLI registers every spelling below as a
hidden option and calls :func:`translate` on what was given; ``docs/launcher.md`` has the table.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Callable, Mapping, Optional

from xlaunch._records import record
from xlaunch.launcher.errors import OptionError


@record
class Spelling:
    name: str                         # click parameter name (underscores)
    takes_value: bool
    origin: str                       # who spells it so: run_cpu, ipexrun
    meaning: str                      # for people and docs: what xlaunch does with it
    to_options: Optional[Callable[[Any], dict[str, Any]]] = None   # None: refused with ``meaning``


def _fixed(**options: Any) -> Callable[[Any], dict[str, Any]]:
    return lambda _value: dict(options)


def _multi_task_manager(value: Any) -> dict[str, Any]:
    text = str(value).strip().lower()
    if text not in ("auto", "none", "numactl", "taskset"):
        raise OptionError("--multi-task-manager", f"{value!r} is not one of auto, none, numactl, taskset")
    return {"bind_with": text}


def _instance_index(value: Any) -> dict[str, Any]:
    return {} if str(value).strip() in ("-1", "") else {"instance_idx": value}


SPELLINGS: tuple[Spelling, ...] = (
    Spelling("enable_jemalloc", False, "run_cpu, ipexrun 1.x", "--memory-allocator jemalloc",
             _fixed(memory_allocator="jemalloc")),
    Spelling("enable_tcmalloc", False, "run_cpu, ipexrun 1.x", "--memory-allocator tcmalloc",
             _fixed(memory_allocator="tcmalloc")),
    Spelling("use_default_allocator", False, "run_cpu, ipexrun 1.x", "--memory-allocator default",
             _fixed(memory_allocator="default")),
    Spelling("disable_iomp", False, "run_cpu, ipexrun 1.x", "--omp-runtime default (GNU OpenMP)",
             _fixed(omp_runtime="default")),
    Spelling("disable_numactl", False, "run_cpu, ipexrun 1.x",
             "--membind none (CPUs stay pinned; memory is not bound)", _fixed(membind="none")),
    Spelling("disable_taskset", False, "run_cpu, ipexrun 1.x",
             "nothing (xlaunch pins without taskset); with --disable-numactl: --bind-with none", _fixed()),
    Spelling("use_logical_core", False, "run_cpu, ipexrun 1.x", "--use-logical-cores",
             _fixed(use_logical_cores=True)),
    Spelling("multi_task_manager", True, "ipexrun", "--bind-with (auto, none, numactl, taskset)",
             _multi_task_manager),
    Spelling("log_path", True, "run_cpu, ipexrun 1.x", "--log-dir", lambda v: {"log_dir": v}),
    Spelling("use_e_cores", False, "ipexrun", "--core-type all (performance and efficiency cores)",
             _fixed(core_type="all")),
    Spelling("rank", True, "run_cpu", "--instance-idx (-1: every instance)", _instance_index),
    Spelling("multi_instance", False, "run_cpu, ipexrun 1.x",
             "--throughput-mode unless --ninstances/--ncores-per-instance are given", _fixed()),
    Spelling("auto_ipex", False, "ipexrun", "--auto-optimize", _fixed(auto_optimize=True)),
    Spelling("auto_ipex_verbose", False, "ipexrun", "--auto-optimize-verbose",
             _fixed(auto_optimize_verbose=True)),
    Spelling("disable_ipex_graph_mode", False, "ipexrun",
             "not an option here: set XLAUNCH_AUTO_OPTIMIZE_FREEZE=none in the environment instead"),
    Spelling("enable_profiling", False, "ipexrun",
             "not supported: xlaunch does not profile; wrap the workload in torch.profiler.profile()"),
    Spelling("ccl_worker_count", True, "ipexrun",
             "--reserve-cores (cores of each rank kept for oneCCL's workers, CCL_WORKER_AFFINITY set)",
             lambda v: {"reserve_cores": v}),
    Spelling("logical_cores_for_ccl", False, "ipexrun",
             "not supported: reserved cores are whole cores; use --reserve-cores K (docs/distributed.md)"),
    Spelling("hostfile", True, "ipexrun",
             "not supported: start ranks with mpirun/srun and run `xlaunch --per-rank PROGRAM` in each"),
    Spelling("extra_mpi_params", True, "ipexrun",
             "not supported: pass MPI options to mpirun and run `xlaunch --per-rank PROGRAM` in each rank"),
    Spelling("more_mpi_params", True, "ipexrun 1.x",
             "not supported: pass MPI options to mpirun and run `xlaunch --per-rank PROGRAM` in each rank"),
    Spelling("distributed", False, "ipexrun 1.x",
             "not needed: use --nproc-per-node N (torchrun) or `xlaunch --per-rank` inside your MPI ranks"),
)
BY_NAME: dict[str, Spelling] = {s.name: s for s in SPELLINGS}
# spellings that only rename an option (ALIASES), and who spells them so
ALIAS_ORIGINS: dict[str, str] = {
    "ncore_per_instance": "ipexrun 1.x", "core_list": "run_cpu", "node_id": "run_cpu",
    "skip_cross_node_cores": "run_cpu, ipexrun 1.x", "nprocs_per_node": "ipexrun",
}
_SHAPE = ("ninstances", "ncores_per_instance", "throughput_mode", "latency_mode")


def flags(spelling: Spelling) -> list[str]:
    dashed = "--" + spelling.name.replace("_", "-")
    return [dashed, "--" + spelling.name] if "_" in spelling.name else [dashed]


def alias_note(typed: str) -> Optional[str]:
    """The ``note:`` for a flag typed in an old spelling that only renames an option
    (``--ncore_per_instance (ipexrun 1.x) means --ncores-per-instance``), else None."""
    from xlaunch.launcher.plan.options import ALIASES, flag_name

    alias = typed.lstrip("-").replace("-", "_")
    if alias not in ALIASES:
        return None
    return f"{typed} ({ALIAS_ORIGINS.get(alias, 'ipexrun')}) means {flag_name(ALIASES[alias])}"


# ipexrun's --instance-idx -1 and run_cpu's --node-id -1 mean "all of them" (plan.options)
_MINUS_ONE = {"instance_idx": ("ipexrun", "every instance"), "nodes_list": ("run_cpu", "every node")}


def minus_one_note(name: str, typed: str, value: Any) -> Optional[str]:
    """The ``note:`` for an old ``-1`` meaning "all" (``--instance-idx -1 (ipexrun) means every
    instance``), else None."""
    if name not in _MINUS_ONE or str(value).strip() != "-1":
        return None
    origin, meaning = _MINUS_ONE[name]
    return f"{typed} -1 ({origin}) means {meaning}"


def _same(given: Any, meant: Any) -> bool:
    if isinstance(meant, str) and isinstance(given, str):
        return given.strip().lower() == meant
    return given == meant


def translate(given: Mapping[str, Any], cli: Mapping[str, Any]) -> dict[str, Any]:
    """Options meant by the old spellings in ``given`` (name -> value), checked against the
    options given in xlaunch's own spelling (``cli``). Raises :class:`OptionError` for a refused
    spelling or a contradiction (``--enable-jemalloc --memory-allocator tcmalloc``)."""
    result: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, value in given.items():
        spelling = BY_NAME[name]
        flag = flags(spelling)[0]
        if spelling.to_options is None:
            raise OptionError(flag, spelling.meaning)
        for option, meant in spelling.to_options(value).items():
            shown = "--" + option.replace("_", "-")
            if option in cli and _same(cli[option], meant) is False:
                raise OptionError(flag, f"means {shown} {meant}, which conflicts with {shown} {cli[option]}")
            if option in result and result[option] != meant:
                raise OptionError(flag, f"means {shown} {meant}, which conflicts with {origin[option]}")
            result[option] = meant
            origin[option] = flag
    if "disable_numactl" in given and "disable_taskset" in given:
        chosen = result.get("bind_with", cli.get("bind_with"))
        if chosen is not None and not _same(chosen, "none"):
            raise OptionError("--disable-taskset", f"with --disable-numactl means --bind-with none, which "
                                                   f"conflicts with --bind-with {chosen}")
        result.pop("membind", None)
        result["bind_with"] = "none"
    if "multi_instance" in given and not any(name in cli or name in result for name in _SHAPE):
        result["throughput_mode"] = True
    return result

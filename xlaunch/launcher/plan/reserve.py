"""``--reserve-cores K``: the first K cores of every instance's slice kept out of its OpenMP
threads (the process may still run there), and oneCCL's workers pointed at them (decisions only).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from xlaunch._records import replace
from xlaunch.cpulist import format_cpulist
from xlaunch.launcher.errors import PlanError
from xlaunch.launcher.plan.environment import choose_runtime, runtime_variables

if TYPE_CHECKING:  # pragma: no cover
    from xlaunch.launcher.plan.options import Options
    from xlaunch.launcher.plan.records import Plan
    from xlaunch.machine.model import Machine




def ccl_available(environ: Mapping[str, str]) -> bool:
    """Whether Intel oneCCL is there: oneAPI's ``CCL_ROOT``, or its PyTorch bindings installed
    (found without importing them)."""
    if environ.get("CCL_ROOT"):
        return True
    import importlib.util

    for name in ("oneccl_bindings_for_pytorch", "torch_ccl"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def split_reserved(cpus: tuple[int, ...], machine: "Machine", count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(reserved, compute)``: the first ``count`` physical cores of a slice (with their CPUs in
    the slice) and the rest."""
    cores: list[list[int]] = []
    index_of: dict[object, int] = {}
    for cpu in sorted(cpus):
        core = machine.core_of(cpu)
        key = core.index if core is not None else ("cpu", cpu)
        if key not in index_of:
            index_of[key] = len(cores)
            cores.append([])
        cores[index_of[key]].append(cpu)
    reserved = tuple(cpu for core in cores[:count] for cpu in core)
    compute = tuple(cpu for core in cores[count:] for cpu in core)
    return reserved, compute


def reserve_cores(
    plan: "Plan",
    options: "Options",
    machine: "Machine",
    environ: Optional[Mapping[str, str]] = None,
    *,
    ccl: Optional[bool] = None,
) -> "Plan":
    """Keep ``options.reserve_cores`` cores of every instance's slice out of its OpenMP threads.

    The instance keeps its whole slice (CPU mask, memory nodes); its thread count, OpenMP places
    and ``XLAUNCH_CPUS`` name only the compute cores, ``XLAUNCH_RESERVED_CPUS`` the others. With
    oneCCL (``ccl``; detected when None) ``CCL_WORKER_COUNT`` is K and ``CCL_WORKER_AFFINITY``
    lists every local rank's reserved cores in rank order, as oneCCL expects. Values the user
    set are kept. Raises :class:`PlanError` when a slice has no more than K cores.
    """
    count = options.reserve_cores
    if not count:
        return plan
    environ = dict(environ or {})
    if ccl is None:
        ccl = ccl_available(environ)
    runtime = choose_runtime(machine, memory_allocator=options.memory_allocator, omp_runtime=options.omp_runtime,
                             benchmark=options.benchmark, environ=environ)
    splits = []
    for inst in plan.instances:
        reserved, compute = split_reserved(inst.cpus, machine, count)
        if not compute:
            cores = len(one_cpu_per_core(reserved, machine, len(reserved)))
            raise PlanError("--reserve-cores", f"instance {inst.index} has {cores} core(s): keeping {count} out "
                                               "leaves none to compute on (give each slice more cores)")
        splits.append((reserved, compute))
    worker_cpus = [one_cpu_per_core(reserved, machine, count) for reserved, _ in splits]
    ccl_env = {"CCL_WORKER_COUNT": str(count), "CCL_WORKER_AFFINITY": ",".join(str(c) for w in worker_cpus for c in w)}
    instances = []
    per_instance: list[dict[str, str]] = []
    for inst, (reserved, compute) in zip(plan.instances, splits):
        env = dict(inst.env)
        changed: dict[str, str] = {}
        ninstances = int(inst.env.get("XLAUNCH_NINSTANCES", len(plan.instances)))
        wanted = runtime_variables(runtime, compute, inst.index, ninstances)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PLACES", "KMP_AFFINITY"):
            if name in wanted and name not in environ:
                changed[name] = wanted[name]
        if ccl:
            changed.update({k: v for k, v in ccl_env.items() if k not in environ})
        changed["XLAUNCH_CPUS"] = format_cpulist(compute)
        changed["XLAUNCH_RESERVED_CPUS"] = format_cpulist(reserved)
        env.update(changed)
        per_instance.append(changed)
        instances.append(replace(inst, env=env))
    env_set = {k: v for k, v in plan.env_set.items()
               if all(i.env.get(k) == v for i in instances)}
    for name, value in per_instance[0].items() if per_instance else ():
        if all(d.get(name) == value for d in per_instance):
            env_set[name] = value
    return replace(plan, instances=tuple(instances), env_set=env_set)


def one_cpu_per_core(reserved: tuple[int, ...], machine: "Machine", count: int) -> tuple[int, ...]:
    """One CPU per reserved core (oneCCL pins one worker per listed CPU)."""
    firsts: list[int] = []
    seen: set[object] = set()
    for cpu in reserved:
        core = machine.core_of(cpu)
        key = core.index if core is not None else ("cpu", cpu)
        if key not in seen:
            seen.add(key)
            firsts.append(cpu)
    return tuple(firsts[:count])

"""The planner: ``plan()``, a pure function of Options and Machine, builds the :class:`Plan` of
:class:`Instance` s the runner starts (both in :mod:`.records`, re-exported here).
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")

from xlaunch.cpulist import format_cpulist
from xlaunch.launcher.errors import PlanError
from xlaunch.launcher.plan.records import Instance, Plan  # noqa: F401  (re-exported)
from xlaunch.launcher.plan.shape import LATENCY_CORES_PER_INSTANCE, Unit, shape  # noqa: F401  (re-exported)

if TYPE_CHECKING:  # pragma: no cover
    from typing import Callable, Mapping, Optional

    from xlaunch.machine.model import Machine
    from xlaunch.launcher.plan.options import Options


# --------------------------------------------------------------------------------------------
# The planner: Options x Machine -> Plan (pure; reads nothing but its arguments and, for
# --bind-with numactl|taskset, where the tool is on PATH through ``which``).
# --------------------------------------------------------------------------------------------

def plan(
    options: "Options",
    machine: "Machine",
    environ: Optional[Mapping[str, str]] = None,
    *,
    which: Optional[Callable[[str], Optional[str]]] = None,
) -> Plan:
    """Decide the instances: which CPUs, memory nodes, environment and argv each one gets.

    ``environ`` is the user's environment the instances inherit (default: empty).
    ``which`` finds numactl/taskset for ``--bind-with numactl|taskset`` (default
    :func:`xlaunch.launcher.plan.which.which` on ``environ``'s PATH). Raises :class:`PlanError` naming the option
    that cannot be satisfied on this machine.
    """
    from xlaunch.launcher.plan.environment import choose_runtime, instance_environment, kernel_report_variables

    environ = dict(environ or {})
    notes: list[str] = []
    units = _select_units(options, machine, notes)
    slices, shape_note = shape(options, units)
    if shape_note:
        notes.append(shape_note)
    ninstances = len(slices)
    indices = _chosen_indices(options, ninstances)

    bind = options.bind_tool
    runtime = choose_runtime(
        machine,
        memory_allocator=options.memory_allocator,
        omp_runtime=options.omp_runtime,
        benchmark=options.benchmark,
        environ=environ,
    )
    notes.extend(runtime.warnings)
    extra_env = _injection_env(options, environ)
    wanted_env = kernel_report_variables(environ, notes) if options.kernel_report else {}
    command = _command(options)
    tool = _bind_tool_path(bind, environ, which)
    allowed_mems = set(machine.allowed_mems)
    chosen_mems = _membind_nodes(options, machine)
    if bind == "taskset" and options.membind != "none":
        notes.append("--bind-with taskset binds CPUs only; memory is not bound (use native or numactl)")

    instances: list[Instance] = []
    kept: dict[str, str] = {}
    added_per_instance: list[dict[str, str]] = []
    for index in indices:
        cpus = tuple(sorted(cpu for unit in slices[index] for cpu in unit.cpus))
        nodes = {machine.cpu(c).node for c in cpus if machine.cpu(c) is not None}
        nodes.discard(None)
        mem_nodes = chosen_mems or tuple(sorted(n for n in nodes if not allowed_mems or n in allowed_mems))
        membind = options.membind if mem_nodes and bind in ("native", "numactl") else "none"
        result = instance_environment(
            environ, runtime, cpus=cpus, index=index, ninstances=ninstances, extra=extra_env, wanted=wanted_env
        )
        kept.update(result.kept)
        added_per_instance.append(result.added)
        argv = _bind_prefix(bind, tool, cpus, mem_nodes, membind) + command
        instances.append(
            Instance(
                index=index,
                cpus=cpus,
                mem_nodes=mem_nodes,
                env=result.env,
                argv=tuple(argv),
                bind=bind,
                membind=membind,
            )
        )
    for name, value in sorted(kept.items()):
        notes.append(f"kept your {name}={value} (xlaunch did not override it)")
    used = {cpu for inst in instances for cpu in inst.cpus}
    online = set(machine.online_cpus)
    idle = tuple(sorted(c for c in machine.allowed_cpus if c in online and c not in used))
    threads = sum(len(i.cpus) for i in instances)
    if machine.cpu_budget is not None and threads > machine.cpu_budget + 1e-9:
        notes.append(
            f"the cgroup CPU budget is {machine.cpu_budget:g} CPUs but the plan runs {threads} "
            "OpenMP threads: expect throttling (ask for fewer cores)"
        )
    result = Plan(
        instances=tuple(instances),
        idle_cpus=idle,
        warnings=tuple(notes),
        env_set=_common(added_per_instance),
        env_kept=kept,
        allocator=runtime.allocator,
        openmp=runtime.openmp, kernel_report=options.kernel_report,
    )
    # -- --reserve-cores: K cores of each slice kept out of its OpenMP threads (plan/reserve.py)
    if getattr(options, "reserve_cores", 0):
        from xlaunch.launcher.plan.reserve import reserve_cores

        result = reserve_cores(result, options, machine, environ)
    if options.share_imports:
        result = _with_import_servers(result, options)
    return result


def _with_import_servers(result: Plan, options: "Options") -> Plan:
    """``--share-imports``: the processes the instances are forked from (plan/shared.py)."""
    from xlaunch._records import replace
    from xlaunch.launcher.plan.shared import import_servers

    hooks_dir = ""
    if options.auto_optimize:   # the servers import without the hooks; each instance installs its own
        from xlaunch.kernels.inject import SITE_DIR as hooks_dir
    servers = import_servers(result.instances, options.share_imports, hooks_dir)
    notes = list(result.warnings)
    if len(result.instances) == 1:
        notes.append("--share-imports with one instance shares nothing (it only adds the importing process)")
    return replace(result, import_servers=servers, warnings=tuple(notes))


def _membind_nodes(options: "Options", machine: "Machine") -> tuple[int, ...]:
    """numactl-style ``--membind 0-1``: every instance's memory on these nodes (checked)."""
    if not options.membind_nodes:
        return ()
    memory_nodes = {n.id for n in machine.nodes if n.memory_kib is None or n.memory_kib > 0}
    for node in options.membind_nodes:
        if node not in memory_nodes:
            raise PlanError("--membind", f"no NUMA node {node} with memory (nodes with memory: "
                                         f"{format_cpulist(sorted(memory_nodes)) or 'none'})")
        if machine.allowed_mems and node not in machine.allowed_mems:
            raise PlanError("--membind", f"NUMA node {node} is not allowed for this process (cpuset mems "
                                         f"{format_cpulist(machine.allowed_mems)})")
    return options.membind_nodes


def _select_units(options: "Options", machine: "Machine", notes: list[str]) -> list[Unit]:
    """The cores the plan may use, ordered node -> L3 -> core, each as the CPUs it contributes."""
    from xlaunch.machine.model import EFFICIENCY, PERFORMANCE

    online = set(machine.online_cpus)
    allowed = set(machine.allowed_cpus) & online
    present = {c.id for c in machine.cpus}
    if options.cores_list is not None:
        # isolcpus= CPUs are in no process's default affinity, yet sched_setaffinity may name them:
        # listing them is how a user asks for them (as with taskset -c)
        isolated = (set(options.cores_list) & set(machine.isolated_cpus) & online) - allowed
        if isolated:
            allowed |= isolated
            notes.append(
                f"--cores-list: CPUs {format_cpulist(sorted(isolated))} are isolated (isolcpus=): used because "
                "they are listed; the scheduler does not move threads between them, so only threads OpenMP "
                "pins spread over them"
            )
        for cpu in options.cores_list:
            if cpu not in present:
                raise PlanError("--cores-list", f"CPU {cpu} does not exist (CPUs: {format_cpulist(present)})")
            if cpu not in online:
                raise PlanError("--cores-list", f"CPU {cpu} is offline")
            if cpu not in allowed:
                raise PlanError(
                    "--cores-list", f"CPU {cpu} is not allowed for this process (allowed: {format_cpulist(allowed)})"
                )
    if options.nodes_list is not None:
        known = {n.id for n in machine.nodes}
        for node_id in options.nodes_list:
            node = machine.node(node_id)
            if node is None:
                raise PlanError("--nodes-list", f"no NUMA node {node_id} (nodes: {format_cpulist(known)})")
            if not node.cpus:
                raise PlanError("--nodes-list", f"node {node_id} has no CPUs (memory only)")
            if not set(node.cpus) & allowed:
                raise PlanError("--nodes-list", f"node {node_id} has no CPU this process may use")

    core_type = options.core_type
    if core_type is None:
        core_type = "all" if options.cores_list is not None else PERFORMANCE
    if core_type == EFFICIENCY and not machine.is_hybrid:
        raise PlanError("--core-type", "this machine has no efficiency cores")
    wanted_kind = {"performance": PERFORMANCE, "efficiency": EFFICIENCY}.get(core_type)

    chosen = set(options.cores_list) if options.cores_list is not None else allowed
    ordered = sorted(machine.cores, key=lambda core: (_order(core.node), _order(core.l3)))
    units: list[Unit] = []
    folded = 0
    for core in ordered:
        cpus = tuple(c for c in core.cpus if c in allowed and c in chosen)
        if not cpus:
            continue
        if options.nodes_list is not None and core.node not in options.nodes_list:
            continue
        if wanted_kind is not None and machine.is_hybrid and core.kind != wanted_kind:
            continue
        if not options.use_logical_cores:
            folded += len(cpus) - 1
            cpus = cpus[:1]
        units.append(Unit(cpus=cpus, node=core.node, l3=core.l3))
    if not units:
        if options.nodes_list is not None or options.cores_list is not None:
            option = "--cores-list" if options.cores_list is not None else "--nodes-list"
            raise PlanError(option, f"no {core_type} core among the selected CPUs")
        raise PlanError("--core-type", f"no {core_type} core among the allowed CPUs")
    if folded and options.cores_list is not None:
        notes.append(
            f"--cores-list names {folded} SMT sibling(s) of listed cores: one CPU per physical core "
            "is used (add --use-logical-cores to use siblings)"
        )
    return units


def _order(value: Optional[int]) -> int:
    return -1 if value is None else value


def _chosen_indices(options: "Options", ninstances: int) -> list[int]:

    if options.instance_idx is None:
        return list(range(ninstances))
    for index in options.instance_idx:
        if index >= ninstances:
            raise PlanError(
                "--instance-idx", f"index {index} out of range: the plan has {ninstances} instance(s), 0-{ninstances - 1}"
            )
    return list(options.instance_idx)


def _command(options: "Options") -> list[str]:
    """What each instance executes (before any numactl/taskset prefix)."""
    if options.program is None:
        return []
    if options.no_python:
        return [options.program, *options.args]
    if options.module:
        return [options.python, "-u", "-m", options.program, *options.args]
    return [options.python, "-u", options.program, *options.args]


def _injection_env(options: "Options", environ: Mapping[str, str]) -> dict[str, str]:
    """The ``--auto-optimize`` variables (imported only when asked: it is not the launcher's room)."""
    if not options.auto_optimize:
        return {}
    try:
        from xlaunch.kernels.inject import injection_env
    except ImportError as exc:
        raise PlanError("--auto-optimize", f"the injection module is not available ({exc})") from None
    try:
        return dict(injection_env(environ, dtype=options.dtype, verbose=options.auto_optimize_verbose))
    except ValueError as exc:   # an XLAUNCH_AUTO_OPTIMIZE_* variable of the user's: refused before any start
        raise PlanError("--auto-optimize", str(exc)) from None


def _bind_tool_path(
    bind: str, environ: Mapping[str, str], which: Optional[Callable[[str], Optional[str]]]
) -> Optional[str]:
    if bind not in ("numactl", "taskset"):
        return None
    if which is None:
        from xlaunch.launcher.plan.which import which as find

        found = find(bind, path=environ.get("PATH") or None)
    else:
        found = which(bind)
    if not found:
        package = "numactl" if bind == "numactl" else "util-linux"
        raise PlanError("--bind-with", f"{bind} not found on PATH (Debian: apt install {package})")
    return found


def _bind_prefix(bind: str, tool: Optional[str], cpus: tuple[int, ...], mem_nodes: tuple[int, ...], membind: str) -> list[str]:

    if bind == "taskset":
        return [str(tool), "-c", format_cpulist(cpus)]
    if bind != "numactl":
        return []
    prefix = [str(tool), f"--physcpubind={format_cpulist(cpus)}"]
    if membind == "bind":
        prefix.append(f"--membind={format_cpulist(mem_nodes)}")
    elif membind == "preferred":
        prefix.append(f"--preferred={mem_nodes[0]}")
    elif membind == "interleave":
        prefix.append(f"--interleave={format_cpulist(mem_nodes)}")
    return prefix + ["--"]


def _common(per_instance: list[dict[str, str]]) -> dict[str, str]:
    """The variables xlaunch set to the same value in every instance."""
    if not per_instance:
        return {}
    first = per_instance[0]
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in per_instance[1:])}

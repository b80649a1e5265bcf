"""Distributed jobs: the torchrun front (``--nproc-per-node``) and the in-rank mode (``--per-rank``).

xlaunch places ranks; torch's elastic agent (``torch.distributed.run``) keeps rendezvous,
restarts and failure handling. How each local rank gets its own CPUs:

* ``--per-rank`` runs *inside* a rank some engine started (torchrun, mpirun, srun, DeepSpeed):
  it reads the local rank and size (:mod:`xlaunch.launcher.distributed.ranks`), plans the node like
  ``--ninstances <local size>``, pins itself to its slice (``sched_setaffinity`` + ``set_mempolicy``,
  both kept across exec), and replaces itself with the program (``execve``): no supervisor per rank,
  the engine's pid *is* the program, its signals and exit status arrive unchanged.
* ``--nproc-per-node N`` runs torch's agent in this process with ``--no-python`` and, as the
  worker command, ``python -m xlaunch --per-rank <the placement options> PROGRAM ...``. So
  every rank is pinned by the same code as under mpirun, with the environment the agent built for
  it (RANK, MASTER_ADDR...) as its base, and the agent supervises the program itself (after
  the exec). The alternative -- patching the agent's process start to pass per-rank masks --
  depends on torch internals; this uses torchrun's public command line only. torch is imported
  only here, when the front really launches.
"""
from __future__ import annotations

import math
import os
import shlex
import signal
import sys
from typing import TYPE_CHECKING, Any, Mapping

from xlaunch._records import replace
from xlaunch.cpulist import format_cpulist
from xlaunch.launcher.errors import OptionError, PlanError
from xlaunch.launcher.plan.target import refuse_recorded, target_machine
from xlaunch.launcher.plan.reserve import ccl_available
from xlaunch.launcher.distributed.ranks import (
    FRONT_MARKER,
    OMP_DEFAULT_MARKER,
    LocalRank,
    local_rank_from,
    rank_environment,
    rank_plan_options,
)

if TYPE_CHECKING:  # pragma: no cover
    from xlaunch.launcher.plan.options import Options
    from xlaunch.launcher.plan.planner import Instance, Plan

# Options forwarded from the front to every rank (placement and runtime tuning).
RANK_OPTIONS = (
    "ncores_per_instance", "nodes_list", "cores_list", "use_logical_cores", "core_type", "bind_numa_node",
    "memory_allocator", "omp_runtime", "bind_with", "membind", "benchmark",
    "module", "no_python", "auto_optimize", "dtype", "auto_optimize_verbose", "reserve_cores",
)


def launch_distributed(options: "Options", environ: Mapping[str, str]) -> int:
    """Entry from the CLI for ``--per-rank`` and ``--nproc-per-node``."""
    machine = target_machine(environ)
    if options.per_rank:
        return run_per_rank(options, environ, machine)
    return run_front(options, environ, machine)


def _warn(plan: "Plan", options: "Options", environ: Mapping[str, str]) -> None:
    if options.verbosity < 0:
        return
    for note in options.notes:          # what old (ipexrun) spellings were taken to mean
        sys.stderr.write(f"xlaunch: note: {note}\n")
    warnings = list(plan.warnings)
    if not options.reserve_cores and ccl_available(environ):
        warnings.append("oneCCL found: its worker threads share the compute cores; --reserve-cores K "
                        "gives them K cores of each rank (CCL_WORKER_COUNT/CCL_WORKER_AFFINITY)")
    for warning in warnings:
        sys.stderr.write(f"xlaunch: warning: {warning}\n")


def _with_summary(plan: "Plan", machine: Any) -> "Plan":
    from xlaunch.machine.report import machine_summary

    return replace(plan, machine_summary=dict(machine_summary(machine)))


# --------------------------------------------------------------------------------------------
# --per-rank


def plan_rank(options: "Options", machine: Any, environ: Mapping[str, str]) -> tuple[LocalRank, "Plan", dict[str, str]]:
    """This rank's place, its node's plan and the environment it was planned from."""
    from xlaunch.launcher.plan.planner import plan

    local = local_rank_from(environ)
    base = rank_environment(environ, local)
    try:
        node_plan = plan(rank_plan_options(options, local.size), machine, base)
    except PlanError as exc:
        if exc.option == "--ninstances":
            exc = PlanError("--per-rank", exc.problem.replace("instances", "ranks"))
        hint = ""
        if local.source not in ("torchrun", "deepspeed") and len(machine.allowed_cpus) < len(machine.online_cpus):
            hint = (f" (this rank may only use CPUs {format_cpulist(machine.allowed_cpus)}: if {local.source} "
                    "binds ranks itself, turn that off, e.g. mpirun --bind-to none, srun --cpu-bind=none)")
        raise PlanError(exc.option, f"{local.describe()}: {exc.problem}{hint}") from None
    return local, node_plan, base


def run_per_rank(options: "Options", environ: Mapping[str, str], machine: Any) -> int:
    """Plan this node's ranks, then become this rank's program on its slice (or print it)."""
    local, node_plan, _base = plan_rank(options, machine, environ)
    instance = node_plan.instances[local.rank]
    if local.rank == 0:
        _warn(node_plan, options, environ)
    if options.dry_run:
        shown = _with_summary(replace(node_plan, instances=(instance,)), machine)
        if options.json:
            import json

            data = shown.to_json(environ)
            data["rank"] = {"local_rank": local.rank, "local_size": local.size, "source": local.source,
                            "variables": list(local.variables)}
            sys.stdout.write(json.dumps(data, indent=2) + "\n")
        else:
            from xlaunch.launcher.plan.show import format_plan

            sys.stdout.write(f"xlaunch: {local.describe()}\n" + format_plan(shown, environ, verbose=True))
        return 0
    refuse_recorded(machine, options.dry_run)
    if options.verbosity > 0:
        sys.stderr.write(f"xlaunch: {local.describe()}: cpus {format_cpulist(instance.cpus)}, "
                         f"mem nodes {format_cpulist(instance.mem_nodes) or '-'}, argv {shlex.join(instance.argv)}\n")
    return exec_instance(instance, quiet=options.verbosity < 0, die_with_parent=FRONT_MARKER in environ)


def exec_instance(instance: "Instance", *, quiet: bool = False, die_with_parent: bool = False) -> int:
    """Pin the calling (single-threaded) process to ``instance`` and ``execve`` its argv.

    Returns only on failure: 1 when the CPUs cannot be used, 126/127 when the program cannot run.
    """
    from xlaunch.launcher.run import binding

    if instance.bind == "native":
        try:
            os.sched_setaffinity(0, instance.cpus)
        except OSError as error:
            sys.stderr.write(f"xlaunch: error: cannot pin to CPUs {format_cpulist(instance.cpus)}: "
                             f"{error.strerror or error}\n")
            return 1
        policy = binding.mempolicy_for(instance.membind, instance.mem_nodes)
        if policy is not None:
            try:
                binding.set_mempolicy(*policy)
            except OSError as refused:
                if not quiet:
                    sys.stderr.write(f"xlaunch: warning: memory policy refused ({refused.strerror or refused}): "
                                     "bound to CPUs only\n")
    if die_with_parent:   # the front's agent started us: die with it even if it is SIGKILLed
        parent = os.getppid()
        binding.die_with_parent(signal.SIGTERM)
        if os.getppid() != parent:
            return 128 + signal.SIGTERM
    sys.stdout.flush()
    sys.stderr.flush()
    argv = list(instance.argv)
    try:
        os.execve(argv[0], argv, dict(instance.env))
    except OSError as error:
        code = 127 if isinstance(error, FileNotFoundError) else 126
        sys.stderr.write(f"xlaunch: error: PROGRAM: {argv[0]}: {error.strerror or error}\n")
        return code
    return 1  # pragma: no cover  (execve does not return)


# --------------------------------------------------------------------------------------------
# the torchrun front


def rank_argv(options: "Options") -> list[str]:
    """``xlaunch --per-rank ...`` options that reproduce ``options``' placement in every rank."""
    from xlaunch.launcher.plan.options import Options

    defaults = Options()
    argv = ["--per-rank"]
    for name in RANK_OPTIONS:
        value = getattr(options, name)
        if value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, tuple):
            argv += [flag, format_cpulist(value)]
        else:
            argv += [flag, str(value)]
    argv += ["-v"] * options.verbosity if options.verbosity > 0 else ["-q"]
    return argv


def rank_command(options: "Options") -> list[str]:
    """What torchrun starts for each local rank (it is started with ``--no-python``)."""
    if options.program is None:
        return []
    return [options.python, "-m", "xlaunch", *rank_argv(options), "--", str(options.program), *options.args]


def torchrun_options(options: "Options") -> list[str]:
    """torchrun's command-line options for ``options`` (before the worker command)."""
    argv = ["--nproc-per-node", str(options.nproc_per_node)]
    for name in ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                 "rdzv_id", "max_restarts"):
        value = getattr(options, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    argv += ["--shutdown-timeout", str(int(math.ceil(options.grace_period)))]
    if options.log_dir is not None:
        argv += ["--log-dir", options.log_dir, "--tee", "3"]
    return argv + ["--no-python"]


def run_front(options: "Options", environ: Mapping[str, str], machine: Any) -> int:
    """Plan N slices like ``--ninstances N``; print them, or run torch's agent with pinned ranks."""
    from xlaunch.launcher.plan.planner import plan

    options = resolve_auto_ranks(options, machine, environ)
    try:
        node_plan = plan(rank_plan_options(options, int(options.nproc_per_node or 1)), machine, environ)
    except PlanError as exc:   # the shape came from --nproc-per-node, not --ninstances
        if exc.option != "--ninstances":
            raise
        raise PlanError("--nproc-per-node", exc.problem.replace("instances", "ranks")) from None
    _warn(node_plan, options, environ)
    agent = torchrun_options(options)
    worker = rank_command(options)
    if options.dry_run or options.verbosity > 0:
        shown = _with_summary(node_plan, machine)
        if options.json and options.dry_run:
            import json

            data = shown.to_json(environ)
            data["distributed"] = {"engine": "torch.distributed.run", "torchrun_options": agent,
                                   "rank_command": worker}
            sys.stdout.write(json.dumps(data, indent=2) + "\n")
        else:
            from xlaunch.launcher.plan.show import format_plan

            text = format_plan(shown, environ, verbose=options.verbosity > 0)
            text += f"  torchrun: {shlex.join(agent)}\n"
            if worker:
                text += f"  each rank runs: {shlex.join(worker)}\n"
            (sys.stdout if options.dry_run else sys.stderr).write(text)
        if options.dry_run:
            return 0
    refuse_recorded(machine, options.dry_run)
    return run_agent(agent, worker, environ)


def resolve_auto_ranks(options: "Options", machine: Any, environ: Mapping[str, str]) -> "Options":
    """``--nproc-per-node auto``: as many ranks as ``--throughput-mode`` would make instances (one
    per NUMA node with CPUs this process may use, within ``--nodes-list``/``--cores-list``), each
    kept inside its node (``--bind-numa-node``) so every rank plans the same slices."""
    if options.nproc_per_node != "auto":
        return options
    from xlaunch.launcher.plan.planner import plan

    shape = replace(options, nproc_per_node=None, throughput_mode=True, ncores_per_instance=None, reserve_cores=0)
    try:
        count = len(plan(shape, machine, environ).instances)
    except PlanError as exc:
        raise PlanError("--nproc-per-node", f"auto: {exc.problem}") from None
    return replace(options, nproc_per_node=count, bind_numa_node=options.bind_numa_node or count > 1)


def run_agent(agent: list[str], worker: list[str], environ: Mapping[str, str]) -> int:
    """Run torch's elastic agent here (``torch.distributed.run``); return the job's exit status.

    Status: 0, the first failed rank's exit code (128+N when killed by signal N), or 128+N when
    this process got signal N (the agent then stops every rank: SIGTERM, SIGKILL after
    ``--shutdown-timeout``).
    """
    # The agent builds each worker's environment from os.environ: say who we are, and whether
    # OMP_NUM_THREADS in the ranks will be torchrun's blanket default rather than the user's.
    os.environ[FRONT_MARKER] = str(os.getpid())
    os.environ[OMP_DEFAULT_MARKER] = "0" if "OMP_NUM_THREADS" in environ else "1"
    if "OMP_NUM_THREADS" not in environ:   # torchrun would set 1 and warn; the ranks drop it anyway
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError as exc:
        raise OptionError("--nproc-per-node", f"needs torch.distributed ({exc})") from None
    parser = torchrun.get_args_parser()
    known = getattr(parser, "_option_string_actions", None)
    if known is not None and "--shutdown-timeout" not in known:   # older torch: its fixed 30 s
        at = agent.index("--shutdown-timeout")
        agent = agent[:at] + agent[at + 2:]
    args = parser.parse_args([*agent, worker[0]])
    args.training_script_args = worker[1:]
    try:
        torchrun.run(args)
    except ChildFailedError as failed:
        sys.stderr.write(failed.format_msg() + "\n")
        _rank, first = failed.get_first_failure()
        code = first.exitcode
        return 128 - code if code < 0 else code or 1
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    except Exception as error:   # rendezvous timeouts, unreachable endpoints, bad backend names
        sys.stderr.write(f"xlaunch: error: torch's elastic agent failed: {type(error).__name__}: {error}\n")
        return 1
    return 0

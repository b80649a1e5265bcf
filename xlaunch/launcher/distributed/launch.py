"""Distributed jobs: the torchrun front (``--nproc-per-node``) and the in-rank mode (``--per-rank``).

xlaunch places ranks; torch's elastic agent (``torch.distributed.run``) keeps rendezvous,
restarts and failure handling. How each local rank gets its own CPUs:

* ``--per-rank`` runs *inside* a rank some engine started (torchrun, mpirun, srun, DeepSpeed):
  it reads the local rank and size (:mod:`xlaunch.launcher.distributed.ranks`), plans the node like
  ``--ninstances <local size>``, pins itself to its slice (``sched_setaffinity`` + ``set_mempolicy``,
  both kept across exec), and replaces itself with the program (``execve``): no supervisor per rank,
  the engine's pid *is* the program, its signals and exit status arrive unchanged.
* ``--nproc-per-node N`` runs torch's agent as a child of xlaunch (:mod:`.agent`) with
  ``--no-python`` and, as the worker command, ``python -m xlaunch --per-rank <the placement
  options> PROGRAM ...``. So every rank is pinned by the same code as under mpirun, with the
  environment the agent built for it (RANK, MASTER_ADDR...) as its base, and the agent supervises
  the program itself (after the exec). xlaunch supervises the agent and the ranks as it does
  instances (:mod:`xlaunch.launcher.distributed.front`): each rank's output on a pipe of its own, per-rank logs and summary,
  the grace period and the watchdog. It uses torchrun's public command line only; torch is
  imported only in the agent's process.
* One node without a rendezvous backend of the user's: torchrun's private c10d rendezvous, with
  the process-group store hosted by rank 0 at ``MASTER_ADDR:MASTER_PORT`` (``--master-addr`` /
  ``--master-port`` when given) rather than shared with the agent, so a script that sets
  ``MASTER_ADDR``/``MASTER_PORT`` itself before ``init_process_group`` (as scripts written for
  ipexrun or mpirun do) works as it does there.
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
from xlaunch.launcher.plan.show import write_page
from xlaunch.launcher.plan.options import parse_nnodes
from xlaunch.launcher.plan.target import refuse_recorded, target_machine
from xlaunch.launcher.plan.reserve import ccl_available
from xlaunch.launcher.distributed.ranks import (
    CHANNELS_VAR,
    FRONT_MARKER,
    OMP_DEFAULT_MARKER,
    LocalRank,
    local_rank_from,
    rank_environment,
    rank_plan_options,
)

if TYPE_CHECKING:  # pragma: no cover
    from typing import Optional

    from xlaunch.launcher.plan.options import Options
    from xlaunch.launcher.plan.records import Instance, Plan

# One node: the agents' private c10d rendezvous, on a free port of this host (torchrun --standalone)
PRIVATE_ENDPOINT = "localhost:0"
# The front's wait for its ranks: the rendezvous' bound plus this, for the agent's start-up
START_SLACK = 60.0
# Options forwarded from the front to every rank (placement and runtime tuning).
RANK_OPTIONS = (
    "ncores_per_instance", "nodes_list", "cores_list", "use_logical_cores", "core_type", "bind_numa_node",
    "memory_allocator", "omp_runtime", "bind_with", "membind", "benchmark",
    "module", "no_python", "auto_optimize", "dtype", "auto_optimize_verbose", "reserve_cores", "kernel_report",
)


def launch_distributed(options: "Options", environ: Mapping[str, str]) -> int:
    """Entry from the CLI for ``--per-rank`` and ``--nproc-per-node``."""
    machine = target_machine(environ)
    if options.per_rank:
        return run_per_rank(options, environ, machine)
    return run_front(options, environ, machine)


def _messages(plan: "Plan", options: "Options", environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The notes (what old ipexrun spellings were taken to mean) and the warnings of this plan."""
    warnings = list(plan.warnings)
    if not options.reserve_cores and ccl_available(environ):
        warnings.append("oneCCL found: its worker threads share the compute cores; --reserve-cores K "
                        "gives them K cores of each rank (CCL_WORKER_COUNT/CCL_WORKER_AFFINITY)")
    return list(options.notes), warnings


def _warn(plan: "Plan", options: "Options", environ: Mapping[str, str]) -> None:
    if options.verbosity < 0:
        return
    from xlaunch.launcher.plan.show import message_lines

    sys.stderr.write(message_lines(*_messages(plan, options, environ)))


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
            return write_page(json.dumps(data, indent=2) + "\n", "--dry-run")
        from xlaunch.launcher.plan.show import format_plan

        return write_page(f"xlaunch: {local.describe()}\n" + format_plan(shown, environ, verbose=True), "--dry-run")
    refuse_recorded(machine, options.dry_run)
    if FRONT_MARKER in environ:   # started by xlaunch's front: output to its pipe, say who we are
        problem = attach_rank(environ, local.rank)
        if problem is not None:
            sys.stderr.write(f"xlaunch: error: --per-rank: {problem}: not starting\n")
            return 128 + signal.SIGTERM
    if options.verbosity > 0:
        sys.stderr.write(f"xlaunch: {local.describe()}: cpus {format_cpulist(instance.cpus)}, "
                         f"mem nodes {format_cpulist(instance.mem_nodes) or '-'}, argv {shlex.join(instance.argv)}\n")
    kernels = rank_label(environ, local) if options.kernel_report else None
    return exec_instance(instance, quiet=options.verbosity < 0, die_with_parent=FRONT_MARKER in environ,
                         kernel_report=kernels)


def rank_label(environ: Mapping[str, str], local: LocalRank) -> str:
    """``rank 3`` (the job-wide rank an engine set), else ``local rank 1``: how reports name a rank."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if environ.get(name, "").isdigit():
            return f"rank {environ[name]}"
    return f"local rank {local.rank}"


def attach_rank(environ: Mapping[str, str], local_rank: int) -> Optional[str]:
    """In ``xlaunch --per-rank`` under the front, before the exec: send stdout and stderr to this
    rank's pipe and register (:class:`xlaunch.launcher.distributed.channels.Channels`). Returns why it could
    not (the front is gone), or None."""
    import fcntl

    from xlaunch.launcher.distributed.channels import REGISTRY, output_name

    path = environ.get(CHANNELS_VAR)
    if not path:
        return None
    try:
        out = os.open(os.path.join(path, output_name(local_rank)), os.O_WRONLY | os.O_NONBLOCK)
        registry = os.open(os.path.join(path, REGISTRY), os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:     # ENXIO: no reader, ENOENT: the directory is gone
        return f"the xlaunch front that started this rank is gone ({error.strerror or error})"
    try:
        flags = fcntl.fcntl(out, fcntl.F_GETFL)
        fcntl.fcntl(out, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)   # the program gets a blocking pipe
        os.write(registry, f"+{os.getpgid(0)} {local_rank} {os.getpid()}\n".encode())
        for fd in (1, 2):
            os.dup2(out, fd)
    except OSError as error:
        return f"cannot reach the xlaunch front ({error.strerror or error})"
    finally:
        os.close(registry)
        os.close(out)
    return None


def exec_instance(instance: "Instance", *, quiet: bool = False, die_with_parent: bool = False,
                  kernel_report: str | None = None) -> int:
    """Pin the calling (single-threaded) process to ``instance`` and ``execve`` its argv.

    ``kernel_report`` (the rank's name in the report): a filter process takes oneDNN's lines out
    of the program's stdout and reports them at its end (:mod:`xlaunch.launcher.run.kernel_tee`).
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
    if kernel_report is not None:
        instance = _start_kernel_filter(instance, kernel_report, quiet)
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
    except OSError as error:       # as for an instance: a missing #! interpreter is named, not the script
        from xlaunch.launcher.run.spawning import start_failure

        sys.stderr.write(f"xlaunch: error: PROGRAM: {start_failure(error, instance)[1]}\n")
        return 127 if isinstance(error, FileNotFoundError) else 126
    return 1  # pragma: no cover  (execve does not return)


def _start_kernel_filter(instance: "Instance", label: str, quiet: bool) -> "Instance":
    """The filter on stdout; if it cannot start, oneDNN's verbose setting of ours is dropped (its
    lines would reach the output unfiltered)."""
    from xlaunch.kernels.build_mark import MARKS_ENV
    from xlaunch.kernels.inject import DTYPE_ENV
    from xlaunch.launcher.plan.environment import ONEDNN_VERBOSE_VALUE
    from xlaunch.launcher.run.kernel_tee import filter_stdout

    sys.stdout.flush()
    try:
        filter_stdout(label, instance.env.get(DTYPE_ENV))
    except OSError as error:
        if not quiet:
            sys.stderr.write(f"xlaunch: warning: --kernel-report: cannot start the filter ({error.strerror or error}): "
                             "no kernel report for this rank\n")
        env = {k: v for k, v in instance.env.items()
               if not (k == "ONEDNN_VERBOSE" and v == ONEDNN_VERBOSE_VALUE) and k != MARKS_ENV}
        return replace(instance, env=env)
    return instance


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


def single_node(options: "Options") -> bool:
    """One node and no rendezvous backend of the user's: torchrun's private c10d rendezvous."""
    one = options.nnodes is None or parse_nnodes(options.nnodes)[1] == 1
    return one and options.rdzv_backend is None and options.rdzv_endpoint is None


def torchrun_options(options: "Options") -> list[str]:
    """torchrun's command-line options for ``options`` (before the worker command).

    On a single node ``--master-addr``/``--master-port`` are not torchrun's: they become the
    ranks' ``MASTER_ADDR``/``MASTER_PORT`` (:func:`agent_environment`), and the agents meet in a
    private c10d rendezvous on a free port (``--rdzv-backend c10d --rdzv-endpoint localhost:0``,
    torchrun's ``--standalone``), named explicitly: torchrun releases from before its own
    single-node default (pytorch#175699) use the static rendezvous on port 29500 instead, whose
    store the agent hosts and tells the ranks to join as clients (``TORCHELASTIC_USE_AGENT_STORE``):
    ranks sent to another ``MASTER_PORT`` (ours, or a script's own) then waited 30 minutes for a
    store nobody hosted. Every rendezvous wait is bounded by
    ``--rdzv-timeout`` (``--rdzv-conf``: c10d's join and read timeouts, the static rendezvous'
    timeout). ``--log-dir`` is xlaunch's own (per-rank logs), not torchrun's.
    """
    from xlaunch.launcher.distributed.addresses import check_endpoint, check_host
    from xlaunch.launcher.plan.options import rendezvous_timeout

    if options.rdzv_endpoint is not None:
        check_endpoint("--rdzv-endpoint", options.rdzv_endpoint)
    if options.master_addr is not None:
        check_host("--master-addr", options.master_addr.strip())
    argv = ["--nproc-per-node", str(options.nproc_per_node)]
    skipped = ("master_addr", "master_port") if single_node(options) else ()
    for name in ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                 "rdzv_id", "max_restarts"):
        value = getattr(options, name)
        if value is not None and name not in skipped:
            argv += ["--" + name.replace("_", "-"), str(value)]
    if single_node(options):
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", PRIVATE_ENDPOINT]
    timeout = int(math.ceil(rendezvous_timeout(options)))      # torch reads them as integers
    argv += ["--rdzv-conf", f"join_timeout={timeout},timeout={timeout},read_timeout={min(timeout, 60)}"]
    argv += ["--shutdown-timeout", str(int(math.ceil(options.grace_period)))]
    return argv + ["--no-python"]


def agent_environment(options: "Options", environ: Mapping[str, str], front_pid: int) -> dict[str, str]:
    """The agent's environment, which it passes on to every rank: the user's, plus what the
    ranks need to know (the front's markers, the master address on one node)."""
    from xlaunch.launcher.distributed.ranks import GRACE_VAR, MASTER_ADDR_VAR, MASTER_PORT_VAR

    env = dict(environ)
    env[FRONT_MARKER] = str(front_pid)
    # whether OMP_NUM_THREADS in the ranks will be torchrun's blanket default rather than the user's
    env[OMP_DEFAULT_MARKER] = "0" if "OMP_NUM_THREADS" in environ else "1"
    env.setdefault("OMP_NUM_THREADS", "1")   # torchrun would set 1 and warn; the ranks drop it anyway
    env[GRACE_VAR] = f"{options.grace_period:g}"
    if single_node(options) or (options.rdzv_backend or "").strip().lower() == "c10d":
        # rank 0 hosts the process-group store (torch's own switch): a script that sets
        # MASTER_ADDR/MASTER_PORT itself then works instead of waiting for the agent's store
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if single_node(options):
        if options.master_addr is not None:
            env[MASTER_ADDR_VAR] = options.master_addr
        if options.master_port is not None:
            env[MASTER_PORT_VAR] = str(options.master_port)
    return env


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
    if options.dry_run:          # a run prints them once its log files are open (FrontSupervisor)
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
            return write_page(json.dumps(data, indent=2) + "\n", "--dry-run")
        else:
            from xlaunch.launcher.plan.show import format_plan

            text = format_plan(shown, environ, verbose=options.verbosity > 0)
            text += f"  torchrun: {shlex.join(agent)}\n"
            if worker:
                text += f"  each rank runs: {shlex.join(worker)}\n"
            if options.dry_run:
                return write_page(text, "--dry-run")
            sys.stderr.write(text)
    refuse_recorded(machine, options.dry_run)
    return run_job(options, node_plan, agent, worker, environ)


def run_job(options: "Options", node_plan: "Plan", agent: list[str], worker: list[str],
            environ: Mapping[str, str]) -> int:
    """Run torch's agent as xlaunch's child and supervise it and its ranks (:mod:`.front`)."""
    from xlaunch._torch import missing_torch_message, torch_installed
    from xlaunch.launcher.distributed.front import FrontSupervisor

    if options.python == sys.executable and not torch_installed():   # one line, nothing started
        raise OptionError("--nproc-per-node", missing_torch_message("torch's elastic agent"))
    agent_argv = [options.python, "-m", "xlaunch.launcher.distributed.agent", *agent, "--", *worker]
    quiet = options.verbosity < 0
    notes, warnings = _messages(node_plan, options, environ)
    return FrontSupervisor(node_plan, agent_argv, agent_environment(options, environ, os.getpid()),
                           log_dir=options.log_dir, log_file_prefix=options.log_file_prefix,
                           grace_period=options.grace_period, quiet=quiet, summary_json=options.summary_json,
                           torchrun=agent, channels_var=CHANNELS_VAR, start_timeout=rank_start_timeout(options),
                           waiting_for=start_wait(options), notes=notes, warnings=warnings).run()


def rank_start_timeout(options: "Options") -> float:
    """How long the front waits for every rank to start once: the rendezvous' bound
    (``--rdzv-timeout``) plus a minute for the agent's own start-up (a Python interpreter
    importing torch: 2-10 s on a busy machine) and the ranks' (``xlaunch --per-rank``). The
    agent's rendezvous error comes first; this catches an agent stuck anywhere else."""
    from xlaunch.launcher.plan.options import rendezvous_timeout

    return rendezvous_timeout(options) + START_SLACK


def start_wait(options: "Options") -> str:
    """What the ranks' start waits for, in words for the front's error line."""
    if single_node(options):
        return f"torch's agent to start, meet in its private rendezvous and start {options.nproc_per_node} ranks"
    if options.rdzv_endpoint is not None:
        where = f"{options.rdzv_backend or 'static'} at {options.rdzv_endpoint}"
    else:
        where = f"static at the master address {options.master_addr or '127.0.0.1'}:{options.master_port or 29500}"
    return f"the rendezvous of --nnodes {options.nnodes} ({where}), then the ranks' start"


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

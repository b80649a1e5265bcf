"""What ``xlaunch``'s command line accepts: one table of options, read by two parsers.

:mod:`~xlaunch.launcher.cli.parse` parses the common invocations from this table without
loading click; :mod:`~xlaunch.launcher.cli.click_command` builds the click command from the same table
for ``--help``, ``--version``, shell completion and every command line the fast parser leaves to
click (errors included). Option values are checked later, by :mod:`~xlaunch.launcher.plan.options`.
"""
from __future__ import annotations

from xlaunch._records import record
from xlaunch.launcher.cli import compat
from xlaunch.launcher.plan.options import ALIASES, ALLOCATORS, BIND_TOOLS, CORE_TYPES, DTYPES, MEMBIND_POLICIES, OMP_RUNTIMES

FLAG, VALUE, COUNT = "flag", "value", "count"

# --help sections, in the order docs/launcher.md presents them
GROUP_INSTANCES = "Instances and cores"
GROUP_PROGRAM = "Program"
GROUP_TUNING = "Runtime tuning"
GROUP_SUPERVISION = "Supervision and output"
GROUP_MACHINE = "Machine information"
GROUP_DISTRIBUTED = "Distributed"
GROUP_ORDER = (GROUP_INSTANCES, GROUP_PROGRAM, GROUP_TUNING, GROUP_DISTRIBUTED, GROUP_SUPERVISION, GROUP_MACHINE)


@record
class Opt:
    """One option: its parameter name, how it takes values, and how --help shows it."""

    name: str                        # parameter name (underscores), the key in Options
    kind: str                        # FLAG (given: True), VALUE (one string), COUNT (times given)
    group: str
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] = ()    # offered by --help and completion; checked by options.py
    flags: tuple[str, ...] = ()      # every accepted spelling, the ones shown first
    hidden: bool = False             # accepted, not in --help (ipexrun/run_cpu spellings)


def _spellings(name: str) -> tuple[str, ...]:
    """``ncores_per_instance`` -> ``--ncores-per-instance``, ``--ncores_per_instance``, plus the
    spellings of its aliases (dashed ones are shown in --help, underscored ones only accepted)."""
    every = [name] + [alias for alias, target in ALIASES.items() if target == name]
    flags: list[str] = []
    for each in every:
        for spelled in ("--" + each.replace("_", "-"), "--" + each):
            if spelled not in flags:
                flags.append(spelled)
    return tuple(flags)


def _opt(name: str, kind: str, group: str, help: str, *, metavar: str | None = None,
         choices: tuple[str, ...] = (), short: str | None = None) -> Opt:
    flags = ((short,) if short else ()) + _spellings(name)
    if choices:
        metavar = "[" + "|".join(choices) + (f"|{metavar}" if metavar else "") + "]"
    return Opt(name, kind, group, help, metavar, tuple(choices), flags)


OPTIONS: tuple[Opt, ...] = (
    _opt("ninstances", VALUE, GROUP_INSTANCES, "Number of instances (default 1, or as many as fit).", metavar="N"),
    _opt("ncores_per_instance", VALUE, GROUP_INSTANCES,
         "Cores per instance (logical CPUs with --use-logical-cores).", metavar="C"),
    _opt("throughput_mode", FLAG, GROUP_INSTANCES, "One instance per NUMA node with CPUs, using all its cores."),
    _opt("latency_mode", FLAG, GROUP_INSTANCES, "4 cores per instance, as many instances as fit."),
    _opt("nodes_list", VALUE, GROUP_INSTANCES, "Use only these NUMA nodes, e.g. 0,2-3.", metavar="LIST"),
    _opt("cores_list", VALUE, GROUP_INSTANCES,
         "Use only these logical CPUs, e.g. 0-7,16 (mapped to their physical cores).", metavar="LIST"),
    _opt("use_logical_cores", FLAG, GROUP_INSTANCES, "Use SMT siblings too; siblings stay in one instance."),
    _opt("core_type", VALUE, GROUP_INSTANCES, "Hybrid parts: which cores to use (default performance).",
         choices=CORE_TYPES),
    _opt("bind_numa_node", FLAG, GROUP_INSTANCES, "No instance spans NUMA nodes."),
    _opt("instance_idx", VALUE, GROUP_INSTANCES, "Start only these instances of the plan, e.g. 0,2-3.",
         metavar="LIST"),
    # program
    _opt("module", FLAG, GROUP_PROGRAM, "PROGRAM is a module: python -m PROGRAM.", short="-m"),
    _opt("no_python", FLAG, GROUP_PROGRAM, "Execute PROGRAM directly (found on PATH)."),
    _opt("auto_optimize", FLAG, GROUP_PROGRAM, "Inject xlaunch.kernels.optimize.pipeline into the unmodified Python program."),
    _opt("dtype", VALUE, GROUP_PROGRAM, "With --auto-optimize: compute type.", choices=DTYPES),
    _opt("auto_optimize_verbose", FLAG, GROUP_PROGRAM, "With --auto-optimize: report what was optimized."),
    _opt("share_imports", VALUE, GROUP_PROGRAM,
         "Import these modules once (e.g. torch) and fork every instance from that process: the instances "
         "share the imported memory.", metavar="MODULES"),
    # runtime tuning
    _opt("memory_allocator", VALUE, GROUP_TUNING,
         "Allocator to preload (auto: jemalloc, else tcmalloc, else tuned glibc).", choices=ALLOCATORS),
    _opt("omp_runtime", VALUE, GROUP_TUNING,
         "OpenMP runtime (auto: Intel OpenMP when libiomp5 is installed, else GNU).", choices=OMP_RUNTIMES),
    _opt("bind_with", VALUE, GROUP_TUNING,
         "How instances are pinned (auto = native: sched_setaffinity + set_mempolicy).", choices=BIND_TOOLS),
    _opt("membind", VALUE, GROUP_TUNING,
         "Memory policy on the instance's NUMA nodes (default bind), or a node list as numactl takes it "
         "(0-1): every instance's memory bound to those nodes.", choices=MEMBIND_POLICIES, metavar="NODES"),
    _opt("benchmark", FLAG, GROUP_TUNING, "Latency-tuned allocator settings: never give memory back."),
    # distributed (docs/distributed.md; logic in launcher/distributed/)
    _opt("nproc_per_node", VALUE, GROUP_DISTRIBUTED,
         "Run N ranks on this node under torch's elastic agent (torchrun), each on its own slice.", metavar="N"),
    _opt("nnodes", VALUE, GROUP_DISTRIBUTED, "With --nproc-per-node: number of nodes (torchrun).", metavar="M|MIN:MAX"),
    _opt("node_rank", VALUE, GROUP_DISTRIBUTED, "With --nproc-per-node: this node's rank (static rendezvous).",
         metavar="R"),
    _opt("master_addr", VALUE, GROUP_DISTRIBUTED, "With --nproc-per-node: address of node 0.", metavar="ADDR"),
    _opt("master_port", VALUE, GROUP_DISTRIBUTED, "With --nproc-per-node: port on node 0.", metavar="PORT"),
    _opt("rdzv_backend", VALUE, GROUP_DISTRIBUTED, "With --nproc-per-node: rendezvous backend (c10d, static...).",
         metavar="NAME"),
    _opt("rdzv_endpoint", VALUE, GROUP_DISTRIBUTED, "With --nproc-per-node: rendezvous endpoint.",
         metavar="HOST:PORT"),
    _opt("rdzv_id", VALUE, GROUP_DISTRIBUTED, "With --nproc-per-node: job id shared by all nodes.", metavar="ID"),
    _opt("max_restarts", VALUE, GROUP_DISTRIBUTED, "With --nproc-per-node: worker group restarts allowed.",
         metavar="K"),
    _opt("rdzv_timeout", VALUE, GROUP_DISTRIBUTED,
         "With --nproc-per-node: seconds the nodes' rendezvous, and the ranks' start, may take (default 600).",
         metavar="S"),
    _opt("per_rank", FLAG, GROUP_DISTRIBUTED,
         "Inside torchrun/mpirun/srun ranks: pin this rank to its slice and become PROGRAM."),
    _opt("reserve_cores", VALUE, GROUP_DISTRIBUTED,
         "Keep K cores of each slice out of OpenMP (collectives, data loading); oneCCL workers go there.",
         metavar="K"),
    # supervision and output
    _opt("log_dir", VALUE, GROUP_SUPERVISION, "Write per-instance logs and xlaunch's log here.", metavar="DIR"),
    _opt("log_file_prefix", VALUE, GROUP_SUPERVISION, "Log file name prefix (default xlaunch).", metavar="PREFIX"),
    _opt("keep_going", FLAG, GROUP_SUPERVISION, "Let other instances finish when one fails (default: fail fast)."),
    _opt("grace_period", VALUE, GROUP_SUPERVISION,
         "Seconds between SIGTERM and SIGKILL when stopping instances (default 5).", metavar="S"),
    _opt("summary_json", VALUE, GROUP_SUPERVISION,
         "Write the end-of-run summary (statuses, what was observed) as JSON to FILE.", metavar="FILE"),
    _opt("kernel_report", FLAG, GROUP_SUPERVISION,
         "Report which oneDNN kernels each instance ran: ISA, implementations, data types, weight reorders."),
    _opt("dry_run", FLAG, GROUP_SUPERVISION, "Print the plan; start nothing."),
    _opt("json", FLAG, GROUP_SUPERVISION, "With --dry-run, --check-isa, --show-topology or --show-cache: print one JSON object."),
    _opt("config", VALUE, GROUP_SUPERVISION,
         "TOML file of options (flags override it), or a shipped preset: throughput, latency, single.",
         metavar="FILE|PRESET"),
    Opt("verbose", COUNT, GROUP_SUPERVISION, "More launcher messages (repeatable).", flags=("-v", "--verbose")),
    Opt("quiet", COUNT, GROUP_SUPERVISION, "Fewer launcher messages (no notes, plan warnings, start line or summary).", flags=("-q", "--quiet")),
    # machine information
    _opt("check_isa", FLAG, GROUP_MACHINE, "Print the instruction sets and dtype advice, then exit."),
    _opt("torch", FLAG, GROUP_MACHINE, "With --check-isa: also ask torch (imports it)."),
    _opt("probe", FLAG, GROUP_MACHINE,
         "With --check-isa: measure GEMM/conv per dtype in a child process and show what oneDNN ran."),
    _opt("show_topology", FLAG, GROUP_MACHINE, "Print the machine model, then exit."),
    _opt("show_cache", FLAG, GROUP_MACHINE,
         "Print the engine cache (--auto-optimize, optimize(backend=...)): entries, sizes, cap; then exit."),
) + tuple(  # ipexrun / run_cpu spellings (compat.py): accepted, translated or refused, not in --help
    Opt(spelling.name, VALUE if spelling.takes_value else FLAG, GROUP_SUPERVISION, spelling.meaning,
        flags=tuple(compat.flags(spelling)), hidden=True)
    for spelling in compat.SPELLINGS
)

COMPLETE_VAR = "_XLAUNCH_COMPLETE"   # click's shell completion protocol (xlaunch completion)
HELP_FLAGS = ("-h", "--help")
# parameters that are about this invocation, not launch options
NOT_OPTIONS = frozenset({"command", "verbose", "quiet", "config", "check_isa", "torch", "probe", "show_topology",
                         "show_cache"})

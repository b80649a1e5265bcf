"""Launcher options: one frozen :class:`Options`, built from CLI values merged over a config file.

Every option has one canonical name (``ncores_per_instance``, shown as ``--ncores-per-instance``);
:data:`ALIASES` maps the other spellings users type (IPEX's ``ncore_per_instance``, ``core_list``,
``node_id``, ``skip_cross_node_cores``) onto it. The CLI and config files share this table, so a
config file accepts exactly the option names the command line does.
"""
from __future__ import annotations

import sys

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Mapping, Optional

from xlaunch._records import factory, fields, record
from xlaunch.cpulist import MAX_ID, CpuListError, CpuListRangeError, parse_cpulist
from xlaunch.launcher.errors import OptionError

ALLOCATORS = ("auto", "default", "jemalloc", "tcmalloc")
OMP_RUNTIMES = ("auto", "default", "intel")
BIND_TOOLS = ("auto", "native", "numactl", "taskset", "none")
MEMBIND_POLICIES = ("bind", "preferred", "interleave", "none")
CORE_TYPES = ("performance", "efficiency", "all")
DTYPES = ("float32", "bfloat16")

# other spelling -> canonical name (both written with underscores; dashes are normalised first)
ALIASES: dict[str, str] = {
    "ncore_per_instance": "ncores_per_instance",
    "core_list": "cores_list",
    "node_id": "nodes_list",
    "skip_cross_node_cores": "bind_numa_node",
    "nprocs_per_node": "nproc_per_node",          # ipexrun's spelling of torchrun's option
}


@record
class Options:
    """Everything the user asked for, validated. ``None`` means "not given: decide from the machine"."""

    # what to run
    program: Optional[str] = None
    args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    python: str = factory(lambda: sys.executable)
    # instances and cores
    ninstances: Optional[int] = None
    ncores_per_instance: Optional[int] = None
    throughput_mode: bool = False
    latency_mode: bool = False
    nodes_list: Optional[tuple[int, ...]] = None
    cores_list: Optional[tuple[int, ...]] = None
    use_logical_cores: bool = False
    core_type: Optional[str] = None          # None: performance on hybrid parts, or as --cores-list says
    bind_numa_node: bool = False
    instance_idx: Optional[tuple[int, ...]] = None
    # runtime tuning
    memory_allocator: str = "auto"
    omp_runtime: str = "auto"
    bind_with: str = "auto"
    membind: str = "bind"
    membind_nodes: Optional[tuple[int, ...]] = None   # numactl-style --membind 0-1: these nodes, not the slice's
    benchmark: bool = False
    auto_optimize: bool = False
    dtype: Optional[str] = None
    auto_optimize_verbose: bool = False
    share_imports: tuple[str, ...] = ()      # modules imported once, in a process the instances are forked from
    # supervision and output
    log_dir: Optional[str] = None
    log_file_prefix: str = "xlaunch"
    keep_going: bool = False
    grace_period: float = 5.0
    summary_json: Optional[str] = None
    kernel_report: bool = False              # oneDNN's creation-level verbose lines, filtered and summarised
    dry_run: bool = False
    json: bool = False
    config: Optional[str] = None             # where merged settings came from (path), for the record
    verbosity: int = 0                       # -v: +1 each, -q: -1 each
    notes: tuple[str, ...] = ()              # what old (ipexrun/run_cpu) spellings were taken to mean
    # distributed (xlaunch/launcher/distributed/launch.py, ranks.py; docs/distributed.md)
    nproc_per_node: Optional[int | str] = None   # torchrun front: ranks on this node, or "auto"
    nnodes: Optional[str] = None             # "M" or "MIN:MAX" (torchrun's spelling)
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rdzv_backend: Optional[str] = None
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    max_restarts: Optional[int] = None
    rdzv_timeout: Optional[float] = None     # seconds; None: DEFAULT_RDZV_TIMEOUT (see rendezvous_timeout)
    per_rank: bool = False                   # inside an engine's rank: pin to this rank's slice, exec
    reserve_cores: int = 0                   # cores of each slice kept out of its OpenMP threads

    @property
    def bind_tool(self) -> str:
        """The binding actually used: ``auto`` means native (no external tool needed)."""
        return "native" if self.bind_with == "auto" else self.bind_with


# canonical name -> kind, for every option a config file or the CLI may set
_KINDS: dict[str, str] = {
    "module": "flag", "no_python": "flag",
    "ninstances": "count", "ncores_per_instance": "count",
    "throughput_mode": "flag", "latency_mode": "flag",
    "nodes_list": "list", "cores_list": "list", "instance_idx": "list",
    "use_logical_cores": "flag", "core_type": "choice", "bind_numa_node": "flag",
    "memory_allocator": "choice", "omp_runtime": "choice", "bind_with": "choice",
    "membind": "choice", "benchmark": "flag",
    "auto_optimize": "flag", "dtype": "choice", "auto_optimize_verbose": "flag", "share_imports": "modules",
    "log_dir": "text", "log_file_prefix": "text", "keep_going": "flag",
    "grace_period": "seconds", "summary_json": "text", "kernel_report": "flag",
    "dry_run": "flag", "json": "flag", "verbosity": "int",
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "core_type": CORE_TYPES, "memory_allocator": ALLOCATORS, "omp_runtime": OMP_RUNTIMES,
    "bind_with": BIND_TOOLS, "membind": MEMBIND_POLICIES, "dtype": DTYPES,
}
# -- distributed options (validated by validate_distributed)
_KINDS.update({
    "nproc_per_node": "ranks", "nnodes": "text", "node_rank": "int", "master_addr": "text",
    "master_port": "int", "rdzv_backend": "text", "rdzv_endpoint": "text", "rdzv_id": "text",
    "max_restarts": "int", "per_rank": "flag", "reserve_cores": "int", "rdzv_timeout": "seconds",
})
SETTABLE = frozenset(_KINDS)
# ipexrun's --instance-idx -1 and run_cpu's --node-id -1 mean "all of them"
_MINUS_ONE_IS_ALL = frozenset({"instance_idx", "nodes_list"})
# options that decide the instance shape; given on the command line they replace the config's
_SHAPE_OPTIONS = frozenset({"ninstances", "ncores_per_instance", "throughput_mode", "latency_mode"})


def flag_name(name: str) -> str:
    """``ncores_per_instance`` -> ``--ncores-per-instance`` (how errors name an option)."""
    return "--" + name.replace("_", "-")


def canonical_name(key: str) -> Optional[str]:
    """Map any accepted spelling (dashes or underscores, leading ``--`` or not, alias) to the
    canonical option name, or None when it names no option."""
    name = key.strip().lstrip("-").replace("-", "_")
    name = ALIASES.get(name, name)
    return name if name in _KINDS else None


def build_options(
    cli: Mapping[str, Any],
    config: Optional[Mapping[str, Any]] = None,
    *,
    config_source: Optional[str] = None,
    program: Optional[str] = None,
    args: tuple[str, ...] = (),
    python: Optional[str] = None,
) -> Options:
    """Merge ``config`` (lower precedence) under ``cli`` (only the options the user gave),
    validate every value and the combination, and return the frozen :class:`Options`.

    Raises :class:`OptionError` naming the first offending option.
    """
    merged: dict[str, Any] = {}
    where = f" in {config_source}" if config_source else ""
    for key, value in (config or {}).items():
        name = canonical_name(str(key))
        if name is None:
            raise OptionError("--config", f"unknown option {key!r}{where}")
        merged[name] = _convert(name, value, where)
    cli_names = {canonical_name(key) for key in cli}
    if cli_names & _SHAPE_OPTIONS:
        # the command line chose how to split the machine: the config's choice gives way
        for name in _SHAPE_OPTIONS:
            merged.pop(name, None)
    for key, value in cli.items():
        name = canonical_name(key)
        if name is None:
            raise OptionError(flag_name(key), "no such option")
        merged[name] = _convert(name, value, "")
    if merged.get("ninstances") is not None and merged.get("ninstances") == merged.get("nproc_per_node"):
        # ipexrun's habit, --ninstances N --nprocs-per-node N: N ranks (their number sets the instances)
        merged.pop("ninstances")
    if isinstance(merged.get("membind"), tuple):
        merged["membind_nodes"] = merged.pop("membind")
        merged["membind"] = "bind"
    options = Options(
        program=program,
        args=tuple(args),
        python=python or sys.executable,
        config=config_source,
        **merged,
    )
    validate(options)
    return options


def _convert(name: str, value: Any, where: str) -> Any:
    """Check one value's type and range; lists arrive as strings (CLI) or strings/ints/lists (TOML)."""
    kind = _KINDS[name]
    option = flag_name(name)
    if kind == "flag":
        if not isinstance(value, bool):
            raise OptionError(option, f"expected true or false, got {value!r}{where}")
        return value
    if kind == "ranks":          # --nproc-per-node: N, or auto (one rank per NUMA node with CPUs)
        word = value.strip().lower() if isinstance(value, str) else None
        if word == "auto":
            return word
        if word in ("cpu", "gpu", "cuda", "xpu"):
            raise OptionError(option, f"torchrun's {word!r} is not taken: give N, or auto for one rank per "
                                      f"NUMA node with CPUs{where}")
        kind = "count"
    if kind in ("count", "int"):
        number = _as_int(option, value, where)
        if kind == "count" and number < 1:
            raise OptionError(option, f"must be a positive integer, got {number}{where}")
        return number
    if kind == "seconds":
        if isinstance(value, bool):
            raise OptionError(option, f"expected a number of seconds, got {value!r}{where}")
        try:
            seconds = float(value) if isinstance(value, (int, float)) else strict_float(value)
        except (TypeError, ValueError):
            raise OptionError(option, f"expected a number of seconds, got {value!r}{where}") from None
        if not seconds >= 0 or seconds == float("inf"):
            raise OptionError(option, f"must be a finite number >= 0, got {value!r}{where}")
        return seconds
    if name == "membind" and (isinstance(value, (list, tuple)) or
                              (not isinstance(value, bool) and str(value).strip()[:1].isdigit())):
        return _as_list(option, value, where)       # numactl's spelling: --membind 0-1
    if kind == "choice":
        text = str(value).strip().lower()
        if name == "dtype":
            text = {"fp32": "float32", "bf16": "bfloat16"}.get(text, text)
            if text == "int8":
                raise OptionError(option, "int8 needs calibration data an unmodified script cannot give: call "
                                          "xlaunch.quantize(model, example_inputs, calibration=...) in the script "
                                          "(docs/quantization.md)")
        if text not in _CHOICES[name]:
            allowed = ", ".join(_CHOICES[name])
            raise OptionError(option, f"{value!r} is not one of {allowed}{where}")
        return text
    if kind == "modules":
        from xlaunch.launcher.plan.shared import module_names

        return module_names(option, value, where)
    if kind == "list":
        if name in _MINUS_ONE_IS_ALL and str(value).strip() == "-1":
            return None
        return _as_list(option, value, where)
    if value is None or not isinstance(value, str):
        raise OptionError(option, f"expected text, got {value!r}{where}")
    return value


def _as_int(option: str, value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise OptionError(option, f"expected an integer, got {value!r}{where}")
    if isinstance(value, int):
        return value
    try:
        return strict_int(str(value))
    except ValueError:
        raise OptionError(option, f"expected an integer, got {value!r}{where}") from None


def strict_int(text: str) -> int:
    """``text`` as a decimal integer written with ASCII digits and an optional sign, spaces
    around allowed; ValueError for anything Python's ``int()`` accepts beyond that (``0_2``,
    fullwidth or Arabic-Indic digits) or for more than 30 characters."""
    text = text.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not (digits.isascii() and digits.isdigit()) or len(text) > 30:
        raise ValueError(f"not an integer: {text!r}")
    return int(text)


def strict_float(text: str) -> float:
    """``text`` as a decimal number (``2``, ``0.5``, ``1e-3``) in ASCII; ValueError for what
    Python's ``float()`` accepts beyond that (``1_0``, fullwidth digits, ``inf``, ``nan``)."""
    text = text.strip()
    if not text.isascii() or not text or not all(c in "0123456789.eE+-" for c in text) or len(text) > 40:
        raise ValueError(f"not a number: {text!r}")
    return float(text)


def _as_list(option: str, value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, bool):
        raise OptionError(option, f"expected a list like 0-3,8, got {value!r}{where}")
    if isinstance(value, int):
        value = str(value)
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_ID for v in value):
            raise OptionError(option, f"expected non-negative integers up to {MAX_ID}, got {list(value)!r}{where}")
        items = tuple(sorted(set(value)))
    elif isinstance(value, str):
        try:
            items = parse_cpulist(value)
        except CpuListRangeError as exc:
            raise OptionError(option, f"{exc}{where}") from None
        except CpuListError as exc:
            raise OptionError(option, f"malformed list: {exc}{where}") from None
    else:
        raise OptionError(option, f"expected a list like 0-3,8, got {value!r}{where}")
    if not items:
        raise OptionError(option, f"empty list{where}")
    return items


def validate(o: Options) -> None:
    """Reject combinations that cannot mean anything (machine-independent checks only)."""
    if o.throughput_mode and o.latency_mode:
        raise OptionError("--latency-mode", "conflicts with --throughput-mode")
    for mode, mode_flag in ((o.throughput_mode, "--throughput-mode"), (o.latency_mode, "--latency-mode")):
        if not mode:
            continue
        if o.ncores_per_instance is not None:
            raise OptionError("--ncores-per-instance", f"conflicts with {mode_flag}")
        if o.ninstances is not None:
            raise OptionError("--ninstances", f"conflicts with {mode_flag}")
    if o.module and o.no_python:
        raise OptionError("--no-python", "conflicts with -m/--module")
    if o.dtype is not None and not o.auto_optimize:
        raise OptionError("--dtype", "only applies with --auto-optimize")
    if o.auto_optimize_verbose and not o.auto_optimize:
        raise OptionError("--auto-optimize-verbose", "only applies with --auto-optimize")
    if o.auto_optimize and o.no_python:
        raise OptionError("--auto-optimize", "needs a Python program (conflicts with --no-python)")
    if o.share_imports:
        from xlaunch.launcher.plan.shared import validate_shared_imports

        validate_shared_imports(o)
    if not o.log_file_prefix or "/" in o.log_file_prefix:
        raise OptionError("--log-file-prefix", f"must be a non-empty file name without '/', got {o.log_file_prefix!r}")
    if o.log_dir is not None and not o.log_dir.strip():
        raise OptionError("--log-dir", "empty path")
    if o.summary_json is not None and not o.summary_json.strip():
        raise OptionError("--summary-json", "empty path")
    validate_distributed(o)


# torchrun options that only mean something with --nproc-per-node
_TORCHRUN_ONLY = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                  "rdzv_id", "max_restarts", "rdzv_timeout")
# How long the front's waits last when --rdzv-timeout is not given: torch's own default for a
# rendezvous (c10d's join timeout, the static rendezvous' timeout).
DEFAULT_RDZV_TIMEOUT = 600.0


def rendezvous_timeout(o: "Options") -> float:
    """Seconds the nodes' rendezvous may take (``--rdzv-timeout``, else :data:`DEFAULT_RDZV_TIMEOUT`)."""
    return DEFAULT_RDZV_TIMEOUT if o.rdzv_timeout is None else o.rdzv_timeout


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``M`` or ``MIN:MAX`` -> ``(min, max)``; raises OptionError."""
    parts = text.strip().split(":")
    try:
        low = high = strict_int(parts[0])
        if len(parts) > 1:
            high = strict_int(parts[1])
    except ValueError:
        low = high = -1
    if len(parts) > 2 or not 0 < low <= high:
        raise OptionError("--nnodes", f"expected N or MIN:MAX with 0 < MIN <= MAX, got {text!r}")
    return low, high


def validate_distributed(o: Options) -> None:
    """The distributed options (``--nproc-per-node``, torchrun's rendezvous options, ``--per-rank``,
    ``--reserve-cores``): ranges and combinations."""
    if o.reserve_cores < 0:
        raise OptionError("--reserve-cores", f"must be an integer >= 0, got {o.reserve_cores}")
    if o.nproc_per_node is None:
        for name in _TORCHRUN_ONLY:
            if getattr(o, name) is not None:
                raise OptionError(flag_name(name), "only applies with --nproc-per-node")
    ranked = "--nproc-per-node" if o.nproc_per_node is not None else "--per-rank" if o.per_rank else None
    if ranked is None:
        return
    if o.per_rank and o.nproc_per_node is not None:
        raise OptionError("--per-rank", "conflicts with --nproc-per-node (the front starts --per-rank ranks itself)")
    if o.ninstances is not None and o.nproc_per_node is not None:
        raise OptionError("--ninstances", f"{o.ninstances} conflicts with --nproc-per-node {o.nproc_per_node} "
                                          "(the number of ranks sets the instances; give one, or the same number)")
    for name, given in (("ninstances", o.ninstances is not None), ("throughput_mode", o.throughput_mode),
                        ("latency_mode", o.latency_mode), ("instance_idx", o.instance_idx is not None),
                        ("keep_going", o.keep_going)):
        if given:
            raise OptionError(flag_name(name), f"conflicts with {ranked} (the number of ranks sets the instances)")
    if o.per_rank and o.log_dir is not None:
        raise OptionError("--log-dir", "conflicts with --per-rank (the rank becomes the program; its engine keeps the logs)")
    if o.per_rank and o.log_file_prefix != "xlaunch":
        raise OptionError("--log-file-prefix", "conflicts with --per-rank (the rank becomes the program and writes "
                                               "no logs; --nproc-per-node keeps per-rank logs)")
    if o.per_rank and o.summary_json is not None:
        raise OptionError("--summary-json", "conflicts with --per-rank (the rank becomes the program: nothing of "
                                            "xlaunch is left to write a summary; --nproc-per-node writes one per rank)")
    if o.nnodes is not None:
        _low, high = parse_nnodes(o.nnodes)
        if o.node_rank is not None and o.node_rank >= high:
            raise OptionError("--node-rank", f"must be below --nnodes ({high}), got {o.node_rank}")
    if o.node_rank is not None and o.node_rank < 0:
        raise OptionError("--node-rank", f"must be an integer >= 0, got {o.node_rank}")
    if o.master_port is not None and not 0 < o.master_port < 65536:
        raise OptionError("--master-port", f"must be a TCP port 1-65535, got {o.master_port}")
    if o.max_restarts is not None and o.max_restarts < 0:
        raise OptionError("--max-restarts", f"must be an integer >= 0, got {o.max_restarts}")
    if o.rdzv_timeout is not None and not o.rdzv_timeout >= 1:
        raise OptionError("--rdzv-timeout", f"must be at least 1 second, got {o.rdzv_timeout:g}")
    for name in ("master_addr", "rdzv_backend", "rdzv_endpoint", "rdzv_id"):
        value = getattr(o, name)
        if value is not None and not value.strip():
            raise OptionError(flag_name(name), "empty value")


def option_fields() -> tuple[str, ...]:
    """Names of every :class:`Options` field (for tests and docs)."""
    return fields(Options)


def load_config_option(spec: str) -> tuple[dict[str, Any], str]:
    """:func:`xlaunch.configs.load_config` for a ``--config`` value: a problem is an
    :class:`~xlaunch.launcher.errors.OptionError` naming ``--config`` (one line, exit 2)."""
    from xlaunch.configs import ConfigError, load_config

    try:
        table, source = load_config(spec)
    except ConfigError as exc:
        raise OptionError("--config", str(exc)) from None
    seen: dict[str, str] = {}
    for key in table:          # TOML keeps both spellings; the last one won without a word
        name = canonical_name(str(key))
        if name is not None and seen.setdefault(name, key) != key:
            raise OptionError("--config", f"{seen[name]!r} and {key!r} name the same option in {source}")
    return table, source

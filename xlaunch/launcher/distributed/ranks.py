"""Ranks of a distributed job: which slice of this node a rank gets (decisions, no effects).

* :func:`local_rank_from` reads the local rank and the number of ranks on this node from the
  variables a launcher sets (torchrun, DeepSpeed, Open MPI, MPICH/Intel MPI, MVAPICH, Cray PMI/PALS,
  Slurm). When launchers are nested (``srun torchrun``, ``mpirun`` inside an ``sbatch`` job) the
  innermost one decides: torchrun/DeepSpeed, then MPI/PMI, then Slurm.
* :func:`rank_plan_options`: a node of N ranks is planned exactly like ``--ninstances N``.

Bad or missing variables raise :class:`~xlaunch.launcher.errors.OptionError` naming ``--per-rank``.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping, Optional

from xlaunch._records import record, replace
from xlaunch.launcher.errors import OptionError
from xlaunch.launcher.plan.options import strict_int

if TYPE_CHECKING:  # pragma: no cover
    from xlaunch.launcher.plan.options import Options


@record
class Engine:
    """Where one launcher puts a rank's local index and the local rank count."""

    name: str
    level: int                      # nesting: lower is closer to the rank (wins)
    rank_var: str
    size_vars: tuple[str, ...]      # any of them; when several are set they must agree


ENGINES: tuple[Engine, ...] = (
    Engine("torchrun", 0, "LOCAL_RANK", ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")),   # LOCAL_SIZE: DeepSpeed
    Engine("openmpi", 1, "OMPI_COMM_WORLD_LOCAL_RANK", ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    Engine("mpich", 1, "MPI_LOCALRANKID", ("MPI_LOCALNRANKS",)),               # MPICH, Intel MPI (Hydra)
    Engine("mvapich", 1, "MV2_COMM_WORLD_LOCAL_RANK", ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    Engine("pmi", 1, "PMI_LOCAL_RANK", ("PMI_LOCAL_SIZE",)),                   # Cray PMI
    Engine("pals", 1, "PALS_LOCAL_RANKID", ("PALS_LOCAL_SIZE",)),              # HPE PALS
    Engine("slurm", 2, "SLURM_LOCALID",
           ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")),
)
FRONT_MARKER = "XLAUNCH_FRONT"                       # set by xlaunch's torchrun front for its ranks
OMP_DEFAULT_MARKER = "XLAUNCH_TORCHRUN_OMP_DEFAULT"  # "1": OMP_NUM_THREADS in a rank is torchrun's default
CHANNELS_VAR = "XLAUNCH_FRONT_CHANNELS"             # the front: where a rank's pipe and registry are
GRACE_VAR = "XLAUNCH_FRONT_GRACE"                   # the front: the agent's cap on its waits before SIGKILL
MASTER_ADDR_VAR = "XLAUNCH_FRONT_MASTER_ADDR"        # the front on one node: the ranks' MASTER_ADDR
MASTER_PORT_VAR = "XLAUNCH_FRONT_MASTER_PORT"        # ... and MASTER_PORT (--master-addr/--master-port)
_FRONT_ONLY = (OMP_DEFAULT_MARKER, FRONT_MARKER, MASTER_ADDR_VAR, MASTER_PORT_VAR, CHANNELS_VAR, GRACE_VAR)
_SLURM_COUNTS = re.compile(r"^([0-9]{1,9})(?:\(x([0-9]{1,9})\))?$")   # ASCII digits; 9 of them at most


@record
class LocalRank:
    """This process's place on its node, and the variables it was read from."""

    rank: int
    size: int
    source: str                      # engine name: torchrun, deepspeed, openmpi, mpich, ..., slurm
    variables: tuple[str, str]       # (rank variable, size variable)
    level: int = 0

    def describe(self) -> str:
        return f"local rank {self.rank} of {self.size} ({self.source}: {self.variables[0]}, {self.variables[1]})"


def _integer(name: str, text: str, minimum: int) -> int:
    try:
        value = strict_int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        kind = "a non-negative integer" if minimum == 0 else "a positive integer"
        raise OptionError("--per-rank", f"{name}={_shown(text)} is not {kind}")
    return value


def slurm_task_counts(name: str, text: str) -> list[tuple[int, int]]:
    """Slurm's compressed per-node task counts as (tasks, nodes) runs: ``2(x3),1`` ->
    ``[(2, 3), (1, 1)]``. Never expanded (``2(x1000000000)`` is two numbers, not a list)."""
    runs: list[tuple[int, int]] = []
    for part in text.split(","):
        match = _SLURM_COUNTS.match(part.strip())
        if not match or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise OptionError("--per-rank", f"{name}={_shown(text)} is not a Slurm task count list like 2(x3),1")
        runs.append((int(match.group(1)), int(match.group(2) or 1)))
    return runs


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:60]) + "..."


def _slurm_size(environ: Mapping[str, str]) -> Optional[tuple[str, int]]:
    for name in ENGINES[-1].size_vars:
        text = environ.get(name)
        if text is None:
            continue
        runs = slurm_task_counts(name, text)
        if len({tasks for tasks, _nodes in runs}) == 1:
            return name, runs[0][0]
        node = environ.get("SLURM_NODEID")
        index = _integer("SLURM_NODEID", node, 0) if node is not None else -1
        nodes = sum(count for _tasks, count in runs)
        if not 0 <= index < nodes:
            raise OptionError(
                "--per-rank", f"{name}={_shown(text)} differs between nodes and SLURM_NODEID "
                f"({_shown(node) if node is not None else 'unset'}) does not pick one of its {nodes} nodes")
        for tasks, count in runs:
            if index < count:
                return name, tasks
            index -= count
    return None


def _read(engine: Engine, environ: Mapping[str, str]) -> Optional[LocalRank]:
    rank_text = environ.get(engine.rank_var)
    if rank_text is None:
        return None
    rank = _integer(engine.rank_var, rank_text, 0)
    if engine.name == "slurm":
        found = _slurm_size(environ)
        sizes = {found[0]: found[1]} if found else {}
    else:
        sizes = {name: _integer(name, environ[name], 1) for name in engine.size_vars if name in environ}
    if not sizes:
        wanted = " or ".join(engine.size_vars)
        raise OptionError("--per-rank", f"{engine.rank_var}={rank_text} is set but not {wanted} "
                                        "(the number of ranks on this node)")
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise OptionError("--per-rank", f"contradictory local sizes: {shown}")
    size_var, size = next(iter(sizes.items()))
    if rank >= size:
        raise OptionError("--per-rank", f"{engine.rank_var}={rank} is not below {size_var}={size}")
    source = "deepspeed" if engine.name == "torchrun" and size_var == "LOCAL_SIZE" else engine.name
    return LocalRank(rank=rank, size=size, source=source, variables=(engine.rank_var, size_var), level=engine.level)


def local_rank_from(environ: Mapping[str, str]) -> LocalRank:
    """The local rank and local size the innermost launcher set, or :class:`OptionError`.

    Only the innermost launcher's variables are checked: an outer one's (the ``SLURM_LOCALID``
    a batch step leaves behind) may be incomplete without being an error.
    """
    for level in sorted({engine.level for engine in ENGINES}):
        engines = [e for e in ENGINES if e.level == level and e.rank_var in environ]
        inner = [r for r in (_read(engine, environ) for engine in engines) if r is not None]
        if not inner:
            continue
        if len({(r.rank, r.size) for r in inner}) > 1:
            shown = "; ".join(f"{r.variables[0]}={r.rank}, {r.variables[1]}={r.size}" for r in inner)
            raise OptionError("--per-rank", f"contradictory launcher variables: {shown}")
        return inner[0]
    names = ", ".join(f"{e.rank_var} ({e.name})" for e in ENGINES)
    raise OptionError("--per-rank", f"no local rank in the environment (looked for {names}): "
                                    "run it as a rank of torchrun, mpirun or srun")


def torchrun_default_threads(environ: Mapping[str, str], local: LocalRank) -> bool:
    """Whether ``OMP_NUM_THREADS`` is torchrun's blanket default rather than the user's choice.

    torchrun sets ``OMP_NUM_THREADS=1`` for every worker when more than one runs per node and
    the variable was unset. xlaunch's own front says so (``XLAUNCH_TORCHRUN_OMP_DEFAULT=1``);
    under a plain torchrun (``TORCHELASTIC_RUN_ID`` set) a value of exactly 1 is taken as it.
    """
    if environ.get(OMP_DEFAULT_MARKER) is not None:
        return environ[OMP_DEFAULT_MARKER] == "1"
    return (local.source == "torchrun" and local.size > 1 and "TORCHELASTIC_RUN_ID" in environ
            and environ.get("OMP_NUM_THREADS", "").strip() == "1")


def rank_environment(environ: Mapping[str, str], local: LocalRank) -> dict[str, str]:
    """The environment a rank is planned from: the launcher's, minus torchrun's thread default
    and the front's markers; on one node the front's ``--master-addr``/``--master-port`` become
    ``MASTER_ADDR``/``MASTER_PORT`` (rank 0 hosts the process-group store there)."""
    env = dict(environ)
    if torchrun_default_threads(environ, local):
        env.pop("OMP_NUM_THREADS", None)
    if MASTER_ADDR_VAR in env:
        env["MASTER_ADDR"] = env[MASTER_ADDR_VAR]
    if MASTER_PORT_VAR in env:
        env["MASTER_PORT"] = env[MASTER_PORT_VAR]
    for name in _FRONT_ONLY:
        env.pop(name, None)
    return env


def rank_plan_options(options: "Options", local_size: int) -> "Options":
    """The planner's options for a node of ``local_size`` ranks: the same as ``--ninstances``."""
    return replace(options, ninstances=local_size, instance_idx=None)

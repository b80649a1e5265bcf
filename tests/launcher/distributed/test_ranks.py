"""Rank slices: every engine's variables, nesting, contradictions, --reserve-cores, the front's
worker command, on recorded machines (pure: nothing is started except the CLI checks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from host_cpus import allowed_cores
from machine_trees import machine_tree

from xlaunch._records import replace
from xlaunch.launcher.cli import command as cli
from xlaunch.launcher.distributed.launch import (
    agent_environment,
    plan_rank,
    rank_argv,
    rank_command,
    resolve_auto_ranks,
    torchrun_options,
)
from xlaunch.launcher.plan.environment import team_places
from xlaunch.launcher.errors import OptionError, PlanError
from xlaunch.machine import load_machine
from xlaunch.launcher.plan.options import Options
from xlaunch.launcher.plan.planner import plan
from xlaunch.launcher.distributed.ranks import (
    local_rank_from,
    rank_environment,
    rank_plan_options,
    slurm_task_counts,
)
from xlaunch.launcher.plan.reserve import reserve_cores

REPO = Path(__file__).resolve().parents[3]
TREES = ("xeon-2s-amx", "epyc-4node-nps4", "xeon-max-snc4-hbm")


def machine_dir(name: str) -> str:
    """A recorded machine's root directory (unpacked from its archive once per session)."""
    return str(machine_tree(name))


_machines: dict = {}


def machine_of(name: str):
    if name not in _machines:
        _machines[name] = load_machine(machine_dir(name))
    return _machines[name]


def engine_env(engine: str, rank: int, size: int) -> dict[str, str]:
    """The variables each engine sets in a rank (the ones xlaunch reads, plus some noise)."""
    return {
        "torchrun": {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size), "RANK": str(rank + size),
                     "TORCHELASTIC_RUN_ID": "job"},
        "deepspeed": {"LOCAL_RANK": str(rank), "LOCAL_SIZE": str(size), "CROSS_RANK": "1"},
        "openmpi": {"OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
                    "OMPI_COMM_WORLD_RANK": str(10 + rank)},
        "mpich": {"MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": str(size), "PMI_RANK": str(10 + rank)},
        "mvapich": {"MV2_COMM_WORLD_LOCAL_RANK": str(rank), "MV2_COMM_WORLD_LOCAL_SIZE": str(size)},
        "pmi": {"PMI_LOCAL_RANK": str(rank), "PMI_LOCAL_SIZE": str(size)},
        "pals": {"PALS_LOCAL_RANKID": str(rank), "PALS_LOCAL_SIZE": str(size)},
        "slurm": {"SLURM_LOCALID": str(rank), "SLURM_STEP_TASKS_PER_NODE": f"{size}(x2)", "SLURM_NODEID": "1"},
    }[engine]


ENGINES = ("torchrun", "deepspeed", "openmpi", "mpich", "mvapich", "pmi", "pals", "slurm")


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_is_read(engine: str) -> None:
    local = local_rank_from(engine_env(engine, 2, 4))
    assert (local.rank, local.size, local.source) == (2, 4, engine)


def test_slurm_counts_and_node_pick() -> None:
    assert slurm_task_counts("X", "2(x3),1") == [(2, 3), (1, 1)]
    env = {"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}
    assert local_rank_from(env).size == 1
    assert local_rank_from({**env, "SLURM_NODEID": "1"}).size == 2
    assert local_rank_from({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4"}).size == 4
    with pytest.raises(OptionError, match="SLURM_NODEID"):
        local_rank_from({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2,1"})
    with pytest.raises(OptionError, match="Slurm task count"):
        local_rank_from({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x)"})


def test_innermost_launcher_wins() -> None:
    # srun starts one torchrun per node; torchrun's ranks inherit SLURM_LOCALID=0
    srun_torchrun = {**engine_env("slurm", 0, 1), **engine_env("torchrun", 3, 4)}
    assert local_rank_from(srun_torchrun).source == "torchrun"
    # mpirun inside an sbatch job: the MPI variables, not the batch step's SLURM_LOCALID
    mpirun_in_job = {**engine_env("slurm", 0, 1), **engine_env("openmpi", 1, 2)}
    assert (local_rank_from(mpirun_in_job).rank, local_rank_from(mpirun_in_job).source) == (1, "openmpi")
    # an outer launcher's incomplete variables do not matter once an inner one decides
    assert local_rank_from({"SLURM_LOCALID": "0", **engine_env("mpich", 1, 2)}).source == "mpich"
    with pytest.raises(OptionError, match="SLURM_LOCALID=0 is set but not"):
        local_rank_from({"SLURM_LOCALID": "0"})
    # two MPI flavours that agree are fine
    agree = {**engine_env("mpich", 1, 2), **engine_env("pmi", 1, 2)}
    assert local_rank_from(agree).rank == 1


@pytest.mark.parametrize(
    "env, problem",
    [
        ({}, "no local rank in the environment"),
        ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 is set but not LOCAL_WORLD_SIZE or LOCAL_SIZE"),
        ({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK='x' is not a non-negative integer"),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0' is not a positive integer"),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "4"}, "contradictory local sizes"),
        ({**{"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
          **{"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}}, "contradictory launcher variables"),
    ],
)
def test_bad_variables(env: dict, problem: str) -> None:
    with pytest.raises(OptionError) as caught:
        local_rank_from(env)
    assert caught.value.option == "--per-rank"
    assert problem in caught.value.problem


def test_size_without_rank_is_not_an_engine() -> None:
    env = {"MV2_COMM_WORLD_LOCAL_SIZE": "16", **engine_env("openmpi", 0, 2)}
    assert local_rank_from(env).source == "openmpi"


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("engine", ENGINES)
def test_rank_slice_is_the_ninstances_slice(tree: str, engine: str) -> None:
    """Each rank gets exactly what --ninstances <local size> gives its index; ranks are disjoint."""
    machine = machine_of(tree)
    options = Options(program="train.py", python="/py", per_rank=True)
    size = 4
    reference = plan(replace(options, per_rank=False, ninstances=size), machine, {})
    seen: set[int] = set()
    for rank in range(size):
        local, node_plan, _ = plan_rank(options, machine, engine_env(engine, rank, size))
        mine = node_plan.instances[local.rank]
        assert mine.cpus == reference.instances[rank].cpus
        assert mine.mem_nodes == reference.instances[rank].mem_nodes
        assert mine.env["OMP_NUM_THREADS"] == str(len(mine.cpus))
        assert mine.env["XLAUNCH_INSTANCE_INDEX"] == str(rank)
        assert not seen & set(mine.cpus)
        seen |= set(mine.cpus)
    assert len(seen) == sum(len(i.cpus) for i in reference.instances)


MODES = {
    "ncores-2": {"ncores_per_instance": 2},
    "logical": {"use_logical_cores": True},
    "bind-numa-node": {"bind_numa_node": True},
    "core-type-all": {"core_type": "all"},
    "numactl": {"bind_with": "numactl"},
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("tree", (*TREES, "hybrid-laptop", "vm-adjacent-smt", "container-cpuset"))
def test_rank_slices_follow_every_mode(tree: str, mode: str) -> None:
    """Filters and modes shape rank slices exactly as they shape --ninstances instances."""
    machine = machine_of(tree)
    options = Options(program="train.py", python="/py", per_rank=True, **MODES[mode])
    reference = plan(replace(options, per_rank=False, ninstances=2), machine, {},
                     which=lambda tool: f"/usr/bin/{tool}")
    for rank in range(2):
        env = engine_env(ENGINES[rank % len(ENGINES)], rank, 2)
        local = local_rank_from(env)
        mine = plan(rank_plan_options(options, local.size), machine, rank_environment(env, local),
                    which=lambda tool: f"/usr/bin/{tool}").instances[rank]
        ref = reference.instances[rank]
        assert (mine.cpus, mine.mem_nodes, mine.argv, mine.bind) == (ref.cpus, ref.mem_nodes, ref.argv, ref.bind)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("engine", ("torchrun", "openmpi", "slurm"))
def test_reserved_cores_per_rank(tree: str, engine: str) -> None:
    machine = machine_of(tree)
    options = Options(program="train.py", python="/py", per_rank=True, reserve_cores=2)
    size = 2
    worker_cpus = []
    for rank in range(size):
        local, node_plan, _ = plan_rank(options, machine, engine_env(engine, rank, size))
        inst = node_plan.instances[rank]
        cores = sorted({machine.core_of(c).index for c in inst.cpus})
        reserved = [c for c in inst.cpus if machine.core_of(c).index in cores[:2]]
        compute = [c for c in inst.cpus if c not in reserved]
        assert inst.env["XLAUNCH_RESERVED_CPUS"] == cli_list(reserved)
        assert inst.env["XLAUNCH_CPUS"] == cli_list(compute)
        assert inst.env["OMP_NUM_THREADS"] == str(len(compute))
        assert inst.env["MKL_NUM_THREADS"] == str(len(compute))
        # Intel OpenMP (found in this venv) or GNU: the places name the compute CPUs only
        if "KMP_AFFINITY" in inst.env:   # workers on the compute CPUs, the master free among them
            assert inst.env["KMP_AFFINITY"] == f"granularity=fine,proclist=[{team_places(compute)}],explicit"
        else:
            assert inst.env["OMP_PLACES"] == ",".join("{%d}" % c for c in compute)
        assert set(reserved) | set(compute) == set(inst.cpus)   # the mask is still the whole slice
        worker_cpus += reserved[:2]
    # oneCCL: the worker list spans every local rank, in rank order
    plain = plan(rank_plan_options(options, size), machine, {})
    with_ccl = reserve_cores(plain, replace(options, reserve_cores=0), machine, {}, ccl=True)
    assert with_ccl is plain          # nothing reserved: plan unchanged
    base = plan(rank_plan_options(replace(options, reserve_cores=0), size), machine, {})
    ccl_plan = reserve_cores(base, options, machine, {}, ccl=True)
    assert ccl_plan.env_set["CCL_WORKER_COUNT"] == "2"
    assert ccl_plan.env_set["CCL_WORKER_AFFINITY"] == ",".join(map(str, worker_cpus))
    users = {"CCL_WORKER_COUNT": "1", "OMP_NUM_THREADS": "3"}      # the user's values stay
    user_base = plan(rank_plan_options(replace(options, reserve_cores=0), size), machine, users)
    kept = reserve_cores(user_base, options, machine, users, ccl=True)
    assert all(i.env["CCL_WORKER_COUNT"] == "1" and i.env["OMP_NUM_THREADS"] == "3" for i in kept.instances)
    assert all(i.env["CCL_WORKER_AFFINITY"] == ccl_plan.env_set["CCL_WORKER_AFFINITY"] for i in kept.instances)


def cli_list(cpus) -> str:
    from xlaunch.cpulist import format_cpulist

    return format_cpulist(cpus)


def test_reserve_too_many_cores() -> None:
    machine = machine_of("epyc-4node-nps4")
    options = Options(program="t.py", python="/py", ncores_per_instance=2, ninstances=2, reserve_cores=2)
    with pytest.raises(PlanError) as caught:
        plan(options, machine, {})
    assert caught.value.option == "--reserve-cores"
    assert caught.value.problem.startswith("instance 0 has 2 core(s): keeping 2 out leaves none")
    logical = replace(options, use_logical_cores=True, ncores_per_instance=4)   # 2 cores, 4 CPUs
    with pytest.raises(PlanError, match="instance 0 has 2 core"):
        plan(logical, machine, {})


def test_torchrun_thread_default_is_dropped() -> None:
    ours = rank_environment({**engine_env("torchrun", 0, 2), "OMP_NUM_THREADS": "1",
                             "XLAUNCH_TORCHRUN_OMP_DEFAULT": "1"}, local_rank_from(engine_env("torchrun", 0, 2)))
    assert "OMP_NUM_THREADS" not in ours and "XLAUNCH_TORCHRUN_OMP_DEFAULT" not in ours
    users = {**engine_env("torchrun", 0, 2), "OMP_NUM_THREADS": "1", "XLAUNCH_TORCHRUN_OMP_DEFAULT": "0"}
    assert rank_environment(users, local_rank_from(users))["OMP_NUM_THREADS"] == "1"
    plain = {**engine_env("torchrun", 0, 2), "OMP_NUM_THREADS": "1"}   # a plain torchrun's default
    assert "OMP_NUM_THREADS" not in rank_environment(plain, local_rank_from(plain))
    mpi = {**engine_env("openmpi", 0, 2), "OMP_NUM_THREADS": "1"}      # under mpirun it is the user's
    assert rank_environment(mpi, local_rank_from(mpi))["OMP_NUM_THREADS"] == "1"


def parse(*argv: str) -> Options:
    return cli.options_from(cli.parse_command_line(argv), {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})


def test_ipexrun_ninstances_with_the_same_nprocs_per_node_means_that_many_ranks() -> None:
    options = parse("--ninstances", "2", "--nprocs-per-node", "2", "--dry-run", "examples/train.py")
    assert (options.nproc_per_node, options.ninstances) == (2, None)
    with pytest.raises(OptionError, match="3 conflicts with --nproc-per-node 2"):
        parse("--ninstances", "3", "--nprocs_per_node", "2", "--dry-run", "examples/train.py")


def test_one_node_ranks_host_their_store_at_the_masters_the_user_gave() -> None:
    """One node: torchrun's private rendezvous, rank 0 hosts the process-group store (so a script
    that sets MASTER_ADDR/MASTER_PORT itself works), at --master-addr/--master-port when given."""
    one = parse("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", "29777", "--dry-run", "examples/train.py")
    env = agent_environment(one, {"PATH": "/bin"}, 4242)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["XLAUNCH_FRONT"] == "4242"
    rank_env = {**env, **engine_env("torchrun", 1, 2), "MASTER_ADDR": "node0.example", "MASTER_PORT": "40000"}
    base = rank_environment(rank_env, local_rank_from(rank_env))
    assert (base["MASTER_ADDR"], base["MASTER_PORT"]) == ("127.0.0.1", "29777")
    assert not [name for name in base if name.startswith("XLAUNCH_FRONT") or name == "XLAUNCH_TORCHRUN_OMP_DEFAULT"]
    two = parse("--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
                "--master-port", "29777", "--dry-run", "examples/train.py")          # static rendezvous: the agent's store
    env = agent_environment(two, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, 1)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0" and "XLAUNCH_FRONT_MASTER_PORT" not in env
    assert torchrun_options(two)[:8] == ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "0",
                                         "--master-addr", "10.0.0.1"]


@pytest.mark.parametrize("dash", [True, False])
def test_torchrun_spellings_and_front_options(dash: bool) -> None:
    def flag(name: str) -> str:
        return "--" + (name.replace("_", "-") if dash else name)

    options = parse(flag("nproc_per_node"), "2", flag("nnodes"), "1:3", flag("node_rank"), "1",
                    flag("master_addr"), "127.0.0.1", flag("master_port"), "29999", flag("rdzv_backend"), "c10d",
                    flag("rdzv_endpoint"), "127.0.0.1:29999", flag("rdzv_id"), "j1", flag("max_restarts"), "2",
                    flag("reserve_cores"), "1", "--nodes-list", "0", "--dry-run", "examples/train.py", "--ddp")
    assert (options.nproc_per_node, options.nnodes, options.node_rank, options.master_port) == (2, "1:3", 1, 29999)
    assert torchrun_options(options) == [
        "--nproc-per-node", "2", "--nnodes", "1:3", "--node-rank", "1", "--master-addr", "127.0.0.1",
        "--master-port", "29999", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999",
        "--rdzv-id", "j1", "--max-restarts", "2", "--rdzv-conf", "join_timeout=600,timeout=600,read_timeout=60",
        "--shutdown-timeout", "5", "--no-python"]
    worker = rank_command(options)
    assert worker[:3] == [options.python, "-m", "xlaunch"] and worker[-3:] == ["--", "examples/train.py", "--ddp"]
    # the ranks' options parse back to the same placement
    back = parse(*worker[3:-3], "--dry-run", "examples/train.py")
    assert back.per_rank and back.nodes_list == (0,) and back.reserve_cores == 1 and back.verbosity == -1
    assert rank_argv(replace(options, verbosity=2))[-2:] == ["-v", "-v"]
    logged = torchrun_options(replace(options, log_dir="/tmp/logs", grace_period=0.5))
    assert logged[-3:] == ["--shutdown-timeout", "1", "--no-python"]     # xlaunch keeps the per-rank logs
    one_node = torchrun_options(replace(options, nnodes=None, rdzv_backend=None, rdzv_endpoint=None))
    assert "--master-port" not in one_node and "--master-addr" not in one_node   # the ranks' MASTER_* instead
    # one node: the agents' private c10d rendezvous on a free port, named whatever torchrun's default
    # (before torch's own single-node default, the static rendezvous on 29500 made the ranks clients of
    # the agent's store while their MASTER_PORT pointed elsewhere: they waited 30 minutes)
    assert one_node[one_node.index("--rdzv-backend"):][:4] == ["--rdzv-backend", "c10d", "--rdzv-endpoint",
                                                               "localhost:0"]
    bounded = torchrun_options(replace(options, rdzv_timeout=2.5))
    assert bounded[bounded.index("--rdzv-conf") + 1] == "join_timeout=3,timeout=3,read_timeout=3"


def test_agent_rendezvous_errors_say_what_was_waited_for() -> None:
    """The agent's one error line for a rendezvous that ran out (torch-free: torchrun's parsed
    arguments and its exceptions' names)."""
    from argparse import Namespace

    from xlaunch.launcher.distributed.agent import is_rendezvous_failure, rendezvous_wait

    conf = "join_timeout=7,timeout=7,read_timeout=7"
    static = Namespace(rdzv_backend="static", rdzv_endpoint="", master_addr="10.0.0.1", master_port=29511, nnodes="2",
                       node_rank=1, rdzv_conf=conf)
    assert rendezvous_wait(static) == ("node 0's rendezvous store at the master address 10.0.0.1:29511 "
                                       "(this is node 1 of 2)", "7 s")
    assert rendezvous_wait(Namespace(**{**vars(static), "node_rank": 0}))[0] == (
        "the other nodes of --nnodes 2 at the master address 10.0.0.1:29511 (node 0 hosts the rendezvous store there)")
    c10d = Namespace(rdzv_backend="c10d", rdzv_endpoint="head:29400", nnodes="1:4", node_rank=None, rdzv_conf="")
    assert rendezvous_wait(c10d) == ("the rendezvous of --nnodes 1:4 (c10d at head:29400)", "torch's default")

    class RendezvousError(Exception):        # torch's exception classes, by name (their modules need torch)
        pass

    class RendezvousTimeoutError(RendezvousError):
        pass

    class DistError(RuntimeError):
        pass

    class DistStoreError(DistError):
        pass

    assert is_rendezvous_failure(RendezvousTimeoutError("join"))
    assert is_rendezvous_failure(DistStoreError("Timed out after 4 seconds waiting for clients. 1/2 clients joined."))
    assert is_rendezvous_failure(TimeoutError())
    assert not is_rendezvous_failure(ValueError("unknown rendezvous backend 'etc'"))


@pytest.mark.parametrize("tree, extra, ranks", [
    ("xeon-2s-amx", (), 2), ("epyc-4node-nps4", (), 4), ("epyc-4node-nps4", ("--nodes-list", "1-3"), 3),
    ("xeon-max-snc4-hbm", (), 8), ("container-cpuset", (), 1), ("hybrid-laptop", (), 1),
])
def test_nproc_per_node_auto_is_one_rank_per_node_with_cpus(tree: str, extra: tuple, ranks: int) -> None:
    """auto: what --throughput-mode would start, one rank per NUMA node (memory-only nodes have
    none); the ranks, planning from torchrun's variables, get the front's slices, each in its node."""
    machine = machine_of(tree)
    options = parse("--nproc-per-node", "AUTO", *extra, "--dry-run", "examples/train.py")
    assert options.nproc_per_node == "auto"
    resolved = resolve_auto_ranks(options, machine, {})
    assert resolved.nproc_per_node == ranks and torchrun_options(resolved)[:2] == ["--nproc-per-node", str(ranks)]
    throughput = plan(replace(options, nproc_per_node=None, throughput_mode=True), machine, {})
    front = plan(rank_plan_options(resolved, ranks), machine, {})
    assert [i.cpus for i in front.instances] == [i.cpus for i in throughput.instances]
    worker = parse(*rank_command(resolved)[3:-2], "--dry-run", "examples/train.py")
    for rank in range(ranks):
        local, node_plan, _ = plan_rank(worker, machine, engine_env("torchrun", rank, ranks))
        mine = node_plan.instances[local.rank]
        assert (mine.cpus, mine.mem_nodes) == (front.instances[rank].cpus, front.instances[rank].mem_nodes)
        assert len({machine.cpu(c).node for c in mine.cpus}) == 1


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--nnodes", "2"], "--nnodes"),
        (["--master-port", "1"], "--master-port"),
        (["--nproc-per-node", "2", "--per-rank"], "--per-rank"),
        (["--nproc-per-node", "0"], "--nproc-per-node"),
        (["--nproc-per-node", "2", "--ninstances", "3"], "--ninstances"),
        (["--per-rank", "--summary-json", "/tmp/s.json"], "--summary-json"),
        (["--per-rank", "--log-file-prefix", "p"], "--log-file-prefix"),
        (["--per-rank", "--throughput-mode"], "--throughput-mode"),
        (["--nproc-per-node", "2", "--nnodes", "2:1"], "--nnodes"),
        (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank"),
        (["--nproc-per-node", "2", "--master-port", "70000"], "--master-port"),
        (["--reserve-cores", "-1"], "--reserve-cores"),
        (["--per-rank", "--log-dir", "/tmp"], "--log-dir"),
        (["--nproc-per-node", "cpu"], "--nproc-per-node"),
        (["--nproc-per-node", "autox"], "--nproc-per-node"),
    ],
)
def test_bad_distributed_options(argv: list, option: str) -> None:
    with pytest.raises(OptionError) as caught:
        parse(*argv, "--dry-run", "examples/train.py")
    assert caught.value.option == option


def run_cli(*argv: str, env: dict) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "xlaunch", *argv], env=full, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cli_missing_and_contradictory_variables_exit_2() -> None:
    missing = run_cli("--per-rank", "examples/train.py", env={})
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("xlaunch: error: --per-rank: no local rank")
    contra = run_cli("--per-rank", "examples/train.py",
                     env={"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                          "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert contra.returncode == 2 and contra.stderr.count("\n") == 1
    assert "contradictory launcher variables" in contra.stderr


def test_cli_dry_run_json_on_recorded_tree() -> None:
    front = run_cli("--nproc-per-node", "4", "--reserve-cores", "1", "--dry-run", "--json", "examples/train.py",
                    env={"XLAUNCH_FSROOT": machine_dir("epyc-4node-nps4")})
    assert front.returncode == 0, front.stderr
    data = json.loads(front.stdout)
    assert [len(i["cpus"]) for i in data["instances"]] == [16] * 4
    assert [i["mem_nodes"] for i in data["instances"]] == [[0], [1], [2], [3]]
    assert data["distributed"]["rank_command"][3:5] == ["--per-rank", "--reserve-cores"]
    rank = run_cli("--per-rank", "--reserve-cores", "1", "--dry-run", "--json", "examples/train.py",
                   env={"XLAUNCH_FSROOT": machine_dir("epyc-4node-nps4"), **engine_env("mpich", 3, 4)})
    assert rank.returncode == 0, rank.stderr
    mine = json.loads(rank.stdout)
    assert [i["cpus"] for i in mine["instances"]] == [data["instances"][3]["cpus"]]
    assert mine["instances"][0]["env"]["XLAUNCH_RESERVED_CPUS"] == data["instances"][3]["env"]["XLAUNCH_RESERVED_CPUS"]
    assert mine["rank"] == {"local_rank": 3, "local_size": 4, "source": "mpich",
                            "variables": ["MPI_LOCALRANKID", "MPI_LOCALNRANKS"]}
    refused = run_cli("--per-rank", "examples/train.py",
                      env={"XLAUNCH_FSROOT": machine_dir("epyc-4node-nps4"), **engine_env("mpich", 3, 4)})
    assert refused.returncode == 2 and "XLAUNCH_FSROOT" in refused.stderr


def test_too_many_ranks_names_the_rank_option(capsys: pytest.CaptureFixture) -> None:
    train = str(REPO / "examples" / "train.py")
    env = {"XLAUNCH_FSROOT": machine_dir("epyc-4node-nps4"), "PATH": "/usr/bin:/bin"}
    assert cli.run(["--nproc-per-node", "65", "--dry-run", train], environ=env) == 2
    assert capsys.readouterr().err == "xlaunch: error: --nproc-per-node: 65 ranks need at least 65 cores, only 64 available\n"
    assert cli.run(["--per-rank", "--dry-run", train], environ={**env, **engine_env("pals", 0, 65)}) == 2
    err = capsys.readouterr().err
    assert err.startswith("xlaunch: error: --per-rank: local rank 0 of 65 (pals") and err.count("\n") == 1


def test_no_torch_on_the_planning_paths() -> None:
    """--per-rank never imports torch; the front only when it really launches."""
    train = str(REPO / "examples" / "train.py")
    ranks = min(2, allowed_cores())            # planned for this machine: as many as it has cores
    for argv, env in ((["--nproc-per-node", str(ranks), "--dry-run", train], {}),
                      (["--per-rank", "--reserve-cores", "0", "--no-python", "/bin/true"],
                       engine_env("torchrun", 0, ranks))):
        full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **env}
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "xlaunch", *argv], env=full, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
        assert "xlaunch.launcher.cli.command" in imported and not [name for name in imported if name.split(".")[0] == "torch"]


@pytest.mark.parametrize("text", ["\u0660", "\uff10", "0_1", "\u00b9", " 1 2"])
def test_ranks_are_ascii_decimal(text: str) -> None:
    with pytest.raises(OptionError, match="is not a non-negative integer"):
        local_rank_from({"LOCAL_RANK": text, "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(OptionError, match="is not a positive integer"):
        local_rank_from({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": text.replace("0", "2")})


def test_slurm_counts_are_never_expanded() -> None:
    import tracemalloc

    tracemalloc.start()
    env = {"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x100000000),1", "SLURM_NODEID": "100000000"}
    assert local_rank_from(env).size == 1                     # the last node: after 10^8 nodes of 2
    assert local_rank_from({**env, "SLURM_NODEID": "99999999"}).size == 2
    assert tracemalloc.get_traced_memory()[1] < 1 << 20       # the old list took 800 MB
    tracemalloc.stop()
    for bad in ("2(x1000000000000)", "2(x0)", "\uff12", "2(x\u0663)", "0"):
        with pytest.raises(OptionError, match="not a Slurm task count list"):
            local_rank_from({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": bad})


@pytest.mark.parametrize("argv, error", [
    (["--rdzv-endpoint", ":29400"], "--rdzv-endpoint: ':29400': no host before the port"),
    (["--rdzv-endpoint", "node0:29400x"], "--rdzv-endpoint: 'node0:29400x': the port after the last ':' must be"),
    (["--rdzv-endpoint", "node0:65536"], "--rdzv-endpoint: 'node0:65536': the port after the last ':' must be"),
    (["--rdzv-endpoint", "node 0:29400"], "--rdzv-endpoint: 'node 0:29400': 'node 0' is not a host name"),
    (["--master-addr", "node 0"], "--master-addr: 'node 0' is not a host name"),
    (["--master-addr", "node0;1"], "--master-addr: 'node0;1' is not a host name"),
    (["--rdzv-endpoint", "node0"], None), (["--rdzv-endpoint", "[::1]:29400"], None),
    (["--rdzv-endpoint", "10.0.0.1:0"], None), (["--master-addr", "node-1.example.com"], None),
])
def test_rendezvous_addresses_torch_would_refuse_are_refused_before_the_agent(
        capsys: pytest.CaptureFixture, argv: list[str], error: str | None) -> None:
    """An address torch's agent cannot parse was its ValueError after it started (exit 1, the option unnamed):
    one line naming the option, exit 2, nothing started (the same test torch makes)."""
    env = {"XLAUNCH_FSROOT": machine_dir("epyc-4node-nps4"), "PATH": "/usr/bin:/bin"}
    backend = ["--rdzv-backend", "c10d"] if argv[0] == "--rdzv-endpoint" else []
    code = cli.run(["--nproc-per-node", "2", "--nnodes", "2", *backend, *argv, "--dry-run",
                    str(REPO / "examples" / "train.py")], environ=env)
    err = capsys.readouterr().err
    if error is None:
        assert code == 0 and "error" not in err, err
    else:
        assert code == 2 and err.startswith(f"xlaunch: error: {error}") and err.count("\n") == 1, err


def test_a_rank_whose_script_interpreter_is_missing_names_it(tmp_path: Path) -> None:
    """``--per-rank`` execs the program itself: a script with Windows line ends ('#!/bin/sh\\r') read as
    'PROGRAM: crlf.sh: No such file or directory', the script being there; it is said as an instance says it."""
    script = tmp_path / "crlf.sh"
    script.write_bytes(b"#!/bin/sh\r\necho hi\r\n")
    script.chmod(0o755)
    done = run_cli("--per-rank", "-q", "--bind-with", "none", "--no-python", str(script),
                   env={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert done.returncode == 127
    assert done.stderr == (f"xlaunch: error: PROGRAM: {script}: its interpreter (the #! line) was not found "
                           "('/bin/sh\\r': the file has Windows line ends, \\r\\n)\n"), done.stderr

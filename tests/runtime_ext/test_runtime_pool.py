"""CPUPool: validation against the CPUs this process may use, defaults, split, repr."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from host_cpus import need_cores, planned

from xlaunch.runtime_ext import CPUPool, topology
from xlaunch.runtime_ext.topology import AllowedCore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
# No OpenMP runtime takes part: test_runtime_iomp.py's reruns under libiomp5 and libomp would repeat the same run.
SAME_UNDER_EVERY_RUNTIME = pytest.mark.skipif("XLAUNCH_TEST_OMP_KIND" in os.environ,
                                              reason="no OpenMP runtime takes part: the first run was this one")


def run_python(code: str, *prefix: str, drop: tuple = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_default_pool_is_one_cpu_per_allowed_core():
    cores = topology.allowed_cores()
    pool = CPUPool()
    assert pool.cpus == tuple(core.cpus[0] for core in cores)
    assert set(pool.cpus) <= set(ALLOWED)
    assert len(pool) == len(cores)


def test_default_pool_skips_smt_siblings(monkeypatch):
    smt = (AllowedCore((0, 4), 0), AllowedCore((1, 5), 0), AllowedCore((2,), 1), AllowedCore((3, 7), 1))
    monkeypatch.setattr(topology, "allowed_cores", lambda: smt)
    assert CPUPool().cpus == (0, 1, 2, 3)
    assert CPUPool.from_node(1).cpus == (2, 3)
    assert CPUPool([4, 5]).cpus == (4, 5)          # siblings are allowed when asked for
    with pytest.raises(ValueError, match="CPU 6 is not allowed"):
        CPUPool([6])
    with pytest.raises(ValueError, match="NUMA node 2 has no CPU .*nodes with allowed CPUs: 0,1"):
        CPUPool(node_id=2)


def test_pools_outside_the_allowed_cpus_are_rejected_by_id():
    outside = max(ALLOWED) + 1
    with pytest.raises(ValueError) as error:
        CPUPool([ALLOWED[0], outside, outside + 2])
    assert f"CPUs {outside},{outside + 2} are not allowed" in str(error.value)
    with pytest.raises(ValueError, match="repeated"):
        CPUPool([ALLOWED[0], ALLOWED[0]])
    with pytest.raises(ValueError, match="non-negative"):
        CPUPool([-1])
    with pytest.raises(ValueError, match="at least one"):
        CPUPool([])
    with pytest.raises(ValueError, match="not both"):
        CPUPool([ALLOWED[0]], node_id=0)


def test_pool_from_string_split_and_repr():
    pool = CPUPool(",".join(map(str, ALLOWED)))
    assert pool.cpus == ALLOWED
    assert pool == CPUPool(list(ALLOWED)) and hash(pool) == hash(CPUPool(list(ALLOWED)))
    parts = pool.split(len(ALLOWED))
    assert [p.cpus for p in parts] == [(c,) for c in ALLOWED]
    with pytest.raises(ValueError, match="cannot split"):
        pool.split(len(ALLOWED) + 1)
    assert repr(CPUPool([ALLOWED[0]])) == f"CPUPool(cpus='{ALLOWED[0]}', n=1)"


def test_uneven_split_keeps_order():
    from xlaunch.runtime_ext.pool import _chunks

    assert _chunks((0, 1, 2, 3, 4), 2) == [(0, 1, 2), (3, 4)]
    assert _chunks((5, 3, 1), 3) == [(5,), (3,), (1,)]


def test_import_builds_no_pool_and_imports_no_torch():
    result = run_python(
        "import sys, xlaunch, xlaunch.runtime_ext as r; r.CPUPool; r.pin; r.Task; r.threads;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "import xlaunch.runtime_ext.pool as p; assert p.topology.allowed_cores.__name__;"
        "print(sorted(m for m in sys.modules if m.startswith('xlaunch.machine')))"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed CPUs")
def test_default_pool_inside_taskset_is_the_restricted_cpu():
    pytest.importorskip("torch")
    code = (
        "import torch, os, threading\n"
        "from xlaunch.runtime_ext import CPUPool, threadpool_info\n"
        "pool = CPUPool()\n"
        "print(pool.cpus)\n"
        "with pool:\n"
        "    print([m.cpus for m in threadpool_info().team])\n"
        "try:\n"
        f"    CPUPool([{ALLOWED[0]}])\n"
        "except ValueError as e:\n"
        "    print('rejected:', e)\n"
    )
    result = run_python(code, "taskset", "-c", str(ALLOWED[-1]))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"({ALLOWED[-1]},)"
    assert lines[1] == f"[({ALLOWED[-1]},)]"
    assert lines[2].startswith(f"rejected: CPU {ALLOWED[0]} is not allowed")


@SAME_UNDER_EVERY_RUNTIME
def test_no_openmp_runtime_gives_one_clear_error():
    code = (
        "from xlaunch.runtime_ext import CPUPool, pinning_supported, OpenMPNotFoundError\n"
        "assert not pinning_supported()\n"
        "try:\n"
        "    with CPUPool():\n"
        "        pass\n"
        "except OpenMPNotFoundError as e:\n"
        "    print(e)\n"
    )
    result = run_python(code, drop=("LD_PRELOAD",))  # a preloaded libiomp5 would be found
    assert result.returncode == 0, result.stderr
    assert "no OpenMP runtime (libgomp, libiomp5 or libomp) is loaded" in result.stdout




@SAME_UNDER_EVERY_RUNTIME
@pytest.mark.parametrize(
    "tree, default, node_pools",
    [
        ("xeon-2s-amx", "0-111", {0: "0-55", 1: "56-111"}),       # 2 sockets, SMT siblings 112-223
        ("container-cpuset", "4-7", {0: "4-7"}),                  # cpuset 4-7,36-39: siblings dropped
        ("vm-adjacent-smt", "0,2,4,6", {0: "0,2,4,6"}),           # siblings numbered next to each other
    ],
)
def test_pools_on_recorded_machines(monkeypatch, tree, default, node_pools):
    from xlaunch.cpulist import format_cpulist

    from machine_trees import machine_tree

    monkeypatch.setenv("XLAUNCH_FSROOT", str(machine_tree(tree)))
    assert format_cpulist(CPUPool().cpus) == default
    for node, cpus in node_pools.items():
        assert format_cpulist(CPUPool.from_node(node).cpus) == cpus


@pytest.mark.skipif(os.environ.get("XLAUNCH_TEST_OMP_KIND") == "iomp",
                    reason="xlaunch sets the instances' OpenMP itself (libiomp5, the same LD_PRELOAD with or without "
                           "a preloaded one): the first run started these very processes")
def test_default_pool_inside_xlaunch_instances_is_each_instances_cpus(tmp_path):
    """Under ``xlaunch --ninstances 2`` each process is already pinned: CPUPool() is its CPUs,
    one team thread on each (however many CPUs an instance has)."""
    pytest.importorskip("torch")
    need_cores(2)
    script = tmp_path / "pool.py"
    script.write_text(
        "import os, torch\n"
        "from xlaunch.runtime_ext import CPUPool, threadpool_info\n"
        "pool = CPUPool()\n"
        "with pool:\n"
        "    team = [m.cpus for m in threadpool_info().team]\n"
        "print('pool', os.environ['XLAUNCH_INSTANCE_INDEX'], list(pool.cpus), [list(c) for c in team])\n")
    instances = planned(["-q", "--ninstances", "2", str(script)])
    result = subprocess.run([sys.executable, "-m", "xlaunch", "-q", "--ninstances", "2", str(script)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if " pool " in line)
    assert lines == [f"[{i}] pool {i} {inst['cpus']} {[[c] for c in inst['cpus']]}" for i, inst in enumerate(instances)]


def test_pools_pickle_and_copy_as_values(monkeypatch):
    """A pool is a value: it pickles (multiprocessing, a saved config) and copies (copy.deepcopy of
    an object holding one); it failed inside pickle (a thread-local)."""
    import copy
    import pickle

    from xlaunch.runtime_ext import pin

    pool = CPUPool(list(reversed(ALLOWED)))
    for clone in (pickle.loads(pickle.dumps(pool)), copy.copy(pool), copy.deepcopy(pool)):
        assert clone == pool and clone.cpus == pool.cpus and clone.node_id is None
    node = topology.node_ids()[0] if topology.node_ids() else None
    if node is not None:
        by_node = pickle.loads(pickle.dumps(CPUPool(node_id=node)))
        assert by_node == CPUPool(node_id=node) and by_node.node_id == node
    decorator = pickle.loads(pickle.dumps(pin(pool)))
    assert decorator.pool == pool
    with CPUPool([ALLOWED[0]]) as entered:            # a pool in use pickles too
        assert pickle.loads(pickle.dumps(entered)) == entered
    # loaded where those CPUs may not be used: refused as a new pool would be
    monkeypatch.setattr(topology, "allowed_cores", lambda: (AllowedCore((max(ALLOWED) + 1,), 0),))
    with pytest.raises(ValueError, match="not allowed for this process"):
        pickle.loads(pickle.dumps(pool))


def test_wrong_kinds_of_arguments_get_one_line_naming_them():
    for bad in (1.5, 3, object()):
        with pytest.raises(TypeError, match="^core_ids must be a list of CPU ids or a string like '0-3', got "):
            CPUPool(bad)
    with pytest.raises(ValueError, match=r"^core_ids: 'a' is not a CPU number"):
        CPUPool("a")
    with pytest.raises(ValueError, match="^node_id must be a non-negative integer, got -1$"):
        CPUPool(node_id=-1)
    with pytest.raises(ValueError, match="^core_ids names more CPUs than any machine has"):
        CPUPool(range(10**12))                        # refused at once, without building the list
    with pytest.raises(ValueError, match="^parts must be an int from 1 to"):
        CPUPool([ALLOWED[0]]).split("1")


def test_numpy_and_tensor_integers_are_cpu_ids():
    """Ids from numpy or torch (``np.arange``, a parsed lscpu table) were refused as "must be
    non-negative integers, got [np.int64(0)]"; anything with ``__index__`` but a bool is an id."""
    np = pytest.importorskip("numpy")
    assert CPUPool(np.array(ALLOWED)).cpus == ALLOWED
    assert CPUPool([np.int32(ALLOWED[0])]).cpus == (ALLOWED[0],)
    assert all(type(c) is int for c in CPUPool(np.array(ALLOWED)).cpus)
    node = topology.node_ids()[0] if topology.node_ids() else None
    if node is not None:
        assert CPUPool(node_id=np.int64(node)) == CPUPool(node_id=node)
    for wrong in ([0.0], [True], [np.float64(0)], [np.bool_(True)]):
        with pytest.raises(ValueError, match="CPU ids must be non-negative integers"):
            CPUPool(wrong)
    pool = CPUPool([ALLOWED[0]])
    assert pool.split(np.int64(1)) == [pool]
    pytest.importorskip("torch")
    from xlaunch.runtime_ext.streams import stream_count

    assert stream_count(np.int64(1), pool) == 1


CPUSET_V1 = "/sys/fs/cgroup/cpuset"
SHRUNK_CPUSET = r"""
import os, sys, torch
from xlaunch.runtime_ext import CPUPool, pin
group, keep, drop = sys.argv[1], sys.argv[2], int(sys.argv[3])
open(os.path.join(group, "cgroup.procs"), "w").write(str(os.getpid()))
pool = CPUPool([drop])
torch.ones(100).add_(1)
open(os.path.join(group, "cpuset.cpus"), "w").write(keep)     # the cpuset shrinks under the pool
before = os.sched_getaffinity(0)
try:
    with pin(pool):
        raise SystemExit("pinned to a CPU the cpuset took away")
except OSError as error:
    print(error)
assert os.sched_getaffinity(0) == before and torch.get_num_threads() >= 1
"""


@pytest.mark.skipif("XLAUNCH_TEST_OMP_KIND" in os.environ, reason="the same under every runtime: run once")
@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed CPUs")
def test_a_pool_whose_cpu_the_cpuset_took_away_is_one_clear_error(tmp_path):
    """A pin to a CPU the process's cpuset no longer allows was a bare '[Errno 22] Invalid argument'."""
    if os.geteuid() != 0 or not os.access(os.path.join(CPUSET_V1, "cgroup.procs"), os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 cpuset hierarchy to shrink a cpuset")
    group = os.path.join(CPUSET_V1, f"xlaunch-test-{os.getpid()}")
    try:
        os.mkdir(group)
        for name in ("cpuset.mems", "cpuset.cpus"):
            with open(os.path.join(CPUSET_V1, name)) as parent, open(os.path.join(group, name), "w") as child:
                child.write(parent.read().strip() if name == "cpuset.mems" else ",".join(map(str, ALLOWED[:2])))
        done = subprocess.run([sys.executable, "-c", SHRUNK_CPUSET, group, str(ALLOWED[0]), str(ALLOWED[1])],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        if os.path.isdir(group):
            os.rmdir(group)
    assert done.returncode == 0 and done.stderr == "", done
    assert done.stdout == (f"[Errno 22] cannot pin to CPU {ALLOWED[1]}: this process may not use it now (its cpuset "
                           "changed since the pool was made?)\n"), done

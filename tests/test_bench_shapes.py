"""The benches' own logic, in-process (no torch, no runs): the configurations they derive from a
machine (recorded trees through ``XLAUNCH_FSROOT``'s reader) and the aggregate over the window
every instance ran (``bench/throughput.py``'s ``shared_window``)."""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
from machine_trees import MACHINE_NAMES, machine_tree

from xlaunch.machine import load_machine

BENCH = Path(__file__).resolve().parent.parent / "bench"


@functools.lru_cache(maxsize=None)
def bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def per_node(tree: str) -> list[int]:
    return bench("_machine_bench").node_cores(load_machine(str(machine_tree(tree))))


# (usable physical cores of each node with any, as the planner counts them)
NODE_CORES = {
    "spr16": [16],                      # 16 cores, one node
    "xeon-2s-amx": [56, 56],            # 2 sockets x 56 cores (SMT siblings fold)
    "epyc-4node-nps4": [16, 16, 16, 16],
    "hybrid-laptop": [4],               # the 4 performance cores
    "container-cpuset": [4],            # cpuset 4-7 + siblings 36-39
    "vm-no-node": [4],
}
assert set(NODE_CORES) <= set(MACHINE_NAMES)


@pytest.mark.parametrize("tree", sorted(NODE_CORES))
def test_node_cores_are_the_planners_and_give_1xN_to_Nx1(tree: str) -> None:
    cores = per_node(tree)
    assert cores == NODE_CORES[tree]
    total = sum(cores)
    shapes = bench("_machine_bench").shapes(cores)
    assert shapes[0] == (1, total) and shapes[-1] == (total, 1)
    assert all(k * width == total for k, width in shapes)
    assert all(all(n % width == 0 for n in cores) for k, width in shapes if k > 1)


def test_shapes_of_a_16_core_node() -> None:
    shapes = bench("_machine_bench").shapes(per_node("spr16"))
    assert shapes == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]


def test_shapes_never_span_two_nodes() -> None:
    shapes = bench("_machine_bench").shapes
    assert shapes([56, 56]) == [(1, 112), (2, 56), (4, 28), (8, 14), (14, 8), (16, 7), (28, 4), (56, 2), (112, 1)]
    assert shapes([16] * 4) == [(1, 64), (4, 16), (8, 8), (16, 4), (32, 2), (64, 1)]
    assert shapes([6, 4]) == [(1, 10), (5, 2), (10, 1)]       # widths that divide every node
    assert shapes([2]) == [(1, 2), (2, 1)] and shapes([1]) == [(1, 1)] and shapes([]) == []


def test_throughput_configurations() -> None:
    configs = bench("throughput").configurations([16])
    names = [c.name for c in configs]
    assert names[0] == "plain python"
    shapes = ["1x16", "2x8", "4x4", "8x2", "16x1"]
    assert names[1:11] == [f"{tool} {s}" for s in shapes for tool in ("xlaunch", "run_cpu")]
    assert names[11:] == ["xlaunch --throughput-mode", "run_cpu --throughput-mode"]
    four = next(c for c in configs if c.name == "run_cpu 4x4")
    assert four.argv(["infer.py"])[-5:] == ["--ninstances", "4", "--ncores-per-instance", "4", "infer.py"]
    xl = next(c for c in configs if c.name == "xlaunch 4x4")
    assert xl.argv(["infer.py"])[1:] == ["-m", "xlaunch", "--ninstances", "4", "--ncore_per_instance", "4", "infer.py"]
    mode = next(c for c in configs if c.name == "run_cpu --throughput-mode")
    assert (mode.instances, mode.cores_per_instance) == (1, 16) and "--throughput-mode" in mode.argv(["x.py"])


def test_distributed_configurations() -> None:
    configs = bench("distributed").configurations([16])
    assert sorted({(c.ranks, c.cores_per_rank) for c in configs}) == [(2, 8), (4, 4), (8, 2), (16, 1)]
    four = [c for c in configs if c.ranks == 4]
    assert [c.name for c in four] == ["torchrun 4x4", "torchrun OMP=4 4x4", "xlaunch 4x4", "xlaunch OMP=4 4x4"]
    assert [c.omp for c in four] == [None, 4, None, 4]
    assert bench("distributed").configurations([1]) == []          # one core: no DDP shape


def timeline(begin: float, ends: list[float], batch: int = 10) -> dict:
    return {"begin": begin, "ends": ends, "batch_size": batch}


def test_shared_window_of_instances_that_ran_together() -> None:
    window = bench("throughput").shared_window
    same = window([timeline(0, [1, 2, 3, 4]), timeline(0, [2, 4])])
    assert same["window"] == (0, 4) and same["per_instance"] == [10.0, 5.0] and same["aggregate"] == 15.0
    assert same["late"] == 0


def test_shared_window_cuts_a_late_start_and_an_early_end() -> None:
    window = bench("throughput").shared_window
    # A runs 0..6 at 10 img/s; B starts at 2 and stops at 5 at 20 img/s (batches of 0.5 s)
    a = timeline(0, [1, 2, 3, 4, 5, 6])
    b = timeline(2, [2.5, 3, 3.5, 4, 4.5, 5])
    result = window([a, b])
    assert result["window"] == (2, 5) and result["late"] == 2
    assert result["per_instance"] == pytest.approx([10.0, 20.0])
    assert result["aggregate"] == pytest.approx(30.0)
    # summing each instance's own rate would count A's time alone: the same 30 here only
    # because A's rate is steady; the window is what keeps B's solo seconds out when it is not


def test_shared_window_counts_batches_in_proportion() -> None:
    window = bench("throughput").shared_window
    # B's start (0.5) and A's end (2.5) fall in the middle of the other's batches
    a = timeline(0, [1, 2, 2.5], batch=8)        # batches 0-1, 1-2, 2-2.5
    b = timeline(0.5, [1.5, 3.5], batch=4)       # batches 0.5-1.5, 1.5-3.5
    result = window([a, b])
    assert result["window"] == (0.5, 2.5)
    a_images = 8 * 0.5 + 8 + 8                  # half of the first batch, then two whole ones
    b_images = 4 + 4 * (1 / 2)                  # the first batch, half of the second
    assert result["per_instance"] == pytest.approx([a_images / 2, b_images / 2])
    assert result["aggregate"] == pytest.approx((a_images + b_images) / 2)


def test_instances_that_never_overlap_have_no_aggregate() -> None:
    window = bench("throughput").shared_window
    solo = window([timeline(0, [1, 2]), timeline(2, [3, 4])])
    assert solo["aggregate"] is None and solo["window"] == (2, 2)
    assert window([timeline(0, [1]), timeline(0, [])])["aggregate"] is None      # one never ran
    assert window([])["aggregate"] is None


def test_own_rates_overstate_when_instances_do_not_overlap() -> None:
    throughput = bench("throughput")
    # two instances, each 20 img/s alone, one after the other: the naive sum says 40
    a, b = timeline(0, [0.5, 1.0]), timeline(1.0, [1.5, 2.0])
    assert throughput.own_rate(a) + throughput.own_rate(b) == pytest.approx(40.0)
    assert throughput.shared_window([a, b])["aggregate"] is None


def test_summarize_writes_the_issue_schema() -> None:
    throughput = bench("throughput")
    configs = throughput.configurations([2])
    for config in configs:
        config.runs = [{"aggregate": 100.0 * config.instances, "round": 0},
                       {"aggregate": None, "round": 1, "error": "exit 1"}]
    results = throughput.summarize(configs)
    assert {r["launcher"] for r in results} == {"plain", "xlaunch", "run_cpu"}
    two = next(r for r in results if r["name"] == "xlaunch 2x1")
    assert (two["instances"], two["cores_per_instance"], two["aggregate"]) == (2, 1, 200.0)
    assert len(two["runs"]) == 2


def test_a_ratio_not_measured_is_shown_as_such() -> None:
    """bench/distributed.py printed 'x0.00' for a ratio it did not have: a failed run, or every row of
    --only xlaunch (no torchrun run to compare with)."""
    row_line = bench("distributed").row_line
    missing = {"name": "xlaunch 2x1", "steps_per_s": 9.5, "ratio_to_torchrun": None, "paired_ratio_to_torchrun": None}
    assert row_line(missing).split() == ["xlaunch", "2x1", "9.50", "steps/s", "-", "(per", "round", "-)"]
    failed = {**missing, "steps_per_s": None}
    assert row_line(failed).split()[2:5] == ["-", "steps/s", "-"]
    measured = {**missing, "ratio_to_torchrun": 1.234, "paired_ratio_to_torchrun": 0.5}
    assert row_line(measured).split()[4:] == ["x1.23", "(per", "round", "x0.50)"]


def test_a_launch_that_failed_gives_no_time_and_no_ratio(capsys) -> None:
    """bench/launch.py timed a run_cpu that failed to import torch (exit 1 in 0.2 s) and printed 'run_cpu /
    xlaunch: 0.6x', as if torch's launcher started faster than xlaunch."""
    launch = bench("launch")
    samples = {launch.BASE: [0.1], launch.XLAUNCH: [0.2], launch.RUN_CPU: [0.06]}
    assert launch.report("here:", samples, {launch.RUN_CPU: 1}) is False
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert lines[3:] == ["run_cpu --no-python true failed (exit status 1): not timed",
                         "xlaunch meets the target: 2.00x <= 3x python -c pass", "run_cpu / xlaunch: -"]
    assert launch.report("here:", samples, {launch.XLAUNCH: 1}) is False
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert lines[-2:] == ["xlaunch MISSES the target: xlaunch failed", "run_cpu / xlaunch: -"]
    assert launch.report("here:", samples, {}) is True
    assert capsys.readouterr().out.splitlines()[-1].split() == ["run_cpu", "/", "xlaunch:", "0.3x"]


def test_a_plot_never_writes_through_a_symlink_and_a_failed_write_is_one_line(tmp_path: Path, capsys) -> None:
    """--plot PATH: matplotlib's savefig wrote through a symlink at PATH (over somebody's file), and a folder
    that does not exist ended the finished run in a traceback."""
    pytest.importorskip("matplotlib")
    common = bench("_machine_bench")
    results = [{"series": "xlaunch", "v": 1.0, "x": 1}, {"series": "xlaunch", "v": 2.0, "x": 2}]
    target = tmp_path / "somebody-elses.txt"
    target.write_text("theirs")
    (tmp_path / "plot.png").symlink_to(target)
    common.plot(str(tmp_path / "plot.png"), results, value="v", ylabel="y", xlabel="x", title="t", x_of=lambda r: r["x"])
    assert target.read_text() == "theirs" and not (tmp_path / "plot.png").is_symlink()
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert capsys.readouterr().out == f"wrote {tmp_path / 'plot.png'}\n"
    common.plot(str(tmp_path / "no-such-folder" / "p.png"), results, value="v", ylabel="y", xlabel="x", title="t",
                x_of=lambda r: r["x"])
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"could not write {tmp_path / 'no-such-folder' / 'p.png'}: ") and \
        len(err.splitlines()) == 1, err


def test_a_bench_names_the_machine_it_runs_on_not_a_recorded_one(monkeypatch) -> None:
    here = load_machine("/")
    monkeypatch.setenv("XLAUNCH_FSROOT", str(machine_tree("spr16")))
    line = bench("_machine_bench").this_machine()
    assert line.startswith(f"{here.isa.model_name}: ") and " ISA " in line, line
    assert f"{len(set(here.allowed_cpus) & set(here.online_cpus))} CPUs allowed" in line, line

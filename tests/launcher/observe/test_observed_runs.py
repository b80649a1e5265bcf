"""What xlaunch reports about instances that really ran: --summary-json, observed libraries and
thread CPUs inside each slice, and the warning for a second OpenMP runtime."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from host_cpus import planned, without_budget_warning

REPO = Path(__file__).resolve().parents[3]
ALLOWED = sorted(os.sched_getaffinity(0))
TORCH_LIB = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "torch" / "lib"


def xlaunch(*argv: str, cwd: Path, preload: str = "") -> subprocess.CompletedProcess:
    """``python -m xlaunch ARGV`` with none of the caller's LD_PRELOAD (``preload`` instead, when given)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLAUNCH_FSROOT", "LD_PRELOAD", "OMP_NUM_THREADS")}
    if preload:
        env["LD_PRELOAD"] = preload
    return subprocess.run([sys.executable, "-m", "xlaunch", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs")
def test_two_instances_summary_json_shows_libraries_and_threads_inside_each_slice(tmp_path, jemalloc_path, iomp_path) -> None:
    program = tmp_path / "work.py"
    # three threads that spin for a second, so every one is seen running
    program.write_text("import threading, time\n"
                       "def spin():\n"
                       "    end = time.time() + 1.2\n"
                       "    while time.time() < end: pass\n"
                       "ts = [threading.Thread(target=spin) for _ in range(3)]\n"
                       "[t.start() for t in ts]; [t.join() for t in ts]\n")
    summary = tmp_path / "summary.json"
    argv = ["--ninstances", "2", "--ncores-per-instance", "1", "--memory-allocator", "jemalloc", "--omp-runtime",
            "intel", str(program)]
    cpus = [inst["cpus"] for inst in planned(argv)]
    result = xlaunch("--summary-json", str(summary), *argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "starting 2 instances on 2 CPUs: allocator jemalloc, OpenMP intel" in result.stderr
    assert "warning" not in without_budget_warning(result.stderr)
    data = json.loads(summary.read_text())
    assert data["exit_status"] == 0 and data["allocator"] == "jemalloc" and data["openmp"] == "intel"
    for instance in data["instances"]:
        observed = instance["observed"]
        assert instance["status"] == "exit 0" and instance["exit_code"] == 0
        assert observed["allocator"] == "jemalloc"
        assert observed["openmp"] == ["intel"]
        assert observed["threads"] >= 4                       # main + 3 spinners
        assert observed["thread_cpus"] and set(observed["thread_cpus"]) <= set(instance["cpus"])
    assert [i["cpus"] for i in data["instances"]] == cpus
    header = next(line for line in result.stderr.splitlines() if "instance" in line and "cpus" in line)
    assert "allocator" in header and "ran on" in header


def test_second_openmp_runtime_is_warned(tmp_path, iomp_path) -> None:
    gomp = sorted(TORCH_LIB.glob("libgomp*.so*"))
    if not gomp:
        pytest.skip("torch's libgomp not found")
    program = tmp_path / "two_runtimes.py"
    # GNU OpenMP is the plan's runtime; the program loads Intel OpenMP itself and uses both
    program.write_text("import ctypes, time\n"
                       f"g = ctypes.CDLL({str(gomp[0])!r}); i = ctypes.CDLL({iomp_path!r})\n"
                       "g.omp_get_max_threads(); i.omp_get_max_threads()\n"
                       "time.sleep(1.0)\n")
    result = xlaunch("--omp-runtime", "default", str(program), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("xlaunch: warning: instance 0:")]
    assert any("OpenMP" in line for line in warnings), result.stderr


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs")
def test_llvm_openmp_in_the_users_ld_preload_is_the_one_that_runs(tmp_path, libomp_path) -> None:
    """Kept, not joined by Intel's: the instance maps LLVM's libomp only, and its team threads run where the
    plan's ``KMP_AFFINITY`` (which libomp reads) puts them, read back from /proc."""
    pytest.importorskip("torch")
    program = tmp_path / "team.py"
    program.write_text("import os, time, torch\n"
                       "x = torch.randn(256, 256)\n"
                       "end = time.time() + 1.2\n"
                       "while time.time() < end: x @ x\n")
    summary = tmp_path / "summary.json"
    result = xlaunch("--ninstances", "1", "--ncores-per-instance", "2", "--summary-json", str(summary), str(program),
                     cwd=tmp_path, preload=libomp_path)
    assert result.returncode == 0, result.stderr
    assert f"kept the OpenMP runtime in your LD_PRELOAD ({libomp_path}); not adding Intel OpenMP" in result.stderr
    data = json.loads(summary.read_text())
    [instance] = data["instances"]
    assert data["openmp"] == "llvm" and instance["observed"]["openmp"] == ["llvm"]
    assert set(instance["observed"]["thread_cpus"]) <= set(instance["cpus"])
    assert not [line for line in result.stderr.splitlines() if "OpenMP runtimes mapped" in line]

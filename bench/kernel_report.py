"""What ``--kernel-report`` costs: ``examples/infer.py`` under xlaunch with and without it.

    .venv/bin/python bench/kernel_report.py [--reps 7] [--iterations 30] [--ninstances 1]

Runs alternate (with, without, without, with, ...) so a change in the machine's load hits both
alike; the throughput of a run is the sum of its instances' ``throughput: X img/s`` lines. Prints
the medians, their ratio (target: with >= 0.97x without), the CPU time of each run (xlaunch and
its instances: on a shared machine the steadier measure of what the report costs), the oneDNN
lines each instance printed (from ``--summary-json``) and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _processes as processes  # noqa: E402
from _args import COUNT  # noqa: E402
from _machine_bench import this_machine  # noqa: E402

XLAUNCH = str(Path(sys.executable).parent / "xlaunch")
INFER = str(REPO / "examples" / "infer.py")
THROUGHPUT = re.compile(rb"throughput: ([0-9.]+) img/s")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(report: bool, ninstances: int, infer_args: list[str], summary: str) -> tuple[float, float, list[int]]:
    argv = [XLAUNCH, "-q", "--ninstances", str(ninstances), "--summary-json", summary]
    argv += ["--kernel-report"] if report else []
    before = cpu_seconds()
    # at the time limit, Ctrl-C or SIGTERM, xlaunch and its instances are stopped
    status, stdout, stderr = processes.run_tree([*argv, INFER, *infer_args], 600, cwd=REPO)
    cpu = cpu_seconds() - before
    if status != 0:
        raise SystemExit(f"xlaunch failed ({status}): {stderr.decode(errors='replace')[-500:]}")
    if b"onednn_verbose" in stdout:
        raise SystemExit("a oneDNN line reached the console")
    values = [float(v) for v in THROUGHPUT.findall(stdout)]
    if len(values) != ninstances:
        raise SystemExit(f"expected {ninstances} throughput lines, got {stdout.decode(errors='replace')[-500:]}")
    data = json.loads(Path(summary).read_text())
    lines = [((i.get("observed") or {}).get("kernels") or {}).get("lines", 0) for i in data["instances"]]
    return sum(values), cpu, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=COUNT, default=7)
    parser.add_argument("--iterations", type=COUNT, default=30)
    parser.add_argument("--ninstances", type=COUNT, default=1)
    args = parser.parse_args()
    infer_args = ["--iterations", str(args.iterations)]
    results: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    lines: list[int] = []
    print(this_machine(), flush=True)
    print(f"load average before: {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        summary = str(Path(scratch) / "summary.json")
        for rep in range(args.reps):
            for report in ((True, False) if rep % 2 == 0 else (False, True)):
                value, seconds, seen = run(report, args.ninstances, infer_args, summary)
                results[report].append(value)
                cpu[report].append(seconds)
                if report:
                    lines = seen
                print(f"  rep {rep + 1}/{args.reps} {'with   ' if report else 'without'} {value:8.1f} img/s "
                      f"{seconds:6.2f} CPU s", flush=True)
    with_report, without = statistics.median(results[True]), statistics.median(results[False])
    print(f"load average after: {loadavg()}")
    print(f"median img/s: with --kernel-report {with_report:.1f}, without {without:.1f}, "
          f"ratio {with_report / without:.3f} (target >= 0.97)")
    cpu_with, cpu_without = statistics.median(cpu[True]), statistics.median(cpu[False])
    print(f"median CPU s per run: with {cpu_with:.2f}, without {cpu_without:.2f}, ratio {cpu_with / cpu_without:.3f}")
    print(f"oneDNN lines per instance in the last reported run: {lines}")


if __name__ == "__main__":
    processes.exit_on_sigterm()
    processes.survive_closed_stdout()
    main()

"""Launch overhead: ``xlaunch --no-python true`` vs ``python -c pass`` vs torch's ``run_cpu``.

    .venv/bin/python bench/launch.py [--reps 10]

Repetitions are interleaved (one of each command per round) so drifting machine load hits all
commands alike; medians are reported with the ratio to ``python -c pass``. Target: xlaunch
<= 3x ``python -c pass``. Not a test: numbers depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
TARGET_RATIO = 3.0


def commands() -> dict[str, list[str]]:
    xlaunch = VENV_BIN / "xlaunch"
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "xlaunch --no-python true": [str(xlaunch), "--no-python", "true"],
        "run_cpu --no-python true": [sys.executable, "-m", "torch.backends.xeon.run_cpu", "--no-python", "true"],
    }


def time_once(argv: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    status = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - start, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--skip-run-cpu", action="store_true", help="leave out torch's run_cpu (slow)")
    args = parser.parse_args()

    # A pip install writes bytecode; an editable install under PYTHONDONTWRITEBYTECODE never
    # does, and compiling xlaunch on every start would be timed instead of starting it.
    import compileall

    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "xlaunch"), quiet=1)
    todo = commands()
    if args.skip_run_cpu:
        del todo["run_cpu --no-python true"]
    samples: dict[str, list[float]] = {name: [] for name in todo}
    failures: dict[str, int] = {}
    for name, argv in todo.items():  # warm the page cache once, untimed
        _elapsed, status = time_once(argv)
        if status != 0:
            failures[name] = status
    for _round in range(args.reps):
        for name, argv in todo.items():
            elapsed, status = time_once(argv)
            samples[name].append(elapsed)
            if status != 0:
                failures[name] = status

    print(f"launch overhead, {args.reps} interleaved rounds, {os.cpu_count()} CPUs, medians:")
    base = statistics.median(samples["python -c pass"])
    for name, values in samples.items():
        median = statistics.median(values)
        note = f"  (exit status {failures[name]}!)" if name in failures else ""
        print(f"  {name:28s} {median * 1000:8.1f} ms  {median / base:6.2f}x python -c pass"
              f"  [min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f} ms]{note}")
    xlaunch = statistics.median(samples["xlaunch --no-python true"]) / base
    verdict = "meets" if xlaunch <= TARGET_RATIO and "xlaunch --no-python true" not in failures else "MISSES"
    print(f"xlaunch {verdict} the target: {xlaunch:.2f}x <= {TARGET_RATIO:g}x python -c pass")
    if "run_cpu --no-python true" in samples:
        run_cpu = statistics.median(samples["run_cpu --no-python true"])
        print(f"run_cpu / xlaunch: {run_cpu / (xlaunch * base):.1f}x")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

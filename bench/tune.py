"""The configuration ``xlaunch-tune`` found, re-measured against the defaults of the launcher
and of ``torch.backends.xeon.run_cpu`` on ``examples/infer.py``.

    .venv/bin/python bench/tune.py --best tune-out/best.toml [--reps 5] [--iterations 20]

Three launches of ``examples/infer.py`` (same arguments), run in interleaved rounds (the order
rotates each round, so drift and neighbours hit each alike):

* ``xlaunch-tune best``  -- ``xlaunch --config BEST PROGRAM``
* ``xlaunch default``    -- ``xlaunch PROGRAM`` (no option)
* ``run_cpu default``    -- ``python -m torch.backends.xeon.run_cpu PROGRAM`` (no option)

A run's throughput is the sum of its ``throughput: X img/s`` lines (one per instance). Medians,
min..max and ratios are printed.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _processes as processes  # noqa: E402
from _args import COUNT, SECONDS  # noqa: E402
from _machine_bench import this_machine  # noqa: E402

INFER = str(REPO / "examples" / "infer.py")
THROUGHPUT = re.compile(rb"throughput: ([0-9.]+) img/s")


def configs(best: str, script: list[str]) -> dict[str, list[str]]:
    xlaunch = [sys.executable, "-m", "xlaunch"]
    return {
        "xlaunch-tune best": [*xlaunch, "--config", best, *script],
        "xlaunch default": [*xlaunch, *script],
        "run_cpu default": [sys.executable, "-m", "torch.backends.xeon.run_cpu", *script],
    }


def run_once(name: str, argv: list[str], timeout: float, grace: float = 10.0) -> float | None:
    """One launch in a session of its own; at ``timeout``, Ctrl-C or SIGTERM the launcher, every
    process under it (run_cpu's program is in a session of its own) and its group get SIGTERM, then
    SIGKILL after ``grace`` s (:func:`_processes.run_tree`)."""
    status, stdout, _ = processes.run_tree(argv, timeout, grace, cwd=REPO, stderr=subprocess.STDOUT)
    if status == "timeout":
        print(f"  {name}: timed out after {timeout:g}s")
        return None
    values = [float(v) for v in THROUGHPUT.findall(stdout)]
    if status != 0 or not values:
        tail = stdout.decode(errors="replace").strip().splitlines()[-3:]
        print(f"  {name}: exit {status}, {len(values)} result(s): {' | '.join(tail)}")
        return None
    return sum(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--best", required=True, help="best.toml written by xlaunch-tune --output-dir")
    parser.add_argument("--reps", type=COUNT, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--iterations", type=COUNT, default=20, help="infer.py --iterations (default 20)")
    parser.add_argument("--batch-size", type=COUNT, default=16, help="infer.py --batch-size (default 16)")
    parser.add_argument("--timeout", type=SECONDS, default=300.0, help="per run, seconds")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from xlaunch.userfiles import UserFileError, read_user_text

    try:
        print(read_user_text(args.best).strip())          # a regular file of at most 1 MiB
    except UserFileError as exc:
        parser.error(f"--best: {exc}")
    print(this_machine(), flush=True)
    script = [INFER, "--iterations", str(args.iterations), "--batch-size", str(args.batch_size)]
    runs = configs(str(Path(args.best).resolve()), script)
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    started = time.monotonic()
    for round_number in range(args.reps):
        order = names[round_number % len(names):] + names[:round_number % len(names)]
        for name in order:
            value = run_once(name, runs[name], args.timeout)
            if value is not None:
                samples[name].append(value)
        print(f"round {round_number + 1}/{args.reps} done after {time.monotonic() - started:.0f}s", flush=True)

    print(f"\nexamples/infer.py throughput, {args.reps} interleaved rounds, median [min .. max] img/s:")
    medians = {}
    for name in names:
        values = samples[name]
        if values:
            medians[name] = statistics.median(values)
            print(f"  {name:18s} {medians[name]:8.1f}  [{min(values):.1f} .. {max(values):.1f}]  n={len(values)}")
        else:
            print(f"  {name:18s}   failed")
    ours = medians.get("xlaunch-tune best")
    if ours is None:
        return 1
    print("\nratio of xlaunch-tune best to:")
    for name in names[1:]:
        if name in medians:
            print(f"  {name:18s} {ours / medians[name]:6.2f}x")
    return 0


if __name__ == "__main__":
    processes.exit_on_sigterm()
    processes.survive_closed_stdout()
    sys.exit(main())

"""DDP training steps/s of ``examples/train.py --ddp`` (gloo, 2 ranks), pinned by xlaunch vs plain torchrun.

    .venv/bin/python bench/distributed.py [--reps 3] [--steps 30] [--batch-size 64] [--only NAME]

Configurations (2 ranks x 1 core on a 2-CPU machine; more cores give more per rank):

* ``torchrun``: ``python -m torch.distributed.run --nproc-per-node 2`` (torchrun's own
  ``OMP_NUM_THREADS=1``, no pinning, the default allocator);
* ``xlaunch``: ``xlaunch --nproc-per-node 2`` (each rank pinned to its slice, its thread count,
  OpenMP places and allocator from the plan);
* ``torchrun+per-rank``: plain torchrun running ``--no-python python -m xlaunch --per-rank``.

A run's speed is the slowest rank's ``steps/s`` (DDP ranks step together); its wall time includes
start-up and rendezvous. Repetitions are interleaved; medians, ratios of the medians to torchrun
and the median of the per-round ratios are printed.
Everything stays on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``).
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "examples" / "train.py")
# ranks share the console and python -u writes a line's text and its newline apart: no anchors
STEPS = re.compile(r"ddp rank (\d+) world \d+ .*?steps/s ([0-9.]+) ")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command(name: str, train: list[str]) -> list[str]:
    port = str(free_port())
    rendezvous = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    torchrun = [sys.executable, "-m", "torch.distributed.run", *rendezvous]
    if name == "torchrun":
        return [*torchrun, *train]
    if name == "xlaunch":
        return [sys.executable, "-m", "xlaunch", *rendezvous, *train]
    if name == "torchrun+per-rank":
        return [*torchrun, "--no-python", sys.executable, "-m", "xlaunch", "--per-rank", *train]
    raise ValueError(name)


def run_once(name: str, train: list[str]) -> tuple[float, float]:
    """(steps/s of the slowest rank, wall seconds)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "KMP_", "MKL_", "XLAUNCH_")) and k not in ("LD_PRELOAD", "MALLOC_CONF")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["GLOO_SOCKET_IFNAME"] = "lo"
    start = time.monotonic()
    done = subprocess.run(command(name, train), env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    rates = {int(rank): float(rate) for rank, rate in STEPS.findall(done.stdout)}
    if done.returncode != 0 or sorted(rates) != [0, 1]:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-2000:]}")
    return min(rates.values()), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--only", action="append", choices=("torchrun", "xlaunch", "torchrun+per-rank"))
    args = parser.parse_args()
    names = args.only or ["torchrun", "xlaunch", "torchrun+per-rank"]
    train = [TRAIN, "--ddp", "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    print(f"{len(os.sched_getaffinity(0))} CPUs allowed; load average {os.getloadavg()[0]:.2f} at start "
          "(the machine may be shared)")
    for rep in range(args.reps):
        for name in names:           # interleaved: every configuration once per round
            rate, wall = run_once(name, train)
            results[name].append((rate, wall))
            print(f"  round {rep + 1} {name:18s} {rate:7.2f} steps/s  wall {wall:5.1f} s", flush=True)
    base = statistics.median(r for r, _ in results["torchrun"]) if "torchrun" in results else None
    print(f"\nmedians over {args.reps} interleaved rounds ({args.steps} steps, batch {args.batch_size}, 2 ranks):")
    for name, runs in results.items():
        rate = statistics.median(r for r, _ in runs)
        wall = statistics.median(w for _, w in runs)
        ratio = ""
        if base:   # per-round ratios cancel the load swings between rounds of a shared machine
            paired = statistics.median(r / t for (r, _), (t, _) in zip(runs, results["torchrun"]))
            ratio = f"  x{rate / base:.2f} vs torchrun (median of per-round ratios x{paired:.2f})"
        print(f"  {name:18s} {rate:7.2f} steps/s  wall {wall:5.1f} s{ratio}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

"""DDP training steps/s of ``examples/train.py --ddp`` (gloo), ranks under xlaunch vs torchrun,
with and without ``OMP_NUM_THREADS``, at every rank count this machine allows.

    .venv/bin/python bench/distributed.py [--quick] [--reps 3] [--steps 30] [--json out.json] [--plot out.png]

Configurations come from the machine (xlaunch's own model): with N usable physical cores, k ranks
of N/k cores for every k >= 2 of ``_machine_bench.shapes`` (the instance widths that divide the
cores of a NUMA node), each run as

* ``torchrun``: ``python -m torch.distributed.run --nproc-per-node k`` (torchrun's own
  ``OMP_NUM_THREADS=1``, no pinning, the default allocator);
* ``torchrun OMP=c``: the same with ``OMP_NUM_THREADS`` set to the cores per rank;
* ``xlaunch``: ``xlaunch --nproc-per-node k`` (each rank pinned to its slice, its thread count,
  OpenMP places and allocator from the plan);
* ``xlaunch OMP=c``: the same with the user's ``OMP_NUM_THREADS`` (xlaunch keeps it);
* ``torchrun+per-rank`` (only with ``--only torchrun+per-rank``): torchrun running
  ``--no-python python -m xlaunch --per-rank``.

A run's speed is the slowest rank's ``steps/s`` (DDP ranks step together, so every rank runs for
the whole measurement); samples/s is that times the batch and the ranks. Its wall time includes
start-up and rendezvous. Repetitions are interleaved; medians, ratios to torchrun of the same rank
count (of the medians, and the median of the per-round ratios) are printed.
Everything stays on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``).
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import _machine_bench as common  # noqa: E402
import _processes as processes  # noqa: E402
from _args import COUNT, SECONDS  # noqa: E402

REPO = BENCH.parent
TRAIN = str(REPO / "examples" / "train.py")
# ranks share the console and python -u writes a line's text and its newline apart: no anchors
STEPS = re.compile(r"ddp rank (\d+) world \d+ .*?steps/s ([0-9.]+) ")
LAUNCHERS = ("torchrun", "torchrun OMP", "xlaunch", "xlaunch OMP")
EXTRA = ("torchrun+per-rank",)


@dataclass
class Config:
    launcher: str          # one of LAUNCHERS or EXTRA
    ranks: int
    cores_per_rank: int
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def omp(self) -> Optional[int]:
        return self.cores_per_rank if self.launcher.endswith(" OMP") else None

    @property
    def name(self) -> str:
        base = self.launcher.replace(" OMP", f" OMP={self.cores_per_rank}")
        return f"{base} {self.ranks}x{self.cores_per_rank}"

    def command(self, train: list[str]) -> list[str]:
        port = str(free_port())
        rendezvous = ["--nproc-per-node", str(self.ranks), "--master-addr", "127.0.0.1", "--master-port", port]
        torchrun = [sys.executable, "-m", "torch.distributed.run", *rendezvous]
        if self.launcher.startswith("torchrun+per-rank"):
            return [*torchrun, "--no-python", sys.executable, "-m", "xlaunch", "--per-rank", *train]
        if self.launcher.startswith("torchrun"):
            return [*torchrun, *train]
        return [sys.executable, "-m", "xlaunch", *rendezvous, *train]


def configurations(per_node: list[int], launchers: tuple[str, ...] = LAUNCHERS) -> list[Config]:
    """Every launcher at k ranks x N/k cores, for the shapes with at least 2 instances."""
    return [Config(launcher, ranks, width)
            for ranks, width in common.shapes(per_node) if ranks >= 2
            for launcher in launchers]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_once(config: Config, train: list[str], timeout: float) -> dict[str, Any]:
    env = common.clean_environment(str(REPO))
    env["GLOO_SOCKET_IFNAME"] = "lo"
    if config.omp is not None:
        env["OMP_NUM_THREADS"] = str(config.omp)
    start = time.monotonic()
    # at the time limit, Ctrl-C or SIGTERM: the launcher and its ranks (torchrun's are in sessions
    # of their own) are stopped
    status, out, err = processes.run_tree(config.command(train), timeout, env=env, cwd=REPO)
    output = out.decode(errors="replace") + err.decode(errors="replace")[-2000:]
    wall = time.monotonic() - start
    rates = {int(rank): float(rate) for rank, rate in STEPS.findall(output)}
    record: dict[str, Any] = {"status": status, "wall_s": round(wall, 2), "per_rank": [rates[r] for r in sorted(rates)]}
    if status != 0 or sorted(rates) != list(range(config.ranks)):
        tail = " | ".join(output.strip().splitlines()[-3:])
        record.update(steps_per_s=None, error=f"exit {status}, {len(rates)} of {config.ranks} rank(s): {tail}")
    else:
        record["steps_per_s"] = min(rates.values())
    return record


def row_line(result: dict[str, Any]) -> str:
    """A result's line: its median and ratios to torchrun, ``-`` for what was not measured (a failed
    run, or no torchrun run to compare with: ``--only xlaunch``)."""
    def shown(value: Optional[float], prefix: str = "") -> str:
        return "-" if value is None else f"{prefix}{value:.2f}"

    return (f"  {result['name']:28s} {shown(result['steps_per_s']):>7s} steps/s  {shown(result['ratio_to_torchrun'], 'x')}"
            f"  (per round {shown(result['paired_ratio_to_torchrun'], 'x')})")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run: 2 rounds of 15 steps")
    parser.add_argument("--reps", type=COUNT, default=None, help="interleaved rounds (default 3; --quick 2)")
    parser.add_argument("--steps", type=COUNT, default=None, help="train.py --steps (default 30; --quick 15)")
    parser.add_argument("--batch-size", type=COUNT, default=64)
    parser.add_argument("--only", action="append", default=[],
                        help="run only configurations whose name contains this (repeatable); "
                             "'torchrun+per-rank' adds that launcher")
    parser.add_argument("--timeout", type=SECONDS, default=600.0, help="per run, seconds")
    parser.add_argument("--list", action="store_true",
                        help="print the configurations and their command lines, run nothing "
                             "(XLAUNCH_FSROOT=<recorded machine> shows another machine's)")
    parser.add_argument("--label", default=None, help="the machine's name in the output")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    parser.add_argument("--plot", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (2 if args.quick else 3)
    steps = args.steps if args.steps is not None else (15 if args.quick else 30)

    if not args.list:
        os.environ.pop("XLAUNCH_FSROOT", None)
    from xlaunch.machine import load_machine

    machine = load_machine()
    draw = common.plot_available(args.plot)
    per_node = common.node_cores(machine)
    description = common.describe_machine(machine, per_node, args.label)
    launchers = LAUNCHERS + tuple(e for e in EXTRA if any(e in word for word in args.only))
    configs = configurations(per_node, launchers)
    configs = common.only(configs, args.only, parser.error, "none: DDP needs at least 2 cores")
    print(common.machine_line(description))
    if not configs:
        print("no configuration: DDP needs at least 2 cores")
        return 1
    if args.list:
        for config in configs:
            omp = f"OMP_NUM_THREADS={config.omp} " if config.omp else ""
            print(f"  {config.name:28s} {omp}{' '.join(config.command(['examples/train.py', '--ddp']))}")
        return 0
    print(f"{len(configs)} configurations x {reps} interleaved rounds, {steps} steps: "
          + ", ".join(c.name for c in configs), flush=True)
    train = [TRAIN, "--ddp", "--steps", str(steps), "--batch-size", str(args.batch_size)]
    progress = common.Progress(len(configs) * reps)
    for round_number in range(reps):
        for config in configs:
            progress.starting(f"round {round_number + 1}/{reps} {config.name}")
            run = run_once(config, train, args.timeout)
            run["round"] = round_number
            config.runs.append(run)
            progress.finished(f"failed: {run['error']}" if run["steps_per_s"] is None
                              else f"{run['steps_per_s']:.2f} steps/s, wall {run['wall_s']:.1f} s")
    description["load_average_end"] = list(os.getloadavg())
    results = []
    for config in configs:
        rate = common.median(r["steps_per_s"] for r in config.runs if r["steps_per_s"] is not None)
        results.append({
            "launcher": config.launcher.split()[0], "omp_num_threads": config.omp, "ranks": config.ranks,
            "cores_per_rank": config.cores_per_rank, "name": config.name,
            "series": config.launcher.replace(" OMP", " OMP_NUM_THREADS=cores"),
            "steps_per_s": rate,
            "samples_per_s": None if rate is None else rate * args.batch_size * config.ranks,
            "runs": config.runs,
        })
    base = {r["ranks"]: r for r in results if r["series"] == "torchrun"}
    print(f"\nmedian steps/s of the slowest rank ({steps} steps, batch {args.batch_size}), ratio to torchrun "
          "of the same ranks (of the medians; median of per-round ratios):")
    for r in results:
        peer = base.get(r["ranks"])
        ratio = r["steps_per_s"] / peer["steps_per_s"] if peer and r["steps_per_s"] and peer["steps_per_s"] else None
        paired = common.paired_ratio([x["steps_per_s"] for x in r["runs"]], [x["steps_per_s"] for x in peer["runs"]]) if peer else None
        r["ratio_to_torchrun"], r["paired_ratio_to_torchrun"] = ratio, paired
        print(row_line(r))
    common.write_results(description, args.json_path,
                         {"steps": steps, "reps": reps, "batch_size": args.batch_size, "results": results})
    if draw:
        title = (f"examples/train.py --ddp b{args.batch_size}, slowest rank, median of {reps}\n"
                 f"{common.short_line(description)}")
        common.plot(args.plot, results, value="samples_per_s", ylabel="samples/s (all ranks)",
                    xlabel="ranks", title=title, x_of=lambda r: r["ranks"])
    return 0 if all(r["steps_per_s"] is not None for r in results) else 1


if __name__ == "__main__":
    processes.exit_on_sigterm()
    processes.survive_closed_stdout()
    sys.exit(main())

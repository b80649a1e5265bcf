"""Throughput of ``examples/infer.py`` under xlaunch, torch's ``run_cpu`` and plain python.

    .venv/bin/python bench/throughput.py [--reps 3] [--iterations 20] [--only xlaunch]

Configurations: plain ``python examples/infer.py``; ``run_cpu`` 1x2 and 2x1; ``xlaunch`` 1x2 and
2x1 (automatic allocator / OpenMP); and each xlaunch 2x1 instance alone on its core ("solo": the
instance's own argv and environment from ``xlaunch --dry-run --json``, under ``taskset``).
The throughput of a run is the sum of every ``throughput: X img/s`` line it prints (one per
instance). Repetitions are interleaved; medians and ratios are printed. Targets: xlaunch 2x1
>= every peer configuration and >= 0.95x the sum of the solo runs.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
XLAUNCH = str(VENV_BIN / "xlaunch")
INFER = str(REPO / "examples" / "infer.py")
THROUGHPUT = re.compile(rb"throughput: ([0-9.]+) img/s")
RUN_CPU = [sys.executable, "-m", "torch.backends.xeon.run_cpu"]


@dataclass(frozen=True)
class Config:
    name: str
    argv: list[str]
    instances: int                      # how many throughput lines a good run prints
    env: dict[str, str] | None = None   # None: inherit


def solo_configs(infer_args: list[str]) -> list[Config]:
    """Each instance of ``xlaunch 2x1``, alone, with exactly its planned argv and environment."""
    dry = subprocess.run([XLAUNCH, "--ninstances", "2", "--ncore_per_instance", "1", "--dry-run", "--json",
                          INFER, *infer_args], capture_output=True, cwd=REPO)
    if dry.returncode != 0:
        print(f"(no solo runs: xlaunch --dry-run --json failed: {dry.stderr.decode().strip()})")
        return []
    plan = json.loads(dry.stdout)
    configs = []
    for instance in plan["instances"]:
        cpus = ",".join(map(str, instance["cpus"]))
        argv = list(instance["argv"])
        if instance.get("bind", "native") == "native":
            argv = ["taskset", "-c", cpus, *argv]
        configs.append(Config(f"solo instance {instance['index']} (cpu {cpus})", argv, 1, instance["env"]))
    return configs


def all_configs(infer_args: list[str]) -> list[Config]:
    script = [INFER, *infer_args]
    return [
        Config("plain python", [sys.executable, INFER, *infer_args], 1),
        Config("run_cpu 1x2", [*RUN_CPU, "--ninstances", "1", "--ncores-per-instance", "2", *script], 1),
        Config("run_cpu 2x1", [*RUN_CPU, "--ninstances", "2", "--ncores-per-instance", "1", *script], 2),
        Config("xlaunch 1x2", [XLAUNCH, "--ninstances", "1", "--ncore_per_instance", "2", *script], 1),
        Config("xlaunch 2x1", [XLAUNCH, "--ninstances", "2", "--ncore_per_instance", "1", *script], 2),
        *solo_configs(infer_args),
    ]


def run_once(config: Config, timeout: float) -> float | None:
    """Total img/s of one run, or None when it failed or printed the wrong number of results."""
    try:
        done = subprocess.run(config.argv, cwd=REPO, env=config.env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  {config.name}: timed out after {timeout:g}s")
        return None
    values = [float(v) for v in THROUGHPUT.findall(done.stdout)]
    if done.returncode != 0 or len(values) != config.instances:
        tail = done.stdout.decode(errors="replace").strip().splitlines()[-3:]
        print(f"  {config.name}: exit {done.returncode}, {len(values)} result(s): {' | '.join(tail)}")
        return None
    return sum(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--iterations", type=int, default=20, help="infer.py --iterations (default 20)")
    parser.add_argument("--batch-size", type=int, default=16, help="infer.py --batch-size (default 16)")
    parser.add_argument("--only", action="append", default=[],
                        help="run only configurations whose name contains this (repeatable)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    args = parser.parse_args()

    infer_args = ["--iterations", str(args.iterations), "--batch-size", str(args.batch_size)]
    configs = all_configs(infer_args)
    if args.only:
        configs = [c for c in configs if any(word in c.name for word in args.only)]
    samples: dict[str, list[float]] = {c.name: [] for c in configs}
    started = time.monotonic()
    for round_number in range(args.reps):
        for config in configs:
            value = run_once(config, args.timeout)
            if value is not None:
                samples[config.name].append(value)
        print(f"round {round_number + 1}/{args.reps} done after {time.monotonic() - started:.0f}s", flush=True)

    medians = {name: statistics.median(v) for name, v in samples.items() if v}
    print(f"\nexamples/infer.py throughput, {args.reps} interleaved rounds, medians (img/s):")
    for name, values in samples.items():
        if values:
            spread = f"[{min(values):.1f} .. {max(values):.1f}]"
            print(f"  {name:28s} {medians[name]:9.1f}  {spread}  n={len(values)}")
        else:
            print(f"  {name:28s}    failed")

    ours = medians.get("xlaunch 2x1")
    if ours is None:
        print("xlaunch 2x1 has no result: no ratios")
        return 1
    print("\nratios of xlaunch 2x1 to:")
    for name, value in medians.items():
        if name != "xlaunch 2x1" and not name.startswith("solo"):
            print(f"  {name:28s} {ours / value:6.2f}x  {'ok' if ours >= value else 'BELOW'}")
    solos = [value for name, value in medians.items() if name.startswith("solo")]
    if solos:
        total = sum(solos)
        print(f"  {'sum of solo runs':28s} {ours / total:6.2f}x  "
              f"{'ok' if ours >= 0.95 * total else 'BELOW'} (target >= 0.95x; sum {total:.1f} img/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

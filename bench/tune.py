"""The configuration ``xlaunch-tune`` found, re-measured against the defaults of the launcher
and of ``torch.backends.xeon.run_cpu`` on ``examples/infer.py``.

    .venv/bin/python bench/tune.py --best tune-out/best.toml [--reps 5] [--seconds 4]

Three launches of ``examples/infer.py`` (same arguments), run in interleaved rounds (the order
rotates each round, so drift and neighbours hit each alike):

* ``xlaunch-tune best``  -- ``xlaunch --config BEST PROGRAM``
* ``xlaunch default``    -- ``xlaunch PROGRAM`` (no option)
* ``run_cpu default``    -- ``python -m torch.backends.xeon.run_cpu PROGRAM`` (no option)

A run's throughput is its aggregate over the shared window, as ``bench/throughput.py`` counts it:
the K instances of a launch (K from xlaunch's own plan, ``--dry-run --json``; 1 for run_cpu's default)
start together once all are warmed up (``infer.py --seconds S --barrier K --timeline-dir DIR``), and
only the work done while every instance ran counts (``throughput.shared_window``), not the sum of each
instance's own line. A run with an instance missing, or whose instances never ran together, failed.
A ``--best`` that xlaunch refuses stops the bench in one line before anything starts. Medians,
min..max and ratios are printed (``-`` for a launch that never measured).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _processes as processes  # noqa: E402
from _args import COUNT, SECONDS  # noqa: E402
from _machine_bench import this_machine  # noqa: E402
from throughput import shared_window  # noqa: E402

INFER = str(REPO / "examples" / "infer.py")
XLAUNCH = [sys.executable, "-m", "xlaunch"]


def configs(best: str, script: list[str]) -> dict[str, list[str]]:
    return {
        "xlaunch-tune best": [*XLAUNCH, "--config", best, *script],
        "xlaunch default": [*XLAUNCH, *script],
        "run_cpu default": [sys.executable, "-m", "torch.backends.xeon.run_cpu", *script],
    }


def planned_instances(options: list[str], timeout: float = 60.0) -> int:
    """How many instances ``xlaunch OPTIONS examples/infer.py`` starts, from its ``--dry-run --json``;
    ``ValueError(xlaunch's own message)`` when it refuses the options."""
    try:
        done = subprocess.run([*XLAUNCH, *options, "--dry-run", "--json", INFER], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ValueError(f"xlaunch --dry-run did not answer in {timeout:g}s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ValueError(lines[-1].removeprefix("xlaunch: error: "))
    try:
        return len(json.loads(done.stdout)["instances"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"xlaunch --dry-run --json printed no plan ({error})") from None


def read_timelines(folder: str) -> list[dict]:
    """The ``<pid>.json`` timelines ``infer.py --timeline-dir`` wrote (its ``ready-*`` files are not)."""
    timelines = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as handle:
                timelines.append(json.load(handle))
    return timelines


def run_once(name: str, argv: list[str], instances: int, timeout: float, grace: float = 10.0) -> Optional[float]:
    """One launch of ``argv`` (its program last, given ``--barrier INSTANCES --timeline-dir DIR``): its
    aggregate img/s over the shared window, or None (with one line why). It runs in a session of its own;
    at ``timeout``, Ctrl-C or SIGTERM the launcher, every process under it (run_cpu's program is in a
    session of its own) and its group get SIGTERM, then SIGKILL after ``grace`` s
    (:func:`_processes.run_tree`); the scratch folder is removed."""
    scratch = tempfile.mkdtemp(prefix="xlaunch-bench-tune-")
    try:
        status, stdout, _ = processes.run_tree([*argv, "--barrier", str(instances), "--timeline-dir", scratch],
                                               timeout, grace, cwd=REPO, stderr=subprocess.STDOUT)
        timelines = read_timelines(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if status == "timeout":
        print(f"  {name}: timed out after {timeout:g}s")
        return None
    if status != 0 or len(timelines) != instances:
        tail = stdout.decode(errors="replace").strip().splitlines()[-3:]
        print(f"  {name}: exit {status}, {len(timelines)} of {instances} instance(s) measured: {' | '.join(tail)}")
        return None
    aggregate = shared_window(timelines)["aggregate"]
    if aggregate is None:
        print(f"  {name}: its {instances} instances never ran at the same time")
    return aggregate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--best", required=True, help="best.toml written by xlaunch-tune --output-dir")
    parser.add_argument("--reps", type=COUNT, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--seconds", type=SECONDS, default=4.0, help="each run's measurement window (default 4)")
    parser.add_argument("--batch-size", type=COUNT, default=16, help="infer.py --batch-size (default 16)")
    parser.add_argument("--timeout", type=SECONDS, default=300.0, help="per run, seconds")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from xlaunch.userfiles import UserFileError, read_user_text

    try:
        text = read_user_text(args.best).strip()          # a regular file of at most 1 MiB
    except UserFileError as exc:
        parser.error(f"--best: {exc}")
    best = str(Path(args.best).resolve())
    try:     # the instances each launch starts (its barrier's count); a config xlaunch refuses stops here
        counts = {"xlaunch-tune best": planned_instances(["--config", best]), "xlaunch default": planned_instances([]),
                  "run_cpu default": 1}
    except ValueError as exc:
        parser.error(f"--best {args.best}: {exc}")
    print(text)
    print(this_machine(), flush=True)
    script = [INFER, "--batch-size", str(args.batch_size), "--warmup", "3", "--seconds", f"{args.seconds:g}"]
    runs = configs(best, script)
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    started = time.monotonic()
    for round_number in range(args.reps):
        order = names[round_number % len(names):] + names[:round_number % len(names)]
        for name in order:
            value = run_once(name, runs[name], counts[name], args.timeout)
            if value is not None:
                samples[name].append(value)
        print(f"round {round_number + 1}/{args.reps} done after {time.monotonic() - started:.0f}s", flush=True)

    print(f"\nexamples/infer.py aggregate throughput over the shared window ({args.seconds:g} s), "
          f"{args.reps} interleaved rounds, median [min .. max] img/s:")
    medians = {}
    for name in names:
        values = samples[name]
        shape = f"{counts[name]} instance{'s' if counts[name] > 1 else ''}"
        if values:
            medians[name] = statistics.median(values)
            print(f"  {name:18s} {medians[name]:8.1f}  [{min(values):.1f} .. {max(values):.1f}]  n={len(values)}, {shape}")
        else:
            print(f"  {name:18s}   failed  ({shape})")
    ours = medians.get("xlaunch-tune best")
    if ours is None:
        return 1
    print("\nratio of xlaunch-tune best to:")
    for name in names[1:]:
        print(f"  {name:18s} " + (f"{ours / medians[name]:6.2f}x" if name in medians else "     -  (it never measured)"))
    return 0


if __name__ == "__main__":
    processes.exit_on_sigterm()
    processes.survive_closed_stdout()
    sys.exit(main())

"""Aggregate throughput of ``examples/infer.py`` under xlaunch, torch's ``run_cpu`` and plain python,
in every shape this machine allows.

    .venv/bin/python bench/throughput.py [--quick] [--reps 3] [--seconds 6] [--json out.json] [--plot out.png]

Configurations come from the machine (xlaunch's own model, ``XLAUNCH_FSROOT`` ignored: the runs
are real): with N usable physical cores, plain ``python examples/infer.py``; xlaunch and
``python -m torch.backends.xeon.run_cpu`` at 1xN, at kx(N/k) for every instance width that
divides the cores of a NUMA node (so 1, 2, 4, 8 and 16 instances on a 16-core node), and at Nx1;
and both tools' ``--throughput-mode``.

Honest aggregates: every instance of a run measures over the same fixed window (``infer.py
--seconds S --barrier K``: the K instances start together once all are warmed up) and writes the
end time of each batch (``--timeline-dir``). The aggregate counts only the work
done while every instance ran: the window from the last instance's start to the first
instance's last batch, each batch counted in proportion to its part inside (``shared_window``).

Repetitions are interleaved (every configuration once per round); the medians, the ratios of
xlaunch to run_cpu of the same shape (of the medians, and the median of the per-round ratios)
and to plain python are printed. ``--json PATH`` writes every run; ``--plot PATH`` a PNG of the
aggregate by instance width, one line per launcher.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
INFER = str(REPO / "examples" / "infer.py")
XLAUNCH = [sys.executable, "-m", "xlaunch"]
RUN_CPU = [sys.executable, "-m", "torch.backends.xeon.run_cpu"]


@dataclass
class Config:
    launcher: str                 # xlaunch | run_cpu | plain
    instances: int
    cores_per_instance: int       # for plain python: every core (torch's own thread count)
    throughput_mode: bool = False
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        if self.launcher == "plain":
            return "plain python"
        shape = "--throughput-mode" if self.throughput_mode else f"{self.instances}x{self.cores_per_instance}"
        return f"{self.launcher} {shape}"

    @property
    def shape(self) -> tuple[int, int, bool]:
        return self.instances, self.cores_per_instance, self.throughput_mode

    def argv(self, program: list[str]) -> list[str]:
        if self.launcher == "plain":
            return [sys.executable, *program]
        tool = XLAUNCH if self.launcher == "xlaunch" else RUN_CPU
        if self.throughput_mode:
            return [*tool, "--throughput-mode", *program]
        per = "--ncore_per_instance" if self.launcher == "xlaunch" else "--ncores-per-instance"
        return [*tool, "--ninstances", str(self.instances), per, str(self.cores_per_instance), *program]


def configurations(per_node: list[int]) -> list[Config]:
    """plain python; xlaunch and run_cpu in every shape of :func:`common.shapes`; both tools'
    ``--throughput-mode`` (one instance per node with all its cores)."""
    total = sum(per_node)
    configs = [Config("plain", 1, total)]
    for instances, width in common.shapes(per_node):
        configs += [Config("xlaunch", instances, width), Config("run_cpu", instances, width)]
    node_width = per_node[0] if len(set(per_node)) == 1 else 0   # 0: nodes differ in size
    configs += [Config(tool, len(per_node), node_width, throughput_mode=True) for tool in ("xlaunch", "run_cpu")]
    return configs


def shared_window(timelines: list[dict[str, Any]]) -> dict[str, Any]:
    """The aggregate over the time every instance ran.

    Each timeline (``infer.py --timeline-dir``) holds ``begin`` (its first batch's start),
    ``ends`` (each batch's end; a batch starts where the previous one ended) and ``batch_size``.
    A run where any instance has no batch has no aggregate.
    The shared window runs from the latest ``begin`` to the earliest last batch end; a batch
    counts ``batch_size`` x the part of it inside the window. Returns ``aggregate`` (img/s, None
    when the instances never ran together), ``window`` ((start, end)), ``per_instance`` (img/s of
    each inside the window) and ``late`` (seconds the last instance began after the first).
    """
    usable = [t for t in timelines if t.get("ends")]
    if not usable or len(usable) < len(timelines):
        return {"aggregate": None, "window": None, "per_instance": [], "late": None}
    start = max(t["begin"] for t in usable)
    end = min(t["ends"][-1] for t in usable)
    late = start - min(t["begin"] for t in usable)
    if end <= start:
        return {"aggregate": None, "window": (start, end), "per_instance": [], "late": late}
    per_instance = []
    for t in usable:
        images = 0.0
        previous = t["begin"]
        for batch_end in t["ends"]:
            inside = min(batch_end, end) - max(previous, start)
            if inside > 0:
                images += t["batch_size"] * inside / (batch_end - previous)
            previous = batch_end
        per_instance.append(images / (end - start))
    return {"aggregate": sum(per_instance), "window": (start, end), "per_instance": per_instance, "late": late}


def own_rate(timeline: dict[str, Any]) -> float:
    """img/s of one instance over its own batches (what summing each instance's line counts)."""
    ends = timeline["ends"]
    if not ends:
        return 0.0
    return timeline["batch_size"] * len(ends) / max(ends[-1] - timeline["begin"], 1e-9)


def run_once(config: Config, infer_args: list[str], seconds: float, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """One run: launch, share a start time, read each instance's timeline. A dict for the JSON."""
    scratch = tempfile.mkdtemp(prefix="xlaunch-bench-")
    try:
        launched = time.time()
        program = [INFER, *infer_args, "--seconds", f"{seconds:g}", "--barrier", str(config.instances),
                   "--timeline-dir", scratch]
        # at the time limit, Ctrl-C or SIGTERM: the launcher and its instances (run_cpu's are in
        # sessions of their own) are stopped, and the scratch folder removed
        status, out, _ = processes.run_tree(config.argv(program), timeout, cwd=REPO, env=env,
                                            stderr=subprocess.STDOUT)
        output = out.decode(errors="replace")
        timelines = []
        for name in sorted(os.listdir(scratch)):
            if name.endswith(".json"):
                with open(os.path.join(scratch, name)) as handle:
                    timelines.append(json.load(handle))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.time() - launched
    record: dict[str, Any] = {"status": status, "wall_s": round(wall, 2), "instances_seen": len(timelines)}
    if timelines:
        record["ready_s"] = round(max(t["ready"] for t in timelines) - launched, 2)
    if status != 0 or len(timelines) != config.instances:
        tail = " | ".join(output.strip().splitlines()[-3:])
        record.update(aggregate=None, error=f"exit {status}, {len(timelines)} of {config.instances} instance(s): {tail}")
        return record
    window = shared_window(timelines)
    record.update(
        aggregate=None if window["aggregate"] is None else round(window["aggregate"], 2),
        window_s=None if window["window"] is None else round(window["window"][1] - window["window"][0], 3),
        # the last instance's start after the shared start (the window lost to start-up)
        late_s=round(max(0.0, max(t["begin"] for t in timelines) - timelines[0]["start_at"]), 3),
        per_instance=[round(v, 2) for v in window["per_instance"]],
        # what the instances' own lines add up to: each over its own window (not the aggregate)
        sum_of_own=round(sum(own_rate(t) for t in timelines), 2),
    )
    if window["aggregate"] is None:
        record["error"] = "the instances never ran at the same time"
    return record


def summarize(configs: list[Config]) -> list[dict[str, Any]]:
    results = []
    for config in configs:
        values = [run["aggregate"] for run in config.runs]
        results.append({
            "launcher": config.launcher, "instances": config.instances,
            "cores_per_instance": config.cores_per_instance, "throughput_mode": config.throughput_mode,
            "name": config.name, "series": config.launcher + (" --throughput-mode" if config.throughput_mode else ""),
            "aggregate": common.median(v for v in values if v is not None),
            "runs": config.runs,
        })
    return results


def print_table(results: list[dict[str, Any]]) -> None:
    by_shape = {(r["launcher"], r["instances"], r["cores_per_instance"], r["throughput_mode"]): r for r in results}
    plain = next((r for r in results if r["launcher"] == "plain"), None)
    print("\nmedian aggregate img/s (shared window), ratio xlaunch/run_cpu of the same shape "
          "(of the medians; median of per-round ratios):")
    print(f"  {'shape':18s} {'xlaunch':>9s} {'run_cpu':>9s} {'ratio':>7s} {'per-round':>9s} {'xlaunch/plain':>13s}")
    if plain:
        print(f"  {'plain python':18s} {fmt(plain['aggregate']):>9s}")
    for r in results:
        if r["launcher"] != "xlaunch":
            continue
        peer = by_shape.get(("run_cpu", r["instances"], r["cores_per_instance"], r["throughput_mode"]))
        ours, theirs = r["aggregate"], peer["aggregate"] if peer else None
        ratio = ours / theirs if ours and theirs else None
        paired = common.paired_ratio([x["aggregate"] for x in r["runs"]], [x["aggregate"] for x in peer["runs"]]) if peer else None
        vs_plain = ours / plain["aggregate"] if ours and plain and plain["aggregate"] else None
        shape = "--throughput-mode" if r["throughput_mode"] else f"{r['instances']}x{r['cores_per_instance']}"
        print(f"  {shape:18s} {fmt(ours):>9s} {fmt(theirs):>9s} {fmt(ratio, 'x'):>7s} {fmt(paired, 'x'):>9s} "
              f"{fmt(vs_plain, 'x'):>13s}")
        r["ratio_to_run_cpu"] = ratio
        r["paired_ratio_to_run_cpu"] = paired


def fmt(value: Optional[float], suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{suffix}" if suffix else f"{value:.1f}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run: 2 rounds of 2-second windows")
    parser.add_argument("--reps", type=COUNT, default=None, help="interleaved rounds (default 3; --quick 2)")
    parser.add_argument("--seconds", type=SECONDS, default=None, help="measurement window (default 6; --quick 2)")
    parser.add_argument("--batch-size", type=COUNT, default=16, help="infer.py --batch-size (default 16)")
    parser.add_argument("--only", action="append", default=[],
                        help="run only configurations whose name contains this (repeatable)")
    parser.add_argument("--timeout", type=SECONDS, default=300.0, help="per run, seconds")
    parser.add_argument("--list", action="store_true",
                        help="print the configurations and their command lines, run nothing "
                             "(XLAUNCH_FSROOT=<recorded machine> shows another machine's)")
    parser.add_argument("--label", default=None, help="the machine's name in the output (e.g. '16-core Xeon VM')")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="draw the aggregates as a PNG (matplotlib)")
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (2 if args.quick else 3)
    seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 6.0)

    if not args.list:
        os.environ.pop("XLAUNCH_FSROOT", None)      # the runs are real: plan for this machine
    from xlaunch.machine import load_machine

    machine = load_machine()
    draw = common.plot_available(args.plot)
    per_node = common.node_cores(machine)
    description = common.describe_machine(machine, per_node, args.label)
    configs = configurations(per_node)
    configs = common.only(configs, args.only, parser.error)
    print(common.machine_line(description))
    if args.list:
        for config in configs:
            print(f"  {config.name:28s} {' '.join(config.argv(['examples/infer.py']))}")
        return 0
    print(f"{len(configs)} configurations x {reps} interleaved rounds, {seconds:g} s windows: "
          + ", ".join(c.name for c in configs), flush=True)
    env = common.clean_environment(str(REPO))
    infer_args = ["--batch-size", str(args.batch_size), "--warmup", "3"]
    progress = common.Progress(len(configs) * reps)
    for round_number in range(reps):
        for config in configs:
            progress.starting(f"round {round_number + 1}/{reps} {config.name}")
            run = run_once(config, infer_args, seconds, args.timeout, env)
            run["round"] = round_number
            config.runs.append(run)
            if run["aggregate"] is None:
                progress.finished(f"failed: {run.get('error')}")
            else:
                progress.finished(f"{run['aggregate']:.1f} img/s over {run['window_s']:.2f} s "
                                  f"(late {run['late_s']:.2f} s; sum of own {run['sum_of_own']:.1f})")
    description["load_average_end"] = list(os.getloadavg())
    results = summarize(configs)
    print_table(results)
    common.write_results(description, args.json_path,
                         {"seconds": seconds, "reps": reps, "batch_size": args.batch_size, "results": results})
    if draw:
        title = (f"examples/infer.py b{args.batch_size}, aggregate over the shared window, median of {reps}\n"
                 f"{common.short_line(description)}")
        common.plot(args.plot, [r for r in results if r["launcher"] != "plain"], value="aggregate",
                    ylabel="aggregate img/s", xlabel="cores per instance", title=title,
                    x_of=lambda r: r["cores_per_instance"] or 1,
                    baseline=next((("plain python", r["aggregate"]) for r in results if r["launcher"] == "plain"), None))
    return 0 if all(r["aggregate"] is not None for r in results) else 1


if __name__ == "__main__":
    processes.exit_on_sigterm()
    processes.survive_closed_stdout()
    sys.exit(main())

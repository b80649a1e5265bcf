"""MultiStreamModule against the plain model and against separate processes, same allocator.

    .venv/bin/python bench/streams.py [--reps 5] [--seconds 2] [--batch 16] [--cpus A,B]

Variants (every process runs with the same allocator preloaded, jemalloc by default):
  plain        one process, the model with 2 torch threads, batch 16
  plain-pinned the same inside ``with CPUPool([0, 1])``
  streams      one process, ``MultiStreamModule`` 2 streams x 1 core, batch 16 (8 per stream)
  threads      one process, two pinned Python threads each calling the model on batch 8 in a
               loop (no MultiStreamModule machinery: isolates in-process effects such as the GIL)
  procs        two processes, ``taskset -c 0`` / ``-c 1``, ``OMP_NUM_THREADS=1``, batch 8 each,
               run at the same time; throughput is their sum
The two CPUs are the first CPU of each of the first two physical cores this process may use (the
planner's view), or ``--cpus``. Workers stay alive between repetitions; variants are interleaved (order rotated each round).
The machine may be shared, so each repetition also records how much CPU other processes used
meanwhile (/proc/stat minus the workers' own time); medians are given over all repetitions and
over the "clean" ones. The last lines are the ratios.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import _processes  # noqa: E402
from _args import COUNT, SECONDS, fraction  # noqa: E402

VARIANTS = ("plain", "plain-pinned", "streams", "threads", "procs")


# --------------------------------------------------------------------------- worker side


def _model_and_input(batch: int):
    import runpy

    import torch

    torch.manual_seed(0)
    model = runpy.run_path(str(REPO / "examples" / "infer.py"))["small_cnn"]().eval()
    return model, torch.randn(batch, 3, 64, 64)


def _timed(call, batch: int, seconds: float) -> float:
    """Images per second of ``call()`` repeated for about ``seconds``."""
    done = 0
    start = time.perf_counter()
    while True:
        call()
        done += batch
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return done / elapsed


def worker(mode: str, batch: int, cpus: list[int]) -> None:
    """Serve ``warm`` / ``run SECONDS`` commands on stdin, answer one number per line."""
    import torch

    from xlaunch.runtime_ext import CPUPool, MultiStreamModule, Task

    sys.path.insert(0, str(REPO))
    model, x = _model_and_input(batch)
    torch.set_grad_enabled(False)
    closables: list = []
    if mode == "plain":
        torch.set_num_threads(len(cpus))
        run = lambda seconds: _timed(lambda: model(x), batch, seconds)  # noqa: E731
    elif mode == "plain-pinned":
        pool = CPUPool(cpus)
        pool.__enter__()
        run = lambda seconds: _timed(lambda: model(x), batch, seconds)  # noqa: E731
    elif mode == "streams":
        msm = MultiStreamModule(model, num_streams=len(cpus), cpu_pool=CPUPool(cpus))
        closables.append(msm)
        run = lambda seconds: _timed(lambda: msm(x), batch, seconds)  # noqa: E731
    elif mode == "threads":
        slices = list(x.split((batch + len(cpus) - 1) // len(cpus)))
        tasks = [Task(lambda s, xs=xs: _timed(lambda: model(xs), xs.shape[0], s), CPUPool([c]))
                 for c, xs in zip(cpus, slices)]
        closables.extend(tasks)
        run = lambda seconds: sum(f.result() for f in [t(seconds) for t in tasks])  # noqa: E731
    elif mode == "single":
        torch.set_num_threads(1)
        run = lambda seconds: _timed(lambda: model(x), batch, seconds)  # noqa: E731
    else:
        raise SystemExit(f"unknown mode {mode}")
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "warm":
            run(0.5)
            print("ok", flush=True)
        elif command[0] == "run":
            print(f"{run(float(command[1])):.3f}", flush=True)
        elif command[0] == "quit":
            break
    for closable in closables:
        closable.close()


# --------------------------------------------------------------------------- driver side


class Worker:
    def __init__(self, mode: str, batch: int, cpus: list[int], env: dict[str, str], prefix: list[str]) -> None:
        argv = [*prefix, sys.executable, __file__, "--worker", mode, "--batch", str(batch),
                "--cpus", ",".join(map(str, cpus))]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=REPO)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args} died (status {self.proc.wait()})")
        return line.strip()

    def close(self) -> None:
        try:
            self.send("quit")
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """End the worker now, mid-window or warming up (an interrupted bench): SIGTERM, SIGKILL 2 s later."""
        if self.proc.returncode is None:
            _processes.stop_tree(self.proc, grace=2.0)
            self.proc.wait()


@contextlib.contextmanager
def workers_closed() -> Iterator[dict[str, list[Worker]]]:
    """The workers a run starts (variant -> its processes): asked to quit when the run ends; stopped at once
    when it is interrupted (Ctrl-C, the bench's SIGTERM, an error), wherever they are."""
    workers: dict[str, list[Worker]] = {}
    try:
        yield workers
    except BaseException:
        for group in workers.values():
            for w in group:
                w.stop()
        raise
    for group in workers.values():
        for w in group:
            w.close()


def find_allocator(kind: str) -> str:
    names = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}
    hits = sorted(glob.glob(f"/usr/lib/*/{names[kind]}")) + sorted(glob.glob(f"/usr/lib/{names[kind]}"))
    if not hits:
        raise SystemExit(f"{names[kind]} not found; install it (scripts/setup.sh) or pass --allocator none")
    return hits[0]


def two_cores() -> tuple[list[int], str]:
    """The first CPU of each of the first two physical cores this process may use, as the planner
    counts them (allowed, online, one CPU per core); and the machine line to print."""
    import _machine_bench as common
    from xlaunch.launcher.plan.options import Options
    from xlaunch.launcher.plan.planner import plan
    from xlaunch.machine import load_machine

    os.environ.pop("XLAUNCH_FSROOT", None)          # the runs are real: this machine's CPUs
    machine = load_machine()
    per_core = plan(Options(program="bench.py", python="python", ncores_per_instance=1), machine, {})
    cpus = [cpu for instance in per_core.instances for cpu in instance.cpus][:2]
    line = common.machine_line(common.describe_machine(machine, common.node_cores(machine)))
    return cpus, line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=COUNT, default=5)
    parser.add_argument("--seconds", type=SECONDS, default=2.0)
    parser.add_argument("--batch", type=COUNT, default=16)
    parser.add_argument("--cpus", default=None,
                        help="the two CPUs to use, A,B (default: the first CPU of each of two physical cores)")
    parser.add_argument("--allocator", choices=("jemalloc", "tcmalloc", "none"), default="jemalloc")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--clean", type=fraction, default=0.05, help="max foreign CPU share of a clean rep")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.batch, [int(c) for c in args.cpus.split(",")])
        return
    _processes.exit_on_sigterm()        # unwinds: the workers are stopped (workers_closed)
    _processes.survive_closed_stdout()
    derived, machine_line = two_cores()
    if args.cpus is None:
        if len(derived) < 2:
            print(f"streams.py: two physical cores are needed, this process may use {len(derived)}; nothing run")
            return
        cpus = derived
    else:
        try:
            cpus = [int(c) for c in args.cpus.split(",")]
        except ValueError:
            parser.error(f"--cpus: expected two CPU numbers A,B, not {args.cpus!r}")
        allowed = os.sched_getaffinity(0)
        if len(cpus) != 2 or len(set(cpus)) != 2 or not set(cpus) <= allowed:
            parser.error(f"--cpus: expected two different CPUs this process may use "
                         f"({','.join(map(str, sorted(allowed)))}), not {args.cpus!r}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants: unknown {', '.join(map(repr, unknown)) or 'none given'} (known: {', '.join(VARIANTS)})")
    if args.batch < len(cpus):
        parser.error(f"--batch: at least one image per CPU ({len(cpus)}), not {args.batch}")
    args.cpus = ",".join(map(str, cpus))
    print(machine_line, flush=True)

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LD_PRELOAD")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if args.allocator != "none":
        env["LD_PRELOAD"] = find_allocator(args.allocator)
    single_env = {**env, "OMP_NUM_THREADS": "1"}
    per_core = args.batch // len(cpus)
    results: dict[str, list[float]] = {v: [] for v in variants}
    foreign: dict[str, list[float]] = {v: [] for v in variants}   # other processes' CPU share per rep
    with workers_closed() as workers:
        for variant in variants:
            if variant == "procs":
                workers[variant] = [Worker("single", per_core, [c], single_env, ["taskset", "-c", str(c)]) for c in cpus]
            else:
                workers[variant] = [Worker(variant, args.batch, cpus, env, [])]
        for group in workers.values():  # one at a time: warm-up must not overlap other variants
            for w in group:
                w.send("warm")
            for w in group:
                w.answer()
        for rep in range(args.reps):
            print(f"  rep {rep + 1}/{args.reps} ...", end="", flush=True)
            order = variants[rep % len(variants):] + variants[: rep % len(variants)]
            for variant in order:
                group = workers[variant]
                busy_before, ours_before = system_busy_ticks(), sum(process_ticks(w.proc.pid) for w in group)
                for w in group:
                    w.send(f"run {args.seconds}")
                rate = sum(float(w.answer()) for w in group)
                others = (system_busy_ticks() - busy_before) - (sum(process_ticks(w.proc.pid) for w in group) - ours_before)
                share = others / (CLOCK_TICKS * args.seconds * len(cpus))
                results[variant].append(rate)
                foreign[variant].append(share)
                print(f" {variant} {rate:.1f}", end="", flush=True)
            print(" img/s", flush=True)

    print(f"small_cnn 64x64, batch {args.batch}, CPUs {args.cpus}, allocator {args.allocator}, "
          f"{args.reps} interleaved reps x {args.seconds:g} s")
    print(f"'clean' reps: other processes used < {args.clean:.0%} of the CPUs meanwhile (the machine is shared)")
    print("\n".join(summary(variants, results, foreign, args.clean)))


def summary(variants: list[str], results: dict[str, list[float]], foreign: dict[str, list[float]],
            limit: float) -> list[str]:
    """Per variant its medians (all reps, the clean ones: others used < ``limit`` of the CPUs) and best, then
    the ratios; ``-`` where no rep was clean (there is no figure to give)."""
    def clean_of(variant: str) -> Optional[float]:
        clean = [r for r, f in zip(results[variant], foreign[variant]) if f < limit]
        return statistics.median(clean) if clean else None

    lines, clean = [], {variant: clean_of(variant) for variant in variants}
    for variant in variants:
        rates, shares = results[variant], foreign[variant]
        kept = sum(f < limit for f in shares)
        shown = "-" if clean[variant] is None else f"{clean[variant]:.1f}"
        lines.append(f"  {variant:13s} median {statistics.median(rates):7.1f} img/s   clean median {shown:>7s} "
                     f"({kept}/{len(rates)} reps)   best {max(rates):7.1f}   "
                     f"others' CPU share median {statistics.median(shares):.0%}")
    for a, b in (("streams", "procs"), ("streams", "plain"), ("threads", "procs"), ("procs", "plain"),
                 ("plain-pinned", "plain")):
        if a in results and b in results:
            both = clean[a] is not None and clean[b] is not None
            lines.append(f"ratio {a}/{b}: median {statistics.median(results[a]) / statistics.median(results[b]):.3f}"
                         f"   clean {f'{clean[a] / clean[b]:.3f}' if both else '-'}"
                         f"   best {max(results[a]) / max(results[b]):.3f}")
    return lines

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def system_busy_ticks() -> int:
    """All CPUs' non-idle time so far (/proc/stat), in clock ticks."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle


def process_ticks(pid: int) -> int:
    """utime + stime of a process, all its threads (/proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])

if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()

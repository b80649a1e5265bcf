"""Launch overhead: ``xlaunch --no-python true`` vs ``python -c pass`` vs torch's ``run_cpu``.

    .venv/bin/python bench/launch.py [--reps 10] [--wheel] [--skip-run-cpu]

Repetitions are interleaved (one of each command per round) so drifting machine load hits all
commands alike; medians are reported with the ratio to ``python -c pass`` of the same venv.
Target: xlaunch <= 3x ``python -c pass``. Not a test: numbers depend on the machine and its load.

The venv this runs in usually holds xlaunch as an editable install, whose import finder makes
every ``python`` start slower (~15 ms in ``site``) and so flatters the ratio. ``--wheel`` also
measures a wheel built from this tree, installed into a throwaway venv (its dependencies are
found through this venv's site-packages, after the wheel), where ``python -c pass`` is bare.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import COUNT  # noqa: E402
from _machine_bench import this_machine  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TARGET_RATIO = 3.0
BASE, XLAUNCH, RUN_CPU = "python -c pass", "xlaunch --no-python true", "run_cpu --no-python true"


def commands(bin_dir: Path, with_run_cpu: bool) -> dict[str, list[str]]:
    python = str(bin_dir / "python")
    todo = {BASE: [python, "-c", "pass"], XLAUNCH: [str(bin_dir / "xlaunch"), "--no-python", "true"]}
    if with_run_cpu:
        todo[RUN_CPU] = [python, "-m", "torch.backends.xeon.run_cpu", "--no-python", "true"]
    return todo


def wheel_venv(where: Path) -> Path:
    """A venv holding a wheel of this tree (bytecode compiled, as pip does); returns its bin/."""
    quiet = {"check": True, "stdout": subprocess.DEVNULL}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(where / "dist"), str(REPO)], **quiet)
    subprocess.run([sys.executable, "-m", "venv", str(where / "venv")], **quiet)
    bin_dir = where / "venv" / "bin"
    wheel = next((where / "dist").glob("xlaunch-*.whl"))
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   **quiet)
    site = subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # click, psutil...: from this venv, after the wheel; a .pth line adds a path, not its .pth files
    Path(site, "zz-bench-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return bin_dir


def time_once(argv: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    status = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - start, status


def measure(todo: dict[str, list[str]], reps: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    samples: dict[str, list[float]] = {name: [] for name in todo}
    failures: dict[str, int] = {}
    print(f"  {reps} interleaved rounds after an untimed one (warms the page cache):", end="", flush=True)
    for round_ in range(reps + 1):          # round 0 warms the page cache, untimed
        print(f" {round_}", end="", flush=True)
        for name, argv in todo.items():
            elapsed, status = time_once(argv)
            if status != 0:
                failures[name] = status
            if round_:
                samples[name].append(elapsed)
    print(flush=True)
    return samples, failures


def report(title: str, samples: dict[str, list[float]], failures: dict[str, int]) -> bool:
    print(title)
    base = statistics.median(samples[BASE])
    for name, values in samples.items():
        median = statistics.median(values)
        if name in failures:         # the time to fail is no launch time: no ratio is drawn from it
            print(f"  {name:28s} failed (exit status {failures[name]}): not timed")
            continue
        print(f"  {name:28s} {median * 1000:8.1f} ms  {median / base:6.2f}x python -c pass"
              f"  [min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f} ms]")
    ratio = statistics.median(samples[XLAUNCH]) / base
    if XLAUNCH in failures or BASE in failures:
        print(f"  xlaunch MISSES the target: {'xlaunch' if XLAUNCH in failures else BASE} failed")
    else:
        print(f"  xlaunch {'meets' if ratio <= TARGET_RATIO else 'MISSES'} the target: {ratio:.2f}x <= "
              f"{TARGET_RATIO:g}x python -c pass")
    if RUN_CPU in samples:
        mine = "-" if {RUN_CPU, XLAUNCH} & set(failures) else f"{statistics.median(samples[RUN_CPU]) / (ratio * base):.1f}x"
        print(f"  run_cpu / xlaunch: {mine}")
    return not failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=COUNT, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--skip-run-cpu", action="store_true", help="leave out torch's run_cpu (slow)")
    parser.add_argument("--wheel", action="store_true",
                        help="also measure a wheel of this tree in a throwaway venv (no editable finder)")
    args = parser.parse_args()

    # A pip install writes bytecode; an editable install under PYTHONDONTWRITEBYTECODE never
    # does, and compiling xlaunch on every start would be timed instead of starting it.
    import compileall

    compileall.compile_dir(str(REPO / "xlaunch"), quiet=1)
    print(this_machine(), flush=True)
    venvs = {f"this venv ({sys.prefix})": commands(Path(sys.executable).parent, not args.skip_run_cpu)}
    with tempfile.TemporaryDirectory(prefix="xlaunch-bench-") as scratch:
        if args.wheel:
            venvs["a wheel of this tree in a fresh venv"] = commands(wheel_venv(Path(scratch)), False)
        # one combined set of interleaved rounds, so both venvs see the same machine load
        todo = {f"{venv}\0{name}": argv for venv, cmds in venvs.items() for name, argv in cmds.items()}
        samples, failures = measure(todo, args.reps)
    print(f"launch overhead, {args.reps} interleaved rounds, medians:")
    ok = True
    for venv in venvs:
        mine = {key.split("\0")[1]: values for key, values in samples.items() if key.startswith(venv + "\0")}
        failed = {key.split("\0")[1]: status for key, status in failures.items() if key.startswith(venv + "\0")}
        ok = report(f"{venv}:", mine, failed) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

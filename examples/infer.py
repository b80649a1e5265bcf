"""The embedded default workload: a small CNN, batch inference, throughput printed at the end.

    python examples/infer.py [--batch-size 16] [--iterations 30] [--warmup 5]
    python examples/infer.py --seconds 5 [--start-at EPOCH] [--timeline-dir DIR]

Under ``xlaunch`` each instance prints its index and CPUs, so a multi-instance run can be read
line by line. The last line is machine-readable: ``throughput: <float> img/s``.

A fixed window instead of a fixed count (what ``bench/throughput.py`` uses to count an aggregate
honestly): ``--seconds S`` runs batches from a start time until S seconds later; the batch running
at the end finishes and is counted in proportion. The start is ``--start-at EPOCH`` (a
``time.time()`` value given to every instance), or with ``--barrier K`` the moment the K-th
instance is ready (each writes ``DIR/ready-<pid>`` with its ready time and waits for K of them;
all start 0.2 s after the last), or else as soon as warm-up ends. ``--timeline-dir DIR`` writes
``DIR/<pid>.json``: when the instance was ready, its window, and the end time of every batch, so
the aggregate can count only the work done while every instance ran (``bench/throughput.py``,
``shared_window``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import stat
import sys
import tempfile
import time


def _quiet_interrupt(kind: type, value: BaseException, tb: object) -> None:
    """Ctrl-C (also while torch imports, or made another error by a library it interrupted) ends the run
    without a traceback."""
    cause: object = value
    for _ in range(16):
        if cause is None or isinstance(cause, KeyboardInterrupt):
            break
        cause = cause.__cause__ or cause.__context__   # type: ignore[attr-defined]
    if not isinstance(cause, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)   # type: ignore[arg-type]


if __name__ == "__main__":   # as a program (not when a test imports it)
    sys.excepthook = _quiet_interrupt

import torch  # noqa: E402  (after the Ctrl-C hook)
from torch import nn  # noqa: E402


def small_cnn(num_classes: int = 10) -> nn.Module:
    """A ResNet-ish stem and three conv/BN/ReLU stages, about 0.6 GFLOP per 64x64 image batch of 1."""

    def block(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        block(32, 64, 2),
        block(64, 128, 2),
        block(128, 256, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(256, num_classes),
    )


def number(kind: type, least: float, above: bool = False):
    """An argparse type: a finite ``kind`` >= ``least`` (> with ``above``); anything else is one line, exit 2."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (value > least if above else value >= least) or not math.isfinite(value):
            bound = f"{'>' if above else '>='} {least:g}"
            what = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, not {text!r}")
        return value
    return check


def directory(text: str) -> str:
    """An argparse type: an existing directory this process may write in (checked before the run)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


def publish(folder: str, name: str, text: str) -> None:
    """``folder/name`` written whole: a private temporary file (``mkstemp``: a new name, never a link planted
    at a predictable one) renamed over it."""
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(temporary, os.path.join(folder, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def read_time(path: str) -> float | None:
    """The ready time in another instance's ``ready-<pid>`` file; None for anything else there (not a regular
    file, a link, longer than a number, not a number)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 64) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=number(int, 1), default=16)
    parser.add_argument("--iterations", type=number(int, 1), default=30)
    parser.add_argument("--warmup", type=number(int, 0), default=5)
    parser.add_argument("--image-size", type=number(int, 1), default=64)
    parser.add_argument("--seconds", type=number(float, 0, above=True), default=None,
                        help="measure for this many seconds (a fixed window) instead of --iterations")
    parser.add_argument("--start-at", type=number(float, 0), default=None, metavar="EPOCH",
                        help="with --seconds: start the window at this time.time() (after warm-up)")
    parser.add_argument("--timeline-dir", type=directory, default=None, metavar="DIR",
                        help="with --seconds: write DIR/<pid>.json (ready time, window, each batch's end)")
    parser.add_argument("--barrier", type=number(int, 1), default=None, metavar="K",
                        help="with --timeline-dir: start when K instances are ready (instead of --start-at)")
    args = parser.parse_args()
    if (args.start_at is not None or args.timeline_dir is not None) and args.seconds is None:
        parser.error("--start-at and --timeline-dir need --seconds")
    if args.barrier is not None and (args.timeline_dir is None or args.start_at is not None):
        parser.error("--barrier needs --timeline-dir, and replaces --start-at")

    torch.manual_seed(0)
    model = small_cnn().eval()
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    index = os.environ.get("XLAUNCH_INSTANCE_INDEX", "-")
    cpus = os.environ.get("XLAUNCH_CPUS") or ",".join(map(str, sorted(os.sched_getaffinity(0))))
    print(f"instance {index}: cpus {cpus}, torch threads {torch.get_num_threads()}", flush=True)

    with torch.no_grad():
        for _ in range(args.warmup):
            model(x)
        if args.seconds is not None:
            start_at = args.start_at
            if args.barrier is not None:
                start_at = barrier(args.timeline_dir, args.barrier)
            images = fixed_window(model, x, args.seconds, start_at, args.timeline_dir, index, cpus)
            print(f"throughput: {images:.1f} img/s", flush=True)
            return
        start = time.perf_counter()
        for _ in range(args.iterations):
            model(x)
        elapsed = time.perf_counter() - start
    print(f"throughput: {args.batch_size * args.iterations / elapsed:.1f} img/s", flush=True)


def barrier(directory: str, count: int, timeout: float = 600.0) -> float:
    """Announce this instance ready, wait for ``count`` ready instances; the shared start time
    (0.2 s after the last one was ready; the same in every instance: it is read from the files)."""
    publish(directory, f"ready-{os.getpid()}", repr(time.time()))
    deadline = time.monotonic() + timeout
    while True:
        names = [n for n in os.listdir(directory) if n.startswith("ready-") and not n.endswith(".tmp")]
        times = [t for t in (read_time(os.path.join(directory, name)) for name in names) if t is not None]
        if len(times) >= count or time.monotonic() > deadline:
            return max(times) + 0.2
        time.sleep(0.01)


def fixed_window(model: nn.Module, x: torch.Tensor, seconds: float, start_at: float | None,
                 timeline_dir: str | None, index: str, cpus: str) -> float:
    """Run batches from ``start_at`` (or now, if later) until ``seconds`` after it; img/s of the
    window, the last batch counted in proportion to its part inside the window."""
    ready = time.time()
    if start_at is not None and start_at > ready:
        time.sleep(start_at - ready)
    begin = time.time()
    # the window's end is fixed from the shared start: a late instance gets a shorter window
    end = (start_at if start_at is not None else begin) + seconds
    ends: list[float] = []
    last = begin
    while last < end:
        model(x)
        last = time.time()
        ends.append(last)
    if ends:   # batches inside [begin, end]: the last one in proportion
        previous = ends[-2] if len(ends) > 1 else begin
        whole = len(ends) - 1 + (end - previous) / max(last - previous, 1e-9)
    else:      # warm-up ended after the window: nothing measured
        whole = 0.0
    if timeline_dir is not None:
        record = {"pid": os.getpid(), "instance": index, "cpus": cpus, "batch_size": x.shape[0],
                  "ready": ready, "start_at": start_at, "begin": begin, "end": end, "ends": ends}
        publish(timeline_dir, f"{os.getpid()}.json", json.dumps(record))
    return x.shape[0] * whole / max(end - begin, 1e-9)


if __name__ == "__main__":
    try:
        main()
        sys.stdout.flush()        # inside the try: a closed pipe found at exit is the same case
    except BrokenPipeError:   # stdout closed early (`| head`): stop quietly, as a Unix tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nothing left to flush at exit
        sys.exit(1)
    except (MemoryError, RuntimeError) as error:   # sizes this machine cannot hold: one line, not torch's traceback
        if not isinstance(error, MemoryError) and "can't allocate memory" not in str(error):
            raise
        told = str(error).split("DefaultCPUAllocator: ")[-1].split(". Error code")[0]
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: --batch-size/--image-size: more memory than this process can "
                         f"allocate ({told or 'MemoryError'})\n")
        sys.exit(2)

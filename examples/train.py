"""A small training workload: an MLP on random data, step time printed at the end.

    python examples/train.py [--steps 50] [--batch-size 64] [--optimizer sgd|adamw] [--ddp]

Run it under ``xlaunch --auto-optimize`` to get the fused optimizers without editing it.
With ``--ddp`` it trains with DistributedDataParallel over gloo, one rank per process, from the
variables torchrun sets (``xlaunch --nproc-per-node 2 examples/train.py --ddp``); each rank reports
where it ran and a checksum of its weights (equal on every rank when gradients were averaged).
"""
from __future__ import annotations

import argparse
import os
import sys
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


def _allowed_cpus() -> str:
    """This process's CPUs as the kernel reports them (/proc/self/status), e.g. ``0-3``. Read before
    torch is imported: GNU OpenMP with ``OMP_PROC_BIND`` then binds the main thread to its first place."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Cpus_allowed_list:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


PROCESS_CPUS = _allowed_cpus()

import torch  # noqa: E402  (after PROCESS_CPUS)
from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


DDP_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (anything else is one line and exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, not {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=50)
    parser.add_argument("--batch-size", type=positive, default=64)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel over gloo (under torchrun)")
    args = parser.parse_args()
    missing = [name for name in DDP_VARIABLES if not os.environ.get(name)]
    if args.ddp and missing:
        parser.error(f"--ddp needs torchrun's {', '.join(missing)} in the environment: run it under "
                     "xlaunch --nproc-per-node N (or torchrun)")

    torch.manual_seed(0)
    model = mlp().train()
    rank = 0
    if args.ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = nn.parallel.DistributedDataParallel(model)
        torch.manual_seed(1 + rank)   # each rank its own batch: only averaged gradients agree
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch_size, 1024)
    y = torch.randint(0, 10, (args.batch_size,))
    loss_fn = nn.CrossEntropyLoss()

    start = None
    for step in range(args.steps + 5):
        if step == 5:
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    assert start is not None
    elapsed = time.perf_counter() - start
    say(f"optimizer: {type(optimizer).__name__}, final loss {loss.item():.4f}")
    say(f"step time: {1000 * elapsed / args.steps:.2f} ms")
    if args.ddp:
        import torch.distributed as dist

        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        say(f"ddp rank {rank} world {dist.get_world_size()} local_rank {os.environ.get('LOCAL_RANK')} "
            f"cpus {PROCESS_CPUS} threads {torch.get_num_threads()} "
            f"steps/s {args.steps / elapsed:.2f} checksum {checksum:.6f}")
        dist.destroy_process_group()


def say(line: str) -> None:
    """One line in one write: DDP ranks share torchrun's stdout, and print() under
    PYTHONUNBUFFERED writes the text and its newline separately (lines of two ranks could merge)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


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
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: --batch-size: more memory than this process can "
                         f"allocate ({told or 'MemoryError'})\n")
        sys.exit(2)

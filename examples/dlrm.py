"""A DLRM-like recommendation model trained and served with xlaunch.nn's operators.

    python examples/dlrm.py [--steps 30] [--batch-size 256] [--optimizer sgd|adagrad] [--bf16]
    xlaunch --ninstances 1 --ncore_per_instance 2 examples/dlrm.py
    xlaunch --auto-optimize examples/dlrm.py
    python examples/dlrm.py --bench-sizes      # 26 tables of 1,000-100,000 rows (589k), dim 64,
                                               # bags of 20, batch 2048: bench/ops.py's sizes

Bottom MLP over 13 dense features, 26 embedding tables in one ``MergedEmbeddingBagWithSGD`` (or
``...WithAdaGrad``: the tables are updated inside backward, the MLPs by a torch optimizer), the
pairwise ``interaction`` of the 27 features, top MLP to a click logit. The data are a few random
batches whose labels depend on the dense features and on one table, repeated, so the loss falls.
Prints the loss and the step time, then the inference time per batch (eval, no_grad).
"""
from __future__ import annotations

import argparse
import math
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

import torch  # noqa: E402  (after the Ctrl-C hook)
from torch import nn  # noqa: E402

from xlaunch.nn import (EmbeddingSpec, MergedEmbeddingBagWithAdaGrad, MergedEmbeddingBagWithSGD,  # noqa: E402
                        interaction)

DENSE_FEATURES = 13
FLOAT32_MAX = 3.4028234663852886e38


def table_rows(tables: int, smallest: int, largest: int) -> list[int]:
    """Table sizes growing geometrically from ``smallest`` to ``largest`` rows."""
    if tables == 1:
        return [smallest]
    return [round(smallest * (largest / smallest) ** (t / (tables - 1))) for t in range(tables)]


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for number, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or number < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, rows: list[int], dim: int, optimizer: str, lr: float) -> None:
        super().__init__()
        self.bottom = mlp([DENSE_FEATURES, 128, dim])
        specs = [EmbeddingSpec(r, dim, "mean") for r in rows]
        if optimizer == "adagrad":
            self.embeddings = MergedEmbeddingBagWithAdaGrad(specs, lr=lr)
        else:
            self.embeddings = MergedEmbeddingBagWithSGD(specs, lr=lr)
        with torch.no_grad():
            self.embeddings.weight.uniform_(-0.05, 0.05)
        features = len(rows) + 1
        self.top = mlp([dim + features * (features - 1) // 2, 128, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, indices: list, offsets: list) -> torch.Tensor:
        pooled = self.embeddings(indices, offsets)
        bottom = self.bottom(dense)
        return self.top(interaction(bottom, *[p.to(bottom.dtype) for p in pooled])).squeeze(1)


def make_batches(rows: list[int], batch: int, bag: int, count: int, seed: int = 0) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        dense = torch.randn(batch, DENSE_FEATURES, generator=gen)
        indices = [torch.randint(0, r, (batch * bag,), generator=gen) for r in rows]
        offsets = [torch.arange(0, batch * bag, bag) for _ in rows]
        signal = dense[:, 0] + dense[:, 1] + (indices[0].view(batch, bag) % 2).float().mean(1) - 0.5
        batches.append((dense, indices, offsets, (signal > 0).float()))
    return batches


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (anything else is one line and exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def learning_rate(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= FLOAT32_MAX:      # the optimizers multiply float32 gradients by it
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (at most {FLOAT32_MAX:.4g}), not {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=30)
    parser.add_argument("--infer-steps", type=positive, default=10)
    parser.add_argument("--batch-size", type=positive, default=256)
    parser.add_argument("--tables", type=positive, default=26)
    parser.add_argument("--rows", type=positive, nargs=2, default=(100, 2000), metavar=("SMALLEST", "LARGEST"))
    parser.add_argument("--dim", type=positive, default=16)
    parser.add_argument("--bag", type=positive, default=5, help="lookups per bag (mean pooling)")
    parser.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd")
    parser.add_argument("--lr", type=learning_rate, default=0.5)
    parser.add_argument("--bf16", action="store_true", help="bf16 tables with split fp32 master weights")
    parser.add_argument("--bench-sizes", action="store_true", help="26 tables of 1,000-100,000 rows, dim 64, "
                                                                   "bags of 20, batch 2048")
    args = parser.parse_args()
    if args.rows[0] > args.rows[1]:
        parser.error(f"argument --rows: SMALLEST ({args.rows[0]}) is larger than LARGEST ({args.rows[1]})")
    if args.bench_sizes:
        args.tables, args.rows, args.dim, args.bag, args.batch_size = 26, (1000, 100000), 64, 20, 2048

    torch.manual_seed(0)
    rows = table_rows(args.tables, *args.rows)
    model = DLRM(rows, args.dim, args.optimizer, args.lr)
    if args.bf16:
        model.embeddings.to_bfloat16_train()
    dense_params = [p for name, p in model.named_parameters() if not name.startswith("embeddings.")]
    optimizer = torch.optim.SGD(dense_params, lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    batches = make_batches(rows, args.batch_size, args.bag, 4)
    print(f"DLRM-like: {len(rows)} tables ({sum(rows):,} rows, dim {args.dim}, {model.embeddings.weight.dtype}), "
          f"bags of {args.bag}, batch {args.batch_size}, {args.optimizer}, {torch.get_num_threads()} threads")

    model.train()
    losses, start = [], None
    for step in range(args.steps + 2):
        if step == 2:
            start = time.perf_counter()
        dense, indices, offsets, labels = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(dense, indices, offsets).float(), labels)
        loss.backward()                    # the embedding rows are updated here
        optimizer.step()                   # the MLPs
        losses.append(loss.item())
    train_ms = (time.perf_counter() - start) * 1e3 / args.steps
    first, last = (sum(part) / len(part) for part in (losses[:4], losses[-4:]))   # fewer than 4 with --steps 1
    print(f"train: {train_ms:.1f} ms per step; loss {first:.4f} -> {last:.4f}")

    model.eval()
    with torch.no_grad():
        for step in range(args.infer_steps + 2):
            if step == 2:
                start = time.perf_counter()
            dense, indices, offsets, _ = batches[step % len(batches)]
            scores = torch.sigmoid(model(dense, indices, offsets).float())
    infer_ms = (time.perf_counter() - start) * 1e3 / args.infer_steps
    print(f"infer: {infer_ms:.1f} ms per batch; mean score {scores.mean().item():.3f}")


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
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: --batch-size/--rows/--dim: more memory than this process can "
                         f"allocate ({told or 'MemoryError'})\n")
        sys.exit(2)

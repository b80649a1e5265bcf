"""A small training workload: an MLP on random data, step time printed at the end.

    python examples/train.py [--steps 50] [--batch-size 64] [--optimizer sgd|adamw]

Run it under ``xlaunch --auto-optimize`` to get the fused optimizers without editing it.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = mlp().train()
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
    print(f"optimizer: {type(optimizer).__name__}, final loss {loss.item():.4f}", flush=True)
    print(f"step time: {1000 * elapsed / args.steps:.2f} ms", flush=True)


if __name__ == "__main__":
    main()

"""The embedded default workload: a small CNN, batch inference, throughput printed at the end.

    python examples/infer.py [--batch-size 16] [--iterations 30] [--warmup 5]

Under ``xlaunch`` each instance prints its index and CPUs, so a multi-instance run can be read
line by line. The last line is machine-readable: ``throughput: <float> img/s``.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = small_cnn().eval()
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    index = os.environ.get("XLAUNCH_INSTANCE_INDEX", "-")
    cpus = os.environ.get("XLAUNCH_CPUS") or ",".join(map(str, sorted(os.sched_getaffinity(0))))
    print(f"instance {index}: cpus {cpus}, torch threads {torch.get_num_threads()}", flush=True)

    with torch.no_grad():
        for _ in range(args.warmup):
            model(x)
        start = time.perf_counter()
        for _ in range(args.iterations):
            model(x)
        elapsed = time.perf_counter() - start
    print(f"throughput: {args.batch_size * args.iterations / elapsed:.1f} img/s", flush=True)


if __name__ == "__main__":
    main()

"""xlaunch.nn's operators side by side with what they replace, on 1 and 2 threads.

Every row of a section is timed interleaved (each round calls every row twice and times the
second call; medians over rounds); ratios are against the section's first row, in the same rounds.

  embedding bags  26 tables of 1,000-100,000 rows (589k), dim 64, mean of 20, batch 2048 (flags):
                  a Python loop of nn.EmbeddingBag, one concatenated table (one F.embedding_bag,
                  indices merged outside the timing), xlaunch's merged bag (compiled kernels, and
                  its pure-torch path), fbgemm-gpu-cpu's table-batched embedding and torchrec's
                  FusedEmbeddingBagCollection when installed (`pip install "xlaunch[bench]"` then
                  `pip install --no-deps torchrec==1.9.2`; a line says when they are not).
                  Forward (no_grad), and forward + backward (random upstream) + SGD update.
  interaction     dense + 26 features of (2048, 128): eager cat/bmm/index vs xlaunch.nn.interaction.
  roi_align       (2, 256, 50, 68) features, 1000 boxes, 7x7, sampling 2, aligned: the compiled
                  kernel (channels-last and NCHW input) vs its pure-torch path.
  threads         xlaunch's kernels on each thread count, the thread counts interleaved in the same
                  rounds (torch.set_num_threads before each call): the scaling, measured fairly.

    .venv/bin/xlaunch --ninstances 1 bench/ops.py [--rounds 7] [--threads 1 2] [--only bags interaction roi threads]
                      [--cpu-time]

Run it under xlaunch (jemalloc with its page-keeping settings, pinned cores): with glibc's malloc,
every fresh 50 MB roi_align output is page-faulted in again on each call, which costs more than
the kernel (46 ms against 14 here).

``--cpu-time`` times with the process's CPU time instead of the wall clock: on a machine shared
with other work, a single-threaded comparison then does not count the time the benchmark was not
running (the cache it shares is still shared). Scaling over threads needs the wall clock.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xlaunch.nn import (MergedEmbeddingBag, MergedEmbeddingBagWithAdaGrad, MergedEmbeddingBagWithSGD, interaction, native,
                        roi_align)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _args import COUNT, int_range  # noqa: E402
from _machine_bench import this_machine  # noqa: E402

Row = tuple[str, Callable[[], object]]


def say(line: str) -> None:
    print(line, flush=True)


def loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def interleaved(rows: list[Row], rounds: int, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median ms per call of each row. Each round runs every row twice and times the second call:
    the steady state of a loop, not the cold caches another row (say, a slow pure-torch one) left."""
    samples: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _ in range(rounds):
        for name, run in rows:
            run()
            start = clock()
            run()
            samples[name].append((clock() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def table_rows(tables: int, smallest: int, largest: int) -> list[int]:
    return [round(smallest * (largest / smallest) ** (t / (tables - 1))) for t in range(tables)]


# ---------------------------------------------------------------------------------------------- bags

def bag_inputs(args: argparse.Namespace) -> tuple[list[int], list, list, list, list]:
    """(rows per table, indices, offsets, lengths, upstream) of the embedding-bag section: bags of
    ``--bag`` lookups, or of uniform random sizes in ``--pooling LOW-HIGH``."""
    if args.small:   # the tests' tables (tests/nn/test_nn_merged.py)
        rows = [40, 25, 18]
    else:
        rows = table_rows(args.tables, 1000, args.largest)
    gen = torch.Generator().manual_seed(0)
    indices, offsets, lengths = [], [], []
    for r in rows:
        if args.pooling:
            low, high = args.pooling
            sizes = torch.randint(low, high + 1, (args.batch,), generator=gen)
        else:
            sizes = torch.full((args.batch,), args.bag)
        lengths.append(sizes)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]]))
        indices.append(torch.randint(0, r, (int(sizes.sum()),), generator=gen))
    upstream = [torch.randn(args.batch, args.dim, generator=gen) for _ in rows]
    return rows, indices, offsets, lengths, upstream


def bag_rows(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    """(forward rows, training rows) of the embedding-bag section."""
    rows, indices, offsets, lengths, upstream = bag_inputs(args)
    dim, batch, lr = args.dim, args.batch, 0.01
    adagrad = args.optimizer == "adagrad"
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    optim = (lambda params: torch.optim.Adagrad(params, lr=lr)) if adagrad else (lambda p: torch.optim.SGD(p, lr=lr))
    pooling = f"pooling {args.pooling[0]}-{args.pooling[1]}" if args.pooling else f"mean of {args.bag}"
    say(f"  {len(rows)} tables, {sum(rows):,} rows, dim {dim}, {pooling} ({sum(map(len, indices)):,} lookups), "
        f"batch {batch}, {args.optimizer}, {dtype}")

    loop = nn.ModuleList(nn.EmbeddingBag(r, dim, mode="mean", sparse=True).to(dtype) for r in rows)
    loop_opt = optim(loop.parameters())
    up = [u.to(dtype) for u in upstream]

    base = torch.tensor([0] + rows[:-1]).cumsum(0).tolist()
    concat = nn.EmbeddingBag(sum(rows), dim, mode="mean", sparse=True).to(dtype)
    concat_opt = optim(concat.parameters())
    flat_indices = torch.cat([i + b for i, b in zip(indices, base)])
    flat_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(lengths).cumsum(0)[:-1]])
    flat_upstream = torch.cat(up)

    fused = MergedEmbeddingBagWithAdaGrad if adagrad else MergedEmbeddingBagWithSGD
    merged = fused.from_embeddingbag_list([nn.EmbeddingBag(r, dim, mode="mean") for r in rows], lr=lr)
    if args.bf16:
        merged.to_bfloat16_train()
    plain = MergedEmbeddingBag.from_embeddingbag_list(list(nn.EmbeddingBag(r, dim, mode="mean").to(dtype)
                                                           for r in rows))

    def loop_forward() -> None:
        with torch.no_grad():
            [t(i, o) for t, i, o in zip(loop, indices, offsets)]

    def loop_train() -> None:
        loop_opt.zero_grad(set_to_none=True)
        torch.autograd.backward([t(i, o) for t, i, o in zip(loop, indices, offsets)], up)
        loop_opt.step()

    def concat_forward() -> None:
        with torch.no_grad():
            concat(flat_indices, flat_offsets)

    def concat_train() -> None:
        concat_opt.zero_grad(set_to_none=True)
        concat(flat_indices, flat_offsets).backward(flat_upstream)
        concat_opt.step()

    def merged_forward(kernels: bool) -> Callable[[], None]:
        def run() -> None:
            with native.prefer_native(kernels), torch.no_grad():
                plain(indices, offsets)
        return run

    def merged_train(kernels: bool) -> Callable[[], None]:
        def run() -> None:
            with native.prefer_native(kernels):
                torch.autograd.backward(merged(indices, offsets), up)
        return run

    name = "Adagrad" if adagrad else "SGD"
    forward: list[Row] = [("loop of nn.EmbeddingBag", loop_forward), ("one concatenated F.embedding_bag", concat_forward),
                          ("xlaunch merged (kernels)", merged_forward(True)),
                          ("xlaunch merged (pure torch)", merged_forward(False))]
    train: list[Row] = [(f"loop of nn.EmbeddingBag + sparse {name}", loop_train),
                        (f"one concatenated table + sparse {name}", concat_train),
                        (f"xlaunch MergedEmbeddingBagWith{name} (kernels)", merged_train(True)),
                        (f"xlaunch MergedEmbeddingBagWith{name} (pure torch)", merged_train(False))]
    for extra in (_fbgemm_rows, _torchrec_rows):
        got = extra(rows, dim, lengths, lr, indices, up, adagrad, dtype)
        if got:
            forward.append(got[0])
            train.append(got[1])
    return forward, train


def _fbgemm_rows(rows, dim, lengths, lr, indices, upstream, adagrad, dtype) -> list[Row]:
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                            SplitTableBatchedEmbeddingBagsCodegen)
        precision = SparseType.BF16 if dtype == torch.bfloat16 else SparseType.FP32
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows],
            optimizer=EmbOptimType.EXACT_ADAGRAD if adagrad else EmbOptimType.EXACT_SGD, learning_rate=lr,
            pooling_mode=PoolingMode.MEAN, weights_precision=precision, output_dtype=precision)
        all_indices = torch.cat(indices)
        all_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(lengths).cumsum(0)])
        with torch.no_grad():
            tbe(all_indices, all_offsets)     # a probe: the CPU kernels lack some precisions (bf16)
    except Exception as exc:  # not installed, a build that does not load with this torch, or no such mode on CPU
        say(f"  fbgemm-gpu-cpu skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return []
    grad = torch.cat(upstream, dim=1)          # TBE output: (batch, tables * dim)

    def forward() -> None:
        with torch.no_grad():
            tbe(all_indices, all_offsets)

    def train() -> None:
        tbe(all_indices, all_offsets).backward(grad)
    mode = "EXACT_ADAGRAD" if adagrad else "EXACT_SGD"
    return [("fbgemm-gpu-cpu TBE", forward), (f"fbgemm-gpu-cpu TBE, fused {mode}", train)]


def _torchrec_rows(rows, dim, lengths, lr, indices, upstream, adagrad, dtype) -> list[Row]:
    try:
        from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=r, feature_names=[f"f{t}"],
                                      pooling=PoolingType.MEAN,
                                      data_type=DataType.BF16 if dtype == torch.bfloat16 else DataType.FP32)
                   for t, r in enumerate(rows)]
        collection = FusedEmbeddingBagCollection(configs, optimizer_type=torch.optim.Adagrad if adagrad else
                                                 torch.optim.SGD, optimizer_kwargs={"lr": lr},
                                                 device=torch.device("cpu"))
        features = KeyedJaggedTensor(keys=[f"f{t}" for t in range(len(rows))], values=torch.cat(indices),
                                     lengths=torch.cat(lengths))
        with torch.no_grad():
            collection(features).values()     # a probe, as for fbgemm
    except Exception as exc:
        say(f"  torchrec skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return []
    grad = torch.cat(upstream, dim=1)

    def forward() -> None:
        with torch.no_grad():
            collection(features).values()

    def train() -> None:
        collection(features).values().backward(grad)
    name = "Adagrad" if adagrad else "SGD"
    return [("torchrec FusedEmbeddingBagCollection", forward), (f"torchrec FusedEmbeddingBagCollection ({name})", train)]


# --------------------------------------------------------------------------------------- interaction

def interaction_rows(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    gen = torch.Generator().manual_seed(1)
    count, batch, dim = 27, args.batch, 128
    features = [torch.randn(batch, dim, generator=gen, requires_grad=True) for _ in range(count)]
    rows, cols = torch.tril_indices(count, count, offset=-1)
    upstream = torch.randn(batch, dim + len(rows), generator=gen)
    say(f"  dense + {count - 1} features of ({batch}, {dim})")

    def eager(*xs: torch.Tensor) -> torch.Tensor:
        stacked = torch.cat(xs, dim=1).view(batch, count, dim)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))
        return torch.cat([xs[0], dots[:, rows, cols]], dim=1)

    def forward(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                fn(*features)
        return run

    def train(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            torch.autograd.grad(fn(*features), features, upstream)
        return run
    return ([("eager cat + bmm + index", forward(eager)), ("xlaunch.nn.interaction", forward(interaction))],
            [("eager cat + bmm + index", train(eager)), ("xlaunch.nn.interaction", train(interaction))])


# ---------------------------------------------------------------------------------------- roi_align

def roi_rows(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    gen = torch.Generator().manual_seed(2)
    n, c, h, w, k = 2, 256, 50, 68, args.boxes
    image = torch.randn(n, c, h, w, generator=gen)
    last = image.contiguous(memory_format=torch.channels_last)
    size = torch.rand(k, 2, generator=gen) * 300 + 16
    corner = torch.rand(k, 2, generator=gen) * torch.tensor([w * 16 - 16.0, h * 16 - 16.0])
    boxes = torch.cat([torch.randint(0, n, (k, 1), generator=gen).float(), corner, corner + size], dim=1)
    upstream = torch.randn(k, c, 7, 7, generator=gen).contiguous(memory_format=torch.channels_last)
    say(f"  ({n}, {c}, {h}, {w}) features, {k} boxes, 7x7, sampling 2, aligned, spatial scale 1/16")

    def forward(x: torch.Tensor, kernels: bool) -> Callable[[], None]:
        def run() -> None:
            with native.prefer_native(kernels), torch.no_grad():
                roi_align(x, boxes, 7, 1 / 16, 2, True)
        return run

    def train(x: torch.Tensor, kernels: bool) -> Callable[[], None]:
        leaf = x.detach().requires_grad_()

        def run() -> None:
            with native.prefer_native(kernels):
                torch.autograd.grad(roi_align(leaf, boxes, 7, 1 / 16, 2, True), leaf, upstream)
        return run
    return ([("kernel, channels-last", forward(last, True)), ("kernel, NCHW", forward(image, True)),
             ("pure torch, channels-last", forward(last, False))],
            [("kernel, channels-last", train(last, True)), ("kernel, NCHW", train(image, True)),
             ("pure torch, channels-last", train(last, False))])


def on_threads(threads: int, run: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        torch.set_num_threads(threads)
        run()
    return call


def thread_rows(args: argparse.Namespace) -> tuple[list[Row], list[Row]]:
    """The xlaunch rows of the other sections, one per thread count, interleaved."""
    bags_forward, bags_train = bag_rows(args)
    _, inter_train = interaction_rows(args)
    roi_forward, roi_train = roi_rows(args)
    picked = [("merged bag forward", dict(bags_forward)["xlaunch merged (kernels)"]),
              ("fused update step", bags_train[2][1]),
              ("interaction fwd+bwd", dict(inter_train)["xlaunch.nn.interaction"]),
              ("roi_align forward", dict(roi_forward)["kernel, channels-last"]),
              ("roi_align fwd+bwd", dict(roi_train)["kernel, channels-last"])]
    rows = [(f"{name}, {threads} thread(s)", on_threads(threads, run)) for name, run in picked
            for threads in args.threads]
    return rows, []


SECTIONS = {"bags": ("embedding bags", bag_rows), "interaction": ("interaction", interaction_rows),
            "roi": ("roi_align", roi_rows), "threads": ("threads", thread_rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=COUNT, default=7)
    parser.add_argument("--threads", type=COUNT, nargs="+", default=[1, 2])
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--tables", type=COUNT, default=26)
    parser.add_argument("--largest", type=COUNT, default=100_000, help="rows of the largest table")
    parser.add_argument("--dim", type=COUNT, default=64)
    parser.add_argument("--bag", type=COUNT, default=20)
    parser.add_argument("--batch", type=COUNT, default=2048)
    parser.add_argument("--boxes", type=COUNT, default=1000)
    parser.add_argument("--pooling", type=int_range, default=None, help="bag sizes uniform in LOW-HIGH (e.g. 1-100) instead of --bag")
    parser.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd")
    parser.add_argument("--bf16", action="store_true", help="bf16 tables (xlaunch: split-bf16 master)")
    parser.add_argument("--small", action="store_true", help="the tests' 3 small tables (40, 25, 18 rows)")
    parser.add_argument("--cpu-time", action="store_true", help="time with process CPU time, not the wall clock")
    args = parser.parse_args()
    args.threads = list(dict.fromkeys(args.threads))      # each count once: the threads rows are named by it
    clock = time.process_time if args.cpu_time else time.perf_counter
    warnings.simplefilter("ignore")
    if native.ops() is None:
        say("note: xlaunch.nn's kernels are not built (python -m xlaunch.nn.native); the kernel rows use torch")
    say(this_machine())
    say(f"torch {torch.__version__}, {'process CPU time' if args.cpu_time else 'wall clock'}, "
        f"load average {loadavg()} at start")
    results: dict[tuple, dict[str, float]] = {}
    for key in args.only:
        title, build = SECTIONS[key]
        for threads in args.threads if key != "threads" else [max(args.threads)]:
            torch.set_num_threads(threads)
            say(f"{title}, {threads} thread(s): building")
            forward, train = build(args)
            for phase, rows in (("forward", forward), ("forward + backward" + (" + update" if key == "bags" else ""),
                                                      train)):
                if not rows:
                    continue
                label = "interleaved" if key == "threads" else f"{threads} thread(s)"
                say(f"{title}, {label}, {phase}: {len(rows)} rows x {args.rounds} rounds")
                results[(title, phase if key != "threads" else "each kernel", label)] = interleaved(rows, args.rounds,
                                                                                                  clock)
    say(f"load average {loadavg()} at end\n")
    for (title, phase, label), medians in results.items():
        if title == "threads":
            say(f"threads, {label}\n\n| | ms (median) | vs {args.threads[0]} thread(s) |\n|---|---:|---:|")
            names = list(medians)
            for name in names:
                base = medians[names[names.index(name) - names.index(name) % len(args.threads)]]
                say(f"| {name} | {medians[name]:.1f} | {base / medians[name]:.2f}x |")
            say("")
            continue
        first = next(iter(medians.values()))
        say(f"{title}, {phase}, {label}\n\n| | ms (median) | vs first row |\n|---|---:|---:|")
        for name, value in medians.items():
            say(f"| {name} | {value:.1f} | {first / value:.2f}x |" if value >= 10 else
                f"| {name} | {value:.3f} | {first / value:.2f}x |")
        say("")
    return 0


if __name__ == "__main__":
    sys.exit(main())

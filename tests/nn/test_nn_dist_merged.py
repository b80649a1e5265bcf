"""DistMergeEmbeddingBagWithAdaGrad on 2 gloo ranks (two short processes on 127.0.0.1, one forked from
the other) against the single-process MergedEmbeddingBagWithAdaGrad: each rank's share of the outputs,
and its shard of the rows after two fused Adagrad steps."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

RANK = r"""
import torch, torch.distributed as dist
from datetime import timedelta
from torch import nn
from xlaunch.nn import DistMergeEmbeddingBagWithAdaGrad, MergedEmbeddingBagWithAdaGrad


def run(rank, store):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        check(rank)
    finally:
        dist.destroy_process_group()
    return f"rank {rank} ok"


def check(rank):
    torch.manual_seed(0)
    tables = [nn.EmbeddingBag(rows, 4, mode="sum", dtype=torch.float64) for rows in (9, 14, 5)]
    gen = torch.Generator().manual_seed(1)
    batch = 6
    sizes = [torch.randint(0, 4, (batch,), generator=gen) for _ in tables]
    indices = [torch.randint(0, t.num_embeddings, (int(s.sum()),), generator=gen) for t, s in zip(tables, sizes)]
    offsets = [torch.cat([torch.zeros(1, dtype=torch.long), s.cumsum(0)[:-1]]) for s in sizes]
    dist_bag = DistMergeEmbeddingBagWithAdaGrad.from_embeddingbag_list(tables, lr=0.3, eps=1e-8)
    ref = MergedEmbeddingBagWithAdaGrad.from_embeddingbag_list(tables, lr=0.3, eps=1e-8)
    mine = slice(rank * batch // 2, (rank + 1) * batch // 2)
    for step in range(2):
        upstream = torch.randn(batch, len(tables), 4, generator=gen, dtype=torch.float64)
        out = dist_bag(indices, offsets)
        want = torch.stack(ref(indices, offsets), dim=1)
        torch.testing.assert_close(out, want[mine].detach(), rtol=0, atol=1e-12)
        out.backward(upstream[mine])
        torch.autograd.backward(list(want.unbind(1)), list(upstream.unbind(1)))
    full = torch.cat([w.detach() for w in ref.weights])
    torch.testing.assert_close(dist_bag.weight.detach(), full[rank::2], rtol=0, atol=1e-12)
    # IPEX's accessors (its tests/cpu/test_distributed_merged_emb.py): weights[0], adagrad_args.hessian
    assert dist_bag.weights[0] is dist_bag.weight
    torch.testing.assert_close(dist_bag.adagrad_args.hessian[0], torch.cat(ref.adagrad_args.hessian)[rank::2],
                               rtol=0, atol=1e-12)
    before = dist_bag.weight.detach().clone()
    bad = [i.clone() for i in indices]
    bad[1][0] = 14
    try:
        dist_bag(bad, offsets)
    except IndexError as exc:
        assert "of table 1 is out of range [0, 14)" in str(exc), exc
    else:
        raise AssertionError("no error")
    assert torch.equal(dist_bag.weight.detach(), before)
    overrun = list(offsets)
    overrun[0] = offsets[0].clone()
    overrun[0][-1] = len(indices[0]) + 1
    try:
        dist_bag(indices, overrun)
    except ValueError as exc:
        assert f"position {batch - 1} of table 0 is out of range" in str(exc), exc
    else:
        raise AssertionError("no error")
    assert torch.equal(dist_bag.weight.detach(), before)


if __name__ == "__main__":
    # torch and xlaunch.nn are imported once; rank 1 is forked before any process group exists and
    # leaves through normal interpreter exit, as a process of its own would. Rank 0's store listens on
    # a port the kernel chose (no race for a port picked beforehand); rank 1 reads it from a pipe.
    import os, signal, sys
    read, write = os.pipe()
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        os.close(write)
        with os.fdopen(read) as pipe:
            port = pipe.read()
        if not port:
            sys.exit("rank 1: rank 0 made no store")
        line = run(1, dist.TCPStore("127.0.0.1", int(port), 2, False, timeout=timedelta(seconds=60)))
        os.write(1, f"{line}\n".encode())   # one write: the ranks share the pipe (print under -u writes twice)
        sys.exit(0)
    os.close(read)
    try:
        with os.fdopen(write, "w") as pipe:
            store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
            pipe.write(str(store.port))
        os.write(1, f"{run(0, store)}\n".encode())
    except BaseException:
        os.kill(child, signal.SIGKILL)
        raise
    finally:
        code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code:
        sys.exit(f"rank 1 exited with status {code}")
"""


def test_two_gloo_ranks_equal_the_single_process_adagrad(tmp_path):
    """Both ranks in a process of their own (gloo starts threads: a hang is killed at the timeout, never the
    suite's), rank 1 forked from rank 0 after the imports (one torch import instead of two, ~1 s of CPU);
    each exits 0 with its line, nothing on stderr."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["OMP_NUM_THREADS"] = "1"
    ranks = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, start_new_session=True)
    try:
        out, err = ranks.communicate(timeout=120)
    finally:
        if ranks.poll() is None:
            os.killpg(ranks.pid, signal.SIGKILL)          # both ranks: rank 1 is in rank 0's group
            ranks.communicate()
    assert (ranks.returncode, sorted(out.splitlines()), err) == (0, ["rank 0 ok", "rank 1 ok"], ""), (out, err)

"""Checkpoint and resume of ``optimize(model, optimizer, dtype=...)`` training, bit for bit.

For every fused optimizer, split-bf16 (forced with ``force_bf16``, so it runs where the CPU only
emulates bf16) and fp32, ``inplace`` True and False: a run saved and resumed after two steps ends
with the same bytes (parameters, buffers, fp32 masters, optimizer state) as one that never stopped,
in one process (``state_dict``/``load_state_dict``, through ``torch.save``/``torch.load(...,
weights_only=True)``) and in a second process.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from resume_helpers import (  # noqa: E402
    OPTIMIZERS, Net, batches, build, checkpoint, differences, resume, snapshot, train,
)

import xlaunch  # noqa: E402
from xlaunch.kernels import master_params  # noqa: E402
from xlaunch.kernels.optim.fused import TRAIL_KEY, is_split  # noqa: E402
from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]   # fast on a busy 2-vCPU box

DATA = batches(4)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "copy"])
@pytest.mark.parametrize("split", [True, False], ids=["split-bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_in_one_process_is_bitwise(name: str, split: bool, inplace: bool) -> None:
    model, optimizer = build(name, split, inplace, seed=0)
    train(model, optimizer, DATA)
    expected = snapshot(model, optimizer)

    model, optimizer = build(name, split, inplace, seed=0)
    train(model, optimizer, DATA[:2])
    before = snapshot(model, optimizer)
    optimizer.load_state_dict(optimizer.state_dict())       # torch alone casts the trail to bf16 here
    assert not differences(snapshot(model, optimizer), before)
    saved = checkpoint(model, optimizer)                     # model.state_dict(): the fp32 masters
    train(model, optimizer, DATA[2:])
    assert not differences(snapshot(model, optimizer), expected)

    fresh, fresh_optimizer = build(name, split, inplace, seed=1)   # other weights: the load must set them
    resume(fresh, fresh_optimizer, saved)
    assert not differences(snapshot(fresh, fresh_optimizer), before)
    train(fresh, fresh_optimizer, DATA[2:])
    assert not differences(snapshot(fresh, fresh_optimizer), expected)


SECOND_PROCESS = """
import sys, torch
torch.set_num_threads(1)   # as the first process's test
from resume_helpers import OPTIMIZERS, batches, build, resume, snapshot, train
root, steps = sys.argv[1], int(sys.argv[2])
data = batches(steps)
out = {}
for i, name in enumerate(sorted(OPTIMIZERS)):
    for split in (True, False):
        model, optimizer = build(name, split, inplace=bool(i % 2), seed=1)
        with open(f"{root}/{name}-{split}.pt", "rb") as f:
            resume(model, optimizer, f.read())
        train(model, optimizer, data[2:])
        out[f"{name}-{split}"] = snapshot(model, optimizer)
torch.save(out, f"{root}/resumed.pt")
"""


def test_resume_in_a_second_process_is_bitwise(tmp_path: Path) -> None:
    expected = {}
    for name in sorted(OPTIMIZERS):
        for split in (True, False):
            model, optimizer = build(name, split, inplace=True, seed=0)
            train(model, optimizer, DATA[:2])
            (tmp_path / f"{name}-{split}.pt").write_bytes(checkpoint(model, optimizer))
            train(model, optimizer, DATA[2:])
            expected[f"{name}-{split}"] = snapshot(model, optimizer)
    script = tmp_path / "second.py"
    script.write_text(SECOND_PROCESS)
    root = Path(xlaunch.__file__).resolve().parents[1]
    paths = [str(Path(__file__).parent), str(root), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(len(DATA))], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert got.keys() == expected.keys()
    for key in expected:
        assert not differences(got[key], expected[key]), key


@pytest.mark.parametrize("split", [True, False], ids=["split-bf16", "fp32"])
@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_a_plain_fp32_checkpoint_resumes_as_optimizing_that_run(name: str, split: bool) -> None:
    """A checkpoint of a plain torch run (contiguous conv weights and state, a torch optimizer)
    loaded into a fresh optimized model (channels-last conv, fused optimizer, split-bf16 or not)
    trains on exactly as ``optimize`` applied to that run itself: its weights become the masters bit
    for bit, the optimizer state stays fp32 in the parameters' layout, whichever is loaded first."""
    torch.manual_seed(0)
    plain = Net().train()
    plain_optimizer = OPTIMIZERS[name](plain.parameters())
    train(plain, plain_optimizer, DATA[:2])
    saved = checkpoint(plain, plain_optimizer)   # as from a file: torch's loads share same-dtype state tensors
    reference, reference_optimizer = optimize(plain, plain_optimizer, dtype=torch.bfloat16 if split else None,
                                              force_bf16=True)   # a copy: plain is left as it is
    assert reference.conv.weight.is_contiguous(memory_format=torch.channels_last)
    train(reference, reference_optimizer, DATA[2:])
    expected = snapshot(reference, reference_optimizer)
    for optimizer_first in (True, False):
        model, optimizer = build(name, split, inplace=True, seed=1)
        state = torch.load(io.BytesIO(saved), weights_only=True)
        model_state, optimizer_state = state["model"], state["optimizer"]
        if optimizer_first:
            optimizer.load_state_dict(optimizer_state)
        model.load_state_dict(model_state)
        if not optimizer_first:
            optimizer.load_state_dict(optimizer_state)
        assert is_split(optimizer, model.conv.weight) == split
        for master, fp32 in zip(master_params(optimizer), plain.parameters()):
            assert torch.equal(master.view(torch.int32), fp32.detach().view(torch.int32))
        train(model, optimizer, DATA[2:])
        assert not differences(snapshot(model, optimizer), expected)


def test_a_split_checkpoint_loads_into_fp32_training() -> None:
    """The other way: a split-bf16 checkpoint resumed in fp32 gives the masters and drops the low halves."""
    model, optimizer = build("sgd", split=True, inplace=True, seed=0)
    train(model, optimizer, DATA[:2])
    masters = master_params(optimizer)
    saved = checkpoint(model, optimizer)
    fp32, fp32_optimizer = build("sgd", split=False, inplace=True, seed=1)
    resume(fp32, fp32_optimizer, saved)
    for p, master in zip(fp32.parameters(), masters):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), master)
        assert TRAIL_KEY not in fp32_optimizer.state[p]
    train(fp32, fp32_optimizer, DATA[2:])


def test_a_split_checkpoint_trained_on_in_plain_torch_resumes_split_again() -> None:
    """Split-bf16, then a plain torch run resumed from its checkpoint, then split-bf16 again from
    that run's: torch's load casts the int16 low halves to the fp32 parameters' dtype and its
    optimizer saves them again, stale. They were refused ("the low half of its fp32 master is
    lost"); they are left out (the model checkpoint holds the masters), whichever loads first."""
    model, optimizer = build("adam", split=True, inplace=True, seed=0)
    train(model, optimizer, DATA[:1])
    torch.manual_seed(1)
    plain = Net().train()
    plain_optimizer = OPTIMIZERS["adam"](plain.parameters())
    resume(plain, plain_optimizer, checkpoint(model, optimizer))
    assert plain_optimizer.state[plain.conv.weight][TRAIL_KEY].dtype == torch.float32
    train(plain, plain_optimizer, DATA[1:2])
    saved = checkpoint(plain, plain_optimizer)
    reference, reference_optimizer = optimize(plain, plain_optimizer, dtype=torch.bfloat16, force_bf16=True)
    train(reference, reference_optimizer, DATA[2:])
    expected = snapshot(reference, reference_optimizer)
    for optimizer_first in (True, False):
        again, again_optimizer = build("adam", split=True, inplace=True, seed=2)
        state = torch.load(io.BytesIO(saved), weights_only=True)
        if optimizer_first:
            again_optimizer.load_state_dict(state["optimizer"])
        again.load_state_dict(state["model"])
        if not optimizer_first:
            again_optimizer.load_state_dict(state["optimizer"])
        for master, fp32 in zip(master_params(again_optimizer), plain.parameters()):
            assert torch.equal(master.view(torch.int32), fp32.detach().view(torch.int32))
        train(again, again_optimizer, DATA[2:])
        assert not differences(snapshot(again, again_optimizer), expected)


def test_a_checkpoint_whose_low_halves_were_cast_is_refused() -> None:
    model, optimizer = build("sgd", split=True, inplace=True, seed=0)
    train(model, optimizer, DATA[:1])
    state = optimizer.state_dict()
    state["state"][0] = dict(state["state"][0], **{TRAIL_KEY: state["state"][0][TRAIL_KEY].to(torch.bfloat16)})
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match="parameter 0's bf16_trail is torch.bfloat16 .* not int16 .* lost"):
        optimizer.load_state_dict(state)
    assert not differences(snapshot(model, optimizer), before)   # refused before anything was loaded


def test_a_bf16_model_checkpoint_sets_the_master_to_that_value() -> None:
    model, optimizer = build("sgd", split=True, inplace=True, seed=0)
    train(model, optimizer, DATA[:1])
    state = {key: value.to(torch.bfloat16) if value.is_floating_point() else value
             for key, value in model.state_dict().items()}
    model.load_state_dict(state)
    master = master_params(optimizer)[0]
    assert torch.equal(master, state["conv.weight"].float())

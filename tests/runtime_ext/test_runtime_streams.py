"""MultiStreamModule gives the plain model's outputs: tensors, tuples, dicts, uneven and tiny batches."""
from __future__ import annotations

import os
import threading

import pytest

torch = pytest.importorskip("torch")

from _runtime_helpers import small_cnn, thread_cpus, thread_ids  # noqa: E402

from xlaunch.runtime_ext import CPUPool, MultiStreamModule, StreamHint  # noqa: E402
from xlaunch.runtime_ext.batching import slice_sizes  # noqa: E402

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
STREAMS = min(2, len(ALLOWED))


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


class TwoHeads(torch.nn.Module):
    """Tuple in (x, scale), tuple and dict out; records which thread ran each slice."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)
        self.threads: set = set()

    def forward(self, x, scale, mask=None):
        self.threads.add((threading.get_native_id(), thread_cpus(threading.get_native_id())))
        y = self.linear(x) * scale
        if mask is not None:
            y = y * mask
        return y, {"sum": y.sum(dim=1, keepdim=True), "first": x[:, :1], "tag": "heads"}


@pytest.fixture(scope="module")
def cnn():
    return small_cnn()


@pytest.fixture(scope="module")
def cnn_streams(cnn):
    with MultiStreamModule(cnn, num_streams=STREAMS, cpu_pool=CPUPool(list(ALLOWED[:STREAMS]))) as msm:
        yield msm


@pytest.mark.parametrize("batch", [16, 5, 3, 1])
def test_cnn_output_equals_the_plain_model(cnn, cnn_streams, batch):
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        close(cnn_streams(x), cnn(x))


def test_tuple_and_dict_outputs_with_replicated_and_keyword_inputs():
    torch.manual_seed(0)
    model = TwoHeads().eval()
    x = torch.randn(7, 6)
    scale = torch.tensor(2.0)
    mask = torch.rand(7, 4)
    hint = StreamHint(0, None, mask=0)
    with torch.no_grad(), MultiStreamModule(model, num_streams=STREAMS, cpu_pool=CPUPool(list(ALLOWED[:STREAMS])),
                                            input_split_hint=hint) as msm:
        y, extras = msm(x, scale, mask=mask)
        model.threads.clear()
        y, extras = msm(x, scale, mask=mask)
        ref_y, ref_extras = model(x, scale, mask=mask)
    close(y, ref_y)
    assert set(extras) == {"sum", "first", "tag"}
    close(extras["sum"], ref_extras["sum"])
    close(extras["first"], ref_extras["first"])
    assert extras["tag"] == "heads"
    model.threads.discard((threading.get_native_id(), thread_cpus(threading.get_native_id())))
    assert sorted(cpus for _, cpus in model.threads) == [(c,) for c in ALLOWED[:STREAMS]]


def test_dict_input_and_output_hint_on_dim_one():
    class DictModel(torch.nn.Module):
        def forward(self, batch):
            return {"t": (batch["a"] + batch["b"]).t(), "n": batch["n"]}

    a, b = torch.randn(5, 3), torch.randn(5, 3)
    with MultiStreamModule(DictModel(), num_streams=STREAMS, cpu_pool=CPUPool(list(ALLOWED[:STREAMS])),
                           input_split_hint=StreamHint({"a": 0, "b": 0, "n": None}),
                           output_concat_hint={"t": 1, "n": None}) as msm:
        out = msm({"a": a, "b": b, "n": 3})
    assert torch.equal(out["t"], (a + b).t()) and out["n"] == 3


def test_batch_split_on_dim_one_and_uncontcatenated_outputs():
    x = torch.randn(4, 9)
    with MultiStreamModule(lambda t: t * 2, num_streams=STREAMS, cpu_pool=CPUPool(list(ALLOWED[:STREAMS])),
                           input_split_hint=StreamHint(1), output_concat_hint=1) as msm:
        assert torch.equal(msm(x), x * 2)
        msm.concat_output = False
        parts = msm(x)
    assert [p.shape[1] for p in parts] == slice_sizes(9, STREAMS)
    assert torch.equal(torch.cat(parts, dim=1), x * 2)


def test_slice_sizes_uneven_and_tiny():
    assert slice_sizes(16, 2) == [8, 8]
    assert slice_sizes(5, 2) == [3, 2]
    assert slice_sizes(7, 3) == [3, 2, 2]
    assert slice_sizes(1, 4) == [1]
    assert slice_sizes(2, 4) == [1, 1]


def test_bad_arguments_are_refused():
    pool = CPUPool([ALLOWED[0]])
    for wrong in (0, -1, "fast", 1.5, True):
        with pytest.raises(ValueError, match="num_streams"):
            MultiStreamModule(lambda t: t, num_streams=wrong, cpu_pool=pool)
    with pytest.raises(TypeError, match="cpu_pool must be a CPUPool"):
        MultiStreamModule(lambda t: t, num_streams=1, cpu_pool=[ALLOWED[0]])
    with pytest.warns(RuntimeWarning, match="num_streams=2 but the pool has 1 CPUs: using 1 streams"):
        with MultiStreamModule(lambda t: t, num_streams=2, cpu_pool=pool) as msm:  # IPEX clamps too
            assert msm.num_streams == 1
    with MultiStreamModule(lambda a, b: a, num_streams=1, cpu_pool=pool) as msm:
        with pytest.raises(ValueError, match="disagree on the batch size"):
            msm(torch.zeros(3, 1), torch.zeros(4, 1))
        with pytest.raises(ValueError, match="no tensor"):
            msm(1, 2)
    with pytest.raises(RuntimeError, match="closed"):
        msm(torch.zeros(1))


def test_streams_exceptions_propagate_and_threads_end_on_close():
    before = thread_ids()

    def picky(t):
        if t.shape[0] == 1:
            raise ValueError("slice of one")
        return t

    msm = MultiStreamModule(picky, num_streams=STREAMS, cpu_pool=CPUPool(list(ALLOWED[:STREAMS])))
    assert msm.num_streams == STREAMS
    with pytest.raises(ValueError, match="slice of one"):
        msm(torch.zeros(STREAMS * 1 if STREAMS > 1 else 1))
    assert torch.equal(msm(torch.ones(4)), torch.ones(4))
    msm.close()
    assert thread_ids() <= before


def test_auto_streams_is_one_per_pool_cpu():
    with MultiStreamModule(lambda t: t) as msm:
        assert msm.num_streams == len(CPUPool())
        assert [p.cpus for p in msm.stream_pools] == [(c,) for c in CPUPool().cpus]


def test_dropped_streams_stop_their_threads():
    import gc

    msm = MultiStreamModule(lambda t: t + 1, num_streams=STREAMS, cpu_pool=CPUPool(list(ALLOWED[:STREAMS])))
    assert torch.equal(msm(torch.zeros(4)), torch.ones(4))
    threads = [task._worker.thread for task in msm._tasks]
    del msm
    gc.collect()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_hints_outside_a_tensors_dimensions_are_one_line_naming_the_hint():
    """A split or concatenation dimension the tensor lacks was an IndexError from deep inside
    (``tuple index out of range``), a 0-dimensional output torch.cat's RuntimeError."""
    from xlaunch.runtime_ext.batching import common_batch, join_outputs

    x = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"^input_split_hint: dimension 2 of a 2-dimensional tensor"):
        common_batch((x,), {}, StreamHint(2))
    with pytest.raises(ValueError, match=r"^input_split_hint: dimension -3 of a 2-dimensional tensor"):
        common_batch((), {"x": x}, StreamHint(x=-3))
    assert common_batch((x,), {}, StreamHint(-1)) == 3
    with pytest.raises(ValueError, match=r"^output_concat_hint: dimension 5 of a 2-dimensional tensor"):
        join_outputs([x, x], 5)
    with pytest.raises(ValueError, match=r"^output_concat_hint: a 0-dimensional output .* None hint"):
        join_outputs([(x, torch.tensor(1.0)), (x, torch.tensor(2.0))], 0)
    assert join_outputs([(x, torch.tensor(1.0)), (x, torch.tensor(2.0))], (0, None))[1].item() == 1.0
    with MultiStreamModule(lambda t: t, num_streams=1, cpu_pool=CPUPool([ALLOWED[0]]), input_split_hint=StreamHint(5)) as msm:
        with pytest.raises(ValueError, match="^input_split_hint: dimension 5"):
            msm(x)


def test_hints_model_and_concat_output_are_checked_when_built_and_numpy_ints_are_dimensions():
    """A float or bool hint was taken and failed only at the first call (not at all where one stream
    or one item left nothing to concatenate); numpy's integers were refused there ("needs an int")."""
    np = pytest.importorskip("numpy")
    pool = CPUPool(list(ALLOWED[:STREAMS]))
    for name, hint in (("output_concat_hint", 1.5), ("output_concat_hint", (0, "x")), ("output_concat_hint", True),
                       ("input_split_hint", StreamHint(0.0)), ("input_split_hint", StreamHint(x={"a": 1.0}))):
        with pytest.raises(TypeError, match=f"^{name}: a hint is an int dimension, None, or a tuple, list or dict"):
            MultiStreamModule(lambda t: t, num_streams=STREAMS, cpu_pool=pool, **{name: hint})
    with pytest.raises(TypeError, match="^model must be a module or callable, got int$"):
        MultiStreamModule(3, num_streams=1, cpu_pool=pool)
    with pytest.raises(TypeError, match="^concat_output must be True or False, not 'no'$"):
        MultiStreamModule(lambda t: t, num_streams=1, cpu_pool=pool, concat_output="no")
    x = torch.arange(8.0).view(2, 4)
    with MultiStreamModule(lambda t: t * 2, num_streams=STREAMS, cpu_pool=pool, input_split_hint=StreamHint(np.int64(1)),
                           output_concat_hint=np.int64(1)) as msm:
        assert torch.equal(msm(x), x * 2)


def test_dataclass_outputs_are_joined_field_by_field():
    """An output dataclass (a model's own result type) came back as the list of per-stream outputs,
    though concat_output=True, with no message."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Result:
        logits: torch.Tensor
        per_item: torch.Tensor
        label: str = "x"

    x = torch.randn(5, 3)
    model = lambda t: Result(t * 2, t.t(), "x")  # noqa: E731
    with MultiStreamModule(model, num_streams=STREAMS, cpu_pool=CPUPool(list(ALLOWED[:STREAMS])),
                           output_concat_hint={"per_item": 1}) as msm:
        out = msm(x)
    assert isinstance(out, Result) and out.label == "x"
    assert torch.equal(out.logits, x * 2) and torch.equal(out.per_item, x.t())

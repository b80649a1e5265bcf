"""xlaunch.llm.kernel_choice: a packed linear's calls of many rows go to ATen's GEMM on a widened weight
when that measured faster, the others to the kernels; the measurement is made once and cached per machine."""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from kernel_levels import use_level  # noqa: E402

from xlaunch.llm import footprint, kernel_choice, native  # noqa: E402
from xlaunch.llm.linear import PackedLinear  # noqa: E402

pytestmark = pytest.mark.torch
ENV = kernel_choice.ENV


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """A cache file of the test's own, nothing remembered from other tests, the choice automatic."""
    monkeypatch.setattr(kernel_choice, "cache_file", lambda level: tmp_path / "choice" / f"{level}.json")
    monkeypatch.setenv(ENV, "auto")
    kernel_choice.forget()
    yield tmp_path / "choice" / "avx2.json"
    kernel_choice.forget()


def routes():
    """(kernel, dense, calls): two stand-in routes recording which one ran, with how many rows."""
    calls = []

    def kernel(x):
        calls.append(("kernel", x.numel() // x.shape[-1]))
        return x

    def dense(x, dtype):
        calls.append(("dense", x.numel() // x.shape[-1], dtype))
        return x

    return kernel, dense, calls


def timer_where_dense_wins_from(rows_needed, seen):
    """A fake clock: the dense route takes 1 s from ``rows_needed`` rows on and 3 s below; the kernel 2 s."""
    def timer(fn, x):
        is_dense = getattr(fn, "is_dense", False)
        seen.append(("dense" if is_dense else "kernel", x.shape[0]))
        return (1.0 if x.shape[0] >= rows_needed else 3.0) if is_dense else 2.0
    return timer


def marked(fn):
    fn.is_dense = True
    return fn


@pytest.mark.parametrize("wins_from, expected, probed", [
    (64, 64, [512, 256, 128, 64, 32]),     # goes down while the dense route wins; stops at its first loss
    (16, 16, [512, 256, 128, 64, 32, 16]),
    (10_000, None, [512]),                 # loses at the largest count: one probe, never dense
])
def test_measure_goes_down_from_the_largest_count_while_dense_wins(wins_from, expected, probed):
    seen = []
    found = kernel_choice.measure(lambda x: x, marked(lambda x: x), 64, 64, torch.float32,
                                  timer=timer_where_dense_wins_from(wins_from, seen))
    assert found == expected
    assert [rows for route, rows in seen if route == "dense"] == probed
    assert [rows for route, rows in seen if route == "kernel"] == probed


def test_the_probes_stay_under_the_work_cap():
    assert kernel_choice.probe_rows(2048, 2048) == kernel_choice.PROBE_ROWS
    assert max(kernel_choice.probe_rows(8192, 2048)) * 8192 * 2048 <= kernel_choice.PROBE_MACS
    assert kernel_choice.probe_rows(128256, 2048) == (16, 32, 64)        # a 128k lm_head: small probes
    assert kernel_choice.probe_rows(1 << 20, 1 << 16) == (16,)          # never none


def test_a_forced_row_count_routes_by_rows_on_any_cpu(monkeypatch):
    monkeypatch.setenv(ENV, "24")
    monkeypatch.setattr(footprint, "native_bf16", lambda: False)
    kernel, dense, calls = routes()
    linear = kernel_choice.routed("avx2", "int8", 32, 8, 0, kernel, dense)
    linear(torch.zeros(23, 8))
    linear(torch.zeros(2, 12, 8))           # 24 rows in a batch of 2
    linear(torch.zeros(30, 8, dtype=torch.bfloat16))
    assert calls == [("kernel", 23), ("dense", 24, torch.float32), ("dense", 30, torch.float32)]


def test_bf16_activations_multiply_in_bf16_only_where_the_cpu_has_native_bf16(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    for native_bf16, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(footprint, "native_bf16", lambda: native_bf16)
        kernel, dense, calls = routes()
        kernel_choice.routed("avx2", "bf16", 32, 8, 0, kernel, dense)(torch.zeros(4, 8, dtype=torch.bfloat16))
        assert calls == [("dense", 4, expected)]


def test_off_and_a_cpu_without_native_bf16_keep_the_kernel_itself(monkeypatch):
    kernel, dense, _ = routes()
    monkeypatch.setattr(footprint, "native_bf16", lambda: False)
    assert kernel_choice.routed("avx2", "bf16", 32, 8, 0, kernel, dense) is kernel        # auto: nothing to measure
    monkeypatch.setattr(footprint, "native_bf16", lambda: True)
    monkeypatch.setenv(ENV, "off")
    assert kernel_choice.routed("avx2", "bf16", 32, 8, 0, kernel, dense) is kernel


@pytest.mark.parametrize("value", ["0", "-3", "fast", "1.5"])
def test_a_bad_setting_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=f"^{ENV}=.*expected auto, off or a positive row count"):
        kernel_choice.routed("avx2", "bf16", 32, 8, 0, *routes()[:2])


def test_one_measurement_per_shape_then_the_cache_file(monkeypatch, isolated):
    monkeypatch.setattr(footprint, "native_bf16", lambda: True)
    measured = []

    def measure(kernel, dense, n, k, dtype, timer=None):
        measured.append((n, k, dtype))
        return 32

    monkeypatch.setattr(kernel_choice, "measure", measure)
    kernel, dense, calls = routes()
    linear = kernel_choice.routed("avx2", "int4", 48, 8, 32, kernel, dense)
    for rows in (8, 15, 16, 40, 31, 32, 40):          # below 16: no measurement; then one for the shape
        linear(torch.zeros(rows, 8, dtype=torch.bfloat16))
    assert measured == [(48, 8, torch.bfloat16)]
    assert [call[:2] for call in calls] == [("kernel", 8), ("kernel", 15), ("kernel", 16), ("dense", 40),
                                            ("kernel", 31), ("dense", 32), ("dense", 40)]
    key = kernel_choice.shape_key("int4", 48, 8, 32, torch.bfloat16, torch.get_num_threads())
    assert json.loads(isolated.read_text()) == {key: 32}

    kernel_choice.forget()                             # a new process: the file answers, nothing is timed
    monkeypatch.setattr(kernel_choice, "measure", lambda *a, **k: pytest.fail("measured again"))
    kernel, dense, calls = routes()
    kernel_choice.routed("avx2", "int4", 48, 8, 32, kernel, dense)(torch.zeros(33, 8, dtype=torch.bfloat16))
    assert calls == [("dense", 33, torch.bfloat16)]


def test_each_kernel_level_is_measured_for_itself(monkeypatch, isolated):
    """A threshold measured with one level's kernels (and kept in that level's file) is not another's."""
    monkeypatch.setattr(footprint, "native_bf16", lambda: True)
    answers = iter([32, None])
    monkeypatch.setattr(kernel_choice, "measure", lambda *a, **k: next(answers))
    taken = []
    for level in ("avx2", "baseline"):
        kernel, dense, calls = routes()
        kernel_choice.routed(level, "bf16", 16, 8, 0, kernel, dense)(torch.zeros(40, 8, dtype=torch.bfloat16))
        taken.append(calls[0][0])
    assert taken == ["dense", "kernel"]
    key = kernel_choice.shape_key("bf16", 16, 8, 0, torch.bfloat16, torch.get_num_threads())
    assert kernel_choice.thresholds() == {"avx2": {key: 32}, "baseline": {key: None}}
    assert [list(json.loads((isolated.parent / f"{level}.json").read_text()).values()) for level in ("avx2", "baseline")] \
        == [[32], [None]]


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b'{"a": "x", "b": -4}', b"\xff" * 10])
def test_a_malformed_cache_file_is_measured_again_and_rewritten(monkeypatch, isolated, content):
    monkeypatch.setattr(footprint, "native_bf16", lambda: True)
    isolated.parent.mkdir(parents=True)
    isolated.write_bytes(content)
    monkeypatch.setattr(kernel_choice, "measure", lambda *a, **k: None)
    kernel, dense, calls = routes()
    kernel_choice.routed("avx2", "bf16", 16, 8, 0, kernel, dense)(torch.zeros(20, 8, dtype=torch.bfloat16))
    assert calls == [("kernel", 20)]
    assert list(json.loads(isolated.read_text()).values()) == [None]


@pytest.mark.parametrize("value", ["true", "1.5", "1e400"])
def test_a_cached_count_of_the_wrong_type_is_measured_again(monkeypatch, isolated, value):
    monkeypatch.setattr(footprint, "native_bf16", lambda: True)
    key = kernel_choice.shape_key("bf16", 16, 8, 0, torch.bfloat16, torch.get_num_threads())
    isolated.parent.mkdir(parents=True)
    isolated.write_text(f'{{"{key}": {value}}}')        # JSON true was read as a count of 1: dense for every call
    monkeypatch.setattr(kernel_choice, "measure", lambda *a, **k: None)
    kernel, dense, calls = routes()
    kernel_choice.routed("avx2", "bf16", 16, 8, 0, kernel, dense)(torch.zeros(20, 8, dtype=torch.bfloat16))
    assert calls == [("kernel", 20)]
    assert json.loads(isolated.read_text()) == {key: None}


def test_a_special_file_or_a_symlinked_folder_is_never_written_through(monkeypatch, isolated, tmp_path):
    monkeypatch.setattr(footprint, "native_bf16", lambda: True)
    monkeypatch.setattr(kernel_choice, "measure", lambda *a, **k: 16)
    isolated.parent.mkdir(parents=True)
    os.mkfifo(isolated)
    kernel, dense, calls = routes()
    kernel_choice.routed("avx2", "bf16", 16, 8, 0, kernel, dense)(torch.zeros(20, 8, dtype=torch.bfloat16))
    assert calls == [("dense", 20, torch.bfloat16)] and not isolated.is_file()      # the FIFO stays as it was

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    linked.symlink_to(elsewhere)
    monkeypatch.setattr(kernel_choice, "cache_file", lambda level: linked / f"{level}.json")
    kernel_choice.forget()
    kernel_choice.routed("avx2", "bf16", 16, 8, 0, *routes()[:2])(torch.zeros(20, 8, dtype=torch.bfloat16))
    assert list(elsewhere.iterdir()) == []


def test_a_real_measurement_picks_a_route_and_keeps_it(monkeypatch, isolated):
    """Both routes really timed on a small layer: whichever wins, the answer is a probe count or None, and stays."""
    if native.ops() is None:
        pytest.skip("the xlaunch.llm kernels are not built (python -m xlaunch.llm.native)")
    monkeypatch.setattr(footprint, "native_bf16", lambda: True)
    layer = PackedLinear(torch.randn(64, 64), None, "bf16")
    linear = layer.bound(native.ops())
    y = linear(torch.randn(20, 64, dtype=torch.bfloat16))
    assert y.shape == (20, 64)
    cache = isolated.parent / f"{native.ops().compiled_isa()}.json"      # the level this CPU runs
    (key, found), = json.loads(cache.read_text()).items()
    assert key.startswith("bf16:64x64:g0:bfloat16:") and found in (None, *kernel_choice.PROBE_ROWS)


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("level", native.LEVELS)
def test_the_dense_route_computes_the_layer_at_every_level(monkeypatch, level, kind, sliced):
    """Forced from 16 rows: 20 rows go through ATen's GEMM on the widened weight, 8 through the level's
    kernel; both match the float reference of the packed weight, in bf16 and fp32 activations (fp32 layers of
    bf16 values: fp32 only, multiplied exactly either way). ``sliced``:
    a widening budget of one block of 64 channels, so the 72 channels are widened and multiplied in two
    slices (64 + a partial block), into a buffer that never holds more than one."""
    monkeypatch.setenv(ENV, "16")
    if sliced:
        monkeypatch.setattr(footprint, "WIDEN_SLICE_BYTES", 64 * 256 * 2)
        kernel_choice.release_reused_buffers()         # none left by an earlier test
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(72, 256, generator=generator), torch.randn(72, generator=generator)
    if kind == "fp32":
        weight = weight.to(torch.bfloat16).float()
    with use_level(level):
        layer = PackedLinear(weight, bias, kind, dtype=torch.float32 if kind == "fp32" else torch.bfloat16, group_size=64)
        assert layer.layout == "native"
        taken = []
        dense_forward = layer.dense_forward
        layer.dense_forward = lambda x, dtype: taken.append(x.shape[0]) or dense_forward(x, dtype)
        for dtype in {"bf16": (torch.bfloat16,), "fp32": (torch.float32,)}.get(kind, (torch.bfloat16, torch.float32)):
            for rows in (20, 8):
                x = torch.randn(rows, 256, generator=generator).to(dtype)
                y = layer(x)
                reference = torch.nn.functional.linear(x.float(), layer.dense_weight(), bias)
                error = ((y.float() - reference).norm() / reference.norm()).item()
                assert y.dtype == dtype and error < (0.01 if dtype == torch.bfloat16 or kind not in ("bf16", "fp32")
                                                     else 1e-5)
    assert taken == [20] * (1 if kind in ("bf16", "fp32") else 2)
    if sliced:
        assert max(buffer.numel() for buffer in kernel_choice._widening.buffers.values()) == 64 * 256


@pytest.mark.parametrize("level", [*native.LEVELS, "torch"])
def test_widened_weights_are_the_packed_values(level):
    """The kernels' ``widen_weight_`` at each level (and torch's unpacking without them): exactly the packed
    values, as fp32 and as bf16 rounded once; odd N and K, a last partial block, every kind."""
    generator = torch.Generator().manual_seed(5)
    with use_level(level) if level != "torch" else native.prefer_native(False):
        for kind, (n, k) in (("bf16", (70, 129)), ("bf16", (64, 128)), ("int8", (70, 96)), ("int4", (130, 128)),
                             ("int6", (130, 128))):
            with native.prefer_native(level if level != "torch" else True):
                layer = PackedLinear(torch.randn(n, k, generator=generator), None, kind, group_size=32)
            expected = layer.dense_weight()
            assert expected.shape == (n, k)
            assert torch.equal(layer.widened_weight(torch.float32), expected)
            assert torch.equal(layer.widened_weight(torch.bfloat16), expected.to(torch.bfloat16))
            for start, end in ((0, 64), (64, n), (0, n)) if n > 64 else ():   # whole blocks, the last one partial
                assert torch.equal(layer.widened_weight(torch.float32, channels=(start, end)), expected[start:end])
            with pytest.raises(ValueError, match="multiple of 64"):
                layer.widened_weight(torch.float32, channels=(10, n))


def test_widen_weight_refuses_a_weight_that_does_not_match():
    if not hasattr(native.ops(), "widen_weight_"):
        pytest.skip("the xlaunch.llm kernels are not built (python -m xlaunch.llm.native)")
    layer = PackedLinear(torch.randn(70, 96), None, "int8")
    with pytest.raises(RuntimeError, match="widen_weight_"):
        native.ops().widen_weight_(torch.empty(70, 96), layer.weight, None, 0)           # no scales
    with pytest.raises(RuntimeError, match="widen_weight_"):
        native.ops().widen_weight_(torch.empty(200, 96), layer.weight, layer.scales, 0)  # another N
    with pytest.raises(RuntimeError, match="widen_weight_"):
        native.ops().widen_weight_(torch.empty(70, 96, dtype=torch.float16), layer.weight, layer.scales, 0)


def test_the_reused_buffer_is_per_thread_and_grows():
    import threading

    from xlaunch.llm.kernel_choice import reused_buffer

    first = reused_buffer(4, 8, torch.float32)
    assert first.shape == (4, 8) and reused_buffer(2, 8, torch.float32).data_ptr() == first.data_ptr()
    grown = reused_buffer(16, 8, torch.float32)
    assert grown.shape == (16, 8) and reused_buffer(4, 8, torch.float32).data_ptr() == grown.data_ptr()
    assert reused_buffer(4, 8, torch.bfloat16).data_ptr() != grown.data_ptr()
    other = []
    thread = threading.Thread(target=lambda: other.append(reused_buffer(4, 8, torch.float32).data_ptr()))
    thread.start()
    thread.join()
    assert other and other[0] != grown.data_ptr()


@pytest.mark.parametrize("found", [None, 32])
def test_a_measurement_the_kernels_win_keeps_no_widened_weight(monkeypatch, found):
    """The dense probes widen into this thread's buffer; when the answer is "never" the buffer is dropped
    (no 64 MiB kept for a route that will not run), else kept for the calls the dense route will take."""
    from xlaunch.llm.kernel_choice import reused_buffer

    monkeypatch.setattr(footprint, "native_bf16", lambda: True)

    def measure(kernel, dense, n, k, dtype, timer=None):
        reused_buffer(n, k, dtype).fill_(1)
        return found

    monkeypatch.setattr(kernel_choice, "measure", measure)
    kernel, dense, calls = routes()
    kernel_choice.release_reused_buffers()
    kernel_choice.routed("avx2", "int8", 256, 64, 0, kernel, dense)(torch.zeros(40, 64, dtype=torch.bfloat16))
    buffers = kernel_choice._widening.__dict__.get("buffers", {})
    assert (torch.bfloat16 in buffers) is (found is not None)
    assert [call[0] for call in calls] == ["kernel" if found is None else "dense"]

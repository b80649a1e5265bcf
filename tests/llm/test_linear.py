"""PackedLinear: every kind against a float reference on odd shapes, the compiled kernels (at every
ISA level this CPU executes) against ATen's paths, and the INT8/INT4/INT6 error bound against
"dequantize, then multiply in bf16"."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from kernel_levels import use_level  # noqa: E402

from xlaunch.llm import native  # noqa: E402
from xlaunch.llm.linear import (PackedLinear, activation_block, dequantize, pack_int6, quantize_int4,  # noqa: E402
                                quantize_int6, quantize_int8, round_activations, unpack_int6)

pytestmark = pytest.mark.torch
F = torch.nn.functional
LAYOUTS = ("native", "aten")


@pytest.fixture(params=native.LEVELS)
def level(request):
    """Each compiled ISA level in turn: its kernels run within the test."""
    with use_level(request.param):
        yield request.param


@pytest.fixture(params=[*(f"native-{lv}" for lv in native.LEVELS), "aten"])
def layout(request):
    """``native`` (each level's kernels in turn, run within the test) or ``aten``."""
    lv = request.param.partition("-")[2]
    with use_level(lv) if lv else contextlib.nullcontext():
        yield "native" if lv else "aten"


def build(layout: str, weight, bias, kind: str, **kw) -> PackedLinear:
    """A layer of ``layout``: native with the level in use (the fixtures above), else ATen's."""
    if layout == "native" and native.ops() is None:
        pytest.skip("the xlaunch.llm kernels are not built (python -m xlaunch.llm.native)")
    with native.prefer_native(False) if layout == "aten" else contextlib.nullcontext():
        layer = PackedLinear(weight, bias, kind, **kw)
    assert layer.layout == layout
    return layer


def max_error(y, ref) -> float:
    return (y.float() - ref).abs().max().item()


def rounds_activations(layer: PackedLinear) -> bool:
    """Whether this layer's kernel takes its activations rounded per block of 32 (integer dot products: every
    level but baseline), at every row count."""
    return layer.layout == "native" and layer.kind in ("int8", "int4", "int6") and bool(activation_block())


# bf16 K = 290: 145 pairs, the AVX2 kernel's passes in chunks of 64 pairs and a last one of 17.
@pytest.mark.parametrize("kind, n, k", [("bf16", 70, 33), ("bf16", 130, 256), ("bf16", 70, 290), ("int8", 70, 33),
                                        ("int8", 130, 96), ("int4", 70, 96), ("int4", 130, 256), ("int6", 70, 96),
                                        ("int6", 130, 256)])
def test_each_kind_computes_x_times_its_dense_weight(layout, kind, n, k):
    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k), torch.randn(n)
    layer = build(layout, weight, bias, kind, group_size=32)
    dense = layer.dense_weight()
    assert dense.shape == (n, k) and dense.dtype == torch.float32
    tolerance = {"bf16": 0.01, "int8": 0.02, "int6": 0.05, "int4": 0.2}[kind]
    assert max_error(dense, weight) <= tolerance * weight.abs().max()
    for m in (1, 2, 3, 17):      # every tile height: 1 to 4 rows (17 = four tiles of 4, then 1)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, k).to(dtype)
            y = layer(x)
            assert y.shape == (m, n) and y.dtype == dtype
            rounded = rounds_activations(layer)   # then exact for the rounded activations
            ref = F.linear(round_activations(x) if rounded else x.float(), dense, layer.bias.float())
            exact = dtype == torch.float32 and (rounded or kind == "int8" or (kind != "bf16" and layout == "aten"))
            rounding = 1e-5 if exact else 2 ** -7   # bf16 outputs, or activations rounded to bf16
            assert max_error(y, ref) <= rounding * ref.abs().max() + 1e-4, (m, dtype)


@pytest.mark.parametrize("kind, n, k", [("fp32", 70, 33), ("bf16", 70, 33), ("bf16", 130, 256), ("int8", 70, 33),
                                        ("int8", 130, 96), ("int6", 70, 64), ("int6", 130, 192)])
@pytest.mark.parametrize("packed", LAYOUTS)
def test_rows_are_the_dense_weights_rows_in_every_layout(packed, kind, n, k):
    """A tied embedding's lookup in its packed lm_head: exactly the rows of the weight the layer stands for
    (the stored values for fp32/bf16, each int8 row times its channel's scale, int6 rows times their groups'),
    last block's rows included, channels of both halves of a block (int6's high bits lie by half)."""
    torch.manual_seed(n + k)
    if kind == "fp32" and packed == "native":
        pytest.skip("fp32 layers have one layout")
    with native.prefer_native(False) if packed == "aten" else contextlib.nullcontext():
        if packed == "native" and native.ops() is None:
            pytest.skip("the xlaunch.llm kernels are not built (python -m xlaunch.llm.native)")
        layer = PackedLinear(torch.randn(n, k), None, kind, group_size=64)
    assert layer.layout == ("aten" if kind == "fp32" else packed)
    ids = torch.tensor([[0, n - 1, 63 % n, 5], [n // 2, 1, n - 2, 33]])
    rows = layer.rows(ids)
    expected = torch.bfloat16 if kind == "bf16" else torch.float32
    assert rows.shape == (2, 4, k) and rows.dtype == expected
    assert torch.equal(rows.float(), layer.dense_weight()[ids])
    with pytest.raises(ValueError, match="int4"):
        PackedLinear(torch.randn(64, 64), None, "int4", group_size=32).rows(ids % 64)


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4", "int6"])
def test_the_kernels_agree_with_the_aten_paths_on_3d_input(kind, level):
    torch.manual_seed(1)
    weight, bias = torch.randn(200, 128), torch.randn(200)
    fast, slow = (build(layout, weight, bias, kind, group_size=64) for layout in LAYOUTS)
    assert torch.equal(fast.dense_weight(), slow.dense_weight())
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    y_fast, y_slow = fast(x), slow(x)
    assert y_fast.shape == y_slow.shape == (2, 5, 200)
    assert max_error(y_fast, y_slow.float()) <= 2 ** -6 * y_slow.float().abs().max()
    with native.prefer_native(False):   # a native layer without its kernels dequantizes and multiplies
        assert max_error(fast(x), y_slow.float()) <= 2 ** -6 * y_slow.float().abs().max()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groups_quantize_each_group_on_its_own(group_size, level):
    torch.manual_seed(group_size)
    weight = torch.randn(64, 256)
    weight[:, :group_size] *= 100.0    # one loud group must not flatten the others
    q, scale = quantize_int4(weight, group_size)
    assert scale.shape == (64, 256 // group_size) and int(q.min()) >= -8 and int(q.max()) <= 7
    for layout in LAYOUTS:
        layer = build(layout, weight, None, "int4", group_size=group_size)
        assert torch.allclose(layer.dense_weight(), dequantize(q, scale))
        quiet = (layer.dense_weight() - weight)[:, group_size:].abs().max()
        assert quiet <= weight[:, group_size:].abs().max() / 7


@pytest.mark.parametrize("kind", ["int8", "int4", "int6"])
def test_quantized_error_stays_within_1_5x_of_dequantize_then_bf16(layout, kind):
    """Error against the fp32 layer of the original weights, over a layer with outlier activations."""
    torch.manual_seed(7)
    weight = torch.randn(256, 512) * 0.05
    x = torch.randn(4, 512)
    x[:, 3] *= 50.0
    x = x.to(torch.bfloat16)
    exact = F.linear(x.float(), weight)
    q, scale = {"int8": lambda: quantize_int8(weight), "int4": lambda: quantize_int4(weight, 32),
                "int6": lambda: quantize_int6(weight, 32)}[kind]()
    reference = F.linear(x, dequantize(q, scale).to(torch.bfloat16)).float()
    layer = build(layout, weight, None, kind, group_size=32)
    if rounds_activations(layer):   # the outlier's block of 32 is rounded on its scale: compare like with like
        reference = F.linear(round_activations(x), dequantize(q, scale).to(torch.bfloat16).float())
    assert max_error(layer(x), exact) <= 1.5 * max_error(reference, exact)


@pytest.mark.parametrize("kind, k, group_size, rows", [("int8", 1000, 32, 3), ("int8", 37, 32, 3), ("int4", 512, 32, 3),
                                                      ("int4", 640, 128, 1), ("int4", 512, 64, 2), ("int6", 512, 64, 3),
                                                      ("int6", 640, 128, 1), ("int6", 2048, 64, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_kernels_stay_within_the_activation_rounding_bound_of_float64(kind, k, group_size, rows, dtype, level):
    """Against float64 with the layer's own (dequantized) weights: the kernels that round activations
    (AVX2) stay within sum_k |w[n, k]| * d(k) / 2 (d: the scale of k's block of 32), plus fp32
    accumulation and bf16 output rounding; the others within fp32 accumulation (INT8) or bf16 rounding."""
    torch.manual_seed(k)
    weight = torch.randn(130, k) * 0.05
    x = torch.randn(rows, k)   # 1 row: decode's kernel; 2 and 3: the row pairs of prefill
    x[:, 5] *= 30.0
    x = x.to(dtype)
    layer = build("native", weight, None, kind, group_size=group_size)
    dense = layer.dense_weight().double()
    exact = x.double() @ dense.T
    slack = 1e-5 * exact.abs().max().item() + 1e-5
    y = layer(x).double()
    if rounds_activations(layer):
        blocks = x.float().abs().reshape(rows, -1).new_zeros(rows, -(-k // 32) * 32)
        blocks[:, :k] = x.float().abs()
        d = blocks.reshape(rows, -1, 32).amax(-1) / 127.0
        half_step = d.repeat_interleave(32, dim=1)[:, :k].double() / 2
        output = exact.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0.0   # y rounded to bf16
        bound = half_step @ dense.abs().T + output + slack
        assert ((y - exact).abs() <= bound).all()
        assert (y - exact).abs().max() > 1e-3 * bound.max()    # the activations really were rounded
    else:
        fp32_exact = dtype == torch.float32 and kind == "int8"   # INT4 and INT6 round fp32 activations to bf16
        assert (y - exact).abs().max() <= (slack if fp32_exact else 2 ** -7 * exact.abs().max().item())


def test_bad_group_sizes_and_kinds_are_refused_clearly():
    weight = torch.randn(16, 100)
    for size in (16, 64.0, "64"):       # 64.0 failed inside a reshape
        with pytest.raises(ValueError, match="group_size must be one of"):
            PackedLinear(weight[:, :64], None, "int4", group_size=size)
    with pytest.raises(ValueError, match="not a multiple of the INT4 group size 32"):
        PackedLinear(weight, None, "int4", group_size=32)
    with pytest.raises(ValueError, match="weights must be one of"):
        PackedLinear(weight, None, "int2")


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_an_input_of_another_width_or_an_integer_dtype_is_one_value_error(layout, kind):
    """The INT8 kernel took a width up to the next multiple of 4 as its own (70 inputs: 71 gave numbers), others
    failed inside a kernel or ATen's GEMM, and integer inputs came back truncated to integers."""
    weight = torch.randn(100, 96 if kind == "int4" else 70).bfloat16().float()     # fp32: bf16 values, native too
    layer = build(layout, weight, None, kind, dtype=torch.float32, group_size=32)
    k = layer.in_features
    for x in (torch.randn(3, k + 1), torch.randn(3, k - 1), torch.ones(3, k, dtype=torch.long), torch.tensor(1.0)):
        with pytest.raises(ValueError, match=rf"^PackedLinear: the input must be a floating-point \[\.\.\., {k}\] tensor"):
            layer(x)
    assert layer(torch.randn(2, 3, k)).shape == (2, 3, 100)


def test_from_linears_concatenates_outputs_and_fills_missing_biases():
    torch.manual_seed(3)
    a, b = torch.nn.Linear(96, 40, bias=True), torch.nn.Linear(96, 24, bias=False)
    layer = PackedLinear.from_linears([a, b], "bf16")
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = torch.cat([a(x.float()), b(x.float())], dim=-1)
    assert layer.out_features == 64 and max_error(layer(x), ref) <= 2 ** -6 * ref.abs().max()


def test_the_operators_have_shapes_for_fake_tensors():
    ops = native.ops()
    if ops is None:
        pytest.skip("the xlaunch.llm kernels are not built")
    layer = PackedLinear(torch.randn(100, 64), None, "int4", group_size=32)
    meta = lambda t: torch.empty_like(t, device="meta")   # noqa: E731
    x = torch.empty(2, 3, 64, dtype=torch.bfloat16, device="meta")
    y = ops.int4_linear(x, meta(layer.weight), meta(layer.scales), None, 100, 32)
    assert y.shape == (2, 3, 100) and y.device.type == "meta" and y.dtype == torch.bfloat16
    layer = PackedLinear(torch.randn(100, 64), None, "int6", group_size=32)
    y = ops.int6_linear(x, meta(layer.weight), meta(layer.scales), None, 100, 32)
    assert y.shape == (2, 3, 100) and y.device.type == "meta" and y.dtype == torch.bfloat16
    x32 = torch.empty(2, 3, 64, device="meta")
    y = ops.fp32_linear(x32, torch.empty(100, 64, device="meta"), None)
    assert y.shape == (2, 3, 100) and y.device.type == "meta" and y.dtype == torch.float32
    layer = PackedLinear(torch.randn(100, 64).to(torch.bfloat16).float(), None, "fp32", dtype=torch.float32)
    y = ops.bf16_linear(x32, meta(layer.weight), None, 100)      # bf16-valued fp32 weights, fp32 activations
    assert y.shape == (2, 3, 100) and y.device.type == "meta" and y.dtype == torch.float32


@pytest.mark.parametrize("kind", ["int8", "int4", "int6"])
def test_bf16_activations_quantize_to_what_their_fp32_values_do_on_every_thread(kind, level):
    """The integer kernels quantize bf16 rows without an fp32 copy of the input, rows shared between the
    threads: the outputs are those of the same values given in fp32 (rounded to bf16), bit for bit, for one
    row, a few, and more rows than one thread takes (70 rows of 2048: 32 a thread at least)."""
    if native.ops() is None or native.ops().linear_activation_block() == 0:
        pytest.skip("this level multiplies the activations as they are (no quantization)")
    layer = PackedLinear(torch.randn(96, 2048) * 0.02, torch.randn(96), kind, group_size=32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (1, 5, 70):
            x = torch.randn(rows, 2048).to(torch.bfloat16)
            assert torch.equal(layer(x), layer(x.float()).to(torch.bfloat16)), rows
    finally:
        torch.set_num_threads(threads)


def test_int6_packing_round_trips_every_value_in_every_position():
    """Every value of [-32, 31] at every (channel, k) position of a step, both halves of a block and a padded
    last block: pack_int6 then unpack_int6 gives the values back, and the bytes follow csrc/linear.h."""
    n, k = 70, 64 * 4
    q = ((torch.arange(n * k).reshape(n, k) * 7 + torch.arange(n)[:, None]) % 64 - 32).to(torch.int8)
    packed = pack_int6(q)
    assert packed.shape == (2, k // 4, 192) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int6(packed, n), q)
    u = q.to(torch.int16) + 32
    for c, kk in ((0, 0), (5, 3), (31, 6), (32, 1), (63, 254), (69, 255)):
        step = packed[c // 64, kk // 4].to(torch.int16)
        p = 2 * (c % 64) + kk % 2
        nibble = step[p] & 15 if kk % 4 < 2 else step[p] >> 4
        high = (step[128 + p % 64] >> (0 if p < 64 else 4)) & 15
        top = high & 3 if kk % 4 < 2 else high >> 2
        assert int(nibble | (top << 4)) == int(u[c, kk]), (c, kk)


def test_int6_extremes_stay_exact_in_the_integer_sums(level):
    """Every weight at -32 or 31 and every activation at its block's largest: the kernels' integer sums (AVX2's
    16-bit pair sums included) do not saturate; the output is the exact product."""
    k = 2048
    for value in (31, -32):
        q = torch.full((64, k), value, dtype=torch.int8)
        layer = PackedLinear.from_packed(pack_int6(q), torch.ones(1, k // 64, 64), None, "int6", torch.float32, 64,
                                         64, k, "native")
        if native.ops() is None:
            pytest.skip("the xlaunch.llm kernels are not built")
        for sign in (1.0, -1.0):
            x = torch.full((2, k), sign)
            assert torch.equal(layer(x), torch.full((2, 64), sign * value * k)), (value, sign)


@pytest.mark.parametrize("n, k", [(70, 33), (130, 256), (3, 1000)])
def test_fp32_weights_take_the_kernels_for_a_few_rows_and_atens_gemm_for_more(level, n, k, monkeypatch):
    """ATen's GEMV runs on one thread, so up to FP32_KERNEL_ROWS rows the kernels' fp32_linear computes an fp32
    layer (its channels split between the threads), from there ATen's GEMM; both within fp32 rounding of float64."""
    import xlaunch.llm.linear as linear

    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k), torch.randn(n)
    layer = PackedLinear(weight, bias, "fp32", dtype=torch.float32)
    aten_calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: aten_calls.append(a[0].shape) or real(*a))
    for shape in ((1, k), (2, k), (3, k), (2, 2, k), (5, k), (17, k)):
        x = torch.randn(*shape)
        ref = (x.double() @ weight.double().T + bias.double()).float()
        y = layer(x)
        assert y.shape == (*shape[:-1], n) and y.dtype == torch.float32
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-5, shape
        rows = x.numel() // k
        assert bool(aten_calls) == (rows > linear.FP32_KERNEL_ROWS), (shape, aten_calls)
        aten_calls.clear()


@pytest.mark.parametrize("n, k", [(70, 33), (130, 290)])
def test_an_fp32_layer_of_bf16_values_is_stored_as_bf16_and_multiplied_in_fp32(level, n, k):
    """A bf16 checkpoint's weights in fp32 lose nothing as bf16: stored so (half the bytes a token reads), and
    multiplied with the fp32 activations as they are, not rounded to bf16 (vdpbf16ps would round them)."""
    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k).to(torch.bfloat16).float(), torch.randn(n)
    layer = PackedLinear(weight, bias, "fp32", dtype=torch.float32)
    assert (layer.layout, layer.weight.dtype) == ("native", torch.bfloat16)
    assert torch.equal(layer.dense_weight(), weight)
    assert torch.equal(layer.rows(torch.tensor([[0, n - 1]])), weight[[0, n - 1]].unsqueeze(0))
    for m in (1, 2, 3, 5, 17):
        x = torch.randn(m, k)                       # not bf16 values: a rounding would show (2^-9 relative)
        ref = (x.double() @ weight.double().T + bias.double()).float()
        y = layer(x)
        assert y.dtype == torch.float32 and (y - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-5, m
    noisy = weight.clone()
    noisy[0, 0] += 1e-4                             # one value that is not a bf16 value: fp32 as it is
    assert PackedLinear(noisy, bias, "fp32", dtype=torch.float32).weight.dtype == torch.float32

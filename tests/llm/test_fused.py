"""xlaunch.llm.fused: each operator's compiled kernel and pure-torch path against an independent
straightforward formula (float64), in fp32 and bf16, odd shapes (GQA, prefill and decode, a start
inside the cache, padding), and the in-place semantics."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kernel_levels import use_level  # noqa: E402

from xlaunch.llm import fused, native  # noqa: E402

pytestmark = pytest.mark.torch

NATIVE = native.available()
RUNNABLE = native.runnable_levels()
# Each compiled ISA level (skipped by kernel_levels.use_level where this CPU cannot run it or it is not
# built), then the torch path.
PATHS = [*(pytest.param(level, id=f"native-{level}") for level in native.LEVELS), pytest.param(False, id="torch")]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3)}


@pytest.fixture(params=PATHS)
def path(request):
    if not request.param:
        with native.prefer_native(False):
            yield False
        return
    with use_level(request.param):
        assert native.ops().compiled_isa() == request.param
        yield request.param


def close(actual, expected, dtype):
    """|actual - expected| <= atol + rtol * |expected| everywhere (torch.testing's first call costs seconds)."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape
    excess = (actual - expected).abs() - (TOL[dtype]["atol"] + TOL[dtype]["rtol"] * expected.abs())
    assert not excess.isnan().any() and excess.max() <= 0, f"off by up to {excess.max().item()} beyond tolerance"


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def tables(b, s, d, start):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.arange(start, start + s, dtype=torch.float64)[None, :].expand(b, s)
    angles = torch.cat((pos[..., None] * inv, pos[..., None] * inv), dim=-1)
    return angles.cos().float(), angles.sin().float()


def attention_formula(q, k_cache, v_cache, start, pad, scale):
    """Per query row: softmax over the allowed keys (explicit loop-free float64 math with a mask)."""
    b, s, h, d = q.shape
    g, total = k_cache.shape[1], start + q.shape[1]
    k = k_cache[:, :, :total].double().repeat_interleave(h // g, dim=1)
    v = v_cache[:, :, :total].double().repeat_interleave(h // g, dim=1)
    scores = torch.einsum("bshd,bhtd->bhst", q.double(), k) * scale
    allowed = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]
    allowed = allowed[None, None] & (~pad[:, None, None, :total] if pad is not None else True)
    weights = torch.where(allowed, scores.exp(), torch.zeros(()))
    denom = weights.sum(-1, keepdim=True)
    probs = torch.where(denom > 0, weights / denom.clamp_min(1e-300), torch.zeros(()))
    return torch.einsum("bhst,bhtd->bshd", probs, v).reshape(b, s, h * d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_the_residual_add(path, dtype):
    torch.manual_seed(0)
    x, res = torch.randn(3, 5, 200, dtype=dtype), torch.randn(3, 5, 200, dtype=dtype)
    w = (torch.rand(200) + 0.5).to(dtype)

    def formula(t):
        t = t.double()
        return w.double() * (t / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())

    out = fused.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, formula(x), dtype)
    assert fused.rms_norm(x, w.float(), 1e-6).dtype == torch.float32   # promoted as weight * normed
    new_res = (res.double() + x.double()).to(dtype)
    kept = res
    out = fused.add_rms_norm(x, res, w, 1e-6)
    assert res is kept
    assert torch.equal(res, new_res)                                     # rounded once, in place
    close(out, formula(new_res), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [5, 197, 203])
def test_widths_past_whole_vectors_and_fp16(path, dtype, width):
    """Rows whose width leaves a partial vector of 16 (the kernels' masked loads and stores: 5, 197 and
    203 leave 5, 5 and 11 values) in each storage dtype, fp16 included, against float64."""
    torch.manual_seed(7)
    x, res = torch.randn(3, width, dtype=dtype), torch.randn(3, width, dtype=dtype)
    w = (torch.rand(width) + 0.5).to(dtype)
    t = (res.double() + x.double()).to(dtype).double()
    expected = w.double() * (t / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())
    close(fused.add_rms_norm(x, res, w, 1e-6), expected, dtype)
    assert torch.equal(res, t.to(dtype))
    gate_up = torch.randn(2, 2 * width, dtype=dtype) * 3
    g, u = gate_up.double().chunk(2, dim=-1)
    close(fused.silu_mul(gate_up), g * torch.sigmoid(g) * u, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [40, 72])
def test_cache_attention_of_heads_past_whole_vectors(path, dtype, d):
    """Head sizes of 40 and 72 (a partial vector of 8 at the end of each row), decode and a few rows."""
    torch.manual_seed(8)
    b, h, g, length = 2, 4, 2, 70
    for s, start in ((1, 66), (3, 20)):
        q = torch.randn(b, s, h, d, dtype=dtype)
        kc, vc = torch.randn(b, g, length, d, dtype=dtype), torch.randn(b, g, length, d, dtype=dtype)
        out = fused.cache_attention(q, kc, vc, start, None, 1 / math.sqrt(d))
        assert out.dtype == dtype
        close(out, attention_formula(q, kc, vc, start, None, 1 / math.sqrt(d)), dtype)


def test_a_level_runs_its_own_kernels_after_another_level_ran():
    """The operators are looked up per level: the first level a process used stayed in use for every
    later one (the level tests then ran one level's code under another's name)."""
    levels = [level for level in RUNNABLE if native.available(level)]
    if len(levels) < 2:
        pytest.skip(f"needs two built levels this CPU runs (has {', '.join(levels) or 'none'})")
    x = torch.randn(1, 2, 2, 64)
    cos, sin = tables(1, 2, 64, 0)
    for level in (levels[0], levels[-1], levels[0]):
        with native.prefer_native(level):
            fused.rope_(x.clone(), cos, sin)
            assert fused._kernel("rope_") is native.ops_at(level).rope_.default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(path, dtype):
    torch.manual_seed(1)
    gate_up = torch.randn(4, 2 * 88, dtype=dtype) * 4
    g, u = gate_up.double().chunk(2, dim=-1)
    out = fused.silu_mul(gate_up)
    assert out.shape == (4, 88) and out.dtype == dtype
    close(out, g * torch.sigmoid(g) * u, dtype)


def test_silu_mul_across_exps_whole_range(path):
    """The kernels' own exp (one polynomial on every level) over the range it is defined on, [-88, 88.7]:
    underflow to 0 below -87.3 included, in fp32 against float64; a NaN gate stays NaN."""
    gate = torch.cat([torch.linspace(-88, 88.6, 4001), torch.tensor([-87.3, -87.2, 0.0, 1e-30, -1e-30])])
    up = torch.linspace(-3, 3, gate.numel())
    out = fused.silu_mul(torch.cat([gate, up])[None])
    close(out[0], gate.double() * torch.sigmoid(gate.double()) * up.double(), torch.float32)
    assert fused.silu_mul(torch.tensor([[float("nan"), 1.0]]))[0, 0].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_rope_in_place_on_a_view_of_fused_qkv(path, dtype, d):
    torch.manual_seed(2)
    b, s, h, g = 2, 7, 4, 2
    qkv = torch.randn(b, s, (h + 2 * g) * d, dtype=dtype)
    q = qkv[..., :h * d].view(b, s, h, d)                                  # strided: a view, not a copy
    expected = q.double() * tables(b, s, d, 3)[0].double()[:, :, None] + \
        rotate_half(q.double()) * tables(b, s, d, 3)[1].double()[:, :, None]
    untouched = qkv[..., h * d:].clone()
    cos, sin = tables(b, s, d, 3)
    assert fused.rope_(q, cos, sin) is q
    close(qkv[..., :h * d].view(b, s, h, d), expected, dtype)
    assert torch.equal(qkv[..., h * d:], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_the_cache_writes(path, dtype):
    torch.manual_seed(3)
    b, s, h, g, d, length, start = 2, 3, 4, 2, 64, 16, 5
    q, k, v = (torch.randn(b, s, n, d, dtype=dtype) for n in (h, g, g))
    cos, sin = tables(b, s, d, start)
    q2, k_before = q.clone(), k.clone()
    kc, vc = torch.zeros(b, g, length, d, dtype=dtype), torch.zeros(b, g, length, d, dtype=dtype)
    fused.rope_write_cache_(q, k, v, cos, sin, kc, vc, start)
    fused.rope_(q2, cos, sin)
    k_rot = fused.rope_(k.clone(), cos, sin)
    assert torch.equal(q, q2) and torch.equal(k, k_before)
    assert torch.equal(kc[:, :, start:start + s], k_rot.transpose(1, 2))
    assert torch.equal(vc[:, :, start:start + s], v.transpose(1, 2))
    assert not kc[:, :, :start].any() and not vc[:, :, start + s:].any()
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    fused.write_cache_(kc2, vc2, k, v, start)
    assert torch.equal(kc2[:, :, start:start + s], k.transpose(1, 2)) and torch.equal(vc2, vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s,start", [(1, 0), (1, 9), (7, 0), (7, 5)])
@pytest.mark.parametrize("padded", [False, True])
def test_cache_attention(path, dtype, d, s, start, padded):
    torch.manual_seed(4)
    b, h, g, length = 2, 4, 2, 24
    q = torch.randn(b, s, h, d, dtype=dtype)
    kc, vc = torch.randn(b, g, length, d, dtype=dtype), torch.randn(b, g, length, d, dtype=dtype)
    pad = None
    if padded:   # row 0 unpadded; row 1 left-padded: its first keys are padding
        pad = torch.zeros(b, start + s, dtype=torch.bool)
        pad[1, :max(1, start + s - 2)] = True
    scale = 1 / math.sqrt(d)
    out = fused.cache_attention(q, kc, vc, start, pad, scale)
    assert out.shape == (b, s, h * d) and out.dtype == dtype
    assert not out.isnan().any()
    close(out, attention_formula(q, kc, vc, start, pad, scale), dtype)


@pytest.mark.parametrize("padded", [False, True])
def test_a_prefill_runs_attention_by_sdpa_and_a_few_rows_by_the_kernel(path, padded):
    """From fused.SDPA_ROWS query rows ATen's SDPA computes the attention (5x faster at 1024 rows here),
    below it the level's kernel: both against the formula, and the runtime's binding chooses the same."""
    from xlaunch.llm.decoder import Kernels
    from xlaunch.llm.linear import PackedLinear

    torch.manual_seed(7)
    b, h, g, d, start = 2, 4, 2, 64, 3
    for s in (fused.SDPA_ROWS - 1, fused.SDPA_ROWS + 9):
        q = torch.randn(b, s, h, d)
        kc, vc = torch.randn(b, g, start + s + 4, d), torch.randn(b, g, start + s + 4, d)
        pad = None
        if padded:
            pad = torch.zeros(b, start + s, dtype=torch.bool)
            pad[1, :5] = True
        out = fused.cache_attention(q, kc, vc, start, pad, 0.125)
        close(out, attention_formula(q, kc, vc, start, pad, 0.125), torch.float32)
        by_sdpa = fused._torch_cache_attention(q, kc, vc, start, pad, 0.125)
        if s >= fused.SDPA_ROWS:
            assert torch.equal(out, by_sdpa)
        elif path:
            assert torch.equal(out, native.ops().cache_attention(q, kc, vc, start, pad, 0.125))
        if path:
            bound = Kernels(native.ops(), [], PackedLinear(torch.randn(64, 64), None, "bf16")).cache_attention
            assert torch.equal(bound(q, kc, vc, start, pad, 0.125), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_a_whole_prompt_takes_sdpas_causal_path_and_the_rest_a_mask(monkeypatch, dtype, heads, kv_heads):
    """No cached slot before it and no window: SDPA's own causal path (no mask made, K/V heads shared), once,
    or once per row after each row's left padding (a padding row attends nothing: zeros). A continued prompt,
    padding that is not a prefix, or a window: the explicit mask. Each against the formula."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    torch.manual_seed(11)
    b, s, d = 3, fused.SDPA_ROWS + 9, 64
    causal, masked = (True, True), (False, False)
    for start, padding, window, expected in ((0, None, None, [causal]), (0, (0, 5, s), None, [causal] * 2),
                                             (3, None, None, [masked]), (0, (0, 5, 0), None, [causal] * 3),
                                             (0, "middle", None, [masked]), (0, None, s - 5, [masked])):
        q = torch.randn(b, s, heads, d).to(dtype)
        kc, vc = torch.randn(b, kv_heads, start + s + 4, d).to(dtype), torch.randn(b, kv_heads, start + s + 4, d).to(dtype)
        pad = None
        if padding == "middle":
            pad = torch.zeros(b, start + s, dtype=torch.bool)
            pad[1, 7] = True
        elif padding is not None:          # each row's count of left padding slots (s: all of it)
            pad = torch.arange(start + s)[None, :] < torch.tensor(padding)[:, None]
        calls.clear()
        out = fused._torch_cache_attention(q, kc, vc, start, pad, 0.125, window)
        assert calls == expected, (start, padding, window)
        assert out.shape == (b, s, heads * d) and out.dtype == dtype and not out.isnan().any()
        if window is None:
            close(out, attention_formula(q, kc, vc, start, pad, 0.125), dtype)
        if padding is not None and padding != "middle" and padding[2] == s:
            assert not out[2].any()        # a row of padding only: zeros, as the masked path gives


def test_attention_of_a_row_whose_keys_are_all_padding_but_itself(path):
    torch.manual_seed(5)
    b, s, h, g, d, start = 1, 4, 4, 2, 64, 6
    q = torch.randn(b, s, h, d)
    kc, vc = torch.randn(b, g, 16, d), torch.randn(b, g, 16, d)
    pad = torch.ones(b, start + s, dtype=torch.bool)
    pad[0, start:] = False               # each new token sees only the new tokens: the first one only itself
    out = fused.cache_attention(q, kc, vc, start, pad, 0.125)
    assert not out.isnan().any()
    # the first new token attends only its own slot: its output is that slot's value, per head
    close(out[0, 0].view(h, d), vc[0, :, start].repeat_interleave(h // g, dim=0), torch.float32)
    pad[0, start] = True                 # now the first token sees nothing at all: zeros, as documented
    out = fused.cache_attention(q, kc, vc, start, pad, 0.125)
    assert not out.isnan().any() and not out[0, 0].any()
    close(out[:, 1:], attention_formula(q, kc, vc, start, pad, 0.125)[:, 1:], torch.float32)


@pytest.mark.skipif(not NATIVE, reason="kernels not built")
def test_decode_over_a_long_cache_splits_the_keys_and_agrees():
    torch.manual_seed(6)
    b, h, g, d, start = 1, 2, 1, 64, 1100          # B x G = 1: split over the cache on any thread count
    q = torch.randn(b, 1, h, d, dtype=torch.bfloat16)
    kc, vc = torch.randn(b, g, 1200, d, dtype=torch.bfloat16), torch.randn(b, g, 1200, d, dtype=torch.bfloat16)
    expected = attention_formula(q, kc, vc, start, None, 0.125)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            with native.prefer_native(True):
                close(fused.cache_attention(q, kc, vc, start, None, 0.125), expected, torch.bfloat16)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.skipif(not NATIVE, reason="kernels not built")
def test_the_kernels_have_meta_kernels_for_tracing():
    """Fake tensors (torch.compile) run the Meta kernels: shapes and dtypes without data."""
    meta = dict(device="meta")
    with native.prefer_native(True):
        x, w = torch.empty(2, 3, 64, dtype=torch.bfloat16, **meta), torch.empty(64, **meta)
        assert fused.rms_norm(x, w.bfloat16(), 1e-6).shape == (2, 3, 64)
        assert fused.add_rms_norm(x, x.clone(), w, 1e-6).dtype == torch.float32
        assert fused.silu_mul(x).shape == (2, 3, 32)
        q, kc = torch.empty(2, 3, 4, 64, **meta), torch.empty(2, 2, 8, 64, **meta)
        assert fused.cache_attention(q, kc, kc, 2, None, 0.1).shape == (2, 3, 256)
        fused.rope_write_cache_(q, kc.transpose(1, 2)[:, :3], kc.transpose(1, 2)[:, :3], x[..., :64].float(),
                                x[..., :64].float(), kc, kc.clone(), 2)

"""The AVX-512 VNNI integer kernels (xlaunch/llm/csrc/int_dot_avx512.h) on any x86 CPU: compiled against
SIMDe's portable AVX-512 and run on one packed block, against a float64 reference built from the packed
layouts' own packers. On an AVX-512 VNNI CPU the same kernels also run natively (test_linear.py's
avx512_vnni and avx512_bf16 levels); here they run where those levels cannot, such as the AVX2 VM."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import require  # noqa: E402

from xlaunch.llm.linear import pack_channels, pack_int4, pack_int6, pack_int8  # noqa: E402

pytestmark = pytest.mark.torch
HERE = Path(__file__).resolve().parent
CSRC = HERE.parent.parent / "xlaunch" / "llm" / "csrc"
SIMDE_HEADER = "/usr/include/simde/x86/avx512.h"
QBLOCK = 32


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The harness's shared library (about 4 s of g++)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to build the emulated kernels")
    require("SIMDe (libsimde-dev)", SIMDE_HEADER if Path(SIMDE_HEADER).is_file() else None)
    target = tmp_path_factory.mktemp("int_dot") / "int_dot_emulated.so"
    build = subprocess.run([compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{CSRC}",
                            str(HERE / "int_dot_emulated.cpp"), "-o", str(target)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-2000:]
    library = ctypes.CDLL(str(target))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.int8q.argtypes = [pointer, pointer, pointer, size, size, pointer, size, pointer]
    library.int4q.argtypes = [pointer, pointer, pointer, size, size, pointer, pointer, size, size, pointer]
    library.int6q.argtypes = library.int4q.argtypes
    return library


def ptr(t: "torch.Tensor") -> ctypes.c_void_p:
    """t's data for a call: the caller keeps t alive (a temporary's memory is freed before the call)."""
    assert t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


def activations(rows: int, k: int, extreme: bool = False):
    """Quantized rows as quantize_activations leaves them: q [rows, ldq] (zero past k), d, qsum per block."""
    ldq = -(-k // QBLOCK) * QBLOCK
    q = torch.zeros(rows, ldq, dtype=torch.int8)
    values = torch.full((rows, k), 127) if extreme else torch.randint(-127, 128, (rows, k))
    q[:, :k] = values.to(torch.int8)
    d = (torch.rand(rows, ldq // QBLOCK) + 0.01).float().contiguous()
    qsum = q.to(torch.int32).reshape(rows, -1, QBLOCK).sum(-1).to(torch.int32).contiguous()
    return q, d, qsum, ldq


def dequantized_rows(q: "torch.Tensor", d: "torch.Tensor", k: int) -> "torch.Tensor":
    return (q.double().reshape(q.shape[0], -1, QBLOCK) * d.double()[:, :, None]).reshape(q.shape[0], -1)[:, :k]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [33, 96, 2048])
def test_int8_block_is_the_sum_of_the_quantized_products(emulated, rows, k):
    """K = 33: a last block of one value and a last step of four K reaching past the weights."""
    torch.manual_seed(rows * 1000 + k)
    q, d, qsum, ldq = activations(rows, k)
    weight = torch.randint(-127, 128, (64, k), dtype=torch.int8)
    packed, out = pack_int8(weight), torch.full((rows, 64), float("nan"))
    assert emulated.int8q(ptr(q), ptr(d), ptr(qsum), ldq, rows, ptr(packed), k, ptr(out)) == 0
    expected = dequantized_rows(q, d, k) @ weight.double().T
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_int8_extremes_do_not_overflow(emulated):
    """Every product at its largest (127 x 127, and -127 weights flipped to 1): the int32 sums stay exact."""
    k = 256
    q, d, qsum, ldq = activations(4, k, extreme=True)
    d.fill_(1.0)
    for value in (127, -127):
        packed, out = pack_int8(torch.full((64, k), value, dtype=torch.int8)), torch.empty(4, 64)
        emulated.int8q(ptr(q), ptr(d), ptr(qsum), ldq, 4, ptr(packed), k, ptr(out))
        assert torch.equal(out, torch.full((4, 64), float(127 * value * k)))


@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k, group_size", [(64, 32), (256, 64), (512, 128)])
def test_nibble_blocks_are_the_sum_of_the_quantized_products_times_group_scales(emulated, bits, rows, k, group_size):
    """INT4, and INT6 (the INT4 route's lm_head: INT4's nibbles plus each value's top two bits from the step's
    high-bit bytes); every value of the range occurs, the extremes included."""
    torch.manual_seed(rows * 1000 + k + group_size + bits)
    q, d, qsum, ldq = activations(rows, k)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = torch.randint(low, high + 1, (64, k), dtype=torch.int8)
    values[0, :8] = torch.tensor([low, high] * 4, dtype=torch.int8)
    scales = (torch.rand(64, k // group_size) + 0.05).float()
    pack, kernel = (pack_int4, emulated.int4q) if bits == 4 else (pack_int6, emulated.int6q)
    packed, packed_scales, out = pack(values), pack_channels(scales), torch.full((rows, 64), float("nan"))
    assert kernel(ptr(q), ptr(d), ptr(qsum), ldq, rows, ptr(packed), ptr(packed_scales), group_size, k, ptr(out)) == 0
    dense = (values.double().reshape(64, -1, group_size) * scales.double()[:, :, None]).reshape(64, k)
    expected = dequantized_rows(q, d, k) @ dense.T
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_every_channel_lands_in_its_own_output(emulated):
    """One weight channel at a time non-zero: each lands in its own output (INT4's interleaved channel order
    is undone exactly)."""
    k = 64
    q, d, qsum, ldq = activations(1, k)
    for channel in (0, 3, 4, 15, 16, 21, 37, 63):
        weight = torch.zeros(64, k, dtype=torch.int8)
        weight[channel] = 1
        packed, out = pack_int8(weight), torch.empty(1, 64)
        emulated.int8q(ptr(q), ptr(d), ptr(qsum), ldq, 1, ptr(packed), k, ptr(out))
        assert out[0].nonzero().flatten().tolist() in ([channel], [])
        assert torch.allclose(out[0, channel].double(), dequantized_rows(q, d, k).sum(), rtol=1e-5)
        values = torch.zeros(64, k, dtype=torch.int8)
        values[channel] = 7
        packed, packed_scales = pack_int4(values), pack_channels(torch.ones(64, 1))
        emulated.int4q(ptr(q), ptr(d), ptr(qsum), ldq, 1, ptr(packed), ptr(packed_scales), k, k, ptr(out))
        assert out[0].nonzero().flatten().tolist() in ([channel], [])
        assert torch.allclose(out[0, channel].double(), 7 * dequantized_rows(q, d, k).sum(), rtol=1e-5)
        values[channel] = -29
        packed = pack_int6(values)
        emulated.int6q(ptr(q), ptr(d), ptr(qsum), ldq, 1, ptr(packed), ptr(packed_scales), k, k, ptr(out))
        assert out[0].nonzero().flatten().tolist() in ([channel], [])
        assert torch.allclose(out[0, channel].double(), -29 * dequantized_rows(q, d, k).sum(), rtol=1e-5)

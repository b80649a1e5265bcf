"""Split-bf16 storage: the fp32 master is two 16-bit halves, and joining them is bit-exact."""
from __future__ import annotations

import struct

import pytest

torch = pytest.importorskip("torch")

from xlaunch.kernels.optim.splitbf16 import bytes_per_element, join, split, split_into  # noqa: E402


def _bits(tensor: "torch.Tensor") -> "torch.Tensor":
    return tensor.contiguous().view(torch.int32)


def _from_bits(words: list[int]) -> "torch.Tensor":
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)


EDGE_WORDS = [
    0x00000000, 0x80000000,              # +0, -0
    0x00000001, 0x807FFFFF, 0x00400000,  # subnormals (smallest, largest negative, middle)
    0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # smallest normal, largest finite, most negative
    0x7F800000, 0xFF800000,              # +inf, -inf
    0x7FC00000, 0xFFC00001, 0x7F800001,  # quiet NaN, negative NaN with payload, signalling NaN
    0x7FBFFFFF, 0x3F800000, 0x3F80FFFF,  # NaN with a full low payload, 1.0, 1.0 + low bits
    0x3F7FFFFF, 0x00008000,              # just below 1.0, a subnormal living only in the low half
]


def test_edge_values_round_trip_bit_exact() -> None:
    master = _from_bits(EDGE_WORDS)
    top, trail = split(master)
    assert top.dtype == torch.bfloat16 and trail.dtype == torch.int16
    assert torch.equal(_bits(join(top, trail)), _bits(master))


def test_top_is_the_high_half_and_trail_the_low_half() -> None:
    master = _from_bits(EDGE_WORDS)
    top, trail = split(master)
    for word, high, low in zip(EDGE_WORDS, top.view(torch.int16).tolist(), trail.tolist()):
        assert high & 0xFFFF == word >> 16
        assert low & 0xFFFF == word & 0xFFFF


def test_top_is_the_truncated_master() -> None:
    """The bf16 the forward sees is the master rounded toward zero (never further from 0)."""
    master = torch.randn(10_000, dtype=torch.float32)
    top, _ = split(master)
    widened = top.float()
    assert torch.all(widened.abs() <= master.abs())
    assert torch.all((master - widened).abs() <= master.abs() * 2.0**-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_bit_patterns_round_trip(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, (100_003,), generator=generator, dtype=torch.int64)
    master = words.to(torch.int32).view(torch.float32)
    top, trail = split(master)
    assert torch.equal(_bits(join(top, trail)), words.to(torch.int32))


def test_channels_last_and_shapes_keep_layout() -> None:
    master = torch.randn(4, 3, 5, 7).to(memory_format=torch.channels_last)
    top, trail = split(master)
    assert top.shape == master.shape and top.stride() == master.stride()
    assert trail.stride() == master.stride()
    assert torch.equal(_bits(join(top, trail)), _bits(master))


def test_halves_in_different_layouts_pair_by_element() -> None:
    """A parameter made channels-last after its split (``model.to(memory_format=...)``) keeps its
    contiguous low half: the halves were paired in memory order, so each element got another's
    low bits (the masters, and every step from them, off by up to a bf16 step)."""
    master = torch.randn(4, 3, 5, 7)
    top, trail = split(master)
    cl_top = top.to(memory_format=torch.channels_last)
    assert torch.equal(_bits(join(cl_top, trail)), _bits(master))
    assert torch.equal(_bits(join(top, trail.to(memory_format=torch.channels_last))), _bits(master))
    moved = master * 3
    split_into(moved.to(memory_format=torch.channels_last), cl_top, trail)   # the trail stays contiguous
    assert trail.is_contiguous() and torch.equal(_bits(join(cl_top, trail)), _bits(moved))


def test_scalar_and_empty_tensors() -> None:
    for master in (torch.tensor(3.14159), torch.empty(0), torch.empty(3, 0)):
        top, trail = split(master)
        assert torch.equal(join(top, trail).view(torch.int32), master.view(torch.int32))


def test_overlapping_or_strided_views_are_refused() -> None:
    base = torch.randn(8, 8)
    with pytest.raises(ValueError, match="dense"):
        split(base[:, ::2])


def test_wrong_dtypes_are_refused() -> None:
    with pytest.raises(TypeError, match="float32"):
        split(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="bfloat16"):
        join(torch.zeros(3), torch.zeros(3, dtype=torch.int16))


def test_four_bytes_per_parameter() -> None:
    top, trail = split(torch.randn(1000))
    assert bytes_per_element(top, trail) == 4
    assert top.untyped_storage().nbytes() + trail.untyped_storage().nbytes() == 4 * 1000


def test_python_reference_for_one_value() -> None:
    """Independent of torch: struct packs the same float into the same two halves."""
    value = -1234.5678
    word = struct.unpack("<I", struct.pack("<f", value))[0]
    top, trail = split(torch.tensor([value], dtype=torch.float32))
    assert top.view(torch.int16).item() & 0xFFFF == word >> 16
    assert trail.item() & 0xFFFF == word & 0xFFFF

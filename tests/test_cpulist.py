"""xlaunch.cpulist: kernel-style CPU lists."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xlaunch.cpulist import CpuListError, format_cpulist, parse_cpulist


@pytest.mark.parametrize("text, expected", [
    ("", ()),
    ("  \n", ()),
    ("0", (0,)),
    ("0-3", (0, 1, 2, 3)),
    ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
    ("0-55,112-167\n", tuple(range(56)) + tuple(range(112, 168))),
    ("8,0-1,1", (0, 1, 8)),
    ("0-7:2", (0, 2, 4, 6)),
    ("0-15:2/8", (0, 1, 8, 9)),                                 # the kernel's groups: used/group
    ("0-9:3/4", (0, 1, 2, 4, 5, 6, 8, 9)),
    ("0-7:4/4", tuple(range(8))),
    ("100-2000:2/25", tuple(c for s in range(100, 2001, 25) for c in (s, s + 1) if c <= 2000)),  # kernel docs
    ("11", (11,)),
    (" 2 - 3 , 5 ", (2, 3, 5)),
])
def test_parse(text, expected):
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("bad", ["a", "1,,2", "3-1", "-1", "1-", "0-4:0", "1.5", ",", "0x3",
                                 "0-7:3/2", "0-7:0/4", "0-7:2/0", "0-7:2/", "0-7:/4", "0-7:1/2/4"])
def test_parse_rejects_with_a_message_naming_the_input(bad):
    with pytest.raises(CpuListError) as info:
        parse_cpulist(bad)
    assert repr(bad.strip()) in str(info.value) or bad.strip() in str(info.value)


@pytest.mark.parametrize("cpus, expected", [
    ([], ""),
    ([5], "5"),
    ([0, 1, 2, 3, 8], "0-3,8"),
    ([3, 1, 2, 2], "1-3"),
    ([0, 2, 4], "0,2,4"),
    (range(112, 168), "112-167"),
])
def test_format(cpus, expected):
    assert format_cpulist(cpus) == expected


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=4096), max_size=300))
def test_round_trip(cpus):
    text = format_cpulist(cpus)
    assert parse_cpulist(text) == tuple(sorted(cpus))
    assert format_cpulist(parse_cpulist(text)) == text          # the format is canonical


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 40), st.integers(1, 5)), max_size=20))
def test_parse_matches_expanded_ranges(ranges):
    text = ",".join(f"{lo}-{lo + span}:{stride}" for lo, span, stride in ranges)
    expected = sorted({c for lo, span, stride in ranges for c in range(lo, lo + span + 1, stride)})
    assert parse_cpulist(text) == tuple(expected)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 60), st.integers(1, 9), st.integers(0, 8)), max_size=20))
def test_groups_match_the_kernels_bitmap_parselist(ranges):
    """``a-b:used/group`` as lib/bitmap-str.c sets it: from a, every group, the first min(used, left) bits."""
    items = [(lo, lo + span, min(used, group), group) for lo, span, group, used in ranges if used]
    text = ",".join(f"{lo}-{hi}:{used}/{group}" for lo, hi, used, group in items)
    expected = set()
    for lo, hi, used, group in items:
        for start in range(lo, hi + 1, group):
            expected.update(range(start, start + min(hi - start + 1, used)))
    assert parse_cpulist(text) == tuple(sorted(expected))

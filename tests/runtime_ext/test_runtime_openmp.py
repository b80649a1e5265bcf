"""Finding the OpenMP runtime: /proc/self/maps parsing and the choice between mapped runtimes."""
from __future__ import annotations

from xlaunch.runtime_ext.openmp import GOMP, IOMP, LLVM_OMP, MappedRuntime, choose_active, parse_maps, runtime_kind

MAPS = """\
7f00-7f10 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f10-7f20 r-xp 00001000 08:01 2 /venv/site-packages/torch/lib/libgomp-a34b3233.so.1
7f20-7f30 r--p 00002000 08:01 2 /venv/site-packages/torch/lib/libgomp-a34b3233.so.1
7f30-7f40 r-xp 00000000 08:01 3 /venv/lib/libiomp5.so
7f40-7f50 r-xp 00000000 08:01 4 /opt/llvm/lib/libomp.so.5 (deleted)
7f50-7f60 rw-p 00000000 00:00 0
7f60-7f70 r-xp 00000000 08:01 5 /opt/lib/libompitt.so
7f70-7f80 r-xp 00000000 08:01 6 /opt/lib/libgomp_stub.txt
"""


def test_kinds_from_file_names():
    assert runtime_kind("/x/libgomp.so.1") == GOMP
    assert runtime_kind("/x/libgomp-a34b3233.so.1") == GOMP
    assert runtime_kind("/x/libiomp5.so") == IOMP
    assert runtime_kind("/x/libomp.so.5") == LLVM_OMP
    assert runtime_kind("/x/libomp.so") == LLVM_OMP
    assert runtime_kind("/x/libompitt.so") is None
    assert runtime_kind("/x/libgomp.a") is None


def test_parse_maps_lists_each_runtime_once_in_order():
    assert parse_maps(MAPS) == (
        MappedRuntime(GOMP, "/venv/site-packages/torch/lib/libgomp-a34b3233.so.1"),
        MappedRuntime(IOMP, "/venv/lib/libiomp5.so"),
        MappedRuntime(LLVM_OMP, "/opt/llvm/lib/libomp.so.5"),
    )


def test_the_globally_bound_runtime_wins():
    mapped = parse_maps(MAPS)
    assert choose_active(mapped, "/venv/lib/libiomp5.so").kind == IOMP
    assert choose_active(mapped, None).kind == GOMP
    assert choose_active(mapped, "/usr/lib/libc.so.6").kind == GOMP
    assert choose_active((), "/venv/lib/libiomp5.so") is None

"""``ONEDNN_MAX_CPU_ISA``: oneDNN's ceiling is what xlaunch's ISA-dependent choices (INT8 ranges,
native bf16) read, so a developer on an AVX-512 or AMX machine sees what an AVX2 machine does: the
rule on recorded flag sets, the choices in-process, and the ISA-dependent optimize/quantize tests
run again under ``ONEDNN_MAX_CPU_ISA=AVX2`` where this CPU has anything above it."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from xlaunch.machine.isa import onednn_flags
from xlaunch.machine.model import Isa

REPO = Path(__file__).resolve().parents[2]
SAPPHIRE_RAPIDS = frozenset("sse4_1 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd avx512ifma "
                            "avx512_vnni avx512_bf16 avx512_fp16 avx_vnni amx_tile amx_int8 amx_bf16".split())
ZEN4 = frozenset("sse4_1 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni avx512_bf16".split())
ZEN3 = frozenset("sse4_1 avx avx2 fma f16c".split())


@pytest.mark.parametrize("ceiling, kept", [
    ("", SAPPHIRE_RAPIDS), ("ALL", SAPPHIRE_RAPIDS), ("no-such-isa", SAPPHIRE_RAPIDS),
    ("AVX2", ZEN3), ("avx2", ZEN3), ("AVX2_VNNI", ZEN3 | {"avx_vnni"}),
    ("AVX512_CORE", ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512ifma"}),
    ("AVX512_CORE_VNNI", ZEN4 - {"avx512_bf16"} | {"avx512ifma"}), ("AVX512_CORE_BF16", ZEN4 | {"avx512ifma"}),
    ("AVX512_CORE_FP16", SAPPHIRE_RAPIDS - {"amx_tile", "amx_int8", "amx_bf16"}),
    ("AVX512_CORE_AMX", SAPPHIRE_RAPIDS), ("AVX10_1_512_AMX", SAPPHIRE_RAPIDS),
])
def test_the_ceiling_leaves_the_flags_of_its_level(ceiling: str, kept: frozenset) -> None:
    assert onednn_flags(SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": ceiling}) == kept
    assert onednn_flags(SAPPHIRE_RAPIDS, {"DNNL_MAX_CPU_ISA": ceiling}) == kept     # the former name
    assert onednn_flags(ZEN3, {"ONEDNN_MAX_CPU_ISA": ceiling}) == ZEN3             # never adds a flag


def test_int8_ranges_and_bf16_follow_the_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    import xlaunch.machine
    from xlaunch.kernels import native_dtypes
    from xlaunch.kernels.quantize import api

    for flags in (SAPPHIRE_RAPIDS, ZEN4):
        machine = types.SimpleNamespace(isa=Isa(flags=flags, amx_permitted="amx_tile" in flags))
        monkeypatch.setattr(xlaunch.machine, "current_machine", lambda machine=machine: machine)
        for ceiling, dot, bf16 in (("", "amx_int8" if "amx_tile" in flags else "avx512_vnni", True),
                                   ("AVX512_CORE", None, False), ("AVX2", None, False)):
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", ceiling)
            native_dtypes.isa_flags.cache_clear()
            traits = api._machine_traits()
            assert (traits.int8_dot, traits.reduce_range) == (dot, dot is None), (flags, ceiling)
            assert (native_dtypes.bf16_unsupported_reason(native_dtypes.isa_flags()) is None) is bf16, (flags, ceiling)
    native_dtypes.isa_flags.cache_clear()


# The tests whose routes depend on VNNI/BF16: INT8 ranges of every engine, optimize's bf16 routes.
ISA_DEPENDENT = ("tests/kernels/quantize/test_quantize_engines.py", "tests/kernels/optimize/test_engines_bf16.py")


def test_isa_dependent_tests_pass_under_an_avx2_ceiling() -> None:
    from xlaunch.kernels import native_dtypes

    native_dtypes.isa_flags.cache_clear()
    host = native_dtypes.isa_flags()
    if onednn_flags(host, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == host:
        pytest.skip("this CPU has nothing above AVX2: the suite's own run of these tests is the AVX2 one")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "XLAUNCH_CPU_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ISA_DEPENDENT],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.strip().splitlines()[-1], done.stdout[-2000:]


def test_the_bf16_reason_names_the_ceiling_not_the_cpu_when_one_is_set(monkeypatch) -> None:
    """Under a ceiling the reason said "this CPU has neither AVX512_BF16 nor AMX_BF16" of a CPU that has them."""
    from xlaunch.kernels.native_dtypes import bf16_unsupported_reason

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert bf16_unsupported_reason(ZEN3).startswith("this CPU has neither AVX512_BF16 nor AMX_BF16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert bf16_unsupported_reason(onednn_flags(SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX2"})).startswith(
        "oneDNN may use neither AVX512_BF16 nor AMX_BF16 under ONEDNN_MAX_CPU_ISA=AVX2")
    assert bf16_unsupported_reason(SAPPHIRE_RAPIDS) is None

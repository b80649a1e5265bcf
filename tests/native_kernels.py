"""For the tests that want a child's (or a run's) output clean: the one warning of a machine where the compiled
kernels of xlaunch.nn or xlaunch.llm are not built (setup builds them; without a compiler the pure-torch paths
run and say so, once per process). Imported by name, like host_cpus."""
from __future__ import annotations

PHRASE = "native kernels not built here"


def kernels_built() -> bool:
    """Whether both libraries are built for this CPU's level (then nothing is forgiven)."""
    from xlaunch.llm import native as llm_native
    from xlaunch.nn import native as nn_native

    return bool(llm_native.available() and nn_native.available())


def without_unbuilt_kernels_warning(text: str) -> str:
    """``text`` (a stderr) less that warning and the source line Python prints under it; unchanged where the
    kernels are built."""
    if kernels_built():
        return text
    kept, after_warning = [], False
    for line in text.splitlines(keepends=True):
        if PHRASE in line:
            after_warning = True
            continue
        if after_warning and line.startswith("  "):
            continue
        after_warning = False
        kept.append(line)
    return "".join(kept)


def without_unbuilt_kernels_messages(messages: list[str]) -> list[str]:
    """``messages`` (warnings' texts) less that warning, where the kernels are not built."""
    return messages if kernels_built() else [m for m in messages if PHRASE not in m]

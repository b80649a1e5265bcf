"""Kernel-style CPU lists: ``"0-3,8,10-11"`` <-> sorted tuples of ints.

Used for sysfs files (``cpulist``, ``shared_cpu_list``), ``/proc/self/status``
(``Cpus_allowed_list``), launcher options (``--cores-list``) and ``OMP_PLACES``.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Iterable


# Kernel limits: NR_CPUS is at most 8192 on x86 (MAXSMP) and NODES_SHIFT at most 10; a list
# naming a larger number is a typo, and expanding it would exhaust memory.
MAX_ID = 65535
SHOWN = 60   # characters of an input an error message quotes (a garbage file may be 64 KiB)


class CpuListError(ValueError):
    """A CPU list that does not parse; the message says which part is wrong."""


class CpuListRangeError(CpuListError):
    """A well-formed list naming a number above :data:`MAX_ID`."""


def parse_cpulist(text: str, limit: int = MAX_ID) -> tuple[int, ...]:
    """Parse ``"0-3,8,10-11"`` into a sorted, unique tuple.

    Kernel syntax (Documentation/admin-guide/kernel-parameters.rst, "cpu lists"), including its
    groups: ``a-b:used/group`` takes the first ``used`` CPUs of every ``group`` from ``a`` (``0-15:2/8``
    is 0,1,8,9); also taskset's ``a-b:stride`` (``0-7:2`` is 0,2,4,6). An empty or blank string is
    the empty list. Raises :class:`CpuListError` on anything else that is not a list of ASCII
    non-negative integers and ascending ranges, and :class:`CpuListRangeError` for a number above
    ``limit`` (so memory stays bounded).
    """
    text = text.strip()
    if not text:
        return ()
    whole = shown(text)
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise CpuListError(f"empty item in {whole}")
        used, group = 1, 1
        if ":" in part:
            part, _, pattern = part.partition(":")
            used_text, slash, group_text = pattern.partition("/")
            used = _non_negative(used_text, whole)
            group = _non_negative(group_text, whole) if slash else used
            if not slash:
                if group == 0:
                    raise CpuListError(f"zero stride in {whole}")
                used = 1              # taskset's stride: one CPU of every `stride`
            elif group == 0 or used == 0 or used > group:
                raise CpuListError(f"group pattern {used}/{group} in {whole} is not 'used/group' with "
                                   "0 < used <= group")
        if "-" in part:
            lo_text, _, hi_text = part.partition("-")
            lo, hi = _non_negative(lo_text, whole), _non_negative(hi_text, whole)
            _check_limit(hi, limit, whole)
            if hi < lo:
                raise CpuListError(f"descending range {lo}-{hi} in {whole}")
            if used == 1:
                cpus.update(range(lo, hi + 1, group))
            else:
                for start in range(lo, hi + 1, group):
                    cpus.update(range(start, min(start + used, hi + 1)))
        else:
            number = _non_negative(part, whole)
            _check_limit(number, limit, whole)
            cpus.add(number)
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPUs as the shortest kernel-style list: ``[0,1,2,3,8]`` -> ``"0-3,8"``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def shown(text: str, limit: int = SHOWN) -> str:
    """``repr(text)``, cut to ``limit`` characters and ``...`` (one-line messages about any file)."""
    quoted = repr(text)
    return quoted if len(quoted) <= limit else quoted[:limit] + "..."


def _check_limit(number: int, limit: int, whole: str) -> None:
    if number > limit:
        raise CpuListRangeError(f"{number} in {whole} is larger than any CPU or node number (at most {limit})")


def _non_negative(token: str, whole: str) -> int:
    token = token.strip()
    if not (token.isascii() and token.isdigit()):
        raise CpuListError(f"{shown(token)} is not a CPU number in {whole}")
    return int(token)

"""The memory a set of processes holds together: ``Pss`` and ``Rss`` from ``/proc/PID/smaps_rollup``
(and one mapped file's share from ``/proc/PID/smaps``), summed over the processes at the same instant.
Used by bench/llm.py ``--instances`` (bench/_llm_instances.py). No torch here."""
from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any, Optional, Sequence


def parse_rollup(text: str) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` (or one smaps entry) as ``{"Rss": kB, "Pss": kB, ...}``."""
    fields = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[key.strip()] = int(parts[0])
    return fields


def mapping_kib(smaps_text: str, path: str, keys: Sequence[str] = ("Rss", "Pss")) -> dict[str, int]:
    """``keys`` (kB; Rss and Pss by default) summed over the entries of ``/proc/PID/smaps`` that map ``path``."""
    total = dict.fromkeys(keys, 0)
    inside = False
    for line in smaps_text.splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):       # an entry's header line
            inside = len(head) >= 6 and " ".join(head[5:]) == path
            continue
        if inside:
            fields = parse_rollup(line)
            for key in total:
                total[key] += fields.get(key, 0)
    return total


class MemorySampler:
    """The sums of Pss and Rss over ``pids``, sampled together; a sample counts only when every pid answers."""

    def __init__(self, pids: Sequence[int], proc: str = "/proc", mapped: Optional[str] = None) -> None:
        self.pids, self.proc, self.mapped = list(pids), proc, mapped
        self.samples: list[dict[str, Any]] = []

    def sample(self) -> bool:
        each = []
        for pid in self.pids:
            try:
                fields = parse_rollup(Path(self.proc, str(pid), "smaps_rollup").read_text())
            except OSError:
                return False
            if "Pss" not in fields or "Rss" not in fields:
                return False
            each.append(fields)
        taken: dict[str, Any] = {"pss_kib": [f["Pss"] for f in each], "rss_kib": [f["Rss"] for f in each]}
        if self.mapped:
            try:
                maps = [mapping_kib(Path(self.proc, str(pid), "smaps").read_text(), self.mapped) for pid in self.pids]
            except OSError:
                return False
            taken["mapped_rss_kib"], taken["mapped_pss_kib"] = [m["Rss"] for m in maps], [m["Pss"] for m in maps]
        self.samples.append(taken)
        return True

    def result(self) -> dict[str, Any]:
        """The median sums over the samples (MiB; a copy restarting or loading makes a few samples low or high),
        the largest, and each instance's median Pss and Rss, and the packed mapping's."""
        if not self.samples:
            return {"samples": 0}

        def each(key: str) -> list[float]:
            return [median([s[key][i] for s in self.samples]) / 1024 for i in range(len(self.samples[0][key]))]

        out = {"samples": len(self.samples),
               "pss_sum_mib": median([sum(s["pss_kib"]) for s in self.samples]) / 1024,
               "rss_sum_mib": median([sum(s["rss_kib"]) for s in self.samples]) / 1024,
               "pss_sum_max_mib": max(sum(s["pss_kib"]) for s in self.samples) / 1024,
               "rss_sum_max_mib": max(sum(s["rss_kib"]) for s in self.samples) / 1024,
               "pss_each_mib": each("pss_kib"), "rss_each_mib": each("rss_kib")}
        if "mapped_pss_kib" in self.samples[0]:
            out["mapped_rss_each_mib"], out["mapped_pss_each_mib"] = each("mapped_rss_kib"), each("mapped_pss_kib")
        return out

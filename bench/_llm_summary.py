"""bench/llm.py ``--instances k``: the summary of a route's windows (``combine``), its ratio to llama.cpp window by
window (``paired``) and the tables (bench/_llm_instances.py runs the windows)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


def combine(windows: Sequence[dict[str, Any]], median: Callable[[Sequence[float]], Optional[float]],
            **extra: Any) -> dict[str, Any]:
    """A route's windows: each window's aggregate (the sum of the copies' median rounds), and over the
    windows the median aggregate, each copy's median, and the median memory sums."""
    done = []
    for window in windows:
        each = [median(rounds) for rounds in window["decode_rounds"]]
        done.append({**window, "decode_tps_each": each, "decode_tps": sum(v for v in each if v is not None)})
    copies = len(done[0]["decode_tps_each"])
    out = {"status": "ok", **extra, "windows": done,
           "decode_tps": median([w["decode_tps"] for w in done]),
           "decode_tps_each": [median([w["decode_tps_each"][i] for w in done]) for i in range(copies)]}
    for key in ("pss_sum_mib", "rss_sum_mib"):
        values = [w[key] for w in done if key in w]
        out[key] = median(values) if values else None
    for key in ("mapped_rss_each_mib", "mapped_pss_each_mib"):
        if key in done[-1]:
            out[key] = done[-1][key]
    return out


def paired(row: dict[str, Any], peer: dict[str, Any], median: Callable) -> Optional[float]:
    """The median over windows of the row's aggregate over the peer's in the same window (pairs, not runs apart)."""
    ratios = [ours["decode_tps"] / theirs["decode_tps"] for ours, theirs in zip(row.get("windows", []), peer.get("windows", []))
              if theirs["decode_tps"]]
    return median(ratios) if ratios else None


def memory(row: dict[str, Any]) -> str:
    """A window's or a route's memory sums, or that none was sampled (a window shorter than one sampling period)."""
    if row.get("pss_sum_mib") is None:
        return "memory not sampled (its windows ended before the first sample: more --new-tokens)"
    return f"PSS sum {row['pss_sum_mib']:.0f} MiB, RSS sum {row['rss_sum_mib']:.0f} MiB"


def ratio(ours: Optional[float], theirs: Optional[float]) -> Optional[float]:
    return ours / theirs if ours is not None and theirs else None


def table(instances: int, threads: int, rows: dict[str, dict[str, Any]], peers: dict[str, str],
          single: dict[str, dict[str, Any]]) -> str:
    """One row per route: aggregate decode tokens/s, memory sums, the ratios to llama.cpp, and to one instance."""
    def number(value: Optional[float], form: str) -> str:
        return "" if value is None else format(value, form)

    lines = [f"| route ({instances} x {threads} thread{'s' if threads > 1 else ''}) | decode tok/s, sum | per instance "
             "| vs llama.cpp | PSS sum MiB | RSS sum MiB | PSS vs llama.cpp | PSS vs 1 instance |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        if row.get("status") != "ok":
            lines.append(f"| {name} | {row.get('status', '').splitlines()[0]} | | | | | | |")
            continue
        peer = rows.get(peers.get(name, ""), {})
        one = single.get(name, {})
        lines.append(
            f"| {name} | {row['decode_tps']:.1f} | {' + '.join(number(v, '.1f') for v in row['decode_tps_each'])} "
            f"| {number(row.get('decode_vs_llamacpp'), '.2f')} "
            f"| {number(row.get('pss_sum_mib'), '.0f')} | {number(row.get('rss_sum_mib'), '.0f')} "
            f"| {number(ratio(row.get('pss_sum_mib'), peer.get('pss_sum_mib')), '.2f')} "
            f"| {number(ratio(row.get('pss_sum_mib'), one.get('pss_sum_mib')), '.2f')} |")
    return "\n".join(lines)


def tables(args: Any, results: dict[str, Any], peers: dict[str, str]) -> str:
    out = []
    for threads in args.threads:
        single = results.get(f"1x{threads}", {})
        for k in args.instances:
            out.append(table(k, threads, results[f"{k}x{threads}"], peers, single) + "\n")
    return "\n".join(out)

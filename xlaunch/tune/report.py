"""The final ranked table (rich when installed, plain columns otherwise)."""
from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

from xlaunch.tune.session import Outcome, Tuner
from xlaunch.tune.space import describe


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"


def _wall(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def rows(tuner: Tuner, outcome: Outcome) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, one row per trial (ranked ok ones first, then failed), and footnote lines."""
    keys = list(tuner.space.keys)
    with_kernels = any(run.get("kernels") for record in tuner.records for run in record.runs)
    kernels = (lambda record: [record.kernels]) if with_kernels else (lambda record: [])
    header = ["rank", "#", *keys, "median", "spread", "wall s", *(["kernels"] if with_kernels else []), "status"]
    body: list[list[str]] = []
    best = outcome.best.number if outcome.best is not None else None
    for rank, record in enumerate(tuner.ranked(), 1):
        summary = record.summary
        spread = f"{_fmt(summary.low)}..{_fmt(summary.high)}" if summary and summary.count > 1 else "-"
        status = "best" if record.number == best else "ok"
        if outcome.final is not None and record.number in outcome.final.numbers and record.number != best:
            status = "ok, lost the re-measurement"
        body.append([str(rank), str(record.number), *(_cell(record.point.get(k)) for k in keys),
                     _fmt(record.value), spread, _wall(record.wall_time), *kernels(record), status])
    for record in tuner.records:
        if not record.ok:
            body.append(["-", str(record.number), *(_cell(record.point.get(k)) for k in keys), "-", "-",
                         _wall(record.wall_time), *kernels(record), f"failed: {record.reason}"])
    notes = [f"objective: {tuner.objective.label}, {'higher' if tuner.objective.goal == 'max' else 'lower'} is better"]
    for skip in tuner.skipped:
        notes.append(f"skipped {describe(skip.point)}: {skip.reason}")
    final = outcome.final
    if final is not None:
        parts = []
        for number in final.numbers:
            values = final.values.get(number, [])
            median = sorted(values)[len(values) // 2] if values else None
            parts.append(f"#{number} {_fmt(median)} (n={len(values)})")
        notes.append("re-measured interleaved: " + " vs ".join(parts) +
                     (f" -> #{final.winner} wins" if final.winner is not None else " -> no result"))
    if outcome.best is not None:
        notes.append(f"best: #{outcome.best.number} {describe(outcome.best.point)}")
    else:
        notes.append("no configuration succeeded")
    if outcome.interrupted:
        notes.append("interrupted: results so far")
    return header, body, notes


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def print_table(tuner: Tuner, outcome: Outcome, stream: Optional[TextIO] = None) -> None:
    stream = stream if stream is not None else sys.stdout
    header, body, notes = rows(tuner, outcome)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        stream.write(plain_table(header, body) + "\n".join(notes) + "\n")
        return
    table = Table(title="xlaunch-tune: ranked configurations", title_justify="left")
    for name in header:
        table.add_column(name, justify="right" if name in ("rank", "#", "median", "wall s") else "left",
                         overflow="fold")
    for row in body:
        style = "bold green" if row[-1] == "best" else ("red" if row[-1].startswith("failed") else None)
        table.add_row(*row, style=style)
    tty = bool(getattr(stream, "isatty", lambda: False)())
    console = Console(file=stream, width=None if tty else 220, highlight=False)
    console.print(table)
    for note in notes:
        console.print(note, highlight=False, markup=False)


def plain_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *body]]
    return "\n".join(lines) + "\n"

"""The final ranked table (rich when installed, plain columns otherwise).

One row per measured configuration, the winner first: it is the one the interleaved
re-measurement chose, which may not be the best search median. Short column names and cells
that never wrap keep it readable in 80 columns; why a configuration failed or was skipped is
told below the table, one line each. And the live progress bar on a terminal (:class:`Progress`,
rich): trial i/N, elapsed, best so far; silent otherwise.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

from xlaunch.tune.objective import summarize
from xlaunch.tune.session import Outcome, Tuner
from xlaunch.tune.space import describe, short_key

BEST, RUNNER_UP, OK, FAILED = "best", "runner-up", "ok", "failed"


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if abs(value) < 1000:
        return f"{value:.4g}"
    return f"{value:.0f}" if abs(value) < 1e9 else f"{value:.4g}"     # 1e20 was printed with all 21 digits


def _wall(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def rows(tuner: Tuner, outcome: Outcome) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, one row per trial (the winner, then the other ok ones by median, then the failed
    ones), and the lines under the table."""
    keys = list(tuner.space.keys)
    final = outcome.final
    finals = {n: summarize(v).median for n, v in final.values.items() if v} if final is not None else {}
    spread_shown = any((r.summary is not None and r.summary.count > 1) for r in tuner.records)
    header = ["rank", "#", *(short_key(k) for k in keys), "median"]
    header += ["spread"] if spread_shown else []
    header += ["final"] if final is not None else []          # the interleaved re-measurement
    with_kernels = any(run.get("kernels") for record in tuner.records for run in record.runs)   # --kernel-report
    kernels = (lambda record: [record.kernels]) if with_kernels else (lambda record: [])
    header += ["wall s", *(["kernels"] if with_kernels else []), "status"]
    best = outcome.best.number if outcome.best is not None else None
    ranked = tuner.ranked()
    ranked = [r for r in ranked if r.number == best] + [r for r in ranked if r.number != best]
    body: list[list[str]] = []
    for rank, record in enumerate(ranked, 1):
        summary = record.summary
        status = BEST if record.number == best else OK
        if final is not None and record.number in final.numbers and record.number != best:
            status = RUNNER_UP
        row = [str(rank), str(record.number), *(_cell(record.point.get(k)) for k in keys), _fmt(record.value)]
        if spread_shown:
            row.append(f"{_fmt(summary.low)}..{_fmt(summary.high)}" if summary and summary.count > 1 else "-")
        if final is not None:
            row.append(_fmt(finals.get(record.number)))
        body.append(row + [_wall(record.wall_time), *kernels(record), status])
    failed = [r for r in tuner.records if not r.ok]
    for record in failed:
        row = ["-", str(record.number), *(_cell(record.point.get(k)) for k in keys), "-"]
        row += ["-"] * (spread_shown + (final is not None))
        body.append(row + [_wall(record.wall_time), *kernels(record), FAILED])
    notes = [f"objective: {tuner.objective.label}, {'higher' if tuner.objective.goal == 'max' else 'lower'} is better"]
    notes += [f"#{record.number} failed: {record.reason}" for record in failed]
    warned: dict[str, list[int]] = {}        # the launcher's plan warnings: "not adding tcmalloc" ran another one
    for record in tuner.records:
        for warning in record.warnings:
            warned.setdefault(warning, []).append(record.number)
    notes += [f"{_numbers(numbers)} ran with the launcher's warning: {warning}" for warning, numbers in warned.items()]
    notes += [f"skipped {describe(skip.point)}: {skip.reason}" for skip in tuner.skipped]
    if final is not None:
        parts = [f"#{n} {_fmt(finals.get(n))} (n={len(final.values.get(n, []))}"
                 + (f", failed {len(final.failures[n])}x: {final.failures[n][0]}" if final.failures.get(n) else "")
                 + ")" for n in final.numbers]
        notes.append("re-measured interleaved: " + " vs ".join(parts) +
                     (f" -> #{final.winner} wins" if final.winner is not None else
                      " -> interrupted before it decided: the search's best is kept" if outcome.interrupted
                      else " -> no result"))
    if outcome.best is not None:
        notes.append(f"best: #{outcome.best.number} {describe(outcome.best.point)}")
    elif not tuner.records and tuner.skipped:
        notes.append(f"nothing ran: all {len(tuner.skipped)} point(s) of the space were skipped (reasons above)")
    elif not tuner.records:
        notes.append("nothing ran")
    else:
        notes.append("no configuration succeeded")
    if outcome.interrupted:
        notes.append("interrupted: results so far")
    return header, body, notes


def _numbers(numbers: list[int], most: int = 8) -> str:
    shown = ", ".join(f"#{n}" for n in numbers[:most])
    return shown + (f" and {len(numbers) - most} more" if len(numbers) > most else "")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def print_results(tuner: Tuner, outcome: Outcome, written: list[str], doc: Optional[dict] = None) -> None:
    """On stdout: ``doc`` as JSON (``--json``), else the table and the files written."""
    if doc is not None:
        import json

        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        return
    print_table(tuner, outcome)
    if written:
        sys.stdout.write("wrote " + ", ".join(written) + "\n")


def print_table(tuner: Tuner, outcome: Outcome, stream: Optional[TextIO] = None) -> None:
    stream = stream if stream is not None else sys.stdout
    header, body, notes = rows(tuner, outcome)
    if not body:                  # nothing measured: the notes say why
        stream.write("\n".join(notes) + "\n")
        return
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        stream.write(plain_table(header, body) + "\n".join(notes) + "\n")
        return
    table = Table(title="xlaunch-tune: ranked configurations", title_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, collapse_padding=True)
    numeric = {"rank", "#", "median", "spread", "final", "wall s"}
    for name in header:
        table.add_column(name, justify="right" if name in numeric else "left", no_wrap=True, overflow="ellipsis")
    for row in body:
        style = "bold green" if row[-1] == BEST else ("red" if row[-1] == FAILED else None)
        table.add_row(*row, style=style)
    tty = bool(getattr(stream, "isatty", lambda: False)())
    console = Console(file=stream, width=None if tty else 220, highlight=False)
    console.print(table)
    for note in notes:
        console.print(note, highlight=False, markup=False, soft_wrap=True)


def plain_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *body]]
    return "\n".join(lines) + "\n"


class Progress:
    """``update()`` after each event; ``close()`` at the end. A no-op when ``stream`` is not a
    terminal or rich is not installed."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, enabled: Optional[bool] = None) -> None:
        stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(stream, "isatty", lambda: False)())
        self._bar: Any = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
        except ImportError:
            return
        self._bar = RichProgress(
            TextColumn("[bold]trial"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
            TextColumn("{task.description}"), console=Console(file=stream), transient=False,
        )
        self._task = self._bar.add_task("", total=total)
        self._bar.start()

    def update(self, done: int, total: int, description: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=min(done, total), total=total, description=description)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

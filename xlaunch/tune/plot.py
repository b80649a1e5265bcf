"""``tune.png``: every configuration's metric with its spread, best first, failures marked.

One row per configuration: the median (a bar), every run (dots), the min..max range (a line),
the finalists' interleaved re-measurements (diamonds); the winner in green; failed
configurations at the bottom with their reason. matplotlib is imported here only.
"""
from __future__ import annotations

import io
from typing import Any, Optional

from xlaunch.tune.session import Outcome, Tuner
from xlaunch.tune.space import short_key
from xlaunch.userfiles import write_atomically

class PlotError(ValueError):
    """Values no plot can show; the session goes on without tune.png."""


MAX_OK_ROWS = 30          # the best 30 and up to 10 failures: a readable height
MAX_FAILED_ROWS = 10
MAX_DRAWN = 1e300         # an axis limit past this: no plot (its ticks overflow, or the span is inf)


def _plain(text: str) -> str:
    """``text`` shown as written: a ``$`` pair (a program argument, a failure's last line, a metric
    regex) is matplotlib's math mode, which garbled the text or failed the whole plot."""
    return text.replace("$", r"\$")


def label(point: dict[str, Any]) -> str:
    parts = []
    for key, value in point.items():
        shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
        parts.append(f"{short_key(key)}={shown}")
    return "  ".join(parts) or "(defaults)"


def save_plot(path: str, tuner: Tuner, outcome: Outcome, title: Optional[str] = None) -> Optional[str]:
    """Write the plot (atomically, never through a symlink); returns None (and writes nothing)
    when matplotlib is not installed. A plot that cannot be drawn is a :class:`PlotError` saying why."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    try:
        image = _draw(plt, tuner, outcome, title)
    except PlotError:
        plt.close("all")
        raise
    except Exception as error:          # matplotlib's own failure costs the plot, never the session
        from xlaunch._errors import error_line

        plt.close("all")
        raise PlotError(f"matplotlib failed ({error_line(error)})") from None
    return write_atomically(path, image)


def _draw(plt: Any, tuner: Tuner, outcome: Outcome, title: Optional[str]) -> bytes:
    ranked = tuner.ranked()
    failed = [r for r in tuner.records if not r.ok]
    hidden = max(0, len(ranked) - MAX_OK_ROWS) + max(0, len(failed) - MAX_FAILED_ROWS)
    rows = ranked[:MAX_OK_ROWS] + failed[:MAX_FAILED_ROWS]
    best = outcome.best.number if outcome.best is not None else None
    finals = outcome.final.values if outcome.final is not None else {}
    height = 1.8 + 0.42 * max(1, len(rows))
    fig, ax = plt.subplots(figsize=(10, height), dpi=110)
    values = [v for r in ranked[:MAX_OK_ROWS] for run in r.runs if (v := run.get("value")) is not None]
    values += [v for vs in finals.values() for v in vs]
    low = min(values) if values else 0.0
    high = max(values) if values else 1.0
    left = 0.0 if low >= 0 else low * 1.1
    span = (high - left) or 1.0
    if not max(abs(left), abs(high + 0.12 * span)) < MAX_DRAWN:    # matplotlib's ticks overflow near 1e308
        raise PlotError(f"values from {low:g} to {high:g} are too large to draw (at most {MAX_DRAWN:g})")
    for y, record in enumerate(rows):
        if not record.ok:
            ax.plot([left + 0.01 * span], [y], marker="x", color="#c0392b", markersize=9, mew=2)
            ax.text(left + 0.03 * span, y, _plain(f"failed: {record.reason}"[:90]), va="center", color="#c0392b", fontsize=8)
            continue
        summary = record.summary
        color = "#27ae60" if record.number == best else "#5d8aa8"
        ax.barh(y, summary.median - left, left=left, height=0.6, color=color, alpha=0.35 if record.number != best else 0.6)
        ax.plot([summary.low, summary.high], [y, y], color=color, lw=2)
        runs = [run["value"] for run in record.runs if run.get("value") is not None]
        ax.plot(runs, [y] * len(runs), "o", color=color, markersize=4)
        extra = finals.get(record.number, [])
        if extra:
            ax.plot(extra, [y + 0.18] * len(extra), "D", color="#8e44ad", markersize=4,
                    label="re-measured (interleaved)" if not any(
                        h.get_label() == "re-measured (interleaved)" for h in ax.lines) else None)
        ax.text(summary.median, y - 0.33, f" {summary.median:.4g}", va="bottom", fontsize=8, color="#333333")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([("★ " if r.number == best else "") + f"#{r.number} " + _plain(label(r.point)) for r in rows],
                       fontsize=8, family="monospace")
    ax.invert_yaxis()
    ax.set_xlim(left, high + 0.12 * span)
    direction = "higher is better →" if tuner.objective.goal == "max" else "← lower is better"
    ax.set_xlabel(_plain(f"{tuner.objective.label}   ({direction})"), fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    heading = title or "xlaunch-tune"
    sub = f"{len(ranked)} ok, {len(failed)} failed, {len(tuner.skipped)} skipped (invalid here)"
    if outcome.best is not None:
        sub += f"; best ★ #{outcome.best.number}"
        if outcome.final is not None and outcome.final.winner == outcome.best.number:
            sub += " (won the interleaved re-measurement)"
    if hidden:
        sub += f"; {hidden} more in trials.csv"
    ax.set_title(_plain(f"{heading}\n{sub}"), fontsize=10, loc="left")
    if any(finals.values()):      # final rounds that all failed draw no diamond (an empty legend warned)
        ax.legend(loc="lower right", fontsize=8, frameon=False)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png")
    plt.close(fig)
    return image.getvalue()

"""A live progress bar on a terminal (rich): trial i/N, elapsed, best so far. Silent otherwise."""
from __future__ import annotations

import sys
from typing import Any, Optional, TextIO


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

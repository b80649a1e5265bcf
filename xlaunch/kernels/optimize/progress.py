"""Progress of the steps that take seconds (building a route, exporting, timing), on stderr.

On a terminal: a rich progress bar (tqdm when rich is not installed). Otherwise (a log, a pipe,
``xlaunch`` prefixing each instance's lines): a line when a step starts (``...: building inductor``)
and one when it ends (``...: building inductor: built in 5.9 s, checked in 1.6 s``), so a step of
several seconds is never silent. A closed or full stderr never stops the work: the line is dropped.

``Progress(quiet_s=0.5)`` (the default ``backend="torch"`` of ``optimize()``, whose steps are often
milliseconds) says nothing while the call is shorter than ``quiet_s``: the step running at that
moment is announced then (from a timer thread), and every later step as it starts; a call that
ends sooner prints nothing. Lines only, no bar.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any, Iterator, Optional

PREFIX = "xlaunch.optimize"


def _write(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):   # closed, full, or no stderr: output degrades
        pass


class Progress:
    """``with progress.step("building onnxruntime") as step: ...; step.done("3.1 s")``."""

    def __init__(self, total: int, enabled: bool = True, title: str = PREFIX, quiet_s: float = 0.0) -> None:
        self.enabled = enabled
        self.title = title
        self.total = total
        self._bar: Any = None
        self._task: Any = None
        self._tqdm: Any = None
        self.quiet_s = quiet_s
        self._begin = time.perf_counter()
        self._loud = quiet_s <= 0          # quiet_s: silent until the call has run that long
        self._lock = threading.Lock()
        if enabled and _is_terminal() and quiet_s <= 0:
            self._start_bar()

    def _announce(self, step: "Step") -> None:
        """The start line of ``step`` (once), if it is still running; from then on every step is said."""
        with self._lock:   # held while writing: the step's end line cannot come before its start
            if step.announced or step.ended:
                return
            step.announced = self._loud = True
            _write(f"{self.title}: {step.what} ...")

    def _quiet_step(self, step: "Step") -> None:
        """Announce ``step`` now when the call is past ``quiet_s``, else when it gets there."""
        left = self.quiet_s - (time.perf_counter() - self._begin)
        if self._loud or left <= 0:
            self._announce(step)
            return
        timer = threading.Timer(left, self._announce, (step,))
        timer.daemon = True
        step.timer = timer
        timer.start()

    def _start_bar(self) -> None:
        try:
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                     TimeElapsedColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.title, total=self.total)
            return
        except Exception:
            self._bar = None
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=self.total, desc=self.title, file=sys.stderr, leave=True)
        except Exception:
            self._tqdm = None

    def line(self, text: str) -> None:
        """A line of its own (not a step): what was kept, a cache hit."""
        if not self.enabled or (self.quiet_s > 0 and not self._loud):
            return
        if self._bar is not None:
            self._bar.console.print(f"{self.title}: {text}", highlight=False)
        elif self._tqdm is not None:
            self._tqdm.write(f"{self.title}: {text}", file=sys.stderr)
        else:
            _write(f"{self.title}: {text}")

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator["Step"]:
        step = Step(what)
        if self.enabled and self.quiet_s > 0:
            self._quiet_step(step)
        elif self._bar is not None:
            self._bar.update(self._task, description=f"{self.title}: {what}")
        elif self._tqdm is not None:
            self._tqdm.set_description(f"{self.title}: {what}")
        elif self.enabled:
            _write(f"{self.title}: {what} ...")
        try:
            yield step
        finally:
            if step.timer is not None:
                step.timer.cancel()
            with self._lock:
                step.ended = True
            seconds = time.perf_counter() - step.start
            outcome = step.outcome or "failed"
            # an outcome that gives its own times (the report's) is not followed by another one
            text = f"{self.title}: {what}: {outcome}" + ("" if step.timed else f" ({seconds:.1f} s)")
            if self._bar is not None:
                self._bar.advance(self._task)
                self._bar.console.print(text, highlight=False)
            elif self._tqdm is not None:
                self._tqdm.update(1)
                self._tqdm.write(text, file=sys.stderr)
            elif self.enabled and self.quiet_s <= 0:
                _write(text)
            elif self.enabled:
                with self._lock:
                    if step.announced:
                        _write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=self.title)
            self._bar.stop()
            self._bar = None
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None


class Step:
    def __init__(self, what: str) -> None:
        self.what = what
        self.start = time.perf_counter()
        self.outcome: Optional[str] = None
        self.timed = False
        self.announced = False   # quiet mode: its start line was written
        self.ended = False
        self.timer: Any = None

    def done(self, outcome: str, timed: bool = False) -> None:
        """How the step ended; ``timed``: ``outcome`` says its own seconds (no total appended)."""
        self.outcome = outcome
        self.timed = timed


def _is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (OSError, ValueError, AttributeError):
        return False

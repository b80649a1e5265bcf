"""A FIFO with no writer, the hostile user file (``from fifos import fifo_with_late_writer``).

Code that opens it blocking (the defect the tests look for) would wait forever and hang the test worker:
:func:`fifo_with_late_writer` opens it for writing after ``seconds``, so such code gets past its open, reads
an empty file and fails the test's assertions instead. Code that refuses the FIFO without opening it
blocking never meets the writer.
"""
from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def fifo_with_late_writer(path: Path, seconds: float = 10.0) -> Iterator[Path]:
    os.mkfifo(path)
    stop = threading.Event()

    def writer() -> None:
        if stop.wait(seconds):
            return
        while not stop.is_set():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:     # ENXIO: no reader has it open yet
                    return
                stop.wait(0.05)
                continue
            os.close(fd)
            return

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()

"""Take oneDNN's verbose lines out of a program's output stream, byte-exactly.

oneDNN writes each verbose line with one ``write()`` (``printf`` then ``fflush``) on stdout, while
the program's own text may sit half-written in its buffers: a verbose line can arrive in the
middle of a line of the program's. So a line is recognised wherever ``onednn_verbose,`` (or the
older ``dnnl_verbose,``) starts, up to its newline, and it is taken out only if it parses as a
verbose line of a known layout (:func:`.kernels.parse_line`); what is around it is passed on
unchanged, so the program's output reads as if oneDNN had printed nothing.

Costs: bytes are passed on as they come, except a chunk's last few bytes when they could begin
the marker (held until the next chunk or the end) and a verbose line until its newline.

    keep = VerboseFilter(raw=log_file)   # raw: where the verbose lines go (or None)
    user_bytes = keep.feed(chunk)        # per chunk read from the pipe
    user_bytes += keep.close()           # at end of stream
    keep.tally.to_json()                 # what ran
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import BinaryIO, Optional

from xlaunch.launcher.observe.kernels import MARKERS, KernelTally

_MARKERS = tuple(marker.encode() + b"," for marker in MARKERS)
# A verbose line longer than this is not one (oneDNN's longest are a few KiB): passed on as output.
MAX_VERBOSE_LINE = 1 << 16


class VerboseFilter:
    """One instance's stream: :meth:`feed` returns the program's bytes, the verbose lines are
    counted in :attr:`tally` and copied to ``raw`` when given."""

    def __init__(self, raw: Optional[BinaryIO] = None) -> None:
        self.tally = KernelTally()
        self.raw = raw
        self.raw_error: Optional[OSError] = None     # the raw log stopped (full disk...): counting goes on
        self.taken = 0                                # verbose lines taken out
        self._held = b""                              # a possible marker start, or a verbose line so far
        self._in_line = False

    def feed(self, chunk: bytes) -> bytes:
        """The program's bytes in ``chunk`` (plus any held back before), verbose lines removed."""
        data = self._held + chunk if self._held else chunk
        self._held = b""
        out: list[bytes] = []
        start = 0
        end = len(data)
        while start < end:
            if self._in_line:
                newline = data.find(b"\n", start)
                if newline < 0:
                    if end - start > MAX_VERBOSE_LINE:   # not oneDNN's: give it back as it was
                        out.append(data[start:])
                        self._in_line = False
                    else:
                        self._held = data[start:]
                    break
                self._in_line = False
                if self._take(data[start:newline + 1]):
                    start = newline + 1
                    continue
                # the program's own text: passed on up to a marker inside it (oneDNN's line may
                # have landed in the middle of it), or whole
                inner = _find_marker(data, start + 1, newline + 1)
                stop = inner if inner >= 0 else newline + 1
                out.append(data[start:stop])
                start = stop
                continue
            found = _find_marker(data, start, end)
            if found >= 0:
                out.append(data[start:found])
                start = found
                self._in_line = True
                continue
            keep = _marker_prefix_length(data, start)
            out.append(data[start:end - keep])
            self._held = data[end - keep:]
            break
        return b"".join(out)

    def close(self) -> bytes:
        """End of stream: what was held back (a cut-off verbose line still counts, unprinted)."""
        held, self._held = self._held, b""
        out: list[bytes] = []
        while self._in_line:
            self._in_line = False
            if self._take(held):
                held = b""
                break
            inner = _find_marker(held, 1, len(held))
            if inner >= 0:
                out.append(held[:inner])
                held = held[inner:]
                self._in_line = True
        held = b"".join(out) + held
        if self.raw is not None and self.raw_error is None:
            try:
                self.raw.flush()
            except OSError as error:
                self.raw_error = error
        return held

    def _take(self, line: bytes) -> bool:
        """Count and log ``line`` if it is a verbose line; False when it is not."""
        if self.tally.add(line.decode("utf-8", "replace")) is None:
            return False
        self.taken += 1
        if self.raw is not None and self.raw_error is None:
            try:
                self.raw.write(line if line.endswith(b"\n") else line + b"\n")
            except OSError as error:
                self.raw_error = error
        return True


def _find_marker(data: bytes, start: int, end: int) -> int:
    """Where the first marker starts in ``data[start:end]``, or -1."""
    return min((at for at in (data.find(m, start, end) for m in _MARKERS) if at >= 0), default=-1)


def _marker_prefix_length(data: bytes, start: int) -> int:
    """How many bytes at the end of ``data[start:]`` could be the start of a marker."""
    longest = 0
    for marker in _MARKERS:
        for length in range(min(len(marker) - 1, len(data) - start), longest, -1):
            if data.endswith(marker[:length]):
                longest = length
                break
    return longest

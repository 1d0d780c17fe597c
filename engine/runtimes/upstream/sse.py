"""Server-sent events, bounded: bytes in, the ``data`` of each complete event out. Pure.

Sizes are checked before a byte is kept: a line longer than ``max_line`` or an event
longer than ``max_event`` raises :class:`SseTooLarge`, whatever the peer sends.
"""

from __future__ import annotations

MAX_LINE = 1 << 20
MAX_EVENT = 4 << 20


class SseTooLarge(ValueError):
    """The upstream sent a line or an event beyond the bounds."""


class SseParser:
    def __init__(self, *, max_line: int = MAX_LINE, max_event: int = MAX_EVENT) -> None:
        self.max_line = max_line
        self.max_event = max_event
        self._partial = bytearray()  # the line not ended yet
        self._data: list[bytes] = []  # data lines of the event under way
        self._size = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of every event ``chunk`` completes (lines joined by a newline)."""
        out: list[bytes] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                rest = len(chunk) - start
                if len(self._partial) + rest > self.max_line:
                    raise SseTooLarge(f"an event-stream line longer than {self.max_line} bytes")
                self._partial += chunk[start:]
                return out
            if len(self._partial) + end - start > self.max_line:
                raise SseTooLarge(f"an event-stream line longer than {self.max_line} bytes")
            if self._partial:
                self._partial += chunk[start:end]
                line = bytes(self._partial)
                self._partial.clear()
            else:
                line = chunk[start:end]
            start = end + 1
            event = self._line(line.rstrip(b"\r"))
            if event is not None:
                out.append(event)

    def _line(self, line: bytes) -> bytes | None:
        if not line:  # a blank line ends the event
            if not self._data:
                return None
            data = b"\n".join(self._data)
            self._data.clear()
            self._size = 0
            return data
        if line.startswith(b":"):  # a comment (keepalive)
            return None
        field, _, value = line.partition(b":")
        if field != b"data":
            return None  # event, id, retry: not used by these engines
        value = value[1:] if value.startswith(b" ") else value
        self._size += len(value) + 1
        if self._size > self.max_event:
            raise SseTooLarge(f"an event longer than {self.max_event} bytes")
        self._data.append(value)
        return None

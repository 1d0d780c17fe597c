"""What a pull raises, and the flag that cancels one (the leaf below every module of
`engine.models`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

CANCELLED = "the pull was cancelled; choose the model again to pull it"


class ModelMissing(Exception):
    """A model cannot be provided; the message is one line: cause and fix."""


class PullCancelled(ModelMissing):
    """The user cancelled the pull; what it had downloaded is removed."""


class CancelFlag:
    """A flag a pull running in a worker thread checks between blocks.

    `set` may come from any thread (the event loop's, usually); whoever waits on the
    pull is woken through `on_set`, so a cancelled wait ends at once."""

    def __init__(self) -> None:
        self.requested = False
        self.keep_part = False  # the part stays for the next start (Shoal quits)
        self._lock = threading.Lock()
        self._wakers: list[Callable[[], None]] = []

    def set(self, *, keep_part: bool = False) -> None:
        """Stop the pull; ``keep_part``: what it downloaded stays, to go on from at the
        next start (quitting), rather than removed (the user cancelled)."""
        with self._lock:
            self.requested = True
            self.keep_part = self.keep_part or keep_part
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def check(self) -> None:
        if self.requested:
            raise PullCancelled(CANCELLED)

    def on_set(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` when the flag is set (at once if it is); returns the undo."""
        with self._lock:
            self._wakers.append(wake)
            now = self.requested
        if now:
            wake()

        def undo() -> None:
            with self._lock:
                if wake in self._wakers:
                    self._wakers.remove(wake)
        return undo


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."

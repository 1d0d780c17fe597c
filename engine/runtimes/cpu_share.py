"""The CPUs of one process, shared by the decode threads of the models it serves at once.

A node that serves several models runs an engine for each, and each engine's llama.cpp
context would use every CPU: with two models decoding at once on two cores, four threads
spin at every layer's barrier for two cores, and each waits for the other's slice (the
benchmark measured a third of two single-model nodes' tokens/s). So an engine says when it
has work, and takes an equal part of the CPUs while others have work too: alone it has
them all, as before; two busy engines on two cores take one each.
"""

from __future__ import annotations

import threading


class CpuShare:
    def __init__(self) -> None:
        self._busy: set[int] = set()
        self._lock = threading.Lock()

    def working(self, engine: int, busy: bool) -> None:
        """``engine`` (any id unique while it lives) has work now, or no longer has."""
        with self._lock:
            if busy:
                self._busy.add(engine)
            else:
                self._busy.discard(engine)

    def threads(self, cpus: int) -> int:
        """The threads an engine with work may use of ``cpus``: an equal part of them."""
        with self._lock:
            return max(1, cpus // max(len(self._busy), 1))


SHARE = CpuShare()  # one per process: every engine of this node's models

"""Machines of the fleet as a source of model files: a pull asks them before the hub.

A machine that pulled a model keeps its files in the hub cache under their sha256 (the
hub's, which its pull checked). Another machine of the fleet that needs the model asks
the machines it knows for it over the fleet's link (engine.node.files does the asking and
the answering) and takes the files from the first that keeps them: checked against the
same sha256, resumable like a download, so a model crosses the internet once per fleet.

The pull runs in a worker thread, several calls below the code that knows the fleet; the
fleet rides along in a context variable (``asyncio.to_thread`` carries the caller's
context into the thread): :func:`fleet_for` around the call, :func:`current` in the pull.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from engine.models.pulls.transfer import Source, Wanted


@dataclass(frozen=True, slots=True)
class PeerOffer:
    """A model's files as a machine of the fleet keeps them, and how to take them."""

    wanted: list[Wanted]  # its files (shards in order), with the hub's sha256 of each
    source: Source


class Peers(Protocol):
    def offer(self, repo: str, quant: str | None,
              stopped: Callable[[], bool]) -> PeerOffer | None:
        """The files of hub model ``repo`` at ``quant`` from the first machine of the fleet
        that keeps them; None when none does (or none answers). Blocking."""
        ...


_FLEET: ContextVar[Peers | None] = ContextVar("shoal_pull_peers", default=None)


def current() -> Peers | None:
    """The machines the pull running here may take files from (None: the hub only)."""
    return _FLEET.get()


@contextlib.contextmanager
def fleet_for(peers: Peers | None) -> Iterator[None]:
    """Pulls started in this context (and the threads it is copied to) ask ``peers``."""
    token = _FLEET.set(peers)
    try:
        yield
    finally:
        _FLEET.reset(token)

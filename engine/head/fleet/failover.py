"""What a session does when an attempt on one node ends, as pure functions.

The session's task (:mod:`engine.head.fleet.sessions`) places the session, runs one
attempt (:mod:`engine.head.fleet.attempt`), then asks :func:`after` what next and
carries it out. No clock and no socket here: the time comes in as ``now``.

Decided on the attempt's final, in this order:

1. **NodeDone** (the node sent ``done``): end with the node's finish reason.
2. **Busy** (the node was full before any token): place again at once (the node is
   skipped for a moment); the queue deadline is kept, never shortened. A session that
   has delivered nothing and never moved does not count the next placement as a move.
3. **RequestRefused** (the request itself: a bad prompt, a prompt too long for the node's
   window): a final error, since no other node would take it either.
4. **Ceiling** (the generation ran for ``max_wall_s``): end as ``length``.
5. **Failover** (the node failed, hung or stalled): exclude it for this session; when
   every token asked for is already delivered, give up as ``length``; else place the
   rest on another node, the delivered tokens becoming context, with a fresh queue
   deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.errors import RequestCode
from engine.head.fleet import attempt as at


@dataclass(frozen=True, slots=True)
class SessionProgress:
    """What a session has done so far, across its attempts."""

    queue_deadline: float  # how long it may wait for a lane before giving up
    moves: int = 0
    cached_tokens: int = 0  # prompt tokens the first node had cached
    exclude: frozenset[str] = frozenset()  # nodes (pool keys) that failed this session
    moved_from: str | None = None  # the next placement moves the session from this node


def begin(now: float, queue_timeout_s: float) -> SessionProgress:
    return SessionProgress(queue_deadline=now + queue_timeout_s)


def placed(progress: SessionProgress, node: str) -> tuple[SessionProgress, str | None]:
    """The session went to ``node``; also returns the node it moved from, if it moved."""
    moved_from = progress.moved_from
    moves = progress.moves + (moved_from is not None)
    return replace(progress, moves=moves, moved_from=node), moved_from


# -- what next -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndSession:
    """The session is over: finish it with ``reason`` (stop | length)."""

    reason: str


@dataclass(frozen=True, slots=True)
class NextNode:
    """The node was full: skip it for a moment and place the session again at once."""

    message: str


@dataclass(frozen=True, slots=True)
class FailRequest:
    """The request itself was refused: fail the session with this code and message."""

    code: RequestCode
    message: str


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The generation ceiling: finish as ``length`` (the node was told to cancel)."""


@dataclass(frozen=True, slots=True)
class Replace:
    """The node failed: place the rest of the session on another node."""

    why: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The node failed after every token asked for was delivered: finish as ``length``."""

    why: str


Decision = EndSession | NextNode | FailRequest | Ceiling | Replace | GiveUp


def after(progress: SessionProgress, final: at.Final | None, *, node: str, delivered: int,
          max_tokens: int, finish_reason: str, cached_tokens: int, now: float,
          queue_timeout_s: float) -> tuple[SessionProgress, Decision]:
    """What the session does now that its attempt on ``node`` (a pool key) ended with
    ``final`` (None: the attempt ended without one). ``delivered`` counts every token of
    the session so far; ``finish_reason`` and ``cached_tokens`` are the node's ``done``."""
    if isinstance(final, at.NodeDone):
        cached = progress.cached_tokens if progress.moves else cached_tokens
        return replace(progress, cached_tokens=cached), EndSession(finish_reason)
    if isinstance(final, at.Busy):
        fresh = not delivered and not progress.moves
        return replace(progress, moved_from=None if fresh else progress.moved_from,
                       queue_deadline=max(progress.queue_deadline, now)), NextNode(final.message)
    if isinstance(final, at.RequestRefused):
        code: RequestCode = ("invalid_request" if final.code == "bad_request"
                             else "context_length_exceeded")
        return progress, FailRequest(code, final.message)
    if isinstance(final, at.WallExceeded):
        return progress, Ceiling()
    why = final.reason if isinstance(final, at.Failover) else "the attempt ended"
    progress = replace(progress, exclude=progress.exclude | {node})
    if delivered >= max_tokens:
        return progress, GiveUp(why)
    return replace(progress, queue_deadline=now + queue_timeout_s), Replace(why)

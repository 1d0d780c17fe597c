"""One try of a session on one node, as a pure state machine.

The IO around it (:mod:`engine.head.fleet.sessions`) sends the generation, then feeds
:func:`step` what happened (a record from the node, or nothing before the
deadline that :func:`next_deadline` named) with the time, and carries out the
returned actions. No clock and no socket here: tests drive it with tables.

What is decided, in this order at every step:

1. **Ceiling**: at ``wall_deadline`` the attempt is cancelled and ends as ``length``.
2. **Hung node**: nothing heard on the connection (a token, a pong, stats) for
   ``stall_s``: the node is hung; fail over and drop every connection to it. After
   ``ping_s`` of silence the head pings, at most once per ``ping_s``.
3. **No progress**: an attempt that gets neither tokens nor ``done`` in time fails
   over (the node answers pings, so only this connection is dropped). In time means:
   ``accepted`` within one lease of sending; the first token within one lease plus the
   prompt's prefill (:func:`prefill_allowance`) of ``accepted``; every later token
   within one lease of the one before. Before the first token (accepted or not yet), a
   ``progress`` record (the node is prefilling the prompt, or loading its model after
   sleeping) moves that bound to one lease after it, never earlier: a node that keeps
   reporting is never failed over for a long prefill or a slow load.
4. **Renewals**: once accepted, the lease is renewed every third of a lease. They
   go out from the attempt's own task, whatever the HTTP client reads.

Records from the node: ``accepted`` starts renewals; ``progress`` counts as progress
(above); ``tokens`` must arrive in index order (a gap or a repeat fails the attempt
over); ``done`` finishes it;
``error`` ends it as busy (before any token: try the next node at once), a
refusal of the request (``bad_request``, ``context_length_exceeded``: final, no
other node would take it) or a node failure (fail over).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from engine.head.fleet.placement import prefill_seconds

# -- what happened -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tick:
    """Nothing arrived before the deadline; ``heard_at`` is the connection's last record."""

    heard_at: float


@dataclass(frozen=True, slots=True)
class GotAccepted:
    pass


@dataclass(frozen=True, slots=True)
class GotTokens:
    index: int
    count: int


@dataclass(frozen=True, slots=True)
class GotProgress:
    """The node is prefilling (``prefilled`` of ``prompt`` tokens) or loading its model."""

    prefilled: int
    prompt: int
    loading: bool = False


@dataclass(frozen=True, slots=True)
class GotDone:
    pass


@dataclass(frozen=True, slots=True)
class GotError:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Lost:
    """The connection closed."""

    reason: str


Event = Tick | GotAccepted | GotProgress | GotTokens | GotDone | GotError | Lost

# -- what to do ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendRenew:
    pass


@dataclass(frozen=True, slots=True)
class SendPing:
    nonce: int


@dataclass(frozen=True, slots=True)
class Deliver:
    """The tokens just received are in order: hand them to the session."""


@dataclass(frozen=True, slots=True)
class NodeDone:
    """``done`` arrived: the connection is reusable."""


@dataclass(frozen=True, slots=True)
class Busy:
    """The node refused the session as full before any token: try the next node."""

    message: str


@dataclass(frozen=True, slots=True)
class RequestRefused:
    """The node refused the request itself; no other node would take it either."""

    code: Literal["bad_request", "context_length_exceeded"]
    message: str


@dataclass(frozen=True, slots=True)
class Failover:
    """This node failed the session: place the rest elsewhere.

    ``hung``: the whole node is silent (drop every connection to it);
    ``drop``: this connection cannot be trusted any more (abort it);
    ``by_node``: the node said it failed (an error record), as against going silent or away.
    """

    reason: str
    hung: bool = False
    drop: bool = True
    by_node: bool = False


@dataclass(frozen=True, slots=True)
class WallExceeded:
    """The generation ceiling: cancel on the node and end as ``length``."""


Action = SendRenew | SendPing | Deliver | NodeDone | Busy | RequestRefused | Failover | WallExceeded
Final = NodeDone | Busy | RequestRefused | Failover | WallExceeded

# -- the machine ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptLimits:
    lease_s: float = 10.0
    stall_s: float = 3.0
    ping_s: float = 1.0
    prefill_floor_tps: float = 50.0  # prices a prompt at a node that has not measured its rate


@dataclass(frozen=True, slots=True)
class AttemptState:
    heard_at: float  # the last record of any kind on this connection
    pinged_at: float
    progress_by: float  # accepted, the first token, or the next token is due by then
    wall_deadline: float
    prefill_s: float  # the seconds the node is given to prefill (prefill_allowance)
    accepted: bool = False
    renew_at: float = math.inf
    expected: int = 0  # index of the next token
    pings: int = 0
    final: bool = False


def start(now: float, *, prompt_tokens: int, prefill_tps: float, wall_deadline: float,
          limits: AttemptLimits, heard_at: float | None = None, cached: int = 0,
          s_per_token: float = 0.0, s_per_token_ctx: float = 0.0) -> AttemptState:
    """The state right after the generation was sent (silence counts from now); the
    prefill is priced by :func:`prefill_allowance` from the node's rates."""
    return AttemptState(heard_at=max(now, heard_at or now), pinged_at=-math.inf,
                        progress_by=now + limits.lease_s, wall_deadline=wall_deadline,
                        prefill_s=prefill_allowance(
                            prompt_tokens, prefill_tps, limits, cached=cached,
                            s_per_token=s_per_token, s_per_token_ctx=s_per_token_ctx))


def prefill_allowance(prompt_tokens: int, prefill_tps: float, limits: AttemptLimits, *,
                      cached: int = 0, s_per_token: float = 0.0,
                      s_per_token_ctx: float = 0.0) -> float:
    """Seconds a node is given to prefill a prompt of ``prompt_tokens``, of which it holds
    the first ``cached`` (0: not known), before its first token is late.

    A node that fitted its cost (``s_per_token``, ``s_per_token_ctx``) is priced by it for
    the part it does not hold (it reports Progress too, so a cache it lost since costs no
    failover). Else the whole prompt at its measured ``prefill_tps``, or at
    ``limits.prefill_floor_tps`` when it has not measured one.
    """
    if s_per_token > 0 or s_per_token_ctx > 0:
        held = max(min(cached, prompt_tokens - 1), 0)
        return prefill_seconds(prompt_tokens - held, held, tps=0.0, s_per_token=s_per_token,
                               s_per_token_ctx=s_per_token_ctx)
    rate = prefill_tps if prefill_tps > 0 else limits.prefill_floor_tps
    return prefill_seconds(prompt_tokens, tps=max(rate, 1e-9))


def first_token_due(accepted_at: float, prompt_tokens: int, prefill_tps: float,
                    limits: AttemptLimits, *, cached: int = 0, s_per_token: float = 0.0,
                    s_per_token_ctx: float = 0.0) -> float:
    """When the first token is due, for a generation accepted at ``accepted_at``."""
    return accepted_at + limits.lease_s + prefill_allowance(
        prompt_tokens, prefill_tps, limits, cached=cached, s_per_token=s_per_token,
        s_per_token_ctx=s_per_token_ctx)


def next_deadline(state: AttemptState, limits: AttemptLimits) -> float:
    """When :func:`step` must run next even if nothing arrives."""
    silent_ping = max(state.heard_at, state.pinged_at) + limits.ping_s
    return min(state.wall_deadline, state.heard_at + limits.stall_s, silent_ping,
               state.progress_by, state.renew_at)


_DELIVER = (Deliver(),)


def step(state: AttemptState, event: Event, now: float,
         limits: AttemptLimits) -> tuple[AttemptState, tuple[Action, ...]]:
    """Apply ``event`` at ``now``: the new state and what to do, finals last."""
    if (type(event) is GotTokens and event.index == state.expected and not state.final
            and now < state.wall_deadline and now < state.renew_at and state.heard_at <= now
            and min(limits.ping_s, limits.stall_s, limits.lease_s) > 0):
        # the common case, once per token: tokens in order with no timer due. The same
        # outcome as the general path below (tests hold them equal), without its copies
        # of the state, which cost more than everything else the head does per token
        return AttemptState(
            heard_at=now, pinged_at=state.pinged_at, progress_by=now + limits.lease_s,
            wall_deadline=state.wall_deadline, prefill_s=state.prefill_s,
            accepted=state.accepted,
            renew_at=state.renew_at, expected=state.expected + event.count,
            pings=state.pings, final=False), _DELIVER
    return _step(state, event, now, limits)


def _step(state: AttemptState, event: Event, now: float,
          limits: AttemptLimits) -> tuple[AttemptState, tuple[Action, ...]]:
    """:func:`step` for every event."""
    if state.final:
        return state, ()
    heard = event.heard_at if isinstance(event, Tick) else now
    state = replace(state, heard_at=max(state.heard_at, heard))
    actions: list[Action] = []
    final: Final | None = _record(state, event, now, limits, actions)
    if isinstance(event, GotAccepted):
        state = replace(state, accepted=True, renew_at=now + limits.lease_s / 3,
                        progress_by=now + limits.lease_s + state.prefill_s)
    elif isinstance(event, GotProgress) and state.expected == 0:
        # still before the first token: the node is working on it
        state = replace(state, progress_by=max(state.progress_by, now + limits.lease_s))
    elif isinstance(event, GotTokens) and final is None:
        state = replace(state, expected=state.expected + event.count,
                        progress_by=now + limits.lease_s)
    if final is None:
        final = _timers(state, now, limits)
    if final is None:
        if state.accepted and now >= state.renew_at:
            actions.append(SendRenew())
            state = replace(state, renew_at=now + limits.lease_s / 3)
        silent = now - state.heard_at
        if silent >= limits.ping_s and now - state.pinged_at >= limits.ping_s:
            actions.append(SendPing(state.pings + 1))
            state = replace(state, pings=state.pings + 1, pinged_at=now)
        return state, tuple(actions)
    return replace(state, final=True), (*actions, final)


def _record(state: AttemptState, event: Event, now: float, limits: AttemptLimits,
            actions: list[Action]) -> Final | None:
    """What a record (or a lost connection) means on its own."""
    if isinstance(event, GotTokens):
        if event.index != state.expected:
            return Failover(f"token index {event.index} where {state.expected} was due")
        actions.append(Deliver())
        return None
    if isinstance(event, GotDone):
        return NodeDone()
    if isinstance(event, Lost):
        return Failover(f"connection lost ({event.reason})", drop=False)
    if isinstance(event, GotError):
        if event.code == "busy" and state.expected == 0:
            return Busy(event.message)
        if event.code == "bad_request":
            return RequestRefused("bad_request", event.message)
        if event.code == "context_length_exceeded":
            return RequestRefused("context_length_exceeded", event.message)
        return Failover(f"node error {event.code}: {event.message}", drop=False, by_node=True)
    return None


def _timers(state: AttemptState, now: float, limits: AttemptLimits) -> Final | None:
    if now >= state.wall_deadline:
        return WallExceeded()
    silent = now - state.heard_at
    if silent >= limits.stall_s:
        return Failover(f"no tokens and no pong for {silent:.1f} s; treating the node as hung",
                        hung=True)
    if now >= state.progress_by:
        what = ("no token" if state.accepted and state.expected else
                "no first token" if state.accepted else "no answer to the generation")
        return Failover(f"{what} in time although the node answers pings; trying another "
                        "node")
    return None

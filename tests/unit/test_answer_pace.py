"""When a waiting answer commits to 200 and sends keepalives (engine.api.answer.Pace):
a pure function of the head's clock, driven by tables."""

from __future__ import annotations

import pytest

from engine.api.answer import DISCONNECT_POLL_S, Pace

PACE = Pace(commit_at=5.0, keepalive_s=5.0)


@pytest.mark.parametrize(("now", "committed", "committable", "last_write", "todo"), [
    # before the commit time a refusal can still be told by its status
    (4.9, False, True, 0.0, "wait"),
    (5.0, False, True, 0.0, "commit"),
    # a request waiting for a node that may never come is never committed
    (60.0, False, False, 0.0, "wait"),
    # once committed: a keepalive every keepalive_s of quiet
    (9.9, True, True, 5.0, "wait"),
    (10.0, True, True, 5.0, "keepalive"),
    (10.0, True, False, 5.0, "keepalive"),
])
def test_when_quiet(now: float, committed: bool, committable: bool, last_write: float,
                    todo: str) -> None:
    assert PACE.when_quiet(now, committed=committed, committable=committable,
                           last_write=last_write) == todo


@pytest.mark.parametrize(("now", "committed", "committable", "last_write", "wait"), [
    (4.8, False, True, 0.0, 0.2),  # until the commit time
    (6.0, False, True, 0.0, 0.0),  # overdue: at once
    (1.0, False, False, 0.0, DISCONNECT_POLL_S),  # polls for a client that went away
    (9.75, True, True, 5.0, 0.25),  # until the next keepalive
    (6.0, True, True, 5.0, DISCONNECT_POLL_S),  # never longer than a poll
])
def test_wait_s(now: float, committed: bool, committable: bool, last_write: float,
                wait: float) -> None:
    got = PACE.wait_s(now, committed=committed, committable=committable,
                      last_write=last_write)
    assert got == pytest.approx(wait)

"""What a session does after an attempt ends (engine.head.fleet.failover): a pure
function of (progress, the attempt's final, now), driven by tables."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.head.fleet import attempt as at
from engine.head.fleet import failover as fo

QUEUE_S = 20.0
START = fo.SessionProgress(queue_deadline=20.0, moved_from="n1")  # placed once, on n1


def after(final: at.Final | None, progress: fo.SessionProgress = START, *, delivered: int = 0,
          max_tokens: int = 10, now: float = 5.0) -> tuple[fo.SessionProgress, fo.Decision]:
    return fo.after(progress, final, node="key-n1", delivered=delivered,
                    max_tokens=max_tokens, finish_reason="stop", cached_tokens=7, now=now,
                    queue_timeout_s=QUEUE_S)


@pytest.mark.parametrize(("final", "delivered", "decision"), [
    (at.NodeDone(), 3, fo.EndSession("stop")),
    (at.Busy("all 1 lanes are busy"), 0, fo.NextNode("all 1 lanes are busy")),
    (at.RequestRefused("bad_request", "ids outside the vocabulary"), 0,
     fo.FailRequest("invalid_request", "ids outside the vocabulary")),
    (at.RequestRefused("context_length_exceeded", "too long"), 0,
     fo.FailRequest("context_length_exceeded", "too long")),
    (at.WallExceeded(), 4, fo.Ceiling()),
    (at.Failover("connection lost (reset)", drop=False), 4,
     fo.Replace("connection lost (reset)")),
    (at.Failover("no first token in time", hung=True), 0, fo.Replace("no first token in time")),
    (None, 4, fo.Replace("the attempt ended")),
    # every token asked for was delivered before the node failed: nothing left to place
    (at.Failover("connection lost (reset)", drop=False), 10,
     fo.GiveUp("connection lost (reset)")),
])
def test_decision_on_each_final(final: at.Final | None, delivered: int,
                                decision: fo.Decision) -> None:
    assert after(final, delivered=delivered)[1] == decision


def test_failover_excludes_the_node_and_gives_a_fresh_queue_deadline() -> None:
    progress, _ = after(at.Failover("hung", hung=True), now=30.0)
    assert progress.exclude == {"key-n1"}
    assert progress.queue_deadline == 30.0 + QUEUE_S
    again, _ = fo.after(progress, at.Failover("hung"), node="key-n2", delivered=0,
                        max_tokens=10, finish_reason="", cached_tokens=0, now=31.0,
                        queue_timeout_s=QUEUE_S)
    assert again.exclude == {"key-n1", "key-n2"}


def test_giving_up_still_excludes_the_node() -> None:
    progress, decision = after(at.Failover("x"), delivered=10, now=30.0)
    assert isinstance(decision, fo.GiveUp)
    assert progress.exclude == {"key-n1"} and progress.queue_deadline == START.queue_deadline


@pytest.mark.parametrize(("now", "deadline"), [(5.0, 20.0), (25.0, 25.0)])
def test_busy_keeps_the_queue_deadline_and_never_shortens_it(now: float,
                                                            deadline: float) -> None:
    progress, _ = after(at.Busy("full"), now=now)
    assert progress.queue_deadline == deadline and progress.exclude == frozenset()


@pytest.mark.parametrize(("moves", "delivered", "moved_from"), [
    (0, 0, None),  # nothing delivered, never moved: the next placement is the first
    (0, 3, "n1"),  # tokens delivered: the next placement is a move from n1
    (1, 0, "n1"),  # moved before: still a move
])
def test_busy_forgets_the_node_only_for_a_fresh_session(moves: int, delivered: int,
                                                        moved_from: str | None) -> None:
    progress, _ = after(at.Busy("full"), replace(START, moves=moves), delivered=delivered)
    assert progress.moved_from == moved_from


@pytest.mark.parametrize(("moves", "cached"), [(0, 7), (1, 0)])
def test_cached_tokens_count_only_on_the_first_node(moves: int, cached: int) -> None:
    progress, _ = after(at.NodeDone(), replace(START, moves=moves))
    assert progress.cached_tokens == cached


def test_placements_count_moves_and_name_the_node_left() -> None:
    progress = fo.begin(100.0, QUEUE_S)
    assert progress == fo.SessionProgress(queue_deadline=120.0)
    progress, moved = fo.placed(progress, "n1")
    assert moved is None and progress.moves == 0
    progress, moved = fo.placed(progress, "n2")
    assert moved == "n1" and progress.moves == 1 and progress.moved_from == "n2"

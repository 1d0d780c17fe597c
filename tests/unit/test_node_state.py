"""A node's state as a head sees it (engine.head.fleet.node_state): the transition table
and the lives of a dialed and a joined node, without sockets."""

from __future__ import annotations

from typing import get_args

import pytest

from engine.head.fleet.node_state import TRANSITIONS, NodeEvent, NodeState, transition

STATES: tuple[NodeState, ...] = get_args(NodeState)
EVENTS: tuple[NodeEvent, ...] = get_args(NodeEvent)

# the expected state after each event (columns in EVENTS order), one row per state
C, R, U, L = "connecting", "ready", "unreachable", "left"
EXPECTED: dict[str, tuple[str, ...]] = {
    #             dial_ok dial_failed with_conns joined closed_joined closed_dialed hung
    "connecting": (R, U, C, R, C, C, U),
    "ready": (R, U, R, R, L, R, U),
    "unreachable": (R, U, U, R, U, U, U),
    "left": (R, U, L, R, L, L, U),
}


def test_events_are_in_the_order_of_the_expected_table() -> None:
    assert EVENTS == ("dial_ok", "dial_failed", "dial_failed_with_conns", "joined",
                      "closed_last_joined", "closed_last_dialed", "hung")


@pytest.mark.parametrize(("state", "event", "after"), [
    (state, event, EXPECTED[state][i]) for state in STATES for i, event in enumerate(EVENTS)])
def test_transition(state: NodeState, event: NodeEvent, after: str) -> None:
    assert transition(state, event) == after


def test_the_table_covers_every_state_and_event() -> None:
    assert set(TRANSITIONS) == set(STATES)
    for state in STATES:
        assert set(TRANSITIONS[state]) == set(EVENTS)


def run(events: list[NodeEvent], start: NodeState = "connecting") -> list[NodeState]:
    states = [start]
    for event in events:
        states.append(transition(states[-1], event))
    return states


def test_a_dialed_node_is_redialed_never_left() -> None:
    assert run(["dial_failed", "dial_failed", "dial_ok", "closed_last_dialed", "dial_failed",
                "dial_ok"]) == [C, U, U, R, R, U, R]


def test_a_joined_node_leaves_and_joins_again() -> None:
    assert run(["joined", "closed_last_joined", "joined"]) == [C, R, L, R]


def test_a_hung_joined_node_is_unreachable_until_it_joins_again() -> None:
    assert run(["joined", "hung", "closed_last_joined", "joined"]) == [C, R, U, U, R]


def test_a_failed_dial_with_connections_open_changes_nothing() -> None:
    for state in STATES:
        assert transition(state, "dial_failed_with_conns") == state

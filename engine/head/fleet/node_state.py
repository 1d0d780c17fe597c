"""A node's state as this head sees it: one table of transitions, no IO.

:class:`engine.head.fleet.links.NodePool` feeds :func:`transition` what happened to its
connections and keeps the result; the logs and events that go with a change stay
with the pool.

States:

- ``connecting``: known to the head, not linked yet.
- ``ready``: linked; takes sessions of the model it serves (a node serving a model
  this head has no tokenizer for is ready too, and placement passes it by).
- ``unreachable``: its dials fail, or it went silent holding a session; a dialed
  node is redialed every ``RETRY_S``.
- ``left``: a joined node whose last connection closed; it comes back by joining
  again (the head never dials a joined node).

Events:

- ``dial_ok``: every connection the head wants to a dialed node is open.
- ``dial_failed``: a dial failed and no connection to the node is open.
- ``dial_failed_with_conns``: a dial failed while other connections stay open.
- ``joined``: a joining node said hello on a new connection.
- ``closed_last_joined``: the last connection of a joined node closed.
- ``closed_last_dialed``: the last connection of a dialed node closed (its maintainer
  redials: the next dial decides).
- ``hung``: the node went silent holding a session; every connection is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

NodeState = Literal["connecting", "ready", "unreachable", "left"]
# as shown (snapshot, /v1/fleet): a ready node whose user paused serving is "paused"
ShownState = Literal["connecting", "ready", "paused", "failing", "unreachable", "left"]
NodeEvent = Literal["dial_ok", "dial_failed", "dial_failed_with_conns", "joined",
                    "closed_last_joined", "closed_last_dialed", "hung"]

# every (state, event) pair, so that no change is implied
TRANSITIONS: Mapping[NodeState, Mapping[NodeEvent, NodeState]] = {
    "connecting": {
        "dial_ok": "ready", "dial_failed": "unreachable",
        "dial_failed_with_conns": "connecting", "joined": "ready",
        "closed_last_joined": "connecting", "closed_last_dialed": "connecting",
        "hung": "unreachable"},
    "ready": {
        "dial_ok": "ready", "dial_failed": "unreachable", "dial_failed_with_conns": "ready",
        "joined": "ready", "closed_last_joined": "left", "closed_last_dialed": "ready",
        "hung": "unreachable"},
    "unreachable": {
        "dial_ok": "ready", "dial_failed": "unreachable",
        "dial_failed_with_conns": "unreachable", "joined": "ready",
        "closed_last_joined": "unreachable", "closed_last_dialed": "unreachable",
        "hung": "unreachable"},
    "left": {
        "dial_ok": "ready", "dial_failed": "unreachable", "dial_failed_with_conns": "left",
        "joined": "ready", "closed_last_joined": "left", "closed_last_dialed": "left",
        "hung": "unreachable"},
}


def transition(state: NodeState, event: NodeEvent) -> NodeState:
    """The state after ``event`` in ``state``."""
    return TRANSITIONS[state][event]

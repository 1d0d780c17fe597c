"""A node that fails sessions before their first token rests (engine/head/fleet/cooldown.py)."""

from __future__ import annotations

from engine.head.fleet.cooldown import FAILS, MAX_S, Cooldown


def test_a_node_rests_after_failures_in_a_row_longer_each_time() -> None:
    c = Cooldown()
    rests = [c.failed_at_once("the model file is damaged", float(n)) for n in range(FAILS + 8)]
    assert rests[:FAILS - 1] == [0.0] * (FAILS - 1)  # a failure or two: no rest yet
    assert rests[FAILS - 1:FAILS + 2] == [1.0, 2.0, 4.0]
    assert rests[-1] == MAX_S and max(rests) == MAX_S
    now = float(FAILS + 7)
    assert c.resting(now) and not c.resting(now + MAX_S)
    assert c.cause == "the model file is damaged"
    c.worked()  # a token there: the count starts again
    assert not c.resting(now) and c.failures == 0 and c.cause == ""

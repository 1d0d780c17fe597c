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


def test_only_the_nodes_own_word_counts_not_a_silent_or_lost_node() -> None:
    """A frozen node's sessions fail before a token too; the link judges it (unreachable,
    then linked again), and it must take sessions as soon as it thaws."""
    from types import SimpleNamespace

    from engine.head.fleet import attempt as at
    from engine.head.fleet.links import Fleet
    from engine.head.fleet.sessions import SessionRunner

    runner = SessionRunner(Fleet(model="m", head_id="h", psk=None))
    pool = SimpleNamespace(cooldown=Cooldown(), info=SimpleNamespace(identity="n"))
    for final in (at.Failover("no tokens and no pong for 3.0 s", hung=True),
                  at.Failover("connection lost (reset)", drop=False)):
        for _ in range(FAILS + 2):
            runner._judge(pool, final, got_tokens=False, now=0.0)  # type: ignore[arg-type]
    assert pool.cooldown.failures == 0 and not pool.cooldown.resting(0.0)
    said = at.Failover("node error internal: damaged", drop=False, by_node=True)
    for _ in range(FAILS):
        runner._judge(pool, said, got_tokens=False, now=0.0)  # type: ignore[arg-type]
    assert pool.cooldown.resting(0.0) and pool.cooldown.cause == said.reason

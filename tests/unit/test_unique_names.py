"""Every machine is shown by its user's name for it, made unique in the fleet
(engine/head/observe.py): two machines both called "vm" once showed as "vm (local)" twice."""

from __future__ import annotations

from typing import Any

from engine.head.observe import told_apart, unique_names
from engine.snapshot import NodeSnapshot


def node(identity: str, address: str, link: Any = "joined") -> NodeSnapshot:
    return NodeSnapshot(key=f"{link}:{identity}@{address}", identity=identity, address=address,
                        link=link, state="ready", model="m", runtime="mock",
                        context_window=4096, lanes=2, lanes_busy=0, own_sessions=0,
                        kv_used=0, kv_total=0, prefill_tps=0.0, decode_tps=0.0, ttft_ms=0.0,
                        last_seen=0.0, sessions_total=0, peak_busy=0, connections=1,
                        error=None)


def test_namesakes_are_told_apart_by_address_and_this_machine_keeps_its_name() -> None:
    shown = unique_names((node("vm", "127.0.0.1:9001", "local"), node("vm", "10.0.0.7:8455"),
                          node("studio", "10.0.0.8:8455")))
    assert [n.identity for n in shown] == ["vm", "vm (10.0.0.7)", "studio"]


def test_two_namesakes_at_one_address_get_their_ports() -> None:
    shown = unique_names((node("vm", "10.0.0.7:8455"), node("vm", "10.0.0.7:8456")))
    names = [n.identity for n in shown]
    assert names == ["vm (10.0.0.7):8455", "vm (10.0.0.7):8456"]
    assert len(set(names)) == 2


def test_heads_and_nodes_are_told_apart_by_one_rule() -> None:
    # this machine's, a namesake elsewhere, and a head too old to say its name (by its id)
    assert told_apart([("vm", "", True), ("vm", "10.0.0.7:8454", False),
                       ("3fa1c0de", "10.0.0.9:8454", False)]) == \
        ["vm", "vm (10.0.0.7)", "3fa1c0de"]

"""Which nodes a split names (engine.head.fleet.split_ask): the serving node's key and where
each lender takes links, or one line naming the cause and the fix. No sockets."""

from __future__ import annotations

import pytest

from engine.errors import CommandError
from engine.head.fleet.split_ask import split_targets
from engine.snapshot import LinkKind, NodeSnapshot


def node(key: str, identity: str, address: str, *, lend: int = 0,
         link: LinkKind = "dialed", reach: str = "") -> NodeSnapshot:
    return NodeSnapshot(key=key, identity=identity, address=address, link=link, state="ready",
                        model="m", runtime="mock", context_window=4096, lanes=1,
                        lanes_busy=0, own_sessions=0, kv_used=0, kv_total=0, prefill_tps=0.0,
                        decode_tps=0.0, ttft_ms=0.0, last_seen=0.0, sessions_total=0,
                        peak_busy=0, connections=1, error=None, lend_bytes=lend,
                        reach=reach)


NODES = (node("local", "studio", "127.0.0.1:41000", lend=1 << 30, link="local"),
         node("10.0.0.2:8455", "laptop", "10.0.0.2:8455"),
         node("10.0.0.3:8455", "desk", "10.0.0.3:8455", lend=8 << 30),
         node("joined:nas", "nas", "10.0.0.4:51234", lend=4 << 30, link="joined"))


def test_a_lender_that_joined_is_reached_where_it_says_it_listens() -> None:
    lends = node("joined:nas", "nas", "10.0.0.4:51234", lend=4 << 30, link="joined",
                 reach="10.0.0.4:8455")
    got = split_targets((*NODES[:3], lends), ["laptop", "nas", "desk"])
    assert got.lenders == ("10.0.0.4:8455", "10.0.0.3:8455")


def test_machines_are_named_as_the_fleet_names_them_or_by_key() -> None:
    got = split_targets(NODES, ["laptop", "Desk"])
    assert (got.serving, got.lenders, got.names) == ("10.0.0.2:8455", ("10.0.0.3:8455",),
                                                     ("laptop", "desk"))
    assert split_targets(NODES, ["10.0.0.2:8455", "10.0.0.3:8455"]) == got
    # this machine serving, by the name the app gives it
    assert split_targets(NODES, ["this machine", "desk"]).serving == "local"


@pytest.mark.parametrize(("machines", "code", "line"), [
    (["laptop", "attic"], "machine_unknown",
     "no machine 'attic' in the fleet (it has: desk, laptop, nas, studio); name machines as "
     "the Fleet page and /v1/fleet show them"),
    (["desk", "laptop"], "not_lending",
     "laptop lends no memory to the fleet; turn lending on there (Settings: Lend this "
     "machine's memory to models split across the fleet, or `shoal node --lend`)"),
    (["laptop", "nas"], "not_listening",
     "nas joined this head and takes no links from other machines; start its node with "
     "--listen to lend its memory"),
    (["laptop", "studio"], "not_listening",
     "studio is reached at 127.0.0.1:41000, on this machine only; serve the model on this "
     "machine, or have another machine lend"),
    (["laptop"], "bad_split", "a split names the machine that serves the model, then at "
                              "least one that lends memory: --split SERVING,LENDER"),
    (["desk", "laptop", "10.0.0.3:8455"], "bad_split",
     "the split names desk twice; name each machine once"),
    (["laptop", *(["desk"] * 8)], "bad_split",
     "a split takes 8 machines at most (9 given); name fewer"),
])
def test_each_refusal_names_the_cause_and_the_fix(machines: list[str], code: str,
                                                  line: str) -> None:
    with pytest.raises(CommandError) as err:
        split_targets(NODES, machines)
    assert (err.value.code, str(err.value)) == (code, line)

"""Heads are shown by their machines' host names, told to each other in their hellos and
made unique in the fleet (issue 30, item 21: heads showed as random hex that changed at
every restart). Three heads in this loop, linked over real fleet links on 127.0.0.1: one
dials the two others, one of them its namesake."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.head.observe import heads_snapshot
from tests.integration.fleet_heads import listening, make_head
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def shown(head: Head) -> list[tuple[str, bool]]:
    return [(h.name, h.this_machine) for h in heads_snapshot(head)]


async def test_heads_go_by_their_host_names_and_a_namesake_by_its_address() -> None:
    vm, studio, other_vm = (make_head(al.AliasTable(), "a1", "vm"),
                            make_head(al.AliasTable(), "b2", "studio"),
                            make_head(al.AliasTable(), "c3", "vm"))
    heads = (vm, studio, other_vm)
    try:
        async with AsyncExitStack() as stack:
            for target in (studio, other_vm):
                port = await stack.enter_async_context(listening(target))
                assert vm.peers is not None
                vm.peers.dial("127.0.0.1", port)
            await until(lambda: all(h.name for h in heads_snapshot(vm)),
                        "the dialing head to have the others' names")
            # the dialer's hello named it to each head it dialed; their hellos named them
            assert sorted(shown(vm)) == [("studio", False), ("vm", True),
                                         ("vm (127.0.0.1)", False)]
            await until(lambda: len(shown(studio)) == 2 and all(n for n, _ in shown(studio)),
                        "the dialed head to have the dialer's name")
            assert sorted(shown(studio)) == [("studio", True), ("vm", False)]
    finally:
        for head in heads:
            await head.close()

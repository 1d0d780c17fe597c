"""What a head knows, as snapshot parts: its nodes, the fleet's heads, aliases and models.

Read only; the service adds this machine's roles and pulls to make a `FleetSnapshot`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from engine.head.commands import AliasCommands
from engine.head.fleet.links import NodePool
from engine.head.head import Head
from engine.head.prompt.model import capabilities
from engine.snapshot import (
    AliasSnapshot,
    FleetSnapshot,
    HeadSnapshot,
    KeptModelSnapshot,
    LinkKind,
    ModelSnapshot,
    NodeSnapshot,
    PullSnapshot,
    Roles,
)


def node_snapshot(pool: NodePool, *, now: float, wall: float) -> NodeSnapshot:
    """One node as this head sees it; ``now`` on the fleet's clock, ``wall`` time.time()."""
    st = pool.stats
    busy = max(pool.own_sessions, st.lanes_busy if st else 0)
    heard = max((c.last_rx for c in [*pool.idle, *pool.busy]), default=0.0)
    link: LinkKind = "local" if pool.key == "local" else "dialed" if pool.dialed else "joined"
    return NodeSnapshot(
        key=pool.key, identity=pool.info.identity, address=pool.address, link=link,
        state=pool.shown_state(),
        model=pool.info.model, runtime=pool.info.runtime,
        context_window=pool.info.context_window, lanes=pool.info.lanes, lanes_busy=busy,
        own_sessions=pool.own_sessions, kv_used=st.kv_used if st else 0,
        kv_total=st.kv_total if st else 0,
        prefill_tps=round(st.rates.prefill_tps, 1) if st else 0.0,
        decode_tps=round(st.rates.decode_tps, 1) if st else 0.0,
        ttft_ms=round(st.rates.ttft_ms, 1) if st else 0.0,
        last_seen=wall - (now - heard) if heard else 0.0,
        sessions_total=pool.sessions_total, peak_busy=st.peak_busy if st else 0,
        connections=pool.conns, error=pool.shown_error(), **pool.pool_report(),
        kept=tuple(KeptModelSnapshot(k.name, k.state, memory=k.mem, size=k.size,
                                     embeddings=k.embeds, context_window=k.context_window)
                   for k in pool.kept))


def told_apart(named: list[tuple[str, str, bool]]) -> list[str]:
    """Each machine's name as its user knows it (its host name), made unique: two machines
    both called "vm" once showed as "vm (local)" twice. ``named``: (name, address, this
    machine's); this machine keeps its name, a namesake elsewhere gets its address's host,
    then (two of one machine) its port."""
    def once(names: list[str], suffix: Callable[[str], str]) -> list[str]:
        seen = Counter(names)
        return [name + suffix(address) if name and seen[name] > 1 and not local else name
                for name, (_, address, local) in zip(names, named, strict=True)]

    by_host = once([n for n, _, _ in named], lambda a: f" ({a.rpartition(':')[0] or a})")
    return once(by_host, lambda a: f":{a.rpartition(':')[2]}")


def unique_names(nodes: tuple[NodeSnapshot, ...]) -> tuple[NodeSnapshot, ...]:
    names = told_apart([(n.identity, n.address, n.link == "local") for n in nodes])
    return tuple(replace(n, identity=name) for n, name in zip(nodes, names, strict=True))


def heads_snapshot(head: Head) -> tuple[HeadSnapshot, ...]:
    """This head first, then every head of the fleet it has met or been given, each by its
    machine's host name (a head too old to say it, by its id)."""
    out = [HeadSnapshot(head_id=head.fleet.head_id, address="", linked=True,
                        this_machine=True, name=head.fleet.name)]
    if head.peers is not None:
        for peer in head.peers.peers.values():
            out.append(HeadSnapshot(head_id=peer.head_id, address=peer.label,
                                    linked=peer.link is not None and not peer.link.closed,
                                    name=peer.name))
    names = told_apart([(h.name or h.head_id, h.address, h.this_machine) for h in out])
    return tuple(replace(h, name=name) for h, name in zip(out, names, strict=True))


def models_snapshot(head: Head) -> tuple[ModelSnapshot, ...]:
    served = head.served()
    out = []
    for name, model in head.models.items():
        can = capabilities(model)
        out.append(ModelSnapshot(name=name, served=name in served,
                                 context_window=head.fleet.context_window(name),
                                 tools=can.tools, fill_in_middle=can.fill_in_middle,
                                 embeddings=can.embedding))
    return tuple(out)


def fleet_snapshot(head: Head | None, *, roles: Roles, fleet_name: str | None,
                   fleet_id: str, has_token: bool, pulls: tuple[PullSnapshot, ...] = (),
                   aliases: Callable[[], list[AliasSnapshot]] | None = None,
                   wall: Callable[[], float] = time.time) -> FleetSnapshot:
    """The whole snapshot: the head's view (when a head runs here) and this machine's."""
    at = wall()
    if head is None:
        return FleetSnapshot(at=at, fleet_name=fleet_name, fleet_id=fleet_id,
                             has_token=has_token, roles=roles, model=None, models=(),
                             nodes=(), heads=(), aliases=(), queued=0, moves=0, pulls=pulls)
    now = head.fleet.clock()
    rows = aliases() if aliases is not None else AliasCommands(head, clock=wall).current()
    return FleetSnapshot(
        at=at, fleet_name=fleet_name, fleet_id=fleet_id, has_token=has_token, roles=roles,
        model=head.model.name, models=models_snapshot(head),
        nodes=unique_names(tuple(node_snapshot(p, now=now, wall=at)
                                 for p in head.fleet.pools.values())),
        heads=heads_snapshot(head), aliases=tuple(rows), queued=head.runner.queued,
        moves=head.runner.moves_total, pulls=pulls)

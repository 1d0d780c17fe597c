"""Which nodes a split names (pure: the fleet's nodes and the names a person gave in, the
serving node and the lenders' addresses out, or a refusal in one line).

`shoal models serve MODEL --split A,B` and the Models page name machines as ``/v1/fleet``
and the Fleet page show them (a node's identity, told apart from namesakes), or by a
node's key; ``this machine`` (or ``local``) is this machine's own node. The first serves
the model; each other one lends memory for its last layers and must say it lends
(``NodeSnapshot.lend_bytes``), and must take links at an address the serving machine
reaches: the address this head dials it at, or for a node that joined this head the
port it says it listens on while it lends, at the address its connection came from (one
that says none takes no links; one reached on loopback is reached so only from this
machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import CommandError
from engine.models import ids
from engine.snapshot import NodeSnapshot

MAX_SPLIT = 8  # engine.link.messages.MAX_SPLIT: the serving machine and 7 lenders at most
LOCAL = ("this machine", "local")  # this machine's own node
LEND_FIX = ("turn lending on there (Settings: Lend this machine's memory to models split "
            "across the fleet, or `shoal node --lend`)")


@dataclass(frozen=True, slots=True)
class SplitTargets:
    serving: str  # the serving node's key
    lenders: tuple[str, ...]  # where each lending node takes links (HOST:PORT), in order
    names: tuple[str, ...]  # the machines as the fleet names them, the serving one first


def hub_spec(spec: str) -> str:
    """``spec`` as a node of the fleet pulls it (org/repo[:QUANT]); CommandError (one
    line) for anything else, a path above all (it names a file on this machine)."""
    spec = spec.strip()
    try:
        ids.parse_model_id(spec)
        if ids.looks_like_path(spec):
            raise ValueError(f"{spec!r} names a file on this machine")
    except ValueError as exc:
        raise CommandError(f"{exc}; a fleet node pulls its model from the hub, so give "
                           "it as org/repo:QUANT", code="bad_model") from None
    return spec


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _find(nodes: Sequence[NodeSnapshot], name: str) -> NodeSnapshot:
    wanted = name.strip()
    key = "local" if wanted.lower() in LOCAL else wanted
    found = next((n for n in nodes if n.key == key), None) or next(
        (n for n in nodes if n.identity.lower() == wanted.lower()), None)
    if found is None:
        known = ", ".join(sorted({n.identity or n.key for n in nodes})[:12]) or "none"
        raise CommandError(f"no machine '{wanted[:80]}' in the fleet (it has: {known}); name "
                           "machines as the Fleet page and /v1/fleet show them",
                           code="machine_unknown")
    return found


def split_targets(nodes: Sequence[NodeSnapshot], machines: Sequence[str]) -> SplitTargets:
    """The node that serves (the first of ``machines``) and where each lender takes links;
    CommandError naming the cause and the fix otherwise."""
    names = [m.strip() for m in machines if m.strip()]
    if len(names) < 2:
        raise CommandError("a split names the machine that serves the model, then at least "
                           "one that lends memory: --split SERVING,LENDER",
                           code="bad_split")
    if len(names) > MAX_SPLIT:
        raise CommandError(f"a split takes {MAX_SPLIT} machines at most ({len(names)} "
                           "given); name fewer", code="bad_split")
    found = [_find(nodes, name) for name in names]
    twice = next((n for i, n in enumerate(found) if n in found[:i]), None)
    if twice is not None:
        raise CommandError(f"the split names {twice.identity or twice.key} twice; name each "
                           "machine once", code="bad_split")
    serving, lenders = found[0], found[1:]
    addresses = []
    for name, n in zip(names[1:], lenders, strict=True):
        if n.lend_bytes <= 0:
            raise CommandError(f"{name} lends no memory to the fleet; {LEND_FIX}",
                               code="not_lending")
        # a node that joined takes links where it says it listens (it does while it lends)
        address = n.reach if n.link == "joined" else n.address
        if not address:
            raise CommandError(f"{name} joined this head and takes no links from other "
                               "machines; start its node with --listen to lend its memory",
                               code="not_listening")
        if _loopback(address) and not _loopback(serving.address):
            raise CommandError(f"{name} is reached at {address}, on this machine only; "
                               "serve the model on this machine, or have another machine "
                               "lend", code="not_listening")
        addresses.append(address)
    return SplitTargets(serving.key, tuple(addresses),
                        tuple(n.identity or n.key for n in found))

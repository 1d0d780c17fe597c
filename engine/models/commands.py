"""Model commands on a running Shoal (``shoal.models``): the catalog, the fit of each of its
models on each machine of the fleet with a split to accept (and, for a model no machine
holds alone, a split across the machines that lend memory), and the models kept on this
machine, removed unless a node here serves them. Every file and device read runs off the
event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import CommandError
from engine.models import bandwidth
from engine.models import store as model_store
from engine.models.fit import Machine, Suggestion
from engine.settings import Settings
from engine.snapshot import FleetSnapshot, NodeSnapshot

log = logging.getLogger("shoal")

if TYPE_CHECKING:  # imported when first used: the catalog is read only when asked for
    from engine.models.catalog import Catalog
    from engine.models.choice import EntryFit, SplitOffer

MACHINE_TTL_S = 10.0  # how long this machine's figures (free GPU memory, disk) are reused
MAX_TEXT = 256  # a name or a device read from a head's answer


@dataclass(frozen=True, slots=True)
class MachineFits:
    """One machine of the fleet and the fit of every catalog model on it."""

    key: str  # "this machine", or the fleet node's key
    label: str
    machine: Machine
    fits: tuple[EntryFit, ...]
    local: bool


@dataclass(frozen=True, slots=True)
class FleetFits:
    catalog: Catalog
    note: str  # a line about the catalog file used, or ""
    machines: tuple[MachineFits, ...]  # this machine first
    # one model a machine, its main one, with its fit there alone (as the catalog shows
    # it); Suggestion.machine is a MachineFits.key
    split: tuple[Suggestion, ...]
    facts: str  # this machine's figures, for people
    # the models suggested beside each machine's main one, chosen to fit together with it
    # in the machine's budget (their fits as placed beside it): an autocomplete model on a
    # machine alone and an embeddings model, for a node that keeps several models
    beside: tuple[Suggestion, ...] = ()
    # each catalog model no machine holds alone, split across machines that lend memory
    # (each machine by its MachineFits.key; `label_of` names them for people)
    offers: tuple[SplitOffer, ...] = ()

    def label_of(self) -> dict[str, str]:
        """Each machine's key -> its label."""
        return {m.key: m.label for m in self.machines}

    def offer_for(self, entry_id: str) -> SplitOffer | None:
        return next((o for o in self.offers if o.entry_id == entry_id), None)


def machine_of(node: NodeSnapshot) -> Machine | None:
    """A fleet node as the fit estimate sees it (None: it did not say how much RAM)."""
    if node.ram_total <= 0:
        return None
    kind = node.device_kind if node.device_kind in ("gpu", "igpu") else ""
    # a node's Stats carry its RAM's bandwidth (0: an older node, which measured none:
    # no estimate); its GPU's, where it does not say, is read from the GPU's name
    mem_bw = node.mem_bandwidth
    gpu_bw = node.gpu_bandwidth or bandwidth.gpu_bandwidth(node.device or "", kind, mem_bw)
    return Machine(node.identity or node.key, ram_total=node.ram_total,
                   budget=node.mem_budget, device_kind=kind,  # type: ignore[arg-type]
                   device_total=node.device_total, device_free=node.device_free,
                   disk_free=node.disk_free or None, lanes=max(node.lanes, 1),
                   mem_bandwidth=mem_bw, gpu_bandwidth=gpu_bw if mem_bw else 0,
                   lend=node.lend_bytes)


def machine_of_json(raw: Mapping[str, object]) -> Machine | None:
    """A node of ``GET /v1/fleet``'s answer as :func:`machine_of` sees it (None: it did not
    say how much RAM); a value of the wrong type or out of bounds counts as not said."""
    def num(key: str) -> int:
        v = raw.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 else 0

    def text(key: str) -> str:
        v = raw.get(key)
        return v[:MAX_TEXT] if isinstance(v, str) else ""

    node = NodeSnapshot(
        key=text("key"), identity=text("identity"), address=text("address"), link="dialed",
        state="ready", model=text("model"), runtime="", context_window=0,
        lanes=min(num("lanes"), 1024), lanes_busy=0, own_sessions=0, kv_used=0, kv_total=0,
        prefill_tps=0.0, decode_tps=0.0, ttft_ms=0.0, last_seen=0.0, sessions_total=0,
        peak_busy=0, connections=0, error=None, mem_budget=num("mem_budget"),
        device=text("device"), ram_total=num("ram_total"), device_kind=text("device_kind"),
        device_total=num("device_total"), device_free=num("device_free"),
        disk_free=num("disk_free"), mem_bandwidth=num("mem_bandwidth"),
        gpu_bandwidth=num("gpu_bandwidth"), lend_bytes=num("lend_bytes"))
    return machine_of(node)


class ModelCommands:
    def __init__(self, *, snapshot: Callable[[], FleetSnapshot],
                 settings: Callable[[], Settings], clock: Callable[[], float]) -> None:
        self._snapshot = snapshot
        self._settings = settings
        self._clock = clock
        self._catalog: tuple[Catalog, str] | None = None
        self._machine: tuple[float, Machine, str] | None = None

    @property
    def _home(self) -> Path:
        return self._settings().home

    async def catalog(self) -> tuple[Catalog, str]:
        """The catalog (a newer one the user dropped in, else the bundled one), read once."""
        if self._catalog is None:
            from engine.models.catalog import CatalogError, load_catalog

            try:
                self._catalog = await asyncio.to_thread(load_catalog, self._home)
            except CatalogError as exc:
                raise CommandError(str(exc), code="bad_catalog") from None
        return self._catalog

    async def say_catalog(self) -> None:
        """Read and check the catalog once (at start): a user's newer one refused, or a
        broken bundled one, is logged in one line (the catalog is not needed to serve)."""
        try:
            _, line = await self.catalog()
        except CommandError as exc:
            line = str(exc)
        if line:
            log.log(logging.INFO if line.startswith("using ") else logging.WARNING, "%s", line)

    async def kept(self) -> list[model_store.StoredModel]:
        """The models on this machine's disk, with who serves each: this Shoal's own node,
        other processes here, and the fleet's nodes by the name they serve."""
        kept = await asyncio.to_thread(model_store.kept_models, self._home)
        mine = f"pid {os.getpid()}"
        fleet: dict[str, list[str]] = {}
        for n in self._snapshot().nodes:
            if n.key != "local":
                fleet.setdefault(n.model.lower(), []).append(n.identity or n.key)
        out = []
        for m in kept:
            who = ["this machine" if p == mine else p for p in m.served_by]
            names = {m.name.lower(), m.spec.lower(), (m.repo or "").lower()} - {""}
            who += sorted({i for name in names for i in fleet.get(name, [])})
            out.append(replace(m, served_by=tuple(who)))
        return out

    async def remove(self, name: str) -> model_store.StoredModel:
        """Delete a kept model; refused (``model_in_use``) while a node here serves it."""
        try:
            return await asyncio.to_thread(model_store.remove, self._home, name)
        except model_store.ModelInUse as exc:
            raise CommandError(str(exc), code="model_in_use") from None
        except model_store.ModelNotKept as exc:
            raise CommandError(str(exc), code="model_unknown") from None

    async def this_machine(self) -> tuple[Machine, str]:
        now = self._clock()
        if self._machine is not None and now - self._machine[0] < MACHINE_TTL_S:
            return self._machine[1], self._machine[2]
        from engine.models.machine import this_machine

        node = self._settings().node
        machine, facts = await asyncio.to_thread(
            this_machine, self._home, budget=node.memory_budget if node else None,
            gpu=node.gpu if node else "auto", lanes=node.lanes if node else 8,
            name="this machine")
        self._machine = (now, machine, facts)
        return machine, facts

    async def fits(self) -> FleetFits:
        """Every catalog model's fit on every machine the fleet knows, and a split."""
        from engine.models.choice import fits_for, fleet_split, split_offers

        catalog, note = await self.catalog()
        machine, facts = await self.this_machine()
        kept = [m.spec for m in await asyncio.to_thread(model_store.kept_models, self._home)]
        node = self._settings().node
        kv = node.kv_type if node is not None else "f16"
        nodes = self._snapshot().nodes
        # what this machine lends, as its own node tells its head
        lend = next((n.lend_bytes for n in nodes if n.key == "local"), 0)
        machine = replace(machine, lend=lend)
        rows = [MachineFits("this machine", "This machine", machine,
                            tuple(fits_for(catalog, machine, kept=kept, kv_type=kv)), True)]
        for n in nodes:
            if n.key == "local":
                continue  # this machine's own node: already first
            other = machine_of(n)
            if other is not None:
                rows.append(MachineFits(n.key, n.identity or n.key, other,
                                        tuple(fits_for(catalog, other, kv_type=kv)), False))
        machines = [replace(r.machine, name=r.key) for r in rows]
        # a machine's main model is shown with its fit there alone, as the catalog shows
        # it (the split chose it leaving room for the models beside it)
        alone = {(r.key, q.spec): q.fit for r in rows for f in r.fits for q in f.quants}
        main: list[Suggestion] = []
        beside: list[Suggestion] = []
        for s in fleet_split(catalog, machines, kv_type=kv):  # each machine's main first
            if any(m.machine == s.machine for m in main):
                beside.append(s)
            else:
                main.append(replace(s, fit=alone.get((s.machine, s.candidate.spec), s.fit)))
        return FleetFits(catalog, note, tuple(rows), tuple(main), facts, tuple(beside),
                         split_offers(catalog, machines, kv_type=kv))

"""The head: its models, aliases, fleet and session runner, and who may call it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from engine.head.access.keys import Policy
from engine.head.fleet.links import Fleet
from engine.head.fleet.peers import HeadPeers
from engine.head.fleet.sessions import SessionRunner
from engine.head.naming import aliases as al
from engine.head.naming.names import match_name
from engine.head.prompt.model import HeadModel


class Head:
    def __init__(self, models: list[HeadModel], fleet: Fleet, runner: SessionRunner, *,
                 tool_parser: str | None = None, aliases_path: Path | None = None,
                 aliases: al.AliasTable | None = None) -> None:
        """``aliases``: the table loaded from ``aliases_path`` (load it off the loop);
        when None it is read here (tests, tools)."""
        self.model = models[0]  # the model announced to joining nodes
        self.models = {m.name: m for m in models}
        self.fleet = fleet
        self.runner = runner
        self.tool_parser = tool_parser
        self.started_wall = int(time.time())
        # the model this machine's node is loading (set by the composition root before the
        # load): /v1/models lists it, marked loading, until a node serves it
        self.local_model: str | None = None
        self._alias_store = al.AliasStore(aliases_path) if aliases_path is not None else None
        if aliases is None:
            aliases = self._alias_store.load() if self._alias_store else al.AliasTable()
        self.aliases = aliases
        self._writer = (al.AliasWriter(self._alias_store, lambda: self.aliases)
                        if self._alias_store is not None else None)
        self.peers: HeadPeers | None = None  # other heads of the fleet, for aliases
        # who may call the HTTP API, set by the composition root (engine.api.auth)
        self.api_key: str | None = None  # --api-key
        self.admin_secret: str | None = None  # what `shoal alias` sends (admin_secret.py)
        self.keys_secret: bytes | None = None  # issued keys sk-shoal-<name>-<sig>
        self.revoked_path: Path | None = None  # their revocation list, re-read on change
        self.key_policy: Policy | None = None  # per-key limits (the defaults when None)
        self.cors_allow: tuple[str, ...] = ()  # browser origins allowed
        # the same, as files the gate watches, so `shoal keys` reaches a running head
        self.keys_secret_path: Path | None = None  # keys turn on when it appears
        self.key_policy_path: Path | None = None
        # Host values served besides loopback and this machine's (DNS rebinding)
        self.allowed_hosts: tuple[str, ...] = ()  # --allow-host
        self.host_names: frozenset[str] = frozenset()  # this machine's, found at start
        # a waiting request gets a keepalive this often; a refusal keeps its status
        # until commit_s (None: until the first keepalive)
        self.keepalive_s: float = 5.0
        self.commit_s: float | None = None
        # a write to a client that has read nothing for this long ends its answer (and
        # frees its lane and its key's slot); tests shorten it
        self.write_timeout_s: float = 30.0

    def add_model(self, model: HeadModel) -> None:
        """A model learnt while the head runs (a fleet node was asked to serve it): its
        requests are placed on the nodes that serve it from now on, and /v1/models lists
        it while one does."""
        self.models[model.name] = model
        if model.name not in self.fleet.models:
            self.fleet.models = (*self.fleet.models, model.name)

    def served(self) -> dict[str, bool]:
        """Models some connected node serves, each with whether a lane is free now."""
        out: dict[str, bool] = {}
        for name in self.models:
            free = self.fleet.free(name)
            if free is not None:
                out[name] = free
        return out

    def resolve(self, requested: str) -> al.Resolution:
        """A request's model name: a model this head knows wins, else an alias."""
        real = match_name(requested, self.models)
        if real is not None:
            free = self.fleet.free(real)
            return al.Resolution(requested=requested, model=real, free=bool(free))
        return al.resolve(requested, table=self.aliases, served=self.served())

    async def save_aliases(self) -> None:
        """Write the alias table as it is now (or a later one) off the loop, through the
        head's one writer: saves never land out of order."""
        if self._writer is not None:
            await self._writer.save()

    def aliases_merged(self, _names: list[str]) -> None:
        """Another head's table was merged in: save it soon (a failure is logged)."""
        if self._writer is not None:
            self._writer.submit()

    async def spread_aliases(self, entries: Sequence[al.AliasEntry]) -> tuple[int, int]:
        """Push changes to the other heads at once: (heads holding all of them, heads
        known)."""
        if self.peers is None:
            return 1, 1
        return await self.peers.spread(entries)

    async def close(self) -> None:
        if self.peers is not None:
            await self.peers.close()
        await self.fleet.close()
        if self._writer is not None:  # a save under way finishes: the file stays whole
            await self._writer.close()

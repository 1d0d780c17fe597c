"""The running roles: this machine's head (the API, placement, and the fleet side taking
nodes from other machines), its node, and its membership in a fleet. `RunningRoles` is
their only keeper: start order, the local node linked, the head switched, the model
swapped, joins, leaves, rekeying, closing; one change at a time (``lock``), each published
as `RolesChanged` and kept in the settings."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace

from engine.credentials.codes import JoinCode
from engine.credentials.keeper import FleetCredentials, new_token
from engine.errors import CommandError, ShoalError, StartError
from engine.events import Notice, RolesChanged, ShoalEvent
from engine.models import store as model_store
from engine.models.loading import Resolved, load_head_model
from engine.node.join import HeadAddress
from engine.node.machine import MachineFacts
from engine.roles.head_role import HeadRole
from engine.roles.local_node import LocalNode
from engine.roles.membership import Membership, head_to_join, locate
from engine.service import configuration
from engine.service.configuration import Configuration, no_node
from engine.service.head_models import HeadModels, Resolve
from engine.service.results import JoinResult
from engine.settings import FLEET_PORT, HeadSettings, JoinSettings, NodeSettings
from engine.snapshot import FleetSnapshot

log = logging.getLogger("shoal")

DRAIN_S = 10.0  # a role that stops at run time lets its sessions finish this long

ServeModel = Callable[[str, tuple[str, ...]], Awaitable[tuple[bool, str]]]
ServeSplit = Callable[[str, tuple[str, ...]], Awaitable[str]]


class RunningRoles:
    """``snapshot``: the whole Shoal's (the head's API serves it); ``machine``,
    ``serve_model``: the node's answers to its heads (`FleetChoice`); ``serve_split``: the
    API's asks for a model split across machines (`Shoal.serve_split`)."""

    def __init__(self, conf: Configuration, creds: FleetCredentials, models: HeadModels, *,
                 resolve: Resolve, emit: Callable[[ShoalEvent], None],
                 clock: Callable[[], float], wall: Callable[[], float],
                 snapshot: Callable[[], FleetSnapshot], machine: Callable[[], MachineFacts],
                 serve_model: ServeModel, serve_split: ServeSplit | None = None) -> None:
        self._conf, self._creds, self._models, self._resolve = conf, creds, models, resolve
        self._emit, self._clock, self._wall = emit, clock, wall
        self._snapshot, self._machine, self._serve_model = snapshot, machine, serve_model
        self._serve_split = serve_split
        self.head: HeadRole | None = None
        self.node: LocalNode | None = None
        self.member: Membership | None = None
        self.lock = asyncio.Lock()  # one role change at a time
        self.stopping = False
        self._parked_head: HeadSettings | None = None  # the API's settings while it is off

    # -- start and close -------------------------------------------------------------

    async def open(self, code: JoinCode | None) -> None:
        """Start the roles the settings name (the caller holds ``lock``), joining by
        ``code`` when given: the fleet's credentials read, every listener bound before any
        slow work (a port in use fails at once), the token checked against a head before
        anything is pulled or loaded."""
        s = self._conf.settings
        given = head_to_join(code, s.join.head if s.join else None,
                       s.join.head_port if s.join else FLEET_PORT)
        await self._creds.load(code, home=s.home, auth_file=s.auth_file,
                               fallback_name=s.fleet_name)
        http_sock = HeadRole.bind_http(s.head) if s.head is not None else None
        fleet_sock = None
        node_sock = None
        try:
            if s.head is not None and s.head.fleet_listen:
                fleet_sock = HeadRole.bind_fleet(s.head.fleet_listen)
            if s.node is not None:
                node_sock = LocalNode.bind_listener(s.node, self._creds.token)
            heads: list[HeadAddress] = []
            announced: str | None = None
            finder = None
            if s.join is not None and s.node is not None:
                heads, hello, finder = await locate(given, psk=self._creds.token,
                                                    discovery=s.discovery,
                                                    head_port=s.join.head_port)
                announced = hello.model
                if s.join.code:
                    await self._creds.keep()
            head_model: Resolved | None = None
            if s.head is not None:
                sock, http_sock = http_sock, None
                head_model = await self._start_head(s.head, sock)
                if fleet_sock is not None:
                    sock, fleet_sock = fleet_sock, None
                    assert self.head is not None
                    await self.head.open_fleet(sock, discovery=s.discovery)
                    for found in heads:
                        self.head.meet(found.host, found.port)
            if s.node is not None:
                sock, node_sock = node_sock, None
                await self._start_node(s.node, sock=sock, announced=announced,
                                       head_model=head_model)
                if s.join is not None and finder is not None:
                    assert self.node is not None
                    self.member = Membership.start(
                        self.node.agent, heads, finder, psk=self._creds.token, given=given,
                        handshake_timeout_s=s.node.handshake_timeout_s)
                    finder = None
        finally:
            for leftover in (http_sock, fleet_sock, node_sock):
                if leftover is not None:
                    leftover.close()
        self.changed()

    async def close(self, drain: float) -> None:
        head, node, member = self.head, self.node, self.member
        if head is not None:
            await head.drain(drain)
        if member is not None:
            await member.close()
        if head is not None:
            await head.close()
        if node is not None:
            await node.close()
        self.head = self.node = self.member = None

    @property
    def running(self) -> bool:
        return self.head is not None or self.node is not None

    def changed(self) -> None:
        """Publish the roles as they are now, and keep them for the next start."""
        node = self.node
        self._emit(RolesChanged(head=self.head is not None,
                                node=node.state if node else "off",
                                fleet=self._creds.name if self._creds.token else None))
        self._conf.save_soon(lambda line: self._emit(Notice(level="error", text=line)))

    async def _start_head(self, hs: HeadSettings, sock: socket.socket | None,
                          resolved: Resolved | None = None) -> Resolved:
        """The head on ``hs``; ``resolved``: the model already made ready (no second look)."""
        s = self._conf.settings
        node = s.node
        spec = hs.model if hs.model is not None else (node.model if node else None)
        runtime = hs.runtime or (node.runtime if node else None)
        model = resolved if resolved is not None else await self._resolve(spec, runtime)
        models, later = await self._models.for_start(hs, model)
        if sock is None:
            sock = HeadRole.bind_http(hs)
        self.head = await HeadRole.start(hs, models, home=s.home, psk=self._creds.token,
                                         emit=self._emit, clock=self._clock, wall=self._wall,
                                         http_sock=sock, snapshot=self._snapshot,
                                         serve_split=self._serve_split)
        await self._models.learn_later(later)
        # models the fleet's nodes keep that this head does not know: learnt as they come
        self.head.head.fleet.on_unknown_kept = self._models.learn_kept
        if self.node is not None:
            self.head.link_local(self.node.host, self.node.port)
        return model

    async def _start_node(self, ns: NodeSettings, *, sock: socket.socket | None,
                          announced: str | None, head_model: Resolved | None,
                          resolved: Resolved | None = None) -> None:
        s = self._conf.settings
        hs = s.head
        same = (hs is not None and (hs.model is None or hs.model == ns.model)
                and (hs.runtime is None or hs.runtime == ns.runtime))
        # the head read this very model (or the caller made it ready): no second pull
        if ns.upstream is not None:
            # an engine the user runs: it names its model itself unless --model-name does
            model = await self._resolve(ns.upstream, ns.runtime)
            name = ns.model_name or ""
        else:
            if resolved is not None:
                model = resolved
            elif head_model is not None and same:
                model = head_model
            else:
                model = await self._resolve(ns.model, ns.runtime)
            name = ns.model_name or announced or (head_model.name if head_model
                                                  else model.name)
        if ns.identity is None and self.head is not None and ns.listen is None:
            ns = replace(ns, identity=socket.gethostname())  # its user's name for it
        if self.head is not None:  # /v1/models lists it as loading from now on
            self.head.head.local_model = name
        stored = await asyncio.to_thread(model_store.kept_models, s.home)
        kept = self._kept_beside(ns, model, stored) if ns.serve_kept else []
        self.node = await LocalNode.start(
            ns, model, name=name, psk=self._creds.token, discovery=s.discovery.mode,
            sock=sock, home=s.home, machine=self._machine, serve_model=self._serve_model,
            kept=kept, keep_alive={str(k.path): k.keep_alive_s for k in stored
                                   if k.keep_alive_s is not None})
        if self.head is not None:
            await self._head_learns(kept)
        if model.runtime == "mock" and self.head is not None:
            log.info("serving the built-in mock engine as the local node (tests only: its "
                     "answers are not a model's)")
        if self.head is not None:
            self.head.link_local(self.node.host, self.node.port)

    async def serve_too(self, model: Resolved) -> str:
        """Serve ``model`` (kept here already) on this machine's node besides its first,
        loaded on the first request for it; from now on the node serves every model kept
        here (``serve_kept``), across restarts too. The line of what happened."""
        async with self.lock:
            node = self.require_node()
            if not node.keep_also(model):
                return f"this machine serves {model.name} already"
            if self.head is not None:
                await self._head_learns([model])
            ns = self._conf.settings.node
            if ns is not None and not ns.serve_kept:
                self._conf.update(lambda s: s.with_node(replace(ns, serve_kept=True)))
                self._conf.save_soon(lambda line: self._emit(Notice(level="error",
                                                                    text=line)))
        log.info("this machine serves %s too, loaded on the first request for it", model.name)
        return f"this machine serves {model.name} too; it loads on the first request for it"

    def peer_addresses(self) -> list[str]:
        """Where the fleet's other machines take links (their nodes' listeners): the
        nodes the head was told of (--fleet) first, then those it dials now, then those its
        node splits its model with. Read from a pull's worker thread: copies of what the
        loop last set, no awaiting."""
        hs = self._conf.settings.head
        told = list(hs.fleet) if hs is not None else []
        head = self.head
        pools = list(head.head.fleet.pools.values()) if head is not None else []
        dialed = [p.address for p in pools if p.dialed and p.key != "local"]
        # the machines this node splits its model with keep the model's layers, and often
        # its file: `shoal serve org/repo:Q --split-with desk:8455` takes it from there
        ns = self._conf.settings.node
        lenders = list(ns.split_with) if ns is not None else []
        return list(dict.fromkeys([*told, *dialed, *lenders]))

    @staticmethod
    def _kept_beside(ns: NodeSettings, first: Resolved,
                     stored: list[model_store.StoredModel]) -> list[Resolved]:
        """Every model kept here besides ``first``, for the node to serve on demand (whole
        files only: a pull under way is not a model yet)."""
        runtime = ns.runtime or first.runtime
        return [Resolved(path=str(k.path), name=k.name, runtime=runtime) for k in stored
                if k.source != "partial" and str(k.path) != first.path]

    async def _head_learns(self, kept: list[Resolved]) -> None:
        """This machine's head learns the tokenizer and template of each model its node
        keeps (from the files here), so that it serves them by name; one it cannot read is
        said in one line and left out."""
        for model in kept:
            head = self.head
            if head is None or model.name in head.head.models:
                continue
            try:
                head.head.add_model(await load_head_model(model))
            except StartError as exc:
                line = f"this machine's API does not serve {model.name}: {exc}"
                log.warning("%s", line)
                self._emit(Notice(level="warning", text=line))

    # -- changes at run time ---------------------------------------------------------

    async def set_head(self, on: bool) -> None:
        """Run the API (and placement) on this machine, or stop it here."""
        async with self.lock:
            if on and self.head is None:
                hs = self._conf.settings.head or self._parked_head or HeadSettings()
                await self._start_head(hs, None)
                self._conf.update(lambda s: s.with_head(hs))
                if self.member is not None or hs.fleet_listen:
                    await self.open_fleet()
            elif not on and self.head is not None:
                head, self.head = self.head, None
                await head.drain(DRAIN_S)
                await head.close()
                self._parked_head = self._conf.settings.head
                self._conf.update(lambda s: s.with_head(None))
            self.changed()

    def pause(self, paused: bool) -> None:
        """Stop taking new sessions on this machine's node (those running finish)."""
        self.require_node().agent.pause(paused)
        self._conf.update(lambda s: s.with_node(replace(s.node, paused=paused))
                          if s.node is not None else s)
        self.changed()

    async def swap(self, spec: str | None, runtime: str | None, model: Resolved,
                   split_with: tuple[str, ...] = ()) -> str:
        """Serve ``model`` (pulled already) here in place of the model served now, split
        with the machines whose node listeners are ``split_with`` (none: whole). When it
        cannot be served, the old one is served again and ShoalError says both."""
        async with self.lock:
            if self.stopping:
                raise CommandError("this Shoal has stopped; start a new one", code="stopped")
            # the node starts again as it will hold its model (a HubId made a plain str)
            ns = replace(self._conf.pending.node or NodeSettings(),
                         model=str(spec) if spec is not None else None, runtime=runtime,
                         model_name=None, split_with=split_with)
            before, old_model = self._conf.settings, self.node.model if self.node else None
            had_fleet = self.head is not None and self.head.fleet_side is not None
            member = self.member
            heads = member.heads if member is not None else []
            port = self.node.port if self.node is not None else 0  # where heads dial it
            await self._close_for_swap()
            head_settings = before.head
            self._conf.update(lambda _: replace(before, node=ns, head=(
                replace(head_settings, model=None, runtime=None) if head_settings else None)))
            try:
                await self._start_swapped(ns, model, heads, had_fleet, port)
            except Exception as exc:  # any failure: the machine serves what it served
                line = f"could not serve {model.name} ({exc})"
                log.warning("%s; serving the model it served before", line)
                await self._close_for_swap()
                self._conf.update(lambda _: before)
                await self._start_swapped(before.node, old_model, heads, had_fleet, port)
                self.changed()
                again = old_model.name if old_model is not None else "its model"
                raise ShoalError(f"{line}; this machine serves {again} again",
                                 code="cannot_load") from None
            self.changed()
            return model.name

    async def _close_for_swap(self) -> None:
        """Drain and close the head and the node, for a model swap."""
        old_head, old_node, member = self.head, self.node, self.member
        if old_head is not None:
            await old_head.drain(DRAIN_S)
            await old_head.close()
            self.head = None
        if old_node is not None:
            await old_node.drain(DRAIN_S)
            if member is not None:
                # the heads see the old node leave, and the new one come with its hello
                await member.joiner.close()
            await old_node.close()
            self.node = None

    async def _start_swapped(self, ns: NodeSettings | None, model: Resolved | None,
                             heads: list[HeadAddress], had_fleet: bool, port: int) -> None:
        """The head and the node (``ns``) on ``model`` (None: as the settings say), linked
        again with the fleet; a node that heads dial listens at ``port`` again."""
        head_model = None
        hs = self._conf.settings.head
        if hs is not None:  # a head that names a model of its own reads that one
            head_model = await self._start_head(hs, None, model if hs.model is None else None)
        if ns is not None:
            await self._start_node(ns, sock=LocalNode.bind_listener(ns, self._creds.token,
                                                                    again=port),
                                   announced=None, head_model=head_model, resolved=model)
        if self.member is not None and self.node is not None:
            self.member.relink(self.node.agent, heads)
        if had_fleet:
            await self.open_fleet()

    # -- the fleet -------------------------------------------------------------------

    async def create_fleet(self, name: str | None) -> None:
        """A token (else the fleet renamed, with ``name``); the head takes nodes."""
        async with self.lock:
            if self._creds.token is None:
                await self._replace_token(new_token(), name or socket.gethostname())
            elif name:
                await self._creds.rename(name)
            if self.head is not None and self.head.fleet_side is None:
                await self.open_fleet()
            self.changed()

    async def new_token(self, *, announce: bool = True) -> None:
        """A new fleet token in use at once (``announce``: as a change of the roles)."""
        async with self.lock:
            await self._replace_token(new_token(), self._creds.name)
            if announce:
                self.changed()

    async def join(self, code: JoinCode | None, head: str | None) -> JoinResult:
        """Link this machine's node with the heads of the fleet of ``code``, or of the
        token kept here at ``head`` (HOST:PORT; None: found on the network), checked
        against a head before anything changes here."""
        token, name = (code.token, code.fleet) if code else (self._creds.token, self._creds.name)
        given = head_to_join(code, head, FLEET_PORT)
        async with self.lock:
            node = self.require_node()
            join = self._conf.settings.join or JoinSettings()
            heads, hello, finder = await locate(given, psk=token,
                                                discovery=self._conf.settings.discovery,
                                                head_port=join.head_port)
            if self.member is not None:
                await self.member.close()
                self.member = None
            if token != self._creds.token or name != self._creds.name:
                # another fleet: what this head took from the old one goes with it
                await self._replace_token(token, name, other_fleet=token != self._creds.token)
            if self.head is not None and self.head.fleet_side is None and token is not None:
                await self.open_fleet()
            if self.head is not None:
                for found in heads:
                    self.head.meet(found.host, found.port)
            self.member = Membership.start(node.agent, heads, finder, psk=token, given=given,
                                           handshake_timeout_s=node.settings.handshake_timeout_s)
            self._conf.update(lambda s: s.with_join(replace(
                join, head=str(given) if given else None, code=None)), rejoin_settled=True)
            self.changed()
            return JoinResult(fleet=name or "", heads=tuple(str(h) for h in heads),
                              model=hello.model)

    async def leave(self, *, forget_token: bool) -> list[str]:
        """Unlink this machine's node from the fleet's heads, stop its head taking nodes
        from other machines; with ``forget_token`` the token goes too. What was done."""
        async with self.lock:
            done: list[str] = []
            if self.member is not None:
                heads = ", ".join(str(h) for h in self.member.heads) or "the heads"
                await self.member.close()
                self.member = None
                done.append(f"closed the links to {heads}")
            if self.head is not None and self.head.fleet_side is not None:
                await self.head.close_fleet()
                self._record_fleet_listen(None)
                self.head.forget_found_nodes()
                done.append("stopped taking nodes from other machines")
            self._conf.update(lambda s: s.with_join(None), rejoin_settled=True)
            if forget_token:
                places = await self._creds.forget()
                self._hand_token()
                if places:
                    done.append(f"removed the fleet token from {' and '.join(places)}")
            self.changed()
            return done

    async def _replace_token(self, token: bytes | None, name: str | None, *,
                             other_fleet: bool = False) -> None:
        """Keep ``token`` and put it to use everywhere (the head's fleet side opened again;
        ``other_fleet``: without the nodes that joined or were found)."""
        if not await self._creds.replace(token, name):
            return
        self._hand_token()
        if self.head is not None:
            await self.head.reopen_fleet(discovery=self._conf.settings.discovery,
                                         forget_found=other_fleet)

    def _hand_token(self) -> None:
        """The roles that speak on the fleet's links take the token now kept."""
        token = self._creds.token
        if self.head is not None:
            self.head.set_psk(token)
        if self.node is not None:
            self.node.set_psk(token)
        if self.member is not None:
            self.member.set_psk(token)

    async def open_fleet(self) -> None:
        """Take nodes from other machines; where is kept for the next start."""
        assert self.head is not None
        listen = self.head.settings.fleet_listen or configuration.DEFAULT_FLEET_LISTEN
        await self.head.open_fleet_at(listen, discovery=self._conf.settings.discovery)
        self._record_fleet_listen(listen)

    def _record_fleet_listen(self, listen: str | None) -> None:
        self._conf.update(lambda s: s.with_head(replace(s.head, fleet_listen=listen))
                          if s.head is not None else s)

    def require_node(self) -> LocalNode:
        if self.node is None:
            raise no_node()
        return self.node

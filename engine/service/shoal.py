"""The `Shoal` object: one running Shoal, in process, that the CLI, the tests and the
desktop app all drive.

    shoal = await Shoal.start(settings)        # the roles the settings name
    shoal.snapshot()                           # frozen state: nodes, heads, aliases, roles
    async for event in shoal.events(): ...     # typed changes, bounded per subscriber
    await shoal.join(code) / leave() / set_head(on) / pause_serving(on) / set_model(spec)
    await shoal.serve_on(node_key, spec)       # this machine's node, or one of the fleet's
    await shoal.aliases.set(...); shoal.keys.issue(name); await shoal.pairing()
    shoal.settings / shoal.pending             # in force / for the next start
    await shoal.update_settings(http_port=8460)  # validated, written once (SettingsChanged)
    shoal.memory                               # this machine's RAM and the default budget
    await shoal.stop(drain=10)                 # leaves no task, thread, socket or file

Roles are parts started and stopped at run time: the head (the API on this machine and
the placement of sessions), the local node (a model served on this machine's lanes),
the fleet side of the head (taking nodes from other machines, announced on the
network) and membership (this machine's node linked with a fleet's heads). Commands
return typed results or raise `ShoalError`s carrying the one line for the user.
Nothing here prints, reads argv or handles signals, and nothing slow runs on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.credentials import codes as pairing
from engine.credentials import tokens
from engine.credentials.keeper import FleetCredentials, new_token
from engine.discovery.fleet_id import fleet_id
from engine.discovery.mdns import local_addresses
from engine.errors import CommandError, JoinError, ShoalError, StartError
from engine.events import (
    EventBus,
    Notice,
    RolesChanged,
    SettingsChanged,
    ShoalEvent,
    Subscription,
)
from engine.head.commands import AliasCommands
from engine.head.fleet.links import NotAsked
from engine.head.observe import fleet_snapshot
from engine.head.prompt.model import HeadModel
from engine.models import cache as model_cache
from engine.models import ids
from engine.models import store as model_store
from engine.models.commands import ModelCommands
from engine.models.learn import READS_HEADERS, learn_model
from engine.models.loading import Pulls, Resolved, load_head_model, resolve
from engine.models.pulls.quota import Quota
from engine.node.join import HeadAddress
from engine.node.machine import DiskFree, MachineFacts
from engine.roles.fleet_models import Made, room_for
from engine.roles.head_role import HeadRole
from engine.roles.local_node import LocalNode
from engine.roles.membership import Membership, locate
from engine.roles.sockets import parse_address
from engine.runtimes.budget import default_budget_bytes, total_memory_bytes
from engine.service import configuration
from engine.service.configuration import Ask, Configuration
from engine.service.keys import KeyCommands
from engine.service.results import JoinResult, MachineMemory, Pairing, SettingsChange
from engine.settings import (
    FLEET_PORT,
    DiscoveryMode,
    HeadSettings,
    JoinSettings,
    NodeSettings,
    Settings,
)
from engine.sizes import (
    KvType,
    Share,
)
from engine.snapshot import FleetSnapshot, PullSnapshot, Roles
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal")

ROOM_S = 8.0  # how long a node sizes a model a head chose before answering (links.ANSWER_S)
LOCAL_KEYS = ("local", "this machine")  # serve_on's names of this machine's own node


class Shoal:
    """One running Shoal. ``keep``: this Shoal owns ``$SHOAL_HOME/config.toml`` (the app):
    every change of its roles and settings is written there, by one writer; ``app``: the
    file's ``[app]`` table (the app's own choices, kept here and changed through
    `update_settings`); ``rejoin``: the fleet this machine was in, written back until
    `join` or `leave` settles it."""

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, keep: bool = False,
                 app: Mapping[str, Any] | None = None,
                 rejoin: JoinSettings | None = None) -> None:
        self._conf = Configuration(settings, keep=keep, app=app, rejoin=rejoin)
        self._opening = False
        self._clock = clock
        self._wall = wall
        self._bus = EventBus()
        self._pulls = Pulls()
        self._creds = FleetCredentials(settings.home, auth_file=settings.auth_file)
        self._head: HeadRole | None = None
        self._node: LocalNode | None = None
        self._member: Membership | None = None
        self._lock = asyncio.Lock()  # one role change at a time
        self._parked_head: HeadSettings | None = None  # the API's settings while it is off
        self._stopped = False
        self._memory: MachineMemory | None = None
        self._disk: DiskFree | None = None  # the disk free where this node keeps models
        # a model a head of the fleet chose for this node, being pulled and loaded
        self._chosen: asyncio.Task[None] | None = None
        self._learning: asyncio.Task[None] | None = None  # the head's models from the hub
        self._chosen_spec = ""
        self._chosen_failed = ""  # why the model a head chose last could not be served
        self.keys = KeyCommands(settings.home)
        # the catalog, the fit of its models on each machine, the models kept here
        self.models = ModelCommands(snapshot=self.snapshot, settings=lambda: self._conf.settings,
                                    clock=clock)

    # -- life cycle ----------------------------------------------------------------

    @classmethod
    async def start(cls, settings: Settings, *, clock: Callable[[], float] = time.monotonic,
                    wall: Callable[[], float] = time.time) -> Shoal:
        """Start the roles ``settings`` names. Raises StartError / JoinError (one line)."""
        shoal = cls(settings, clock=clock, wall=wall)
        try:
            await shoal.open()
        except BaseException:
            await shoal.stop(drain=0)
            raise
        return shoal

    async def _check_catalog(self) -> None:
        """Read and check the model catalog once at start: a user's newer one refused, or
        a broken bundled one, is said in one line (the catalog is not needed to serve)."""
        try:
            _, line = await self.models.catalog()
        except CommandError as exc:
            line = str(exc)
        if line:
            log.log(logging.INFO if line.startswith("using ") else logging.WARNING, "%s", line)

    async def open(self, settings: Settings | None = None) -> None:
        """Start the roles (for a caller that subscribed to `events` first, to see the
        start's own progress). On failure every part started is stopped again and the
        Shoal stays as it was before: it can be opened again, on ``settings`` when given
        (the cause fixed: another port, say). Raises StartError / JoinError (one line)."""
        async with self._lock:
            if self._stopped:
                raise CommandError("this Shoal has stopped; start a new one", code="stopped")
            if self._head is not None or self._node is not None:
                raise CommandError("Shoal runs already", code="running")
            if settings is not None:
                self._conf.update(lambda _: settings)
                self.keys = KeyCommands(settings.home)
            self._opening = True
            try:
                await self._start()
            except BaseException:
                await self._close_roles(drain=0)
                raise
            finally:
                self._opening = False
            await self._check_catalog()

    async def _start(self) -> None:
        s = self.settings
        given: HeadAddress | None = None
        code = None
        if s.join is not None and s.join.code:
            code = await _parse_code(s.join.code)
            given = HeadAddress(code.head_host, code.head_port, "code")
        elif s.join is not None and s.join.head:
            host, port = parse_address(s.join.head, s.join.head_port, what="the head")
            given = HeadAddress(host, port, "given")
        self._creds = FleetCredentials(s.home, auth_file=s.auth_file)
        await self._creds.load(code, fallback_name=s.fleet_name)
        # bind every listener before any slow work, so a port in use fails at once
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
                # check the token against a head before pulling or loading anything
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
                    assert self._head is not None
                    await self._head.open_fleet(sock, discovery=s.discovery)
                    for found in heads:
                        self._head.meet(found.host, found.port)
            if s.node is not None:
                sock, node_sock = node_sock, None
                await self._start_node(s.node, sock=sock, announced=announced,
                                       head_model=head_model)
                if s.join is not None and finder is not None:
                    assert self._node is not None
                    self._member = Membership.start(
                        self._node.agent, heads, finder, psk=self._creds.token, given=given,
                        handshake_timeout_s=s.node.handshake_timeout_s)
                    finder = None
        finally:
            for leftover in (http_sock, fleet_sock, node_sock):
                if leftover is not None:
                    leftover.close()
        self._roles_changed()

    async def _start_head(self, hs: HeadSettings, sock: socket.socket | None,
                          resolved: Resolved | None = None) -> Resolved:
        """The head on ``hs``; ``resolved``: the model already made ready (no second look)."""
        s = self.settings
        node = s.node
        spec = hs.model if hs.model is not None else (node.model if node else None)
        runtime = hs.runtime or (node.runtime if node else None)
        model = resolved if resolved is not None else await self._resolve(spec, runtime)
        models: list[HeadModel] = [await load_head_model(model, chat_template=hs.chat_template)]
        later: list[str] = []  # not on disk: learnt from the hub once the head runs
        for other in hs.also_models:
            if model.runtime in READS_HEADERS:
                try:
                    models.append((await learn_model(other, model.runtime, home=s.home,
                                                     offline=True))[0])
                except StartError:
                    later.append(other)
                continue
            learnt = await self._also_model(other, model.runtime)
            if learnt is not None:
                models.append(learnt)
        if sock is None:
            sock = HeadRole.bind_http(hs)
        self._head = await HeadRole.start(hs, models, home=s.home, psk=self._creds.token,
                                          emit=self._emit, clock=self._clock, wall=self._wall,
                                          http_sock=sock, snapshot=self.snapshot)
        await cancel_and_wait([self._learning], "the head's models from the hub")
        self._learning = None
        if later:  # the head serves the others meanwhile; a hub that never answers is
            # given up on per file (header_fetch.DEADLINE_S)
            self._learning = asyncio.get_running_loop().create_task(
                self._learn_all(later), name="shoal-head-learns")
        if self._node is not None:
            self._link_local()
        return model

    async def _start_node(self, ns: NodeSettings, *, sock: socket.socket | None,
                          announced: str | None, head_model: Resolved | None,
                          resolved: Resolved | None = None) -> None:
        s = self.settings
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
        if ns.identity is None and self._head is not None and ns.listen is None:
            ns = replace(ns, identity=socket.gethostname())  # its user's name for it
        if self._head is not None:  # /v1/models lists it as loading from now on
            self._head.head.local_model = name
        if self._disk is None or self._disk.folder != s.models_dir:
            self._disk = DiskFree(s.models_dir, clock=self._clock)
        self._node = await LocalNode.start(ns, model, name=name, psk=self._creds.token,
                                           discovery=s.discovery.mode, sock=sock, home=s.home,
                                           machine=self._machine_facts,
                                           serve_model=self._fleet_chooses)
        if model.runtime == "mock" and self._head is not None:
            log.info("serving the built-in mock engine as the local node (tests only: its "
                     "answers are not a model's)")
        if self._head is not None:
            self._link_local()

    def _link_local(self) -> None:
        """This machine's head dials this machine's node over loopback."""
        assert self._head is not None and self._node is not None
        fleet = self._head.head.fleet
        if "local" in fleet.pools:
            fleet.forget("local")
        host = self._node.host
        if host in ("0.0.0.0", "", "::"):  # noqa: S104 - comparing, not binding
            host = "127.0.0.1"
        fleet.add_dialed(host, self._node.port, key="local")

    async def stop(self, drain: float = 10.0) -> None:
        """Finish (or, after ``drain`` seconds, cancel) the sessions under way and stop
        every role. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._chosen is not None:  # a pull a head asked for stops with this Shoal,
            # and goes on from where it stopped at the next start
            self._pulls.cancel(self._chosen_spec, keep_part=True)
            await cancel_and_wait([self._chosen], "the model a head chose")
        await cancel_and_wait([self._learning], "the head's models from the hub")
        await self._close_roles(drain)
        await self._conf.flush()
        self._bus.close()

    async def _close_roles(self, drain: float) -> None:
        head, node, member = self._head, self._node, self._member
        if head is not None:
            await head.drain(drain)
        if member is not None:
            await member.close()
        if head is not None:
            await head.close()
        if node is not None:
            await node.close()
        self._head = self._node = self._member = None

    # -- reading -------------------------------------------------------------------

    def snapshot(self) -> FleetSnapshot:
        head, creds = self._head, self._creds
        node = self._node
        roles = Roles(
            head=head is not None, api_url=head.api_url if head else None,
            fleet_listen=(f"{head.fleet_side.host}:{head.fleet_side.port}"
                          if head is not None and head.fleet_side is not None else None),
            node=node.snapshot(tuple(str(h) for h in self._member.heads) if self._member
                               else (), self._member.linked() if self._member else ())
            if node else None,
            member=self._member is not None)
        pulls = tuple(PullSnapshot(model=p.model, done_bytes=p.done_bytes,
                                   total_bytes=p.total_bytes, state=p.state, message=p.message,
                                   rate_bps=p.rate_bps, eta_s=p.eta_s)
                      for p in self._pulls.running.values())
        return fleet_snapshot(head.head if head else None, roles=roles,
                              fleet_name=creds.name if creds.token else None,
                              fleet_id=fleet_id(creds.token), has_token=creds.token is not None,
                              pulls=pulls, aliases=head.aliases.current if head else None,
                              wall=self._wall)

    @property
    def settings(self) -> Settings:
        """The settings in force: the roles running now have them."""
        return self._conf.settings

    @property
    def pending(self) -> Settings:
        """The settings the next start will have: those in force, with the changes made
        for the next start (`update_settings`) over them."""
        return self._conf.pending

    @property
    def app_settings(self) -> Mapping[str, Any]:
        """The app's own choices (config.toml's ``[app]`` table), read-only."""
        return self._conf.app

    @property
    def memory(self) -> MachineMemory:
        """This machine's RAM and the node's default budget (read once, a small file)."""
        if self._memory is None:
            total = total_memory_bytes()
            self._memory = MachineMemory(total=total, default_budget=default_budget_bytes(total))
        return self._memory

    async def update_settings(self, *, http_port: int | None = None,
                              fleet_port: int | None = None,
                              discovery: DiscoveryMode | None = None,
                              queue_timeout_s: float | None = None,
                              memory_budget: int | Share | None = None,
                              kv_type: KvType | None = None,
                              gpu: str | None = None,
                              idle_unload_s: float | None = None,
                              fleet_may_choose_model: bool | None = None,
                              fleet_models_quota: Quota | None = None,
                              app: Mapping[str, Any] | None = None) -> SettingsChange:
        """Change this machine's settings: the API's port, the port where machines join,
        discovery and the queue limit apply at the next start (at once while nothing
        runs: after a failed start, the next `open` takes them); how the node holds its
        model (``memory_budget``: bytes or a share of RAM, 0 the default share;
        ``kv_type``; ``gpu``: auto, off or a device name; ``idle_unload_s``: 0 never) at
        the node's next start (Shoal's, or another model served);
        ``fleet_may_choose_model``: whether a head of the fleet may have this node serve
        another model, at once; ``fleet_models_quota``: the disk the models heads chose
        may take here (bytes, or a share of the models folder's disk), from their next
        choice; ``app``: the app's own choices, merged key by key.
        Validated first (CommandError with the fix), then written once (with ``keep``),
        and `SettingsChanged` is published."""
        running = self._head is not None or self._node is not None or self._opening
        change = self._conf.ask(
            Ask(http_port=http_port, fleet_port=fleet_port, discovery=discovery,
                queue_timeout_s=queue_timeout_s, memory_budget=memory_budget,
                kv_type=kv_type, gpu=gpu, idle_unload_s=idle_unload_s,
                fleet_may_choose_model=fleet_may_choose_model,
                fleet_models_quota=fleet_models_quota, app=app),
            running=running, ram_total=self.memory.total)
        self._emit(SettingsChanged(restart_needed=change.restart_needed))
        await self._conf.save()
        return change

    def events(self, *, buffer: int = 1024) -> Subscription:
        """Typed events from now on (``async for``; ``close()`` or ``async with`` to stop)."""
        return self._bus.subscribe(buffer=buffer)

    @property
    def aliases(self) -> AliasCommands:
        if self._head is None:
            raise CommandError("the API does not run on this machine; turn it on (Run the "
                               "API on this machine, or `shoal serve`) to change aliases",
                               code="no_head")
        return self._head.aliases

    @property
    def api_url(self) -> str | None:
        return self._head.api_url if self._head else None

    @property
    def fleet_address(self) -> tuple[str, int] | None:
        """Where this machine's head takes nodes that join, when it does."""
        side = self._head.fleet_side if self._head else None
        return (side.host, side.port) if side else None

    @property
    def node_address(self) -> tuple[str, int] | None:
        return (self._node.host, self._node.port) if self._node else None

    # -- roles ---------------------------------------------------------------------

    async def set_head(self, on: bool) -> None:
        """Run the API (and placement) on this machine, or stop it here."""
        async with self._lock:
            if on and self._head is None:
                hs = self.settings.head or self._parked_head or HeadSettings()
                await self._start_head(hs, None)
                self._conf.update(lambda s: s.with_head(hs))
                if self._member is not None or hs.fleet_listen:
                    await self._open_fleet()
            elif not on and self._head is not None:
                head, self._head = self._head, None
                await head.drain(self._drain_s)
                await head.close()
                self._parked_head = self.settings.head
                self._conf.update(lambda s: s.with_head(None))
            self._roles_changed()

    async def pause_serving(self, paused: bool) -> None:
        """Stop taking new sessions on this machine's node (those running finish)."""
        node = self._require_node()
        node.agent.pause(paused)
        self._conf.update(lambda s: s.with_node(replace(s.node, paused=paused))
                          if s.node is not None else s)
        self._roles_changed()

    async def set_model(self, spec: str | None, *, runtime: str | None = None) -> str:
        """Serve another model here (None: the embedded default): pull it with progress,
        load it, then move the head's tokenizer and the node over. Returns its name. When
        the new model cannot be served (it fails to load, it is too big, of a kind the
        runtime cannot run), the old one is served again and the settings keep its name:
        ShoalError says both. The pull holds no role lock: leave, join and the API's
        switch go on meanwhile; only the swap waits for them."""
        model = await self._resolve(spec, runtime)
        if spec is not None:  # the owner's choice: never removed by the fleet's quota
            await asyncio.to_thread(model_store.forget_fleet_chosen, self.settings.home,
                                    str(spec))
        return await self._swap_to(spec, runtime, model)

    async def _swap_to(self, spec: str | None, runtime: str | None, model: Resolved) -> str:
        """Serve ``model`` (pulled already) here in place of the model served now."""
        async with self._lock:
            if self._stopped:
                raise CommandError("this Shoal has stopped; start a new one", code="stopped")
            # the node starts again: with how it will hold its model (update_settings)
            # (a plain str: a HubId has done its work once the model is found)
            ns = replace(self.pending.node or NodeSettings(),
                         model=str(spec) if spec is not None else None, runtime=runtime,
                         model_name=None)
            before, old_model = self.settings, self._node.model if self._node else None
            had_fleet = self._head is not None and self._head.fleet_side is not None
            member = self._member
            heads = member.heads if member is not None else []
            await self._close_for_swap()
            head_settings = before.head
            self._conf.update(lambda _: replace(before, node=ns, head=(
                replace(head_settings, model=None, runtime=None) if head_settings else None)))
            try:
                await self._start_swapped(ns, model, heads, had_fleet)
            except Exception as exc:  # any failure: the machine serves what it served
                line = f"could not serve {model.name} ({exc})"
                log.warning("%s; serving the model it served before", line)
                await self._close_for_swap()
                self._conf.update(lambda _: before)
                await self._start_swapped(before.node, old_model, heads, had_fleet)
                self._roles_changed()
                again = old_model.name if old_model is not None else "its model"
                raise ShoalError(f"{line}; this machine serves {again} again",
                                 code="cannot_load") from None
            self._roles_changed()
            return model.name

    async def _close_for_swap(self) -> None:
        """Drain and close the head and the node, for a model swap."""
        old_head, old_node, member = self._head, self._node, self._member
        if old_head is not None:
            await old_head.drain(self._drain_s)
            await old_head.close()
            self._head = None
        if old_node is not None:
            await old_node.drain(self._drain_s)
            if member is not None:
                # the links to the fleet's heads go with the old node (they see it
                # leave) and come back from the new one, with its hello
                await member.joiner.close()
            await old_node.close()
            self._node = None

    async def _start_swapped(self, ns: NodeSettings | None, model: Resolved | None,
                             heads: list[HeadAddress], had_fleet: bool) -> None:
        """The head and the node (``ns``) on ``model`` (None: as the settings say), the
        joined heads linked again and the fleet side open again."""
        head_model = None
        hs = self.settings.head
        if hs is not None:  # a head that names a model of its own reads that one
            head_model = await self._start_head(hs, None, model if hs.model is None else None)
        if ns is not None:
            await self._start_node(ns, sock=LocalNode.bind_listener(ns, self._creds.token),
                                   announced=None, head_model=head_model, resolved=model)
        if self._member is not None and self._node is not None:
            self._member.agent = self._node.agent
            self._member.joiner.agent = self._node.agent
            for head in heads:
                self._member.joiner.link(head)
        if had_fleet:
            await self._open_fleet()

    def cancel_pull(self, model: str) -> bool:
        """Stop a pull under way; its partial file is removed. False: no such pull."""
        return self._pulls.cancel(model)

    async def serve_on(self, node_key: str, spec: str) -> str:
        """Serve ``spec`` on one machine of the fleet: this machine's own node (``local``
        or ``this machine``) as `set_model` does, once it serves it; a node of the fleet
        (its key in the snapshot) is asked over its link and answers at once, then pulls
        and swaps the model by itself (its pull shows in its NodeSnapshot, and its model
        changes there once it serves it); this machine's head then learns the model from
        its GGUF header, if it lacks it. Returns the line of what happens. CommandError
        (one line) when the node is unknown, not linked, too old or refuses, or ``spec``
        is not a hub id (org/repo:QUANT) a node can pull."""
        if node_key in LOCAL_KEYS:
            node = self.pending.node
            name = await self.set_model(spec, runtime=node.runtime if node else None)
            return f"this machine serves {name}"
        spec = spec.strip()
        try:
            ids.parse_model_id(spec)
            if ids.looks_like_path(spec):
                raise ValueError(f"{spec!r} names a file on this machine")
        except ValueError as exc:
            raise CommandError(f"{exc}; a fleet node pulls its model from the hub, so give "
                               "it as org/repo:QUANT", code="bad_model") from None
        head = self._head
        if head is None:
            raise CommandError("the API does not run on this machine, so it links with no "
                               "fleet node; turn it on (Run the API on this machine), or "
                               "choose the model on that machine", code="no_head")
        try:
            answer = await head.head.fleet.serve_model(node_key, spec)
        except NotAsked as exc:
            raise CommandError(str(exc), code=exc.code) from None
        if not answer.accepted:
            pool = head.head.fleet.pools.get(node_key)
            who = (pool.info.identity if pool is not None else "") or node_key
            raise CommandError(f"{who} refused to serve {spec}: {answer.message}",
                               code="node_refused")
        learnt = await self._head_learns(spec)
        return f"{answer.message}; {learnt}" if learnt else answer.message

    async def _head_learns(self, spec: str) -> str:
        """This machine's head learns ``spec``, which a fleet node now serves: its tokenizer
        and template from the model's GGUF header alone (fetched off the loop), kept in the
        head's ``also_models`` across restarts. Returns the line of what happened ("" when
        the head had it, or had it from a file here); a failure is that line too (the node
        serves the model all the same), and a Notice."""
        head = self._head
        if head is None or spec in head.head.models:
            return ""
        try:
            model, line = await learn_model(spec, head.head.model.runtime,
                                            home=self.settings.home,
                                            offline=self.settings.offline)
        except StartError as exc:
            line = f"this machine's API cannot serve {spec}: {exc}"
            log.warning("%s", line)
            self.notice("warning", line)
            return line
        if self._head is not None and spec not in self._head.head.models:
            self._head.head.add_model(model)
        hs = self.settings.head
        if hs is not None and spec not in hs.also_models:
            self._conf.update(lambda s: replace(s, head=replace(
                hs, also_models=(*hs.also_models, spec))))
            # a restart's head learns it again, from disk
            self._conf.save_soon(lambda text: self.notice("error", text))
        log.info("this machine's API serves %s too%s", spec, f" ({line})" if line else "")
        return f"this machine's API {line}" if line else ""

    async def _learn_all(self, specs: list[str]) -> None:
        for spec in specs:
            await self._head_learns(spec)

    async def _also_model(self, spec: str, runtime: str) -> HeadModel | None:
        """Another model the head serves (``also_models``): through its header where the
        runtime reads one, else its file. One that cannot be had is said in one line and
        left out: the head serves the others."""
        try:
            if runtime in READS_HEADERS:
                return (await learn_model(spec, runtime, home=self.settings.home,
                                          offline=self.settings.offline))[0]
            return await load_head_model(await self._resolve(spec, runtime))
        except StartError as exc:
            line = f"this machine's API does not serve {spec}: {exc}"
            log.warning("%s", line)
            self.notice("warning", line)
            return None

    async def _fleet_chooses(self, spec: str) -> tuple[bool, str]:
        """A head of the fleet asks this machine's node to serve ``spec`` (a hub id, checked
        by the agent): taken when the settings let the fleet choose and the owner's quota
        of fleet models has room for it (older fleet models removed to make it), then
        pulled and loaded in the background; refused with why otherwise. Answers within
        ROOM_S (the hub sizes the model): beyond it, taken, and a refusal found later is
        said in this node's stats."""
        node = self.settings.node
        if node is None or self._stopped:
            return False, "this machine is stopping; ask again once it serves"
        if not node.fleet_may_choose_model:
            return False, ("this machine keeps the model its user chose (Settings: \"Let "
                           "the fleet choose this machine's model\" is off); choose its "
                           "model on that machine")
        if node.upstream is not None:
            return False, (f"this node fronts the engine at {node.upstream}; choose that "
                           "engine's model there")
        if self._chosen is not None and not self._chosen.done():
            return False, (f"this node is switching to {self._chosen_spec} already; ask "
                           "again once it serves it")
        if self._node is not None and self._node.engine.info.model == spec:
            return True, f"serves {spec} already"
        self._chosen_spec, self._chosen_failed = spec, ""
        loop = asyncio.get_running_loop()
        room: asyncio.Future[str | None] = loop.create_future()
        self._chosen = loop.create_task(
            self._serve_chosen(model_cache.HubId(spec), node.runtime, node.fleet_models_quota,
                               room), name="shoal-fleet-model")
        try:
            async with asyncio.timeout(ROOM_S):
                refusal = await asyncio.shield(room)
        except TimeoutError:
            return True, f"pulling {spec} once the hub says its size; this node serves it " \
                         "once it is loaded"
        if refusal is not None:
            return False, refusal
        return True, f"pulling {spec}; this node serves it once it is loaded"

    async def _serve_chosen(self, spec: str, runtime: str | None, quota: Quota,
                            room: asyncio.Future[str | None]) -> None:
        """Make room for ``spec`` (said on ``room``), pull it without the role lock, then
        swap it in under the lock."""
        home = self.settings.home
        try:
            serving = self._node.engine.info.model if self._node is not None else ""
            try:
                made = await asyncio.to_thread(
                    room_for, spec, home=home, offline=self.settings.offline, quota=quota,
                    runtime=runtime, serving=serving)
            except OSError as exc:
                made = Made(refusal=f"could not look at the models kept here ({exc})")
            room.set_result(made.refusal)
            if made.refusal is not None:
                raise ShoalError(made.refusal, code="no_room")
            model = await self._resolve(spec, runtime)
            if made.need:  # a new model, here because the fleet chose it: the quota's
                await asyncio.to_thread(model_store.note_fleet_chosen, home, str(spec))
            name = await self._swap_to(spec, runtime, model)
        except ShoalError as exc:
            line = f"could not serve {spec}, which a head of the fleet chose: {exc}"
            log.warning("%s", line)
            self.notice("error", line)
            self._chosen_failed = line  # the heads hear it in this node's stats
            return
        finally:
            if not room.done():  # stopped first
                room.set_result("this machine is stopping; ask again once it serves")
        log.info("serving %s, which a head of the fleet chose", name)

    def _machine_facts(self) -> MachineFacts:
        """What this machine's node tells its heads of the machine: RAM, the disk free
        where models are kept (read off the loop every few seconds), a pull under way."""
        pull = next((p for p in reversed(self._pulls.running.values())
                     if p.state == "running"), None)
        return MachineFacts(ram_total=self.memory.total,
                            disk_free=self._disk.now() if self._disk is not None else 0,
                            pull_model=pull.model if pull else "",
                            pull_done=pull.done_bytes if pull else 0,
                            pull_total=pull.total_bytes if pull else 0,
                            serve_failed=self._chosen_failed)

    # -- the fleet -----------------------------------------------------------------

    async def create_fleet(self, name: str | None = None) -> Pairing:
        """Make this machine the start of a fleet: a token (if it has none), the head
        taking nodes from other machines and announced on the network. Returns the
        pairing code for the next machine."""
        async with self._lock:
            if self._creds.token is None:
                await self._set_token(new_token(), name or socket.gethostname())
            elif name:
                await self._creds.rename(name)
            if self._head is not None and self._head.fleet_side is None:
                await self._open_fleet()
            self._roles_changed()
        return await self.pairing()

    async def fleet_token(self, *, rotate: bool = False) -> bytes:
        """The fleet token (made when absent; replaced with ``rotate``). For a person who
        asked for it (`shoal fleet token`): it is the key to the whole fleet."""
        if rotate or self._creds.token is None:
            async with self._lock:
                await self._set_token(new_token(), self._creds.name)
        token = self._creds.token
        assert token is not None
        return token

    async def move_token(self, to: tokens.Place) -> str:
        """Keep the token in the OS keychain or in the token file; one line says where."""
        return await self._creds.move(to)

    async def pairing(self, *, head: str | None = None) -> Pairing:
        """The join URL and QR code of this fleet, pointing at this machine's head (or
        ``head``, HOST:PORT)."""
        token = self._creds.token
        if token is None:
            raise CommandError("this machine has no fleet token yet; start a fleet here "
                               "first (Start a fleet here, or `shoal fleet token`)",
                               code="no_token")
        if head is None:
            side = self.fleet_address
            port = side[1] if side else FLEET_PORT
            addresses = await asyncio.to_thread(local_addresses)
            head = f"{addresses[0] if addresses else '127.0.0.1'}:{port}"
        name = self._creds.name or socket.gethostname()
        try:
            url = pairing.join_url(head, token, name)
        except pairing.PairingError as exc:
            raise CommandError(str(exc), code="bad_pairing") from None
        png = await asyncio.to_thread(pairing.qr_png, url)
        return Pairing(url=url, fleet=name, head=head, png=png, text=pairing.qr_text(url))

    async def rotate_token(self) -> Pairing:
        """A new fleet token: every other machine must pair again."""
        async with self._lock:
            await self._set_token(new_token(), self._creds.name)
            self._roles_changed()
        return await self.pairing()

    async def join(self, code: str | None = None, *, head: str | None = None) -> JoinResult:
        """Join a fleet: by a join code (the URL, or the path of an image of its QR code),
        or with this machine's token by a head's HOST:PORT (None: found on the network).
        The token is checked against a head before anything changes here."""
        async with self._lock:
            node = self._require_node()
            psk: bytes | None
            name: str | None
            if code is not None:
                parsed = await _parse_code(code)
                psk, name = parsed.token, parsed.fleet
                given: HeadAddress | None = HeadAddress(parsed.head_host, parsed.head_port,
                                                        "code")
            else:
                psk, name = self._creds.token, self._creds.name
                given = None
                if head is not None:
                    host, port = parse_address(head, FLEET_PORT, what="the head")
                    given = HeadAddress(host, port, "given")
            join = self.settings.join or JoinSettings()
            heads, hello, finder = await locate(given, psk=psk, discovery=self.settings.discovery,
                                                head_port=join.head_port)
            if self._member is not None:
                await self._member.close()
                self._member = None
            if psk != self._creds.token or name != self._creds.name:
                # another fleet: what this head took from the old one goes with it
                await self._set_token(psk, name, other_fleet=psk != self._creds.token)
            if self._head is not None and self._head.fleet_side is None and psk is not None:
                await self._open_fleet()
            if self._head is not None:
                for found in heads:
                    self._head.meet(found.host, found.port)
            self._member = Membership.start(node.agent, heads, finder, psk=psk, given=given,
                                            handshake_timeout_s=node.settings.handshake_timeout_s)
            self._conf.update(lambda s: s.with_join(replace(
                join, head=str(given) if given else None, code=None)), rejoin_settled=True)
            self._roles_changed()
            return JoinResult(fleet=name or "", heads=tuple(str(h) for h in heads),
                              model=hello.model)

    async def leave(self, *, forget_token: bool = False) -> list[str]:
        """Leave the fleet: this machine's node unlinks from the fleet's heads, its head
        stops taking nodes from other machines; with ``forget_token`` the token goes too.
        Returns what was done, one line each."""
        async with self._lock:
            done: list[str] = []
            if self._member is not None:
                heads = ", ".join(str(h) for h in self._member.heads) or "the heads"
                await self._member.close()
                self._member = None
                done.append(f"closed the links to {heads}")
            if self._head is not None and self._head.fleet_side is not None:
                await self._head.close_fleet()
                self._record_fleet_listen(None)
                self._head.forget_found_nodes()
                done.append("stopped taking nodes from other machines")
            self._conf.update(lambda s: s.with_join(None), rejoin_settled=True)
            if forget_token:
                places = await self._creds.forget()
                self._hand_token()
                if places:
                    done.append(f"removed the fleet token from {' and '.join(places)}")
            self._roles_changed()
            return done

    # -- helpers -------------------------------------------------------------------

    @property
    def _drain_s(self) -> float:
        return 10.0

    def _require_node(self) -> LocalNode:
        if self._node is None:
            raise CommandError("this machine serves no model; choose one to serve first",
                               code="no_node")
        return self._node

    async def _resolve(self, spec: str | None, runtime: str | None) -> Resolved:
        return await resolve(spec, runtime, home=self.settings.home,
                             offline=self.settings.offline, emit=self._emit, pulls=self._pulls)

    async def _set_token(self, psk: bytes | None, name: str | None, *,
                         other_fleet: bool = False) -> None:
        """Keep ``psk`` and put it to use everywhere. The head's fleet side (links with
        other heads, its announcement, the finders of heads and nodes) took the old token
        when it opened, so it is closed and opened again on the same address;
        ``other_fleet``: the nodes that joined or were found go too (they are the old
        fleet's)."""
        if not await self._creds.replace(psk, name):
            return
        self._hand_token()
        head = self._head
        if head is None or head.fleet_side is None:
            return
        side = head.fleet_side
        await head.close_fleet()
        if other_fleet:
            head.forget_found_nodes()
        host = f"[{side.host}]" if ":" in side.host else side.host
        await self._open_fleet(f"{host}:{side.port}")

    def _hand_token(self) -> None:
        """The roles that speak on the fleet's links take the token now kept."""
        psk = self._creds.token
        if self._head is not None:
            self._head.set_psk(psk)
        if self._node is not None:
            self._node.set_psk(psk)
        if self._member is not None:
            self._member.set_psk(psk)

    async def _open_fleet(self, again_on: str | None = None) -> None:
        """Take nodes from other machines (``again_on``: where the fleet side listened
        until a moment ago: opened there again, the settings unchanged)."""
        assert self._head is not None
        hs = self._head.settings
        listen = again_on or hs.fleet_listen or configuration.DEFAULT_FLEET_LISTEN
        sock = HeadRole.bind_fleet(listen)
        await self._head.open_fleet(sock, discovery=self.settings.discovery)
        if again_on is None:
            self._record_fleet_listen(listen)

    def _record_fleet_listen(self, listen: str | None) -> None:
        """Keep where the head takes joins in the settings, so that a caller saving them
        (the app) comes back to the fleet after a restart, and not after `leave`."""
        self._conf.update(lambda s: s.with_head(replace(s.head, fleet_listen=listen))
                          if s.head is not None else s)

    def _emit(self, event: ShoalEvent) -> None:
        self._bus.publish(event)

    def _roles_changed(self) -> None:
        node = self._node
        self._emit(RolesChanged(head=self._head is not None,
                                node=node.state if node else "off",
                                fleet=self._creds.name if self._creds.token else None))
        # after a restart it comes back as it is now
        self._conf.save_soon(lambda line: self.notice("error", line))

    def notice(self, level: str, text: str) -> None:
        """Publish a warning or error line (for parts that only log)."""
        self._emit(Notice(level=level, text=text))  # type: ignore[arg-type]


async def _parse_code(code: str) -> pairing.JoinCode:
    """A join URL, or an image of its QR code (read off the loop)."""
    text = code.strip()
    try:
        if not text.lower().startswith(f"{pairing.SCHEME}://"):
            text = await asyncio.to_thread(_read_code_image, text)
        return pairing.parse_join_url(text)
    except pairing.PairingError as exc:
        raise JoinError(str(exc), code="bad_join_code") from None


def _read_code_image(path: str) -> str:
    return pairing.read_qr_image(Path(path).expanduser())

"""The `Shoal` object: one running Shoal, in process, that the CLI, the tests and the
desktop app all drive.

    shoal = await Shoal.start(settings)        # the roles the settings name
    shoal.snapshot()                           # frozen state: nodes, heads, aliases, roles
    async for event in shoal.events(): ...     # typed changes, bounded per subscriber
    await shoal.join(code) / leave() / set_head(on) / pause_serving(on) / set_model(spec)
    await shoal.serve_on(node_key, spec)       # this machine's node, or one of the fleet's
    await shoal.serve_split(spec, machines)    # one model across machines that lend memory
    await shoal.aliases.set(...); shoal.keys.issue(name); await shoal.pairing()
    shoal.settings / shoal.pending             # in force / for the next start
    await shoal.update_settings(http_port=8460)  # validated, written once (SettingsChanged)
    shoal.memory                               # this machine's RAM and the default budget
    await shoal.stop(drain=10)                 # leaves no task, thread, socket or file

`Shoal` is a facade and the composition root: each fact has one owner, wired here, none
of which calls back up into it: `Configuration` (the settings), `FleetCredentials` (the
token and the fleet's name), `RunningRoles` (head, node, membership), `HeadModels`,
`FleetChoice` (what the fleet asks of this machine's models) and `Pulls`. Commands return
typed results or raise `ShoalError`s with the one line for the user. Nothing here prints,
reads argv or handles signals, and nothing slow runs on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.credentials import tokens
from engine.credentials.keeper import FleetCredentials, read_join_code
from engine.discovery.fleet_id import fleet_id
from engine.discovery.mdns import local_addresses
from engine.errors import CommandError
from engine.events import EventBus, Notice, SettingsChanged, ShoalEvent, Subscription
from engine.head.commands import AliasCommands
from engine.head.fleet.split_ask import hub_spec, split_targets
from engine.head.observe import fleet_snapshot
from engine.models import store as model_store
from engine.models.commands import ModelCommands
from engine.models.loading import Pulls, Resolved
from engine.models.pulls.quota import Quota
from engine.node import model_set
from engine.node.files import FleetPeers
from engine.roles.head_role import HeadRole
from engine.service.configuration import Ask, Configuration
from engine.service.fleet_choice import FleetChoice
from engine.service.head_models import HeadModels, ModelSource
from engine.service.keys import KeyCommands
from engine.service.rejoin import Rejoin
from engine.service.results import (
    JoinResult,
    MachineMemory,
    Pairing,
    SettingsChange,
    machine_memory,
)
from engine.service.roles import RunningRoles
from engine.settings import FLEET_PORT, DiscoveryMode, JoinSettings, Settings
from engine.sizes import KvType, Share
from engine.snapshot import FleetSnapshot, PullSnapshot, Roles

log = logging.getLogger("shoal")

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
        self._wall = wall
        self._bus = EventBus()
        self._emit: Callable[[ShoalEvent], None] = self._bus.publish
        self._pulls = Pulls()
        self._opening = False
        self._conf = Configuration(settings, keep=keep, app=app, rejoin=rejoin)
        self._creds = FleetCredentials(settings.home, auth_file=settings.auth_file)
        self._resolve = ModelSource(self._conf, self._pulls, self._emit)
        self._head_models = HeadModels(self._conf, resolve=self._resolve, emit=self._emit,
                                       head=lambda: self._roles.head)
        self._choice = FleetChoice(self._conf, pulls=self._pulls, resolve=self._resolve,
                                   swap=lambda spec, runtime, model, split:
                                   self._roles.swap(spec, runtime, model, split),
                                   serving=self._roles_serving,
                                   ram_total=lambda: machine_memory().total, emit=self._emit,
                                   clock=clock)
        self._roles = RunningRoles(self._conf, self._creds, self._head_models,
                                   resolve=self._resolve, emit=self._emit, clock=clock,
                                   wall=wall, snapshot=self.snapshot,
                                   machine=self._choice.machine_facts,
                                   serve_model=self._choice.ask,
                                   serve_split=self.serve_split)
        # a pull asks the fleet's machines for a model before the hub: those this machine's
        # roles know, and those a split being switched to names
        self._pulls.peers = FleetPeers(
            lambda: [*self._roles.peer_addresses(), *self._choice.lenders()],
            lambda: self._creds.token)
        self._rejoin = Rejoin(self._conf, join=lambda head: self._roles.join(None, head))
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

    async def open(self, settings: Settings | None = None) -> None:
        """Start the roles (for a caller that subscribed to `events` first, to see the
        start's own progress). On failure every part started is stopped again and the
        Shoal stays as it was before: it can be opened again, on ``settings`` when given
        (the cause fixed: another port, say). Raises StartError / JoinError (one line)."""
        async with self._roles.lock:
            if self._roles.stopping:
                raise CommandError("this Shoal has stopped; start a new one", code="stopped")
            if self._roles.running:
                raise CommandError("Shoal runs already", code="running")
            if settings is not None:
                self._conf.update(lambda _: settings)
                self.keys = KeyCommands(settings.home)
            self._opening = True
            try:
                if self.settings.node is not None:  # what its stats say, from the first
                    await self._choice.read_machine()
                join = self.settings.join
                await self._roles.open(await read_join_code(join.code)
                                       if join is not None and join.code else None)
            except BaseException:
                await self._roles.close(drain=0)
                raise
            finally:
                self._opening = False
            if self._roles.node is not None:
                self._rejoin.start()
        await self.models.say_catalog()

    async def stop(self, drain: float = 10.0) -> None:
        """Finish (or, after ``drain`` seconds, cancel) the sessions under way and stop
        every role. Idempotent."""
        if self._roles.stopping:
            return
        self._roles.stopping = True
        await self._rejoin.close()
        await self._choice.close()
        await self._head_models.close()
        await self._roles.close(drain)
        await self._conf.flush()
        self._bus.close()

    # -- reading -------------------------------------------------------------------

    def snapshot(self) -> FleetSnapshot:
        head, node, member, creds = (self._roles.head, self._roles.node, self._roles.member,
                                     self._creds)
        roles = Roles(
            head=head is not None, api_url=head.api_url if head else None,
            fleet_listen=(f"{head.fleet_side.host}:{head.fleet_side.port}"
                          if head is not None and head.fleet_side is not None else None),
            node=node.snapshot(tuple(str(h) for h in member.heads) if member else (),
                               member.linked() if member else ()) if node else None,
            member=member is not None, rejoining=self._rejoin.waiting,
            rejoin_error=self._rejoin.error)
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
        return machine_memory()

    async def update_settings(self, *, http_port: int | None = None,
                              fleet_port: int | None = None,
                              discovery: DiscoveryMode | None = None,
                              queue_timeout_s: float | None = None,
                              memory_budget: int | Share | None = None,
                              kv_type: KvType | None = None,
                              gpu: str | None = None,
                              idle_unload_s: float | None = None,
                              serve_kept: bool | None = None,
                              fleet_may_choose_model: bool | None = None,
                              fleet_models_quota: Quota | None = None,
                              lend: bool | None = None,
                              lend_on_battery: bool | None = None,
                              app: Mapping[str, Any] | None = None) -> SettingsChange:
        """Change this machine's settings (`configuration.Ask` says when each applies).
        Validated first (CommandError with the fix), then written once (with ``keep``),
        and `SettingsChanged` is published."""
        change = self._conf.ask(
            Ask(http_port=http_port, fleet_port=fleet_port, discovery=discovery,
                queue_timeout_s=queue_timeout_s, memory_budget=memory_budget,
                kv_type=kv_type, gpu=gpu, idle_unload_s=idle_unload_s,
                serve_kept=serve_kept, fleet_may_choose_model=fleet_may_choose_model,
                fleet_models_quota=fleet_models_quota, lend=lend,
                lend_on_battery=lend_on_battery, app=app),
            running=self._roles.running or self._opening, ram_total=self.memory.total)
        if lend is not None and self._roles.node is not None:
            await self._roles.node.set_lend(lend, self.settings.home)
        if lend_on_battery is not None and self._roles.node is not None:
            self._roles.node.set_lend_on_battery(lend_on_battery)
        self._emit(SettingsChanged(restart_needed=change.restart_needed))
        await self._conf.save()
        return change

    def events(self, *, buffer: int = 1024) -> Subscription:
        """Typed events from now on (``async for``; ``close()`` or ``async with`` to stop)."""
        return self._bus.subscribe(buffer=buffer)

    @property
    def aliases(self) -> AliasCommands:
        if self._roles.head is None:
            raise CommandError("the API does not run on this machine; turn it on (Run the "
                               "API on this machine, or `shoal serve`) to change aliases",
                               code="no_head")
        return self._roles.head.aliases

    @property
    def api_url(self) -> str | None:
        return self._roles.head.api_url if self._roles.head else None

    @property
    def fleet_address(self) -> tuple[str, int] | None:
        """Where this machine's head takes nodes that join, when it does."""
        side = self._roles.head.fleet_side if self._roles.head else None
        return (side.host, side.port) if side else None

    @property
    def node_address(self) -> tuple[str, int] | None:
        node = self._roles.node
        return (node.host, node.port) if node else None

    # -- roles ---------------------------------------------------------------------

    async def set_head(self, on: bool) -> None:
        """Run the API (and placement) on this machine, or stop it here."""
        await self._roles.set_head(on)

    async def pause_serving(self, paused: bool) -> None:
        """Stop taking new sessions on this machine's node (those running finish)."""
        self._roles.pause(paused)

    async def set_model(self, spec: str | None, *, runtime: str | None = None) -> str:
        """Serve another model here (None: the embedded default): pull it with progress,
        load it, then move the head's tokenizer and the node over. Returns its name. When
        the new model cannot be served (it fails to load, it is too big, of a kind the
        runtime cannot run), the old one is served again and the settings keep its name:
        ShoalError says both. The pull holds no role lock: leave, join and the API's
        switch go on meanwhile; only the swap waits for them."""
        return await self._roles.swap(spec, runtime, await self._owned(spec, runtime))

    async def serve_too(self, spec: str, *, runtime: str | None = None) -> str:
        """Serve ``spec`` on this machine besides the model it serves (pulled first, with
        progress; a file elsewhere is imported into the models kept here, linked): it loads
        on the first request for it, and unloads when idle or when another needs the room.
        The line of what happened; ShoalError when it cannot."""
        node = self.settings.node
        model = await self._owned(spec, runtime or (node.runtime if node else None))
        home = self.settings.home
        kept = await asyncio.to_thread(model_store.kept_models, home)
        here = next((k for k in kept if str(k.path) == model.path or k.name == model.name),
                    None)
        if here is not None:  # kept already (imported before, under its name)
            model = Resolved(path=str(here.path), name=here.name, runtime=model.runtime)
        elif await asyncio.to_thread(Path(model.path).is_file):  # none for the mock runtime
            try:
                stored = await asyncio.to_thread(model_store.import_gguf, home,
                                                 Path(model.path), model.name)
            except model_store.CannotImport as exc:
                raise CommandError(str(exc), code="cannot_import") from None
            model = Resolved(path=str(stored.path), name=stored.name, runtime=model.runtime)
        return await self._roles.serve_too(model)

    async def load_model(self, name: str) -> str:
        """Load ``name`` on this machine's node (its first model, or one it keeps) as a
        request would; the line of what happened. CommandError when it cannot."""
        return await self._roles.require_node().load(name)

    async def unload_model(self, name: str) -> str:
        """Free ``name``'s memory on this machine's node; it loads again on demand."""
        return await self._roles.require_node().unload(name)

    async def set_keep_alive(self, name: str, seconds: float | None) -> str:
        """How long ``name``, a model kept here, stays loaded once idle, now and after
        restarts: seconds (``math.inf``: never unload; 0: after each request), or None for
        the node's own idle time. The line of what happened; CommandError when no model of
        that name is kept here."""
        home = self.settings.home
        try:
            stored = await asyncio.to_thread(
                lambda: model_store.find_kept(model_store.kept_models(home), name))
        except model_store.ModelNotKept as exc:
            raise CommandError(str(exc)) from None
        await asyncio.to_thread(model_store.set_keep_alive, home, stored.name, seconds)
        node = self._roles.node
        if node is not None:
            node.set_keep_alive(str(stored.path), stored.name, seconds)
        return f"{stored.name} {model_set.idle_words(seconds)}"

    async def pull_model(self, spec: str, *, runtime: str | None = None) -> Path:
        """Pull ``spec`` into the models kept here (with PullProgress events), without
        serving it (`shoal models pull`); the file's path."""
        return Path((await self._owned(spec, runtime)).path)

    async def _owned(self, spec: str | None, runtime: str | None) -> Resolved:
        """``spec`` pulled; the owner's choice from now on, which the fleet's quota of the
        models it chose never removes."""
        model = await self._resolve(spec, runtime)
        if spec is not None:
            await asyncio.to_thread(model_store.forget_fleet_chosen, self.settings.home,
                                    str(spec))
        return model

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
        spec = hub_spec(spec)
        said = await self._require_head().ask_node_to_serve(node_key, spec)
        learnt = await self._head_models.learn(spec)
        return f"{said}; {learnt}" if learnt else said

    async def serve_split(self, spec: str, machines: Sequence[str]) -> str:
        """Serve ``spec`` (a hub id, org/repo:QUANT) on the first of ``machines``, its last
        layers on the memory the others lend (each named as the Fleet page and /v1/fleet
        name it, by its node's key, or ``this machine``): this machine's node swaps to it
        at once, as `set_model` does; a node of the fleet is asked over its link and
        answers at once, then pulls it and serves it split. The line of what happens;
        CommandError (one line) for an unknown machine, one that lends nothing or cannot
        be reached, or a serving machine that does not take models from heads."""
        spec = hub_spec(spec)
        head = self._require_head()
        targets = split_targets(self.snapshot().nodes, machines)
        names = ", ".join(targets.names[1:])
        if targets.serving == "local":
            node = self.pending.node
            runtime = node.runtime if node else None
            name = await self._roles.swap(spec, runtime, await self._owned(spec, runtime),
                                          targets.lenders)
            return f"this machine serves {name}, its last layers on {names}"
        said = await head.ask_node_to_serve(targets.serving, spec, targets.lenders)
        learnt = await self._head_models.learn(spec)
        return f"{targets.names[0]}: {said}; {learnt}" if learnt else \
            f"{targets.names[0]}: {said}"

    def _require_head(self) -> HeadRole:
        head = self._roles.head
        if head is None:
            raise CommandError("the API does not run on this machine, so it links with no "
                               "fleet node; turn it on (Run the API on this machine), or "
                               "choose the model on that machine", code="no_head")
        return head

    # -- the fleet -----------------------------------------------------------------

    async def create_fleet(self, name: str | None = None) -> Pairing:
        """Make this machine the start of a fleet: a token (if it has none), the head
        taking nodes from other machines and announced on the network. Returns the
        pairing code for the next machine."""
        await self._roles.create_fleet(name)
        return await self.pairing()

    async def fleet_token(self, *, rotate: bool = False) -> bytes:
        """The fleet token (made when absent; replaced with ``rotate``). For a person who
        asked for it (`shoal fleet token`): it is the key to the whole fleet."""
        if rotate or self._creds.token is None:
            await self._roles.new_token(announce=False)
        token = self._creds.token
        assert token is not None
        return token

    async def move_token(self, to: tokens.Place) -> str:
        """Keep the token in the OS keychain or in the token file; one line says where."""
        return await self._creds.move(to)

    async def pairing(self, *, head: str | None = None) -> Pairing:
        """The join URL and QR code of this fleet, pointing at this machine's head (or
        ``head``, HOST:PORT)."""
        if head is None and self._creds.token is not None:
            side = self.fleet_address
            port = side[1] if side else FLEET_PORT
            addresses = await asyncio.to_thread(local_addresses)
            head = f"{addresses[0] if addresses else '127.0.0.1'}:{port}"
        url, name, png, text = await self._creds.join_code(head or "", socket.gethostname())
        return Pairing(url=url, fleet=name, head=head or "", png=png, text=text)

    async def rotate_token(self) -> Pairing:
        """A new fleet token: every other machine must pair again."""
        await self._roles.new_token()
        return await self.pairing()

    async def join(self, code: str | None = None, *, head: str | None = None) -> JoinResult:
        """Join a fleet: by a join code (the URL, or the path of an image of its QR code),
        or with this machine's token by a head's HOST:PORT (None: found on the network).
        The token is checked against a head before anything changes here."""
        self._roles.require_node()
        return await self._roles.join(await read_join_code(code) if code is not None
                                      else None, head)

    async def leave(self, *, forget_token: bool = False) -> list[str]:
        """Leave the fleet: this machine's node unlinks from the fleet's heads, its head
        stops taking nodes from other machines; with ``forget_token`` the token goes too.
        Returns what was done, one line each."""
        return await self._roles.leave(forget_token=forget_token)

    # -- wiring --------------------------------------------------------------------

    def _roles_serving(self) -> str | None:
        return self._roles.node.engine.info.model if self._roles.node is not None else None

    def notice(self, level: str, text: str) -> None:
        """Publish a warning or error line (for parts that only log)."""
        self._emit(Notice(level=level, text=text))  # type: ignore[arg-type]

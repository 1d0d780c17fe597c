"""This machine's node: a loaded engine, the agent that admits sessions onto its lanes,
and a listener that heads dial (a loopback one for this machine's own head).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.discovery.service import announce_node
from engine.errors import CommandError, StartError
from engine.link.transport import LinkClosed, is_loopback
from engine.models import store as model_store
from engine.models.loading import Resolved, load_engine
from engine.node import model_set
from engine.node.agent import NodeAgent, ServeModelAsked
from engine.node.files import FileShelf
from engine.node.lending import Lender, NotLending, Tunnel
from engine.node.machine import MachineFacts
from engine.node.shelf import Keep, ModelShelf, Refused
from engine.roles.sockets import bind, bound_address, parse_address
from engine.runtimes.base import Embedder, Engine
from engine.runtimes.budget import default_budget_bytes, total_memory_bytes
from engine.runtimes.isolated import EngineStartFailed, IsolatedEngine, Load
from engine.runtimes.llamacpp import MAX_LENDERS, usable_cpus
from engine.runtimes.upstream.engine import UpstreamEngine
from engine.settings import NODE_PORT, DiscoveryMode, NodeSettings
from engine.sizes import Share, budget_bytes
from engine.snapshot import KeptModelSnapshot, LocalNodeSnapshot, ServingState

log = logging.getLogger("shoal.node")
DRAIN_POLL_S = 0.05


@dataclass
class LocalNode:
    settings: NodeSettings
    model: Resolved
    engine: Engine
    agent: NodeAgent
    host: str  # where it listens: 127.0.0.1 for this machine's head only, or --listen
    port: int
    _closers: list[Callable[[], Awaitable[None]]]
    closed: bool = False
    shelf: ModelShelf | None = None  # the models it keeps besides ``model``
    # the idle time its owner set per model (seconds; inf: never), by model file
    keep_alive: dict[str, float] = field(default_factory=dict)
    # where a node that heads do not dial takes the fleet's links while it lends
    _lend_server: asyncio.Server | None = None

    @classmethod
    async def start(cls, settings: NodeSettings, model: Resolved, *, name: str,
                    psk: bytes | None, discovery: DiscoveryMode,
                    sock: socket.socket | None = None, home: Path | None = None,
                    machine: Callable[[], MachineFacts] | None = None,
                    serve_model: ServeModelAsked | None = None,
                    kept: Sequence[Resolved] = (),
                    keep_alive: Mapping[str, float] | None = None) -> LocalNode:
        """Load ``model`` and serve it. ``sock``: the listener, bound earlier (before the
        model loaded); without one the node listens on loopback for this machine's head.
        ``home``: the model is marked served there while the node runs (`shoal models rm`
        refuses it). ``machine``, ``serve_model``: what its stats say of the machine, and who
        answers a head that asks it to serve another model (`NodeAgent`). ``kept``: models
        it serves besides ``model``, each loaded on the first request for it.
        ``keep_alive``: the idle time its owner set for some models, by their files."""
        keep_alive = dict(keep_alive or {})
        if sock is None:
            sock = bind("127.0.0.1", 0, what="the local node's")
        host, port = bound_address(sock)
        closers: list[Callable[[], Awaitable[None]]] = []
        engine: Engine | None = None
        shelf: ModelShelf | None = None
        try:
            tunnels = await _tunnels(settings, psk, closers)
            if tunnels:
                engine = await _split_engine(settings, model, name, tunnels)
            else:
                engine = await load_engine(model, name=name, lanes=settings.lanes,
                                           max_context=settings.max_context,
                                           mock_speed=settings.mock_speed,
                                           memory_budget=settings.memory_budget,
                                           kv_type=settings.kv_type, gpu=settings.gpu)
            # an engine it fronts has its own tokenizer: check it against each head's
            probe = engine.probe if isinstance(engine, UpstreamEngine) else []
            if kept:
                shelf = _shelf(settings, engine, kept, keep_alive)
            agent = NodeAgent(engine, identity=settings.identity or socket.gethostname(),
                              psk=psk, handshake_timeout_s=settings.handshake_timeout_s,
                              idle_timeout_s=settings.idle_timeout_s,
                              idle_unload_s=keep_alive.get(model.path,
                                                           settings.idle_unload_s),
                              probe=probe,
                              probe_source=f"the {engine.info.runtime} at {engine.info.path}",
                              machine=machine, serve_model=serve_model, shelf=shelf,
                              files=FileShelf(home) if home is not None else None,
                              lender=await _lender(settings, engine, home, closers))
            agent.paused = settings.paused
            await agent.listen_on(sock)
        except BaseException:
            sock.close()
            if engine is not None:
                await engine.close()
            for close in reversed(closers):
                with contextlib.suppress(Exception):
                    await close()
            raise
        node = cls(settings, model, engine, agent, host, port, closers, shelf=shelf,
                   keep_alive=keep_alive)
        if home is not None:
            marks = await asyncio.to_thread(_mark_served, home, model.path)
            closers.append(lambda: asyncio.to_thread(marks.close))
        if settings.lend:
            await node._lend_listener(True)
        if settings.listen is not None and not is_loopback(host) and discovery != "none":
            closers.extend(await announce_node(discovery, identity=agent.identity,
                                               model=engine.info.model, psk=psk, port=port,
                                               host=host))
        return node

    @staticmethod
    def bind_listener(settings: NodeSettings, psk: bytes | None, *,
                      again: int = 0) -> socket.socket | None:
        """The listener of a node that heads dial (``--listen``), bound before the load
        (and refused before it without a token off loopback: the link would be plaintext).
        ``again``: the port this node listened on before its model changed, taken again
        where the settings leave the port to the system (0): its heads dial it there."""
        if settings.listen is None:
            return None
        host, port = parse_address(settings.listen, NODE_PORT, what="--listen")
        port = port or again
        if psk is None and not is_loopback(host) and not settings.insecure_no_auth:
            raise StartError(f"refusing to listen on {host}:{port} without a fleet token; "
                             "make one with `shoal fleet token` (or pair this machine), "
                             "listen on 127.0.0.1, or pass --insecure-no-auth",
                             code="no_token")
        return bind(host, port, what="the node's")

    @property
    def state(self) -> ServingState:
        return "paused" if self.agent.paused else "serving"

    def snapshot(self, heads: tuple[str, ...] = (),
                 linked: tuple[str, ...] = ()) -> LocalNodeSnapshot:
        info = self.engine.info
        st = self.engine.stats()
        facts = self.agent.facts()
        return LocalNodeSnapshot(
            state=self.state, identity=self.agent.identity, model=info.model,
            runtime=info.runtime, path=info.path, context_window=info.context_window,
            window_pinned=info.window_pinned, lanes=info.lanes, lanes_busy=self.agent.busy,
            address=f"{self.host}:{self.port}", listening=self.settings.listen is not None,
            encrypted=self.agent.psk is not None, heads=heads, linked=linked,
            kv_cells=st.kv_total, memory_used=st.mem_used, memory_budget=st.mem_budget,
            host_cache_limit=st.host_cache_limit, sleep=self.agent.sleep,
            device=st.device, gpu_layers=st.gpu_layers, model_layers=st.model_layers,
            device_note=st.device_note, embeddings=isinstance(self.engine, Embedder),
            ram_total=facts.ram_total, device_kind=st.device_kind,
            device_total=st.device_total, device_free=st.device_free,
            disk_free=facts.disk_free, model_memory=self.agent.first_bytes,
            kept=tuple(KeptModelSnapshot(k.name, k.state, memory=k.mem, size=k.size,
                                         embeddings=k.embeds, context_window=k.context_window)
                       for k in (self.shelf.records() if self.shelf is not None else [])))

    async def load(self, name: str) -> str:
        """Load ``name``, the first model or one it keeps, as a request would (a person's
        click): the line of what happened. CommandError (one line) when it cannot."""
        if name == self.engine.info.model:
            if not self.agent.sleep:
                return f"{name} is loaded already"
            await self.agent.wake()
            return f"loaded {name}"
        shelf = self._shelf_with(name)
        if shelf.loaded(name) is not None:
            return f"{name} is loaded already"
        try:
            await shelf.acquire(name)
        except Refused as exc:
            raise CommandError(str(exc)) from None
        shelf.release(name)
        return f"loaded {name}"

    async def unload(self, name: str) -> str:
        """Free ``name``'s memory now; it loads again on the next request for it."""
        if name == self.engine.info.model:
            if not self.agent.can_unload:
                raise CommandError(f"{name} cannot be unloaded: its runtime keeps it loaded")
            if not await self.agent.unload_first():
                raise CommandError(f"{name} is answering requests; unload it when they "
                                   "finish, or pause serving first")
            return f"unloaded {name}; it loads again on the next request"
        shelf = self._shelf_with(name)
        if shelf.loaded(name) is None:
            return f"{name} is not loaded"
        if not await shelf.unload(name):
            raise CommandError(f"{name} is answering requests; unload it when they finish")
        return f"unloaded {name}; it loads again on the next request"

    def keep_also(self, model: Resolved) -> bool:
        """Serve ``model`` too, loaded on the first request for it (False: served already)."""
        if model.name == self.engine.info.model or model.path == self.model.path:
            return False
        if self.shelf is None:
            self.shelf = _shelf(self.settings, self.engine, [model], self.keep_alive)
            self.agent.attach(self.shelf)
            return True
        return self.shelf.add(_keep(self.settings, model, self.keep_alive.get(model.path)))

    async def set_lend(self, on: bool, home: Path) -> None:
        """Lend this machine's memory to the fleet's split models from now on, or stop
        (the RPC server ends; a split using it fails over as a failed node does)."""
        self.settings = replace(self.settings, lend=on)
        if on and self.agent.lender is None:
            self.agent.lender = await _lender(self.settings, self.engine, home, self._closers)
        elif not on and self.agent.lender is not None:
            lender, self.agent.lender = self.agent.lender, None
            await lender.close()
            log.info("this machine lends no memory to the fleet any more")
        await self._lend_listener(on)

    async def _lend_listener(self, on: bool) -> None:
        """A node that heads dial takes the fleet's links already (``--listen``); one that
        only joined heads, or serves this machine's head on loopback, listens on the node
        port while it lends, so that a split's serving machine reaches it (its stats say
        the port; a head names it there)."""
        if not on:
            server, self._lend_server = self._lend_server, None
            if server is not None:
                self.agent.listens = 0
                await self.agent.stop_listening(server)
            return
        if self._lend_server is not None or self.settings.listen is not None:
            return  # listening already, where its owner said
        if self.agent.psk is None:
            log.warning("lending memory needs a fleet token to take links from other "
                        "machines; make one with `shoal fleet token` or pair this machine")
            return
        # every address, as a node that heads dial: a link there needs the fleet token
        try:
            sock = bind("0.0.0.0", NODE_PORT, what="the lending node's")  # noqa: S104
        except StartError:  # another node of this machine has it: any port will do
            sock = bind("0.0.0.0", 0, what="the lending node's")  # noqa: S104
        self._lend_server = await self.agent.listen_on(sock)
        self.agent.listens = bound_address(sock)[1]
        log.info("lending memory: this node takes links from the fleet's machines on port "
                 "%d", self.agent.listens)

    def set_lend_on_battery(self, on: bool) -> None:
        """Lend on battery power too from now on, or only on mains (asked at each split)."""
        self.settings = replace(self.settings, lend_on_battery=on)
        if self.agent.lender is not None:
            self.agent.lender.on_battery_too = on

    def set_keep_alive(self, path: str, name: str, seconds: float | None) -> bool:
        """The idle time of the model kept at ``path`` as ``name`` (None: the node's own
        again), from now on; False when this node does not serve it."""
        if seconds is None:
            self.keep_alive.pop(path, None)
        else:
            self.keep_alive[path] = seconds
        if path == self.model.path:
            self.agent.set_idle_unload(self.settings.idle_unload_s if seconds is None
                                       else seconds)
            return True
        if self.shelf is None or name not in self.shelf:
            return False
        self.shelf.set_keep_alive(name, _idle_of(self.settings) if seconds is None
                                  else seconds)
        return True

    def _shelf_with(self, name: str) -> ModelShelf:
        if self.shelf is None or name not in self.shelf:
            kept = ", ".join([self.engine.info.model,
                              *(self.shelf.names() if self.shelf else [])])
            raise CommandError(f"this machine's node does not serve {name}; it serves "
                               f"{kept} (serve every kept model with --serve-kept)")
        return self.shelf

    def set_psk(self, psk: bytes | None) -> None:
        """A new fleet token: new links use it (heads and joins redial with it)."""
        self.agent.psk = psk

    async def drain(self, timeout_s: float) -> None:
        """Take no new session and give those running up to ``timeout_s`` to finish."""
        self.agent.pause(True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.agent.busy:  # noqa: ASYNC110 - once, at shutdown, bounded
                    await asyncio.sleep(DRAIN_POLL_S)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                await close()
        await self.agent.close()
        if self.shelf is not None:
            await self.shelf.close()
        await self.engine.close()


async def _tunnels(settings: NodeSettings, psk: bytes | None,
                   closers: list[Callable[[], Awaitable[None]]]) -> list[Tunnel]:
    """A loopback tunnel to each machine the model is split with (``--split-with``);
    StartError (one line) where one lends nothing."""
    out: list[Tunnel] = []
    if len(settings.split_with) > MAX_LENDERS:
        raise StartError(f"a model splits across at most {MAX_LENDERS} lending machines "
                         f"(llama.cpp's RPC backend), not {len(settings.split_with)}; name "
                         "fewer in --split-with", code="bad_split")
    for address in settings.split_with:
        tunnel = Tunnel(address, psk, settings.identity or socket.gethostname())
        try:
            await tunnel.open()
        except NotLending as exc:
            raise StartError(f"cannot split the model with {address}: {exc}",
                             code="not_lending") from None
        except (OSError, LinkClosed, TimeoutError) as exc:
            raise StartError(f"cannot split the model with {address}: {exc}; check the "
                             "address, and that its node runs with this fleet's token",
                             code="split_unreachable") from None
        closers.append(tunnel.close)
        out.append(tunnel)
    return out


async def _split_engine(settings: NodeSettings, model: Resolved, name: str,
                        tunnels: Sequence[Tunnel]) -> Engine:
    """A split model's engine, in a process of its own (engine.runtimes.isolated): a
    lending machine that leaves aborts llama.cpp's RPC client, which would end this node
    and every session on it. Here the node fails those sessions over, refuses new ones
    while the split is down, and forms it again once every lending machine answers."""
    total = await asyncio.to_thread(total_memory_bytes) \
        if isinstance(settings.memory_budget, Share) else 0
    load = Load(path=model.path, name=name, runtime=model.runtime, lanes=settings.lanes,
                max_context=settings.max_context,
                memory_budget=budget_bytes(settings.memory_budget, total) or 0,
                kv_type=settings.kv_type, gpu=settings.gpu,
                split_with=tuple((t.endpoint, t.lend_bytes, t.label) for t in tunnels))

    async def all_answer() -> None:
        for t in tunnels:
            await t.probe()

    names = ", ".join(t.label for t in tunnels)
    engine = IsolatedEngine(load, module="engine.roles.engine_process", gate=all_answer,
                            what=f"the split with {names}",
                            again=f"it forms again when {names} "
                                  f"{'lends' if len(tunnels) == 1 else 'lend'} again")
    for t in tunnels:
        t.on_lost = engine.lost
    try:
        await engine.start()
    except EngineStartFailed as exc:
        raise StartError(str(exc), code=exc.code) from None
    return engine


async def _lender(settings: NodeSettings, engine: Engine, home: Path | None,
                  closers: list[Callable[[], Awaitable[None]]]) -> Lender | None:
    """This machine's memory lent to the fleet (``--lend``): its node budget less what its
    own model holds."""
    if not settings.lend or home is None:
        return None
    st = engine.stats()
    budget = st.mem_budget
    if not budget:  # /proc/meminfo or sysctl: read off the loop
        total = await asyncio.to_thread(total_memory_bytes)
        budget = budget_bytes(settings.memory_budget, total) or default_budget_bytes(total)
    lender = Lender(home, lend_bytes=max(budget - st.mem_used, 0), threads=usable_cpus(),
                    on_battery_too=settings.lend_on_battery,
                    quota=settings.fleet_models_quota)
    closers.append(lender.close)
    return lender


def _shelf(settings: NodeSettings, engine: Engine, kept: Sequence[Resolved],
           keep_alive: Mapping[str, float]) -> ModelShelf:
    """The models a node keeps besides ``engine``'s, within its memory budget."""
    budget = engine.stats().mem_budget  # what the engine keeps within, else the settings'
    if not budget:
        total = total_memory_bytes()
        budget = budget_bytes(settings.memory_budget, total) or default_budget_bytes(total)
    return ModelShelf([_keep(settings, r, keep_alive.get(r.path)) for r in kept],
                      budget=budget)


def _keep(settings: NodeSettings, model: Resolved, idle: float | None = None) -> Keep:
    """A kept model, loaded as the node's first one is (its lanes, budget and device);
    ``idle``: the idle time its owner set for it (None: the node's own)."""
    def load() -> Awaitable[Engine]:
        return load_engine(model, name=model.name, lanes=settings.lanes,
                           max_context=settings.max_context, mock_speed=settings.mock_speed,
                           memory_budget=settings.memory_budget, kv_type=settings.kv_type,
                           gpu=settings.gpu, measure_at_start=False)

    size = Path(model.path).stat().st_size if Path(model.path).is_file() else 0
    return Keep(name=model.name, size=size, load=load,
                keep_alive_s=_idle_of(settings) if idle is None else idle)


def _idle_of(settings: NodeSettings) -> float:
    """A kept model's idle time where its owner set none: the first model's
    (--idle-unload), until a request says else."""
    idle = settings.idle_unload_s
    return model_set.FOREVER if idle is None else idle


def _mark_served(home: Path, path: str) -> contextlib.ExitStack:
    """The model file marked served by this process until the stack closes (nothing for
    an engine that loads no file of ours: the mock, an upstream server)."""
    marks = contextlib.ExitStack()
    if Path(path).is_file():
        marks.enter_context(model_store.serving(home, path))
    return marks

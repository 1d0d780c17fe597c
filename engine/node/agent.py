"""The node agent: admits sessions onto lanes, streams tokens, fences lapsed leases.

One connection (or one channel of a link a head dialed: :mod:`engine.link.mux`)
carries one generation at a time. The agent, not the
connection, counts lanes: a node never runs more generations than its lanes,
whichever heads ask, and refuses a session at once when it is full (or when its
engine is down: an upstream engine that stopped answering).

A node given ``probe`` (the ids its engine makes of
:data:`engine.runtimes.probe.PROBE_TEXTS`: an engine it fronts, whose tokenizer it
did not load) refuses a head that announces the same model but tokenizes those
strings otherwise, with a ``wrong_model`` error, and closes the link.

An engine whose lanes share one KV pool (:class:`~engine.runtimes.base.Admitter`)
is asked before each session whether it fits now; one that does not is refused as
busy at once, so the head places it elsewhere. Before the first token the node
tells a head that reads them (its hello says ``progress``) how far the prompt is
every ``PROGRESS_S``, so that a long prefill is never taken for a hung attempt.

A head may ask the node to serve another model (``ServeModel``): the agent checks the
id and hands it to its owner's ``serve_model`` (given at construction), which says at
once whether it takes it; the agent answers the head with that (``ServeModelResult``).
Without one, the node refuses. A head may ask for the model split (``split_with``: the
machines whose lent memory holds its last layers), which the owner hears too. Its stats
carry what its owner's ``machine`` says of the machine (RAM, disk free, a pull under way)
beside the engine's device and its memory, and the memory it lends to split models.

Idle unload (``idle_unload_s``, an engine that is a
:class:`~engine.runtimes.base.Sleeper`): after that long with no session the
engine frees its model and pool, the links stay up and the stats say "asleep";
the next session wakes it (the stats say "waking", and that session's head gets
``Progress(loading=True)`` while the model loads).

A :class:`NodeObserver` given at construction (benchmarks, tests) is told of each
generation the node admits and of each ``Tokens`` record it hands to the link; without
one the node does nothing more per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from engine.link import messages as m
from engine.link.admission import FIRST_MESSAGE_S, PendingHandshakes
from engine.link.connection import LinkError
from engine.link.hello import WrongPeer, exchange_hellos
from engine.link.listener import NotTaken, take
from engine.link.mux import Carrier, Channel, Mux
from engine.link.transport import Incoming, Link, LinkClosed, serve
from engine.models import ids as model_ids
from engine.node import embeds, leases, model_set
from engine.node.files import FileShelf
from engine.node.lending import Lender
from engine.node.machine import MachineFacts
from engine.node.shelf import FirstModel, ModelShelf, Refused
from engine.runtimes.base import (
    Admitter,
    Embedder,
    Engine,
    EngineStats,
    Generation,
    GenerationRequest,
    Sampling,
    Sleeper,
)
from engine.runtimes.budget import process_rss_bytes
from engine.runtimes.decode_thread import PoolFull
from engine.runtimes.probe import mismatch
from engine.tasks import TaskSet, cancel_and_wait

log = logging.getLogger("shoal.node")

STATS_INTERVAL_S = 1.0
PROGRESS_S = 1.0  # how often a head hears how far the prompt (or the model's load) is
_TOLD_MAX = 1024
SleepState = Literal["", "asleep", "waking"]
# the owner's answer to a head asking this node to serve a model (split with the machines
# at the addresses given, where any are): (taken, the line why), within the head's wait
# (links.ANSWER_S): it may look at the model's size first
ServeModelAsked = Callable[[str, tuple[str, ...]], Awaitable[tuple[bool, str]]]
NO_FLEET_MODELS = ("this node does not take models chosen by heads; choose its model on "
                   "that machine")


class NodeObserver(Protocol):
    """Told of the node's work as it happens, on the node's loop: it must return at once
    and never raise (what it raises fails the generation it was told of)."""

    def admitted(self, gen: m.Generate) -> None:
        """``gen`` took a lane: the head has been told it was accepted."""
        ...

    def tokens(self, gen: m.Generate, record: m.Tokens) -> None:
        """``record``, the next tokens of ``gen``, is being handed to the link (just
        before it is, in the same step of the loop that the engine produced them in)."""
        ...


@dataclass
class _HeadLinks:
    links: set[Carrier] = field(default_factory=set)


class NodeAgent:
    offers_channels = True  # off only in tests, to stand in for a node from before channels

    def __init__(self, engine: Engine, *, identity: str, psk: bytes | None,
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic,
                 probe: Sequence[Sequence[int]] = (), probe_source: str = "",
                 idle_unload_s: float | None = None,
                 machine: Callable[[], MachineFacts] | None = None,
                 serve_model: ServeModelAsked | None = None,
                 observer: NodeObserver | None = None,
                 shelf: ModelShelf | None = None, files: FileShelf | None = None,
                 lender: Lender | None = None) -> None:
        self.engine = engine
        # the memory this machine lends to the fleet's split models (None: none, --lend)
        self.lender = lender
        # the model files this machine hands to the fleet's other machines (None: none)
        self.files = files
        # the models it keeps besides ``engine``'s, loaded on demand (None: that one only)
        self.shelf = shelf
        # the first model's file, and what it held of the budget when an unload measured
        # it (0: not yet); together what the shelf's choices take it to hold
        self._first_size = _file_size(engine.info.path)
        self._first_measured = 0
        self.observer = observer  # told of admissions and Tokens records (None: nobody)
        self.machine = machine  # what the stats say of the machine (None: nothing)
        self.serve_model = serve_model  # None: heads cannot choose this node's model
        self.probe = probe  # the engine's ids for PROBE_TEXTS; () when not checked
        self.probe_source = probe_source  # how a refusal names the engine
        self.identity = identity
        self.psk = psk
        self.handshake_timeout_s = handshake_timeout_s
        self.first_message_s = FIRST_MESSAGE_S  # a connection's first bytes (admission.py)
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._busy = 0
        self._peak = 0
        self._heads: dict[str, _HeadLinks] = {}
        self._tasks = TaskSet("the node")
        self._servers: list[asyncio.Server] = []
        # the port where the fleet's machines reach it, for a node whose heads it joined and
        # that listens only because it lends (its stats say it; 0: none such)
        self.listens = 0
        self._stats_task: asyncio.Task[None] | None = None
        self._closing = False
        self.paused = False
        self._pending: PendingHandshakes[Incoming] = PendingHandshakes()
        self._told: set[tuple[str, str]] = set()  # (address, failure) already logged
        self.instance = secrets.token_hex(8)
        self.idle_unload_s = idle_unload_s if isinstance(engine, Sleeper) else None
        self.sleep: SleepState = ""
        self._last_active = clock()
        self._activity = asyncio.Event()  # a session started or ended: re-time the unload
        self._sleep_task: asyncio.Task[None] | None = None
        # the last request's keep_alive (seconds; inf: never unload), over idle_unload_s
        self.keep_alive_s: float | None = None
        self._engine_lock = asyncio.Lock()  # one unload or load at a time
        if shelf is not None:
            self.attach(shelf)

    def attach(self, shelf: ModelShelf) -> None:
        """Serve the models ``shelf`` keeps besides the first, from now on."""
        shelf.first = FirstModel(name=self.engine.info.model, held=self._first_held,
                                 unload=self._suspend)
        shelf.changed = self._broadcast_stats
        self.shelf = shelf
        if self._heads:
            self._broadcast_stats()

    # -- lifecycle -------------------------------------------------------------

    @property
    def lanes(self) -> int:
        return self.engine.info.lanes

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        server = await serve(self._on_accept, host, port)
        self._servers.append(server)
        self._ensure_stats()
        sock = server.sockets[0].getsockname()
        return str(sock[0]), int(sock[1])

    async def listen_on(self, sock: socket.socket) -> asyncio.Server:
        """Serve on a socket bound earlier (bound before the model loaded)."""
        server = await serve(self._on_accept, sock=sock)
        self._servers.append(server)
        self._ensure_stats()
        return server

    async def stop_listening(self, server: asyncio.Server) -> None:
        """Take no more links on ``server`` (those it took go on)."""
        if server in self._servers:
            self._servers.remove(server)
        server.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                await server.wait_closed()

    def _ensure_stats(self) -> None:
        if self._stats_task is None:
            self._stats_task = asyncio.create_task(self._stats_loop(), name="node-stats")
        if self._sleep_task is None and (self.idle_unload_s is not None
                                         or self.keep_alive_s is not None):
            self._sleep_task = asyncio.create_task(self._sleep_loop(), name="node-idle-unload")

    def set_idle_unload(self, seconds: float | None) -> None:
        """The first model's own idle time from now on (None or inf: never unload; 0: after
        each request), as its owner set it; a request's keep_alive still wins for it."""
        if not isinstance(self.engine, Sleeper):
            return
        self.idle_unload_s = seconds
        self._activity.set()
        if self._servers:
            self._ensure_stats()

    def _keep_alive(self, seconds: float | None) -> None:
        """A request's keep_alive, as Ollama applies it: the model stays loaded that long
        once idle, and a request that names none brings back the node's own idle time
        (``idle_unload_s``), so a ``keep_alive: 0`` does not stick to later requests."""
        if not isinstance(self.engine, Sleeper):
            return
        self.keep_alive_s = seconds
        self._activity.set()
        if self._servers:
            self._ensure_stats()

    async def close(self) -> None:
        self._closing = True
        for server in self._servers:
            server.close()
        await cancel_and_wait([*self._tasks, self._stats_task, self._sleep_task], "the node")
        # the links it took from heads it joined are served in its joiner's tasks: closed
        # here, so that no head keeps a link to a node that is gone
        for heads in list(self._heads.values()):
            for link in list(heads.links):
                link.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await server.wait_closed()

    # -- connections -------------------------------------------------------------

    def _on_accept(self, incoming: Incoming) -> None:
        # the connection runs in a task the agent owns, so close() can cancel it
        self._tasks.spawn(self._handle(incoming), "node-conn")

    async def _handle(self, incoming: Incoming) -> None:
        address = incoming.peer_host
        try:
            taken = await take(incoming, self._pending, address, psk=self.psk,
                               hello=self._hello, expect=m.HeadHello,
                               handshake_timeout_s=self.handshake_timeout_s,
                               first_message_s=self.first_message_s)
        except NotTaken as exc:
            self._refused(incoming.peer, address, exc.cause, handshaken=exc.handshaken,
                          bound=exc.bound)
            return
        if taken is None:
            return
        link, head = taken
        await self.serve_link(link, responder=True, head=head)

    def _refused(self, peer: str, address: str, exc: Exception, *, handshaken: bool,
                 bound: float) -> None:
        """Say once per address and cause why a connection was not taken."""
        if isinstance(exc, LinkError):
            self._once(address, exc.kind.name, logging.WARNING, "refused a head at %s: %s; %s",
                       peer, exc, _fix(exc))
        elif isinstance(exc, WrongPeer):
            self._once(address, "no-hello", logging.WARNING,
                       "head at %s did not say hello; closing", peer)
        elif not handshaken:
            self._once(address, "slow", logging.INFO,
                       "a connection from %s did not finish the handshake in time", peer)
        else:
            self._once(address, "silent", logging.WARNING,
                       "a connection from %s finished the handshake but sent no hello "
                       "in %.0f s, so it has not shown the fleet token (a copied "
                       "handshake, or a peer of another Shoal version); closed it",
                       peer, bound)

    def _once(self, address: str, what: str, level: int, message: str,
              *args: object) -> None:
        """Log ``message`` the first time ``address`` fails the handshake this way: a peer
        that keeps trying (or a flood of them) costs one line, not one per connection."""
        if len(self._told) >= _TOLD_MAX:  # bounded: a scan of many addresses
            self._told.clear()
        if (address, what) not in self._told:
            self._told.add((address, what))
            log.log(level, message, *args)

    async def serve_link(self, link: Link, *, responder: bool,
                         head: m.HeadHello | None = None) -> bool:
        """Run one head connection until it closes. Used for dialed and joined links;
        ``head``: the head's hello when it was read already. False when this node
        refused the head (another tokenizer under the same name), or is closed."""
        if self._closing:  # its model is gone: a joiner asks again later, of its new node
            link.close()
            return False
        try:
            if head is None:
                try:
                    # as the initiator, the node reads the head's hello before saying its
                    # own, so that a head it refuses never takes it for a node
                    head = await exchange_hellos(link, self._hello() if responder else None,
                                                 responder=responder, expect=m.HeadHello,
                                                 timeout_s=self.handshake_timeout_s)
                except WrongPeer:
                    log.warning("head at %s did not say hello; closing", link.peer)
                    return True
            refusal = self._refusal(head)
            if refusal is not None:
                self._once(f"head:{head.model}", refusal, logging.WARNING, "refused the head "
                           "at %s: %s", link.peer, refusal)
                link.send(m.Error(code="wrong_model", message=refusal[:4000]))
                with contextlib.suppress(LinkClosed):
                    await link.drain()
                return False
            if not responder:
                link.send(self._hello())
            if responder and head.channels and self.offers_channels:
                await self._serve_channels(link, head.head_id, head.progress)
            else:
                await self._serve(link, head.head_id, head.progress)
        except (LinkClosed, TimeoutError):
            pass
        finally:
            link.close()
        return True

    def _refusal(self, head: m.HeadHello) -> str | None:
        """Why this node refuses ``head``: the same model name, another tokenizer."""
        if not self.probe or head.model != self.engine.info.model:
            return None
        found = mismatch(head.probe, self.probe)
        if found is None:
            return None
        return (f"{self.probe_source or 'the engine'} tokenizes differently from the head's "
                f"model '{head.model}' ({found.describe()}, engine vs head); run the same "
                "model on both, or give this node another --model-name")

    def _hello(self) -> m.NodeHello:
        info = self.engine.info
        st = self.engine.stats()
        return m.NodeHello(identity=self.identity, model=info.model, runtime=info.runtime,
                           context_window=info.context_window, lanes=info.lanes,
                           kv_total=st.kv_total, rates=_rates(st), instance=self.instance,
                           channels=self.offers_channels, takes_models=True,
                           embeds=isinstance(self.engine, Embedder),
                           kept=self.shelf.records() if self.shelf is not None else [],
                           splits=True)

    async def _serve_channels(self, link: Link, head_id: str, progress: bool) -> None:
        """A head that dialed carries its sessions as channels of this one link: each is
        served as a connection of its own would be."""
        def opened(chan: Channel) -> None:
            self._tasks.spawn(self._serve_channel(chan, head_id, progress), "node-channel")

        await Mux(link, on_channel=opened).run(self.idle_timeout_s)

    async def _serve_channel(self, chan: Channel, head_id: str, progress: bool) -> None:
        try:
            await self._serve(chan, head_id, progress)
        except (LinkClosed, TimeoutError):
            pass
        finally:
            chan.close()

    async def _serve(self, link: Carrier, head_id: str, progress: bool = False) -> None:
        heads = self._heads.setdefault(head_id, _HeadLinks())
        heads.links.add(link)
        self._send_stats_to(link)
        run: _Run | None = None
        embedding: asyncio.Task[None] | None = None
        transfer: asyncio.Task[None] | None = None  # a model file sent to a peer
        try:
            while True:
                if run is not None and run.task.done():
                    run = None
                if embedding is not None and embedding.done():
                    embedding = None
                if transfer is not None and transfer.done():
                    transfer = None
                timeout = None if run is not None or embedding or transfer \
                    else self.idle_timeout_s
                try:
                    async with asyncio.timeout(timeout):
                        rec = await link.recv()
                except TimeoutError:
                    log.info("dropping a connection from %s idle for %.0f s", link.peer,
                             self.idle_timeout_s)
                    return
                if run is not None and run.task.done():
                    run = None
                if isinstance(rec, m.Ping):
                    link.send(m.Pong(nonce=rec.nonce))
                elif isinstance(rec, m.Embed):
                    if run is not None or (embedding is not None and not embedding.done()):
                        link.send(m.Error(code="bad_request",
                                          message="one request per connection at a time"))
                    else:
                        embedding = self._embed(link, rec)
                elif isinstance(rec, m.Generate):
                    if run is not None or (embedding is not None and not embedding.done()):
                        link.send(m.Error(code="bad_request",
                                          message="one generation per connection at a time"))
                    else:
                        run = self._admit(link, rec, progress)
                elif isinstance(rec, m.Renew):
                    if run is not None and run.session == rec.session:
                        run.lease = leases.renew(run.lease, self._clock(), rec.lease_ms / 1000)
                elif isinstance(rec, m.Cancel):
                    if run is not None and run.session == rec.session:
                        run.cancel()
                elif isinstance(rec, m.ServeModel):  # answered in its own task: the
                    # owner may take a few seconds, and this link's records go on
                    self._tasks.spawn(self._answer(link, rec), "node-serve-answer")
                elif isinstance(rec, m.RpcOpen):
                    refused = ("it lends no memory (its owner allows it with --lend)"
                               if self.lender is None or not isinstance(link, Link) or run
                               or embedding else await self.lender.refusal())
                    if refused is not None:
                        link.send(m.Error(code="not_found", message=refused))
                    else:  # the link carries the RPC server's connection from now on
                        assert self.lender is not None and isinstance(link, Link)
                        try:
                            await self.lender.tunnel(link)
                        except (OSError, RuntimeError, TimeoutError) as exc:
                            log.warning("could not lend memory to %s: %s", link.peer, exc)
                            with contextlib.suppress(LinkClosed):
                                link.send(m.Error(code="internal", message=f"its RPC server "
                                                  f"did not start: {str(exc)[:3000]}"))
                        return
                elif isinstance(rec, m.FilesWanted | m.FileWanted):
                    if self.files is None or not isinstance(link, Link):
                        link.send(m.Error(code="not_found", message="this node hands out "
                                          "no model files"))
                    elif transfer is not None:
                        link.send(m.Error(code="bad_request",
                                          message="one file at a time per connection"))
                    else:
                        transfer = self._tasks.spawn(self.files.answer(link, rec),
                                                     "node-model-file")
                elif isinstance(rec, m.HeadHello):
                    continue
                else:
                    log.debug("ignoring %s from %s", type(rec).__name__, link.peer)
        finally:
            if run is not None:
                run.cancel()
                with contextlib.suppress(BaseException):
                    await run.task
            await cancel_and_wait([embedding, transfer], "an embedding or a file")
            heads.links.discard(link)
            if not heads.links:
                self._heads.pop(head_id, None)

    async def _answer(self, link: Carrier, ask: m.ServeModel) -> None:
        answer = await self.asked_to_serve(ask)
        with contextlib.suppress(LinkClosed):  # the head went: it hears nothing
            link.send(answer)

    async def asked_to_serve(self, ask: m.ServeModel) -> m.ServeModelResult:
        """The answer to a head that asks this node to serve ``ask.spec``: the owner's,
        for a hub id it may take; a refusal naming why otherwise."""
        def answer(accepted: bool, line: str) -> m.ServeModelResult:
            return m.ServeModelResult(accepted=accepted, message=line[:m.MAX_ANSWER],
                                      ask=ask.ask)

        if self.serve_model is None:
            return answer(False, NO_FLEET_MODELS)
        if self._closing:
            return answer(False, "the node is shutting down")
        spec = ask.spec.strip()
        try:
            model_ids.parse_model_id(spec)
            if model_ids.looks_like_path(spec):
                raise ValueError(f"{spec!r} names a file; a head names a model by its hub id "
                                 "(org/repo:QUANT)")
        except ValueError as exc:
            return answer(False, str(exc))
        try:
            accepted, line = await self.serve_model(spec, tuple(ask.split_with))
        except Exception as exc:  # the owner's bug: the head hears it, the node goes on
            log.exception("could not take the model %s a head asked for", spec)
            return answer(False, f"the node could not take it: {exc}")
        log.info("a head asked this node to serve %s: %s", spec, line)
        return answer(accepted, line)

    # -- generations -----------------------------------------------------------

    def _admit(self, link: Carrier, gen: m.Generate, progress: bool = False) -> _Run | None:
        """Start ``gen`` on a lane, or tell the head why not. The lane is counted busy
        only once the engine has taken the generation (or, asleep, once the node has
        taken it to wake for), and freed on every path after."""
        refused = self._no_lane() or self._not_kept(gen.model)
        if refused is not None:
            link.send(refused)
            return None
        if self._kept(gen.model):
            return self._accept(link, gen, None, progress)
        down = self.engine.stats().down
        if down:  # an upstream that stopped answering: heads place elsewhere
            link.send(m.Error(code="busy", message=down[:4000]))
            return None
        # asleep, the pool is asked once the model is loaded again
        misfit = _misfit(self.engine, gen, pool=not self.sleep)
        if misfit is not None:  # at once: the head places it on another node
            link.send(misfit)
            return None
        generation: Generation | None = None
        if not self.sleep:  # asleep, it is started once the model is loaded again
            generation = self._start(link, gen)
            if generation is None:
                return None
        self._keep_alive(gen.keep_alive_s)
        return self._accept(link, gen, generation, progress)

    def _accept(self, link: Carrier, gen: m.Generate, generation: Generation | None,
                progress: bool) -> _Run | None:
        """Count ``gen`` on a lane and tell its head; its task starts it where it is not
        started yet (the model loads first)."""
        self._busy += 1
        self._peak = max(self._peak, self._busy)
        self._touch()
        run = _Run(gen, leases.grant(self._clock(), gen.lease_ms / 1000), generation,
                   progress=progress)
        try:
            link.send(m.Accepted(session=gen.session))
        except LinkClosed:
            self._release(run)
            return None
        if self.observer is not None:
            self.observer.admitted(gen)
        self._broadcast_stats()
        run.task = self._tasks.spawn(self._generate(link, run), f"gen-{gen.session}")
        return run

    def _kept(self, model: str) -> bool:
        """``model`` names one of the models this node keeps besides its first."""
        return bool(model) and model != self.engine.info.model and self.shelf is not None \
            and model in self.shelf

    def _not_kept(self, model: str) -> m.Error | None:
        if not model or model == self.engine.info.model or self._kept(model):
            return None
        kept = ", ".join([self.engine.info.model, *(self.shelf.names() if self.shelf else [])])
        return m.Error(code="bad_request", message=f"this node does not keep the model "
                       f"'{model[:m.MAX_NAME]}'; it serves {kept[:3000]}")

    def _no_lane(self) -> m.Error | None:
        """Why this node takes no new request now: it is shutting down, every lane is
        busy, or its user paused serving (heads take that as full and try the next node)."""
        if self._closing:
            return m.Error(code="shutdown", message="the node is shutting down")
        if self._busy >= self.lanes:
            return m.Error(code="busy", message=f"all {self.lanes} lanes are busy")
        if self.paused:
            return m.Error(code="busy", message="serving is paused on this node")
        return None

    def _embed(self, link: Carrier, rec: m.Embed) -> asyncio.Task[None] | None:
        """Embed ``rec`` on a lane of its own, or tell the head why not."""
        refused = self._no_lane() or self._not_kept(rec.model)
        if refused is None and not self._kept(rec.model):
            refused = embeds.refusal(self.engine, self.engine.info.model, rec)
        if refused is not None:
            with contextlib.suppress(LinkClosed):
                link.send(refused)
            return None
        self._busy += 1
        self._peak = max(self._peak, self._busy)
        if not self._kept(rec.model):
            self._keep_alive(rec.keep_alive_s)
        self._touch()
        self._broadcast_stats()
        task = self._tasks.spawn(self._embedding(link, rec), f"embed-{rec.session}")
        # freed when the task ends, also if it is cancelled before it ever ran
        task.add_done_callback(self._embedded)
        return task

    def _embedded(self, _task: asyncio.Task[None]) -> None:
        self._busy -= 1
        self._touch()
        self._broadcast_stats()

    async def _embedding(self, link: Carrier, rec: m.Embed) -> None:
        if self._kept(rec.model):
            await self._kept_embedding(link, rec)
            return
        if self.sleep:
            try:
                await self.wake()
            except Exception as exc:
                with contextlib.suppress(LinkClosed):
                    link.send(m.Error(code="internal", message="the node could not load "
                                      f"its model again: {str(exc)[:3000]}"))
                return
        engine = self.engine
        assert isinstance(engine, Embedder)
        await embeds.answer(engine, link, rec)

    async def _kept_embedding(self, link: Carrier, rec: m.Embed) -> None:
        shelf = self.shelf
        assert shelf is not None
        try:
            engine = await shelf.acquire(rec.model)
        except Refused as exc:
            with contextlib.suppress(LinkClosed):
                link.send(m.Error(code="busy", message=str(exc)[:4000]))
            return
        try:
            refused = embeds.refusal(engine, rec.model, rec)
            if refused is not None:
                with contextlib.suppress(LinkClosed):
                    link.send(refused)
                return
            assert isinstance(engine, Embedder)
            await embeds.answer(engine, link, rec)
        finally:
            shelf.release(rec.model, rec.keep_alive_s)

    def _start(self, link: Carrier, gen: m.Generate,
               engine: Engine | None = None) -> Generation | None:
        """The engine (``engine``, else the first model's) takes ``gen``; None when it
        refuses (the head was told why)."""
        try:
            return (engine or self.engine).generate(_request(gen))
        except PoolFull as exc:  # filled since it was asked: the head tries another node
            link.send(m.Error(code="busy", message=str(exc)[:4000]))
        except ValueError as exc:  # a prompt the runtime refuses (empty, ids outside vocab)
            log.warning("refused session %s: %s", gen.session, exc)
            link.send(m.Error(code="bad_request", message=str(exc)[:4000]))
        except Exception as exc:  # a runtime that stopped (its decode thread died)
            log.error("cannot start session %s: %s", gen.session, exc)
            link.send(m.Error(code="internal", message=f"the node's runtime failed: "
                              f"{str(exc)[:3000]}"))
        return None

    def _release(self, run: _Run) -> None:
        """Free the lane of ``run``, exactly once."""
        run.cancel()
        if not run.released:
            run.released = True
            if run.shelved and self.shelf is not None:
                self.shelf.release(run.shelved, run.gen.keep_alive_s)
            self._busy -= 1
            self._touch()
            self._broadcast_stats()

    def _touch(self) -> None:
        self._last_active = self._clock()
        self._activity.set()

    async def _reporting(self, link: Carrier, run: _Run, *, loading: bool) -> None:
        """Progress every PROGRESS_S until cancelled (the first token came, or the model
        is loaded): a head that reads it does not take the wait for a hung node."""
        prompt = len(run.gen.prompt)
        while True:
            await asyncio.sleep(PROGRESS_S)
            # an engine that does not say (an upstream one) reports 0 read so far
            done = 0 if loading else getattr(run.generation, "prefilled", 0)
            with contextlib.suppress(LinkClosed):
                link.send(m.Progress(prefilled=min(int(done), prompt), prompt=prompt,
                                     loading=loading))

    async def _woken(self, link: Carrier, run: _Run) -> Generation | None:
        """Load the model for ``run`` (the node was asleep, or it asks for a model the node
        keeps), then start it."""
        reporter = self._tasks.spawn(self._reporting(link, run, loading=True), "node-waking") \
            if run.progress else None
        try:
            if self._kept(run.gen.model):
                return await self._kept_start(link, run)
            await self.wake()
        except Exception as exc:
            log.error("cannot load the model again for session %s: %s", run.session, exc)
            link.send(m.Error(code="internal", message=f"the node could not load its model "
                              f"again: {str(exc)[:3000]}"))
            return None
        finally:
            if reporter is not None:
                reporter.cancel()
        if run.cancelled:
            return None
        return self._start(link, run.gen)

    async def _kept_start(self, link: Carrier, run: _Run) -> Generation | None:
        """Start ``run`` on a model the node keeps, loading it first if it must; the model
        is released when the run ends (``_release``)."""
        shelf = self.shelf
        assert shelf is not None
        gen = run.gen
        try:
            engine = await shelf.acquire(gen.model)
        except Refused as exc:
            log.warning("could not load %s for session %s: %s", gen.model, run.session, exc)
            link.send(m.Error(code="busy", message=str(exc)[:4000]))
            return None
        run.shelved = gen.model
        if run.cancelled:
            return None
        misfit = _misfit(engine, gen)
        if misfit is not None:
            link.send(misfit)
            return None
        return self._start(link, gen, engine)

    async def _generate(self, link: Carrier, run: _Run) -> None:
        index = 0
        fenced = False
        reporter: asyncio.Task[None] | None = None
        try:
            watchdog = self._tasks.spawn(self._lease_watch(link, run), f"lease-{run.session}")
            try:
                if run.generation is None:
                    run.generation = await self._woken(link, run)
                    if run.generation is None:
                        return
                generation = run.generation
                observer = self.observer
                if run.progress:
                    reporter = self._tasks.spawn(self._reporting(link, run, loading=False),
                                           f"progress-{run.session}")
                async for ids in generation:
                    if reporter is not None:
                        reporter.cancel()
                        reporter = None
                    if leases.expired(run.lease, self._clock()):
                        fenced = True
                        break
                    record = m.Tokens(ids=ids, index=index)
                    if observer is not None:
                        observer.tokens(run.gen, record)
                    link.send(record)
                    index += len(ids)
                    await link.drain()
                if run.fenced or fenced:
                    fenced = True
                    return
                r = generation.result
                link.send(m.Done(finish_reason=r.finish_reason, prompt_tokens=r.prompt_tokens,
                                 completion_tokens=r.completion_tokens,
                                 cached_tokens=r.cached_tokens, ttft_ms=r.ttft_ms,
                                 prefill_tps=r.prefill_tps, decode_tps=r.decode_tps))
            finally:
                watchdog.cancel()
                if reporter is not None:
                    reporter.cancel()
        except LinkClosed:
            pass
        except Exception as exc:  # the runtime failed mid-generation: tell the head
            log.error("session %s failed on this node: %s", run.session, exc)
            with contextlib.suppress(LinkClosed):
                link.send(m.Error(code="internal", message=f"the node's runtime failed: "
                                  f"{str(exc)[:3000]}"))
        finally:
            self._release(run)
            if fenced or run.fenced:
                log.warning("session %s missed its lease renewal; fenced it and freed the lane",
                            run.session)
                link.abort()

    async def _lease_watch(self, link: Carrier, run: _Run) -> None:
        while True:
            delay = run.lease.deadline - self._clock()
            await asyncio.sleep(max(delay, 0.0) + 0.01)
            if leases.expired(run.lease, self._clock()):
                run.fenced = True
                run.cancel()
                return

    # -- stats ---------------------------------------------------------------------

    def pause(self, paused: bool) -> None:
        """Take no new session (those running finish); paused, the node says so in its
        stats, so that heads place elsewhere without asking (its lanes counted neither
        free nor busy)."""
        self.paused = paused
        self._broadcast_stats()

    @property
    def busy(self) -> int:
        return self._busy

    def stats_record(self) -> m.Stats:
        st = self.engine.stats()
        facts = self.facts()
        busy = self.lanes if st.down else self._busy
        return m.Stats(lanes=self.lanes, lanes_busy=busy, kv_used=st.kv_used,
                       kv_total=st.kv_total, rates=_rates(st), sessions=self._busy,
                       peak_busy=self._peak, kv_parked=st.kv_parked,
                       max_prompt=st.max_prompt, mem_used=st.mem_used,
                       mem_budget=st.mem_budget, sleep=self.sleep,
                       prompt_from_lanes=st.prompt_from_lanes,
                       prompt_from_host=st.prompt_from_host,
                       prompt_prefilled=st.prompt_prefilled,
                       # cut to what the link carries: a longer name would fail the record
                       device=st.device[:m.MAX_DEVICE], gpu_layers=st.gpu_layers,
                       model_layers=st.model_layers, ram_total=facts.ram_total,
                       device_kind=st.device_kind[:m.MAX_KIND], device_total=st.device_total,
                       device_free=st.device_free, disk_free=facts.disk_free,
                       pull_model=facts.pull_model[:m.MAX_NAME], pull_done=facts.pull_done,
                       pull_total=facts.pull_total, paused=self.paused,
                       serve_failed=facts.serve_failed[:m.MAX_ANSWER],
                       mem_bandwidth=facts.mem_bandwidth,
                       kept=self.shelf.records() if self.shelf is not None else [],
                       lend_bytes=self.lender.lend_bytes if self.lender is not None else 0,
                       listens=self.listens)

    def facts(self) -> MachineFacts:
        """What the owner says of the machine now (nothing, without an owner's word)."""
        return self.machine() if self.machine is not None else MachineFacts()

    # -- idle unload -----------------------------------------------------------------

    def idle_s(self) -> float | None:
        """How long the model stays loaded once idle: the last request's keep_alive, else
        ``idle_unload_s`` (None or inf: for ever)."""
        idle = self.keep_alive_s if self.keep_alive_s is not None else self.idle_unload_s
        return None if idle is None or math.isinf(idle) else idle

    async def _sleep_loop(self) -> None:
        """Unload the engine once no session has run for ``idle_s()``."""
        while True:
            self._activity.clear()
            idle = self.idle_s()
            delay = None if idle is None else self._last_active + idle - self._clock()
            if delay is not None and not self.sleep and not self._busy and delay <= 0:
                if await self._suspend():
                    log.info("no session for %.0f s: unloaded the model (it loads again on "
                             "the next request)", idle)
                continue
            with contextlib.suppress(TimeoutError):
                # asleep, busy or kept for ever: until a session starts or ends (or a
                # keep_alive comes); else until it is due
                async with asyncio.timeout(None if self.sleep or self._busy else delay):
                    await self._activity.wait()

    @property
    def first_bytes(self) -> int:
        """What the first model holds of the budget (its file until an unload measured)."""
        return model_set.need_of(self._first_size, self._first_measured)

    @property
    def can_unload(self) -> bool:
        return isinstance(self.engine, Sleeper)

    async def unload_first(self) -> bool:
        """Unload the first model now (a person's click); False while it answers."""
        if self._first_busy():
            return False
        await self._suspend()
        return True

    def _first_busy(self) -> int:
        """Requests on the first model now (the kept models' are counted by the shelf)."""
        return self._busy - (self.shelf.busy() if self.shelf is not None else 0)

    def _first_held(self) -> model_set.Held | None:
        """The first model as the shelf's choices see it (None: unloaded); one that cannot
        unload (an engine that cannot sleep) is never chosen to make room."""
        if self.sleep == "asleep":
            return None
        busy = self._first_busy() if isinstance(self.engine, Sleeper) else 1
        idle = self.idle_s()
        return model_set.Held(self.engine.info.model, self.first_bytes, self._last_active,
                              busy, model_set.FOREVER if idle is None else idle)

    async def _suspend(self) -> bool:
        """Unload the first model; False when it did not (it sleeps, or answers)."""
        engine = self.engine
        assert isinstance(engine, Sleeper)
        async with self._engine_lock:
            if self.sleep or self._first_busy():
                return False
            self.sleep = "asleep"
            before = await asyncio.to_thread(process_rss_bytes)
            await engine.suspend()
            freed = before - await asyncio.to_thread(process_rss_bytes)
            if freed > 0:
                self._first_measured = max(freed, self._first_size)
        self._broadcast_stats()
        return True

    async def wake(self) -> None:
        """Load the engine again if it is asleep (once, whoever asks meanwhile)."""
        engine = self.engine
        if not self.sleep or not isinstance(engine, Sleeper):
            return
        async with self._engine_lock:
            if not self.sleep:
                return
            self.sleep = "waking"
            self._broadcast_stats()
            try:
                if self.shelf is not None:  # the kept models make room first
                    await self.shelf.make_room(self.engine.info.model, self.first_bytes)
                await engine.resume()
            except BaseException:
                self.sleep = "asleep"
                self._broadcast_stats()
                raise
            self.sleep = ""
        log.info("loaded the model again for a request")
        self._touch()
        self._broadcast_stats()

    def _send_stats_to(self, link: Carrier) -> None:
        with contextlib.suppress(LinkClosed):
            link.send(self.stats_record())

    def _broadcast_stats(self) -> None:
        rec = self.stats_record()
        for heads in self._heads.values():
            for link in heads.links:
                if not link.closed:
                    with contextlib.suppress(LinkClosed):
                        link.send(rec)
                    break

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            self._broadcast_stats()


class _Run:
    def __init__(self, gen: m.Generate, lease: leases.Lease, generation: Generation | None,
                 *, progress: bool = False) -> None:
        self.gen = gen
        self.session = gen.session
        self.lease = lease
        self.generation = generation  # None until an asleep node has loaded its model
        self.progress = progress  # its head reads Progress records
        self.fenced = False
        self.released = False
        self.shelved = ""  # the kept model it holds busy on the node's shelf ("": none)
        self.cancelled = False
        self.task: asyncio.Task[None]

    def cancel(self) -> None:
        self.cancelled = True
        if self.generation is not None:
            self.generation.cancel()


def _request(gen: m.Generate) -> GenerationRequest:
    s = gen.sampling
    return GenerationRequest(
        prompt=gen.prompt, max_tokens=gen.max_tokens, stop_ids=frozenset(gen.stop_ids),
        session=gen.session,
        sampling=Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          min_p=s.min_p, seed=s.seed, presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty,
                          repeat_penalty=s.repeat_penalty))


def _misfit(engine: Engine, gen: m.Generate, *, pool: bool = True) -> m.Error | None:
    """Why ``engine`` cannot take ``gen`` now: a prompt its window cannot hold, or (with
    ``pool``) a shared KV pool with no room for it; None when it can."""
    window = engine.info.context_window
    if len(gen.prompt) >= window:
        return m.Error(code="context_length_exceeded",
                       message=f"prompt of {len(gen.prompt)} tokens does not fit the window "
                               f"of {window}")
    if pool and isinstance(engine, Admitter):
        full = engine.admission(len(gen.prompt), gen.max_tokens)
        if full is not None:
            return m.Error(code="busy", message=full[:4000])
    return None


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # an engine with no file of its own (the mock, an upstream server)
        return 0


def _rates(st: EngineStats) -> m.Rates:
    return m.Rates(prefill_tps=st.prefill_tps, decode_tps=st.decode_tps, ttft_ms=st.ttft_ms,
                   prefill_s_per_token=st.prefill_s_per_token,
                   prefill_s_per_token_ctx=st.prefill_s_per_token_ctx)


def _fix(exc: LinkError) -> str:
    from engine.link.connection import LinkErrorKind as K

    return {
        K.WRONG_TOKEN: "give the node's --auth-file the same token as the head's --fleet-auth",
        K.NO_TOKEN_THERE: "give the head the fleet token (--fleet-auth)",
        K.NO_TOKEN_HERE: "give this node the fleet token (--auth-file)",
        K.OLD_PEER: "update Shoal on the head's machine",
        K.REPLAYED: "it was not answered",
    }.get(exc.kind, "check that both ends run the same Shoal version")

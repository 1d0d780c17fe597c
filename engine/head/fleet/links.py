"""The head's links to its nodes: connection pools, hellos, stats, keepalives, redials.

A node this head dials (and that can) carries all of this head's sessions over one
link, as channels (:mod:`engine.link.mux`): a connection here is one channel of it,
or, to a node that joined or an older node, a connection of its own. Records are
handed over as the transport reads them (no reader task): stats and pongs go to the
node's pool, everything else to the sink of the session attempt that holds the
connection. A session never reads the socket itself, and a token reaches the HTTP side
without another task to wake in between.

A head asks a node to serve another model (:meth:`Fleet.serve_model`) over any of its
connections, idle or carrying a session: the node answers on the same one, and the
answer goes to the question by its ``ask`` (never to a session's sink).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypedDict

from engine import events as ev
from engine.head.fleet.cooldown import Cooldown
from engine.head.fleet.node_state import NodeEvent, NodeState, ShownState, transition
from engine.head.fleet.placement import NodeView
from engine.link import messages as m
from engine.link.connection import LinkError, LinkErrorKind
from engine.link.hello import WrongPeer, exchange_hellos
from engine.link.mux import Carrier, Mux
from engine.link.transport import Link, LinkClosed, dial
from engine.settings import FLEET_PORT, NODE_PORT
from engine.tasks import TaskSet

log = logging.getLogger("shoal.head")

RETRY_S = 10.0
DROP_DISCOVERED_AFTER = 3  # failed dials in a row before a node found on the network is let go
KEEPALIVE_S = 15.0
FULL_HOLD_S = 1.0  # after a "busy" refusal, skip the node until fresh stats or this long
# a kept model's window before the node first loaded it: any prompt goes, and the node
# refuses one its window cannot hold once it knows (context_length_exceeded)
KEPT_WINDOW_UNKNOWN = (1 << 31) - 1
ANSWER_S = 10.0  # how long a node may take to answer a ServeModel (it answers at once)
# a model never loaded on a node: its file read at about the rate of the loads measured
# here (SmolLM2 135M 0.65 GB/s, Gemma 3 270M 0.35 GB/s, both from the page cache)
UNMEASURED_LOAD_BYTES_PER_S = 0.5e9


class ConnClosed:
    """Handed to a session's sink when its connection is gone."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


CLOSED_NOTE = "connection closed"


class NotAsked(Exception):
    """A node could not be asked to serve a model, or did not answer: ``str`` is the one
    line (the cause and the fix), ``code`` says which."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
Inbound = m.Record | ConnClosed
Sink = Callable[[Inbound], None]


class NodeConn:
    def __init__(self, pool: NodePool, link: Carrier) -> None:
        self.pool = pool
        self.link = link
        self.sink: Sink | None = None  # set while a session attempt holds the connection
        self.last_rx = pool.fleet.clock()
        self.closed = False
        self.close_reason = CLOSED_NOTE

    def start(self) -> None:
        """Take the connection's records as they are read (no reader task: see
        :meth:`engine.link.transport.Link.deliver_to`)."""
        self.link.deliver_to(self._on_record, self._on_closed)

    def _on_record(self, rec: m.Record) -> None:
        self.last_rx = self.pool.fleet.clock()
        if isinstance(rec, m.Stats):
            self.pool.on_stats(rec)
        elif isinstance(rec, m.Pong):
            return
        elif isinstance(rec, m.Error) and rec.code == "wrong_model":
            self.pool.on_refused(rec.message)
        elif isinstance(rec, m.ServeModelResult):
            self.pool.on_serve_answer(rec)
        elif self.sink is not None:
            self.sink(rec)

    def _on_closed(self, reason: str) -> None:
        self.closed = True
        self.close_reason = reason
        self.link.close()
        if self.sink is not None:
            self.sink(ConnClosed(reason))
        self.pool.on_conn_closed(self)

    def abort(self) -> None:
        self.link.abort()


class PoolReport(TypedDict):
    """What a node said last of the KV pool its lanes share, its memory, its sleep and the
    device its model runs on (engine.link.messages.Stats; zeros and "" before it said
    anything; device "" is the CPU)."""

    kv_parked: int
    max_prompt: int
    mem_used: int
    mem_budget: int
    sleep: Literal["", "asleep", "waking"]
    prompt_from_lanes: int
    prompt_from_host: int
    prompt_prefilled: int
    device: str
    gpu_layers: int
    model_layers: int
    ram_total: int
    device_kind: str
    device_total: int
    device_free: int
    disk_free: int
    pull_model: str
    pull_done: int
    pull_total: int
    serve_failed: str
    mem_bandwidth: int
    gpu_bandwidth: int
    lend_bytes: int
    reach: str  # where other machines take links to a node that joined (HOST:PORT; "")


@dataclass
class NodeInfo:
    identity: str = ""
    model: str = ""
    runtime: str = ""
    context_window: int = 0
    lanes: int = 0
    takes_models: bool = False  # it reads ServeModel (its hello said so)
    splits: bool = False  # and ServeModel.split_with
    kept: tuple[m.KeptModel, ...] = ()  # the models it keeps besides ``model`` (its hello)


def kept_load_seconds(kept: m.KeptModel) -> float:
    """What loading ``kept`` adds before its first token on the node that keeps it: 0
    where it is loaded; its last load there; else its size at a typical load's rate."""
    if kept.state == "loaded":
        return 0.0
    if kept.load_ms:
        return kept.load_ms / 1000
    return kept.size / UNMEASURED_LOAD_BYTES_PER_S


class NodePool:
    """Every connection this head keeps to one node, and what it knows of the node."""

    def __init__(self, fleet: Fleet, key: str, host: str, port: int, *, dialed: bool,
                 discovered: bool = False) -> None:
        self.fleet = fleet
        self.key = key
        self.host = host
        self.port = port
        self.dialed = dialed
        self.discovered = discovered  # found on the network, not given by the user
        self.failures = 0  # failed dials in a row
        self.info = NodeInfo()
        self._state: NodeState = "connecting"
        self.last_error = ""
        self.idle: list[NodeConn] = []
        self.busy: set[NodeConn] = set()
        self.own_sessions = 0
        self.stats: m.Stats | None = None
        self.stats_at = 0.0
        self.full_until = 0.0
        self.cooldown = Cooldown()  # sessions failed there before a token (cooldown.py)
        self.sessions_total = 0
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._announced = False
        self.instance = ""
        self.mux: Mux | None = None  # the link whose channels the connections are, if any
        self.refused_at = -RETRY_S  # when the node last refused this head (wrong_model)
        # ServeModel questions waiting for their answer: by ask, with the connection asked
        self._asks: dict[int, tuple[NodeConn, asyncio.Future[m.ServeModelResult]]] = {}

    @property
    def state(self) -> NodeState:
        """See :mod:`engine.head.fleet.node_state`; changed only through :meth:`_apply`."""
        return self._state

    def _apply(self, event: NodeEvent) -> NodeState:
        """Move the state machine; returns the state before."""
        before = self._state
        self._state = transition(before, event)
        if self._state == "ready" and before != "ready":
            info = self.info
            self.fleet.emit(ev.NodeLinked(key=self.key, identity=info.identity,
                                          address=self.address, model=info.model,
                                          lanes=info.lanes, context_window=info.context_window))
        return before

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}" if self.dialed else self.key

    @property
    def conns(self) -> int:
        return len(self.idle) + len(self.busy)

    def target_conns(self) -> int:
        lanes = self.info.lanes or 1
        want = self.fleet.conns_per_node or lanes
        return max(1, want)

    # -- events from connections -------------------------------------------------

    def on_stats(self, st: m.Stats) -> None:
        old = self.stats
        before = self.reported_busy
        self.stats = st
        self.stats_at = self.fleet.clock()
        if st.kept and (old is None or old.kept != st.kept):
            self.fleet.kept_seen(st.kept)
        if st.lanes_busy < st.lanes:
            self.full_until = 0.0
        # a lane freed, or the pool that the lanes share has room for a longer prompt
        if st.lanes_busy < before or (old is not None and 0 < old.max_prompt < st.max_prompt):
            self.fleet.capacity_changed()

    def on_refused(self, why: str) -> None:
        """The node refused this head (it serves another model under this name): say so
        once, and dial it again only every RETRY_S."""
        if why != self.last_error:
            log.warning("fleet node %s refused this head: %s", self.address, why)
        self.last_error = why
        self.refused_at = self.fleet.clock()

    @property
    def reported_busy(self) -> int:
        return self.stats.lanes_busy if self.stats is not None else 0

    def on_serve_answer(self, answer: m.ServeModelResult) -> None:
        asked = self._asks.pop(answer.ask, None)
        if asked is not None and not asked[1].done():
            asked[1].set_result(answer)

    async def serve_model(self, spec: str, *, split_with: tuple[str, ...] = (),
                          timeout_s: float = ANSWER_S) -> m.ServeModelResult:
        """Ask the node to serve ``spec`` (a hub id; split with the machines whose node
        listeners are ``split_with``, where any) and wait for its answer; NotAsked (one
        line) when it cannot be asked or does not answer in ``timeout_s``."""
        name = self.info.identity or self.address
        conn = next((c for c in [*self.idle, *self.busy] if not c.closed), None)
        if self.state != "ready" or conn is None:
            why = f": {self.last_error}" if self.last_error else ""
            raise NotAsked(f"the node {name} is not linked with this head now{why}; try again "
                           "once it is ready", "node_not_linked")
        if not self.info.takes_models:
            raise NotAsked(f"the node {name} runs an older Shoal that cannot take a model "
                           "from the fleet; update Shoal there, or choose its model on that "
                           "machine", "node_too_old")
        if split_with and not self.info.splits:
            raise NotAsked(f"the node {name} runs an older Shoal that cannot serve a model "
                           "split across machines; update Shoal there, or serve it split "
                           "from another machine", "node_too_old")
        ask = self.fleet.next_ask()
        answered: asyncio.Future[m.ServeModelResult] = \
            asyncio.get_running_loop().create_future()
        self._asks[ask] = (conn, answered)
        try:
            conn.link.send(m.ServeModel(spec=spec, ask=ask, split_with=list(split_with)))
            async with asyncio.timeout(timeout_s):
                return await answered
        except LinkClosed:
            raise NotAsked(f"the link to the node {name} closed before it was asked; try "
                           "again", "node_not_linked") from None
        except TimeoutError:
            raise NotAsked(f"the node {name} did not answer in {timeout_s:.0f} s; check "
                           "that it runs", "node_silent") from None
        finally:
            self._asks.pop(ask, None)

    def on_conn_closed(self, conn: NodeConn) -> None:
        for ask, (asked, answered) in list(self._asks.items()):
            if asked is conn and not answered.done():  # no answer comes on it now
                del self._asks[ask]
                answered.set_exception(NotAsked(
                    f"the link to the node {self.info.identity or self.address} closed "
                    f"before it answered ({conn.close_reason}); see whether it serves the "
                    "model, or ask again", "node_not_linked"))
        if conn in self.idle:
            self.idle.remove(conn)
        self.busy.discard(conn)
        self.wake.set()
        if self.conns:
            return
        before = self._apply("closed_last_dialed" if self.dialed else "closed_last_joined")
        if self.state == "left" and before != "left":
            # a joined node is waited for, never dialed: it comes back by itself
            self._announced = False
            log.info("joined node '%s' left; waiting for it to join again", self.info.identity)
            self.fleet.emit(ev.NodeLeft(key=self.key, identity=self.info.identity))

    def add_conn(self, link: Carrier) -> NodeConn:
        conn = NodeConn(self, link)
        self.idle.append(conn)
        conn.start()
        return conn

    # -- sessions ----------------------------------------------------------------

    def acquire(self) -> NodeConn | None:
        while self.idle:
            conn = self.idle.pop()
            if conn.closed:
                continue
            self.busy.add(conn)
            self.own_sessions += 1
            self.sessions_total += 1
            return conn
        return None

    def release(self, conn: NodeConn, *, reusable: bool) -> None:
        self.own_sessions -= 1
        self.busy.discard(conn)
        conn.sink = None
        if reusable and not conn.closed:
            self.idle.append(conn)
        else:
            conn.abort()
            self.wake.set()
        self.fleet.capacity_changed()

    def mark_full(self, now: float) -> None:
        self.full_until = now + FULL_HOLD_S

    def drop_links(self) -> None:
        """Drop every connection to the node, and the link they are channels of."""
        for conn in [*self.idle, *self.busy]:
            conn.abort()
        if self.mux is not None:
            self.mux.abort()
            self.mux = None

    def close_links(self) -> None:
        for conn in [*self.idle, *self.busy]:
            conn.link.close()
        if self.mux is not None:
            self.mux.close()

    def mark_unresponsive(self, why: str) -> None:
        """A hung node: drop every connection; the maintainer redials."""
        if self.state == "unreachable":
            # the sessions on one link hear their last tokens in the same record, so each
            # finds the node silent at the same moment: the node is dropped and told once
            self.drop_links()
            return
        self.last_error = why
        self.drop_links()
        self.idle.clear()
        self._apply("hung")
        self.fleet.emit(ev.NodeUnreachable(key=self.key, address=self.address, reason=why))
        self._announced = False
        self.wake.set()

    @property
    def kept(self) -> tuple[m.KeptModel, ...]:
        """The models it keeps besides its first, as its last word says (stats, else its
        hello)."""
        return tuple(self.stats.kept) if self.stats is not None else self.info.kept

    def keeps(self, model: str) -> m.KeptModel | None:
        return next((k for k in self.kept if k.name == model), None) \
            if model and model != self.info.model else None

    def view(self, kept: m.KeptModel | None = None) -> NodeView:
        """The node as placement sees it: its first model's view, or for ``kept`` (a model
        it keeps, from ``keeps``) one with that model's window and state, its lanes the
        same; an unloaded one counts as asleep (it loads for the request)."""
        base = self._view()
        if kept is None:
            return base
        return replace(base, model=kept.name,
                       context_window=kept.context_window or KEPT_WINDOW_UNKNOWN,
                       kv_used=0, kv_total=0, max_prompt=0, kv_parked=0, prefill_tps=0.0,
                       decode_tps=0.0, prefill_s_per_token=0.0, prefill_s_per_token_ctx=0.0,
                       sleep="" if kept.state == "loaded" else
                       "waking" if kept.state == "loading" else "asleep",
                       load_s=kept_load_seconds(kept))

    def _view(self) -> NodeView:
        st = self.stats
        return NodeView(
            key=self.key, identity=self.info.identity, model=self.info.model,
            context_window=self.info.context_window, lanes=self.info.lanes,
            idle_conns=len(self.idle) if self.state == "ready" else 0,
            own_sessions=self.own_sessions,
            reported_busy=st.lanes_busy if st else 0,
            kv_used=st.kv_used if st else 0, kv_total=st.kv_total if st else 0,
            prefill_tps=st.rates.prefill_tps if st else 0.0,
            decode_tps=st.rates.decode_tps if st else 0.0,
            full_until=self.full_until, ready=self.state == "ready",
            prefill_s_per_token=st.rates.prefill_s_per_token if st else 0.0,
            prefill_s_per_token_ctx=st.rates.prefill_s_per_token_ctx if st else 0.0,
            max_prompt=st.max_prompt if st else 0, kv_parked=st.kv_parked if st else 0,
            sleep=st.sleep if st else "", paused=bool(st and st.paused),
            resting_until=self.cooldown.until, failing=self.cooldown.cause)

    def pool_report(self) -> PoolReport:
        st = self.stats or m.Stats(lanes=1, lanes_busy=0, kv_used=0, kv_total=0)
        return PoolReport(kv_parked=st.kv_parked, max_prompt=st.max_prompt,
                          mem_used=st.mem_used, mem_budget=st.mem_budget, sleep=st.sleep,
                          prompt_from_lanes=st.prompt_from_lanes,
                          prompt_from_host=st.prompt_from_host,
                          prompt_prefilled=st.prompt_prefilled, device=st.device,
                          gpu_layers=st.gpu_layers, model_layers=st.model_layers,
                          ram_total=st.ram_total, device_kind=st.device_kind,
                          device_total=st.device_total, device_free=st.device_free,
                          disk_free=st.disk_free, pull_model=st.pull_model,
                          pull_done=st.pull_done, pull_total=st.pull_total,
                          serve_failed=st.serve_failed, mem_bandwidth=st.mem_bandwidth,
                          gpu_bandwidth=st.gpu_bandwidth, lend_bytes=st.lend_bytes,
                          reach=self.reach(st.listens))

    def reach(self, listens: int) -> str:
        """Where the fleet's other machines take links to this node: a node that joined
        and listens, at the address its connection came from and the port it says."""
        if self.dialed or not listens or not self.host:
            return ""
        host = self.host.strip("[]")
        return f"[{host}]:{listens}" if ":" in host else f"{host}:{listens}"

    def shown_state(self) -> ShownState:
        """The link's state; for a linked node, "paused" when its user paused serving and
        "failing" while it rests after sessions failed there (cooldown.py)."""
        if self.state != "ready":
            return self.state
        if self.stats is not None and self.stats.paused:
            return "paused"
        return "failing" if self.cooldown.resting(self.fleet.clock()) else "ready"

    def shown_error(self) -> str | None:
        """Why it is failing, while it rests; else the last link error, if any."""
        if self.shown_state() == "failing":
            return self.cooldown.cause
        return self.last_error or None

    def describe(self) -> dict[str, object]:
        st = self.stats
        busy = max(self.own_sessions, st.lanes_busy if st else 0)
        return {
            "identity": self.info.identity or None, "address": self.address,
            "model": self.info.model or None, "runtime": self.info.runtime or None,
            "state": self.shown_state(), "context_window": self.info.context_window,
            "lanes": self.info.lanes, "lanes_busy": busy,
            "kv_used": st.kv_used if st else 0, "kv_total": st.kv_total if st else 0,
            "sessions": busy, "own_sessions": self.own_sessions,
            "sessions_total": self.sessions_total, "peak_busy": st.peak_busy if st else 0,
            "prefill_tps": round(st.rates.prefill_tps, 1) if st else 0.0,
            "decode_tps": round(st.rates.decode_tps, 1) if st else 0.0,
            "ttft_ms": round(st.rates.ttft_ms, 1) if st else 0.0,
            "connections": self.conns, "error": self.shown_error(),
            **self.pool_report(),
            "device": (st.device or None) if st else None,  # None: the CPU
        }

    # -- keeping connections up (dialed nodes) ---------------------------------------

    async def maintain(self) -> None:
        """Keep target_conns() connections open; redial every RETRY_S when unreachable."""
        while True:
            self.wake.clear()
            wait = self.refused_at + RETRY_S - self.fleet.clock()
            if wait > 0:  # refused by the node: no dial storm
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self.fleet.stopping.wait()
                if self.fleet.stopping.is_set():
                    return
            if self.conns < self.target_conns() or self.state != "ready":
                ok = await self._fill()
                if not ok and self.discovered and self.conns == 0 and \
                        self.failures >= DROP_DISCOVERED_AFTER:
                    # an announcement that leads nowhere: stop dialing it; discovery
                    # offers it again if it really is a node of this fleet
                    log.info("forgetting the node at %s found on the network: %d dials "
                             "failed (%s)", self.address, self.failures, self.last_error)
                    self.fleet.forget(self.key)
                    return
                if not ok:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(RETRY_S):
                            await self.fleet.stopping.wait()
                    continue
            await self._keepalive_until_woken()

    async def _fill(self) -> bool:
        opened = 0
        fresh: Mux | None = None  # a link dialed here whose channels the node must take
        while self.conns < self.target_conns():
            if self.mux is not None and self.mux.ended is None:
                self.add_conn(self.mux.open())  # one more channel: no dial, no handshake
                opened += 1
                continue
            self.mux = None
            try:
                link = await dial(self.host, self.port, psk=self.fleet.psk,
                                  timeout_s=self.fleet.handshake_timeout_s,
                                  found=self.discovered)
                hello = await exchange_hellos(
                    link, m.HeadHello(head_id=self.fleet.head_id, model=self.fleet.model,
                                      probe=self.fleet.probe, channels=True,
                                      progress=True),
                    responder=False, expect=m.NodeHello,
                    timeout_s=self.fleet.handshake_timeout_s)
            except (OSError, TimeoutError, LinkError, LinkClosed) as exc:
                self._unreachable(exc)
                return opened > 0 or self.conns > 0
            if not self._accept_hello(hello):
                link.close()
                return False
            self.failures = 0
            if hello.channels:  # the node carries every session over this link
                self.mux = fresh = Mux(link)
                fresh.start()
                continue  # its channels are opened above
            self.add_conn(link)
            opened += 1
        if fresh is not None and not await self._served(fresh):
            return False
        if self._apply("dial_ok") != "ready":
            self.fleet.capacity_changed()
        return True

    async def _served(self, mux: Mux) -> bool:
        """Whether the node answers on a link just dialed (it refuses a head, if it does,
        before it serves a channel); if not, the link is dropped and the node not ready."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.fleet.handshake_timeout_s):
                await asyncio.shield(mux.answered)
        if mux.ended is None and mux.answered.done():
            return True
        silent = not mux.answered.done()
        mux.abort()
        self.mux = None
        if silent:
            self._unreachable(TimeoutError())
        else:  # refused (said and logged in on_refused) or gone
            self._apply("dial_failed")
        return False

    def joined(self, hello: m.NodeHello, link: Link) -> None:
        """A connection a joining node opened to this head."""
        self.instance = hello.instance
        self._accept_hello(hello)
        self.add_conn(link)
        self._apply("joined")
        self.fleet.capacity_changed()

    def _accept_hello(self, hello: m.NodeHello) -> bool:
        fresh = (hello.identity, hello.model, hello.context_window, hello.lanes) != (
            self.info.identity, self.info.model, self.info.context_window, self.info.lanes)
        self.info = NodeInfo(identity=hello.identity, model=hello.model, runtime=hello.runtime,
                             context_window=hello.context_window, lanes=hello.lanes,
                             takes_models=hello.takes_models, splits=hello.splits,
                             kept=tuple(hello.kept))
        if hello.kept:
            self.fleet.kept_seen(hello.kept)
        if fresh or not self._announced:
            self._announced = True
            self.last_error = ""
            log.info("fleet node '%s' at %s: %s, context window %d tokens, %d lanes",
                     hello.identity, self.address, hello.model, hello.context_window, hello.lanes)
            if hello.model not in self.fleet.models:
                log.warning("fleet node '%s' at %s serves '%s', not %s; no sessions go there "
                            "until it serves a model this head knows (serve it with "
                            "--also-model)", hello.identity, self.address, hello.model,
                            " or ".join(f"'{x}'" for x in self.fleet.models))
            self.fleet.window_changed()
        return True

    def _unreachable(self, exc: BaseException) -> None:
        self.failures += 1
        why = _why(exc)
        if self.state != "unreachable" or why != self.last_error:
            log.warning("fleet node %s: %s; retrying it every %d s", self.address, why,
                        int(RETRY_S))
            self.fleet.emit(ev.NodeUnreachable(key=self.key, address=self.address,
                                               reason=why))
        self.last_error = why
        self._apply("dial_failed_with_conns" if self.conns else "dial_failed")
        if self.conns == 0:
            self._announced = False

    async def _keepalive_until_woken(self) -> None:
        """Ping idle connections every KEEPALIVE_S (under the node's idle timeout)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KEEPALIVE_S):
                    await self.wake.wait()
                    return
            for conn in list(self.idle):
                with contextlib.suppress(LinkClosed):
                    conn.link.send(m.Ping(nonce=0))


def _why(exc: BaseException) -> str:
    if isinstance(exc, LinkError):
        if exc.kind is LinkErrorKind.CLOSED_AT_HANDSHAKE:
            return ("closed the connection at the handshake; check that --fleet-auth holds "
                    "the token in the node's --auth-file")
        if exc.kind is LinkErrorKind.WRONG_TOKEN:
            return "holds another fleet token; give both ends the same token"
        if exc.kind is LinkErrorKind.NO_TOKEN_THERE:
            return "has no fleet token; give the node --auth-file with the fleet token"
        if exc.kind is LinkErrorKind.NO_TOKEN_HERE:
            return "uses a fleet token; give the head --fleet-auth with it"
        return str(exc)
    if isinstance(exc, WrongPeer):
        return (f"{exc}; check the port (a node listens on {NODE_PORT}, a head takes joins on "
                f"{FLEET_PORT})")
    if isinstance(exc, TimeoutError):
        return "did not answer the handshake in time; check that it is a Shoal node and running"
    if isinstance(exc, ConnectionRefusedError):
        return "refused the connection; is the node running on that port?"
    if isinstance(exc, LinkClosed):
        return f"closed the link: {exc}"
    return f"cannot connect: {exc}"


class Fleet:
    """Every node this head knows, and the signals its sessions wait on."""

    def __init__(self, *, model: str, head_id: str, psk: bytes | None,
                 conns_per_node: int = 0, handshake_timeout_s: float = 10.0,
                 also: tuple[str, ...] = (), name: str = "",
                 clock: Callable[[], float] = time.monotonic,
                 emit: ev.Emit = ev.ignore, probe: list[list[int]] | None = None) -> None:
        self.clock = clock
        self.probe = probe or []  # ids of PROBE_TEXTS in the head's vocabulary, sent in hellos
        self.emit = emit  # where the fleet's changes go (the service's event bus)
        self.model = model  # announced to joining nodes
        self.models = (model, *also)  # every model this head has a tokenizer for
        self.head_id = head_id
        self.name = name  # its machine's host name, which people know this head by
        self.psk = psk
        self.conns_per_node = conns_per_node
        self.handshake_timeout_s = handshake_timeout_s
        self.pools: dict[str, NodePool] = {}
        self.stopping = asyncio.Event()
        self._capacity = asyncio.Event()
        self._tasks = TaskSet("the fleet's node links")
        self.on_capacity: Callable[[], None] | None = None
        self.on_window: Callable[[], None] | None = None
        # told of models a node keeps that this head has no tokenizer for (it may learn
        # them: engine.service.head_models); each name once
        self.on_unknown_kept: Callable[[list[str]], None] | None = None
        self._told_kept: set[str] = set()
        self._asks = 0  # the last ServeModel's ask, over every node

    def next_ask(self) -> int:
        self._asks += 1
        return self._asks

    async def serve_model(self, key: str, spec: str, *, split_with: tuple[str, ...] = (),
                          timeout_s: float = ANSWER_S) -> m.ServeModelResult:
        """Ask the node ``key`` (a NodeSnapshot's key) to serve ``spec``; its answer, or
        NotAsked (one line) when there is no such node or it cannot be asked."""
        pool = self.pools.get(key)
        if pool is None:
            known = ", ".join(sorted(self.pools)[:8]) or "none"
            raise NotAsked(f"no node '{key}' in this head's fleet (it knows: {known}); give "
                           "a node's key as the fleet lists it", "node_unknown")
        return await pool.serve_model(spec, split_with=split_with, timeout_s=timeout_s)

    def add_dialed(self, host: str, port: int, *, key: str | None = None,
                   discovered: bool = False) -> NodePool:
        key = key or f"{host}:{port}"
        pool = NodePool(self, key, host, port, dialed=True, discovered=discovered)
        self.pools[key] = pool
        pool.task = self._tasks.spawn(pool.maintain(), f"pool-{key}")
        return pool

    def add_joined(self, hello: m.NodeHello, link: Link) -> NodePool:
        """File a joined node's connection under its identity (and instance, for namesakes)."""
        key = f"joined:{hello.identity}"
        pool = self.pools.get(key)
        if pool is not None and pool.conns and pool.instance and pool.instance != hello.instance:
            # another live node with the same name: keep them apart
            key = f"joined:{hello.identity}@{link.peer.rsplit(':', 1)[0]}"
            pool = self.pools.get(key)
        if pool is None:
            host, _, port = link.peer.rpartition(":")
            pool = NodePool(self, key, host, int(port or 0), dialed=False)
            self.pools[key] = pool
        pool.joined(hello, link)
        return pool

    def forget(self, key: str) -> None:
        """Stop keeping a node (its maintainer returns by itself)."""
        pool = self.pools.pop(key, None)
        if pool is not None:
            pool.drop_links()

    def capacity_changed(self) -> None:
        if self.on_capacity is not None:
            self.on_capacity()

    def kept_seen(self, kept: Sequence[m.KeptModel]) -> None:
        """A node said what it keeps: pass on the names this head has not met."""
        new = [k.name for k in kept if k.name not in self.models and k.name not in
               self._told_kept]
        if new and self.on_unknown_kept is not None:
            if len(self._told_kept) > 4096:  # bounded: names from many nodes over time
                self._told_kept.clear()
            self._told_kept.update(new)
            self.on_unknown_kept(new)

    def window_changed(self) -> None:
        if self.on_window is not None:
            self.on_window()

    def views(self, model: str | None = None) -> list[NodeView]:
        """Every node as placement sees it; with ``model``, a node that keeps it (besides
        its first model) is seen as serving it."""
        out: list[NodeView] = []
        for p in self.pools.values():
            if p.info.identity:
                out.append(p.view())
                kept = p.keeps(model) if model is not None else None
                if kept is not None:
                    out.append(p.view(kept))
        return out

    def context_window(self, model: str | None = None) -> int:
        """The largest window of a connected node serving ``model`` (the announced one)."""
        want = model or self.model
        return max([p.info.context_window for p in self.pools.values()
                    if p.info.model == want and p.conns]
                   + [k.context_window for p in self.pools.values() if p.conns
                      and (k := p.keeps(want)) is not None], default=0)

    def loaded(self, model: str) -> bool:
        """Whether a linked node has ``model`` loaded now (its first model awake, or a kept
        one loaded), not only kept on its disk."""
        for pool in self.pools.values():
            if pool.state != "ready" or not pool.info.identity:
                continue
            if pool.info.model == model and not (pool.stats and pool.stats.sleep):
                return True
            kept = pool.keeps(model)
            if kept is not None and kept.state == "loaded":
                return True
        return False

    def free(self, model: str) -> bool | None:
        """Whether a node serving ``model`` has a free lane now; None when none serves it."""
        from engine.head.fleet.placement import has_free_lane

        now = self.clock()
        serving = False
        for pool in self.pools.values():  # every request asks: stop at the first free node
            kept = pool.keeps(model)
            if not pool.info.identity or (pool.info.model != model and kept is None):
                continue
            view = pool.view(kept)
            if view.idle_conns + view.own_sessions:
                serving = True
                if has_free_lane(view, now):
                    return True
        return False if serving else None

    async def close(self) -> None:
        self.stopping.set()
        await self._tasks.close()
        for pool in self.pools.values():
            pool.close_links()

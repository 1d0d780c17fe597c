"""Running a session on the fleet: queue, placement, streaming, failover.

A session is placed whole on one node. If that node fails (its connection
closes, it goes silent, or it stops making progress: see :mod:`engine.head.fleet.attempt`),
the tokens already delivered become part of the prompt and the session is placed
again on the next capable node, asking only for what is left. Token indices from
the node let the head check that nothing arrives twice or goes missing.

Each session has a task of its own that places it and waits for each attempt to
end. An attempt runs where its connection's records are read (the transport's read
callback): it renews the lease and pings from its timer, and files the tokens in
the session's buffer as they arrive; the HTTP side reads that buffer at its own
pace. A client that stops reading costs only its buffer (at most the tokens it
asked for), never a lease, a lane or a node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Literal, assert_never

from engine import events as ev
from engine.errors import RequestError
from engine.head.fleet import attempt as at
from engine.head.fleet import failover as fo
from engine.head.fleet.alarm import Alarm
from engine.head.fleet.links import ConnClosed, Fleet, Inbound, NodeConn, NodePool
from engine.head.fleet.placement import NoPlacement, Placement, PlacementRequest, Policy, place
from engine.link import messages as m
from engine.link.transport import LinkClosed
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal.head")

# A node that sends nothing (no token, no pong) for this long while it holds a
# session counts as hung; the head pings it every PING_S of silence first.
STALL_S = 3.0
PING_S = 1.0
LEASE_MS = 10_000
MAX_WALL_S = 600.0
QUEUE_TIMEOUT_S = 20.0
RETRY_NODE_S = 10  # Retry-After when no node can take the request now
RETRY_RESTART_S = 5  # Retry-After for the sessions a stopping head ends
_AFFINITY_MAX = 10_000


@dataclass(frozen=True, slots=True)
class Job:
    session: str  # unique per request: names the generation on the link
    model: str
    prompt: list[int]
    max_tokens: int
    sampling: m.SamplingParams = field(default_factory=m.SamplingParams)
    stop_ids: list[int] = field(default_factory=list)
    affinity: str | None = None  # X-Session-Id / X-Session-Affinity
    # a conversation's first turn under a key the head derived: where it goes is
    # remembered for the next turn, but the key (which other conversations opening
    # with the same words share) does not steer it; the policy places it
    first_turn: bool = False
    pin_host: str | None = None
    prefer: tuple[str, ...] = ()
    # an issued API key's request: the cached tokens it is told are only those its own
    # conversation left on the node (another key's prompt is never confirmed to it)
    keyed: bool = False
    keep_alive_s: float | None = None  # Ollama's keep_alive (Generate.keep_alive_s)


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    node: str
    moves: int


class FifoGate:
    """Waiters for a free lane, served strictly in arrival order."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
            return

    def enqueue(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def is_first(self, fut: asyncio.Future[None]) -> bool:
        return bool(self._waiters) and self._waiters[0] is fut

    def rearm(self, fut: asyncio.Future[None]) -> asyncio.Future[None]:
        """Keep this waiter's place with a fresh future."""
        new: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for i, f in enumerate(self._waiters):
            if f is fut:
                self._waiters[i] = new
                break
        return new

    def leave(self, fut: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        self.notify()


SessionState = Literal["placing", "waiting", "queued", "running", "ended"]


class SessionRunner:
    def __init__(self, fleet: Fleet, *, policy: Policy = "load-aware", pool_high: float = 90.0,
                 queue_timeout_s: float = QUEUE_TIMEOUT_S, stall_s: float = STALL_S,
                 lease_ms: int = LEASE_MS, max_wall_s: float = MAX_WALL_S,
                 clock: Callable[[], float] | None = None) -> None:
        self.fleet = fleet
        self.clock = clock or fleet.clock
        self.policy = policy
        self.pool_high = pool_high
        self.queue_timeout_s = queue_timeout_s
        self.lease_ms = lease_ms
        self.max_wall_s = max_wall_s
        self.limits = at.AttemptLimits(lease_s=lease_ms / 1000, stall_s=stall_s, ping_s=PING_S)
        self.gate = FifoGate()
        self._cursor = 0
        # session -> (the node key holding its prompt cache, the tokens it holds)
        self._affinity: OrderedDict[str, tuple[str, int]] = OrderedDict()
        fleet.on_capacity = self.gate.notify
        self.moves_total = 0
        self.placements = 0  # decisions made, and the seconds they took (the fleet's views
        self.placement_s = 0.0  # and the policy): /metrics shows them
        self._live: set[Session] = set()
        self._stopping: str | None = None  # why sessions are refused: the head is stopping

    @property
    def stall_s(self) -> float:
        return self.limits.stall_s

    @property
    def queued(self) -> int:
        return len(self.gate)

    # -- placement and queue ---------------------------------------------------------

    def _try_place(self, job: Job, prompt_len: int, max_tokens: int,
                   exclude: frozenset[str]) -> tuple[NodePool, NodeConn, str] | NoPlacement:
        held = self._held(job)
        req = PlacementRequest(model=job.model, prompt_tokens=prompt_len,
                               max_tokens=max_tokens, exclude=exclude,
                               affinity=held[0] if held else None,
                               affinity_cached=held[1] if held else 0,
                               pin_host=job.pin_host, prefer=job.prefer)
        now = self.clock()
        while True:
            t0 = time.perf_counter()
            decision = place(req, self.fleet.views(job.model), now=now, policy=self.policy,
                             pool_high=self.pool_high, cursor=self._cursor)
            self.placement_s += time.perf_counter() - t0  # what one decision costs the head
            self.placements += 1
            if isinstance(decision, NoPlacement):
                return decision
            assert isinstance(decision, Placement)
            self._cursor = decision.cursor
            pool = self.fleet.pools[decision.node]
            conn = pool.acquire()
            if conn is not None:
                return pool, conn, decision.reason
            # every idle connection was dead: the view is fresh now, place again
            req = dataclasses.replace(req, exclude=req.exclude | {pool.key})

    async def _acquire(self, job: Job, session: Session, prompt_len: int, max_tokens: int,
                       exclude: frozenset[str], deadline: float
                       ) -> tuple[NodePool, NodeConn, str]:
        def waiting(state: SessionState) -> None:
            session.state = state

        return await self.acquire(job, prompt_len, max_tokens, exclude, deadline, waiting)

    async def acquire(self, job: Job, prompt_len: int, max_tokens: int,
                      exclude: frozenset[str], deadline: float,
                      waiting: Callable[[SessionState], None] = lambda _state: None
                      ) -> tuple[NodePool, NodeConn, str]:
        """A connection to the best node, waiting in FIFO order when every node is full
        (``waiting`` hears why it waits). Raises RequestError when none comes by
        ``deadline`` or none ever can."""
        fut: asyncio.Future[None] | None = None
        if not len(self.gate):
            got = self._try_place(job, prompt_len, max_tokens, exclude)
            if not isinstance(got, NoPlacement):
                return got
            self._raise_if_final(got)
            waiting(_waiting_state(got))
        fut = self.gate.enqueue()
        try:
            last: NoPlacement | None = None
            while True:
                if self.gate.is_first(fut):
                    got = self._try_place(job, prompt_len, max_tokens, exclude)
                    if not isinstance(got, NoPlacement):
                        return got
                    self._raise_if_final(got)
                    last = got
                    waiting(_waiting_state(got))
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise self._timeout_error(last)
                # wake on any capacity change, and re-check at least twice a second
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, 0.5)):
                        await asyncio.shield(fut)
                if fut.done():
                    fut = self.gate.rearm(fut)
        finally:
            self.gate.leave(fut)

    def _raise_if_final(self, refusal: NoPlacement) -> None:
        if refusal.code == "context_length_exceeded":
            raise RequestError(refusal.message, code="context_length_exceeded")
        if refusal.code == "unknown_node":
            raise RequestError(refusal.message, code="node_not_found")
        if refusal.code == "paused":
            raise RequestError(refusal.message, code="fleet_paused", retry_after=RETRY_NODE_S)
        if refusal.code == "failing":
            raise RequestError(refusal.message, code="no_node_available",
                               retry_after=RETRY_NODE_S)
        if refusal.code == "node_down":
            raise RequestError(refusal.message, code="node_unavailable",
                               retry_after=RETRY_NODE_S)

    def _timeout_error(self, last: NoPlacement | None) -> RequestError:
        if last is not None and last.code == "no_node":
            return RequestError(last.message, code="no_node_available",
                                retry_after=RETRY_NODE_S)
        waited = int(self.queue_timeout_s)
        return RequestError(
            f"every lane of the fleet stayed busy for {waited} s; retry later or add a node",
            code="fleet_busy", retry_after=max(1, waited // 4))

    # -- running -------------------------------------------------------------------

    def start(self, job: Job) -> Session:
        """Run ``job`` in a task of its own; read it through the returned session."""
        session = Session(self, job)
        if self._stopping is not None:
            session.end(self._stopping_error())
        else:
            self._live.add(session)
            session.on_end(self._live.discard)
        return session

    @property
    def live(self) -> int:
        """Sessions placing, queued or running now."""
        return len(self._live)

    def stop_sessions(self, why: str) -> int:
        """The head is stopping: end every live session with an error that says ``why``
        (each is cancelled on its node, and its reader gets the tokens already made, then
        the error), and refuse the sessions that come after. Returns how many ended."""
        self._stopping = why
        live = list(self._live)
        for session in live:
            session.end(self._stopping_error())
        return len(live)

    def _stopping_error(self) -> RequestError:
        return RequestError(self._stopping or "the head is stopping", code="shutting_down",
                            retry_after=RETRY_RESTART_S)

    async def run(self, job: Job) -> AsyncGenerator[list[int] | Finish, None]:
        """Yield batches of new token ids, then one Finish. Raises RequestError."""
        session = self.start(job)
        try:
            while True:
                item = await session.next()
                yield item
                if isinstance(item, Finish):
                    return
        finally:
            await session.close()

    async def _generate(self, job: Job, session: Session) -> None:
        """The session's work, driven by its own task (see :class:`Session`): place, run
        one attempt, then carry out what :func:`failover.after` decides. Token batches
        reach the session's reader straight from the transport's read callback (through
        :meth:`Session.put`); this task only waits for each attempt to end."""
        started = self.clock()
        wall_deadline = started + self.max_wall_s
        delivered: list[int] = []
        progress = fo.begin(started, self.queue_timeout_s)

        def deliver(ids: list[int]) -> None:
            delivered.extend(ids)
            session.put(ids)

        while True:
            remaining = job.max_tokens - len(delivered)
            # no copy of a long prompt on the loop until tokens were delivered
            context = job.prompt + delivered if delivered else job.prompt
            pool, conn, reason = await self._acquire(job, session, len(context), remaining,
                                                     progress.exclude,
                                                     progress.queue_deadline)
            session.state = "running"
            node = session.node = pool.info.identity
            progress, moved_from = fo.placed(progress, node)
            if moved_from is not None:
                self.moves_total += 1
                log.warning("session %s moved from '%s' to '%s' at %s after %d tokens (%s)",
                            job.session, moved_from, node, pool.address, len(delivered),
                            reason)
                self.fleet.emit(ev.SessionMoved(session=job.session, from_node=moved_from,
                                                to_node=node, after_tokens=len(delivered),
                                                reason=reason))
            else:
                log.info("session %s placed on '%s' at %s (%s)", job.session, node,
                         pool.address, reason)
                self.fleet.emit(ev.SessionPlaced(session=job.session, model=job.model,
                                                 node=node, reason=reason))
            cached = self._held_on(job, pool.key)  # before the next turn is remembered
            if job.affinity:
                self._remember(job.affinity, pool.key, len(context))
            attempt = _Attempt(self, pool, conn, job, context, remaining, wall_deadline,
                               deliver, cached=cached)
            before = len(delivered)
            try:
                await attempt.run()
            finally:
                attempt.release()
            done = attempt.done
            now = self.clock()
            self._judge(pool, attempt.final, got_tokens=len(delivered) > before, now=now)
            reused = done.cached_tokens if done else 0
            if job.keyed:  # what this key's conversation left there, and no more
                reused = min(reused, cached)
            progress, decision = fo.after(
                progress, attempt.final, node=pool.key, delivered=len(delivered),
                max_tokens=job.max_tokens, finish_reason=done.finish_reason if done else "",
                cached_tokens=reused, now=now, queue_timeout_s=self.queue_timeout_s)
            ending = Finish(reason="length", prompt_tokens=len(job.prompt),
                            completion_tokens=len(delivered),
                            cached_tokens=progress.cached_tokens, node=node,
                            moves=progress.moves)
            if isinstance(decision, fo.EndSession):
                if job.affinity:  # the node parks the whole conversation so far
                    self._remember(job.affinity, pool.key, len(job.prompt) + len(delivered))
                session.put(dataclasses.replace(ending, reason=decision.reason))
                return
            if isinstance(decision, fo.NextNode):
                log.info("node '%s' is full (%s); trying the next node", node, decision.message)
                pool.mark_full(now)
                continue
            if isinstance(decision, fo.FailRequest):
                raise RequestError(decision.message, code=decision.code)
            if isinstance(decision, fo.Ceiling):
                log.warning("session %s reached the %d s ceiling; ending it", job.session,
                            int(self.max_wall_s))
                session.put(ending)
                return
            if isinstance(decision, fo.Replace | fo.GiveUp):
                log.warning("session %s lost node '%s' at %s: %s", job.session, node,
                            pool.address, decision.why)
                if isinstance(decision, fo.GiveUp):
                    session.put(ending)
                    return
                continue
            assert_never(decision)

    def _judge(self, pool: NodePool, final: at.Final | None, *, got_tokens: bool,
               now: float) -> None:
        """A node that fails sessions before their first token rests (cooldown.py). Only
        its own word counts: a node gone silent or away is the link's to judge (it is
        unreachable, then linked again), and a frozen node must be ready once it thaws."""
        if got_tokens or isinstance(final, at.NodeDone):
            pool.cooldown.worked()
        elif isinstance(final, at.Failover) and final.by_node:
            rest = pool.cooldown.failed_at_once(final.reason, now)
            if rest:
                log.warning("node '%s' failed %d sessions in a row before their first token "
                            "(%s); placing elsewhere for %.0f s", pool.info.identity,
                            pool.cooldown.failures, final.reason, rest)
                self.fleet.capacity_changed()

    def _held(self, job: Job) -> tuple[str, int] | None:
        """The node holding this conversation's prompt cache and the tokens it holds, as
        last remembered; None when the key does not steer the conversation."""
        return (self._affinity.get(job.affinity)
                if job.affinity and not job.first_turn else None)

    def _held_on(self, job: Job, key: str) -> int:
        """The prompt tokens node ``key`` holds of this conversation (0: none known)."""
        held = self._held(job)
        return held[1] if held is not None and held[0] == key else 0

    def _remember(self, session: str, key: str, tokens: int) -> None:
        self._affinity[session] = (key, tokens)
        self._affinity.move_to_end(session)
        while len(self._affinity) > _AFFINITY_MAX:
            self._affinity.popitem(last=False)


def _waiting_state(refusal: NoPlacement) -> SessionState:
    return "waiting" if refusal.code == "no_node" else "queued"


class Session:
    """A session running in its own task; :meth:`next` reads what it produced.

    The buffer holds what the node sent and the client has not read yet. It needs
    no bound of its own: a session produces at most ``job.max_tokens`` tokens, which
    the node's window bounds."""

    def __init__(self, runner: SessionRunner, job: Job) -> None:
        self.runner = runner
        self.job = job
        self.state: SessionState = "placing"
        self.node = ""
        self._out: deque[list[int] | Finish | RequestError] = deque()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None  # the reader, waiting for _out
        self._alarm = Alarm(self._loop.time, self._wake)  # the reader's deadlines (next_by)
        self._task = asyncio.create_task(self._run(), name=f"session-{job.session}")

    def on_end(self, callback: Callable[[Session], None]) -> None:
        """Call ``callback(self)`` once the session's task has ended."""
        self._task.add_done_callback(lambda _task: callback(self))

    def end(self, error: RequestError) -> None:
        """End the session now: cancel its work (on its node too) and let its reader get
        what was already made, then ``error``."""
        if self._task.done():
            return
        self._task.cancel()
        self._put(error)

    def put(self, item: list[int] | Finish) -> None:
        """What the session produced, for its reader (from the transport's read callback
        or the session's own task)."""
        self._put(item)

    def _put(self, item: list[int] | Finish | RequestError) -> None:
        self._out.append(item)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _run(self) -> None:
        try:
            await self.runner._generate(self.job, self)
        except RequestError as exc:
            self._put(exc)
        except Exception:
            log.exception("session %s failed", self.job.session)
            self._put(RequestError(
                "internal error; the head's log has the details", code="internal_error"))
        finally:
            self.state = "ended"

    @property
    def committable(self) -> bool:
        """Whether the request is really waiting for a lane or for its tokens, so that a
        keepalive may commit the answer (a request that waits for a node may still be
        refused with its real status)."""
        return self.state in ("queued", "running")

    async def next(self) -> list[int] | Finish:
        """The next batch of ids (every batch already waiting, as one) or the Finish.
        Raises the session's RequestError."""
        while not self._out:
            await self._wait()
        return self._merged(self._out.popleft())

    async def next_by(self, deadline: float) -> list[int] | Finish:
        """:meth:`next`, or TimeoutError at ``deadline`` (the loop's time).

        A reader that waits once per token with a deadline a little later each time (the
        next keepalive) would set and cancel a timer per token; here one alarm serves
        them all, moved only when a deadline comes earlier than the one it is set for.
        An alarm that rings before the reader's deadline is set again."""
        while not self._out:
            if self._loop.time() >= deadline:
                raise TimeoutError
            self._alarm.set_by(deadline)
            await self._wait()
        return self._merged(self._out.popleft())

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> list[int] | Finish | None:
        """:meth:`next` when something is waiting, else None, without suspending."""
        return self._merged(self._out.popleft()) if self._out else None

    def _merged(self, item: list[int] | Finish | RequestError) -> list[int] | Finish:
        if isinstance(item, RequestError):
            raise item
        if isinstance(item, list):
            out = self._out
            while out and isinstance(out[0], list):
                item.extend(out.popleft())  # type: ignore[arg-type]  # a list, checked
        return item

    async def close(self) -> None:
        """Stop the session (cancelling it on its node) unless it has ended."""
        self._alarm.cancel()
        await cancel_and_wait([self._task], "a session")


class _Attempt:
    """One try of a session on one node: the IO around :mod:`engine.head.fleet.attempt`.

    The transport's read callback hands each record to :meth:`_on_record` as it is read,
    which steps the machine and gives tokens to ``deliver`` there and then: a token
    wakes one task at the head (the HTTP handler), not three. One timer per attempt
    wakes the machine when nothing arrives; it is moved only when the machine's next
    deadline comes earlier than the one it is set for (a timer that rings before the
    deadline that records have since moved on is set again, without a step).
    """

    def __init__(self, runner: SessionRunner, pool: NodePool, conn: NodeConn, job: Job,
                 context: list[int], max_tokens: int, wall_deadline: float,
                 deliver: Callable[[list[int]], None], *, cached: int = 0) -> None:
        self.runner = runner
        self.cached = cached  # prompt tokens the node holds already, as far as known
        self.pool = pool
        self.conn = conn
        self.job = job
        self.context = context
        self.max_tokens = max_tokens
        self.wall_deadline = wall_deadline
        self.final: at.Final | None = None
        self.done: m.Done | None = None
        self._deliver = deliver
        self._released = False
        self._loop = asyncio.get_running_loop()
        self._ended: asyncio.Future[None] = self._loop.create_future()
        self._state: at.AttemptState | None = None
        self._timer = Alarm(runner.clock, self._on_timer)

    async def run(self) -> None:
        """Send the generation and wait until the attempt ends (``final`` says how)."""
        job = self.job
        try:
            self.conn.link.send(m.Generate(session=job.session, lease_ms=self.runner.lease_ms,
                                           prompt=self.context, max_tokens=self.max_tokens,
                                           sampling=job.sampling, stop_ids=job.stop_ids,
                                           keep_alive_s=job.keep_alive_s, model=job.model))
        except LinkClosed as exc:
            self.final = at.Failover(str(exc), drop=False)
            return
        stats = self.pool.stats
        rates = stats.rates if stats is not None else m.Rates()
        self._state = at.start(self.runner.clock(), prompt_tokens=len(self.context),
                               prefill_tps=rates.prefill_tps, cached=self.cached,
                               s_per_token=rates.prefill_s_per_token,
                               s_per_token_ctx=rates.prefill_s_per_token_ctx,
                               wall_deadline=self.wall_deadline, limits=self.runner.limits)
        self.conn.sink = self._on_record
        if self.conn.closed:  # closed before the sink was in place: nobody will call it
            self._on_record(ConnClosed(self.conn.close_reason))
        else:
            self._arm()
        await self._ended

    def _on_record(self, rec: Inbound) -> None:
        if self.final is not None:
            return
        if type(rec) is m.Tokens:
            self._step(at.GotTokens(rec.index, len(rec.ids)), rec.ids)
            return
        event: at.Event
        if isinstance(rec, ConnClosed):
            event = at.Lost(rec.reason)
        elif isinstance(rec, m.Accepted):
            event = at.GotAccepted()
        elif isinstance(rec, m.Progress):
            event = at.GotProgress(rec.prefilled, rec.prompt, rec.loading)
        elif isinstance(rec, m.Done):
            self.done = rec
            event = at.GotDone()
        elif isinstance(rec, m.Error):
            event = at.GotError(rec.code, rec.message)
        else:
            return
        self._step(event, None)

    def _on_timer(self) -> None:
        if self.final is None:
            assert self._state is not None
            if self.runner.clock() < at.next_deadline(self._state, self.runner.limits):
                self._arm()  # set for a deadline that records since have moved on
                return
            self._step(at.Tick(self.conn.last_rx), None)

    def _step(self, event: at.Event, ids: list[int] | None) -> None:
        assert self._state is not None
        limits = self.runner.limits
        self._state, actions = at.step(self._state, event, self.runner.clock(), limits)
        for action in actions:
            if isinstance(action, at.Deliver):
                assert ids is not None
                self._deliver(ids)
            elif isinstance(action, at.SendRenew):
                with contextlib.suppress(LinkClosed):
                    self.conn.link.send(m.Renew(session=self.job.session,
                                                lease_ms=self.runner.lease_ms))
            elif isinstance(action, at.SendPing):
                with contextlib.suppress(LinkClosed):
                    self.conn.link.send(m.Ping(nonce=action.nonce))
            else:
                self._carry_out(action)
                return
        self._arm()

    def _arm(self) -> None:
        assert self._state is not None
        self._timer.set_by(at.next_deadline(self._state, self.runner.limits))

    def _stop(self) -> None:
        """Take the attempt off its connection and its timer."""
        if self.conn.sink == self._on_record:
            self.conn.sink = None
        self._timer.cancel()
        if not self._ended.done():
            self._ended.set_result(None)

    def _carry_out(self, final: at.Final) -> None:
        self.final = final
        self._stop()
        if isinstance(final, at.Failover):
            if final.hung:
                self.pool.mark_unresponsive(final.reason)
            elif final.drop:
                self.conn.abort()
        elif isinstance(final, at.WallExceeded):
            self._cancel()

    def _cancel(self) -> None:
        with contextlib.suppress(LinkClosed):
            self.conn.link.send(m.Cancel(session=self.job.session))

    def release(self) -> None:
        """Give the connection back; one left mid-generation is cancelled and dropped."""
        if self._released:
            return
        self._released = True
        self._stop()
        final = self.final
        reusable = isinstance(final, at.NodeDone | at.Busy | at.RequestRefused) or (
            isinstance(final, at.Failover) and not final.drop and not final.hung)
        if final is None and not self.conn.closed:
            # the client went away or a stop string matched: stop the node's work
            self._cancel()
        self.pool.release(self.conn, reusable=reusable and not self.conn.closed)

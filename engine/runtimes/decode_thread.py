"""The decode thread that the llama.cpp and mlx engines share.

One daemon thread owns the model from load to unload. The event loop talks to
it through one command queue (a new job, a job id to cancel, stop); the thread
hands tokens back through each job's :class:`TokenSink`.

Life cycle: ``start()`` starts the thread, which loads the model (so the thread
that loads is the thread that decodes: mlx-lm's generation stream is per
thread, and a llama.cpp context never changes hands) and reports through a
future; a failed load raises from ``start()``. ``close()`` posts stop and joins;
on its way out the thread ends everything still queued or running as
cancelled, then unloads.

The loop, until stop: take every queued command (blocking only when idle),
end jobs that want no tokens, admit waiting jobs while the runtime finds them a
lane, then run one step over the active jobs. A runtime supplies only what is
its own: ``_load``, ``_admit``, ``_step`` (which reports each sampled token to
``_sampled``), ``_leave_lane`` and ``_unload``.

It also keeps the counters the node reports (lanes busy, KV cells used, under
a lock) and the rate windows: medians of time to first token, prefill and
decode rates over the last ``RECENT`` requests, and the prefill fit by length
(:mod:`engine.runtimes.prefill_fit`).

The KV pool (a runtime whose lanes share one sets ``_pool`` in ``_load``): every
generation commits its prompt plus an answer reserve (``ANSWER_RESERVE`` tokens,
or fewer when it asks for fewer) when it is submitted, on the event loop, under
the lock; :meth:`admission` says whether a new one fits what is not committed, so
the node refuses it as busy at once. Parked prefixes are not committed: the
runtime reclaims them when a committed generation needs their cells. An answer
that outgrows its reserve takes free cells one at a time (its commitment grows
with it), and when none is left it ends as ``length`` with one warning line (see
``docs/decisions.md``, "One KV pool").

``suspend`` stops the thread (the model and pool are freed) and ``resume``
loads again: a node's idle unload.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from engine.runtimes.base import (
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
)
from engine.runtimes.budget import process_rss_bytes
from engine.runtimes.cpu_share import SHARE
from engine.runtimes.prefill_fit import PrefillFit
from engine.runtimes.threaded import ThreadedGeneration, TokenSink, check_prompt

log = logging.getLogger("shoal.node")

RECENT = 64  # requests the measured rates and the ttft median look back over
ANSWER_RESERVE = 512  # pool cells an answer commits at admission (fewer if it asks fewer)
RSS_EVERY_S = 0.5  # the process's memory is read at most this often


def answer_reserve(prompt_tokens: int, max_tokens: int, window: int,
                   reserve: int = ANSWER_RESERVE) -> int:
    """Cells a generation commits for its answer: what it asks, within the window, at
    most ``reserve`` (it may grow past that while cells are free)."""
    return max(min(max_tokens, window - prompt_tokens, reserve), 1)


class PoolFull(RuntimeError):
    """The pool cannot commit the cells a new generation needs now (the node says busy)."""


@dataclass(eq=False)
class DecodeJob:
    """One generation as the decode thread sees it; runtimes add their own fields."""

    id: int
    request: GenerationRequest
    sink: TokenSink
    t_submit: float
    prompt: list[int]
    stops: frozenset[int]  # end-of-generation ids and the request's stop ids
    limit: int  # completion tokens allowed: max_tokens, capped by the window
    cached: int = 0  # prompt tokens whose KV the lane already held (or restored)
    from_host: int = 0  # of those, restored from the host-memory cache
    commit: int = 0  # pool cells committed to it: prompt + answer reserve, grown past that
    completion: int = 0
    t_lane: float = 0.0
    t_first: float = 0.0


J = TypeVar("J", bound=DecodeJob)


class PoolLane(Protocol):
    """What the pool reads of a runtime's lane."""

    @property
    def tokens(self) -> Sequence[int]: ...  # tokens whose KV the lane holds

    @property
    def last_used(self) -> float: ...

    @property
    def job(self) -> DecodeJob | None: ...  # the job on it; None while its sequence is parked


class _Stop:
    pass


_STOP = _Stop()


class DecodeThreadEngine(abc.ABC, Generic[J]):
    """An engine whose lanes one decode thread runs; see the module's docstring."""

    # cells an answer commits at admission; tests of the growth past it make it small
    answer_reserve = ANSWER_RESERVE

    def __init__(
        self,
        path: str,
        *,
        runtime: str,
        job_type: type[J],
        model_name: str,
        lanes: int,
        max_context: int | None,
    ) -> None:
        if lanes < 1:
            raise ValueError("lanes must be at least 1")
        if max_context is not None and max_context < 1:
            raise ValueError("--max-context must be a positive number of tokens")
        self.path = path
        self.lanes = lanes
        self.max_context = max_context
        self.info = EngineInfo(
            model=model_name,
            runtime=runtime,
            context_window=max_context or 0,
            lanes=lanes,
            path=path,
            window_pinned=max_context is not None,
        )
        self._job_type = job_type
        # set by _load
        self._window = max_context or 0
        self._n_vocab = 0
        self._eos: frozenset[int] = frozenset()
        self._pool = 0  # cells of the KV pool the lanes share; 0: no shared pool
        self._budget = 0  # bytes the node keeps within; 0: none

        self._commands: queue.SimpleQueue[J | int | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the counters and rate windows below
        self._busy = 0  # admitted and not finished
        self._kv_used = 0
        self._next_id = 0
        self._closed = False
        self._accepting = False
        self._failure: Exception | None = None
        self._ttft: deque[float] = deque(maxlen=RECENT)
        self._prefill_rates: deque[float] = deque(maxlen=RECENT)
        self._decode_rates: deque[float] = deque(maxlen=RECENT)
        self._fit = PrefillFit()
        self._committed = 0  # pool cells committed to generations not finished
        self._parked = 0  # cells held by parked sequences (the runtime says)
        self._from_lanes = 0
        self._from_host = 0
        self._prefilled = 0
        self._rss = (0.0, 0)  # (when read, bytes)
        self._asleep = False  # suspended: the model and pool are freed

    # -- what a runtime supplies (all but _load run on the decode thread's loop) --------

    pool_hint = "raise --memory-budget or serve fewer lanes"  # said when the pool is full

    def _pool_lanes(self) -> Sequence[PoolLane]:
        """Every lane, for the pool's accounting (a runtime with a pool overrides it)."""
        return ()

    def _reclaim(self, lane: PoolLane) -> None:
        """Free a parked lane's cells (its sequence is dropped, or kept elsewhere)."""
        raise NotImplementedError

    def _host_cache_use(self) -> tuple[int, int]:
        """Bytes the host-memory prompt cache holds, and may hold (none: 0, 0)."""
        return 0, 0

    def _device_stats(self) -> tuple[str, int, int]:
        """The device the model runs on, and its layers there and in all ("": the CPU)."""
        return "", 0, 0

    def _device_note(self) -> str:
        """What the runtime chose to run on and why, one line ("": no choice to make)."""
        return ""

    def _lane_of(self, job: J) -> PoolLane | None:
        """The lane ``job`` runs on (a runtime with a pool overrides it)."""
        return None

    @abc.abstractmethod
    def _load(self) -> None:
        """Load the model; set ``_window``, ``_n_vocab`` and ``_eos``. Raise to fail start."""

    @abc.abstractmethod
    def _admit(self, job: J, active: dict[int, J]) -> bool:
        """Put the job on a free lane and set ``t_lane``; False when no lane is free."""

    @abc.abstractmethod
    def _step(self, active: dict[int, J]) -> None:
        """Advance every active job once; report each sampled token to ``_sampled``."""

    @abc.abstractmethod
    def _leave_lane(self, job: J, now: float) -> None:
        """Free what the job holds on its lane (it is leaving it)."""

    @abc.abstractmethod
    def _unload(self) -> None:
        """Free the model: the thread is ending and no job is left."""

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        thread = threading.Thread(
            target=self._run,
            args=(ready,),
            name=f"shoal-{self.info.runtime}-decode",
            daemon=True,
        )
        self._thread = thread
        thread.start()
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            self._commands.put(_STOP)  # if it loaded after all (start was cancelled)
            await asyncio.to_thread(thread.join)
            self._thread = None
            self._commands = queue.SimpleQueue()
            raise
        self.info = replace(self.info, context_window=self._window)
        with self._lock:
            self._accepting = not self._closed
            self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep

    async def suspend(self) -> None:
        """Free the model and the pool (the caller runs no generation now); ``resume``
        loads them again. Anything still queued ends as cancelled."""
        thread = self._thread
        if thread is None or self._closed:
            return
        with self._lock:
            self._accepting = False
        self._commands.put(_STOP)
        await asyncio.to_thread(thread.join)
        self._thread = None
        self._commands = queue.SimpleQueue()
        with self._lock:
            self._kv_used = 0
            self._parked = 0
            self._asleep = True

    async def resume(self) -> None:
        """Load the model again after ``suspend`` (a no-op when it is loaded)."""
        await self.start()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._accepting = False
        thread = self._thread
        if thread is not None:
            self._commands.put(_STOP)
            await asyncio.to_thread(thread.join)

    # -- requests (on the event loop) ---------------------------------------------------

    def generate(self, request: GenerationRequest) -> ThreadedGeneration:
        runtime = self.info.runtime
        if self._failure is not None:
            raise RuntimeError(f"the {runtime} engine stopped: {self._failure!r}")
        if self._thread is None or self._closed:
            raise RuntimeError("the engine is not running; await start() first")
        prompt = check_prompt(request.prompt, window=self._window, n_vocab=self._n_vocab)
        sink = TokenSink(asyncio.get_running_loop())
        commit = len(prompt) + answer_reserve(len(prompt), request.max_tokens, self._window,
                                              self.answer_reserve)
        with self._lock:
            if not self._accepting:
                raise RuntimeError("the engine is closing")
            if not self._fits(commit):
                raise PoolFull(self._full_text())
            self._committed += commit
            self._next_id += 1
            job = self._job_type(
                id=self._next_id,
                request=request,
                sink=sink,
                t_submit=time.perf_counter(),
                prompt=prompt,
                stops=self._eos | frozenset(int(t) for t in request.stop_ids),
                # the window holds the prompt and the whole completion
                limit=min(request.max_tokens, self._window - len(prompt)),
                commit=commit,
            )
            self._busy += 1
            self._commands.put(job)
        return ThreadedGeneration(self._post_cancel, job.id, sink)

    def _post_cancel(self, job_id: int) -> None:
        if not self._closed:
            self._commands.put(job_id)

    def _fits(self, cells: int) -> bool:
        """Whether ``cells`` more can be committed (under the lock; no pool: always)."""
        return not self._pool or self._committed + cells <= self._pool

    def _full_text(self) -> str:
        return (f"the KV pool is full ({self._committed} of {self._pool} cells committed to "
                "running sessions)")

    def admission(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """None when a session of this size fits the pool now; else why not, one line."""
        if not self._pool:
            return None
        need = prompt_tokens + answer_reserve(prompt_tokens, max_tokens, self._window,
                                              self.answer_reserve)
        with self._lock:
            return None if self._fits(need) else self._full_text()

    def _max_prompt(self) -> int:
        """The longest prompt a new session can bring now (with a full answer reserve);
        at least 1 with a pool, since 0 says "no pool" on the link and a full pool must
        still turn the head away."""
        if not self._pool:
            return 0
        free = self._pool - self._committed
        if free >= self._window:
            return self._window - 1
        return max(free - self.answer_reserve, 1)

    def _mem_used(self) -> int:
        now = time.monotonic()
        when, rss = self._rss
        if now - when >= RSS_EVERY_S:
            rss = process_rss_bytes()
            self._rss = (now, rss)
        return rss

    def record_rates(self, prompt_tokens: int, prefill_s: float, decode_tps: float) -> None:
        """A measurement taken outside a generation (the start-up warm-up)."""
        with self._lock:
            # the rate only: a prompt this short says little of how prefill grows with
            # length, which the fit learns from the requests
            if prefill_s > 0:
                self._prefill_rates.append(prompt_tokens / prefill_s)
            if decode_tps > 0:
                self._decode_rates.append(decode_tps)

    def stats(self) -> EngineStats:
        with self._lock:
            busy = self._busy
            kv_used = self._kv_used
            ttft = statistics.median(self._ttft) if self._ttft else 0.0
            prefill = statistics.median(self._prefill_rates) if self._prefill_rates else 0.0
            decode = statistics.median(self._decode_rates) if self._decode_rates else 0.0
            fit = self._fit.fit()
            host_bytes, host_limit = self._host_cache_use()
            parked = self._parked
            max_prompt = self._max_prompt()
            counts = (self._from_lanes, self._from_host, self._prefilled)
        device, gpu_layers, model_layers = self._device_stats()
        return EngineStats(
            lanes=self.lanes,
            lanes_busy=min(busy, self.lanes),
            kv_used=kv_used,
            kv_total=self._pool or self._window * self.lanes,
            prefill_tps=prefill,
            decode_tps=decode,
            ttft_ms=ttft,
            kv_parked=parked,
            max_prompt=max_prompt,
            mem_used=self._mem_used(),
            mem_budget=self._budget,
            prompt_from_lanes=counts[0],
            prompt_from_host=counts[1],
            prompt_prefilled=counts[2],
            host_cache_bytes=host_bytes,
            host_cache_limit=host_limit,
            prefill_s_per_token=fit.a,
            prefill_s_per_token_ctx=fit.b,
            device=device,
            gpu_layers=gpu_layers,
            model_layers=model_layers,
            device_note=self._device_note(),
        )

    # -- the decode thread --------------------------------------------------------------

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            self._load()
        except BaseException as exc:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # start() gave up
                ready.set_exception(exc)
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            ready.set_result(None)  # else start() gave up meanwhile, and its stop is queued
        waiting: deque[J] = deque()
        active: dict[int, J] = {}  # by job id, in admission order
        try:
            self._loop(waiting, active)
        except Exception as exc:  # pragma: no cover - a bug or a broken library
            self._failure = exc
            sys.stderr.write(f"shoal: the {self.info.runtime} decode loop stopped: {exc!r}\n")
        finally:
            with self._lock:
                self._accepting = False
            # whatever is still queued or running ends as cancelled
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(cmd, _Stop | int):
                    waiting.append(cmd)
            for job in list(active.values()):
                self._finish(job, "cancelled", active)
            for job in waiting:
                self._end_unstarted(job, "cancelled")
            SHARE.working(id(self), False)
            self._unload()

    def _loop(self, waiting: deque[J], active: dict[int, J]) -> None:
        commands = self._commands
        working = False  # this engine told the process's CPU share it has work
        while True:
            # take commands; block when there is nothing to do
            block = not active and not waiting
            if block and working:
                working = False
                SHARE.working(id(self), False)
            while True:
                try:
                    cmd = commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if isinstance(cmd, _Stop):
                    return
                if isinstance(cmd, int):
                    self._cancel(cmd, waiting, active)
                else:
                    waiting.append(cmd)
            # lanes join between steps
            while waiting:
                job = waiting[0]
                if job.request.max_tokens <= 0:  # wants no token: ends without a lane
                    waiting.popleft()
                    self._end_unstarted(job, "length")
                    continue
                if not self._admit(job, active):
                    break
                waiting.popleft()
                active[job.id] = job
            if active:
                if not working:
                    working = True
                    SHARE.working(id(self), True)
                self._share_cpus()
                self._step(active)

    def _share_cpus(self) -> None:
        """Take this engine's part of the CPUs for the next step (a runtime whose threads
        can change overrides it: engine.runtimes.cpu_share)."""

    def _cancel(self, job_id: int, waiting: deque[J], active: dict[int, J]) -> None:
        job = active.get(job_id)
        if job is not None:
            self._finish(job, "cancelled", active)
            return
        for job in waiting:
            if job.id == job_id:
                waiting.remove(job)
                self._end_unstarted(job, "cancelled")
                return

    def _sampled(
        self, job: J, tok: int, now: float, active: dict[int, J], *, ended: bool = False
    ) -> bool:
        """A sampled token: hand it over, or end the job at a stop id or its budget.

        ``ended``: the runtime ended the sequence itself. True while the job goes on.
        """
        if job.t_first == 0.0:
            job.t_first = now
            self._record_first(job)
        if tok in job.stops:
            self._finish(job, "stop", active)  # the stop id is not yielded
            return False
        job.completion += 1
        if job.completion >= job.limit or ended:
            self._finish(job, "length", active, [tok])
            return False
        self._deliver(job, [tok], None)
        return True

    def _finish(
        self, job: J, reason: FinishReason, active: dict[int, J], emit: list[int] | None = None
    ) -> None:
        """The job leaves its lane and its caller gets the last tokens and the result."""
        now = time.perf_counter()
        result = self._result(job, reason, now)
        active.pop(job.id, None)
        self._leave_lane(job, now)
        with self._lock:
            if result.decode_tps > 0:
                self._decode_rates.append(result.decode_tps)
            self._busy -= 1
            self._committed -= job.commit
        self._deliver(job, emit or [], result)

    def _end_unstarted(self, job: J, reason: FinishReason) -> None:
        """A job that never took a lane ends."""
        with self._lock:
            self._busy -= 1
            self._committed -= job.commit
        self._deliver(job, [], self._result(job, reason, time.perf_counter()))

    def _grow_commit(self, job: J, cells: int) -> None:
        """An answer past its reserve takes ``cells`` more of the pool."""
        job.commit += cells
        with self._lock:
            self._committed += cells

    def _room_for(self, cells: int, lane: PoolLane) -> bool:
        """Whether ``lane`` can hold ``cells`` beside what the other lanes hold and what
        their running jobs have committed; parked lanes are reclaimed (least recently
        used first) until it can."""
        def free() -> int:
            taken = 0
            for other in self._pool_lanes():
                if other is not lane:
                    held = len(other.tokens)
                    taken += held if other.job is None else max(held, other.job.commit)
            return self._pool - taken

        while free() < cells:
            parked = [other for other in self._pool_lanes()
                      if other.job is None and other is not lane and other.tokens]
            if not parked:
                return False
            self._reclaim(min(parked, key=lambda other: other.last_used))
        return True

    def _grow_answers(self, active: dict[int, J]) -> None:
        """Before a step: an answer at the end of its commitment takes one more cell; with
        none free after reclaiming parked lanes it ends as ``length``, with one line."""
        for job in list(active.values()):
            lane = self._lane_of(job)
            if lane is None or len(lane.tokens) < job.commit:
                continue
            if self._room_for(len(lane.tokens) + 1, lane):
                self._grow_commit(job, 1)
                continue
            log.warning("the KV pool is full (%d cells): ended a session at %d tokens of its "
                        "answer (finish reason length); %s", self._pool, job.completion,
                        self.pool_hint)
            self._finish(job, "length", active)

    def _set_parked(self, cells: int) -> None:
        with self._lock:
            self._parked = cells

    def _deliver(self, job: J, tokens: list[int], result: GenerationResult | None) -> None:
        if not job.sink.hand_over(tokens, result) and result is None:
            self._commands.put(job.id)  # nobody reads it any more: cancel the job

    def _kv_add(self, cells: int) -> None:
        with self._lock:
            self._kv_used += cells

    def _record_first(self, job: J) -> None:
        ttft_ms = (job.t_first - job.t_submit) * 1000.0
        prefilled = len(job.prompt) - job.cached
        dt = job.t_first - job.t_lane
        with self._lock:
            self._ttft.append(ttft_ms)
            if prefilled >= 8 and dt > 0:
                self._prefill_rates.append(prefilled / dt)
                self._fit.add(prefilled, job.cached, dt)
            self._from_lanes += job.cached - job.from_host
            self._from_host += job.from_host
            self._prefilled += prefilled

    @staticmethod
    def _result(job: DecodeJob, reason: FinishReason, now: float) -> GenerationResult:
        ttft_ms = (job.t_first - job.t_submit) * 1000.0 if job.t_first else 0.0
        prefilled = len(job.prompt) - job.cached
        prefill_dt = (job.t_first - job.t_lane) if job.t_first else 0.0
        decode_dt = now - job.t_first if job.t_first else 0.0
        return GenerationResult(
            finish_reason=reason,
            prompt_tokens=len(job.prompt),
            completion_tokens=job.completion,
            cached_tokens=job.cached,
            ttft_ms=ttft_ms,
            prefill_tps=prefilled / prefill_dt if prefill_dt > 0 else 0.0,
            decode_tps=(job.completion - 1) / decode_dt
            if decode_dt > 0 and job.completion > 1
            else 0.0,
        )

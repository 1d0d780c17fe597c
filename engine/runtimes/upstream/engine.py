"""A node's engine that is a serving engine the user runs (llama-server, vLLM): the IO.

The dialect (:mod:`.llama_server`, :mod:`.vllm`) says what to send and how to read
the answers; this module sends and reads, with aiohttp on the node's loop.

Bounds, each one named here so that the node fails over instead of waiting:

- Start: every request answers within ``REQUEST_S``; an upstream that does not
  fails the start in one line naming it and the fix.
- Stream: the first token within ``FIRST_TOKEN_S`` plus the prompt priced at
  ``PREFILL_FLOOR_TPS`` (at most ``FIRST_EVENT_MAX_S``; the head allows the same:
  one lease plus the prompt at that rate), every later event within ``TOKEN_GAP_S``
  of the one before (the head's bound for a node that answers but makes no
  progress). A hung upstream is seen sooner, by the poller: ``/health`` not
  answering within ``POLL_TIMEOUT_S`` fails every stream at once, about
  ``POLL_S + POLL_TIMEOUT_S`` (3 s, the head's hung-node bound) after it hung. A stream that is
  silent longer, breaks, or answers with an error raises
  :class:`UpstreamFailed`: the node reports the session failed and the head
  fails it over, the tokens already delivered kept as context.
- Lines of the event stream at most 1 MiB, events 4 MiB, other answers 4 MiB.
- A poller (the engine's own task, from :meth:`start` to :meth:`close`) asks the
  upstream how it is every ``POLL_S``, each poll bounded by ``POLL_TIMEOUT_S``.
  While ``/health`` fails (or a stream broke on the connection) the engine is
  *down*: :attr:`EngineStats.down` says why, the node refuses new sessions as busy
  and reports every lane busy; the first poll that succeeds brings it back.

Cancelling a generation (the head cancelled, a stop id arrived, the lease lapsed)
closes its HTTP response, which the upstream sees as the client going away and
aborts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import aiohttp

from engine.runtimes.base import (
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RuntimeUnavailable,
)
from engine.runtimes.lanes import Lane, common_prefix, pick_lane
from engine.runtimes.probe import PROBE_TEXTS
from engine.runtimes.upstream.dialect import Dialect, Layout, Load, UpstreamAnswerError
from engine.runtimes.upstream.sse import SseParser, SseTooLarge
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal.node")

REQUEST_S = 10.0
POLL_S = 1.0
POLL_TIMEOUT_S = 2.0
TOKEN_GAP_S = 10.0  # = the head's lease: a loaded CPU box can take seconds per token
FIRST_TOKEN_S = 10.0  # = the head's lease: a busy CPU box takes seconds to start a prompt
PREFILL_FLOOR_TPS = 50.0  # = the head's price of a prompt at an unmeasured node
FIRST_EVENT_MAX_S = 600.0
MAX_ANSWER = 4 << 20
_RECENT = 32  # generations the rates are the median of


class UpstreamFailed(RuntimeError):
    """A generation the upstream broke off, or never answered; one line."""


class UpstreamEngine:
    """The :class:`~engine.runtimes.base.Engine` of a node that fronts an upstream."""

    def __init__(self, dialect: Dialect, url: str, *, model_name: str = "", lanes: int = 0,
                 max_context: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dialect = dialect
        self.url = url.rstrip("/")
        self._named = model_name  # --model-name; "" takes the upstream's own
        self._lanes_given = lanes  # 0: as the upstream says
        self._max_context = max_context
        self._clock = clock
        self.info = EngineInfo(model=model_name or "?", runtime=dialect.runtime,
                               context_window=1, lanes=max(lanes, 1), path=self.url,
                               window_pinned=max_context is not None)
        self.probe: list[list[int]] = []  # the upstream's ids for PROBE_TEXTS
        self.eos_ids: frozenset[int] = frozenset()
        self.model_id = ""
        self._lanes: list[Lane] = []
        self._busy: set[int] = set()
        self._load = Load()
        self._down = ""
        self._told: set[str] = set()
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=_RECENT)
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._live: set[UpstreamGeneration] = set()  # streams under way

    # -- lifecycle -----------------------------------------------------------------------

    def _what(self) -> str:
        return f"the {self.dialect.label} at {self.url}"

    async def start(self) -> None:
        self._session = _new_session()
        try:
            layout = await self._describe()
            self.probe = [await self.tokenize(text) for text in PROBE_TEXTS]
            if layout.eos_text:
                eos = await self.tokenize(layout.eos_text, special=True)
                self.eos_ids = frozenset(eos) if len(eos) == 1 else frozenset()
            answers = await self._poll_answers()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            await self.close()
            raise RuntimeUnavailable(f"cannot reach {self._what()} ({_why(exc)}); start it, "
                                     "or fix --upstream") from None
        except UpstreamAnswerError as exc:
            await self.close()
            raise RuntimeUnavailable(f"{self._what()} answered oddly: {exc}; check that "
                                     f"--runtime {self.dialect.runtime} names the engine "
                                     "running there") from None
        # what /metrics shows of the lanes first, then the load over the lanes settled on
        try:
            self._configure(layout,
                            self.dialect.load(answers, context_window=0, lanes=0).lanes)
        except RuntimeUnavailable:
            await self.close()
            raise
        self._load = self.dialect.load(answers, context_window=self.info.context_window,
                                       lanes=self.info.lanes)
        if self._load.missing:
            self._tell(f"{self._what()} does not show {self._load.missing}; the node reports "
                       "what it can see")
        self._poller = asyncio.create_task(self._poll_loop(), name="upstream-poll")

    def _configure(self, layout: Layout, shown_lanes: int) -> None:
        lanes = layout.lanes or shown_lanes
        if self._lanes_given:
            lanes = min(self._lanes_given, lanes) if lanes else self._lanes_given
        if not lanes:
            raise RuntimeUnavailable(
                f"{self._what()} does not say how many sequences it runs at once; give the "
                "node --max-batch N (vLLM's --max-num-seqs)")
        window = layout.context_window
        if self._max_context is not None:
            window = min(window, self._max_context) if window else self._max_context
        if not window:
            raise RuntimeUnavailable(f"{self._what()} does not say its context length; give "
                                     "the node --max-context N")
        self.model_id = layout.model_id
        self.info = replace(self.info, lanes=lanes, context_window=window,
                            model=self._named or self.dialect.model_name(layout.model_id))
        self._lanes = [Lane(seq=i) for i in range(lanes)]

    async def close(self) -> None:
        if self._poller is not None:
            await cancel_and_wait([self._poller], "the engine's poller")
            self._poller = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- requests --------------------------------------------------------------------------

    async def _describe(self) -> Layout:
        answers: dict[str, object] = {}
        for path in self.dialect.info_paths:
            status, answer = await self._get(path, REQUEST_S)
            if status != 200:
                raise UpstreamAnswerError(f"{path} answered HTTP {status}")
            answers[path] = answer
        return self.dialect.layout(answers)

    async def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """The upstream's ids for ``text`` (no BOS)."""
        body = self.dialect.tokenize_body(self.model_id, text, special=special)
        status, answer = await self._request("POST", self.dialect.tokenize_path, REQUEST_S,
                                             body)
        if status != 200:
            raise UpstreamAnswerError(f"{self.dialect.tokenize_path} answered HTTP {status}")
        return self.dialect.tokens(answer)

    async def _get(self, path: str, timeout_s: float) -> tuple[int, object]:
        return await self._request("GET", path, timeout_s, None)

    async def _request(self, method: str, path: str, timeout_s: float,
                       body: dict[str, object] | None) -> tuple[int, object]:
        """(status, the answer: JSON parsed, /metrics as text, None when unreadable)."""
        assert self._session is not None
        async with asyncio.timeout(timeout_s), \
                self._session.request(method, self.url + path, json=body) as resp:
            data = await _read_bounded(resp.content, MAX_ANSWER)
            if resp.status != 200 or path == "/health":
                return resp.status, None
            if path == "/metrics":
                return resp.status, data.decode("utf-8", errors="replace")
            try:
                return resp.status, json.loads(data)
            except ValueError:
                raise UpstreamAnswerError(f"{path} answered something that is not "
                                          "JSON") from None

    # -- health and load ----------------------------------------------------------------

    async def _poll_answers(self) -> dict[str, object]:
        """The answers of the poll paths; raises when /health does not answer 200."""
        answers: dict[str, object] = {}
        async with asyncio.timeout(POLL_TIMEOUT_S * len(self.dialect.poll_paths)):
            for path in self.dialect.poll_paths:
                status, answer = await self._get(path, POLL_TIMEOUT_S)
                if path == "/health" and status != 200:
                    raise UpstreamAnswerError(f"/health answered HTTP {status}")
                if status == 200 and answer is not None:
                    answers[path] = answer
        return answers

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.poll()

    async def poll(self) -> None:
        """Ask the upstream how it is, once: up or down, and its load."""
        try:
            load = self.dialect.load(await self._poll_answers(),
                                     context_window=self.info.context_window,
                                     lanes=self.info.lanes)
            if self._down:
                layout = await self._describe()
                if layout.model_id != self.model_id:
                    self._set_down(f"{self._what()} now serves '{layout.model_id}', not "
                                   f"'{self.model_id}'; restart this node to serve it")
                    return
        except (aiohttp.ClientError, OSError, TimeoutError, UpstreamAnswerError) as exc:
            self._set_down(f"{self._what()} is not answering ({_why(exc)}); start it again")
            return
        if self._down:
            log.info("%s answers again; taking sessions", self._what())
            self._down = ""
            await self._renew_session()
        self._load = load
        if load.missing:
            self._tell(f"{self._what()} does not show {load.missing}; the node reports "
                       "what it can see")

    def _set_down(self, why: str) -> None:
        if why != self._down:
            log.warning("%s; taking no session until it answers", why)
        self._down = why
        for generation in list(self._live):  # a hung upstream: fail over now, not later
            generation.abort(why)

    async def _renew_session(self) -> None:
        """Fresh connections after an outage: the pooled ones went with the old process."""
        if self._busy or self._session is None:
            return
        old, self._session = self._session, _new_session()
        await old.close()

    def _tell(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            log.warning("%s", message)

    # -- the Engine protocol ---------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> UpstreamGeneration:
        if self._down:
            raise UpstreamFailed(self._down)
        if not request.prompt:
            raise ValueError("an empty prompt; send at least one token")
        free = [lane for lane in self._lanes if lane.seq not in self._busy]
        lane = pick_lane(free, request.prompt, request.session)
        if lane is None:
            raise RuntimeError(f"all {len(self._lanes)} lanes are busy")
        self._busy.add(lane.seq)
        # what the slot's cache holds of this prompt: what the upstream reuses, as long as
        # nobody else used that slot (its own count, when it says it, wins)
        reuse = common_prefix(lane.tokens, request.prompt) if self.dialect.uses_slots else 0
        lane.session = request.session
        lane.last_used = self._clock()
        lane.tokens = list(request.prompt)
        return UpstreamGeneration(self, request, lane,
                                  reuse=min(reuse, len(request.prompt) - 1))

    def stats(self) -> EngineStats:
        load = self._load
        recent = list(self._recent)
        lanes = self.info.lanes
        busy = lanes if self._down else len(self._busy)
        return EngineStats(
            lanes=lanes, lanes_busy=busy, kv_used=load.kv_used,
            kv_total=load.kv_total or self.info.context_window * lanes,
            prefill_tps=_median([r[1] for r in recent if r[1] > 0]),
            decode_tps=_median([r[2] for r in recent if r[2] > 0]),
            ttft_ms=_median([r[0] for r in recent]), down=self._down)

    # -- for generations -----------------------------------------------------------------

    def _finished(self, lane: Lane, ttft_ms: float, prefill_tps: float,
                  decode_tps: float) -> None:
        self._busy.discard(lane.seq)
        lane.last_used = self._clock()
        if ttft_ms > 0:
            self._recent.append((ttft_ms, prefill_tps, decode_tps))

    def _broken(self, why: str) -> None:
        """A stream broke on the connection: down until a poll says otherwise."""
        self._set_down(f"{self._what()} is not answering ({why}); start it again")


class UpstreamGeneration:
    """One completion streamed from the upstream (see the module's docstring)."""

    def __init__(self, engine: UpstreamEngine, request: GenerationRequest, lane: Lane, *,
                 reuse: int = 0) -> None:
        self._engine = engine
        self._reuse = reuse  # prompt tokens the slot is expected to hold already
        self._request = request
        self._lane = lane
        self._stop = request.stop_ids | engine.eos_ids
        self._response: aiohttp.ClientResponse | None = None
        self._cancelled = False
        self._failed = ""  # why the engine gave up on this stream (the upstream is down)
        self._freed = False
        self._result = GenerationResult("cancelled", len(request.prompt), 0)
        self._ttft_ms = 0.0
        self._prefill_tps = 0.0
        self._decode_tps = 0.0

    @property
    def result(self) -> GenerationResult:
        return self._result

    def cancel(self) -> None:
        self._cancelled = True
        if self._response is not None:
            self._response.close()  # the upstream sees the client go and stops
        self._free()

    def abort(self, why: str) -> None:
        """Fail the stream (it raises UpstreamFailed): its upstream stopped answering."""
        self._failed = why
        if self._response is not None:
            self._response.close()

    def _free(self) -> None:
        if not self._freed:
            self._freed = True
            self._engine._finished(self._lane, self._ttft_ms, self._prefill_tps,
                                   self._decode_tps)

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[list[int]]:
        eng = self._engine
        req = self._request
        dialect = eng.dialect
        clock = eng._clock
        started = clock()
        first_by = started + min(FIRST_TOKEN_S + len(req.prompt) / PREFILL_FLOOR_TPS,
                                 FIRST_EVENT_MAX_S)
        body = dialect.completion_body(req, model=eng.model_id,
                                       slot=self._lane.seq if dialect.uses_slots else None)
        produced = 0
        finish: FinishReason | None = None
        cached: int | None = None  # as the upstream says (it may not: a stop id cut it short)
        first_at = last_at = 0.0
        eng._live.add(self)
        try:
            if self._cancelled or eng._session is None:
                return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + (first_by - started)
            try:
                async with asyncio.timeout_at(deadline):
                    self._response = await eng._session.post(
                        eng.url + dialect.completion_path, json=body)
                resp = self._response
                if resp.status != 200:
                    text = (await _read_bounded(resp.content, 4096)).decode(errors="replace")
                    raise UpstreamFailed(f"{eng._what()} refused the generation: HTTP "
                                         f"{resp.status} {text[:300]}")
                parser = SseParser()
                done = False
                while not done and not self._cancelled:
                    async with asyncio.timeout_at(deadline):
                        data = await resp.content.readany()
                    if self._failed:
                        raise UpstreamFailed(self._failed)
                    if not data:
                        if finish is None and not self._cancelled:
                            raise UpstreamFailed(f"{eng._what()} ended the stream before the "
                                                 "generation ended")
                        break
                    deadline = loop.time() + TOKEN_GAP_S if produced else deadline
                    out: list[int] = []
                    for event in parser.feed(data):
                        chunk = dialect.chunk(event)
                        if chunk is None:
                            continue
                        cached = chunk.cached_tokens if chunk.cached_tokens is not None \
                            else cached
                        finish = chunk.finish or finish
                        done = done or chunk.done
                        for token in chunk.ids:
                            if token in self._stop:
                                finish, done = "stop", True
                                break
                            out.append(token)
                            if produced + len(out) >= req.max_tokens:
                                finish, done = "length", True
                                break
                        if done:
                            break
                    if out:
                        now = clock()
                        if not produced:
                            first_at = now
                            deadline = loop.time() + TOKEN_GAP_S
                        last_at = now
                        produced += len(out)
                        self._lane.tokens.extend(out)
                        yield out
            except TimeoutError:
                if not self._cancelled:
                    what = "the first token" if not produced else "the next token"
                    raise UpstreamFailed(f"{eng._what()} did not send {what} in time; "
                                         "treating it as hung") from None
            except (aiohttp.ClientError, OSError) as exc:
                if self._failed:
                    raise UpstreamFailed(self._failed) from None
                if not self._cancelled:
                    eng._broken(_why(exc))
                    raise UpstreamFailed(f"{eng._what()} broke off the generation "
                                         f"({_why(exc)})") from None
            except (UpstreamAnswerError, SseTooLarge) as exc:
                raise UpstreamFailed(f"{eng._what()}: {exc}") from None
        finally:
            eng._live.discard(self)
            if self._response is not None:
                self._response.close()  # a stop id or a cancel: the upstream stops too
            if first_at:
                self._ttft_ms = (first_at - started) * 1000
                if cached is None:
                    cached = self._reuse
                fresh = len(req.prompt) - cached
                self._prefill_tps = fresh / max(first_at - started, 1e-6) if fresh > 0 else 0.0
                if produced > 1 and last_at > first_at:
                    self._decode_tps = (produced - 1) / (last_at - first_at)
            self._result = GenerationResult(
                finish_reason="cancelled" if self._cancelled else (finish or "stop"),
                prompt_tokens=len(req.prompt), completion_tokens=produced,
                cached_tokens=min(cached or 0, len(req.prompt)), ttft_ms=self._ttft_ms,
                prefill_tps=self._prefill_tps, decode_tps=self._decode_tps)
            self._free()


def _new_session() -> aiohttp.ClientSession:
    # a connection per request: llama-server (0.3.36's llama.cpp) closes the connection
    # after a streamed /completion while announcing keep-alive, so a pooled one can be
    # dead when the next generation writes its request ("Can not write request body")
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_S),
        connector=aiohttp.TCPConnector(limit=0, force_close=True), auto_decompress=False)


async def _read_bounded(content: aiohttp.StreamReader, cap: int) -> bytes:
    """The whole body, refused past ``cap`` bytes (checked before each byte is kept)."""
    out = bytearray()
    while True:
        chunk = await content.readany()
        if not chunk:
            return bytes(out)
        if len(out) + len(chunk) > cap:
            raise UpstreamAnswerError(f"an answer larger than {cap} bytes")
        out += chunk


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"connection refused or unreachable: {exc.os_error.strerror or exc}"
    text = str(exc) or type(exc).__name__
    return text[:200]

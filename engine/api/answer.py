"""How every generating route answers a turn: the status while a refusal can still be
told, keepalives after.

Keepalives start the moment a request is accepted. A refusal that comes within
the commit time (a full fleet that gave up queueing, an oversized prompt) still
gets its status; past it the head commits to 200 and keeps the connection
alive, SSE comments for a stream and leading whitespace for one JSON answer
(JSON parsers skip it), until the first token or the answer is ready. A
failure after that is reported inside the answer.

A client that reads nothing (its socket's buffers full, so that a write waits for
room) gets ``write_timeout_s`` (the head's setting, WRITE_TIMEOUT_S by default; tests
shorten it on the Head): a write that makes no room for that long ends the answer and
drops the connection, which stops the session, frees its lane and its key's slot.

A route writes its shape through a :class:`Wire` and calls :func:`answer`; when to
commit and when to send a keepalive is :class:`Pace`, a pure function of the head's
clock.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from engine.api.context import ARRIVED
from engine.api.errors import error_body, refusal, status_for
from engine.api.metrics import METRICS
from engine.errors import RequestError, ShoalError
from engine.head.head import Head
from engine.head.prompt.tools import TextDelta
from engine.head.prompt.turn import ChatEvent, ChatFinal, Turn

log = logging.getLogger("shoal.api")
KEEPALIVE_S = 5.0
DISCONNECT_POLL_S = 0.5  # how soon a client that went away is noticed while nothing comes
WRITE_TIMEOUT_S = 30.0  # a write that finds no room for this long: the client reads nothing


class StalledClient(Exception):
    """The client read nothing of its answer for the write timeout."""


def write_timeout_s(head: Head) -> float:
    """How long one write may wait for the client to take what was written before."""
    value = getattr(head, "write_timeout_s", WRITE_TIMEOUT_S)
    return float(value) if value and value > 0 else WRITE_TIMEOUT_S


def keepalive_s(head: Head) -> float:
    value = getattr(head, "keepalive_s", KEEPALIVE_S)
    return float(value) if value and value > 0 else KEEPALIVE_S


def commit_s(head: Head) -> float:
    """How long a refusal can still be told by its status: by default until the first
    keepalive is due."""
    value = getattr(head, "commit_s", None)
    return keepalive_s(head) if value is None else max(0.0, float(value))


Quiet = Literal["wait", "commit", "keepalive"]


@dataclass(frozen=True, slots=True)
class Pace:
    """When a waiting answer commits to 200 and when it sends a keepalive; times are the
    head's clock, passed in."""

    commit_at: float
    keepalive_s: float

    def wait_s(self, now: float, *, committed: bool, committable: bool,
               last_write: float) -> float:
        """How long to wait for the turn's next event before :meth:`when_quiet`."""
        if not committed:
            # a request waiting for a node that may never come is not committed: it may
            # still be refused with its real status
            due = self.commit_at if committable else now + DISCONNECT_POLL_S
        else:
            due = last_write + self.keepalive_s
        return min(max(due - now, 0.0), DISCONNECT_POLL_S)

    def when_quiet(self, now: float, *, committed: bool, committable: bool,
                   last_write: float) -> Quiet:
        """What to do when no event came in time: keep waiting, commit to 200 (and send
        the first keepalive), or send a keepalive."""
        if not committed:
            return "commit" if committable and now >= self.commit_at else "wait"
        return "keepalive" if now - last_write >= self.keepalive_s else "wait"


class Wire:
    """How one route writes a turn's answer. Streaming wires turn each event into
    bytes as it comes; the others collect and write everything at the end."""

    streaming = False
    content_type = "application/json"
    keepalive = b" "

    def __init__(self, request: web.Request, head: Head, model: str) -> None:
        self.request = request
        self.head = head
        self.model = model  # the name the client asked for, echoed back
        self.clock: Callable[[], float] = head.runner.clock
        self.arrived = float(request.get(ARRIVED, self.clock()))
        self.first_at: float | None = None
        self.final: ChatFinal | None = None

    def begin(self) -> bytes:
        """Written once before the first event's bytes of a stream."""
        return b""

    def ping(self) -> bytes:
        """A keepalive, the first of which commits the answer to 200."""
        return self.keepalive

    def event(self, ev: ChatEvent) -> bytes:
        raise NotImplementedError

    def end(self) -> bytes:
        """The rest of the answer once the turn has ended (all of it for JSON)."""
        raise NotImplementedError

    def failed(self, exc: ShoalError) -> bytes:
        """A failure after the answer was committed to 200, in the route's shape."""
        status = status_for(exc)
        body = error_body(status, str(exc), code=exc.code)
        body["error"]["type"] = "server_error" if status >= 500 else body["error"]["type"]
        return json.dumps(body).encode()

    def refuse(self, exc: ShoalError, names: dict[str, str]) -> web.Response:
        return refusal(self.request, exc, names)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SSEWire(Wire):
    streaming = True
    content_type = "text/event-stream"
    keepalive = b": keepalive\n\n"

    def failed(self, exc: ShoalError) -> bytes:
        return b"data: " + super().failed(exc) + b"\n\n"


class CollectedJSON(Wire):
    """A non-streaming answer: the text is gathered and written once, at the end."""

    def __init__(self, request: web.Request, head: Head, model: str, cid: str) -> None:
        super().__init__(request, head, model)
        self.cid = cid
        self.text: list[str] = []

    def event(self, ev: ChatEvent) -> bytes:
        if isinstance(ev, TextDelta):
            self.text.append(ev.text)
        return b""


def usage(final: ChatFinal) -> dict[str, Any]:
    """Token counts in OpenAI's ``usage`` shape."""
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def answer(request: web.Request, head: Head, turn: Turn, wire: Wire,
                 names: dict[str, str]) -> web.StreamResponse:
    """Run ``turn`` and write its answer through ``wire``, with keepalives."""
    metrics = request.app[METRICS]
    clock = wire.clock
    pace = Pace(commit_at=wire.arrived + commit_s(head), keepalive_s=keepalive_s(head))
    pump = turn.reader()
    resp: web.StreamResponse | None = None
    last_write = clock()
    begun = False
    bound_s = write_timeout_s(head)

    async def bounded(step: Awaitable[object]) -> None:
        try:
            async with asyncio.timeout(bound_s):
                await step
        except TimeoutError:
            raise StalledClient from None

    async def commit() -> web.StreamResponse:
        r = web.StreamResponse(status=200, headers={
            "Content-Type": wire.content_type, "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", **names})
        await bounded(r.prepare(request))
        return r

    async def write(r: web.StreamResponse, data: bytes) -> None:
        await bounded(r.write(data))

    try:
        while True:
            wait = pace.wait_s(clock(), committed=resp is not None,
                               committable=turn.committable, last_write=last_write)
            try:
                ev = await pump.get(wait)
            except TimeoutError:
                if _gone(request):
                    log.info("client went away before session %s answered", turn.session)
                    metrics.stream_errors["client_disconnected"] += 1
                    return resp if resp is not None else web.Response(status=499)
                now = clock()
                todo = pace.when_quiet(now, committed=resp is not None,
                                       committable=turn.committable, last_write=last_write)
                if todo == "wait":
                    continue
                if resp is None:
                    resp = await commit()
                await write(resp, wire.ping())
                metrics.keepalives += 1
                last_write = now
                continue
            except ShoalError as exc:
                if resp is None:
                    return wire.refuse(exc, names)
                metrics.stream_errors[exc.code] += 1
                await write(resp, wire.failed(exc))
                break
            except Exception:
                if resp is None:
                    raise  # the 500 of the error middleware, logged there
                log.exception("unexpected error in session %s", turn.session)
                metrics.stream_errors["internal_error"] += 1
                await write(resp, wire.failed(RequestError(
                    "internal error; the head's log has the details", code="internal_error")))
                break
            if _gone(request):
                # an answer gathered for one write at the end writes nothing before it,
                # so only this notices a client gone while tokens flow: stop the session
                # (and free its lane) now rather than at the end of the generation
                log.info("client went away during session %s", turn.session)
                metrics.stream_errors["client_disconnected"] += 1
                return resp if resp is not None else web.Response(status=499)
            now = clock()
            if ev is None:  # the turn ended
                if resp is None and not wire.streaming:
                    return web.Response(body=wire.end(), status=200, headers={
                        "Content-Type": wire.content_type, **names})
                if resp is None:
                    resp = await commit()
                data = (wire.begin() if not begun and wire.streaming else b"") + wire.end()
                if data:
                    await write(resp, data)
                break
            if wire.first_at is None:
                wire.first_at = now
                metrics.ttft(now - wire.arrived)
            if isinstance(ev, ChatFinal):
                wire.final = ev
                if ev.node:
                    names["X-Shoal-Node"] = ev.node
                metrics.tokens(turn.model.name, ev.prompt_tokens, ev.completion_tokens,
                               ev.cached_tokens)
            data = wire.event(ev)
            if not wire.streaming:
                continue
            if resp is None:
                resp = await commit()
            if not begun:
                data = wire.begin() + data
                begun = True
            if data:
                await write(resp, data)
                last_write = now
        await bounded(resp.write_eof())
        return resp
    except StalledClient:
        log.info("client read nothing of session %s for %g s; dropping it", turn.session,
                 bound_s)
        metrics.stream_errors["client_stalled"] += 1
        transport = request.transport
        if transport is not None:
            transport.abort()  # what waits in its buffer is never going to be read
        return resp if resp is not None else web.Response(status=499)
    except ConnectionResetError:
        log.info("client went away during session %s", turn.session)
        metrics.stream_errors["client_disconnected"] += 1
        return resp if resp is not None else web.Response(status=499)
    finally:
        await pump.close()

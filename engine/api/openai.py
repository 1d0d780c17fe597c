"""OpenAI routes: /v1/chat/completions and /v1/models, and how every generating route
answers: the status while a refusal can still be told, keepalives after.

Keepalives start the moment a request is accepted. A refusal that comes within
the commit time (a full fleet that gave up queueing, an oversized prompt) still
gets its status; past it the head commits to 200 and keeps the connection
alive, SSE comments for a stream and leading whitespace for one JSON answer
(JSON parsers skip it), until the first token or the answer is ready. A
failure after that is reported inside the answer.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from engine.api.errors import STATUS, error_body, error_for, refusal, status_for
from engine.api.metrics import METRICS
from engine.api.schemas import BadRequest, ChatRequest, decode_chat, unsupported
from engine.api.turns import chat_request_turn
from engine.errors import RequestError, ShoalError
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.head.prompt.tools import TextDelta, ToolCallDelta
from engine.head.prompt.turn import ChatEvent, ChatFinal, EventPump, Routing, Turn

log = logging.getLogger("shoal.api")
HEAD: web.AppKey[Head] = web.AppKey("head", Head)
KEEPALIVE_S = 5.0
DISCONNECT_POLL_S = 0.5


def request_key(name: str, kind: type[Any]) -> Any:
    """A typed request key where aiohttp has them (3.13+), else a plain string."""
    make = getattr(web, "RequestKey", None)
    return make(name, kind) if make is not None else f"shoal.{name}"


ARRIVED = request_key("arrived", float)  # time.monotonic() when the request came in


def keepalive_s(head: Head) -> float:
    value = getattr(head, "keepalive_s", KEEPALIVE_S)
    return float(value) if value and value > 0 else KEEPALIVE_S


def commit_s(head: Head) -> float:
    """How long a refusal can still be told by its status: by default until the first
    keepalive is due."""
    value = getattr(head, "commit_s", None)
    return keepalive_s(head) if value is None else max(0.0, float(value))


def routing_of(request: web.Request) -> Routing:
    affinity = (request.headers.get("X-Session-Id")
                or request.headers.get("X-Session-Affinity") or None)
    pin = request.query.get("host") or None
    prefer_raw = request.query.get("prefer") or request.headers.get("X-Shoal-Prefer") or ""
    prefer = tuple(p.strip() for p in prefer_raw.split(",") if p.strip())[:16]
    return Routing(affinity=affinity[:256] if affinity else None,
                   pin_host=pin[:256] if pin else None, prefer=prefer)


# -- model names ---------------------------------------------------------------------


def resolve_model(head: Head, requested: str, *, ollama: bool = False) -> al.Resolution:
    """A request's model through the head (real model, loose names, aliases); Ollama's
    clients may add ``:latest`` to a name that has no tag."""
    found = head.resolve(requested)
    if found.unknown and ollama and requested.endswith(":latest"):
        bare = head.resolve(requested[: -len(":latest")])
        if not bare.unknown:
            return bare
    return found


def model_headers(found: al.Resolution) -> dict[str, str]:
    names: dict[str, str] = {}
    if found.model:
        names["X-Shoal-Model"] = found.model
    if found.alias:
        names["X-Shoal-Alias"] = found.alias
    return names


def refuse_resolution(request: web.Request, found: al.Resolution) -> web.Response | None:
    """The 404 or 503 answer when the name names nothing that can run, else None."""
    if found.model is not None and not found.unknown:
        return None
    code = "model_not_found" if found.unknown else "model_unavailable"
    return error_for(request, STATUS[code], found.message, code=code, param="model",
                     retry_after=found.retry_after, headers=model_headers(found))


def runnable(request: web.Request, head: Head, requested: str, *,
             ollama: bool = False) -> tuple[str, dict[str, str]] | web.Response:
    """The model a request's name runs and the X-Shoal-* headers, or the refusal."""
    found = resolve_model(head, requested, ollama=ollama)
    refused = refuse_resolution(request, found)
    if refused is not None:
        return refused
    assert found.model is not None
    return found.model, model_headers(found)


# -- answering a turn ----------------------------------------------------------------


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
        self.arrived = float(request.get(ARRIVED, time.monotonic()))
        self.first_at: float | None = None
        self.final: ChatFinal | None = None

    def begin(self) -> bytes:
        """Written once before the first event's bytes of a stream."""
        return b""

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


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def answer(request: web.Request, head: Head, turn: Turn, wire: Wire,
                 names: dict[str, str]) -> web.StreamResponse:
    """Run ``turn`` and write its answer through ``wire``, with keepalives."""
    metrics = request.app[METRICS]
    ka = keepalive_s(head)
    commit_at = wire.arrived + commit_s(head)
    pump = EventPump(turn.events())
    resp: web.StreamResponse | None = None
    last_write = time.monotonic()
    begun = False

    async def commit() -> web.StreamResponse:
        r = web.StreamResponse(status=200, headers={
            "Content-Type": wire.content_type, "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", **names})
        await r.prepare(request)
        return r

    try:
        while True:
            now = time.monotonic()
            if resp is None:
                # a request waiting for a node that may never come is not committed: it
                # may still be refused with its real status
                due = commit_at if turn.committable else now + DISCONNECT_POLL_S
            else:
                due = last_write + ka
            try:
                ev = await pump.get(min(max(due - now, 0.0), DISCONNECT_POLL_S))
            except TimeoutError:
                if _gone(request):
                    log.info("client went away before session %s answered", turn.session)
                    metrics.stream_errors["client_disconnected"] += 1
                    return resp if resp is not None else web.Response(status=499)
                now = time.monotonic()
                if resp is None:
                    if now < commit_at or not turn.committable:
                        continue
                    resp = await commit()
                elif now - last_write < ka:
                    continue
                await resp.write(wire.keepalive)
                metrics.keepalives += 1
                last_write = now
                continue
            except ShoalError as exc:
                if resp is None:
                    return wire.refuse(exc, names)
                metrics.stream_errors[exc.code] += 1
                await resp.write(wire.failed(exc))
                break
            except Exception:
                if resp is None:
                    raise  # the 500 of the error middleware, logged there
                log.exception("unexpected error in session %s", turn.session)
                metrics.stream_errors["internal_error"] += 1
                await resp.write(wire.failed(RequestError(
                    "internal error; the head's log has the details", code="internal_error")))
                break
            now = time.monotonic()
            if ev is None:  # the turn ended
                if resp is None and not wire.streaming:
                    return web.Response(body=wire.end(), status=200, headers={
                        "Content-Type": wire.content_type, **names})
                if resp is None:
                    resp = await commit()
                data = (wire.begin() if not begun and wire.streaming else b"") + wire.end()
                if data:
                    await resp.write(data)
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
                await resp.write(data)
                last_write = now
        await resp.write_eof()
        return resp
    except ConnectionResetError:
        log.info("client went away during session %s", turn.session)
        metrics.stream_errors["client_disconnected"] += 1
        return resp if resp is not None else web.Response(status=499)
    finally:
        await pump.close()


# -- /v1/chat/completions ------------------------------------------------------------


def _usage(final: ChatFinal) -> dict[str, Any]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SSEWire(Wire):
    streaming = True
    content_type = "text/event-stream"
    keepalive = b": keepalive\n\n"

    def failed(self, exc: ShoalError) -> bytes:
        return b"data: " + super().failed(exc) + b"\n\n"


class ChatStream(SSEWire):
    def __init__(self, request: web.Request, head: Head, req: ChatRequest, cid: str) -> None:
        super().__init__(request, head, req.model)
        self.cid = cid
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]})

    def begin(self) -> bytes:
        return self.chunk({"role": "assistant", "content": ""})

    def event(self, ev: ChatEvent) -> bytes:
        if isinstance(ev, TextDelta):
            return self.chunk({"content": ev.text}) if ev.text else b""
        if isinstance(ev, ToolCallDelta):
            call: dict[str, Any] = {"index": ev.index}
            if ev.id:
                call["id"] = ev.id
                call["type"] = "function"
            fn: dict[str, Any] = {}
            if ev.name:
                fn["name"] = ev.name
            fn["arguments"] = ev.arguments_fragment or ""
            call["function"] = fn
            return self.chunk({"tool_calls": [call]})
        out = self.chunk({}, ev.finish_reason)
        if self.include_usage:
            out += sse({"id": self.cid, "object": "chat.completion.chunk",
                        "created": self.created, "model": self.model, "choices": [],
                        "usage": _usage(ev)})
        return out

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"


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


class ChatJSON(CollectedJSON):
    def __init__(self, request: web.Request, head: Head, req: ChatRequest, cid: str) -> None:
        super().__init__(request, head, req.model, cid)

    def end(self) -> bytes:
        final = self.final
        assert final is not None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if final.tool_calls:
            message["tool_calls"] = final.tool_calls
            message["content"] = message["content"] or None
        body = {"id": self.cid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": final.finish_reason}],
                "usage": _usage(final)}
        return json.dumps(body).encode()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    body = await request.read()
    try:
        req = decode_chat(body)
    except BadRequest as exc:
        return error_for(request, 400, str(exc), code="invalid_request")
    problem = unsupported(req)
    if problem:
        return error_for(request, 400, problem, code="unsupported_parameter")
    resolved = runnable(request, head, req.model)
    if isinstance(resolved, web.Response):
        return resolved
    model_name, names = resolved
    try:
        turn = await chat_request_turn(head.models[model_name], head.runner, req,
                                       routing_of(request), tool_parser=head.tool_parser)
    except RequestError as exc:
        return refusal(request, exc, names)
    cid = "chatcmpl-" + turn.session[2:]
    wire: Wire = (ChatStream(request, head, req, cid) if req.stream
                  else ChatJSON(request, head, req, cid))
    return await answer(request, head, turn, wire, names)


# -- /v1/models ----------------------------------------------------------------------


def _model_entries(head: Head) -> list[dict[str, Any]]:
    served = head.served()
    data: list[dict[str, Any]] = [
        {"id": name, "object": "model", "created": head.started_wall, "owned_by": "shoal",
         "context_window": head.fleet.context_window(name)}
        for name in head.models if name in served]
    for entry in head.aliases.entries():
        found = head.resolve(entry.name)
        data.append({"id": entry.name, "object": "model", "created": int(entry.updated_at),
                     "owned_by": "shoal-alias", "alias_for": entry.target,
                     "fallbacks": list(entry.fallbacks), "resolves_to": found.model})
    return data


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _model_entries(request.app[HEAD])})


async def get_model(request: web.Request) -> web.Response:
    head = request.app[HEAD]
    wanted = request.match_info["model"]
    found = resolve_model(head, wanted)
    entries = _model_entries(head)
    for entry in entries:
        if entry["id"] == (found.alias or found.model):
            return web.json_response(entry, headers=model_headers(found))
    if found.model is not None and found.model in head.models:
        # known to the head but no node serves it now
        return web.json_response({"id": found.model, "object": "model",
                                  "created": head.started_wall, "owned_by": "shoal",
                                  "context_window": 0}, headers=model_headers(found))
    return error_for(request, 404, f"model {wanted!r} is neither served by a node nor an "
                     "alias; GET /v1/models lists the models and aliases",
                     code="model_not_found", param="model")

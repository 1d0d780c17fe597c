"""OpenAI routes: /v1/chat/completions and /v1/models."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from engine.api.errors import error_response
from engine.api.schemas import BadRequest, ChatRequest, decode_chat, unsupported
from engine.head.chat import ChatFinal, ChatTurn, Routing
from engine.head.head import Head
from engine.head.sessions import PlacementError
from engine.head.tools import TextDelta, ToolCallDelta

log = logging.getLogger("shoal.api")
HEAD: web.AppKey[Head] = web.AppKey("head", Head)


def routing_of(request: web.Request) -> Routing:
    affinity = (request.headers.get("X-Session-Id")
                or request.headers.get("X-Session-Affinity") or None)
    pin = request.query.get("host") or None
    prefer_raw = request.query.get("prefer") or request.headers.get("X-Shoal-Prefer") or ""
    prefer = tuple(p.strip() for p in prefer_raw.split(",") if p.strip())[:16]
    return Routing(affinity=affinity[:256] if affinity else None,
                   pin_host=pin[:256] if pin else None, prefer=prefer)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    body = await request.read()
    try:
        req = decode_chat(body)
    except BadRequest as exc:
        return error_response(400, str(exc), code="invalid_request")
    problem = unsupported(req)
    if problem:
        return error_response(400, problem, code="unsupported_parameter")
    found = head.resolve(req.model)
    if found.unknown or found.model is None:
        status, code = (404, "model_not_found") if found.unknown else (503, "model_unavailable")
        return error_response(status, found.message, code=code, param="model",
                              retry_after=found.retry_after)
    try:
        turn = ChatTurn(head.models[found.model], head.runner, req, routing_of(request),
                        tool_parser=head.tool_parser)
    except PlacementError as exc:
        return error_response(exc.status, str(exc), code=exc.code, retry_after=exc.retry_after)
    head.metrics.requests += 1
    names = {"X-Shoal-Model": found.model}
    if found.alias:
        names["X-Shoal-Alias"] = found.alias
    if req.stream:
        return await _stream(request, head, req, turn, names)
    return await _complete(head, req, turn, names)


def _usage(final: ChatFinal) -> dict[str, Any]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


async def _complete(head: Head, req: ChatRequest, turn: ChatTurn,
                    names: dict[str, str]) -> web.Response:
    text: list[str] = []
    final: ChatFinal | None = None
    try:
        async for ev in turn.events():
            if isinstance(ev, TextDelta):
                text.append(ev.text)
            elif isinstance(ev, ChatFinal):
                final = ev
    except PlacementError as exc:
        return error_response(exc.status, str(exc), code=exc.code, retry_after=exc.retry_after)
    assert final is not None
    head.metrics.completion_tokens += final.completion_tokens
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if final.tool_calls:
        message["tool_calls"] = final.tool_calls
        message["content"] = message["content"] or None
    body = {"id": "chatcmpl-" + turn.session[2:], "object": "chat.completion",
            "created": int(time.time()), "model": req.model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": final.finish_reason}],
            "usage": _usage(final)}
    return web.json_response(body, headers={"X-Shoal-Node": final.node, **names})


async def _stream(request: web.Request, head: Head, req: ChatRequest,
                  turn: ChatTurn, names: dict[str, str]) -> web.StreamResponse:
    events = turn.events()
    # place before answering 200, so a full fleet or an oversized prompt gets its status
    try:
        first = await anext(events)
    except PlacementError as exc:
        return error_response(exc.status, str(exc), code=exc.code, retry_after=exc.retry_after)
    except StopAsyncIteration:
        first = None
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **names})
    await resp.prepare(request)
    cid = "chatcmpl-" + turn.session[2:]
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created,
               "model": req.model,
               "choices": [{"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": finish}]}
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        await resp.write(chunk({"role": "assistant", "content": ""}))
        pending = [first] if first is not None else []
        async for ev in _chain(pending, events):
            if isinstance(ev, TextDelta):
                if ev.text:
                    await resp.write(chunk({"content": ev.text}))
            elif isinstance(ev, ToolCallDelta):
                call: dict[str, Any] = {"index": ev.index}
                if ev.id:
                    call["id"] = ev.id
                    call["type"] = "function"
                fn: dict[str, Any] = {}
                if ev.name:
                    fn["name"] = ev.name
                fn["arguments"] = ev.arguments_fragment or ""
                call["function"] = fn
                await resp.write(chunk({"tool_calls": [call]}))
            elif isinstance(ev, ChatFinal):
                head.metrics.completion_tokens += ev.completion_tokens
                await resp.write(chunk({}, ev.finish_reason))
                if include_usage:
                    obj = {"id": cid, "object": "chat.completion.chunk", "created": created,
                           "model": req.model, "choices": [], "usage": _usage(ev)}
                    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    except PlacementError as exc:
        err = {"error": {"message": str(exc), "type": "server_error", "code": exc.code}}
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away during session %s", turn.session)
        raise
    finally:
        await events.aclose()
    return resp


async def _chain(first: list[Any], rest: Any) -> Any:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def list_models(request: web.Request) -> web.Response:
    head = request.app[HEAD]
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
    return web.json_response({"object": "list", "data": data})

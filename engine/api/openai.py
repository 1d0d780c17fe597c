"""OpenAI routes: /v1/chat/completions and /v1/models."""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring_ascii
from typing import Any, NamedTuple

from aiohttp import web

from engine.api.answer import CollectedJSON, SSEWire, Wire, answer, sse, usage
from engine.api.context import (
    HEAD,
    Conversation,
    conversation_of,
    key_name_of,
    model_headers,
    resolve_model,
    routing_of,
    runnable,
)
from engine.api.errors import error_for, refusal
from engine.api.schemas import BadRequest, ChatRequest, decode_chat, unsupported
from engine.api.turns import BadField, chat_request_turn, openai_tool_choice, to_template_messages
from engine.errors import RequestError
from engine.head.head import Head
from engine.head.naming.names import match_name
from engine.head.prompt.model import capabilities
from engine.head.prompt.tools import TextDelta, ToolCallDelta
from engine.head.prompt.turn import ChatEvent, ToolChoice, off_loop

# -- /v1/chat/completions ------------------------------------------------------------


class ChatStream(SSEWire):
    def __init__(self, request: web.Request, head: Head, req: ChatRequest, cid: str) -> None:
        super().__init__(request, head, req.model)
        self.cid = cid
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # a text delta is most of a stream's events: its bytes are this template around
        # the escaped text, the same bytes chunk() makes, without a dict and a dumps each
        template = self.chunk({"content": ""})
        cut = template.rindex(b'"content":""') + len(b'"content":')
        self._text_head, self._text_tail = template[:cut], template[cut + 2:]

    def text_chunk(self, text: str) -> bytes:
        return self._text_head + encode_basestring_ascii(text).encode() + self._text_tail

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]})

    def begin(self) -> bytes:
        return self.chunk({"role": "assistant", "content": ""})

    def event(self, ev: ChatEvent) -> bytes:
        if isinstance(ev, TextDelta):
            return self.text_chunk(ev.text) if ev.text else b""
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
                        "usage": usage(ev)})
        return out

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"


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
                "usage": usage(final)}
        return json.dumps(body).encode()


class _Parsed(NamedTuple):
    req: ChatRequest
    problem: str | None  # what it asks that Shoal does not do
    choice: ToolChoice
    messages: list[dict[str, Any]]  # as templates read them
    conversation: Conversation


def _parsed(body: bytes, key_name: str) -> _Parsed:
    """The request taken apart for its turn; BadRequest or BadField when it cannot be
    taken."""
    req = decode_chat(body)
    problem = unsupported(req)
    if problem:
        return _Parsed(req, problem, ToolChoice(), [], conversation_of([]))
    messages = to_template_messages(req)
    return _Parsed(req, None, openai_tool_choice(req.tool_choice, req.tools), messages,
                   conversation_of(messages, key_name))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    body = await request.read()
    key_name = key_name_of(request)
    try:
        # off the loop when large: a body of many small messages takes long to decode
        parsed = await off_loop(len(body), lambda: _parsed(body, key_name))
    except BadRequest as exc:
        return error_for(request, 400, str(exc), code="invalid_request")
    except BadField as exc:
        return error_for(request, 400, str(exc), code="invalid_request", param=exc.param)
    req = parsed.req
    if parsed.problem:
        return error_for(request, 400, parsed.problem, code="unsupported_parameter")
    resolved = runnable(request, head, req.model)
    if isinstance(resolved, web.Response):
        return resolved
    model_name, names = resolved
    try:
        turn = await chat_request_turn(head.models[model_name], head.runner, req,
                                       routing_of(request, parsed.conversation),
                                       messages=parsed.messages, tool_choice=parsed.choice,
                                       tool_parser=head.tool_parser)
    except RequestError as exc:
        return refusal(request, exc, names)
    cid = "chatcmpl-" + turn.session[2:]
    wire: Wire = (ChatStream(request, head, req, cid) if req.stream
                  else ChatJSON(request, head, req, cid))
    return await answer(request, head, turn, wire, names)


# -- /v1/models ----------------------------------------------------------------------


def _described(head: Head, name: str | None) -> dict[str, Any]:
    """What a model can do and how much it holds (zeros and no capabilities when the
    head has no tokenizer for it, as for an alias pointing at another head's model)."""
    model = head.models.get(name) if name is not None else None
    if model is None:
        return {"context_window": 0, "context_length": 0, "capabilities": None}
    window = head.fleet.context_window(model.name)
    return {"context_window": window, "context_length": window,
            "capabilities": capabilities(model).flags()}


def _model_entries(head: Head) -> list[dict[str, Any]]:
    """``GET /v1/models``: the models some node serves now (``status: ready``) and the
    one this machine's node is loading (``status: loading``, ``available: false``: an
    editor that lists models as Shoal starts sees it), then every alias; an alias that
    nothing serves now says so (``available: false``)."""
    served = head.served()
    data: list[dict[str, Any]] = [
        {"id": name, "object": "model", "created": head.started_wall, "owned_by": "shoal",
         "available": name in served, "status": _status(head, name, served),
         # in some node's memory now; false: kept on a disk, loaded by the first request
         "loaded": head.fleet.loaded(name), **_described(head, name)}
        for name in head.models if name in served or name == head.local_model]
    for entry in head.aliases.entries():
        found = head.resolve(entry.name)
        target = found.model or match_name(entry.target or "", head.models)
        data.append({"id": entry.name, "object": "model", "created": int(entry.updated_at),
                     "owned_by": "shoal-alias", "alias_for": entry.target,
                     "fallbacks": list(entry.fallbacks), "resolves_to": found.model,
                     "available": found.model is not None,
                     "status": "ready" if found.model is not None
                     else _status(head, target, served),
                     **_described(head, target)})
    return data


def _status(head: Head, name: str | None, served: dict[str, bool]) -> str:
    """``ready``: a node serves it; ``loading``: this machine's node is getting it ready;
    ``unavailable``: neither."""
    if name is not None and name in served:
        return "ready"
    return "loading" if name is not None and name == head.local_model else "unavailable"


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
                                  "available": False, "status": "unavailable",
                                  **_described(head, found.model),
                                  "context_window": 0, "context_length": 0},
                                 headers=model_headers(found))
    return error_for(request, 404, f"model {wanted!r} is neither served by a node nor an "
                     "alias; GET /v1/models lists the models and aliases",
                     code="model_not_found", param="model")

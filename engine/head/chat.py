"""A chat completion on the head: messages to prompt ids, ids back to text and tool calls.

Nothing here touches HTTP; the API layer turns the events into JSON or SSE.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from engine.api.schemas import ChatRequest, message_text
from engine.head.model import HeadModel
from engine.head.sessions import Finish, Job, PlacementError, SessionRunner
from engine.head.templates import TemplateError
from engine.head.text import Detokenizer, StopMatcher
from engine.head.tools import TextDelta, ToolCallDelta, ToolCallParser, parser_for
from engine.link import messages as m


@dataclass(frozen=True, slots=True)
class Routing:
    affinity: str | None = None
    pin_host: str | None = None
    prefer: tuple[str, ...] = ()


@dataclass(slots=True)
class ChatFinal:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    node: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


ChatEvent = TextDelta | ToolCallDelta | ChatFinal


def to_template_messages(req: ChatRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for msg in req.messages:
        role = "system" if msg.role == "developer" else msg.role
        d: dict[str, Any] = {"role": role, "content": message_text(msg.content)}
        if msg.name:
            d["name"] = msg.name
        if msg.tool_calls:
            calls = []
            for call in msg.tool_calls:
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": _args(call.function.arguments)}})
            d["tool_calls"] = calls
        if msg.tool_call_id:
            d["tool_call_id"] = msg.tool_call_id
        out.append(d)
    return out


def _args(raw: str) -> Any:
    import json

    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return raw


def sampling_of(req: ChatRequest) -> m.SamplingParams:
    d = m.SamplingParams()
    return m.SamplingParams(
        temperature=d.temperature if req.temperature is None else req.temperature,
        top_p=d.top_p if req.top_p is None else req.top_p,
        top_k=d.top_k if req.top_k is None else req.top_k,
        min_p=d.min_p if req.min_p is None else req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repeat_penalty=1.0 if req.repeat_penalty is None else req.repeat_penalty)


def template_kwargs(req: ChatRequest) -> dict[str, Any]:
    """Thinking stays off for small reasoning models unless the request asks for it."""
    kwargs: dict[str, Any] = {"enable_thinking": False}
    if req.reasoning_effort and req.reasoning_effort not in ("none", "minimal"):
        kwargs["enable_thinking"] = True
    if req.chat_template_kwargs:
        kwargs.update(req.chat_template_kwargs)
    return kwargs


class ChatTurn:
    """Prepares one request and runs it, yielding text, tool-call deltas and a final."""

    def __init__(self, model: HeadModel, runner: SessionRunner, req: ChatRequest,
                 routing: Routing, *, tool_parser: str | None = None) -> None:
        self.model = model
        self.runner = runner
        self.req = req
        self.routing = routing
        try:
            self.prompt = model.render(to_template_messages(req), tools=req.tools,
                                       **template_kwargs(req))
        except TemplateError as exc:
            raise PlacementError(400, "invalid_request_error", str(exc)) from None
        window = runner.fleet.context_window(model.name)
        asked = req.max_completion_tokens or req.max_tokens
        room = max(window - len(self.prompt), 1)
        self.max_tokens = min(asked, room) if asked else room
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self._stops = stops
        self._parser: ToolCallParser | None = (
            parser_for(tool_parser, model.template.family) if req.tools else None)
        self.session = "s-" + secrets.token_hex(8)

    async def events(self) -> AsyncGenerator[ChatEvent, None]:
        detok = Detokenizer(self.model.vocab.token_bytes)
        stopper = StopMatcher(self._stops)
        parser = self._parser
        job = Job(session=self.session, model=self.model.name, prompt=self.prompt,
                  max_tokens=self.max_tokens,
                  sampling=sampling_of(self.req), stop_ids=sorted(self.model.stop_ids),
                  affinity=self.routing.affinity, pin_host=self.routing.pin_host,
                  prefer=self.routing.prefer)
        calls: list[dict[str, Any]] = []

        def emit(text: str) -> list[TextDelta | ToolCallDelta]:
            if not text:
                return []
            if parser is None:
                return [TextDelta(text)]
            return parser.feed(text)

        run = self.runner.run(job)
        produced = 0
        try:
            async for item in run:
                if isinstance(item, Finish):
                    tail, _ = stopper.feed(detok.flush())
                    out = emit(tail + stopper.flush())
                    if parser is not None:
                        out += parser.finish()
                    for ev in out:
                        _collect(calls, ev)
                        yield ev
                    reason = item.reason if item.reason in ("stop", "length") else "stop"
                    if calls:
                        reason = "tool_calls"
                    yield ChatFinal(finish_reason=reason, prompt_tokens=item.prompt_tokens,
                                    completion_tokens=item.completion_tokens,
                                    cached_tokens=item.cached_tokens, node=item.node,
                                    tool_calls=calls)
                    return
                produced += len(item)
                text, hit = stopper.feed(detok.feed(item))
                for ev in emit(text):
                    _collect(calls, ev)
                    yield ev
                if hit:
                    out = parser.finish() if parser is not None else []
                    for ev in out:
                        _collect(calls, ev)
                        yield ev
                    yield ChatFinal(finish_reason="tool_calls" if calls else "stop",
                                    prompt_tokens=len(self.prompt),
                                    completion_tokens=produced, cached_tokens=0, node="",
                                    tool_calls=calls)
                    return
        finally:
            await run.aclose()


def _collect(calls: list[dict[str, Any]], ev: TextDelta | ToolCallDelta) -> None:
    if not isinstance(ev, ToolCallDelta):
        return
    while len(calls) <= ev.index:
        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[ev.index]
    if ev.id:
        call["id"] = ev.id
    if ev.name:
        call["function"]["name"] = ev.name
    call["function"]["arguments"] += ev.arguments_fragment or ""

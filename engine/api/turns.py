"""Requests in the head's terms: template messages, template arguments, sampling, stops.

The head's prompt code knows nothing of request bodies; the routes turn theirs into
the plain values it takes (:func:`engine.head.prompt.turn.chat_turn`) here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import nesting
from engine.api.schemas import ChatRequest, SamplingRequest, message_text
from engine.head.fleet.sessions import SessionRunner
from engine.head.prompt.model import HeadModel
from engine.head.prompt.turn import Routing, ToolChoice, Turn, chat_turn
from engine.link import messages as m


class BadField(ValueError):
    """A request the head cannot take as sent: the message names the field and the fix."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Chat:
    """A conversation in the head's terms, from any route's body: template messages,
    tools (OpenAI's function shape), whether a tool must be called, and the text the
    answer begins with."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    choice: ToolChoice = field(default_factory=ToolChoice)
    prefill: str = ""
    parallel: bool = True  # False: only the answer's first tool call is kept


def tool_names(tools: Sequence[dict[str, Any]] | None) -> list[str]:
    out = []
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str):
            out.append(name)
    return out


def forced(name: str | None, tools: Sequence[dict[str, Any]] | None,
           param: str = "tool_choice") -> ToolChoice:
    """A required call (to ``name``, or any tool), checked against the tools offered."""
    if not tools:
        raise BadField(f"{param} asks for a tool call but the request offers no tools; "
                       "send tools, or leave tool_choice out", param)
    if name is not None and name not in tool_names(tools):
        raise BadField(f"{param} names the tool {name[:100]!r}, which is not among the "
                       "request's tools", param)
    return ToolChoice("required", name)


def openai_tool_choice(value: Any, tools: Sequence[dict[str, Any]] | None) -> ToolChoice:
    """Chat Completions' ``tool_choice``: none, auto, required, or one function."""
    if value is None or value == "auto":
        return ToolChoice()
    if value == "none":
        return ToolChoice("none")
    if value == "required":
        return forced(None, tools)
    if isinstance(value, dict):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type") == "function" and isinstance(name, str):
            return forced(name, tools)
        if value.get("type") == "allowed_tools":
            return ToolChoice()
    raise BadField("tool_choice must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def to_template_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The request's messages as chat templates read them (``developer`` is ``system``,
    tool-call arguments parsed from their JSON string)."""
    out: list[dict[str, Any]] = []
    for msg in req.messages:
        role = "system" if msg.role == "developer" else msg.role
        d: dict[str, Any] = {"role": role, "content": message_text(msg.content)}
        if msg.name:
            d["name"] = msg.name
        if msg.tool_calls:
            d["tool_calls"] = [{"id": call.id, "type": "function",
                                "function": {"name": call.function.name,
                                             "arguments": _args(call.function.arguments)}}
                               for call in msg.tool_calls]
        if msg.tool_call_id:
            d["tool_call_id"] = msg.tool_call_id
        out.append(d)
    return out


def _args(raw: str) -> Any:
    try:
        return nesting.json_loads(raw) if raw else {}
    except ValueError:
        return raw


def template_kwargs(req: ChatRequest) -> dict[str, Any]:
    """Thinking stays off for small reasoning models unless the request asks for it."""
    kwargs: dict[str, Any] = {"enable_thinking": False}
    if req.reasoning_effort and req.reasoning_effort not in ("none", "minimal"):
        kwargs["enable_thinking"] = True
    if req.chat_template_kwargs:
        kwargs.update(req.chat_template_kwargs)  # the head drops the ones it reserves
    return kwargs


def sampling_of(req: SamplingRequest) -> m.SamplingParams:
    """The request's sampler settings, with llama.cpp's defaults for what it leaves out."""
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


def stops_of(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


async def chat_request_turn(model: HeadModel, runner: SessionRunner, req: ChatRequest,
                            routing: Routing, *, messages: list[dict[str, Any]] | None = None,
                            tool_choice: ToolChoice | None = None,
                            tool_parser: str | None = None) -> Turn:
    """The Turn of a chat request (OpenAI's, or Ollama's turned into one); ``messages``
    when the caller has them already. Raises RequestError when the template refuses
    the messages or the prompt is empty."""
    if messages is None:
        messages = to_template_messages(req)
    return await chat_turn(model, runner, messages, routing=routing,
                           tools=req.tools, template_kwargs=template_kwargs(req),
                           sampling=sampling_of(req), stops=stops_of(req.stop),
                           max_tokens=req.max_completion_tokens or req.max_tokens,
                           tool_parser=tool_parser, requested=req.model,
                           tool_choice=tool_choice)

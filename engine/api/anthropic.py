"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

For agents that speak it (Claude Code with ``ANTHROPIC_BASE_URL=http://127.0.0.1:8453``):
a system prompt, turns of text, ``system`` messages among the turns (Claude Code's
mid-conversation system messages: they stay where they stand), ``tool_use`` and
``tool_result`` blocks, client tools and ``tool_choice``, ``stop_sequences`` and the
sampling fields. A final assistant turn is the answer's beginning (prefill): the model
continues it. Thinking blocks in earlier turns are dropped (as Anthropic does) and
thinking stays off; ``thinking``, ``output_config.effort``, ``context_management``,
``cache_control`` markers, ``metadata`` and the ``?beta=true`` query are taken and
ignored (none changes the prompt text); a structured-output format, image, document
and server-tool blocks are refused by name (400). Claude Code's billing-header block is
taken out before templating (engine.head.prompt.volatile).

Streams follow Anthropic's event sequence: ``message_start``, then per block
``content_block_start``, ``content_block_delta`` (``text_delta`` or
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason
and usage) and ``message_stop``; ``ping`` is the keepalive. Errors on these routes
are in Anthropic's shape (`engine.api.errors`).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from engine import nesting
from engine.api.answer import SSEWire, Wire, answer
from engine.api.context import (
    HEAD,
    Conversation,
    conversation_of,
    key_name_of,
    routing_of,
    runnable,
)
from engine.api.errors import anthropic_body, error_for, refusal, status_for
from engine.api.schemas import (
    AnthropicBlock,
    AnthropicCountRequest,
    AnthropicInnerBlock,
    AnthropicRequest,
    BadRequest,
    SamplingRequest,
    decode_as,
)
from engine.api.turns import BadField, Chat, forced, sampling_of
from engine.errors import RequestError, ShoalError
from engine.head.head import Head
from engine.head.prompt.tools import TextDelta, ToolCallDelta
from engine.head.prompt.turn import (
    ChatEvent,
    ChatFinal,
    ToolChoice,
    chat_prompt,
    chat_turn,
    off_loop,
)
from engine.head.prompt.volatile import without_volatile

_THINKING_OFF = {"enable_thinking": False}
_UNREADABLE = ("image", "document", "search_result", "container_upload")


# -- the request in the head's terms -----------------------------------------------


def _refuse_block(kind: str, where: str) -> BadField:
    if kind in _UNREADABLE:
        return BadField(f"{where}: {kind} blocks are not supported; Shoal's models read text "
                        f"only: send the {kind}'s content as text", where)
    return BadField(f"{where}: content blocks of type {kind[:64]!r} are not supported; send "
                    "text, tool_use and tool_result blocks", where)


def _inner_text(content: str | list[AnthropicInnerBlock] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for block in content:
        if block.type != "text":
            raise _refuse_block(block.type, where)
        parts.append(block.text or "")
    return "\n".join(parts)


def system_text(system: str | list[AnthropicBlock] | None, where: str = "system") -> str:
    """The system text, less the per-request lines agents put at its head
    (:func:`engine.head.prompt.volatile.without_volatile`), which would otherwise break
    every prompt cache shared between conversations."""
    if system is None or isinstance(system, str):
        return without_volatile(system or "")
    parts = []
    for block in system:
        if block.type != "text":
            raise _refuse_block(block.type, where)
        text = without_volatile(block.text or "")
        if text:
            parts.append(text)
    return "\n".join(parts)


def refused_field(req: AnthropicCountRequest) -> BadField | None:
    """A field the head cannot honour that would change the answer; everything else a
    client sends (thinking, effort, context_management, cache_control, metadata, the
    beta query) is taken and, where Shoal has no use for it, ignored."""
    fmt = (req.output_config or {}).get("format")
    if fmt is not None or req.output_format is not None:
        where = "output_config.format" if fmt is not None else "output_format"
        return BadField(f"{where}: structured output (a JSON schema the answer must follow) "
                        "is not supported; ask for JSON in the prompt and parse the text",
                        where)
    return None


def _turn(role: str, blocks: list[AnthropicBlock], where: str,
          names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic turn as template messages: a user turn's tool results become tool
    messages (before its text); an assistant turn's tool_use blocks its tool calls."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        at = f"{where}.content[{i}]"
        if block.type == "text":
            text.append(block.text or "")
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning: Anthropic drops it from the prompt too
        elif block.type == "tool_use" and role == "assistant":
            args = {} if block.input is None else block.input
            if not block.id or not block.name or not isinstance(args, dict):
                raise BadField(f"{at}: a tool_use block needs an id, a name and an input "
                               "object", at)
            names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": args}})
        elif block.type == "tool_result" and role == "user":
            if not block.tool_use_id:
                raise BadField(f"{at}: a tool_result block needs the tool_use_id it answers",
                               at)
            content = _inner_text(block.content, at)
            result: dict[str, Any] = {
                "role": "tool", "tool_call_id": block.tool_use_id,
                "content": f"Error: {content}" if block.is_error else content}
            if block.tool_use_id in names:
                result["name"] = names[block.tool_use_id]
            results.append(result)
        else:
            raise _refuse_block(block.type, at)
    out = list(results)
    if calls or text or not results:
        message: dict[str, Any] = {"role": role, "content": "\n".join(text)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def to_chat(req: AnthropicCountRequest) -> Chat:
    """A Messages request in the head's terms; BadField names what cannot be taken.

    A ``system`` message inside ``messages`` (Claude Code sends them) stays where it
    stands, as a system turn; the template decides how it is shown
    (engine.head.prompt.templates)."""
    problem = refused_field(req)
    if problem is not None:
        raise problem
    messages: list[dict[str, Any]] = []
    system = system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}
    for i, msg in enumerate(req.messages):
        if msg.role == "system":
            text = system_text(msg.content, f"messages[{i}]")
            if text:
                messages.append({"role": "system", "content": text})
        elif isinstance(msg.content, str):
            messages.append({"role": msg.role, "content": msg.content})
        else:
            messages.extend(_turn(msg.role, msg.content, f"messages[{i}]", names))
    if not any(m["role"] != "system" for m in messages):
        raise BadField("messages: send at least one user message (system messages alone "
                       "ask nothing)", "messages")
    prefill = ""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls") \
            and len(messages) > 1:
        prefill = str(messages.pop()["content"])  # the answer continues this text
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.type not in (None, "custom"):
                raise BadField(f"tools[{i}]: {tool.name[:64]!r} is a server tool "
                               f"({tool.type[:64]}), which Shoal does not run; offer client "
                               "tools (name, description, input_schema)", f"tools[{i}]")
            tools.append({"type": "function", "function": {
                "name": tool.name, "description": tool.description or "",
                "parameters": tool.input_schema or {"type": "object", "properties": {}}}})
    choice, parallel = ToolChoice(), True
    tc = req.tool_choice
    if tc is not None:
        parallel = not tc.disable_parallel_tool_use
        if tc.type == "none":
            choice = ToolChoice("none")
        elif tc.type == "any":
            choice = forced(None, tools)
        elif tc.type == "tool":
            if not tc.name:
                raise BadField("tool_choice of type 'tool' needs the tool's name",
                               "tool_choice")
            choice = forced(tc.name, tools)
    return Chat(messages=messages, tools=tools, choice=choice, prefill=prefill,
                parallel=parallel)


# -- the answer ----------------------------------------------------------------------


def _stop_reason(final: ChatFinal, any_call: bool) -> str:
    if any_call:
        return "tool_use"
    if final.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if final.stop_sequence else "end_turn"


def _usage(final: ChatFinal) -> dict[str, int]:
    """Anthropic counts the prompt in parts: read from the cache, and the rest."""
    return {"input_tokens": final.prompt_tokens - final.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": final.cached_tokens,
            "output_tokens": final.completion_tokens}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return (f"event: {name}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode()
            + b"\n\n")


PING = _event("ping", {"type": "ping"})


def _text_delta(index: int, text: str) -> bytes:
    """The one event of every token, written without building its dict."""
    return (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
            + str(index).encode() + b',"delta":{"type":"text_delta","text":'
            + json.dumps(text).encode() + b"}}\n\n")


class _Blocks:
    """The answer's content blocks as events come: a text block per run of text, a
    tool_use block per call. With ``stream``, ``events`` gets the bytes of each change."""

    def __init__(self, parallel: bool, *, stream: bool) -> None:
        self.parallel = parallel
        self.stream = stream
        self.content: list[dict[str, Any]] = []
        self.texts: dict[int, list[str]] = {}  # a text block's pieces, joined at the end
        self.events: list[bytes] = []
        self.open = False
        self.calls = 0

    def _close(self) -> None:
        if self.open:
            if self.stream:
                self.events.append(_event("content_block_stop", {
                    "type": "content_block_stop", "index": len(self.content) - 1}))
            self.open = False

    def text(self, text: str) -> None:
        if not text:
            return
        if not self.open or self.content[-1]["type"] != "text":
            self._close()
            self.content.append({"type": "text", "text": ""})
            self.texts[len(self.content) - 1] = []
            self.open = True
            if self.stream:
                self.events.append(_event("content_block_start", {
                    "type": "content_block_start", "index": len(self.content) - 1,
                    "content_block": {"type": "text", "text": ""}}))
        index = len(self.content) - 1
        self.texts[index].append(text)
        if self.stream:
            self.events.append(_text_delta(index, text))

    def call(self, ev: ToolCallDelta) -> None:
        if ev.index > 0 and not self.parallel:
            return  # disable_parallel_tool_use: the first call only
        self._close()
        args = ev.arguments_fragment or "{}"
        try:
            parsed = nesting.json_loads(args)
        except ValueError:
            parsed = {}
        self.content.append({"type": "tool_use", "id": ev.id or f"toolu_{ev.index}",
                             "name": ev.name or "", "input": parsed})
        index = len(self.content) - 1
        self.calls += 1
        if self.stream:
            self.events += [
                _event("content_block_start", {
                    "type": "content_block_start", "index": index,
                    "content_block": {**self.content[-1], "input": {}}}),
                _event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": args}}),
                _event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def finish(self) -> None:
        self._close()

    def blocks(self) -> list[dict[str, Any]]:
        return [{**block, "text": "".join(self.texts[i])} if i in self.texts else block
                for i, block in enumerate(self.content)]


class _Message:
    """What the stream and the JSON answer share: the message's id, model and blocks."""

    def __init__(self, mid: str, model: str, prompt_tokens: int, parallel: bool, *,
                 stream: bool) -> None:
        self.mid = mid
        self.shown_model = model
        self.prompt_tokens = prompt_tokens
        self.blocks = _Blocks(parallel, stream=stream)

    def feed(self, ev: ChatEvent) -> None:
        if isinstance(ev, TextDelta):
            self.blocks.text(ev.text)
        elif isinstance(ev, ToolCallDelta):
            self.blocks.call(ev)
        else:
            self.blocks.finish()

    def body(self, final: ChatFinal | None, *, content: bool) -> dict[str, Any]:
        usage = _usage(final) if final is not None else {
            "input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": 0}
        return {"id": self.mid, "type": "message", "role": "assistant",
                "model": self.shown_model,
                "content": self.blocks.blocks() if content else [],
                "stop_reason": _stop_reason(final, self.blocks.calls > 0) if final else None,
                "stop_sequence": final.stop_sequence if final else None,
                "usage": usage}


class MessagesStream(SSEWire):
    def __init__(self, request: web.Request, head: Head, model: str, mid: str,
                 prompt_tokens: int, parallel: bool) -> None:
        super().__init__(request, head, model)
        self.message = _Message(mid, model, prompt_tokens, parallel, stream=True)
        self.started = False

    def begin(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return _event("message_start", {"type": "message_start",
                                        "message": self.message.body(None, content=False)})

    def ping(self) -> bytes:
        # message_start leads even when the first thing written is a keepalive
        return self.begin() + PING

    def event(self, ev: ChatEvent) -> bytes:
        blocks = self.message.blocks
        self.message.feed(ev)
        if len(blocks.events) == 1:
            return blocks.events.pop()
        out = b"".join(blocks.events)
        blocks.events.clear()
        return out

    def end(self) -> bytes:
        final = self.final
        assert final is not None
        delta = {"stop_reason": _stop_reason(final, self.message.blocks.calls > 0),
                 "stop_sequence": final.stop_sequence}
        return (_event("message_delta", {"type": "message_delta", "delta": delta,
                                         "usage": _usage(final)})
                + _event("message_stop", {"type": "message_stop"}))

    def failed(self, exc: ShoalError) -> bytes:
        return _event("error", anthropic_body(status_for(exc), str(exc)))


class MessagesJSON(Wire):
    def __init__(self, request: web.Request, head: Head, model: str, mid: str,
                 prompt_tokens: int, parallel: bool) -> None:
        super().__init__(request, head, model)
        self.message = _Message(mid, model, prompt_tokens, parallel, stream=False)

    def event(self, ev: ChatEvent) -> bytes:
        self.message.feed(ev)
        return b""

    def end(self) -> bytes:
        return json.dumps(self.message.body(self.final, content=True)).encode()

    def failed(self, exc: ShoalError) -> bytes:
        return json.dumps(anthropic_body(status_for(exc), str(exc))).encode()


# -- routes --------------------------------------------------------------------------


def _sampling(req: AnthropicRequest) -> Any:
    return sampling_of(SamplingRequest(temperature=req.temperature, top_p=req.top_p,
                                       top_k=req.top_k))


def _decoded(kind: type[Any], body: bytes, key_name: str) -> tuple[Any, Chat, Conversation]:
    req = decode_as(kind, body)
    chat = to_chat(req)
    return req, chat, conversation_of(chat.messages, key_name)


async def _decode(request: web.Request, kind: type[Any]) -> Any:
    """The request and its chat, decoded off the loop when the body is large (a body of
    many small messages or tools takes long to decode and convert)."""
    body = await request.read()
    key_name = key_name_of(request)
    try:
        return await off_loop(len(body), lambda: _decoded(kind, body, key_name))
    except BadRequest as exc:
        return error_for(request, 400, str(exc), code="invalid_request")
    except BadField as exc:
        return error_for(request, 400, str(exc), code="invalid_request", param=exc.param)


async def messages(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    decoded = await _decode(request, AnthropicRequest)
    if isinstance(decoded, web.Response):
        return decoded
    req, chat, conversation = decoded
    resolved = runnable(request, head, req.model)
    if isinstance(resolved, web.Response):
        return resolved
    model_name, names = resolved
    try:
        turn = await chat_turn(head.models[model_name], head.runner, chat.messages,
                               routing=routing_of(request, conversation), tools=chat.tools,
                               template_kwargs=_THINKING_OFF, sampling=_sampling(req),
                               stops=req.stop_sequences or (), max_tokens=req.max_tokens,
                               tool_parser=head.tool_parser, requested=req.model,
                               tool_choice=chat.choice, prefill=chat.prefill)
    except RequestError as exc:
        return refusal(request, exc, names)
    mid = "msg_" + turn.session[2:]
    wire: Wire = (MessagesStream if req.stream else MessagesJSON)(
        request, head, req.model, mid, len(turn.prompt), chat.parallel)
    return await answer(request, head, turn, wire, names)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt tokens a Messages request with this body would use, counted by the
    model's own template and tokenizer (no node needed)."""
    head = request.app[HEAD]
    decoded = await _decode(request, AnthropicCountRequest)
    if isinstance(decoded, web.Response):
        return decoded
    req, chat, _conversation = decoded
    resolved = runnable(request, head, req.model)
    if isinstance(resolved, web.Response):
        return resolved
    model_name, names = resolved
    try:
        prompt, _parser = await chat_prompt(head.models[model_name], chat.messages,
                                            tools=chat.tools, template_kwargs=_THINKING_OFF,
                                            tool_parser=head.tool_parser,
                                            tool_choice=chat.choice, prefill=chat.prefill)
    except RequestError as exc:
        return refusal(request, exc, names)
    return web.json_response({"input_tokens": len(prompt)}, headers=names)

"""OpenAI's Responses API: ``POST /v1/responses``, stateless.

For Codex-style agents and Copilot's bring-your-own-key endpoint: ``instructions``,
``input`` as text or items (messages, ``developer`` ones as system turns,
``function_call`` and ``function_call_output``; ``reasoning`` items are dropped),
function tools, ``namespace`` tools (offered as the functions they hold, a call going
back with its namespace), hosted tools (``web_search`` and the like: left out of the
prompt and of the response, since OpenAI's servers would run them), ``tool_choice``,
``max_output_tokens``; ``include``, ``reasoning`` and ``client_metadata`` are taken and
ignored. The head keeps no responses (``store`` is always false): a
request naming ``previous_response_id`` or a ``conversation`` is refused with the
fix, send the whole conversation as input items. ``prompt_cache_key`` keeps a
conversation on the node that holds its prompt cache, like ``X-Session-Id``.

A stream is the Responses event sequence, every event numbered by
``sequence_number``: ``response.created``, ``response.in_progress``, then per output
item ``response.output_item.added``, its content (``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``; or ``response.function_call_arguments.delta`` and
``.done``) and ``response.output_item.done``; last ``response.completed``, or
``response.incomplete`` when ``max_output_tokens`` cut the answer, or
``response.failed``. Keepalives are SSE comments.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
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
from engine.api.errors import error_for, refusal
from engine.api.schemas import (
    BadRequest,
    ResponsesItem,
    ResponsesPart,
    ResponsesRequest,
    ResponsesTool,
    SamplingRequest,
    decode_as,
)
from engine.api.turns import BadField, Chat, forced, sampling_of
from engine.errors import RequestError, ShoalError
from engine.head.head import Head
from engine.head.prompt.tools import TextDelta, ToolCallDelta
from engine.head.prompt.turn import ChatEvent, ChatFinal, ToolChoice, chat_turn, off_loop

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text")
_UNREADABLE = ("input_image", "input_file", "input_audio")

# -- the request in the head's terms -----------------------------------------------


def _text(content: str | list[ResponsesPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.type in _TEXT_PARTS:
            parts.append(part.text or "")
        elif part.type == "refusal":
            continue
        elif part.type in _UNREADABLE:
            kind = part.type.removeprefix("input_")
            raise BadField(f"{where}.content[{i}]: {kind} input is not supported; Shoal's "
                           f"models read text only: send the {kind}'s content as text",
                           f"{where}.content[{i}]")
        else:
            raise BadField(f"{where}.content[{i}]: content parts of type {part.type[:64]!r} "
                           "are not supported; send input_text parts", f"{where}.content[{i}]")
    return "\n".join(parts)


def _arguments(raw: str | None) -> Any:
    """A call's arguments as templates read them: the object, or the text when it is not
    JSON."""
    try:
        return nesting.json_loads(raw) if raw else {}
    except ValueError:
        return raw


def _items(items: list[ResponsesItem], messages: list[dict[str, Any]]) -> None:
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.type or ("message" if item.role else "")
        if kind == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise BadField(f"{at}: a message's role is user, assistant, system or "
                               "developer", at)
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content, at)})
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise BadField(f"{at}: a function_call item needs its call_id and name", at)
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments)}}
            if item.namespace:
                call["namespace"] = item.namespace  # named as the model knows it later
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # text then calls: one turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id:
                raise BadField(f"{at}: a function_call_output item needs the call_id it "
                               "answers", at)
            result: dict[str, Any] = {"role": "tool", "tool_call_id": item.call_id,
                                      "content": _text(item.output, at)}
            name = item.name or names.get(item.call_id)
            if name:
                result["name"] = name
            messages.append(result)
        elif kind == "reasoning":
            continue  # earlier reasoning: not part of the next prompt
        elif kind == "item_reference":
            raise BadField(f"{at}: item_reference needs stored responses, and this head "
                           "keeps none; send the items themselves", at)
        else:
            raise BadField(f"{at}: input items of type {kind[:64]!r} are not supported; send "
                           "message, function_call and function_call_output items", at)


# Tools that OpenAI's servers run for the model: a client that offers them (Codex offers
# web_search) expects them done by someone else, so they are left out of the prompt, and
# out of the response's tools: the model is never told it has them, and nothing claims
# that they ran.
HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter",
          "image_generation", "computer_use", "computer_use_preview", "mcp")
MAX_TOOLS = 512  # functions offered to the model, namespaces' members included


def _hosted(kind: str) -> bool:
    return any(kind == h or kind.startswith(h + "_") for h in HOSTED)


def _function(tool: ResponsesTool, at: str) -> dict[str, Any]:
    if tool.type != "function" or not tool.name:
        what = "a function tool needs a name" if tool.type == "function" else \
            f"tools of type {tool.type[:64]!r} are not supported"
        raise BadField(f"{at}: {what}; Shoal offers function tools (type, name, description, "
                       "parameters), namespaces of them, and leaves hosted tools out", at)
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description or "",
        "parameters": tool.parameters or {"type": "object", "properties": {}}}}


@dataclass
class Offered:
    """The tools as the model sees them (function tools, a namespace's members among
    them), which namespace each of its names belongs to, and the request's tools less the
    hosted ones (what the response says it offered)."""

    tools: list[dict[str, Any]] | None = None
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)  # seen -> (ns, name)
    shown: list[dict[str, Any]] = field(default_factory=list)

    def called(self, seen: str) -> tuple[str | None, str]:
        """A call of ``seen`` as the client named it: (its namespace, its name)."""
        ns, name = self.namespaces.get(seen, (None, seen))
        return ns, name

    def seen_name(self, namespace: str | None, name: str) -> str:
        """The name the model knows a client's (namespace, name) by."""
        if namespace:
            for seen, (ns, inner) in self.namespaces.items():
                if ns == namespace and inner == name:
                    return seen
        return name


def offered(req: ResponsesRequest) -> Offered:
    """The request's tools in the head's terms. A ``namespace`` tool's functions are offered
    under their own names (as ``namespace.name`` where a name is taken twice), and a call
    of one goes back to the client with its namespace; hosted tools are left out."""
    if not req.tools:
        return Offered()
    # counted before anything is built: 512 namespaces of 512 would be 262,144 functions
    total = sum(len(t.tools or ()) if t.type == "namespace" else 1 for t in req.tools)
    if total > MAX_TOOLS:
        raise BadField(f"tools: {total} functions offered, at most {MAX_TOOLS}; offer fewer",
                       "tools")
    out: list[dict[str, Any]] = []
    found = Offered()
    members: list[tuple[str, ResponsesTool, str]] = []
    for i, tool in enumerate(req.tools):
        at = f"tools[{i}]"
        if _hosted(tool.type):
            continue
        if tool.type == "namespace":
            if not tool.name or not tool.tools:
                raise BadField(f"{at}: a namespace tool needs a name and its tools", at)
            for j, inner in enumerate(tool.tools):
                members.append((tool.name, inner, f"{at}.tools[{j}]"))
            found.shown.append({"type": "namespace", "name": tool.name,
                                "description": tool.description or "",
                                "tools": [_shown(_function(t, at)) for t in tool.tools]})
        else:
            out.append(_function(tool, at))
            found.shown.append(_shown(out[-1]))
    taken = {t["function"]["name"] for t in out}
    for ns, inner, at in members:
        fn = _function(inner, at)
        name = fn["function"]["name"]
        seen = name if name not in taken else f"{ns}.{name}"
        if seen in taken:
            raise BadField(f"{at}: the tool name {seen[:64]!r} is offered twice", at)
        taken.add(seen)
        fn["function"]["name"] = seen
        found.namespaces[seen] = (ns, name)
        out.append(fn)
    found.tools = out or None
    return found


def _shown(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    return {"type": "function", "name": fn["name"], "description": fn["description"],
            "parameters": fn["parameters"], "strict": False}


def _choice(req: ResponsesRequest, tools: list[dict[str, Any]] | None) -> ToolChoice:
    tc = req.tool_choice
    if tc is None or tc == "auto":
        return ToolChoice()
    if tc == "none":
        return ToolChoice("none")
    if tc == "required":
        return forced(None, tools)
    if not isinstance(tc, str):
        if tc.type == "function" and tc.name:
            return forced(tc.name, tools)
        if tc.type == "allowed_tools":
            return ToolChoice()
    raise BadField('tool_choice must be "none", "auto", "required" or {"type": "function", '
                   '"name": ...}', "tool_choice")


def refused_field(req: ResponsesRequest) -> BadField | None:
    """The first field of a Responses request that the head cannot honour."""
    if req.previous_response_id:
        return BadField("previous_response_id: this head keeps no responses (it answers as "
                        "with store: false); send the whole conversation as input items",
                        "previous_response_id")
    if req.conversation is not None:
        return BadField("conversation: this head keeps no conversations; send the whole "
                        "conversation as input items", "conversation")
    if req.background:
        return BadField("background responses are not supported (nothing is stored to poll); "
                        "send the request with stream: true instead", "background")
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        return BadField("text.format other than text is not supported; ask for JSON in the "
                        "instructions", "text.format")
    if req.top_logprobs:
        return BadField("top_logprobs is not supported", "top_logprobs")
    return None


def to_chat(req: ResponsesRequest) -> Chat:
    """A Responses request in the head's terms; BadField names what cannot be taken."""
    return convert(req)[0]


def convert(req: ResponsesRequest) -> tuple[Chat, Offered]:
    """The request in the head's terms, and the tools as offered to the model."""
    problem = refused_field(req)
    if problem is not None:
        raise problem
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        if req.input:
            messages.append({"role": "user", "content": req.input})
    else:
        _items(req.input, messages)
    if not any(m["role"] != "system" for m in messages):
        raise BadField("input is empty; send the user's text or input items", "input")
    tools = offered(req)
    _name_calls(messages, tools)
    return Chat(messages=messages, tools=tools.tools, choice=_choice(req, tools.tools),
                parallel=req.parallel_tool_calls is not False), tools


def _name_calls(messages: list[dict[str, Any]], tools: Offered) -> None:
    """Earlier calls of a namespace's tools under the names the model knows them by."""
    for m in messages:
        for call in m.get("tool_calls", ()):
            fn = call["function"]
            fn["name"] = tools.seen_name(call.pop("namespace", None), fn["name"])


def _template_kwargs(req: ResponsesRequest) -> dict[str, Any]:
    effort = req.reasoning.effort if req.reasoning else None
    return {"enable_thinking": bool(effort) and effort not in ("none", "minimal")}


# -- the answer ----------------------------------------------------------------------


def usage(final: ChatFinal) -> dict[str, Any]:
    return {"input_tokens": final.prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.cached_tokens},
            "output_tokens": final.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.prompt_tokens + final.completion_tokens}


def _shown_choice(tc: str | Any) -> Any:
    if tc is None:
        return "auto"
    if isinstance(tc, str):
        return tc
    return {"type": tc.type, **({"name": tc.name} if tc.name else {})}


Delta = tuple[str, int, str]  # a text delta's item id, output index and text


class _Output:
    """The response being written: its output items as events come, and each step as
    (event type, fields) in ``events`` (a text delta, the one event of every token, as
    a `Delta` that the stream writes without building its dict)."""

    def __init__(self, rid: str, req: ResponsesRequest, tools: Offered,
                 parallel: bool) -> None:
        self.rid = rid
        self.req = req
        self.parallel = parallel
        self.created = int(time.time())
        self.offered = tools
        self.tools = tools.shown
        self.items: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any] | Delta]] = []
        self.text: dict[str, Any] | None = None  # the message item being written
        self.parts: list[str] = []  # its text so far, joined when it is done
        self.calls = 0

    def response(self, status: str, final: ChatFinal | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        output: list[dict[str, Any]] = []
        if status != "in_progress":
            output = copy.deepcopy(self.items)
            if self.text is not None:  # failed while writing it: what was written
                output[self.items.index(self.text)]["content"][0]["text"] = "".join(self.parts)
        return {
            "id": self.rid, "object": "response", "created_at": self.created,
            "status": status, "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": req.model, "output": output,
            "parallel_tool_calls": self.parallel, "previous_response_id": None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": None},
            "store": False, "temperature": req.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": _shown_choice(req.tool_choice), "tools": self.tools,
            "top_p": req.top_p, "truncation": "disabled",
            "usage": usage(final) if final is not None else None,
            "user": req.user, "metadata": req.metadata or {}}

    def _add(self, item: dict[str, Any]) -> int:
        self.items.append(item)
        index = len(self.items) - 1
        self.events.append(("response.output_item.added",
                            {"output_index": index, "item": copy.deepcopy(item)}))
        return index

    def _close_text(self) -> None:
        item = self.text
        if item is None:
            return
        self.text = None
        index = self.items.index(item)
        part = item["content"][0]
        part["text"] = "".join(self.parts)
        self.parts = []
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        item["status"] = "completed"
        self.events += [
            ("response.output_text.done", {**where, "text": part["text"], "logprobs": []}),
            ("response.content_part.done", {**where, "part": dict(part)}),
            ("response.output_item.done", {"output_index": index,
                                           "item": copy.deepcopy(item)})]

    def feed(self, ev: ChatEvent) -> None:
        if isinstance(ev, TextDelta):
            if not ev.text:
                return
            if self.text is None:
                self.text = {"id": f"msg_{self.rid[5:]}_{len(self.items)}", "type": "message",
                             "status": "in_progress", "role": "assistant", "content": []}
                index = self._add(self.text)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.text["content"].append(part)
                self.events.append(("response.content_part.added", {
                    "item_id": self.text["id"], "output_index": index, "content_index": 0,
                    "part": dict(part)}))
            self.parts.append(ev.text)
            self.events.append(("response.output_text.delta",
                                (self.text["id"], len(self.items) - 1, ev.text)))
        elif isinstance(ev, ToolCallDelta):
            if ev.index > 0 and not self.parallel:
                return  # parallel_tool_calls false: the first call only
            self._close_text()
            args = ev.arguments_fragment or "{}"
            namespace, name = self.offered.called(ev.name or "")
            item = {"id": f"fc_{self.rid[5:]}_{len(self.items)}", "type": "function_call",
                    "status": "in_progress", "call_id": ev.id or f"call_{ev.index}",
                    "name": name, "arguments": ""}
            if namespace is not None:
                item["namespace"] = namespace
            index = self._add(item)
            item["arguments"] = args
            item["status"] = "completed"
            self.events += [
                ("response.function_call_arguments.delta",
                 {"item_id": item["id"], "output_index": index, "delta": args}),
                ("response.function_call_arguments.done",
                 {"item_id": item["id"], "output_index": index, "name": item["name"],
                  "arguments": args}),
                ("response.output_item.done", {"output_index": index,
                                               "item": copy.deepcopy(item)})]
            self.calls += 1
        else:
            self._close_text()

    def status(self, final: ChatFinal) -> str:
        return "incomplete" if final.finish_reason == "length" and not self.calls \
            else "completed"


class ResponsesStream(SSEWire):
    def __init__(self, request: web.Request, head: Head, output: _Output) -> None:
        super().__init__(request, head, output.req.model)
        self.output = output
        self.seq = 0
        self.started = False

    def _event(self, kind: str, fields: dict[str, Any] | Delta) -> bytes:
        seq = self.seq
        self.seq += 1
        if isinstance(fields, tuple):  # a text delta: the one event of every token
            item_id, index, text = fields
            return (b'event: response.output_text.delta\ndata: {"type":"response.output_text'
                    b'.delta","sequence_number":' + str(seq).encode() + b',"item_id":"'
                    + item_id.encode() + b'","output_index":' + str(index).encode()
                    + b',"content_index":0,"delta":' + json.dumps(text).encode()
                    + b',"logprobs":[]}\n\n')
        data = {"type": kind, "sequence_number": seq, **fields}
        return (f"event: {kind}\ndata: ".encode()
                + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")

    def _flush(self) -> bytes:
        events = self.output.events
        if len(events) == 1:
            kind, fields = events.pop()
            return self._event(kind, fields)
        out = b"".join(self._event(kind, fields) for kind, fields in events)
        events.clear()
        return out

    def begin(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        created = self.output.response("in_progress")
        return (self._event("response.created", {"response": created})
                + self._event("response.in_progress", {"response": created}))

    def ping(self) -> bytes:
        # response.created leads even when the first thing written is a keepalive
        return self.begin() + self.keepalive

    def event(self, ev: ChatEvent) -> bytes:
        first = self.begin()  # numbered before this event's own
        self.output.feed(ev)
        return first + self._flush()

    def end(self) -> bytes:
        final = self.final
        assert final is not None
        status = self.output.status(final)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return self._flush() + self._event(kind, {
            "response": self.output.response(status, final)})

    def failed(self, exc: ShoalError) -> bytes:
        self.output.events.clear()
        error = {"code": "server_error", "message": str(exc)}
        return self._event("response.failed", {
            "response": self.output.response("failed", error=error)})


class ResponsesJSON(Wire):
    def __init__(self, request: web.Request, head: Head, output: _Output) -> None:
        super().__init__(request, head, output.req.model)
        self.output = output

    def event(self, ev: ChatEvent) -> bytes:
        self.output.feed(ev)
        return b""

    def end(self) -> bytes:
        final = self.final
        assert final is not None
        return json.dumps(self.output.response(self.output.status(final), final)).encode()


# -- the route -----------------------------------------------------------------------


def _decoded(body: bytes, key_name: str) -> tuple[ResponsesRequest, Chat, Offered,
                                                   Conversation]:
    req: ResponsesRequest = decode_as(ResponsesRequest, body)
    chat, tools = convert(req)
    return req, chat, tools, conversation_of(chat.messages, key_name)


async def responses(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    body = await request.read()
    key_name = key_name_of(request)
    try:
        # off the loop when large: a body of many small items takes long to decode
        req, chat, tools, conversation = await off_loop(len(body),
                                                        lambda: _decoded(body, key_name))
    except BadRequest as exc:
        return error_for(request, 400, str(exc), code="invalid_request")
    except BadField as exc:
        return error_for(request, 400, str(exc), code="invalid_request", param=exc.param)
    resolved = runnable(request, head, req.model)
    if isinstance(resolved, web.Response):
        return resolved
    model_name, names = resolved
    sampling = sampling_of(SamplingRequest(temperature=req.temperature, top_p=req.top_p))
    try:
        turn = await chat_turn(head.models[model_name], head.runner, chat.messages,
                               routing=routing_of(request, conversation,
                                                  cache_key=req.prompt_cache_key),
                               tools=chat.tools, template_kwargs=_template_kwargs(req),
                               sampling=sampling, max_tokens=req.max_output_tokens,
                               tool_parser=head.tool_parser, requested=req.model,
                               tool_choice=chat.choice)
    except RequestError as exc:
        return refusal(request, exc, names)
    output = _Output("resp_" + turn.session[2:], req, tools, chat.parallel)
    wire: Wire = (ResponsesStream(request, head, output) if req.stream
                  else ResponsesJSON(request, head, output))
    return await answer(request, head, turn, wire, names)

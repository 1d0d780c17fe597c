"""Ollama's native routes: /api/chat, /api/generate, /api/tags, /api/show, /api/ps,
/api/version.

Shaped as Ollama answers them, so its clients and the tools built on them work
unchanged: NDJSON streams by default (``"stream": false`` for one JSON object),
durations in nanoseconds, ``done_reason``, and errors as ``{"error": "..."}``.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from engine import __version__, nesting
from engine.api.answer import Wire, answer
from engine.api.context import (
    HEAD,
    Conversation,
    conversation_of,
    keep_alive_of,
    key_name_of,
    routing_of,
    runnable,
)
from engine.api.errors import ollama_error, refusal
from engine.api.schemas import (
    BadRequest,
    ChatRequest,
    Message,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    OllamaShowRequest,
    SamplingRequest,
    ToolCall,
    ToolCallFunction,
    decode_as,
    unsupported_ollama,
)
from engine.api.turns import chat_request_turn, sampling_of, to_template_messages
from engine.errors import RequestError, ShoalError
from engine.head.fleet.sessions import Job
from engine.head.head import Head
from engine.head.observe import node_snapshot
from engine.head.prompt.model import HeadModel, capabilities
from engine.head.prompt.tools import TextDelta, ToolCallDelta
from engine.head.prompt.turn import (
    ChatEvent,
    Turn,
    completion_prompt_ids,
    off_loop,
    render_prompt,
)
from engine.snapshot import NodeSnapshot

# the Ollama API version these routes follow; clients that check a minimum version
# (for tools, thinking, suffix) compare against it
OLLAMA_API_VERSION = "0.12.0"
_QUANT = re.compile(r"(?i)(?:^|[.\-_])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32)$")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _think(value: bool | str | None) -> dict[str, Any]:
    """Ollama's ``think``: off unless asked (small reasoning models spend their budget)."""
    if value is None:
        return {}
    return {"chat_template_kwargs": {"enable_thinking": value is not False}}


def _max_tokens(options: OllamaOptions | None) -> int | None:
    n = options.num_predict if options else None
    return n if n is not None and n > 0 else None  # -1 and -2: until the window is full


def _stops(options: OllamaOptions | None) -> list[str]:
    stop = options.stop if options else None
    return [stop] if isinstance(stop, str) else list(stop or [])


def _sampling_fields(options: OllamaOptions | None) -> dict[str, Any]:
    if options is None:
        return {}
    return {k: getattr(options, k) for k in (
        "temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty",
        "presence_penalty", "frequency_penalty") if getattr(options, k) is not None}


class _Ollama(Wire):
    """Chunks as Ollama writes them; the last one carries ``done`` and the timings."""

    key = "response"

    def __init__(self, request: web.Request, head: Head, model: str, *,
                 stream: bool) -> None:
        super().__init__(request, head, model)
        self.streaming = stream
        self.content_type = "application/x-ndjson" if stream else "application/json"
        self.text: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def piece(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"model": self.model, "created_at": _now(), self.key: text, "done": False}

    def line(self, obj: dict[str, Any]) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode() + b"\n"

    def event(self, ev: ChatEvent) -> bytes:
        if isinstance(ev, TextDelta):
            if not self.streaming:
                self.text.append(ev.text)
                return b""
            return self.line(self.piece(ev.text)) if ev.text else b""
        if isinstance(ev, ToolCallDelta):
            call = {"function": {"name": ev.name or "",
                                 "arguments": _arguments(ev.arguments_fragment)}}
            if not self.streaming:
                self.calls.append(call)
                return b""
            return self.line(self.piece("", [call]))
        return b""

    def done(self) -> dict[str, Any]:
        final = self.final
        assert final is not None
        end = self.clock()
        first = self.first_at if self.first_at is not None else end
        body = self.piece("".join(self.text), self.calls or None)
        body.update({
            "done": True, "done_reason": "length" if final.finish_reason == "length" else "stop",
            "total_duration": _ns(end - self.arrived), "load_duration": 0,
            "prompt_eval_count": final.prompt_tokens,
            "prompt_eval_duration": _ns(first - self.arrived),
            "eval_count": final.completion_tokens, "eval_duration": _ns(end - first)})
        return body

    def end(self) -> bytes:
        body = self.done()
        return self.line(body) if self.streaming else json.dumps(body).encode()

    def failed(self, exc: ShoalError) -> bytes:
        out = json.dumps({"error": str(exc)}).encode()
        return out + b"\n" if self.streaming else out


class ChatWire(_Ollama):
    key = "message"

    def piece(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {"model": self.model, "created_at": _now(), "message": message, "done": False}


def _arguments(raw: str) -> Any:
    try:
        value = nesting.json_loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def _loaded(request: web.Request, head: Head, model: str, model_name: str,
                  keep_alive: float | str | None, key: str,
                  names: dict[str, str]) -> web.Response:
    """Ollama's answer to a request with nothing to generate: it loads the model on a node
    of the fleet (a one-token generation whose answer nobody reads), which then keeps it
    for the request's keep_alive; ``keep_alive: 0`` unloads it instead, where a node has
    it loaded (``ollama stop``). Answered once that is done: "load" or "unload"."""
    try:
        keep_alive_s = keep_alive_of(keep_alive)
        unload = keep_alive_s == 0
        if not unload or head.fleet.loaded(model_name):
            job = Job(session=f"load-{secrets.token_hex(8)}", model=model_name,
                      prompt=_any_token(head.models[model_name]), max_tokens=1,
                      keep_alive_s=keep_alive_s)
            async for _ in head.runner.run(job):
                pass
    except RequestError as exc:
        return refusal(request, exc, names)
    body: dict[str, Any] = {"model": model, "created_at": _now(), "done": True,
                            "done_reason": "unload" if unload else "load"}
    body[key] = {"role": "assistant", "content": ""} if key == "message" else ""
    return web.json_response(body, headers=names)


def _any_token(model: HeadModel) -> list[int]:
    """A one-token prompt any model takes: its first ordinary token for a newline."""
    return model.vocab.encode("\n", special=False)[:1] or [0]


def _to_chat(req: OllamaChatRequest, stream: bool) -> ChatRequest:
    messages = []
    for msg in req.messages:
        calls = None
        if msg.tool_calls:
            calls = [ToolCall(function=ToolCallFunction(
                name=c.function.name,
                arguments=(c.function.arguments if isinstance(c.function.arguments, str)
                           else json.dumps(c.function.arguments))))
                for c in msg.tool_calls]
        messages.append(Message(role=msg.role, content=msg.content, tool_calls=calls,
                                name=msg.tool_name if msg.role == "tool" else None))
    return ChatRequest(model=req.model, messages=messages, stream=stream,
                       max_tokens=_max_tokens(req.options), stop=_stops(req.options) or None,
                       tools=req.tools or None, **_sampling_fields(req.options),
                       **_think(req.think))


async def _decode(request: web.Request, kind: type[Any]) -> Any:
    body = await request.read()
    try:  # off the loop when large: a body of many small messages takes long to decode
        return await off_loop(len(body), lambda: decode_as(kind, body))
    except BadRequest as exc:
        return ollama_error(400, str(exc))


R = TypeVar("R", OllamaChatRequest, OllamaGenerateRequest)


async def _accept(request: web.Request,
                  kind: type[R]) -> tuple[R, str, dict[str, str]] | web.Response:
    """The request decoded, checked for what Shoal does not do, and its model resolved
    (the model's name and the X-Shoal-* headers), or the answer that refuses it."""
    req = await _decode(request, kind)
    if isinstance(req, web.Response):
        return req
    problem = unsupported_ollama(req)
    if problem:
        return ollama_error(400, problem)
    resolved = runnable(request, request.app[HEAD], req.model, ollama=True)
    if isinstance(resolved, web.Response):
        return resolved
    model_name, names = resolved
    return req, model_name, names


def _chat_parts(req: OllamaChatRequest,
                key_name: str) -> tuple[ChatRequest, list[dict[str, Any]], Conversation]:
    """The chat as OpenAI's request, its turns as templates read them, and what routing
    reads of them."""
    chat_req = _to_chat(req, req.stream)
    messages = to_template_messages(chat_req)
    return chat_req, messages, conversation_of(messages, key_name)


async def chat(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    accepted = await _accept(request, OllamaChatRequest)
    if isinstance(accepted, web.Response):
        return accepted
    req, model_name, names = accepted
    if not req.messages:
        return await _loaded(request, head, req.model, model_name, req.keep_alive,
                             "message", names)
    key_name = key_name_of(request)
    try:
        # off the loop when large, like the decoding: 100,000 small messages take long
        chat_req, messages, conversation = await off_loop(
            len(await request.read()), lambda: _chat_parts(req, key_name))
        turn = await chat_request_turn(head.models[model_name], head.runner, chat_req,
                                       routing_of(request, conversation,
                                                  keep_alive=req.keep_alive),
                                       messages=messages, tool_parser=head.tool_parser)
    except RequestError as exc:
        return refusal(request, exc, names)
    return await answer(request, head, turn,
                        ChatWire(request, head, req.model, stream=req.stream), names)


async def _generate_prompt(model: HeadModel, req: OllamaGenerateRequest) -> list[int]:
    size = len(req.prompt) + len(req.suffix or "") + len(req.system or "")
    if req.suffix is not None or req.raw:
        return await off_loop(size, lambda: completion_prompt_ids(model, req.prompt,
                                                                  req.suffix))
    messages = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    messages.append({"role": "user", "content": req.prompt})
    enable = req.think is not None and req.think is not False
    return await render_prompt(model, messages, template_kwargs={"enable_thinking": enable})


async def generate(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    accepted = await _accept(request, OllamaGenerateRequest)
    if isinstance(accepted, web.Response):
        return accepted
    req, model_name, names = accepted
    if not req.prompt and not req.suffix:
        # nothing to continue (an editor's autocomplete in an empty file, a preload, or
        # `ollama stop`): Ollama loads the model (or unloads it) and answers empty
        return await _loaded(request, head, req.model, model_name, req.keep_alive,
                             "response", names)
    model = head.models[model_name]
    sampling = sampling_of(SamplingRequest(**_sampling_fields(req.options)))
    try:
        prompt = await _generate_prompt(model, req)
        turn = Turn(model, head.runner, prompt,
                    routing=routing_of(request, keep_alive=req.keep_alive), sampling=sampling,
                    max_tokens=_max_tokens(req.options), stops=_stops(req.options),
                    requested=req.model)
    except RequestError as exc:
        return refusal(request, exc, names)
    return await answer(request, head, turn,
                        _Ollama(request, head, req.model, stream=req.stream), names)


# -- models --------------------------------------------------------------------------


def _details(model: HeadModel) -> dict[str, Any]:
    meta = model.vocab.metadata()
    arch = meta.get("general.architecture", "") or model.template.family
    quant = _QUANT.search(model.name)
    return {"parent_model": "",
            "format": {"llamacpp": "gguf", "mlx": "safetensors"}.get(model.runtime,
                                                                     model.runtime),
            "family": arch, "families": [arch] if arch else [],
            "parameter_size": meta.get("general.size_label", ""),
            "quantization_level": quant.group(1).upper() if quant else ""}


def _size(model: HeadModel) -> int:
    path = getattr(model.vocab, "path", None)
    try:
        return Path(path).stat().st_size if isinstance(path, str) else 0
    except OSError:
        return 0


def _modified(head: Head) -> str:
    return datetime.fromtimestamp(head.started_wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _entry(head: Head, name: str, model: HeadModel) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": _modified(head), "size": _size(model),
            # an identifier of the name (the head has no blob to hash)
            "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": _details(model)}


async def tags(request: web.Request) -> web.Response:
    head = request.app[HEAD]
    served = head.served()
    models = [_entry(head, name, model) for name, model in head.models.items()
              if name in served]
    for alias in head.aliases.entries():
        found = head.resolve(alias.name)
        if found.model is not None and found.model in head.models:
            models.append(_entry(head, alias.name, head.models[found.model]))
    return web.json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    head = request.app[HEAD]
    req = await _decode(request, OllamaShowRequest)
    if isinstance(req, web.Response):
        return req
    wanted = req.model or req.name
    if not wanted:
        return ollama_error(400, "say which model to show: {\"model\": NAME}")
    resolved = runnable(request, head, wanted, ollama=True, kind="any")
    if isinstance(resolved, web.Response):
        return resolved
    model_name, names = resolved
    model = head.models[model_name]
    meta = model.vocab.metadata()
    info: dict[str, Any] = {k: v for k, v in meta.items() if not k.startswith("tokenizer.")}
    # Ollama's clients read the window as model_info["<architecture>.context_length"]
    arch = meta.get("general.architecture") or "shoal"
    info["general.architecture"] = arch
    window = head.fleet.context_window(model.name)
    if window:
        info[f"{arch}.context_length"] = window
    return web.json_response({
        "modelfile": f"# served by Shoal through its fleet\nFROM {model.name}\n",
        "parameters": "", "template": model.template.source,
        "details": _details(model), "model_info": info,
        "capabilities": capabilities(model).names(), "modified_at": _modified(head)},
        headers=names)


NEVER = "9999-12-31T23:59:59Z"  # a model on a node stays loaded while the node runs


def size_vram(size: int, node: NodeSnapshot) -> int:
    """The share of the model's ``size`` on the node's GPU, by its layers there (Ollama's
    ``size_vram``): 0 on the CPU."""
    if not node.device or node.model_layers <= 0:
        return 0
    return size * min(node.gpu_layers, node.model_layers) // node.model_layers


async def ps(request: web.Request) -> web.Response:
    """What is loaded where: one entry per node linked now, with its model, window,
    lanes and KV use (Ollama's fields, then Shoal's under ``shoal``)."""
    head = request.app[HEAD]
    now = head.fleet.clock()
    wall = time.time()
    entries = []
    for pool in head.fleet.pools.values():
        if pool.state != "ready":
            continue
        node = node_snapshot(pool, now=now, wall=wall)
        model = head.models.get(node.model)
        size = _size(model) if model is not None else 0
        entry: dict[str, Any] = {
            "name": node.model, "model": node.model, "size": size,
            "digest": hashlib.sha256(node.model.encode()).hexdigest(),
            "details": _details(model) if model is not None else {},
            "expires_at": NEVER, "size_vram": size_vram(size, node),
            "context_length": node.context_window,
            "shoal": {"node": node.identity, "address": node.address,
                      "runtime": node.runtime, "lanes": node.lanes,
                      "lanes_busy": node.lanes_busy, "kv_used": node.kv_used,
                      "kv_total": node.kv_total, "decode_tps": node.decode_tps,
                      "device": node.device or None, "gpu_layers": node.gpu_layers,
                      "model_layers": node.model_layers}}
        entries.append(entry)
        for kept in pool.kept:  # the models it keeps besides, while loaded
            if kept.state != "loaded":
                continue
            described = head.models.get(kept.name)
            entries.append({
                "name": kept.name, "model": kept.name, "size": kept.mem,
                "digest": hashlib.sha256(kept.name.encode()).hexdigest(),
                "details": _details(described) if described is not None else {},
                "expires_at": NEVER, "size_vram": 0, "context_length": kept.context_window,
                "shoal": {"node": node.identity, "address": node.address,
                          "runtime": node.runtime, "lanes": node.lanes,
                          "lanes_busy": node.lanes_busy, "kept": True}})
    return web.json_response({"models": entries})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_API_VERSION, "shoal": __version__})

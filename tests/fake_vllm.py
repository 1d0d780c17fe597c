"""A fake vLLM OpenAI-compatible server on 127.0.0.1 (port 0) whose model is Shoal's mock model.

It follows the request and response shapes of vLLM 0.10.2 to 0.11 (``return_token_ids``
arrived in 0.10.2, vllm-project/vllm PR #22587), as read in vllm-project/vllm:

* ``vllm/entrypoints/openai/protocol.py``: ``CompletionRequest`` (``prompt`` as a list of
  token ids, ``max_tokens`` default 16, ``temperature`` default 1.0, ``seed``,
  ``stop_token_ids``, ``ignore_eos``, ``stream``, ``stream_options.include_usage``,
  ``return_token_ids``), ``CompletionResponseChoice`` / ``CompletionResponseStreamChoice``
  (``text``, ``finish_reason``, ``stop_reason``, ``token_ids``, ``prompt_token_ids``),
  ``TokenizeCompletionRequest`` / ``TokenizeResponse`` (``count``, ``max_model_len``,
  ``tokens``, ``token_strs``), ``ModelCard`` (``/v1/models``);
* ``vllm/entrypoints/openai/serving_completion.py`` (commit 00463e627b4c),
  ``completion_stream_generator``: one ``data: {json}`` event per engine step, its
  ``token_ids`` the delta, ``prompt_token_ids`` on the first chunk only, the finish
  reason on the chunk of the last token, a ``choices: []`` usage chunk when
  ``include_usage``, then ``data: [DONE]``; fields not asked for are ``null``;
* ``vllm/v1/core/sched/utils.py`` ``check_stop``: EOS and a ``stop_token_ids`` hit are
  the LAST output token (so they appear in ``token_ids``, with empty text), finish
  ``stop``; ``stop_reason`` is the stop id, ``null`` for EOS; ``max_tokens`` or the model
  length ends with ``length``;
* metrics (https://docs.vllm.ai/en/latest/design/metrics/, PR #18354):
  ``vllm:kv_cache_usage_perc`` (0-1) replaced ``vllm:gpu_cache_usage_perc``, which vLLM
  up to 0.10 emits (``kv_metric=LEGACY_KV_METRIC`` here); ``vllm:num_requests_running``
  and ``vllm:num_requests_waiting`` gauges labelled ``engine`` and ``model_name``.
  vLLM does not export ``max_num_seqs`` as a metric (``vllm:cache_config_info`` carries
  the cache config only), so neither does this fake.

Like vLLM it runs at most ``max_num_seqs`` requests at once and queues the rest as
waiting (never refuses them), and aborts a request whose client disconnects.

The model is ``engine/runtimes/mock.py``: each next token is ``next_token(seed, context)``
and ``/tokenize`` is ``MockTokenizer``, so a node fronting this fake produces exactly the
tokens of a mock node with the same seed (temperature 0 means seed 0, as the mock does).

Controls for tests: ``pace`` (tokens/s per request), ``die()`` (connections aborted, the
port closed), ``hang()`` (every handler stops where it is, connections stay open),
``revive()``; ``aborted`` (requests whose client went away), ``in_flight``, ``running``,
``waiting``, ``bodies`` (every completion request body received).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.runtimes.mock import EOS, MockTokenizer, next_token

KV_METRIC = "vllm:kv_cache_usage_perc"
LEGACY_KV_METRIC = "vllm:gpu_cache_usage_perc"
VERSION = "0.11.0"
MAX_BODY = 8 * 1024 * 1024
MAX_PROMPTS_KEPT = 256
_TOK = MockTokenizer()


class FakeVLLM:
    """One fake vLLM server; ``await start()`` then ``url``; ``await close()`` at the end."""

    def __init__(self, *, model: str = "mock", max_num_seqs: int = 4, pace: float = 0.0,
                 max_model_len: int = 4096, kv_metric: str = KV_METRIC,
                 return_token_ids: bool = True,
                 tokenize: Callable[[str, bool], list[int]] | None = None) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.pace = pace  # tokens/s per request; 0 = as fast as the loop allows
        self.max_model_len = max_model_len
        self.kv_metric = kv_metric
        # False: a vLLM before 0.10.2, which ignores the field and sends no token ids
        self.return_token_ids = return_token_ids
        self.tokenize = tokenize or (lambda text, special: _TOK.encode(text, special=special))
        self.kv_override: float | None = None  # report this KV usage instead of the computed one
        self.aborted = 0
        self.completed = 0
        self.in_flight = 0
        self.bodies: deque[dict[str, Any]] = deque(maxlen=MAX_PROMPTS_KEPT)
        self._running: dict[int, list[int]] = {}  # request number -> its context (for KV)
        self._waiters: deque[tuple[asyncio.Future[int], list[int]]] = deque()
        self._next_id = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._dead = False
        self._port = 0
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    # ---- lifecycle and controls

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def start(self) -> str:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._completions)
        # a client that goes away cancels its handler: how the fake sees an abort at once
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await self._listen()
        return self.url

    async def _listen(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await self._site.start()
        if not self._port:
            self._port = int(self._runner.addresses[0][1])

    async def close(self) -> None:
        self._flowing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def die(self) -> None:
        """Like a killed process: every connection cut at once, the port closed."""
        self._dead = True
        if self._site is not None:
            await self._site.stop()
            self._site = None
        self._abort_connections()
        self._flowing.set()  # hung handlers wake up to find their connection gone

    def hang(self) -> None:
        """Like a frozen process: nothing more is sent or answered; connections stay."""
        self._flowing.clear()

    async def revive(self) -> None:
        """Back on the same port, answering and generating again."""
        if self._dead:
            self._dead = False
            await self._listen()
        self._flowing.set()

    def _abort_connections(self) -> None:
        if self._runner is None or self._runner.server is None:
            return
        for proto in list(self._runner.server.connections):
            transport = proto.transport
            if transport is not None:
                transport.abort()

    async def _flow(self) -> None:
        await self._flowing.wait()
        if self._dead:
            raise ConnectionResetError("the fake vLLM died")

    # ---- scheduling: at most max_num_seqs running, the rest waiting in order

    async def _admit(self, context: list[int]) -> int:
        """A request number once it runs; until then it waits in order, like vLLM."""
        if len(self._running) < self.max_num_seqs and not self._waiters:
            return self._run(context)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        entry = (fut, context)
        self._waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._leave(fut.result())  # it was handed a slot as it went away
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def _run(self, context: list[int]) -> int:
        self._next_id += 1
        self._running[self._next_id] = context
        return self._next_id

    def _leave(self, rid: int) -> None:
        self._running.pop(rid, None)
        while self._waiters and len(self._running) < self.max_num_seqs:
            fut, context = self._waiters.popleft()
            if not fut.done():
                fut.set_result(self._run(context))  # the slot is taken at hand-over

    # ---- routes

    async def _health(self, request: web.Request) -> web.Response:
        await self._flow()
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        await self._flow()
        return web.json_response({"version": VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        await self._flow()
        card = {"id": self.model, "object": "model", "created": int(time.time()),
                "owned_by": "vllm", "root": self.model, "parent": None,
                "max_model_len": self.max_model_len, "permission": []}
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._flow()
        labels = f'engine="0",model_name="{self.model}"'
        capacity = self.max_model_len * self.max_num_seqs
        kv = self.kv_override
        if kv is None:
            kv = min(1.0, sum(len(c) for c in self._running.values()) / capacity)
        lines = [
            "# HELP python_gc_objects_collected_total Objects collected during gc",
            "# TYPE python_gc_objects_collected_total counter",
            'python_gc_objects_collected_total{generation="0"} 1234.0',
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",'
            f'num_gpu_blocks="{capacity // 16}"}} 1.0',
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(len(self._running))}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(self.waiting)}",
            f"# HELP {self.kv_metric} KV-cache usage. 1 means 100 percent usage.",
            f"# TYPE {self.kv_metric} gauge",
            f"{self.kv_metric}{{{labels}}} {kv!r}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(self.completed)}",
        ]
        return web.Response(text="\n".join(lines) + "\n",
                            content_type="text/plain", charset="utf-8")

    async def _tokenize(self, request: web.Request) -> web.Response:
        await self._flow()
        body = await _json_body(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return _error(400, "prompt must be a string")
        tokens = self.tokenize(prompt, bool(body.get("add_special_tokens", True)))
        return web.json_response({"count": len(tokens), "max_model_len": self.max_model_len,
                                  "tokens": tokens, "token_strs": None})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        await self._flow()
        body = await _json_body(request)
        self.bodies.append(body)
        try:
            gen = _Generation.parse(body, self)
        except ValueError as exc:
            return _error(400, str(exc))
        self.in_flight += 1
        rid = 0
        try:
            rid = await self._admit(gen.context)
            if gen.stream:
                return await self._stream(request, gen)
            return await self._whole(gen)
        except (asyncio.CancelledError, ConnectionResetError):
            if not self._dead:
                self.aborted += 1  # the client went away: vLLM aborts the request
            raise
        finally:
            self.in_flight -= 1
            if rid:
                self._leave(rid)

    async def _whole(self, gen: _Generation) -> web.Response:
        ids: list[int] = []
        async for step in gen.steps(self):
            ids.extend(step)
        self.completed += 1
        choice: dict[str, Any] = {
            "index": 0, "text": gen.text(ids), "logprobs": None,
            "finish_reason": gen.finish, "stop_reason": gen.stop_reason,
            "prompt_logprobs": None, "token_ids": None, "prompt_token_ids": None}
        if gen.return_ids and self.return_token_ids:
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = gen.prompt
        return web.json_response({
            "id": gen.id, "object": "text_completion", "created": gen.created,
            "model": self.model, "choices": [choice], "usage": gen.usage(len(ids)),
            "kv_transfer_params": None})

    async def _stream(self, request: web.Request, gen: _Generation) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        produced = 0
        first = True
        async for step in gen.steps(self):
            produced += len(step)
            choice: dict[str, Any] = {
                "index": 0, "text": gen.text(step), "logprobs": None,
                "finish_reason": gen.finish, "stop_reason": gen.stop_reason}
            if self.return_token_ids:
                # vLLM >= 0.10.2 always has the fields, null unless asked for
                choice["prompt_token_ids"] = gen.prompt if first and gen.return_ids else None
                choice["token_ids"] = step if gen.return_ids else None
            first = False
            await resp.write(_event({"id": gen.id, "object": "text_completion",
                                     "created": gen.created, "model": self.model,
                                     "choices": [choice], "usage": None}))
        if gen.include_usage:
            await resp.write(_event({"id": gen.id, "object": "text_completion",
                                     "created": gen.created, "model": self.model,
                                     "choices": [], "usage": gen.usage(produced)}))
        await resp.write(b"data: [DONE]\n\n")
        self.completed += 1
        await resp.write_eof()
        return resp


@dataclass
class _Generation:
    """One completion request: its parsed fields and the mock model's steps."""

    prompt: list[int]
    max_tokens: int
    seed: int
    stop_ids: set[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_ids: bool
    window: int
    context: list[int] = field(init=False)
    finish: str | None = None
    stop_reason: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: f"cmpl-{random.getrandbits(64):016x}")

    def __post_init__(self) -> None:
        self.context = list(self.prompt)

    @classmethod
    def parse(cls, body: dict[str, Any], fake: FakeVLLM) -> _Generation:
        prompt = body.get("prompt")
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise ValueError("this fake takes the prompt as a non-empty list of token ids")
        bad = [t for t in prompt if not 0 <= t < MockTokenizer.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary")
        max_tokens = body.get("max_tokens", 16)
        max_tokens = 16 if max_tokens is None else int(max_tokens)
        if len(prompt) + max_tokens > fake.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {fake.max_model_len} tokens. However, "
                f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                f"messages, {max_tokens} in the completion).")
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        seed = body.get("seed")
        # the mock model's rule (engine/runtimes/mock.py): greedy is seed 0
        if temperature <= 0:
            seed = 0
        elif seed is None:
            seed = random.getrandbits(63)
        options = body.get("stream_options") or {}
        return cls(prompt=list(prompt), max_tokens=max_tokens, seed=int(seed),
                   stop_ids=set(body.get("stop_token_ids") or ()),
                   ignore_eos=bool(body.get("ignore_eos")), stream=bool(body.get("stream")),
                   include_usage=bool(options.get("include_usage")),
                   return_ids=bool(body.get("return_token_ids")), window=fake.max_model_len)

    async def steps(self, fake: FakeVLLM) -> AsyncIterator[list[int]]:
        """One token per engine step, paced; the last step carries the finish reason."""
        period = 1.0 / fake.pace if fake.pace > 0 else 0.0
        due = time.monotonic()
        produced = 0
        while self.finish is None:
            await fake._flow()
            tok = next_token(self.seed, self.context)
            self.context.append(tok)
            produced += 1
            if tok == EOS and not self.ignore_eos:
                self.finish = "stop"
            elif tok in self.stop_ids:
                self.finish, self.stop_reason = "stop", tok
            elif produced >= self.max_tokens or len(self.context) >= self.window:
                self.finish = "length"
            due += period
            delay = due - time.monotonic()
            await asyncio.sleep(delay if delay > 0 else 0)
            await fake._flow()
            yield [tok]

    def text(self, ids: list[int]) -> str:
        # skip_special_tokens (vLLM's default): EOS and the stop id add no text
        return b"".join(_TOK.token_bytes(t) for t in ids
                        if t != EOS and t not in self.stop_ids).decode("utf-8", "replace")

    def usage(self, completion: int) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": completion,
                "total_tokens": len(self.prompt) + completion}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError",
                                        "param": None, "code": status}}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text="body is not JSON") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body is not a JSON object")
    return body


@contextlib.asynccontextmanager
async def running_fake_vllm(**options: Any) -> AsyncIterator[FakeVLLM]:
    """A started fake for the body of the ``async with``; closed after."""
    fake = FakeVLLM(**options)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.close()

"""POST /v1/completions: a raw prompt, or fill-in-the-middle with ``suffix``.

Editor plugins send the code before the cursor as ``prompt`` and the code after
it as ``suffix``; the head wraps them in the model's FIM tokens. A model without
them answers a non-empty suffix with a clear 400.
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from engine.api.answer import CollectedJSON, SSEWire, Wire, answer, sse, usage
from engine.api.context import HEAD, routing_of, runnable
from engine.api.errors import error_for, refusal
from engine.api.schemas import (
    DEFAULT_COMPLETION_TOKENS,
    BadRequest,
    CompletionRequest,
    completion_prompt,
    decode_as,
    unsupported_completion,
)
from engine.api.turns import sampling_of, stops_of
from engine.errors import RequestError
from engine.head.head import Head
from engine.head.prompt.tools import TextDelta
from engine.head.prompt.turn import ChatEvent, ChatFinal, Turn, completion_prompt_ids, off_loop


class CompletionStream(SSEWire):
    def __init__(self, request: web.Request, head: Head, req: CompletionRequest,
                 cid: str) -> None:
        super().__init__(request, head, req.model)
        self.cid = cid
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(self, text: str, finish: str | None = None) -> bytes:
        return sse({"id": self.cid, "object": "text_completion", "created": self.created,
                    "model": self.model,
                    "choices": [{"text": text, "index": 0, "logprobs": None,
                                 "finish_reason": finish}]})

    def event(self, ev: ChatEvent) -> bytes:
        if isinstance(ev, TextDelta):
            return self.chunk(ev.text) if ev.text else b""
        if isinstance(ev, ChatFinal):
            out = self.chunk("", ev.finish_reason)
            if self.include_usage:
                out += sse({"id": self.cid, "object": "text_completion",
                            "created": self.created, "model": self.model, "choices": [],
                            "usage": usage(ev)})
            return out
        return b""

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"


class CompletionJSON(CollectedJSON):
    def __init__(self, request: web.Request, head: Head, req: CompletionRequest,
                 cid: str) -> None:
        super().__init__(request, head, req.model, cid)

    def end(self) -> bytes:
        final = self.final
        assert final is not None
        body = {"id": self.cid, "object": "text_completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"text": "".join(self.text), "index": 0, "logprobs": None,
                             "finish_reason": final.finish_reason}],
                "usage": usage(final)}
        return json.dumps(body).encode()


async def completions(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    try:
        req: CompletionRequest = decode_as(CompletionRequest, await request.read())
    except BadRequest as exc:
        return error_for(request, 400, str(exc), code="invalid_request")
    problem = unsupported_completion(req)
    if problem:
        return error_for(request, 400, problem, code="unsupported_parameter")
    resolved = runnable(request, head, req.model)
    if isinstance(resolved, web.Response):
        return resolved
    model_name, names = resolved
    model = head.models[model_name]
    try:
        text = completion_prompt(req)
        prompt = await off_loop(len(text) + len(req.suffix or ""),
                                lambda: completion_prompt_ids(model, text, req.suffix))
        if not prompt:
            return error_for(request, 400, "the prompt is empty; send some text to continue",
                             code="invalid_request", param="prompt", headers=names)
        turn = Turn(model, head.runner, prompt, routing=routing_of(request),
                    sampling=sampling_of(req),
                    max_tokens=req.max_tokens or DEFAULT_COMPLETION_TOKENS,
                    stops=stops_of(req.stop), requested=req.model)
    except RequestError as exc:
        return refusal(request, exc, names)
    cid = "cmpl-" + turn.session[2:]
    wire: Wire = (CompletionStream(request, head, req, cid) if req.stream
                  else CompletionJSON(request, head, req, cid))
    return await answer(request, head, turn, wire, names)

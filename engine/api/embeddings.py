"""Embeddings: OpenAI's ``POST /v1/embeddings`` and Ollama's ``POST /api/embed`` and
``POST /api/embeddings``. The head tokenizes each input with the model's vocabulary (its
own special tokens around it), the fleet's nodes serving the model make the vectors
(engine.head.fleet.embeds), and the route answers in its API's shape: floats, or OpenAI's
base64 of the float32 bytes. ``dimensions`` below the model's own cuts each vector and
scales it to length 1 again, as Matryoshka-trained models are meant to be used."""

from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from engine.api.context import HEAD, routing_of, runnable
from engine.api.errors import error_for, refusal
from engine.api.schemas import (
    MAX_EMBED_INPUTS,
    BadRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OpenAIEmbedRequest,
    decode_as,
)
from engine.errors import RequestError
from engine.head.fleet.embeds import EmbedAnswer, EmbedJob, embed
from engine.head.head import Head
from engine.head.prompt.model import HeadModel
from engine.head.prompt.turn import off_loop
from engine.runtimes.embedding import pack, unit, unpack


@dataclass(frozen=True, slots=True)
class Inputs:
    texts: list[str] | None  # texts to tokenize here
    ids: list[list[int]] | None  # token ids given as they are (OpenAI's arrays)


def read_input(value: Any, field: str = "input") -> Inputs:
    """OpenAI's ``input`` (and Ollama's): a string, a list of strings, a list of token ids,
    or a list of such lists. BadRequest naming what is wrong."""
    if isinstance(value, str):
        return Inputs([value], None)
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{field}' must be a string or a non-empty list of strings or of "
                         "token ids")
    if len(value) > MAX_EMBED_INPUTS:
        raise BadRequest(f"'{field}' holds {len(value)} inputs; send at most {MAX_EMBED_INPUTS} "
                         "per request")
    if all(isinstance(v, str) for v in value):
        return Inputs(list(value), None)
    if all(_is_id(v) for v in value):
        return Inputs(None, [list(value)])
    if all(isinstance(v, list) and v and all(_is_id(t) for t in v) for v in value):
        return Inputs(None, [list(v) for v in value])
    raise BadRequest(f"'{field}' must be a string, a list of strings, a list of token ids "
                     "or a list of lists of token ids, each non-empty")


def _is_id(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31


def tokenize(model: HeadModel, inputs: Inputs, *, window: int, truncate: bool) -> list[list[int]]:
    """Each input's ids with the vocabulary's special tokens around it; one longer than
    ``window`` is cut to it (its closing special token kept) where ``truncate``, else
    refused. Runs off the loop for a large request."""
    if inputs.ids is not None:
        out = inputs.ids
    else:
        assert inputs.texts is not None
        if any(not t for t in inputs.texts):
            raise RequestError("an input is empty; send some text to embed")
        out = [model.vocab.encode_input(t) for t in inputs.texts]
    closing = model.vocab.encode_input("")[-1:]  # BERT's SEP; nothing for most others
    for i, ids in enumerate(out):
        if len(ids) <= window or window <= 0:
            continue
        if not truncate:
            raise RequestError(f"input {i} is {len(ids)} tokens, more than the model's window "
                               f"of {window}; shorten it or split it",
                               code="context_length_exceeded")
        end = closing if closing and ids[-1:] == closing else []
        out[i] = ids[:window - len(end)] + end
    return out


def vectors_of(answer: EmbedAnswer, dimensions: int | None) -> list[list[float]]:
    """The answer's vectors as floats, cut to ``dimensions`` (then of length 1 again)."""
    vectors = unpack(answer.vectors, answer.dims)
    if dimensions is None or dimensions == answer.dims:
        return vectors
    return [unit(v[:dimensions]) for v in vectors]


def vector_bytes(answer: EmbedAnswer, dimensions: int | None) -> list[bytes]:
    """Each vector as float32 bytes, OpenAI's base64 form: the node's own bytes, sliced,
    unless ``dimensions`` cuts them."""
    if dimensions is None or dimensions == answer.dims:
        width = answer.dims * 4
        return [answer.vectors[i:i + width] for i in range(0, len(answer.vectors), width)]
    return [pack([v]) for v in vectors_of(answer, dimensions)]


async def _run(request: web.Request, head: Head, requested: str, inputs: Inputs, *,
               truncate: bool, dimensions: int | None, ollama: bool = False,
               keep_alive: Any = None) -> tuple[EmbedAnswer, dict[str, str]] | web.Response:
    """Resolve, tokenize and embed; the refusal as the route's error where that fails."""
    resolved = runnable(request, head, requested, ollama=ollama, kind="embeddings")
    if isinstance(resolved, web.Response):
        return resolved
    name, names = resolved
    model = head.models[name]
    window = head.fleet.context_window(model.name)
    size = sum(len(t) for t in inputs.texts or ()) + sum(len(i) for i in inputs.ids or ())
    try:
        routing = routing_of(request, keep_alive=keep_alive)
        ids = await off_loop(size, lambda: tokenize(model, inputs, window=window,
                                                     truncate=truncate))
        answer = await embed(head.runner, EmbedJob(
            session="e-" + secrets.token_hex(8), model=model.name, inputs=ids,
            pin_host=routing.pin_host, prefer=routing.prefer,
            keep_alive_s=routing.keep_alive_s))
    except RequestError as exc:
        return refusal(request, exc, names)
    if dimensions is not None and dimensions > answer.dims:
        return error_for(request, 400, f"'{model.name}' makes vectors of {answer.dims} "
                         f"dimensions; ask for at most that many", code="invalid_request",
                         param="dimensions", headers=names)
    return answer, names


async def _json(body: dict[str, Any], size: int, headers: dict[str, str]) -> web.Response:
    # msgspec writes the floats about ten times as fast as json.dumps (3 ms of a
    # 16-vector answer's 35), to the same shortest text that reads back as each value
    data = await off_loop(size, lambda: _ENCODER.encode(body))
    return web.Response(body=data, content_type="application/json", headers=headers)


_ENCODER = msgspec.json.Encoder()


async def openai_embeddings(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    try:
        req: OpenAIEmbedRequest = decode_as(OpenAIEmbedRequest, await request.read())
        if req.encoding_format not in ("float", "base64"):
            raise BadRequest(f"encoding_format {req.encoding_format!r} is not one of 'float' "
                             "and 'base64'")
        inputs = read_input(req.input)
    except BadRequest as exc:
        return error_for(request, 400, str(exc), code="invalid_request")
    got = await _run(request, head, req.model, inputs, truncate=False,
                     dimensions=req.dimensions)
    if isinstance(got, web.Response):
        return got
    answer, names = got

    def body() -> dict[str, Any]:
        data: list[Any] = (
            [base64.b64encode(b).decode() for b in vector_bytes(answer, req.dimensions)]
            if req.encoding_format == "base64" else vectors_of(answer, req.dimensions))
        return {"object": "list", "model": req.model,
                "data": [{"object": "embedding", "index": i, "embedding": v}
                         for i, v in enumerate(data)],
                "usage": {"prompt_tokens": answer.prompt_tokens,
                          "total_tokens": answer.prompt_tokens}}

    made = await off_loop(len(answer.vectors), body)
    return await _json(made, len(answer.vectors), names)


async def ollama_embed(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    started = time.perf_counter_ns()
    try:
        req: OllamaEmbedRequest = decode_as(OllamaEmbedRequest, await request.read())
        inputs = read_input(req.input)
    except BadRequest as exc:
        return error_for(request, 400, str(exc))
    got = await _run(request, head, req.model, inputs, truncate=req.truncate,
                     dimensions=req.dimensions, ollama=True, keep_alive=req.keep_alive)
    if isinstance(got, web.Response):
        return got
    answer, names = got
    vectors = await off_loop(len(answer.vectors), lambda: vectors_of(answer, req.dimensions))
    return await _json({"model": req.model, "embeddings": vectors,
                        "total_duration": time.perf_counter_ns() - started,
                        "load_duration": 0, "prompt_eval_count": answer.prompt_tokens},
                       len(answer.vectors), names)


async def ollama_embeddings(request: web.Request) -> web.StreamResponse:
    head = request.app[HEAD]
    try:
        req: OllamaEmbeddingsRequest = decode_as(OllamaEmbeddingsRequest, await request.read())
    except BadRequest as exc:
        return error_for(request, 400, str(exc))
    if not req.prompt:  # Ollama answers an empty prompt with an empty embedding
        return web.json_response({"embedding": []})
    got = await _run(request, head, req.model, Inputs([req.prompt], None), truncate=True,
                     dimensions=None, ollama=True, keep_alive=req.keep_alive)
    if isinstance(got, web.Response):
        return got
    answer, names = got
    return await _json({"embedding": vectors_of(answer, None)[0]}, len(answer.vectors), names)

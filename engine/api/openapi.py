"""GET /openapi.json: the head's whole HTTP surface as OpenAPI 3.1.

Request bodies come from the msgspec structs the routes decode with, so the
description cannot drift from what the head accepts.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from engine import __version__
from engine.api import schemas as s

REF = "#/components/schemas/{name}"
_STRUCTS: tuple[type[msgspec.Struct], ...] = (
    s.ChatRequest, s.CompletionRequest, s.ResponsesRequest, s.AnthropicRequest,
    s.AnthropicCountRequest, s.OllamaChatRequest, s.OllamaGenerateRequest,
    s.OllamaShowRequest, s.OpenAIEmbedRequest, s.OllamaEmbedRequest, s.OllamaEmbeddingsRequest)

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}
_OLLAMA_ERROR = {"type": "object", "required": ["error"],
                 "properties": {"error": {"type": "string"}}}
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
_ALIAS_SET = {"type": "object", "required": ["target"], "properties": {
    "target": {"type": "string", "maxLength": 512},
    "fallbacks": {"type": "array", "items": {"type": "string", "maxLength": 512},
                  "maxItems": 16}}}
_OBJECT = {"type": "object"}
_SPLIT_ASK = {"type": "object", "required": ["model", "split"], "properties": {
    "model": {"type": "string", "maxLength": 256},
    "split": {"type": "array", "items": {"type": "string", "maxLength": 256},
              "minItems": 2, "maxItems": 8}}}

# (method, path, operationId, summary, request schema name or inline schema, kind)
# kind: "openai" | "ollama" | "anthropic" | "stream" (may answer SSE) | "anthropic-stream"
#       | "ndjson" | "text" | "plain"
Route = tuple[str, str, str, str, str | dict[str, Any] | None, str]
ROUTES: tuple[Route, ...] = (
    ("post", "/v1/chat/completions", "createChatCompletion",
     "Chat completion (SSE with stream: true)", "ChatRequest", "stream"),
    ("post", "/v1/completions", "createCompletion",
     "Text completion; with suffix, fill-in-the-middle (SSE with stream: true)",
     "CompletionRequest", "stream"),
    ("post", "/v1/responses", "createResponse",
     "OpenAI Responses, stateless: store is false, previous_response_id is refused "
     "(SSE with stream: true)", "ResponsesRequest", "stream"),
    ("post", "/v1/messages", "createMessage",
     "Anthropic Messages (SSE with stream: true); errors in Anthropic's shape",
     "AnthropicRequest", "anthropic-stream"),
    ("post", "/v1/messages/count_tokens", "countMessageTokens",
     "Anthropic: the prompt tokens a Messages request would use", "AnthropicCountRequest",
     "anthropic"),
    ("post", "/v1/embeddings", "createEmbedding",
     "Embeddings of strings or token ids (float or base64)", "OpenAIEmbedRequest", "openai"),
    ("get", "/v1/models", "listModels",
     "Models served by the fleet, and aliases, with context window and capabilities", None,
     "openai"),
    ("get", "/v1/models/{model}", "retrieveModel", "One model or alias", None, "openai"),
    ("post", "/api/chat", "ollamaChat", "Ollama chat (NDJSON stream unless stream: false)",
     "OllamaChatRequest", "ndjson"),
    ("post", "/api/generate", "ollamaGenerate",
     "Ollama generate (NDJSON stream unless stream: false)", "OllamaGenerateRequest",
     "ndjson"),
    ("post", "/api/embed", "ollamaEmbed", "Ollama: embeddings of one input or several",
     "OllamaEmbedRequest", "ollama"),
    ("post", "/api/embeddings", "ollamaEmbeddings", "Ollama: the older embedding of one prompt",
     "OllamaEmbeddingsRequest", "ollama"),
    ("get", "/api/tags", "ollamaTags", "Ollama: models served by the fleet", None, "ollama"),
    ("post", "/api/show", "ollamaShow", "Ollama: one model's details", "OllamaShowRequest",
     "ollama"),
    ("get", "/api/ps", "ollamaPs", "Ollama: what is loaded on which node, with its KV use",
     None, "ollama"),
    ("get", "/api/version", "ollamaVersion", "Ollama API version", None, "ollama"),
    ("get", "/health", "health", "Liveness and ready nodes", None, "plain"),
    ("get", "/metrics", "metrics", "Prometheus metrics", None, "text"),
    ("get", "/v1/fleet", "fleet", "Nodes, lanes, KV occupancy and rates", None, "openai"),
    ("get", "/openapi.json", "openapi", "This description", None, "plain"),
    ("get", "/v1/aliases", "listAliases", "Aliases and what they resolve to", None, "openai"),
    ("get", "/v1/aliases/export", "exportAliases", "The alias table as a file", None,
     "openai"),
    ("post", "/v1/aliases/import", "importAliases", "Import an alias table (this machine)",
     _OBJECT, "openai"),
    ("get", "/v1/aliases/{name}/history", "aliasHistory", "Versions of one alias", None,
     "openai"),
    ("put", "/v1/aliases/{name}", "setAlias", "Point an alias at a model (this machine)",
     _ALIAS_SET, "openai"),
    ("delete", "/v1/aliases/{name}", "removeAlias", "Remove an alias (this machine)", None,
     "openai"),
    ("post", "/v1/aliases/{name}/revert", "revertAlias",
     "Point an alias back at its previous target (this machine)", None, "openai"),
    ("post", "/v1/fleet/serve", "serveSplit",
     "Serve a model on one machine, its last layers on memory others lend (this machine)",
     _SPLIT_ASK, "openai"),
)

GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              "/api/chat", "/api/generate")
_STATUSES = {"400": "Invalid request", "401": "Missing or invalid API key",
             "403": "Origin not allowed, or not from this machine",
             "404": "Unknown model, alias or route", "413": "Body too large",
             "429": "Rate limited or fleet busy (see Retry-After)",
             "503": "No node serves the model now (see Retry-After)"}


def _responses(kind: str) -> dict[str, Any]:
    err = (_OLLAMA_ERROR if kind in ("ollama", "ndjson")
           else _ANTHROPIC_ERROR if kind.startswith("anthropic") else _ERROR)
    if kind in ("stream", "anthropic-stream"):
        ok = {"description": "The answer (JSON), or its events (SSE)", "content": {
            "application/json": {"schema": _OBJECT},
            "text/event-stream": {"schema": {"type": "string"}}}}
    elif kind == "ndjson":
        ok = {"description": "The answer (JSON), or its chunks (NDJSON)", "content": {
            "application/json": {"schema": _OBJECT},
            "application/x-ndjson": {"schema": {"type": "string"}}}}
    elif kind == "text":
        ok = {"description": "Prometheus text format", "content": {
            "text/plain": {"schema": {"type": "string"}}}}
    else:
        ok = {"description": "OK", "content": {"application/json": {"schema": _OBJECT}}}
    out: dict[str, Any] = {"200": ok}
    for status, what in _STATUSES.items():
        out[status] = {"description": what,
                       "content": {"application/json": {"schema": err}}}
    return out


def _params(path: str) -> list[dict[str, Any]]:
    params = []
    for name in ("model", "name"):
        if "{" + name + "}" in path:
            params.append({"name": name, "in": "path", "required": True,
                           "schema": {"type": "string", "minLength": 1, "maxLength": 512}})
    if path in GENERATING:
        params += [
            {"name": "host", "in": "query", "required": False,
             "description": "pin the request to the node of this name",
             "schema": {"type": "string", "maxLength": 256}},
            {"name": "prefer", "in": "query", "required": False,
             "description": "nodes to prefer when they have a free lane, comma-separated",
             "schema": {"type": "string", "maxLength": 4096}},
            {"name": "X-Session-Id", "in": "header", "required": False,
             "description": "keeps a conversation on the node that has its prompt cached",
             "schema": {"type": "string", "maxLength": 256}},
        ]
    return params


_NULL = {"type": "null"}
_ONE = {"anyOf": [{"const": 1}, _NULL]}
_NO = {"anyOf": [{"const": False}, _NULL]}
_NOTHING = {"anyOf": [{"const": 0}, _NULL]}
_EMPTY_MAP = {"anyOf": [{"type": "object", "maxProperties": 0}, _NULL]}
_EMPTY_LIST = {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]}
_NO_FORMAT = {"anyOf": [{"const": ""}, _NULL]}

_TEXT = {"type": "string", "minLength": 1, "maxLength": s.MAX_BODY}
_ID = {"type": "integer", "minimum": 0, "exclusiveMaximum": 1 << 31}
_IDS = {"type": "array", "minItems": 1, "maxItems": s.MAX_EMBED_INPUTS, "items": _ID}
_EMBED_INPUT = {"anyOf": [
    _TEXT, {"type": "array", "minItems": 1, "maxItems": s.MAX_EMBED_INPUTS, "items": _TEXT},
    _IDS, {"type": "array", "minItems": 1, "maxItems": s.MAX_EMBED_INPUTS, "items": _IDS}]}

# What the routes refuse beyond the structs' types (each with its own clear 400),
# written into the description so that it says exactly what is accepted.
_REFINE: dict[str, dict[str, Any]] = {
    "ChatRequest": {"n": _ONE, "logprobs": _NO, "top_logprobs": _NOTHING,
                    "logit_bias": _EMPTY_MAP,
                    "response_format": {"anyOf": [
                        {"type": "object", "properties": {"type": {"const": "text"}}}, _NULL]}},
    "ContentPart": {"type": {"const": "text"}},
    "CompletionRequest": {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": s.MAX_BODY},
                             {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": {"type": "string", "minLength": 1,
                                        "maxLength": s.MAX_BODY}}]},
        "n": _ONE, "best_of": _ONE, "echo": _NO, "logprobs": _NOTHING,
        "logit_bias": _EMPTY_MAP},
    # the head answers an empty input with 400 ("input is empty"): say it is needed
    "ResponsesRequest": {"previous_response_id": _NULL, "conversation": _NULL,
                         "background": _NO, "top_logprobs": _NOTHING,
                         "input": {"anyOf": [
                             {"type": "string", "minLength": 1, "maxLength": s.MAX_BODY},
                             {"type": "array", "minItems": 1, "maxItems": 100_000,
                              "items": {"$ref": REF.format(name="ResponsesItem")}}]}},
    "ResponsesItem": {"type": {"anyOf": [{"enum": [
        "message", "function_call", "function_call_output", "reasoning"]}, _NULL]}},
    "ResponsesPart": {"type": {"enum": ["input_text", "output_text", "text",
                                        "summary_text", "refusal"]}},
    "ResponsesTool": {"type": {"const": "function"}},
    "ResponsesFormat": {"type": {"const": "text"}},
    "AnthropicBlock": {"type": {"enum": ["text", "tool_use", "tool_result", "thinking",
                                         "redacted_thinking"]}},
    "AnthropicInnerBlock": {"type": {"const": "text"}},
    "AnthropicTool": {"type": {"anyOf": [{"const": "custom"}, _NULL]}},
    "OpenAIEmbedRequest": {"input": _EMBED_INPUT,
                           "encoding_format": {"enum": ["float", "base64"]}},
    "OllamaEmbedRequest": {"input": _EMBED_INPUT},
    "OllamaChatRequest": {"format": _NO_FORMAT},
    "OllamaGenerateRequest": {"format": _NO_FORMAT, "images": _EMPTY_LIST,
                              "template": _NO_FORMAT, "context": _EMPTY_LIST},
    "OllamaMessage": {"images": _EMPTY_LIST},
    "OllamaOptions": {"num_predict": {"anyOf": [
        {"type": "integer", "minimum": -2, "maximum": -1},
        {"type": "integer", "minimum": 1, "exclusiveMaximum": 1 << 31}, _NULL]}},
}


_NEEDED = ("prompt", "input")  # optional in the structs, refused when empty: required here


def _refine(components: dict[str, Any]) -> None:
    for name, props in _REFINE.items():
        schema = components[name]
        for prop, value in props.items():
            default = schema["properties"][prop].get("default", ...)
            schema["properties"][prop] = dict(value)
            if default is not ... and prop not in _NEEDED:
                schema["properties"][prop]["default"] = default
    for name, field in (("CompletionRequest", "prompt"), ("ResponsesRequest", "input")):
        needed = components[name]
        needed["required"] = sorted({*needed.get("required", []), field})
    if "required" in components["ContentPart"]:
        components["ContentPart"]["required"] = sorted(
            {*components["ContentPart"]["required"], "text"})
    else:
        components["ContentPart"]["required"] = ["type", "text"]
    components["ContentPart"]["properties"]["text"] = {"type": "string",
                                                       "maxLength": s.MAX_BODY}
    show = components["OllamaShowRequest"]
    show["anyOf"] = [{"required": ["model"], "properties": {"model": {"type": "string",
                                                                      "minLength": 1}}},
                     {"required": ["name"], "properties": {"name": {"type": "string",
                                                                    "minLength": 1}}}]


def build_spec() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(_STRUCTS, ref_template=REF)
    _refine(components)
    paths: dict[str, dict[str, Any]] = {}
    for method, path, op_id, summary, body, kind in ROUTES:
        op: dict[str, Any] = {"operationId": op_id, "summary": summary,
                              "responses": _responses(kind)}
        params = _params(path)
        if params:
            op["parameters"] = params
        if body is not None:
            schema = {"$ref": REF.format(name=body)} if isinstance(body, str) else body
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": schema}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Shoal head", "version": __version__,
                 "description": "OpenAI-, Anthropic- and Ollama-compatible API of a Shoal "
                                "fleet."},
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "only when the head has keys"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                           "description": "the same keys, as Anthropic's clients send them"}}},
    }


_SPEC: dict[str, Any] | None = None


async def openapi_route(request: web.Request) -> web.Response:
    global _SPEC
    if _SPEC is None:
        _SPEC = build_spec()
    return web.json_response(_SPEC)

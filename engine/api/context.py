"""What every route reads from its request: the head, the arrival time, routing hints,
and the model a request's name runs (or the refusal when it names nothing runnable)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from engine.api.errors import STATUS, error_for
from engine.errors import RequestError
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.head.prompt.turn import Routing
from engine.node.model_set import DEFAULT_KEEP_ALIVE_S, BadKeepAlive, keep_alive_seconds

HEAD: web.AppKey[Head] = web.AppKey("head", Head)


def request_key(name: str, kind: type[Any]) -> Any:
    """A typed request key where aiohttp has them (3.13+), else a plain string."""
    make = getattr(web, "RequestKey", None)
    return make(name, kind) if make is not None else f"shoal.{name}"


ARRIVED = request_key("arrived", float)  # the head's clock when the request came in
KEY_NAME = request_key("key_name", str)  # the name of the issued key used (auth.py sets it)


def conversation_key(messages: Sequence[Mapping[str, Any]], key_name: str = "") -> str | None:
    """A stable session key for a conversation whose client sends no X-Session-Id: a
    hash of what every turn of it repeats unchanged, the system prompt and the first
    user turn, and of the API key's name (two people's conversations never share a
    key). None when there is no user turn to go by."""
    system = next((m.get("content") for m in messages if m.get("role") == "system"), "")
    user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    if user is None:
        return None
    h = hashlib.sha256()
    for part in (key_name, str(system or ""), str(user)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part.encode("utf-8", "surrogatepass"))
    return "conv-" + h.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Conversation:
    """What routing reads of a chat's turns, worked out where the turns are decoded (off
    the loop for a large request: a walk over 100,000 messages holds it for 100 ms)."""

    key: str | None  # conversation_key: None when there is no user turn
    first_turn: bool  # no assistant or tool turn yet


def conversation_of(messages: Sequence[Mapping[str, Any]], key_name: str = "") -> Conversation:
    return Conversation(
        key=conversation_key(messages, key_name),
        first_turn=not any(m.get("role") in ("assistant", "tool") for m in messages))


def key_name_of(request: web.Request) -> str:
    """The name of the issued key the request came with ("" without keys)."""
    return str(request.get(KEY_NAME) or "")


def keep_alive_of(value: float | str | None) -> float | None:
    """Ollama's ``keep_alive`` in seconds (inf: never unload), None when not given;
    RequestError (400) for one that is no duration."""
    if value is None:
        return None
    try:
        return keep_alive_seconds(value, DEFAULT_KEEP_ALIVE_S)
    except BadKeepAlive as exc:
        raise RequestError(str(exc)) from None


def routing_of(request: web.Request, conversation: Conversation | None = None, *,
               cache_key: str | None = None, keep_alive: float | str | None = None
               ) -> Routing:
    """The request's placement hints: affinity, ?host= and ?prefer=, and Ollama's
    ``keep_alive`` (RequestError when it is no duration).

    Affinity: ``X-Session-Id`` (or ``X-Session-Affinity``) when sent; else a key the
    body names (``cache_key``: the Responses API's ``prompt_cache_key``); else, for a
    chat, the conversation's own key (:func:`conversation_of`, worked out with the
    decoded turns), so an agent's turns reach the node holding their prompt cache without
    a header. A derived key steers only the later turns: a first turn (no assistant turn
    yet), which any number of conversations may open with the same words, is placed by the
    policy, and where it went is remembered for the turn that follows it."""
    key = key_name_of(request)
    affinity = (request.headers.get("X-Session-Id")
                or request.headers.get("X-Session-Affinity") or None)
    if affinity is not None and key:  # one key's session id never names another's
        affinity = f"key-{key}-{affinity}"
    first_turn = False
    if affinity is None and cache_key:
        affinity = f"key-{key}-{cache_key}"
    if affinity is None and conversation is not None:
        affinity, first_turn = conversation.key, conversation.first_turn
    pin = request.query.get("host") or None
    prefer_raw = request.query.get("prefer") or request.headers.get("X-Shoal-Prefer") or ""
    prefer = tuple(p.strip() for p in prefer_raw.split(",") if p.strip())[:16]
    return Routing(affinity=affinity[:256] if affinity else None, first_turn=first_turn,
                   pin_host=pin[:256] if pin else None, prefer=prefer, keyed=bool(key),
                   keep_alive_s=keep_alive_of(keep_alive))


def resolve_model(head: Head, requested: str, *, ollama: bool = False) -> al.Resolution:
    """A request's model through the head (real model, loose names, aliases); Ollama's
    clients may add ``:latest`` to a name that has no tag."""
    found = head.resolve(requested)
    if found.unknown and ollama and requested.endswith(":latest"):
        bare = head.resolve(requested[: -len(":latest")])
        if not bare.unknown:
            return bare
    return found


def model_headers(found: al.Resolution) -> dict[str, str]:
    names: dict[str, str] = {}
    if found.model:
        names["X-Shoal-Model"] = found.model
    if found.alias:
        names["X-Shoal-Alias"] = found.alias
    return names


def refuse_resolution(request: web.Request, found: al.Resolution) -> web.Response | None:
    """The 404 or 503 answer when the name names nothing that can run, else None."""
    if found.model is not None and not found.unknown:
        return None
    code = "model_not_found" if found.unknown else "model_unavailable"
    return error_for(request, STATUS[code], found.message, code=code, param="model",
                     retry_after=found.retry_after, headers=model_headers(found))


def runnable(request: web.Request, head: Head, requested: str, *,
             ollama: bool = False, kind: Literal["text", "embeddings", "any"] = "text"
             ) -> tuple[str, dict[str, str]] | web.Response:
    """The model a request's name runs and the X-Shoal-* headers, or the refusal: a route
    that makes text refuses an embedding model, an embedding route a model that makes
    text (``kind``; "any" for a route that only describes the model)."""
    found = resolve_model(head, requested, ollama=ollama)
    refused = refuse_resolution(request, found)
    if refused is not None:
        return refused
    assert found.model is not None
    names = model_headers(found)
    embedding = head.models[found.model].embedding
    if kind == "text" and embedding:
        return error_for(request, 400, f"'{found.model}' is an embedding model and makes no "
                         "text; send it to /v1/embeddings (or Ollama's /api/embed), or name a "
                         "chat model", code="model_not_chat", param="model", headers=names)
    if kind == "embeddings" and not embedding:
        embedders = sorted(n for n, m in head.models.items() if m.embedding)
        served = (f"the fleet's embedding models: {', '.join(embedders)}" if embedders
                  else "the fleet serves no embedding model; serve one (e.g. shoal models "
                       "pull an embedding model from the catalog)")
        return error_for(request, 400, f"'{found.model}' makes text, not embeddings; name an "
                         f"embedding model ({served})", code="model_not_embedding",
                         param="model", headers=names)
    return found.model, names

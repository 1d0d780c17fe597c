"""The aiohttp application of the head: routes, keys and limits, metrics, the error shape."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from engine.api import (
    admin,
    anthropic,
    completions,
    context,
    embeddings,
    ollama,
    openai,
    ops,
    responses,
)
from engine.api.auth import Gate, add_cors_headers, gate_middleware
from engine.api.errors import error_for
from engine.api.metrics import METRICS, ApiMetrics, metrics_route
from engine.api.openapi import openapi_route
from engine.api.schemas import MAX_BODY
from engine.head.commands import AliasCommands
from engine.head.head import Head
from engine.head.observe import fleet_snapshot
from engine.snapshot import FleetSnapshot, Roles

log = logging.getLogger("shoal.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GATE: web.AppKey[Gate] = web.AppKey("gate", Gate)

HEADER_TIMEOUT_S = 60.0
"""How long a connection may take to send a request's headers, and stay idle between
requests: aiohttp's keep-alive timer runs from the moment a connection opens until a
whole request has arrived (its default, an hour, let a client that sends its headers a
byte at a time hold a connection that long). An answer being written is never cut."""
BODY_TIMEOUT_S = 60.0
"""How long a request's body may take to arrive once its headers have (a body is at
most MAX_BODY): a client that trickles it gets 408 instead of holding a handler."""


def server_options() -> dict[str, Any]:
    """The options of the HTTP server that serves :func:`build_app` (for its AppRunner)."""
    return {"keepalive_timeout": HEADER_TIMEOUT_S}


@web.middleware
async def bounded_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read the body within BODY_TIMEOUT_S (the routes then read it from memory)."""
    if request.body_exists:
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                await request.read()
        except TimeoutError:
            log.info("%s %s: the body did not arrive within %g s; answered 408",
                     request.method, request.path[:200], BODY_TIMEOUT_S)
            resp = error_for(request, 408, f"the request body did not arrive within "
                             f"{BODY_TIMEOUT_S:g} s", code="request_timeout",
                             headers={"Connection": "close"})
            await resp.prepare(request)
            await resp.write_eof()
            # close once the answer is out, rather than read the rest of the trickle for
            # aiohttp's lingering time
            request.protocol.force_close()
            return resp
    return await handler(request)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves in the route's error shape; none as a traceback."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return error_for(request, 413, f"the body is larger than {MAX_BODY} bytes",
                         code="request_too_large")
    except web.HTTPNotFound:
        return error_for(request, 404, f"no route {request.method} {request.path[:200]}",
                         code="not_found")
    except web.HTTPMethodNotAllowed as exc:
        return error_for(request, 405, f"{request.method} is not allowed on "
                         f"{request.path[:200]}; use {', '.join(sorted(exc.allowed_methods))}",
                         code="method_not_allowed",
                         headers={"Allow": ",".join(sorted(exc.allowed_methods))})
    except web.HTTPException:
        raise
    except ConnectionResetError:
        log.info("client went away during %s %s", request.method, request.path[:200])
        return web.Response(status=499)
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path[:200])
        return error_for(request, 500, "internal error; the head's log has the details",
                         code="internal_error")


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def counting(metrics: ApiMetrics, clock: Callable[[], float]) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[context.ARRIVED] = clock()
        metrics.in_flight += 1
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            metrics.in_flight -= 1
            metrics.request(_route_label(request), request.method, status)

    return middleware


def build_app(head: Head, *, snapshot: Callable[[], FleetSnapshot] | None = None,
              aliases: AliasCommands | None = None,
              serve_split: admin.ServeSplit | None = None) -> web.Application:
    """The head's API. ``snapshot`` renders ``GET /v1/fleet`` (the service's whole
    snapshot; by default the head's own view), ``aliases`` serves the alias routes,
    ``serve_split`` the ask for a model split across machines (none: refused)."""
    metrics = ApiMetrics()
    gate = Gate(head)
    if aliases is None:
        aliases = AliasCommands(head, clock=time.time)
    if snapshot is None:
        snapshot = _head_only(head, aliases)

    def refused(reason: str) -> None:
        metrics.refused[reason] += 1

    app = web.Application(client_max_size=MAX_BODY, middlewares=[
        counting(metrics, head.runner.clock), openai_errors, gate_middleware(gate, refused),
        bounded_body])
    app[context.HEAD] = head
    app[admin.ALIASES] = aliases
    if serve_split is not None:
        app[admin.SERVE_SPLIT] = serve_split
    app[ops.SNAPSHOT] = snapshot
    app[METRICS] = metrics
    app[GATE] = gate
    app.on_response_prepare.append(add_cors_headers)
    r = app.router
    r.add_post("/v1/chat/completions", openai.chat_completions)
    r.add_post("/v1/completions", completions.completions)
    r.add_post("/v1/responses", responses.responses)
    r.add_post("/v1/embeddings", embeddings.openai_embeddings)
    r.add_post("/v1/messages", anthropic.messages)
    r.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
    r.add_get("/v1/models", openai.list_models)
    r.add_get("/v1/models/{model:.+}", openai.get_model)
    r.add_post("/api/chat", ollama.chat)
    r.add_post("/api/generate", ollama.generate)
    r.add_post("/api/embed", embeddings.ollama_embed)
    r.add_post("/api/embeddings", embeddings.ollama_embeddings)
    r.add_get("/api/tags", ollama.tags)
    r.add_post("/api/show", ollama.show)
    r.add_get("/api/ps", ollama.ps)
    r.add_get("/api/version", ollama.version)
    r.add_get("/v1/fleet", ops.fleet)
    r.add_get("/health", ops.health)
    r.add_get("/metrics", metrics_route)
    r.add_get("/openapi.json", openapi_route)
    admin.add_routes(app)
    return app


def _head_only(head: Head, aliases: AliasCommands) -> Callable[[], FleetSnapshot]:
    """The snapshot of a head built without a service (tools and tests)."""
    roles = Roles(head=True, api_url=None, fleet_listen=None, node=None, member=False)

    def snapshot() -> FleetSnapshot:
        return fleet_snapshot(head, roles=roles, fleet_name=None, fleet_id="",
                              has_token=head.fleet.psk is not None, aliases=aliases.current)
    return snapshot

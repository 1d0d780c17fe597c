"""The aiohttp application of the head: routes, limits and the error shape."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine.api import openai, ops
from engine.api.errors import error_response
from engine.api.schemas import MAX_BODY
from engine.head.head import Head

log = logging.getLogger("shoal.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves in the OpenAI error shape; none as a traceback."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"the body is larger than {MAX_BODY} bytes",
                              code="request_too_large")
    except web.HTTPNotFound:
        return error_response(404, f"no route {request.method} {request.path}",
                              code="not_found")
    except web.HTTPMethodNotAllowed as exc:
        return error_response(405, f"{request.method} is not allowed on {request.path}; "
                              f"use {', '.join(sorted(exc.allowed_methods))}",
                              code="method_not_allowed")
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal error; the head's log has the details",
                              code="internal_error")


def build_app(head: Head) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[openai_errors])
    app[openai.HEAD] = head
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_get("/v1/models", openai.list_models)
    app.router.add_get("/v1/fleet", ops.fleet)
    app.router.add_get("/health", ops.health)
    return app

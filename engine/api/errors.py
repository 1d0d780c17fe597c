"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Ollama's routes (``/api/...``) answer in Ollama's own shape, ``{"error": "message"}``,
which its clients read; Anthropic's (``/v1/messages...``) in Anthropic's,
``{"type": "error", "error": {"type", "message"}}``. The engine's errors carry a code
and no status: ``STATUS`` is the one place that says how each code is answered over HTTP.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from engine.errors import ShoalError

STATUS: dict[str, int] = {
    "invalid_request": 400, "invalid_request_error": 400, "context_length_exceeded": 400,
    "fim_unsupported": 400,
    "node_not_found": 404, "model_not_found": 404,
    "fleet_busy": 429,
    "internal_error": 500,
    "no_node_available": 503, "node_unavailable": 503, "fleet_paused": 503,
    "model_unavailable": 503, "shutting_down": 503,
}

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          502: "server_error", 503: "server_error"}


# Anthropic's error types by status (its 529 "overloaded" is our 503: no node free)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                                   else "invalid_request_error"),
                      "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(status: int, message: str, *, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def _headers(retry_after: int | None,
             extra: dict[str, str] | None = None) -> dict[str, str] | None:
    headers = dict(extra or {})
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return headers or None


def error_response(status: int, message: str, *, code: str | None = None,
                   param: str | None = None, retry_after: int | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message, code=code, param=param),
                             status=status, headers=_headers(retry_after, headers))


def ollama_error(status: int, message: str, *, retry_after: int | None = None,
                 headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status,
                             headers=_headers(retry_after, headers))


def is_ollama_path(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def error_for(request: web.Request, status: int, message: str, *, code: str | None = None,
              param: str | None = None, retry_after: int | None = None,
              headers: dict[str, str] | None = None) -> web.Response:
    """An error in the shape the route's clients read."""
    if is_ollama_path(request.path):
        return ollama_error(status, message, retry_after=retry_after, headers=headers)
    if is_anthropic_path(request.path):
        return web.json_response(anthropic_body(status, message), status=status,
                                 headers=_headers(retry_after, headers))
    return error_response(status, message, code=code, param=param, retry_after=retry_after,
                          headers=headers)


def status_for(exc: ShoalError) -> int:
    """The HTTP status of an engine error; a code missing from STATUS is a bug (500)."""
    return STATUS.get(exc.code, 500)


def refusal(request: web.Request, exc: ShoalError,
            headers: dict[str, str] | None = None) -> web.Response:
    """An engine error as the route's error answer, with its status and Retry-After."""
    return error_for(request, status_for(exc), str(exc), code=exc.code,
                     retry_after=exc.retry_after, headers=headers)

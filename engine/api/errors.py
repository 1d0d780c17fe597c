"""Errors in the OpenAI shape: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

from aiohttp import web

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 502: "server_error",
          503: "server_error"}


def error_response(status: int, message: str, *, code: str | None = None,
                   param: str | None = None, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)

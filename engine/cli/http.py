"""HTTP to a running head, for the CLI's commands that go through its admin routes
(`shoal alias ...`, `shoal models serve --split`): this machine's admin secret sent to a
head on this machine only, never through a proxy; failures as one line (StartError)."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

from engine import nesting
from engine.errors import StartError


def _admin_headers(head: str) -> dict[str, str]:
    """This machine's admin secret, for a head on this machine only (never sent away)."""
    from engine.head.access.admin_secret import HEADER, AdminSecretError, read_admin_secret
    from engine.settings import default_home

    if not _local(head):
        return {}
    try:
        secret = read_admin_secret(default_home())
    except AdminSecretError as exc:
        raise StartError(str(exc)) from None
    return {HEADER: secret} if secret else {}


def _local(head: str) -> bool:
    from engine.link.transport import is_loopback

    host = head.rsplit(":", 1)[0].strip("[]") if ":" in head else head
    return host == "localhost" or is_loopback(host)


def _opener(head: str) -> urllib.request.OpenerDirector:
    """No proxy for a head on this machine: http_proxy would carry the admin secret away
    (urllib honours it even for 127.0.0.1 when no_proxy is unset)."""
    if _local(head):
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


def call(head: str, method: str, path: str, body: bytes | None = None) -> Any:
    url = f"http://{head}{path}"
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json",
                                          **_admin_headers(head)})
    try:
        with _opener(head).open(req, timeout=30) as resp:
            data = resp.read()
    except urllib.error.HTTPError as exc:
        try:
            message = nesting.json_loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        raise StartError(message) from None
    except (urllib.error.URLError, OSError) as exc:
        raise StartError(f"no head answers at {head} ({getattr(exc, 'reason', exc)}); start "
                         "one with `shoal serve`, or name it with --head HOST:PORT") from None
    try:
        return nesting.json_loads(data or b"null")
    except ValueError as exc:
        raise StartError(f"the head at {head} answered with malformed JSON ({exc}); "
                         "check that a Shoal head listens there") from None

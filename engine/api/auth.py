"""Who may call the head: the Host it is reached by, API keys, per-key limits, and
browser origins (CORS).

Settings are read from the head at each request, so the composition root can set
them at any time:

- ``allowed_hosts`` and ``host_names``: the ``Host`` values served besides
  loopback and this machine's names and addresses (`host_allowed`);
- neither ``api_key`` nor a keys secret: no keys (a head for this machine);
- ``api_key``: that one static key (``--api-key``), with no limits;
- ``keys_secret`` (bytes) or ``keys_secret_path`` (a file, watched): stateless
  keys ``sk-shoal-<name>-<sig>`` checked against the secret and the revocation
  list at ``revoked_path``, each limited by the policy (``key_policy``, or the
  file ``key_policy_path``: rate with burst, concurrent requests).

The files are watched (`keys.FileWatch`): a key issued, revoked or rotated, or a
policy edited, reaches the running head within a second. Keys turn on when the
secret file appears; once seen, a removed secret refuses every issued key (it
fails closed) until `shoal keys issue` makes a new one.

The Host check comes first and covers every path: a web page whose name was
rebound to 127.0.0.1 reaches the head as same-origin, with its own name in
``Host``. ``/health`` is otherwise open. A request to the alias routes that carries
this machine's admin secret (`shoal alias` sends it) needs no key, so `shoal alias`
works on the head's machine with keys on; coming from loopback alone is not enough
(behind a reverse proxy every client is loopback).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from engine.api.context import KEY_NAME, request_key
from engine.api.errors import error_for
from engine.head.access import keys
from engine.head.access.admin_secret import HEADER as ADMIN_HEADER
from engine.head.access.admin_secret import admin_secret_ok
from engine.head.access.hosts import host_allowed, host_of, machine_names

log = logging.getLogger("shoal.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health"})
ALLOW_HEADERS = ("Authorization, Content-Type, X-Session-Id, X-Session-Affinity, "
                 "X-Shoal-Prefer, OpenAI-Organization, OpenAI-Project, X-Api-Key, "
                 "Anthropic-Version, Anthropic-Beta")
EXPOSE_HEADERS = "X-Shoal-Model, X-Shoal-Alias, X-Shoal-Node, Retry-After"
ALLOW_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
PREFLIGHT_MAX_AGE_S = 600
NAMES_REFRESH_S = 30.0  # a missed Host looks up this machine's addresses again this often
CORS_ORIGIN = request_key("cors_origin", str)  # the allowed Origin to echo back


# -- the gate ----------------------------------------------------------------------


@dataclass
class _Watches:
    """The watched files, made when a setting names a path (and again if it changes)."""

    secret: keys.FileWatch[bytes | None] | None = None
    policy: keys.FileWatch[keys.Policy] | None = None
    revoked: keys.RevokedWatcher | None = None


class Gate:
    """Host check, auth, limits and CORS for one app, reading the head's settings as
    it goes. ``clock`` paces the file checks; ``names`` finds this machine's names."""

    def __init__(self, head: Any, *, clock: Callable[[], float] = time.monotonic,
                 names: Callable[[], frozenset[str]] = machine_names) -> None:
        self.head = head
        self.clock = clock
        self._names_source = names
        self._names: frozenset[str] = frozenset()
        self._names_at: float | None = None
        self._watch = _Watches()
        self._limiter: keys.Limiter | None = None
        self._warned: dict[str, str | None] = {}

    # -- settings ------------------------------------------------------------------

    @property
    def api_key(self) -> str | None:
        return getattr(self.head, "api_key", None) or None

    @property
    def cors_allow(self) -> tuple[str, ...]:
        return tuple(getattr(self.head, "cors_allow", ()) or ())

    @property
    def allowed_hosts(self) -> tuple[str, ...]:
        return tuple(getattr(self.head, "allowed_hosts", ()) or ())

    def _report(self, what: str, problem: str | None) -> None:
        """Log a watched file's problem once, when it changes."""
        if problem and problem != self._warned.get(what):
            log.warning("%s", problem)
        self._warned[what] = problem

    def _watched(self, what: str, w: keys.FileWatch[Any]) -> None:
        self._report(what, w.error and f"{w.error}; keeping the last good {what}")

    def secret(self) -> tuple[bool, bytes | None]:
        """(whether issued keys are on, the secret that verifies them)."""
        fixed = getattr(self.head, "keys_secret", None)
        if fixed:
            return True, bytes(fixed)
        source = getattr(self.head, "keys_secret_path", None)
        if source is None:
            return False, None
        w = self._watch.secret
        if w is None or w.path != Path(source):
            w = self._watch.secret = keys.FileWatch(Path(source), keys.read_secret, None)
        value = w.current(self.clock())
        if w.seen and value is None and w.error is None:
            self._report("keys secret", f"the keys secret {w.path} is gone: every issued key "
                         "is refused until `shoal keys issue NAME` makes a new one")
        else:
            self._watched("keys secret", w)
        return w.seen, value

    @property
    def enabled(self) -> bool:
        return self.api_key is not None or self.secret()[0]

    def limiter(self) -> keys.Limiter:
        source = getattr(self.head, "key_policy", None)
        if isinstance(source, keys.Policy):
            policy = source
        else:
            path = source if isinstance(source, str | Path) else \
                getattr(self.head, "key_policy_path", None)
            if path is None:
                policy = keys.Policy()
            else:
                w = self._watch.policy
                if w is None or w.path != Path(path):
                    w = self._watch.policy = keys.FileWatch(Path(path), keys.load_policy,
                                                            keys.Policy())
                policy = w.current(self.clock())
                self._watched("key policy", w)
        if self._limiter is None:
            self._limiter = keys.Limiter(policy)
        elif self._limiter.policy is not policy:
            self._limiter.policy = policy  # an edited policy keeps each key's bucket
        return self._limiter

    def revoked(self) -> frozenset[str]:
        source = getattr(self.head, "revoked_path", None)
        if source is None:
            return frozenset()
        w = self._watch.revoked
        if w is None or w.path != Path(source):
            w = self._watch.revoked = keys.RevokedWatcher(Path(source))
        names = w.current(self.clock())
        self._watched("revocation list", w)
        return names

    # -- checks --------------------------------------------------------------------

    def host_ok(self, host: str | None) -> bool:
        """Whether a request naming ``host`` is served (see `host_allowed`)."""
        allowed = self.allowed_hosts
        fixed = getattr(self.head, "host_names", None) or frozenset()
        if host_allowed(host, allowed, self._names | fixed):
            return True
        now = self.clock()
        if self._names_at is not None and now - self._names_at < NAMES_REFRESH_S:
            return False
        # addresses come and go (DHCP, a VPN coming up): look again, at most this often
        self._names, self._names_at = self._names_source(), now
        return host_allowed(host, allowed, self._names | fixed)

    def identify(self, token: str | None) -> tuple[str | None, str]:
        """(key name, "") for an issued key, ("", "") for the static key, or
        (None, why) when the token opens nothing."""
        if token is None:
            return None, ("this head needs an API key; send it as "
                          "'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        static = self.api_key
        if static is not None and keys.static_key_ok(static, token):
            return "", ""
        _on, secret = self.secret()
        if secret is not None:
            name = keys.verify_key(secret, token, self.revoked())
            if name is not None:
                return name, ""
            claimed = keys.key_name(token)
            if claimed is not None and keys.verify_key(secret, token, frozenset()):
                return None, (f"key {claimed!r} has been revoked; ask the fleet's owner "
                              "for a new one")
        return None, "the API key is not valid for this head; check it or ask for a new one"


def presented_key(request: web.Request) -> str | None:
    """The key a request carries: ``Authorization: Bearer`` (OpenAI's clients), else
    ``x-api-key`` (Anthropic's)."""
    bearer = keys.bearer_token(request.headers.get("Authorization"))
    if bearer is not None:
        return bearer
    other = request.headers.get("x-api-key", "").strip()
    return other or None


def _refuse(request: web.Request, status: int, message: str, code: str, *,
            retry_after: int | None = None, headers: dict[str, str] | None = None
            ) -> web.Response:
    return error_for(request, status, message, code=code, retry_after=retry_after,
                     headers=headers)


def gate_middleware(gate: Gate,
                    on_refused: Callable[[str], None] | None = None) -> Middleware:
    def refused(reason: str) -> None:
        if on_refused is not None:
            on_refused(reason)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        origin = request.headers.get("Origin")
        host = request.headers.get("Host")
        # first: a page rebound to this address must not read anything, /health included
        if not gate.host_ok(host):
            refused("host")
            shown = host_of(host or "") or (host or "")[:100]
            return _refuse(request, 403, f"this head does not answer to the host name "
                           f"{shown[:100]!r} (a guard against DNS rebinding); if you reach it "
                           f"by that name, start it with --allow-host {shown[:100]}",
                           "host_not_allowed")
        if path in OPEN_PATHS:
            return await handler(request)
        # browsers: the origin must be on the allow-list
        if origin is not None:
            if not keys.origin_allowed(origin, gate.cors_allow):
                refused("origin")
                return _refuse(request, 403, f"origin {origin[:200]!r} is not allowed; add it "
                               "to the head's CORS allow-list (--cors-allow)",
                               "origin_not_allowed")
            request[CORS_ORIGIN] = origin
            if request.method == "OPTIONS" and \
                    "Access-Control-Request-Method" in request.headers:
                return web.Response(status=204, headers={
                    "Access-Control-Allow-Methods": ALLOW_METHODS,
                    "Access-Control-Allow-Headers":
                        request.headers.get("Access-Control-Request-Headers", ALLOW_HEADERS),
                    "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
        if not gate.enabled:
            return await handler(request)
        if path.startswith("/v1/aliases") and admin_secret_ok(
                getattr(gate.head, "admin_secret", None), request.headers.get(ADMIN_HEADER)):
            return await handler(request)  # `shoal alias` on this machine: no key needed
        name, why = gate.identify(presented_key(request))
        if name is None:
            refused("key")
            return _refuse(request, 401, why, "invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="shoal"'})
        if name == "":  # the static key: the operator's, not limited
            return await handler(request)
        limiter = gate.limiter()
        verdict = limiter.admit(name, gate.clock())
        if not verdict.ok:
            refused(verdict.reason)
            return _refuse(request, 429, verdict.message, f"rate_limited_{verdict.reason}",
                           retry_after=verdict.retry_after_s)
        request[KEY_NAME] = name
        try:
            return await handler(request)
        finally:
            limiter.release(name)

    return middleware


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: CORS headers on every answer to an allowed origin,
    streams included (their headers leave before the handler returns)."""
    origin = request.get(CORS_ORIGIN)
    if origin is None:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
    vary = response.headers.get("Vary")
    response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"

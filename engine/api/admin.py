"""Alias administration over HTTP, for `shoal alias ...` on this machine.

Writes are taken only from this machine (loopback) or with the head's API key:
an alias changes what every client of the fleet gets.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from engine import nesting
from engine.api.context import HEAD
from engine.api.errors import error_response
from engine.head.access import keys
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.link.transport import is_loopback

MAX_IMPORT = 1 << 20


def _entry(e: al.AliasEntry) -> dict[str, Any]:
    return e.to_dict()


def _allowed(request: web.Request) -> bool:
    peer = request.remote or ""
    if is_loopback(peer):
        return True
    head: Head = request.app[HEAD]
    key = getattr(head, "api_key", None)
    presented = keys.bearer_token(request.headers.get("Authorization"))
    # static_key_ok compares in constant time, and lets anything in without a key: not here
    return bool(key) and presented is not None and keys.static_key_ok(key, presented)


def _refuse() -> web.Response:
    return error_response(403, "alias changes are taken from this machine only; run "
                          "`shoal alias` on the head's machine", code="forbidden")


async def _changed(head: Head, entry: al.AliasEntry) -> web.Response:
    head.save_aliases()
    held, total = await head.spread_aliases(entry)
    return web.json_response({"entry": _entry(entry), "heads_holding": held,
                              "heads_total": total})


async def list_aliases(request: web.Request) -> web.Response:
    head: Head = request.app[HEAD]
    out = []
    for e in head.aliases.entries():
        found = head.resolve(e.name)
        out.append({**_entry(e), "resolves_to": found.model,
                    "state": ("unavailable" if found.unavailable else
                              "shadowed" if found.alias is None else
                              "fallback" if found.fallback else "ok")})
    return web.json_response({"aliases": out, "digest": head.aliases.digest()})


async def history(request: web.Request) -> web.Response:
    head: Head = request.app[HEAD]
    name = request.match_info["name"]
    entries = head.aliases.history(name)
    if not entries:
        return error_response(404, f"no alias '{name}'; `shoal alias ls` lists them",
                              code="alias_not_found")
    return web.json_response({"name": name, "history": [_entry(e) for e in entries]})


async def set_alias(request: web.Request) -> web.Response:
    if not _allowed(request):
        return _refuse()
    head: Head = request.app[HEAD]
    try:
        body = nesting.json_loads(await request.read())
        target = body["target"]
        fallbacks = body.get("fallbacks", [])
        if not isinstance(target, str) or not isinstance(fallbacks, list):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return error_response(400, 'send {"target": MODEL, "fallbacks": [MODEL, ...]}',
                              code="invalid_request")
    name = request.match_info["name"]
    if name in head.models:
        return error_response(400, f"'{name}' is a model this head serves; a real model name "
                              "always wins, so choose another alias name",
                              code="alias_shadowed")
    try:
        entry = head.aliases.set(name, target, fallbacks, time.time(), head.fleet.head_id)
    except al.AliasError as exc:
        return error_response(400, str(exc), code="invalid_alias")
    return await _changed(head, entry)


async def remove_alias(request: web.Request) -> web.Response:
    if not _allowed(request):
        return _refuse()
    head: Head = request.app[HEAD]
    try:
        entry = head.aliases.remove(request.match_info["name"], time.time(), head.fleet.head_id)
    except al.AliasError as exc:
        return error_response(404, str(exc), code="alias_not_found")
    return await _changed(head, entry)


async def revert_alias(request: web.Request) -> web.Response:
    if not _allowed(request):
        return _refuse()
    head: Head = request.app[HEAD]
    try:
        entry = head.aliases.revert(request.match_info["name"], time.time(), head.fleet.head_id)
    except al.AliasError as exc:
        return error_response(400, str(exc), code="invalid_alias")
    return await _changed(head, entry)


async def export_aliases(request: web.Request) -> web.Response:
    head: Head = request.app[HEAD]
    return web.Response(text=head.aliases.to_json(), content_type="application/json")


async def import_aliases(request: web.Request) -> web.Response:
    if not _allowed(request):
        return _refuse()
    head: Head = request.app[HEAD]
    data = await request.read()
    if len(data) > MAX_IMPORT:
        return error_response(413, f"an alias file larger than {MAX_IMPORT} bytes",
                              code="request_too_large")
    try:
        incoming = al.AliasTable.from_json(data, source="the imported file")
        changed = head.aliases.import_entries(incoming.entries(), time.time(),
                                              head.fleet.head_id)
    except al.AliasError as exc:
        return error_response(400, str(exc), code="invalid_alias")
    head.save_aliases()
    held = total = 1
    for name in changed:
        entry = head.aliases.get(name)
        if entry is not None:
            held, total = await head.spread_aliases(entry)
    return web.json_response({"imported": changed, "heads_holding": held,
                              "heads_total": total})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/aliases", list_aliases)
    app.router.add_get("/v1/aliases/export", export_aliases)
    app.router.add_post("/v1/aliases/import", import_aliases)
    app.router.add_get("/v1/aliases/{name}/history", history)
    app.router.add_put("/v1/aliases/{name}", set_alias)
    app.router.add_delete("/v1/aliases/{name}", remove_alias)
    app.router.add_post("/v1/aliases/{name}/revert", revert_alias)

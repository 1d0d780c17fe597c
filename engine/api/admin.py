"""Administration over HTTP, for `shoal alias ...` and `shoal models serve --split` on this
machine: the alias routes call the head's alias commands (`engine.head.commands`), as the
app does; ``POST /v1/fleet/serve`` asks the service to serve a model split across
machines (`Shoal.serve_split`), as the Models page does.

Writes are taken only with this machine's admin secret (the CLI sends it:
engine/head/access/admin_secret.py) or the head's API key: an alias changes what every
client of the fleet gets, a split changes what machines serve, and coming from loopback
proves nothing behind a reverse proxy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from engine import nesting
from engine.api.context import HEAD
from engine.api.errors import error_response
from engine.errors import CommandError, ShoalError
from engine.head.access import keys
from engine.head.access.admin_secret import HEADER, admin_secret_ok
from engine.head.commands import AliasChange, AliasCommands

ALIASES: web.AppKey[AliasCommands] = web.AppKey("aliases", AliasCommands)
# serve a model (org/repo:QUANT) on the first machine named, its last layers on the
# memory the others lend: the line of what happens, or CommandError
ServeSplit = Callable[[str, tuple[str, ...]], Awaitable[str]]
SERVE_SPLIT: web.AppKey[ServeSplit] = web.AppKey("serve_split")
MAX_SPLIT_NAME = 256  # a machine's name in a split ask
# a split that names what is not there, or asks what cannot be done: 404 and 400; a
# machine that cannot be asked now or refuses: 409 (the default)
_SPLIT_STATUS = {"machine_unknown": 404, "bad_split": 400, "bad_model": 400}
# a change or an import that the alias table has no room for: 413, as a body too large
_STATUS = {"alias_not_found": 404, "request_too_large": 413, "alias_table_full": 413}


def _allowed(request: web.Request) -> bool:
    head = request.app[HEAD]
    if admin_secret_ok(getattr(head, "admin_secret", None), request.headers.get(HEADER)):
        return True
    key = getattr(head, "api_key", None)
    presented = keys.bearer_token(request.headers.get("Authorization"))
    # static_key_ok compares in constant time, and lets anything in without a key: not here
    return bool(key) and presented is not None and keys.static_key_ok(key, presented)


def _refuse(what: str = "alias changes", command: str = "shoal alias") -> web.Response:
    return error_response(403, f"{what} need this machine's admin secret: run "
                          f"`{command}` on the head's machine (it sends "
                          "$SHOAL_HOME/fleet/admin.secret), or send the head's --api-key",
                          code="forbidden")


def _failed(exc: CommandError) -> web.Response:
    return error_response(_STATUS.get(exc.code, 400), str(exc), code=exc.code)


def _changed(change: AliasChange) -> web.Response:
    return web.json_response({"entry": change.entry.to_dict(),
                              "heads_holding": change.heads_holding,
                              "heads_total": change.heads_total})


async def list_aliases(request: web.Request) -> web.Response:
    commands = request.app[ALIASES]
    rows: list[dict[str, Any]] = []
    for row in commands.current():
        entry = request.app[HEAD].aliases.get(row.name)
        rows.append({**(entry.to_dict() if entry else {}), "resolves_to": row.resolves_to,
                     "state": row.state})
    return web.json_response({"aliases": rows, "digest": commands.digest})


async def history(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        entries = request.app[ALIASES].history(name)
    except CommandError as exc:
        return _failed(exc)
    return web.json_response({"name": name, "history": [e.to_dict() for e in entries]})


async def set_alias(request: web.Request) -> web.Response:
    if not _allowed(request):
        return _refuse()
    try:
        body = nesting.json_loads(await request.read())
        target = body["target"]
        fallbacks = body.get("fallbacks", [])
        if not isinstance(target, str) or not isinstance(fallbacks, list) \
                or not all(isinstance(f, str) for f in fallbacks):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return error_response(400, 'send {"target": MODEL, "fallbacks": [MODEL, ...]}',
                              code="invalid_request")
    try:
        change = await request.app[ALIASES].set(request.match_info["name"], target,
                                                tuple(fallbacks))
    except CommandError as exc:
        return _failed(exc)
    return _changed(change)


async def remove_alias(request: web.Request) -> web.Response:
    if not _allowed(request):
        return _refuse()
    try:
        return _changed(await request.app[ALIASES].remove(request.match_info["name"]))
    except CommandError as exc:
        return _failed(exc)


async def revert_alias(request: web.Request) -> web.Response:
    if not _allowed(request):
        return _refuse()
    try:
        return _changed(await request.app[ALIASES].revert(request.match_info["name"]))
    except CommandError as exc:
        return _failed(exc)


async def export_aliases(request: web.Request) -> web.Response:
    return web.Response(text=request.app[ALIASES].export(), content_type="application/json")


async def import_aliases(request: web.Request) -> web.Response:
    if not _allowed(request):
        return _refuse()
    try:
        result = await request.app[ALIASES].import_table(await request.read())
    except CommandError as exc:
        return _failed(exc)
    return web.json_response({"imported": list(result.imported),
                              "heads_holding": result.heads_holding,
                              "heads_total": result.heads_total})


async def serve_split(request: web.Request) -> web.Response:
    """``{"model": "org/repo:QUANT", "split": ["laptop", "desk"]}``: serve the model on the
    first machine, its last layers on the memory the others lend."""
    if not _allowed(request):
        return _refuse("splits across machines", "shoal models serve --split")
    serve = request.app.get(SERVE_SPLIT)
    if serve is None:
        return error_response(503, "this head runs without Shoal's service and serves no "
                              "split; start it with `shoal serve`", code="no_service")
    try:
        body = nesting.json_loads(await request.read())
        model, split = body["model"], body["split"]
        if not isinstance(model, str) or not isinstance(split, list) \
                or not all(isinstance(n, str) and len(n) <= MAX_SPLIT_NAME for n in split):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return error_response(400, 'send {"model": "org/repo:QUANT", "split": [SERVING, '
                              "LENDER, ...]}, each machine as /v1/fleet names it",
                              code="invalid_request")
    try:
        line = await serve(model, tuple(split))
    except ShoalError as exc:  # a machine that refused, or this one failing to serve it
        return error_response(_SPLIT_STATUS.get(exc.code, 409), str(exc), code=exc.code)
    return web.json_response({"message": line})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/aliases", list_aliases)
    app.router.add_get("/v1/aliases/export", export_aliases)
    app.router.add_post("/v1/aliases/import", import_aliases)
    app.router.add_get("/v1/aliases/{name}/history", history)
    app.router.add_put("/v1/aliases/{name}", set_alias)
    app.router.add_delete("/v1/aliases/{name}", remove_alias)
    app.router.add_post("/v1/aliases/{name}/revert", revert_alias)
    app.router.add_post("/v1/fleet/serve", serve_split)

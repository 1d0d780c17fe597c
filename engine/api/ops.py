"""Operations routes: /health and /v1/fleet (the same snapshot the app's window renders)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from engine import __version__
from engine.api.context import HEAD
from engine.snapshot import FleetSnapshot, to_json

SNAPSHOT: web.AppKey[Callable[[], FleetSnapshot]] = web.AppKey("snapshot")


async def health(request: web.Request) -> web.Response:
    head = request.app[HEAD]
    ready = sum(1 for p in head.fleet.pools.values()
                if p.state == "ready" and p.info.model in head.models)
    return web.json_response({"status": "ok" if ready else "degraded", "version": __version__,
                              "model": head.model.name, "nodes_ready": ready,
                              "nodes": len(head.fleet.pools)})


async def fleet(request: web.Request) -> web.Response:
    return web.json_response(to_json(request.app[SNAPSHOT]()))

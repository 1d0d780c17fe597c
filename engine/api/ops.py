"""Operations routes: /health and /v1/fleet."""

from __future__ import annotations

from aiohttp import web

from engine import __version__
from engine.api.context import HEAD


async def health(request: web.Request) -> web.Response:
    head = request.app[HEAD]
    ready = sum(1 for p in head.fleet.pools.values()
                if p.state == "ready" and p.info.model in head.models)
    return web.json_response({"status": "ok" if ready else "degraded", "version": __version__,
                              "model": head.model.name, "nodes_ready": ready,
                              "nodes": len(head.fleet.pools)})


async def fleet(request: web.Request) -> web.Response:
    return web.json_response(request.app[HEAD].fleet_snapshot())

"""A Hugging Face hub on 127.0.0.1 serving local files, for pulls with no network.

It answers the two calls a pull makes, in the hub's own shapes: the repo's file tree
(`GET /api/models/{repo}/tree/main`) and a file (`HEAD`/`GET .../resolve/main/{name}`,
with the commit and ETag headers huggingface_hub keys its cache on). A download can
be held part-way (``hold_after`` bytes) until the test releases it, so a test can
cancel a pull while it is running. huggingface_hub reads its endpoint once at import;
:func:`pointed_at` repoints it for one test.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from huggingface_hub import close_session, constants, hf_api  # imported here, off the loop

COMMIT = "0" * 40
CHUNK = 256 * 1024


@dataclass
class FakeHub:
    repos: dict[str, dict[str, Path]]  # repo id -> file name -> the local file served
    hold_after: int | None = None  # bytes of a GET sent before waiting for `release`
    release: asyncio.Event = field(default_factory=asyncio.Event)
    held: asyncio.Event = field(default_factory=asyncio.Event)  # a GET is waiting
    gets: int = 0
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/tree/main", self._tree)
        app.router.add_route("HEAD", "/{org}/{name}/resolve/main/{file}", self._head)
        app.router.add_get("/{org}/{name}/resolve/main/{file}", self._get, allow_head=False)
        return app

    def _file(self, request: web.Request) -> Path:
        files = self.repos.get(f"{request.match_info['org']}/{request.match_info['name']}")
        if files is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"})
        path = files.get(request.match_info.get("file", ""))
        if path is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        return path

    async def _tree(self, request: web.Request) -> web.Response:
        files = self.repos.get(f"{request.match_info['org']}/{request.match_info['name']}")
        if files is None:
            return web.json_response({"error": "Repository not found"}, status=404,
                                     headers={"X-Error-Code": "RepoNotFound"})
        return web.json_response([
            {"type": "file", "path": name, "size": path.stat().st_size, "oid": _etag(path)}
            for name, path in files.items()])

    def _headers(self, path: Path) -> dict[str, str]:
        return {"X-Repo-Commit": COMMIT, "ETag": f'"{_etag(path)}"',
                "Content-Length": str(path.stat().st_size), "Accept-Ranges": "bytes"}

    async def _head(self, request: web.Request) -> web.Response:
        path = self._file(request)
        return web.Response(headers=self._headers(path))

    async def _get(self, request: web.Request) -> web.StreamResponse:
        path = self._file(request)
        self.gets += 1
        size = path.stat().st_size
        start = 0
        if request.http_range.start is not None:
            start = request.http_range.start
        headers = self._headers(path)
        headers["Content-Length"] = str(size - start)
        response = web.StreamResponse(status=206 if start else 200, headers=headers)
        if start:
            response.headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        await response.prepare(request)
        sent = start
        with path.open("rb") as f:
            f.seek(start)
            while chunk := f.read(CHUNK):
                if self.hold_after is not None and sent >= self.hold_after:
                    self.held.set()
                    await self.release.wait()
                try:
                    await response.write(chunk)
                except ConnectionResetError:  # the client stopped the pull
                    return response
                sent += len(chunk)
        await response.write_eof()
        return response


_SHAS: dict[Path, str] = {}


def _etag(path: Path) -> str:
    # what the hub gives an LFS file: its sha256, worked out before serving (off the loop)
    return _SHAS[path]


def _hash_all(hub: FakeHub) -> None:
    for files in hub.repos.values():
        for path in files.values():
            if path not in _SHAS:
                with path.open("rb") as f:
                    _SHAS[path] = hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.asynccontextmanager
async def serving(hub: FakeHub) -> AsyncIterator[FakeHub]:
    await asyncio.to_thread(_hash_all, hub)
    runner = web.AppRunner(hub.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    hub.url = f"http://127.0.0.1:{port}"
    try:
        yield hub
    finally:
        hub.release.set()
        await runner.cleanup()


@contextlib.contextmanager
def pointed_at(monkeypatch: pytest.MonkeyPatch, url: str) -> Iterator[None]:
    """huggingface_hub talks to ``url`` instead of the hub, for this test only."""
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf_api.api, "endpoint", url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        yield
    finally:
        close_session()  # its pooled connection to this hub

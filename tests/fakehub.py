"""A Hugging Face hub on 127.0.0.1 serving local files, for pulls with no network.

It answers the calls a pull makes, in the hub's own shapes: the model info with its files'
sizes and LFS sha256 (`GET /api/models/{repo}?blobs=True`, what `HfApi().model_info(repo,
files_metadata=True)` asks), the repo's file tree (`GET /api/models/{repo}/tree/main`) and
a file (`HEAD`/`GET .../resolve/{revision}/{name}`, with `Range` and the commit and ETag
headers huggingface_hub keys its cache on).

What a test can make it do, and what it counts:

- ``hold_after``: bytes of a GET sent before it waits for ``release`` (a pull held
  part-way, to cancel it while it runs);
- ``cut_after``: bytes of a GET sent before its connection is closed, for the next
  ``cuts`` GETs (None: every one) -- a download interrupted half way;
- ``corrupt``: the bytes served differ from the sha256 the model info gives (one byte in
  the middle is flipped);
- ``rate_bps``: the bytes a second it sends at most (a download slow enough to measure);
- ``no_range``: it answers every GET with the whole file (a server that ignores Range);
- ``gets`` (GETs of a file), ``starts`` (the byte each began at), ``sent`` (file bytes
  written), ``infos`` (model-info requests).

huggingface_hub reads its endpoint once at import; :func:`pointed_at` repoints it for one
test.
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
    cut_after: int | None = None  # bytes of a GET sent before its connection is closed
    cuts: int | None = None  # how many GETs are cut (None: all, while cut_after is set)
    corrupt: bool = False  # serve bytes that do not match the advertised sha256
    rate_bps: int | None = None  # at most this many bytes a second
    no_range: bool = False  # ignore Range: every GET sends the whole file
    hold_infos: bool = False  # a model's info waits for `release` (a hub that hangs)
    gets: int = 0
    starts: list[int] = field(default_factory=list)  # the first byte of each GET
    sent: int = 0  # bytes of files written to clients
    infos: int = 0
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/tree/main", self._tree)
        app.router.add_get("/api/models/{org}/{name}", self._info)
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_route("HEAD", "/{org}/{name}/resolve/{rev}/{file:.+}", self._head)
        app.router.add_get("/{org}/{name}/resolve/{rev}/{file:.+}", self._get,
                           allow_head=False)
        return app

    def _repo(self, request: web.Request) -> dict[str, Path]:
        files = self.repos.get(f"{request.match_info['org']}/{request.match_info['name']}")
        if files is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"},
                                   text='{"error": "Repository not found"}')
        return files

    def _file(self, request: web.Request) -> Path:
        path = self._repo(request).get(request.match_info.get("file", ""))
        if path is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        return path

    async def _tree(self, request: web.Request) -> web.Response:
        files = self._repo(request)
        return web.json_response([
            {"type": "file", "path": name, "size": path.stat().st_size, "oid": _etag(path)}
            for name, path in files.items()])

    async def _info(self, request: web.Request) -> web.Response:
        """The model info as the hub gives it with ``blobs=True``: every file with its
        size, git blob id and LFS record (size, sha256, pointer size)."""
        files = self._repo(request)
        self.infos += 1
        if self.hold_infos:
            await self.release.wait()
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response({
            "_id": "0" * 24, "id": repo, "modelId": repo, "sha": COMMIT, "private": False,
            "siblings": [
                {"rfilename": name, "size": path.stat().st_size, "blobId": "1" * 40,
                 "lfs": {"size": path.stat().st_size, "sha256": _etag(path),
                         "pointerSize": 135}}
                for name, path in files.items()]})

    def _headers(self, path: Path) -> dict[str, str]:
        return {"X-Repo-Commit": COMMIT, "ETag": f'"{_etag(path)}"',
                "Content-Length": str(path.stat().st_size), "Accept-Ranges": "bytes"}

    async def _head(self, request: web.Request) -> web.Response:
        path = self._file(request)
        return web.Response(headers=self._headers(path))

    def _cut_this_one(self) -> int | None:
        if self.cut_after is None or self.cuts == 0:
            return None
        if self.cuts is not None:
            self.cuts -= 1
        return self.cut_after

    async def _get(self, request: web.Request) -> web.StreamResponse:
        path = self._file(request)
        self.gets += 1
        size = path.stat().st_size
        start = 0 if self.no_range else request.http_range.start or 0
        # bytes=A-B: stop is B + 1
        stop = size if self.no_range else min(size, request.http_range.stop or size)
        self.starts.append(start)
        cut = self._cut_this_one()
        headers = self._headers(path)
        headers["Content-Length"] = str(stop - start)
        ranged = bool(start) or stop < size
        response = web.StreamResponse(status=206 if ranged else 200, headers=headers)
        if ranged:
            response.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        await response.prepare(request)
        sent = start
        with path.open("rb") as f:
            f.seek(start)
            # the file is read off the loop, as a real server's sendfile would be
            while chunk := await asyncio.to_thread(f.read, min(CHUNK, stop - sent)):
                if self.hold_after is not None and sent >= self.hold_after:
                    self.held.set()
                    await self.release.wait()
                if cut is not None:
                    chunk = chunk[:max(0, cut - (sent - start))]
                chunk = self._spoil(chunk, sent, size)
                try:
                    await response.write(chunk)
                except ConnectionResetError:  # the client stopped the pull
                    return response
                sent += len(chunk)
                self.sent += len(chunk)
                if cut is not None and sent - start >= cut:
                    assert request.transport is not None
                    request.transport.close()  # the connection breaks half way
                    return response
                if self.rate_bps:
                    await asyncio.sleep(len(chunk) / self.rate_bps)
        await response.write_eof()
        return response

    def _spoil(self, chunk: bytes, offset: int, size: int) -> bytes:
        middle = size // 2
        if not self.corrupt or not offset <= middle < offset + len(chunk):
            return chunk
        at = middle - offset
        return chunk[:at] + bytes([chunk[at] ^ 0xFF]) + chunk[at + 1:]


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

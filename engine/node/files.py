"""A model's files between machines of the fleet, over the fleet's link.

**Answering** (:class:`FileShelf`, served by the node agent on every link a head may
open): a peer asks which files of a hub model this machine keeps (``FilesWanted``); the
answer names each file with its size and sha256 (``FilesOffered``), the sha256 being the
name of its blob in the hub cache, which this machine's own pull checked against the hub.
Then the peer asks for a file's bytes from an offset (``FileWanted``) and they come in
``FileChunk`` records, at most one MiB each, each sent once the link has drained the one
before (so a slow reader holds this end back, not its memory). Only files of the hub
cache are handed out, and only to a peer that holds the fleet token (the link's
handshake).

**Asking** (:class:`FleetPeers`, a pull's :class:`~engine.models.pulls.peers.Peers`):
from the pull's worker thread, each machine it knows is dialed on a private event loop,
as a head dials a node (its hello names no model), and asked in turn; the first that
keeps the model's files is their source. Each file then comes over a link of its own,
written to the pull's part as it arrives and checked like a download (resumable from
the part, its sha256 compared at the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import socket
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import BinaryIO

from engine.link import messages as m
from engine.link.connection import LinkError
from engine.link.hello import exchange_hellos
from engine.link.transport import Link, LinkClosed, dial
from engine.models.errors import ModelMissing
from engine.models.ids import ModelChoiceError, models_dir, pick_gguf, shards_of
from engine.models.pulls.cache import blob_path, main_commit, repo_dir
from engine.models.pulls.peers import PeerOffer
from engine.models.pulls.transfer import Sink, Source, SourceBroken, Wanted
from engine.sizes import amount

log = logging.getLogger("shoal.node")

DIAL_S = 5.0  # a machine that does not answer by then is passed over
ANSWER_S = 30.0  # for the list of files (the answering side reads a folder)
CHUNK_S = 60.0  # no chunk for this long: the transfer is taken as broken
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


# -- answering -------------------------------------------------------------------------


class FileShelf:
    """The model files of this machine's hub cache (``$SHOAL_HOME/models/hub``) that the
    fleet may take."""

    def __init__(self, home: Path) -> None:
        self.cache = models_dir(home) / "hub"

    def offer(self, want: m.FilesWanted) -> m.FilesOffered | None:
        """The files of the model ``want`` names, as kept here whole; None when it is not
        (or not whole). Blocking: reads the cache's folders."""
        commit = main_commit(self.cache, want.repo)
        if commit is None or not _COMMIT.match(commit):
            return None
        snap = repo_dir(self.cache, want.repo) / "snapshots" / commit
        try:
            names = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*")
                           if p.is_file())
            chosen = pick_gguf(names, want.quant or None)
        except (OSError, ModelChoiceError):
            return None
        files: list[m.OfferedFile] = []
        for name in shards_of(names, chosen)[:m.MAX_FILES]:
            blob = (snap / name).resolve()
            if not _SHA256.match(blob.name) or len(name) > m.MAX_FILE_NAME:
                return None  # not laid out as a pull leaves it: nothing to check it by
            try:
                size = blob.stat().st_size
            except OSError:
                return None
            files.append(m.OfferedFile(name=name, size=size, sha256=blob.name))
        return m.FilesOffered(repo=want.repo, commit=commit, files=files)

    def blob(self, want: m.FileWanted) -> Path | None:
        path = blob_path(self.cache, want.repo, want.sha256)
        return path if path.is_file() else None

    async def answer(self, link: Link, rec: m.FilesWanted | m.FileWanted) -> None:
        """Answer ``rec`` on ``link``: the list of files, or one file's bytes."""
        try:
            if isinstance(rec, m.FilesWanted):
                offered = await asyncio.to_thread(self.offer, rec)
                link.send(offered if offered is not None else m.Error(
                    code="not_found", message=f"this machine keeps no whole copy of "
                                              f"{rec.repo}{':' + rec.quant if rec.quant else ''}"))
                return
            path = await asyncio.to_thread(self.blob, rec)
            if path is None:
                link.send(m.Error(code="not_found",
                                  message=f"this machine keeps no file {rec.sha256[:12]}… of "
                                          f"{rec.repo}"))
                return
            await _send_file(link, path, rec.offset)
        except LinkClosed:
            pass  # the peer went: it resumes from what it has


async def _send_file(link: Link, path: Path, offset: int) -> None:
    """The file's bytes from ``offset`` in FileChunks; the next chunk is read from the
    disk while the link sends this one."""
    f: BinaryIO = await asyncio.to_thread(path.open, "rb")
    reading: asyncio.Future[bytes] | None = None
    try:
        await asyncio.to_thread(f.seek, offset)
        reading = asyncio.ensure_future(asyncio.to_thread(f.read, m.MAX_CHUNK))
        while data := await reading:
            reading = asyncio.ensure_future(asyncio.to_thread(f.read, m.MAX_CHUNK))
            link.send(m.FileChunk(data=data))
            await link.drain()
    finally:
        if reading is not None and not reading.done():  # its thread still reads f
            with contextlib.suppress(Exception):
                await asyncio.shield(reading)
        await asyncio.to_thread(f.close)


# -- asking ----------------------------------------------------------------------------


class FleetPeers:
    """The machines of the fleet a pull asks for a model's files before the hub:
    ``addresses()`` (HOST:PORT of their nodes' listeners) and the fleet token, read when a
    pull asks (both may change while Shoal runs)."""

    def __init__(self, addresses: Callable[[], Sequence[str]],
                 psk: Callable[[], bytes | None], *, name: str = "") -> None:
        self._addresses = addresses
        self._psk = psk
        self.name = name or socket.gethostname()

    def offer(self, repo: str, quant: str | None,
              stopped: Callable[[], bool]) -> PeerOffer | None:
        psk = self._psk()
        if psk is None:  # no fleet: nothing to ask (and no plaintext links off this machine)
            return None
        want = m.FilesWanted(repo=repo, quant=quant or "")
        for address in dict.fromkeys(self._addresses()):
            if stopped():
                return None
            try:
                got = asyncio.run(self._ask(address, psk, want))
            except (OSError, LinkError, LinkClosed, TimeoutError, ValueError) as exc:
                log.info("asked %s for %s: no answer (%s)", address, repo, exc)
                continue
            if got is None:
                continue
            identity, offered = got
            wanted = [Wanted(offered.repo, offered.commit, f.name, f.size, f.sha256)
                      for f in offered.files]
            log.info("%s keeps %s (%s): taking it from there", identity, repo,
                     amount(sum(w.size for w in wanted)))
            where = f"from {identity} ({address}), a machine of the fleet"
            return PeerOffer(wanted, Source(where, partial(self._send, address, psk)))
        return None

    async def _open(self, address: str, psk: bytes) -> tuple[Link, m.NodeHello]:
        host, _, port = address.rpartition(":")
        link = await dial(host.strip("[]"), int(port), psk=psk, timeout_s=DIAL_S)
        hello = m.HeadHello(head_id=f"files-{secrets.token_hex(8)}", model="",
                            name=self.name[:m.MAX_NAME])
        node = await exchange_hellos(link, hello, responder=False, expect=m.NodeHello,
                                     timeout_s=DIAL_S)
        return link, node

    async def _ask(self, address: str, psk: bytes,
                   want: m.FilesWanted) -> tuple[str, m.FilesOffered] | None:
        link, node = await self._open(address, psk)
        try:
            link.send(want)
            async with asyncio.timeout(ANSWER_S):
                while True:
                    rec = await link.recv()
                    if isinstance(rec, m.FilesOffered) and rec.repo == want.repo:
                        return node.identity, rec
                    if isinstance(rec, m.Error):
                        return None
        finally:
            link.close()

    def _send(self, address: str, psk: bytes, wanted: Wanted, offset: int,
              sink: Sink) -> None:
        """The file's bytes from ``offset``, handed to ``sink`` (blocking: its own loop)."""
        try:
            asyncio.run(self._receive(address, psk, wanted, offset, sink))
        except (OSError, LinkError, LinkClosed, TimeoutError) as exc:
            raise SourceBroken(str(exc) or type(exc).__name__) from None

    async def _receive(self, address: str, psk: bytes, wanted: Wanted, offset: int,
                       sink: Sink) -> None:
        link, node = await self._open(address, psk)
        writing: asyncio.Future[None] | None = None
        try:
            link.send(m.FileWanted(repo=wanted.repo, sha256=wanted.sha256, offset=offset))
            done = offset
            while done < wanted.size:
                async with asyncio.timeout(CHUNK_S):
                    rec = await link.recv()
                if isinstance(rec, m.FileChunk):
                    # written and hashed in a thread while the next chunk comes (both
                    # leave the GIL), one chunk at a time, in order
                    if writing is not None:
                        await writing
                    writing = asyncio.ensure_future(asyncio.to_thread(sink, rec.data))
                    done += len(rec.data)
                elif isinstance(rec, m.Error):
                    raise ModelMissing(f"{node.identity} stopped sending {wanted.label}: "
                                       f"{rec.message}; run again")
            if writing is not None:
                await writing
        finally:
            if writing is not None and not writing.done():  # the sink is the caller's
                with contextlib.suppress(Exception):
                    await asyncio.shield(writing)
            link.close()

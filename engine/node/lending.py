"""Memory lent to the fleet, and reached through it: llama.cpp's RPC server carried by the
fleet's link (issue 33).

**Lending** (:class:`Lender`, on a machine whose owner allows it: ``--lend``): llama.cpp's
RPC server runs in a process of its own (engine.runtimes.rpc_lender), started on the first
request, bound to ``127.0.0.1`` on a port of its own, so that no other machine can reach
it; its tensor cache lives under ``$SHOAL_HOME/rpc-cache``, so a split that forms again
sends no weight twice. A head-like peer that holds the fleet token sends ``RpcOpen`` on a
link to this machine's node; the node connects to the server on loopback and the link
carries that connection's bytes both ways (``RpcBytes``) until either side ends.

**Reaching** (:class:`Tunnel`, on the node that serves a split model): a listener on this
machine's loopback whose every connection becomes a link to the lending machine and an
``RpcOpen`` there; llama.cpp's RPC client connects to that listener (``127.0.0.1:PORT``)
as if the server were here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from engine.link import messages as m
from engine.link.hello import exchange_hellos
from engine.link.transport import Link, LinkClosed, dial
from engine.models.pulls.quota import DEFAULT_QUOTA, Quota
from engine.node import power, rpc_cache
from engine.tasks import TaskSet, cancel_and_wait

log = logging.getLogger("shoal.node")

START_S = 30.0  # the RPC server's start (it loads the CPU backend)
DIAL_S = 10.0
READ = m.MAX_CHUNK  # bytes read from a socket at a time
CONNECT_RETRY_S = 0.05  # between tries to reach the RPC server as it starts
START_TRIES = 3  # a port another process took between our pick and the server's bind
BEAT_S = 2.0  # the lending side's sign of life on each RPC connection
STALL_S = 15.0  # a lending machine silent this long is taken as gone (it sleeps)


def stall_seconds() -> float:
    """STALL_S, or SHOAL_RPC_STALL_S where a test sets it shorter."""
    try:
        return max(float(os.environ.get("SHOAL_RPC_STALL_S", STALL_S)), BEAT_S * 2)
    except ValueError:
        return STALL_S


async def _pipe(link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                on_peer_end: Callable[[], None] | None = None, *, beat_s: float = 0.0,
                stall_s: float = 0.0) -> None:
    """Carry a TCP connection's bytes over ``link`` both ways until either ends.
    ``on_peer_end``: called when the link's side ended first (the other machine left),
    before the socket closes. ``beat_s``: the lending side says it is there that often
    (an empty RpcBytes), also while its server computes; ``stall_s``: the serving side
    takes a link silent that long as ended (the lending machine sleeps, or its network
    went: no TCP reset comes for minutes)."""
    async def out() -> None:  # the socket's bytes onto the link
        while data := await reader.read(READ):
            link.send(m.RpcBytes(data=data))
            await link.drain()

    async def back() -> None:  # the link's bytes into the socket
        while True:
            if stall_s:
                async with asyncio.timeout(stall_s):
                    rec = await link.recv()
            else:
                rec = await link.recv()
            if isinstance(rec, m.RpcBytes):
                if rec.data:
                    writer.write(rec.data)
                    await writer.drain()
            elif isinstance(rec, m.Error):
                return

    async def beat() -> None:
        while True:
            await asyncio.sleep(beat_s)
            link.send(m.RpcBytes(data=b""))

    sending = asyncio.create_task(out(), name="rpc-out")
    tasks = [sending, asyncio.create_task(back(), name="rpc-back")]
    if beat_s:
        tasks.append(asyncio.create_task(beat(), name="rpc-beat"))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # the socket's end is the local side's; anything else (the link closed, an
        # Error from the other side, a failed send) is the other machine's
        local_end = sending.done() and not sending.cancelled() and \
            sending.exception() is None
        await cancel_and_wait(tasks, "an RPC connection")
        link.close()
        if on_peer_end is not None and not local_end:
            on_peer_end()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


class NotLending(Exception):
    """The machine asked lends no memory (its owner did not allow it); its reason."""


class Lender:
    """This machine's RPC server, for the fleet's split models."""

    def __init__(self, home: Path, *, lend_bytes: int, threads: int,
                 on_battery_too: bool = False, quota: Quota = DEFAULT_QUOTA) -> None:
        self.home = home
        self.cache = home / "rpc-cache"
        self.quota = quota  # what the fleet may keep here, its tensors with its models
        self.on_battery_too = on_battery_too  # else it lends only on mains power
        self.lend_bytes = lend_bytes
        self.threads = threads
        self._proc: asyncio.subprocess.Process | None = None
        self._port = 0
        self._lock = asyncio.Lock()
        self._tasks = TaskSet("the memory lent")

    @property
    def port(self) -> int:
        """Where its server listens on 127.0.0.1 (0: not started, or ended)."""
        return self._port if self._proc is not None and self._proc.returncode is None else 0

    async def _ensure(self) -> int:
        async with self._lock:
            if self.port:
                return self._port
            await self.close()
            await asyncio.to_thread(self.cache.mkdir, parents=True, exist_ok=True)
            await self.trim()
            for attempt in range(START_TRIES):
                port = _free_port()  # another process may take it before the server binds
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "engine.runtimes.rpc_lender", f"127.0.0.1:{port}",
                    str(self.cache), str(self.threads), str(self.lend_bytes),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True)
                self._proc = proc
                try:
                    async with asyncio.timeout(START_S):
                        await _serving(proc)
                        # it says it listens before it binds: a connection proves it
                        _, writer = await _connect(port, proc)
                        writer.close()
                except RuntimeError:
                    await self.close()
                    if attempt + 1 == START_TRIES:
                        raise
                    continue
                except BaseException:
                    await self.close()
                    raise
                break
            self._port = port
            # its later lines (each client it takes) would fill the pipe: read them away
            self._tasks.spawn(_drain(proc), "rpc-server-output")
            log.info("lending memory to the fleet: llama.cpp's RPC server on 127.0.0.1:%d "
                     "(pid %d)", port, proc.pid)
            return port

    async def refusal(self) -> str | None:
        """Why it lends nothing now (on battery, its owner not having asked), else None."""
        if not self.on_battery_too and await asyncio.to_thread(power.on_battery):
            return ("it runs on its battery and lends memory only on mains power "
                    "(--lend-on-battery lends on battery too)")
        return None

    async def tunnel(self, link: Link) -> None:
        """Carry ``link`` to this machine's RPC server until either ends."""
        port = await self._ensure()
        reader, writer = await _connect(port)
        link.send(m.RpcOpened(lend_bytes=self.lend_bytes))
        try:
            await _pipe(link, reader, writer, beat_s=BEAT_S)
        finally:  # the tensors that split sent are on the disk now
            await self.trim()

    async def trim(self) -> None:
        """Keep the tensor cache within the fleet's quota here (engine.node.rpc_cache)."""
        try:
            await asyncio.to_thread(rpc_cache.trim, self.home, self.cache, self.quota)
        except OSError as exc:
            log.warning("could not trim the tensors kept for the fleet's split models in "
                        "%s: %s", self.cache, exc)

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        self._port = 0
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(5):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await self._tasks.close()


async def _connect(port: int, proc: asyncio.subprocess.Process | None = None
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the server on 127.0.0.1:``port``: it says it listens a moment
    before it does, and takes one client at a time (the next waits in its backlog).
    RuntimeError when ``proc`` (the server) ended first."""
    async with asyncio.timeout(START_S):
        while True:
            try:
                return await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                if proc is not None and proc.returncode is not None:
                    raise RuntimeError("llama.cpp's RPC server ended as it started (its "
                                       f"port {port} was taken?)") from None
                await asyncio.sleep(CONNECT_RETRY_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serving(proc: asyncio.subprocess.Process) -> None:
    """Until the server says it listens (its "transport" line); RuntimeError if it ends."""
    assert proc.stdout is not None
    seen: list[str] = []
    while raw := await proc.stdout.readline():
        line = raw.decode(errors="replace").strip()
        seen.append(line)
        if line.startswith("transport"):
            return
    raise RuntimeError("llama.cpp's RPC server did not start: " + " | ".join(seen[-3:]))


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while raw := await proc.stdout.readline():
        log.debug("rpc server: %s", raw.decode(errors="replace").rstrip())


class Tunnel:
    """A loopback port on this machine that reaches a lending machine's RPC server.

    ``on_lost`` (set by whoever uses the port) hears when a connection's link ended from
    the lending machine's side: it left, or its server ended."""

    def __init__(self, address: str, psk: bytes | None, name: str) -> None:
        self.address = address
        self.psk = psk
        self.name = name
        self.lend_bytes = 0
        self.endpoint = ""
        self.identity = ""  # the lending machine's name, as its node says it
        self.on_lost: Callable[[str], None] | None = None
        self._server: asyncio.Server | None = None
        self._tasks = TaskSet("an RPC tunnel")

    @property
    def label(self) -> str:
        """The lending machine as lines name it: "desk (192.168.1.20:8455)"."""
        return f"{self.identity or 'a machine of the fleet'} ({self.address})"

    async def open(self) -> None:
        """Ask the lending machine once (what it lends), then listen on loopback."""
        await self.probe()
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"127.0.0.1:{port}"

    async def probe(self) -> None:
        """Ask the lending machine whether it lends now (and how much); NotLending,
        OSError, LinkClosed or TimeoutError when it does not answer so."""
        link, opened = await self._connect()
        link.close()
        self.lend_bytes = opened.lend_bytes

    async def _connect(self) -> tuple[Link, m.RpcOpened]:
        host, _, port = self.address.rpartition(":")
        link = await dial(host.strip("[]"), int(port), psk=self.psk, timeout_s=DIAL_S)
        hello = m.HeadHello(head_id=f"rpc-{secrets.token_hex(8)}", model="",
                            name=self.name[:m.MAX_NAME])
        try:
            node = await exchange_hellos(link, hello, responder=False, expect=m.NodeHello,
                                         timeout_s=DIAL_S)
            self.identity = node.identity
            link.send(m.RpcOpen())
            async with asyncio.timeout(START_S + DIAL_S):
                while True:
                    rec = await link.recv()
                    if isinstance(rec, m.RpcOpened):
                        return link, rec
                    if isinstance(rec, m.Error) and rec.code == "not_found":
                        raise NotLending(rec.message)
                    if isinstance(rec, m.Error):  # it lends, but its server failed
                        raise LinkClosed(rec.message)
        except BaseException:
            link.close()
            raise

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.spawn(self._carry(reader, writer), "rpc-tunnel")

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            link, _ = await self._connect()
        except (OSError, LinkClosed, TimeoutError, NotLending) as exc:
            log.warning("cannot reach the memory %s lends: %s", self.label, exc)
            self._lost(f"{self.label} does not answer ({exc})")
            writer.close()
            return
        await _pipe(link, reader, writer,
                    on_peer_end=lambda: self._lost(f"the link to {self.label} ended"),
                    stall_s=stall_seconds())

    def _lost(self, why: str) -> None:
        if self.on_lost is not None:
            self.on_lost(why)

    async def close(self) -> None:
        self.on_lost = None
        if self._server is not None:
            self._server.close()
            self._server = None
        await self._tasks.close()

"""A real llama-server process on 127.0.0.1 for tests and benchmarks, ended by its pid.

The binary comes from the ``llama_server_binary`` fixture (tests/conftest.py), built once
per machine by ``scripts/test`` (scripts/lib/llama_server.py). llama-server binds port 0
itself and logs ``listening on http://127.0.0.1:PORT`` once its model is loaded, so the
port is read from its log (no race for a free port), then ``/health`` must say ok.

In an async test (the loop is never blocked: the waits poll)::

    async with running_llama_server(llama_server_binary, smollm2_gguf, parallel=4,
                                    log=tmp_path / "llama-server.log") as srv:
        srv.url        # http://127.0.0.1:PORT
        srv.kill()     # SIGKILL by pid, e.g. mid-stream; the context exit is then a no-op

From blocking code (a benchmark, a ``processes`` test)::

    srv = LlamaServer(binary, model, parallel=8, log=path)
    srv.start(); srv.wait_ready_sync()
    try: ...
    finally: srv.stop_sync()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

from engine.runtimes.cpu_quirks import repack_here

READY_TIMEOUT = 120.0  # s: loading a small model on a busy 2-core machine
STOP_TIMEOUT = 10.0
POLL_S = 0.05
_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def same_repacking() -> list[str]:
    """llama-server's flag for what Shoal's runtime does with weights on this CPU (kept
    unpacked on AMX CPUs, where llama.cpp's AMX path crashes: cpu_quirks.py), so that
    both start and are compared on the same kernels."""
    return [] if repack_here() else ["--no-repack"]


class LlamaServer:
    """One llama-server process that this code started; stopped only by its pid."""

    def __init__(self, binary: Path, model: Path, *, parallel: int = 4, ctx_per_slot: int = 1024,
                 threads: int | None = None, log: Path, extra: Sequence[str] = ()) -> None:
        self.cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "0",
                    "--parallel", str(parallel), "-c", str(ctx_per_slot * parallel),
                    "--no-ui", *same_repacking(), *extra]
        # llama-server counts the machine's cores, not the CPUs it may run on: a suite
        # worker pinned to one CPU would run two threads spinning at barriers on it
        threads = threads if threads is not None else len(os.sched_getaffinity(0))
        self.cmd += ["-t", str(threads), "-tb", str(threads)]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("llama-server is not ready yet")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def _poll_port(self) -> int:
        """The port from the log once it is listening; raises if the process ended."""
        assert self.proc is not None
        m = _LISTENING.search(self.log.read_text(errors="replace"))
        if m:
            return int(m.group(1))
        if self.proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {self.proc.returncode} while "
                               f"starting: {self.tail()}")
        return 0

    def tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until it listens and ``/health`` answers ``{"status": "ok"}``; bounded."""
        deadline = time.monotonic() + timeout
        while not self.port:
            self.port = self._poll_port()
            if not self.port:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not listen within {timeout:.0f} s: "
                                       f"{self.tail()}")
                await asyncio.sleep(POLL_S)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with http.get(f"{self.url}/health") as r:
                        if r.status == 200 and (await r.json()).get("status") == "ok":
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server /health not ok within {timeout:.0f} s: "
                                       f"{self.tail()}")
                await asyncio.sleep(POLL_S)

    def wait_ready_sync(self, timeout: float = READY_TIMEOUT) -> None:
        """The same from blocking code (benchmarks, process tests)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.port:
                self.port = self._poll_port()
            if self.port and self._healthy_sync():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready within {timeout:.0f} s: "
                                   f"{self.tail()}")
            time.sleep(POLL_S)

    def _healthy_sync(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200 and json.loads(r.read()).get("status") == "ok"
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def kill(self) -> None:
        """SIGKILL now (a crash mid-stream); reaped by ``stop``/``stop_sync``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        """SIGTERM, wait (polling, never blocking the loop), then SIGKILL; reaps it."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                while proc.poll() is None:  # a SIGKILLed process ends at once
                    await asyncio.sleep(POLL_S)

    def stop_sync(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(STOP_TIMEOUT)


@contextlib.asynccontextmanager
async def running_llama_server(binary: Path, model: Path, *, log: Path, parallel: int = 4,
                               ctx_per_slot: int = 1024, threads: int | None = None,
                               extra: Sequence[str] = ()) -> AsyncIterator[LlamaServer]:
    """A ready llama-server for the body of the ``async with``; stopped by pid after."""
    srv = LlamaServer(binary, model, parallel=parallel, ctx_per_slot=ctx_per_slot,
                      threads=threads, log=log, extra=extra)
    srv.start()
    try:
        await srv.wait_ready()
        yield srv
    finally:
        await srv.stop()

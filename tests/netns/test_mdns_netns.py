"""mDNS across two hosts: two network namespaces joined by a veth pair.

The test makes the namespaces itself (unique names per run, 10.x addresses that
exist only inside them, a multicast route on each veth), runs an announcer in
one and a browser in the other as subprocesses, and deletes both namespaces
(and with them the veth pair) whatever happens. It is skipped, with the
reason, where namespaces cannot be made (not root, no iproute2, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
from pathlib import Path

import pytest

from engine.discovery.fleet_id import fleet_id
from engine.discovery.mdns import PROTOCOL_VERSION
from tests.netns.conftest import Pair

pytestmark = pytest.mark.netns

PROBE = Path(__file__).with_name("mdns_probe.py")
ROOT = Path(__file__).resolve().parents[2]
IP_TIMEOUT_S = 10.0
STEP_TIMEOUT_S = 20.0


class Probe:
    """One probe subprocess inside a namespace; killed by its pid if still running."""

    def __init__(self, proc: asyncio.subprocess.Process, what: str) -> None:
        self.proc = proc
        self.what = what

    @classmethod
    async def start(cls, ns: str, *args: str) -> Probe:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, sys.executable, str(PROBE), *args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env)
        return cls(proc, f"{args[0]} in {ns}")

    async def line(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        try:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), STEP_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(f"{self.what}: no output within {STEP_TIMEOUT_S} s; "
                                 f"stderr: {await self.stderr()}") from None
        if not raw:
            raise AssertionError(f"{self.what} ended: {await self.stderr()}")
        obj = json.loads(raw)
        assert isinstance(obj, dict)
        return obj

    async def stderr(self) -> str:
        if self.proc.returncode is None:
            self.kill()
        assert self.proc.stderr is not None
        try:
            data = await asyncio.wait_for(self.proc.stderr.read(), 5)
        except TimeoutError:
            return "(stderr not readable)"
        return data.decode(errors="replace")[-2000:]

    def close_stdin(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()

    async def wait(self) -> int:
        try:
            return await asyncio.wait_for(self.proc.wait(), STEP_TIMEOUT_S)
        except TimeoutError:
            self.kill()
            raise AssertionError(f"{self.what} did not exit in {STEP_TIMEOUT_S} s") from None

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def finish(self) -> None:
        self.close_stdin()
        self.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5)


async def test_browser_in_one_namespace_finds_head_in_the_other(netns_pair: Pair) -> None:
    fid = fleet_id(secrets.token_bytes(32))
    instance = f"head-{secrets.token_hex(3)}"
    # The announcer chooses its addresses itself: in its namespace the only real
    # interface is the veth, so that is what it must announce (never 127.0.0.1).
    announcer = await Probe.start(netns_pair.a, "announce", "--instance", instance,
                                  "--port", "8454", "--role", "head",
                                  "--model", "smollm2-135m", "--fleet", fid)
    browser: Probe | None = None
    other: Probe | None = None
    try:
        ready = await announcer.line()
        assert ready == {"ready": instance, "addresses": [netns_pair.addr_a]}
        # A head of another fleet beside it must not be picked.
        other = await Probe.start(netns_pair.a, "announce", "--instance", f"x{instance}",
                                  "--port", "9454", "--role", "head", "--model", "other",
                                  "--fleet", fleet_id(secrets.token_bytes(32)))
        assert "ready" in await other.line()

        browser = await Probe.start(netns_pair.b, "browse", "--fleet", fid, "--role", "head",
                                    "--timeout", str(STEP_TIMEOUT_S), "--until-gone")
        found = await browser.line()
        assert found == {"found": [{
            "name": instance, "host": netns_pair.addr_a, "port": 8454, "role": "head",
            "model": "smollm2-135m", "fleet": fid, "protocol": PROTOCOL_VERSION,
            "source": "lan", "addresses": [netns_pair.addr_a]}]}, found

        announcer.close_stdin()  # the announcer unregisters: a goodbye crosses the veth
        assert await announcer.line() == {"closed": True}
        assert await browser.line() == {"gone": True}
        assert await browser.wait() == 0
        assert await announcer.wait() == 0
    finally:
        for probe in (browser, other, announcer):
            if probe is not None:
                await probe.finish()

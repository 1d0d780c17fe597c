"""`shoal keys issue|revoke` and a rotated secret reach a running head, with no restart."""

from __future__ import annotations

import subprocess

import aiohttp
import pytest

from engine.head.access import keys
from tests.integration.conftest import SHOAL, Cluster, Proc
from tests.waiting import until_result

pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 10.0  # the head checks its files every 0.5 s; this only bounds a failure


def shoal(cluster: Cluster, *args: str) -> str:
    out = subprocess.run([*SHOAL, *args], env=cluster.env, capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


async def status(http: aiohttp.ClientSession, head: Proc, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.get(f"http://127.0.0.1:{head.port}/v1/models", headers=headers) as r:
        return r.status


async def answers(http: aiohttp.ClientSession, head: Proc, key: str | None, want: int) -> None:
    await until_result(lambda: status(http, head, key), lambda got: got == want,
                       what=f"{want} for key {key and key[:15]!r}", timeout=DEADLINE_S)


async def test_issue_revoke_and_rotate_reach_a_running_head(cluster: Cluster):
    cluster.token()
    # generous limits: the polling below must not run into the default rate limit
    keys.policy_path(cluster.home).write_text(
        '{"default": {"rpm": 60000, "burst": 1000, "concurrent": 8}}')
    head = cluster.head([])
    async with aiohttp.ClientSession() as http:
        assert await status(http, head) == 200  # no key issued yet: none needed
        alice = shoal(cluster, "keys", "issue", "alice")
        assert alice.startswith("sk-shoal-alice-")
        await answers(http, head, None, 401)  # keys are on now
        assert await status(http, head, alice) == 200
        assert await status(http, head, alice[:-2] + "xx") == 401
        shoal(cluster, "keys", "revoke", "alice")
        await answers(http, head, alice, 401)
        bob = shoal(cluster, "keys", "issue", "bob")
        assert await status(http, head, bob) == 200
        keys.rotate_secret(keys.secret_path(cluster.home))
        await answers(http, head, bob, 401)
        new_bob = shoal(cluster, "keys", "issue", "bob")
        assert new_bob != bob
        assert await status(http, head, new_bob) == 200
    log = head.log_text()
    assert "the API needs no key until `shoal keys issue NAME` makes one" in log
    assert alice not in log and bob not in log

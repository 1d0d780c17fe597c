"""A node tells its heads what sets its decode speed: its RAM's bandwidth, measured once and
kept (here seeded, so no test measures), in its Stats; the
head shows it in /v1/fleet, where the fit estimate of a model there reads it."""

from __future__ import annotations

import json

import pytest

from engine.models import bandwidth
from tests.integration.test_fleet import fleet_state, wait_ready
from tests.waiting import until_result

pytestmark = pytest.mark.timeout(60)
SEEDED = 21_500_000_000  # bytes/s


async def test_a_nodes_stats_carry_its_machines_ram_bandwidth(cluster, tmp_path):
    cache = tmp_path / "machine"
    cache.mkdir()
    (cache / bandwidth.SPEED_FILE).write_text(json.dumps(
        {"key": bandwidth.machine_key(), "mem_bandwidth": SEEDED}))
    cluster.token()
    node = cluster.node("n", env={**cluster.env, bandwidth.MACHINE_CACHE_ENV: str(cache)})
    head = cluster.head([node])
    await wait_ready(head, 1)
    state = await until_result(lambda: fleet_state(head),
                               lambda st: st["nodes"][0]["mem_bandwidth"] > 0,
                               what="the node's bandwidth in its stats")
    (seen,) = state["nodes"]
    assert seen["mem_bandwidth"] == SEEDED
    assert seen["gpu_bandwidth"] == 0  # no GPU: nothing said

"""What a node's owner tells heads of the machine (engine.service.fleet_choice): the RAM's
bandwidth, read once off the loop, whether the node started with this Shoal (read before
its first stats) or later (a join, a switch: read on the first stats that ask)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from engine.events import ignore
from engine.models import bandwidth
from engine.models.loading import Pulls
from engine.service.configuration import Configuration
from engine.service.fleet_choice import FleetChoice
from engine.settings import Settings
from tests.waiting import until

SEEDED = 17_250_000_000  # bytes/s


def choice(home: Path) -> FleetChoice:
    async def never(*_args: object) -> object:
        raise AssertionError("nothing is resolved or swapped here")

    return FleetChoice(Configuration(Settings(home=home)), pulls=Pulls(), resolve=never,
                       swap=never, serving=lambda: None, ram_total=lambda: 8 << 30,
                       emit=ignore, clock=time.monotonic)


@pytest.fixture
def seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home holding the machine's figure, as after its first measurement."""
    monkeypatch.delenv(bandwidth.MACHINE_CACHE_ENV, raising=False)
    (tmp_path / bandwidth.SPEED_FILE).write_text(json.dumps(
        {"key": bandwidth.machine_key(), "mem_bandwidth": SEEDED}))
    return tmp_path


async def test_read_before_the_nodes_first_stats(seeded: Path) -> None:
    owner = choice(seeded)
    await owner.read_machine()
    assert owner.machine_facts().mem_bandwidth == SEEDED


async def test_a_node_started_later_has_it_from_the_stats_after_the_first(seeded: Path) -> None:
    owner = choice(seeded)
    assert owner.machine_facts().mem_bandwidth == 0  # being read, off the loop
    await until(lambda: owner.machine_facts().mem_bandwidth == SEEDED, "the figure read")

"""Pulling a model through `Shoal.set_model`: progress, a cancel that stops the download,
leaves no partial file and keeps the model serving before it, a pull that then starts
again, and the pulled model answering. The hub is a local one (tests/fakehub.py)
serving the real SmolLM2 GGUF; llama.cpp loads what was pulled."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import events as ev
from engine.errors import StartError
from engine.service import Shoal
from tests.fakehub import FakeHub, pointed_at, serving
from tests.integration.test_service import both, chat, ready, running
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(180)]
SPEC = "shoal-test/smollm2-gguf:Q4_1"
FILE = "smollm2-135m-instruct-q4_1.gguf"


def hub_for(smollm2_gguf: Path, **kw: object) -> FakeHub:
    return FakeHub(repos={"shoal-test/smollm2-gguf": {FILE: smollm2_gguf}},
                   **kw)  # type: ignore[arg-type]


def pulls_of(events: list[ev.ShoalEvent]) -> list[ev.PullProgress]:
    return [e for e in events if isinstance(e, ev.PullProgress) and e.model == SPEC]


async def collect(shoal: Shoal, into: list[ev.ShoalEvent]) -> None:
    async with shoal.events(buffer=4096) as events:
        async for event in events:
            into.append(event)


async def test_pull_shows_progress_and_the_pulled_model_answers(
        tmp_path: Path, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ev.ShoalEvent] = []
    hub = hub_for(smollm2_gguf)
    async with serving(hub), running(both(tmp_path)) as shoal:
        with pointed_at(monkeypatch, hub.url):
            watcher = asyncio.create_task(collect(shoal, seen))
            try:
                await ready(shoal)
                name = await shoal.set_model(SPEC, runtime="llamacpp")
                assert name == SPEC
                await ready(shoal)
                snap = shoal.snapshot()
                assert snap.model == SPEC and snap.nodes[0].runtime == "llamacpp"
                status, body = await chat(shoal, model=SPEC, max_tokens=8)
                assert status == 200 and body["usage"]["completion_tokens"] > 0
                await until(lambda: any(p.state == "done" for p in pulls_of(seen)),
                            "the pull reported done")
            finally:
                watcher.cancel()
    size = smollm2_gguf.stat().st_size
    progress = pulls_of(seen)
    running_reports = [p for p in progress if p.state == "running"]
    assert running_reports and all(p.total_bytes in (0, size) for p in running_reports)
    done_bytes = [p.done_bytes for p in running_reports]
    assert done_bytes == sorted(done_bytes)  # progress only goes forward
    assert progress[-1].state == "done"
    assert hub.gets == 1


async def test_cancel_stops_the_pull_and_keeps_the_model_before_it(
        tmp_path: Path, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ev.ShoalEvent] = []
    size = smollm2_gguf.stat().st_size
    hub = hub_for(smollm2_gguf, hold_after=size // 4)
    async with serving(hub), running(both(tmp_path)) as shoal:
        with pointed_at(monkeypatch, hub.url):
            watcher = asyncio.create_task(collect(shoal, seen))
            try:
                await ready(shoal)
                pull = asyncio.create_task(shoal.set_model(SPEC, runtime="llamacpp"))
                await asyncio.wait_for(hub.held.wait(), 60)
                await until(lambda: SPEC in {p.model for p in shoal.snapshot().pulls},
                            "the pull in the snapshot")
                assert shoal.cancel_pull(SPEC)
                hub.release.set()
                with pytest.raises(StartError) as info:
                    await pull
                assert info.value.code == "pull_cancelled"
                assert "cancelled" in str(info.value)
                # the model from before still serves, and the snapshot has no pull left
                snap = shoal.snapshot()
                assert snap.model == "mock-m" and not snap.pulls
                status, _ = await chat(shoal)
                assert status == 200
                await until(lambda: any(p.state == "cancelled" for p in pulls_of(seen)),
                            "a cancelled event")
                assert not list(tmp_path.rglob("*.incomplete"))  # nothing half-pulled stays
                # chosen again, it pulls and serves
                hub.hold_after = None
                assert await shoal.set_model(SPEC, runtime="llamacpp") == SPEC
                await ready(shoal)
                assert shoal.snapshot().model == SPEC
            finally:
                watcher.cancel()
    assert hub.gets == 2
    assert not shoal.cancel_pull(SPEC)  # nothing left to cancel

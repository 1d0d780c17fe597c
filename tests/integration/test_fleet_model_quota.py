"""The models a fleet's head chooses for a node live within the quota its owner sets (issue
30, item 4): `Shoal.serve_on` over real links on 127.0.0.1, the node a real `Shoal` whose
mock runtime pulls hub ids for real, from a local hub (tests/fakehub.py). Over the quota
the least used fleet model goes (never the owner's, never the one served); a model that
cannot fit is refused in the head's answer; and a stalled pull holds no role change up."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.errors import CommandError
from engine.models import cache as model_cache
from engine.models import ids as model_ids
from engine.models import store as model_store
from engine.runtimes import registry
from engine.service import Shoal, fleet_choice
from engine.settings import NodeSettings, Settings
from tests.fakehub import FakeHub, pointed_at, serving
from tests.integration.test_fleet_chooses_model import head_settings, joined_fleet, node_at
from tests.integration.test_service import QUIET, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)
KB = 1000
QUOTA = 800 * KB
OWN, A, B, C, HUGE = (f"acme/{n}-GGUF:Q4_K_M" for n in ("Own", "A", "B", "C", "Huge"))
SIZES = {OWN: 500 * KB, A: 300 * KB, B: 300 * KB, C: 300 * KB, HUGE: 1200 * KB}


def hub_pulls(spec: str | None, home: Path, offline: bool, progress: object,
              cancel: object) -> registry.ResolvedModel:
    """The mock runtime's model lookup, pulling a hub id as llama.cpp's does."""
    if spec is None or "/" not in spec:
        return registry.ResolvedModel(spec or "mock", spec or "mock")
    path = model_cache.resolve_model(spec, home=home, offline=offline,
                                progress=progress,  # type: ignore[arg-type]
                                cancel=cancel)  # type: ignore[arg-type]
    return registry.ResolvedModel(str(path), model_ids.model_name(spec))


@pytest.fixture
def pulling_mock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    mock = registry._RUNTIMES["mock"]
    monkeypatch.setitem(registry._RUNTIMES, "mock", dataclasses.replace(
        mock, find_model=hub_pulls, keeps_pulls=True))
    yield


def local_hub(folder: Path, **kw: object) -> FakeHub:
    folder.mkdir()
    repos: dict[str, dict[str, Path]] = {}
    for spec, size in SIZES.items():
        repo = spec.split(":")[0]
        path = folder / f"{repo.split('/')[1]}-Q4_K_M.gguf"
        path.write_bytes(os.urandom(size))
        repos[repo] = {path.name: path}
    return FakeHub(repos=repos, **kw)  # type: ignore[arg-type]


def quota_node(home: Path) -> Settings:
    return Settings(home=home, discovery=QUIET, node=NodeSettings(
        model="mock-m", runtime="mock", lanes=2, identity="b-node",
        fleet_models_quota=QUOTA))


def kept(home: Path) -> set[str]:
    return {m.name for m in model_store.kept_models(home) if m.source == "hub"}


async def fleet_serves(a: Shoal, key: str, spec: str) -> str:
    line = await a.serve_on(key, spec)
    await until(lambda: (n := node_at(a, "b-node")) is not None and n.model == spec,
                f"b serving {spec} at a", timeout=30)
    return line


async def test_the_least_used_fleet_model_goes_and_one_beyond_the_quota_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pulling_mock: None):
    hub = local_hub(tmp_path / "files")
    home = tmp_path / "b"
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            async with running(head_settings(tmp_path / "a")) as a, \
                    running(quota_node(home)) as b:
                seen = await joined_fleet(a, b)
                await b.set_model(OWN, runtime="mock")  # the owner's: never the fleet's
                await until(lambda: (n := node_at(a, "b-node")) is not None and n.model == OWN,
                            "b serving its owner's model at a", timeout=30)
                await fleet_serves(a, seen.key, A)
                await fleet_serves(a, seen.key, B)
                assert kept(home) == {OWN, A, B}  # 600 of 800 kB: nothing went
                assert set(model_store.fleet_chosen(home)) == {A, B}

                # C makes 900 kB: A, the least used (B is served), goes; the owner's stays
                line = await fleet_serves(a, seen.key, C)
                assert line.startswith(f"pulling {C}")
                assert kept(home) == {OWN, B, C}
                assert set(model_store.fleet_chosen(home)) == {B, C}

                # larger than the quota: refused in the answer, nothing pulled or removed
                with pytest.raises(CommandError) as err:
                    await a.serve_on(seen.key, HUGE)
                assert err.value.code == "node_refused"
                said = str(err.value)
                assert said.startswith(f"b-node refused to serve {HUGE}: fleet models may "
                                       f"use ") and f"here and {HUGE} needs " in said
                assert said.endswith(": raise 'Fleet models may use' in Settings on that "
                                     "machine") and "\n" not in said
                assert kept(home) == {OWN, B, C}
                assert hub.gets == 4  # Own, A, B and C: Huge was only sized
                assert b.snapshot().roles.node is not None
                assert b.snapshot().roles.node.model == C
                # the owner serves B himself: it is his now, and no longer the fleet's
                await b.set_model(B, runtime="mock")
                assert set(model_store.fleet_chosen(home)) == {C}


async def test_a_role_change_goes_on_while_a_model_the_fleet_chose_is_pulled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pulling_mock: None):
    hub = local_hub(tmp_path / "files", hold_after=100 * KB)
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            async with running(head_settings(tmp_path / "a")) as a, \
                    running(quota_node(tmp_path / "b")) as b:
                seen = await joined_fleet(a, b)
                await a.serve_on(seen.key, A)
                await until(hub.held.is_set, "the pull held part-way")
                leaving = asyncio.create_task(b.leave())
                # the pull holds no role lock: leave ends while the hub still holds it
                done = await until(lambda: leaving.done() and leaving.result(),
                                   "b left while its pull is held")
                assert done[0].startswith("closed the links to")
                assert b.settings.join is None and not hub.release.is_set()
                await until(lambda: node_at(a, "b-node") is None, "b gone from a")
                hub.release.set()  # the pull ends, and the model is swapped in after all
                await until(lambda: (n := b.snapshot().roles.node) is not None
                            and n.model == A, "b serving A", timeout=30)


async def test_a_hub_slow_to_size_the_model_gets_a_yes_and_the_refusal_comes_in_the_stats(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pulling_mock: None):
    hub = local_hub(tmp_path / "files", hold_infos=True)
    monkeypatch.setattr(fleet_choice, "ROOM_S", 0.2)  # the head waits 10 s for the answer
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            async with running(head_settings(tmp_path / "a")) as a, \
                    running(quota_node(tmp_path / "b")) as b:
                seen = await joined_fleet(a, b)
                line = await a.serve_on(seen.key, HUGE)
                assert line.startswith(f"pulling {HUGE} once the hub says its size")
                hub.release.set()
                failed = await until(lambda: (n := node_at(a, "b-node")) is not None
                                     and n.serve_failed, "b's refusal at a")
                assert failed.startswith(f"could not serve {HUGE}, which a head of the fleet "
                                         "chose: fleet models may use ")
                assert failed.endswith("in Settings on that machine")
                assert hub.gets == 0 and kept(tmp_path / "b") == set()

"""A head learns a model a fleet node serves from the model's GGUF header alone (issue 25):
a local hub (tests/fakehub.py) on 127.0.0.1 serves the real SmolLM2 and Gemma GGUFs and
counts the bytes it sends; the header file reads as the whole file does in llama.cpp; a
head whose own model is SmolLM2 asks a fleet node to serve Gemma, learns Gemma's tokenizer
from a few megabytes, lists it, places a chat for it on that node, and keeps it across a
restart."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp
import pytest

from engine.config import machine_settings
from engine.head.prompt.model import HeadModel, load_head_model
from engine.models import cache as model_cache
from engine.models import errors as model_errors
from engine.models import store as model_store
from engine.models.pulls import header_fetch
from engine.models.pulls.header_fetch import HeaderFile, NoRange, fetch_header, headers_dir
from engine.runtimes.mock import MockTokenizer
from engine.service import Shoal
from engine.settings import HeadSettings, Settings
from tests.e2e.conftest import gemma_gguf, smollm2_gguf  # noqa: F401  # cached per machine
from tests.fakehub import FakeHub, pointed_at, serving
from tests.integration.test_fleet_chooses_model import joined_fleet, node_at, node_settings
from tests.integration.test_service import QUIET, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)
GEMMA = "acme/gemma-3-270m-GGUF:Q4_K_M"
GEMMA_FILE = "gemma-3-270m-Q4_K_M.gguf"
TEXTS = ["Hello, world!", "def f(x):\n    return x ** 2  # ünïcødé 日本語 🐟",
         "<start_of_turn>user\nhi<end_of_turn>", "  spaces\tand\ttabs  "]
CHAT = [{"role": "user", "content": "What is a shoal?"},
        {"role": "assistant", "content": "A group of fish."},
        {"role": "user", "content": "And a fleet?"}]


def hub_of(smollm2: Path, gemma: Path, **kw: object) -> FakeHub:
    return FakeHub(repos={"acme/SmolLM2-135M-Instruct-GGUF": {"SmolLM2-Q4_1.gguf": smollm2},
                          "acme/gemma-3-270m-GGUF": {GEMMA_FILE: gemma}}, **kw)  # type: ignore[arg-type]


def load(path: Path, name: str) -> HeadModel:
    return load_head_model("llamacpp", str(path), name=name)


async def free(*loaded: HeadModel) -> None:
    """llama.cpp frees a vocabulary in its finalizer: off the loop, not where it is dropped."""
    for model in loaded:
        await asyncio.to_thread(model.vocab.close)  # type: ignore[attr-defined]


def assert_reads_the_same(learnt: HeadModel, full: HeadModel) -> None:
    for text in TEXTS:
        assert learnt.vocab.encode(text) == full.vocab.encode(text), text
    assert learnt.render(CHAT, tools=None) == full.render(CHAT, tools=None)
    assert learnt.template.source == full.template.source
    assert learnt.stop_ids == full.stop_ids and learnt.vocab.fim_ids() == full.vocab.fim_ids()


async def test_a_header_fetch_sends_a_sliver_of_the_file_and_reads_as_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path,  # noqa: F811
        gemma_gguf: Path):  # noqa: F811
    hub = hub_of(smollm2_gguf, gemma_gguf)
    home = tmp_path / "home"
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            got = await asyncio.to_thread(fetch_header, GEMMA, home=home)
            sent = hub.sent
            again = await asyncio.to_thread(fetch_header, GEMMA, home=home)
    size = gemma_gguf.stat().st_size
    assert got == HeaderFile(got.path, sent, size) and again == dataclasses.replace(got, fetched=0)
    assert 6_525_112 <= sent < size // 20  # the header (6.2 MiB) of a 241 MiB file
    assert hub.sent == sent and hub.infos == 1  # the second found it on disk, unasked
    assert got.path.stat().st_size == size  # llama.cpp checks tensors against this
    assert got.path.stat().st_blocks * 512 < size // 10  # a hole where the tensors were
    assert got.path.is_relative_to(headers_dir(home)) and got.path.name.startswith("header-")
    assert [p.name for p in got.path.parent.iterdir()] == [got.path.name]  # no temp left
    learnt, full = await asyncio.gather(asyncio.to_thread(load, got.path, GEMMA),
                                        asyncio.to_thread(load, gemma_gguf, "full"))
    assert_reads_the_same(learnt, full)
    await free(learnt, full)
    # never taken for the model: no pull finds it, no list of kept models shows it
    with pytest.raises(model_errors.ModelMissing):
        model_cache.resolve_model(GEMMA, home=home, offline=True)
    assert await asyncio.to_thread(model_store.kept_models, home) == []


async def test_a_hub_that_ignores_range_leaves_no_header_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path,  # noqa: F811
        gemma_gguf: Path):  # noqa: F811
    hub = hub_of(smollm2_gguf, gemma_gguf, no_range=True)
    home = tmp_path / "home"
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url), pytest.raises(NoRange) as refused:
            await asyncio.to_thread(fetch_header, GEMMA, home=home)
    line = str(refused.value)
    assert "cannot read its tokenizer without the whole model" in line and "\n" not in line
    assert hub.gets == 1 and not headers_dir(home).exists()


async def test_no_header_is_fetched_where_files_cannot_be_sparse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path,  # noqa: F811
        gemma_gguf: Path):  # noqa: F811
    """On exFAT or FAT the hole would be written out as zeros, as many as the hub claims
    the file holds (the probe is faked here: this machine's disk holds holes)."""
    monkeypatch.setattr(header_fetch, "_sparse", {})
    real = header_fetch.sparse_files
    asked: list[Path] = []

    def fat(folder: Path) -> bool:
        asked.append(folder)
        return not real(folder)  # this disk's answer, the other way round

    monkeypatch.setattr(header_fetch, "sparse_files", fat)
    hub = hub_of(smollm2_gguf, gemma_gguf)
    home = tmp_path / "home"
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url), pytest.raises(model_errors.ModelMissing) as refused:
            await asyncio.to_thread(fetch_header, GEMMA, home=home)
    line = str(refused.value)
    assert "without sparse files" in line and "pull the model on this machine" in line
    assert asked and hub.sent < gemma_gguf.stat().st_size // 20  # the header's bytes only
    assert [p for p in headers_dir(home).rglob("*") if p.is_file()] == []


def smollm2_head(home: Path, smollm2: Path) -> Settings:
    """A head (no node of its own) whose model is SmolLM2, taking nodes that join."""
    return Settings(home=home, discovery=QUIET,
                    head=HeadSettings(model=str(smollm2), runtime="llamacpp",
                                      http="127.0.0.1:0", fleet_listen="127.0.0.1:0"))


async def chat(shoal: Shoal, model: str) -> tuple[int, dict[str, object]]:
    assert shoal.api_url is not None
    body = {"model": model, "messages": CHAT, "max_tokens": 4}
    async with aiohttp.ClientSession() as http, \
            http.post(shoal.api_url + "/chat/completions", json=body) as r:
        return r.status, await r.json()


async def listed(shoal: Shoal) -> dict[str, str]:
    assert shoal.api_url is not None
    async with aiohttp.ClientSession() as http, http.get(shoal.api_url + "/models") as r:
        return {m["id"]: m["status"] for m in (await r.json())["data"]}


async def test_a_head_learns_the_model_it_has_a_fleet_node_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path,  # noqa: F811
        gemma_gguf: Path):  # noqa: F811
    hub = hub_of(smollm2_gguf, gemma_gguf)
    home = tmp_path / "a"
    # the node's mock engine takes Gemma's token ids (it answers in bytes, ids under 259)
    monkeypatch.setattr(MockTokenizer, "vocab_size", 262_144)
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            a = Shoal(smollm2_head(home, smollm2_gguf), keep=True)
            await a.open()
            try:
                # the node runs the mock engine: its "pull" of GEMMA takes no hub bytes
                async with running(node_settings(tmp_path / "b")) as b:
                    seen = await joined_fleet(a, b)
                    assert GEMMA not in await listed(a)
                    line = await a.serve_on(seen.key, GEMMA)
                    assert line.startswith(f"pulling {GEMMA}")
                    assert f"read the tokenizer and template of {GEMMA} from 8 MiB of its " \
                           "241 MiB file" in line
                    sent = hub.sent
                    assert 6_525_112 <= sent < gemma_gguf.stat().st_size // 20
                    await until(lambda: (n := node_at(a, "b-node")) is not None
                                and n.model == GEMMA, "b serving Gemma at a")
                    assert (await listed(a))[GEMMA] == "ready"
                    status, body = await chat(a, GEMMA)
                    assert status == 200, body
                    assert body["model"] == GEMMA
                    full = await asyncio.to_thread(load, gemma_gguf, "full")
                    assert a._roles.head is not None
                    assert_reads_the_same(a._roles.head.head.models[GEMMA], full)
                    # the node was asked again: the head has it, nothing more is fetched
                    assert await a.serve_on(seen.key, GEMMA) == f"serves {GEMMA} already"
                    assert hub.sent == sent
            finally:
                await a.stop(drain=0)
            # kept across a restart, through the app's config file, from the header on disk
            assert a.settings.head is not None and a.settings.head.also_models == (GEMMA,)
            again, _ = await asyncio.to_thread(machine_settings, home,
                                               smollm2_head(home, smollm2_gguf))
            assert again.head is not None and again.head.also_models == (GEMMA,)
            async with running(again) as restarted:
                assert restarted._roles.head is not None
                assert_reads_the_same(restarted._roles.head.head.models[GEMMA], full)
            assert hub.sent == sent
    await free(full)


async def test_a_head_starts_at_once_while_the_hub_hangs_and_learns_its_models_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path,  # noqa: F811
        gemma_gguf: Path):  # noqa: F811
    """A learnt model whose header is not on disk once held the head's start for the hub's
    timeout per model (forever with a hub that trickles)."""
    hub = hub_of(smollm2_gguf, gemma_gguf, hold_infos=True)
    settings = smollm2_head(tmp_path / "home", smollm2_gguf)
    settings = dataclasses.replace(settings, head=dataclasses.replace(
        settings.head, also_models=(GEMMA,)))  # type: ignore[type-var]
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            # the hub answers nothing until told: the start must not wait on it
            shoal = await asyncio.wait_for(Shoal.start(settings), 60)
            try:
                await until(lambda: hub.infos >= 1, "the head asking the hub, after its start")
                assert GEMMA not in shoal._roles.head.head.models  # type: ignore[union-attr]
                hub.release.set()
                await until(lambda: GEMMA in shoal._roles.head.head.models,  # type: ignore[union-attr]
                            "the head learning the model once the hub answers")
            finally:
                hub.release.set()
                await shoal.stop()

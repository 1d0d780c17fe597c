"""`shoal models serve MODEL --split A,B` and `POST /v1/fleet/serve` (issue 33): a head asks
the fleet's node A to serve a model split with the memory B lends, over real links on
127.0.0.1, every machine a real `Shoal` on the mock runtime (A's pull held, then failed, so
that it never forms the split itself: the ask is what is tested). The lending machine's lent memory
reaches the head (/v1/fleet), the lenders' addresses reach A, and each refusal names its
cause and its fix in one line."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from engine.cli import main
from engine.head.access.admin_secret import HEADER, read_admin_secret
from engine.service import Shoal
from engine.settings import HeadSettings, NodeSettings, Settings
from engine.snapshot import to_json
from tests.integration.test_fleet_chooses_model import CHOSEN, SlowPull, holding, node_at
from tests.integration.test_service import QUIET, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)
LENT = 2 << 30  # the lender's node budget: its mock model holds next to none of it


@pytest.fixture
def held_pull(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowPull]:
    """The pull of any hub id a head asks for held until the test lets it go, then failed:
    the machine asked never swaps its model (a split would start llama.cpp's RPC server on
    the lending machine)."""
    yield from holding(monkeypatch, SlowPull(lambda spec: "/" in spec, fail=True))


def node(home: Path, identity: str, **node: object) -> Settings:
    return Settings(home=home, discovery=QUIET, node=NodeSettings(
        model="mock-m", runtime="mock", lanes=1, identity=identity, listen="127.0.0.1:0",
        **node))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def fleet(tmp: Path) -> AsyncIterator[tuple[Shoal, Shoal, str]]:
    """A head (with its own node) that dials the node ``serving`` and the node ``desk``,
    which lends its memory; and the head's HOST:PORT."""
    async with running(node(tmp / "b", "serving")) as b, \
            running(node(tmp / "c", "desk", lend=True, memory_budget=LENT)) as c:
        dialed = tuple(f"{h}:{p}" for h, p in (b.node_address, c.node_address))  # type: ignore[misc]
        head = Settings(home=tmp / "a", discovery=QUIET,
                        head=HeadSettings(model="mock-m", runtime="mock", http="127.0.0.1:0",
                                          fleet=dialed),
                        node=NodeSettings(model="mock-m", runtime="mock", lanes=1))
        async with running(head) as a:
            await until(lambda: node_at(a, "serving") and node_at(a, "desk"),
                        "both nodes ready at the head")
            assert a.api_url is not None
            yield a, b, a.api_url.removeprefix("http://").removesuffix("/v1")


async def ask(address: str, secret: str | None, body: object) -> tuple[int, dict]:  # type: ignore[type-arg]
    headers = {HEADER: secret} if secret else {}
    async with aiohttp.ClientSession() as http, \
            http.post(f"http://{address}/v1/fleet/serve", json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_the_head_asks_the_serving_node_with_the_lenders_address(
        tmp_path: Path, held_pull: SlowPull, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    async with fleet(tmp_path) as (a, b, address):
        # what the desk lends reaches the head, and /v1/fleet says it
        desk = await until(lambda: (n := node_at(a, "desk")) is not None and n.lend_bytes
                           and n, "the desk's lent memory at the head")
        assert 0 < desk.lend_bytes <= LENT
        serving = node_at(a, "serving")
        assert serving is not None and serving.lend_bytes == 0  # its owner lends nothing
        [row] = [n for n in to_json(a.snapshot())["nodes"] if n["identity"] == "desk"]
        assert row["lend_bytes"] == desk.lend_bytes

        # the CLI on this machine (it sends this machine's admin secret) parses and prints
        monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "a"))
        code = await asyncio.to_thread(main, ["models", "serve", CHOSEN, "--split",
                                              "serving,desk", "--head", address])
        out = capsys.readouterr().out
        assert code == 0, out
        assert out == (f"serving: pulling {CHOSEN}; this node serves it split with "
                       f"{desk.address} once it is loaded\n")
        # the serving machine pulls it, to serve it split with the desk
        await until(lambda: (n := node_at(a, "serving")) is not None
                    and n.pull_model == CHOSEN, "the serving machine's pull at the head")
        assert held_pull.asked == [CHOSEN]
        held_pull.go.set()  # the pull fails: the serving machine says why, and goes on
        failed = await until(lambda: (n := node_at(a, "serving")) is not None
                             and n.serve_failed and n, "the failed pull said at the head")
        assert f"could not serve {CHOSEN}" in failed.serve_failed
        assert b.snapshot().roles.node is not None
        assert b.snapshot().roles.node.model == "mock-m"


async def test_each_refusal_names_its_cause_and_fix(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]):
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "a"))  # the CLI's admin secret
    async with fleet(tmp_path) as (a, b, address):
        await until(lambda: (n := node_at(a, "desk")) is not None and n.lend_bytes,
                    "the desk's lent memory at the head")
        secret = read_admin_secret(tmp_path / "a")
        split = {"model": CHOSEN, "split": ["serving", "desk"]}
        # without this machine's admin secret: refused
        status, body = await ask(address, None, split)
        assert status == 403 and "admin secret" in body["error"]["message"]
        # an unknown machine, a machine that lends nothing, one machine alone, a path
        for machines, status_code, line in (
                (["serving", "nobody"], 404, "no machine 'nobody' in the fleet (it has: "),
                (["desk", "serving"], 409, "serving lends no memory to the fleet; turn "
                                           "lending on there"),
                (["serving"], 400, "a split names the machine that serves the model, then "
                                   "at least one that lends memory")):
            status, body = await ask(address, secret, {"model": CHOSEN, "split": machines})
            assert (status, body["error"]["message"][:len(line)]) == (status_code, line)
        status, body = await ask(address, secret, {"model": "/models/x.gguf",
                                                   "split": ["serving", "desk"]})
        assert status == 400 and "org/repo:QUANT" in body["error"]["message"]
        status, body = await ask(address, secret, {"model": CHOSEN, "split": "serving"})
        assert status == 400 and body["error"]["code"] == "invalid_request"
        # a serving machine whose owner keeps its model: its own word, through the CLI
        await b.update_settings(fleet_may_choose_model=False)
        code = await asyncio.to_thread(main, ["models", "serve", CHOSEN, "--split",
                                              "serving,desk", "--head", address])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith(f"shoal: serving refused to serve {CHOSEN}: this machine keeps "
                              "the model its user chose")
        assert err.count("\n") == 1

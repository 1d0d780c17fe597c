"""The Fleet page and the tray render each node's memory against its budget and whether its
model sleeps (unloaded while idle, or loading again), from the snapshot alone (issue 23)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.bridge import ShoalBridge
from app.pages.fleet import NODE_COLUMNS, FleetPage, memory_cell
from engine.sizes import GiB, MiB, amount
from tests.ui.test_tray_view import local, node, snap

pytestmark = pytest.mark.timeout(60)


def sleepy(key: str, *, sleep: str = "", used: int = 0, budget: int = 0, link: str = "dialed",
           **more: object):
    return replace(node(key), link=link, sleep=sleep, mem_used=used,  # type: ignore[arg-type]
                   mem_budget=budget, **more)


def test_memory_in_binary_units_as_the_cli_and_the_welcome_say_it() -> None:
    # one formatter: the Fleet page's cell reads as the CLI's fit line and the welcome
    # (it read "12 GB" here and "11.8 GB" there)
    assert memory_cell(replace(node("a"), mem_used=412 * MiB, mem_budget=int(11.8 * GiB))
                       ).text == f"412 MiB of {amount(int(11.8 * GiB))}" == "412 MiB of 11.8 GiB"
    assert amount(3 * GiB // 2) == "1.5 GiB" and amount(GiB) == "1 GiB"


async def test_each_node_shows_its_memory_and_whether_its_model_sleeps(bridge: ShoalBridge):
    page = FleetPage(bridge)
    try:
        fleet = snap(sleepy("local", link="local", sleep="asleep", used=412 * MiB,
                            budget=12 * GiB, kv_parked=300, max_prompt=3500),
                     sleepy("studio", sleep="waking", used=0, budget=0),
                     sleepy("laptop", used=3 * GiB // 2, budget=8 * GiB),
                     replace(sleepy("gone", sleep="asleep"), state="unreachable"))
        page.render(fleet)
        rows = {page.nodes.key_at(r): r for r in range(page.nodes.rowCount())}
        mine, studio, laptop, gone = (rows[k] for k in ("local", "studio", "laptop", "gone"))
        assert page.nodes.text(mine, "Memory") == "412 MiB of 12 GiB"
        assert page.nodes.text(laptop, "Memory") == "1.5 GiB of 8 GiB"
        assert page.nodes.text(studio, "Memory") == "—"  # a node that says neither
        assert page.nodes.text(mine, "State") == "asleep"
        state = page.nodes.rows[mine][NODE_COLUMNS.index("State")]
        assert "next request loads it again" in state.tip
        assert page.nodes.text(studio, "State") == "waking"
        assert page.nodes.text(laptop, "State") == "ready"
        assert page.nodes.text(gone, "State") == "unreachable"  # the link first
        kv = page.nodes.rows[mine][NODE_COLUMNS.index("KV cache")].tip
        assert "300 of them kept for conversations" in kv and "3,500 tokens now" in kv
        assert page.serving.text() == "Serving m · 8 lanes · asleep"

        page.render(snap(sleepy("local", link="local", used=GiB, budget=12 * GiB)))
        assert page.nodes.text(0, "State") == "ready"  # awake again
        assert page.nodes.text(0, "Memory") == "1 GiB of 12 GiB"
        assert page.serving.text() == "Serving m · 8 lanes"
    finally:
        page.deleteLater()


@pytest.mark.parametrize(("sleep", "line"), [
    ("asleep", "Not in a fleet · 1 node ready · 0/8 lanes busy · model asleep"),
    ("waking", "Not in a fleet · 1 node ready · 0/8 lanes busy · model waking"),
    ("", "Not in a fleet · 1 node ready · 0/8 lanes busy"),
])
def test_the_tray_says_when_this_machines_model_sleeps(sleep: str, line: str) -> None:
    from app.tray import status_line
    from tests.ui.test_tray_view import view

    assert status_line(view(snap(sleepy("local", link="local", sleep=sleep)))) == line
    # another machine's sleeping node is not this machine's
    assert "asleep" not in status_line(view(snap(sleepy("b", sleep="asleep"),
                                                 mine=local())))


async def test_a_node_that_keeps_models_shows_them_and_which_one_loads(
        bridge: ShoalBridge) -> None:
    from app.tray import status_line
    from engine.snapshot import KeptModelSnapshot
    from tests.ui.test_tray_view import view

    kept = (KeptModelSnapshot("gemma", "loading", size=241 * MiB),
            KeptModelSnapshot("minilm", "loaded", memory=57 * MiB, size=44 * MiB))
    page = FleetPage(bridge)
    try:
        page.render(snap(sleepy("local", link="local", kept=kept), sleepy("other")))
        rows = {page.nodes.key_at(r): r for r in range(page.nodes.rowCount())}
        assert page.nodes.text(rows["local"], "Model") == "m +2"
        tip = page.nodes.rows[rows["local"]][NODE_COLUMNS.index("Model")].tip
        assert "gemma: loading…" in tip and "minilm: loaded, 57 MiB" in tip, tip
        assert page.nodes.text(rows["local"], "State") == "loading gemma"
        assert page.nodes.text(rows["other"], "Model") == "m"  # keeps nothing besides
        page.render(snap(sleepy("local", link="local", kept=kept[1:])))
        assert page.nodes.text(0, "State") == "ready"
    finally:
        page.deleteLater()
    line = status_line(view(snap(sleepy("local", link="local"),
                                 mine=replace(local(), kept=kept))))
    assert line.endswith(" · loading gemma"), line

"""The Models page and the welcome offer a model no machine of the fleet holds alone split
across the machines that lend memory (issue 33), driven as a person would against Shoal in
process (real sockets on 127.0.0.1): the catalog card says how it would run split and how
fast, the fleet's split card and the welcome's model step name the largest such model, and
"Serve it split" asks the serving machine over its link, naming this machine's node as the
lender (the laptop's pull is held, then failed: a split formed for real would start
llama.cpp's RPC server here)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from app.pages.catalog import split_text
from app.pages.fleet_split import largest_offer, offer_text
from app.pages.model_options import split_line
from engine.service import Shoal, configuration
from engine.sizes import GiB
from tests.integration.test_fleet_chooses_model import SlowPull
from tests.integration.test_split_ask import held_pull
from tests.ui.running import both, bridged, node_only, running, token_file, visible
from tests.ui.test_models_page import click, models_page
from tests.ui.test_welcome import at_the_model_step
from tests.waiting import until

__all__ = ["held_pull"]  # the fixture, used by name
pytestmark = [pytest.mark.ui, pytest.mark.timeout(90)]
DESK = 3 * GiB  # this machine's node budget, which it lends (its mock model holds little)
LAPTOP = 4 * GiB  # the laptop's, which lends nothing


@contextlib.asynccontextmanager
async def desk_lending_to_laptop(tmp: Path) -> AsyncIterator[tuple[Shoal, Shoal]]:
    """This machine (the desk) runs the API, lends its memory and dials the laptop's node;
    both hold the fleet's token."""
    token = token_file(tmp / "fleet")
    laptop_settings = replace(node_only(tmp / "laptop", "laptop", listen="127.0.0.1:0",
                                        memory_budget=LAPTOP), auth_file=token)
    async with running(laptop_settings) as laptop:
        host, port = laptop.node_address  # type: ignore[misc]
        desk_settings = both(tmp / "desk", fleet=(f"{host}:{port}",))
        assert desk_settings.node is not None
        desk_settings = replace(desk_settings.with_node(replace(
            desk_settings.node, lend=True, memory_budget=DESK)), auth_file=token)
        async with running(desk_settings) as desk:
            await until(lambda: any(n.identity == "laptop" and n.state == "ready"
                                    and n.ram_total for n in desk.snapshot().nodes)
                        and any(n.key == "local" and n.lend_bytes
                                for n in desk.snapshot().nodes),
                        "the laptop's RAM and this machine's lent memory at the head")
            yield desk, laptop


async def test_a_model_no_machine_holds_is_offered_split_and_served_so_by_a_click(
        tmp_path: Path, qtbot, held_pull: SlowPull):  # type: ignore[no-untyped-def]
    async with desk_lending_to_laptop(tmp_path) as (desk, laptop), bridged(desk) as ui:
        _window, page = models_page(ui)
        card = page.catalog
        fits = await desk.models.fits()
        here, there = fits.machines
        assert (here.machine.lend, there.machine.lend) != (0, 0) and there.machine.lend == 0
        assert fits.offers, "no model offered split"
        # each offer is a model no machine holds alone, served on the laptop (which has the
        # room), its last layers on this machine's lent memory
        for offer in fits.offers:
            entry = {f.entry.id: f for f in here.fits}[offer.entry_id]
            assert not any(q.fit.fits for m in fits.machines for f in m.fits
                           if f.entry.id == offer.entry_id for q in f.quants), entry.entry.id
            assert offer.proposal.machines == (there.key, here.key)
        offer = fits.offers[0]
        await until(lambda: offer.entry_id in card.catalog.keys, "the catalog shown")
        card.select(offer.entry_id)
        await until(lambda: card.split_line.text() == split_text(offer, fits),
                    "the split line of the model chosen")
        line = card.split_line.text()
        assert line.startswith(f"No machine holds it alone; {offer.quant} split across "
                               "laptop + This machine (")
        assert f" of {offer.proposal.layers} layers)" in line
        assert visible(card.split_line) and card.serve_split.isEnabled()
        assert not card.serve_here.isEnabled()  # it fits no machine alone
        # the fleet's card names the largest such model, with its split
        await until(lambda: page.split.offer_line.text() == offer_text(fits),
                    "the split card's offer")
        assert page.split.offer_line.text().startswith("Larger than any one machine: ")
        assert visible(page.split)
        # a model some machine holds: no split offered
        alone = next(f for f in here.fits if f.best.fit.fits)
        card.select(alone.entry.id)
        assert not visible(card.split_line) and not visible(card.serve_split)

        card.select(offer.entry_id)
        click(qtbot, card.serve_split)
        assert not card.serve_split.isEnabled()  # once
        await until(lambda: card.split_done.text() == laptop_answer(desk, offer.spec),
                    "the laptop's answer under the card", timeout=30)
        # the laptop answers first, then sizes the model (asking the fleet) and pulls it
        await until(lambda: held_pull.asked == [offer.spec], "the laptop's pull")
        assert card.serve_split.isEnabled()  # asked and answered: it may be asked again
        await pull_failed(held_pull, desk, laptop, offer.spec)


def laptop_answer(desk: Shoal, spec: str) -> str:
    """What the laptop answers when asked to serve ``spec`` split with this machine."""
    lent = next(n.address for n in desk.snapshot().nodes if n.key == "local")
    return f"laptop: pulling {spec}; this node serves it split with {lent} once it is loaded"


async def pull_failed(held_pull: SlowPull, desk: Shoal, laptop: Shoal, spec: str) -> None:
    """Let the laptop's held pull fail: it says so, and serves what it served."""
    held_pull.go.set()
    await until(lambda: any(n.identity == "laptop" and n.serve_failed
                            for n in desk.snapshot().nodes), "the laptop's failed pull")
    assert laptop.snapshot().roles.node is not None
    assert laptop.snapshot().roles.node.model != spec


async def test_the_welcome_offers_the_largest_split_and_its_click_asks_the_serving_machine(
        tmp_path: Path, qtbot, held_pull: SlowPull,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    async with desk_lending_to_laptop(tmp_path) as (desk, laptop), bridged(desk) as ui:
        welcome, _options, _tiny = await at_the_model_step(ui, qtbot)
        fits = await desk.models.fits()
        offer = largest_offer(fits)
        assert offer is not None, "no model offered split"
        sizes = {e.id: e.params_b for e in fits.catalog.entries}
        assert sizes[offer.entry_id] == max(sizes[o.entry_id] for o in fits.offers)
        # beside the models that fit this machine, the largest one no machine holds alone
        await until(lambda: welcome.split_offer.text() == split_line(fits),
                    "the welcome's split offer")
        line = welcome.split_offer.text()
        assert line.startswith("Larger than any one machine: ")
        assert f" {offer.quant}, split across laptop + This machine (" in line
        assert visible(welcome.split_offer) and visible(welcome.serve_split)
        assert not visible(welcome.split_done)

        click(qtbot, welcome.serve_split)
        assert not welcome.serve_split.isEnabled()  # once
        await until(lambda: welcome.split_done.text() == laptop_answer(desk, offer.spec),
                    "the laptop's answer on the welcome", timeout=30)
        assert visible(welcome.split_done) and welcome.serve_split.isEnabled()
        await until(lambda: held_pull.asked == [offer.spec], "the laptop's pull")
        assert welcome.step == "model"  # this machine's own model is still to choose
        await pull_failed(held_pull, desk, laptop, offer.spec)

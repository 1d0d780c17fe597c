"""The Models page's catalog, split and kept models, driven as a person would against Shoal
in process (real sockets on 127.0.0.1): each catalog model's fit on this machine and on a
second machine of the fleet, the split accepted with one click and each machine then
serving its model, a catalog model pulled from a local hub and served, the models kept
here removed (refused while served), and the tray's line for a pull under way. Each fit
shows its speed estimate ("fits · ~35 tok/s", "slow" where too slow), and the split
names the models beside each machine's own (autocomplete, embeddings)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QPushButton

from app.bridge import sentence
from app.pages.catalog import BASE_COLUMNS, CatalogCard, fit_cell
from app.pages.models import ModelsPage
from app.prefs import Prefs
from app.tray import TrayView, menu_entries
from app.window import MainWindow
from engine.models.fit import Fit, tokens_text
from engine.models.speed import speed_text
from engine.service import Shoal
from engine.settings import NodeSettings
from engine.sizes import amount
from engine.snapshot import PullSnapshot
from tests.fakehub import FakeHub, pointed_at, serving
from tests.ui.running import both, bridged, node_only, ready, running, visible
from tests.ui.test_start_again import free_port
from tests.waiting import until

pytestmark = [pytest.mark.ui, pytest.mark.timeout(90)]
SMALL = 1 << 30  # this machine's node budget: the larger models do not fit here
EMBEDDED = "smollm2-135m-instruct"  # the embedded default, as the models kept here name it
TINY = "smollm2-135m-instruct"  # its catalog entry: the Q4_1 file is the embedded one


def click(qtbot, button: QPushButton) -> None:  # type: ignore[no-untyped-def]
    assert button.isEnabled(), f"{button.text()!r} is disabled"
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)


def models_page(ui) -> tuple[MainWindow, ModelsPage]:  # type: ignore[no-untyped-def]
    """The window on its Models page (the caller keeps the window: one with no reference
    is deleted, its pages with it)."""
    window = MainWindow(ui.bridge)
    window.show()
    window.show_page("models")
    return window, window.models


def pick_quant(card: CatalogCard, quant: str) -> None:
    """Choose ``quant`` in the chooser of the row chosen, as a user does."""
    index = card.quant.findData(quant)
    card.quant.setCurrentIndex(index)
    card.quant.activated.emit(index)


def shown_fit(fit: Fit) -> tuple[str, str, str]:
    """A machine's cell as the page must show ``fit``: text, tooltip, tone."""
    if fit.verdict == "none":
        return "no", fit.line, "bad"
    if fit.disk_short:
        return "no disk room", fit.line, "bad"
    speed = "" if fit.tps is None else \
        f" · {'slow: ' if fit.slow else ''}{speed_text(fit.tps)}"
    if fit.verdict == "full":
        return "fits" + speed, fit.line, "warn" if fit.slow else "good"
    return f"{tokens_text(fit.window)} window" + speed, fit.line, "warn"


@contextlib.asynccontextmanager
async def desk_and_laptop(tmp: Path) -> AsyncIterator[tuple[Shoal, Shoal]]:
    """A small desk (a 1 GiB node budget) running the API, and a laptop joined to it. The
    desk takes joins on a port of its own choosing, not port 0: when its model changes its
    head starts again, and the laptop links again at the address it joined."""
    desk_settings = both(tmp / "desk", fleet_listen=f"127.0.0.1:{free_port()}")
    assert desk_settings.node is not None
    desk_settings = desk_settings.with_node(replace(desk_settings.node, memory_budget=SMALL))
    async with running(desk_settings) as desk, \
            running(node_only(tmp / "laptop", "laptop")) as laptop:
        await desk.create_fleet("desk")
        host, port = desk.fleet_address  # type: ignore[misc]
        await laptop.join((await desk.pairing(head=f"{host}:{port}")).url)
        await until(lambda: any(n.identity == "laptop" and n.state == "ready" and n.ram_total
                                for n in desk.snapshot().nodes), "the laptop's RAM at the desk")
        yield desk, laptop


async def test_the_catalog_shows_each_models_fit_here_and_on_the_laptop(tmp_path: Path,
                                                                       qtbot):
    async with desk_and_laptop(tmp_path) as (desk, _laptop), bridged(desk) as ui:
        _window, page = models_page(ui)
        card = page.catalog
        fits = await desk.models.fits()
        assert [m.label for m in fits.machines] == ["This machine", "laptop"]
        entries = [e.id for e in fits.catalog.entries]
        await until(lambda: card.catalog.headers == [*BASE_COLUMNS, "This machine", "laptop"]
                    and card.catalog.keys == entries, "the catalog with a column per machine")
        assert card.facts.text() == f"This machine: {fits.facts}."
        here, there = fits.machines
        texts = []
        for row, (mine, theirs) in enumerate(zip(here.fits, there.fits, strict=True)):
            name = card.catalog.text(row, "Model")
            quant = name.rsplit(" ", 1)[1]
            assert name == f"{mine.entry.name} {quant}"
            cells = card.catalog.rows[row]
            for column, fitted in (("This machine", mine), ("laptop", theirs)):
                q = next(q for q in fitted.quants if q.quant.name == quant)
                cell = cells[card.catalog.headers.index(column)]
                assert (cell.text, cell.tip, cell.tone) == shown_fit(q.fit), (name, column)
            texts.append((cells[-2].text, cells[-1].text))
        # the desk's small budget: some models fit it, the larger ones fit only the laptop;
        # this machine measured its RAM's speed, so a model that fits here says how fast
        # (the laptop's node here says none: its cells, checked above, have no estimate)
        assert any(mine.startswith("fits · ~") and mine.endswith(" tok/s")
                   for mine, _ in texts), texts
        assert any(mine == "no" and theirs != "no" for mine, theirs in texts)
        # an embeddings model does not decode: it fits, with no speed to show
        embeds = [row for row, f in enumerate(here.fits) if f.entry.embeddings]
        assert embeds and any(card.catalog.rows[row][-2].text == "fits" for row in embeds)

        # the model suggested for this machine is the one chosen, at its quantisation
        [mine] = [s for s in fits.split if s.machine == here.key]
        assert card.selected_id() == mine.candidate.entry_id
        assert card.quant.currentData() == mine.candidate.quant
        assert card.fit_line.text().lower() == mine.fit.line.lower()
        assert mine.fit.tps is not None and speed_text(mine.fit.tps) in card.fit_line.text()
        assert card.serve_here.isEnabled()

        # another quantisation of a model: its size and fit in the row, its line below
        gemma = next(f for f in here.fits if len(f.quants) > 1 and f.best.fit.fits)
        card.select(gemma.entry.id)
        other = next(q for q in gemma.quants if q.quant.name != card.quant.currentData())
        pick_quant(card, other.quant.name)
        row = card.catalog.keys.index(gemma.entry.id)
        assert card.catalog.text(row, "Model") == f"{gemma.entry.name} {other.quant.name}"
        assert card.catalog.text(row, "Size") == amount(other.quant.size)
        assert card.fit_line.text().lower() == other.fit.line.lower()
        # a model that fits nowhere here cannot be served here
        too_big = next(f for f in here.fits if not any(q.fit.fits for q in f.quants))
        card.select(too_big.entry.id)
        assert not card.serve_here.isEnabled()
        assert card.fit_line.text().startswith("Does not fit")


ROLES = {"agents": "agents and chat", "chat": "chat", "autocomplete": "editor autocomplete",
         "embeddings": "embeddings (codebase search)"}


def split_rows(fits) -> list:  # type: ignore[no-untyped-def,type-arg]
    """The split's rows as the card must list them: each machine's main model, then the
    models beside it."""
    return [x for s in fits.split
            for x in (s, *(b for b in fits.beside if b.machine == s.machine))]


async def test_the_split_has_each_machine_serve_its_model_with_one_click(tmp_path: Path,
                                                                        qtbot):
    async with desk_and_laptop(tmp_path) as (desk, laptop), bridged(desk) as ui:
        _window, page = models_page(ui)
        split = page.split
        fits = await desk.models.fits()
        wanted = {s.machine: s.candidate.spec for s in fits.split}
        laptop_key = next(m.key for m in fits.machines if m.label == "laptop")
        assert set(wanted) == {"this machine", laptop_key}
        rows = split_rows(fits)
        await until(lambda: visible(split) and split.rows.rowCount() == len(rows),
                    "the split shown")
        # each machine's model, and under it those beside it: the laptop's (a larger
        # machine) an embeddings model for its editors' codebase search
        assert [split.rows.text(r, "Machine") for r in range(len(rows))] == \
            ["This machine" if s.machine == "this machine" else "laptop" for s in rows]
        beside = [(split.rows.text(r, "Machine"), split.rows.text(r, "For"))
                  for r, s in enumerate(rows) if s in fits.beside]
        assert ("laptop", ROLES["embeddings"]) in beside, beside
        for r, s in enumerate(rows):
            assert split.rows.text(r, "Fit") == s.fit_line  # with its speed estimate
            if s in fits.beside:
                assert split.rows.text(r, "For") == ROLES[s.role]
        assert any("tok/s" in split.rows.text(r, "Fit") for r in range(len(rows)))
        mains = [s.machine for s in fits.split]  # their rows' keys

        def now() -> list[str]:
            return [split.rows.text(split.rows.keys.index(k), "Now") for k in mains]

        def beside_now() -> list[str]:
            return [split.rows.text(r, "Now") for r, k in enumerate(split.rows.keys)
                    if k not in mains]

        assert now() == ["serves mock-m"] * 2
        assert beside_now() == ["not served"] * len(fits.beside)
        click(qtbot, split.use)  # the one click
        assert not split.use.isEnabled()  # once: each machine is asked
        await until(lambda: now() == ["serves it"] * 2, "both machines serving their models",
                    timeout=30)
        # this machine serves the models beside its own too (each loaded on demand); beside
        # the laptop's they are suggestions
        here = [b for b in fits.beside if b.machine == "this machine"]
        assert here, fits.beside
        await until(lambda: beside_now() == ["served in the fleet" if b in here
                                             else "not served" for b in fits.beside],
                    "this machine serving the models beside its own", timeout=30)
        desk_node, laptop_node = desk.snapshot().roles.node, laptop.snapshot().roles.node
        assert desk_node is not None and desk_node.model == wanted["this machine"]
        assert laptop_node is not None and laptop_node.model == wanted[laptop_key]
        assert {k.name for k in desk_node.kept} == {b.candidate.spec for b in here}
        assert split.done_line.text() == "Every machine serves its suggested model."
        assert not split.use.isEnabled()


async def test_the_split_is_hidden_for_one_machine_serving_its_suggestion(tmp_path: Path,
                                                                         qtbot):
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        _window, page = models_page(ui)
        fits = await shoal.models.fits()
        [alone] = fits.split
        rows = page.split.rows
        await until(lambda: visible(page.split) and rows.rowCount() == 1 + len(fits.beside),
                    "the split offered")
        # one machine alone gets every role an editor needs: chat, autocomplete (its own
        # model, or the main one's fill-in-the-middle) and embeddings
        roles = [rows.text(r, "For") for r in range(rows.rowCount())]
        assert roles[0].startswith("agents and chat") or roles[0].startswith("chat"), roles
        assert ROLES["embeddings"] in roles[1:], roles
        assert ROLES["autocomplete"] in roles[1:] or roles[0].endswith(
            ", editor autocomplete"), roles
        await shoal.set_model(alone.candidate.spec, runtime="mock")
        # still offered: the models beside it are not served yet; one click serves them
        await until(lambda: page.split.use.isEnabled(), "the split offering the rest")
        assert page.split.isVisible() and page.split.done_line.text() == ""
        click(qtbot, page.split.use)
        await until(lambda: not page.split.isVisible(), "the split hidden")
        node = shoal.snapshot().roles.node
        assert node is not None and node.model == alone.candidate.spec
        assert {k.name for k in node.kept} == {b.candidate.spec for b in fits.beside}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_catalog_model_is_pulled_and_served_and_the_one_before_removed(
        tmp_path: Path, qtbot, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch):
    from tests.e2e.test_models_kept import put_embedded

    home = tmp_path / "home"
    embedded = await asyncio.to_thread(put_embedded, home, smollm2_gguf)
    settings = both(home).with_node(NodeSettings(model=None, runtime="llamacpp", lanes=1,
                                                 gpu="off"))
    async with running(settings) as shoal, bridged(shoal) as ui:
        catalog, _ = await shoal.models.catalog()
        entry = catalog.get(TINY)
        assert entry is not None
        quant = entry.quant("Q4_1")
        spec = entry.spec(quant.name)
        hub = FakeHub(repos={entry.gguf_repo: {quant.files[0]: smollm2_gguf}},
                      hold_after=smollm2_gguf.stat().st_size // 2)
        async with serving(hub):
            with pointed_at(monkeypatch, hub.url):
                await ready(shoal)
                _window, page = models_page(ui)
                kept = page.kept
                await until(lambda: kept.rows.keys == [EMBEDDED]
                            and kept.rows.text(0, "Served by") == "this machine",
                            "the embedded model kept, and served")
                one = embedded.stat().st_size
                assert kept.total.text() == f"1 model, {amount(one)} on disk in all."
                kept.select(EMBEDDED)
                click(qtbot, kept.remove_button)
                await until(kept.error.isVisible, "the refusal")
                assert kept.error.text().startswith(sentence(f"{EMBEDDED} is being served on "
                                                             "this machine"))
                assert embedded.exists() and kept.rows.keys == [EMBEDDED]

                card = page.catalog
                await until(lambda: TINY in card.catalog.keys, "the catalog listed")
                card.select(TINY)
                pick_quant(card, quant.name)
                click(qtbot, card.serve_here)
                serve = page.serve
                # a loaded machine takes a while from the click to the hub (the catalog's
                # metadata, the disk check, Qt's events): the download is held there
                await until(lambda: hub.held.is_set() and 0 < serve.progress.value() < 1000,
                            "the download half-way", timeout=60)
                assert visible(serve.progress_row) and not card.serve_here.isEnabled()
                assert spec in serve.progress_text.text()
                hub.release.set()
                await until(serve.ok.isVisible, "the model served", timeout=120)
                assert serve.ok.text() == f"Now serving {spec}."
                node = shoal.snapshot().roles.node
                assert node is not None and node.model == spec

                # both kept now, the pulled one served; the embedded one removed
                def served_by() -> dict[str, str]:
                    return {k: kept.rows.text(i, "Served by")
                            for i, k in enumerate(kept.rows.keys)}

                await until(lambda: sorted(served_by().values()) == ["this machine", "—"]
                            and served_by()[EMBEDDED] == "—", "two models kept, one served")
                [pulled] = [k for k in kept.rows.keys if k != EMBEDDED]
                both_sizes = sum(m.size for m in await shoal.models.kept())
                assert both_sizes > one
                assert kept.total.text() == f"2 models, {amount(both_sizes)} on disk in all."
                kept.select(EMBEDDED)
                click(qtbot, kept.remove_button)
                await until(lambda: kept.rows.keys == [pulled] and kept.ok.isVisible(),
                            "the embedded model gone")
                assert kept.ok.text() == f"Removed {EMBEDDED}: {amount(one)} freed."
                assert not kept.error.isVisible() and not embedded.exists()
                assert kept.total.text() == \
                    f"1 model, {amount(both_sizes - one)} on disk in all."


def test_a_model_that_fits_but_is_slow_says_so_in_its_cell():
    base = "fits with its whole 32K window"
    fast = Fit("full", 32768, 0, 29, 0, base + "; ~35 tok/s", tps=35.0, base_line=base)
    slow = replace(fast, line=base + "; slow here: ~2.1 tok/s (chat wants 10)", tps=2.1)
    unknown = replace(fast, line=base, tps=None)  # the machine's bandwidth is not known
    cells = [fit_cell(f) for f in (fast, slow, unknown)]
    assert [(c.text, c.tone) for c in cells] == [
        ("fits · ~35 tok/s", "good"), ("fits · slow: ~2.1 tok/s", "warn"), ("fits", "good")]
    assert cells[1].tip == "Fits with its whole 32K window; slow here: ~2.1 tok/s (chat " \
        "wants 10)".replace("F", "f", 1)


def test_the_tray_says_how_far_a_pull_is():
    from tests.ui.test_tray_view import snap

    pull = PullSnapshot(model="org/Coder-GGUF:Q4_K_M", done_bytes=300 << 20,
                        total_bytes=1200 << 20, state="running", rate_bps=12 << 20, eta_s=75)
    done = replace(pull, model="org/Other-GGUF:Q8_0", state="done")
    view = TrayView(snapshot=replace(snap(), pulls=(pull, done)), prefs=Prefs(welcomed=True))
    lines = [e for e in menu_entries(view) if e.key == "pull"]
    assert [(e.text, e.enabled) for e in lines] == [
        ("Downloading org/Coder-GGUF:Q4_K_M: 25% of 1.2 GiB, 12 MiB/s, 1 min 15 s left", False)]
    quiet = TrayView(snapshot=snap(), prefs=Prefs(welcomed=True))
    assert not [e for e in menu_entries(quiet) if e.key == "pull"]


async def test_a_machine_that_cannot_serve_its_model_of_the_split_says_why(
        tmp_path: Path, qtbot, monkeypatch: pytest.MonkeyPatch):
    """The other machine logged its failed load within a second, while its row said
    "pulling..." until the app quit and the button stayed disabled."""
    from engine.runtimes import registry

    async with desk_and_laptop(tmp_path) as (desk, _laptop), bridged(desk) as ui:
        _window, page = models_page(ui)
        split = page.split
        fits = await desk.models.fits()
        laptop_key = next(m.key for m in fits.machines if m.label == "laptop")
        broken = next(s.candidate.spec for s in fits.split if s.machine == laptop_key)
        mock = registry._RUNTIMES["mock"]

        def make(spec: registry.EngineSpec) -> object:
            if spec.path == broken:  # the laptop's model of the split will not load
                raise RuntimeError("the model file is damaged")
            return mock.make_engine(spec)

        monkeypatch.setitem(registry._RUNTIMES, "mock", replace(mock, make_engine=make))
        await until(lambda: visible(split) and split.rows.rowCount() == len(split_rows(fits)),
                    "the split shown")
        row = split.rows.keys.index(laptop_key)
        click(qtbot, split.use)
        await until(lambda: "the model file is damaged" in split.rows.text(row, "Now"),
                    "the laptop's failure shown at the desk", timeout=30)
        assert split.rows.text(row, "Now").startswith(f"could not serve {broken}")
        assert split.use.isEnabled()  # the user may ask again


async def test_kept_models_load_and_unload_by_a_click(tmp_path: Path, qtbot,
                                                      smollm2_gguf: Path) -> None:
    """A node that serves every model kept here (Settings' "Serve every model kept on this
    machine"): the Models page says which are in memory and how much each holds, and Load
    and Unload move them as a person clicks (the first model too)."""
    from app.pages.kept_models import IDLE_CHOICES
    from engine.models.store import import_gguf, keep_alive_defaults
    from tests.e2e.test_models_kept import put_embedded

    home = tmp_path / "home"
    await asyncio.to_thread(put_embedded, home, smollm2_gguf)
    await asyncio.to_thread(import_gguf, home, smollm2_gguf, "second")
    settings = both(home).with_node(NodeSettings(model=None, runtime="llamacpp", lanes=1,
                                                 gpu="off", serve_kept=True))
    async with running(settings) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        _window, page = models_page(ui)
        kept = page.kept

        def memory() -> dict[str, str]:
            return {k: kept.rows.text(i, "In memory") for i, k in enumerate(kept.rows.keys)}

        await until(lambda: set(memory()) == {EMBEDDED, "second"}
                    and memory()["second"].startswith("on disk")
                    and memory()[EMBEDDED].startswith("loaded, "), "both kept, one loaded")
        kept.select("second")
        click(qtbot, kept.load_button)
        await until(lambda: memory()["second"].startswith("loaded, "), "second loaded")
        await until(kept.ok.isVisible, "the line of the load")
        assert kept.ok.text() == "Loaded second."
        node = shoal.snapshot().roles.node
        assert node is not None and [k.state for k in node.kept] == ["loaded"]
        assert node.kept[0].memory > 0

        click(qtbot, kept.unload_button)
        await until(lambda: memory()["second"].startswith("on disk"), "second unloaded")
        kept.select(EMBEDDED)
        click(qtbot, kept.unload_button)
        await until(lambda: memory()[EMBEDDED].startswith("on disk"), "the first unloaded")
        click(qtbot, kept.load_button)
        await until(lambda: memory()[EMBEDDED].startswith("loaded, "), "the first back")
        assert not kept.error.isVisible()

        # "Once idle": the owner's idle time for one model, kept across restarts; at
        # "unload after each request" it unloads as soon as its load (a request) ends
        kept.select("second")
        assert kept.idle.currentText() == "The node's idle time"
        choice = next(i for i, (text, _s) in enumerate(IDLE_CHOICES)
                      if text == "unload after each request")
        kept.idle.activated.emit(choice)  # as a person's pick in the combo
        await until(lambda: kept.rows.text(kept.rows.keys.index("second"), "Once idle")
                    == "unloads at once", "the column says so")
        assert kept.ok.text() == "Second unloads after each request."
        assert keep_alive_defaults(home) == {"second": 0.0}
        click(qtbot, kept.load_button)
        await until(lambda: kept.ok.text() == "Loaded second.", "second loaded")
        await until(lambda: memory()["second"].startswith("on disk"), "second unloads idle")
        assert memory()[EMBEDDED].startswith("loaded, ")  # the node's idle time for it

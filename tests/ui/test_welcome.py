"""The first-run welcome, clicked through as a new user does: start a fleet here (its QR
code, then the model, then the editor settings), or join a fleet by pasting its code; the
way back, and finishing, which remembers that the welcome was done. The model step lists
the catalog's models that fit this machine (never an embeddings model) with the one
suggested for it chosen, each with its speed estimate, names the models suggested beside it
for an editor (autocomplete, embeddings), and its button pulls the model chosen (from a
local hub) and serves it, then goes on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.welcome import Welcome
from engine.models.speed import speed_text
from engine.service import configuration
from engine.settings import Settings
from engine.sizes import amount
from tests.fakehub import FakeHub, pointed_at, serving
from tests.ui.running import both, bridged, node_only, ready, running, visible
from tests.waiting import until

pytestmark = [pytest.mark.ui, pytest.mark.timeout(90)]


BUDGET = 4 << 30  # this machine's node budget in these tests: what fits does not vary
SMOLLM2 = "smollm2-135m-instruct"  # the catalog's tiny model the local hub serves


def click(qtbot, widget) -> None:  # type: ignore[no-untyped-def]
    qtbot.mouseClick(widget, Qt.MouseButton.LeftButton)


def budgeted(settings: Settings) -> Settings:
    assert settings.node is not None
    return settings.with_node(replace(settings.node, memory_budget=BUDGET))


async def listed(welcome: Welcome) -> list:  # type: ignore[type-arg]
    """The model step's options once the catalog's fits are in."""
    await until(lambda: any(r.option.kind == "catalog" for r in welcome.options.rows),
                "the catalog's models listed")
    return [r.option for r in welcome.options.rows]


def choose(qtbot, welcome: Welcome, key: str) -> None:  # type: ignore[no-untyped-def]
    """Click the row of the option ``key``, as a user picks it."""
    [row] = [r for r in welcome.options.rows if r.option.key == key]
    click(qtbot, row)
    assert welcome.options.chosen() == row.option


async def test_start_a_fleet_here_then_the_model_then_the_editor(
        tmp_path: Path, qtbot, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    async with running(budgeted(both(tmp_path))) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        welcome = Welcome(ui.bridge)
        welcome.show()
        assert welcome.step == "choose" and not welcome.next.isVisible()
        assert welcome.where.text() == "Step 1 of 4"

        click(qtbot, welcome.start_choice)
        assert welcome.step == "start" and not welcome.next.isEnabled()  # no code yet
        welcome.fleet_name.setText("desk")
        click(qtbot, welcome.start_button)
        await until(lambda: welcome.pairing_view.pairing is not None, "the fleet's code")
        assert visible(welcome.pairing_view) and welcome.next.isEnabled()
        assert welcome.pairing_view.pairing.fleet == "desk"
        assert shoal.snapshot().fleet_name == "desk" and shoal.snapshot().has_token

        click(qtbot, welcome.next)
        assert welcome.step == "model" and welcome.where.text() == "Step 3 of 4"
        assert welcome.current.text() == "Now serving mock-m (serving)."

        # the catalog's models that fit here, the one suggested for this machine first
        # and chosen: one click on the step's button takes it
        options = await listed(welcome)
        fits = await shoal.models.fits()
        here = fits.machines[0]
        [mine] = [s for s in fits.split if s.machine == here.key]
        first = options[0]
        assert first.suggested and first.spec == mine.candidate.spec
        assert welcome.options.chosen() == first
        assert welcome.next.text() == f"Download and serve ({amount(first.download)})"
        assert welcome.model_facts.text() == f"This machine: {fits.facts}."
        fitting = {f.entry.id for f in here.fits if f.best.fit.fits
                   and not f.best.fit.disk_short and not f.entry.embeddings}
        offered = [o for o in options if o.kind == "catalog"]
        by_spec = {q.spec: (f.entry.id, q) for f in here.fits for q in f.quants}
        assert {by_spec[o.spec][0] for o in offered} == fitting
        assert len(offered) == len(fitting)  # each model once, at one quantisation
        assert all(by_spec[o.spec][1].fit.fits for o in offered)
        # an embeddings model fits here, but makes vectors, not answers: never offered as
        # the model this machine serves
        embeddings = {f.entry.id for f in here.fits if f.entry.embeddings and f.best.fit.fits}
        assert embeddings and not embeddings & {o.entry for o in options}
        assert not any("embeddings" in o.line for o in offered)
        # the suggestion's fit, with how fast it would answer here
        assert first.line.startswith(f"{amount(first.download)} download · {mine.fit_line}")
        assert mine.fit.tps is not None and speed_text(mine.fit.tps) in first.line
        assert [o.kind for o in options[-3:]] == ["embedded", "current", "other"]
        # beside it, the models an editor needs with it: autocomplete (unless the
        # suggestion does fill-in-the-middle itself) and embeddings, each with its fit
        beside = [s for s in fits.beside if s.machine == here.key]
        assert {s.role for s in beside} | set(mine.also) == {"autocomplete", "embeddings"}
        assert visible(welcome.beside)
        shown = welcome.beside.text()
        assert shown.startswith("Beside the suggested model, for your editor: "), shown
        names = {e.id: e.name for e in fits.catalog.entries}
        for s, role in ((s, {"autocomplete": "editor autocomplete",
                             "embeddings": "embeddings (codebase search)"}[s.role])
                        for s in beside):
            said = (f"{names[s.candidate.entry_id]} {s.candidate.quant} for {role} "
                    f"({s.fit_line})")
            assert said in shown, (said, shown)
        left_out = len([e for e in fits.catalog.entries if not e.embeddings]) - len(fitting)
        assert welcome.left_out.text() == (
            f"{left_out} more in the catalog need more memory than this machine gives a "
            "model; the Models page lists them all.")

        # "Other model…" shows the file and id fields; keeping what it serves goes on
        choose(qtbot, welcome, "other")
        assert visible(welcome.serve.choices) and welcome.next.text() == "Serve this model"
        choose(qtbot, welcome, "current")
        assert not visible(welcome.serve.choices) and welcome.next.text() == "Next"
        click(qtbot, welcome.back)  # back to the code, and on again
        assert welcome.step == "start"
        click(qtbot, welcome.next)
        assert welcome.options.chosen().key == "current"  # the user's choice stays
        click(qtbot, welcome.next)
        assert welcome.step == "editor" and welcome.next.text() == "Finish"
        assert shoal.snapshot().roles.node.model == "mock-m"  # type: ignore[union-attr]
        await until(lambda: welcome.editors.base.text() == shoal.api_url, "the base URL")

        assert "welcomed" not in shoal.app_settings
        click(qtbot, welcome.next)
        assert not welcome.isVisible()
        await until(lambda: shoal.app_settings.get("welcomed") is True, "the welcome kept")


async def test_join_a_fleet_by_pasting_its_code(tmp_path: Path, qtbot):
    async with running(both(tmp_path / "a", fleet_listen="127.0.0.1:0")) as head, \
            running(node_only(tmp_path / "b", "laptop")) as joiner, \
            bridged(joiner) as ui:
        await head.create_fleet("desk")
        host, port = head.fleet_address  # type: ignore[misc]
        code = (await head.pairing(head=f"{host}:{port}")).url
        await ready(head)
        welcome = Welcome(ui.bridge)
        welcome.show()
        click(qtbot, welcome.join_choice)
        assert welcome.step == "join"
        assert not welcome.next.isEnabled() and welcome.next.text() == "Next (join first)"
        assert not visible(welcome.found_card)  # no token here yet: joining is by code

        panel = welcome.join_panel
        panel.code.setText("shoal://join?head=127.0.0.1:1&token=00&fleet=x")
        click(qtbot, panel.join_button)
        await until(lambda: panel.error.isVisible(), "the bad code refused")
        assert panel.error.text()[:1].isupper() and "\n" not in panel.error.text()
        assert not welcome.next.isEnabled()

        panel.code.setText(code)
        click(qtbot, panel.join_button)
        await until(lambda: panel.ok.isVisible(), "the join")
        assert panel.ok.text().startswith("Joined “desk”")
        await until(welcome.next.isEnabled, "Next once joined")
        assert welcome.next.text() == "Next"
        click(qtbot, welcome.next)
        assert welcome.step == "model"
        assert welcome.current.text() == "Now serving mock-m (serving)."
        await listed(welcome)
        choose(qtbot, welcome, "current")
        click(qtbot, welcome.next)
        click(qtbot, welcome.next)  # Finish
        assert not welcome.isVisible()
        await until(lambda: joiner.app_settings.get("welcomed") is True, "the welcome kept")
        await until(lambda: head.snapshot().ready_nodes == 2, "the head to see the laptop")


async def at_the_model_step(ui, qtbot) -> tuple[Welcome, list, object]:  # type: ignore[no-untyped-def]
    """The welcome past starting a fleet, at its model step: the options listed, and the
    catalog's tiny model among them (the one the local hub can serve)."""
    welcome = Welcome(ui.bridge)
    welcome.show()
    click(qtbot, welcome.start_choice)
    click(qtbot, welcome.start_button)
    await until(lambda: welcome.pairing_view.pairing is not None, "the fleet's code")
    click(qtbot, welcome.next)
    options = await listed(welcome)
    [tiny] = [o for o in options if o.kind == "catalog" and SMOLLM2 in o.spec.lower()]
    return welcome, options, tiny


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_model_step_pulls_the_chosen_model_and_goes_on(
        tmp_path: Path, qtbot, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    async with running(budgeted(both(tmp_path))) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        welcome, _options, tiny = await at_the_model_step(ui, qtbot)
        catalog, _ = await shoal.models.catalog()
        found = catalog.by_spec(tiny.spec)
        assert found is not None
        entry, quant = found
        # the local hub serves the embedded GGUF under the file this quantisation names
        hub = FakeHub(repos={entry.gguf_repo: {quant.files[0]: smollm2_gguf}},
                      hold_after=smollm2_gguf.stat().st_size // 2)
        async with serving(hub):
            with pointed_at(monkeypatch, hub.url):
                choose(qtbot, welcome, tiny.key)
                assert welcome.next.text() == f"Download and serve ({amount(quant.size)})"
                click(qtbot, welcome.next)
                serve = welcome.serve
                # a loaded machine takes a while from the click to the hub (the catalog's
                # metadata, the disk check, Qt's events): the download is held there
                try:
                    await until(lambda: hub.held.is_set() and 0 < serve.progress.value() < 1000,
                                "the download half-way", timeout=60)
                except AssertionError as exc:  # say what the step showed instead
                    raise AssertionError(f"{exc}; the step says {serve.error.text()!r} / "
                                         f"{serve.progress_text.text()!r}; hub gets "
                                         f"{hub.gets}, infos {hub.infos}") from None
                assert visible(serve.progress_row) and visible(serve.cancel)
                assert not welcome.next.isEnabled() and welcome.step == "model"
                hub.release.set()
                await until(lambda: welcome.step == "editor" or serve.error.isVisible(),
                            "the model served", timeout=120)
                assert welcome.step == "editor", serve.error.text()
        node = shoal.snapshot().roles.node
        assert node is not None and node.model == tiny.spec and node.runtime == "llamacpp"
        assert shoal.pending.node is not None and shoal.pending.node.model == tiny.spec


async def test_a_hub_error_goes_once_another_model_is_chosen_and_speaks_the_apps_words(
        tmp_path: Path, qtbot, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(configuration, "DEFAULT_FLEET_LISTEN", "127.0.0.1:0")  # never 8454 here
    async with running(budgeted(both(tmp_path))) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        welcome, options, tiny = await at_the_model_step(ui, qtbot)
        other = next(o for o in options if o.key != tiny.key)
        serve = welcome.serve
        hub = FakeHub(repos={})  # a hub that has none of the catalog's models
        async with serving(hub):
            with pointed_at(monkeypatch, hub.url):
                choose(qtbot, welcome, tiny.key)
                click(qtbot, welcome.next)
                await until(lambda: serve.error.isVisible(), "the hub's refusal shown")
        line = serve.error.text()
        assert "run again" not in line and "`shoal" not in line, line
        assert welcome.step == "model"
        choose(qtbot, welcome, other.key)  # another model: the last one's error goes
        assert not serve.error.isVisible()


@pytest.mark.parametrize(("engine_line", "shown"), [
    ("the download of acme/m.gguf stopped at 12 MiB of 80 MiB; run again to resume from there",
     "the download of acme/m.gguf stopped at 12 MiB of 80 MiB; choose it again to resume from "
     "there"),
    ("cannot write acme/m.gguf (No space left); free disk space or check the folder, then "
     "run again", "cannot write acme/m.gguf (No space left); free disk space or check the "
     "folder, then choose it again"),
    ("model acme/m is not in the cache at /x; run once without --offline to pull it",
     "model acme/m is not in the cache at /x; turn off offline mode to pull it"),
])
def test_a_pulls_error_is_said_in_the_apps_words(engine_line: str, shown: str) -> None:
    from app.join import in_the_app

    assert in_the_app(engine_line) == shown

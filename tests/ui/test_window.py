"""The window driven as a person would, against Shoal in process (mock runtime, real
sockets on 127.0.0.1): what each page shows, and what its buttons do."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import yaml
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QFileDialog, QMessageBox, QPushButton, QToolButton

from app.pages.fleet import NODE_COLUMNS
from app.pages.pairing import JOIN_COMMAND
from app.window import PAGES, MainWindow
from engine.errors import StartError
from engine.events import PullProgress, SessionFinished
from engine.settings import Settings
from tests.ui.running import (
    MODEL,
    QUIET,
    both,
    bridged,
    chat,
    node_only,
    ready,
    running,
    token_file,
    visible,
)
from tests.waiting import until

pytestmark = [pytest.mark.ui, pytest.mark.timeout(90)]


def click(qtbot, button: QPushButton) -> None:
    assert button.isEnabled(), f"{button.text()!r} is disabled"
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)


def clipboard() -> str:
    return QGuiApplication.clipboard().text()


def window_for(ui) -> MainWindow:
    window = MainWindow(ui.bridge)
    window.show()
    return window


async def test_fleet_page_lists_every_node_live_and_keeps_the_selection(tmp_path: Path, qtbot):
    token = token_file(tmp_path)
    async with listening_nodes(tmp_path, token) as nodes:
        addresses = tuple(f"{h}:{p}" for h, p in (n.node_address for n in nodes))
        settings = both(tmp_path / "head", lanes=2, speed=20.0, fleet=addresses)
        settings = Settings(home=settings.home, discovery=QUIET, auth_file=token,
                            fleet_name="desk", head=settings.head, node=settings.node)
        async with running(settings) as head, bridged(head) as ui:
            window = window_for(ui)
            page = window.fleet
            await ready(head, 3)
            # the window draws from the bridge's snapshots, a moment behind the engine
            await until(lambda: page.nodes.rowCount() == 3
                        and "3 of 3 nodes ready" in window.status.text(), "three nodes ready")
            names = [page.nodes.text(r, "Node") for r in range(3)]
            assert names[0] == socket.gethostname() and sorted(names[1:]) == ["laptop", "studio"]
            assert [page.nodes.text(r, "Link") for r in range(3)] == \
                ["this machine", "dialed", "dialed"]
            assert page.nodes.text(1, "Lanes") == "0/2" and page.nodes.text(1, "Model") == MODEL
            assert page.api.text() == head.api_url and visible(page.api)
            assert page.fleet.text() == "desk"
            assert not any("(connecting)" in page.nodes.text(r, "Node") for r in range(3))
            click(qtbot, page.api.button)
            assert clipboard() == head.api_url

            # a row chosen by the user stays chosen while the table refreshes under it
            page.node_view.selectRow(2)
            before = page.nodes.rows[2]
            answers = [asyncio.ensure_future(chat(head, max_tokens=50)) for _ in range(3)]
            await until(lambda: page.nodes.text(0, "Lanes") != "0/2"
                        or page.nodes.rows[2] != before, "a row to change")
            await until(lambda: any((page.nodes.rows[r][NODE_COLUMNS.index("KV cache")].bar
                                     or 0) > 0 for r in range(3)), "a KV cache in use")
            [selected] = page.node_view.selectionModel().selectedRows()
            assert page.nodes.key_at(selected.row()) == page.nodes.keys[2]
            heads = [page.heads.text(r, 0) for r in range(page.heads.rowCount())]
            assert len(heads) == 1 and heads[0].endswith("(this machine)")
            assert await asyncio.gather(*answers) == [200, 200, 200]

            # pause and resume this machine's node
            assert page.serving.text().startswith("Serving")
            click(qtbot, page.pause)
            await until(lambda: page.serving.text().startswith("Paused"), "paused")
            assert page.pause.text() == "Resume serving"
            click(qtbot, page.pause)
            await until(lambda: page.serving.text().startswith("Serving"), "serving again")


class listening_nodes:
    """Two mock nodes that heads dial, holding ``token`` (the head dials them with it)."""

    def __init__(self, tmp: Path, token: Path) -> None:
        self._tmp, self._token = tmp, token
        self.nodes: list = []

    async def __aenter__(self) -> list:
        from engine.service import Shoal

        for name in ("laptop", "studio"):
            s = node_only(self._tmp / name, name, listen="127.0.0.1:0", mock_speed=10.0)
            self.nodes.append(await Shoal.start(Settings(
                home=s.home, discovery=QUIET, auth_file=self._token, node=s.node)))
        return self.nodes

    async def __aexit__(self, *exc: object) -> None:
        for n in self.nodes:
            await n.stop(drain=0)


async def test_models_page_sets_reverts_removes_aliases_with_history(tmp_path: Path, qtbot):
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        window = window_for(ui)
        window.show_page("models")
        page = window.models
        await until(lambda: page.models.rowCount() == 1, "the served model")
        assert page.models.text(0, "Model") == MODEL and page.models.text(0, "Serving") == "yes"
        assert MODEL in page.current.text() and "serving" in page.current.text()

        page.name.setText("coder")
        page.target.setEditText(MODEL)
        page.fallbacks.setText("other-a, other-b")
        click(qtbot, page.set_button)
        await until(lambda: page.alias_ok.isVisible(), "the change reported")
        assert page.alias_ok.text() == f"coder -> {MODEL} then other-a, other-b (ver 1): 1/1 heads"
        await until(lambda: page.aliases.rowCount() == 1, "the alias listed")
        assert page.aliases.text(0, "Answers with") == MODEL
        assert page.aliases.text(0, "Fallbacks") == "other-a, other-b"

        page.fallbacks.setText("other-c")
        click(qtbot, page.set_button)
        await until(lambda: "(ver 2)" in page.alias_ok.text(), "the second version")
        click(qtbot, page.revert_button)
        await until(lambda: "(ver 3)" in page.alias_ok.text(), "the revert")
        assert "then other-a, other-b" in page.alias_ok.text()
        click(qtbot, page.history_button)
        await until(lambda: page.history is not None and page.history.isVisible(), "history")
        assert page.history.windowTitle() == "History of coder"
        assert [page.history.rows.text(r, "Version") for r in range(3)] == ["3", "2", "1"]
        assert page.history.rows.text(1, "Fallbacks") == "other-c"
        page.history.close()

        # a model's own name cannot be an alias: the engine's line, under the form
        page.name.setText(MODEL)
        click(qtbot, page.set_button)
        await until(lambda: page.alias_error.isVisible(), "the refusal")
        assert "a real model name always wins" in page.alias_error.text()

        page.alias_view.selectRow(0)
        assert page.name.text() == "coder"
        click(qtbot, page.remove_button)
        await until(lambda: page.aliases.rowCount() == 0, "the alias gone")
        assert page.alias_ok.text().startswith("coder removed (ver 4)")


async def test_models_page_refuses_a_model_id_it_cannot_get_and_says_why(tmp_path: Path,
                                                                        qtbot):
    settings = both(tmp_path)
    settings = Settings(home=tmp_path, discovery=QUIET, head=settings.head,
                        node=settings.node, offline=True)
    async with running(settings) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        window = window_for(ui)
        window.show_page("models")
        serve = window.models.serve
        serve.model_id.setText("not-an-id")
        serve.hub.setChecked(True)
        click(qtbot, serve.serve)
        assert serve.error.text().startswith("Write a model id as org/repo")
        serve.model_id.setText("someone/some-model-GGUF:Q4_K_M")
        click(qtbot, serve.serve)
        await until(lambda: serve.error.isVisible(), "the engine's refusal")
        assert "not in the cache" in serve.error.text()
        assert not serve.progress_row.isVisible() and serve.serve.isEnabled()
        # the node kept serving what it served
        assert shoal.snapshot().roles.node.model == MODEL  # type: ignore[union-attr]


async def test_a_pull_shows_its_progress_and_can_be_cancelled(tmp_path: Path, qtbot):
    """The widget's side of a pull: PullProgress events as the engine sends them drive the
    bar, and Cancel asks the engine to cancel that pull. (A real pull needs the network;
    the engine's command is held here so the pull stays under way.)"""
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        window = window_for(ui)
        window.show_page("models")
        serve = window.models.serve
        release = asyncio.Event()
        cancelled: list[str] = []

        async def pulling(spec: str | None, *, runtime: str | None = None) -> str:
            await release.wait()
            raise StartError("the pull was cancelled; start it again to resume",
                             code="pull_cancelled")

        shoal.set_model = pulling  # type: ignore[method-assign]
        shoal.cancel_pull = lambda model: cancelled.append(model) or True  # type: ignore
        serve.model_id.setText("org/repo:Q4_K_M")
        serve.hub.setChecked(True)
        click(qtbot, serve.serve)
        assert serve.progress_row.isVisible() and not serve.serve.isEnabled()
        ui.bridge.event.emit(PullProgress(model="org/repo:Q4_K_M", done_bytes=50 << 20,
                                          total_bytes=200 << 20))
        assert serve.progress.value() == 250 and serve.progress.maximum() == 1000
        assert serve.progress_text.text() == \
            "Downloading org/repo:Q4_K_M: 50 MiB of 200 MiB"
        click(qtbot, serve.cancel)
        assert cancelled == ["org/repo:Q4_K_M"]
        assert serve.progress_text.text().startswith("Cancelling")
        release.set()
        await until(lambda: serve.error.isVisible(), "the cancellation reported")
        assert serve.error.text() == "The pull was cancelled; start it again to resume"
        assert not serve.progress_row.isVisible()


async def test_pairing_starts_a_fleet_shows_its_qr_and_rotates_after_confirming(
        tmp_path: Path, qtbot):
    import zxingcpp

    async with running(both(tmp_path, fleet_listen="127.0.0.1:0")) as shoal, \
            bridged(shoal) as ui:
        window = window_for(ui)
        window.show_page("pairing")
        page = window.pairing
        assert visible(page.start_card) and not visible(page.code_card)
        page.name.setText("desk")
        click(qtbot, page.start)
        await until(lambda: page.view.pairing is not None, "the pairing code")
        await until(lambda: visible(page.code_card), "the code shown")
        url = page.view.pairing.url
        token = (await shoal.fleet_token()).hex()
        assert token in url and page.view.fleet.text() == "Fleet “desk”"
        assert token not in page.view.url.field.text() and "token=•" in page.view.url.field.text()
        assert token not in window.windowTitle()
        # the QR on screen reads back as the join URL, crisp at its size
        image = page.view.qr.pixmap().toImage()
        assert image.width() >= 150
        # zxing may report one code twice (it did once in CI); every reading is the URL
        found = zxingcpp.read_barcodes(_as_pil(image))
        assert found and {f.text for f in found} == {url}
        click(qtbot, page.view.url.button)
        assert clipboard() == url
        click(qtbot, page.view.command.button)
        assert clipboard() == JOIN_COMMAND

        # rotating asks first; Cancel leaves the token as it was
        click(qtbot, page.rotate)
        box = page.confirm
        assert isinstance(box, QMessageBox) and box.isVisible()
        assert "pairs again" in box.text()
        click(qtbot, box.button(QMessageBox.StandardButton.Cancel))
        await until(lambda: page.confirm is None, "the question closed")
        assert page.view.pairing.url == url
        click(qtbot, page.rotate)
        box = page.confirm
        rotate = next(b for b in box.buttons() if b.text() == "Rotate token")
        click(qtbot, rotate)
        await until(lambda: page.view.pairing.url != url, "a new code")
        assert (await shoal.fleet_token()).hex() != token


def _as_pil(image):
    from PIL import Image
    from PySide6.QtCore import QBuffer, QIODevice

    buf = QBuffer()
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buf, "PNG")
    import io

    return Image.open(io.BytesIO(bytes(buf.data())))


async def test_activity_lists_requests_newest_first_and_nodes_coming_and_going(
        tmp_path: Path, qtbot):
    async with running(both(tmp_path / "a", fleet_listen="127.0.0.1:0")) as head, \
            bridged(head) as ui:
        await ready(head)
        window = window_for(ui)
        window.show_page("activity")
        page = window.activity
        assert visible(page.empty)
        for tokens in (3, 4, 5):
            assert await chat(head, max_tokens=tokens) == 200
        await until(lambda: page.requests.rowCount() == 3, "three requests listed")
        assert [page.requests.text(r, "Tokens").split(" → ")[1] for r in range(3)] == \
            ["5", "4", "3"]
        assert page.requests.text(0, "Model") == MODEL
        assert page.requests.text(0, "Result") == "length" and not visible(page.empty)
        assert page.count.text() == "3 requests, 0 failed"

        await head.create_fleet("desk")
        host, port = head.fleet_address  # type: ignore[misc]
        pairing = await head.pairing(head=f"{host}:{port}")
        async with running(node_only(tmp_path / "b", "other-machine")) as other:
            await other.join(pairing.url)
            await until(lambda: any("other-machine joined" in page.events.text(r, 1)
                                    for r in range(page.events.rowCount())), "the join listed")
        await until(lambda: any("other-machine left the fleet" in page.events.text(r, 1)
                                for r in range(page.events.rowCount())), "the leave listed",
                    timeout=20)
        click(qtbot, next(b for b in page.findChildren(QPushButton) if b.text() == "Clear"))
        assert page.requests.rowCount() == 0 and page.events.rowCount() == 0


async def test_try_it_streams_stops_and_says_when_the_api_is_off(tmp_path: Path, qtbot):
    async with running(both(tmp_path, speed=30.0)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        window = window_for(ui)
        window.show_page("try")
        page = window.try_it
        await until(lambda: page.model.count() == 1, "the model picker filled")
        assert page.model.currentData() == MODEL
        page.seed = 7  # the mock then fills each answer to its bound (unseeded it may end early)
        page.max_tokens = 8
        page.prompt.setPlainText("hello there")
        click(qtbot, page.send_button)
        assert page.streaming and page.stop_button.isEnabled()
        await until(lambda: not page.streaming, "the answer")
        text = page.transcript.toPlainText()
        answer = "".join(page._answer)  # the mock's bytes
        assert answer and text == "You\nhello there\n\nmock-m\n" + answer
        assert page.status.text().startswith("8 tokens in")

        page.max_tokens = 400
        page.prompt.setPlainText("a long one")
        click(qtbot, page.send_button)
        await until(lambda: page.transcript.toPlainText().count("mock-m") == 2
                    and len(page._answer) > 2, "the answer streaming")
        click(qtbot, page.stop_button)
        await until(lambda: not page.streaming, "the stop")
        assert page.transcript.toPlainText().endswith("[stopped]")
        assert page.status.text() == "Stopped." and page.send_button.isEnabled()

        # keys on: the page asks the engine for its own key and carries on
        await shoal.keys.issue("alice")
        await until(lambda: _status(chat(shoal)), "keys on")
        page.max_tokens = 4
        page.prompt.setPlainText("with keys on")
        click(qtbot, page.send_button)
        await until(lambda: not page.streaming, "the answer with a key")
        assert not page.error.isVisible(), page.error.text()
        assert page.status.text().startswith("4 tokens in")

        await shoal.set_head(False)
        await until(lambda: visible(page.off_row), "the API-off line")
        assert not page.send_button.isEnabled()
        click(qtbot, page.api_on)
        await until(lambda: not visible(page.off_row), "the API back")


async def _status(code) -> bool:
    return await code == 401


async def test_settings_save_for_the_next_start_keys_and_notifications(tmp_path: Path, qtbot):
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        window = window_for(ui)
        window.show_page("settings")
        page = window.settings
        page.http_port.setValue(18453)
        assert not page.fleet_port.isEnabled()  # no joins taken outside a fleet
        page.discovery.setCurrentIndex(page.discovery.findData("lan"))
        page.queue.setValue(30)
        click(qtbot, page.save)
        await until(lambda: page.saved.isVisible(), "saved")
        assert "next starts" in page.saved.text()
        pending = shoal.pending  # what the next start has (the app's Shoal writes it)
        assert pending.head is not None and pending.head.http == "127.0.0.1:18453"
        assert pending.head.fleet_listen is None and pending.join is None
        assert pending.head.queue_timeout_s == 30.0
        assert pending.discovery.mode == "lan"
        # the running head keeps its port until the next start
        assert shoal.api_url is not None and ":18453" not in shoal.api_url

        click(qtbot, page.issue)
        assert page.key_error.text().startswith("Give the key a name")
        page.key_name.setText("alice")
        click(qtbot, page.issue)
        await until(lambda: visible(page.key), "the key shown")
        key = page.key.text()
        assert key and visible(page.key_note)
        assert await chat(shoal, key=key) == 200
        click(qtbot, page.revoke)
        await until(lambda: page.key_done.text() == "alice's key is revoked.", "revoked")
        assert not visible(page.key)
        click(qtbot, page.revoke)
        await until(lambda: page.key_done.text() == "alice's key was already revoked.",
                    "revoked twice")

        assert page.notify.isChecked()
        qtbot.mouseClick(page.notify, Qt.MouseButton.LeftButton,
                         pos=QPoint(8, page.notify.height() // 2))  # on its box
        await until(lambda: shoal.app_settings.get("notify") is False, "the choice kept")
        assert not page.notify.isChecked()
        assert str(tmp_path / "models") in page.models_dir


async def test_the_editor_page_follows_the_fleet(tmp_path: Path, qtbot):
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        window = window_for(ui)
        window.show_page("editors")
        panel = window.editors
        await until(lambda: panel.chat.count() == 1, "the models offered")
        assert panel.base.text() == shoal.api_url
        config = yaml.safe_load(panel.snippet_text("Continue"))
        assert [m["model"] for m in config["models"]] == [MODEL]
        assert config["models"][0]["apiBase"] == shoal.api_url
        assert visible(panel.views["Continue"].warning)  # the mock model has no FIM tokens
        await shoal.aliases.set("coder", MODEL)
        await until(lambda: "coder" in panel.snippet_text("Zed"), "the alias offered")
        panel.tabs.setCurrentIndex(list(panel.views).index("Aider"))
        click(qtbot, panel.views["Aider"].copy)
        assert clipboard() == panel.snippet_text("Aider")
        assert f"--model openai/{MODEL}" in clipboard()
        await shoal.set_head(False)
        await until(lambda: visible(panel.off), "the API-off line")
        assert not panel.tabs.isEnabled()


async def test_every_page_opens_and_a_failed_command_shows_one_line(tmp_path: Path, qtbot):
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        window = window_for(ui)
        assert window.windowTitle() == "Shoal"
        for key, label in PAGES:
            window.show_page(key)
            assert window.current_page == key
            assert window.sidebar.currentItem().text() == label
        with pytest.raises(ValueError, match="no page 'nope'"):
            window.show_page("nope")
        # a command that fails: the engine's line in the banner, until dismissed
        ui.bridge.run(shoal.pairing())
        await until(lambda: window.banner.isVisible(), "the banner")
        assert window.banner.text().startswith("This machine has no fleet token yet")
        qtbot.mouseClick(window.banner.findChild(QToolButton, "bannerClose"),
                         Qt.MouseButton.LeftButton)
        assert not window.banner.isVisible()
        window.close()
        assert not window.isVisible()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_serve_a_gguf_file_then_try_it_answers_from_smollm2(tmp_path: Path, qtbot,
                                                                   smollm2_gguf: Path):
    async with running(both(tmp_path)) as shoal, bridged(shoal) as ui:
        await ready(shoal)
        window = window_for(ui)
        window.show_page("models")
        serve = window.models.serve
        click(qtbot, serve.browse)
        dialog = window.findChild(QFileDialog, "chooseFile")
        assert dialog is not None and dialog.isVisible()
        dialog.selectFile(str(smollm2_gguf))
        dialog.accept()
        assert serve.path.text() == str(smollm2_gguf) and serve.file.isChecked()
        click(qtbot, serve.serve)
        name = smollm2_gguf.stem
        await until(lambda: serve.ok.isVisible() or serve.error.isVisible(), "the model loaded",
                    timeout=120)
        assert serve.ok.text() == f"Now serving {name}.", serve.error.text()
        node = shoal.pending.node  # kept for the next start (the app's Shoal writes it)
        assert node is not None and node.model == str(smollm2_gguf)
        await ready(shoal)

        window.show_page("try")
        page = window.try_it
        await until(lambda: page.model.findData(name) >= 0, "the new model offered")
        page.model.setCurrentIndex(page.model.findData(name))
        page.max_tokens = 12
        page.prompt.setPlainText("Name three colours.")
        async with shoal.events() as events:
            click(qtbot, page.send_button)
            await until(lambda: not page.streaming, "the answer", timeout=180)
            # the engine's own count of the answer, to hold the page's figure against
            finished = await until(lambda: next(
                (e for e in iter(events.get_nowait, None)
                 if isinstance(e, SessionFinished) and e.requested == name), None),
                "the engine's record of the answer")
        assert not page.error.isVisible(), page.error.text()
        answer = page.transcript.toPlainText().split(f"{name}\n", 1)[1]
        assert len(answer.split()) >= 2
        assert finished.error is None and 2 <= finished.completion_tokens <= 12
        if finished.finish_reason == "length":
            assert finished.completion_tokens == 12
        assert page.status.text().startswith(f"{finished.completion_tokens} tokens in "), \
            page.status.text()


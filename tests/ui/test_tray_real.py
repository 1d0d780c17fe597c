"""The tray over the real embedded model (SmolLM2-135M-Instruct on llama.cpp), in process:
the start shows in the menu until the model is loaded, the copied URL answers with the
model's words, and Pause shows in the icon while the model stays loaded."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from PySide6.QtGui import QGuiApplication

from app.main import Shell
from app.prefs import Prefs
from engine.settings import HeadSettings, NodeSettings, Settings
from tests.ui.conftest import QUIET, choose, read_menu
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
NAME = "SmolLM2-135M-Instruct.Q4_1"  # a model given by path goes by its file name


async def test_the_tray_over_the_real_model(ui_home: Path, smollm2_gguf: Path):
    model = str(smollm2_gguf)
    shell = Shell(Settings(home=ui_home, discovery=QUIET,
                           head=HeadSettings(model=model, http="127.0.0.1:0"),
                           node=NodeSettings(model=model, lanes=2, max_context=1024)),
                  Prefs(welcomed=True), system_tray=True)
    shell.start()
    try:
        # while llama.cpp loads the model the app is already there, and says so
        starting = await read_menu(shell.tray.menu)  # loading takes seconds, this a moment
        assert starting["status"][0].startswith("Starting: ")
        assert not starting["copy_api_url"][1] and not starting["pause"][1]
        assert shell.tray.look == "busy"
        await until(lambda: shell.phase == "running", "the model to load", timeout=120)
        await until(lambda: shell.bridge.refresh().ready_nodes == 1, "the node ready")
        menu = await read_menu(shell.tray.menu)
        assert menu["status"][0] == "Not in a fleet · 1 node ready · 0/2 lanes busy"

        await choose(shell.tray.menu, "copy_api_url")
        url = QGuiApplication.clipboard().text()
        assert url == shell.bridge.last.roles.api_url
        body = {"model": NAME, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "Name three colours."}]}
        async with aiohttp.ClientSession() as http, \
                http.post(f"{url}/chat/completions", json=body) as r:
            assert r.status == 200
            answer = (await r.json())["choices"][0]["message"]["content"]
        assert len(answer.split()) >= 2

        await choose(shell.tray.menu, "pause")
        await until(lambda: shell.tray.look == "paused", "the paused icon")
        node = shell.bridge.refresh().roles.node
        assert node is not None and node.state == "paused" and node.runtime == "llamacpp"
        assert (await read_menu(shell.tray.menu))["pause"][2] is True
        await choose(shell.tray.menu, "pause")
        await until(lambda: shell.tray.look == "lonely", "serving again")
    finally:
        await shell.stop(drain=5)

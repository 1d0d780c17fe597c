"""Stop strings over HTTP: longer than MAX_STOP_CHARS is refused by name, shorter works.

An in-process head with a mock node (no subprocess needed: the limit is in the
request schema, the matching in the head)."""

from __future__ import annotations

import aiohttp
import pytest

from engine.head.prompt.text import MAX_STOP_CHARS
from tests.integration.test_api_surface import MODEL, live_head

pytestmark = pytest.mark.timeout(120)
OK = "x" * MAX_STOP_CHARS
LONG = "x" * (MAX_STOP_CHARS + 1)
MESSAGES = [{"role": "user", "content": "hello"}]

ROUTES = [
    # path, body with the stop strings, where the error names them, error shape
    ("/v1/chat/completions", lambda stop: {"model": MODEL, "messages": MESSAGES, "stop": stop,
                                           "max_tokens": 4}, "$.stop", "openai"),
    ("/v1/completions", lambda stop: {"model": MODEL, "prompt": "hi", "stop": stop,
                                      "max_tokens": 4}, "$.stop", "openai"),
    ("/api/chat", lambda stop: {"model": MODEL, "messages": MESSAGES, "stream": False,
                                "options": {"stop": stop, "num_predict": 4}},
     "$.options.stop", "ollama"),
    ("/api/generate", lambda stop: {"model": MODEL, "prompt": "hi", "stream": False,
                                    "options": {"stop": stop, "num_predict": 4}},
     "$.options.stop", "ollama"),
]


async def test_a_stop_over_the_limit_gets_400_naming_the_field_and_limit():
    async with live_head() as live, aiohttp.ClientSession() as http:
        for path, body, field, shape in ROUTES:
            for stop, where in ((LONG, field), (["a", LONG], field + "[1]"),
                                ([LONG] * 16, field + "[0]")):
                async with http.post(live.url(path), json=body(stop)) as r:
                    assert r.status == 400, (path, await r.text())
                    err = (await r.json())["error"]
                message = err["message"] if shape == "openai" else err
                assert f"length <= {MAX_STOP_CHARS}" in message, message
                assert where in message, message
                assert "\n" not in message
            for stop in (OK, [OK] * 16, ["", OK]):
                async with http.post(live.url(path), json=body(stop)) as r:
                    assert r.status == 200, (path, await r.text())

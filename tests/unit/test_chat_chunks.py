"""Chat Completions' text chunks (engine.api.openai.ChatStream): the template a text delta
is written through makes the same bytes as the general chunk builder."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from engine.api.openai import ChatStream
from engine.api.schemas import decode_chat
from engine.head.prompt.tools import TextDelta


def stream(model: str = "bench") -> ChatStream:
    req = decode_chat(json.dumps({"model": model, "stream": True,
                                  "messages": [{"role": "user", "content": "hi"}]}).encode())
    # the wire reads only the request's arrival time and the head's clock
    head: Any = SimpleNamespace(runner=SimpleNamespace(clock=time.monotonic))
    return ChatStream({}, head, req, "chatcmpl-0123abcd")  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["a", " ", "hello world", 'quote " and \\ back',
                                  "line\nbreak\ttab\x00\x1f", "é ü 漢字 🐟", "\u2028\u2029",
                                  "</script>"])
def test_a_text_delta_is_the_chunk_json_dumps_makes(text: str) -> None:
    s = stream()
    made = s.event(TextDelta(text))
    assert made == s.chunk({"content": text})
    assert json.loads(made[len(b"data: "):])["choices"][0]["delta"]["content"] == text


def test_a_model_name_that_needs_escaping_keeps_the_template_whole() -> None:
    s = stream('odd "model" \\ name')
    assert s.event(TextDelta("x")) == s.chunk({"content": "x"})

"""A tool call opened for the model (what a required ``tool_choice`` does), an answer
that continues a prefill, and which stop string ended a text: the head's side of the
agents' routes, without sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.head.prompt.model import HeadModel
from engine.head.prompt.templates import load_chat_template
from engine.head.prompt.text import StopMatcher
from engine.head.prompt.tools import ToolCallDelta, collect, parser_for
from engine.head.prompt.turn import ToolChoice, chat_prompt
from engine.runtimes.mock import MockTokenizer

FUNCTION = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def model_with(template: str) -> HeadModel:
    vocab = MockTokenizer()
    tpl = load_chat_template(vocab.metadata(), chat_template=template, bos_text="",
                             eos_text=vocab.eos_text)
    return HeadModel(name="m", runtime="mock", vocab=vocab, template=tpl,
                     stop_ids=frozenset(vocab.eos_ids))


@pytest.mark.parametrize(("parser", "name", "rest"), [
    ("hermes", "get_weather", '{"city": "Paris"}}\n</tool_call>'),
    ("hermes", None, 'get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
    ("llama3", "get_weather", '{"city": "Paris"}}'),
    ("llama3", None, 'get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", "get_weather", '{"city": "Paris"}}]'),
    ("mistral", None, 'get_weather", "arguments": {"city": "Paris"}}]'),
])
def test_an_opened_call_completes_with_the_models_text(parser: str, name: str | None,
                                                       rest: str):
    p = parser_for(parser, "chatml", id_factory=lambda: "call_1")
    opener = p.opener(name)
    assert opener is not None
    assert p.feed(opener) == []  # the opener alone is never text
    deltas = [*p.feed(rest), *p.finish()]
    assert collect(deltas) == ("", [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    assert all(isinstance(d, ToolCallDelta) for d in deltas)


def test_an_opener_quotes_the_name_as_json():
    assert parser_for("hermes", "chatml").opener('a"b') == \
        '<tool_call>\n{"name": "a\\"b", "arguments": '
    assert parser_for("none", "chatml").opener("f") is None


def test_chat_prompt_opens_the_call_or_leaves_tools_out():
    model = model_with("{% for m in messages %}{{ m.content }}|{% endfor %}"
                       "{% if tools %}T:{{ tools[0].function.name }}|{% endif %}>")
    msgs = [{"role": "user", "content": "hi"}]

    def text(ids: list[int]) -> str:
        return "".join(MockTokenizer().special_text(i) for i in ids)

    async def prompt(choice: ToolChoice, prefill: str = "") -> tuple[str, Any]:
        ids, parser = await chat_prompt(model, msgs, tools=[FUNCTION], tool_choice=choice,
                                        prefill=prefill)
        return text(ids), parser

    auto, parser = asyncio.run(prompt(ToolChoice()))
    assert auto == "hi|T:get_weather|>" and parser is not None
    none, parser = asyncio.run(prompt(ToolChoice("none")))
    assert none == "hi|>" and parser is None
    forced, parser = asyncio.run(prompt(ToolChoice("required", "get_weather"), "Sure. "))
    assert forced == 'hi|T:get_weather|>Sure. <tool_call>\n{"name": "get_weather", ' \
        '"arguments": '
    assert parser.feed('{}}</tool_call>')[0].name == "get_weather"


def test_the_stop_string_that_ended_the_text_is_known():
    stops = StopMatcher(["END", "STOP", "ST"])
    assert stops.feed("abc S") == ("abc ", False) and stops.matched is None
    assert stops.feed("TOP and more") == ("", True)
    assert stops.matched == "ST"  # the one that starts first, and ends first
    later = StopMatcher(["END", "XEND"])
    assert later.feed("aXEND") == ("a", True) and later.matched == "XEND"

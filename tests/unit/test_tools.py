"""Tool call parsing: formats, streaming equals whole, malformed input, fuzzing."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.head.tools import (
    PARSERS,
    Delta,
    HermesParser,
    Llama3Parser,
    MistralParser,
    NoToolParser,
    TextDelta,
    ToolCallDelta,
    collect,
    parser_for,
)


def fixed_id() -> str:
    return "call_test"


def run(name: str, chunks: list[str]) -> tuple[list[Delta], tuple[str, list[dict[str, Any]]]]:
    p = parser_for(name, "chatml", id_factory=fixed_id)
    deltas: list[Delta] = []
    for c in chunks:
        deltas += p.feed(c)
    deltas += p.finish()
    return deltas, collect(deltas)


def whole(name: str, text: str) -> tuple[str, list[dict[str, Any]]]:
    return parser_for(name, "chatml", id_factory=fixed_id).parse_complete(text)


def call(name: str, args: dict[str, Any], cid: str = "call_test") -> dict[str, Any]:
    return {
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


CASES: list[tuple[str, str, str, list[dict[str, Any]]]] = [
    # parser, model output, content, tool_calls
    ("hermes", "Just text.", "Just text.", []),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [call("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        "Checking both.\n\n"
        '<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "w", "arguments": {"city": "Rome"}}\n</tool_call>\n',
        "Checking both.",
        [call("w", {"city": "Paris"}), call("w", {"city": "Rome"})],
    ),
    # the stop token cut the closing tag
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}', "", [call("f", {})]),
    # arguments as a JSON string are accepted and normalised
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "",
        [call("f", {"a": 1})],
    ),
    (
        "hermes",
        "x <tool_call>{not json}</tool_call> y",
        "x <tool_call>{not json}</tool_call> y",
        [],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    ("hermes", "<tool_call>unfinished", "<tool_call>unfinished", []),
    ("hermes", "a < b <tool_c", "a < b <tool_c", []),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [call("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}',
        "",
        [call("f", {}), call("g", {"x": 1})],
    ),
    (
        "llama3",
        'Let me look.<|python_tag|>{"name": "f", "parameters": {"q": "é"}}',
        "Let me look.",
        [
            {
                "id": "call_test",
                "type": "function",
                "function": {"name": "f", "arguments": '{"q": "é"}'},
            }
        ],
    ),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3", "  Hello there", "  Hello there", []),
    ("llama3", '{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
    (
        "llama3",
        '<|python_tag|>brave_search.call(query="x")',
        '<|python_tag|>brave_search.call(query="x")',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "abc123def"}, '
        '{"name": "g", "arguments": {}}]',
        "",
        [call("f", {"a": 1}, "abc123def"), call("g", {})],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]g[ARGS]{}',
        "Sure.",
        [call("get_weather", {"city": "Paris"}), call("g", {})],
    ),
    ("mistral", "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
    ("mistral", '[TOOL_CALLS] [{"x": 1}] after', '[TOOL_CALLS] [{"x": 1}] after', []),
    ("mistral", "plain [TOOL", "plain [TOOL", []),
    ("none", '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parse_complete(name: str, text: str, content: str, calls: list[dict[str, Any]]) -> None:
    assert whole(name, text) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_char_by_char_equals_whole(
    name: str, text: str, content: str, calls: list[dict[str, Any]]
) -> None:
    _, result = run(name, list(text))
    assert result == (content, calls)
    _, in_one = run(name, [text])
    assert in_one == result


def test_streaming_shape() -> None:
    p = HermesParser(id_factory=fixed_id)
    assert p.feed("Hello") == [TextDelta("Hello")]  # ordinary text goes at once
    assert p.feed(" <tool") == []  # might be a marker: held
    assert p.feed('_call>{"name": "f", ') == []
    out = p.feed('"arguments": {"a": 1}}</tool_call>')
    assert out == [ToolCallDelta(0, "call_test", "f", '{"a": 1}')]
    assert p.finish() == []


def test_held_text_is_released_when_not_a_marker() -> None:
    p = HermesParser()
    assert p.feed("a <tool") == [TextDelta("a")]
    assert p.feed("box> b") == [TextDelta(" <toolbox> b")]
    assert p.finish() == []


def test_trailing_whitespace_kept_without_calls() -> None:
    assert whole("hermes", "text\n\n") == ("text\n\n", [])
    assert whole("mistral", "text \n") == ("text \n", [])


def test_indices_count_across_markers() -> None:
    deltas, _ = run(
        "hermes",
        [
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        ],
    )
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert [(c.index, c.name) for c in calls] == [(0, "a"), (1, "b")]


def test_default_ids_are_unique() -> None:
    _, calls = HermesParser().parse_complete(
        '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    )
    ids = [c["id"] for c in calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize(
    ("name", "family", "cls"),
    [
        (None, "chatml", HermesParser),
        (None, "gemma", HermesParser),
        (None, "phi3", HermesParser),
        (None, "llama3", Llama3Parser),
        (None, "mistral", MistralParser),
        (None, "somethingelse", HermesParser),
        ("none", "llama3", NoToolParser),
        ("mistral", "chatml", MistralParser),
    ],
)
def test_parser_for(name: str | None, family: str, cls: type) -> None:
    assert type(parser_for(name, family)) is cls


def test_parser_for_unknown_name() -> None:
    with pytest.raises(ValueError, match="hermes, llama3, mistral, none"):
        parser_for("pythonic", "chatml")


PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[ARGS]",
        '{"name": "f", "arguments": {"a": 1}}',
        '{"name": "g", "parameters": {}}',
        "[",
        "]",
        "{",
        "}",
        '"',
        ";",
        ",",
        "\n",
        " ",
        "<",
        "name",
        "<tool",
        "[TOOL",
    ]
)
TEXTS = st.lists(st.one_of(PIECES, st.text(max_size=8)), max_size=20).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
@pytest.mark.parametrize("name", PARSERS)
def test_fuzz_never_raises_and_chunking_does_not_matter(
    name: str, text: str, cuts: list[int]
) -> None:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    _, streamed = run(name, chunks)
    assert streamed == whole(name, text)
    content, calls = streamed
    for c in calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
        assert c["function"]["name"]
    if not calls:
        # without calls, nothing is lost: the text comes back as it was
        assert content == text

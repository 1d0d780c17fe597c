"""Tool call parsing: formats, streaming equals whole, malformed input, fuzzing."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.head.prompt import tools
from engine.head.prompt.tools import (
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
from tests.unit import tools_reference


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


# -- the same answers as before, in linear work ------------------------------------------


def reference(name: str, chunks: list[str]) -> tuple[str, list[dict[str, Any]]]:
    p = tools_reference.parser_for(name, "chatml", id_factory=fixed_id)
    deltas: list[Any] = []
    for c in chunks:
        deltas += p.feed(c)
    deltas += p.finish()
    return tools_reference.collect(deltas)


MORE_PIECES = st.sampled_from(
    ["[TOOL_CALLS]", "[ARGS]", "[ARG", "get_w", "\\", '\\"', '"a]"', "{}", "[]", "  ", "\t",
     '{"name": "f"', ', "arguments": ', '"x"', "1", "]}", "}]", "?", "<|python", "_tag|>",
     "</tool_call", ">", '{"id": "abc123def", "name": "g", "arguments": {}}',
     # whole calls, so that random text lands before, after and inside real ones
     '[TOOL_CALLS]get_w[ARGS]{"a": "]"}', "[TOOL_CALLS] g [ARGS] {}", "[TOOL_CALLS]g{}",
     '[TOOL_CALLS] [{"name": "f", "arguments": {"a": "\\\\"}}]', "[TOOL_CALLS]g [AR",
     '[TOOL_CALLS]f[ARGS]{"a": "\\"}"}',
     '<tool_call>{"name": "f"}</tool_call>', '<|python_tag|>{"name": "f", "parameters": {}}'])
MORE_TEXTS = st.lists(st.one_of(PIECES, MORE_PIECES, st.text(max_size=4)), max_size=24).map(
    "".join)


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(TEXTS, MORE_TEXTS),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_same_content_and_calls_as_the_reference(name: str, text: str, cuts: list[int]) -> None:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    expected = reference(name, [text])
    assert run(name, chunks)[1] == expected
    assert run(name, list(text))[1] == expected


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_cases_agree_with_the_reference(
    name: str, text: str, content: str, calls: list[dict[str, Any]]
) -> None:
    assert reference(name, list(text)) == (content, calls)


class CountingDecoder(json.JSONDecoder):
    """Counts the characters handed to ``raw_decode`` (what it may have to read)."""

    def __init__(self) -> None:
        super().__init__()
        self.chars = 0

    def raw_decode(self, s: str, idx: int = 0) -> tuple[Any, int]:
        self.chars += len(s) - idx
        return super().raw_decode(s, idx)


N = 20_000
ARRAY = "[" + ", ".join(["[1]"] * N) + "]"
LONG_OUTPUTS = [
    # parser, output with a bracket every few characters, chunk size
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": ' + ARRAY + "}}]", 3),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ' + ARRAY + "}", 2),
    ("mistral", "[TOOL_CALLS] [" + "[1], " * N + "oops", 4),  # never closes
    ("mistral", "[TOOL_CALLS]" + "name" * N + " x" + "]" * N, 3),  # never a call
    ("mistral", "[TOOL_CALLS]" + " " * N + '[{"name": "f"}]' + "}" * N, 3),
    ("mistral", "[TOOL_CALLS]f[ARGS]{} " * (N // 4), 5),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + ARRAY + "}}</tool_call>", 3),
    ("hermes", "<tool_call>" + "</tool_cal" * N, 4),
    ("llama3", " " * N + '{ "name": "f", "parameters": {"a": ' + ARRAY + "}}", 3),
    ("llama3", "{" + " " * N + '"name": "f", "parameters": {}}', 2),
    ("llama3", "<|python_tag|>" + ARRAY, 3),
]


@pytest.mark.parametrize("whole_text", [False, True])  # small chunks, or all in one
@pytest.mark.parametrize(("name", "text", "size"), LONG_OUTPUTS)
def test_parser_work_is_linear(monkeypatch: pytest.MonkeyPatch, name: str, text: str,
                               size: int, whole_text: bool) -> None:
    size = len(text) if whole_text else size
    decoder = CountingDecoder()
    monkeypatch.setattr(tools, "_DECODER", decoder)
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    p = parser_for(name, "chatml", id_factory=fixed_id)
    deltas: list[Delta] = []
    for c in chunks:
        deltas += p.feed(c)
    deltas += p.finish()
    # the buffered call is decoded once (a run of calls: each once), never re-read
    assert decoder.chars <= 2 * len(text)
    # a few looks per character, and a marker's length per chunk: never the buffer's
    assert p.steps <= 4 * len(text) + 2 * len("<|python_tag|>") * len(chunks)
    monkeypatch.undo()
    assert collect(deltas) == reference(name, [text])

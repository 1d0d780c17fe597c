"""Deeply nested input is refused cleanly by every decoder of outside input (no sockets).

Thousands of nested brackets make the C decoders (json, msgspec) and tomllib raise
RecursionError, which is not the ValueError their callers handle; a few hundred
levels decode but break code that walks the result later. Each decoder must refuse
both with its own error type, never let RecursionError out.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import nesting
from engine.api.schemas import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    OllamaChatRequest,
    OllamaGenerateRequest,
    decode_as,
    decode_chat,
)
from engine.api.turns import to_template_messages
from engine.config import ConfigError, parse_config
from engine.discovery.tailscale import TailscaleError, parse_status
from engine.head.access.keys import KeysError, load_policy, parse_revoked
from engine.head.naming import aliases as al
from engine.head.prompt.model import load_head_model
from engine.head.prompt.tools import PARSERS, parser_for
from engine.link import messages as m
from engine.link.connection import NEED_DATA, LinkConnection, LinkError, LinkErrorKind

DEEP = 5000  # far past Python's recursion limit of 1000


def deep_json(n: int = DEEP) -> str:
    return "[" * n + "]" * n


def nested_list(n: int) -> Any:
    value: Any = []
    for _ in range(n - 1):
        value = [value]
    return value


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def with_raw(body: dict[str, Any], key: str, raw: str) -> bytes:
    """``body`` as JSON with ``"key": raw`` spliced in verbatim (raw may be any depth)."""
    text = json.dumps(body)
    return (text[:-1] + f', "{key}": {raw}}}').encode()


# -- the helper ------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, nesting.MAX_DEPTH - 1, nesting.MAX_DEPTH])
def test_check_depth_accepts_up_to_the_limit(depth: int) -> None:
    nesting.check_depth(nested_list(depth))
    if depth > 3:
        nesting.check_depth({"a": [{"b": nested_list(depth - 3)}]})
    assert nesting.json_loads(deep_json(depth)) == nested_list(depth)


@pytest.mark.parametrize("depth", [nesting.MAX_DEPTH + 1, 900, 50_000])
def test_check_depth_refuses_past_the_limit(depth: int) -> None:
    # built without recursion, walked without recursion: 50 000 levels do not overflow
    with pytest.raises(nesting.TooDeep, match=f"deeper than {nesting.MAX_DEPTH} levels"):
        nesting.check_depth(nested_list(depth))


def test_depth_counts_objects_lists_and_tuples_alike() -> None:
    value: Any = 0
    for i in range(nesting.MAX_DEPTH):
        value = {"k": value} if i % 3 == 0 else [value] if i % 3 == 1 else ("t", value)
    nesting.check_depth(value)
    with pytest.raises(nesting.TooDeep):
        nesting.check_depth([value])


def test_wide_is_not_deep() -> None:
    nesting.check_depth([[[]] * 100_000, {str(i): [] for i in range(1000)}])


TRICKY = st.text(alphabet='[]{}"\\/ au\u00e9\u2713\n', max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
    max_leaves=30)


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


@settings(max_examples=500, deadline=None)
@given(value=JSON_VALUES, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_json_depth_reads_brackets_outside_strings_only(value: Any, ascii_only: bool,
                                                        indent: int | None) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert nesting.json_depth(text) == depth_of(value)
    assert nesting.json_depth(text.encode()) == depth_of(value)


def test_deep_unknown_fields_count_too() -> None:
    # measured on the text, before msgspec skips the field it does not know
    with pytest.raises(BadRequest, match="deeper than"):
        decode_chat(with_raw(chat_body(), "unknown", deep_json(nesting.MAX_DEPTH)))
    assert decode_chat(with_raw(chat_body(), "unknown", deep_json(nesting.MAX_DEPTH - 1)))


@pytest.mark.parametrize("text", [deep_json(), '{"a": ' * DEEP + "1" + "}" * DEEP,
                                  deep_json(nesting.MAX_DEPTH + 1)])
def test_json_loads_raises_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="deeper than"):
        nesting.json_loads(text)
    with pytest.raises(ValueError, match="deeper than"):
        nesting.json_loads(text.encode())


def test_toml_loads_raises_a_value_error() -> None:
    with pytest.raises(ValueError, match="deeper than"):
        nesting.toml_loads("a = " + deep_json())
    assert nesting.toml_loads("a = [[1]]") == {"a": [[1]]}


# -- the HTTP request bodies ----------------------------------------------------------------


@pytest.mark.parametrize("key", ["tools", "tool_choice", "response_format", "unknown_field",
                                 "chat_template_kwargs", "messages", "stop", "model"])
def test_decode_chat_refuses_very_deep_bodies(key: str) -> None:
    # past the recursion limit, whatever the field: typed, free-form or unknown
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    body.pop(key, None)
    with pytest.raises(BadRequest) as info:
        decode_chat(with_raw(body, key, deep_json()))
    assert "\n" not in str(info.value)
    with pytest.raises(BadRequest):
        decode_chat(deep_json().encode())


@pytest.mark.parametrize("raw", [
    deep_json(nesting.MAX_DEPTH),  # tool_choice: 1 level for the body + 128
    '{"a": ' + deep_json(nesting.MAX_DEPTH - 1) + "}",
])
def test_decode_chat_refuses_free_form_fields_past_the_limit(raw: str) -> None:
    # under the recursion limit msgspec decodes it; the head would then walk it
    with pytest.raises(BadRequest, match=f"deeper than {nesting.MAX_DEPTH} levels"):
        decode_chat(with_raw(chat_body(), "tool_choice", raw))
    shallower = raw.replace("[", "", 1).replace("]", "", 1)
    assert decode_chat(with_raw(chat_body(), "tool_choice", shallower)).tool_choice


def test_decode_chat_refuses_deep_tool_schemas_and_message_parts() -> None:
    schema = '{"type": "object", "properties": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}"
    tool = '[{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}]"
    with pytest.raises(BadRequest, match=f"deeper than {nesting.MAX_DEPTH} levels"):
        decode_chat(with_raw(chat_body(), "tools", tool))
    body = '{"model": "m", "messages": [{"role": "user", "content": [' + deep_json() + "]}]}"
    with pytest.raises(BadRequest, match="deeper than"):
        decode_chat(body.encode())


def test_decode_chat_keeps_ordinary_nesting() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters":
                                               {"type": "object", "properties": {
                                                   "a": {"type": "array", "items": nested_list(
                                                       nesting.MAX_DEPTH - 8)}}}}}]
    req = decode_chat(json.dumps(chat_body(tools=tools)).encode())
    assert req.tools == tools


@pytest.mark.parametrize("kind", [CompletionRequest, OllamaChatRequest, OllamaGenerateRequest,
                                  ChatRequest])
@pytest.mark.parametrize("key", ["format", "extra", "tools"])
def test_decode_as_refuses_deep_bodies(kind: type[Any], key: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    raw = '[{"a": ' + deep_json() + "}]" if key == "tools" else deep_json()
    with pytest.raises(BadRequest, match="deeper than"):
        decode_as(kind, with_raw(body, key, raw))
    with pytest.raises(BadRequest):
        decode_as(kind, deep_json().encode())


def test_ollama_tool_call_arguments_as_an_object_are_bounded() -> None:
    args = '{"a": ' * (nesting.MAX_DEPTH) + "1" + "}" * (nesting.MAX_DEPTH)
    body = ('{"model": "m", "messages": [{"role": "assistant", "tool_calls": '
            '[{"function": {"name": "f", "arguments": ' + args + "}}]}]}")
    with pytest.raises(BadRequest, match="deeper than"):
        decode_as(OllamaChatRequest, body.encode())


def test_tool_call_arguments_string_does_not_break_the_template() -> None:
    # arguments arrive as a JSON string: the head parses it to render the template
    req = decode_chat(json.dumps(chat_body(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": deep_json()}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])).encode())
    messages = to_template_messages(req)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == deep_json()
    model = load_head_model("mock", "mock-m", name="mock-m")
    assert model.render(messages, tools=None)  # the template gets the text as given


# -- the link ------------------------------------------------------------------------------

_DEEP_MSGPACK = b"\x91" * DEEP + b"\x00"  # DEEP nested one-element arrays around 0


@pytest.mark.parametrize("data", [
    b"\x93\xa4ping\x01" + _DEEP_MSGPACK,  # an extra trailing field, skipped by msgspec
    b"\x92\xa4ping" + _DEEP_MSGPACK,
    _DEEP_MSGPACK,
    b"\x95\xa5stats\x01\x00\x00\x00" + b"\x94\x00\x00\x00" + _DEEP_MSGPACK,
])
def test_link_decode_refuses_deep_records(data: bytes) -> None:
    with pytest.raises(m.RecordError, match="bad record from peer"):
        m.decode(data)


def test_link_connection_fails_on_a_deep_record() -> None:
    conn = LinkConnection(initiator=False, psk=None)
    body = b"\x93\xa4ping\x01" + _DEEP_MSGPACK
    conn.receive_data(struct.pack(">H", 0))  # the plaintext dialer's marker
    conn.next_event()
    stream = struct.pack(">I", len(body)) + body
    for i in range(0, len(stream), 60_000):
        chunk = stream[i:i + 60_000]
        conn.receive_data(struct.pack(">H", len(chunk)) + chunk)
    with pytest.raises(LinkError) as info:
        while conn.next_event() is not NEED_DATA:
            pass
    assert info.value.kind is LinkErrorKind.PROTOCOL
    assert "bad record from peer" in str(info.value)


# -- alias tables, key files, config, tailscaled ------------------------------------------


def test_alias_table_from_json_refuses_deep_tables() -> None:
    doc = '{"format": "' + al.FORMAT + '", "version": 1, "aliases": ' + deep_json() + "}"
    for text in (doc, deep_json()):
        with pytest.raises(al.AliasError, match="deeper than"):
            al.AliasTable.from_json(text, source="head h1")


def test_key_files_refuse_deep_documents(tmp_path: Path) -> None:
    with pytest.raises(KeysError, match="deeper than"):
        parse_revoked(deep_json())
    for name, text in (("policy.toml", "a = " + deep_json()), ("policy.json", deep_json())):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(KeysError, match="deeper than"):
            load_policy(path)


def test_config_refuses_deep_toml() -> None:
    with pytest.raises(ConfigError, match="deeper than"):
        parse_config("[discovery]\nseeds = " + deep_json(), source="config.toml")


def test_tailscale_status_refuses_deep_json() -> None:
    with pytest.raises(TailscaleError):
        parse_status(('{"BackendState": "Running", "Peer": ' + deep_json() + "}").encode())


# -- model output -------------------------------------------------------------------------


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("text", [
    "<tool_call>" + deep_json() + "</tool_call>",
    '<tool_call>{"name": "f", "arguments": ' + deep_json() + "}</tool_call>",
    '<tool_call>{"name": "f", "arguments": "' + deep_json() + '"}</tool_call>',
    "<|python_tag|>" + deep_json(),
    '{"name": "f", "parameters": ' + deep_json() + "}",
    "[TOOL_CALLS] " + deep_json(),
    '[TOOL_CALLS] [{"name": "f", "arguments": ' + deep_json() + "}]",
    "[TOOL_CALLS]f[ARGS]" + "{" + '"a": {' * DEEP + "}" * DEEP + "}",
])
def test_parsers_give_deep_output_back_as_text(name: str, text: str) -> None:
    parser = parser_for(name, "chatml")
    content, calls = parser.parse_complete(text)
    assert (content, calls) == (text, [])
    streamed = parser_for(name, "chatml")
    out = []
    for i in range(0, len(text), 7):
        out += streamed.feed(text[i:i + 7])
    out += streamed.finish()
    assert "".join(getattr(d, "text", "") for d in out) == text

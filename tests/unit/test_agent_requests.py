"""The agents' request bodies in the head's terms, without sockets: Anthropic Messages and
the Responses API as template messages, tools and tool choice; Chat Completions'
tool choice; conversation keys and the placement hints they give; and every request the
real agents sent (tests/fixtures/agents), through the same decoders and templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from hypothesis import given
from hypothesis import strategies as st

from engine.api import anthropic, responses
from engine.api.context import conversation_key, conversation_of, routing_of
from engine.api.schemas import (
    AnthropicRequest,
    ResponsesRequest,
    decode_as,
    decode_chat,
    unsupported,
)
from engine.api.turns import (
    BadField,
    Chat,
    openai_tool_choice,
    to_template_messages,
    tool_names,
)
from engine.head.prompt.templates import ChatTemplate, builtin_template
from engine.head.prompt.turn import Routing, ToolChoice
from tests.agent_fixtures import fixture_files, hosted_tools, load, offered_tools, tool_results

TOOL = {"name": "get_weather", "description": "the weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
FUNCTION = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                             "parameters": TOOL["input_schema"]}}


def messages_request(**body: Any) -> AnthropicRequest:
    result: AnthropicRequest = decode_as(AnthropicRequest, json.dumps(
        {"model": "m", "max_tokens": 8, **body}).encode())
    return result


def responses_request(**body: Any) -> ResponsesRequest:
    result: ResponsesRequest = decode_as(ResponsesRequest, json.dumps(
        {"model": "m", **body}).encode())
    return result


# -- Anthropic Messages ----------------------------------------------------------------


def test_anthropic_turns_become_template_messages():
    req = messages_request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "down",
                 "is_error": True},
                {"type": "text", "text": "Thanks."}]}])
    chat = anthropic.to_chat(req)
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "toolu_9", "content": "Error: down"},
        {"role": "user", "content": "Thanks."}]
    assert chat.tools == [FUNCTION]
    assert chat.choice == ToolChoice() and chat.prefill == "" and chat.parallel


def test_anthropic_final_assistant_turn_is_the_answers_beginning():
    chat = anthropic.to_chat(messages_request(messages=[
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}]))
    assert chat.prefill == "Hi"
    assert chat.messages == [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "auto"}, ToolChoice(), True),
    ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice(), False),
    ({"type": "none"}, ToolChoice("none"), True),
    ({"type": "any"}, ToolChoice("required"), True),
    ({"type": "tool", "name": "get_weather"}, ToolChoice("required", "get_weather"), True),
])
def test_anthropic_tool_choice(choice: dict[str, Any], expected: ToolChoice, parallel: bool):
    chat = anthropic.to_chat(messages_request(
        tools=[TOOL], tool_choice=choice, messages=[{"role": "user", "content": "x"}]))
    assert chat.choice == expected and chat.parallel is parallel


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "aGk="}}]}]},
     "messages[0].content[0]: image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "document blocks are not supported"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {}}]}]}]},
     "messages[0].content[0]: image blocks"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "content blocks of type 'tool_use' are not supported"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
     "needs an id, a name and an input object"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "needs the tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "server_tool_use"}]}]},
     "'server_tool_use' are not supported"),
    ({"system": [{"type": "image"}], "messages": [{"role": "user", "content": "x"}]},
     "system: image blocks"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "x"}]}, "server tool"),
    ({"tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]},
     "offers no tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"},
      "messages": [{"role": "user", "content": "x"}]}, "needs the tool's name"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"},
      "messages": [{"role": "user", "content": "x"}]}, "'other', which is not among"),
])
def test_anthropic_refusals_name_the_block(body: dict[str, Any], words: str):
    with pytest.raises(BadField) as err:
        anthropic.to_chat(messages_request(**body))
    assert words in str(err.value)


# -- Responses -------------------------------------------------------------------------


def test_responses_items_become_template_messages():
    req = responses_request(
        instructions="Be brief.", tools=[{"type": "function", "name": "get_weather",
                                          "description": "the weather",
                                          "parameters": TOOL["input_schema"]}],
        input=[{"role": "developer", "content": "Use tools."},
               {"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
               {"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Looking."}]},
               {"type": "function_call", "call_id": "c1", "name": "get_weather",
                "arguments": '{"city": "Paris"}'},
               {"type": "function_call", "call_id": "c2", "name": "get_weather",
                "arguments": "not json"},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
               {"type": "function_call_output", "call_id": "c2",
                "output": [{"type": "input_text", "text": "?"}]}],
        parallel_tool_calls=False)
    chat = responses.to_chat(req)
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {**call, "id": "c1", "function": {**call["function"],
                                              "arguments": {"city": "Paris"}}},
            {**call, "id": "c2", "function": {**call["function"], "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "?", "name": "get_weather"}]
    assert chat.tools == [FUNCTION] and chat.parallel is False
    plain = responses.to_chat(responses_request(input="Hello"))
    assert plain.messages == [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(("choice", "expected"), [
    ("auto", ToolChoice()), ("none", ToolChoice("none")),
    ("required", ToolChoice("required")),
    ({"type": "function", "name": "get_weather"}, ToolChoice("required", "get_weather")),
    ({"type": "allowed_tools", "mode": "auto", "tools": []}, ToolChoice()),
])
def test_responses_tool_choice(choice: Any, expected: ToolChoice):
    req = responses_request(input="x", tool_choice=choice, tools=[
        {"type": "function", "name": "get_weather", "parameters": {}}])
    assert responses.to_chat(req).choice == expected


@pytest.mark.parametrize(("body", "words"), [
    ({"previous_response_id": "resp_1"}, "keeps no responses"),
    ({"conversation": "conv_1"}, "keeps no conversations"),
    ({"background": True}, "background responses are not supported"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "keeps none"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]},
     "'computer_call_output' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]: file input is not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role is user, assistant"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "needs its call_id and name"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "needs the call_id"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]},
     "tools of type 'custom' are not supported"),
    ({"tools": [{"type": "namespace", "name": "ns"}]}, "a namespace tool needs"),
    ({"tools": [{"type": "function"}]}, "a function tool needs a name"),
    ({"tool_choice": "sometimes"}, "tool_choice must be"),
    ({"input": "", "instructions": "Be brief."}, "input is empty"),
])
def test_responses_refusals_name_the_field(body: dict[str, Any], words: str):
    with pytest.raises(BadField) as err:
        responses.to_chat(responses_request(**{"input": "x", **body}))
    assert words in str(err.value)


def test_chat_completions_tool_choice():
    assert openai_tool_choice(None, None) == ToolChoice()
    assert openai_tool_choice("none", [FUNCTION]) == ToolChoice("none")
    assert openai_tool_choice("required", [FUNCTION]) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert openai_tool_choice(named, [FUNCTION]) == ToolChoice("required", "get_weather")
    for bad in ("always", {"type": "function"}, 3):
        with pytest.raises(BadField):
            openai_tool_choice(bad, [FUNCTION])
    with pytest.raises(BadField):
        openai_tool_choice("required", None)


# -- conversation keys -------------------------------------------------------------------


def convo(system: str, *users: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, text in enumerate(users):
        out += [{"role": "user", "content": text}, {"role": "assistant", "content": f"a{i}"}]
    return out


def test_a_conversation_keeps_its_key_as_it_grows():
    first = conversation_key(convo("You code.", "Fix it."))
    assert first is not None and first.startswith("conv-")
    assert conversation_key(convo("You code.", "Fix it.", "More.", "Done?")) == first
    assert conversation_key([*convo("You code.", "Fix it."),
                             {"role": "tool", "content": "ok", "tool_call_id": "c"}]) == first
    # another system prompt, first turn or key: another conversation
    assert conversation_key(convo("You test.", "Fix it.")) != first
    assert conversation_key(convo("You code.", "Fix that.")) != first
    assert conversation_key(convo("You code.", "Fix it."), "alice") != first
    assert conversation_key([{"role": "system", "content": "only"}]) is None


def routing(messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
            cache_key: str | None = None) -> Routing:
    request = make_mocked_request("POST", "/v1/messages", headers=headers or {})
    return routing_of(request, conversation_of(messages) if messages else None,
                      cache_key=cache_key)


def test_a_derived_key_steers_the_later_turns_only():
    opening = [{"role": "system", "content": "You code."}, {"role": "user", "content": "Go."}]
    first = routing(opening)
    assert first.affinity == conversation_key(opening) and first.first_turn
    later = routing([*opening, {"role": "assistant", "content": "Done."},
                     {"role": "user", "content": "More."}])
    assert later.affinity == first.affinity and not later.first_turn
    tool = routing([*opening, {"role": "tool", "content": "ok", "tool_call_id": "c"}])
    assert not tool.first_turn
    # a key the client chose steers from the first turn on
    sent = routing(opening, {"X-Session-Id": "agent-7"})
    assert sent.affinity == "agent-7" and not sent.first_turn
    cached = routing(opening, cache_key="repo-1")
    assert cached.affinity == "key--repo-1" and not cached.first_turn
    assert routing([]).affinity is None


@given(st.text(max_size=8), st.text(max_size=8), st.text(max_size=8), st.text(max_size=8))
def test_conversation_keys_never_run_their_parts_together(a: str, b: str, c: str, d: str):
    if (a, b) != (c, d):
        assert conversation_key(convo(a, b)) != conversation_key(convo(c, d))


# -- the requests the real agents sent (tests/fixtures/agents, recorded by
# tests/integration/test_real_agents.py) -----------------------------------------------

AGENT_FIXTURES = fixture_files()
BILLING_LINE = "x-anthropic-billing-header:"


def fixture_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def decode_fixture(path: str, body: dict[str, Any]) -> Chat:
    """A recorded body through the decoders of the route it was sent to, as the head's
    route takes it (BadField or BadRequest when the head would answer 400)."""
    raw = json.dumps(body).encode()
    if path == "/v1/messages":
        return anthropic.to_chat(decode_as(AnthropicRequest, raw))
    if path == "/v1/responses":
        return responses.to_chat(decode_as(ResponsesRequest, raw))
    assert path == "/v1/chat/completions", path
    req = decode_chat(raw)
    problem = unsupported(req)
    if problem is not None:
        raise BadField(problem, "")
    return Chat(messages=to_template_messages(req), tools=req.tools,
                choice=openai_tool_choice(req.tool_choice, req.tools))


def structured(body: dict[str, Any]) -> bool:
    """Claude Code's session-title request asks for a JSON schema (output_config.format),
    which the head refuses by name: the one request an agent sends that it may refuse."""
    return (body.get("output_config") or {}).get("format") is not None


def test_every_pinned_agent_has_recorded_requests():
    assert {p.parent.name.rsplit("-", 1)[0] for p in AGENT_FIXTURES} == \
        {"claude", "codex", "opencode", "cn", "aider", "pi", "cline", "kilo", "qwen"}


@pytest.mark.parametrize("path", AGENT_FIXTURES, ids=fixture_id)
def test_recorded_agent_request_decodes(path: Path):
    """Each request a real agent sent is taken (nothing refused), keeps its turns' roles,
    and offers the model every client tool the agent offered; tool results come back as
    tool messages. Claude Code and Codex need the decoding of issue 22: a system message
    inside ``messages``, Codex's namespace and hosted tools, and the billing-header line
    taken out of the prompt."""
    fx = load(path)
    route, body = fx["path"], fx["body"]
    if structured(body):
        with pytest.raises(BadField, match=r"^output_config\.format: structured output"):
            decode_fixture(route, body)
        return
    chat = decode_fixture(route, body)  # needs issue 22's decoding for Claude Code, Codex
    roles = [m["role"] for m in chat.messages]
    assert set(roles) <= {"system", "user", "assistant", "tool"} and "user" in roles
    assert roles[0] == "system"  # every agent sends its instructions first
    assert sorted(tool_names(chat.tools)) == sorted(offered_tools(route, body))
    if body.get("tools"):
        assert chat.choice == ToolChoice()  # the model decides
    results = tool_results(route, body)
    shown = [m["content"] for m in chat.messages if m["role"] == "tool"]
    assert len(shown) == len(results)
    assert all(r in s for r, s in zip(results, shown, strict=True))
    if route == "/v1/messages":
        # system messages inside `messages` stay system turns, where they stand
        inner = [m for m in body["messages"] if m["role"] == "system"]
        assert roles.count("system") == 1 + len(inner)
        assert all(BILLING_LINE not in str(m["content"]) for m in chat.messages)
    if route == "/v1/responses":
        # developer items are system turns; hosted tools are left out, not refused
        items = [i for i in body["input"] if i.get("type", "message") == "message"]
        assert roles.count("system") == bool(body.get("instructions")) + sum(
            i["role"] in ("system", "developer") for i in items)
        assert hosted_tools(body) == ["web_search"]
        assert "web_search" not in tool_names(chat.tools)
    if route == "/v1/chat/completions":
        assert roles == [m["role"] for m in body["messages"]]


@pytest.mark.parametrize("path", [p for p in AGENT_FIXTURES
                                  if not structured(load(p)["body"])], ids=fixture_id)
def test_recorded_agent_request_renders(path: Path):
    """The decoded request through a built-in ChatML template (which shows later system
    turns where they stand) and Gemma's (one system message: the others are folded): the
    prompt holds the agent's last turn and each tool result, and no billing line."""
    fx = load(path)
    chat = decode_fixture(fx["path"], fx["body"])
    last = next(m["content"] for m in reversed(chat.messages) if m["content"])
    for family in ("chatml", "gemma"):
        text = ChatTemplate(builtin_template(family), family=family).render(
            chat.messages, tools=chat.tools)
        assert last.strip()[-200:] in text, family
        assert BILLING_LINE not in text
        for result in tool_results(fx["path"], fx["body"]):
            assert result.strip() in text


def conversations() -> dict[str, list[Path]]:
    """Each recorded conversation's main turns (those that offer tools), by agent and
    test: the turn that called a tool, then the one that carried its result."""
    out: dict[str, list[Path]] = {}
    for path in AGENT_FIXTURES:
        body = load(path)["body"]
        if body.get("tools") and not structured(body):
            what = path.stem.split("-")[1]
            out.setdefault(f"{path.parent.name}/{what}", []).append(path)
    return {k: v for k, v in out.items() if len(v) > 1}


@pytest.mark.parametrize("paths", conversations().values(), ids=conversations().keys())
def test_a_recorded_conversation_keeps_one_affinity(paths: list[Path]):
    """An agent's turns of one conversation reach the node that holds its prompt cache:
    from its session header, its prompt_cache_key or, failing both, the conversation's
    own key (which the billing-header line must not change)."""
    keys = []
    for path in paths:
        fx = load(path)
        request = make_mocked_request("POST", fx["path"], headers=fx["headers"])
        chat = decode_fixture(fx["path"], fx["body"])
        keys.append(routing_of(request, conversation_of(chat.messages),
                               cache_key=fx["body"].get("prompt_cache_key")).affinity)
    assert keys[0] is not None and keys == [keys[0]] * len(keys)

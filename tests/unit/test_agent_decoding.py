"""What today's agents send beyond the SDKs' documented shapes, in the head's terms (no
sockets): Claude Code's system messages inside `messages`, its billing-header block and
the fields it adds; Codex's namespace and hosted tools. The recorded requests of the real
binaries are checked in tests/unit/test_agent_requests.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.api import anthropic, responses
from engine.api.context import conversation_key
from engine.api.schemas import AnthropicRequest, ResponsesRequest
from engine.api.turns import BadField
from engine.head.prompt.templates import ChatTemplate, builtin_template, fold_later_system
from engine.head.prompt.tools import ToolCallDelta
from tests.unit.test_agent_requests import messages_request
from tests.unit.test_agent_requests import responses_request as request_of

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;"
SHELL = {"type": "function", "name": "exec_command", "description": "run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "start a sub-agent",
         "parameters": {"type": "object", "properties": {}}}


def responses_request(**body: Any) -> ResponsesRequest:
    return request_of(**{"input": "hi", **body})


def claude_code(hash_: str, first: str) -> AnthropicRequest:
    """The shape of Claude Code 2.1.197's main request (its fields, not its size)."""
    return messages_request(
        system=[{"type": "text", "text": BILLING.format(hash_)},
                {"type": "text", "text": "You are a Claude agent.",
                 "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "You help with software engineering."}],
        messages=[{"role": "user", "content": [
                      {"type": "text", "text": "<system-reminder>date</system-reminder>"},
                      {"type": "text", "text": first, "cache_control": {"type": "ephemeral"}}]},
                  {"role": "system", "content": "Available agent types: claude, Explore."}],
        tools=[{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
        metadata={"user_id": "{\"session_id\": \"x\"}"}, thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"}, stream=True)


def test_claude_codes_request_is_taken_with_its_system_message_where_it_stands():
    chat = anthropic.to_chat(claude_code("111", "say hi"))
    assert [m["role"] for m in chat.messages] == ["system", "user", "system"]
    assert chat.messages[0]["content"] == ("You are a Claude agent.\n"
                                           "You help with software engineering.")
    assert chat.messages[2]["content"] == "Available agent types: claude, Explore."
    assert "billing" not in json.dumps(chat.messages)
    assert [t["function"]["name"] for t in chat.tools or []] == ["Bash"]


def test_two_conversations_share_the_system_prompt_and_a_conversation_its_key():
    a = anthropic.to_chat(claude_code("111", "say hi"))
    b = anthropic.to_chat(claude_code("222", "say hi"))
    c = anthropic.to_chat(claude_code("333", "list the files"))
    assert a.messages == b.messages  # the header was all that differed
    assert a.messages[0] == c.messages[0]  # another conversation: the same system prompt
    assert conversation_key(a.messages, "") == conversation_key(b.messages, "")


@pytest.mark.parametrize("field", [
    {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    {"output_format": {"type": "json_schema", "schema": {"type": "object"}}},
])
def test_a_structured_output_format_is_refused_by_name(field: dict[str, Any]):
    with pytest.raises(BadField) as err:
        anthropic.to_chat(messages_request(messages=[{"role": "user", "content": "hi"}],
                                           **field))
    assert "structured output" in str(err.value)
    assert err.value.param in ("output_config.format", "output_format")


def test_a_system_message_of_only_the_header_leaves_nothing():
    chat = anthropic.to_chat(messages_request(
        system=[{"type": "text", "text": BILLING.format("9")}],
        messages=[{"role": "user", "content": "hi"}]))
    assert chat.messages == [{"role": "user", "content": "hi"}]


# -- templates and system messages after the first turn ---------------------------------

CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "system", "content": "Agents: Explore."},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "more"}]
# a template that, like many in GGUF files, allows one system message only
ONE_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
              "{{ raise_exception('only the first message may be a system message') }}"
              "{% endif %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}")
DROPS = ("{% for m in messages %}{% if m.role != 'system' or loop.first %}"
         "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endif %}{% endfor %}")


def test_chatml_shows_a_later_system_message_as_a_system_turn_where_it_stands():
    text = ChatTemplate(builtin_template("chatml"), family="chatml").render(CONVO)
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>system\nAgents: Explore.<|im_end|>\n" \
        "<|im_start|>assistant\nHello." in text


@pytest.mark.parametrize("source", [ONE_SYSTEM, DROPS], ids=["refuses", "drops"])
def test_a_template_with_one_system_message_gets_it_folded_into_the_user_turn(source: str):
    text = ChatTemplate(source, family="chatml").render(CONVO, add_generation_prompt=False)
    assert text == ("<system>Be brief.</system><user>hi\n\nAgents: Explore.</user>"
                    "<assistant>Hello.</assistant><user>more</user>")


def test_folding_keeps_the_earlier_turns_as_the_conversation_grows():
    first = fold_later_system([dict(m) for m in CONVO[:3]], [2])
    later = fold_later_system([dict(m) for m in CONVO], [2])
    assert later[:len(first)] == first
    # a system message right before a user turn goes into that turn
    assert fold_later_system([{"role": "system", "content": "S"},
                              {"role": "system", "content": "T"},
                              {"role": "user", "content": "u"}], [1]) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "T\n\nu"}]
    # between two assistant turns, with no user turn beside it: a user turn of its own
    assert fold_later_system([{"role": "assistant", "content": "a"},
                              {"role": "system", "content": "T"},
                              {"role": "assistant", "content": "b"}], [1])[1] == \
        {"role": "user", "content": "T"}


# -- Codex: namespace and hosted tools --------------------------------------------------

CODEX_TOOLS = [SHELL, {"type": "namespace", "name": "multi_agent_v1",
                       "description": "sub-agents", "tools": [SPAWN]},
               {"type": "web_search", "external_web_access": False}]


def test_namespace_tools_are_offered_as_their_functions_and_hosted_ones_left_out():
    chat, tools = responses.convert(responses_request(
        input=[{"type": "message", "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}]},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "hi"}]}],
        tools=CODEX_TOOLS, include=["reasoning.encrypted_content"], store=False,
        reasoning={"summary": "auto"}, parallel_tool_calls=True, prompt_cache_key="k1"))
    assert [m["role"] for m in chat.messages] == ["system", "user"]
    assert [t["function"]["name"] for t in chat.tools or []] == ["exec_command", "spawn_agent"]
    assert tools.called("spawn_agent") == ("multi_agent_v1", "spawn_agent")
    assert tools.called("exec_command") == (None, "exec_command")
    # what the response says it offered: no web search, the namespace as it was sent
    assert [t["type"] for t in tools.shown] == ["function", "namespace"]
    assert "web_search" not in json.dumps(tools.shown)


def test_a_call_of_a_namespaced_tool_goes_back_with_its_namespace():
    req = responses_request(tools=CODEX_TOOLS)
    _chat, tools = responses.convert(req)
    out = responses._Output("resp_abc", req, tools, True)
    out.feed(ToolCallDelta(index=0, id="call_1", name="spawn_agent", arguments_fragment="{}"))
    item = out.items[0]
    assert item["type"] == "function_call" and item["name"] == "spawn_agent"
    assert item["namespace"] == "multi_agent_v1"
    assert "web_search" not in json.dumps(out.response("completed"))


def test_earlier_calls_of_namespaced_tools_keep_the_name_the_model_knows():
    # spawn_agent is also a top-level function here: the namespace's one is qualified
    chat, tools = responses.convert(responses_request(
        tools=[SPAWN, {"type": "namespace", "name": "multi_agent_v1", "tools": [SPAWN]}],
        input=[{"type": "message", "role": "user", "content": "go"},
               {"type": "function_call", "call_id": "c1", "name": "spawn_agent",
                "namespace": "multi_agent_v1", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "started"}]))
    names = [t["function"]["name"] for t in chat.tools or []]
    assert names == ["spawn_agent", "multi_agent_v1.spawn_agent"]
    assert chat.messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1.spawn_agent"
    assert tools.called("multi_agent_v1.spawn_agent") == ("multi_agent_v1", "spawn_agent")


def test_namespaces_are_counted_before_their_functions_are_built():
    many = [{"type": "namespace", "name": f"ns{i}", "tools": [SPAWN] * 100} for i in range(6)]
    with pytest.raises(BadField) as err:
        responses.convert(responses_request(tools=many))
    assert "600 functions offered, at most 512" in str(err.value)

"""A node killed mid-stream under an agent's route: the stream the real SDK reads goes on
from another node, with no text twice and none missing (a head and mock nodes as
processes; the SDKs run in a worker thread, as a client program would)."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from tests.integration.conftest import Cluster, Proc
from tests.integration.test_fleet import url, wait_ready

pytestmark = pytest.mark.timeout(180)
MODEL = "mock-m"
KILL_AT = 60  # text deltas read before the node serving the stream is killed
STORY = "tell me a very long story"  # greedy on the mock: 240 tokens, no end before


def kill_serving_node(head: Proc, nodes: list[Proc]) -> Proc:
    """SIGKILL the node that runs this head's only session now."""
    with urllib.request.urlopen(url(head, "/v1/fleet"), timeout=10) as r:
        state = json.load(r)
    busy = [n for n in state["nodes"] if n["own_sessions"] > 0]
    assert len(busy) == 1, state
    victim = next(p for p in nodes if p.address == busy[0]["address"])
    victim.signal(signal.SIGKILL)
    return victim


def messages_stream(head: Proc, on_delta: Callable[[int], None], *, model: str = MODEL,
                    prompt: str = STORY, max_tokens: int = 240) -> tuple[list[str], Any]:
    """Anthropic's ``messages.stream``: the text deltas as they came, and the final
    message."""
    with anthropic.Anthropic(base_url=url(head, ""), api_key="unused",
                             max_retries=0) as client, \
            client.messages.stream(model=model, max_tokens=max_tokens,
                                   extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": prompt}]) as stream:
        parts = []
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                parts.append(event.delta.text)
                on_delta(len(parts))
        return parts, stream.get_final_message()


def responses_stream(head: Proc, on_delta: Callable[[int], None], *, model: str = MODEL,
                     prompt: str = STORY, max_tokens: int = 240) -> tuple[list[str], Any]:
    """The Responses API's ``responses.stream``: the text deltas as they came, and
    the response its last event carries (completed, or incomplete at the token limit)."""
    with openai.OpenAI(base_url=url(head, "/v1"), api_key="unused", max_retries=0) as client, \
            client.responses.stream(model=model, input=prompt, max_output_tokens=max_tokens,
                                    temperature=0) as stream:
        parts, last = [], None
        for event in stream:
            if event.type == "response.output_text.delta":
                parts.append(event.delta)
                on_delta(len(parts))
            last = event
        assert last is not None and last.type in ("response.completed", "response.incomplete")
        return parts, last.response


async def _kill_mid_stream(cluster: Cluster,
                           read: Callable[[Proc, Callable[[int], None]], tuple[list[str], Any]]
                           ) -> tuple[Any, Any]:
    cluster.token()
    nodes = [cluster.node(f"n{i}", speed=150.0) for i in range(3)]
    head = cluster.head(nodes)
    await wait_ready(head, 3)
    ref_parts, ref_final = await asyncio.to_thread(read, head, lambda n: None)
    reference = "".join(ref_parts)
    assert len(reference) > 100
    victims: list[Proc] = []

    def on_delta(n: int) -> None:
        if n == KILL_AT and not victims:
            victims.append(kill_serving_node(head, nodes))

    parts, final = await asyncio.to_thread(read, head, on_delta)
    text = "".join(parts)
    assert victims, "the stream ended before the node could be killed"
    assert text == reference  # nothing twice, nothing missing
    assert "moved from" in head.log_text()
    return ref_final, final


async def test_anthropic_stream_survives_a_node_kill(cluster: Cluster):
    reference, final = await _kill_mid_stream(cluster, messages_stream)
    assert final.content[0].text == reference.content[0].text
    assert final.stop_reason == reference.stop_reason
    assert final.usage.output_tokens == reference.usage.output_tokens == \
        len(reference.content[0].text)


async def test_responses_stream_survives_a_node_kill(cluster: Cluster):
    reference, final = await _kill_mid_stream(cluster, responses_stream)
    assert final.output_text == reference.output_text
    assert final.status == reference.status
    assert final.usage.output_tokens == reference.usage.output_tokens == \
        len(reference.output_text)

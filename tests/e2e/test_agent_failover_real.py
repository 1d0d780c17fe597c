"""A real SmolLM2 node killed mid-stream under the agents' routes: the stream that the
`anthropic` SDK (``messages.stream``) or the `openai` SDK (``responses.stream``) reads
goes on from the other node, with no token twice and none missing.

What the head delivered before the kill is the reference's greedy text, token for token.
What the next node writes after it may part from the reference: llama.cpp reads the
moved context in one batch where the first node had decoded it a token at a time, and
its sums round differently, enough to flip a near tie later on. So the seam is checked
where the head made it (the "after N tokens" of its log), not by equal whole texts.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_fleet_real import NAME, real_head, real_node
from tests.integration.conftest import Cluster, Proc
from tests.integration.test_agent_failover import (
    kill_serving_node,
    messages_stream,
    responses_stream,
)
from tests.integration.test_fleet import wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.processes,
              pytest.mark.timeout(300)]
PROMPT = "Tell me about the history of the bicycle."
MAX_TOKENS = 80
KILL_AT = 30  # text deltas read before the node serving the stream is killed

Read = Callable[..., tuple[list[str], Any]]


async def kill_mid_stream(cluster: Cluster, gguf: Path, read: Read
                          ) -> tuple[list[str], Any, list[str], Any]:
    """The reference stream's deltas and final object, then the killed stream's."""
    cluster.token()
    nodes = [real_node(cluster, gguf, f"k{i}", lanes=1) for i in range(2)]
    head = real_head(cluster, gguf, nodes)
    await wait_ready(head, 2)

    def stream(on_delta: Callable[[int], None]) -> tuple[list[str], Any]:
        return read(head, on_delta, model=NAME, prompt=PROMPT, max_tokens=MAX_TOKENS)

    reference, ref_final = await asyncio.to_thread(stream, lambda n: None)
    victims: list[Proc] = []

    def on_delta(n: int) -> None:
        if n == KILL_AT and not victims:
            victims.append(kill_serving_node(head, nodes))

    parts, final = await asyncio.to_thread(stream, on_delta)
    assert victims, f"the stream ended before {KILL_AT} deltas: {reference!r}"
    moved = re.search(r"moved from .* after (\d+) tokens", head.log_text())
    assert moved, head.log_text()
    at = int(moved.group(1))
    assert KILL_AT <= at < MAX_TOKENS
    # one text delta per token, but for a node or head whose loop lagged a token (it
    # relays the tokens waiting as one batch: one delta for two); a token delivered
    # twice would make more deltas than tokens
    ref_merged, got_merged = MAX_TOKENS - len(reference), MAX_TOKENS - len(parts)
    assert 0 <= ref_merged <= 3 and 0 <= got_merged <= 3, (reference, parts)
    # before the seam, each stream is the other's greedy text: the first k deltas of a
    # stream with m merges hold at most k + m tokens, so those of the first at - m
    # deltas were made before the seam
    assert "".join(parts).startswith("".join(reference[:at - ref_merged])), (reference, parts)
    assert "".join(reference).startswith("".join(parts[:at - got_merged])), (reference, parts)
    return reference, ref_final, parts, final


async def test_anthropic_stream_on_a_real_model_survives_a_node_kill(cluster: Cluster,
                                                                     smollm2_gguf: Path):
    reference, ref_final, parts, final = await kill_mid_stream(cluster, smollm2_gguf,
                                                               messages_stream)
    assert ref_final.content[0].text == "".join(reference)
    assert final.content[0].text == "".join(parts)
    assert final.stop_reason == ref_final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == ref_final.usage.output_tokens == MAX_TOKENS


async def test_responses_stream_on_a_real_model_survives_a_node_kill(cluster: Cluster,
                                                                     smollm2_gguf: Path):
    reference, ref_final, parts, final = await kill_mid_stream(cluster, smollm2_gguf,
                                                               responses_stream)
    assert ref_final.output_text == "".join(reference)
    assert final.output_text == "".join(parts)
    assert final.status == ref_final.status == "incomplete"
    assert final.usage.output_tokens == ref_final.usage.output_tokens == MAX_TOKENS

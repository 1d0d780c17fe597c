"""Ollama's keep_alive on a node: the last request's says how long the model stays loaded
once idle (0: it unloads at once, negative: never, a duration), over the node's own
--idle-unload; a keep_alive that is no duration is refused in one line. The Ollama client
against a head and a mock node whose engine unloads and loads again, in this loop."""

from __future__ import annotations

import math

import ollama
import pytest

from engine.runtimes.mock import MockEngine
from tests.integration.test_api_surface import MODEL, live_head
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


async def test_keep_alive_unloads_at_once_keeps_for_ever_or_is_refused():
    async with live_head(lanes=2, make_engine=lambda name: MockEngine(model=name)) as h:
        (agent,) = h.agents
        engine = agent.engine
        assert isinstance(engine, MockEngine)
        client = ollama.AsyncClient(host=h.url(""))
        try:
            got = await client.generate(model=MODEL, prompt="hi", keep_alive=0,
                                        options={"num_predict": 4})
            assert got.response
            # idle at once after its request: unloaded
            await until(lambda: engine.asleep and agent.sleep == "asleep", "the unload")
            assert agent.idle_s() == 0

            got = await client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    keep_alive=-1, options={"num_predict": 4})
            assert got.message.content
            assert engine.loads == 2 and not engine.asleep  # loaded again for it
            assert math.isinf(agent.keep_alive_s or 0) and agent.idle_s() is None

            got = await client.generate(model=MODEL, prompt="hi", keep_alive="90s",
                                        options={"num_predict": 4})
            assert agent.idle_s() == 90.0 and not engine.asleep

            with pytest.raises(ollama.ResponseError) as refused:
                await client.generate(model=MODEL, prompt="hi", keep_alive="five minutes")
            assert refused.value.status_code == 400
            assert "is not a duration" in str(refused.value)
            assert agent.idle_s() == 90.0  # a refused request changes nothing

            # one that names none brings back the node's own idle time, as Ollama's does:
            # a keep_alive of 0 does not stick to the requests after it
            await client.generate(model=MODEL, prompt="hi", keep_alive=0,
                                  options={"num_predict": 2})
            await client.generate(model=MODEL, prompt="hi", options={"num_predict": 2})
            assert agent.keep_alive_s is None and agent.idle_s() != 0

            # nothing to generate: `ollama stop` unloads, a bare request loads, as Ollama's
            stopped = await client.generate(model=MODEL, keep_alive=0)
            assert stopped.done_reason == "unload"
            await until(lambda: engine.asleep and agent.sleep == "asleep", "the stop")
            loads = engine.loads
            loaded = await client.chat(model=MODEL, messages=[])
            assert loaded.done_reason == "load" and not engine.asleep
            assert engine.loads == loads + 1
        finally:
            await client.close()

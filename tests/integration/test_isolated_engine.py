"""An engine in a process of its own (engine.runtimes.isolated), the way a node runs a model
split across machines: real child processes running the mock runtime. A generation the
child runs streams as it would in the node; a child killed mid-answer fails that
generation with EngineLost (the node then fails the session over), the engine reports
itself down and refuses new generations until its gate passes, then forms again; closing
the engine ends its child."""

from __future__ import annotations

import asyncio
import os
import signal
import struct

import msgspec
import pytest

from engine.runtimes import isolated
from engine.runtimes.base import GenerationRequest, Sampling
from engine.runtimes.isolated import EngineLost, EngineStartFailed, IsolatedEngine, Load
from tests.waiting import until

pytestmark = [pytest.mark.processes]

MODULE = "engine.roles.engine_process"
GREEDY = Sampling(temperature=0.0)


def request(max_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt=[1, 2, 3], max_tokens=max_tokens, sampling=GREEDY)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has ended; its parent (this test's loop) reaps it soon
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


async def test_a_generation_runs_in_the_child_and_the_child_ends_with_the_engine() -> None:
    engine = IsolatedEngine(Load(path="mock-m", name="mock-m", runtime="mock", lanes=2),
                            module=MODULE)
    await engine.start()
    pid = engine.pid
    assert pid is not None and pid != os.getpid()
    try:
        assert (engine.info.model, engine.info.runtime, engine.info.lanes) == \
            ("mock-m", "mock", 2)
        gen = engine.generate(request(12))
        ids = [t async for batch in gen for t in batch]
        assert len(ids) == 12
        assert (gen.result.finish_reason, gen.result.completion_tokens) == ("length", 12)
        again = engine.generate(request(12))
        assert [t async for batch in again for t in batch] == ids  # the mock is greedy
        assert engine.stats().down == ""
    finally:
        await engine.close()
    await until(lambda: not alive(pid), "the engine's process to end with the engine")


async def test_a_child_killed_mid_answer_fails_it_and_the_engine_forms_again() -> None:
    back = asyncio.Event()
    tries = 0

    async def gate() -> None:  # the lending machine: away until the test says it returned
        nonlocal tries
        tries += 1
        if not back.is_set():
            raise ConnectionRefusedError("desk does not answer")

    engine = IsolatedEngine(Load(path="mock-m", name="mock-m", runtime="mock", lanes=2,
                                 mock_speed=50.0),
                            module=MODULE, gate=gate, what="the split with desk")
    await engine.start()
    first = engine.pid
    assert first is not None
    try:
        gen = engine.generate(request(10_000))
        got: list[int] = []
        with pytest.raises(EngineLost, match="the split with desk is down: the link to desk"):
            async for batch in gen:
                got.extend(batch)
                if len(got) >= 5 and engine.stats().down == "":
                    engine.lost("the link to desk ended")
        assert 5 <= len(got) < 10_000
        await until(lambda: not alive(first), "the killed child to end")
        st = engine.stats()
        assert st.down.startswith("the split with desk is down: the link to desk ended")
        assert st.lanes_busy == st.lanes  # every lane busy: heads place elsewhere
        with pytest.raises(EngineLost, match="is down"):
            engine.generate(request(4))
        await until(lambda: tries >= 2, "the engine to ask its gate again")
        assert engine.pid is None and engine.restarts == 0
        back.set()
        await until(lambda: engine.stats().down == "", "the engine to form again")
        assert engine.restarts == 1 and engine.pid not in (None, first)
        gen = engine.generate(request(6))
        assert len([t async for batch in gen for t in batch]) == 6
    finally:
        await engine.close()


async def test_a_child_that_dies_by_itself_is_started_again() -> None:
    engine = IsolatedEngine(Load(path="mock-m", name="mock-m", runtime="mock", lanes=1,
                                 mock_speed=50.0), module=MODULE)
    await engine.start()
    pid = engine.pid
    assert pid is not None
    try:
        gen = engine.generate(request(10_000))
        with pytest.raises(EngineLost, match=r"its process ended \(exit code -9\)"):
            async for _ in gen:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        await until(lambda: engine.restarts == 1 and engine.stats().down == "",
                    "the engine to start its process again")
    finally:
        await engine.close()


async def test_a_model_that_cannot_load_fails_the_start_in_its_own_line() -> None:
    engine = IsolatedEngine(Load(path="/nonexistent/model.gguf", name="m",
                                 runtime="llamacpp", lanes=1), module=MODULE)
    with pytest.raises(EngineStartFailed) as failed:
        await engine.start()
    assert failed.value.code == "cannot_load"
    assert "/nonexistent/model.gguf" in str(failed.value)
    assert "\n" not in str(failed.value)
    assert engine.pid is None


async def test_a_record_longer_than_the_bound_is_refused_before_it_is_read() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", isolated.MAX_FRAME + 1))
    with pytest.raises(isolated.FrameTooLarge):
        await isolated.read_frame(reader, isolated.to_parent)
    reader = asyncio.StreamReader()
    reader.feed_data(isolated.frame(isolated.Cancel(id=7)))
    assert await isolated.read_frame(reader, isolated.to_child) == isolated.Cancel(id=7)
    reader = asyncio.StreamReader()
    reader.feed_data(isolated.frame(isolated.Cancel(id=7)))
    with pytest.raises(msgspec.ValidationError):  # a record of the other direction
        await isolated.read_frame(reader, isolated.to_parent)

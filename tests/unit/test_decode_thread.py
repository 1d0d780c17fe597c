"""The decode-thread base on a fake runtime: life cycle, budgets, cancels, stats."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from engine.runtimes.base import GenerationRequest, GenerationResult
from engine.runtimes.decode_thread import DecodeJob, DecodeThreadEngine
from engine.runtimes.threaded import ThreadedGeneration
from tests.waiting import until

WINDOW = 64
EOS = 99


@dataclass(eq=False)
class _FakeJob(DecodeJob):
    pass


class FakeEngine(DecodeThreadEngine[_FakeJob]):
    """Each step gives every lane its next token: 1, 2, 3, ... While ``held``, steps idle."""

    def __init__(self, *, lanes: int = 2, load_error: Exception | None = None) -> None:
        super().__init__("fake.bin", runtime="fake", job_type=_FakeJob, model_name="fake",
                         lanes=lanes, max_context=WINDOW)
        self.load_error = load_error
        self.loading = threading.Event()  # set: the load may finish
        self.loading.set()
        self.running = threading.Event()  # clear: steps produce nothing
        self.running.set()
        self.admitted: list[int] = []
        self.left: list[int] = []
        self.unloaded = threading.Event()

    def _load(self) -> None:
        self.loading.wait(10)
        if self.load_error is not None:
            raise self.load_error
        self._n_vocab = 100
        self._eos = frozenset({EOS})

    def _admit(self, job: _FakeJob, active: dict[int, _FakeJob]) -> bool:
        if len(active) >= self.lanes:
            return False
        self.admitted.append(job.id)
        job.t_lane = time.perf_counter()
        self._kv_add(len(job.prompt))
        return True

    def _step(self, active: dict[int, _FakeJob]) -> None:
        if not self.running.wait(0.005):  # the fake's own pace while held
            return
        for job in list(active.values()):
            tok = job.completion + 1
            if tok not in job.stops:
                self._kv_add(1)
            self._sampled(job, tok, time.perf_counter(), active)

    def _leave_lane(self, job: _FakeJob, now: float) -> None:
        self.left.append(job.id)
        self._kv_add(-(len(job.prompt) + job.completion))

    def _unload(self) -> None:
        self.unloaded.set()


def request(max_tokens: int, *, prompt_len: int = 10, stop: frozenset[int] = frozenset(),
            ) -> GenerationRequest:
    return GenerationRequest(prompt=[5] * prompt_len, max_tokens=max_tokens, stop_ids=stop)


async def tokens_of(gen: ThreadedGeneration) -> tuple[list[int], GenerationResult]:
    async with asyncio.timeout(10):
        out = [t async for batch in gen for t in batch]
    return out, gen.result


def decode_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shoal-fake-decode"]


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    eng = FakeEngine()
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


async def test_runs_to_the_budget_or_the_window(engine: FakeEngine) -> None:
    out, res = await tokens_of(engine.generate(request(5)))
    assert out == [1, 2, 3, 4, 5]
    assert (res.finish_reason, res.prompt_tokens, res.completion_tokens) == ("length", 10, 5)
    # the window holds the prompt and the whole completion
    out, res = await tokens_of(engine.generate(request(1000, prompt_len=60)))
    assert out == [1, 2, 3, 4] and res.finish_reason == "length"
    assert engine.info.context_window == WINDOW


async def test_a_stop_id_ends_unyielded(engine: FakeEngine) -> None:
    out, res = await tokens_of(engine.generate(request(50, stop=frozenset({4}))))
    assert out == [1, 2, 3] and (res.finish_reason, res.completion_tokens) == ("stop", 3)
    assert engine.stats().kv_used == 0


async def test_no_tokens_asked_ends_at_once_even_with_every_lane_busy(
        engine: FakeEngine) -> None:
    engine.running.clear()
    held = [engine.generate(request(50)) for _ in range(2)]
    await until(lambda: len(engine.admitted) == 2, "both lanes taken")
    out, res = await tokens_of(engine.generate(request(0)))
    assert out == [] and (res.finish_reason, res.completion_tokens) == ("length", 0)
    assert len(engine.admitted) == 2  # it never took a lane
    engine.running.set()
    for gen in held:
        assert (await tokens_of(gen))[1].finish_reason == "length"


async def test_cancel_frees_the_lane_for_the_next(engine: FakeEngine) -> None:
    engine.running.clear()
    first, second, third = (engine.generate(request(50)) for _ in range(3))
    await until(lambda: len(engine.admitted) == 2, "both lanes taken")
    assert engine.stats().lanes_busy == 2
    first.cancel()
    out, res = await tokens_of(first)
    assert res.finish_reason == "cancelled" and out == []
    await until(lambda: len(engine.admitted) == 3, "the third request to take the freed lane")
    assert engine.left == [engine.admitted[0]]
    engine.running.set()
    for gen in (second, third):
        assert (await tokens_of(gen))[1].completion_tokens == 50
    await until(lambda: engine.stats().lanes_busy == 0, "every lane free")
    assert engine.stats().kv_used == 0


async def test_close_ends_what_runs_and_what_waits_as_cancelled() -> None:
    eng = FakeEngine(lanes=1)
    await eng.start()
    eng.running.clear()
    gens = [eng.generate(request(50)) for _ in range(3)]  # two wait for the lane
    await until(lambda: len(eng.admitted) == 1, "the lane taken")
    await eng.close()
    for gen in gens:
        assert (await tokens_of(gen))[1].finish_reason == "cancelled"
    assert eng.unloaded.is_set() and not decode_threads()
    assert eng.stats().lanes_busy == 0
    with pytest.raises(RuntimeError, match="not running"):
        eng.generate(request(4))


async def test_a_failed_load_raises_from_start_and_leaves_no_thread() -> None:
    eng = FakeEngine(load_error=ValueError("fake cannot load fake.bin; pass a fake file"))
    with pytest.raises(ValueError, match=r"cannot load fake\.bin"):
        await eng.start()
    assert not decode_threads()
    with pytest.raises(RuntimeError, match="not running"):
        eng.generate(request(4))
    await eng.close()


async def test_start_cancelled_while_loading_unloads_and_leaves_no_thread() -> None:
    eng = FakeEngine()
    eng.loading.clear()
    task = asyncio.create_task(eng.start())
    await until(decode_threads, "the decode thread to start loading")
    task.cancel()
    eng.loading.set()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await task
    assert eng.unloaded.is_set() and not decode_threads()
    await eng.close()


async def test_stats_count_lanes_kv_and_rates(engine: FakeEngine) -> None:
    st = engine.stats()
    assert (st.lanes, st.lanes_busy, st.kv_used, st.kv_total) == (2, 0, 0, 2 * WINDOW)
    assert (st.ttft_ms, st.prefill_tps, st.decode_tps) == (0.0, 0.0, 0.0)
    engine.running.clear()
    gen = engine.generate(request(8))
    await until(lambda: engine.admitted, "the lane taken")
    assert engine.stats().lanes_busy == 1 and engine.stats().kv_used == 10
    engine.running.set()
    _, res = await tokens_of(gen)
    st = engine.stats()
    assert st.lanes_busy == 0 and st.kv_used == 0
    assert st.ttft_ms == res.ttft_ms > 0
    assert st.decode_tps == res.decode_tps > 0
    assert st.prefill_tps == res.prefill_tps > 0

"""One KV pool for all lanes, its host-memory cache and idle unload, on real llama.cpp."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from engine.head.fleet.links import Fleet
from engine.head.fleet.sessions import Finish, Job, SessionRunner
from engine.link import messages as m
from engine.node.agent import NodeAgent
from engine.runtimes.base import GenerationRequest
from engine.runtimes.decode_thread import PoolFull
from engine.runtimes.llamacpp import LlamaCppEngine, LlamaCppVocab
from tests.e2e.engine_run import GREEDY, run, started, until_idle
from tests.integration.test_node_and_sessions import collect, wait_ready
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
TOKEN = bytes(range(32))


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def vocab(smollm2_gguf: str) -> LlamaCppVocab:
    return LlamaCppVocab(smollm2_gguf)


def smollm2(path: str, **kw: object) -> LlamaCppEngine:
    return LlamaCppEngine(path, model_name="smollm2", **kw)  # type: ignore[arg-type]


async def test_eight_sessions_share_the_pool_and_a_ninth_is_refused_as_busy(
        smollm2_gguf: str, vocab: LlamaCppVocab) -> None:
    async with started(smollm2(smollm2_gguf, lanes=9, pool_cells=1024)) as eng:
        assert eng.pool_cells == 1024 and eng.info.context_window == 1024
        prompts = [vocab.encode(chat(f"Count from {i} to {i + 30}.")) for i in range(9)]
        longest = max(len(p) for p in prompts)
        answer = 1024 // 8 - longest - 4  # eight prompts and answers fill the pool, nine not
        gens = [eng.generate(GenerationRequest(prompt=p, max_tokens=answer, sampling=GREEDY,
                                               session=f"s{i}"))
                for i, p in enumerate(prompts[:8])]
        why = eng.admission(len(prompts[8]), answer)
        assert why is not None and "KV pool is full" in why
        with pytest.raises(PoolFull):
            eng.generate(GenerationRequest(prompt=prompts[8], max_tokens=answer))
        assert eng.stats().max_prompt < len(prompts[8])  # what the head reads
        # a session that asks for a short answer still fits beside them
        assert eng.admission(len(prompts[8]), 8) is None
        results = []
        for gen in gens:
            async for _ in gen:
                pass
            results.append(gen.result)
        assert all(r.finish_reason in ("stop", "length") for r in results)
        # the eight ran in one pool: what they held together never passed it
        assert sum(r.prompt_tokens + r.completion_tokens for r in results) <= 1024
        await until_idle(eng)
        assert eng.admission(len(prompts[8]), answer) is None  # their cells are free again
        _out, res = await run(eng, prompts[8], answer)
        assert res.prompt_tokens == len(prompts[8])


async def test_a_reclaimed_prefix_comes_back_from_the_host_cache(
        smollm2_gguf: str, vocab: LlamaCppVocab) -> None:
    story = " ".join(f"Line {i}: the river ran past the old mill." for i in range(40))
    a = vocab.encode(chat(story + " Summarise the story."))
    b = vocab.encode(chat("Name three colours of the rainbow, please, in order."))
    b = b + vocab.encode(" ".join(["and more"] * 60), special=False)
    async with started(smollm2(smollm2_gguf, lanes=1, max_context=2048)) as eng:
        first, _ = await run(eng, a, 16, session="a")
        await run(eng, b, 4, session="b")  # takes the only lane: a's sequence is reclaimed
        assert eng.host_cache_bytes > 0
        before = eng.stats()
        again, res = await run(eng, a, 16, session="a")
        after = eng.stats()
        assert res.cached_tokens == len(a) - 1  # all but the last token, which is re-read
        assert after.prompt_from_host - before.prompt_from_host == len(a) - 1
        assert after.prompt_prefilled - before.prompt_prefilled == 1
    # the reference: a fresh engine that prefilled the same prompt and re-reads its last
    # token, as a restore does (llama.cpp's CPU flash attention rounds a one-token read
    # differently from a batch, so any prefix reuse may change a greedy answer a little:
    # what a restore must give is what the same KV, prefilled here, gives)
    async with started(smollm2(smollm2_gguf, lanes=1, max_context=2048)) as fresh:
        await run(fresh, a, 1, session="r")
        reference, ref = await run(fresh, a, 16, session="r")
    assert ref.cached_tokens == len(a) - 1 and ref.finish_reason == res.finish_reason
    assert again == reference  # greedy: the restored KV is the prefilled KV, bit for bit
    assert first[0] == again[0]


async def test_an_answer_past_its_reserve_grows_while_cells_are_free(
        smollm2_gguf: str, vocab: LlamaCppVocab) -> None:
    eng = smollm2(smollm2_gguf, lanes=2, pool_cells=256)
    eng.answer_reserve = 32  # (512 in use): the same growth, at an eighth of the decode
    async with started(eng):
        prompt = vocab.encode(chat("Write a very long story about a dragon."))
        out, res = await run(eng, prompt, 225)  # reserve 32, then cell by cell
        assert len(out) > eng.answer_reserve  # it grew past its reserve
        assert res.prompt_tokens + len(out) <= 256
        if res.finish_reason == "length":
            assert len(out) == min(225, 256 - len(prompt))


@contextlib.asynccontextmanager
async def node(eng: LlamaCppEngine, identity: str,
               **kw: object) -> AsyncIterator[tuple[NodeAgent, int]]:
    agent = NodeAgent(eng, identity=identity, psk=TOKEN, **kw)  # type: ignore[arg-type]
    _host, port = await agent.listen("127.0.0.1", 0)
    try:
        yield agent, port
    finally:
        await agent.close()




async def test_the_head_places_a_session_a_full_pool_refuses_on_another_node(
        smollm2_gguf: str, vocab: LlamaCppVocab, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with started(smollm2(smollm2_gguf, lanes=4, pool_cells=1024)) as full_eng, \
            started(smollm2(smollm2_gguf, lanes=4, pool_cells=1024)) as free_eng, \
            node(full_eng, "full") as (_a, pa), node(free_eng, "free") as (_b, pb):
        fleet = Fleet(model="smollm2", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", pa)
        fleet.add_dialed("127.0.0.1", pb)
        runner = SessionRunner(fleet)
        await wait_ready(fleet, 2)
        # another head's long sessions hold most of the first node's pool (greedy, [1, 2, 3]
        # writes 480 tokens without an end: they outlast this session)
        holders = [full_eng.generate(GenerationRequest(prompt=[1, 2, 3], max_tokens=480,
                                                       sampling=GREEDY, session=f"h{i}"))
                   for i in range(2)]
        prompt = vocab.encode(chat("What is the capital of France?"))
        assert full_eng.admission(len(prompt), 64) is not None
        full = fleet.pools[f"127.0.0.1:{pa}"]
        # the node's stats tell the head its pool cannot take the prompt now
        await until(lambda: full.stats is not None and 0 < full.stats.max_prompt <= len(prompt),
                    "the head to hear that the first node's pool is full")
        ids, fin = await collect(runner, Job(session="s", model="smollm2", prompt=prompt,
                                             max_tokens=64, prefer=("full",),
                                             sampling=m.SamplingParams(temperature=0.0)))
        assert fin.node == "free" and ids
        assert "node 'full' is full" not in caplog.text  # placed elsewhere without asking
        for gen in holders:
            gen.cancel()
        await fleet.close()


async def test_an_idle_node_unloads_and_a_waiting_request_wakes_it(
        smollm2_gguf: str, vocab: LlamaCppVocab) -> None:
    prompt = vocab.encode(chat("Name a fruit."))
    async with started(smollm2(smollm2_gguf, lanes=2, max_context=1024)) as eng, \
            node(eng, "sleepy", idle_unload_s=0.5) as (agent, port):
        fleet = Fleet(model="smollm2", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", port)
        runner = SessionRunner(fleet)
        await wait_ready(fleet, 1)
        job = Job(session="s", model="smollm2", prompt=prompt, max_tokens=12,
                  sampling=m.SamplingParams(temperature=0.0))
        awake, _ = await collect(runner, job)
        loaded = agent.stats_record().mem_used
        await until(lambda: eng.asleep, "the node to unload its model", timeout=30)
        assert agent.sleep == "asleep"
        # the model and the pool are freed, the links stay up and say so
        await until(lambda: any(p.stats is not None and p.stats.sleep == "asleep"
                                for p in fleet.pools.values()), "the head to hear it")
        assert agent.stats_record().mem_used < loaded - 100 * 1024 * 1024
        woken, fin = await collect(runner, job)
        assert woken == awake and fin.moves == 0  # served by the node it woke, unchanged
        assert agent.sleep == "" and not eng.asleep
        await fleet.close()


# the whole window at a size that costs seconds: two lanes and a 2,048-token window make the
# same pool as eight lanes and Gemma's own 32,768 (one window, each lane's floor of 1,024
# cells within it); that size is scripts/bench/capacity.py's
LANES, WINDOW = 2, 2048


async def test_one_session_takes_gemmas_whole_window_while_the_other_lanes_are_free(
        gemma_gguf: str) -> None:
    """Lanes under a budget: one session may still hold every cell of the window."""
    async with started(LlamaCppEngine(gemma_gguf, model_name="gemma", lanes=LANES,
                                      max_context=WINDOW, memory_budget=4 << 30)) as eng:
        assert eng.info.context_window == WINDOW and eng.pool_cells == WINDOW
        prompt = [2] + [1000 + (j * 37) % 20000 for j in range(WINDOW - 8)]
        gen = eng.generate(GenerationRequest(prompt=prompt, max_tokens=16, sampling=GREEDY))
        st = eng.stats()
        assert st.lanes_busy == 1 and st.lanes == LANES
        # another lane is free, but the pool is committed whole: another session is refused
        # at once (the head places it on another node), never squeezed in to cut this one
        assert eng.admission(4, 4) is not None
        out = [t async for batch in gen for t in batch]
        res = gen.result
        assert res.prompt_tokens == len(prompt) and res.finish_reason == "length"
        assert len(out) == WINDOW - len(prompt)  # the answer ran to the window's very end
        assert eng.stats().kv_used >= WINDOW - 1


@contextlib.contextmanager
def cpu_hogs() -> Iterator[Callable[[], None]]:
    """Other work on every core of this machine, started here and ended by pid, here or
    earlier by calling what it yields."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(len(os.sched_getaffinity(0)))]  # every CPU this test may use

    def end() -> None:
        for hog in hogs:
            if hog.poll() is None:
                hog.kill()
                hog.wait(10)

    try:
        yield end
    finally:
        end()


async def test_a_long_prefill_on_a_node_loaded_by_other_work_is_not_failed_over(
        smollm2_gguf: str, vocab: LlamaCppVocab) -> None:
    async with started(smollm2(smollm2_gguf, lanes=2)) as eng, \
            node(eng, "loaded") as (_a, port):
        fleet = Fleet(model="smollm2", head_id="h", psk=TOKEN)
        fleet.add_dialed("127.0.0.1", port)
        runner = SessionRunner(fleet, lease_ms=2500)  # a short lease: a tight first-token bound
        await wait_ready(fleet, 1)
        greedy = m.SamplingParams(temperature=0.0)
        # on a quiet machine the node measures and fits its prefill cost
        for words in (60, 200, 400):
            text = " ".join(f"item{i}" for i in range(words))
            await collect(runner, Job(session=f"w{words}", model="smollm2", max_tokens=2,
                                      prompt=vocab.encode(chat(text)), sampling=greedy))
        await until(lambda: eng.stats().prefill_s_per_token > 0, "the node's prefill fit")
        # about 1,000 tokens: a prefill of seconds on one CPU, twice that beside the hogs,
        # past its bound of the lease plus the fitted cost
        long_prompt = vocab.encode(chat(" ".join(f"entry{i}" for i in range(250))))
        # then other work takes every core: the prompt's prefill runs far past the bound
        # its fitted cost gives, and only the node's progress reports keep the attempt alive.
        # The hogs end at the first token: each later one is due within one lease, and an
        # oversubscribed llama.cpp decode (its threads spin on barriers) can take longer
        ids: list[int] = []
        fin: Finish | None = None
        with cpu_hogs() as end_hogs:
            async for item in runner.run(Job(session="long", model="smollm2",
                                             prompt=long_prompt, max_tokens=4,
                                             sampling=greedy)):
                end_hogs()
                if isinstance(item, Finish):
                    fin = item
                    break
                ids.extend(item)
        assert fin is not None
        assert fin.moves == 0 and fin.node == "loaded"
        assert fin.prompt_tokens == len(long_prompt) and ids
        await fleet.close()

"""The llamacpp runtime on the real SmolLM2-135M-Instruct GGUF."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from engine.runtimes.base import GenerationRequest, GenerationResult, Sampling
from engine.runtimes.llamacpp import (
    LlamaCppEngine,
    LlamaCppGeneration,
    LlamaCppVocab,
    start_line,
)
from tests.e2e.engine_run import GREEDY, run, until_idle
from tests.loopwatch import LoopWatch

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(90)]

WINDOW = 1024


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def vocab(smollm2_gguf: str) -> LlamaCppVocab:
    return LlamaCppVocab(smollm2_gguf)


@pytest.fixture
async def engine(smollm2_gguf: str) -> AsyncIterator[LlamaCppEngine]:
    eng = LlamaCppEngine(smollm2_gguf, model_name="smollm2", lanes=8, max_context=WINDOW)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


async def test_greedy_is_deterministic_and_sensible(
    smollm2_gguf: str, vocab: LlamaCppVocab
) -> None:
    prompt = vocab.encode(chat("What is the capital of France?"))
    outs = []
    for _ in range(2):
        eng = LlamaCppEngine(smollm2_gguf, model_name="smollm2", lanes=2, max_context=WINDOW)
        await eng.start()
        try:
            outs.append(await run(eng, prompt, 24))
        finally:
            await eng.close()
    (a, ra), (b, _rb) = outs
    assert a == b
    text = vocab.decode(a)
    assert "Paris" in text, text
    assert ra.finish_reason == "stop"  # ended at <|im_end|>, which is not yielded
    assert 2 not in a
    assert ra.prompt_tokens == len(prompt) and ra.completion_tokens == len(a)
    assert ra.cached_tokens == 0 and ra.ttft_ms > 0 and ra.prefill_tps > 0


async def test_eight_generations_run_together(engine: LlamaCppEngine, vocab: LlamaCppVocab) -> None:
    loop = asyncio.get_running_loop()
    topics = ["the sea", "a cat", "mountains", "a robot", "rain", "a city", "the moon", "bread"]
    first: list[float] = []
    finished: list[float] = []
    busy_seen: list[int] = []

    async def one(topic: str) -> tuple[int, GenerationResult]:
        gen = engine.generate(
            GenerationRequest(
                prompt=vocab.encode(chat(f"Write a long poem about {topic}.")),
                max_tokens=16,
                sampling=GREEDY,
                session=topic,
            )
        )
        n = 0
        async for batch in gen:
            if n == 0:
                first.append(loop.time())
                busy_seen.append(engine.stats().lanes_busy)
            n += len(batch)
        finished.append(loop.time())
        return n, gen.result

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(t) for t in topics))
    dt = time.perf_counter() - t0
    assert len(first) == 8 and len(finished) == 8
    # every lane had yielded before any of them finished: all eight were in flight together
    assert max(first) < min(finished)
    assert max(busy_seen) == 8
    assert all(n > 0 and n == r.completion_tokens for n, r in results)
    total = sum(n for n, _ in results)
    print(f"8 lanes: {total} tokens in {dt:.2f}s = {total / dt:.0f} tok/s aggregate")
    await until_idle(engine)
    assert engine.stats().lanes_busy == 0


async def test_new_prompt_joins_while_others_decode(
    engine: LlamaCppEngine, vocab: LlamaCppVocab
) -> None:
    loop = asyncio.get_running_loop()
    times: dict[str, list[float]] = {"a": [], "b": [], "c": []}

    async def consume(name: str, gen: LlamaCppGeneration) -> GenerationResult:
        async for batch in gen:
            times[name].extend([loop.time()] * len(batch))
        return gen.result

    def start(name: str, prompt: list[int], max_tokens: int) -> asyncio.Task[GenerationResult]:
        # greedy: a sampled answer may end after a few tokens (it did once in CI), and a
        # and b must decode on while c prefills
        gen = engine.generate(GenerationRequest(prompt=prompt, max_tokens=max_tokens,
                                                sampling=Sampling(temperature=0.0)))
        return asyncio.ensure_future(consume(name, gen))

    ta = start("a", vocab.encode(chat("Count from one to one hundred in words.")), 40)
    tb = start("b", vocab.encode(chat("List the colours of the rainbow.")), 40)
    while len(times["a"]) < 3:
        await asyncio.sleep(0.01)
    # a prompt longer than one batch: it prefills over several steps
    long_text = " ".join(f"Item {i} is a small red box." for i in range(80))
    long_prompt = vocab.encode(chat(long_text + " Which item is last?"))
    assert len(long_prompt) > engine._n_batch
    joined = loop.time()
    tc = start("c", long_prompt, 8)
    ra, rb, rc = await asyncio.gather(ta, tb, tc)
    assert rc.completion_tokens > 0 and rc.prompt_tokens == len(long_prompt)
    first_c = times["c"][0]
    # lane a kept decoding while c was prefilling, and was still running when c answered
    assert any(joined < t < first_c for t in times["a"] + times["b"])
    assert times["a"][-1] > first_c or times["b"][-1] > first_c
    assert ra.completion_tokens > 3 and rb.completion_tokens > 0


async def test_second_turn_reuses_the_session_cache(
    engine: LlamaCppEngine, vocab: LlamaCppVocab
) -> None:
    turn1 = vocab.encode(chat("Name three fruits."))
    out1, r1 = await run(engine, turn1, 12, session="s1")
    assert r1.cached_tokens == 0
    # another conversation in between takes another lane and leaves s1 parked
    other, _ = await run(engine, vocab.encode(chat("Say hello.")), 4, session="s2")
    assert other
    turn2 = turn1 + out1 + vocab.encode("<|im_end|>\n" + chat("And three vegetables?"))
    out2, r2 = await run(engine, turn2, 8, session="s1")
    assert out2
    assert r2.cached_tokens >= len(turn1)
    assert r2.prompt_tokens == len(turn2)
    assert r2.prompt_tokens - r2.cached_tokens < r2.prompt_tokens // 2


async def test_cancel_frees_the_lane(engine: LlamaCppEngine, vocab: LlamaCppVocab) -> None:
    prompt = vocab.encode(chat("Tell me a very long story about dragons."))
    gen = engine.generate(GenerationRequest(prompt=prompt, max_tokens=500))
    got: list[int] = []
    async for batch in gen:
        got.extend(batch)
        if len(got) >= 2:
            gen.cancel()
    assert gen.result.finish_reason == "cancelled"
    assert gen.result.completion_tokens < 500
    assert engine.stats().lanes_busy == 0


async def test_breaking_out_or_dropping_does_not_leak_a_lane(
    engine: LlamaCppEngine, vocab: LlamaCppVocab
) -> None:
    prompt = vocab.encode(chat("Tell me a very long story about knights."))
    gen = engine.generate(GenerationRequest(prompt=prompt, max_tokens=500))
    async for _batch in gen:
        break
    del gen
    engine.generate(GenerationRequest(prompt=prompt, max_tokens=500))  # never read
    await until_idle(engine)
    assert engine.stats().lanes_busy == 0

    # an explicit aclose of the iterator cancels too
    gen2 = engine.generate(GenerationRequest(prompt=prompt, max_tokens=500))
    it = gen2.__aiter__()
    assert await it.__anext__()
    await it.aclose()
    await until_idle(engine)
    assert engine.stats().lanes_busy == 0


async def test_close_ends_running_generations(smollm2_gguf: str, vocab: LlamaCppVocab) -> None:
    eng = LlamaCppEngine(smollm2_gguf, model_name="smollm2", lanes=2, max_context=WINDOW)
    await eng.start()
    prompt = vocab.encode(chat("Tell me a very long story about ships."))
    gen = eng.generate(GenerationRequest(prompt=prompt, max_tokens=500))
    it = gen.__aiter__()
    assert await it.__anext__()
    await eng.close()
    async for _batch in it:
        pass
    assert gen.result.finish_reason == "cancelled"
    with pytest.raises(RuntimeError):
        eng.generate(GenerationRequest(prompt=prompt, max_tokens=4))


async def test_max_tokens_ends_with_length(engine: LlamaCppEngine, vocab: LlamaCppVocab) -> None:
    out, res = await run(engine, vocab.encode(chat("Write an essay about trees.")), 3)
    assert len(out) == 3 and res.completion_tokens == 3
    assert res.finish_reason == "length"


async def test_full_window_ends_with_length(smollm2_gguf: str, vocab: LlamaCppVocab) -> None:
    eng = LlamaCppEngine(smollm2_gguf, model_name="smollm2", lanes=1, max_context=512)
    await eng.start()
    try:
        filler = " ".join(f"word{i}" for i in range(400))
        prompt = vocab.encode(chat(filler + " Now repeat all the words."))
        prompt = prompt[-(512 - 5) :]  # five tokens of room
        out, res = await run(eng, prompt, 100)
    finally:
        await eng.close()
    if res.finish_reason == "stop":  # the model may end its turn first
        assert len(prompt) + len(out) <= 512
    else:
        assert res.finish_reason == "length"
        assert len(out) == 5 and res.prompt_tokens + res.completion_tokens == 512


async def test_stop_id_is_honoured(engine: LlamaCppEngine, vocab: LlamaCppVocab) -> None:
    prompt = vocab.encode(chat("Write a sentence about the sun."))
    await run(engine, prompt, 1)  # warm: the next two runs then share the same cached prefix
    ref, _ = await run(engine, prompt, 10)
    idx = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    out, res = await run(engine, prompt, 10, stop=frozenset({ref[idx]}))
    assert res.finish_reason == "stop"
    assert out == ref[:idx]


async def test_stats_are_sane(engine: LlamaCppEngine, vocab: LlamaCppVocab) -> None:
    s0 = engine.stats()
    assert s0.lanes == 8 and s0.lanes_busy == 0 and s0.kv_used == 0
    # measured at start (the warm-up), before any request, and nothing of it left behind
    assert s0.prefill_tps > 0.0 and s0.decode_tps > 0.0 and s0.ttft_ms == 0.0
    assert s0.prompt_prefilled == 0 and engine.kv_used_from_llama() == 0
    assert (s0.device, s0.gpu_layers, s0.model_layers) == ("", 0, 31)  # SmolLM2, the CPU
    assert engine.info.context_window == WINDOW and engine.info.window_pinned
    assert s0.kv_total == WINDOW * 8
    _out, res = await run(engine, vocab.encode(chat("Describe a forest in detail.")), 6)
    s1 = engine.stats()
    assert s1.kv_used > 0
    assert s1.kv_used == engine.kv_used_from_llama()
    assert s1.kv_used >= res.prompt_tokens
    assert s1.kv_total == WINDOW * 8
    assert s1.prefill_tps > 0 and s1.ttft_ms > 0 and s1.decode_tps > 0
    assert s1.lanes_busy == 0
    assert "(pinned by --max-context), 8 lanes" in start_line(engine.info)
    assert "context window 1024 tokens" in start_line(engine.info)


async def test_window_is_the_models_own_in_one_pool(smollm2_gguf: str) -> None:
    eng = LlamaCppEngine(smollm2_gguf, model_name="smollm2", lanes=2)
    await eng.start()
    try:
        info = eng.info
        assert not info.window_pinned
        assert info.context_window == 8192  # SmolLM2's training context, for one session
        assert eng.stats().kv_total == 8192  # one pool that both lanes share
        assert eng.pool_cells == 8192
        line = start_line(info)
        assert line.startswith(f"runtime llamacpp serves {smollm2_gguf}: context window ")
        assert line.endswith("tokens (the model's own), 2 lanes")
    finally:
        await eng.close()


async def test_prompt_longer_than_the_window_is_refused(
    engine: LlamaCppEngine, vocab: LlamaCppVocab
) -> None:
    with pytest.raises(ValueError, match="window"):
        engine.generate(GenerationRequest(prompt=[1] * WINDOW, max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate(GenerationRequest(prompt=[], max_tokens=4))
    assert engine.stats().lanes_busy == 0


async def test_event_loop_is_not_blocked(smollm2_gguf: str, vocab: LlamaCppVocab,
                                         loop_watch: LoopWatch) -> None:
    turns = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal turns
        while not stop.is_set():
            await asyncio.sleep(0.01)
            turns += 1

    tick = asyncio.create_task(ticker())
    eng = LlamaCppEngine(smollm2_gguf, model_name="smollm2", lanes=4, max_context=WINDOW)
    await eng.start()  # the load runs off the loop too
    try:
        prompts = [vocab.encode(chat(f"Write a poem about number {i}.")) for i in range(4)]
        await asyncio.gather(*(run(eng, p, 16) for p in prompts))
    finally:
        stop.set()
        await tick
        await eng.close()
    # the loop kept turning while four lanes loaded, prefilled and decoded, and the
    # loop-lag probe saw no stall over its bound
    assert turns > 10
    assert loop_watch.stalls == [], loop_watch.report()


def test_vocab_round_trips_and_reads_metadata(vocab: LlamaCppVocab) -> None:
    text = "Hello, world! Ünïcödé ✓ and   spaces\nnew line 12345"
    ids = vocab.encode(text, special=False)
    assert ids and b"".join(vocab.token_bytes(t) for t in ids).decode() == text
    # special tokens parse as one id only with special=True
    im_start = vocab.encode("<|im_start|>")
    assert len(im_start) == 1
    assert len(vocab.encode("<|im_start|>", special=False)) > 1
    assert vocab.token_bytes(im_start[0]) == b""
    assert vocab.special_text(im_start[0]) == "<|im_start|>"
    assert vocab.encode("<|im_end|>")[0] in vocab.eos_ids
    assert vocab.eos_text in {vocab.special_text(t) for t in vocab.eos_ids}
    # BOS: added on request, never twice
    if vocab.bos_id >= 0:
        with_bos = vocab.encode("hi", add_bos=True)
        assert with_bos[0] == vocab.bos_id
        assert vocab.encode(vocab.bos_text + "hi", add_bos=True) == with_bos
        assert vocab.encode("hi", add_bos=False)[0] != vocab.bos_id or vocab.bos_text == ""
    meta = vocab.metadata()
    assert meta["general.architecture"] == "llama"
    template = vocab.chat_template()
    assert template is not None and "<|im_start|>" in template
    # SmolLM2's vocabulary has no fill-in-the-middle tokens: the head refuses a suffix
    assert vocab.fim_ids() is None

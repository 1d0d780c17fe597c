"""The mlx runtime on a tiny model the test builds itself (random weights, small BPE).

Where mlx does not import (no Apple silicon, no CPU build), every test that
needs it skips with the import error as its reason; the refusal test runs
everywhere.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.runtimes.base import (
    GenerationRequest,
    GenerationResult,
    RuntimeUnavailable,
    Sampling,
)
from engine.runtimes.mlx import MlxEngine, MlxVocab
from tests.e2e.engine_run import GREEDY, run
from tests.e2e.mlx_tiny import build_tiny_model, chat, mlx_import_error
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(90)]

# hot enough that the tiny model's sharp logits still leave room for chance
HOT = Sampling(temperature=6.0, top_p=1.0, top_k=0, min_p=0.0)
WINDOW = 256
LONG = 4096  # tokens the tiny model takes seconds to fill


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    error = mlx_import_error()
    if error is not None:
        pytest.skip(error)
    return str(build_tiny_model(tmp_path_factory.mktemp("mlx-tiny") / "tiny-llama"))


@pytest.fixture(scope="module")
def vocab(tiny_model: str) -> MlxVocab:
    return MlxVocab(tiny_model)


@pytest.fixture
async def engine(tiny_model: str) -> AsyncIterator[MlxEngine]:
    eng = MlxEngine(tiny_model, model_name="tiny", lanes=2, max_context=WINDOW)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


async def until_idle(eng: MlxEngine, timeout: float = 30.0) -> None:
    async def idle() -> bool:
        gc.collect()  # a generation dropped unread frees its lane from its finalizer
        st = eng.stats()
        # what the lanes still hold is parked for the next request
        return st.lanes_busy == 0 and st.kv_used == st.kv_parked

    await until(idle, "every lane to be free", timeout=timeout)


# -- where mlx is missing ---------------------------------------------------------


def test_refuses_with_one_line_without_mlx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never skipped: with mlx unimportable, construction names the cause and the fix."""
    for name in ("mlx", "mlx.core", "mlx_lm"):
        monkeypatch.setitem(sys.modules, name, None)
    for make in (
        lambda: MlxEngine("/nowhere", model_name="x", lanes=2),
        lambda: MlxVocab("/nowhere"),
    ):
        with pytest.raises(RuntimeUnavailable) as info:
            make()
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith("runtime mlx needs Apple silicon")
        assert "--runtime llamacpp" in message
        if sys.platform != "darwin":
            assert "pip install 'mlx[cpu]' mlx-lm" in message
            assert "mlx cannot be imported here" in message


# -- on the tiny model ------------------------------------------------------------


async def test_generation_runs_to_length(engine: MlxEngine, vocab: MlxVocab) -> None:
    prompt = vocab.encode(chat("Hello, world!"))
    out, res = await run(engine, prompt, 16)
    assert len(out) == 16
    assert all(0 <= t < vocab.n_vocab for t in out)
    assert not set(out) & vocab.eos_ids
    assert res.finish_reason == "length"
    assert res.prompt_tokens == len(prompt) and res.completion_tokens == 16
    assert res.cached_tokens == 0 and res.ttft_ms > 0 and res.decode_tps > 0
    assert engine.info.runtime == "mlx" and engine.info.context_window == WINDOW
    assert engine.batched


async def test_greedy_is_deterministic(tiny_model: str, vocab: MlxVocab) -> None:
    prompt = vocab.encode(chat("What is the capital of France?"))
    outs = []
    for _ in range(2):
        eng = MlxEngine(tiny_model, model_name="tiny", lanes=2, max_context=WINDOW)
        await eng.start()
        try:
            outs.append((await run(eng, prompt, 20))[0])
            outs.append((await run(eng, prompt, 20))[0])
        finally:
            await eng.close()
    assert len(outs[0]) == 20
    assert all(o == outs[0] for o in outs)


async def test_seeded_sampling_repeats_and_seeds_differ(engine: MlxEngine, vocab: MlxVocab) -> None:
    prompt = vocab.encode(chat("Write a short poem about the sea."))

    def seeded(seed: int) -> Sampling:
        return Sampling(temperature=6.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed)

    a, _ = await run(engine, prompt, 24, sampling=seeded(7))
    b, _ = await run(engine, prompt, 24, sampling=seeded(7))
    c, _ = await run(engine, prompt, 24, sampling=seeded(8))
    greedy, _ = await run(engine, prompt, 24)
    assert a == b
    assert a != c
    assert a != greedy
    # top-k 1 is greedy whatever the temperature
    k1, _ = await run(engine, prompt, 24, sampling=Sampling(temperature=6.0, top_k=1, seed=1))
    assert k1 == greedy


async def test_stop_id_ends_the_generation_unyielded(engine: MlxEngine, vocab: MlxVocab) -> None:
    prompt = vocab.encode(chat("The quick brown fox"))
    out, _ = await run(engine, prompt, 24)
    cut = next(i for i in range(1, len(out)) if out[i] not in out[:i])
    got, res = await run(engine, prompt, 24, stop=frozenset({out[cut]}))
    assert got == out[:cut]
    assert res.finish_reason == "stop" and res.completion_tokens == cut


async def test_two_lanes_run_together(engine: MlxEngine, vocab: MlxVocab) -> None:
    loop = asyncio.get_running_loop()
    prompts = [vocab.encode(chat("a cat")), vocab.encode(chat("the moon and the rain"))]
    alone = [(await run(engine, p, 40))[0] for p in prompts]
    first: list[float] = []
    finished: list[float] = []
    busy_seen: list[int] = []

    async def one(prompt: list[int]) -> tuple[list[int], GenerationResult]:
        gen = engine.generate(GenerationRequest(prompt=prompt, max_tokens=40, sampling=GREEDY))
        out: list[int] = []
        async for batch in gen:
            if not out:
                first.append(loop.time())
                busy_seen.append(engine.stats().lanes_busy)
            out.extend(batch)
        finished.append(loop.time())
        return out, gen.result

    results = await asyncio.gather(*(one(p) for p in prompts))
    # both were in flight together
    assert max(first) < min(finished)
    assert max(busy_seen) == 2
    for (out, res), solo in zip(results, alone, strict=True):
        assert res.finish_reason == "length" and len(out) == 40
        # batching does not change what a lane produces
        assert out == solo
    await until_idle(engine)
    assert engine.stats().lanes_busy == 0


async def test_cancel_frees_the_lane(tiny_model: str, vocab: MlxVocab) -> None:
    eng = MlxEngine(tiny_model, model_name="tiny", lanes=1, max_context=LONG)
    await eng.start()
    try:
        prompt = vocab.encode(chat("Tell me everything."))
        gen = eng.generate(GenerationRequest(prompt=prompt, max_tokens=10_000, sampling=GREEDY))
        got: list[int] = []
        async for batch in gen:
            if not got:
                assert eng.stats().lanes_busy == 1
                assert eng.stats().kv_used >= len(prompt) + len(batch)
                gen.cancel()
            got.extend(batch)  # what was already on its way still arrives
        assert gen.result.finish_reason == "cancelled"
        assert gen.result.completion_tokens < LONG - len(prompt)
        await until_idle(eng)
        # the cancelled sequence stays parked: the prompt and every token it sampled
        assert eng.stats().kv_parked == len(prompt) + gen.result.completion_tokens

        # leaving the loop early cancels too
        gen2 = eng.generate(GenerationRequest(prompt=prompt, max_tokens=10_000, sampling=GREEDY))
        async for _batch in gen2:
            break
        del gen2
        await until_idle(eng)
        assert eng.stats().lanes_busy == 0

        # the single lane serves the next request
        out, res = await asyncio.wait_for(run(eng, prompt, 8), 30)
        assert res.finish_reason == "length" and len(out) == 8
    finally:
        await eng.close()


async def test_close_ends_what_is_running(tiny_model: str, vocab: MlxVocab) -> None:
    eng = MlxEngine(tiny_model, model_name="tiny", lanes=2, max_context=LONG)
    await eng.start()
    prompt = vocab.encode(chat("Tell me everything."))
    gens = [
        eng.generate(GenerationRequest(prompt=prompt, max_tokens=LONG, sampling=GREEDY))
        for _ in range(3)  # the third waits for a lane
    ]
    async for _batch in gens[0]:
        break
    await eng.close()
    for gen in gens:
        assert (await asyncio.wait_for(gen.wait(), 10)).finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="not running"):
        eng.generate(GenerationRequest(prompt=prompt, max_tokens=4))


async def test_window_caps_the_completion(tiny_model: str, vocab: MlxVocab) -> None:
    eng = MlxEngine(tiny_model, model_name="tiny", lanes=1, max_context=48)
    await eng.start()
    try:
        prompt = vocab.encode(chat("What is the capital of France? " * 4))[:40]
        assert len(prompt) == 40
        out, res = await run(eng, prompt, 100)
        assert res.finish_reason == "length" and len(out) == 48 - 40
        _, zero = await run(eng, prompt, 0)
        assert zero.finish_reason == "length" and zero.completion_tokens == 0
        with pytest.raises(ValueError, match="window is 48"):
            eng.generate(GenerationRequest(prompt=[5] * 48, max_tokens=4))
        with pytest.raises(ValueError, match="empty"):
            eng.generate(GenerationRequest(prompt=[], max_tokens=4))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.generate(GenerationRequest(prompt=[vocab.n_vocab + 5], max_tokens=4))
    finally:
        await eng.close()


async def test_stats_are_sane(tiny_model: str, vocab: MlxVocab) -> None:
    # a window long enough that a generation is still running when it is looked at
    eng = MlxEngine(tiny_model, model_name="tiny", lanes=2, max_context=LONG)
    await eng.start()
    try:
        st = eng.stats()
        assert (st.lanes, st.lanes_busy, st.kv_used) == (2, 0, 0)
        assert st.kv_total == LONG  # one pool of one window, shared by the two lanes
        assert st.decode_tps == 0.0 and st.ttft_ms == 0.0 and st.prefill_tps == 0.0
        prompt = vocab.encode(chat("Write a short poem about the sea, the moon and the rain."))
        _, res = await run(eng, prompt, 32, sampling=HOT)
        assert res.decode_tps > 0
        st = eng.stats()
        assert st.lanes_busy == 0 and st.kv_used == st.kv_parked == len(prompt) + 32
        assert st.decode_tps > 0 and st.ttft_ms > 0 and st.prefill_tps > 0

        gen = eng.generate(GenerationRequest(prompt=prompt, max_tokens=LONG, sampling=GREEDY))
        seen = 0
        async for batch in gen:
            seen += len(batch)
            st = eng.stats()
            assert st.lanes_busy == 1
            assert len(prompt) + seen <= st.kv_used <= LONG
            if seen >= 16:
                break  # leaving the loop cancels
        await until_idle(eng)
        assert eng.stats().lanes_busy == 0
    finally:
        await eng.close()


async def test_round_robin_fallback(
    tiny_model: str, vocab: MlxVocab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose cache mlx-lm cannot batch runs its lanes in turn."""
    prompts = [vocab.encode(chat("a cat")), vocab.encode(chat("the moon and the rain"))]
    ref = MlxEngine(tiny_model, model_name="tiny", lanes=2, max_context=WINDOW)
    await ref.start()
    try:
        want = [(await run(ref, p, 20))[0] for p in prompts]
    finally:
        await ref.close()
    monkeypatch.setattr("engine.runtimes.mlx._batchable", lambda caches: False)
    eng = MlxEngine(tiny_model, model_name="tiny", lanes=2, max_context=WINDOW)
    await eng.start()
    try:
        assert not eng.batched
        results = await asyncio.gather(*(run(eng, p, 20) for p in prompts))
        assert [out for out, _ in results] == want
        assert all(res.finish_reason == "length" for _, res in results)
        gen = eng.generate(GenerationRequest(prompt=prompts[0], max_tokens=500))
        async for _batch in gen:
            gen.cancel()
        assert gen.result.finish_reason == "cancelled"
        await until_idle(eng)
        # each lane keeps its last sequence: the cancelled one, and the other prompt's
        held = len(prompts[0]) + gen.result.completion_tokens + len(prompts[1]) + 20
        assert eng.stats().kv_parked == held
    finally:
        await eng.close()


async def test_missing_model_is_named(tiny_model: str, tmp_path: Path) -> None:
    eng = MlxEngine(str(tmp_path / "absent"), model_name="x", lanes=1)
    with pytest.raises(FileNotFoundError, match="neither an MLX model folder"):
        await eng.start()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="--runtime llamacpp"):
        await MlxEngine(str(gguf), model_name="x", lanes=1).start()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        await MlxEngine(str(tmp_path), model_name="x", lanes=1).start()


def test_vocab_round_trip(vocab: MlxVocab) -> None:
    from tests.e2e.mlx_tiny import CHATML, EOS_TEXT

    text = "Hello, wörld! 日本語 and the quick brown fox."
    ids = vocab.encode(text)
    assert len(ids) < len(text.encode())  # the merges are used
    assert vocab.decode(ids) == text
    assert b"".join(vocab.token_bytes(t) for t in ids) == text.encode()

    eos = vocab.encode(EOS_TEXT)
    assert len(eos) == 1 and set(eos) == set(vocab.eos_ids)
    assert vocab.eos_text == EOS_TEXT and vocab.special_text(eos[0]) == EOS_TEXT
    assert vocab.token_bytes(eos[0]) == b""
    # without special parsing the marker is plain text
    plain = vocab.encode(EOS_TEXT, special=False)
    assert len(plain) > 1 and vocab.decode(plain) == EOS_TEXT

    framed = vocab.encode(chat("hi"))
    assert framed[0] == vocab.encode("<|im_start|>")[0]
    assert vocab.decode(framed) == "user\nhi\nassistant\n"

    assert vocab.bos_text == "" and not vocab.add_bos
    assert vocab.chat_template() == CHATML
    meta = vocab.metadata()
    assert meta["general.architecture"] == "llama"
    assert meta["general.name"] == "tiny-llama"
    assert meta["tokenizer.chat_template"] == CHATML
    assert vocab.fim_ids() is None
    assert vocab.token_bytes(-1) == b"" and vocab.special_text(10**6) == ""


def test_vocab_feeds_the_head(vocab: MlxVocab) -> None:
    from engine.head.prompt.templates import load_chat_template

    template = load_chat_template(
        vocab.metadata(),
        chat_template=vocab.chat_template(),
        bos_text=vocab.bos_text,
        eos_text=vocab.eos_text,
    )
    text = template.render(
        [{"role": "user", "content": "hi"}], tools=None, add_generation_prompt=True
    )
    assert vocab.encode(text) == vocab.encode(chat("hi"))

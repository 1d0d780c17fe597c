"""The mlx runtime's prompt cache and KV pool, on the tiny model the tests build.

A lane keeps its sequence's cache after the request; the next turn of the
conversation prefills only what is new, and greedy output is the same as a fresh
engine's. The pool commits each generation's prompt and answer reserve, refuses
what does not fit, and reclaims parked lanes least recently used first.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.runtimes.base import GenerationRequest, Sampling
from engine.runtimes.decode_thread import PoolFull
from engine.runtimes.mlx import MlxEngine, MlxVocab, reuse_cache
from tests.e2e.engine_run import GREEDY, run, started, until_idle
from tests.e2e.mlx_tiny import EOS_TEXT, build_tiny_model, chat, mlx_import_error

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(120)]

WINDOW = 1024
LONG = 4096
GROW = 2048  # a window the growth test fills in a few seconds
# greedy, with penalties that look back over the prompt
PENALISED = Sampling(temperature=0.0, repeat_penalty=1.5, presence_penalty=2.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    error = mlx_import_error()
    if error is not None:
        pytest.skip(error)
    root = tmp_path_factory.mktemp("mlx-cache")
    return {
        "full": str(build_tiny_model(root / "tiny-llama")),
        "sliding": str(build_tiny_model(root / "tiny-sliding", sliding_window=24)),
    }


@pytest.fixture(scope="module")
def tiny_model(models: dict[str, str]) -> str:
    return models["full"]


@pytest.fixture(scope="module")
def vocab(tiny_model: str) -> MlxVocab:
    return MlxVocab(tiny_model)


@pytest.fixture(params=["batched", "round-robin"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a lane runs: in mlx-lm's batch, and the round-robin fallback that a
    model whose cache cannot batch gets (forced here on the same model)."""
    if request.param == "round-robin":
        monkeypatch.setattr("engine.runtimes.mlx._batchable", lambda caches: False)
    return str(request.param)


def tiny(path: str, **kw: object) -> MlxEngine:
    return MlxEngine(path, model_name="tiny", **kw)  # type: ignore[arg-type]


async def fresh_run(path: str, prompt: list[int], max_tokens: int,
                    sampling: Sampling = GREEDY) -> list[int]:
    """What an engine with nothing cached answers."""
    async with started(tiny(path, lanes=1, max_context=WINDOW)) as eng:
        out, res = await run(eng, prompt, max_tokens, sampling=sampling)
    assert res.cached_tokens == 0
    return out


def next_turn(vocab: MlxVocab, prompt: list[int], answer: list[int], user: str) -> list[int]:
    """The conversation's next prompt: what was said, the answer closed, a new turn."""
    return prompt + answer + vocab.encode(EOS_TEXT + "\n" + chat(user))


# -- reuse ------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, PENALISED], ids=["greedy", "penalties"])
async def test_the_second_turn_prefills_only_what_is_new(
        tiny_model: str, vocab: MlxVocab, mode: str, sampling: Sampling) -> None:
    first = vocab.encode(chat("What is the capital of France?"))
    async with started(tiny(tiny_model, lanes=2, max_context=WINDOW)) as eng:
        answer, res1 = await run(eng, first, 24, sampling=sampling, session="s")
        assert res1.cached_tokens == 0 and len(answer) == 24
        second = next_turn(vocab, first, answer, "And the capital of Italy?")
        before = eng.stats()
        gen = eng.generate(GenerationRequest(prompt=second, max_tokens=24, sampling=sampling,
                                             session="s"))
        out = [tok async for batch in gen for tok in batch]
        res2 = gen.result
        after = eng.stats()
        assert gen.prefilled == len(second)  # what it reports read: the reused part too
    # the lane held the first prompt and its whole answer (mlx-lm feeds each token
    # before it hands it over): all of it is reused, the new turn is prefilled
    reused = len(first) + len(answer)
    assert res2.cached_tokens == reused
    assert after.prompt_from_lanes - before.prompt_from_lanes == reused
    assert after.prompt_prefilled - before.prompt_prefilled == len(second) - reused
    assert after.prompt_from_host == before.prompt_from_host == 0
    assert out == await fresh_run(tiny_model, second, 24, sampling)


async def test_an_edited_turn_keeps_the_common_prefix(
        tiny_model: str, vocab: MlxVocab, mode: str) -> None:
    first = vocab.encode(chat("Write a short poem about the sea, the moon and the rain."))
    async with started(tiny(tiny_model, lanes=1, max_context=WINDOW)) as eng:
        answer, _ = await run(eng, first, 16)
        # the same prompt again: all but its last token, which is read for its logits
        again, res = await run(eng, first, 16)
        assert res.cached_tokens == len(first) - 1
        assert again == answer
        # the user edits the turn: the lane's cache is trimmed to what is shared
        edited = vocab.encode(chat("Write a short poem about the sun."))
        shared = next(i for i, (a, b) in enumerate(zip(first, edited, strict=False)) if a != b)
        assert shared >= 16  # enough for the lane to be chosen by its prefix
        out, res = await run(eng, edited, 16)
        assert res.cached_tokens == shared
    assert out == await fresh_run(tiny_model, edited, 16)


async def test_a_cache_that_cannot_be_trimmed_starts_afresh(
        models: dict[str, str], vocab: MlxVocab, mode: str) -> None:
    """The sliding-window layer's cache has wrapped after 24 tokens: it is kept when the
    next prompt extends all it holds, and replaced when it would need a trim."""
    path = models["sliding"]
    first = vocab.encode(chat("Write a short poem about the sea, the moon and the rain."))
    assert len(first) > 24
    async with started(tiny(path, lanes=1, max_context=WINDOW)) as eng:
        answer, _ = await run(eng, first, 16)
        second = next_turn(vocab, first, answer, "Another one.")
        extended, res = await run(eng, second, 16)
        assert res.cached_tokens == len(first) + len(answer)
        edited, res = await run(eng, first, 16)  # shares a prefix, but needs a trim
        assert res.cached_tokens == 0
    assert extended == await fresh_run(path, second, 16)
    assert edited == answer


def test_reuse_cache_trims_what_it_can() -> None:
    """On mlx-lm's own cache types: a KV cache is trimmed to the prefix; a sliding
    window that has wrapped is not, and the lane starts afresh (0 kept)."""
    if (error := mlx_import_error()) is not None:
        pytest.skip(error)
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    def filled(cache: KVCache | RotatingKVCache, n: int) -> list[KVCache | RotatingKVCache]:
        cache.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
        return [cache]

    kv = filled(KVCache(), 10)
    assert reuse_cache(kv, 10, 6) == 6 and kv[0].offset == 6
    assert reuse_cache(kv, 6, 6) == 6 and kv[0].offset == 6  # nothing to trim
    wrapped = filled(RotatingKVCache(max_size=8), 10)
    assert reuse_cache(wrapped, 10, 6) == 0
    assert reuse_cache(wrapped, 10, 10) == 10  # the prompt extends it: kept as it is
    short = filled(RotatingKVCache(max_size=8), 5)
    assert reuse_cache(short, 5, 3) == 3 and short[0].offset == 3
    assert reuse_cache(None, 0, 0) == 0
    assert reuse_cache(filled(KVCache(), 4), 4, 0) == 0


# -- the pool ---------------------------------------------------------------------


def tokens(n: int, seed: int) -> list[int]:
    """``n`` plain tokens (no control token), different from the first for each seed."""
    return [3 + (seed * 101 + i * 17) % 300 for i in range(n)]


async def test_the_pool_refuses_what_does_not_fit_what_is_committed(tiny_model: str) -> None:
    async with started(tiny(tiny_model, lanes=2, max_context=LONG)) as eng:
        # one window, shared by the two lanes, within the default budget
        assert eng.pool_cells == LONG and eng.stats().kv_total == LONG
        assert eng.stats().mem_budget == eng.memory_budget_bytes > 0
        # committed at once: 2,000 prompt tokens and a 512-token answer reserve
        holder = eng.generate(GenerationRequest(prompt=tokens(2000, 1), max_tokens=LONG,
                                                sampling=GREEDY))
        room = LONG - 2512 - 512  # the longest prompt that still fits, with its reserve
        assert eng.admission(room, 512) is None
        why = eng.admission(room + 1, 512)
        assert why is not None and "KV pool is full" in why
        with pytest.raises(PoolFull):
            eng.generate(GenerationRequest(prompt=tokens(room + 1, 2), max_tokens=512))
        holder.cancel()
        await holder.wait()
        assert eng.admission(room + 1, 512) is None  # its commitment is released


async def test_parked_lanes_are_reclaimed_least_recently_used_first(tiny_model: str) -> None:
    a, b, c = (tokens(1500, seed) for seed in (1, 2, 3))
    async with started(tiny(tiny_model, lanes=3, max_context=LONG)) as eng:
        assert eng.pool_cells == LONG
        await run(eng, a, 8, session="a")
        await run(eng, b, 8, session="b")
        assert eng.stats().kv_parked == 2 * 1508
        # c's 1,508 cells do not fit beside a's and b's: a, the older, is dropped
        await run(eng, c, 8, session="c")
        await until_idle(eng)
        assert eng.stats().kv_parked == 2 * 1508
        b_out, _ = await run(eng, b, 8, session="b")
        _, res_b = await run(eng, b + b_out + tokens(20, 4), 8, session="b")
        assert res_b.cached_tokens == 1508
        _, res_a = await run(eng, a + tokens(20, 5), 8, session="a")
        assert res_a.cached_tokens == 0


async def test_an_answer_grows_past_its_reserve_until_the_pool_is_full(
        tiny_model: str, vocab: MlxVocab, caplog: pytest.LogCaptureFixture) -> None:
    prompt = vocab.encode(chat("Tell me everything."))
    limit = GROW - len(prompt)
    async with started(tiny(tiny_model, lanes=2, max_context=GROW)) as eng:
        assert eng.pool_cells == GROW  # one window for the two lanes
        with caplog.at_level(logging.WARNING, logger="shoal.node"):
            runs = await asyncio.gather(run(eng, prompt, GROW), run(eng, prompt, GROW))
        await until_idle(eng)
        parked = eng.stats().kv_parked
    results = [res for _, res in runs]
    short, long = sorted(results, key=lambda r: r.completion_tokens)
    # both grew cell by cell past their 512-token reserve; when the pool was full the
    # one ahead ended, and the other took its parked cells to run to the window
    assert short.finish_reason == long.finish_reason == "length"
    assert 512 < short.completion_tokens < limit
    assert long.completion_tokens == limit
    assert parked == GROW  # the one that ran on holds the window; the other was reclaimed
    assert short.prompt_tokens + short.completion_tokens >= GROW // 2
    assert any("the KV pool is full" in r.getMessage() for r in caplog.records)


# -- idle unload --------------------------------------------------------------------


async def test_suspend_then_resume_serves_the_same(
        tiny_model: str, vocab: MlxVocab, mode: str) -> None:
    prompt = vocab.encode(chat("Name a fruit."))
    async with started(tiny(tiny_model, lanes=2, max_context=WINDOW)) as eng:
        before, _ = await run(eng, prompt, 16, session="s")
        await eng.suspend()
        assert eng.asleep
        st = eng.stats()
        assert st.kv_used == 0 and st.kv_parked == 0
        with pytest.raises(RuntimeError, match="not running"):
            eng.generate(GenerationRequest(prompt=prompt, max_tokens=4))
        await eng.resume()
        assert not eng.asleep
        after, res = await run(eng, prompt, 16, session="s")
        assert after == before
        assert res.cached_tokens == 0  # the caches went with the model
        again, res = await run(eng, prompt, 16, session="s")
        assert again == before and res.cached_tokens == len(prompt) - 1

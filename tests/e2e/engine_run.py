"""Driving an engine directly, as the node agent does: shared by the runtime tests."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator
from typing import TypeVar

from engine.runtimes.base import Engine, GenerationRequest, GenerationResult, Sampling
from tests.waiting import until

GREEDY = Sampling(temperature=0.0)
E = TypeVar("E", bound=Engine)


@contextlib.asynccontextmanager
async def started(eng: E) -> AsyncIterator[E]:
    """``eng`` started, and closed when the block ends."""
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


async def run(eng: Engine, prompt: list[int], max_tokens: int, *, sampling: Sampling = GREEDY,
              session: str = "",
              stop: frozenset[int] = frozenset()) -> tuple[list[int], GenerationResult]:
    """Every token ``eng`` generates for ``prompt`` (each batch non-empty), and its result."""
    gen = eng.generate(GenerationRequest(prompt=prompt, max_tokens=max_tokens,
                                         sampling=sampling, session=session, stop_ids=stop))
    out: list[int] = []
    async for batch in gen:
        assert batch
        out.extend(batch)
    return out, gen.result


async def until_idle(eng: Engine, timeout: float = 30.0) -> None:
    """Wait until no lane of ``eng`` is busy (a generous bound: a busy machine slows it)."""
    async def idle() -> bool:
        gc.collect()  # a generation dropped unread frees its lane from its finalizer
        return eng.stats().lanes_busy == 0

    await until(idle, "every lane to be free", timeout=timeout)

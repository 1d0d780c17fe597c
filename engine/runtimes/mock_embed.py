"""The mock embedding model: deterministic vectors for tests of the head's embedding
routes and of the link, with no model file. A vector is the sum of one pseudo-random
vector per input token (so texts that share words point alike), scaled to length 1.

The mock runtime serves it for a model whose name ends in ``MOCK_EMBED_SUFFIX``."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

from engine.runtimes.base import (
    Embeddings,
    EngineInfo,
    EngineStats,
    Generation,
    GenerationRequest,
)
from engine.runtimes.embedding import pack, unit

MOCK_EMBED_SUFFIX = "-embed"
DIMS = 32
VOCAB = 256  # the mock vocabulary's bytes; its control tokens never reach an embedding


@lru_cache(maxsize=VOCAB)
def _token_vector(token: int) -> tuple[float, ...]:
    raw = hashlib.sha256(token.to_bytes(4, "little")).digest()
    return tuple((b - 127.5) / 127.5 for b in raw[:DIMS])


def vector(ids: Sequence[int]) -> list[float]:
    """The mock model's embedding of ``ids`` (before packing)."""
    total = [0.0] * DIMS
    for tok in ids:
        for i, x in enumerate(_token_vector(tok)):
            total[i] += x
    return unit(total)


class MockEmbedder:
    """An engine of the mock runtime that makes embeddings and no text."""

    def __init__(self, *, model: str, lanes: int = 8, context_window: int = 512) -> None:
        self.info = EngineInfo(model=model, runtime="mock", context_window=context_window,
                               lanes=lanes, path="(built in)", window_pinned=True)
        self.inputs = 0  # inputs embedded so far

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def generate(self, request: GenerationRequest) -> Generation:
        raise ValueError(f"'{self.info.model}' is an embedding model and makes no text")

    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        for ids in inputs:
            if len(ids) > self.info.context_window:
                raise ValueError(f"an input of {len(ids)} tokens exceeds the model's window "
                                 f"of {self.info.context_window}; shorten it")
            if any(not 0 <= t < VOCAB for t in ids):
                raise ValueError("an input holds ids outside the model's vocabulary")
        self.inputs += len(inputs)
        return Embeddings(dims=DIMS, count=len(inputs),
                          vectors=pack(vector(ids) for ids in inputs),
                          tokens=sum(len(ids) for ids in inputs))

    def stats(self) -> EngineStats:
        return EngineStats(lanes=self.info.lanes, lanes_busy=0, kv_used=0, kv_total=0,
                           prefill_tps=0.0, decode_tps=0.0, ttft_ms=0.0)


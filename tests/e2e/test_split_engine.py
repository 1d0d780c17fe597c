"""A split model's engine in this process against a lending machine's RPC server started
as the node starts it (engine.node.lending's Lender, on loopback, no link between): its
layers are shared as planned, it keeps its CPU threads
between graphs (a split's every token is several graphs), and it answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.node.lending import Lender
from engine.runtimes.base import GenerationRequest, Sampling
from engine.runtimes.llamacpp import LlamaCppEngine
from engine.sizes import MiB
from tests.e2e.conftest import gemma_gguf  # noqa: F401  # the real GGUF, cached per machine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_a_split_engine_keeps_its_cpu_threads_between_graphs(
        tmp_path: Path, gemma_gguf: Path) -> None:  # noqa: F811
    lender = Lender(tmp_path / "desk", lend_bytes=150 * MiB, threads=1)
    port = await lender._ensure()
    engine = LlamaCppEngine(gemma_gguf, model_name="gemma", lanes=1, max_context=512,
                            split_with=((f"127.0.0.1:{port}", 150 * MiB, "desk (x:1)"),))
    try:
        await engine.start()
        assert engine.kept_threadpool  # not new threads for every graph of every token
        off = engine.offload
        assert off is not None and 0 < off.layers < off.of - 1
        assert engine.split_parts == (off.layers,)
        gen = engine.generate(GenerationRequest(prompt=[2, 651, 3925], max_tokens=8,
                                                sampling=Sampling(temperature=0.0)))
        assert len([t async for batch in gen for t in batch]) == 8
    finally:
        await engine.close()
        await lender.close()
    assert not engine.kept_threadpool  # freed with its context

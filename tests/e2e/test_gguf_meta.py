"""A GGUF's scalar metadata through ggml's own parser (engine.runtimes.gguf_meta), on the
real files: what tells an embedding model from a text one without loading a vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.runtimes import gguf_meta, llamacpp, registry

pytestmark = pytest.mark.e2e


def test_the_header_says_the_architecture_and_pooling(smollm2_gguf: Path, minilm_gguf: Path,
                                                      tmp_path: Path) -> None:
    lib = llamacpp.library()
    smol = gguf_meta.read_metadata(lib, str(smollm2_gguf), ["general.name", "no.such.key"],
                                   arch_keys=["context_length", "pooling_type"])
    assert smol["general.architecture"] == "llama"
    assert smol["llama.context_length"] == "8192"
    assert "no.such.key" not in smol and "llama.pooling_type" not in smol
    bert = gguf_meta.read_metadata(lib, str(minilm_gguf), [], arch_keys=["pooling_type"])
    assert bert == {"general.architecture": "bert", "bert.pooling_type": "1"}  # mean
    assert registry.makes_embeddings("llamacpp", str(minilm_gguf))
    assert not registry.makes_embeddings("llamacpp", str(smollm2_gguf))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"is not a GGUF file llama\.cpp can read"):
        gguf_meta.read_metadata(lib, str(junk), [])


def test_the_repeating_layers_are_weighed_apart_from_the_embeddings(
        gemma_gguf: Path, tmp_path: Path) -> None:
    """What a split lends is the repeating layers; Gemma 3 270M's 262k-word embeddings (its
    output layer too) are most of its file and stay on the serving machine."""
    lib = llamacpp.library()
    blocks = gguf_meta.block_bytes(lib, str(gemma_gguf))
    size = gemma_gguf.stat().st_size
    assert 0 < blocks < size // 2
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"is not a GGUF file llama\.cpp can read"):
        gguf_meta.block_bytes(lib, str(junk))

"""What every runtime's embeddings share: which models make them, and their wire form."""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence

# architectures llama.cpp runs as encoders only: they make embeddings, never text
ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2",
                           "jina-bert-v3", "modern-bert", "neo-bert", "t5encoder"})
# llama.cpp's llama_pooling_type: NONE makes one vector per token (no sentence embedding),
# UNSPECIFIED leaves it to the model's default
_NO_POOLING = frozenset({"", "0", "-1"})


def is_embedding_model(metadata: Mapping[str, str]) -> bool:
    """Whether a GGUF's metadata says its model makes embeddings: a pooling type of its
    own (BERT's mean, Qwen3-Embedding's last token), or an encoder-only architecture."""
    arch = metadata.get("general.architecture", "")
    pooling = metadata.get(f"{arch}.pooling_type")
    if pooling is not None:
        return pooling.strip() not in _NO_POOLING
    return arch in ENCODER_ARCHS


def unit(vector: Sequence[float]) -> list[float]:
    """``vector`` scaled to length 1 (a zero vector stays zero), as OpenAI's are."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else [0.0] * len(vector)


def pack(vectors: Iterable[Sequence[float]]) -> bytes:
    """Vectors as float32, little-endian, one after another (Embedded.vectors)."""
    out = array("f")
    for v in vectors:
        out.extend(v)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def unpack(data: bytes, dims: int) -> list[list[float]]:
    """The vectors of ``pack``, ``dims`` values each."""
    flat = array("f")
    flat.frombytes(data)
    if sys.byteorder != "little":
        flat.byteswap()
    return [flat[i:i + dims].tolist() for i in range(0, len(flat), dims)]

"""The same model on both ends, checked: how a head's vocabulary and a node's engine
tokenize a few fixed strings, and where they differ. Pure.

A head sends its ids for :data:`PROBE_TEXTS` in its hello; a node that fronts an
engine it did not load (llama-server, vLLM) asks that engine for the same strings
and refuses a head whose model has the name it announces but tokenizes otherwise:
token ids crossing the link would mean other words there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

# plain words, punctuation, digits, code, and text outside ASCII: tokenizers of
# different families part ways on at least one of them
PROBE_TEXTS: tuple[str, ...] = (
    "Hello, world",
    " The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "naïve café, Zürich 東京 🙂",
    "1234567 + 0.25 = ?",
)
MAX_PROBE_IDS = 256  # per text: a peer's probe longer than this is refused at decoding


def without_bos(ids: Sequence[int], bos: Sequence[int]) -> list[int]:
    """``ids`` without the leading BOS that some vocabularies add on their own."""
    if bos and list(ids[:len(bos)]) == list(bos):
        return list(ids[len(bos):])
    return list(ids)


class Encodes(Protocol):
    """What the probe needs of a vocabulary (engine.runtimes.base.Tokenizer has it)."""

    def encode(self, text: str, *, special: bool = True) -> list[int]: ...


def head_probe(vocab: Encodes) -> list[list[int]]:
    """The head's ids for :data:`PROBE_TEXTS`: plain text (no control tokens), no BOS."""
    bos = vocab.encode("", special=False)  # [BOS] where the vocabulary adds one, else []
    return [without_bos(vocab.encode(text, special=False), bos)[:MAX_PROBE_IDS]
            for text in PROBE_TEXTS]


class Mismatch(NamedTuple):
    text: str
    head: list[int]
    engine: list[int]

    def describe(self) -> str:
        return f"{self.text!r} → {_short(self.engine)} vs {_short(self.head)}"


def mismatch(head: Sequence[Sequence[int]], engine: Sequence[Sequence[int]]) -> Mismatch | None:
    """The first probe string the two tokenize differently, or None when they agree.

    An empty ``head`` (a head older than the probe) or one of another length (a head
    with other probe strings) is not checked.
    """
    if len(head) != len(PROBE_TEXTS) or len(engine) != len(PROBE_TEXTS):
        return None
    for text, theirs, ours in zip(PROBE_TEXTS, head, engine, strict=True):
        if list(theirs[:MAX_PROBE_IDS]) != list(ours[:MAX_PROBE_IDS]):
            return Mismatch(text, list(theirs), list(ours))
    return None


def _short(ids: Sequence[int], keep: int = 8) -> str:
    shown = ", ".join(str(i) for i in ids[:keep])
    return f"[{shown}{', …' if len(ids) > keep else ''}]"

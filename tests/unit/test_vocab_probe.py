"""The same model on both ends: comparing probe ids, and the hello that carries them
staying compatible with peers older and newer than the probe."""

from __future__ import annotations

import msgspec
import pytest

from engine.link import messages as m
from engine.runtimes.mock import MockTokenizer
from engine.runtimes.probe import MAX_PROBE_IDS, PROBE_TEXTS, head_probe, mismatch


class _OldHeadHello(msgspec.Struct, frozen=True, array_like=True, tag="head_hello",
                    tag_field="t"):
    """HeadHello as Shoal sent and read it before the probe."""

    head_id: str
    model: str
    protocol: int = 1
    listen_port: int = 0


class _BosVocab:
    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return [1, *(ord(c) for c in text)]


def test_head_probe_has_one_list_per_text_without_bos() -> None:
    probe = head_probe(_BosVocab())
    assert len(probe) == len(PROBE_TEXTS)
    assert probe[0] == [ord(c) for c in PROBE_TEXTS[0]]  # the BOS the vocabulary adds is gone
    assert head_probe(MockTokenizer())[0] == list(PROBE_TEXTS[0].encode())


def test_mismatch_names_the_first_string_that_differs() -> None:
    ours = [[1, 2], [3], [4], [5], [6]]
    assert mismatch(ours, [list(x) for x in ours]) is None
    theirs = [[1, 2], [3], [4, 4], [5], [6]]
    found = mismatch(theirs, ours)
    assert found is not None and found.text == PROBE_TEXTS[2]
    assert found.describe() == f"{PROBE_TEXTS[2]!r} → [4] vs [4, 4]"  # engine vs head
    assert mismatch([], ours) is None  # a head older than the probe is not checked
    assert mismatch(theirs[:3], ours) is None  # nor one with other probe strings


def test_hello_probe_is_bounded() -> None:
    too_long = m.HeadHello(head_id="h", model="x", probe=[[1] * (MAX_PROBE_IDS + 1)])
    with pytest.raises(m.RecordError):
        m.decode(m.encode(too_long))


def test_an_older_node_reads_a_newer_heads_hello() -> None:
    new = m.HeadHello(head_id="h", model="smollm2", listen_port=8454,
                      probe=head_probe(MockTokenizer()))
    old = msgspec.msgpack.decode(m.encode(new), type=_OldHeadHello)
    assert (old.head_id, old.model, old.listen_port) == ("h", "smollm2", 8454)


def test_a_newer_node_reads_an_older_heads_hello_with_an_empty_probe() -> None:
    got = m.decode(msgspec.msgpack.encode(_OldHeadHello("h", "smollm2", 1, 8454)))
    assert got == m.HeadHello(head_id="h", model="smollm2", listen_port=8454, probe=[])

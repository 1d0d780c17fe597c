"""The GGUF header reader: where a header ends, told from prefixes of the two real test
GGUFs, and crafted headers it must refuse in one line (every count and length judged
before it is used)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.models.pulls import gguf_header
from engine.models.pulls.gguf_header import Complete, HeaderError, NeedMore, header_extent
from tests.e2e.conftest import gemma_gguf, smollm2_gguf  # noqa: F401  # cached per machine

# where each header ends and its tensor data begins, as llama.cpp's gguf reader finds them
KNOWN = {"smollm2": (1785664, 1785664, 272, 33), "gemma": (6525112, 6525120, 236, 33)}


@pytest.fixture(params=sorted(KNOWN))
def real(request: pytest.FixtureRequest, smollm2_gguf: Path, gemma_gguf: Path  # noqa: F811
         ) -> tuple[str, bytes, int]:
    path = {"smollm2": smollm2_gguf, "gemma": gemma_gguf}[request.param]
    with path.open("rb") as f:
        return request.param, f.read(8 << 20), path.stat().st_size


def test_a_real_header_is_complete_where_it_ends(real: tuple[str, bytes, int]):
    name, data, size = real
    end, data_at, tensors, kv = KNOWN[name]
    found = header_extent(data[:end], file_size=size)
    assert found == Complete(size=end, data_offset=data_at, version=3, n_tensors=tensors,
                             n_kv=kv, alignment=32, split_count=1, split_no=0)
    assert header_extent(data, file_size=size) == found  # the tensors after it change nothing


@pytest.mark.parametrize("cut", [0, 3, 4, 8, 23, 24, 100, 4096, 500_000, -4096, -1])
def test_a_cut_header_asks_for_more_and_never_past_its_end(real: tuple[str, bytes, int],
                                                           cut: int):
    name, data, size = real
    end = KNOWN[name][0]
    have = cut if cut >= 0 else end + cut
    found = header_extent(data[:have], file_size=size)
    assert isinstance(found, NeedMore)
    assert 1 <= found.at_least <= end - have  # a lower bound: asking for it overshoots nothing


def test_growing_as_the_fetch_does_reaches_the_end_in_a_few_steps(
        real: tuple[str, bytes, int]):
    name, data, _ = real
    have, asked = 1024, []
    while isinstance(found := header_extent(data[:have]), NeedMore):
        have = max(have + found.at_least, 2 * have)  # header_fetch's growth
        asked.append(have)
    assert found.size == KNOWN[name][0] <= have
    assert len(asked) == (11 if name == "smollm2" else 13)  # 1 KiB doubled past the end


# -- crafted headers --------------------------------------------------------------------

def s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def kv(key: bytes, kind: int, value: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + value


def tensor(name: bytes = b"t", dims: tuple[int, ...] = (4,), kind: int = 0,
           offset: int = 0) -> bytes:
    return (s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", kind, offset))


def gguf(kvs: Sequence[bytes] = (), tensors: Sequence[bytes] = (), *, version: int = 3,
         n_kv: int | None = None, n_tensors: int | None = None, magic: bytes = b"GGUF") -> bytes:
    return (magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv)
            + b"".join(kvs) + b"".join(tensors))


U32, STR, ARR, U64 = 4, 8, 9, 10
GOOD = gguf([kv(b"general.architecture", STR, s(b"llama")),
             kv(b"general.alignment", U32, struct.pack("<I", 64)),
             kv(b"tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 2) + s(b"a") + s(b"b")),
             kv(b"split.count", 2, struct.pack("<H", 3)), kv(b"split.no", 2, struct.pack("<H", 0))],
            [tensor(b"w", (4, 2), 0, 0), tensor(b"b", (4,), 0, 64)])


def test_a_crafted_header_reads_its_alignment_and_split():
    found = header_extent(GOOD)
    assert found == Complete(size=len(GOOD), data_offset=-(-len(GOOD) // 64) * 64, version=3,
                             n_tensors=2, n_kv=5, alignment=64, split_count=3, split_no=0)
    assert header_extent(GOOD[:-1]) == NeedMore(1)


HUGE = 1 << 62
BAD = {
    "not gguf": (gguf(magic=b"GGML"), "does not start with GGUF"),
    "version 1": (gguf(version=1), "version 1"),
    "version 4": (gguf(version=4), "version 4"),
    "tensors": (gguf(n_tensors=HUGE), "tensors"),
    "keys": (gguf(n_kv=HUGE), "keys"),
    "key length": (gguf(n_kv=1) + struct.pack("<Q", HUGE), "a key of"),
    "string length": (gguf(n_kv=1) + s(b"k") + struct.pack("<IQ", STR, HUGE), "a string of"),
    "array count": (gguf(n_kv=1) + s(b"k") + struct.pack("<IIQ", ARR, U64, HUGE), "items"),
    "nested arrays": (gguf([kv(b"k", ARR, struct.pack("<IQ", ARR, 1))]), "nests arrays"),
    "value type": (gguf([kv(b"k", 13, b"")]), "unknown type 13"),
    "array item type": (gguf([kv(b"k", ARR, struct.pack("<IQ", 99, 1))]), "unknown type 99"),
    "alignment": (gguf([kv(b"general.alignment", U32, struct.pack("<I", 48))]), "alignment 48"),
    "no dims": (gguf([], [tensor(dims=())]), "0 dimensions"),
    "five dims": (gguf([], [tensor(dims=(1, 1, 1, 1, 1))]), "5 dimensions"),
    "dim": (gguf([], [tensor(dims=(HUGE,))]), "absurdly large"),
    "tensor type": (gguf([], [tensor(kind=1000)]), "unknown type"),
    "offset": (gguf([], [tensor(offset=HUGE)]), "past any file's end"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_header_is_refused_in_one_line(case: str):
    data, says = BAD[case]
    with pytest.raises(HeaderError) as refused:
        header_extent(data + b"\0" * 64)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_header_longer_than_its_file_is_refused():
    with pytest.raises(HeaderError, match="reaches byte"):
        header_extent(GOOD, file_size=len(GOOD) - 1)
    assert isinstance(header_extent(GOOD, file_size=-(-len(GOOD) // 64) * 64 + 64), Complete)


def test_a_header_past_the_cap_is_refused_before_its_bytes(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(gguf_header, "MAX_HEADER_BYTES", 1000)
    data = gguf([kv(b"k", STR, s(b"x" * 2000))])
    with pytest.raises(HeaderError, match="goes on past 1000 B"):
        header_extent(data[:200])  # refused with 200 bytes in hand: it asks for no more

"""How many bytes a GGUF file's header takes, told from a prefix of the file (pure).

A head needs a model's tokenizer and chat template, which live in the header; the
tensors after it are the model's bulk. `header_extent(prefix)` walks the header as far
as ``prefix`` goes:

    magic "GGUF", version (2 or 3), n_tensors, n_kv            (u32, u32, u64, u64)
    n_kv times: key (string), value type (u32), value          (arrays: type, count, items)
    n_tensors times: name (string), n_dims (u32), dims (u64 each), type (u32), offset (u64)

and answers `Complete` (the header ends at ``size``; tensor data starts at
``data_offset``, aligned to ``general.alignment``) or `NeedMore` (at least ``at_least``
more bytes before it can say). Little-endian only, as llama.cpp writes it.

The bytes come from a peer (the hub), so every count and length is judged before it is
used: an absurd one raises `HeaderError` with one line, never a huge allocation or a
request for gigabytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from engine.sizes import amount

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 used 32-bit counts; llama.cpp reads it no more
# a 256k vocabulary with merges takes ~20 MB; parsing costs ~0.14 s of CPU per MB, so a
# hostile header of 256 MB cost 35 s and half a gigabyte before it was refused
MAX_HEADER_BYTES = 48 << 20
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 16
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 24  # a chat template is kilobytes; a token a few bytes
MAX_ARRAY_ITEMS = 1 << 24  # vocabularies reach a few hundred thousand tokens
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_TYPE = 255  # ggml's types are under 64; llama.cpp judges the exact set
MAX_DIM = 1 << 40
MAX_FILE_BYTES = 1 << 42  # as the hub module bounds a file
DEFAULT_ALIGNMENT = 32

# GGUF value types: fixed sizes (string 8 and array 9 are walked)
_STRING, _ARRAY, _UINT32, _UINT16 = 8, 9, 4, 2
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class HeaderError(ValueError):
    """Not a GGUF header this reader takes; the message is one line."""


@dataclass(frozen=True, slots=True)
class Complete:
    size: int  # bytes from the start of the file to the end of the tensor infos
    data_offset: int  # where the tensor data begins (size, padded to the alignment)
    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    split_count: int  # split.count (1: the model is one file)
    split_no: int  # split.no (0: the first shard, or the only file)


@dataclass(frozen=True, slots=True)
class NeedMore:
    at_least: int  # more bytes wanted after the prefix (a lower bound)


class _Short(Exception):
    def __init__(self, end: int) -> None:
        self.end = end  # the byte the walk needed to reach


class _Cursor:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > MAX_HEADER_BYTES:
            raise HeaderError(f"the GGUF header goes on past {amount(MAX_HEADER_BYTES)}; "
                              "it is not a model header this head reads")
        if end > len(self.data):
            raise _Short(end)
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def u16(self) -> int:
        return int(struct.unpack("<H", self.take(2))[0])

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self, limit: int, what: str) -> memoryview:
        n = self.u64()
        if n > limit:
            raise HeaderError(f"the GGUF header gives {what} of {n} bytes (at most {limit}); "
                              "the file is damaged or not a GGUF model")
        return self.take(n)


def header_extent(prefix: bytes | bytearray | memoryview, *, file_size: int | None = None
                  ) -> Complete | NeedMore:
    """Where the header of the GGUF file starting with ``prefix`` ends, or how many more
    bytes that takes to say. ``file_size``: the whole file's, when known (a header or a
    tensor reaching past it is refused). HeaderError (one line) when it is no header."""
    cur = _Cursor(prefix)
    try:
        return _walk(cur, file_size)
    except _Short as short:
        return NeedMore(at_least=short.end - len(cur.data))


def _walk(cur: _Cursor, file_size: int | None) -> Complete:
    if bytes(cur.take(4)) != MAGIC:
        raise HeaderError("the file does not start with GGUF; it is not a GGUF model")
    version = cur.u32()
    if version not in VERSIONS:
        raise HeaderError(f"GGUF version {version} is not read here (only 2 and 3); use a "
                          "newer conversion of the model")
    n_tensors, n_kv = cur.u64(), cur.u64()
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise HeaderError(f"the GGUF header claims {n_tensors} tensors and {n_kv} keys (at "
                          f"most {MAX_TENSORS} and {MAX_KV}); the file is damaged")
    alignment, split_count, split_no = DEFAULT_ALIGNMENT, 1, 0
    for _ in range(n_kv):
        key = bytes(cur.string(MAX_KEY_BYTES, "a key"))
        kind = cur.u32()
        if key == b"general.alignment" and kind == _UINT32:
            alignment = cur.u32()
            if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                raise HeaderError(f"the GGUF header's alignment {alignment} is not a power "
                                  "of two up to 1 MB; the file is damaged")
        elif key == b"split.count" and kind == _UINT16:
            split_count = cur.u16()
        elif key == b"split.no" and kind == _UINT16:
            split_no = cur.u16()
        else:
            _skip_value(cur, kind)
    data_size = 0
    for _ in range(n_tensors):
        cur.string(MAX_KEY_BYTES, "a tensor name")
        n_dims = cur.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise HeaderError(f"a tensor of the GGUF header has {n_dims} dimensions (1 to "
                              f"{MAX_DIMS}); the file is damaged")
        for _ in range(n_dims):
            if cur.u64() > MAX_DIM:
                raise HeaderError("a tensor of the GGUF header is absurdly large; the file "
                                  "is damaged")
        if cur.u32() > MAX_TENSOR_TYPE:
            raise HeaderError("a tensor of the GGUF header has an unknown type; the file is "
                              "damaged or newer than this reader")
        offset = cur.u64()
        if offset > MAX_FILE_BYTES:
            raise HeaderError("a tensor of the GGUF header starts past any file's end; the "
                              "file is damaged")
        data_size = max(data_size, offset)
    size = cur.pos
    data_offset = -(-size // alignment) * alignment
    if file_size is not None and data_offset + data_size > file_size:
        raise HeaderError(f"the GGUF header reaches byte {data_offset + data_size} of a file "
                          f"of {file_size}; the file is damaged or not this one")
    return Complete(size=size, data_offset=data_offset, version=2 if version == 2 else 3,
                    n_tensors=n_tensors, n_kv=n_kv, alignment=alignment,
                    split_count=split_count, split_no=split_no)


def _skip_value(cur: _Cursor, kind: int) -> None:
    if kind == _STRING:
        cur.string(MAX_STRING_BYTES, "a string")
        return
    if kind != _ARRAY:
        cur.take(_fixed(kind))
        return
    item, count = cur.u32(), cur.u64()
    if count > MAX_ARRAY_ITEMS:
        raise HeaderError(f"an array of the GGUF header claims {count} items (at most "
                          f"{MAX_ARRAY_ITEMS}); the file is damaged")
    if item == _ARRAY:
        raise HeaderError("the GGUF header nests arrays, which llama.cpp does not read; the "
                          "file is damaged")
    if item == _STRING:
        for _ in range(count):
            cur.string(MAX_STRING_BYTES, "a string")
        return
    cur.take(_fixed(item) * count)  # bounded: count and the item size are


def _fixed(kind: int) -> int:
    size = _FIXED.get(kind)
    if size is None:
        raise HeaderError(f"the GGUF header holds a value of unknown type {kind}; the file "
                          "is damaged or newer than this reader")
    return size

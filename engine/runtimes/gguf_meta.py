"""A GGUF file's scalar metadata, read by ggml's own parser (``gguf_init_from_file`` with
no tensor data) through llama.cpp's library: milliseconds, where loading the model's
vocabulary to read the same keys took most of a second for a 262K-token vocabulary
(blocking: run it off the loop)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable
from typing import Any

# ggml's enum gguf_type: the scalar types read here, and how
_STRING = 8
_READERS = {0: ("gguf_get_val_u8", ctypes.c_uint8), 1: ("gguf_get_val_i8", ctypes.c_int8),
            2: ("gguf_get_val_u16", ctypes.c_uint16), 3: ("gguf_get_val_i16", ctypes.c_int16),
            4: ("gguf_get_val_u32", ctypes.c_uint32), 5: ("gguf_get_val_i32", ctypes.c_int32),
            7: ("gguf_get_val_bool", ctypes.c_bool), 10: ("gguf_get_val_u64", ctypes.c_uint64),
            11: ("gguf_get_val_i64", ctypes.c_int64)}


class _InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_typed = threading.Lock()
_ready: Any = None


def _api(cdll: Any) -> Any:
    """The library with the gguf functions' signatures set (once)."""
    global _ready
    with _typed:
        if _ready is not None:
            return _ready
        cdll.gguf_init_from_file.argtypes = [ctypes.c_char_p, _InitParams]
        cdll.gguf_init_from_file.restype = ctypes.c_void_p
        cdll.gguf_free.argtypes = [ctypes.c_void_p]
        cdll.gguf_free.restype = None
        cdll.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        cdll.gguf_find_key.restype = ctypes.c_int64
        cdll.gguf_get_kv_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        cdll.gguf_get_kv_type.restype = ctypes.c_int
        cdll.gguf_get_val_str.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        cdll.gguf_get_val_str.restype = ctypes.c_char_p
        for name, kind in _READERS.values():
            fn = getattr(cdll, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
            fn.restype = kind
        cdll.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
        cdll.gguf_get_n_tensors.restype = ctypes.c_int64
        cdll.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        cdll.gguf_get_tensor_name.restype = ctypes.c_char_p
        cdll.gguf_get_tensor_size.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        cdll.gguf_get_tensor_size.restype = ctypes.c_size_t
        _ready = cdll
        return cdll


def read_metadata(cdll: Any, path: str, keys: Iterable[str],
                  arch_keys: Iterable[str] = ()) -> dict[str, str]:
    """``keys`` of the GGUF at ``path`` that it has with a scalar value, as strings (an
    integer in decimal, a bool as 0 or 1), and ``arch_keys`` under its architecture's
    prefix (``pooling_type``: ``bert.pooling_type``); ValueError when ggml cannot read
    the file."""
    api = _api(cdll)
    ctx = api.gguf_init_from_file(path.encode(), _InitParams(True, None))
    if not ctx:
        raise ValueError(f"{path} is not a GGUF file llama.cpp can read")
    out: dict[str, str] = {}
    try:
        for key in ["general.architecture", *keys]:
            _read(api, ctx, key, out)
        arch = out.get("general.architecture", "")
        for key in arch_keys:
            _read(api, ctx, f"{arch}.{key}", out)
    finally:
        api.gguf_free(ctx)
    return out


def _read(api: Any, ctx: int, key: str, out: dict[str, str]) -> None:
    at = api.gguf_find_key(ctx, key.encode())
    if at < 0:
        return
    kind = api.gguf_get_kv_type(ctx, at)
    if kind == _STRING:
        raw = api.gguf_get_val_str(ctx, at)
        out[key] = raw.decode("utf-8", "replace") if raw is not None else ""
    elif kind in _READERS:
        out[key] = str(int(getattr(api, _READERS[kind][0])(ctx, at)))


def block_bytes(cdll: Any, path: str) -> int:
    """The bytes of the GGUF at ``path``'s repeating layers (its ``blk.N.`` tensors): the
    rest (the embeddings, the output layer, their norms) is what a split keeps on the
    serving machine whatever the layers lent. ValueError when ggml cannot read it."""
    api = _api(cdll)
    ctx = api.gguf_init_from_file(path.encode(), _InitParams(True, None))
    if not ctx:
        raise ValueError(f"{path} is not a GGUF file llama.cpp can read")
    try:
        total = 0
        for i in range(int(api.gguf_get_n_tensors(ctx))):
            if (api.gguf_get_tensor_name(ctx, i) or b"").startswith(b"blk."):
                total += int(api.gguf_get_tensor_size(ctx, i))
        return total
    finally:
        api.gguf_free(ctx)

"""Outside JSON and TOML, parsed with a bound on nesting (pure).

Clients, peers and files choose how deep their arrays and objects nest. The C
decoders (json, msgspec) and tomllib recurse once per level and raise
RecursionError near Python's recursion limit, which is no ValueError and so
slips past every handler written for malformed input; a structure just under
that limit still breaks code that walks it later (templates, ``json.dumps``).
Every parse of outside input goes through here and refuses more than
``MAX_DEPTH`` levels with :class:`TooDeep`, a ValueError like any other
malformed input. JSON is measured before it is decoded, on its brackets at C
speed (walking the decoded objects in Python would cost many times the decode);
TOML, which comes from local files only, is walked once decoded.
"""

from __future__ import annotations

import itertools
import json
import tomllib
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import msgspec

# serde_json's default; a tool's JSON schema nests a dozen levels
MAX_DEPTH = 128

T = TypeVar("T")
_CONTAINERS = (dict, list, tuple)


class TooDeep(ValueError):
    def __init__(self, limit: int = MAX_DEPTH) -> None:
        super().__init__(f"arrays and objects nested deeper than {limit} levels")
        self.limit = limit


def _containers(value: object) -> Iterator[object]:
    """The children of a dict, list or tuple that are containers themselves."""
    items = value.values() if isinstance(value, dict) else value
    assert isinstance(items, Iterable)
    return (c for c in items if isinstance(c, _CONTAINERS))


def check_depth(value: object, limit: int = MAX_DEPTH) -> None:
    """Raise TooDeep when dicts, lists or tuples in ``value`` nest past ``limit``."""
    if not isinstance(value, _CONTAINERS):
        return
    # a stack of iterators, one per open level: a recursive walk would hit the very
    # limit it guards against, and a stack of pending items would grow with the width
    stack = [_containers(value)]
    while stack:
        for child in stack[-1]:
            if len(stack) >= limit:
                raise TooDeep(limit)
            stack.append(_containers(child))
            break
        else:
            stack.pop()


_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _steps(data: str | bytes | bytearray | memoryview) -> bytes:
    """The JSON text's brackets outside strings, as +1 and -1 (signed bytes)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    # drop escaped backslashes, then escaped quotes (pairs match left to right as the
    # JSON lexer reads them): every quote left opens or closes a string
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(raw.split(b'"')[::2])
    return outside.translate(_STEPS, _NOT_BRACKETS)


def json_depth(data: str | bytes | bytearray | memoryview) -> int:
    """How deep arrays and objects nest in the JSON text ``data``, without decoding it.

    Exact for valid JSON (invalid JSON is refused by its decoder anyway), at C speed
    and linear in the text: strings dropped, brackets kept as +1/-1, the deepest
    running sum taken."""
    return max(itertools.accumulate(memoryview(_steps(data)).cast("b")), default=0)


def _check_json(data: str | bytes | bytearray | memoryview, limit: int) -> None:
    steps = _steps(data)
    if steps.count(1) <= limit:  # fewer openings than the limit: no need to sum
        return
    if max(itertools.accumulate(memoryview(steps).cast("b"))) > limit:
        raise TooDeep(limit)


def json_loads(data: str | bytes | bytearray, limit: int = MAX_DEPTH) -> Any:
    """``json.loads``; TooDeep (a ValueError) past ``limit`` levels."""
    _check_json(data, limit)
    try:
        return json.loads(data)
    except RecursionError:  # only with a limit near the interpreter's own
        raise TooDeep(limit) from None


def json_raw_decode(decoder: json.JSONDecoder, text: str, idx: int,
                    limit: int = MAX_DEPTH) -> tuple[Any, int]:
    """``decoder.raw_decode(text, idx)``; TooDeep (a ValueError) past ``limit`` levels.

    The text after the value may be anything, so the depth is measured on the value
    once decoded; past the interpreter's recursion limit the decoder stops first."""
    try:
        value, end = decoder.raw_decode(text, idx)
    except RecursionError:
        raise TooDeep(limit) from None
    _check_json(text[idx:end], limit)
    return value, end


def toml_loads(text: str, limit: int = MAX_DEPTH) -> dict[str, Any]:
    """``tomllib.loads``; TooDeep (a ValueError) past ``limit`` levels."""
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        raise TooDeep(limit) from None
    check_depth(doc, limit)
    return doc


def msgspec_decode(decoder: msgspec.json.Decoder[T], data: bytes | memoryview,
                   limit: int = MAX_DEPTH) -> T:
    """``decoder.decode(data)``; TooDeep past ``limit`` levels (measured before decoding,
    skipped unknown fields included), msgspec's own errors as they are."""
    _check_json(data, limit)
    try:
        return decoder.decode(data)
    except RecursionError:  # only with a limit near the interpreter's own
        raise TooDeep(limit) from None

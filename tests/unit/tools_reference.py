"""The tool-call parsers as they were before they became linear, frozen as a reference.

The tests check that the new parsers give the same content and calls on any text
that this one handles (it raised RecursionError on deeply nested JSON). Do not edit.
"""

# ruff: noqa
# mypy: ignore-errors
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

PARSERS = ("hermes", "llama3", "mistral", "none")
_BY_FAMILY = {
    "chatml": "hermes",
    "gemma": "hermes",
    "phi3": "hermes",
    "llama3": "llama3",
    "mistral": "mistral",
}


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """OpenAI streaming shape: the first delta of a call carries id and name,
    later ones (if any) only append to the arguments."""

    index: int
    id: str | None
    name: str | None
    arguments_fragment: str


Delta = TextDelta | ToolCallDelta


@dataclass(frozen=True, slots=True)
class _Call:
    name: str
    arguments: str  # a JSON object, serialised
    id: str | None = None  # when the model wrote one (Mistral)


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def collect(deltas: Iterable[Delta]) -> tuple[str, list[dict[str, Any]]]:
    """Content and OpenAI ``tool_calls`` from a sequence of deltas."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if isinstance(d, TextDelta):
            text.append(d.text)
            continue
        call = calls.setdefault(
            d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if d.id:
            call["id"] = d.id
        if d.name:
            call["function"]["name"] = d.name
        call["function"]["arguments"] += d.arguments_fragment
    return "".join(text), [calls[i] for i in sorted(calls)]


# --- helpers shared by the parsers ---------------------------------------------


def _held_len(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``buf`` that could begin one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


def _arguments(value: Any) -> str | None:
    """Arguments as a JSON object string, or None when they are not an object."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call_from(obj: Any, *, keys: tuple[str, ...], require_args: bool = False) -> _Call | None:
    """A call from ``{"name", <one of keys>}``, also nested as ``{"function": {...}}``."""
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function")
    if isinstance(fn, dict) and "name" not in obj:
        merged = {**fn, **({"id": obj["id"]} if "id" in obj else {})}
        return _call_from(merged, keys=keys, require_args=require_args)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    if any(k in obj for k in keys):
        args = _arguments(next(obj[k] for k in keys if k in obj))
    elif require_args:
        return None
    else:
        args = "{}"
    if args is None:
        return None
    call_id = obj.get("id")
    return _Call(name.strip(), args, call_id if isinstance(call_id, str) and call_id else None)


def _calls_from(
    value: Any, *, keys: tuple[str, ...], require_args: bool = False
) -> list[_Call] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call_from(v, keys=keys, require_args=require_args) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


_DECODER = json.JSONDecoder()


def _json_sequence(text: str, seps: str) -> list[Any] | None:
    """Every JSON value in ``text``, separated by whitespace or ``seps``; None if other text."""
    values: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or (values and text[i] in seps)):
            i += 1
        if i >= n:
            return values or None
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _flatten(values: list[Any] | None) -> list[Any]:
    # a model may write several calls as one JSON array or as a run of objects
    return [x for v in values or [] for x in (v if isinstance(v, list) else [v])]


class _TextOut:
    """Plain text on its way out: trailing whitespace waits, so that the blank
    line a model writes before a call does not become content; whitespace
    right after a call is dropped for the same reason."""

    def __init__(self) -> None:
        self.pending_ws = ""
        self.strip_lead = False
        self.any_call = False

    def text(self, s: str) -> list[Delta]:
        if self.strip_lead:
            s = s.lstrip()
            if not s:
                return []
            self.strip_lead = False
        body = s.rstrip()
        if not body:
            self.pending_ws += s
            return []
        out: list[Delta] = [TextDelta(self.pending_ws + body)]
        self.pending_ws = s[len(body) :]
        return out

    def calls_follow(self) -> None:
        self.pending_ws = ""
        self.strip_lead = True
        self.any_call = True

    def finish(self) -> list[Delta]:
        ws, self.pending_ws = self.pending_ws, ""
        return [TextDelta(ws)] if ws and not self.any_call else []


# --- the parsers -----------------------------------------------------------------


class ToolCallParser(ABC):
    """Incremental parser of one generation: ``feed`` chunks, then ``finish`` once."""

    name: ClassVar[str]

    def __init__(self, *, id_factory: Callable[[], str] | None = None) -> None:
        self._id_factory = id_factory or _new_id
        self._out = _TextOut()
        self._index = 0

    @abstractmethod
    def feed(self, text: str) -> list[Delta]: ...

    @abstractmethod
    def finish(self) -> list[Delta]: ...

    def parse_complete(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content and OpenAI ``tool_calls`` of a whole output (a fresh parser's view)."""
        fresh = type(self)(id_factory=self._id_factory)
        return collect([*fresh.feed(text), *fresh.finish()])

    def _emit_calls(self, calls: list[_Call]) -> list[Delta]:
        self._out.calls_follow()
        out: list[Delta] = []
        for c in calls:
            out.append(ToolCallDelta(self._index, c.id or self._id_factory(), c.name, c.arguments))
            self._index += 1
        return out


class NoToolParser(ToolCallParser):
    """``--tool-call-parser none``: everything is text, untouched."""

    name = "none"

    def feed(self, text: str) -> list[Delta]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[Delta]:
        return []


class HermesParser(ToolCallParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, *, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self.OPEN)
                if i < 0:
                    n = len(self._buf) - _held_len(self._buf, (self.OPEN,))
                    out += self._out.text(self._buf[:n])
                    self._buf = self._buf[n:]
                    return out
                out += self._out.text(self._buf[:i])
                self._buf = self._buf[i + len(self.OPEN) :]
                self._in_call = True
            else:
                j = self._buf.find(self.CLOSE)
                if j < 0:
                    return out
                inner = self._buf[:j]
                self._buf = self._buf[j + len(self.CLOSE) :]
                self._in_call = False
                out += self._call_or_text(inner, self.OPEN + inner + self.CLOSE)

    def finish(self) -> list[Delta]:
        buf, self._buf = self._buf, ""
        if self._in_call:
            # a stop token often cuts the closing tag; a complete JSON still counts
            self._in_call = False
            out = self._call_or_text(buf, self.OPEN + buf)
        else:
            out = self._out.text(buf)
        return out + self._out.finish()

    def _call_or_text(self, inner: str, raw: str) -> list[Delta]:
        flat = _flatten(_json_sequence(inner, ""))
        calls = _calls_from(flat, keys=("arguments", "parameters")) if flat else None
        return self._emit_calls(calls) if calls else self._out.text(raw)


class Llama3Parser(ToolCallParser):
    name = "llama3"
    TAG = "<|python_tag|>"
    _KEYS = ("name", "type", "function")  # first keys of a JSON call

    def __init__(self, *, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._buf = ""
        self._state = "start"  # start -> text | call (held to the end)
        self._raw_prefix = ""  # what to give back as text if the call is not one

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while True:
            if self._state == "start":
                s = self._buf.lstrip()
                lead = self._buf[: len(self._buf) - len(s)]
                if not s or (self.TAG.startswith(s) and s != self.TAG):
                    return out
                if s.startswith(self.TAG):
                    self._state, self._raw_prefix = "call", lead + self.TAG
                    self._buf = s[len(self.TAG) :]
                    continue
                verdict = self._json_call_head(s)
                if verdict is None:
                    return out
                self._state = "call" if verdict else "text"
                if verdict:
                    self._raw_prefix, self._buf = lead, s
            elif self._state == "text":
                i = self._buf.find(self.TAG)
                if i < 0:
                    n = len(self._buf) - _held_len(self._buf, (self.TAG,))
                    out += self._out.text(self._buf[:n])
                    self._buf = self._buf[n:]
                    return out
                out += self._out.text(self._buf[:i])
                self._state, self._raw_prefix = "call", self.TAG
                self._buf = self._buf[i + len(self.TAG) :]
            else:
                return out  # a call runs to the end of the message

    def finish(self) -> list[Delta]:
        buf, self._buf = self._buf, ""
        out: list[Delta] = []
        if self._state == "call":
            flat = _flatten(_json_sequence(buf, ";,"))
            # no markers around it, so ordinary JSON output such as {"name": "Bob"}
            # must not pass for a call: the arguments key is required
            keys = ("parameters", "arguments")
            calls = _calls_from(flat, keys=keys, require_args=True) if flat else None
            out = self._emit_calls(calls) if calls else self._out.text(self._raw_prefix + buf)
        else:
            out = self._out.text(buf)
        self._state = "text"
        return out + self._out.finish()

    @classmethod
    def _json_call_head(cls, s: str) -> bool | None:
        """Does ``s`` open like a JSON call? None while it cannot tell yet."""
        if not s.startswith("{"):
            return False
        rest = s[1:].lstrip()
        if not rest:
            return None
        if rest[0] != '"':
            return False
        key = rest[1:]
        for k in cls._KEYS:
            if key.startswith(k + '"'):
                return True
            if (k + '"').startswith(key):
                return None
        return False


class MistralParser(ToolCallParser):
    name = "mistral"
    MARK = "[TOOL_CALLS]"
    _V11 = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*")  # name[ARGS]{...}

    def __init__(self, *, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._run(closing_seen=any(c in text for c in "]}"))

    def _run(self, *, closing_seen: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self.MARK)
                if i < 0:
                    n = len(self._buf) - _held_len(self._buf, (self.MARK,))
                    out += self._out.text(self._buf[:n])
                    self._buf = self._buf[n:]
                    return out
                out += self._out.text(self._buf[:i])
                self._buf = self._buf[i + len(self.MARK) :]
                self._in_call = True
                closing_seen = True  # the rest of the buffer is new to the call
            else:
                # a call ends with "]" or "}": decode only when one arrived
                if not closing_seen:
                    return out
                decoded = self._decode(self._buf)
                if decoded is None:
                    return out
                calls, end = decoded
                raw = self._buf[:end]
                self._buf = self._buf[end:]
                self._in_call = False
                out += self._emit_calls(calls) if calls else self._out.text(self.MARK + raw)

    def _decode(self, buf: str) -> tuple[list[_Call] | None, int] | None:
        """(calls or None if the JSON is not calls, end) once a value is complete."""
        s = buf.lstrip()
        start = len(buf) - len(s)
        if s.startswith(("[", "{")):
            try:
                value, end = _DECODER.raw_decode(buf, start)
            except ValueError:
                return None
            return _calls_from(value, keys=("arguments", "parameters")), end
        m = self._V11.match(buf)
        if m is None or m.end() >= len(buf) or buf[m.end()] != "{":
            return None
        try:
            value, end = _DECODER.raw_decode(buf, m.end())
        except ValueError:
            return None
        return _calls_from({"name": m[1], "arguments": value}, keys=("arguments",)), end

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._in_call:
            out += self._run(closing_seen=True)
        if self._in_call:  # never became a complete call
            self._in_call = False
            out += self._out.text(self.MARK + self._buf)
        else:
            out += self._out.text(self._buf)
        self._buf = ""
        return out + self._out.finish()


_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3Parser, MistralParser, NoToolParser)
}


def parser_for(
    name: str | None, family: str, *, id_factory: Callable[[], str] | None = None
) -> ToolCallParser:
    """A fresh parser: ``name`` from ``--tool-call-parser``, or None to follow the family."""
    key = name if name is not None else _BY_FAMILY.get(family, "hermes")
    try:
        cls = _PARSERS[key]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; use one of: {', '.join(PARSERS)}"
        ) from None
    return cls(id_factory=id_factory)

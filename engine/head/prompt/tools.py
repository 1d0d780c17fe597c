"""Tool calls in model output, turned into OpenAI ``tool_calls``.

Three output formats, chosen by ``--tool-call-parser`` or by the template family:

- ``hermes`` (Qwen, ChatML models, and our Gemma/Phi-3 fallbacks):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or several;
- ``llama3``: the whole message is ``{"name": ..., "parameters": {...}}``
  (several separated by ``;`` or newlines), or such JSON after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, and
  the newer ``[TOOL_CALLS]name[ARGS]{...}``.

The parsers are incremental for streaming. Ordinary text passes through at
once, except a tail that might be the start of a marker (held until the next
chunk decides it) and trailing whitespace (dropped when a call follows). A
call is announced whole, id, name and arguments in one :class:`ToolCallDelta`,
once its JSON is complete and valid: announcing a name before the arguments
parse would leave a broken call in the client when they don't. Malformed JSON
inside markers comes out as plain text, markers included; nothing raises.

Every decision depends only on the text seen so far, never on how it was
chunked, so streaming and :meth:`ToolCallParser.parse_complete` agree.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from engine import nesting

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
            value = nesting.json_loads(value) if value.strip() else {}
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


def _raw_decode(text: str, idx: int) -> tuple[Any, int]:
    """One JSON value of model output; a ValueError when malformed or nested too deep."""
    return nesting.json_raw_decode(_DECODER, text, idx)


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
            value, i = _raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _flatten(values: list[Any] | None) -> list[Any]:
    # a model may write several calls as one JSON array or as a run of objects
    return [x for v in values or [] for x in (v if isinstance(v, list) else [v])]


class _Pieces:
    """Text that grows by appends and is read whole once: ``s += t`` on an
    attribute copies ``s`` every time, which makes a long stream quadratic."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.size = 0

    def append(self, s: str) -> None:
        if s:
            self._parts.append(s)
            self.size += len(s)

    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


class _TextOut:
    """Plain text on its way out: trailing whitespace waits, so that the blank
    line a model writes before a call does not become content; whitespace
    right after a call is dropped for the same reason."""

    def __init__(self) -> None:
        self.pending_ws = _Pieces()
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
            self.pending_ws.append(s)
            return []
        out: list[Delta] = [TextDelta(self.pending_ws.text() + body)]
        self.pending_ws = _Pieces()
        self.pending_ws.append(s[len(body) :])
        return out

    def calls_follow(self) -> None:
        self.pending_ws = _Pieces()
        self.strip_lead = True
        self.any_call = True

    def finish(self) -> list[Delta]:
        ws, self.pending_ws = self.pending_ws.text(), _Pieces()
        return [TextDelta(ws)] if ws and not self.any_call else []


# --- the parsers -----------------------------------------------------------------


class ToolCallParser(ABC):
    """Incremental parser of one generation: ``feed`` chunks, then ``finish`` once.

    A feed works by position within its chunk and buffers a call's text in
    pieces joined once, so its cost is linear in the chunk, never in what came
    before. ``steps`` counts the characters looked at, searched, joined and decoded.
    """

    name: ClassVar[str]

    def __init__(self, *, id_factory: Callable[[], str] | None = None) -> None:
        self._id_factory = id_factory or _new_id
        self._out = _TextOut()
        self._index = 0
        self._held = ""  # outside a call: a tail of plain text that may begin a marker
        self.steps = 0

    @abstractmethod
    def feed(self, text: str) -> list[Delta]: ...

    @abstractmethod
    def finish(self) -> list[Delta]: ...

    @classmethod
    def opener(cls, name: str | None) -> str | None:
        """The text that begins a call in this format, up to the arguments when ``name``
        is given, else up to the name. A turn whose answer must be a call starts with
        it (the model continues from there); None when the format has no call to open.
        """
        return None

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

    def _plain_until(self, buf: str, pos: int, marker: str, out: list[Delta]) -> int:
        """Plain text of ``buf`` from ``pos`` up to ``marker``: the index just past the
        marker, or -1 when there is none (a tail that may begin it goes to ``_held``)."""
        i = buf.find(marker, pos)
        self.steps += (len(buf) if i < 0 else i + len(marker)) - pos
        if i >= 0:
            out.extend(self._out.text(buf[pos:i]))
            return i + len(marker)
        n = len(buf) - _held_len(buf[max(pos, len(buf) - len(marker) + 1) :], (marker,))
        out.extend(self._out.text(buf[pos:n]))
        self._held = buf[n:]
        return -1

    def _join(self, pieces: _Pieces) -> str:
        self.steps += pieces.size
        return pieces.text()


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

    @classmethod
    def opener(cls, name: str | None) -> str | None:
        head = cls.OPEN + '\n{"name": '
        return head + '"' if name is None else f"{head}{json.dumps(name)}, \"arguments\": "

    def __init__(self, *, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._in_call = False
        self._inner = _Pieces()  # inside a call: the text after OPEN so far
        self._tail = ""  # its last characters, which may begin CLOSE

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        buf, self._held = self._held + text, ""  # a held tail only comes outside a call
        pos = 0
        while pos < len(buf):
            if not self._in_call:
                pos = self._plain_until(buf, pos, self.OPEN, out)
                if pos < 0:
                    break
                self._in_call, self._inner, self._tail = True, _Pieces(), ""
                continue
            close = self._find_close(buf, pos)
            if close is None:
                rest = buf[pos:]
                self._inner.append(rest)
                keep = len(self.CLOSE) - 1
                self._tail = (self._tail + rest)[-keep:] if len(rest) < keep else rest[-keep:]
                break
            share, cut, pos = close
            self._inner.append(share)
            inner = self._join(self._inner)
            inner = inner[: len(inner) - cut]
            self._in_call = False
            out += self._call_or_text(inner, self.OPEN + inner + self.CLOSE)
        return out

    def _find_close(self, buf: str, pos: int) -> tuple[str, int, int] | None:
        """CLOSE from ``pos`` on, or None: (this chunk's share of the call text, how
        much of CLOSE the call text already ends with, the index past CLOSE)."""
        if self._tail:  # CLOSE may begin in the call text before this chunk
            probe = self._tail + buf[pos : pos + len(self.CLOSE) - 1]
            self.steps += len(probe)
            j = probe.find(self.CLOSE)
            if 0 <= j < len(self._tail):
                cut = len(self._tail) - j
                return "", cut, pos + len(self.CLOSE) - cut
        j = buf.find(self.CLOSE, pos)
        self.steps += (len(buf) if j < 0 else j + len(self.CLOSE)) - pos
        return None if j < 0 else (buf[pos:j], 0, j + len(self.CLOSE))

    def finish(self) -> list[Delta]:
        if self._in_call:
            # a stop token often cuts the closing tag; a complete JSON still counts
            self._in_call = False
            buf = self._join(self._inner)
            out = self._call_or_text(buf, self.OPEN + buf)
        else:
            out = self._out.text(self._held)
        self._held = ""
        return out + self._out.finish()

    def _call_or_text(self, inner: str, raw: str) -> list[Delta]:
        self.steps += len(inner)
        flat = _flatten(_json_sequence(inner, ""))
        calls = _calls_from(flat, keys=("arguments", "parameters")) if flat else None
        return self._emit_calls(calls) if calls else self._out.text(raw)


_HEAD_PROBE = 16  # non-blank characters enough to tell the tag or a call's first key


class Llama3Parser(ToolCallParser):
    name = "llama3"
    TAG = "<|python_tag|>"
    _KEYS = ("name", "type", "function")  # first keys of a JSON call

    @classmethod
    def opener(cls, name: str | None) -> str | None:
        return '{"name": "' if name is None else f'{{"name": {json.dumps(name)}, "parameters": '

    def __init__(self, *, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._state = "start"  # start -> text | call (held to the end)
        self._start = _Pieces()  # the text while undecided
        self._lead = 0  # its leading whitespace
        self._probe = ""  # its first non-blank characters, blanks after a "{" dropped
        self._call = _Pieces()  # in a call: everything after the prefix
        self._raw_prefix = ""  # what to give back as text if the call is not one

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if self._state == "start":
            text = self._decide(text)
            if self._state == "start":
                return out
        if self._state == "text":
            buf, self._held = self._held + text, ""
            pos = self._plain_until(buf, 0, self.TAG, out)
            if pos < 0:
                return out
            self._state, self._raw_prefix, text = "call", self.TAG, buf[pos:]
        self.steps += len(text)
        self._call.append(text)  # a call runs to the end of the message
        return out

    def _decide(self, text: str) -> str:
        """Take ``text`` while undecided; once decided, the text the new state begins with."""
        self.steps += len(text)
        self._start.append(text)
        if not self._probe or self._probe == "{":
            text = text.lstrip()
            if not self._probe:
                self._lead = self._start.size - len(text)
                if text.startswith("{"):
                    self._probe, text = "{", text[1:].lstrip()
        self._probe += text[: _HEAD_PROBE - len(self._probe)]
        p = self._probe
        if not p or (self.TAG.startswith(p) and p != self.TAG):
            return ""
        tag = p.startswith(self.TAG)
        verdict = True if tag else self._json_call_head(p)
        if verdict is None:
            return ""
        whole = self._join(self._start)
        if tag:
            self._state = "call"
            self._raw_prefix = whole[: self._lead + len(self.TAG)]
            return whole[self._lead + len(self.TAG) :]
        if verdict:
            self._state, self._raw_prefix = "call", whole[: self._lead]
            return whole[self._lead :]
        self._state = "text"
        return whole

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._state == "call":
            buf = self._join(self._call)
            flat = _flatten(_json_sequence(buf, ";,"))
            # no markers around it, so ordinary JSON output such as {"name": "Bob"}
            # must not pass for a call: the arguments key is required
            keys = ("parameters", "arguments")
            calls = _calls_from(flat, keys=keys, require_args=True) if flat else None
            out = self._emit_calls(calls) if calls else self._out.text(self._raw_prefix + buf)
        elif self._state == "start":
            out = self._out.text(self._join(self._start))
        else:
            out = self._out.text(self._held)
        self._state, self._held = "text", ""
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


_BLANKS = re.compile(r"\s*")
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_JSON_MARK = re.compile(r'[\[\]{}"]')  # outside a string, only these change the depth
_STRING_MARK = re.compile(r'["\\]')
_ARGS = "[ARGS]"


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS]`` then a JSON array or object, or ``name[ARGS]{...}``.

    After the marker, a small scanner reads each character once: blanks, then
    either a JSON value or a name, blanks, an optional ``[ARGS]``, blanks and an
    object. It follows brackets and strings to the end of the value and only
    then decodes it, once. Text that cannot become a call (no name, another
    character where ``{`` belongs, a value that does not decode or nests deeper
    than ``nesting.MAX_DEPTH``) makes the call dead: the marker and everything
    after it come out as text at the end, as a malformed call always did.
    """

    name = "mistral"
    MARK = "[TOOL_CALLS]"

    @classmethod
    def opener(cls, name: str | None) -> str | None:
        head = cls.MARK + '[{"name": '
        return head + '"' if name is None else f'{head}{json.dumps(name)}, "arguments": '

    def __init__(self, *, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._in_call = False
        self._reset_call()

    def _reset_call(self) -> None:
        self._call = _Pieces()  # the text after MARK
        self._phase = "lead"  # lead, name, ws2, args, ws3, json or dead
        self._args_seen = 0  # characters of "[ARGS]" matched
        self._name = (0, 0)  # where the name is in the call text
        self._v11 = False  # name[ARGS]{...} rather than a JSON array or object
        self._start = 0  # where the JSON value begins in the call text
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        buf, self._held = self._held + text, ""  # a held tail only comes outside a call
        pos = 0
        while pos < len(buf):
            if not self._in_call:
                pos = self._plain_until(buf, pos, self.MARK, out)
                if pos < 0:
                    break
                self._in_call = True
                self._reset_call()
                continue
            end = self._scan(buf, pos, self._call.size - pos)
            if end is None:  # the call goes on past this chunk
                self._call.append(buf[pos:])
                break
            self._call.append(buf[pos:end])
            deltas = self._complete()
            if deltas is None:  # dead: the rest of the output belongs to it
                self._call.append(buf[end:])
                break
            out += deltas
            pos = end
        return out

    def _scan(self, buf: str, i: int, shift: int) -> int | None:
        """Advance from ``i`` (``buf[k]`` is at ``k + shift`` in the call text); the index
        in ``buf`` just past the value once it is complete, else None."""
        n = len(buf)
        start = i
        try:
            while i < n:
                phase = self._phase
                if phase == "dead":
                    return None
                if phase == "json":
                    return self._scan_json(buf, i)
                if phase in ("lead", "ws2", "ws3"):
                    i = _match_end(_BLANKS, buf, i)
                    if i == n:
                        return None
                    c = buf[i]
                    if c == "{" or (c == "[" and phase == "lead"):
                        self._phase, self._start, self._depth = "json", i + shift, 0
                        self._v11 = self._name[1] > self._name[0]
                    elif c == "[" and phase == "ws2":
                        self._phase = "args"
                    elif phase == "lead" and _match_end(_NAME, buf, i) > i:
                        self._phase, self._name = "name", (i + shift, i + shift)
                    else:
                        self._phase = "dead"
                elif phase == "name":
                    i = _match_end(_NAME, buf, i)
                    self._name = (self._name[0], i + shift)
                    if i < n:
                        # what follows the name: blanks, "[ARGS]" or "{" (checked there)
                        self._phase = "ws2"
                else:  # args
                    want = _ARGS[self._args_seen :]
                    got = buf[i : i + len(want)]
                    if not want.startswith(got):
                        self._phase = "dead"  # "{" had to come where "[" is
                        continue
                    i += len(got)
                    self._args_seen += len(got)
                    if self._args_seen == len(_ARGS):
                        self._phase = "ws3"
            return None
        finally:
            self.steps += i - start

    def _scan_json(self, buf: str, i: int) -> int | None:
        """Follow brackets and strings from ``i``; the index just past the value's
        closing bracket, or None when it is still open (or dead)."""
        start, n = i, len(buf)
        try:
            while i < n:
                if self._escaped:
                    self._escaped, i = False, i + 1
                    continue
                if self._in_string:
                    m = _STRING_MARK.search(buf, i)
                    if m is None:
                        i = n
                        return None
                    i = m.end()
                    if m[0] == "\\":
                        self._escaped = True
                    else:
                        self._in_string = False
                    continue
                m = _JSON_MARK.search(buf, i)
                if m is None:
                    i = n
                    return None
                i = m.end()
                c = m[0]
                if c == '"':
                    self._in_string = True
                elif c in "[{":
                    self._depth += 1
                    if self._depth > nesting.MAX_DEPTH:
                        self._phase = "dead"  # too deep to decode: never a call
                        return None
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        return i
            return None
        finally:
            self.steps += i - start

    def _complete(self) -> list[Delta] | None:
        """The call text ends with a complete value: decode it once; None if it is dead."""
        whole = self._join(self._call)
        self.steps += len(whole) - self._start
        try:
            value, end = _raw_decode(whole, self._start)
        except ValueError:
            end = -1
        if end != len(whole):
            # malformed inside (the decoder and the scanner agree on where valid JSON
            # ends): no later text can mend it, so the rest is text too
            self._phase = "dead"
            return None
        if self._v11:
            name = whole[self._name[0] : self._name[1]]
            calls = _calls_from({"name": name, "arguments": value}, keys=("arguments",))
        else:
            calls = _calls_from(value, keys=("arguments", "parameters"))
        self._in_call = False
        self._reset_call()
        return self._emit_calls(calls) if calls else self._out.text(self.MARK + whole)

    def finish(self) -> list[Delta]:
        if self._in_call:  # never became a complete call
            self._in_call = False
            out = self._out.text(self.MARK + self._join(self._call))
            self._reset_call()
        else:
            out = self._out.text(self._held)
        self._held = ""
        return out + self._out.finish()


def _match_end(pattern: re.Pattern[str], text: str, i: int) -> int:
    m = pattern.match(text, i)
    return m.end() if m is not None else i


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

"""A chat completion on the head: messages to prompt ids, ids back to text and tool calls.

Nothing here touches HTTP: the API layer turns its requests into template messages,
sampling parameters and stops, and the events back into JSON or SSE.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Literal, TypeVar

from engine.errors import RequestError
from engine.events import SessionFinished
from engine.head.fleet.sessions import Finish, Job, Session, SessionRunner
from engine.head.prompt.model import HeadModel
from engine.head.prompt.templates import TemplateError
from engine.head.prompt.text import Detokenizer, StopMatcher
from engine.head.prompt.tools import TextDelta, ToolCallDelta, ToolCallParser, parser_for
from engine.link import messages as m


@dataclass(frozen=True, slots=True)
class Routing:
    affinity: str | None = None
    first_turn: bool = False  # the affinity key is remembered, not followed (see Job)
    keyed: bool = False  # came with an issued API key: cached tokens only of its own turns
    pin_host: str | None = None
    prefer: tuple[str, ...] = ()
    # Ollama's keep_alive, in seconds (inf: never unload); None: the node's own default
    keep_alive_s: float | None = None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether the answer may, must or must not call a tool: ``auto`` (the model
    decides), ``none`` (no tools offered), ``required`` (a call to any of them, or to
    ``name``). A required call is opened for the model, in its format: the answer
    begins with the call's opening text and the model writes the rest."""

    mode: Literal["auto", "none", "required"] = "auto"
    name: str | None = None


@dataclass(slots=True)
class ChatFinal:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    node: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    stop_sequence: str | None = None  # the request's stop string that ended the answer


ChatEvent = TextDelta | ToolCallDelta | ChatFinal


# what the head itself passes to a template; a request cannot override these
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})


UNKNOWN_ROOM = 1 << 16


class Turn:
    """One generation on the fleet: prompt ids in, text and tool-call deltas and a final out."""

    def __init__(self, model: HeadModel, runner: SessionRunner, prompt: list[int], *,
                 routing: Routing, sampling: m.SamplingParams | None = None,
                 max_tokens: int | None = None, stops: Sequence[str] = (),
                 parser: ToolCallParser | None = None, requested: str = "") -> None:
        if not prompt:
            # every runtime refuses an empty prompt; say so here rather than on a node
            raise RequestError("the prompt is empty after the model's template; send some "
                               "text", code="invalid_request")
        self.model = model
        self.runner = runner
        self.routing = routing
        self.prompt = prompt
        self.sampling = sampling if sampling is not None else m.SamplingParams()
        window = runner.fleet.context_window(model.name)
        # no node connected yet (the request queues for one): the node stops at its window
        room = max(window - len(prompt), 1) if window else UNKNOWN_ROOM
        self.max_tokens = min(max_tokens, room) if max_tokens else room
        self._stops = [s for s in stops if s]
        self._parser = parser
        self.session = "s-" + secrets.token_hex(8)
        self.requested = requested or model.name  # the name the client asked for
        self._running: Session | None = None

    @property
    def committable(self) -> bool:
        """Whether a keepalive may commit the answer to 200: the request is waiting for a
        lane or for its tokens, not for a node that may never come (see Session)."""
        return self._running is not None and self._running.committable

    def reader(self) -> TurnReader:
        """Start the generation; read its events with :meth:`TurnReader.get`."""
        return TurnReader(self)

    async def events(self) -> AsyncGenerator[ChatEvent, None]:
        """The turn's events, until the final one (a reader without a timeout)."""
        reader = self.reader()
        try:
            while (ev := await reader.get(None)) is not None:
                yield ev
        finally:
            await reader.close()


class TurnReader:
    """A running turn: the session's token batches turned into text and tool-call deltas
    and a final, in the task that reads them (the HTTP handler's). ``get`` waits for the
    next event at most ``wait_s`` (TimeoutError; the generation goes on), re-raises the
    session's RequestError, and returns None once the final event was read. ``close``
    stops the session (freeing its lane) unless it has ended, and reports the turn."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        model = turn.model
        self._detok = Detokenizer(model.vocab.token_bytes)
        self._stopper = StopMatcher(turn._stops)
        self._parser = turn._parser
        r = turn.routing
        job = Job(session=turn.session, model=model.name, prompt=turn.prompt,
                  max_tokens=turn.max_tokens, sampling=turn.sampling,
                  stop_ids=sorted(model.stop_ids), affinity=r.affinity,
                  first_turn=r.first_turn, pin_host=r.pin_host, prefer=r.prefer,
                  keyed=r.keyed, keep_alive_s=r.keep_alive_s)
        self._calls: list[dict[str, Any]] = []
        self._clock = turn.runner.clock
        self._started = self._clock()
        self._first_at = 0.0
        self._produced = 0
        self._moves = 0
        self._final: ChatFinal | None = None
        self._error: str | None = None
        self._ready: deque[ChatEvent] = deque()
        self._ended = False  # the final event is among the ready ones, or was read
        self._closed = False
        self.session = turn._running = turn.runner.start(job)

    async def get(self, wait_s: float | None) -> ChatEvent | None:
        deadline = None if wait_s is None else asyncio.get_running_loop().time() + wait_s
        while not self._ready and not self._ended:
            try:
                item = self.session.take()
                if item is None:  # nothing waiting: wait, without losing what comes
                    item = await (self.session.next() if deadline is None
                                  else self.session.next_by(deadline))
            except RequestError as exc:
                self._error = str(exc)
                self._ended = True
                raise
            self._feed(item)
        return self._ready.popleft() if self._ready else None

    def _emit(self, text: str) -> None:
        if not text:
            return
        parser = self._parser
        for ev in [TextDelta(text)] if parser is None else parser.feed(text):
            _collect(self._calls, ev)
            self._ready.append(ev)

    def _end(self, final: ChatFinal) -> None:
        if self._parser is not None:
            for ev in self._parser.finish():
                _collect(self._calls, ev)
                self._ready.append(ev)
        if self._calls:
            final.finish_reason = "tool_calls"
        final.tool_calls = self._calls
        self._final = final
        self._ready.append(final)
        self._ended = True

    def _feed(self, item: list[int] | Finish) -> None:
        if not self._first_at:
            self._first_at = self._clock()
        stopper = self._stopper
        if isinstance(item, Finish):
            self._moves = item.moves
            tail, _ = stopper.feed(self._detok.flush())
            self._emit(tail + stopper.flush())
            self._end(ChatFinal(
                finish_reason=item.reason if item.reason in ("stop", "length") else "stop",
                prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens,
                cached_tokens=item.cached_tokens, node=item.node))
            return
        self._produced += len(item)
        text, hit = stopper.feed(self._detok.feed(item))
        self._emit(text)
        if hit:
            self._end(ChatFinal(finish_reason="stop", prompt_tokens=len(self.turn.prompt),
                                completion_tokens=self._produced, cached_tokens=0,
                                node=self.session.node, stop_sequence=stopper.matched))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        session = self.session
        await session.close()
        turn = self.turn
        final = self._final
        now = self._clock()
        turn.runner.fleet.emit(SessionFinished(
            session=turn.session, model=turn.model.name, requested=turn.requested,
            node=final.node if final else session.node,
            prompt_tokens=len(turn.prompt),
            completion_tokens=final.completion_tokens if final else self._produced,
            cached_tokens=final.cached_tokens if final else 0,
            ttft_ms=(self._first_at - self._started) * 1000 if self._first_at else 0.0,
            duration_ms=(now - self._started) * 1000, moves=self._moves,
            finish_reason=final.finish_reason if final else "cancelled",
            error=self._error if final is None else None))


async def render_prompt(model: HeadModel, messages: list[dict[str, Any]], *,
                        tools: list[dict[str, Any]] | None = None,
                        template_kwargs: Mapping[str, Any] | None = None,
                        prefill: str = "") -> list[int]:
    """Prompt ids of ``messages`` through the model's chat template (off the loop when
    the request weighs more than INLINE_CHARS: its messages, their content and tool
    calls, the tools and the template arguments, see :func:`weight`), then ``prefill``,
    the text the answer begins with; the head's own template arguments cannot be
    overridden."""
    kwargs = {k: v for k, v in (template_kwargs or {}).items()
              if k not in RESERVED_TEMPLATE_KWARGS}
    size = weight((messages, tools, kwargs, prefill), INLINE_CHARS)
    try:
        return await off_loop(size, lambda: model.render(messages, tools=tools,
                                                         prefill=prefill, **kwargs))
    except TemplateError as exc:
        raise RequestError(str(exc), code="invalid_request_error") from None


async def chat_turn(model: HeadModel, runner: SessionRunner, messages: list[dict[str, Any]],
                    *, routing: Routing, tools: list[dict[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None,
                    sampling: m.SamplingParams | None = None, stops: Sequence[str] = (),
                    max_tokens: int | None = None, tool_parser: str | None = None,
                    requested: str = "", tool_choice: ToolChoice | None = None,
                    prefill: str = "") -> Turn:
    """A chat: ``messages`` (the template's dicts) rendered through the model's template,
    then a Turn; with ``tools``, tool calls are parsed out of the text.

    ``prefill``: text the assistant's answer begins with (the client has it: it is not
    delivered again). ``tool_choice``: ``none`` renders no tools; ``required`` opens a
    call for the model (see :class:`ToolChoice`), after any prefill."""
    prompt, parser = await chat_prompt(model, messages, tools=tools,
                                       template_kwargs=template_kwargs,
                                       tool_parser=tool_parser, tool_choice=tool_choice,
                                       prefill=prefill)
    return Turn(model, runner, prompt, routing=routing, sampling=sampling,
                max_tokens=max_tokens, stops=stops, parser=parser, requested=requested)


async def chat_prompt(model: HeadModel, messages: list[dict[str, Any]], *,
                      tools: list[dict[str, Any]] | None = None,
                      template_kwargs: Mapping[str, Any] | None = None,
                      tool_parser: str | None = None, tool_choice: ToolChoice | None = None,
                      prefill: str = "") -> tuple[list[int], ToolCallParser | None]:
    """The prompt ids of a chat and the parser its answer goes through (see
    :func:`chat_turn`); also what a token count of the chat counts."""
    choice = tool_choice or ToolChoice()
    offered = tools if choice.mode != "none" else None
    parser = parser_for(tool_parser, model.template.family) if offered else None
    opener = parser.opener(choice.name) if parser is not None and \
        choice.mode == "required" else None
    if parser is not None and opener:
        parser.feed(opener)  # the call is open: the model's text continues inside it
    prompt = await render_prompt(model, messages, tools=offered,
                                 template_kwargs=template_kwargs,
                                 prefill=prefill + (opener or ""))
    return prompt, parser


INLINE_CHARS = 16_384  # tokenizing this much takes a few ms: less than a thread hop costs
ITEM_CHARS = 8  # what a value weighs beyond its text: its key, its markup in the template
T = TypeVar("T")
_END = object()


def weight(value: object, budget: int) -> int:
    """About how many characters ``value`` (a request's messages, tools and template
    arguments: dicts, lists, strings, numbers) makes a template render, counted until it
    passes ``budget``: every string counts its length, and every value, key and item
    ITEM_CHARS more, so 100,000 empty messages weigh as much as one long message, and
    tools and tool-call arguments count as the content does. The walk ends once past
    the budget: on the loop it takes at most a budget's worth of steps, whatever the
    request's size."""
    total = 0
    stack: list[Iterator[object]] = [iter((value,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        total += ITEM_CHARS
        if isinstance(item, str | bytes):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.append(chain.from_iterable(item.items()))
        elif isinstance(item, list | tuple):
            stack.append(iter(item))
        if total > budget:
            break
    return total


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """Run ``work`` (decoding a request body, template rendering, tokenizing) on the loop
    when its input's ``size`` is small, else in a worker thread: a long prompt takes about
    0.2 s per MB, and decoding a body of 100,000 small messages about as long, which must
    not stall the head's other requests and sessions (their pings and renewals)."""
    if size <= INLINE_CHARS:
        return work()
    return await asyncio.to_thread(work)


def _strip_bos(ids: list[int], bos: list[int]) -> list[int]:
    return ids[len(bos):] if bos and ids[:len(bos)] == bos else ids


def completion_prompt_ids(model: HeadModel, prompt: str, suffix: str | None) -> list[int]:
    """Prompt ids of a raw completion; with ``suffix``, fill-in-the-middle through the
    model's FIM tokens (BOS, prefix marker, prompt, suffix marker, suffix, middle marker).

    An empty suffix uses FIM when the model has the tokens and a plain completion
    otherwise; a non-empty one on a model without them is refused (400)."""
    vocab = model.vocab
    if suffix is None:
        return vocab.encode(prompt, special=True)
    fim = vocab.fim_ids()
    if fim is None:
        if not suffix:
            return vocab.encode(prompt, special=True)
        raise RequestError(
            f"model {model.name} has no fill-in-the-middle tokens; send the prompt without "
            "a suffix, or serve a code model that has them (for example Qwen2.5-Coder)",
            code="fim_unsupported")
    pre, suf, mid = fim
    bos = vocab.encode("", special=True)
    head = _strip_bos(vocab.encode(prompt, special=False), bos)
    tail = _strip_bos(vocab.encode(suffix, special=False), bos)
    return [*bos, pre, *head, suf, *tail, mid]


def _collect(calls: list[dict[str, Any]], ev: TextDelta | ToolCallDelta) -> None:
    if not isinstance(ev, ToolCallDelta):
        return
    while len(calls) <= ev.index:
        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[ev.index]
    if ev.id:
        call["id"] = ev.id
    if ev.name:
        call["function"]["name"] = ev.name
    call["function"]["arguments"] += ev.arguments_fragment or ""

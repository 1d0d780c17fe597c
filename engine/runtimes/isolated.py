"""An engine that runs in a process of its own, so that its failure is not the node's.

A model split across machines (issue 33) runs its last layers through llama.cpp's RPC
client, which aborts the whole process when its connection breaks: a lending machine that
leaves would take the serving node down with it, and every session on it. Here the engine
runs in a child process (``python -m engine.roles.engine_process``) and the node keeps an
:class:`IsolatedEngine` that speaks to it over the child's stdin and stdout:

- frames are a 4-byte big-endian length and a msgpack record (:data:`ToChild`,
  :data:`ToParent`), at most :data:`MAX_FRAME` bytes, checked before reading the body;
- the child sends its stats every :data:`STATS_S` while anything changes, and with each
  generation's end, so that ``stats()`` and ``admission()`` answer at once, off no pipe;
- the child ends when its stdin does (the node ended), so none outlives its node.

When the child ends unexpectedly, or the node learns that the machine it splits with left
(:meth:`IsolatedEngine.lost`: the tunnel's link ended), the engine is *down*: each
running generation raises :class:`EngineLost` (the node reports the session failed and the
head moves it to another node, the tokens already sent kept), new sessions are refused as
busy, and a supervisor starts the child again once ``gate`` passes (the lending machine
answers again), waiting longer after each failed try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Annotated

import msgspec

from engine.backoff import doubling
from engine.runtimes.base import (
    Engine,
    EngineInfo,
    EngineStats,
    Generation,
    GenerationRequest,
    GenerationResult,
    Sampling,
)
from engine.tasks import TaskSet

log = logging.getLogger("shoal.node")

MAX_FRAME = 16 << 20  # a prompt of a million tokens' ids fits; a stats record is ~300 bytes
MAX_LINE = 2000  # a failure's text
STATS_S = 0.2  # between the child's stats while they change
START_S = 300.0  # the child's import and model load (a large model on a slow disk)
RETRY_FIRST_S = 0.5  # the supervisor's first wait after a failed try, doubled up to
RETRY_MOST_S = 10.0
_HEADER = struct.Struct(">I")

_Line = Annotated[str, msgspec.Meta(max_length=MAX_LINE)]


# -- the records -----------------------------------------------------------------------

class Load(msgspec.Struct, frozen=True, tag="load", tag_field="t"):
    """Parent to child, first: what to load (engine.models.loading.load_engine's
    arguments; ``memory_budget`` in bytes, 0: the runtime's default)."""

    path: str
    name: str
    runtime: str
    lanes: int
    max_context: int | None = None
    memory_budget: int = 0
    kv_type: str = "f16"
    gpu: str = "auto"
    split_with: tuple[tuple[str, int, str], ...] = ()
    mock_speed: float = 0.0  # the mock runtime's tokens/s per lane (tests)


class Generate(msgspec.Struct, frozen=True, tag="generate", tag_field="t"):
    id: int
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: list[int]
    session: str = ""


class Cancel(msgspec.Struct, frozen=True, tag="cancel", tag_field="t"):
    id: int


class Ready(msgspec.Struct, frozen=True, tag="ready", tag_field="t"):
    info: EngineInfo
    stats: EngineStats


class StartFailed(msgspec.Struct, frozen=True, tag="start_failed", tag_field="t"):
    message: _Line
    code: str = "cannot_load"


class Tokens(msgspec.Struct, frozen=True, tag="tokens", tag_field="t"):
    id: int
    ids: list[int]


class Prefilled(msgspec.Struct, frozen=True, tag="prefilled", tag_field="t"):
    id: int
    prefilled: int


class Finished(msgspec.Struct, frozen=True, tag="finished", tag_field="t"):
    id: int
    result: GenerationResult


class Failed(msgspec.Struct, frozen=True, tag="failed", tag_field="t"):
    id: int
    message: _Line
    bad_request: bool = False  # the engine refused the request itself (ValueError)


class Stats(msgspec.Struct, frozen=True, tag="stats", tag_field="t"):
    stats: EngineStats


ToChild = Load | Generate | Cancel
ToParent = Ready | StartFailed | Tokens | Prefilled | Finished | Failed | Stats

_encoder = msgspec.msgpack.Encoder()


def frame(record: ToChild | ToParent) -> bytes:
    body = _encoder.encode(record)
    return _HEADER.pack(len(body)) + body


class FrameTooLarge(ValueError):
    pass


async def read_frame(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder[object]
                     ) -> object:
    """The next record; IncompleteReadError at the end of the stream; FrameTooLarge for a
    length above MAX_FRAME (checked before the body is read)."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME:
        raise FrameTooLarge(f"a record of {size} bytes from the engine's process "
                            f"(at most {MAX_FRAME})")
    return decoder.decode(await reader.readexactly(size))


to_child: msgspec.msgpack.Decoder[object] = msgspec.msgpack.Decoder(ToChild)
to_parent: msgspec.msgpack.Decoder[object] = msgspec.msgpack.Decoder(ToParent)


# -- the node's side -------------------------------------------------------------------

class EngineLost(RuntimeError):
    """The engine's process ended under a generation; one line naming why."""


class EngineStartFailed(RuntimeError):
    """The child could not load the model: its line and its StartError code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


Gate = Callable[[], Awaitable[None]]  # returns when a new child may start; raises if not


@dataclass
class _Child:
    proc: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class IsolatedGeneration:
    """A generation the child runs: iterate for batches of ids, then read ``result``."""

    def __init__(self, engine: IsolatedEngine, gen_id: int) -> None:
        self._engine = engine
        self._id = gen_id
        self._buf: list[int] = []
        self._result: GenerationResult | None = None
        self._failure: Exception | None = None
        self._event = asyncio.Event()
        self._cancelled = False
        self.prefilled = 0  # prompt tokens read so far, as the child last said

    # from the engine's reader
    def _push(self, ids: list[int]) -> None:
        self._buf.extend(ids)
        self._event.set()

    def _end(self, result: GenerationResult | None, failure: Exception | None) -> None:
        if self._result is None and self._failure is None:
            self._result, self._failure = result, failure
        self._event.set()

    @property
    def done(self) -> bool:
        return self._result is not None or self._failure is not None

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[int]]:
        try:
            while True:
                if self._buf:
                    batch, self._buf = self._buf, []
                    yield batch
                    continue
                if self._failure is not None:
                    raise self._failure
                if self._result is not None:
                    return
                self._event.clear()
                await self._event.wait()
        finally:
            if not self.done:
                self.cancel()

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the generation is still running; read result after iterating")
        return self._result

    def cancel(self) -> None:
        if not self.done and not self._cancelled:
            self._cancelled = True
            self._engine._send(Cancel(id=self._id))


class IsolatedEngine:
    """The :class:`~engine.runtimes.base.Engine` of a node whose engine runs in a child
    process (``module``, run as ``python -m module``), started again after it is lost."""

    def __init__(self, load: Load, *, module: str, gate: Gate | None = None,
                 what: str = "the model's engine",
                 again: str = "it starts again by itself") -> None:
        self.load = load
        self.module = module
        self.gate = gate
        self.what = what  # names the engine in lines: "the split with desk"
        self.again = again  # when it comes back: "it forms again when desk answers"
        self.info = EngineInfo(model=load.name, runtime=load.runtime, context_window=0,
                               lanes=load.lanes, path=load.path)
        self._stats = EngineStats(lanes=load.lanes, lanes_busy=0, kv_used=0, kv_total=0,
                                  prefill_tps=0.0, decode_tps=0.0, ttft_ms=0.0)
        self._child: _Child | None = None
        self._running: dict[int, IsolatedGeneration] = {}
        self._next_id = 0
        self._down = ""
        self._closing = False
        self._tasks = TaskSet("an isolated engine")
        self._supervisor: asyncio.Task[None] | None = None
        self.restarts = 0  # how many times it formed again after a loss

    async def start(self) -> None:
        """Start the child and wait until its model is loaded; EngineStartFailed names why
        it could not."""
        await self._launch()

    async def _launch(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=None, limit=64 * 1024)
        assert proc.stdin is not None and proc.stdout is not None
        child = _Child(proc, proc.stdout, proc.stdin)
        try:
            child.writer.write(frame(self.load))
            async with asyncio.timeout(START_S):
                await child.writer.drain()
                first = await read_frame(child.reader, to_parent)
        except BaseException as exc:
            await _end(proc)
            if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                raise EngineStartFailed(f"{self.what} ended as it loaded (exit code "
                                        f"{proc.returncode}); its log says why",
                                        "cannot_load") from None
            if isinstance(exc, TimeoutError):
                raise EngineStartFailed(f"{self.what} did not load within {START_S:.0f} s",
                                        "cannot_load") from None
            raise
        if isinstance(first, StartFailed):
            await _end(proc)
            raise EngineStartFailed(first.message, first.code)
        if not isinstance(first, Ready):
            await _end(proc)
            raise EngineStartFailed(f"{self.what} answered its load with "
                                    f"{type(first).__name__}", "cannot_load")
        self.info, self._stats = first.info, first.stats
        self._child = child
        self._down = ""
        self._tasks.spawn(self._read(child), "isolated-engine-reader")

    async def _read(self, child: _Child) -> None:
        why = ""
        try:
            while True:
                rec = await read_frame(child.reader, to_parent)
                if isinstance(rec, Tokens):
                    if (gen := self._running.get(rec.id)) is not None:
                        gen._push(rec.ids)
                elif isinstance(rec, Prefilled):
                    if (gen := self._running.get(rec.id)) is not None:
                        gen.prefilled = max(gen.prefilled, rec.prefilled)
                elif isinstance(rec, Finished):
                    if (gen := self._running.pop(rec.id, None)) is not None:
                        gen._end(rec.result, None)
                elif isinstance(rec, Failed):
                    if (gen := self._running.pop(rec.id, None)) is not None:
                        err: Exception = (ValueError(rec.message) if rec.bad_request
                                          else RuntimeError(rec.message))
                        gen._end(None, err)
                elif isinstance(rec, Stats):
                    self._stats = rec.stats
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (FrameTooLarge, msgspec.DecodeError) as exc:
            why = str(exc)
        await _end(child.proc)
        if self._child is child:
            self._child = None
            if not self._closing:
                self._lost(why or self._down or
                           f"its process ended (exit code {child.proc.returncode})")

    def lost(self, why: str) -> None:
        """What it runs on is gone (the tunnel's link to the lending machine ended): end
        the child now, before llama.cpp aborts it on its next call; the supervisor brings it
        back."""
        if self._closing or self._child is None:
            return
        self._set_down(why)
        with contextlib.suppress(ProcessLookupError):
            self._child.proc.kill()

    def _set_down(self, why: str) -> None:
        if not self._down:
            self._down = f"{self.what} is down: {why}; {self.again}"
            log.warning("%s", self._down)

    def _lost(self, why: str) -> None:
        self._set_down(why)
        failure = EngineLost(self._down)
        running, self._running = self._running, {}
        for gen in running.values():
            gen._end(None, failure)
        if self._supervisor is None or self._supervisor.done():
            self._supervisor = self._tasks.spawn(self._form_again(), "isolated-engine-again")

    async def _form_again(self) -> None:
        step = 0
        while not self._closing:
            await asyncio.sleep(doubling(RETRY_FIRST_S, step, RETRY_MOST_S))
            step += 1
            try:
                if self.gate is not None:
                    await self.gate()
                await self._launch()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not back yet: wait longer and try again
                log.info("%s: not formed again yet: %s", self.what, exc)
                continue
            self.restarts += 1
            log.warning("%s formed again", self.what)
            return

    def _send(self, record: ToChild) -> None:
        child = self._child
        if child is not None and not child.writer.is_closing():
            child.writer.write(frame(record))

    def generate(self, request: GenerationRequest) -> IsolatedGeneration:
        if self._down or self._child is None:
            raise EngineLost(self._down or f"{self.what} is not running")
        self._next_id += 1
        gen = IsolatedGeneration(self, self._next_id)
        self._running[gen._id] = gen
        self._send(Generate(id=gen._id, prompt=list(request.prompt),
                            max_tokens=request.max_tokens, sampling=request.sampling,
                            stop_ids=sorted(request.stop_ids), session=request.session))
        return gen

    def admission(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """From the child's last stats: a prompt longer than the longest one a new session
        may bring now (with a whole answer's room) waits for another node."""
        st = self._stats
        if st.max_prompt and prompt_tokens > st.max_prompt:
            return (f"the KV pool has room for a prompt of {st.max_prompt} tokens now, not "
                    f"{prompt_tokens}; wait for a session to end")
        return None

    def stats(self) -> EngineStats:
        st = self._stats
        if self._down:
            return replace(st, down=self._down, lanes_busy=st.lanes)
        busy = max(st.lanes_busy, min(len(self._running), st.lanes))
        return replace(st, lanes_busy=busy) if busy != st.lanes_busy else st

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None

    async def close(self) -> None:
        self._closing = True
        child, self._child = self._child, None
        if child is not None:
            child.writer.close()  # the child ends at its stdin's end
            await _end(child.proc, grace_s=5.0)
        await self._tasks.close()
        failure = EngineLost(f"{self.what} was closed")
        for gen in self._running.values():
            gen._end(None, failure)
        self._running.clear()


async def _end(proc: asyncio.subprocess.Process, *, grace_s: float = 0.0) -> None:
    """Wait ``grace_s`` for the child to end, then kill it and reap it."""
    if proc.returncode is None and grace_s:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await proc.wait()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


# -- the child's side ------------------------------------------------------------------

async def serve(eng: Engine, reader: asyncio.StreamReader,
                write: Callable[[bytes], None]) -> None:
    """Run ``eng``'s generations as the parent asks until its stdin ends (the engine
    started already; its Ready sent). ``write`` puts a frame on the parent's pipe."""
    tasks = TaskSet("the engine's process")
    running: dict[int, Generation] = {}

    async def run(rec: Generate) -> None:
        try:
            gen = eng.generate(GenerationRequest(
                prompt=rec.prompt, max_tokens=rec.max_tokens, sampling=rec.sampling,
                stop_ids=frozenset(rec.stop_ids), session=rec.session))
        except ValueError as exc:
            write(frame(Failed(id=rec.id, message=str(exc)[:MAX_LINE], bad_request=True)))
            return
        except Exception as exc:
            write(frame(Failed(id=rec.id, message=str(exc)[:MAX_LINE])))
            return
        running[rec.id] = gen
        reporter = tasks.spawn(_report_prefill(gen, rec.id, write), f"prefill-{rec.id}")
        try:
            async for ids in gen:
                reporter.cancel()
                write(frame(Tokens(id=rec.id, ids=ids)))
            write(frame(Stats(stats=eng.stats())))
            write(frame(Finished(id=rec.id, result=gen.result)))
        except Exception as exc:
            write(frame(Failed(id=rec.id, message=str(exc)[:MAX_LINE])))
        finally:
            reporter.cancel()
            running.pop(rec.id, None)

    async def stats() -> None:
        last: EngineStats | None = None
        while True:
            st = eng.stats()
            if st != last:
                write(frame(Stats(stats=st)))
                last = st
            await asyncio.sleep(STATS_S)

    tasks.spawn(stats(), "engine-stats")
    try:
        while True:
            try:
                rec = await read_frame(reader, to_child)
            except asyncio.IncompleteReadError:
                return  # the node ended, or closes this engine
            if isinstance(rec, Generate):
                tasks.spawn(run(rec), f"generate-{rec.id}")
            elif isinstance(rec, Cancel):
                gen = running.get(rec.id)
                if gen is not None:
                    gen.cancel()
    finally:
        for gen in list(running.values()):
            gen.cancel()
        await tasks.close()


async def _report_prefill(gen: Generation, gen_id: int, write: Callable[[bytes], None]) -> None:
    """The prompt tokens read so far, while the first token is still coming (the node
    reports it to the head)."""
    last = 0
    while True:
        await asyncio.sleep(STATS_S)
        done = int(getattr(gen, "prefilled", 0))
        if done != last:
            write(frame(Prefilled(id=gen_id, prefilled=done)))
            last = done

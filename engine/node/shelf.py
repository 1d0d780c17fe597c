"""The models a node keeps besides its first: loaded on demand, unloaded when idle or when
another needs the room (the adapter of :mod:`engine.node.model_set`, whose policy it asks).

A request for a kept model takes it (``acquire``): loaded, it answers at once; otherwise
the shelf loads it, first unloading the least recently used idle models (the node's first
model among them, through the agent) until the policy says it fits. The engine's own plan
is the last word: a load the budget cannot hold after all fails with the engine's numbers,
and the shelf then frees the next idle model and tries again, or refuses with that line
when none is left. What a loaded model holds is measured (the process's resident memory
across its load), so the next plan uses what it really took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from engine.errors import StartError
from engine.link import messages as m
from engine.node import model_set
from engine.runtimes.base import Embedder, Engine
from engine.runtimes.budget import process_rss_bytes
from engine.sizes import MiB
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal.node")


class Refused(Exception):
    """A kept model that cannot be loaded now; the message is one line with the numbers."""


@dataclass(frozen=True, slots=True)
class Keep:
    """A model the node keeps: its name, its file's size and how to load its engine."""

    name: str
    size: int
    load: Callable[[], Awaitable[Engine]]  # a started engine (it loads off the loop)
    keep_alive_s: float = model_set.DEFAULT_KEEP_ALIVE_S


@dataclass
class FirstModel:
    """The node's first model, as the agent lends it to the shelf's choices: what it
    holds, whether it answers now, and how to unload it (the agent's idle unload)."""

    name: str
    held: Callable[[], model_set.Held | None]  # None: not loaded now
    unload: Callable[[], Awaitable[bool]]  # False: it did not (it answers, or sleeps)


class _Entry:
    def __init__(self, keep: Keep, now: float) -> None:
        self.keep = keep
        self.engine: Engine | None = None
        self.loading: asyncio.Task[Engine] | None = None
        self.held = 0  # measured at its last load (0: never loaded)
        self.window = 0  # its engine's window, known once it loaded (0: not yet)
        self.load_ms = 0  # what its last load took (0: never loaded here)
        self.embeds = False
        self.busy = 0
        self.last_used = now
        self.keep_alive_s = keep.keep_alive_s

    def need(self) -> int:
        return model_set.need_of(self.keep.size, self.held)

    def as_held(self) -> model_set.Held:
        return model_set.Held(self.keep.name, self.need(), self.last_used, self.busy,
                              self.keep_alive_s)


class ModelShelf:
    def __init__(self, keeps: Sequence[Keep], *, budget: int,
                 clock: Callable[[], float] = time.monotonic,
                 rss: Callable[[], int] = process_rss_bytes,
                 changed: Callable[[], None] = lambda: None) -> None:
        now = clock()
        self._entries = {k.name: _Entry(k, now) for k in keeps}
        self.budget = budget
        self._clock = clock
        self._rss = rss
        self.changed = changed  # told when a model loads or unloads (the agent's stats)
        self.first: FirstModel | None = None  # set by the agent that serves the shelf
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._wake = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    def add(self, keep: Keep) -> bool:
        """Keep one more model (False: one of that name is kept already)."""
        if keep.name in self._entries:
            return False
        self._entries[keep.name] = _Entry(keep, self._clock())
        self.changed()
        return True

    # -- what the node says ------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def busy(self) -> int:
        return sum(e.busy for e in self._entries.values())

    def loaded(self, name: str) -> Engine | None:
        entry = self._entries.get(name)
        return entry.engine if entry is not None else None

    def records(self) -> list[m.KeptModel]:
        out: list[m.KeptModel] = []
        for e in list(self._entries.values())[:m.MAX_KEPT]:
            engine = e.engine
            state: Literal["loaded", "loading", "unloaded"] = (
                "loaded" if engine is not None else "loading" if e.loading else "unloaded")
            out.append(m.KeptModel(
                name=e.keep.name[:m.MAX_NAME], state=state,
                mem=e.held if engine is not None else 0, embeds=e.embeds,
                context_window=e.window, size=e.keep.size, load_ms=e.load_ms))
        return out

    # -- requests ----------------------------------------------------------------------

    async def acquire(self, name: str) -> Engine:
        """The engine of ``name``, loaded if it is not, counted busy until ``release``
        (so it is never unloaded under a request). Raises Refused."""
        entry = self._entries[name]
        entry.busy += 1
        self._touch(entry)
        try:
            while entry.engine is None:
                if entry.loading is None:
                    entry.loading = asyncio.get_running_loop().create_task(
                        self._load(entry), name=f"shelf-load-{name}")
                    self.changed()
                loading = entry.loading
                try:
                    # shielded: a request that gives up waiting leaves the load to others
                    await asyncio.shield(loading)
                finally:
                    if loading.done() and entry.loading is loading:
                        entry.loading = None
                        self.changed()
            return entry.engine
        except BaseException:
            entry.busy -= 1
            self._touch(entry)
            raise

    def release(self, name: str, keep_alive_s: float | None = None) -> None:
        """A request on ``name`` ended; ``keep_alive_s`` (the request's; None: it named
        none, so the model's default) is how long the model stays loaded once idle."""
        entry = self._entries[name]
        entry.busy = max(entry.busy - 1, 0)
        entry.keep_alive_s = entry.keep.keep_alive_s if keep_alive_s is None else keep_alive_s
        self._touch(entry)

    def set_keep_alive(self, name: str, seconds: float) -> None:
        """``name``'s own idle time from now on (FOREVER: never unload; 0: after each
        request), as its owner set it; a request's keep_alive still wins for that request."""
        entry = self._entries[name]
        entry.keep = replace(entry.keep, keep_alive_s=seconds)
        if not entry.busy:
            entry.keep_alive_s = seconds
        self._wake.set()

    def _touch(self, entry: _Entry) -> None:
        entry.last_used = self._clock()
        self._wake.set()

    # -- loading and unloading -------------------------------------------------------------

    def held(self) -> list[model_set.Held]:
        """Every loaded model as the policy sees it, the first among them."""
        out = self._kept_held()
        first = self.first.held() if self.first is not None else None
        return [first, *out] if first is not None else out

    def _kept_held(self) -> list[model_set.Held]:
        """The loaded kept models (not the first) as the policy sees them."""
        return [e.as_held() for e in self._entries.values() if e.engine is not None]

    async def make_room(self, name: str, need: int) -> None:
        """Unload idle models until ``need`` more bytes fit (the first model's load asks
        this too). Raises Refused when the budget cannot hold it beside busy models."""
        async with self._lock:
            await self._room(name, need)

    async def _room(self, name: str, need: int) -> None:
        held = [h for h in self.held() if h.name != name]
        # what the process holds besides its models (the interpreter, libraries), measured
        base = max(await asyncio.to_thread(self._rss) - sum(h.bytes for h in held), 0)
        plan = model_set.plan_load(name, need, held, self.budget, base)
        if isinstance(plan, model_set.Refuse):
            raise Refused(plan.message)
        for victim in plan.evict:
            await self._unload(victim, why=f"to make room for {name}")

    async def _load(self, entry: _Entry) -> Engine:
        name = entry.keep.name
        async with self._lock:
            while True:
                await self._room(name, entry.need())
                before = await asyncio.to_thread(self._rss)
                started = time.monotonic()
                try:
                    engine = await entry.keep.load()
                except StartError as exc:
                    # the engine's own plan did not fit: free one more idle model and retry
                    idle = model_set.evictable(h for h in self.held() if h.name != name)
                    if not idle:
                        raise Refused(f"cannot load {name}: {exc}") from None
                    await self._unload(idle[0].name, why=f"to make room for {name}")
                    continue
                after = await asyncio.to_thread(self._rss)
                entry.held = max(after - before, entry.keep.size, 1)
                # placement prices the next load by it (wall time, as a request waits)
                entry.load_ms = min(max(round((time.monotonic() - started) * 1000), 1),
                                    (1 << 31) - 1)
                entry.engine = engine
                entry.window = engine.info.context_window
                entry.embeds = isinstance(engine, Embedder)
                entry.last_used = self._clock()
                log.info("loaded %s for a request (it holds about %d MiB)", name,
                         entry.held // MiB)
                self.changed()
                self._ensure_sweeper()
                return engine

    async def _unload(self, name: str, *, why: str) -> bool:
        """Unload ``name`` if it is loaded and answers nothing (the caller holds the lock);
        False when it did not."""
        first = self.first
        if first is not None and name == first.name:
            done = await first.unload()
        else:
            entry = self._entries.get(name)
            if entry is None or entry.engine is None or entry.busy:
                return False
            engine, entry.engine = entry.engine, None
            await engine.close()
            self.changed()
            done = True
        if done:
            log.info("unloaded %s %s", name, why)
        return done

    async def unload(self, name: str) -> bool:
        """Unload ``name`` now if it is loaded and idle (a person's click, keep_alive 0)."""
        if name not in self._entries:  # the first model unloads through its agent
            return False
        async with self._lock:
            return await self._unload(name, why="as asked")

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None and not self._closed:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep(), name="shelf-idle-unload")

    async def _sweep(self) -> None:
        """Unload each kept model once it has been idle for its keep-alive."""
        while True:
            self._wake.clear()
            for name in model_set.due_to_unload(self._kept_held(), self._clock()):
                async with self._lock:  # checked again under it: a request may have come
                    await self._unload(name, why="after its keep-alive")
            # never inf: a model kept for ever has no unload time
            due = model_set.next_unload(self._kept_held())
            delay = None if due is None else max(due - self._clock(), 0.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait([self._sweeper, *(e.loading for e in self._entries.values())],
                              "the kept models")
        for entry in self._entries.values():
            if entry.engine is not None:
                engine, entry.engine = entry.engine, None
                with contextlib.suppress(Exception):
                    await engine.close()

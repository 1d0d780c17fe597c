"""Getting a model ready, off the event loop: pull or assemble it (with progress and a
cancel), check its runtime, load an engine for a node or a vocabulary for a head.

Every slow step runs in a worker thread; progress comes back to the loop as
`PullProgress` events, a few a second while bytes come or stall, with the rate and the
time left measured where the bytes arrive (engine.models.pulls.meter).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import StartError
from engine.events import Emit, PullProgress
from engine.head.prompt.model import HeadModel
from engine.head.prompt.model import load_head_model as _load_head_model
from engine.head.prompt.templates import TemplateError
from engine.models import embedded as model_embedded
from engine.models import errors as model_errors
from engine.models.pulls import peers as fleet_peers
from engine.models.pulls.meter import Meter, Reading
from engine.runtimes import registry
from engine.runtimes.base import Engine, RuntimeUnavailable
from engine.runtimes.budget import total_memory_bytes
from engine.sizes import Budget, Share, budget_bytes
from engine.tasks import cancel_and_wait

REPORT_EVERY_S = 0.25


@dataclass(frozen=True, slots=True)
class Resolved:
    path: str  # what the runtime loads
    name: str  # the model's name on the link and in /v1/models
    runtime: str


@dataclass
class Pulls:
    """Pulls under way, for the snapshot; each can be cancelled."""

    running: dict[str, PullProgress] = field(default_factory=dict)
    # one flag per resolve under way: two of one model (a head's and a node's) both stop
    cancels: dict[str, list[model_errors.CancelFlag]] = field(default_factory=dict)
    # the machines of the fleet a pull asks before the hub (engine.node.files)
    peers: fleet_peers.Peers | None = None

    def cancel(self, model: str, *, keep_part: bool = False) -> bool:
        """Stop the pulls of ``model``; ``keep_part``: for the next start (quitting)."""
        flags = self.cancels.get(model)
        if not flags:
            return False
        for flag in flags:
            flag.set(keep_part=keep_part)
        return True

    def add(self, model: str, flag: model_errors.CancelFlag) -> None:
        self.cancels.setdefault(model, []).append(flag)

    def remove(self, model: str, flag: model_errors.CancelFlag) -> bool:
        """Forget ``flag``; True when it was the last resolve of ``model``."""
        flags = self.cancels.get(model, [])
        if flag in flags:
            flags.remove(flag)
        if not flags:
            self.cancels.pop(model, None)
        return not flags


async def resolve(spec: str | None, runtime: str | None, *, home: Path, offline: bool,
                  emit: Emit, pulls: Pulls) -> Resolved:
    """The model ``spec`` (None: the embedded default) ready on disk for ``runtime``."""
    try:
        rt = registry.pick_runtime(runtime, spec)
        await asyncio.to_thread(registry.check_runtime, rt)
    except RuntimeUnavailable as exc:
        raise StartError(str(exc), code="runtime_unavailable") from None
    label = spec or model_embedded.EMBEDDED_NAME
    cancel = model_errors.CancelFlag()
    loop = asyncio.get_running_loop()
    latest = _Latest()

    def progress(line: str, done: int, total: int) -> None:
        # from the worker thread: every block feeds the meter; a new step (a file, a resumed
        # part) is told at once, the bytes a few times a second (by the ticker when they come
        # faster than that)
        reading = latest.heard(time.monotonic(), line, done, total)
        if reading is not None:
            loop.call_soon_threadsafe(_report, label, done, total, line, reading, emit, pulls)

    async def ticking() -> None:
        # the bytes that came since the last report, and the rate falling in a stall
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            due = latest.due(time.monotonic())
            if due is not None:
                done, total, reading = due
                _report(label, done, total, "", reading, emit, pulls)

    ticker = asyncio.create_task(ticking(), name=f"shoal-pull-progress-{label}")
    pulls.add(label, cancel)
    last_one = True
    try:
        with fleet_peers.fleet_for(None if offline else pulls.peers):  # into the thread
            path, name = await asyncio.to_thread(
                registry.resolve_model, rt, spec, home=home, offline=offline,
                progress=progress, cancel=cancel)
    except model_errors.PullCancelled as exc:
        if pulls.remove(label, cancel):
            _finish(label, "cancelled", str(exc), emit, pulls)
        raise StartError(str(exc), code="pull_cancelled") from None
    except (model_errors.ModelMissing, RuntimeUnavailable, FileNotFoundError, ValueError) as exc:
        if pulls.remove(label, cancel):
            _finish(label, "failed", str(exc), emit, pulls)
        raise StartError(str(exc), code="model_missing") from None
    else:
        last_one = pulls.remove(label, cancel)
    finally:
        await cancel_and_wait([ticker], "pull progress")
    if last_one and label in pulls.running:
        _finish(label, "done", "", emit, pulls)
    return Resolved(path=str(path), name=str(name), runtime=rt)  # a HubId stops here


class _Latest:
    """What the worker thread last heard of a pull, and when the loop was last told: shared
    by the thread's reports and the loop's ticker, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meter = Meter()
        self._done = 0
        self._total = 0
        self._heard = False  # a pull began: there is something to show
        self._told_at = 0.0

    def heard(self, now: float, line: str, done: int, total: int) -> Reading | None:
        """Take a report; the reading to tell the loop now, or None (the ticker will)."""
        with self._lock:
            if line:  # a new step starts at ``done``: what came before is no rate
                self._meter.reset()
            self._meter.add(now, done)
            self._done, self._total, self._heard = done, total, True
            if line or now - self._told_at >= REPORT_EVERY_S or (total and done >= total):
                self._told_at = now
                return self._meter.reading(now, total)
            return None

    def due(self, now: float) -> tuple[int, int, Reading] | None:
        """The bytes done, in all, and their reading, when the loop has not been told for a
        while."""
        with self._lock:
            if not self._heard or now - self._told_at < REPORT_EVERY_S:
                return None
            self._told_at = now
            return self._done, self._total, self._meter.reading(now, self._total)


def _report(label: str, done: int, total: int, line: str, reading: Reading, emit: Emit,
            pulls: Pulls) -> None:
    before = pulls.running.get(label)
    if before is not None and before.state != "running":
        return
    if label not in pulls.cancels:  # it ended: a report queued before the end came late
        return
    event = PullProgress(model=label, done_bytes=done or (before.done_bytes if before else 0),
                         total_bytes=total or (before.total_bytes if before else 0),
                         message=line or (before.message if before else ""),
                         rate_bps=reading.rate_bps, eta_s=reading.eta_s)
    pulls.running[label] = event
    emit(event)


def _finish(label: str, state: str, message: str, emit: Emit, pulls: Pulls) -> None:
    before = pulls.running.pop(label, None)
    if before is None and state == "done":
        return
    emit(PullProgress(model=label, done_bytes=before.done_bytes if before else 0,
                      total_bytes=before.total_bytes if before else 0,
                      state=state, message=message))  # type: ignore[arg-type]


async def load_engine(model: Resolved, *, name: str, lanes: int, max_context: int | None,
                      mock_speed: float, memory_budget: Budget = None,
                      kv_type: str = "f16", gpu: str = "auto",
                      measure_at_start: bool = True,
                      split_with: tuple[tuple[str, int, str], ...] = ()) -> Engine:
    """An engine loaded and running its decode thread (the load runs off the loop).
    ``memory_budget``: a share of RAM is taken of this machine's; ``measure_at_start``:
    off for a model loaded for a request that waits (registry.EngineSpec)."""
    total = (await asyncio.to_thread(total_memory_bytes) if isinstance(memory_budget, Share)
             else 0)
    try:
        budget = budget_bytes(memory_budget, total)
    except ValueError as exc:  # a share of a small machine
        raise StartError(str(exc), code="bad_budget") from None
    try:
        embedding = await asyncio.to_thread(registry.makes_embeddings, model.runtime,
                                            model.path)
        engine = registry.make_engine(model.runtime, model.path, model_name=name, lanes=lanes,
                                      max_context=max_context, mock_speed=mock_speed,
                                      memory_budget=budget, kv_type=kv_type, gpu=gpu,
                                      embedding=embedding, measure_at_start=measure_at_start,
                                      split_with=split_with)
        await engine.start()
    except (RuntimeUnavailable, FileNotFoundError, ValueError) as exc:
        raise StartError(str(exc), code="cannot_load") from None
    return engine


async def load_head_model(model: Resolved, *, chat_template: Path | None = None,
                          read: Callable[[Path], str] | None = None) -> HeadModel:
    """The head's tokenizer and template for ``model`` (the vocabulary loads off the loop)."""
    template: str | None = None
    if chat_template is not None:
        try:
            template = await asyncio.to_thread(chat_template.read_text, encoding="utf-8")
        except OSError as exc:
            raise StartError(f"cannot read the chat template {chat_template}: "
                             f"{exc.strerror}; check the path", code="bad_template") from None
    try:
        return await asyncio.to_thread(_load_head_model, model.runtime, model.path,
                                       name=model.name, chat_template=template)
    except (RuntimeUnavailable, FileNotFoundError, ValueError) as exc:
        raise StartError(str(exc), code="cannot_load") from None
    except TemplateError as exc:
        raise StartError(f"the chat template {chat_template} does not compile: {exc}; fix "
                         "it or leave out --chat-template", code="bad_template") from None

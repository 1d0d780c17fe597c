"""The models this machine's head serves: the one it starts on, those its settings name
besides it (``also_models``), and those it learns while it runs because a fleet node
serves them (from the GGUF header alone, fetched off the loop). `HeadModels` owns the
background learning and is the only writer of ``also_models``, through `Configuration`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from engine.errors import StartError
from engine.events import Notice, ShoalEvent
from engine.head.prompt.model import HeadModel
from engine.models import cache as model_cache
from engine.models import errors as model_errors
from engine.models import ids
from engine.models.learn import READS_HEADERS, learn_model
from engine.models.loading import Pulls, Resolved, load_head_model, resolve
from engine.roles.head_role import HeadRole
from engine.service.configuration import Configuration
from engine.settings import HeadSettings
from engine.tasks import TaskSet, cancel_and_wait

log = logging.getLogger("shoal")

# a model spec (None: the embedded default) and a runtime, made a file here: pulled with
# progress when it is not (`ModelSource`)
Resolve = Callable[[str | None, str | None], Awaitable[Resolved]]


class ModelSource:
    """Models made ready for this Shoal: found here, else pulled through its ``pulls``
    (PullProgress events as they go), offline when the settings say so."""

    def __init__(self, conf: Configuration, pulls: Pulls,
                 emit: Callable[[ShoalEvent], None]) -> None:
        self._conf, self._pulls, self._emit = conf, pulls, emit

    async def __call__(self, spec: str | None, runtime: str | None) -> Resolved:
        s = self._conf.settings
        return await resolve(spec, runtime, home=s.home, offline=s.offline, emit=self._emit,
                             pulls=self._pulls)


class HeadModels:
    def __init__(self, conf: Configuration, *, resolve: Resolve,
                 emit: Callable[[ShoalEvent], None],
                 head: Callable[[], HeadRole | None]) -> None:
        self._conf = conf
        self._resolve = resolve
        self._emit = emit
        self._head = head  # the head running now (it changes while a header is fetched)
        self._learning: asyncio.Task[None] | None = None
        self._kept: TaskSet = TaskSet("the head's learning of kept models")

    async def for_start(self, hs: HeadSettings, model: Resolved
                        ) -> tuple[list[HeadModel], list[str]]:
        """The models a head on ``hs`` starts with: ``model`` (made ready), then each of
        ``also_models`` that can be had from disk now; and those that cannot, to learn from
        the hub once it runs (`learn_later`)."""
        models: list[HeadModel] = [await load_head_model(model, chat_template=hs.chat_template)]
        later: list[str] = []
        for other in hs.also_models:
            if model.runtime in READS_HEADERS:
                try:
                    models.append((await learn_model(other, model.runtime,
                                                     home=self._conf.settings.home,
                                                     offline=True))[0])
                except StartError:
                    later.append(other)
                continue
            learnt = await self._also_model(other, model.runtime)
            if learnt is not None:
                models.append(learnt)
        return models, later

    async def learn_later(self, later: list[str]) -> None:
        """Learn ``later`` from the hub, in the background (any learning of an earlier head
        stopped first): the head serves the others meanwhile, and a hub that never answers
        is given up on per file (header_fetch.DEADLINE_S)."""
        await self.close()
        if later:
            self._learning = asyncio.get_running_loop().create_task(
                self._learn_all(later), name="shoal-head-learns")

    def learn_kept(self, names: list[str]) -> None:
        """A fleet node keeps ``names``, which this head has no tokenizer for: learn each
        in the background (a hub id from its header; a name the hub cannot give, such as
        an imported file's, is said in one line and left out)."""
        for name in names:
            self._kept.spawn(self._learn_kept(name), "head-learns-kept")

    async def _learn_kept(self, name: str) -> None:
        head = self._head()
        runtime = head.head.model.runtime if head is not None else ""
        try:
            ids.parse_model_id(name)
        except ValueError:
            # not a hub id (a file imported under a name): only a copy here can teach it
            if runtime != "mock" and not await asyncio.to_thread(
                    self._kept_here, name):
                self._warn(f"a fleet node keeps {name}, which this machine's API cannot "
                           "serve: it is no hub id, so its tokenizer cannot be fetched; "
                           f"import the same file here (`shoal models import FILE --name "
                           f"{name}`) and restart Shoal")
                return
        await self.learn(name)

    def _kept_here(self, name: str) -> bool:
        try:
            model_cache.resolve_model(name, home=self._conf.settings.home, offline=True)
        except (model_errors.ModelMissing, ValueError):
            return False
        return True

    async def close(self) -> None:
        await cancel_and_wait([self._learning, *self._kept],
                              "the head's models from the hub")
        self._learning = None

    async def learn(self, spec: str) -> str:
        """This machine's head learns ``spec``, which a fleet node now serves: its tokenizer
        and template from the model's GGUF header alone, kept in the head's
        ``also_models`` across restarts. Returns the line of what happened ("" when the
        head had it, or had it from a file here); a failure is that line too (the node
        serves the model all the same), and a Notice."""
        head = self._head()
        if head is None or spec in head.head.models:
            return ""
        settings = self._conf.settings
        try:
            model, line = await learn_model(spec, head.head.model.runtime,
                                            home=settings.home, offline=settings.offline)
        except StartError as exc:
            return self._warn(f"this machine's API cannot serve {spec}: {exc}")
        head = self._head()
        if head is not None and spec not in head.head.models:
            head.head.add_model(model)
        hs = self._conf.settings.head
        if hs is not None and spec not in hs.also_models:
            self._conf.update(lambda s: replace(s, head=replace(
                hs, also_models=(*hs.also_models, spec))))
            # a restart's head learns it again, from disk
            self._conf.save_soon(lambda text: self._emit(Notice(level="error", text=text)))
        log.info("this machine's API serves %s too%s", spec, f" ({line})" if line else "")
        return f"this machine's API {line}" if line else ""

    async def _learn_all(self, specs: list[str]) -> None:
        for spec in specs:
            await self.learn(spec)

    async def _also_model(self, spec: str, runtime: str) -> HeadModel | None:
        """Another model the head serves (``also_models``): through its header where the
        runtime reads one, else its file. One that cannot be had is said in one line and
        left out: the head serves the others."""
        settings = self._conf.settings
        try:
            if runtime in READS_HEADERS:
                return (await learn_model(spec, runtime, home=settings.home,
                                          offline=settings.offline))[0]
            return await load_head_model(await self._resolve(spec, runtime))
        except StartError as exc:
            self._warn(f"this machine's API does not serve {spec}: {exc}")
            return None

    def _warn(self, line: str) -> str:
        log.warning("%s", line)
        self._emit(Notice(level="warning", text=line))
        return line

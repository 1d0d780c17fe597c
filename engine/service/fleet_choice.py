"""What the fleet asks of this machine's models: a head asks this node to serve another
model, whole or split with machines that lend memory. `answer_at_once` is the pure
decision (the settings, what is served and what is being switched to); `FleetChoice`
executes a taken choice (room made under the owner's quota, the pull without the role
lock, the swap under it) and is the only keeper of what was chosen and why it failed,
which this node's stats tell its heads (`machine_facts`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from engine.errors import ShoalError
from engine.events import Notice, ShoalEvent
from engine.models import bandwidth
from engine.models import cache as model_cache
from engine.models import store as model_store
from engine.models.loading import Pulls, Resolved
from engine.models.pulls import peers as fleet_peers
from engine.models.pulls.quota import Quota
from engine.node.machine import DiskFree, MachineFacts
from engine.roles.fleet_models import Made, room_for
from engine.service.configuration import Configuration
from engine.service.head_models import Resolve
from engine.settings import NodeSettings
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal")

ROOM_S = 8.0  # how long a node sizes a model a head chose before answering (links.ANSWER_S)
STOPPING = "this machine is stopping; ask again once it serves"

# serve a model (pulled already) here in place of the one served now, split with the
# machines whose node listeners are given (none: whole); its name
Swap = Callable[[str, str | None, Resolved, tuple[str, ...]], Awaitable[str]]


def answer_at_once(spec: str, node: NodeSettings | None, *, stopping: bool,
                   switching_to: str | None, serving: str | None,
                   split_with: tuple[str, ...] = ()) -> tuple[bool, str] | None:
    """The answer to a head that asks this node to serve ``spec`` (split with the machines
    at ``split_with``, where any) when it needs no look at the disk or the hub: refused
    (why, and where to choose instead), or taken because it is served so already; None:
    take it, once room is made for it."""
    if node is None or stopping:
        return False, STOPPING
    if not node.fleet_may_choose_model:
        return False, ("this machine keeps the model its user chose (Settings: \"Let "
                       "the fleet choose this machine's model\" is off); choose its "
                       "model on that machine")
    if node.upstream is not None:
        return False, (f"this node fronts the engine at {node.upstream}; choose that "
                       "engine's model there")
    if switching_to is not None:
        return False, (f"this node is switching to {switching_to} already; ask again once "
                       "it serves it")
    if serving == spec and tuple(node.split_with) == split_with:
        return True, f"serves {spec} already" + (
            f" split with {', '.join(split_with)}" if split_with else "")
    return None


class FleetChoice:
    """The model a head of the fleet chose for this node: answered, pulled and swapped in.
    ``serving``: the model this node serves now (None: no node); ``swap``: the running
    roles' swap; ``ram_total``: this machine's RAM, for its facts."""

    def __init__(self, conf: Configuration, *, pulls: Pulls, resolve: Resolve, swap: Swap,
                 serving: Callable[[], str | None], ram_total: Callable[[], int],
                 emit: Callable[[ShoalEvent], None],
                 clock: Callable[[], float]) -> None:
        self._conf, self._pulls, self._resolve, self._swap = conf, pulls, resolve, swap
        self._serving, self._ram_total, self._emit, self._clock = serving, ram_total, emit, clock
        self._task: asyncio.Task[None] | None = None
        self._spec = ""
        self._lenders: tuple[str, ...] = ()  # the machines the model under way splits with
        self._failed = ""  # why the model a head chose last could not be served
        self._disk: DiskFree | None = None  # the disk free where this node keeps models
        # this machine's RAM bandwidth, measured once per machine off the loop (0 until read)
        self._bandwidth: asyncio.Future[int] | None = None
        self._stopping = False

    async def ask(self, spec: str, split_with: tuple[str, ...] = ()) -> tuple[bool, str]:
        """A head asks this node to serve ``spec`` (a hub id, checked by the agent), split
        with the machines whose node listeners are ``split_with`` where any: taken
        when the settings let the fleet choose and the owner's quota of fleet models has
        room for it (older fleet models removed to make it), then pulled and loaded in the
        background; refused with why otherwise. Answers within ROOM_S (the hub sizes the
        model): beyond it, taken, and a refusal found later is said in the node's stats."""
        node = self._conf.settings.node
        running = self._task is not None and not self._task.done()
        answer = answer_at_once(spec, node, stopping=self._stopping,
                                switching_to=self._spec if running else None,
                                serving=self._serving(), split_with=split_with)
        if answer is not None:
            return answer
        assert node is not None
        self._spec, self._lenders, self._failed = spec, split_with, ""
        loop = asyncio.get_running_loop()
        room: asyncio.Future[str | None] = loop.create_future()
        self._task = loop.create_task(
            self._serve(model_cache.HubId(spec), node.runtime, node.fleet_models_quota, room,
                        split_with),
            name="shoal-fleet-model")
        try:
            async with asyncio.timeout(ROOM_S):
                refusal = await asyncio.shield(room)
        except TimeoutError:
            return True, f"pulling {spec} once the hub says its size; this node serves it " \
                         "once it is loaded"
        if refusal is not None:
            return False, refusal
        split = f" split with {', '.join(split_with)}" if split_with else ""
        return True, f"pulling {spec}; this node serves it{split} once it is loaded"

    def lenders(self) -> tuple[str, ...]:
        """Where the machines that lend memory to the model being switched to take links:
        machines of the fleet, which its pull asks for the model's files too (read from
        the pull's worker thread)."""
        running = self._task is not None and not self._task.done()
        return self._lenders if running else ()

    async def close(self) -> None:
        """Stop with this Shoal: a pull under way goes on from where it stopped at the
        next start."""
        self._stopping = True
        if self._task is not None:
            self._pulls.cancel(self._spec, keep_part=True)
            await cancel_and_wait([self._task], "the model a head chose")

    def machine_facts(self) -> MachineFacts:
        """What this machine's node tells its heads of the machine: RAM, the disk free
        where models are kept (read off the loop every few seconds), a pull under way, and
        why the model a head chose last could not be served."""
        folder = self._conf.settings.models_dir
        if self._disk is None or self._disk.folder != folder:
            self._disk = DiskFree(folder, clock=self._clock)
        pull = next((p for p in reversed(self._pulls.running.values())
                     if p.state == "running"), None)
        return MachineFacts(ram_total=self._ram_total(), disk_free=self._disk.now(),
                            mem_bandwidth=self._mem_bandwidth(),
                            pull_model=pull.model if pull else "",
                            pull_done=pull.done_bytes if pull else 0,
                            pull_total=pull.total_bytes if pull else 0,
                            serve_failed=self._failed)

    async def read_machine(self) -> None:
        """Read this machine's RAM bandwidth before the node's first stats, off the loop
        (measured once, then read from where Shoal keeps it), so that no head sees a
        node's figure appear, and what it suggests change, after the node started."""
        await asyncio.wait([self._reading()])

    def _reading(self) -> asyncio.Future[int]:
        """The one reading of the bandwidth, started in a worker thread on first need."""
        if self._bandwidth is None:
            folder = bandwidth.machine_cache(self._conf.settings.home)
            self._bandwidth = asyncio.get_running_loop().run_in_executor(
                None, bandwidth.memory_bandwidth, folder)
        return self._bandwidth

    def _mem_bandwidth(self) -> int:
        """The RAM's bandwidth as read; 0 while it is read (a node started after this
        Shoal opened, by a join or a switch, has it from its next stats on)."""
        try:
            reading = self._reading()
        except RuntimeError:  # asked outside the loop: nothing to read with
            return 0
        if not reading.done() or reading.cancelled():
            return 0
        return reading.result() if reading.exception() is None else 0

    async def _serve(self, spec: str, runtime: str | None, quota: Quota,
                     room: asyncio.Future[str | None], split_with: tuple[str, ...]) -> None:
        """Make room for ``spec`` (said on ``room``), pull it without the role lock, then
        swap it in under the lock."""
        settings = self._conf.settings
        home = settings.home
        try:
            try:
                # sized where the pull takes it from: the fleet's machines, else the hub
                with fleet_peers.fleet_for(None if settings.offline else self._pulls.peers):
                    made = await asyncio.to_thread(
                        room_for, spec, home=home, offline=settings.offline, quota=quota,
                        runtime=runtime, serving=self._serving() or "")
            except OSError as exc:
                made = Made(refusal=f"could not look at the models kept here ({exc})")
            room.set_result(made.refusal)
            if made.refusal is not None:
                raise ShoalError(made.refusal, code="no_room")
            model = await self._resolve(spec, runtime)
            if made.need:  # a new model, here because the fleet chose it: the quota's
                await asyncio.to_thread(model_store.note_fleet_chosen, home, str(spec))
            name = await self._swap(spec, runtime, model, split_with)
        except ShoalError as exc:
            line = f"could not serve {spec}, which a head of the fleet chose: {exc}"
            log.warning("%s", line)
            self._emit(Notice(level="error", text=line))
            self._failed = line  # the heads hear it in this node's stats
            return
        finally:
            if not room.done():  # stopped first
                room.set_result(STOPPING)
        log.info("serving %s, which a head of the fleet chose", name)

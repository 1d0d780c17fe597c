"""This machine's configuration while Shoal runs: the settings in force, what waits for the
next start, the app's own table, and ``config.toml``. `Configuration` is their only keeper
and writer: every change goes through `update` (a fact of the running roles: the head
turned on, a fleet joined, a model served) or `ask` (a person's change, checked first
and split into what applies now and what waits for the next start)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from engine.config import (
    MODES,
    ConfigError,
    ConfigFile,
    NextStart,
    NodeMemory,
    check_app_table,
    with_port,
)
from engine.errors import CommandError
from engine.models.pulls.quota import Quota
from engine.service.results import SettingsChange
from engine.settings import (
    FLEET_PORT,
    HTTP_DEFAULT,
    DiscoveryMode,
    DiscoverySettings,
    HeadSettings,
    JoinSettings,
    NodeSettings,
    Settings,
    check_gpu,
)
from engine.sizes import (
    KV_TYPES,
    MAX_IDLE_UNLOAD_MIN,
    Budget,
    KvType,
    Share,
    budget_bytes,
    check_bytes,
)

DEFAULT_FLEET_LISTEN = f"0.0.0.0:{FLEET_PORT}"  # other machines join here


@dataclass(frozen=True, slots=True)
class Ask:
    """A person's changes (`Shoal.update_settings`; each None: unchanged). The API's port,
    the port where machines join, discovery and the queue limit wait for the next start;
    how the node holds its model (``memory_budget``: bytes or a share of RAM, 0 the
    default share; ``kv_type``; ``gpu``: auto, off or a device name; ``idle_unload_s``: 0
    never) waits for the node's next start; ``fleet_may_choose_model``,
    ``fleet_models_quota``, ``lend`` and ``lend_on_battery`` apply at once; ``app`` is merged
    key by key."""

    http_port: int | None = None
    fleet_port: int | None = None
    discovery: DiscoveryMode | None = None
    queue_timeout_s: float | None = None
    memory_budget: int | Share | None = None
    kv_type: KvType | None = None
    gpu: str | None = None
    idle_unload_s: float | None = None
    serve_kept: bool | None = None  # serve every model kept here too (the node's next start)
    fleet_may_choose_model: bool | None = None
    fleet_models_quota: Quota | None = None
    lend: bool | None = None  # lend memory to the fleet's split models (at once)
    lend_on_battery: bool | None = None  # and on battery power too (at once)
    app: Mapping[str, Any] | None = None


class Configuration:
    """The settings in force and pending, and the file they are kept in. ``keep``: this
    Shoal owns ``$SHOAL_HOME/config.toml`` (the app), written on every change; ``rejoin``:
    the fleet this machine was in, kept for the next start until a join or a leave
    settles it."""

    def __init__(self, settings: Settings, *, keep: bool = False,
                 app: Mapping[str, Any] | None = None,
                 rejoin: JoinSettings | None = None) -> None:
        self._settings = settings
        self._next = NextStart(join=rejoin)  # over the settings in force
        self._app: dict[str, Any] = check_app_table(app or {})
        self._file = ConfigFile(lambda: (self.pending, self._app)) if keep else None

    @property
    def settings(self) -> Settings:
        """In force: the roles running now have them."""
        return self._settings

    @property
    def pending(self) -> Settings:
        """The settings the next start will have: those in force, with the changes made for
        the next start over them."""
        return self._next.over(self._settings)

    @property
    def rejoin(self) -> JoinSettings | None:
        """The fleet this machine was in, not joined again yet (None: settled)."""
        return self._next.join

    @property
    def app(self) -> Mapping[str, Any]:
        """The app's own choices (config.toml's ``[app]`` table), read-only."""
        return MappingProxyType(self._app)

    def update(self, change: Callable[[Settings], Settings], *,
               rejoin_settled: bool = False) -> Settings:
        """The settings in force as ``change`` makes them (the only write of them);
        ``rejoin_settled``: a join or a leave decided the fleet, so no rejoin waits."""
        self._settings = change(self._settings)
        if rejoin_settled:
            self._next = replace(self._next, join=None)
        return self._settings

    def ask(self, ask: Ask, *, running: bool, ram_total: int) -> SettingsChange:
        """A person's changes: checked (CommandError with the fix, nothing changed), then
        what applies now applied and the rest kept for the next start (at once while
        nothing is ``running``: the next open takes them). `save` writes them."""
        changes, chooser = _checked(ask, self.pending, self._settings, ram_total)
        merged = self._app
        if ask.app:
            try:
                merged = check_app_table({**self._app, **ask.app})
            except ValueError as exc:
                raise CommandError(str(exc), code="bad_setting") from None
        wanted = replace(self._next, **changes)
        if chooser is not None:  # in force at once: the node asks the settings each time
            self._settings = self._settings.with_node(chooser)
        if not running:  # what is asked for is what the next open starts with
            self._settings = replace(wanted, join=None).over(self._settings)
            wanted = NextStart(join=self._next.join)
        self._next, self._app = wanted, merged
        restart = replace(self.pending, join=None) != replace(self._settings, join=None)
        return SettingsChange(pending=self.pending, restart_needed=restart)

    async def save(self) -> None:
        """Write the file now (with ``keep``); CommandError (one line) when it cannot be."""
        if self._file is not None:
            try:
                await self._file.write()
            except ConfigError as exc:
                raise CommandError(str(exc), code="cannot_save") from None

    def save_soon(self, failed: Callable[[str], None]) -> None:
        """Write the file in the background (with ``keep``); ``failed`` gets the line."""
        if self._file is not None:
            self._file.write_soon(failed)

    async def flush(self) -> None:
        """Wait for the writes asked for so far."""
        if self._file is not None:
            await self._file.flush()


def _checked(ask: Ask, pending: Settings, in_force: Settings,
             ram_total: int) -> tuple[dict[str, Any], NodeSettings | None]:
    """The next start's changes and the node's settings that change at once, checked."""
    changes: dict[str, Any] = {}
    if any(v is not None for v in (ask.memory_budget, ask.kv_type, ask.gpu,
                                   ask.idle_unload_s, ask.serve_kept)):
        changes["node_memory"] = _node_memory(pending, ask, ram_total)
    head = pending.head or HeadSettings()
    if ask.http_port is not None:
        changes["http"] = with_port(head.http, _port(ask.http_port, "the API"), HTTP_DEFAULT)
    if ask.fleet_port is not None:
        changes["fleet_listen"] = with_port(head.fleet_listen,
                                            _port(ask.fleet_port, "the fleet"),
                                            DEFAULT_FLEET_LISTEN)
    if ask.discovery is not None:
        if ask.discovery not in MODES:
            raise CommandError(f"discovery is one of {', '.join(MODES)}, not "
                               f"{ask.discovery!r}", code="bad_setting")
        d = pending.discovery
        changes["discovery"] = DiscoverySettings(mode=ask.discovery, seeds=d.seeds,
                                                 tailscale_socket=d.tailscale_socket)
    if ask.queue_timeout_s is not None:
        if isinstance(ask.queue_timeout_s, bool) or not 1 <= ask.queue_timeout_s <= 600:
            raise CommandError("the queue limit is 1 to 600 seconds", code="bad_setting")
        changes["queue_timeout_s"] = float(ask.queue_timeout_s)
    chooser: NodeSettings | None = None
    if ask.fleet_may_choose_model is not None:
        if not isinstance(ask.fleet_may_choose_model, bool):
            raise CommandError("whether the fleet may choose this machine's model is "
                               "true or false", code="bad_setting")
        chooser = replace(require_node(in_force),
                          fleet_may_choose_model=ask.fleet_may_choose_model)
    if ask.fleet_models_quota is not None:
        chooser = replace(chooser or require_node(in_force),
                          fleet_models_quota=_quota(ask.fleet_models_quota))
    if ask.lend is not None:
        if not isinstance(ask.lend, bool):
            raise CommandError("whether this machine lends memory is true or false",
                               code="bad_setting")
        chooser = replace(chooser or require_node(in_force), lend=ask.lend)
    if ask.lend_on_battery is not None:
        if not isinstance(ask.lend_on_battery, bool):
            raise CommandError("whether this machine lends memory on battery is true or "
                               "false", code="bad_setting")
        chooser = replace(chooser or require_node(in_force),
                          lend_on_battery=ask.lend_on_battery)
    return changes, chooser


def no_node() -> CommandError:
    """The refusal of a command that needs this machine's node when it has none."""
    return CommandError("this machine serves no model; choose one to serve first",
                        code="no_node")


def require_node(settings: Settings) -> NodeSettings:
    if settings.node is None:
        raise no_node()
    return settings.node


def _node_memory(pending: Settings, ask: Ask, ram_total: int) -> NodeMemory:
    """How the node will hold its model with these changes (each None: as it is)."""
    now = NodeMemory.of(require_node(pending))
    budget, kv_type, gpu, idle_unload_s = (ask.memory_budget, ask.kv_type, ask.gpu,
                                           ask.idle_unload_s)
    new_budget: Budget = now.memory_budget
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int | Share):
            raise CommandError("the memory budget is a number of bytes or a share of "
                               "this machine's RAM", code="bad_setting")
        try:
            if isinstance(budget, Share):
                budget_bytes(budget, ram_total)
            elif budget != 0:
                check_bytes(budget)
        except ValueError as exc:
            raise CommandError(str(exc), code="bad_setting") from None
        new_budget = budget or None
    if kv_type is not None and kv_type not in KV_TYPES:
        raise CommandError(f"the KV cache is {' or '.join(KV_TYPES)}, not {kv_type!r}",
                           code="bad_setting")
    if gpu is not None:
        try:
            gpu = check_gpu(gpu)
        except ValueError as exc:
            raise CommandError(f"the GPU choice {gpu!r} is not valid; {exc}",
                               code="bad_setting") from None
    idle = now.idle_unload_s
    if idle_unload_s is not None:
        if isinstance(idle_unload_s, bool) or not 0 <= idle_unload_s <= \
                MAX_IDLE_UNLOAD_MIN * 60:
            raise CommandError(f"the model unloads after 0 (never) to "
                               f"{MAX_IDLE_UNLOAD_MIN} minutes idle", code="bad_setting")
        idle = float(idle_unload_s) or None
    if ask.serve_kept is not None and not isinstance(ask.serve_kept, bool):
        raise CommandError("whether the node serves every kept model is true or false",
                           code="bad_setting")
    return NodeMemory(memory_budget=new_budget, kv_type=kv_type or now.kv_type,
                      idle_unload_s=idle, gpu=gpu or now.gpu,
                      serve_kept=now.serve_kept if ask.serve_kept is None
                      else ask.serve_kept)


def _port(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise CommandError(f"{what} port must be a number from 1 to 65535, not {value!r}",
                           code="bad_setting")
    return value


def _quota(value: Quota) -> Quota:
    """The quota of fleet models as given, checked (CommandError with the fix)."""
    if isinstance(value, Share) and 0 < value.percent <= 100:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise CommandError("the fleet's models may use a number of bytes or a share (above 0, "
                       "at most 100%) of the models folder's disk", code="bad_setting")

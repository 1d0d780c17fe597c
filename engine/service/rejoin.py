"""Back into the fleet this machine was in when it last ran. Its heads may be away, or
refuse (the line then says to pair again), so `Rejoin` tries again every REJOIN_EVERY_S
until it works, or until a join or a leave settles which fleet this machine is in. What
it waits for and why shows in the snapshot (`Roles.rejoining`, `Roles.rejoin_error`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from engine.errors import JoinError
from engine.service.configuration import Configuration
from engine.settings import JoinSettings
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal")

REJOIN_EVERY_S = 30.0  # while the fleet's heads are away, look again this often


class Rejoin:
    """``join``: this Shoal's join with the fleet's kept token, by a head's HOST:PORT
    (None: found on the network)."""

    def __init__(self, conf: Configuration, *,
                 join: Callable[[str | None], Awaitable[object]]) -> None:
        self._conf = conf
        self._join = join
        self._task: asyncio.Task[None] | None = None
        self._error: str | None = None

    @property
    def waiting(self) -> bool:
        return self._conf.rejoin is not None

    @property
    def error(self) -> str | None:
        """Why the last try failed, while this machine still waits to be joined again."""
        return self._error if self.waiting else None

    def start(self) -> None:
        """Begin, when a fleet waits to be joined again."""
        join = self._conf.rejoin
        if join is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(join),
                                                                name="shoal-rejoin")

    async def close(self) -> None:
        await cancel_and_wait([self._task], "the rejoin")
        self._task = None

    async def _run(self, join: JoinSettings) -> None:
        while self._conf.rejoin is join:  # a join or a leave settles it
            try:
                await self._join(join.head)
            except JoinError as exc:
                if self._conf.rejoin is not join:
                    break
                self._error = str(exc)
                log.warning("not linked with the fleet: %s; trying again in %.0f s",
                            exc, REJOIN_EVERY_S)
                await asyncio.sleep(REJOIN_EVERY_S)
            else:
                break
        self._error = None

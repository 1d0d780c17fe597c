"""`shoal keys ...`: stateless API keys, files that a running head watches."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from engine.errors import CommandError
from engine.head.access import keys as keyfiles

T = TypeVar("T")


class KeyCommands:
    """Stateless API keys (`shoal keys ...`): files a running head watches."""

    def __init__(self, home: Path) -> None:
        self._home = home

    async def issue(self, name: str) -> str:
        def run() -> str:
            secret = keyfiles.load_or_make_secret(keyfiles.secret_path(self._home))
            return keyfiles.issue_key(secret, name)
        return await self._off_loop(run)

    async def revoke(self, name: str) -> bool:
        """True when the key was live and is revoked now (False: it already was)."""
        return await self._off_loop(
            lambda: keyfiles.revoke(keyfiles.revoked_path(self._home), name))

    async def rotate(self) -> None:
        """A new keys secret: every key issued so far stops working."""
        await self._off_loop(lambda: keyfiles.rotate_secret(keyfiles.secret_path(self._home)))

    @staticmethod
    async def _off_loop(work: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(work)
        except keyfiles.KeysError as exc:
            raise CommandError(str(exc), code="bad_key") from None

"""Alias commands on a running head: what `shoal alias ...`, the admin routes and the app's
Models tab all call.

Each change is made in the head's table, saved (off the loop), pushed to the other
heads of the fleet (once per command: an import of many names too), and reported with
how many heads hold it; it is also published as an `AliasChanged` event. A change
that the table has no room for is refused (``alias_table_full``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import CommandError
from engine.events import AliasChanged, Emit, ignore
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.snapshot import AliasSnapshot, AliasState

MAX_IMPORT = 1 << 20


@dataclass(frozen=True, slots=True)
class AliasChange:
    """A change made, and how far it reached."""

    entry: al.AliasEntry
    heads_holding: int
    heads_total: int

    @property
    def line(self) -> str:
        """What the CLI prints: ``coder -> m then n (ver 3): 2/2 heads``."""
        e = self.entry
        heads = f"{self.heads_holding}/{self.heads_total} heads"
        if e.target is None:
            return f"{e.name} removed (ver {e.version}): {heads}"
        fallbacks = f" then {', '.join(e.fallbacks)}" if e.fallbacks else ""
        return f"{e.name} -> {e.target}{fallbacks} (ver {e.version}): {heads}"


@dataclass(frozen=True, slots=True)
class AliasImport:
    imported: tuple[str, ...]
    heads_holding: int
    heads_total: int


class AliasCommands:
    def __init__(self, head: Head, *, clock: Callable[[], float],
                 emit: Emit = ignore) -> None:
        self._head = head
        self._clock = clock  # wall-clock seconds: entries carry when they were made
        self._emit = emit
        self._lock = asyncio.Lock()  # one change at a time: the table is saved whole

    # -- reading ---------------------------------------------------------------------

    def current(self) -> list[AliasSnapshot]:
        """Every live alias, with what it resolves to now."""
        head = self._head
        out = []
        for e in head.aliases.entries():
            found = head.resolve(e.name)
            state: AliasState = ("unavailable" if found.unavailable else
                                 "shadowed" if found.alias is None else
                                 "fallback" if found.fallback else "ok")
            out.append(AliasSnapshot(name=e.name, target=e.target, fallbacks=e.fallbacks,
                                     version=e.version, updated_at=e.updated_at,
                                     resolves_to=found.model, state=state))
        return out

    def history(self, name: str) -> list[al.AliasEntry]:
        entries = self._head.aliases.history(name)
        if not entries:
            raise CommandError(f"no alias '{name}'; `shoal alias ls` lists them",
                               code="alias_not_found")
        return entries

    def export(self) -> str:
        return self._head.aliases.to_json()

    @property
    def digest(self) -> str:
        return self._head.aliases.digest()

    # -- changing --------------------------------------------------------------------

    async def set(self, name: str, target: str, fallbacks: tuple[str, ...] = ()) -> AliasChange:
        head = self._head
        if name in head.models:
            raise CommandError(f"'{name}' is a model this head serves; a real model name "
                               "always wins, so choose another alias name",
                               code="alias_shadowed")
        async with self._lock:
            try:
                entry = head.aliases.set(name, target, list(fallbacks), self._clock(),
                                         head.fleet.head_id)
            except al.AliasTableFull as exc:
                raise CommandError(str(exc), code="alias_table_full") from None
            except al.AliasError as exc:
                raise CommandError(str(exc), code="invalid_alias") from None
            return await self._changed(entry)

    async def remove(self, name: str) -> AliasChange:
        head = self._head
        async with self._lock:
            try:
                entry = head.aliases.remove(name, self._clock(), head.fleet.head_id)
            except al.AliasError as exc:
                raise CommandError(str(exc), code="alias_not_found") from None
            return await self._changed(entry)

    async def revert(self, name: str) -> AliasChange:
        head = self._head
        async with self._lock:
            try:
                entry = head.aliases.revert(name, self._clock(), head.fleet.head_id)
            except al.AliasTableFull as exc:
                raise CommandError(str(exc), code="alias_table_full") from None
            except al.AliasError as exc:
                raise CommandError(str(exc), code="invalid_alias") from None
            return await self._changed(entry)

    async def import_table(self, data: bytes) -> AliasImport:
        """Load a table written by ``export``; newer entries replace older ones."""
        if len(data) > MAX_IMPORT:
            raise CommandError(f"an alias file larger than {MAX_IMPORT} bytes; split it",
                               code="request_too_large")
        head = self._head
        try:  # a file of a megabyte is parsed and checked off the loop
            incoming = await asyncio.to_thread(al.AliasTable.from_json, data,
                                               source="the imported file")
        except al.AliasError as exc:
            raise CommandError(str(exc), code="invalid_alias") from None
        async with self._lock:
            try:
                changed = head.aliases.import_entries(incoming.entries(), self._clock(),
                                                      head.fleet.head_id)
            except al.AliasTableFull as exc:
                raise CommandError(str(exc), code="alias_table_full") from None
            except al.AliasError as exc:
                raise CommandError(str(exc), code="invalid_alias") from None
            entries = [e for e in map(head.aliases.get, changed) if e is not None]
            held, total = await self._spread(entries)
            for entry in entries:
                self._announce(entry, held, total)
            return AliasImport(tuple(changed), held, total)

    async def _changed(self, entry: al.AliasEntry) -> AliasChange:
        held, total = await self._spread([entry])
        self._announce(entry, held, total)
        return AliasChange(entry, held, total)

    async def _spread(self, entries: list[al.AliasEntry]) -> tuple[int, int]:
        """Save the table and push it to the other heads once: (heads holding every one
        of ``entries``, heads known)."""
        await self._save()
        if not entries:
            return 1, 1
        return await self._head.spread_aliases(entries)

    async def _save(self) -> None:
        await self._head.save_aliases()

    def _announce(self, entry: al.AliasEntry, held: int, total: int) -> None:
        self._emit(AliasChanged(name=entry.name, target=entry.target,
                                fallbacks=entry.fallbacks, version=entry.version,
                                heads_holding=held, heads_total=total))

"""A head's alias file ends equal to its latest table, whatever order the worker threads
that write it finish in: saves go through one writer, one at a time, the latest table
winning. The race is made deterministic by holding the file's writes (``asyncio.to_thread``
of `AliasStore.save`) until the test runs them, newest first: the worst order two
threads could finish in."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from engine.head.commands import AliasCommands
from engine.head.fleet.links import Fleet
from engine.head.fleet.sessions import SessionRunner
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.head.prompt.model import load_head_model
from tests.waiting import until

NONE = al.AliasEntry("none", None, (), 1, 0.0, "h")


class HeldWrites:
    """``asyncio.to_thread`` that holds each write of the alias file until
    :meth:`run_newest_first`; every other call runs as usual."""

    def __init__(self, real: Callable[..., Awaitable[Any]]) -> None:
        self.real = real
        self.held: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self.written: list[str | None] = []  # the target each write put on disk

    async def __call__(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if getattr(func, "__func__", None) is not al.AliasStore.save:
            return await self.real(func, *args, **kwargs)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.held.append((func, args, fut))
        return await fut

    async def run_newest_first(self) -> None:
        while self.held:
            func, args, fut = self.held.pop()
            table: al.AliasTable = args[0]
            entry = table.lookup("coder")
            self.written.append(entry.target if entry else None)
            try:
                fut.set_result(await self.real(func, *args))
            except Exception as exc:
                fut.set_exception(exc)


def make_head(path: Path) -> Head:
    model = load_head_model("mock", "mock-m", name="mock-m")
    fleet = Fleet(model=model.name, head_id="h-saves", psk=None)
    return Head([model], fleet, SessionRunner(fleet), aliases_path=path,
                aliases=al.AliasTable())


async def test_the_file_ends_equal_to_the_latest_table(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldWrites(asyncio.to_thread)
    monkeypatch.setattr(asyncio, "to_thread", held)
    path = tmp_path / "aliases.json"
    head = make_head(path)
    commands = AliasCommands(head, clock=lambda: 10.0)
    try:
        # a change merged from another head asks for a save; at once a change made here
        # (`shoal alias set`) asks for its own
        head.aliases.set("coder", "m0", (), now=1.0, origin="h-peer")
        head.aliases_merged(["coder"])
        change = asyncio.create_task(commands.set("coder", "m1"))
        await until(lambda: held.held and (head.aliases.lookup("coder") or NONE).target == "m1",
                    "both changes made and a save started")
        latest = head.aliases.digest()

        async def on_disk_is_latest() -> bool:
            await held.run_newest_first()
            table = await held.real(al.load, path)
            return bool(table.digest() == latest)

        await until(on_disk_is_latest, "the file to hold the latest table")
        assert (await change).entry.target == "m1"  # told once its change was on disk
    finally:
        await held.run_newest_first()
        await head.close()
    # never an older table after a newer one
    assert held.written[-1] == "m1" and "m1" not in held.written[:-1], held.written
    assert (await held.real(al.load, path)).digest() == latest


async def test_a_save_waits_for_a_write_that_holds_its_change(tmp_path: Path) -> None:
    path = tmp_path / "aliases.json"
    head = make_head(path)
    try:
        head.aliases.set("a", "m1", (), now=1.0, origin="h")
        first = asyncio.create_task(head.save_aliases())
        head.aliases.set("b", "m2", (), now=2.0, origin="h")
        second = asyncio.create_task(head.save_aliases())
        await asyncio.gather(first, second)
        on_disk = await asyncio.to_thread(al.load, path)
        assert [e.name for e in on_disk.entries()] == ["a", "b"]
    finally:
        await head.close()


async def test_a_failed_save_is_told_to_its_caller(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    head = make_head(blocker / "aliases.json")  # its folder cannot be made
    try:
        head.aliases.set("a", "m1", (), now=1.0, origin="h")
        with pytest.raises(al.AliasError, match="cannot write the alias table"):
            await head.save_aliases()
    finally:
        await head.close()

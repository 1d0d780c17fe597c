"""The node's shelf of kept models (engine.node.shelf) over mock engines whose resident
memory the test keeps: loads on demand, the least recently used idle model makes room,
busy ones never do, an engine whose own plan does not fit frees one more and retries,
keep-alive unloads, and the first model takes part through the agent's hooks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from engine.errors import StartError
from engine.node import model_set
from engine.node.shelf import FirstModel, Keep, ModelShelf, Refused
from engine.runtimes.base import Engine
from engine.runtimes.mock import MockEngine
from engine.sizes import MiB

pytestmark = pytest.mark.quick

BASE = 100 * MiB  # the process before any model


class Memory:
    """The resident memory the shelf measures: BASE plus each loaded model's bytes."""

    def __init__(self) -> None:
        self.loaded: dict[str, int] = {}
        self.refuse_below: dict[str, int] = {}  # a model whose own plan wants this free

    def rss(self) -> int:
        return BASE + sum(self.loaded.values())

    def keep(self, name: str, size: int, budget: int) -> Keep:
        memory = self

        class Engine_(MockEngine):
            async def close(self) -> None:
                memory.loaded.pop(name, None)
                await super().close()

        async def load() -> Engine:
            want = self.refuse_below.get(name, 0)
            if want and budget - self.rss() < want:
                raise StartError(f"{name} needs {want} free", code="cannot_load")
            self.loaded[name] = size
            return Engine_(model=name, lanes=2)

        return Keep(name=name, size=size, load=load, keep_alive_s=60.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def shelf_of(memory: Memory, budget: int, sizes: dict[str, int],
             clock: Callable[[], float] | None = None) -> ModelShelf:
    # a model's measured holding is its size here; its first load's need is size + margin
    return ModelShelf([memory.keep(n, s, budget) for n, s in sizes.items()], budget=budget,
                      clock=clock or Clock(), rss=memory.rss)


async def use(shelf: ModelShelf, name: str, keep_alive_s: float | None = None) -> Engine:
    engine = await shelf.acquire(name)
    shelf.release(name, keep_alive_s)
    return engine


async def test_the_least_recently_used_idle_model_makes_room() -> None:
    memory, clock = Memory(), Clock()
    shelf = shelf_of(memory, 600 * MiB, {"a": 200 * MiB, "b": 200 * MiB, "c": 150 * MiB},
                     clock)
    try:
        assert (await use(shelf, "a")).info.model == "a"
        clock.now += 1
        await use(shelf, "b")
        clock.now += 1
        await use(shelf, "a")  # b is now the least recently used
        assert set(memory.loaded) == {"a", "b"}
        clock.now += 1
        await use(shelf, "c")
        assert set(memory.loaded) == {"a", "c"}
        assert [r.state for r in shelf.records()] == ["loaded", "unloaded", "loaded"]
        await use(shelf, "b")  # loads again: a, now the oldest, makes room
        assert "b" in memory.loaded and memory.rss() <= 600 * MiB
    finally:
        await shelf.close()
    assert memory.loaded == {}


async def test_a_busy_model_is_never_unloaded_and_the_refusal_has_the_numbers() -> None:
    memory = Memory()
    shelf = shelf_of(memory, 500 * MiB, {"a": 250 * MiB, "b": 250 * MiB})
    try:
        await shelf.acquire("a")  # answering: held busy
        with pytest.raises(Refused) as refused:
            await shelf.acquire("b")
        line = str(refused.value)
        assert "\n" not in line and "b needs" in line and "a (250 MiB)" in line, line
        assert set(memory.loaded) == {"a"}
        shelf.release("a")
        await use(shelf, "b")
        assert set(memory.loaded) == {"b"}
    finally:
        await shelf.close()


async def test_an_engine_whose_own_plan_does_not_fit_frees_one_more_and_retries() -> None:
    memory, clock = Memory(), Clock()
    shelf = shelf_of(memory, 700 * MiB, {"a": 150 * MiB, "b": 150 * MiB, "c": 100 * MiB},
                     clock)
    memory.refuse_below["c"] = 350 * MiB  # its pool wants more than the policy guessed
    try:
        await use(shelf, "a")
        clock.now += 1
        await use(shelf, "b")
        clock.now += 1
        await use(shelf, "c")
        assert set(memory.loaded) == {"b", "c"}  # a, the oldest, went for it
    finally:
        await shelf.close()


async def test_a_model_unloads_after_its_keep_alive_and_zero_unloads_at_once() -> None:
    memory = Memory()
    shelf = shelf_of(memory, 900 * MiB, {"a": 100 * MiB, "b": 100 * MiB},
                     clock=time.monotonic)
    try:
        await use(shelf, "a", keep_alive_s=0.0)
        await use(shelf, "b", keep_alive_s=model_set.FOREVER)
        await until(lambda: "a" not in memory.loaded)
        assert "b" in memory.loaded
        # a request that names no keep_alive brings back the model's default (60 s here)
        await use(shelf, "a", keep_alive_s=0.0)
        await use(shelf, "a")
        assert shelf.records()[0].state == "loaded"
    finally:
        await shelf.close()


async def test_an_idle_time_set_for_a_model_applies_to_it_from_then_on() -> None:
    """The owner's idle time for one model (the Models page, `shoal models keep-alive`):
    an idle loaded model unloads by it at once, later requests that name no keep_alive
    keep to it, and the other models keep theirs."""
    memory = Memory()
    shelf = shelf_of(memory, 900 * MiB, {"a": 100 * MiB, "b": 100 * MiB},
                     clock=time.monotonic)
    try:
        assert [r.load_ms for r in shelf.records()] == [0, 0]  # never loaded yet
        await use(shelf, "a")
        await use(shelf, "b")
        assert all(r.load_ms >= 1 for r in shelf.records())  # placement prices the next
        shelf.set_keep_alive("a", 0.0)
        await until(lambda: "a" not in memory.loaded)
        await use(shelf, "a")  # names none: the model's own idle time, now 0
        await until(lambda: "a" not in memory.loaded)
        assert "b" in memory.loaded
        shelf.set_keep_alive("a", model_set.FOREVER)
        await use(shelf, "a")
        assert [r.state for r in shelf.records()] == ["loaded", "loaded"]
    finally:
        await shelf.close()


async def test_the_first_model_is_unloaded_through_its_agent_when_it_is_the_oldest() -> None:
    memory, clock = Memory(), Clock()
    shelf = shelf_of(memory, 500 * MiB, {"b": 200 * MiB}, clock)
    unloaded: list[str] = []
    memory.loaded["first"] = 250 * MiB

    async def unload() -> None:
        unloaded.append("first")
        memory.loaded.pop("first")

    def held() -> model_set.Held | None:
        return (model_set.Held("first", 250 * MiB, 999.0, 0, 60.0)
                if "first" in memory.loaded else None)

    shelf.first = FirstModel(name="first", held=held, unload=unload)
    try:
        await use(shelf, "b")
        assert unloaded == ["first"] and set(memory.loaded) == {"b"}
        await shelf.make_room("first", 250 * MiB)  # the agent wakes it: b goes
        assert memory.loaded == {}
    finally:
        await shelf.close()


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # the shelf's own task changes it
            await asyncio.sleep(0.01)


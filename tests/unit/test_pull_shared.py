"""One download per blob in a process (engine/models/pulls/shared.py): callers share a transfer,
hear its progress and get its result or its error; a cancel lets one caller go, and
stops the transfer only when every caller has cancelled. Threads and events, no sockets."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.models.errors import CancelFlag, ModelMissing, PullCancelled
from engine.models.pulls.shared import Handle, Shared

WAIT_S = 10.0
KEY = "ab" * 32


class Work:
    """A transfer's work held until the test lets it go on."""

    def __init__(self, result: Path = Path("/blob")) -> None:
        self.calls = 0
        self.began = threading.Event()
        self.go = threading.Event()
        self.saw_stop = False
        self.result = result
        self.fail: Exception | None = None

    def __call__(self, handle: Handle) -> Path:
        self.calls += 1
        handle.holding()
        handle.report("pulling x", 0, 10)
        self.began.set()
        for _ in range(int(WAIT_S / 0.01)):  # blocks come, until the test lets it end
            if handle.stopped():  # checked between blocks, as a download does
                self.saw_stop = True
                raise PullCancelled("the pull was cancelled; choose the model again")
            if self.go.wait(0.01):
                break
        if self.fail is not None:
            raise self.fail
        handle.report("", 10, 10)
        return self.result


def until_callers(shared: Shared, n: int) -> None:
    done = threading.Event()
    for _ in range(1000):
        if shared.callers(KEY) == n:
            return
        done.wait(0.01)
    raise AssertionError(f"{n} callers never waited (now {shared.callers(KEY)})")


@pytest.fixture
def pool() -> ThreadPoolExecutor:
    with ThreadPoolExecutor(4) as executor:
        yield executor


def start(pool: ThreadPoolExecutor, shared: Shared, work: Work, cancel: CancelFlag,
          seen: list[tuple[str, int, int]]) -> Future[Path]:
    return pool.submit(shared.run, KEY, work,
                       lambda line, done, total: seen.append((line, done, total)), cancel)


def test_two_callers_share_one_transfer_and_its_progress(pool: ThreadPoolExecutor) -> None:
    shared, work = Shared(), Work()
    first: list[tuple[str, int, int]] = []
    second: list[tuple[str, int, int]] = []
    a = start(pool, shared, work, CancelFlag(), first)
    assert work.began.wait(WAIT_S)
    b = start(pool, shared, work, CancelFlag(), second)
    until_callers(shared, 2)
    work.go.set()
    assert a.result(WAIT_S) == b.result(WAIT_S) == Path("/blob")
    assert work.calls == 1
    assert first == [("pulling x", 0, 10), ("", 10, 10)]
    assert second == [("", 10, 10)]  # joined after the first report
    assert shared.callers(KEY) == 0


def test_every_caller_gets_the_error(pool: ThreadPoolExecutor) -> None:
    shared, work = Shared(), Work()
    work.fail = ModelMissing("x came out with sha256 ab…, the hub says cd…; run again")
    a = start(pool, shared, work, CancelFlag(), [])
    assert work.began.wait(WAIT_S)
    b = start(pool, shared, work, CancelFlag(), [])
    until_callers(shared, 2)
    work.go.set()
    for f in (a, b):
        with pytest.raises(ModelMissing, match="came out with sha256"):
            f.result(WAIT_S)


def test_a_bug_in_the_work_reaches_each_caller_as_one_line(pool: ThreadPoolExecutor) -> None:
    shared, work = Shared(), Work()
    work.fail = KeyError("oops")
    work.go.set()
    with pytest.raises(ModelMissing) as info:
        start(pool, shared, work, CancelFlag(), []).result(WAIT_S)
    assert str(info.value).startswith("the pull failed ('oops'); run again")


def test_one_cancel_of_two_lets_that_caller_go_and_the_other_wait(
        pool: ThreadPoolExecutor) -> None:
    shared, work = Shared(), Work()
    cancel = CancelFlag()
    a = start(pool, shared, work, cancel, [])
    assert work.began.wait(WAIT_S)
    b = start(pool, shared, work, CancelFlag(), [])
    until_callers(shared, 2)
    cancel.set()
    with pytest.raises(PullCancelled):
        a.result(WAIT_S)  # at once: the work is still held
    assert not b.done() and shared.callers(KEY) == 1
    work.go.set()
    assert b.result(WAIT_S) == Path("/blob")
    assert not work.saw_stop and work.calls == 1


def test_the_transfer_stops_when_every_caller_cancelled(pool: ThreadPoolExecutor) -> None:
    shared, work = Shared(), Work()
    first, second = CancelFlag(), CancelFlag()
    a = start(pool, shared, work, first, [])
    assert work.began.wait(WAIT_S)
    b = start(pool, shared, work, second, [])
    until_callers(shared, 2)
    first.set()
    with pytest.raises(PullCancelled):
        a.result(WAIT_S)
    second.set()
    with pytest.raises(PullCancelled):
        b.result(WAIT_S)
    # the last caller waited for the work to end (its part removed) before it returned
    assert work.saw_stop and shared.callers(KEY) == 0


def test_a_caller_after_a_stop_starts_a_new_transfer(pool: ThreadPoolExecutor) -> None:
    shared, work = Shared(), Work()
    cancel = CancelFlag()
    cancel.set()  # cancelled before it even began
    with pytest.raises(PullCancelled):
        start(pool, shared, work, cancel, []).result(WAIT_S)
    again = Work(Path("/blob2"))
    again.go.set()
    assert start(pool, shared, again, CancelFlag(), []).result(WAIT_S) == Path("/blob2")
    assert again.calls == 1


def test_a_cancel_flag_wakes_who_waits_on_it() -> None:
    cancel = CancelFlag()
    woken: list[str] = []
    undo = cancel.on_set(lambda: woken.append("a"))
    cancel.on_set(lambda: woken.append("b"))
    undo()
    cancel.set()
    assert woken == ["b"] and cancel.requested
    cancel.on_set(lambda: woken.append("c"))  # already set: at once
    assert woken == ["b", "c"]
    with pytest.raises(PullCancelled):
        cancel.check()

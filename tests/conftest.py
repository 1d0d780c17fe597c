"""Fixtures for every level of the suite."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.leaks import Baseline
from tests.loopwatch import LoopWatch

LOOP_BOUND_S = 0.1

# never the developer's keychain: in-process tests keep tokens in their temporary homes
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.null.Keyring"


@pytest_asyncio.fixture
async def loop_watch() -> AsyncIterator[LoopWatch]:
    """Fails the test if its event loop was blocked for more than LOOP_BOUND_S, or if
    it left a thread, a task or a socket behind."""
    base = Baseline.now()
    watch = LoopWatch(asyncio.get_running_loop(), bound_s=LOOP_BOUND_S)
    watch.start()
    yield watch
    watch.stop()
    if watch.stalls:
        pytest.fail(watch.report(), pytrace=False)
    leaks = await base.leaks()
    if leaks:
        pytest.fail("the test left behind: " + "; ".join(leaks), pytrace=False)


@pytest.fixture(autouse=True)
def _found_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's own record of the addresses found on the network that its process
    dialed: a port a test failed on is another test's later (engine/link/found.py)."""
    from engine.link import found, transport

    monkeypatch.setattr(transport, "_FOUND", found.FoundAddresses())


@pytest.fixture(autouse=True)
def _no_blocked_loop(request: pytest.FixtureRequest) -> None:
    """Every async test that runs engine code in its loop is under the loop-lag probe
    and the leak check.

    Left out: tests that drive Shoal as processes (the ``cluster`` fixture, or the mark
    ``processes``: they start and stop processes with blocking calls, and no engine code
    runs in the test's loop, only a client), and tests marked ``blocking_ok`` (they say
    why)."""
    test = getattr(request.node, "obj", None)
    if not inspect.iscoroutinefunction(test) or "cluster" in request.fixturenames:
        return
    node = request.node
    if not node.get_closest_marker("blocking_ok") and not node.get_closest_marker("processes"):
        request.getfixturevalue("loop_watch")


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """llama.cpp's llama-server for the installed llama-cpp-python, built once per machine
    by scripts/test (scripts/lib/llama_server.py). Missing is a failure, not a skip: the
    tests of ``--runtime llama-server`` must run wherever the suite runs."""
    from scripts.lib.llama_server import binary_path, find_llama_server

    found = find_llama_server()
    if found is None:
        pytest.fail(f"llama-server is not built at {binary_path()}; run scripts/test, which "
                    "builds it once for this machine (about 30 minutes on 2 cores)",
                    pytrace=False)
    return found


@pytest.fixture(scope="session")
def agent_binaries() -> dict[str, Path]:
    """The coding agents the tests run, at their pinned versions, installed once per machine
    by scripts/test (scripts/lib/agents.py). Missing is a failure, not a skip: the agents'
    tests must run wherever the suite runs."""
    from scripts.lib.agents import PINS, cache_root, installed

    found = {a.name: installed(a.name) for a in PINS}
    missing = [f"{a.package}@{a.version}" for a in PINS if found[a.name] is None]
    if missing:
        pytest.fail(f"agents not installed under {cache_root()}: {', '.join(missing)}; run "
                    "scripts/test, or .venv/bin/python scripts/lib/agents.py, which installs "
                    "them once for this machine", pytrace=False)
    return {name: path for name, path in found.items() if path is not None}


# the edit-test loop (`scripts/test --quick`, i.e. `pytest -m quick`): the unit tests and the
# in-process integration tests, which take a fraction of a second each (about two minutes in
# all on 2 cores); CI runs everything
QUICK_LEVELS = ("unit", "integration")
NOT_QUICK_MARKS = ("e2e", "ui", "netns", "slow", "drills", "installer", "processes")
# what only the full run sets up (scripts/test builds or installs them before pytest), and
# Shoal as processes (each start costs a second or more of CPU)
NOT_QUICK_FIXTURES = ("llama_server_binary", "agent_binaries", "cluster")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        try:
            level = item.path.relative_to(tests).parts[0]
        except ValueError:
            continue
        if level not in QUICK_LEVELS:
            continue
        if any(item.get_closest_marker(mark) for mark in NOT_QUICK_MARKS):
            continue
        if any(f in getattr(item, "fixturenames", ()) for f in NOT_QUICK_FIXTURES):
            continue
        item.add_marker(pytest.mark.quick)

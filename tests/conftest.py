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
# the machine's RAM bandwidth, measured once for the whole run (a second of both CPUs)
# rather than in each of the hundreds of homes the tests' Shoal processes start in
os.environ.setdefault("SHOAL_MACHINE_CACHE", "/tmp/shoal-test-machine")


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
                    "builds it once for this machine (2 to 13 minutes on 2 cores)",
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


# scripts/test runs the suite on two workers (pytest-xdist); the tests of one group run on
# one worker, one after another, in the order below (xdist's own groups, --dist loadgroup,
# do nothing under pytest 9: it renames items by a field pytest no longer reads)
SERIAL_GROUPS = {
    # dpkg installs the one .deb on this machine, and the benchmark's smoke runs that build
    "installer": ("installer/test_deb.py", "bench/test_smoke.py::test_installer"),
    # fixed mDNS names and ports on this machine's multicast
    "mdns": ("integration/test_mdns.py", "integration/test_hostile_mdns.py",
             "integration/test_discovery_guards.py"),
}


def serial_group(nodeid: str) -> str | None:
    where = nodeid.removeprefix("tests/")
    return next((g for g, prefixes in SERIAL_GROUPS.items() if where.startswith(prefixes)),
                None)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Each group a unit of work for one worker; every other test a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return serial_group(nodeid) or nodeid

    return Groups(config, log)  # type: ignore[arg-type]


def pytest_configure(config: pytest.Config) -> None:
    _pin_worker()


def _pin_worker() -> None:
    """Under xdist, each worker (and the processes it starts) on CPUs of its own: llama.cpp
    sizes its threads to the CPUs it may use, and two workers' nodes each running a thread
    per core of the machine spun at ggml's barriers for cores the other held (a test of
    15 s took 184)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return
    os.sched_setaffinity(0, cpus[int(worker[2:]) % count::count])


def _installer_benchmark_last(items: list[pytest.Item]) -> None:
    """The installer's benchmark after the build it measures (collected first, it would
    find none on a fresh clone and skip)."""
    group = [i for i in items if serial_group(i.nodeid) == "installer"]
    builds = [i for i in group if not i.nodeid.startswith("tests/bench/")]
    for item in (i for i in group if builds and i not in builds):
        items.remove(item)
        items.insert(items.index(builds[-1]) + 1, item)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    _installer_benchmark_last(items)
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

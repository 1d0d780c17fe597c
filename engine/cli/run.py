"""Running Shoal in the foreground for the CLI: start it, print what a person needs, stop
it on SIGINT or SIGTERM. The printing follows the engine's events; `shoal node leave`
finds a joined node of this machine through a small state file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from engine.events import Notice, PullProgress, ShoalEvent, Subscription
from engine.files import write_private
from engine.models.pulls import text as pull_text
from engine.process_stamp import PROC, process_stamp, same_process
from engine.service import Shoal
from engine.serving_gc import pace_for_serving
from engine.settings import UPSTREAM_RUNTIMES, Settings
from engine.sizes import amount
from engine.snapshot import LocalNodeSnapshot
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal")
WINDOW_WAIT_S = 3.0  # how long `serve` waits for a node's window before its banner
DRAIN_S = 10.0
LEAVE_WAIT_S = 10.0


def setup_logging(name: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{name}: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # huggingface_hub's HTTP client logs each request; a pull prints its own lines
    logging.getLogger("httpx2").setLevel(logging.WARNING)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


class PullLines:
    """What the CLI prints of a pull: each step's line once (``pulling org/repo/file``),
    then a line at every tenth of the bytes with the rate and the time left."""

    def __init__(self) -> None:
        self._said: dict[str, tuple[str, int]] = {}  # model -> (last line, last tenth)

    def lines(self, event: PullProgress) -> list[str]:
        if event.state != "running":
            self._said.pop(event.model, None)
            return [event.message] if event.message else []
        said, tenth = self._said.get(event.model, ("", -1))
        out: list[str] = []
        if event.message and event.message != said:
            out.append(event.message)
            said, tenth = event.message, (10 * event.done_bytes // event.total_bytes
                                          if event.total_bytes > 0 else -1)
        if event.total_bytes > 0:
            now = 10 * event.done_bytes // event.total_bytes
            if now > tenth:
                out.append(f"pulling {event.model}: " + pull_text.progress(
                    event.done_bytes, event.total_bytes, event.rate_bps, event.eta_s))
                tenth = now
        self._said[event.model] = (said, tenth)
        return out


def _print_event(event: ShoalEvent, pulls: PullLines) -> None:
    """What the CLI shows of the engine's events (its logs say the rest)."""
    if isinstance(event, PullProgress):
        for line in pulls.lines(event):
            log.info("%s", line)
    elif isinstance(event, Notice):
        log.log(logging.ERROR if event.level == "error" else logging.WARNING, "%s", event.text)


async def _print_events(events: Subscription) -> None:
    pulls = PullLines()
    async for event in events:
        _print_event(event, pulls)


async def run(settings: Settings, banner: Callable[[Shoal], Awaitable[list[str]]], *,
              state: Callable[[Shoal], dict[str, object]] | None = None) -> int:
    """Start Shoal, print ``banner(shoal)`` on stdout, run until a signal, stop."""
    stop = _stop_event()
    shoal = Shoal(settings)
    events = shoal.events()
    printer = asyncio.create_task(_print_events(events), name="cli-printer")
    state_file = node_state_path(settings.home) if state is not None else None
    try:
        await shoal.open()
        pace_for_serving()
        for line in await banner(shoal):
            print(line, flush=True)
        if state_file is not None and state is not None:
            await asyncio.to_thread(_write_state, state_file, state(shoal))
        await stop.wait()
    finally:
        await shoal.stop(drain=DRAIN_S)
        events.close()
        await cancel_and_wait([printer], "the event printer")
        if state_file is not None:
            with contextlib.suppress(FileNotFoundError):
                state_file.unlink()
    return 0


async def wait_for_window(shoal: Shoal, wait_s: float = WINDOW_WAIT_S) -> int:
    """The context window of the head's model, once a node has said it (bounded)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_s):
            events = shoal.events()
            try:
                while not shoal.snapshot().context_window():
                    await events.get()  # a node linking is an event
            finally:
                events.close()
    return shoal.snapshot().context_window()


# -- a joined node of this machine, for `shoal node leave` ------------------------------


def node_lines(node: LocalNodeSnapshot) -> list[str]:
    """What a node prints when it starts: what the runtime serves, where it listens."""
    how = "pinned by --max-context" if node.window_pinned else "the model's own"
    if node.runtime == "mock":
        how = "mock engine, for tests"
    elif node.runtime in UPSTREAM_RUNTIMES:
        how = "as the engine there says" if not node.window_pinned else how
    link = "encrypted" if node.encrypted else "plaintext, loopback only"
    kind = ("an embedding model: it makes embeddings (/v1/embeddings), not text; "
            if node.embeddings else "")
    return [f"runtime {node.runtime} serves {node.path}: {kind}context window "
            f"{node.context_window} tokens ({how}), {node.lanes} lanes",
            *([node.device_note] if node.device_note else []),
            *pool_lines(node),
            f"node '{node.identity}' serving '{node.model}' on {node.address} (link {link}): "
            f"context window {node.context_window} tokens, {node.lanes} lanes"]


def pool_lines(node: LocalNodeSnapshot) -> list[str]:
    """The KV pool and memory budget, for a runtime that keeps them."""
    if not node.memory_budget:
        return []
    host = (f", a host prompt cache of up to {amount(node.host_cache_limit)}"
            if node.host_cache_limit else "")
    return [f"KV pool of {node.kv_cells} cells shared by {node.lanes} lanes{host}, within a "
            f"memory budget of {amount(node.memory_budget)} (--memory-budget)"]


def node_state_path(home: Path) -> Path:
    return home / "fleet" / "node.json"


def _write_state(path: Path, state: dict[str, object], *, proc: Path = PROC) -> None:
    """Record this process (its pid, and its stamp, so that `leave` signals this very
    process and no later one given the same pid) with ``state``; written atomically."""
    pid = os.getpid()
    doc = {"pid": pid, "started": process_stamp(pid, proc=proc), **state}
    write_private(path, json.dumps(doc).encode("utf-8"))


def leave(home: Path, *, forget_token: bool, proc: Path = PROC) -> list[str]:
    """Stop this machine's joined node (it runs in another process), forget its head, and
    the token if asked. Returns what was done, one line each. The node is signalled only
    when its pid still names the process that wrote the state file (``proc``: where
    procfs is; elsewhere ``ps`` is asked)."""
    done: list[str] = []
    path = node_state_path(home)
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError
    except (FileNotFoundError, ValueError):
        state = None
    if state is not None:
        pid = state.get("pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else 0
        if pid and same_process(pid, state.get("started"), proc=proc):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + LEAVE_WAIT_S
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            heads = state.get("heads")
            names = ", ".join(str(h) for h in heads) if isinstance(heads, list) else ""
            done.append(f"closed the links to {names or 'the head'}")
        elif pid and _alive(pid):
            # the node ended and its pid went to another program, or it cannot be told
            done.append(f"left process {pid} alone: it cannot be confirmed as the node "
                        "that joined (its pid may belong to another program now); if the "
                        "node still runs, stop it in its terminal with Ctrl-C")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        done.append("forgot the head")
    if forget_token:
        from engine.credentials.tokens import forget_token as forget

        for place in forget(home):
            done.append(f"removed the fleet token from {place}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

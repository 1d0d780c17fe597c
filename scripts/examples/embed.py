"""Shoal embedded in another program: start it in-process, watch its events, read a
snapshot, set an alias, answer one request, stop.

    .venv/bin/python scripts/examples/embed.py            # the embedded default model
    .venv/bin/python scripts/examples/embed.py --mock     # the mock engine (no model)

Everything goes through the one `Shoal` object the CLI and the desktop app use.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
import urllib.request
from pathlib import Path

from engine.events import NodeLinked, ShoalEvent
from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings


def show(event: ShoalEvent) -> None:
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name != "at"}
    print(f"event {type(event).__name__}: {fields}")


def ask(url: str, model: str) -> str:
    body = json.dumps({"model": model, "max_tokens": 12, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    req = urllib.request.Request(url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return str(json.loads(resp.read())["choices"][0]["message"]["content"])


async def main(mock: bool, home: Path) -> None:
    runtime, model = ("mock", "demo") if mock else (None, None)
    settings = Settings(home=home, discovery=DiscoverySettings(mode="none"),
                        head=HeadSettings(model=model, runtime=runtime, http="127.0.0.1:0"),
                        node=NodeSettings(model=model, runtime=runtime, lanes=2))
    shoal = Shoal(settings)
    events = shoal.events()  # subscribed before the start, to see its progress too

    linked = asyncio.Event()

    async def watch() -> None:
        async for event in events:
            show(event)
            if isinstance(event, NodeLinked):
                linked.set()

    watcher = asyncio.create_task(watch())
    await shoal.open()
    try:
        await asyncio.wait_for(linked.wait(), 60)  # the local node linked with the head
        snap = shoal.snapshot()
        print(f"snapshot: model {snap.model}, {snap.ready_nodes} node(s), "
              f"{snap.lanes_busy}/{snap.lanes} lanes busy, API at {snap.roles.api_url}")
        change = await shoal.aliases.set("assistant", snap.model or "")
        print(f"alias: {change.line}")
        assert shoal.api_url is not None
        answer = await asyncio.to_thread(ask, shoal.api_url, "assistant")
        print(f"answer through the alias: {answer!r}")
    finally:
        await shoal.stop(drain=5)
        await watcher
    print("stopped")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mock", action="store_true", help="use the mock engine")
    parser.add_argument("--home", type=Path, help="SHOAL_HOME to use (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(args.mock, args.home or Path(tmp)))

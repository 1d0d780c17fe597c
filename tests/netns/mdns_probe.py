"""A tiny mDNS announcer or browser for the namespace tests, run as a subprocess.

    python tests/netns/mdns_probe.py announce --instance NAME --port P --role head \
        --model M --fleet F [--address A ...] [--interface I ...]
        prints {"ready": ...} once announced, then keeps announcing until its
        stdin closes (or --lifetime passes), unregisters and prints {"closed": true}.

    python tests/netns/mdns_probe.py browse --fleet F --role head [--timeout S] [--until-gone]
        prints {"found": [...]} when a matching service appears; with
        --until-gone then prints {"gone": true} when it has disappeared.
        Exits 2 with {"timeout": ...} when the deadline passes first.

Every line on stdout is one JSON object; everything is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.discovery.mdns import Announcer, Browser


def emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


async def announce(args: argparse.Namespace) -> int:
    announcer = Announcer()
    await announcer.start(instance=args.instance, port=args.port, role=args.role,
                          model=args.model, fleet=args.fleet,
                          addresses=args.address or None, interfaces=args.interface or None)
    emit({"ready": announcer.name, "addresses": announcer.addresses})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.lifetime):
                await reader.read()  # until stdin closes
    finally:
        transport.close()
        await announcer.close()
    emit({"closed": True})
    return 0


async def browse(args: argparse.Namespace) -> int:
    browser = Browser(interfaces=args.interface or None)
    await browser.start()
    loop = asyncio.get_running_loop()
    end = loop.time() + args.timeout
    try:
        stage = "found"
        while True:
            matches = browser.found(args.fleet, args.role)
            if stage == "found" and matches:
                emit({"found": [dataclasses.asdict(f) for f in matches]})
                if not args.until_gone:
                    return 0
                stage = "gone"
            elif stage == "gone" and not matches:
                emit({"gone": True})
                return 0
            remaining = end - loop.time()
            if remaining <= 0:
                emit({"timeout": stage,
                      "all": [dataclasses.asdict(f) for f in browser.all_found()]})
                return 2
            await browser.wait_change(min(remaining, 0.5), since=browser.changes)
    finally:
        await browser.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("announce")
    a.add_argument("--instance", required=True)
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--role", default="head")
    a.add_argument("--model", default="m")
    a.add_argument("--fleet", required=True)
    a.add_argument("--address", action="append", default=[])
    a.add_argument("--interface", action="append", default=[])
    a.add_argument("--lifetime", type=float, default=60.0)
    b = sub.add_parser("browse")
    b.add_argument("--fleet", required=True)
    b.add_argument("--role", default="head")
    b.add_argument("--timeout", type=float, default=15.0)
    b.add_argument("--until-gone", action="store_true")
    b.add_argument("--interface", action="append", default=[])
    args = parser.parse_args()
    return asyncio.run(announce(args) if args.cmd == "announce" else browse(args))


if __name__ == "__main__":
    sys.exit(main())

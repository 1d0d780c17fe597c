"""`shoal fleet ...`, `shoal alias ...` and `shoal keys ...`: thin clients of the engine's
commands (the alias ones through the running head's admin routes)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from engine.cli.http import call
from engine.errors import StartError
from engine.settings import HTTP_DEFAULT


def _head_option(p: argparse.ArgumentParser, *, again: bool = False) -> None:
    """``--head`` on `alias` and again on each verb, so it may come before or after the
    verb (`shoal alias set a b --head H`): on a verb it is left out unless given."""
    p.add_argument("--head", default=argparse.SUPPRESS if again else HTTP_DEFAULT,
                   metavar="HOST:PORT", help="the head to talk to (default: this machine's, "
                   f"{HTTP_DEFAULT})")


def add_parsers(sub: Any) -> None:
    alias = sub.add_parser("alias", help="fleet-wide names for models")
    _head_option(alias)
    asub = alias.add_subparsers(dest="alias_command", required=True,
                                metavar="{set,ls,history,revert,rm,export,import}",
                                help="`shoal alias VERB --help` for its arguments")
    aset = asub.add_parser("set", help="point NAME at TARGET (then the fallbacks)")
    aset.add_argument("name", help="the alias clients will ask for")
    aset.add_argument("target", help="the model (or alias) it stands for")
    aset.add_argument("--fallback", action="append", default=[], metavar="MODEL",
                      help="a model to use when TARGET is unavailable (repeatable, in order)")
    verbs = [aset, asub.add_parser("ls", help="list the aliases")]
    for verb, text in (("history", "every version of an alias"),
                       ("revert", "swap an alias back to its previous target"),
                       ("rm", "remove an alias")):
        p = asub.add_parser(verb, help=text)
        p.add_argument("name", help="the alias")
        verbs.append(p)
    verbs.append(asub.add_parser("export", help="print the table as JSON (an off-fleet copy)"))
    imp = asub.add_parser("import", help="load a table written by export")
    imp.add_argument("file", type=Path, help="a JSON file written by `shoal alias export`")
    verbs.append(imp)
    for p in verbs:
        _head_option(p, again=True)

    keys = sub.add_parser("keys", help="stateless API keys")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="{issue,revoke}",
                               help="a running head takes the change within a second")
    for verb, text in (("issue", "print the key for NAME"),
                       ("revoke", "stop accepting NAME's key")):
        p = ksub.add_parser(verb, help=text)
        p.add_argument("name", help="whose key: 1-63 of a-z, 0-9, '_' and '.'")


def _changed(result: dict[str, Any]) -> str:
    e = result["entry"]
    heads = f"{result['heads_holding']}/{result['heads_total']} heads"
    if e.get("target") is None:
        return f"{e['name']} removed (ver {e['version']}): {heads}"
    fallbacks = f" then {', '.join(e['fallbacks'])}" if e.get("fallbacks") else ""
    return f"{e['name']} -> {e['target']}{fallbacks} (ver {e['version']}): {heads}"


def run_alias(args: argparse.Namespace) -> int:
    head = args.head
    cmd = args.alias_command
    if cmd == "set":
        body = json.dumps({"target": args.target, "fallbacks": args.fallback}).encode()
        print(_changed(call(head, "PUT", f"/v1/aliases/{args.name}", body)))
    elif cmd == "rm":
        print(_changed(call(head, "DELETE", f"/v1/aliases/{args.name}")))
    elif cmd == "revert":
        print(_changed(call(head, "POST", f"/v1/aliases/{args.name}/revert")))
    elif cmd == "ls":
        rows = call(head, "GET", "/v1/aliases")["aliases"]
        if not rows:
            print("no aliases; make one with `shoal alias set NAME MODEL`")
        for r in rows:
            fallbacks = f" then {', '.join(r['fallbacks'])}" if r["fallbacks"] else ""
            print(f"{r['name']} -> {r['target']}{fallbacks} (ver {r['version']}, "
                  f"{r['state']}, now {r['resolves_to'] or 'nothing'})")
    elif cmd == "history":
        for e in call(head, "GET", f"/v1/aliases/{args.name}/history")["history"]:
            target = e["target"] if e["target"] is not None else "(removed)"
            print(f"ver {e['version']}: {target}"
                  + (f" then {', '.join(e['fallbacks'])}" if e["fallbacks"] else ""))
    elif cmd == "export":
        sys.stdout.write(json.dumps(call(head, "GET", "/v1/aliases/export"), indent=2) + "\n")
    elif cmd == "import":
        try:
            data = args.file.read_bytes()
        except OSError as exc:
            raise StartError(f"cannot read {args.file}: {exc.strerror}") from None
        result = call(head, "POST", "/v1/aliases/import", data)
        names = ", ".join(result["imported"]) or "nothing new"
        print(f"imported {names}: {result['heads_holding']}/{result['heads_total']} heads")
    return 0


async def run_keys(args: argparse.Namespace, home: Path) -> int:
    from engine.service import KeyCommands

    commands = KeyCommands(home)
    if args.keys_command == "issue":
        print(await commands.issue(args.name))
    else:
        fresh = await commands.revoke(args.name)
        print(f"revoked the key of '{args.name}'" if fresh
              else f"the key of '{args.name}' was already revoked")
    return 0


async def run_fleet(args: argparse.Namespace, home: Path) -> int:
    from engine.service import Shoal
    from engine.settings import Settings

    shoal = await Shoal.start(Settings(home=home, fleet_name=getattr(args, "fleet_name", None)))
    try:
        if args.fleet_command == "pair":
            pairing = await shoal.pairing(head=args.head)
            lines = [pairing.text, pairing.url, "",
                     "On the new machine, scan this code, or run and paste it:",
                     "  shoal node join --code - --model MODEL"]
            if args.png is not None:
                from engine.credentials.codes import PairingError, save_qr_png

                try:
                    await asyncio.to_thread(save_qr_png, pairing.url, args.png)
                except PairingError as exc:
                    raise StartError(str(exc)) from None
                lines.append(f"(QR code saved to {args.png}, readable by you only)")
            print("\n".join(lines))
        elif args.store:
            print(f"shoal: {await shoal.move_token(args.store)}")
        else:
            print((await shoal.fleet_token(rotate=args.rotate)).hex())
    finally:
        await shoal.stop(drain=0)
    return 0


def main(args: argparse.Namespace, home: Path) -> int:
    if args.command == "alias":
        return run_alias(args)
    if args.command == "keys":
        return asyncio.run(run_keys(args, home))
    return asyncio.run(run_fleet(args, home))

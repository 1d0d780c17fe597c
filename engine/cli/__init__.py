"""`shoal`: parse the command line, build `Settings`, and run a `Shoal` or one command.

The CLI holds no fleet logic: it parses (engine.cli.parser), moves secrets out of its
own command line (engine.cli.argv), prints, and handles signals (engine.cli.run).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.cli import argv as cli_argv
from engine.cli import run as cli_run  # the module: its `run` would shadow it as engine.cli.run
from engine.cli.parser import build_parser
from engine.cli.run import leave, node_lines, pool_lines, setup_logging, wait_for_window
from engine.config import Config, ConfigError, load_config
from engine.credentials.tokens import TokenError
from engine.errors import ShoalError, StartError
from engine.service import Shoal
from engine.settings import (
    LANES_DEFAULT,
    UPSTREAM_RUNTIMES,
    DiscoverySettings,
    HeadSettings,
    JoinSettings,
    NodeSettings,
    Settings,
    default_home,
)

log = logging.getLogger("shoal")


def _split(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _config(home: Path) -> Config:
    try:
        return load_config(home)
    except ConfigError as exc:
        raise StartError(str(exc)) from None


# the options of how a node holds its model, and their NodeSettings fields
MEMORY_OPTIONS = {"memory_budget": "memory_budget", "kv_type": "kv_type", "gpu": "gpu",
                  "idle_unload": "idle_unload_s", "serve_kept": "serve_kept", "lend": "lend",
                  "lend_on_battery": "lend_on_battery",
                  "split_with": "split_with"}


def _memory(args: argparse.Namespace, cfg: Config) -> dict[str, Any]:
    """How the node holds its model: the flags given, over config.toml's ``[node]``
    (NodeSettings' defaults where neither says)."""
    given = vars(args)
    return {**cfg.node_memory,
            **{field: given[dest] for dest, field in MEMORY_OPTIONS.items() if dest in given}}


def _discovery(args: argparse.Namespace, cfg: Config) -> DiscoverySettings:
    """Discovery from the flags, over $SHOAL_HOME/config.toml where they leave it out."""
    seeds = _split(getattr(args, "seeds", "") or "") or tuple(cfg.seeds)
    return DiscoverySettings(mode=getattr(args, "discovery", None) or cfg.discovery,
                             seeds=seeds,
                             tailscale_socket=getattr(args, "tailscale_socket", None)
                             or cfg.tailscale_socket)


def _cors(spec: str) -> tuple[str, ...]:
    from engine.head.access.keys import KeysError, parse_allow_list

    try:
        return parse_allow_list(spec)
    except KeysError as exc:
        raise StartError(str(exc)) from None


def _allow_hosts(specs: list[str]) -> tuple[str, ...]:
    from engine.head.access.hosts import HostError, parse_allowed_hosts

    try:
        return parse_allowed_hosts(specs)
    except HostError as exc:
        raise StartError(str(exc)) from None


def _node(args: argparse.Namespace, *, listen: str | None, embedded_default: bool = False,
          cfg: Config | None = None) -> NodeSettings:
    """The node of `shoal node` (``--model`` required) or `shoal node join`
    (``embedded_default``: without ``--model`` it serves the embedded default, the model
    `shoal serve` and the app serve when none is given); ``cfg``: config.toml's."""
    fronts = args.runtime in UPSTREAM_RUNTIMES
    if fronts and not args.upstream:
        raise StartError(f"--runtime {args.runtime} fronts an engine you run; give its "
                         "address with --upstream http://HOST:PORT")
    if args.upstream and not fronts:
        raise StartError("--upstream names an engine you run; say which with --runtime "
                         "llama-server or --runtime vllm")
    if not args.model and not fronts and not embedded_default:
        raise StartError("say which model to serve with --model (a GGUF path or "
                         "org/repo[:QUANT])")
    lanes = args.max_batch or (0 if fronts else LANES_DEFAULT)  # 0: as the upstream says
    # model None: the embedded default, resolved where `shoal serve`'s is (roles.loading)
    return NodeSettings(model=None if fronts else args.model or None, runtime=args.runtime,
                        model_name=args.model_name, upstream=args.upstream,
                        max_context=args.max_context, lanes=lanes,
                        identity=args.identity, listen=listen,
                        insecure_no_auth=args.insecure_no_auth,
                        handshake_timeout_s=args.handshake_timeout_ms / 1000,
                        idle_timeout_s=args.idle_timeout_ms / 1000, mock_speed=args.mock_speed,
                        **_memory(args, cfg or Config()))


def serve_settings(args: argparse.Namespace, home: Path) -> Settings:
    """`shoal serve`: a head, and a node in the same process unless the head only dials
    nodes or takes nodes that join (``--fleet``, ``--fleet-listen``) without --local-node."""
    head = HeadSettings(
        model=args.model, runtime=args.runtime, http=args.http, fleet=_split(args.fleet),
        fleet_listen=args.fleet_listen, also_models=tuple(args.also_model),
        policy=args.fleet_policy, pool_high=args.fleet_pool_high,
        conns_per_node=args.fleet_conns_per_node or 0, queue_timeout_s=args.queue_timeout,
        keepalive_s=args.keepalive if args.keepalive > 0 else 5.0,
        tool_call_parser=args.tool_call_parser, chat_template=args.chat_template,
        api_key=cli_argv.api_key(args), insecure_no_auth=args.insecure_no_auth,
        keys=args.keys, key_policy=args.key_policy,
        cors_allow=_cors(args.cors_allow), allow_hosts=_allow_hosts(args.allow_host),
        node_port=args.node_port)
    embedded = not (args.fleet or args.fleet_listen) or args.local_node
    cfg = _config(home)
    node = NodeSettings(model=args.model, runtime=args.runtime, max_context=args.max_context,
                        lanes=args.max_batch or LANES_DEFAULT, mock_speed=args.mock_speed,
                        **_memory(args, cfg)) if embedded else None
    return Settings(home=home, head=head, node=node, discovery=_discovery(args, cfg),
                    auth_file=args.fleet_auth, offline=args.offline)


def join_settings(args: argparse.Namespace, home: Path, code: str | None) -> Settings:
    """`shoal node join`: a node that dials the fleet's head (given, in the join code
    ``code``, or found on the network); the embedded default model unless --model."""
    cfg = _config(home)
    return Settings(home=home, node=_node(args, listen=None, embedded_default=True, cfg=cfg),
                    join=JoinSettings(head=args.head, code=code, head_port=args.head_port),
                    discovery=_discovery(args, cfg), auth_file=args.auth_file,
                    offline=args.offline)


def node_settings(args: argparse.Namespace, home: Path) -> Settings:
    """`shoal node`: a node that heads dial (at --listen)."""
    cfg = _config(home)
    return Settings(home=home, node=_node(args, listen=args.listen, cfg=cfg),
                    discovery=_discovery(args, cfg), auth_file=args.auth_file,
                    offline=args.offline)


async def _serve_banner(shoal: Shoal) -> list[str]:
    node = shoal.snapshot().roles.node
    if node is not None:
        for line in node_lines(node):
            log.info("%s", line)
    window = await wait_for_window(shoal)
    if window:
        log.info("context window %d tokens (the largest node's)", window)
    return [f"shoal: serving '{shoal.snapshot().model}' at {shoal.api_url}  "
            "(paste this base URL into your editor plugin)"]


async def _node_banner(shoal: Shoal) -> list[str]:
    node = shoal.snapshot().roles.node
    return node_lines(node) if node is not None else []


async def _join_banner(shoal: Shoal) -> list[str]:
    node = shoal.snapshot().roles.node
    if node is None:
        return []
    link = "encrypted" if node.encrypted else "plaintext, loopback only"
    return [f"runtime {node.runtime} serves {node.path}: context window "
            f"{node.context_window} tokens, {node.lanes} lanes",
            *([node.device_note] if node.device_note else []), *pool_lines(node),
            f"node '{node.identity}' joining {', '.join(node.heads)} as '{node.model}' "
            f"(link {link})"]


def _joined_heads(shoal: Shoal) -> dict[str, object]:
    node = shoal.snapshot().roles.node
    return {"heads": list(node.heads) if node else []}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    home = default_home()
    try:
        if argv is None:  # this process's own command line
            found = cli_argv.secrets_in_argv(args)
            if found:
                cli_argv.hand_over_and_exec(found)
            for dest, value in cli_argv.take_handed_over().items():
                setattr(args, dest, value)
        if args.command == "app":
            raise StartError("the desktop app starts from the `shoal` program (`shoal app`), "
                             "not from engine.cli; install Shoal with its app to run it")
        if args.command in ("fleet", "alias", "keys"):
            from engine.cli import admin as cli_admin

            return cli_admin.main(args, home)
        if args.command == "models":
            from engine.cli import models as cli_models

            return cli_models.main(args, home)
        if args.command == "serve":
            setup_logging("shoal")
            return asyncio.run(cli_run.run(serve_settings(args, home), _serve_banner))
        if args.command == "node" and args.node_command == "leave":
            for line in leave(home, forget_token=args.forget_token) or ["no joined node here"]:
                print(f"shoal: {line}")
            return 0
        if args.command == "node" and args.node_command == "join":
            setup_logging("shoal-node")
            code = cli_argv.read_stdin_code() if args.code == "-" else args.code
            if code is not None:
                from engine.credentials.codes import PairingError, join_code_from

                try:
                    code = join_code_from(code)
                except PairingError as exc:
                    raise StartError(str(exc)) from None
            return asyncio.run(cli_run.run(join_settings(args, home, code), _join_banner,
                                           state=_joined_heads))
        if args.command == "node":
            setup_logging("shoal-node")
            return asyncio.run(cli_run.run(node_settings(args, home), _node_banner))
    except (ShoalError, TokenError) as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


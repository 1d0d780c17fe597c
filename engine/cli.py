"""Argument parsing only: every command calls into engine.core."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine import __version__
from engine.core import (
    JoinOptions,
    NodeOptions,
    ServeOptions,
    StartError,
    leave,
    run_node,
    run_node_join,
    run_serve,
    setup_logging,
)
from engine.secrets import TokenError, default_home


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"{value} must be between 0 and 100")
    return value


def _discovery_options(p: argparse.ArgumentParser, *, again: bool = False) -> None:
    p.add_argument("--discovery", choices=["lan", "tailnet", "both", "none"],
                   default=argparse.SUPPRESS if again else None,
                   help="where to look for the fleet: mDNS on the LAN, the tailnet, or both "
                   "(default: both, or the config file's)")
    p.add_argument("--seeds", default="", help="HOST:PORT,... to try where discovery "
                   "cannot reach")
    p.add_argument("--tailscale-socket", help="tailscaled's LocalAPI socket (default: the "
                   "platform's)")


def _node_options(p: argparse.ArgumentParser, *, listen: bool, again: bool = False) -> None:
    """The options of a node. ``again``: on a subcommand (`node join`) whose parent
    (`node`) has them too, so that either place works: they are left out of the
    result unless given there, and the parent's value or default stands."""
    def add(*names: str, **kw: Any) -> None:
        if again:
            kw["default"] = argparse.SUPPRESS
        p.add_argument(*names, **kw)

    add("--model", help="a GGUF path or org/repo[:QUANT]")
    if listen:
        add("--listen", default="0.0.0.0:8455", help="ADDR:PORT where heads dial this node "
            "(default 0.0.0.0:8455)")
    add("--runtime", choices=["llamacpp", "mlx", "mock"],
        help="what runs the model (default llamacpp; mlx on Apple silicon; mock for tests)")
    add("--model-name", help="the name heads match on (default: the model's id)")
    add("--max-context", type=_positive, help="tokens one session can hold (default: what "
        "the model and this device allow)")
    add("--max-batch", type=_positive, default=8, help="lanes: sessions generated at once "
        "(default 8)")
    add("--identity", help="the name in the heads' logs (default: host name)")
    add("--offline", action="store_true", help="pull nothing; fail if the model is not "
        "in the cache")
    add("--auth-file", type=Path, help="the fleet token file (default: the keychain or "
        "$SHOAL_HOME/fleet/token)")
    add("--insecure-no-auth", action="store_true",
        help="listen off loopback without a token (plaintext link)")
    add("--handshake-timeout-ms", type=_positive, default=10_000,
        help="drop a link whose handshake takes longer (default 10000)")
    add("--idle-timeout-ms", type=_positive, default=120_000,
        help="drop a link silent for longer; heads ping every 15 s (default 120000)")
    add("--mock-speed", type=float, default=0.0,
        help="mock runtime: tokens/s per lane (0 = unlimited)")


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run a head (and a local node unless --fleet)")
    serve.add_argument("model", nargs="?", help="model id or path (default: the embedded one)")
    serve.add_argument("--http", default="127.0.0.1:8453", help="ADDR:PORT of the HTTP API "
                       "(default 127.0.0.1:8453; 0.0.0.0:8453 serves the LAN)")
    serve.add_argument("--fleet", default="", help="nodes to dial: HOST:PORT,...")
    serve.add_argument("--fleet-auth", type=Path, help="the fleet token file (default: the "
                       "keychain or $SHOAL_HOME/fleet/token)")
    serve.add_argument("--fleet-policy", default="load-aware",
                       choices=["load-aware", "least-loaded", "round-robin"],
                       help="how sessions are placed on nodes (default load-aware: the "
                       "soonest finish by measured rates)")
    serve.add_argument("--fleet-pool-high", type=_percent, default=90.0, metavar="PCT",
                       help="KV cache use above which a node takes no new session "
                       "(default 90)")
    serve.add_argument("--fleet-conns-per-node", type=_positive, default=None, metavar="N",
                       help="links opened to each node (default: one per lane)")
    serve.add_argument("--runtime", choices=["llamacpp", "mlx", "mock"],
                       help="what runs the model (default llamacpp; mlx on Apple silicon; "
                       "mock for tests)")
    serve.add_argument("--max-context", type=_positive, help="tokens one session can hold "
                       "on the local node (default: what the model and device allow)")
    serve.add_argument("--max-batch", type=_positive, default=8,
                       help="lanes of the local node (default 8)")
    serve.add_argument("--offline", action="store_true",
                       help="pull nothing; fail if the model is not in the cache")
    serve.add_argument("--local-node", action="store_true",
                       help="with --fleet: also run a node in this process")
    serve.add_argument("--queue-timeout", type=float, default=20.0,
                       help="seconds a request waits for a free lane before 429")
    serve.add_argument("--tool-call-parser", choices=["hermes", "llama3", "mistral", "none"],
                       help="how tool calls are read from the model's text (default: by "
                       "model family)")
    serve.add_argument("--chat-template", type=Path,
                       help="a Jinja chat template file to use instead of the model's")
    serve.add_argument("--mock-speed", type=float, default=0.0,
                       help="mock runtime: tokens/s per lane (0 = unlimited)")
    serve.add_argument("--also-model", action="append", default=[], metavar="MODEL",
                       help="another model this head serves through nodes (repeatable)")
    serve.add_argument("--fleet-listen", help="ADDR:PORT where nodes join (announced on the "
                       "network)")
    serve.add_argument("--node-port", type=_positive, default=8455,
                       help="where this head looks for listening nodes on tailnet peers")
    serve.add_argument("--api-key", default=None,
                       help="require this key (Authorization: Bearer KEY); other users can "
                       "read a command line (ps), so prefer --api-key-file or $SHOAL_API_KEY "
                       "(shoal moves a key given here out of its command line at start)")
    serve.add_argument("--api-key-file", type=Path, metavar="PATH",
                       help="require the key held in this file (mode 0600)")
    serve.add_argument("--keys", choices=["auto", "on", "off"], default="auto",
                       help="take keys made with `shoal keys issue` (auto: once one was "
                       "issued, also while running)")
    serve.add_argument("--key-policy", type=Path, help="per-key limits, JSON or TOML "
                       "(default: $SHOAL_HOME/keys.policy.json; edits apply while running)")
    serve.add_argument("--cors-allow", default="", metavar="ORIGINS",
                       help="browser origins allowed, comma-separated "
                       "(https://app.example,http://localhost:*)")
    serve.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                       help="also answer requests addressed to HOST (a proxy's or tunnel's "
                       "name, *.example.com, or * for any); repeatable or comma-separated. "
                       "Only this machine's names and addresses are served otherwise, "
                       "against DNS rebinding")
    serve.add_argument("--keepalive", type=float, default=5.0, metavar="SECONDS",
                       help="keepalive interval while a request waits or its prompt "
                       "prefills")
    _discovery_options(serve)


def _node_parser(sub: Any) -> Any:
    node = sub.add_parser("node", help="serve a model to the fleet's heads")
    _node_options(node, listen=True)
    node.add_argument("--discovery", choices=["lan", "tailnet", "both", "none"], default=None,
                      help="announce this node on the LAN so heads dial it (default: both, "
                      "or the config file's)")
    node_sub = node.add_subparsers(dest="node_command", metavar="{join,leave}",
                                   help="without one: a node that heads dial")
    join = node_sub.add_parser("join", help="dial the fleet's head (found on the network when "
                               "no address is given)")
    join.add_argument("head", nargs="?", help="HOST:PORT of the head")
    join.add_argument("--code", metavar="CODE",
                      help="the join code: a shoal://join?... URL, - to read it from stdin, "
                      "or a file (@FILE or a path) holding it as text or a QR image. Other "
                      "users can read a command line (ps): shoal moves a URL given here out "
                      "of its own at start, but your shell history keeps it")
    join.add_argument("--head-port", type=_positive, default=8454,
                      help="the port heads take joins on, where discovery looks (default 8454)")
    _node_options(join, listen=False, again=True)
    _discovery_options(join, again=True)  # `node --discovery X join` works too
    return node_sub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Pool your machines into one "
                                     "private LLM endpoint.")
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; `shoal COMMAND --help` for its options")

    fleet = sub.add_parser("fleet", help="the fleet token")
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True, metavar="{token,pair}",
                                     help="token: print or move it; pair: add a machine")
    tok = fleet_sub.add_parser("token", help="print the fleet token (make it if absent)")
    tok.add_argument("--rotate", action="store_true", help="replace it with a new one")
    tok.add_argument("--store", choices=["keychain", "file"],
                     help="move the token to the OS keychain or the token file")
    pair = fleet_sub.add_parser("pair", help="print the join URL and a QR code for a new node")
    pair.add_argument("--head", help="HOST:PORT nodes should dial (default: this machine's "
                      "address on port 8454)")
    pair.add_argument("--fleet-name", default=None, help="a name for the fleet (default: "
                      "this machine's name)")
    pair.add_argument("--png", type=Path, help="also save the QR code as a PNG file "
                      "(mode 0600: it holds the token)")

    _serve_parser(sub)
    node_sub = _node_parser(sub)
    from engine.cli_admin import add_parsers

    add_parsers(sub)
    leave = node_sub.add_parser("leave", help="close the links and forget the head")
    leave.add_argument("--forget-token", action="store_true",
                       help="also remove the fleet token from this machine")
    return parser


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _apply_config(args: argparse.Namespace, home: Path) -> None:
    """Discovery settings from $SHOAL_HOME/config.toml where the flags leave them out."""
    from engine.config import ConfigError, load_config

    try:
        cfg = load_config(home)
    except ConfigError as exc:
        raise StartError(str(exc)) from None
    if getattr(args, "discovery", "unset") is None:
        args.discovery = cfg.discovery
    if getattr(args, "seeds", None) == "" and cfg.seeds:
        args.seeds = ",".join(cfg.seeds)
    if hasattr(args, "tailscale_socket") and args.tailscale_socket is None:
        args.tailscale_socket = cfg.tailscale_socket


def _cors(spec: str) -> tuple[str, ...]:
    from engine.head.access.keys import KeysError, parse_allow_list

    try:
        return parse_allow_list(spec)
    except KeysError as exc:
        raise StartError(str(exc)) from None


def _fleet(args: argparse.Namespace, home: Path) -> int:
    if args.fleet_command == "pair":
        from engine.core import pair_text

        print(pair_text(home, head=args.head, fleet_name=args.fleet_name, png=args.png))
        return 0
    if args.store:
        from engine.secrets import move_token

        print(f"shoal: {move_token(home, args.store)}")
        return 0
    import secrets as pysecrets

    from engine.secrets import load_fleet_token, store_fleet_token

    token = load_fleet_token(home)
    if token is None or args.rotate:
        token = pysecrets.token_bytes(32)
        store_fleet_token(home, token, "auto")
    print(token.hex())
    return 0


# -- secrets given on the command line ------------------------------------------------
#
# Any user of the machine can read a process's command line (ps, /proc/PID/cmdline)
# for as long as it runs. A secret given there (a join code holds the fleet token;
# an API key) is moved out at once: the process runs itself again without it, handing
# the value over through an inherited pipe, so the running node or head never shows it.

SECRETS_FD_ENV = "SHOAL_ARGV_SECRETS_FD"
SECRET_OPTIONS = {"code": "--code", "api_key": "--api-key"}  # dest -> option
MAX_HANDED_OVER = 16_384


def without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without every ``OPTION VALUE`` and ``OPTION=VALUE`` (an abbreviation
    of OPTION too, as argparse takes it); what follows ``--`` is kept."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        name, eq, _ = arg.partition("=")
        if len(name) > 2 and name.startswith("--") and option.startswith(name):
            i += 1 if eq else 2
            continue
        out.append(arg)
        i += 1
    return out


def _literal_code(code: str) -> bool:
    """Whether --code was given the join URL itself (not -, @FILE or a path)."""
    return code != "-" and not code.startswith("@") and not Path(code).is_file()


def _secrets_in_argv(args: argparse.Namespace) -> dict[str, str]:
    found: dict[str, str] = {}
    code = getattr(args, "code", None)
    if isinstance(code, str) and _literal_code(code):
        found["code"] = code
    key = getattr(args, "api_key", None)
    if isinstance(key, str):
        found["api_key"] = key
    return found


def _hand_over_and_exec(found: dict[str, str]) -> None:
    """Run this program again without the secrets in its command line; they go through a
    pipe the new program inherits. Returns (after a warning) only where that cannot be
    done; on success it does not return."""
    tail = sys.argv[1:]
    for dest in found:
        tail = without_option(tail, SECRET_OPTIONS[dest])
    orig = list(getattr(sys, "orig_argv", []))
    n = len(sys.argv) - 1
    data = json.dumps(found).encode("utf-8")
    if os.name == "nt" or not orig or (n and orig[-n:] != sys.argv[1:]) \
            or any(arg == v or arg.endswith(f"={v}") for v in found.values() for arg in tail) \
            or len(data) > MAX_HANDED_OVER:
        names = " and ".join(SECRET_OPTIONS[d] for d in found)
        print(f"shoal: other users of this machine can read the value of {names} in its "
              "command line; use --code - or @FILE, --api-key-file or $SHOAL_API_KEY instead",
              file=sys.stderr)
        return
    prefix = orig[:len(orig) - n] if n else orig
    read_end, write_end = os.pipe()
    try:
        view = memoryview(data)
        while view:  # far below a pipe's buffer: this never waits for the reader
            view = view[os.write(write_end, view):]
    finally:
        os.close(write_end)
    os.set_inheritable(read_end, True)
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, SECRETS_FD_ENV: str(read_end)}
    os.execve(sys.executable, [*prefix, *tail], env)  # noqa: S606 - this very program


def _take_handed_over() -> dict[str, str]:
    """The secrets the previous image of this process handed over (see above)."""
    fd_text = os.environ.pop(SECRETS_FD_ENV, None)  # not for our children
    if fd_text is None:
        return {}
    try:
        fd = int(fd_text)
        with os.fdopen(fd, "rb") as pipe:
            found = json.loads(pipe.read(MAX_HANDED_OVER + 1))
        if not isinstance(found, dict) or not set(found) <= set(SECRET_OPTIONS) \
                or not all(isinstance(v, str) for v in found.values()):
            raise ValueError
    except (OSError, ValueError):
        raise StartError("the options moved out of the command line at start were lost; "
                         "run the command again") from None
    return found


def _read_stdin_code() -> str:
    """``--code -``: the join code from stdin, typed without echo on a terminal."""
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass("shoal: paste the join code (shoal://join?...) and press "
                               "Enter: ", stream=sys.stderr)
    line = sys.stdin.readline(MAX_HANDED_OVER)
    if not line.strip():
        raise StartError("--code - read no join code from stdin; pipe it in, e.g. "
                         "`shoal node join --code - < code.txt`")
    return line


def _api_key(args: argparse.Namespace) -> str | None:
    """The static key: --api-key, --api-key-file (private) or $SHOAL_API_KEY."""
    from engine.files import ExposedFileError, read_private

    path: Path | None = args.api_key_file
    if path is None:
        return args.api_key or os.environ.get("SHOAL_API_KEY") or None
    if args.api_key:
        raise StartError("give the API key with --api-key or --api-key-file, not both")
    try:
        data = read_private(path)
    except ExposedFileError as exc:
        raise StartError(f"other users can read or change the API key file {path} (mode "
                         f"{exc.mode:04o}); run `chmod 600 {path}`") from None
    except OSError as exc:
        raise StartError(f"cannot read the API key file {path}: {exc.strerror}") from None
    key = (data or b"").decode("utf-8", errors="replace").strip()
    if data is None or not key:
        raise StartError(f"there is no API key in {path}; write the key there or leave out "
                         "--api-key-file")
    return key


def _allow_hosts(specs: list[str]) -> tuple[str, ...]:
    from engine.head.access.hosts import HostError, parse_allowed_hosts

    try:
        return parse_allowed_hosts(specs)
    except HostError as exc:
        raise StartError(str(exc)) from None


def _node_opts(args: argparse.Namespace, home: Path, cls: type[NodeOptions]) -> NodeOptions:
    if not args.model:
        raise StartError("say which model to serve with --model (a GGUF path or "
                         "org/repo[:QUANT])")
    return cls(model=args.model, runtime=args.runtime, model_name=args.model_name,
               max_context=args.max_context, max_batch=args.max_batch,
               identity=args.identity, offline=args.offline, auth_file=args.auth_file,
               insecure_no_auth=args.insecure_no_auth,
               handshake_timeout_ms=args.handshake_timeout_ms,
               idle_timeout_ms=args.idle_timeout_ms, mock_speed=args.mock_speed, home=home)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    home = default_home()
    try:
        if argv is None:  # this process's own command line
            found = _secrets_in_argv(args)
            if found:
                _hand_over_and_exec(found)
            for dest, value in _take_handed_over().items():
                setattr(args, dest, value)
        _apply_config(args, home)
        if args.command == "fleet":
            return _fleet(args, home)
        if args.command in ("alias", "keys"):
            from engine.cli_admin import run_alias, run_keys

            return run_alias(args) if args.command == "alias" else run_keys(args, home)
        if args.command == "serve":
            setup_logging("shoal")
            opts = ServeOptions(
                model=args.model, http=args.http, fleet=_split(args.fleet),
                fleet_auth=args.fleet_auth, fleet_policy=args.fleet_policy,
                fleet_pool_high=args.fleet_pool_high,
                fleet_conns_per_node=args.fleet_conns_per_node or 0, runtime=args.runtime,
                max_context=args.max_context, max_batch=args.max_batch, offline=args.offline,
                local_node=args.local_node, mock_speed=args.mock_speed,
                queue_timeout_s=args.queue_timeout, tool_call_parser=args.tool_call_parser,
                chat_template=args.chat_template, fleet_listen=args.fleet_listen,
                also_models=args.also_model,
                discovery=args.discovery, seeds=_split(args.seeds),
                tailscale_socket=args.tailscale_socket, api_key=_api_key(args),
                keys=args.keys, key_policy=args.key_policy,
                cors_allow=_cors(args.cors_allow), allow_hosts=_allow_hosts(args.allow_host),
                keepalive_s=args.keepalive if args.keepalive > 0 else 5.0,
                node_port=args.node_port, home=home)
            return asyncio.run(run_serve(opts))
        if args.command == "node" and args.node_command == "leave":
            for line in leave(home, forget_token=args.forget_token) or ["no joined node here"]:
                print(f"shoal: {line}")
            return 0
        if args.command == "node" and args.node_command == "join":
            setup_logging("shoal-node")
            jopts = _node_opts(args, home, JoinOptions)
            assert isinstance(jopts, JoinOptions)
            code = _read_stdin_code() if args.code == "-" else args.code
            jopts.head, jopts.code = args.head, code
            jopts.discovery, jopts.seeds = args.discovery, _split(args.seeds)
            jopts.tailscale_socket = args.tailscale_socket
            jopts.head_port = args.head_port
            return asyncio.run(run_node_join(jopts))
        if args.command == "node":
            setup_logging("shoal-node")
            nopts = _node_opts(args, home, NodeOptions)
            nopts.listen = args.listen
            nopts.discovery = args.discovery
            return asyncio.run(run_node(nopts))
    except (StartError, TokenError) as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())

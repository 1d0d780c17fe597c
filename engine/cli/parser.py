"""The `shoal` command line: every command, option and help line (parsing only)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from engine import __version__
from engine.settings import FLEET_PORT, HTTP_DEFAULT, HTTP_PORT, NODE_PORT, check_gpu
from engine.sizes import KV_TYPES, Share, budget_bytes, parse_budget, parse_idle_unload


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


def _memory_budget(text: str) -> int | Share:
    """``--memory-budget``: bytes, or a share of RAM (kept as one; checked against it)."""
    from engine.runtimes.budget import total_memory_bytes

    try:
        budget = parse_budget(text)
        budget_bytes(budget, total_memory_bytes())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return budget


def _idle_unload(text: str) -> float | None:
    try:
        return parse_idle_unload(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _addresses(text: str) -> tuple[str, ...]:
    """HOST:PORT,... as given (each checked to have a port)."""
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    for address in out:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"{address!r} is not HOST:PORT")
    if not out:
        raise argparse.ArgumentTypeError("give HOST:PORT")
    return out


def _gpu(text: str) -> str:
    try:
        return check_gpu(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _memory_options(p: argparse.ArgumentParser) -> None:
    """How a node holds its model. Left out of the result unless given, so that the
    config file's ``[node]`` (then the defaults) stands (engine.cli)."""
    p.add_argument("--memory-budget", type=_memory_budget, default=argparse.SUPPRESS,
                   metavar="SIZE", help="memory the model and the KV cache all lanes share "
                   "may use: 6G, 6GiB, 4096M, 512MB (binary units) or 50%% of this "
                   "machine's RAM (default: a share that leaves the desktop room, about half "
                   "of it; or the config file's)")
    p.add_argument("--kv-type", choices=KV_TYPES, default=argparse.SUPPRESS,
                   help="the KV cache's number type: f16 (full quality) or q8_0 (half the "
                   "memory, so about twice the context) (default f16)")
    p.add_argument("--gpu", type=_gpu, default=argparse.SUPPRESS, metavar="auto|off|DEVICE",
                   help="GPU to run the model on: auto (the GPU with most free memory, if "
                   "llama.cpp finds one), off (CPU only), or a device name from the start-up "
                   "line (Vulkan0) (default auto; or the config file's)")
    p.add_argument("--idle-unload", type=_idle_unload, default=argparse.SUPPRESS,
                   metavar="MIN|never", help="unload the model after this many minutes "
                   "without a request; it loads again on the next one (default 15; 0 or "
                   "never: keep it loaded)")
    p.add_argument("--serve-kept", action="store_true", default=argparse.SUPPRESS,
                   help="serve every model kept on this machine (`shoal models list`) besides "
                   "--model: each loads on the first request that names it, and the least "
                   "recently used unloads when the memory budget needs room")
    p.add_argument("--lend", action="store_true", default=argparse.SUPPRESS,
                   help="lend this machine's memory to the fleet for the layers of a model "
                   "split across machines (llama.cpp's RPC server on 127.0.0.1, reached only "
                   "through the fleet's encrypted link)")
    p.add_argument("--lend-on-battery", action="store_true", default=argparse.SUPPRESS,
                   help="with --lend: lend on battery power too (by default a machine on its "
                   "battery lends nothing)")
    p.add_argument("--split-with", type=_addresses, default=argparse.SUPPRESS,
                   metavar="HOST:PORT[,...]", help="split the model with the machines whose "
                   "nodes listen there and lend memory (--lend): its last layers run there, "
                   "each holding a share in proportion to what it lends")


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

    add("--model", help="a GGUF path or org/repo[:QUANT] (not with --upstream)" + (
        "; default: the embedded model, as `shoal serve` serves it" if again else ""))
    if listen:
        add("--listen", default=f"0.0.0.0:{NODE_PORT}", help="ADDR:PORT where heads dial "
            f"this node (default 0.0.0.0:{NODE_PORT})")
    add("--runtime", choices=["llamacpp", "mlx", "mock", "llama-server", "vllm"],
        help="what runs the model (default llamacpp; mlx on Apple silicon; mock for tests; "
        "llama-server or vllm: an engine you run, at --upstream)")
    add("--upstream", metavar="URL", help="with --runtime llama-server or vllm: where that "
        "engine serves, e.g. http://127.0.0.1:8080 (Shoal never starts it)")
    add("--model-name", help="the name heads match on (default: the model's id, or the "
        "name the upstream engine serves it under)")
    add("--max-context", type=_positive, help="tokens one session can hold (default: what "
        "the model and this device allow)")
    add("--max-batch", type=_positive, default=None, help="lanes: sessions generated at "
        "once (default 8; llama-server: its slots; vllm: give its --max-num-seqs)")
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
    _memory_options(p)


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run a head (and a local node unless --fleet)")
    serve.add_argument("model", nargs="?", help="model id or path (default: the embedded one)")
    serve.add_argument("--http", default=HTTP_DEFAULT, help="ADDR:PORT of the HTTP API "
                       f"(default {HTTP_DEFAULT}; 0.0.0.0:{HTTP_PORT} serves the LAN)")
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
    _memory_options(serve)
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
    serve.add_argument("--node-port", type=_positive, default=NODE_PORT,
                       help="where this head looks for listening nodes on tailnet peers")
    serve.add_argument("--api-key", default=None,
                       help="require this key (Authorization: Bearer KEY); other users can "
                       "read a command line (ps), so prefer --api-key-file or $SHOAL_API_KEY "
                       "(shoal moves a key given here out of its command line at start)")
    serve.add_argument("--api-key-file", type=Path, metavar="PATH",
                       help="require the key held in this file (mode 0600)")
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="serve the HTTP API off loopback (--http 0.0.0.0:...) with no "
                       "key: anyone who reaches this machine may use it")
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
    join.add_argument("--head-port", type=_positive, default=FLEET_PORT,
                      help="the port heads take joins on, where discovery looks (default "
                      f"{FLEET_PORT})")
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
                      f"address on port {FLEET_PORT})")
    pair.add_argument("--fleet-name", default=None, help="a name for the fleet (default: "
                      "this machine's name)")
    pair.add_argument("--png", type=Path, help="also save the QR code as a PNG file "
                      "(mode 0600: it holds the token)")

    sub.add_parser("app", help="the desktop app: a tray icon and the fleet window "
                   "(needs PySide6; started by the `shoal` program)")
    _serve_parser(sub)
    node_sub = _node_parser(sub)
    from engine.cli.admin import add_parsers
    from engine.cli.models import add_parser as add_models_parser

    add_parsers(sub)
    add_models_parser(sub)
    leave = node_sub.add_parser("leave", help="close the links and forget the head")
    leave.add_argument("--forget-token", action="store_true",
                       help="also remove the fleet token from this machine")
    return parser

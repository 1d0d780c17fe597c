"""The composition root: builds nodes, heads and the API from options.

The CLI and the desktop app both start Shoal through these functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets as pysecrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from engine import nesting
from engine.head.fleet.links import Fleet
from engine.head.head import Head
from engine.head.prompt.templates import TemplateError
from engine.link.transport import is_loopback
from engine.node.agent import NodeAgent
from engine.node.join import HeadAddress, Joiner, JoinRefused, probe_head
from engine.runtimes import registry
from engine.runtimes.base import RuntimeUnavailable
from engine.secrets import TokenError, default_home, read_token, token_path

log = logging.getLogger("shoal")


class StartError(Exception):
    """Shoal cannot start as asked; the message names the cause and the fix."""


def setup_logging(name: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{name}: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def split_hostport(text: str, default_port: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, default_port
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        value = int(port)
    except ValueError:
        raise StartError(f"'{text}' is not HOST:PORT; write it like 127.0.0.1:8455") from None
    if not 0 <= value < 65536:
        raise StartError(f"port {value} in '{text}' is out of range")
    return host or "0.0.0.0", value  # noqa: S104 - an empty host means every interface


@dataclass
class NodeOptions:
    model: str
    listen: str = "0.0.0.0:8455"
    runtime: str | None = None
    model_name: str | None = None
    max_context: int | None = None
    max_batch: int = 8
    identity: str | None = None
    offline: bool = False
    auth_file: Path | None = None
    insecure_no_auth: bool = False
    handshake_timeout_ms: int = 10_000
    idle_timeout_ms: int = 120_000
    mock_speed: float = 0.0
    discovery: str = "both"  # a listening node announces itself on the LAN unless "none"
    home: Path = field(default_factory=default_home)


@dataclass
class ServeOptions:
    model: str | None
    http: str = "127.0.0.1:8453"
    fleet: list[str] = field(default_factory=list)
    fleet_auth: Path | None = None
    fleet_policy: str = "load-aware"
    fleet_pool_high: float = 90.0
    fleet_conns_per_node: int = 0
    runtime: str | None = None
    max_context: int | None = None
    max_batch: int = 8
    offline: bool = False
    local_node: bool = False
    mock_speed: float = 0.0
    queue_timeout_s: float = 20.0
    tool_call_parser: str | None = None
    chat_template: Path | None = None
    fleet_listen: str | None = None
    also_models: list[str] = field(default_factory=list)
    discovery: str = "both"  # lan | tailnet | both | none
    seeds: list[str] = field(default_factory=list)
    tailscale_socket: str | None = None
    api_key: str | None = None  # --api-key: one static key, not rate-limited
    keys: str = "auto"  # keys from `shoal keys issue`: auto (once one was issued) | on | off
    key_policy: Path | None = None  # per-key limits; default $SHOAL_HOME/keys.policy.json
    cors_allow: tuple[str, ...] = ()  # browser origins allowed to call the API
    allow_hosts: tuple[str, ...] = ()  # Host values served besides this machine's (--allow-host)
    keepalive_s: float = 5.0  # seconds between keepalives while a request waits
    node_port: int = 8455  # where a head looks for listening nodes on tailnet peers
    home: Path = field(default_factory=default_home)


def load_token(path: Path | None, home: Path) -> bytes | None:
    """The fleet token: from ``path`` when given, else the keychain or the token file."""
    from engine.secrets import load_fleet_token

    try:
        return read_token(path) if path is not None else load_fleet_token(home)
    except TokenError as exc:
        raise StartError(str(exc)) from None


def pick_runtime(runtime: str | None, model: str) -> str:
    try:
        return registry.pick_runtime(runtime, model)
    except RuntimeUnavailable as exc:
        raise StartError(str(exc)) from None


def resolve_model_path(spec: str | None, runtime: str, *, home: Path, offline: bool,
                       progress: Callable[[str], None] | None = None) -> tuple[str, str]:
    """(path or name the runtime loads, the model's name on the link)."""
    from engine.models import ModelMissing

    try:
        return registry.resolve_model(runtime, spec, home=home, offline=offline,
                                      progress=progress)
    except (ModelMissing, RuntimeUnavailable) as exc:
        raise StartError(str(exc)) from None


def check_runtime(runtime: str) -> None:
    """Refuse an unusable runtime before any slow work (pulls, loads)."""
    try:
        registry.check_runtime(runtime)
    except RuntimeUnavailable as exc:
        raise StartError(str(exc)) from None


def bind(host: str, port: int, *, what: str) -> socket.socket:
    """Bind before any slow start-up work, so a port in use fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == 98 or "in use" in str(exc):
            raise StartError(f"{what} port {host}:{port} is in use; stop the other process "
                             "or choose another port") from None
        raise StartError(f"cannot listen on {host}:{port} for {what}: {exc.strerror}") \
            from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


# -- node ---------------------------------------------------------------------------


async def build_agent(opts: NodeOptions, *, psk: bytes | None,
                      announced: str | None = None) -> NodeAgent:
    """Resolve (pull) the model, load it into an engine, and wrap it in a node agent.

    ``announced`` is the model name a head announced: a joining node takes it,
    so the same model under another path or id still matches (--model-name wins).
    """
    runtime = pick_runtime(opts.runtime, opts.model)
    check_runtime(runtime)
    path, name = resolve_model_path(opts.model, runtime, home=opts.home, offline=opts.offline,
                                    progress=lambda line: log.info("%s", line))
    try:
        engine = registry.make_engine(runtime, path,
                                      model_name=opts.model_name or announced or name,
                                      lanes=opts.max_batch, max_context=opts.max_context,
                                      mock_speed=opts.mock_speed)
        await engine.start()
    except (RuntimeUnavailable, FileNotFoundError, ValueError) as exc:
        raise StartError(str(exc)) from None
    return NodeAgent(engine, identity=opts.identity or socket.gethostname(), psk=psk,
                     handshake_timeout_s=opts.handshake_timeout_ms / 1000,
                     idle_timeout_s=opts.idle_timeout_ms / 1000)


async def start_node(opts: NodeOptions, *, psk: bytes | None = None,
                     use_token: bool = True) -> tuple[NodeAgent, str, int]:
    """Check the token, bind, load the model, and listen. Returns (agent, host, port)."""
    host, port = split_hostport(opts.listen, 8455)
    if use_token:
        psk = load_token(opts.auth_file, opts.home)
    if psk is None and not is_loopback(host) and not opts.insecure_no_auth:
        where = opts.auth_file or token_path(opts.home)
        raise StartError(f"refusing to listen on {host}:{port} without a fleet token at "
                         f"{where}; copy the head's token there (`shoal fleet token` prints "
                         "it), listen on 127.0.0.1, or pass --insecure-no-auth")
    sock = bind(host, port, what="the node's")
    try:
        agent = await build_agent(opts, psk=psk)
    except BaseException:
        sock.close()
        raise
    await agent.listen_on(sock)
    bound = sock.getsockname()
    return agent, str(bound[0]), int(bound[1])


def describe_node(agent: NodeAgent, host: str, port: int) -> str:
    """Two lines: what the runtime serves, and where the node listens."""
    info = agent.engine.info
    how = "pinned by --max-context" if info.window_pinned else "sized for this device"
    if info.runtime == "mock":
        how = "mock engine, for tests"
    return (f"runtime {info.runtime} serves {info.path}: context window "
            f"{info.context_window} tokens ({how}), {info.lanes} lanes\n"
            f"node '{agent.identity}' serving '{info.model}' on {host}:{port} "
            f"(link {'encrypted' if agent.psk else 'plaintext, loopback only'}): "
            f"context window {info.context_window} tokens, {info.lanes} lanes")


async def run_node(opts: NodeOptions) -> int:
    stop = _stop_event()
    agent, host, port = await start_node(opts)
    print(describe_node(agent, host, port), flush=True)
    closers: list[Callable[[], Awaitable[None]]] = []
    if not is_loopback(host) and opts.discovery in ("lan", "both"):
        from engine.discovery.service import announce_node

        closers = await announce_node(opts.discovery, identity=agent.identity,
                                      model=agent.engine.info.model, psk=agent.psk, port=port,
                                      host=host)
    try:
        await stop.wait()
    finally:
        for close in closers:
            await close()
        await agent.close()
        await agent.engine.close()
    return 0


# -- head -------------------------------------------------------------------------


@dataclass
class RunningHead:
    head: Head
    runner: web.AppRunner
    host: str
    port: int
    local_agent: NodeAgent | None = None
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def close(self) -> None:
        for close in reversed(self.closers):
            await close()
        await self.runner.cleanup()
        await self.head.close()
        if self.local_agent is not None:
            await self.local_agent.close()
            await self.local_agent.engine.close()


def configure_access(head: Head, opts: ServeOptions) -> None:
    """Who may call the HTTP API: the Host names served, the static key, issued keys and
    their limits, browser origins; and how often a waiting request gets a keepalive.

    The keys files are checked here, so a broken one fails the start; the API then
    watches them, so `shoal keys issue|revoke` and a rotated secret take effect on
    the running head (with --keys auto, keys turn on when the first is issued).
    """
    from engine.head.access import keys
    from engine.head.access.hosts import machine_names

    head.api_key = opts.api_key or None
    head.cors_allow = opts.cors_allow
    head.keepalive_s = opts.keepalive_s
    head.allowed_hosts = opts.allow_hosts
    head.host_names = machine_names(fqdn=True)  # may ask DNS: once, at start
    if opts.keys == "off":
        if head.api_key:
            log.info("the API takes the key given with --api-key")
        return
    if opts.key_policy is not None and not opts.key_policy.exists():
        raise StartError(f"no key policy at {opts.key_policy}; write one like "
                         '{"default": {"rpm": 60, "burst": 10, "concurrent": 4}} '
                         "or leave out --key-policy")
    secret_file = keys.secret_path(opts.home)
    policy_file = opts.key_policy or keys.policy_path(opts.home)
    try:
        secret = (keys.load_or_make_secret(secret_file) if opts.keys == "on"
                  else keys.read_secret(secret_file))
        policy = keys.load_policy(policy_file)
    except keys.KeysError as exc:
        raise StartError(str(exc)) from None
    head.keys_secret_path = secret_file
    head.key_policy_path = policy_file
    head.revoked_path = keys.revoked_path(opts.home)
    if secret is None:
        log.info("the API takes the key given with --api-key, and keys from `shoal keys "
                 "issue NAME` once one is made" if head.api_key else
                 "the API needs no key until `shoal keys issue NAME` makes one")
        return
    limits = policy.default
    log.info("the API takes keys from `shoal keys issue`%s; each limited to %g requests a "
             "minute (burst %d) and %d at once unless the policy says otherwise",
             " and the --api-key key" if head.api_key else "", limits.rpm, limits.burst,
             limits.concurrent)


async def start_head(opts: ServeOptions) -> RunningHead:
    from engine.api.app import build_app
    from engine.head.fleet.sessions import SessionRunner
    from engine.head.prompt.model import load_head_model

    http_host, http_port = split_hostport(opts.http, 8453)
    psk = load_token(opts.fleet_auth, opts.home)
    http_sock = bind(http_host, http_port, what="the HTTP API's")
    join_sock: socket.socket | None = None
    runtime = pick_runtime(opts.runtime, opts.model or "")
    embedded = not (opts.fleet or opts.fleet_listen) or opts.local_node
    local_agent = None
    closers: list[Callable[[], Awaitable[None]]] = []
    try:
        if opts.fleet_listen:
            jhost, jport = split_hostport(opts.fleet_listen, 8454)
            join_sock = bind(jhost, jport, what="the fleet listener's")
        path, name = resolve_model_path(opts.model, runtime, home=opts.home,
                                        offline=opts.offline,
                                        progress=lambda line: log.info("%s", line))
        template = None
        if opts.chat_template is not None:
            try:
                template = opts.chat_template.read_text(encoding="utf-8")
            except OSError as exc:
                raise StartError(f"cannot read the chat template {opts.chat_template}: "
                                 f"{exc.strerror}") from None
        try:
            model = load_head_model(runtime, path, name=name, chat_template=template)
            others = []
            for spec in opts.also_models:
                opath, oname = resolve_model_path(spec, runtime, home=opts.home,
                                                  offline=opts.offline,
                                                  progress=lambda line: log.info("%s", line))
                others.append(load_head_model(runtime, opath, name=oname))
        except (RuntimeUnavailable, FileNotFoundError) as exc:
            raise StartError(str(exc)) from None
        except TemplateError as exc:
            raise StartError(f"the chat template {opts.chat_template} does not compile: "
                             f"{exc}; fix it or leave out --chat-template") from None
        fleet = Fleet(model=name, head_id=pysecrets.token_hex(8), psk=psk,
                      conns_per_node=opts.fleet_conns_per_node,
                      also=tuple(o.name for o in others))
        runner = SessionRunner(fleet, policy=opts.fleet_policy,  # type: ignore[arg-type]
                               pool_high=opts.fleet_pool_high,
                               queue_timeout_s=opts.queue_timeout_s)
        head = Head([model, *others], fleet, runner, tool_parser=opts.tool_call_parser,
                    aliases_path=opts.home / "aliases.json")
        configure_access(head, opts)
        if embedded:
            node_opts = NodeOptions(model=opts.model or path, listen="127.0.0.1:0",
                                    runtime=runtime, model_name=name,
                                    max_context=opts.max_context, max_batch=opts.max_batch,
                                    identity=f"{socket.gethostname()} (local)",
                                    offline=opts.offline, mock_speed=opts.mock_speed,
                                    home=opts.home)
            local_agent, nhost, nport = await start_node(node_opts, psk=psk, use_token=False)
            if runtime == "mock":
                log.info("serving the built-in mock engine as the local node (tests only: "
                         "its answers are not a model's)")
            for line in describe_node(local_agent, nhost, nport).splitlines():
                log.info("%s", line)
            fleet.add_dialed(nhost, nport, key="local")
        for entry in opts.fleet:
            host, port = split_hostport(entry, 8455)
            fleet.add_dialed(host, port)
        if join_sock is not None:
            from engine.head.fleet.joins import JoinListener
            from engine.head.fleet.peers import HeadPeers

            def merged(_names: list[str]) -> None:
                head.save_aliases()

            head.peers = HeadPeers(head_id=fleet.head_id, model=fleet.model, psk=psk,
                                   listen_port=int(join_sock.getsockname()[1]),
                                   table=lambda: head.aliases, on_merged=merged)
            for seed in opts.seeds:
                shost, sport = split_hostport(seed, 8454)
                head.peers.dial(shost, sport)
            listener = JoinListener(fleet, peers=head.peers)
            await listener.listen_on(join_sock)
            closers.append(listener.close)
            bound_join = join_sock.getsockname()
            log.info("taking nodes that join on %s:%d", bound_join[0], bound_join[1])
            closers.extend(await start_head_discovery(opts, head, psk, str(bound_join[0]),
                                                      int(bound_join[1])))
        app = build_app(head)
        app_runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await app_runner.setup()
        site = web.SockSite(app_runner, http_sock)
        await site.start()
    except BaseException:
        http_sock.close()
        if join_sock is not None:
            join_sock.close()
        for close in closers:
            await close()
        if local_agent is not None:
            await local_agent.close()
        raise
    bound = http_sock.getsockname()
    return RunningHead(head=head, runner=app_runner, host=str(bound[0]), port=int(bound[1]),
                       local_agent=local_agent, closers=closers)


async def start_head_discovery(opts: ServeOptions, head: Head, psk: bytes | None,
                               join_host: str, join_port: int
                               ) -> list[Callable[[], Awaitable[None]]]:
    """Announce this head so nodes find it, and look for the fleet's other heads."""
    from engine.discovery.service import HeadFinder, announce_head

    if psk is None:
        # without a token every link is plaintext, which never leaves this machine
        log.info("no fleet token: this head takes nodes from this machine only and looks "
                 "for none on the network; make one with `shoal fleet token` to pair others")
        return []
    closers = await announce_head(opts.discovery, fleet=head.fleet, psk=psk, port=join_port,
                                  host=join_host)
    if opts.discovery == "none":
        return closers
    finder = HeadFinder(opts.discovery, psk=psk, seeds=[],
                        tailscale_socket=opts.tailscale_socket, head_port=join_port)
    node_finder = HeadFinder(opts.discovery, psk=psk, seeds=[],
                             tailscale_socket=opts.tailscale_socket, head_port=opts.node_port,
                             role="node")
    await finder.start()
    await node_finder.start()

    async def look() -> None:
        while True:
            for found in await finder.find(timeout_s=3.0):
                if head.peers is not None:
                    head.peers.dial(found.host, found.port, discovered=True)
            # listening nodes of this fleet, announced on the LAN or on a tailnet peer
            for node in await node_finder.find(timeout_s=1.0):
                known = any(p.dialed and (p.host, p.port) == (node.host, node.port)
                            for p in head.fleet.pools.values())
                if not known:
                    log.info("found a node at %s (%s); dialing it", node, node.source)
                    head.fleet.add_dialed(node.host, node.port, discovered=True)
            await asyncio.sleep(REDISCOVER_S)

    task = asyncio.create_task(look(), name="head-discovery")

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await finder.close()
        await node_finder.close()

    return [*closers, stop]


async def _report_window(running: RunningHead, wait_s: float) -> None:
    head = running.head
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_s):
            while not head.fleet.context_window():  # noqa: ASYNC110 - waits on nodes' hellos
                await asyncio.sleep(0.1)
    window = head.fleet.context_window()
    if window:
        log.info("context window %d tokens (the largest node's)", window)


async def run_serve(opts: ServeOptions) -> int:
    stop = _stop_event()
    running = await start_head(opts)
    url = f"http://{running.host}:{running.port}/v1"
    await _report_window(running, 3.0)
    print(f"shoal: serving '{running.head.model.name}' at {url}  "
          "(paste this base URL into your editor plugin)", flush=True)
    try:
        await stop.wait()
    finally:
        await running.close()
    return 0


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")


# -- a node that joins heads ------------------------------------------------------


@dataclass
class JoinOptions(NodeOptions):
    head: str | None = None  # HOST:PORT; found on the network when None
    code: str | None = None  # shoal://join?..., or a file (@PATH or a path) holding it
    discovery: str = "both"
    seeds: list[str] = field(default_factory=list)
    tailscale_socket: str | None = None
    head_port: int = 8454


REDISCOVER_S = 60.0
LOST_CHECK_S = 5.0  # how often a joined node checks whether every head stopped answering
LOST_AFTER = 3  # failed dials in a row before a head counts as gone


def node_state_path(home: Path) -> Path:
    return home / "fleet" / "node.json"


async def run_node_join(opts: JoinOptions) -> int:
    from engine.discovery.service import HeadFinder

    stop = _stop_event()
    psk, given = _join_credentials(opts)
    finder = HeadFinder(opts.discovery, psk=psk, seeds=opts.seeds,
                        tailscale_socket=opts.tailscale_socket, head_port=opts.head_port)
    await finder.start()
    joiner: Joiner | None = None
    agent: NodeAgent | None = None
    try:
        heads = [given] if given is not None else await finder.find(timeout_s=5.0)
        if not heads:
            raise StartError(f"no head of this fleet found ({finder.where_looked()}); start one "
                             "with `shoal serve --fleet-listen`, or give its HOST:PORT")
        # check the token against a head before pulling or loading anything
        hello = None
        problems = []
        for head in heads:
            try:
                hello = await probe_head(head, psk=psk)
                break
            except JoinRefused as exc:
                problems.append(str(exc))
        if hello is None:
            raise StartError(problems[0])
        agent = await build_agent(opts, psk=psk, announced=hello.model)
        info = agent.engine.info
        print(f"runtime {info.runtime} serves {info.path}: context window "
              f"{info.context_window} tokens, {info.lanes} lanes", flush=True)
        joiner = Joiner(agent, psk=psk, handshake_timeout_s=opts.handshake_timeout_ms / 1000)
        for head in heads:
            joiner.link(head)
        print(f"node '{agent.identity}' joining {', '.join(map(str, heads))} as "
              f"'{info.model}' (link {'encrypted' if psk else 'plaintext, loopback only'})",
              flush=True)
        _write_node_state(opts.home, heads)
        loop = asyncio.get_running_loop()
        next_look = loop.time() + REDISCOVER_S
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LOST_CHECK_S if given is None else None):
                    await stop.wait()
            if stop.is_set() or given is not None:
                break
            # look again every REDISCOVER_S, and at once when every head stopped answering
            # (it may have moved): new heads are linked, moved ones found at their new place
            lost = all(joiner.failures.get(h, 0) >= LOST_AFTER for h in joiner.heads)
            if not lost and loop.time() < next_look:
                continue
            next_look = loop.time() + REDISCOVER_S
            found = await finder.find(timeout_s=3.0)
            for head in found:
                if head not in joiner.heads:
                    log.info("found the head at %s (%s)", head, head.source)
                    joiner.link(head)
            for head in joiner.heads:
                if joiner.failures.get(head, 0) >= LOST_AFTER and head not in found:
                    log.info("the head at %s is gone; forgetting it", head)
                    await joiner.unlink(head)
    finally:
        if joiner is not None:
            await joiner.close()
        await finder.close()
        if agent is not None:
            await agent.close()
            await agent.engine.close()
        with contextlib.suppress(FileNotFoundError):
            node_state_path(opts.home).unlink()
    return 0


def _join_credentials(opts: JoinOptions) -> tuple[bytes | None, HeadAddress | None]:
    """The token and the given head (None: discover), from a join code or the options."""
    if opts.code:
        from engine import pairing
        from engine.secrets import store_fleet_token

        try:
            code = pairing.parse_join_url(pairing.join_code_from(opts.code))
        except pairing.PairingError as exc:
            raise StartError(str(exc)) from None
        where = store_fleet_token(opts.home, code.token, "auto")
        log.info("stored the fleet token of '%s' in %s", code.fleet, where)
        return code.token, HeadAddress(code.head_host, code.head_port, "code")
    psk = load_token(opts.auth_file, opts.home)
    if opts.head:
        host, port = split_hostport(opts.head, opts.head_port)
        return psk, HeadAddress(host, port, "given")
    return psk, None


def _write_node_state(home: Path, heads: list[HeadAddress]) -> None:
    import json

    path = node_state_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "heads": [str(h) for h in heads]}))


def leave(home: Path, *, forget_token: bool) -> list[str]:
    """Stop this machine's joined node, forget its head, and the token if asked."""
    import time

    done: list[str] = []
    path = node_state_path(home)
    try:
        state = nesting.json_loads(path.read_text())
    except (FileNotFoundError, ValueError):
        state = None
    if state is not None:
        pid = int(state.get("pid", 0))
        if pid > 0 and _is_shoal_process(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            done.append(f"closed the links to {', '.join(state.get('heads', [])) or 'the head'}")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        done.append("forgot the head")
    if forget_token:
        from engine.secrets import forget_token as forget

        forget(home)
        done.append("removed the fleet token from this machine")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_shoal_process(pid: int) -> bool:
    """Signal only a Shoal process: the pid in the state file may have been reused."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return _alive(pid) and sys.platform == "darwin"
    return b"shoal" in cmdline or b"engine.cli" in cmdline


def primary_address() -> str:
    """This machine's address for others to dial: a LAN or tailnet IPv4, else loopback."""
    import ipaddress

    import ifaddr

    candidates: list[ipaddress.IPv4Address] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                addr = ipaddress.IPv4Address(ip.ip)
                if not addr.is_loopback and not addr.is_link_local:
                    candidates.append(addr)
    # a private LAN address first, then a tailnet (100.64/10) one
    candidates.sort(key=lambda a: (not a.is_private, a in ipaddress.ip_network("100.64.0.0/10")))
    return str(candidates[0]) if candidates else "127.0.0.1"


def pair_text(home: Path, *, head: str | None, fleet_name: str | None,
              png: Path | None) -> str:
    """What `shoal fleet pair` prints: a QR code, the join URL, and the command to run."""
    from engine import pairing

    token = load_token(None, home)
    if token is None:
        raise StartError("this machine has no fleet token yet; make one with "
                         "`shoal fleet token` (and run the head here), then pair")
    if head:
        host, port = split_hostport(head, 8454)
    else:
        host, port = primary_address(), 8454
    url = pairing.join_url(f"{host}:{port}", token, fleet_name or socket.gethostname())
    lines = [pairing.qr_text(url), url, "",
             "On the new machine, scan this code or run:",
             f"  shoal node join --code '{url}' --model MODEL"]
    if png is not None:
        pairing.save_qr_png(url, png)
        lines.append(f"(QR code saved to {png})")
    return "\n".join(lines)

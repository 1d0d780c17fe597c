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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from engine.head.head import Head
from engine.head.templates import TemplateError
from engine.link.transport import is_loopback
from engine.node.agent import NodeAgent
from engine.runtimes.base import Engine, RuntimeUnavailable
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
    home: Path = field(default_factory=default_home)


def load_token(path: Path | None, home: Path) -> bytes | None:
    try:
        return read_token(path or token_path(home))
    except TokenError as exc:
        raise StartError(str(exc)) from None


def pick_runtime(runtime: str | None, model: str) -> str:
    if runtime:
        if runtime not in ("llamacpp", "mlx", "mock"):
            raise StartError(f"unknown runtime '{runtime}'; use llamacpp, mlx or mock")
        return runtime
    return "llamacpp"


def resolve_model_path(spec: str | None, runtime: str, *, home: Path, offline: bool,
                       progress: Callable[[str], None] | None = None) -> tuple[str, str]:
    """(path or name the runtime loads, the model's name on the link)."""
    if runtime == "mock":
        name = spec or "mock"
        return name, name
    from engine import models

    if runtime == "mlx":
        # MLX loads a model folder or a repo already in the Hugging Face cache itself
        check_runtime(runtime)
        if spec is None:
            raise StartError("runtime mlx has no embedded default model; give an MLX model "
                             "folder or repo id, or use --runtime llamacpp")
        return spec, models.model_name(spec)

    try:
        if spec is None:
            path = models.ensure_embedded_default(home, offline=offline, progress=progress)
            return str(path), models.EMBEDDED_NAME
        path = models.resolve_model(spec, home=home, offline=offline, progress=progress)
    except models.ModelMissing as exc:
        raise StartError(str(exc)) from None
    return str(path), models.model_name(spec)


def check_runtime(runtime: str) -> None:
    """Refuse an unusable runtime before any slow work (pulls, loads)."""
    if runtime == "mlx":
        from engine.runtimes.mlx import check_available

        try:
            check_available()
        except RuntimeUnavailable as exc:
            raise StartError(str(exc)) from None


def make_engine(runtime: str, model: str, *, name: str, lanes: int, max_context: int | None,
                mock_speed: float = 0.0) -> Engine:
    if runtime == "mock":
        from engine.runtimes.mock import MockEngine

        return MockEngine(model=name, lanes=lanes, context_window=max_context or 4096,
                          speed=mock_speed)
    if runtime == "llamacpp":
        from engine.runtimes.llamacpp import LlamaCppEngine

        return LlamaCppEngine(model, model_name=name, lanes=lanes, max_context=max_context)
    if runtime == "mlx":
        from engine.runtimes.mlx import MlxEngine

        mlx_engine: Engine = MlxEngine(model, model_name=name, lanes=lanes,
                                       max_context=max_context)
        return mlx_engine
    raise StartError(f"unknown runtime '{runtime}'")


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


async def start_node(opts: NodeOptions, *, sock: socket.socket | None = None,
                     psk: bytes | None = None,
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
    if sock is None:
        sock = bind(host, port, what="the node's")
    runtime = pick_runtime(opts.runtime, opts.model)
    try:
        path, name = resolve_model_path(opts.model, runtime, home=opts.home,
                                        offline=opts.offline,
                                        progress=lambda line: log.info("%s", line))
        engine = make_engine(runtime, path, name=opts.model_name or name, lanes=opts.max_batch,
                             max_context=opts.max_context, mock_speed=opts.mock_speed)
        await engine.start()
    except (RuntimeUnavailable, FileNotFoundError, ValueError) as exc:
        sock.close()
        raise StartError(str(exc)) from None
    except BaseException:
        sock.close()
        raise
    identity = opts.identity or socket.gethostname()
    agent = NodeAgent(engine, identity=identity, psk=psk,
                      handshake_timeout_s=opts.handshake_timeout_ms / 1000,
                      idle_timeout_s=opts.idle_timeout_ms / 1000)
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
            f"(link {'encrypted' if agent.psk else 'plaintext, loopback only'})")


async def run_node(opts: NodeOptions) -> int:
    stop = _stop_event()
    agent, host, port = await start_node(opts)
    print(describe_node(agent, host, port), flush=True)
    try:
        await stop.wait()
    finally:
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

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.head.close()
        if self.local_agent is not None:
            await self.local_agent.close()
            await self.local_agent.engine.close()


async def start_head(opts: ServeOptions) -> RunningHead:
    from engine.api.app import build_app
    from engine.head.fleet import Fleet
    from engine.head.model import load_head_model
    from engine.head.sessions import SessionRunner

    http_host, http_port = split_hostport(opts.http, 8453)
    psk = load_token(opts.fleet_auth, opts.home)
    http_sock = bind(http_host, http_port, what="the HTTP API's")
    runtime = pick_runtime(opts.runtime, opts.model or "")
    embedded = not opts.fleet or opts.local_node
    local_agent = None
    try:
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
        except (RuntimeUnavailable, FileNotFoundError) as exc:
            raise StartError(str(exc)) from None
        except TemplateError as exc:
            raise StartError(f"the chat template {opts.chat_template} does not compile: "
                             f"{exc}; fix it or leave out --chat-template") from None
        fleet = Fleet(model=name, head_id=pysecrets.token_hex(8), psk=psk,
                      conns_per_node=opts.fleet_conns_per_node)
        runner = SessionRunner(fleet, policy=opts.fleet_policy,  # type: ignore[arg-type]
                               pool_high=opts.fleet_pool_high,
                               queue_timeout_s=opts.queue_timeout_s)
        head = Head(model, fleet, runner, tool_parser=opts.tool_call_parser)
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
        app = build_app(head)
        app_runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await app_runner.setup()
        site = web.SockSite(app_runner, http_sock)
        await site.start()
    except BaseException:
        http_sock.close()
        if local_agent is not None:
            await local_agent.close()
        raise
    bound = http_sock.getsockname()
    return RunningHead(head=head, runner=app_runner, host=str(bound[0]), port=int(bound[1]),
                       local_agent=local_agent)


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

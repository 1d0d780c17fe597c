"""This machine's head: the HTTP API, the session runner over the fleet, and (when it takes
nodes from other machines) the fleet listener, alias sync with the other heads, its
announcement and the discovery of heads and listening nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from engine.api.admin import ServeSplit
from engine.api.app import build_app, server_options
from engine.discovery.service import HeadFinder, announce_head
from engine.errors import CommandError, StartError
from engine.events import Emit
from engine.head.access import keys
from engine.head.access.admin_secret import AdminSecretError, load_or_make_admin_secret
from engine.head.access.hosts import machine_names
from engine.head.commands import AliasCommands
from engine.head.fleet.joins import JoinListener
from engine.head.fleet.links import Fleet, NotAsked
from engine.head.fleet.peers import HeadPeers
from engine.head.fleet.sessions import SessionRunner
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.head.prompt.model import HeadModel
from engine.link.transport import is_loopback
from engine.roles.sockets import bound_address, parse_address
from engine.runtimes.probe import head_probe
from engine.settings import FLEET_PORT, HTTP_PORT, NODE_PORT, DiscoverySettings, HeadSettings
from engine.snapshot import FleetSnapshot
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal")

REDISCOVER_S = 60.0
FINAL_WRITE_S = 1.0
DRAIN_POLL_S = 0.05
Closer = Callable[[], Awaitable[None]]


def configure_access(head: Head, hs: HeadSettings, home: Path) -> None:
    """Who may call the HTTP API: the Host names served, the static key, issued keys and
    their limits, browser origins; and how often a waiting request gets a keepalive.

    Reads files and may ask DNS (this machine's full name): call it off the loop. The
    keys files are checked here, so a broken one fails the start; the API then watches
    them, so `shoal keys issue|revoke` and a rotated secret reach the running head (with
    keys "auto", keys turn on when the first is issued).
    """
    head.api_key = hs.api_key or None
    head.cors_allow = hs.cors_allow
    head.keepalive_s = hs.keepalive_s
    head.allowed_hosts = hs.allow_hosts
    head.host_names = machine_names(fqdn=True)
    try:
        head.admin_secret = load_or_make_admin_secret(home)
    except AdminSecretError as exc:
        raise StartError(str(exc), code="bad_admin_secret") from None
    if hs.keys == "off":
        _refuse_open_api(hs, keyed=bool(head.api_key))
        if head.api_key:
            log.info("the API takes the key given with --api-key")
        return
    if hs.key_policy is not None and not hs.key_policy.exists():
        raise StartError(f"no key policy at {hs.key_policy}; write one like "
                         '{"default": {"rpm": 60, "burst": 10, "concurrent": 4}} '
                         "or leave out --key-policy", code="bad_key_policy")
    secret_file = keys.secret_path(home)
    policy_file = hs.key_policy or keys.policy_path(home)
    try:
        secret = (keys.load_or_make_secret(secret_file) if hs.keys == "on"
                  else keys.read_secret(secret_file))
        policy = keys.load_policy(policy_file)
    except keys.KeysError as exc:
        raise StartError(str(exc), code="bad_keys") from None
    _refuse_open_api(hs, keyed=bool(head.api_key) or secret is not None)
    head.keys_secret_path = secret_file
    head.key_policy_path = policy_file
    head.revoked_path = keys.revoked_path(home)
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


def _refuse_open_api(hs: HeadSettings, *, keyed: bool) -> None:
    """A node refuses to listen off loopback without a token; the HTTP API likewise
    refuses to answer other machines without a key, unless told to (docs/decisions.md)."""
    host, _port = parse_address(hs.http, HTTP_PORT, what="--http")
    if keyed or hs.insecure_no_auth or host == "localhost" or is_loopback(host):
        return
    raise StartError(f"the HTTP API on {hs.http} would answer anyone who can reach this "
                     "machine, with no key; make one with `shoal keys issue NAME` (clients "
                     "send it as a Bearer token), or add --insecure-no-auth to serve "
                     "without keys", code="open_api")


@dataclass
class FleetSide:
    """What a head runs to take nodes from other machines."""

    listener: JoinListener
    host: str
    port: int
    closers: list[Closer] = field(default_factory=list)

    async def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                await close()
        await self.listener.close()


class HeadRole:
    def __init__(self, settings: HeadSettings, head: Head, runner: web.AppRunner,
                 http: tuple[str, int], aliases: AliasCommands) -> None:
        self.settings = settings
        self.head = head
        self._runner = runner
        self.http_host, self.http_port = http
        self.aliases = aliases
        self.fleet_side: FleetSide | None = None
        self.closed = False

    @property
    def api_url(self) -> str:
        host = self.http_host
        if host in ("0.0.0.0", "::", ""):  # noqa: S104 - comparing, not binding
            host = "127.0.0.1"
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.http_port}/v1"

    @staticmethod
    def bind_http(hs: HeadSettings) -> socket.socket:
        from engine.roles.sockets import bind

        host, port = parse_address(hs.http, HTTP_PORT, what="--http")
        return bind(host, port, what="the HTTP API's")

    @classmethod
    async def start(cls, hs: HeadSettings, models: list[HeadModel], *, home: Path,
                    psk: bytes | None, emit: Emit, clock: Callable[[], float],
                    wall: Callable[[], float], http_sock: socket.socket,
                    snapshot: Callable[[], FleetSnapshot],
                    serve_split: ServeSplit | None = None) -> HeadRole:
        """Start the head on ``http_sock`` (bound earlier) with ``models`` (loaded);
        ``serve_split`` serves the API's asks for a model split across machines."""
        main = models[0]
        fleet = Fleet(model=main.name, head_id=secrets.token_hex(8), psk=psk,
                      name=socket.gethostname(),
                      conns_per_node=hs.conns_per_node, also=tuple(m.name for m in models[1:]),
                      clock=clock, emit=emit, probe=head_probe(main.vocab))
        runner = SessionRunner(fleet, policy=hs.policy, pool_high=hs.pool_high,
                               queue_timeout_s=hs.queue_timeout_s, clock=clock)
        aliases_path = home / al.FILE_NAME
        try:
            table = await asyncio.to_thread(al.load, aliases_path)
        except al.AliasError as exc:
            raise StartError(str(exc), code="bad_aliases") from None
        head = Head(models, fleet, runner, tool_parser=hs.tool_call_parser,
                    aliases_path=aliases_path, aliases=table)
        try:
            await asyncio.to_thread(configure_access, head, hs, home)
            for entry in hs.fleet:
                host, port = parse_address(entry, NODE_PORT, what="--fleet")
                fleet.add_dialed(host, port)
            commands = AliasCommands(head, clock=wall, emit=emit)
            app = build_app(head, snapshot=snapshot, aliases=commands,
                            serve_split=serve_split)
            # stop() drains sessions itself first; what is left then gets this long
            app_runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                       shutdown_timeout=FINAL_WRITE_S, **server_options())
            await app_runner.setup()
            await web.SockSite(app_runner, http_sock).start()
        except BaseException:
            http_sock.close()
            await head.close()
            raise
        # the first long prompt should not wait for a worker thread to start
        await asyncio.get_running_loop().run_in_executor(None, lambda: None)
        return cls(hs, head, app_runner, bound_address(http_sock), commands)

    # -- taking nodes from other machines -------------------------------------------

    @staticmethod
    def bind_fleet(address: str) -> socket.socket:
        from engine.roles.sockets import bind

        host, port = parse_address(address, FLEET_PORT, what="--fleet-listen")
        return bind(host, port, what="the fleet listener's")

    async def open_fleet(self, sock: socket.socket, *, discovery: DiscoverySettings) -> None:
        """Take nodes that join on ``sock``; sync aliases with the fleet's heads; when the
        fleet has a token, announce this head and look for the fleet's heads and nodes."""
        head, fleet = self.head, self.head.fleet
        host, port = bound_address(sock)
        head.peers = HeadPeers(head_id=fleet.head_id, name=fleet.name, model=fleet.model,
                               psk=fleet.psk, listen_port=port, table=lambda: head.aliases,
                               on_merged=head.aliases_merged)
        for seed in discovery.seeds:
            shost, sport = parse_address(seed, FLEET_PORT, what="a seed")
            head.peers.dial(shost, sport)
        listener = JoinListener(fleet, peers=head.peers)
        await listener.listen_on(sock)
        side = FleetSide(listener, host, port)
        self.fleet_side = side
        log.info("taking nodes that join on %s:%d", host, port)
        if fleet.psk is None:
            # without a token every link is plaintext, which never leaves this machine
            log.info("no fleet token: this head takes nodes from this machine only and "
                     "looks for none on the network; make one with `shoal fleet token` to "
                     "pair others")
            return
        side.closers.extend(await announce_head(discovery.mode, head_id=fleet.head_id,
                                                model=fleet.model, psk=fleet.psk,
                                                port=port, host=host))
        if discovery.mode != "none":
            side.closers.append(await self._look(discovery, port))

    async def _look(self, discovery: DiscoverySettings, join_port: int) -> Closer:
        """Look for the fleet's other heads (alias sync) and its listening nodes."""
        head, psk = self.head, self.head.fleet.psk
        finder = HeadFinder(discovery.mode, psk=psk, seeds=[],
                            tailscale_socket=discovery.tailscale_socket, head_port=join_port)
        node_finder = HeadFinder(discovery.mode, psk=psk, seeds=[],
                                 tailscale_socket=discovery.tailscale_socket,
                                 head_port=self.settings.node_port, role="node")
        await finder.start()
        await node_finder.start()

        async def look() -> None:
            while True:
                for found in await finder.find(timeout_s=3.0):
                    if head.peers is not None:
                        head.peers.dial(found.host, found.port, discovered=True)
                for node in await node_finder.find(timeout_s=1.0):
                    known = any(p.dialed and (p.host, p.port) == (node.host, node.port)
                                for p in head.fleet.pools.values())
                    if not known:
                        log.info("found a node at %s (%s); dialing it", node, node.source)
                        head.fleet.add_dialed(node.host, node.port, discovered=True)
                await asyncio.sleep(REDISCOVER_S)

        task = asyncio.create_task(look(), name="head-discovery")

        async def stop() -> None:
            await cancel_and_wait([task], "the head's discovery")
            await finder.close()
            await node_finder.close()

        return stop

    async def close_fleet(self) -> None:
        side, self.fleet_side = self.fleet_side, None
        if side is not None:
            await side.close()
        if self.head.peers is not None:
            await self.head.peers.close()
            self.head.peers = None

    async def open_fleet_at(self, listen: str, *, discovery: DiscoverySettings) -> None:
        """`open_fleet` on a new listener bound at ``listen`` (HOST:PORT)."""
        await self.open_fleet(self.bind_fleet(listen), discovery=discovery)

    async def reopen_fleet(self, *, discovery: DiscoverySettings, forget_found: bool) -> None:
        """Close the fleet side and open it again on the same address, for a new token
        (the links with other heads, the announcement and the finders took the old one);
        ``forget_found``: the nodes that joined or were found go too (another fleet's)."""
        side = self.fleet_side
        if side is None:
            return
        await self.close_fleet()
        if forget_found:
            self.forget_found_nodes()
        host = f"[{side.host}]" if ":" in side.host else side.host
        await self.open_fleet_at(f"{host}:{side.port}", discovery=discovery)

    def link_local(self, host: str, port: int) -> None:
        """Dial this machine's own node (listening on ``host``:``port``) over loopback, as
        the pool ``local``, in place of one dialed before."""
        fleet = self.head.fleet
        if "local" in fleet.pools:
            fleet.forget("local")
        if host in ("0.0.0.0", "", "::"):  # noqa: S104 - comparing, not binding
            host = "127.0.0.1"
        fleet.add_dialed(host, port, key="local")

    async def ask_node_to_serve(self, node_key: str, spec: str,
                                split_with: tuple[str, ...] = ()) -> str:
        """Ask the fleet's node ``node_key`` to serve ``spec`` (split with the machines
        whose node listeners are ``split_with``, where any); the line of its yes, or
        CommandError (one line) when it cannot be asked or refuses."""
        fleet = self.head.fleet
        try:
            answer = await fleet.serve_model(node_key, spec, split_with=split_with)
        except NotAsked as exc:
            raise CommandError(str(exc), code=exc.code) from None
        if not answer.accepted:
            pool = fleet.pools.get(node_key)
            who = (pool.info.identity if pool is not None else "") or node_key
            raise CommandError(f"{who} refused to serve {spec}: {answer.message}",
                               code="node_refused")
        return answer.message

    def meet(self, host: str, port: int) -> None:
        """Sync aliases with the head at host:port (one this machine joined), when this
        head takes part in a fleet."""
        if self.head.peers is not None:
            self.head.peers.dial(host, port)

    def forget_found_nodes(self) -> None:
        """Forget the nodes that joined this head and those found on the network (they
        belong to the fleet it is leaving); keep this machine's and those the user gave."""
        fleet = self.head.fleet
        for key, pool in list(fleet.pools.items()):
            if key != "local" and (not pool.dialed or pool.discovered):
                fleet.forget(key)

    def set_psk(self, psk: bytes | None) -> None:
        """A new fleet token: every node link is made again with it. The fleet side (links
        with other heads, the announcement, the finders) holds the token it was opened
        with: close and open it again (`reopen_fleet`)."""
        fleet = self.head.fleet
        fleet.psk = psk
        for pool in fleet.pools.values():
            pool.drop_links()

    # -- stopping ------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> None:
        """Take no new request and give the sessions under way up to ``timeout_s`` to
        finish (those still running after that are cancelled by `close`)."""
        for site in list(self._runner.sites):
            await site.stop()
        fleet = self.head.fleet
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                # polled: it runs once, at shutdown, bounded by timeout_s
                while any(p.busy for p in fleet.pools.values()) or \
                        self.head.runner.queued:  # noqa: ASYNC110
                    await asyncio.sleep(DRAIN_POLL_S)
        # what is still running ends with an error its client reads (written during the
        # FINAL_WRITE_S that `close` gives the answers), never a stream that just stops
        ended = self.head.runner.stop_sessions(
            "the head is stopping (a restart or shutdown) and ended this request after "
            f"{timeout_s:g} s; send it again in a moment")
        if ended:
            log.warning("the head is stopping: ended %d request%s still running after %g s",
                        ended, "" if ended == 1 else "s", timeout_s)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self._runner.cleanup()
        await self.close_fleet()
        await self.head.close()

"""The soak: 32 seeded streams at once over four node processes while nodes are killed,
frozen, restarted and cut off at moments drawn from a fixed seed.

Every stream must end in one of two ways: complete, with exactly the text, finish
reason and token count of an uninterrupted run (no token lost, none twice), or with
an error event that names its cause. A stream that just stops is a failure.

The faults: SIGKILL (the node comes back on the same port a moment later), SIGSTOP
then SIGCONT (sometimes shorter than the head's stall bound, sometimes longer),
SIGTERM and a start on the same port, and a cut (the node lives in a network
namespace of its own; its veth link is set down, then up). At most two nodes are
disturbed at once, so the fleet always has a lane for every stream: a stream that
fails here fails for a bug, not for want of capacity (the drill in
test_faults.py::test_streams_end_with_a_clear_error_when_no_node_is_left covers that).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
import pytest

from tests.drills.conftest import (
    DrillCluster,
    NetnsLink,
    StreamResult,
    chat_body,
    fleet,
    long_seeds,
    made_netns,
    ready_nodes,
    reference,
    stop_gracefully,
)
from tests.drills.record import record, token_free
from tests.integration.conftest import Proc
from tests.waiting import until

pytestmark = [pytest.mark.drills, pytest.mark.slow, pytest.mark.timeout(240)]

SEED = 1212
NODES = 4
LANES = 16  # two nodes down still leave a lane for each of the 32 streams
SPEED = 40.0  # tokens/s per lane: a stream of MAX_TOKENS lasts about 5 s undisturbed
STREAMS = 32
MAX_TOKENS = 200
FAULTS_PER_KIND = 3
SOAK_S = 150.0  # a bound: streams start until every fault has struck and the fleet is whole
RECOVER_S = 40.0  # a disturbed node is linked again within this (the head redials every 10 s)
PROMPT = "drill: tell me a long story about a shoal of fish"


@dataclass
class Fault:
    kind: str  # kill | freeze | restart | cut
    node: str
    gap_s: float  # after the previous fault was applied
    hold_s: float  # how long the node stays killed, frozen or cut off
    busy: int = 0  # sessions of this head on the node when it struck
    applied_at: float = 0.0


def plan(rng: random.Random, nodes: list[str], cut_node: str | None) -> list[Fault]:
    kinds = ["kill", "freeze", "restart"] + (["cut"] if cut_node else [])
    order = [k for k in kinds for _ in range(FAULTS_PER_KIND)]
    rng.shuffle(order)
    faults = []
    for kind in order:
        node = cut_node if kind == "cut" else rng.choice(nodes)
        hold = {"kill": rng.uniform(0.5, 3.0), "freeze": rng.uniform(1.0, 6.0),
                "restart": 0.0, "cut": rng.uniform(2.0, 8.0)}[kind]
        faults.append(Fault(kind, node, gap_s=rng.uniform(1.5, 4.0), hold_s=hold))
    return faults


class Soak:
    def __init__(self, cluster: DrillCluster, head: Proc, nodes: dict[str, Proc],
                 ns: NetnsLink | None, cut_node: str | None) -> None:
        self.cluster = cluster
        self.head = head
        self.base = f"http://127.0.0.1:{head.port}"
        self.nodes = nodes
        self.ns = ns
        self.cut_node = cut_node
        self.disturbed: set[str] = set()
        self.recoveries: list[asyncio.Task[None]] = []
        self.http: aiohttp.ClientSession

    async def own_sessions(self, node: str) -> int:
        state = await fleet(self.http, self.base)
        return sum(n["own_sessions"] for n in state["nodes"] if n["identity"] == node)

    async def strike(self, fault: Fault) -> None:
        await until(lambda: len(self.disturbed) < 2 and fault.node not in self.disturbed,
                    f"a moment with at most one node disturbed before {fault.kind}",
                    timeout=RECOVER_S * 2)
        fault.busy = await self.own_sessions(fault.node)
        fault.applied_at = time.monotonic()
        self.disturbed.add(fault.node)
        proc = self.nodes[fault.node]
        ns = self.ns if fault.node == self.cut_node else None
        if fault.kind == "kill":
            proc.signal(signal.SIGKILL)
            await asyncio.to_thread(proc.popen.wait, 10)
        elif fault.kind == "freeze":
            proc.signal(signal.SIGSTOP)
        elif fault.kind == "restart":
            await asyncio.to_thread(stop_gracefully, proc)
            self.nodes[fault.node] = await asyncio.to_thread(self.cluster.restart, proc, ns)
        elif fault.kind == "cut":
            assert ns is not None
            await asyncio.to_thread(ns.set_link, False)
        self.recoveries.append(asyncio.create_task(self.recover(fault)))

    async def recover(self, fault: Fault) -> None:
        # the drill holds the fault for a drawn time: a moment, not a synchronisation
        await asyncio.sleep(fault.hold_s)
        proc = self.nodes[fault.node]
        ns = self.ns if fault.node == self.cut_node else None
        if fault.kind == "kill":
            self.nodes[fault.node] = await asyncio.to_thread(self.cluster.restart, proc, ns)
        elif fault.kind == "freeze":
            proc.signal(signal.SIGCONT)
        elif fault.kind == "cut":
            assert ns is not None
            await asyncio.to_thread(ns.set_link, True)
        await until(lambda: self._linked(fault.node), f"'{fault.node}' to be linked again "
                    f"after {fault.kind}", timeout=RECOVER_S)
        self.disturbed.discard(fault.node)

    async def _linked(self, node: str) -> bool:
        return node in await ready_nodes(self.http, self.base)


async def test_soak_with_kills_freezes_restarts_and_cuts(cluster: DrillCluster):
    token = cluster.token()
    rng = random.Random(SEED)
    seeds = iter(long_seeds(PROMPT, MAX_TOKENS, 600))
    with made_netns() as ns_or_reason:
        ns = ns_or_reason if isinstance(ns_or_reason, NetnsLink) else None
        names = [f"n{i}" for i in range(NODES)]
        nodes = {name: cluster.node(name, lanes=LANES, speed=SPEED) for name in names[:-1]}
        last = names[-1]
        if ns is not None:
            nodes[last] = cluster.netns_node(ns, last, lanes=LANES, speed=SPEED)
            addresses = [p.address for p in nodes.values() if p.name != last]
            addresses.append(f"{ns.inner}:{nodes[last].port}")
        else:
            nodes[last] = cluster.node(last, lanes=LANES, speed=SPEED)
            addresses = [p.address for p in nodes.values()]
        head = cluster.head(addresses)
        soak = Soak(cluster, head, nodes, ns, last if ns is not None else None)
        faults = plan(rng, names, soak.cut_node)
        results: list[tuple[int, StreamResult]] = []
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=STREAMS * 2)) as http:
            soak.http = http
            await until(lambda: _all_ready(http, soak.base, names), "all four nodes",
                        timeout=30)
            started = time.monotonic()
            end = started + SOAK_S
            calm = asyncio.Event()  # every fault struck and recovered
            last_start = started

            async def worker() -> None:
                from tests.drills.conftest import stream

                nonlocal last_start
                while not calm.is_set() and time.monotonic() < end:
                    seed = next(seeds)
                    last_start = time.monotonic()
                    results.append((seed, await stream(
                        http, soak.base, chat_body(PROMPT, seed, MAX_TOKENS), timeout=150)))

            workers = [asyncio.create_task(worker()) for _ in range(STREAMS)]
            try:
                await until(lambda: _busy(http, soak.base, STREAMS), "every stream to run")
                for fault in faults:
                    await asyncio.sleep(fault.gap_s)  # the drawn moment of the next fault
                    await soak.strike(fault)
                async with asyncio.timeout(RECOVER_S * 2):
                    await asyncio.gather(*soak.recoveries)
                calm.set()
                async with asyncio.timeout(200):
                    await asyncio.gather(*workers)
            finally:
                for task in [*workers, *soak.recoveries]:
                    task.cancel()
                for proc in soak.nodes.values():  # never leave a node stopped
                    if proc.popen.poll() is None:
                        proc.signal(signal.SIGCONT)
                if ns is not None:
                    ns.set_link(True)
            final = await fleet(http, soak.base)
        elapsed = time.monotonic() - started
        logs = cluster.logs_text()
    assert faults[-1].applied_at < last_start, "the faults did not all fall inside the soak"

    # -- every stream: identical to its uninterrupted run, or a clear error ------------
    outcomes: Counter[str] = Counter()
    lost = 0
    delivered = 0
    problems: list[str] = []
    for seed, res in results:
        ref, ref_finish = reference(PROMPT, seed, MAX_TOKENS)
        delivered += len(res.text)
        if res.completed:
            if res.text != ref or res.finish != ref_finish or \
                    not res.usage or res.usage["completion_tokens"] != len(ref):
                problems.append(f"seed {seed}: differs from its uninterrupted run "
                                f"({len(res.text)}/{len(ref)} chars, {res.finish}, "
                                f"{res.usage})")
                lost += abs(len(ref) - len(res.text))
                outcomes["wrong"] += 1
            else:
                outcomes["identical"] += 1
        elif res.error is not None and res.clear_error:
            outcomes["clear_error"] += 1
            if not ref.startswith(res.text):
                problems.append(f"seed {seed}: text before the error is not the run's start")
        else:
            outcomes["cut_short"] += 1
            lost += len(ref) - len(res.text)
            problems.append(f"seed {seed}: {res.broken or res.error} after "
                            f"{len(res.text)} chars; last events {res.events[-3:]}")
    head_log = head.log_text()
    moves = head_log.count("moved from")
    hung = head_log.count("treating the node as hung")
    kinds = Counter(f.kind for f in faults)
    row = record(
        "soak", kind="drill",
        tried=(f"{len(results)} seeded streams ({STREAMS} at once, {MAX_TOKENS} tokens each) "
               f"over {NODES} nodes of {LANES} lanes for {elapsed:.0f} s; faults at seeded "
               "moments: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
               + ("" if ns is not None else f" (no cut: {ns_or_reason})")),
        times=len(results),
        outcome=(f"{outcomes['identical']} identical to the uninterrupted run, "
                 f"{outcomes['clear_error']} ended with a clear error, "
                 f"{outcomes['cut_short']} cut short, {outcomes['wrong']} wrong; "
                 f"{moves} sessions moved to another node, {hung} of them from a node "
                 "they found hung"),
        tokens_lost=lost, failed_clear=outcomes["clear_error"],
        streams=len(results), identical=outcomes["identical"], faults=dict(kinds),
        faults_on_busy_nodes=sum(1 for f in faults if f.busy), moves=moves, hung=hung,
        tokens_delivered=delivered, elapsed_s=round(elapsed, 1),
        cut=ns is not None)
    print(row)
    assert not problems, "\n".join(problems[:20])
    assert outcomes["identical"] == len(results) >= STREAMS * 3
    # the faults hit running sessions, and those sessions moved (a kill always moves them)
    assert any(f.kind == "kill" and f.busy for f in faults), [vars(f) for f in faults]
    assert moves >= sum(1 for f in faults if f.kind == "kill" and f.busy)
    for node in final["nodes"]:
        assert node["peak_busy"] <= LANES, node
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
    token_free(logs, token)


async def _all_ready(http: aiohttp.ClientSession, base: str, names: list[str]) -> bool:
    return set(names) <= await ready_nodes(http, base)


async def _busy(http: aiohttp.ClientSession, base: str, count: int) -> bool:
    state = await fleet(http, base)
    return sum(n["own_sessions"] for n in state["nodes"]) >= count




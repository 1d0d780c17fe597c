"""Placement study: the three policies on a simulated mixed fleet, in simulated time.

No sockets and no clock: the head's own pure placement function (engine.head.fleet.
placement.place) decides, over views of simulated nodes, exactly as the head would; a
small discrete-event simulation plays the nodes and the users.

The fleet: fast and slow nodes (prefill and decode rates measured on real machines of
the kinds a home fleet has), each with lanes whose decode rate drops as more of them run
at once (continuous batching), and a prompt cache per lane (a finished sequence stays
parked for its session until the lane is needed; the next turn of that session on the
same node prefills only what is new). The users: conversations of one to five turns,
short and long prompts, a think time between turns, arriving at random.

Reported per policy (several seeds, all requests pooled): mean and p95 completion time
(arrival to last token, queueing included), time to first token, and the prompt-cache
hit rate (follow-up turns that found their session's prefix parked where they ran).

    .venv/bin/python scripts/bench/placement_study.py [--seeds 5] [--write]
    .venv/bin/python scripts/bench/placement_study.py --smoke   (one seed, figures checked,
                                                                 the plot to a temp folder)
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.head.fleet.placement import (  # noqa: E402
    NodeView,
    NoPlacement,
    Placement,
    PlacementRequest,
    Policy,
    place,
)

MODEL = "m"
WINDOW = 8192
POLICIES: tuple[Policy, ...] = ("load-aware", "least-loaded", "round-robin")


@dataclass(frozen=True)
class Kind:
    name: str
    prefill_tps: float  # prompt tokens per second (one prompt at a time)
    decode_tps: float  # tokens per second of one lane running alone
    lanes: int
    batch_cost: float  # each more running lane slows every lane by this fraction


# measured orders of magnitude for a 7-8B model at Q4: an Apple M-series Max, a recent
# desktop CPU, an older laptop
FAST = Kind("fast", prefill_tps=900.0, decode_tps=45.0, lanes=4, batch_cost=0.12)
MID = Kind("mid", prefill_tps=250.0, decode_tps=18.0, lanes=4, batch_cost=0.18)
SLOW = Kind("slow", prefill_tps=80.0, decode_tps=8.0, lanes=2, batch_cost=0.25)
FLEET = (FAST, MID, MID, SLOW)


@dataclass
class Turn:
    session: str
    index: int  # 0 for the first turn
    arrival: float
    prompt: int  # tokens of the whole conversation so far
    answer: int  # tokens to generate
    start: float = 0.0
    first: float = 0.0
    done: float = 0.0
    node: str = ""
    cached: int = 0
    hit: bool = False
    could_hit: bool = False  # its prefix was still parked where the head remembered it


@dataclass
class Running:
    turn: Turn
    prefill_left: float  # prompt tokens still to prefill
    decode_left: float  # tokens still to generate


@dataclass
class Node:
    key: str
    kind: Kind
    running: list[Running] = field(default_factory=list)
    # the prefix each lane holds parked: session -> tokens, least recently used first
    parked: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def rates(self) -> tuple[float, float]:
        """(prefill tokens/s for each prefilling turn, decode tokens/s for each decoding
        turn) with what runs now: prompts share the prefill, lanes slow each other."""
        prefilling = sum(1 for r in self.running if r.prefill_left > 0)
        decoding = sum(1 for r in self.running if r.prefill_left <= 0)
        busy = len(self.running)
        slow = 1.0 + self.kind.batch_cost * max(busy - 1, 0)
        prefill = self.kind.prefill_tps / slow / max(prefilling, 1)
        return prefill, self.kind.decode_tps / slow if decoding else 0.0

    def view(self, now: float) -> NodeView:
        busy = len(self.running)
        return NodeView(key=self.key, identity=self.key, model=MODEL, context_window=WINDOW,
                        lanes=self.kind.lanes, idle_conns=self.kind.lanes - busy,
                        own_sessions=busy, reported_busy=busy,
                        kv_used=sum(self.parked.values()),
                        kv_total=WINDOW * self.kind.lanes,
                        prefill_tps=self.kind.prefill_tps, decode_tps=self.kind.decode_tps)


def conversations(rng: random.Random, *, count: int, rate_per_s: float) -> list[Turn]:
    """First turns of ``count`` conversations; follow-ups are made as answers finish."""
    out = []
    t = 0.0
    for i in range(count):
        t += rng.expovariate(rate_per_s)
        long = rng.random() < 0.3  # an agent or a pasted file: a long first prompt
        prompt = rng.randint(1500, 5000) if long else rng.randint(60, 600)
        out.append(Turn(f"c{i}", 0, t, prompt, rng.randint(60, 300)))
    return out


@dataclass
class Result:
    policy: str
    affinity: bool
    turns: list[Turn]

    @property
    def completion(self) -> list[float]:
        return [t.done - t.arrival for t in self.turns]

    @property
    def ttft(self) -> list[float]:
        return [t.first - t.arrival for t in self.turns]

    @property
    def hit_rate(self) -> float:
        follow = [t for t in self.turns if t.index > 0]
        return sum(t.hit for t in follow) / len(follow) if follow else 0.0

    @property
    def kept_rate(self) -> float:
        """Of the follow-ups whose prefix was still parked at arrival, the share placed
        there: what the policy decides (the rest of the misses are the cache's size)."""
        could = [t for t in self.turns if t.index > 0 and t.could_hit]
        return sum(t.hit for t in could) / len(could) if could else 0.0

    @property
    def parked_rate(self) -> float:
        follow = [t for t in self.turns if t.index > 0]
        return sum(t.could_hit for t in follow) / len(follow) if follow else 0.0


def simulate(policy: Policy, seed: int, *, affinity: bool = True, cache_aware: bool = True,
             count: int = 400, rate_per_s: float = 0.09) -> Result:
    rng = random.Random(seed)
    nodes = {f"{k.name}-{i}": Node(f"{k.name}-{i}", k) for i, k in enumerate(FLEET)}
    pending: list[tuple[float, int, Turn]] = []  # arrivals, by time
    serial = 0
    for turn in conversations(rng, count=count, rate_per_s=rate_per_s):
        heapq.heappush(pending, (turn.arrival, serial, turn))
        serial += 1
    queue: list[Turn] = []  # waiting for a lane, first in first out
    # session -> (node key, tokens it holds): the head's affinity table
    remembered: dict[str, tuple[str, int]] = {}
    finished: list[Turn] = []
    cursor = 0
    now = 0.0
    follow_ups = random.Random(seed + 1)

    def try_place(turn: Turn) -> bool:
        nonlocal cursor
        held = remembered.get(turn.session) if affinity else None
        req = PlacementRequest(model=MODEL, prompt_tokens=turn.prompt,
                               max_tokens=turn.answer, affinity=held[0] if held else None,
                               affinity_cached=held[1] if held and cache_aware else 0)
        got = place(req, [n.view(now) for n in nodes.values()], now=now, policy=policy,
                    cursor=cursor)
        if isinstance(got, NoPlacement):
            return False
        assert isinstance(got, Placement)
        cursor = got.cursor
        if held is not None:
            turn.could_hit = turn.session in nodes[held[0]].parked
        node = nodes[got.node]
        held_tokens = node.parked.pop(turn.session, 0)
        turn.cached = min(held_tokens, turn.prompt - 1)
        turn.hit = turn.cached > 0
        if len(node.parked) + len(node.running) >= node.kind.lanes and node.parked:
            node.parked.popitem(last=False)  # the lane it takes loses its parked prefix
        turn.node, turn.start = node.key, now
        remembered[turn.session] = (node.key, turn.prompt)
        node.running.append(Running(turn, turn.prompt - turn.cached, turn.answer))
        return True

    while pending or queue or any(n.running for n in nodes.values()):
        # the next thing to happen: an arrival, or a prefill or generation ending
        step = math.inf
        for node in nodes.values():
            prefill, decode = node.rates()
            for r in node.running:
                left = r.prefill_left / prefill if r.prefill_left > 0 else \
                    r.decode_left / decode
                step = min(step, left)
        next_arrival = pending[0][0] - now if pending else math.inf
        dt = min(step, next_arrival)
        assert dt < math.inf
        # advance every running turn by dt at its current rate
        for node in nodes.values():
            prefill, decode = node.rates()
            for r in list(node.running):
                if r.prefill_left > 0:
                    r.prefill_left -= prefill * dt
                    if r.prefill_left <= 1e-9:
                        r.prefill_left = 0.0
                        r.turn.first = now + dt
                else:
                    r.decode_left -= decode * dt
                    if r.decode_left <= 1e-9:
                        node.running.remove(r)
                        turn = r.turn
                        turn.done = now + dt
                        finished.append(turn)
                        node.parked[turn.session] = turn.prompt + turn.answer
                        remembered[turn.session] = (node.key, turn.prompt + turn.answer)
                        node.parked.move_to_end(turn.session)
                        while len(node.parked) + len(node.running) > node.kind.lanes:
                            node.parked.popitem(last=False)
                        if turn.index < 4 and follow_ups.random() < 0.65:
                            think = follow_ups.expovariate(1 / 25.0)
                            nxt = Turn(turn.session, turn.index + 1, turn.done + think,
                                       turn.prompt + turn.answer
                                       + follow_ups.randint(20, 250),
                                       follow_ups.randint(60, 300))
                            heapq.heappush(pending, (nxt.arrival, serial, nxt))
                            serial += 1
        now += dt
        while pending and pending[0][0] <= now + 1e-12:
            queue.append(heapq.heappop(pending)[2])
        # the queue is served in order; the first that cannot be placed waits
        while queue and try_place(queue[0]):
            queue.pop(0)
    return Result(policy, affinity, finished)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def study(seeds: int) -> list[tuple[str, dict[str, float]]]:
    rows = []
    variants: list[tuple[str, Policy, bool, bool]] = [(p, p, True, True) for p in POLICIES]
    variants += [("load-aware, affinity priced without the cached prefix", "load-aware",
                  True, False),
                 ("load-aware, no affinity", "load-aware", False, False)]
    for label, policy, affinity, cache_aware in variants:
        turns = []
        for seed in range(seeds):
            turns.extend(simulate(policy, seed, affinity=affinity,
                                  cache_aware=cache_aware).turns)
        res = Result(policy, affinity, turns)
        rows.append((label, {
            "requests": float(len(turns)),
            "mean_s": statistics.fmean(res.completion), "p95_s": pct(res.completion, 0.95),
            "ttft_mean_s": statistics.fmean(res.ttft), "ttft_p95_s": pct(res.ttft, 0.95),
            "hit_rate": res.hit_rate, "kept_rate": res.kept_rate,
            "parked_rate": res.parked_rate}))
    return rows


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    out = ["| policy | requests | mean completion s | p95 completion s | mean TTFT s | "
           "p95 TTFT s | prompt-cache hits (follow-ups) | still parked at arrival | "
           "placed where parked |",
           "|:--|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in rows:
        out.append(f"| {label} | {int(r['requests'])} | {r['mean_s']:.1f} | {r['p95_s']:.1f} | "
                   f"{r['ttft_mean_s']:.1f} | {r['ttft_p95_s']:.1f} | "
                   f"{100 * r['hit_rate']:.0f} % | {100 * r['parked_rate']:.0f} % | "
                   f"{100 * r['kept_rate']:.0f} % |")
    return "\n".join(out)


def plot(rows: list[tuple[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"load-aware, affinity priced without the cached prefix": "load-aware\n(old pricing)",
             "load-aware, no affinity": "load-aware\n(no affinity)"}
    labels = [short.get(label, label) for label, _ in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["mean_s"] for _, r in rows], width=0.4, label="mean")
    ax1.bar([i + 0.2 for i in x], [r["p95_s"] for _, r in rows], width=0.4, label="p95")
    ax1.set_xticks(list(x), labels, fontsize=8)
    ax1.set_ylabel("completion time (s)")
    ax1.set_title("completion time, lower is better")
    ax1.legend()
    ax2.bar(list(x), [100 * r["hit_rate"] for _, r in rows], color="tab:green")
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_ylabel("follow-up turns with a prompt-cache hit (%)")
    ax2.set_title("prompt-cache hits, higher is better")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def smoke_verdict(rows: list[tuple[str, dict[str, float]]]) -> None:
    from scripts.bench.smoke import scratch, verdict

    plot(rows, scratch("placement") / "placement_study.png")
    by = dict(rows)
    ratio = by["round-robin"]["mean_s"] / by["load-aware"]["mean_s"]
    figures = {"requests": {label: int(r["requests"]) for label, r in rows},
               "round_robin_over_load_aware": ratio}
    verdict(figures, {
        "every policy placed requests": all(r["requests"] > 0 for _, r in rows),
        "completion times are positive": all(0 < r["mean_s"] <= r["p95_s"] for _, r in rows),
        "hit rates are shares": all(0 <= r[k] <= 1 for _, r in rows
                                    for k in ("hit_rate", "kept_rate", "parked_rate")),
        "the ratio of policies was computed": math.isfinite(ratio) and ratio > 0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--write", action="store_true",
                        help="write the plot to docs/placement_study.png")
    parser.add_argument("--smoke", action="store_true",
                        help="one seed, the plot to a temp folder; exit 1 if the figures "
                        "make no sense")
    args = parser.parse_args()
    rows = study(1 if args.smoke else args.seeds)
    text = table(rows)
    print(text)
    if args.smoke:
        smoke_verdict(rows)
        return
    if args.write:
        plot(rows, ROOT / "docs" / "placement_study.png")
        print("wrote docs/placement_study.png")


if __name__ == "__main__":
    main()

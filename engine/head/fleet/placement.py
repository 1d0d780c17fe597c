"""Where a head places a new session: a pure function over a snapshot of its nodes.

No I/O and no clock: the head passes ``now`` and its current view of every node,
and gets back either a `Placement` (node key, log reason, round-robin cursor) or
a `NoPlacement` whose message names the cause and the fix.

Order of decisions:

1. Candidates: nodes serving ``req.model``, not in ``req.exclude`` (they already
   failed this session), named ``req.pin_host`` when pinned, linked now (``ready``),
   and whose window (the longest session the node's model takes there) holds the
   prompt plus one generated token. Refusals: ``unknown_node`` when the pin names no
   node serving the model (final: it can never be placed), ``node_down`` when it names
   one that is not linked now (final: the user asked for that node only), ``no_node``
   when nothing linked serves the model (after the exclusions; the head waits for a
   node then), ``context_length_exceeded`` when some do but no window holds the
   prompt (final).
2. Free now: a candidate with a free lane (:func:`has_free_lane`) whose KV pool, which
   all its lanes share, takes the prompt now (:func:`takes_prompt`: the node's
   ``max_prompt``, when it said one). A pool that cannot counts as a busy node does:
   ``no_free_lane`` when no candidate is free (the head queues on that, and parked
   prefixes and ending sessions free the pool meanwhile). An asleep node is free (the
   request wakes it), but below every awake one in the steps that follow.
3. ``prefer``: the first named node (by identity) that is free wins outright, ahead of
   speed, affinity and sleep; a name with no free node is passed over.
4. Affinity (every policy): the node holding the session's prompt cache wins
   while its estimate is within ``affinity_slack`` x the best estimate, unless it is
   asleep and an awake node is free. That node is priced with only the part of the
   prompt it does not hold yet (``req.affinity_cached`` tokens are already there): a
   long conversation's next turn costs it a few hundred tokens of prefill, and the
   whole prompt anywhere else.
5. The policy, awake nodes before asleep or waking ones in each: ``load-aware``
   (lowest estimate, after skipping nodes at or above ``pool_high`` % KV occupancy
   unless that skips all; cells held by parked prefixes, which a new session may
   reclaim, are not counted), ``least-loaded`` (fewest sessions) or ``round-robin``
   (rotate over the candidates by key, passing over an asleep node while an awake one
   is free).

Estimate of a session's completion time on node ``n``::

    load     = max(n.own_sessions, n.reported_busy)
    slowdown = 1 + load / n.lanes
    est      = load + prefill + max_tokens * slowdown / decode_tps
    load     = the seconds loading the model takes first, on a node that keeps it
               unloaded (``n.load_s``: its last load there, else its file's size at
               the rate of a typical load); 0 where it is loaded
    prefill  = p * a + b * p * (c + p / 2)    a node that fitted its cost (a, b)
             | p / prefill_tps                one that has not (yet)

``p`` is the prompt tokens the node must prefill: the whole prompt, or on the node
holding the session's prompt cache the part it does not hold; ``c`` the tokens it
holds before them (:func:`prefill_seconds`). ``a`` is the node's seconds per prompt
token and ``b`` the extra seconds per token for every token of context before it
(attention grows with the context), so a long prompt costs more per token than a
short one. ``decode_tps`` is per lane; batching more lanes slows each one, so a node
that is already running ``lanes - 1`` sessions decodes at about half its idle rate.
A node that has not measured a rate yet is priced at the mean of the measured
nodes serving the model. A term whose rate nobody has measured is left out
(it would be the same on every node), so with nothing measured every estimate
is 0 and nodes tie; ties go to the lower load, then the lower key.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, assert_never

Policy = Literal["load-aware", "least-loaded", "round-robin"]
Sleep = Literal["", "asleep", "waking"]  # awake; model unloaded while idle; loading it


@dataclass(frozen=True, slots=True)
class NodeView:
    """What one head knows about one node at placement time."""

    key: str  # "host:port" for a dialed node, "joined:<identity>" for a joined one
    identity: str
    model: str
    context_window: int  # tokens one session can hold there
    lanes: int
    idle_conns: int  # this head's idle connections to it; 0 = cannot start a session now
    own_sessions: int  # sessions this head runs there now
    reported_busy: int  # lanes busy in the node's last stats (all heads together)
    kv_used: int
    kv_total: int
    prefill_tps: float  # prompt tokens/s; 0.0 = not measured yet
    decode_tps: float  # tokens/s per lane; 0.0 = not measured yet
    full_until: float = 0.0  # refused a session as full: full until then (or fresher stats)
    ready: bool = True  # linked now (not connecting, unreachable or left)
    # the node's fitted prefill cost (prefill_seconds); both 0.0 until it fitted them
    prefill_s_per_token: float = 0.0
    prefill_s_per_token_ctx: float = 0.0
    # the KV pool all its lanes share: the longest prompt a new session can bring now
    # (0: not said; the window then), and the cells parked prefixes hold (reclaimable)
    max_prompt: int = 0
    kv_parked: int = 0
    sleep: Sleep = ""
    paused: bool = False  # its user paused serving: no new session, its lanes not counted
    # sessions failed there before their first token: passed over until then (cooldown.py)
    resting_until: float = 0.0
    failing: str = ""  # the cause the node gave
    # a kept model not loaded there: the seconds its load adds before the first token
    load_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    model: str
    prompt_tokens: int
    max_tokens: int
    exclude: frozenset[str] = frozenset()  # node keys that already failed this session
    affinity: str | None = None  # node key holding this session's prompt cache
    affinity_cached: int = 0  # prompt tokens that node holds (its last turn's context)
    pin_host: str | None = None  # ?host=NAME: compared with identities, never dialed
    prefer: tuple[str, ...] = ()  # ?prefer=a,b: identities, first free one wins


@dataclass(frozen=True, slots=True)
class Placement:
    node: str  # key
    reason: str  # short text for the head's log
    cursor: int  # round-robin cursor to pass next time


@dataclass(frozen=True, slots=True)
class NoPlacement:
    code: Literal["context_length_exceeded", "no_free_lane", "no_node", "unknown_node",
                  "node_down", "paused", "failing"]
    message: str  # one line for the user: cause and fix


def node_load(n: NodeView) -> int:
    # Other heads' sessions show up only in the report, ours may be newer than it.
    return max(n.own_sessions, n.reported_busy)


def has_free_lane(n: NodeView, now: float) -> bool:
    return node_load(n) < n.lanes and n.idle_conns > 0 and now >= n.full_until


def takes_prompt(n: NodeView, prompt_tokens: int) -> bool:
    """Whether the node's KV pool takes a prompt of ``prompt_tokens`` (and one token)
    now; a node that has not said (``max_prompt`` 0) is judged by its window alone."""
    return n.max_prompt <= 0 or prompt_tokens + 1 <= n.max_prompt


def awake(n: NodeView) -> bool:
    return n.sleep == ""


def kv_percent(n: NodeView) -> float:
    # A node that has not reported its pool yet is not held against it, nor are the cells
    # its parked prefixes hold (a new session reclaims them).
    held = max(n.kv_used - n.kv_parked, 0)
    return held / n.kv_total * 100.0 if n.kv_total > 0 else 0.0


def prefill_seconds(tokens: int, cached: int = 0, *, tps: float, s_per_token: float = 0.0,
                    s_per_token_ctx: float = 0.0) -> float:
    """Seconds to prefill ``tokens`` new prompt tokens after ``cached`` tokens of context.

    With a fitted cost (``s_per_token`` a, ``s_per_token_ctx`` b, from the node's rates):
    ``n * a + b * n * (c + n / 2)``, each token costing a plus b for every token before
    it (the c held ones and, on average, half the new ones). Without one: ``n / tps``;
    0.0 when ``tps`` <= 0 too (nobody measured it).
    """
    n = max(tokens, 0)
    if s_per_token > 0 or s_per_token_ctx > 0:
        return n * s_per_token + s_per_token_ctx * n * (max(cached, 0) + n / 2)
    return n / tps if tps > 0 else 0.0


def estimate_seconds(
    n: NodeView, req: PlacementRequest, prefill_tps: float, decode_tps: float,
    cached: int = 0,
) -> float:
    """Seconds to finish ``req`` on ``n`` at the given (already resolved) rates, where
    ``n`` already holds the first ``cached`` prompt tokens.

    ``n``'s fitted prefill cost wins over ``prefill_tps``. A rate <= 0 means nobody
    measured it: that term is dropped, see the module doc.
    """
    prefill = prefill_seconds(req.prompt_tokens - cached, cached, tps=prefill_tps,
                              s_per_token=n.prefill_s_per_token,
                              s_per_token_ctx=n.prefill_s_per_token_ctx)
    if decode_tps <= 0:
        return n.load_s + prefill
    slowdown = 1.0 + node_load(n) / n.lanes if n.lanes > 0 else 1.0
    return n.load_s + prefill + req.max_tokens * slowdown / decode_tps


def place(
    req: PlacementRequest,
    nodes: Sequence[NodeView],
    *,
    now: float,
    policy: Policy = "load-aware",
    pool_high: float = 90.0,
    cursor: int = 0,
    affinity_slack: float = 1.25,
) -> Placement | NoPlacement:
    serving = [n for n in nodes if n.model == req.model]
    pinned = [n for n in serving if req.pin_host is None or n.identity == req.pin_host]
    if req.pin_host is not None and not pinned:
        return NoPlacement("unknown_node", _no_node_message(req, nodes, serving, pinned))
    usable = [n for n in pinned if n.key not in req.exclude and n.ready]
    if not usable:
        if req.pin_host is not None and not any(n.ready for n in pinned):
            return NoPlacement("node_down", f"node '{req.pin_host}' is not linked to this head "
                               "now; retry when it is back, or drop ?host= to use any node")
        linked = [n for n in pinned if n.ready]
        if linked and all(n.failing for n in linked):  # each failed it before a token
            return _failing(req, linked)
        return NoPlacement("no_node", _no_node_message(req, nodes, serving, pinned))
    if all(n.paused for n in usable):  # nothing to wait for: said at once
        names = ", ".join(sorted({n.identity for n in usable}))
        return NoPlacement("paused", f"every node serving '{req.model}' is paused ({names}); "
                           "resume serving on one (Resume serving in its tray menu) or add a node")
    usable = [n for n in usable if not n.paused]
    if all(now < n.resting_until for n in usable):  # ended with the cause the nodes gave
        return _failing(req, usable)
    usable = [n for n in usable if now >= n.resting_until]

    need = req.prompt_tokens + 1  # room for at least one generated token
    capable = sorted((n for n in usable if n.context_window >= need), key=lambda n: n.key)
    if not capable:
        largest = max(n.context_window for n in usable)
        verb = "exceeds" if req.prompt_tokens > largest else "leaves no room to generate in"
        return NoPlacement(
            "context_length_exceeded",
            f"prompt of {req.prompt_tokens} tokens {verb} every node's context window "
            f"(largest {largest}); shorten the conversation, or serve a model with a "
            "longer window",
        )

    free = [n for n in capable if has_free_lane(n, now) and takes_prompt(n, req.prompt_tokens)]
    if not free:
        return NoPlacement("no_free_lane", _no_free_lane_message(req, capable, now))
    any_awake = any(awake(n) for n in free)

    # Rates come from every node of the model, excluded or not: a measurement
    # stays true after that node failed this one session.
    mean_prefill = _mean(n.prefill_tps for n in serving)
    mean_decode = _mean(n.decode_tps for n in serving)
    cached = max(min(req.affinity_cached, req.prompt_tokens - 1), 0)
    est = {
        n.key: estimate_seconds(
            n,
            req,
            n.prefill_tps if n.prefill_tps > 0 else mean_prefill,
            n.decode_tps if n.decode_tps > 0 else mean_decode,
            cached if n.key == req.affinity else 0,
        )
        for n in free
    }

    def rank(n: NodeView) -> tuple[bool, float, int, str]:
        return (not awake(n), est[n.key], node_load(n), n.key)

    for name in req.prefer:
        named = [n for n in free if n.identity == name]
        if named:
            pick = min(named, key=rank)
            return Placement(pick.key, _woken("prefer", pick), cursor)

    pool = free
    if policy == "load-aware":
        pool = [n for n in free if kv_percent(n) < pool_high] or free

    if req.affinity is not None:
        # The affinity node skips the pool_high test: its KV already holds this
        # session's prompt, so staying there costs the pool only the new turn.
        # An asleep node lost its pool with its model, and must load that first.
        held = next((n for n in free if n.key == req.affinity
                     and (awake(n) or not any_awake)), None)
        best = min(est[n.key] for n in pool)
        if held is not None and est[held.key] <= affinity_slack * best:
            return Placement(held.key, _woken("affinity", held), cursor)

    if policy == "load-aware":
        pick = min(pool, key=rank)
        return Placement(pick.key, _woken(f"load-aware est {est[pick.key]:.1f}s", pick),
                         cursor)
    if policy == "least-loaded":
        pick = min(pool, key=lambda n: (not awake(n), node_load(n), n.key))
        return Placement(pick.key,
                         _woken(f"least-loaded load {node_load(pick)}/{pick.lanes}", pick),
                         cursor)
    if policy == "round-robin":
        # The ring is every capable node, busy or not, so positions stay put
        # while a node fills and frees; busy ones are skipped, and asleep ones while
        # an awake one is free.
        start = cursor % len(capable)
        keys = {n.key for n in free if awake(n) or not any_awake}
        for step in range(len(capable)):
            i = (start + step) % len(capable)
            if capable[i].key in keys:
                return Placement(capable[i].key, _woken("round-robin", capable[i]),
                                 (i + 1) % len(capable))
        raise AssertionError("unreachable: free is non-empty")
    assert_never(policy)


def _failing(req: PlacementRequest, nodes: Sequence[NodeView]) -> NoPlacement:
    causes = "; ".join(f"{n.identity}: {n.failing}"
                       for n in sorted(nodes, key=lambda n: n.identity)[:3])
    return NoPlacement("failing", f"every node serving '{req.model}' failed its last sessions "
                       f"before a token ({causes}); fix the node, or retry later")


def _woken(reason: str, n: NodeView) -> str:
    return reason if awake(n) else f"{reason}, {n.sleep} (the request wakes it)"


def _mean(rates: Iterable[float]) -> float:
    measured = [r for r in rates if r > 0]
    return sum(measured) / len(measured) if measured else 0.0


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _no_node_message(
    req: PlacementRequest,
    nodes: Sequence[NodeView],
    serving: Sequence[NodeView],
    pinned: Sequence[NodeView],
) -> str:
    if not nodes:
        return (
            f"no node serves model '{req.model}' (the fleet has 0 nodes); start a node "
            "with the same fleet token, or check that the head can reach it"
        )
    if not serving:
        models = ", ".join(sorted({n.model for n in nodes}))
        return (
            f"no node serves model '{req.model}' ({_plural(len(nodes), 'node')} serve: "
            f"{models}); request one of those or start a node with --model-name {req.model}"
        )
    if not pinned:
        names = ", ".join(sorted({n.identity for n in serving}))
        return (
            f"no node named '{req.pin_host}' serves model '{req.model}' "
            f"({_plural(len(serving), 'node')} serve it: {names}); fix or drop ?host="
        )
    failed = sum(1 for n in pinned if n.key in req.exclude)
    if failed == len(pinned):
        return (
            f"all {_plural(len(pinned), 'node')} serving model '{req.model}' already failed "
            "this request; retry later or add a node"
        )
    down = sum(1 for n in pinned if not n.ready and n.key not in req.exclude)
    return (
        f"no node serving model '{req.model}' is linked to this head now ({down} unreachable "
        f"or gone{f', {failed} failed this request' if failed else ''}); start one or check "
        "that the head can reach it"
    )


def _no_free_lane_message(req: PlacementRequest, capable: Sequence[NodeView], now: float) -> str:
    busy = sum(min(node_load(n), n.lanes) for n in capable)
    lanes = sum(n.lanes for n in capable)
    extra = []
    refused = sum(1 for n in capable if now < n.full_until)
    if refused:
        extra.append(f"{refused} refused a session as full")
    unconnected = sum(1 for n in capable if n.idle_conns <= 0 and node_load(n) < n.lanes)
    if unconnected:
        extra.append(f"{unconnected} with no idle connection")
    pool_full = sum(1 for n in capable if not takes_prompt(n, req.prompt_tokens))
    if pool_full:
        extra.append(f"{pool_full} cannot hold the prompt now (KV pool full)")
    detail = "; ".join([f"{busy}/{lanes} lanes busy", *extra])
    # more lanes do not help where the pool is what is short
    fix = ("wait and retry or add a node" if pool_full == len(capable)
           else "wait and retry, add a node or raise --max-batch")
    return (
        f"no free lane on the {_plural(len(capable), 'node')} serving '{req.model}' that "
        f"can hold the prompt ({detail}); {fix}"
    )

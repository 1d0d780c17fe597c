from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.head.fleet.placement import (
    NodeView,
    NoPlacement,
    Placement,
    PlacementRequest,
    Policy,
    estimate_seconds,
    has_free_lane,
    kv_percent,
    node_load,
    place,
    prefill_seconds,
    takes_prompt,
)

POLICIES: tuple[Policy, ...] = ("load-aware", "least-loaded", "round-robin")


def node(key: str, **kw: Any) -> NodeView:
    base: dict[str, Any] = {
        "key": key,
        "identity": key,
        "model": "m",
        "context_window": 8192,
        "lanes": 4,
        "idle_conns": 4,
        "own_sessions": 0,
        "reported_busy": 0,
        "kv_used": 0,
        "kv_total": 1000,
        "prefill_tps": 1000.0,
        "decode_tps": 20.0,
    }
    base.update(kw)
    return NodeView(**base)


def req(**kw: Any) -> PlacementRequest:
    base: dict[str, Any] = {"model": "m", "prompt_tokens": 1000, "max_tokens": 100}
    base.update(kw)
    return PlacementRequest(**base)


def placed(result: Placement | NoPlacement) -> Placement:
    assert isinstance(result, Placement), result
    return result


def refused(result: Placement | NoPlacement) -> NoPlacement:
    assert isinstance(result, NoPlacement), result
    return result


# --- building blocks ---------------------------------------------------------------


def test_node_load_is_the_higher_of_own_and_reported() -> None:
    assert node_load(node("a", own_sessions=3, reported_busy=1)) == 3
    assert node_load(node("a", own_sessions=1, reported_busy=2)) == 2


def test_has_free_lane() -> None:
    assert has_free_lane(node("a"), now=0.0)
    assert not has_free_lane(node("a", reported_busy=4), now=0.0)
    assert not has_free_lane(node("a", own_sessions=4), now=0.0)
    assert not has_free_lane(node("a", idle_conns=0), now=0.0)
    assert not has_free_lane(node("a", full_until=10.0), now=9.9)
    assert has_free_lane(node("a", full_until=10.0), now=10.0)


def test_estimate_formula() -> None:
    n = node("a", reported_busy=2, lanes=4)
    r = req(prompt_tokens=1000, max_tokens=100)
    # 1000/500 prefill + 100 tokens at 20/s slowed by 1 + 2/4
    assert estimate_seconds(n, r, 500.0, 20.0) == pytest.approx(2.0 + 7.5)
    assert estimate_seconds(node("a"), r, 500.0, 20.0) == pytest.approx(2.0 + 5.0)


def test_estimate_drops_unmeasured_terms() -> None:
    r = req(prompt_tokens=1000, max_tokens=100)
    assert estimate_seconds(node("a"), r, 0.0, 20.0) == pytest.approx(5.0)
    assert estimate_seconds(node("a"), r, 500.0, 0.0) == pytest.approx(2.0)
    assert estimate_seconds(node("a"), r, 0.0, 0.0) == 0.0


@pytest.mark.parametrize(("tokens", "cached", "tps", "a", "b", "seconds"), [
    (1000, 0, 500.0, 0.0, 0.0, 2.0),  # not fitted: at the measured rate
    (1000, 0, 0.0, 0.0, 0.0, 0.0),  # nothing measured: left out
    (1000, 0, 500.0, 1e-3, 0.0, 1.0),  # a fitted cost wins over the rate
    (1000, 0, 0.0, 1e-3, 1e-6, 1.0 + 1e-6 * 1000 * 500),  # each token after half the rest
    (8000, 0, 0.0, 1e-3, 1e-6, 8.0 + 1e-6 * 8000 * 4000),  # 8x the tokens, 20x the time
    (200, 4000, 0.0, 1e-3, 1e-6, 0.2 + 1e-6 * 200 * 4100),  # after 4000 held tokens
    (200, 4000, 500.0, 0.0, 0.0, 0.4),  # a rate does not know the context
    (-5, 0, 500.0, 1e-3, 1e-6, 0.0),
])
def test_prefill_is_priced_by_length(tokens: int, cached: int, tps: float, a: float, b: float,
                                     seconds: float) -> None:
    got = prefill_seconds(tokens, cached, tps=tps, s_per_token=a, s_per_token_ctx=b)
    assert got == pytest.approx(seconds)


def test_estimate_uses_the_nodes_fitted_prefill_cost() -> None:
    fitted = node("a", prefill_s_per_token=1e-3, prefill_s_per_token_ctx=1e-6)
    r = req(prompt_tokens=1000, max_tokens=100)
    assert estimate_seconds(fitted, r, 500.0, 20.0) == pytest.approx(1.5 + 5.0)
    # holding the first 800 tokens, it prefills 200 after them
    assert estimate_seconds(fitted, r, 500.0, 20.0, cached=800) == pytest.approx(
        0.2 + 1e-6 * 200 * 900 + 5.0)


def test_a_long_prompt_goes_where_its_length_costs_least() -> None:
    # "steep" reads short prompts twice as fast, but its cost grows with the context
    flat = node("flat", prefill_tps=500.0, prefill_s_per_token=2e-3, decode_tps=0.0)
    steep = node("steep", prefill_tps=1000.0, prefill_s_per_token=1e-3,
                 prefill_s_per_token_ctx=1e-6, decode_tps=0.0)
    p = placed(place(req(prompt_tokens=1000), [flat, steep], now=0.0))
    assert (p.node, p.reason) == ("steep", "load-aware est 1.5s")
    p = placed(place(req(prompt_tokens=8000), [flat, steep], now=0.0))
    assert (p.node, p.reason) == ("flat", "load-aware est 16.0s")


# --- load-aware --------------------------------------------------------------------


def test_load_aware_picks_lowest_estimate() -> None:
    nodes = [node("a", decode_tps=10.0), node("b", decode_tps=40.0), node("c", decode_tps=20.0)]
    p = placed(place(req(), nodes, now=0.0))
    assert p.node == "b"
    assert p.reason == "load-aware est 3.5s"  # 1000/1000 + 100/40
    assert p.cursor == 0


def test_load_aware_counts_load_against_a_fast_node() -> None:
    # b is faster per lane but 3 of its 4 lanes are busy (from another head): 100*1.75/30
    nodes = [node("a", decode_tps=20.0), node("b", decode_tps=30.0, reported_busy=3)]
    assert placed(place(req(), nodes, now=0.0)).node == "a"


def test_load_aware_skips_nodes_at_pool_high() -> None:
    nodes = [node("fast", decode_tps=80.0, kv_used=900), node("slow", decode_tps=10.0)]
    assert placed(place(req(), nodes, now=0.0)).node == "slow"  # 90% is at the mark
    below = [replace(nodes[0], kv_used=899), nodes[1]]
    assert placed(place(req(), below, now=0.0)).node == "fast"
    assert placed(place(req(), nodes, now=0.0, pool_high=95.0)).node == "fast"


def test_load_aware_keeps_pool_high_nodes_when_all_are_high() -> None:
    nodes = [node("a", decode_tps=10.0, kv_used=950), node("b", decode_tps=30.0, kv_used=990)]
    assert placed(place(req(), nodes, now=0.0)).node == "b"


def test_load_aware_ignores_kv_of_a_node_without_report() -> None:
    nodes = [node("a", decode_tps=10.0), node("b", decode_tps=30.0, kv_used=0, kv_total=0)]
    assert placed(place(req(), nodes, now=0.0)).node == "b"


def test_unmeasured_node_counts_at_the_mean_of_measured() -> None:
    nodes = [
        node("fast", prefill_tps=3000.0, decode_tps=30.0),
        node("new", prefill_tps=0.0, decode_tps=0.0),
        node("slow", prefill_tps=1000.0, decode_tps=10.0),
    ]
    assert placed(place(req(), nodes, now=0.0)).node == "fast"
    # without fast, the mean (2000 prompt tok/s, 20 tok/s) still beats slow
    p = placed(place(req(exclude=frozenset({"fast"})), nodes, now=0.0))
    assert p.node == "new"
    assert p.reason == "load-aware est 5.5s"  # 1000/2000 + 100/20


def test_with_nothing_measured_nodes_tie_then_lower_load_then_key() -> None:
    bare = {"prefill_tps": 0.0, "decode_tps": 0.0}
    nodes = [
        node("c", **bare),
        node("b", own_sessions=1, **bare),
        node("a", reported_busy=2, **bare),
    ]
    p = placed(place(req(), nodes, now=0.0))
    assert (p.node, p.reason) == ("c", "load-aware est 0.0s")
    nodes = [node("c", **bare), node("b", **bare)]
    assert placed(place(req(), nodes, now=0.0)).node == "b"


# --- least-loaded and round-robin ----------------------------------------------------


def test_least_loaded_picks_fewest_sessions_whatever_the_speed() -> None:
    nodes = [
        node("a", decode_tps=100.0, own_sessions=2),
        node("b", decode_tps=5.0, reported_busy=1),
        node("c", decode_tps=100.0, own_sessions=1, reported_busy=3),
    ]
    p = placed(place(req(), nodes, now=0.0, policy="least-loaded"))
    assert (p.node, p.reason) == ("b", "least-loaded load 1/4")


def test_least_loaded_ties_by_key() -> None:
    nodes = [node("b"), node("a"), node("c")]
    assert placed(place(req(), nodes, now=0.0, policy="least-loaded")).node == "a"


def test_least_loaded_does_not_skip_pool_high() -> None:
    nodes = [node("a", kv_used=990), node("b", own_sessions=1)]
    assert placed(place(req(), nodes, now=0.0, policy="least-loaded")).node == "a"


def test_round_robin_rotates_in_key_order() -> None:
    nodes = [node("c"), node("a"), node("b")]
    cursor, seen = 0, []
    for _ in range(6):
        p = placed(place(req(), nodes, now=0.0, policy="round-robin", cursor=cursor))
        assert p.reason == "round-robin"
        seen.append(p.node)
        cursor = p.cursor
    assert seen == ["a", "b", "c", "a", "b", "c"]


def test_round_robin_skips_busy_nodes_and_returns_cursor_past_the_pick() -> None:
    nodes = [node("a"), node("b", reported_busy=4), node("c")]
    p = placed(place(req(), nodes, now=0.0, policy="round-robin", cursor=1))
    assert (p.node, p.cursor) == ("c", 0)
    p = placed(place(req(), nodes, now=0.0, policy="round-robin", cursor=7))  # wraps
    assert (p.node, p.cursor) == ("c", 0)


def test_round_robin_ignores_speed() -> None:
    nodes = [node("a", decode_tps=1.0), node("b", decode_tps=100.0)]
    assert placed(place(req(), nodes, now=0.0, policy="round-robin")).node == "a"


# --- affinity ----------------------------------------------------------------------


def _affinity_nodes(ratio: float) -> list[NodeView]:
    # nothing to prefill: estimates are 100/decode, so "held" is `ratio` x the best
    bare = {"prefill_tps": 1000.0}
    return [node("best", decode_tps=20.0, **bare), node("held", decode_tps=20.0 / ratio, **bare)]


@pytest.mark.parametrize("policy", POLICIES)
def test_affinity_within_slack_keeps_the_session(policy: Policy) -> None:
    r = req(prompt_tokens=0, affinity="held")
    p = placed(place(r, _affinity_nodes(1.2), now=0.0, policy=policy, cursor=5))
    assert (p.node, p.reason, p.cursor) == ("held", "affinity", 5)
    p = placed(place(r, _affinity_nodes(1.25), now=0.0, policy=policy))
    assert p.node == "held"


@pytest.mark.parametrize("policy", POLICIES)
def test_affinity_beyond_slack_moves_the_session(policy: Policy) -> None:
    r = req(prompt_tokens=0, affinity="held")
    p = placed(place(r, _affinity_nodes(1.3), now=0.0, policy=policy, cursor=0))
    assert p.node == "best"
    assert p.reason != "affinity"


def test_affinity_slack_is_a_parameter() -> None:
    r = req(prompt_tokens=0, affinity="held")
    nodes = _affinity_nodes(1.3)
    assert placed(place(r, nodes, now=0.0, affinity_slack=1.5)).node == "held"
    assert placed(place(r, _affinity_nodes(1.1), now=0.0, affinity_slack=1.0)).node == "best"


def test_affinity_node_without_a_free_lane_or_excluded_is_not_used() -> None:
    nodes = [node("a"), node("held", reported_busy=4)]
    assert placed(place(req(affinity="held"), nodes, now=0.0)).node == "a"
    nodes = [node("a"), node("held")]
    r = req(affinity="held", exclude=frozenset({"held"}))
    assert placed(place(r, nodes, now=0.0)).node == "a"
    r = req(affinity="gone")
    assert placed(place(r, nodes, now=0.0)).node == "a"


def test_affinity_node_above_pool_high_is_still_kept() -> None:
    # its KV already holds this conversation's prompt
    nodes = [node("a"), node("held", kv_used=950)]
    assert placed(place(req(affinity="held"), nodes, now=0.0)).node == "held"


def test_affinity_with_nothing_measured_keeps_the_session() -> None:
    bare = {"prefill_tps": 0.0, "decode_tps": 0.0}
    nodes = [node("a", **bare), node("held", own_sessions=2, **bare)]
    assert placed(place(req(affinity="held"), nodes, now=0.0)).node == "held"


# --- full_until, exclude, pin, prefer --------------------------------------------------


def test_full_until_skips_a_node_until_then() -> None:
    nodes = [node("a", decode_tps=80.0, full_until=100.0), node("b")]
    assert placed(place(req(), nodes, now=50.0)).node == "b"
    assert placed(place(req(), nodes, now=100.0)).node == "a"


def test_no_idle_connection_skips_a_node() -> None:
    nodes = [node("a", decode_tps=80.0, idle_conns=0), node("b")]
    assert placed(place(req(), nodes, now=0.0)).node == "b"


def test_exclude_skips_nodes_that_failed_this_session() -> None:
    nodes = [node("a", decode_tps=80.0), node("b")]
    assert placed(place(req(exclude=frozenset({"a"})), nodes, now=0.0)).node == "b"


def test_pin_host_filters_by_identity() -> None:
    nodes = [
        node("10.0.0.1:8454", identity="box-a", decode_tps=80.0),
        node("joined:box-b", identity="box-b"),
    ]
    p = placed(place(req(pin_host="box-b"), nodes, now=0.0))
    assert p.node == "joined:box-b"


def test_pin_host_to_a_busy_node_waits_rather_than_routing_elsewhere() -> None:
    nodes = [node("a", identity="box-a", reported_busy=4), node("b", identity="box-b")]
    assert refused(place(req(pin_host="box-a"), nodes, now=0.0)).code == "no_free_lane"


def test_pin_host_to_an_unknown_name_can_never_be_placed() -> None:
    nodes = [node("a", identity="box-a"), node("b", identity="box-b")]
    r = refused(place(req(pin_host="box-z"), nodes, now=0.0))
    assert r.code == "unknown_node"
    assert "'box-z'" in r.message
    assert "2 nodes" in r.message
    assert "box-a, box-b" in r.message


def test_pin_host_to_a_node_that_is_down_is_refused_not_queued() -> None:
    nodes = [node("a", identity="box-a", ready=False), node("b", identity="box-b")]
    r = refused(place(req(pin_host="box-a"), nodes, now=0.0))
    assert r.code == "node_down"
    assert "'box-a'" in r.message


def test_nodes_that_are_not_linked_are_no_candidates() -> None:
    nodes = [node("a", identity="box-a", ready=False), node("b", identity="box-b")]
    assert placed(place(req(), nodes, now=0.0)).node == "b"
    r = refused(place(req(), [node("a", identity="box-a", ready=False)], now=0.0))
    assert r.code == "no_node"
    assert "1 unreachable or gone" in r.message


def test_prefer_first_free_named_node_wins_over_speed_and_affinity() -> None:
    nodes = [node("a", identity="box-a", decode_tps=80.0), node("b", identity="box-b")]
    p = placed(place(req(prefer=("box-b",), affinity="a"), nodes, now=0.0, cursor=3))
    assert (p.node, p.reason, p.cursor) == ("b", "prefer", 3)


def test_prefer_walks_the_list_in_order() -> None:
    nodes = [
        node("a", identity="box-a"),
        node("b", identity="box-b", reported_busy=4),
        node("c", identity="box-c"),
    ]
    r = req(prefer=("unknown", "box-b", "box-c", "box-a"))
    assert placed(place(r, nodes, now=0.0)).node == "c"


def test_prefer_with_none_free_routes_normally() -> None:
    nodes = [
        node("a", identity="box-a", decode_tps=10.0),
        node("b", identity="box-b", reported_busy=4),
        node("c", identity="box-c", decode_tps=30.0),
        node("d", identity="box-d", context_window=512),
    ]
    p = placed(place(req(prefer=("box-b", "box-d", "nowhere")), nodes, now=0.0))
    assert p.node == "c"
    assert p.reason.startswith("load-aware")


# --- refusals -------------------------------------------------------------------------


def test_no_node_when_the_fleet_is_empty() -> None:
    r = refused(place(req(), [], now=0.0))
    assert r.code == "no_node"
    assert "'m'" in r.message and "0 nodes" in r.message


def test_no_node_when_nobody_serves_the_model() -> None:
    r = refused(place(req(model="qwen"), [node("a", model="llama")], now=0.0))
    assert r.code == "no_node"
    assert "'qwen'" in r.message and "1 node serve: llama" in r.message
    assert "--model-name qwen" in r.message


def test_no_node_when_every_server_already_failed() -> None:
    nodes = [node("a"), node("b")]
    r = refused(place(req(exclude=frozenset({"a", "b"})), nodes, now=0.0))
    assert r.code == "no_node"
    assert "all 2 nodes" in r.message


def test_context_length_exceeded_names_prompt_and_largest_window() -> None:
    nodes = [node("a", context_window=4096), node("b", context_window=8192)]
    r = refused(place(req(prompt_tokens=9000), nodes, now=0.0))
    assert r == NoPlacement(
        "context_length_exceeded",
        "prompt of 9000 tokens exceeds every node's context window (largest 8192); "
        "shorten the conversation, or serve a model with a longer window",
    )


def test_context_needs_room_for_one_token() -> None:
    nodes = [node("a", context_window=8192)]
    r = refused(place(req(prompt_tokens=8192), nodes, now=0.0))
    assert r.code == "context_length_exceeded"
    assert "8192 tokens" in r.message and "largest 8192" in r.message
    assert placed(place(req(prompt_tokens=8191), nodes, now=0.0)).node == "a"


def test_context_check_comes_before_the_lane_check() -> None:
    nodes = [node("a", context_window=4096, reported_busy=4)]
    assert refused(place(req(prompt_tokens=5000), nodes, now=0.0)).code == "context_length_exceeded"


def test_small_nodes_are_skipped_for_a_long_prompt() -> None:
    nodes = [node("a", context_window=2048, decode_tps=80.0), node("b", context_window=32768)]
    assert placed(place(req(prompt_tokens=4000), nodes, now=0.0)).node == "b"


def test_no_free_lane_names_the_lanes() -> None:
    nodes = [
        node("a", reported_busy=4),
        node("b", own_sessions=4),
        node("c", full_until=10.0),
        node("d", idle_conns=0, own_sessions=1),
        node("e", context_window=100),  # cannot hold the prompt: not counted
    ]
    r = refused(place(req(), nodes, now=5.0))
    assert r.code == "no_free_lane"
    assert "4 nodes" in r.message
    assert "9/16 lanes busy" in r.message
    assert "1 refused a session as full" in r.message
    assert "1 with no idle connection" in r.message


# --- the KV pool the lanes share ----------------------------------------------------


@pytest.mark.parametrize(("max_prompt", "prompt", "takes"), [
    (0, 8000, True),  # not said: the window alone decides
    (1001, 1000, True),  # the prompt and one token
    (1000, 1000, False),
    (500, 1000, False),
])
def test_takes_prompt(max_prompt: int, prompt: int, takes: bool) -> None:
    assert takes_prompt(node("a", max_prompt=max_prompt), prompt) is takes


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pool_that_cannot_take_the_prompt_now_counts_as_busy(policy: Policy) -> None:
    # "a" is the fastest and first in key order, but its pool has room for 500 tokens now
    nodes = [node("a", decode_tps=80.0, max_prompt=500), node("b")]
    assert placed(place(req(prompt_tokens=1000), nodes, now=0.0, policy=policy)).node == "b"
    # a shorter prompt fits there
    assert placed(place(req(prompt_tokens=400), nodes, now=0.0, policy=policy)).node == "a"


def test_full_pools_queue_the_request_rather_than_refuse_it() -> None:
    nodes = [node("a", max_prompt=300), node("b", max_prompt=999), node("c", reported_busy=4)]
    r = refused(place(req(prompt_tokens=1000), nodes, now=0.0))
    assert r.code == "no_free_lane"
    assert "3 nodes" in r.message and "4/12 lanes busy" in r.message
    assert "2 cannot hold the prompt now (KV pool full)" in r.message
    assert "raise --max-batch" in r.message  # c's lanes are busy
    r = refused(place(req(prompt_tokens=1000), nodes[:2], now=0.0))
    assert "2 cannot hold the prompt now (KV pool full)" in r.message
    assert r.message.endswith("; wait and retry or add a node")  # more lanes would not help


def test_context_length_exceeded_only_when_no_window_holds_the_prompt() -> None:
    # a full pool holds the prompt later; a window too small never does
    nodes = [node("a", context_window=4096), node("b", context_window=16384, max_prompt=100)]
    assert refused(place(req(prompt_tokens=9000), nodes, now=0.0)).code == "no_free_lane"
    r = refused(place(req(prompt_tokens=20_000), nodes, now=0.0))
    assert r.code == "context_length_exceeded"
    assert "largest 16384" in r.message and "--max-context" not in r.message


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("sleep", ["asleep", "waking"])
def test_an_awake_node_that_can_serve_goes_before_an_asleep_one(policy: Policy,
                                                                 sleep: str) -> None:
    # the asleep node is faster, idler and first in key order: awake wins all the same
    nodes = [node("a", decode_tps=80.0, sleep=sleep), node("b", decode_tps=10.0,
                                                            own_sessions=2)]
    for cursor in range(4):
        p = placed(place(req(), nodes, now=0.0, policy=policy, cursor=cursor))
        assert p.node == "b", (cursor, p)
    # an asleep node is a candidate: the request wakes it, and the log says so
    p = placed(place(req(), nodes[:1], now=0.0, policy=policy))
    assert p.node == "a" and p.reason.endswith(f", {sleep} (the request wakes it)")
    # and with every awake node busy, it takes the request rather than queue it
    busy = [nodes[0], replace(nodes[1], own_sessions=4)]
    assert placed(place(req(), busy, now=0.0, policy=policy)).node == "a"


def test_among_nodes_that_must_load_the_model_the_load_time_is_priced() -> None:
    # both keep the model unloaded; "slow-load" decodes faster, but its load takes 6 s
    # more than the other's, more than the answer's whole decode there
    nodes = [node("slow-load", decode_tps=40.0, sleep="asleep", load_s=8.0),
             node("quick-load", decode_tps=20.0, sleep="asleep", load_s=2.0)]
    p = placed(place(req(), nodes, now=0.0))
    assert p.node == "quick-load"
    assert p.reason == "load-aware est 8.0s, asleep (the request wakes it)"
    loaded = replace(nodes[0], load_s=0.0)  # priced without it, the faster one wins
    assert placed(place(req(), [loaded, nodes[1]], now=0.0)).node == "slow-load"
    assert estimate_seconds(nodes[0], req(), 1000.0, 40.0) == pytest.approx(8.0 + 1 + 2.5)


def test_a_kept_models_load_is_its_last_load_else_its_size_at_a_typical_rate() -> None:
    from engine.head.fleet.links import UNMEASURED_LOAD_BYTES_PER_S, kept_load_seconds
    from engine.link.messages import KeptModel

    assert kept_load_seconds(KeptModel("g", "unloaded", size=500_000_000, load_ms=730)) \
        == pytest.approx(0.73)
    assert kept_load_seconds(KeptModel("g", "unloaded", size=500_000_000)) == pytest.approx(
        500_000_000 / UNMEASURED_LOAD_BYTES_PER_S)
    assert kept_load_seconds(KeptModel("g", "loaded", size=500_000_000, load_ms=730)) == 0.0


def test_round_robin_rotates_over_the_awake_nodes_while_one_is_free() -> None:
    nodes = [node("a", sleep="asleep"), node("b"), node("c"), node("d", sleep="waking")]
    cursor, seen = 0, []
    for _ in range(4):
        p = placed(place(req(), nodes, now=0.0, policy="round-robin", cursor=cursor))
        seen.append(p.node)
        cursor = p.cursor
    assert seen == ["b", "c", "b", "c"]
    nodes = [nodes[0], replace(nodes[1], reported_busy=4), replace(nodes[2], idle_conns=0),
             nodes[3]]
    p = placed(place(req(), nodes, now=0.0, policy="round-robin", cursor=2))
    assert (p.node, p.cursor) == ("d", 0)


def test_affinity_to_an_asleep_node_gives_way_to_an_awake_one() -> None:
    nodes = [node("a"), node("held", sleep="asleep")]
    turn = req(affinity="held", affinity_cached=900)
    assert placed(place(turn, nodes, now=0.0)).node == "a"
    p = placed(place(turn, [nodes[1]], now=0.0))
    assert (p.node, p.reason) == ("held", "affinity, asleep (the request wakes it)")


def test_a_preferred_node_wins_asleep_or_not() -> None:
    nodes = [node("a", identity="box-a"), node("b", identity="box-b", sleep="asleep")]
    p = placed(place(req(prefer=("box-b",)), nodes, now=0.0))
    assert (p.node, p.reason) == ("b", "prefer, asleep (the request wakes it)")


def test_parked_prefixes_do_not_count_against_pool_high() -> None:
    # 95% of the cells are in use, 60% of them by parked prefixes a session may reclaim
    parked = node("parked", decode_tps=80.0, kv_used=950, kv_parked=600)
    assert kv_percent(parked) == pytest.approx(35.0)
    assert kv_percent(node("odd", kv_used=10, kv_parked=50)) == 0.0
    nodes = [parked, node("slow", decode_tps=10.0)]
    assert placed(place(req(), nodes, now=0.0)).node == "parked"
    nodes = [replace(parked, kv_parked=0), nodes[1]]
    assert placed(place(req(), nodes, now=0.0)).node == "slow"


# --- properties -----------------------------------------------------------------------

_nodes = st.builds(
    NodeView,
    key=st.just(""),
    identity=st.sampled_from(["box-a", "box-b", "box-c"]),
    model=st.sampled_from(["m", "m", "other"]),
    context_window=st.sampled_from([0, 512, 4096, 8192, 32768]),
    lanes=st.sampled_from([0, 1, 4, 8]),
    idle_conns=st.sampled_from([0, 1, 4, 8]),
    own_sessions=st.integers(0, 4),
    reported_busy=st.integers(0, 4),
    kv_used=st.integers(0, 1000),
    kv_total=st.integers(0, 1000),
    prefill_tps=st.sampled_from([0.0, 100.0, 1000.0, 5000.0]),
    decode_tps=st.sampled_from([0.0, 5.0, 20.0, 60.0]),
    full_until=st.sampled_from([0.0, 0.0, 5.0, 20.0]),
    max_prompt=st.sampled_from([0, 0, 100, 2000, 9000]),
    sleep=st.sampled_from(["", "", "asleep", "waking"]),
    prefill_s_per_token=st.sampled_from([0.0, 1e-3]),
    prefill_s_per_token_ctx=st.sampled_from([0.0, 1e-6]),
)


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeView]:
    drawn = draw(st.lists(_nodes, max_size=6))
    return [replace(n, key=f"n{i}") for i, n in enumerate(drawn)]


@st.composite
def requests(draw: st.DrawFn) -> PlacementRequest:
    keys = st.sampled_from([f"n{i}" for i in range(7)])
    names = st.sampled_from(["box-a", "box-b", "box-c", "box-z"])
    return PlacementRequest(
        model="m",
        prompt_tokens=draw(st.integers(0, 9000)),
        max_tokens=draw(st.integers(0, 2000)),
        exclude=draw(st.frozensets(keys, max_size=2)),
        affinity=draw(st.none() | keys),
        pin_host=draw(st.sampled_from([None, None, None, "box-a", "box-z"])),
        prefer=tuple(draw(st.lists(names, max_size=3))),
    )


@settings(max_examples=600, deadline=None)
@given(
    nodes=fleets(),
    r=requests(),
    now=st.sampled_from([0.0, 10.0, 30.0]),
    policy=st.sampled_from(POLICIES),
    cursor=st.integers(-3, 10),
)
def test_place_only_returns_a_free_node_that_holds_the_prompt(
    nodes: list[NodeView], r: PlacementRequest, now: float, policy: Policy, cursor: int
) -> None:
    result = place(r, nodes, now=now, policy=policy, cursor=cursor)
    fits = [
        n
        for n in nodes
        if n.model == r.model
        and n.key not in r.exclude
        and (r.pin_host is None or n.identity == r.pin_host)
        and n.context_window >= r.prompt_tokens + 1
        and has_free_lane(n, now)
        and (n.max_prompt == 0 or n.max_prompt >= r.prompt_tokens + 1)
    ]
    if isinstance(result, Placement):
        assert result.node in {n.key for n in fits}
        pick = next(n for n in fits if n.key == result.node)
        if pick.sleep and not result.reason.startswith("prefer"):
            # an asleep node only when no awake one can serve, or (load-aware) every awake
            # one is at or above pool_high: waking an idle node beats a nearly full pool
            awake = [n for n in fits if n.sleep == ""]
            if policy == "load-aware":
                awake = [n for n in awake if kv_percent(n) < 90.0]
            assert not awake, (result, fits)
    else:
        assert not fits
        assert result.message


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 8), sessions=st.integers(0, 60), start=st.integers(0, 20))
def test_round_robin_spreads_sessions_evenly(k: int, sessions: int, start: int) -> None:
    nodes = [node(f"n{i}", lanes=100, idle_conns=100) for i in range(k)]
    counts: Counter[str] = Counter()
    cursor = start
    for _ in range(sessions):
        p = placed(place(req(), nodes, now=0.0, policy="round-robin", cursor=cursor))
        counts[p.node] += 1
        cursor = p.cursor
    per_node = [counts[n.key] for n in nodes]
    assert max(per_node) - min(per_node) <= 1
    assert sum(per_node) == sessions


def test_the_node_holding_the_prefix_is_priced_with_the_new_tokens_only() -> None:
    # a slow node holds the conversation's first 4000 tokens; a fast one holds nothing
    slow = node("slow", prefill_tps=100.0, decode_tps=10.0)
    fast = node("fast", prefill_tps=1000.0, decode_tps=30.0)
    turn = req(prompt_tokens=4200, max_tokens=50, affinity="slow")
    # priced with the whole prompt, the slow node is 40 s behind: affinity gives way
    assert placed(place(turn, [slow, fast], now=0.0)).node == "fast"
    # priced with the 200 new tokens it has to read, it is the quickest
    p = placed(place(replace(turn, affinity_cached=4000), [slow, fast], now=0.0))
    assert p.node == "slow" and p.reason == "affinity"
    # a claim beyond the prompt counts as the prompt less one token
    p = placed(place(replace(turn, affinity_cached=10**9), [slow, fast], now=0.0))
    assert p.node == "slow"


def test_the_node_holding_the_prefix_is_priced_by_its_fitted_cost_after_it() -> None:
    # each of the 200 new tokens attends to the 20 000 held before it: 0.2 + 4.02 s
    held = node("held", prefill_tps=1000.0, prefill_s_per_token=1e-3,
                prefill_s_per_token_ctx=1e-6, decode_tps=0.0, context_window=32768)
    # the whole prompt in 2.0 s
    fast = node("fast", prefill_tps=10_100.0, decode_tps=0.0, context_window=32768)
    turn = req(prompt_tokens=20_200, affinity="held", affinity_cached=20_000)
    p = placed(place(turn, [held, fast], now=0.0))  # 4.22 s is beyond 1.25 x 2.0 s
    assert (p.node, p.reason) == ("fast", "load-aware est 2.0s")
    p = placed(place(turn, [held, fast], now=0.0, affinity_slack=2.2))
    assert (p.node, p.reason) == ("held", "affinity")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_paused_node_is_passed_over_and_its_lanes_are_not_counted(policy: Policy) -> None:
    nodes = [node("a", paused=True), node("b", reported_busy=3)]  # a: idle but paused
    assert placed(place(req(), nodes, now=0.0, policy=policy)).node == "b"
    full = refused(place(req(), [nodes[0], node("b", reported_busy=4)], now=0.0))
    assert full.code == "no_free_lane" and "4/4 lanes busy" in full.message  # b's only


def test_a_fleet_of_paused_nodes_refuses_at_once_with_why() -> None:
    got = refused(place(req(), [node("b", paused=True), node("a", paused=True)], now=0.0))
    assert got.code == "paused"
    assert got.message == ("every node serving 'm' is paused (a, b); resume serving on one "
                           "(Resume serving in its tray menu) or add a node")
    pinned = refused(place(req(pin_host="a"), [node("a", paused=True), node("b")], now=0.0))
    assert pinned.code == "paused" and "(a)" in pinned.message


def test_a_resting_node_is_passed_over_and_a_fleet_of_them_says_why() -> None:
    bad = node("a", resting_until=10.0, failing="node error internal: damaged")
    assert placed(place(req(), [bad, node("b", reported_busy=3)], now=5.0)).node == "b"
    assert placed(place(req(), [bad], now=10.0)).node == "a"  # rested: tried again
    got = refused(place(req(), [bad], now=5.0))
    assert got.code == "failing"
    assert got.message == ("every node serving 'm' failed its last sessions before a token "
                           "(a: node error internal: damaged); fix the node, or retry later")

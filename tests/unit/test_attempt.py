"""The attempt machine (engine.head.fleet.attempt): failover, renewal and stall decisions as a
pure function of (state, event, now), driven by tables. No sockets, no clock."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from engine.head.fleet import attempt as at

L = at.AttemptLimits(lease_s=10.0, stall_s=3.0, ping_s=1.0, prefill_floor_tps=50.0)


def fresh(now: float = 0.0, *, prompt: int = 100, prefill_tps: float = 1000.0,
          wall: float = 600.0) -> at.AttemptState:
    return at.start(now, prompt_tokens=prompt, prefill_tps=prefill_tps, wall_deadline=wall,
                    limits=L)


def run(state: at.AttemptState, *steps: tuple[float, at.Event]
        ) -> tuple[at.AttemptState, list[tuple[float, at.Action]]]:
    out: list[tuple[float, at.Action]] = []
    for now, event in steps:
        state, actions = at.step(state, event, now, L)
        out.extend((now, a) for a in actions)
    return state, out


def kinds(actions: list[tuple[float, at.Action]]) -> list[str]:
    return [type(a).__name__ for _, a in actions]


def final(actions: list[tuple[float, at.Action]]) -> at.Action:
    assert actions, "no action"
    return actions[-1][1]


@pytest.mark.parametrize(("events", "expected"), [
    # the ordinary life: accepted, tokens in order, done
    ([(0.1, at.GotAccepted()), (0.2, at.GotTokens(0, 3)), (0.3, at.GotTokens(3, 2)),
      (0.4, at.GotDone())], ["Deliver", "Deliver", "NodeDone"]),
    # a repeat or a gap in the indices fails the attempt over and drops the connection
    ([(0.1, at.GotAccepted()), (0.2, at.GotTokens(0, 3)), (0.3, at.GotTokens(2, 1))],
     ["Deliver", "Failover"]),
    ([(0.1, at.GotAccepted()), (0.2, at.GotTokens(0, 3)), (0.3, at.GotTokens(4, 1))],
     ["Deliver", "Failover"]),
    # busy before any token: the next node at once; after a token it is a failure
    ([(0.1, at.GotError("busy", "all 1 lanes are busy"))], ["Busy"]),
    ([(0.1, at.GotAccepted()), (0.2, at.GotTokens(0, 1)), (0.3, at.GotError("busy", "x"))],
     ["Deliver", "Failover"]),
    # the node refuses the request itself: final, no other node would take it
    ([(0.1, at.GotError("bad_request", "the prompt is empty"))], ["RequestRefused"]),
    ([(0.1, at.GotError("context_length_exceeded", "too long"))], ["RequestRefused"]),
    # the node's runtime failed: fail over, keeping the connection (the node said so)
    ([(0.1, at.GotAccepted()), (0.2, at.GotError("internal", "decode thread died"))],
     ["Failover"]),
    ([(0.1, at.GotAccepted()), (0.5, at.Lost("reset"))], ["Failover"]),
])
def test_records(events: list[tuple[float, at.Event]], expected: list[str]) -> None:
    state, actions = run(fresh(), *events)
    assert kinds(actions) == expected
    assert state.final is (expected[-1] not in ("Deliver",))


def test_failover_kinds_say_what_to_drop() -> None:
    _, out = run(fresh(), (0.1, at.GotAccepted()), (0.2, at.GotTokens(1, 1)))
    assert final(out) == at.Failover("token index 1 where 0 was due", hung=False, drop=True)
    _, out = run(fresh(), (0.1, at.GotAccepted()), (0.2, at.Lost("reset")))
    f = final(out)
    assert isinstance(f, at.Failover) and not f.drop and not f.hung
    _, out = run(fresh(), (0.1, at.GotError("internal", "boom")))
    f = final(out)
    assert isinstance(f, at.Failover) and "internal" in f.reason and not f.drop


def test_renewals_every_third_of_a_lease_once_accepted_whatever_the_client_reads() -> None:
    state, _out = run(fresh(), (0.5, at.GotAccepted()))
    assert state.renew_at == pytest.approx(0.5 + 10 / 3)
    # tokens keep the node heard; renewals come on time, driven by the deadline alone
    times = []
    now = 0.5
    for i in range(30):
        now += 0.5
        state, actions = at.step(state, at.GotTokens(i, 1), now, L)
        times += [now for a in actions if isinstance(a, at.SendRenew)]
    assert times == pytest.approx([4.0, 7.5, 11.0, 14.5])
    assert not state.final


def test_no_renewal_before_accepted() -> None:
    state = fresh()
    assert state.renew_at == math.inf
    state, out = run(state, (0.9, at.Tick(heard_at=0.9)))
    assert "SendRenew" not in kinds(out)


def test_silence_pings_once_a_second_then_the_node_is_hung() -> None:
    _state, out = run(fresh(), (0.1, at.GotAccepted()), (1.1, at.Tick(heard_at=0.1)),
                     (1.5, at.Tick(heard_at=0.1)), (2.1, at.Tick(heard_at=0.1)),
                     (3.1, at.Tick(heard_at=0.1)))
    assert kinds(out) == ["SendPing", "SendPing", "Failover"]
    f = final(out)
    assert isinstance(f, at.Failover) and f.hung
    assert "3.0 s" in f.reason


def test_a_pong_or_stats_keeps_a_slow_prefill_alive() -> None:
    # the node answers pings (heard_at moves) while it prefills a long prompt
    state = fresh(prompt=20_000, prefill_tps=400.0)
    state, _out = run(state, (0.1, at.GotAccepted()))
    for t in range(2, 55):
        state, actions = at.step(state, at.Tick(heard_at=t - 0.5), float(t), L)
        assert not state.final, (t, actions)
    # the first token is due by accepted + lease + 20000/400 = 60.1 s
    assert state.progress_by == pytest.approx(60.1)
    state, out2 = run(state, (60.2, at.Tick(heard_at=60.0)))
    f = final(out2)
    assert isinstance(f, at.Failover) and not f.hung and f.drop
    assert "no first token" in f.reason


def drive(state: at.AttemptState, records: list[tuple[float, at.Event]], *, end: float,
          pong_s: float = 0.01) -> tuple[at.AttemptState, list[tuple[float, at.Action]]]:
    """Run the machine as the session's IO does: each record at its time, and a Tick at
    every deadline in between; the node answers each ping ``pong_s`` later (a pong moves
    only the connection's last record, which the next Tick carries)."""
    out: list[tuple[float, at.Action]] = []
    pending = sorted(records, key=lambda r: r[0])
    pongs: list[float] = []
    heard = state.heard_at
    ticked = -math.inf
    while not state.final:
        # a timer that rang a hair early (float rounding) rings again a moment later
        due = max(at.next_deadline(state, L), ticked + 1e-6)
        record_at = pending[0][0] if pending else math.inf
        pong_at = min(pongs, default=math.inf)
        now = min(due, record_at, pong_at)
        if now > end:
            break
        event: at.Event
        if now == record_at:
            event = pending.pop(0)[1]
            heard = now
        elif now == pong_at:
            pongs.remove(now)
            heard = now
            continue
        else:
            event = at.Tick(heard_at=heard)
            ticked = now
        state, actions = at.step(state, event, now, L)
        out.extend((now, a) for a in actions)
        pongs.extend(now + pong_s for a in actions if isinstance(a, at.SendPing))
    return state, out


def every(start: float, stop: float, event: at.Event, step: float = 1.0
          ) -> list[tuple[float, at.Event]]:
    return [(start + i * step, event) for i in range(int((stop - start) / step) + 1)]


PREFILLING = at.GotProgress(prefilled=100, prompt=20_000)
LOADING = at.GotProgress(prefilled=0, prompt=20_000, loading=True)
ANSWER = [(120.5, at.GotTokens(0, 1)), (120.6, at.GotTokens(1, 1)), (121.0, at.GotDone())]


@pytest.mark.parametrize(("records", "outcome", "when", "why"), [
    # a 20 000-token prompt at 400 tok/s is due by 60.1 s; this prefill takes 120 s
    ([(0.1, at.GotAccepted()), *every(1.0, 120.0, PREFILLING), *ANSWER],
     "NodeDone", 121.0, ""),
    ([(0.1, at.GotAccepted()), *ANSWER], "Failover", 60.1, "no first token"),
    # progress that stops is progress no more: one lease after the last report
    ([(0.1, at.GotAccepted()), *every(1.0, 70.0, PREFILLING), *ANSWER],
     "Failover", 80.0, "no first token"),
    # an asleep node loads its model before it accepts (30 s), reporting as it goes
    ([*every(1.0, 30.0, LOADING), (30.5, at.GotAccepted()), (31.0, at.GotTokens(0, 1)),
      (31.5, at.GotDone())], "NodeDone", 31.5, ""),
    ([(30.5, at.GotAccepted()), (31.0, at.GotTokens(0, 1))], "Failover", 10.0,
     "no answer to the generation"),
    # after the first token, progress says nothing: the next token is due in one lease
    ([(0.1, at.GotAccepted()), (0.2, at.GotTokens(0, 1)), *every(1.0, 30.0, PREFILLING),
      (30.5, at.GotTokens(1, 1))], "Failover", 10.2, "no token"),
])
def test_progress_before_the_first_token_keeps_a_long_prefill_alive(
        records: list[tuple[float, at.Event]], outcome: str, when: float, why: str) -> None:
    state, out = drive(fresh(prompt=20_000, prefill_tps=400.0), records, end=200.0)
    assert state.final
    last_at, last = out[-1]
    assert type(last).__name__ == outcome, out[-3:]
    assert last_at == pytest.approx(when)
    if why:
        assert isinstance(last, at.Failover) and why in last.reason and not last.hung


def test_progress_never_brings_the_first_token_bound_earlier() -> None:
    state, _ = run(fresh(prompt=20_000, prefill_tps=400.0), (0.1, at.GotAccepted()),
                   (0.5, PREFILLING))
    assert state.progress_by == pytest.approx(60.1)
    state, _ = run(state, (55.0, PREFILLING))
    assert state.progress_by == pytest.approx(65.0)
    assert state.heard_at == 55.0  # a progress record is heard like any other


def test_unknown_prefill_rate_is_priced_at_the_floor() -> None:
    assert at.first_token_due(1.0, 1000, 0.0, L) == pytest.approx(1.0 + 10 + 1000 / 50)
    assert at.first_token_due(1.0, 1000, 500.0, L) == pytest.approx(1.0 + 10 + 2)


FIT = {"s_per_token": 1e-3, "s_per_token_ctx": 1e-7}


@pytest.mark.parametrize(("prompt", "tps", "kw", "due"), [
    # fitted: 20 000 tokens cost 20 s per token and 20 s of context (1e-7 x 20 000 x 10 000)
    (20_000, 400.0, FIT, 1.0 + 10 + 20 + 20),
    # holding 19 800 of them: 200 new tokens, each after the 19 800 and half the rest
    (20_000, 400.0, {**FIT, "cached": 19_800}, 1.0 + 10 + 0.2 + 1e-7 * 200 * 19_900),
    # a held count beyond the prompt leaves one token to prefill
    (20_000, 400.0, {**FIT, "cached": 10**9}, 1.0 + 10 + 1e-3 + 1e-7 * 19_999.5),
    # not fitted: the whole prompt at its rate, whatever it holds (it may have lost it,
    # and such a node may not report progress either)
    (20_000, 400.0, {"cached": 19_800}, 1.0 + 10 + 50),
    (20_000, 0.0, {"cached": 19_800}, 1.0 + 10 + 400),
])
def test_the_first_token_is_due_after_the_prefill_priced_by_length(
        prompt: int, tps: float, kw: dict, due: float) -> None:
    assert at.first_token_due(1.0, prompt, tps, L, **kw) == pytest.approx(due)
    state = at.start(0.0, prompt_tokens=prompt, prefill_tps=tps, wall_deadline=600.0,
                     limits=L, **kw)
    state, _ = run(state, (1.0, at.GotAccepted()))
    assert state.progress_by == pytest.approx(due)


def test_accepted_but_no_tokens_while_answering_pings_fails_over_within_one_lease() -> None:
    # a node whose runtime never starts the generation but whose loop answers pings
    state, _ = run(fresh(prompt=10, prefill_tps=1000.0), (0.1, at.GotAccepted()))
    out: list[tuple[float, at.Action]] = []
    now = 0.1
    while not state.final and now < 30:
        now = at.next_deadline(state, L)
        state, actions = at.step(state, at.Tick(heard_at=now), now, L)  # pongs arrive
        out += [(now, a) for a in actions]
    f = final(out)
    assert isinstance(f, at.Failover) and not f.hung
    assert now == pytest.approx(0.1 + 10 + 10 / 1000)


def test_a_gap_between_tokens_longer_than_a_lease_fails_over() -> None:
    state, _ = run(fresh(), (0.1, at.GotAccepted()), (0.2, at.GotTokens(0, 1)))
    assert state.progress_by == pytest.approx(10.2)
    state, out = run(state, (10.2, at.Tick(heard_at=10.1)))
    f = final(out)
    assert isinstance(f, at.Failover) and "no token" in f.reason


def test_no_answer_to_the_generation_within_a_lease() -> None:
    _state, out = run(fresh(), (10.0, at.Tick(heard_at=9.9)))
    f = final(out)
    assert isinstance(f, at.Failover) and "no answer" in f.reason


def test_the_ceiling_wins_over_everything() -> None:
    _state, out = run(fresh(wall=5.0), (0.1, at.GotAccepted()), (5.0, at.GotTokens(0, 1)))
    assert kinds(out) == ["Deliver", "WallExceeded"]


def test_next_deadline_is_the_earliest_timer() -> None:
    state = fresh()
    assert at.next_deadline(state, L) == pytest.approx(1.0)  # first ping after 1 s silence
    state = replace(state, heard_at=5.0, pinged_at=5.5)
    assert at.next_deadline(state, L) == pytest.approx(6.5)
    state, _ = run(fresh(wall=0.5), (0.0, at.Tick(heard_at=0.0)))
    assert at.next_deadline(state, L) == pytest.approx(0.5)


def test_a_final_state_ignores_everything_after() -> None:
    state, _ = run(fresh(), (0.1, at.GotDone()))
    assert state.final
    assert at.step(state, at.GotTokens(0, 1), 0.2, L) == (state, ())


def test_the_fast_path_for_tokens_in_order_decides_as_the_general_path() -> None:
    """step() takes a shortcut for the common case (tokens in order, no timer due); over
    random sequences of token records, times and limits, it decides as the general path."""
    import random

    rng = random.Random(7)
    fast_taken = 0
    for _ in range(300):
        limits = at.AttemptLimits(lease_s=rng.choice([0.5, 10.0]), stall_s=rng.choice([0.2, 3.0]),
                                  ping_s=rng.choice([0.1, 1.0]))
        state = at.start(0.0, prompt_tokens=10, prefill_tps=0.0,
                         wall_deadline=rng.choice([2.0, 600.0]), limits=limits)
        slow = state
        now = 0.0
        for k in range(40):
            now += rng.choice([0.0, 0.01, 0.2, 0.4, 1.5])
            event: at.Event
            if k == 0 and rng.random() < 0.8:
                event = at.GotAccepted()
            elif rng.random() < 0.1:
                event = at.GotProgress(prefilled=k, prompt=10, loading=rng.random() < 0.5)
            else:
                index = slow.expected + rng.choice([0, 0, 0, 0, 1, -1])
                event = at.GotTokens(index, rng.randint(1, 3))
            fast_taken += (type(event) is at.GotTokens and event.index == slow.expected
                           and not slow.final and now < slow.renew_at)
            state, actions = at.step(state, event, now, limits)
            slow, slow_actions = at._step(slow, event, now, limits)
            assert (state, actions) == (slow, slow_actions)
    assert fast_taken > 200  # the shortcut was taken often enough to be tested

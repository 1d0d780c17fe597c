"""Lane choice and the llama.cpp batch plan: pure functions over plain data."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.runtimes.lanes import (
    MIN_REUSE,
    Lane,
    LaneWant,
    common_prefix,
    pick_lane,
    plan_batch,
)

PROMPT = list(range(100, 140))  # 40 tokens
HEADER = PROMPT[:3]  # a chat header: shared, but too short to pick a lane


def lane(seq: int, tokens: list[int] | None = None, session: str = "",
         last_used: float = 0.0) -> Lane:
    return Lane(seq=seq, tokens=list(tokens or []), session=session, last_used=last_used)


# -- common_prefix ---------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b", "want"), [
    ([], [], 0),
    ([1, 2, 3], [], 0),
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2, 3], [1, 2], 2),
    ([1, 2, 3], [1, 9, 3], 1),
    ([7, 2, 3], [1, 2, 3], 0),
])
def test_common_prefix(a: list[int], b: list[int], want: int) -> None:
    assert common_prefix(a, b) == want
    assert common_prefix(b, a) == want


# -- pick_lane -------------------------------------------------------------------------

PICKS = [
    pytest.param([], PROMPT, "", None, id="no free lane"),
    pytest.param([lane(0, last_used=5.0), lane(1, last_used=2.0), lane(2, last_used=9.0)],
                 PROMPT, "", 1, id="nothing cached: least recently used"),
    pytest.param([lane(0, last_used=3.0), lane(1, last_used=3.0)],
                 PROMPT, "", 0, id="least recently used tie: the first"),
    pytest.param([lane(0, PROMPT[:30], last_used=1.0), lane(1, [1, 2], session="s", last_used=9.0)],
                 PROMPT, "s", 1, id="the session's parked lane beats a longer prefix"),
    pytest.param([lane(0, PROMPT[:30], last_used=5.0), lane(1, session="s", last_used=1.0)],
                 PROMPT, "s", 0, id="an empty lane of the session is not parked"),
    pytest.param([lane(0, PROMPT[:30], last_used=5.0), lane(1, [1, 2], last_used=1.0)],
                 PROMPT, "", 0, id="no session: never matches a lane without one"),
    pytest.param([lane(0, PROMPT[:20], last_used=1.0), lane(1, PROMPT[:30], last_used=5.0),
                  lane(2, last_used=0.0)],
                 PROMPT, "t", 1, id="longest useful prefix beats least recently used"),
    pytest.param([lane(0, [*PROMPT[:MIN_REUSE], 1], last_used=9.0), lane(1, last_used=0.0)],
                 PROMPT, "", 0, id="a prefix of exactly MIN_REUSE tokens is useful"),
    pytest.param([lane(0, [*PROMPT[:MIN_REUSE - 1], 1], last_used=9.0), lane(1, last_used=0.0)],
                 PROMPT, "", 1, id="a prefix one short of MIN_REUSE is not"),
    pytest.param([lane(0, [*HEADER, 1, 2], last_used=9.0), lane(1, last_used=0.0)],
                 PROMPT, "", 1, id="a chat header alone evicts nothing"),
    pytest.param([lane(0, [1, 2, 3, 4, 9], last_used=9.0), lane(1, last_used=0.0)],
                 [1, 2, 3, 4, 5], "", 0, id="a short prompt cached but its last token"),
    pytest.param([lane(0, [1, 2, 3, 9], last_used=9.0), lane(1, last_used=0.0)],
                 [1, 2, 3, 4, 5], "", 1, id="a short prompt cached but its last two"),
    pytest.param([lane(0, [5, 6], last_used=9.0), lane(1, last_used=0.0)],
                 [5], "", 0, id="a one-token prompt already held"),
    pytest.param([lane(0, [6], last_used=9.0), lane(1, last_used=0.0)],
                 [5], "", 1, id="a one-token prompt not held"),
    pytest.param([lane(0, PROMPT[:20], last_used=9.0), lane(1, PROMPT[:20], last_used=0.0)],
                 PROMPT, "", 0, id="equal prefixes: the first"),
]


@pytest.mark.parametrize(("lanes", "prompt", "session", "want"), PICKS)
def test_pick_lane(lanes: list[Lane], prompt: list[int], session: str,
                   want: int | None) -> None:
    got = pick_lane(lanes, prompt, session)
    assert (got.seq if got is not None else None) == want


# -- plan_batch ------------------------------------------------------------------------


def plan(wants: list[LaneWant], n_batch: int) -> list[tuple[int, tuple[int, ...], bool]]:
    """The plan as (sequence id, tokens, wants logits), in batch order."""
    return [(wants[f.slot].seq, tuple(f.tokens), f.logits) for f in plan_batch(wants, n_batch)]


def decoding(seq: int, token: int) -> LaneWant:
    return LaneWant(seq=seq, pending=[], next_token=token)


def prefilling(seq: int, pending: list[int]) -> LaneWant:
    return LaneWant(seq=seq, pending=pending, next_token=-1)


PLANS = [
    pytest.param([], 8, [], id="nothing runs"),
    pytest.param([decoding(2, 20), decoding(0, 10), decoding(1, 11)], 8,
                 [(0, (10,), True), (1, (11,), True), (2, (20,), True)],
                 id="decoding lanes in lane order, whatever the admission order"),
    pytest.param([prefilling(0, [1, 2, 3]), decoding(3, 30), decoding(1, 11)], 16,
                 [(1, (11,), True), (3, (30,), True), (0, (1, 2, 3), True)],
                 id="decoding lanes first, then prompts"),
    pytest.param([prefilling(3, [1, 2, 3, 4, 5]), prefilling(1, [6, 7, 8, 9]), decoding(0, 1),
                  decoding(2, 2)], 8,
                 [(0, (1,), True), (2, (2,), True), (1, (6,), False), (3, (1, 2, 3, 4, 5), True)],
                 id="prompts share the rest in admission order, then sort by lane"),
    pytest.param([prefilling(0, [1, 2, 3, 4]), prefilling(1, [5, 6])], 3,
                 [(0, (1, 2, 3), False)],
                 id="a prompt beyond the budget waits for the next step"),
    pytest.param([prefilling(0, [1, 2, 3]), prefilling(1, [5, 6])], 5,
                 [(0, (1, 2, 3), True), (1, (5, 6), True)],
                 id="an exact fit: both prompts end and want logits"),
    pytest.param([decoding(0, 7), decoding(1, 8), prefilling(2, [1, 2])], 2,
                 [(0, (7,), True), (1, (8,), True)],
                 id="decoding lanes fill the batch: no prompt this step"),
]


@pytest.mark.parametrize(("wants", "n_batch", "want"), PLANS)
def test_plan_batch(wants: list[LaneWant], n_batch: int,
                    want: list[tuple[int, tuple[int, ...], bool]]) -> None:
    assert plan(wants, n_batch) == want


@st.composite
def lane_wants(draw: st.DrawFn) -> list[LaneWant]:
    seqs = draw(st.permutations(range(draw(st.integers(0, 8)))))
    return [
        draw(st.one_of(
            st.builds(decoding, st.just(seq), st.integers(0, 1000)),
            st.builds(prefilling, st.just(seq), st.lists(st.integers(0, 1000), min_size=1,
                                                        max_size=40)),
        ))
        for seq in seqs
    ]


@given(lane_wants(), st.integers(8, 64))
def test_plan_batch_rules(wants: list[LaneWant], n_batch: int) -> None:
    feeds = plan_batch(wants, n_batch)
    slots = [f.slot for f in feeds]
    assert len(set(slots)) == len(slots)  # a lane appears at most once
    # the batch is as full as the budget and the work allow
    work = sum(len(w.pending) or 1 for w in wants)
    assert sum(len(f.tokens) for f in feeds) == min(n_batch, work)
    # every decoding lane feeds its token; the decoding group comes first
    dec = [s for s, w in enumerate(wants) if not w.pending]
    assert sorted(slots[: len(dec)]) == dec
    for f in feeds[: len(dec)]:
        assert list(f.tokens) == [wants[f.slot].next_token] and f.logits
    # each group in lane order
    seqs = [wants[s].seq for s in slots]
    assert seqs[: len(dec)] == sorted(seqs[: len(dec)])
    assert seqs[len(dec):] == sorted(seqs[len(dec):])
    # a prompt feeds a non-empty head of what it has left; logits when that is all of it
    for f in feeds[len(dec):]:
        pending = list(wants[f.slot].pending)
        assert f.tokens and list(f.tokens) == pending[: len(f.tokens)]
        assert f.logits == (len(f.tokens) == len(pending))
    # prompts are served in admission order: only the last one served may be cut short
    served = sorted(slots[len(dec):])
    prompts = [s for s, w in enumerate(wants) if w.pending]
    assert served == prompts[: len(served)]
    cut = [f.slot for f in feeds[len(dec):] if not f.logits]
    assert cut in ([], served[-1:])

"""A model larger than any one machine, proposed split across the fleet's machines that lend
memory (engine.models.split_fit), table-tested: no files, no sockets."""

from __future__ import annotations

import pytest

from engine.models.fit import Machine, ModelShape, estimate
from engine.models.speed import SPLIT_HOP_S, decode_tps, split_tps
from engine.models.split_fit import propose_split, share_layers
from engine.sizes import GiB

# a 32B model at Q4_K_M: 64 layers, 8 KV heads of 128 (about 19 GiB with a chat turn)
B32 = ModelShape(size=19_851_336_192, layers=64, embedding=5120,
                 kv_bytes_per_token=64 * 2 * 8 * 128 * 2, context=32768)
GB = 1_000_000_000


def laptop(**kw: int) -> Machine:
    return Machine("laptop", ram_total=32 * GiB, budget=kw.pop("budget", 12 * GiB), **kw)


def desk(**kw: int) -> Machine:
    return Machine("desk", ram_total=32 * GiB, budget=12 * GiB, lend=kw.pop("lend", 10 * GiB),
                   **kw)


@pytest.mark.parametrize(("total", "room", "weights", "shared"), [
    (24, [20, 20], [1.0, 1.0], [12, 12]),
    (24, [30, 10], [30.0, 10.0], [18, 6]),
    (10, [3, 100], [1.0, 1.0], [3, 7]),  # the first holds 3 only: the rest to the other
    (7, [10, 10, 10], [1.0, 1.0, 1.0], [3, 2, 2]),  # the one left over: the first
    (25, [20, 20], [1.0, 1.0], [13, 12]),
    (24, [10, 10], [1.0, 1.0], None),  # together they hold 20 of 24
])
def test_layers_are_shared_in_proportion_and_never_past_a_parts_room(
        total: int, room: list[int], weights: list[float], shared: list[int] | None) -> None:
    assert share_layers(total, room, weights) == shared


def test_a_model_no_machine_holds_is_split_with_the_layers_in_proportion() -> None:
    machines = [laptop(budget=16 * GiB), desk(lend=12 * GiB)]
    assert not any(estimate(B32, m).fits for m in machines)
    p = propose_split(B32, machines)
    assert p is not None
    assert p.machines == ("laptop", "desk")
    assert p.serving.layers + sum(lender.layers for lender in p.lenders) == 64 == p.layers
    # the laptop's 16 GiB holds 52 layers, the desk's lent 12 GiB 40: 64 shared 52:40
    assert (p.serving.layers, p.lenders[0].layers) == (36, 28)
    assert p.serving.bytes <= 16 * GiB and p.lenders[0].bytes <= 12 * GiB
    assert p.tps is None  # no bandwidth known: no speed said
    assert p.line == "split across laptop + desk (36 + 28 of 64 layers)"


def test_the_speed_is_every_part_in_turn_and_a_faster_machine_takes_more() -> None:
    slow_desk = propose_split(B32, [laptop(budget=16 * GiB, mem_bandwidth=60 * GB),
                                    desk(lend=12 * GiB, mem_bandwidth=20 * GB)])
    assert slow_desk is not None
    # by room alone 36 + 28; the laptop reads three times as fast, so it takes more
    assert slow_desk.serving.layers > 36
    assert slow_desk.tps == pytest.approx(split_tps(
        B32, [(slow_desk.serving.layers, 60 * GB), (slow_desk.lenders[0].layers, 20 * GB)]))
    assert slow_desk.line == "split across laptop + desk (51 + 13 of 64 layers), about 1.2 tokens/s"
    # one machine's bandwidth unknown: no estimate, and the layers by room only
    unknown = propose_split(B32, [laptop(budget=16 * GiB, mem_bandwidth=60 * GB),
                                  desk(lend=12 * GiB)])
    assert unknown is not None and unknown.tps is None and unknown.serving.layers == 36


def test_a_split_token_costs_each_part_and_a_hop_for_each_lender() -> None:
    whole = decode_tps(B32, mem_bandwidth=50 * GB)
    assert whole is not None
    assert split_tps(B32, [(64, 50 * GB)]) == pytest.approx(whole)
    two = split_tps(B32, [(32, 50 * GB), (32, 50 * GB)])
    assert two is not None and 1 / two == pytest.approx(1 / whole + SPLIT_HOP_S)
    assert split_tps(B32, [(32, 50 * GB), (32, 0)]) is None


def test_no_proposal_when_one_machine_holds_it() -> None:
    big = Machine("big", ram_total=64 * GiB, budget=32 * GiB)
    assert estimate(B32, big).fits
    assert propose_split(B32, [laptop(), desk(), big]) is None


def test_no_proposal_when_the_lenders_together_cannot_hold_it() -> None:
    nas = Machine("nas", ram_total=16 * GiB, budget=8 * GiB, lend=5 * GiB)
    assert propose_split(B32, [laptop(), nas]) is None
    assert propose_split(B32, [laptop()]) is None  # nobody lends
    assert propose_split(B32, []) is None


def test_a_machine_that_lends_nothing_is_never_a_lender() -> None:
    # the studio has the most memory of all, but its owner lends none
    studio = Machine("studio", ram_total=64 * GiB, budget=16 * GiB)
    p = propose_split(B32, [studio, laptop(), desk()])
    assert p is not None
    assert [lender.machine for lender in p.lenders] == ["desk"]
    assert propose_split(B32, [studio, laptop()]) is None


def test_the_fewest_lenders_are_chosen_those_holding_most_first() -> None:
    small = [Machine(f"pi{i}", ram_total=8 * GiB, budget=4 * GiB, lend=4 * GiB)
             for i in range(3)]
    p = propose_split(B32, [laptop(), *small, desk()])
    assert p is not None and p.machines == ("laptop", "desk")
    # without the desk three small lenders are needed, and they are enough
    p = propose_split(B32, [laptop(), *small])
    assert p is not None and len(p.lenders) == 3
    assert p.serving.layers + sum(lender.layers for lender in p.lenders) == 64


def test_an_embeddings_model_is_never_split() -> None:
    emb = ModelShape(size=B32.size, layers=64, embedding=5120, kv_bytes_per_token=1,
                     context=8192, embeddings=True)
    assert propose_split(emb, [laptop(), desk()]) is None

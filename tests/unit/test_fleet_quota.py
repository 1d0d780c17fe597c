"""The quota of the models a fleet's head chose for a node (issue 30, item 4): what goes to
make room for another, and when it is refused (engine/models/pulls/quota.py, pure)."""

from __future__ import annotations

import pytest

from engine.models.pulls.quota import FleetModel, Room, make_room, parse_quota, quota_bytes
from engine.sizes import GiB, Share, amount

OLD = FleetModel("acme/Old-GGUF:Q4_K_M", 6 * GiB, last_used=100.0)
MID = FleetModel("acme/Mid-GGUF:Q4_K_M", 5 * GiB, last_used=200.0)
NEW = FleetModel("acme/New-GGUF:Q4_K_M", 4 * GiB, last_used=300.0)


def test_a_model_that_fits_takes_nothing():
    assert make_room([OLD, MID], 20 * GiB, 9 * GiB, "x") == Room()
    assert make_room([], 20 * GiB, 20 * GiB, "x") == Room()  # exactly the quota


def test_the_least_recently_used_go_first_and_only_as_many_as_needed():
    # 15 GiB kept, 20 GiB allowed: 8 more is 3 over, so the oldest (6 GiB) goes alone
    assert make_room([NEW, MID, OLD], 20 * GiB, 8 * GiB, "x") == Room(evict=(OLD.name,))
    # 12 more is 7 over: the oldest and the next
    assert make_room([NEW, OLD, MID], 20 * GiB, 12 * GiB, "x") == Room(
        evict=(OLD.name, MID.name))


def test_the_model_being_served_never_goes():
    served = FleetModel(OLD.name, OLD.size, OLD.last_used, serving=True)
    assert make_room([served, MID, NEW], 20 * GiB, 8 * GiB, "x") == Room(evict=(MID.name,))
    room = make_room([served], 10 * GiB, 5 * GiB, "acme/Big-GGUF:Q8_0")
    assert room.evict == ()
    assert room.refusal == (
        f"fleet models may use {amount(10 * GiB)} here and acme/Big-GGUF:Q8_0 needs "
        f"{amount(5 * GiB)}, but {OLD.name} takes {amount(6 * GiB)} of it "
        "while it serves: raise 'Fleet models may use' in Settings on that machine, "
        "or ask again once it serves another")


def test_a_model_larger_than_the_quota_is_refused_and_nothing_goes():
    room = make_room([OLD, MID], 20 * GiB, 25 * GiB, "acme/Huge-GGUF:Q8_0")
    assert room == Room(refusal=(
        f"fleet models may use {amount(20 * GiB)} here and acme/Huge-GGUF:Q8_0 needs "
        f"{amount(25 * GiB)}: raise "
        "'Fleet models may use' in Settings on that machine"))


def test_a_quota_is_a_size_or_a_share_of_the_disk():
    assert parse_quota("20G") == 20 * GiB and parse_quota(" 50% ") == Share(50.0)
    assert quota_bytes(Share(50.0), 900 * GiB) == 450 * GiB
    assert quota_bytes(20 * GiB, 900 * GiB) == 20 * GiB
    for bad in ("lots", "150%", "0%", "1M"):
        with pytest.raises(ValueError, match="is not a limit for the fleet's models; give a "
                                             "size like 20G"):
            parse_quota(bad)

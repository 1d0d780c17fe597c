from __future__ import annotations

import dataclasses

import pytest

from engine.node.leases import Lease, expired, grant, renew


def test_grant_sets_deadline() -> None:
    assert grant(100.0, 30.0) == Lease(130.0)


def test_expired_only_after_the_deadline() -> None:
    lease = grant(100.0, 30.0)
    assert not expired(lease, 129.9)
    assert not expired(lease, 130.0)
    assert expired(lease, 130.1)


def test_renew_extends_from_now() -> None:
    lease = renew(grant(100.0, 30.0), 120.0, 30.0)
    assert lease == Lease(150.0)
    assert not expired(lease, 140.0)


def test_renew_never_shortens() -> None:
    lease = grant(100.0, 60.0)
    assert renew(lease, 110.0, 10.0) == Lease(160.0)


def test_renew_at_the_deadline_still_counts() -> None:
    assert renew(grant(0.0, 10.0), 10.0, 10.0) == Lease(20.0)


def test_an_expired_lease_stays_fenced() -> None:
    lease = grant(0.0, 10.0)
    late = renew(lease, 10.5, 10.0)
    assert late == lease
    assert expired(late, 10.5)


def test_lease_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        grant(0.0, 1.0).deadline = 5.0  # type: ignore[misc]

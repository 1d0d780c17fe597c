"""The replay guard of the first handshake message, and the stamp the link puts in it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.link.connection import HandshakeDone, LinkConnection, LinkError, LinkErrorKind
from engine.link.replay import WINDOW_S, ReplayGuard, Verdict, explain, read_stamp, stamp

TOKEN = bytes(range(32))
NOW = 1_800_000_000.0
K1, K2, K3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


@pytest.mark.parametrize(("sent_at", "verdict"), [
    (NOW, Verdict.FRESH),
    (NOW - WINDOW_S, Verdict.FRESH),  # the window's edges are inside it
    (NOW + WINDOW_S, Verdict.FRESH),
    (NOW - WINDOW_S - 0.001, Verdict.SKEWED),
    (NOW + WINDOW_S + 0.001, Verdict.SKEWED),
    (0.0, Verdict.SKEWED),
])
def test_a_first_message_is_taken_within_the_window(sent_at: float, verdict: Verdict):
    assert ReplayGuard().check(K1, sent_at, NOW) is verdict


def test_a_key_is_taken_once_and_refused_until_its_time_leaves_the_window():
    guard = ReplayGuard()
    assert guard.check(K1, NOW, NOW) is Verdict.FRESH
    assert guard.check(K1, NOW, NOW + 1) is Verdict.REPLAYED
    assert guard.check(K1, NOW, NOW + WINDOW_S) is Verdict.REPLAYED  # still remembered
    assert len(guard) == 1
    # past the window the time refuses it, and the key is forgotten
    assert guard.check(K1, NOW, NOW + WINDOW_S + 1) is Verdict.SKEWED
    assert len(guard) == 0
    assert guard.check(K2, NOW + WINDOW_S + 1, NOW + WINDOW_S + 1) is Verdict.FRESH


def test_a_full_memory_forgets_the_soonest_to_expire_and_never_refuses_a_new_key():
    """A stranger who fills the memory with harvested messages must not shut the fleet
    out: the guard forgets the oldest key instead (a replay of it gains nothing, since no
    hello can follow it)."""
    guard = ReplayGuard(max_remembered=2)
    assert guard.check(K1, NOW, NOW) is Verdict.FRESH
    assert guard.check(K2, NOW + 10, NOW) is Verdict.FRESH
    assert guard.check(K3, NOW, NOW) is Verdict.FRESH  # K1 (the soonest to expire) goes
    assert len(guard) == 2 and guard.forgotten == 1
    assert guard.check(K2, NOW + 10, NOW) is Verdict.REPLAYED  # the newer ones still held
    assert guard.check(K3, NOW, NOW) is Verdict.REPLAYED


def test_a_flood_of_fresh_keys_never_refuses_a_real_peer():
    guard = ReplayGuard(max_remembered=100)
    flood = [i.to_bytes(32, "big") for i in range(1000)]
    verdicts = {guard.check(key, NOW, NOW + n / 100) for n, key in enumerate(flood)}
    assert verdicts == {Verdict.FRESH} and len(guard) == 100 and guard.forgotten == 900
    real = b"\xee" * 32
    assert guard.check(real, NOW + 10, NOW + 10) is Verdict.FRESH
    assert guard.check(real, NOW + 10, NOW + 10) is Verdict.REPLAYED


@given(st.lists(st.tuples(st.integers(0, 5), st.floats(-400, 400), st.floats(0, 300)),
                max_size=40))
def test_no_key_is_taken_twice_while_its_first_time_is_in_the_window(
        tries: list[tuple[int, float, float]]):
    guard = ReplayGuard()
    taken_at: dict[int, float] = {}  # key -> the stamp it was last taken with
    now = NOW
    for key, offset, advance in tries:
        now += advance  # the clock only moves forward
        sent_at = NOW + offset
        verdict = guard.check(bytes([key]) * 32, sent_at, now)
        if abs(now - sent_at) > WINDOW_S:
            assert verdict is Verdict.SKEWED
        elif verdict is Verdict.FRESH:
            if key in taken_at:  # taken before: only once that stamp left the window
                assert now > taken_at[key] + WINDOW_S, (key, taken_at[key], now)
            taken_at[key] = sent_at
        else:
            assert verdict is Verdict.REPLAYED and key in taken_at


def test_explanations_name_the_cause_and_the_fix():
    assert "replayed" in explain(Verdict.REPLAYED, NOW, NOW)
    skew = explain(Verdict.SKEWED, NOW - 600, NOW)
    assert "600 s behind" in skew and "network time" in skew
    assert "ahead of" in explain(Verdict.SKEWED, NOW + 600, NOW)


def test_the_stamp_round_trips_to_the_millisecond():
    assert read_stamp(stamp(NOW + 0.123)) == pytest.approx(NOW + 0.123, abs=0.001)
    assert read_stamp(b"") is None and read_stamp(b"\0" * 9) is None


def _handshake(now: float) -> tuple[LinkConnection, HandshakeDone]:
    ini = LinkConnection(initiator=True, psk=TOKEN)
    res = LinkConnection(initiator=False, psk=TOKEN)
    res.receive_data(ini.initiate(now))
    done = res.next_event()
    assert isinstance(done, HandshakeDone)
    return ini, done


def test_the_responder_hands_out_the_dialers_key_and_time():
    _ini, done = _handshake(NOW)
    assert done.encrypted and done.sent_at == pytest.approx(NOW)
    assert len(done.peer_key) == 32
    _ini2, again = _handshake(NOW)
    assert again.peer_key != done.peer_key  # a new dialer, a new ephemeral key


def test_a_copy_of_the_first_message_gives_the_same_key_at_another_responder():
    ini = LinkConnection(initiator=True, psk=TOKEN)
    first = ini.initiate(NOW)
    keys = []
    for _ in range(2):
        res = LinkConnection(initiator=False, psk=TOKEN)
        res.receive_data(first)
        done = res.next_event()
        assert isinstance(done, HandshakeDone)
        keys.append(done.peer_key)
    assert keys[0] == keys[1]
    guard = ReplayGuard()
    assert guard.check(keys[0], NOW, NOW) is Verdict.FRESH
    assert guard.check(keys[1], NOW, NOW) is Verdict.REPLAYED


def test_a_first_message_from_before_the_stamp_is_refused_as_an_old_peer():
    # a Shoal from before the stamp sent a 48-byte first message (e and the empty tag)
    old = (48).to_bytes(2, "big") + b"\x07" * 48
    res = LinkConnection(initiator=False, psk=TOKEN)
    res.receive_data(old)
    with pytest.raises(LinkError) as info:
        res.next_event()
    assert info.value.kind is LinkErrorKind.OLD_PEER
    assert "older Shoal" in str(info.value)

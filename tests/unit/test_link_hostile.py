"""A hostile peer against the sans-IO link: random, mutated, replayed, truncated and
oversized bytes, delivered in any chunks. No sockets.

What must hold whatever arrives: the link raises only LinkError (never another
exception), an encrypted link never yields a record the peer did not send (a mutated
stream yields a prefix of the real records, then an error), and a size a peer claims is
refused before anything is allocated for it.
"""

from __future__ import annotations

import itertools
import struct
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.link import messages as m
from engine.link.connection import (
    MAX_FRAME,
    NEED_DATA,
    PROLOGUE,
    Closed,
    HandshakeDone,
    LinkConnection,
    LinkError,
    LinkErrorKind,
    State,
)
from engine.link.noise import HandshakeState
from tests.drills.record import record

TOKEN = bytes(range(32))
RECORDS: list[m.Record] = [
    m.HeadHello(head_id="h-1", model="m"),
    m.Generate(session="s1", lease_ms=10_000, prompt=list(range(300)), max_tokens=9,
               stop_ids=[256]),
    m.Renew(session="s1", lease_ms=10_000),
    m.Ping(nonce=7),
    m.Cancel(session="s1"),
    m.Generate(session="big", lease_ms=1000, prompt=list(range(40_000)), max_tokens=1),
]
EXAMPLES = 300
SMALL_PEAK = 256 * 1024  # bytes: far below what any claimed size here would need


@pytest.fixture(scope="module")
def counts() -> Iterator[Counter[str]]:
    """How many cases of each kind the tests of this module ran; filed as the drill
    figures once they are done, whichever of them ran and in whatever order."""
    ran: Counter[str] = Counter()
    yield ran
    file_figures(ran)


def drain(conn: LinkConnection) -> list[object]:
    out = []
    while (ev := conn.next_event()) is not NEED_DATA:
        out.append(ev)
        if isinstance(ev, Closed):
            break
    return out


def responder(psk: bytes | None) -> LinkConnection:
    """A responder whose ephemeral key is fixed, so that a stream captured once can be
    delivered to a fresh one again (a real responder's key is random)."""
    res = LinkConnection(initiator=False, psk=psk)
    if psk is not None:
        res._hs = HandshakeState(initiator=False, psk=psk, prologue=PROLOGUE,
                                 ephemeral=bytes(range(100, 132)))
    return res


def stream_of(psk: bytes | None) -> tuple[bytes, LinkConnection]:
    """The initiator's whole stream (its handshake message, then RECORDS) as it would be
    sent to a :func:`responder`, and that initiator (open, for more records)."""
    ini = LinkConnection(initiator=True, psk=psk)
    res = responder(psk)
    first = ini.initiate(now=0.0)
    res.receive_data(first)
    assert drain(res) == [HandshakeDone(encrypted=psk is not None)]
    if psk is not None:
        ini.receive_data(res.handshake_reply())
        assert drain(ini) == [HandshakeDone(encrypted=True)]
    return first + b"".join(ini.send(r) for r in RECORDS), ini


def feed(conn: LinkConnection, data: bytes, cuts: list[int]) -> tuple[list[object],
                                                                    LinkError | None]:
    """Deliver ``data`` split at ``cuts``, then EOF; the events and the error, if any."""
    events: list[object] = []
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    try:
        for a, b in itertools.pairwise(bounds):
            conn.receive_data(data[a:b])
            events += drain(conn)
        conn.receive_data(b"")
        events += drain(conn)
    except LinkError as exc:
        return events, exc
    return events, None


# -- chunkings ---------------------------------------------------------------------------


@pytest.mark.parametrize("psk", [TOKEN, None], ids=["noise", "plaintext"])
@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0), max_size=40))
def test_any_chunking_gives_the_same_records(counts: Counter[str], psk: bytes | None,
                                             cuts: list[int]) -> None:
    counts["chunking"] += 1
    data, _ini = stream_of(psk)
    events, err = feed(responder(psk), data, cuts)
    assert err is None
    assert events == [HandshakeDone(encrypted=psk is not None), *RECORDS, Closed()]


# -- mutations -------------------------------------------------------------------------


def _mutate(data: bytes, op: str, at: int, size: int, junk: bytes) -> bytes:
    at %= len(data)
    if op == "flip":
        return data[:at] + bytes([data[at] ^ (junk[0] | 1 if junk else 1)]) + data[at + 1:]
    if op == "delete":
        return data[:at] + data[at + size:]
    if op == "insert":
        return data[:at] + junk + data[at:]
    if op == "truncate":
        return data[:at]
    if op == "duplicate":
        return data[:at + size] + data[at:at + size] + data[at + size:]
    return data[:at] + bytes(reversed(data[at:at + size])) + data[at + size:]  # swap


MUTATION = st.tuples(st.sampled_from(["flip", "delete", "insert", "truncate", "duplicate",
                                      "reverse"]),
                     st.integers(min_value=0), st.integers(min_value=1, max_value=600),
                     st.binary(min_size=1, max_size=64))


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_a_mutated_encrypted_stream_yields_only_real_records(
        counts: Counter[str], mutations: list[tuple[str, int, int, bytes]],
        cuts: list[int]) -> None:
    counts["mutated_noise"] += 1
    data, _ini = stream_of(TOKEN)
    for op, at, size, junk in mutations:
        data = _mutate(data, op, at, size, junk) or b"\x00"
    events, _err = feed(responder(TOKEN), data, cuts)
    records = [e for e in events if not isinstance(e, HandshakeDone | Closed)]
    # authenticated encryption: what comes out is what was sent, in order, or nothing
    assert records == RECORDS[:len(records)]


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_a_mutated_plaintext_stream_yields_only_valid_records(
        counts: Counter[str], mutations: list[tuple[str, int, int, bytes]],
        cuts: list[int]) -> None:
    counts["mutated_plaintext"] += 1
    data, _ini = stream_of(None)
    for op, at, size, junk in mutations:
        data = _mutate(data, op, at, size, junk) or b"\x00"
    events, _err = feed(responder(None), data, cuts)
    kinds = (HandshakeDone, Closed, *m.Record.__args__)  # type: ignore[attr-defined]
    for ev in events:  # no authentication here: only the codec's strictness holds
        assert isinstance(ev, kinds)


@settings(max_examples=EXAMPLES, deadline=None)
@given(body=st.binary(max_size=2000))
def test_random_record_bodies_only_raise_record_errors(counts: Counter[str], body: bytes) -> None:
    counts["random_record"] += 1
    try:
        rec = m.decode(body)
    except m.RecordError:
        return
    assert isinstance(rec, m.Record.__args__)  # type: ignore[attr-defined]


@settings(max_examples=EXAMPLES, deadline=None)
@given(index=st.integers(min_value=0, max_value=len(RECORDS) - 1),
       mutation=MUTATION)
def test_mutated_record_bodies_only_raise_record_errors(
        counts: Counter[str], index: int, mutation: tuple[str, int, int, bytes]) -> None:
    counts["mutated_record"] += 1
    body = _mutate(m.encode(RECORDS[index]), *mutation) or b"\x00"
    try:
        rec = m.decode(body)
    except m.RecordError:
        return
    assert isinstance(rec, m.Record.__args__)  # type: ignore[attr-defined]


# -- replays -----------------------------------------------------------------------------


def test_a_replayed_first_message_opens_nothing_the_replayer_can_use(counts: Counter[str]) -> None:
    """NNpsk0's first message can be replayed to a fresh responder, which answers; but the
    replayer lacks the ephemeral key, so the captured traffic it sends next is refused."""
    data, _ini = stream_of(TOKEN)
    first, rest = data[:2 + 56], data[2 + 56:]
    res = LinkConnection(initiator=False, psk=TOKEN)
    res.receive_data(first)
    assert drain(res) == [HandshakeDone(encrypted=True)]
    res.receive_data(rest)
    with pytest.raises(LinkError) as err:
        drain(res)
    assert err.value.kind is LinkErrorKind.PROTOCOL  # the first frame fails authentication
    counts["replay"] += 1


def test_a_replayed_reply_is_refused_by_another_dialer(counts: Counter[str]) -> None:
    ini1 = LinkConnection(initiator=True, psk=TOKEN)
    res = LinkConnection(initiator=False, psk=TOKEN)
    res.receive_data(ini1.initiate(now=0.0))
    drain(res)
    reply = res.handshake_reply()
    ini2 = LinkConnection(initiator=True, psk=TOKEN)
    ini2.initiate(now=0.0)
    ini2.receive_data(reply)  # bound to ini1's ephemeral key
    with pytest.raises(LinkError) as err:
        drain(ini2)
    assert err.value.kind is LinkErrorKind.WRONG_TOKEN
    counts["replay"] += 1


@pytest.mark.parametrize("how", ["again", "swapped"])
def test_replayed_or_reordered_frames_break_the_link(counts: Counter[str], how: str) -> None:
    data, ini = stream_of(TOKEN)
    res = responder(TOKEN)
    res.receive_data(data)
    assert drain(res)[1:] == RECORDS
    one, two = ini.send(m.Ping(nonce=1)), ini.send(m.Ping(nonce=2))
    res.receive_data(one + one if how == "again" else two + one)
    with pytest.raises(LinkError) as err:
        drain(res)
    assert err.value.kind is LinkErrorKind.PROTOCOL
    counts["replay"] += 1


# -- truncated handshakes -------------------------------------------------------------------


@pytest.mark.parametrize("psk", [TOKEN, None], ids=["noise", "plaintext"])
def test_every_truncated_handshake_ends_in_a_link_error(counts: Counter[str],
                                                        psk: bytes | None) -> None:
    data, _ini = stream_of(psk)
    first = data[:2 + (56 if psk else 0)]
    for cut in range(len(first)):
        res = responder(psk)
        if cut:
            res.receive_data(first[:cut])
        assert drain(res) == [] and res.state is State.HANDSHAKE  # waiting, never wrong
        res.receive_data(b"")
        with pytest.raises(LinkError) as err:
            drain(res)
        assert err.value.kind is LinkErrorKind.CLOSED_AT_HANDSHAKE
        counts["truncated_handshake"] += 1


@pytest.mark.parametrize(("psk", "length", "kind"), [
    (TOKEN, 47, LinkErrorKind.PROTOCOL), (TOKEN, 49, LinkErrorKind.PROTOCOL),
    (TOKEN, MAX_FRAME, LinkErrorKind.PROTOCOL), (TOKEN, 0, LinkErrorKind.NO_TOKEN_THERE),
    (None, 48, LinkErrorKind.NO_TOKEN_HERE), (None, MAX_FRAME, LinkErrorKind.NO_TOKEN_HERE),
])
def test_a_handshake_frame_of_the_wrong_length_is_refused_on_its_length(
        counts: Counter[str], psk: bytes | None, length: int, kind: LinkErrorKind) -> None:
    """Two bytes are enough: the link neither waits for nor buffers the announced frame."""
    res = LinkConnection(initiator=False, psk=psk)
    res.receive_data(struct.pack(">H", length))
    with pytest.raises(LinkError) as err:
        drain(res)
    assert err.value.kind is kind
    counts["handshake_length"] += 1


# -- sizes a peer claims ---------------------------------------------------------------


def peak_while(work: Callable[[], object]) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    tracemalloc.reset_peak()
    error: BaseException | None = None
    try:
        work()
    except (LinkError, m.RecordError) as exc:
        error = exc
    finally:
        _now, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, error


@pytest.mark.parametrize("psk", [TOKEN, None], ids=["noise", "plaintext"])
@pytest.mark.parametrize("claim", [m.MAX_RECORD + 1, 1 << 31, (1 << 32) - 1])
def test_a_claimed_huge_record_is_refused_before_any_allocation(counts: Counter[str],
                                                                psk: bytes | None,
                                                                claim: int) -> None:
    """A peer that announces a record of up to 4 GiB gets an error from the 4-byte length
    alone; the receiving end's memory never grows towards the claim."""
    ini = LinkConnection(initiator=True, psk=psk)
    res = LinkConnection(initiator=False, psk=psk)
    res.receive_data(ini.initiate(now=0.0))
    drain(res)
    if psk is not None:
        ini.receive_data(res.handshake_reply())
        drain(ini)
    # the sender's own checks refuse such a record: build its frame by hand
    header = struct.pack(">I", claim) + b"\x93" + b"\x00" * 64
    cs = ini._send_cs
    payload = cs.encrypt_with_ad(b"", header) if cs is not None else header
    wire = struct.pack(">H", len(payload)) + payload

    def work() -> None:
        res.receive_data(wire)
        drain(res)

    peak, error = peak_while(work)
    assert isinstance(error, LinkError) and error.kind is LinkErrorKind.TOO_LARGE
    assert str(claim) in str(error)
    assert peak < SMALL_PEAK, peak
    counts["huge_claim"] += 1


@pytest.mark.parametrize(("what", "body"), [
    ("array of 2**32-1 ids", b"\x93\xa6tokens\xdd\xff\xff\xff\xff\x01"),
    ("string of 4 GiB", b"\x92\xa4ping\xdb\xff\xff\xff\xff"),
    ("bytes of 4 GiB", b"\x94\xaaalias_sync\xc6\xff\xff\xff\xff"),
    ("map of 2**32-1 pairs", b"\x92\xa4ping\xdf\xff\xff\xff\xff"),
    ("extension of 4 GiB", b"\x92\xa4ping\xc9\xff\xff\xff\xff\x01"),
    ("array of 2**20 ids, then nothing", b"\x93\xa6tokens\xdd\x00\x10\x00\x00\x01"),
])
def test_sizes_claimed_inside_a_record_are_refused_before_allocation(counts: Counter[str],
                                                                     what: str,
                                                                     body: bytes) -> None:
    peak, error = peak_while(lambda: m.decode(body))
    assert isinstance(error, m.RecordError), what
    assert peak < SMALL_PEAK, (what, peak)
    counts["huge_claim"] += 1


def test_the_record_limit_is_exact() -> None:
    limit = 4096
    res = LinkConnection(initiator=False, psk=None, max_record=limit)
    res.receive_data(struct.pack(">H", 0))
    drain(res)
    ok = m.encode(m.AliasSync(table=b"x" * (limit - 20)))
    ok += b"\x00" * 0
    assert len(ok) <= limit
    body = struct.pack(">I", len(ok)) + ok
    res.receive_data(struct.pack(">H", len(body)) + body)
    assert drain(res) == [m.AliasSync(table=b"x" * (limit - 20))]
    res.receive_data(struct.pack(">H", 4) + struct.pack(">I", limit + 1))
    with pytest.raises(LinkError) as err:
        drain(res)
    assert err.value.kind is LinkErrorKind.TOO_LARGE


def file_figures(ran: Counter[str]) -> None:
    """One row for each group of cases, for the groups that ran."""
    decoders = ("chunking", "mutated_noise", "mutated_plaintext", "random_record",
                "mutated_record")
    if any(ran[k] for k in decoders):
        record("link_decoders", kind="hostile",
               tried="frames and records: any chunking of a real stream, random and mutated "
                     "bytes (flip, delete, insert, truncate, duplicate, reverse), random and "
                     "mutated record bodies",
               times=sum(ran[k] for k in decoders),
               outcome="only LinkError or RecordError, never another exception; an "
                       "encrypted link yielded only records the peer sent, in order",
               tokens_lost=None, failed_clear=None, **dict(ran))
    handshakes = ("replay", "truncated_handshake", "handshake_length")
    if any(ran[k] for k in handshakes):
        record("handshake", kind="hostile",
               tried="replayed first message, replayed reply, replayed and reordered frames; "
                     "the handshake cut at every byte; handshake frames of the wrong length",
               times=sum(ran[k] for k in handshakes),
               outcome="every replay refused (the replayer cannot use what it opens); every "
                       "cut ends in a link error at EOF; a wrong length is refused on its 2 "
                       "bytes",
               tokens_lost=None, failed_clear=None)
    if ran["huge_claim"]:
        record("claimed_sizes", kind="hostile",
               tried="records claimed at 8 MiB+1, 2 GiB and 4 GiB-1 (encrypted and "
                     "plaintext); arrays, strings, bytes, maps and extensions claimed at up "
                     "to 4 GiB inside a record",
               times=ran["huge_claim"],
               outcome=f"refused before allocation: tracemalloc's peak stayed under "
                       f"{SMALL_PEAK // 1024} KiB each time",
               tokens_lost=None, failed_clear=None)

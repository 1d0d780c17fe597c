"""The sans-IO link: two LinkConnections wired back to back, no sockets."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.link import messages as m
from engine.link.connection import (
    MAX_FRAME,
    NEED_DATA,
    Closed,
    HandshakeDone,
    LinkConnection,
    LinkError,
    LinkErrorKind,
    State,
)

TOKEN = bytes(range(32))
OTHER = bytes(range(1, 33))


def drain(conn: LinkConnection) -> list[object]:
    out = []
    while (ev := conn.next_event()) is not NEED_DATA:
        out.append(ev)
        if isinstance(ev, Closed):
            break
    return out


def pair(psk_i: bytes | None = TOKEN, psk_r: bytes | None = TOKEN):
    ini = LinkConnection(initiator=True, psk=psk_i)
    res = LinkConnection(initiator=False, psk=psk_r)
    res.receive_data(ini.initiate(now=0.0))
    events = drain(res)
    assert events == [HandshakeDone(encrypted=psk_r is not None)]
    reply = res.handshake_reply()
    if psk_i is not None:
        ini.receive_data(reply)
        assert drain(ini) == [HandshakeDone(encrypted=True)]
    assert ini.state is State.OPEN and res.state is State.OPEN
    return ini, res


@pytest.mark.parametrize("psk", [TOKEN, None])
def test_records_cross_both_ways(psk):
    ini, res = pair(psk, psk)
    hello = m.NodeHello(identity="box-a", model="m", runtime="mock", context_window=4096,
                        lanes=8)
    ini.receive_data(res.send(hello))
    assert drain(ini) == [hello]
    gen = m.Generate(session="s1", lease_ms=10_000, prompt=[1, 2, 3], max_tokens=9)
    res.receive_data(ini.send(gen) + ini.send(m.Ping(nonce=7)))
    assert drain(res) == [gen, m.Ping(nonce=7)]


def test_ciphertext_hides_the_record():
    ini, _res = pair()
    wire = ini.send(m.Generate(session="secret-session", lease_ms=1000, prompt=[5],
                               max_tokens=1))
    assert b"secret-session" not in wire


def test_byte_by_byte_delivery_reassembles():
    ini, res = pair()
    recs = [m.Tokens(ids=[i, i + 1], index=i) for i in range(20)]
    wire = b"".join(ini.send(r) for r in recs)
    got = []
    for b in wire:
        res.receive_data(bytes([b]))
        got += drain(res)
    assert got == recs


def test_large_record_spans_frames():
    ini, res = pair()
    prompt = list(range(100_000))  # ~300 KB of msgpack: several 64 KiB frames
    wire = ini.send(m.Generate(session="big", lease_ms=1000, prompt=prompt, max_tokens=1))
    assert len(wire) > 3 * MAX_FRAME
    res.receive_data(wire)
    (rec,) = drain(res)
    assert isinstance(rec, m.Generate) and rec.prompt == prompt


def test_announced_oversize_record_refused_before_buffering():
    _ini, _res = pair(None, None)
    ini_small = LinkConnection(initiator=False, psk=None, max_record=1000)
    ini_small.receive_data(struct.pack(">H", 0))
    drain(ini_small)
    # a frame that announces a 2 GiB record: refused from the 4-byte header alone
    ini_small.receive_data(struct.pack(">H", 4) + struct.pack(">I", 2_000_000_000))
    with pytest.raises(LinkError) as err:
        drain(ini_small)
    assert err.value.kind is LinkErrorKind.TOO_LARGE


def test_sender_refuses_record_over_limit():
    ini = LinkConnection(initiator=True, psk=None, max_record=64)
    ini.initiate(now=0.0)
    with pytest.raises(LinkError):
        ini.send(m.Generate(session="s", lease_ms=1000, prompt=list(range(100)), max_tokens=1))


def test_wrong_token_fails_at_the_handshake():
    ini = LinkConnection(initiator=True, psk=TOKEN)
    res = LinkConnection(initiator=False, psk=OTHER)
    res.receive_data(ini.initiate(now=0.0))
    with pytest.raises(LinkError) as err:
        drain(res)
    assert err.value.kind is LinkErrorKind.WRONG_TOKEN
    # the dialer sees the responder close during the handshake
    ini.receive_data(b"")
    with pytest.raises(LinkError) as err2:
        drain(ini)
    assert err2.value.kind is LinkErrorKind.CLOSED_AT_HANDSHAKE


def test_token_on_one_side_only_is_named():
    ini = LinkConnection(initiator=True, psk=None)
    res = LinkConnection(initiator=False, psk=TOKEN)
    res.receive_data(ini.initiate(now=0.0))
    with pytest.raises(LinkError) as err:
        drain(res)
    assert err.value.kind is LinkErrorKind.NO_TOKEN_THERE

    ini2 = LinkConnection(initiator=True, psk=TOKEN)
    res2 = LinkConnection(initiator=False, psk=None)
    res2.receive_data(ini2.initiate(now=0.0))
    with pytest.raises(LinkError) as err2:
        drain(res2)
    assert err2.value.kind is LinkErrorKind.NO_TOKEN_HERE


def test_tampered_frame_breaks_the_link():
    ini, res = pair()
    wire = bytearray(ini.send(m.Ping(nonce=1)))
    wire[5] ^= 0x40
    res.receive_data(bytes(wire))
    with pytest.raises(LinkError) as err:
        drain(res)
    assert err.value.kind is LinkErrorKind.PROTOCOL


def test_eof_between_records_is_clean_and_inside_is_not():
    ini, res = pair()
    res.receive_data(ini.send(m.Ping(nonce=1)))
    res.receive_data(b"")
    assert drain(res) == [m.Ping(nonce=1), Closed()]

    ini, res = pair()
    wire = ini.send(m.Ping(nonce=1))
    res.receive_data(wire[:-3])
    res.receive_data(b"")
    with pytest.raises(LinkError):
        drain(res)


def test_unknown_record_is_a_protocol_error():
    _ini, res = pair(None, None)
    body = b"\x92\xa4nope\x01"  # msgpack ["nope", 1]
    res.receive_data(struct.pack(">H", 4 + len(body)) + struct.pack(">I", len(body)) + body)
    with pytest.raises(LinkError) as err:
        drain(res)
    assert err.value.kind is LinkErrorKind.PROTOCOL


def test_peer_sizes_are_bounded_in_records():
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode(["tokens", [-1], 0]))
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode(["node_hello", "x" * 300, "m", "mock", 10, 1]))
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode(["stats", 0, 0, 0, 0]))  # zero lanes


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_only_raise_link_errors(data):
    res = LinkConnection(initiator=False, psk=TOKEN)
    res.receive_data(data)
    with contextlib.suppress(LinkError):
        drain(res)
    _ini, res2 = pair()
    res2.receive_data(struct.pack(">H", len(data)) + data if len(data) < MAX_FRAME else data)
    with contextlib.suppress(LinkError):
        drain(res2)

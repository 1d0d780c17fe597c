"""Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s against the published cacophony vectors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.link.noise import (
    MAX_MESSAGE,
    PROTOCOL_NAME,
    CipherState,
    HandshakeState,
    NoiseError,
)

VECTOR_FILE = Path(__file__).parent / "vectors" / "noise_nnpsk0_blake2s.json"
PROLOGUE = b"shoal-fleet/1"


def _load_vectors() -> list[dict[str, Any]]:
    data = json.loads(VECTOR_FILE.read_text())
    assert "source" in data
    vectors = [v for v in data["vectors"] if v["protocol_name"] == PROTOCOL_NAME.decode()]
    assert vectors, "no vectors for this protocol"
    return vectors


VECTORS = _load_vectors()


def _pair(
    *,
    init_psk: bytes | None = None,
    resp_psk: bytes | None = None,
    prologue: bytes = PROLOGUE,
) -> tuple[HandshakeState, HandshakeState]:
    psk = os.urandom(32)
    init = HandshakeState(initiator=True, psk=init_psk or psk, prologue=prologue)
    resp = HandshakeState(initiator=False, psk=resp_psk or psk, prologue=prologue)
    return init, resp


def _handshake() -> tuple[CipherState, CipherState, CipherState, CipherState]:
    init, resp = _pair()
    assert resp.read_message(init.write_message(b"hi")) == b"hi"
    assert init.read_message(resp.write_message(b"hello")) == b"hello"
    i_send, i_recv = init.split()
    r_send, r_recv = resp.split()
    return i_send, i_recv, r_send, r_recv


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["protocol_name"])
def test_published_vector(vector: dict[str, Any]) -> None:
    h = bytes.fromhex
    init = HandshakeState(
        initiator=True,
        psk=h(vector["init_psks"][0]),
        prologue=h(vector["init_prologue"]),
        ephemeral=h(vector["init_ephemeral"]),
    )
    resp = HandshakeState(
        initiator=False,
        psk=h(vector["resp_psks"][0]),
        prologue=h(vector["resp_prologue"]),
        ephemeral=h(vector["resp_ephemeral"]),
    )
    messages = vector["messages"]
    assert len(messages) >= 6

    # Handshake: -> psk, e   then   <- e, ee
    m0, m1 = messages[0], messages[1]
    ct = init.write_message(h(m0["payload"]))
    assert ct.hex() == m0["ciphertext"]
    assert resp.read_message(ct) == h(m0["payload"])
    assert not init.complete and not resp.complete

    ct = resp.write_message(h(m1["payload"]))
    assert ct.hex() == m1["ciphertext"]
    assert init.read_message(ct) == h(m1["payload"])

    assert init.complete and resp.complete
    assert init.handshake_hash.hex() == vector["handshake_hash"]
    assert resp.handshake_hash.hex() == vector["handshake_hash"]

    # Transport: the initiator sends the even messages, the responder the odd ones.
    i_send, i_recv = init.split()
    r_send, r_recv = resp.split()
    for index, message in enumerate(messages[2:], start=2):
        sender, receiver = (i_send, r_recv) if index % 2 == 0 else (r_send, i_recv)
        ct = sender.encrypt_with_ad(b"", h(message["payload"]))
        assert ct.hex() == message["ciphertext"], f"message {index}"
        assert receiver.decrypt_with_ad(b"", ct) == h(message["payload"])


def test_vector_file_holds_only_this_protocol() -> None:
    data = json.loads(VECTOR_FILE.read_text())
    assert {v["protocol_name"] for v in data["vectors"]} == {PROTOCOL_NAME.decode()}
    assert "mcginty/snow" in data["source"]


def test_round_trip_with_random_ephemerals() -> None:
    i_send, i_recv, r_send, r_recv = _handshake()
    for n in range(50):
        msg = os.urandom(n * 7)
        assert r_recv.decrypt_with_ad(b"", i_send.encrypt_with_ad(b"", msg)) == msg
        assert i_recv.decrypt_with_ad(b"", r_send.encrypt_with_ad(b"", msg)) == msg


def test_split_is_send_receive_from_each_side() -> None:
    i_send, i_recv, _r_send, r_recv = _handshake()
    ct = i_send.encrypt_with_ad(b"", b"x")
    with pytest.raises(NoiseError):
        i_recv.decrypt_with_ad(b"", ct)  # own direction is not the receive key
    assert r_recv.decrypt_with_ad(b"", ct) == b"x"


def test_wrong_psk_fails_at_responder() -> None:
    init, resp = _pair(init_psk=b"\x01" * 32, resp_psk=b"\x02" * 32)
    msg = init.write_message(b"hello")
    with pytest.raises(NoiseError):
        resp.read_message(msg)
    assert not resp.complete
    # A failed handshake stays failed.
    with pytest.raises(NoiseError):
        resp.write_message(b"")


def test_prologue_mismatch_fails() -> None:
    psk = os.urandom(32)
    init = HandshakeState(initiator=True, psk=psk, prologue=b"shoal-fleet/1")
    resp = HandshakeState(initiator=False, psk=psk, prologue=b"shoal-fleet/2")
    with pytest.raises(NoiseError):
        resp.read_message(init.write_message())


@pytest.mark.parametrize("length", [0, 1, 31, 32, 33, 47])
def test_truncated_first_message(length: int) -> None:
    init, resp = _pair()
    msg = init.write_message(b"")  # 32 + 16 bytes
    assert len(msg) == 48
    with pytest.raises(NoiseError):
        resp.read_message(msg[:length])


@pytest.mark.parametrize("cut", [1, 16, 17, 40])
def test_truncated_second_message(cut: int) -> None:
    init, resp = _pair()
    resp.read_message(init.write_message(b"abc"))
    msg = resp.write_message(b"abcdef")
    with pytest.raises(NoiseError):
        init.read_message(msg[:-cut])


def test_tampered_transport_does_not_advance_nonce() -> None:
    i_send, _i_recv, _r_send, r_recv = _handshake()
    first = i_send.encrypt_with_ad(b"", b"token ids 1 2 3")
    second = i_send.encrypt_with_ad(b"", b"token ids 4 5 6")
    tampered = bytes([first[0] ^ 0x01]) + first[1:]
    with pytest.raises(NoiseError):
        r_recv.decrypt_with_ad(b"", tampered)
    with pytest.raises(NoiseError):
        r_recv.decrypt_with_ad(b"", first[:-1])
    with pytest.raises(NoiseError):
        r_recv.decrypt_with_ad(b"", first[:10])
    # The failures consumed no nonce: the genuine messages still decrypt in order.
    assert r_recv.decrypt_with_ad(b"", first) == b"token ids 1 2 3"
    assert r_recv.decrypt_with_ad(b"", second) == b"token ids 4 5 6"


def test_replay_is_rejected() -> None:
    i_send, _i_recv, _r_send, r_recv = _handshake()
    ct = i_send.encrypt_with_ad(b"", b"once")
    assert r_recv.decrypt_with_ad(b"", ct) == b"once"
    with pytest.raises(NoiseError):
        r_recv.decrypt_with_ad(b"", ct)


def test_ad_is_authenticated() -> None:
    i_send, _i_recv, _r_send, r_recv = _handshake()
    ct = i_send.encrypt_with_ad(b"a", b"payload")
    with pytest.raises(NoiseError):
        r_recv.decrypt_with_ad(b"b", ct)
    assert r_recv.decrypt_with_ad(b"a", ct) == b"payload"


def test_nonce_exhaustion() -> None:
    key = os.urandom(32)
    sender, receiver = CipherState(key), CipherState(key)
    sender._n = 2**64 - 2
    receiver._n = 2**64 - 2
    ct = sender.encrypt_with_ad(b"", b"last")
    assert receiver.decrypt_with_ad(b"", ct) == b"last"
    with pytest.raises(NoiseError):
        sender.encrypt_with_ad(b"", b"one too many")
    with pytest.raises(NoiseError):
        receiver.decrypt_with_ad(b"", ct)


def test_cipher_state_nonce_layout() -> None:
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    key = os.urandom(32)
    cs = CipherState(key)
    cs.encrypt_with_ad(b"", b"")
    cs.encrypt_with_ad(b"", b"")
    nonce = b"\x00" * 4 + (2).to_bytes(8, "little")
    assert cs.encrypt_with_ad(b"ad", b"abc") == ChaCha20Poly1305(key).encrypt(nonce, b"abc", b"ad")


def test_cipher_state_without_key_passes_through() -> None:
    cs = CipherState(None)
    assert cs.encrypt_with_ad(b"", b"plain") == b"plain"
    assert cs.decrypt_with_ad(b"", b"plain") == b"plain"


def test_cipher_state_rejects_bad_key_length() -> None:
    with pytest.raises(ValueError):
        CipherState(b"short")


def test_message_size_limits() -> None:
    i_send, _i_recv, _r_send, r_recv = _handshake()
    biggest = b"\x00" * (MAX_MESSAGE - 16)
    ct = i_send.encrypt_with_ad(b"", biggest)
    assert len(ct) == MAX_MESSAGE
    assert r_recv.decrypt_with_ad(b"", ct) == biggest
    with pytest.raises(NoiseError):
        i_send.encrypt_with_ad(b"", biggest + b"\x00")
    with pytest.raises(NoiseError):
        r_recv.decrypt_with_ad(b"", ct + b"\x00")

    init, resp = _pair()
    with pytest.raises(NoiseError):
        init.write_message(b"\x00" * (MAX_MESSAGE - 48 + 1))
    # The refused payload left the handshake usable.
    msg = init.write_message(b"\x00" * (MAX_MESSAGE - 48))
    assert len(msg) == MAX_MESSAGE
    resp.read_message(msg)
    with pytest.raises(NoiseError):
        _pair()[1].read_message(b"\x00" * (MAX_MESSAGE + 1))


def test_out_of_turn() -> None:
    init, resp = _pair()
    with pytest.raises(NoiseError):
        init.read_message(b"\x00" * 48)
    with pytest.raises(NoiseError):
        resp.write_message(b"")
    msg = init.write_message(b"")
    with pytest.raises(NoiseError):
        init.write_message(b"")
    resp.read_message(msg)
    with pytest.raises(NoiseError):
        resp.read_message(msg)
    reply = resp.write_message(b"")
    init.read_message(reply)
    # Complete: no more handshake messages either way.
    for hs in (init, resp):
        with pytest.raises(NoiseError):
            hs.write_message(b"")
        with pytest.raises(NoiseError):
            hs.read_message(reply)


def test_split_and_hash_need_completion_and_split_once() -> None:
    init, resp = _pair()
    with pytest.raises(NoiseError):
        init.split()
    with pytest.raises(NoiseError):
        _ = init.handshake_hash
    resp.read_message(init.write_message())
    init.read_message(resp.write_message())
    assert init.handshake_hash == resp.handshake_hash
    assert len(init.handshake_hash) == 32
    init.split()
    with pytest.raises(NoiseError):
        init.split()


def test_psk_and_ephemeral_length_checks() -> None:
    with pytest.raises(ValueError):
        HandshakeState(initiator=True, psk=b"x" * 31, prologue=b"")
    with pytest.raises(ValueError):
        HandshakeState(initiator=True, psk=b"x" * 33, prologue=b"")
    with pytest.raises(ValueError):
        HandshakeState(initiator=True, psk=b"x" * 32, prologue=b"", ephemeral=b"e" * 31)


def test_low_order_ephemeral_rejected() -> None:
    # An all-zero public key yields an all-zero DH output: refused as NoiseError.
    init, resp = _pair()
    resp.read_message(init.write_message())
    reply = resp.write_message()
    with pytest.raises(NoiseError):
        init.read_message(b"\x00" * 32 + reply[32:])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_to_responder_only_raise_noise_error(data: bytes) -> None:
    _init, resp = _pair()
    try:
        resp.read_message(data)
    except NoiseError:
        return
    pytest.fail("random bytes were accepted as a handshake message")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_to_initiator_only_raise_noise_error(data: bytes) -> None:
    init, _resp = _pair()
    init.write_message(b"")
    try:
        init.read_message(data)
    except NoiseError:
        return
    pytest.fail("random bytes were accepted as a handshake message")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=16))
def test_random_bytes_to_transport_only_raise_noise_error(data: bytes, ad: bytes) -> None:
    cs = CipherState(b"\x07" * 32)
    with pytest.raises(NoiseError):
        cs.decrypt_with_ad(ad, data)

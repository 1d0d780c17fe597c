"""Sans-IO Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s (Noise spec rev 34).

The link between head and node runs this handshake with the fleet token as the
PSK, so a peer holding another token fails at the first message. The module
does no IO: callers frame each returned message with its 2-byte length.

    NNpsk0:
      -> psk, e
      <- e, ee
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

__all__ = [
    "MAX_MESSAGE",
    "PROTOCOL_NAME",
    "CipherState",
    "HandshakeState",
    "NoiseError",
]

PROTOCOL_NAME: bytes = b"Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s"
MAX_MESSAGE = 65535

HASHLEN = 32
DHLEN = 32
KEYLEN = 32
TAGLEN = 16
PSKLEN = 32
# 2**64-1 is reserved by the spec (rekey uses it), so it is never a usable nonce.
_MAX_NONCE = 2**64 - 1
# 4 zero bytes then the 64-bit counter little-endian: the ChaChaPoly nonce layout.
_NONCE = struct.Struct("<4xQ")

# Each message of the pattern as its tokens; the initiator writes the even ones.
_PATTERN: tuple[tuple[str, ...], ...] = (("psk", "e"), ("e", "ee"))


class NoiseError(Exception):
    """A handshake or decryption failure (a bad tag usually means another PSK)."""


def _hash(data: bytes) -> bytes:
    return hashlib.blake2s(data).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, data, hashlib.blake2s)


def _hkdf2(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    temp = _hmac(chaining_key, ikm)
    out1 = _hmac(temp, b"\x01")
    out2 = _hmac(temp, out1 + b"\x02")
    return out1, out2


def _hkdf3(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes, bytes]:
    temp = _hmac(chaining_key, ikm)
    out1 = _hmac(temp, b"\x01")
    out2 = _hmac(temp, out1 + b"\x02")
    out3 = _hmac(temp, out2 + b"\x03")
    return out1, out2, out3


class CipherState:
    """One direction of a Noise channel: a key and a 64-bit message counter."""

    __slots__ = ("_aead", "_n")

    def __init__(self, key: bytes | None) -> None:
        if key is not None and len(key) != KEYLEN:
            raise ValueError(f"a Noise cipher key is {KEYLEN} bytes, got {len(key)}")
        # One AEAD object per key: building it per message would dominate the hot path.
        self._aead: ChaCha20Poly1305 | None = None if key is None else ChaCha20Poly1305(key)
        self._n = 0

    @property
    def has_key(self) -> bool:
        return self._aead is not None

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes | memoryview) -> bytes:
        aead = self._aead
        if aead is None:
            # Spec: without a key the "ciphertext" is the plaintext (never the case
            # after MixKeyAndHash(psk), kept for fidelity to the spec).
            return bytes(plaintext)
        if len(plaintext) + TAGLEN > MAX_MESSAGE:
            raise NoiseError(f"plaintext of {len(plaintext)} bytes exceeds a Noise message")
        n = self._n
        if n >= _MAX_NONCE:
            raise NoiseError("nonce exhausted; the link must be re-established")
        ciphertext = aead.encrypt(_NONCE.pack(n), plaintext, ad)
        self._n = n + 1
        return ciphertext

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        aead = self._aead
        if aead is None:
            return ciphertext
        if len(ciphertext) > MAX_MESSAGE:
            raise NoiseError(f"ciphertext of {len(ciphertext)} bytes exceeds a Noise message")
        if len(ciphertext) < TAGLEN:
            raise NoiseError("ciphertext shorter than its authentication tag")
        n = self._n
        if n >= _MAX_NONCE:
            raise NoiseError("nonce exhausted; the link must be re-established")
        try:
            plaintext = aead.decrypt(_NONCE.pack(n), ciphertext, ad)
        except InvalidTag:
            raise NoiseError("bad authentication tag (another key, or tampered)") from None
        # Advance only on success so a forged message cannot desynchronise the peers.
        self._n = n + 1
        return plaintext


class _SymmetricState:
    __slots__ = ("_cipher", "_ck", "_h")

    def __init__(self, protocol_name: bytes) -> None:
        if len(protocol_name) <= HASHLEN:
            self._h = protocol_name.ljust(HASHLEN, b"\x00")
        else:
            self._h = _hash(protocol_name)
        self._ck = self._h
        self._cipher = CipherState(None)

    @property
    def h(self) -> bytes:
        return self._h

    def mix_key(self, ikm: bytes) -> None:
        self._ck, temp_k = _hkdf2(self._ck, ikm)
        self._cipher = CipherState(temp_k)

    def mix_hash(self, data: bytes) -> None:
        self._h = _hash(self._h + data)

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self._ck, temp_h, temp_k = _hkdf3(self._ck, ikm)
        self.mix_hash(temp_h)
        self._cipher = CipherState(temp_k)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self._cipher.encrypt_with_ad(self._h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self._cipher.decrypt_with_ad(self._h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        temp_k1, temp_k2 = _hkdf2(self._ck, b"")
        return CipherState(temp_k1), CipherState(temp_k2)


class HandshakeState:
    """Either side of an NNpsk0 handshake; feed it messages, then split()."""

    def __init__(
        self,
        *,
        initiator: bool,
        psk: bytes,
        prologue: bytes,
        ephemeral: bytes | None = None,
    ) -> None:
        if len(psk) != PSKLEN:
            raise ValueError(f"the Noise PSK must be {PSKLEN} bytes, got {len(psk)}")
        if ephemeral is not None and len(ephemeral) != DHLEN:
            raise ValueError(f"an X25519 private key is {DHLEN} bytes, got {len(ephemeral)}")
        self._initiator = initiator
        self._psk: bytes | None = bytes(psk)
        # A fixed ephemeral exists only to replay published test vectors.
        self._fixed_ephemeral = ephemeral
        self._e: X25519PrivateKey | None = None
        self._re: X25519PublicKey | None = None
        self._re_bytes = b""
        self._index = 0
        self._failed = False
        self._split_done = False
        self._ss = _SymmetricState(PROTOCOL_NAME)
        self._ss.mix_hash(prologue)

    @property
    def complete(self) -> bool:
        return self._index == len(_PATTERN) and not self._failed

    @property
    def remote_ephemeral(self) -> bytes:
        """The peer's ephemeral public key, once its first message was read (b"" before):
        a responder remembers it to refuse a copy of the same message."""
        return self._re_bytes

    @property
    def handshake_hash(self) -> bytes:
        self._require_complete()
        return self._ss.h

    def split(self) -> tuple[CipherState, CipherState]:
        self._require_complete()
        # A second split would hand out fresh nonce-0 ciphers for the same keys.
        if self._split_done:
            raise NoiseError("split() may be called only once")
        c1, c2 = self._ss.split()
        self._split_done = True
        # Keys are no longer needed once the transport ciphers exist.
        self._psk = None
        self._e = None
        return (c1, c2) if self._initiator else (c2, c1)

    def write_message(self, payload: bytes = b"") -> bytes:
        ops = self._begin(writing=True)
        ss = self._ss
        # Checked before any state changes so an oversize payload leaves us usable.
        overhead = DHLEN * ops.count("e") + TAGLEN
        if len(payload) + overhead > MAX_MESSAGE:
            raise NoiseError(f"payload of {len(payload)} bytes exceeds a Noise message")
        out = bytearray()
        for op in ops:
            if op == "psk":
                ss.mix_key_and_hash(self._require_psk())
            elif op == "e":
                if self._fixed_ephemeral is not None:
                    self._e = X25519PrivateKey.from_private_bytes(self._fixed_ephemeral)
                else:
                    self._e = X25519PrivateKey.generate()
                pub = self._e.public_key().public_bytes_raw()
                out += pub
                ss.mix_hash(pub)
                # psk modifier: e also keys the cipher, binding the PSK to it.
                ss.mix_key(pub)
            elif op == "ee":
                ss.mix_key(self._dh())
        out += ss.encrypt_and_hash(bytes(payload))
        self._index += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        ops = self._begin(writing=False)
        try:
            payload = self._read(ops, bytes(message))
        except NoiseError:
            # The transcript hash has already absorbed part of the message: this
            # handshake can never succeed, so refuse any further use of it.
            self._failed = True
            raise
        self._index += 1
        return payload

    def _read(self, ops: tuple[str, ...], message: bytes) -> bytes:
        ss = self._ss
        if len(message) > MAX_MESSAGE:
            raise NoiseError(f"handshake message of {len(message)} bytes exceeds a Noise message")
        pos = 0
        for op in ops:
            if op == "psk":
                ss.mix_key_and_hash(self._require_psk())
            elif op == "e":
                if len(message) - pos < DHLEN:
                    raise NoiseError("handshake message truncated")
                pub = message[pos : pos + DHLEN]
                pos += DHLEN
                self._re = X25519PublicKey.from_public_bytes(pub)
                self._re_bytes = pub
                ss.mix_hash(pub)
                ss.mix_key(pub)
            elif op == "ee":
                ss.mix_key(self._dh())
        rest = message[pos:]
        if len(rest) < TAGLEN:
            raise NoiseError("handshake message truncated")
        return ss.decrypt_and_hash(rest)

    def _begin(self, *, writing: bool) -> tuple[str, ...]:
        if self._failed:
            raise NoiseError("handshake already failed")
        if self._index >= len(_PATTERN):
            raise NoiseError("handshake already complete")
        # The initiator writes messages 0, 2, ...; the responder the odd ones.
        my_turn_to_write = (self._index % 2 == 0) == self._initiator
        if writing != my_turn_to_write:
            action = "write" if writing else "read"
            raise NoiseError(f"out of turn: cannot {action} handshake message {self._index}")
        return _PATTERN[self._index]

    def _dh(self) -> bytes:
        if self._e is None or self._re is None:
            raise NoiseError("ee before both ephemerals are known")
        try:
            return self._e.exchange(self._re)
        except ValueError:
            # cryptography refuses an all-zero shared secret (a low-order point).
            raise NoiseError("invalid ephemeral public key from peer") from None

    def _require_psk(self) -> bytes:
        if self._psk is None:
            raise NoiseError("PSK no longer available")
        return self._psk

    def _require_complete(self) -> None:
        if not self.complete:
            raise NoiseError("handshake not complete")

"""The link as a sans-IO object: bytes in, records out; records in, bytes out.

Wire format (DESIGN.md, "The link"): every Noise message and every transport
message is a frame with a 2-byte big-endian length. After the handshake the
decrypted frames form one byte stream of records, each a 4-byte big-endian
length followed by a msgpack record; a record may span several frames. Both
lengths are checked before anything is buffered for them.

Without a token the link is plaintext (loopback only; the adapters enforce
that). The dialer then opens with one empty frame so that a peer expecting a
Noise handshake can tell "no token" from "another token" and say so.

The dialer's first Noise message carries, as its encrypted payload, the time it was
sent (:mod:`engine.link.replay`); the responder hands that time and the dialer's
ephemeral key out with :class:`HandshakeDone`, for its adapter to refuse a copy of
a message it already took before it answers (its reply is sent only then).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

from engine.link import messages
from engine.link.noise import CipherState, HandshakeState, NoiseError
from engine.link.replay import STAMP, read_stamp, stamp

PROLOGUE = b"shoal-fleet/1"
MAX_FRAME = 65535
_TAG = 16
_MAX_PLAIN = MAX_FRAME - _TAG
_REPLY_LEN = 48  # NNpsk0's second message: a 32-byte ephemeral key + the 16-byte tag
_FIRST_LEN = _REPLY_LEN + STAMP.size  # the first one: the same, with the time sent inside
_FIRST_LEN_BEFORE_STAMPS = _REPLY_LEN  # a dialer of a Shoal from before the stamp


class LinkErrorKind(enum.Enum):
    WRONG_TOKEN = enum.auto()
    NO_TOKEN_HERE = enum.auto()  # the peer uses a token and this end has none
    NO_TOKEN_THERE = enum.auto()  # this end has a token and the peer has none
    CLOSED_AT_HANDSHAKE = enum.auto()
    PROTOCOL = enum.auto()
    TOO_LARGE = enum.auto()
    PLAINTEXT_OFF_LOOPBACK = enum.auto()  # no token here, and the peer is another machine
    OLD_PEER = enum.auto()  # the peer's handshake is that of an older Shoal
    REPLAYED = enum.auto()  # a copy of a first message already taken, or out of its time
    BACKING_OFF = enum.auto()  # a found address that failed its handshake: not dialed yet


class LinkError(Exception):
    def __init__(self, kind: LinkErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class State(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSED = "closed"


class NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()


@dataclass(frozen=True, slots=True)
class HandshakeDone:
    encrypted: bool
    # a responder's view of the dialer's first message: its ephemeral key and the time
    # it says it was sent (seconds since the epoch); b"" and None for a dialer. Facts
    # for the replay guard, not what tells one event from another.
    peer_key: bytes = field(default=b"", compare=False)
    sent_at: float | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Closed:
    """The peer closed the stream cleanly between records."""


Event = HandshakeDone | messages.Record | Closed
_LEN2 = struct.Struct(">H")
_LEN4 = struct.Struct(">I")


class LinkConnection:
    def __init__(self, *, initiator: bool, psk: bytes | None,
                 max_record: int = messages.MAX_RECORD) -> None:
        if psk is not None and len(psk) != 32:
            raise ValueError("the fleet token must be 32 bytes")
        self.initiator = initiator
        self.encrypted = psk is not None
        self.max_record = max_record
        self.state = State.HANDSHAKE
        self._hs = (HandshakeState(initiator=initiator, psk=psk, prologue=PROLOGUE)
                    if psk is not None else None)
        self._send_cs: CipherState | None = None
        self._recv_cs: CipherState | None = None
        self._inbox = bytearray()  # raw frames not yet parsed
        self._plain = bytearray()  # decrypted record stream
        self._need: int | None = None  # length of the record being assembled
        self._eof = False
        self._reply = b""

    # -- starting -------------------------------------------------------------

    def initiate(self, now: float) -> bytes:
        """The dialer's first bytes at ``now`` (this machine's clock, seconds since the
        epoch): Noise message 1 with the time inside, or the plaintext marker."""
        if not self.initiator or self.state is not State.HANDSHAKE:
            raise RuntimeError("only a dialer in the handshake state initiates")
        if self._hs is None:
            self._open()
            return _LEN2.pack(0)
        return _frame(self._hs.write_message(stamp(now)))

    # -- receiving ------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
            return
        self._inbox += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out as records."""
        return len(self._inbox) + len(self._plain)

    def next_event(self) -> Event | NeedData:
        """The next event, or NEED_DATA; raises LinkError on a broken peer."""
        if self.state is State.CLOSED:
            return Closed()
        while True:
            if self.state is State.OPEN:
                record = self._next_record()
                if record is not None:
                    return record
            frame = self._next_frame()
            if frame is None:
                if self._eof:
                    return self._on_eof()
                return NEED_DATA
            event = self._on_frame(frame)
            if event is not None:
                return event

    def _next_frame(self) -> bytes | None:
        if len(self._inbox) < 2:
            return None
        (n,) = _LEN2.unpack_from(self._inbox)
        if self.state is State.HANDSHAKE:
            # judged on the length alone: a stranger is refused before its frame is
            # waited for or buffered
            self._check_handshake_length(n)
        if len(self._inbox) < 2 + n:
            return None
        with memoryview(self._inbox) as view:
            frame = bytes(view[2:2 + n])
        del self._inbox[:2 + n]
        return frame

    def _on_frame(self, frame: bytes) -> Event | None:
        if self.state is State.HANDSHAKE:
            return self._on_handshake_frame(frame)
        if self._recv_cs is not None:
            try:
                frame = self._recv_cs.decrypt_with_ad(b"", frame)
            except NoiseError:
                raise LinkError(LinkErrorKind.PROTOCOL,
                                "a frame failed authentication; the link is not safe") from None
        if not self._plain and self._need is None and len(frame) >= 4:
            # a frame holding exactly one whole record (how every small record is sent):
            # decoded in place, without going through the record stream's buffer
            (n,) = _LEN4.unpack_from(frame)
            if len(frame) == 4 + n and n <= self.max_record:
                return _decoded(memoryview(frame)[4:])
        self._plain += frame
        return None

    def _check_handshake_length(self, n: int) -> None:
        """A handshake frame is the plaintext marker (empty) or a Noise message of the
        length its turn gives."""
        if self._hs is None:
            # plaintext responder: the dialer's marker, or a Noise message
            if n:
                raise LinkError(LinkErrorKind.NO_TOKEN_HERE,
                                "the peer uses a fleet token and this end has none")
        elif not n:
            raise LinkError(LinkErrorKind.NO_TOKEN_THERE,
                            "the peer has no fleet token and this end has one")
        elif self.initiator and n != _REPLY_LEN:
            raise LinkError(LinkErrorKind.PROTOCOL, "the peer sent a malformed handshake")
        elif not self.initiator and n == _FIRST_LEN_BEFORE_STAMPS:
            raise LinkError(LinkErrorKind.OLD_PEER, "the peer runs an older Shoal, whose "
                            "handshake carries no time; update it to this version")
        elif not self.initiator and n != _FIRST_LEN:
            raise LinkError(LinkErrorKind.PROTOCOL, "the peer sent a malformed handshake")

    def _on_handshake_frame(self, frame: bytes) -> Event | None:
        hs = self._hs
        if hs is None:  # the plaintext marker (its length was checked)
            self._open()
            return HandshakeDone(encrypted=False)
        try:
            payload = hs.read_message(frame)
        except NoiseError:
            raise LinkError(LinkErrorKind.WRONG_TOKEN, "the peer holds another fleet token") \
                from None
        if self.initiator:
            done = HandshakeDone(encrypted=True)
        else:
            sent_at = read_stamp(payload)
            if sent_at is None:  # the length was right, so only a peer with the token
                raise LinkError(LinkErrorKind.PROTOCOL, "the peer's handshake holds no time")
            done = HandshakeDone(encrypted=True, peer_key=hs.remote_ephemeral, sent_at=sent_at)
            self._reply = _frame(hs.write_message(b""))
        self._send_cs, self._recv_cs = hs.split()
        self._open()
        return done

    def handshake_reply(self) -> bytes:
        """The responder's Noise message 2, to send once HandshakeDone came out."""
        reply, self._reply = self._reply, b""
        return reply

    def _open(self) -> None:
        self.state = State.OPEN

    def _next_record(self) -> messages.Record | None:
        if self._need is None:
            if len(self._plain) < 4:
                return None
            (n,) = _LEN4.unpack_from(self._plain)
            if n > self.max_record:
                raise LinkError(LinkErrorKind.TOO_LARGE, f"the peer announced a record of {n} "
                                f"bytes (limit {self.max_record})")
            del self._plain[:4]
            self._need = n
        if len(self._plain) < self._need:
            return None
        with memoryview(self._plain) as view:  # one copy (a slice of a bytearray is two)
            body = bytes(view[:self._need])
        del self._plain[:self._need]
        self._need = None
        return _decoded(body)

    def _on_eof(self) -> Event:
        was = self.state
        self.state = State.CLOSED
        if was is State.HANDSHAKE:
            raise LinkError(LinkErrorKind.CLOSED_AT_HANDSHAKE,
                            "the peer closed the connection at the handshake")
        if self._inbox or self._plain or self._need is not None:
            raise LinkError(LinkErrorKind.PROTOCOL, "the peer closed in the middle of a record")
        return Closed()

    # -- sending --------------------------------------------------------------

    def send(self, record: messages.Record) -> bytes:
        if self.state is not State.OPEN:
            raise RuntimeError(f"cannot send in state {self.state.value}")
        body = messages.encode(record)
        if len(body) > self.max_record:
            raise LinkError(LinkErrorKind.TOO_LARGE,
                            f"record of {len(body)} bytes exceeds {self.max_record}")
        stream = _LEN4.pack(len(body)) + body
        cs = self._send_cs
        if len(stream) <= _MAX_PLAIN:
            chunk = cs.encrypt_with_ad(b"", stream) if cs is not None else stream
            return _LEN2.pack(len(chunk)) + chunk
        # a large record (a file's chunk): each frame encrypted from a view of the stream
        # and the frames joined once
        view = memoryview(stream)
        parts: list[bytes | memoryview] = []
        for i in range(0, len(stream), _MAX_PLAIN):
            piece: bytes | memoryview = view[i:i + _MAX_PLAIN]
            if cs is not None:
                piece = cs.encrypt_with_ad(b"", piece)
            parts.append(_LEN2.pack(len(piece)))
            parts.append(piece)
        return b"".join(parts)


def _decoded(body: bytes | memoryview) -> messages.Record:
    try:
        return messages.decode(body)
    except messages.RecordError as exc:
        raise LinkError(LinkErrorKind.PROTOCOL, str(exc)) from None


def _frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME:
        raise ValueError("frame too large")
    return _LEN2.pack(len(payload)) + payload

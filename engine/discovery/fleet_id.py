"""The fleet id: a one-way name for a fleet, safe to announce on a network.

mDNS TXT records carry it so a joining node can pick its own fleet's head
among several without the token ever leaving the machine. It is the first 64
bits of a personalised BLAKE2s of the token: nothing about the token can be
learned from it, and two fleets collide with negligible probability.
"""

from __future__ import annotations

import hashlib

OPEN_FLEET = "open"
"""The id of a fleet without a token (plaintext links, loopback only)."""

FLEET_ID_CHARS = 16
_PERSON = b"shoalfid"


def fleet_id(token: bytes | None) -> str:
    """16 hex characters derived one-way from ``token``; ``"open"`` without a token."""
    if token is None:
        return OPEN_FLEET
    digest = hashlib.blake2s(token, digest_size=32, person=_PERSON).hexdigest()
    return digest[:FLEET_ID_CHARS]


def is_fleet_id(text: str) -> bool:
    """Whether ``text`` has the shape of a fleet id (what a TXT record may carry)."""
    if text == OPEN_FLEET:
        return True
    return len(text) == FLEET_ID_CHARS and all(c in "0123456789abcdef" for c in text)

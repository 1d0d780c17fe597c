"""This machine's admin secret: what `shoal alias` sends to change the fleet's aliases.

An alias changes what every client of the fleet gets, so a head takes alias changes only
from whoever can read ``$SHOAL_HOME`` (the user who runs Shoal on this machine) or holds
its ``--api-key``. Coming from loopback is not enough: behind a reverse proxy on the
same machine (nginx, caddy, `tailscale serve`) every client is loopback, and a web page
reaches loopback too. The head makes the secret at start (32 random bytes, 0600) and
`shoal alias` reads it and sends it, to a head on this machine only, in ``X-Shoal-Admin``.
The app changes aliases through the engine's commands, not over HTTP.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from engine.files import hex_secret, read_secret_file, write_private

HEADER = "X-Shoal-Admin"
SECRET_BYTES = 32


class AdminSecretError(Exception):
    """The admin secret file cannot be used; the message says why and what to do."""


def admin_secret_path(home: Path) -> Path:
    return home / "fleet" / "admin.secret"


def read_admin_secret(home: Path) -> str | None:
    """The secret (64 hex characters), None when there is none yet. Reads a file: call
    it off the event loop."""
    path = admin_secret_path(home)
    raw = read_secret_file(path, "the admin secret file", AdminSecretError)
    if raw is None:
        return None
    text = raw.decode("ascii", errors="replace").strip()
    if hex_secret(text, SECRET_BYTES) is None:
        raise AdminSecretError(f"{path} does not hold an admin secret (64 hex characters); "
                               "delete it and restart Shoal to make a new one")
    return text.lower()


def load_or_make_admin_secret(home: Path) -> str:
    """The secret, made when absent (two processes racing end with the same one)."""
    existing = read_admin_secret(home)
    if existing is not None:
        return existing
    made = secrets.token_hex(SECRET_BYTES)
    path = admin_secret_path(home)
    try:
        if write_private(path, made.encode("ascii") + b"\n", replace=False):
            return made
    except OSError as exc:
        raise AdminSecretError(f"cannot write {path}: {exc.strerror}; check that "
                               f"{path.parent} is writable") from None
    again = read_admin_secret(home)  # another process made it first
    assert again is not None
    return again


def admin_secret_ok(expected: str | None, presented: str | None) -> bool:
    """Whether ``presented`` is the secret (constant-time); never without one."""
    if not expected or not presented:
        return False
    return hmac.compare_digest(expected.encode("ascii"),
                               presented.strip().lower().encode("ascii", errors="replace"))

"""The fleet token: 32 random bytes, kept as 64 hex characters.

The token never appears in a log line, a process title or an error message;
callers get bytes and print the token only when the user asks for it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_BYTES = 32


class TokenError(Exception):
    """The token file is unusable; the message names the file and the fix."""


def default_home() -> Path:
    return Path(os.environ.get("SHOAL_HOME") or Path.home() / ".shoal")


def token_path(home: Path) -> Path:
    return home / "fleet" / "token"


def parse_token(text: str, *, source: str) -> bytes:
    raw = text.strip()
    try:
        data = bytes.fromhex(raw)
    except ValueError:
        data = b""
    if len(data) != TOKEN_BYTES:
        raise TokenError(f"{source} does not hold a fleet token (64 hex characters); "
                         "make one with `shoal fleet token` and copy it there")
    return data


def read_token(path: Path) -> bytes | None:
    """The token at path, None when the file does not exist."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TokenError(f"cannot read the fleet token at {path}: {exc.strerror}; "
                         "check its permissions") from None
    return parse_token(text, source=str(path))


def write_token(path: Path, token: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, token.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def ensure_token(path: Path, *, rotate: bool = False) -> bytes:
    """The token at path, made first when absent (or replaced when rotating)."""
    if not rotate:
        existing = read_token(path)
        if existing is not None:
            return existing
    token = secrets.token_bytes(TOKEN_BYTES)
    write_token(path, token)
    return token

"""Small file helpers shared by the modules that keep state under $SHOAL_HOME."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path


def write_private(path: Path, data: bytes, *, replace: bool = True) -> bool:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename), mode 0600.
    With ``replace=False`` an existing file is kept and False is returned."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    written = True
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails when another process made it first
            except FileExistsError:
                written = False
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return written


class ExposedFileError(OSError):
    """A secret file that users other than its owner may read or change."""

    def __init__(self, path: Path, mode: int) -> None:
        super().__init__(f"{path} has mode {mode:04o}; run `chmod 600 {path}`")
        self.path = path
        self.mode = mode


PRIVATE_MAX_BYTES = 1 << 16


def read_private(path: Path, *, max_bytes: int = PRIVATE_MAX_BYTES) -> bytes | None:
    """The bytes of a secret file (at most ``max_bytes``), None when it does not exist.

    Raises ExposedFileError when group or others have any access to it: a secret
    others can read is no longer a secret, and one they can change is not ours (the
    rule ssh applies to private keys). The mode is read from the opened file, so a
    file swapped in after the check is not read. Not checked on Windows (no modes).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        if os.name != "nt":
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode & 0o077:
                raise ExposedFileError(path, mode)
        chunks: list[bytes] = []
        left = max_bytes
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 14))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_secret_file(path: Path, what: str,
                     error: Callable[[str], Exception]) -> bytes | None:
    """`read_private` for a secret a person keeps: its two failures said in one line
    each, raised as ``error(line)``. ``what`` names the file ("the fleet token file")."""
    try:
        return read_private(path)
    except ExposedFileError as exc:
        raise error(f"other users can read or change {what} {path} (mode {exc.mode:04o}); "
                    f"run `chmod 600 {path}`") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}; check its "
                    "permissions") from None


def hex_secret(text: str, size: int) -> bytes | None:
    """The ``size`` bytes that ``text`` writes in hex (blanks around them ignored), as
    Shoal keeps its secrets; None when it holds anything else."""
    try:
        data = bytes.fromhex(text.strip())
    except ValueError:
        return None
    return data if len(data) == size else None

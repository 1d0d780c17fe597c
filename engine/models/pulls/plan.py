"""The decisions of a download, as pure functions: where it resumes, what a response to a
ranged request means, and how much disk is missing."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.sizes import amount

MARGIN = 64 << 20  # kept free beyond the download: the cache's links, a log, the system
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def resume_offset(part_bytes: int, size: int) -> int:
    """Where a download of ``size`` bytes goes on from a part holding ``part_bytes``: a part
    longer than the file is not a prefix of it, so it starts over."""
    return part_bytes if 0 <= part_bytes <= size else 0


def range_header(offset: int) -> dict[str, str]:
    return {"Range": f"bytes={offset}-"} if offset > 0 else {}


def body_starts_at(status: int, content_range: str | None, asked: int) -> int | None:
    """Where the body of a response to ``Range: bytes=asked-`` begins in the file: ``asked``
    for a 206 that says so, 0 for a 200 (the server ignored the range: start over), None
    for anything else (a range that does not start where asked cannot be appended)."""
    if status == 200:
        return 0
    if status != 206 or content_range is None:
        return None
    m = _CONTENT_RANGE.match(content_range.strip())
    if m is None or int(m[1]) != asked:
        return None
    return asked


@dataclass(frozen=True, slots=True)
class Need:
    """Bytes a pull still has to write on one filesystem, and what that one has free."""

    where: str  # the folder checked, as the user knows it
    bytes: int
    free: int


def shortfall(need: Need, margin: int = MARGIN) -> int:
    """Bytes to free before the pull may start (0: there is room)."""
    if need.bytes <= 0:
        return 0
    return max(0, need.bytes + margin - need.free)


def disk_refusal(what: str, needs: list[Need], margin: int = MARGIN) -> str | None:
    """One line when a filesystem lacks room for the pull of ``what``, else None."""
    for need in needs:
        short = shortfall(need, margin)
        if short:
            return (f"pulling {what} needs {amount(need.bytes + margin)} more and "
                    f"{need.where} has {amount(need.free)} free: free {amount(short)}, or "
                    "pick a smaller quantisation")
    return None

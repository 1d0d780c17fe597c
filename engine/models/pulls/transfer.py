"""One file of a repository downloaded into its part, ``downloads/<sha256>.part``.

The part lives outside the model folder. A download goes on from what the part holds
(``Range: bytes=N-``; a server that ignores the range sends it all and the part starts
over), hashes as it writes (a part left by an earlier run is hashed first), and ends
with the file's size and sha256 checked against what the hub said:

- the bytes do not match: the part is removed, ModelMissing;
- the connection broke: the part is kept and the download goes on from it, a few times
  while it gains bytes; then ModelMissing, and the next pull resumes it;
- ``stopped()`` (every caller cancelled): PullCancelled; the caller removes the part, or
  keeps it for the next start when Shoal quits.

The bytes come from the hub, or from a machine of the fleet that keeps the file (a
:data:`Source`, engine.node.files): checked against the same sha256 either way, the
hub's, which the other machine's own pull checked.

Blocking: runs in a worker thread.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.models.errors import CANCELLED, ModelMissing, PullCancelled, one_line
from engine.models.pulls.plan import body_starts_at, range_header, resume_offset
from engine.sizes import amount

BLOCK = 1 << 20  # of a part hashed from disk
TIMEOUT_S = 60.0  # no byte for this long: the connection is taken as broken
ATTEMPTS = 4  # tries of one download in a row, each gaining bytes, before it fails

Report = Callable[[str, int, int], None]
"""A line for people (or ""), and the bytes of this file done and in all."""

Sink = Callable[[bytes], None]
"""Takes the next block of the file (raises to stop the source: cancelled, too long)."""


@dataclass(frozen=True, slots=True)
class Source:
    """Where a file's bytes come from other than the hub: ``send(wanted, offset, sink)``
    hands the file's bytes from ``offset`` to ``sink`` as they come, raising SourceBroken
    when the connection ends before the file does, ModelMissing when the source refuses."""

    where: str  # for people: "from desk (a machine of the fleet)"
    send: Callable[[Wanted, int, Sink], None]


class SourceBroken(Exception):
    """The connection ended before the file did; the part keeps what came."""


@dataclass(frozen=True, slots=True)
class Wanted:
    repo: str
    commit: str
    name: str  # the path inside the repository
    size: int
    sha256: str

    @property
    def label(self) -> str:
        return f"{self.repo}/{self.name}"


def part_path(downloads: Path, sha256: str) -> Path:
    return downloads / f"{sha256}.part"


class _StartOver(Exception):
    """The server will not go on from the part (416): it is thrown away."""


class _TooLong(Exception):
    """The body goes on past the file's size."""


class _Hashed:
    """The sha256 of a part's first ``done`` bytes, carried from one try to the next."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.done = 0

    def restart(self) -> None:
        self.digest = hashlib.sha256()
        self.done = 0

    def add(self, block: bytes) -> None:
        self.digest.update(block)
        self.done += len(block)


def fetch(wanted: Wanted, part: Path, report: Report, stopped: Callable[[], bool],
          source: Source | None = None) -> None:
    """Leave ``part`` holding the whole file, checked, or raise (see the module doc);
    its bytes from ``source``, else the hub."""
    where = f" {source.where}" if source is not None else ""
    part.parent.mkdir(parents=True, exist_ok=True)
    hashed = _Hashed()
    tries = 0
    while True:
        offset = _prepare(wanted, part, hashed, report, stopped)
        if offset == wanted.size:
            break
        before = offset
        report(f"pulling {wanted.label} ({amount(wanted.size)}){where}" if offset == 0 else
               f"resuming {wanted.label} at {amount(offset)} of {amount(wanted.size)}{where}",
               offset, wanted.size)
        try:
            if source is None:
                _stream(wanted, part, offset, hashed, report, stopped)
            else:
                _from(source, wanted, part, offset, hashed, report, stopped)
            break
        except _StartOver:
            tries += 1
            if tries >= ATTEMPTS:
                raise ModelMissing(f"the hub refuses every range of {wanted.label}; run "
                                   "again later") from None
        except SourceBroken as exc:
            tries += 1
            if hashed.done <= before or tries >= ATTEMPTS:  # a try that gained nothing
                raise ModelMissing(
                    f"the download of {wanted.label}{where} stopped at {amount(hashed.done)} "
                    f"of {amount(wanted.size)} ({exc}); run again to resume from there") \
                    from None
    _check(wanted, part, hashed, where)


def _prepare(wanted: Wanted, part: Path, hashed: _Hashed, report: Report,
             stopped: Callable[[], bool]) -> int:
    """Where this try starts: the part's length, its bytes hashed (when not yet)."""
    try:
        held = part.stat().st_size
    except FileNotFoundError:
        held = 0
    offset = resume_offset(held, wanted.size)
    if offset != held:
        _cut_to(part, offset)
    if hashed.done == offset:
        return offset
    hashed.restart()
    if offset:
        report(f"checking the {amount(offset)} of {wanted.label} pulled before", 0,
               wanted.size)
        with part.open("rb") as f:
            while hashed.done < offset:
                _stop_if(stopped)
                block = f.read(min(BLOCK, offset - hashed.done))
                if not block:
                    break
                hashed.add(block)
    return hashed.done


def _stream(wanted: Wanted, part: Path, offset: int, hashed: _Hashed, report: Report,
            stopped: Callable[[], bool]) -> None:
    import httpx2
    from huggingface_hub import get_session, hf_hub_url, hf_raise_for_status
    from huggingface_hub.utils._headers import build_hf_headers  # its token and agent

    url = hf_hub_url(wanted.repo, wanted.name, revision=wanted.commit)
    headers = {**build_hf_headers(), "Accept-Encoding": "identity", **range_header(offset)}
    try:
        with get_session().stream("GET", url, headers=headers, timeout=TIMEOUT_S,
                                  follow_redirects=True) as response:
            if response.status_code == 416 and offset > 0:  # the part is not of this file
                _cut_to(part, 0)
                hashed.restart()
                raise _StartOver
            if response.status_code >= 400:
                response.read()
                try:
                    hf_raise_for_status(response)
                except Exception as exc:
                    raise ModelMissing(
                        f"pulling {wanted.label} failed ({one_line(exc)}); check the id and "
                        "the network, then run again") from None
            start = body_starts_at(response.status_code,
                                   response.headers.get("Content-Range"), offset)
            if start is None:
                raise ModelMissing(
                    f"the hub answered {response.status_code} to a request for "
                    f"{wanted.label} from byte {offset}; run again")
            if start != offset:  # the range was ignored: the body is the whole file
                _cut_to(part, 0)
                hashed.restart()
            # as the network gives them: a block cut short by a break is kept, not dropped
            _append(wanted, part, response.iter_raw(), hashed, report, stopped)
    except httpx2.TransportError as exc:
        raise SourceBroken(one_line(exc) if str(exc) else type(exc).__name__) from None
    except OSError as exc:
        if isinstance(exc, ConnectionError):  # offline mode refused, the network down
            raise SourceBroken(one_line(exc)) from None
        raise ModelMissing(f"cannot write {part} ({exc.strerror or exc}); free disk space "
                           "or check the folder, then run again") from None
    if hashed.done < wanted.size:
        raise SourceBroken("the server ended the file early")


def _from(source: Source, wanted: Wanted, part: Path, offset: int, hashed: _Hashed,
          report: Report, stopped: Callable[[], bool]) -> None:
    """The file's bytes from ``offset`` on, as ``source`` sends them, added to the part."""
    try:
        with _Appending(wanted, part, hashed, report, stopped) as add:
            source.send(wanted, offset, add)
    except OSError as exc:
        raise ModelMissing(f"cannot write {part} ({exc.strerror or exc}); free disk space "
                           "or check the folder, then run again") from None
    if hashed.done < wanted.size:
        raise SourceBroken(f"it ended the file at {amount(hashed.done)}")


def _append(wanted: Wanted, part: Path, blocks: Iterator[bytes], hashed: _Hashed,
            report: Report, stopped: Callable[[], bool]) -> None:
    """The body's blocks added to the part."""
    with _Appending(wanted, part, hashed, report, stopped) as add:
        for block in blocks:
            add(block)


class _Appending:
    """Blocks added to the part, hashed and reported as they come (a sink); one that
    would make it longer than the file removes the part (it is not the file)."""

    def __init__(self, wanted: Wanted, part: Path, hashed: _Hashed, report: Report,
                 stopped: Callable[[], bool]) -> None:
        self.wanted, self.part, self.hashed = wanted, part, hashed
        self.report, self.stopped = report, stopped

    def __enter__(self) -> Sink:
        self.out = self.part.open("ab")
        return self.add

    def add(self, block: bytes) -> None:
        if self.stopped():
            raise PullCancelled(CANCELLED)
        if self.hashed.done + len(block) > self.wanted.size:
            raise _TooLong
        self.out.write(block)
        self.hashed.add(block)
        self.report("", self.hashed.done, self.wanted.size)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        try:
            self.out.flush()
            os.fsync(self.out.fileno())
        finally:
            self.out.close()
        if isinstance(exc, _TooLong):
            self.part.unlink(missing_ok=True)
            raise ModelMissing(
                f"{self.wanted.label} came out longer than the {amount(self.wanted.size)} "
                "the hub says; the download is corrupt, run again") from None


def _check(wanted: Wanted, part: Path, hashed: _Hashed, where: str = "") -> None:
    got = hashed.digest.hexdigest()
    if got != wanted.sha256:
        part.unlink(missing_ok=True)
        if not where:
            raise ModelMissing(
                f"{wanted.label} came out with sha256 {got[:12]}…, the hub says "
                f"{wanted.sha256[:12]}…; the download is corrupt, run again")
        raise ModelMissing(
            f"{wanted.label}{where} came out with sha256 {got[:12]}…, the hub says "
            f"{wanted.sha256[:12]}…; its copy there is damaged, so nothing was kept: "
            "remove it there (`shoal models rm`) and run again")


def _stop_if(stopped: Callable[[], bool]) -> None:
    if stopped():
        raise PullCancelled(CANCELLED)


def _cut_to(part: Path, size: int) -> None:
    with part.open("ab") as f:
        f.truncate(size)

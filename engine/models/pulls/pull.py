"""The files of one model pulled into the hub cache: the disk checked first, each file
downloaded once (shared with any other pull of it), checked, then installed and linked.

Blocking: runs in a worker thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from engine.filelock import exclusive
from engine.models.errors import CANCELLED, CancelFlag, ModelMissing, PullCancelled
from engine.models.pulls import disk, shared
from engine.models.pulls.cache import blob_path, has_blob, install_blob, link
from engine.models.pulls.hub import RepoInfo
from engine.models.pulls.plan import Need, disk_refusal, resume_offset
from engine.models.pulls.shared import Handle, Shared
from engine.models.pulls.transfer import Source, Wanted, fetch, part_path

Progress = Callable[[str, int, int], None]


def downloads_dir(home: Path) -> Path:
    return home / "downloads"


def wanted_files(info: RepoInfo, names: list[str]) -> list[Wanted]:
    out: list[Wanted] = []
    for name in names:
        f = info.file(name)
        if f.sha256 is None:
            raise ModelMissing(
                f"the hub lists no sha256 for {info.repo}/{name}, so its download could not "
                "be checked; pick another repository, or tell its owner")
        out.append(Wanted(info.repo, info.commit, name, f.size, f.sha256))
    return out


def pull_files(wanted: list[Wanted], *, home: Path, cache: Path, what: str,
               progress: Progress | None = None, cancel: CancelFlag | None = None,
               registry: Shared | None = None, source: Source | None = None) -> list[Path]:
    """The snapshot paths of ``wanted`` (one model's files), pulled where missing (from
    ``source``, else the hub). Progress counts the bytes of all of them together."""
    downloading = registry if registry is not None else shared.REGISTRY
    downloads = downloads_dir(home)
    flag = cancel if cancel is not None else CancelFlag()
    todo = [w for w in wanted if not has_blob(blob_path(cache, w.repo, w.sha256), w.size)]
    check_disk(what, todo, downloads, cache)
    total = sum(w.size for w in wanted)
    base = 0
    paths: list[Path] = []
    for w in wanted:
        flag.check()
        blob = blob_path(cache, w.repo, w.sha256)
        got = blob
        if w in todo:
            def report(line: str, done: int, _size: int, base: int = base) -> None:
                if progress is not None:
                    progress(line, base + done, total)
            work = functools.partial(_download, w, cache, downloads, source)
            # one transfer per destination: the same file pulled into another home (another
            # SHOAL_HOME in this process) is its own download
            got = downloading.run(str(blob), work, report, flag)
        try:
            paths.append(link(cache, w.repo, w.commit, w.name, w.sha256, got))
        except OSError as exc:
            raise ModelMissing(f"cannot put {w.label} into {cache} ({exc.strerror or exc}); "
                               "check the folder, then run again") from None
        base += w.size
        if progress is not None:
            progress("", base, total)
    return paths


def check_disk(what: str, todo: list[Wanted], downloads: Path, cache: Path) -> None:
    """Refuse before the first byte when the bytes still to fetch do not fit."""
    if not todo:
        return
    still = sum(w.size - resume_offset(_held(part_path(downloads, w.sha256)), w.size)
                for w in todo)
    needs = [Need(str(downloads), still, disk.free_bytes(downloads))]
    if not disk.same_filesystem(downloads, cache):  # the blob is copied across, whole
        needs.append(Need(str(cache), sum(w.size for w in todo), disk.free_bytes(cache)))
    line = disk_refusal(what, needs)
    if line is not None:
        raise ModelMissing(line)


def _held(part: Path) -> int:
    try:
        return part.stat().st_size
    except FileNotFoundError:
        return 0


def _download(w: Wanted, cache: Path, downloads: Path, source: Source | None,
              handle: Handle) -> Path:
    """The blob of ``w`` in the cache: downloaded into its part under the part's lock (a
    second process waits there, then finds the blob), checked, moved in."""
    part = part_path(downloads, w.sha256)
    blob = blob_path(cache, w.repo, w.sha256)
    try:
        with exclusive(part):
            if handle.stopped():
                raise PullCancelled(CANCELLED)
            handle.holding()
            if has_blob(blob, w.size):  # another process pulled it meanwhile
                return blob
            try:
                fetch(w, part, handle.report, handle.stopped, source)
            except PullCancelled:
                if not handle.keeps_part():  # a cancel keeps nothing; quitting keeps it
                    part.unlink(missing_ok=True)
                raise
            install_blob(part, blob)
    except OSError as exc:
        raise ModelMissing(f"cannot write {w.label} under {downloads} or {cache} "
                           f"({exc.strerror or exc}); check the folders, then run again") \
            from None
    return blob

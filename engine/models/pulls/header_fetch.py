"""A model's GGUF header fetched from the hub without its tensors, for a head's tokenizer.

A head needs only the vocabulary and the chat template of a model some fleet node
serves, and both sit in the file's header (megabytes of a file of gigabytes). So the
header alone is fetched, with ranged GETs of the file's start that grow until
`gguf_header` says it is whole, and written to a sparse file of the file's full size:
llama.cpp's vocabulary load checks every tensor against the file's size but reads no
tensor data, so the zeros past the header are never read.

    $SHOAL_HOME/models/headers/models--org--repo/<commit>/header-only.<file name>

Outside ``models/hub``, so no pull ever takes it for the model, and never listed as a
model kept here. A split model gets the header of every shard (llama.cpp opens them all,
even for the vocabulary), each named as its shard so llama.cpp finds the next. Each is
written whole or not at all (a temporary name, then a rename). A hub that answers a range
with the whole file gets nothing from us: the head then cannot serve the model without
its file, and says so in one line. On a file system without sparse files (exFAT, FAT)
the zeros would be written out, as many as the hub claims the file holds: there the
header is not fetched at all, and the line says to pull the model.

Blocking: runs in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from engine.models import ids
from engine.models.errors import ModelMissing, one_line
from engine.models.pulls.cache import fsync_dir, repo_dir
from engine.models.pulls.gguf_header import MAX_HEADER_BYTES, Complete, HeaderError, header_extent
from engine.models.pulls.hub import HubUnreachable, RepoInfo, repo_info
from engine.models.pulls.plan import body_starts_at
from engine.sizes import amount

FIRST_BYTES = 2 << 20  # a small model's header is under 2 MB; a large vocabulary's, ~20
TIMEOUT_S = 30.0  # no byte for this long: the hub is taken as gone
DEADLINE_S = 120.0  # one file's header in all: a hub that trickles is given up on
PREFIX = "header-only."


class NoRange(ModelMissing):
    """The hub does not serve part of a file: only the whole model would do."""


@dataclass(frozen=True, slots=True)
class HeaderFile:
    path: Path  # what a head's vocabulary load is given (the first shard's)
    fetched: int  # bytes of the model fetched this time (0: found on disk)
    size: int  # the model's files in all, as the hub gives them


def headers_dir(home: Path) -> Path:
    return ids.models_dir(home) / "headers"


def header_path(home: Path, repo: str, commit: str, name: str) -> Path:
    return (repo_dir(headers_dir(home), repo) / commit
            / (PREFIX + PurePosixPath(name).name))


def fetch_header(spec: str, *, home: Path, offline: bool = False) -> HeaderFile:
    """The header file of the hub model ``spec`` (org/repo[:QUANT]), fetched unless it is
    here already. ModelMissing (one line) when it cannot be had."""
    try:
        mid = ids.parse_model_id(spec)
    except ValueError as exc:
        raise ModelMissing(str(exc)) from None
    if offline:
        return _on_disk(mid, home, why="offline")
    with contextlib.suppress(ModelMissing):  # fetched before: no need to ask the hub
        return _on_disk(mid, home, why="")
    try:
        info = repo_info(mid.repo)
    except HubUnreachable as exc:
        return _on_disk(mid, home, why=f"the hub is unreachable ({exc})")
    chosen = ids.pick_gguf(info.names, mid.quant)
    fetched = 0
    names = ids.shards_of(info.names, chosen)
    for name in names:
        fetched += _one(info, name, home)
    return HeaderFile(header_path(home, info.repo, info.commit, chosen), fetched,
                      sum(info.file(n).size for n in names))


def _on_disk(mid: ids.ModelId, home: Path, *, why: str) -> HeaderFile:
    """A header fetched before, when the hub cannot be asked."""
    folder = repo_dir(headers_dir(home), mid.repo)
    commits = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True) \
        if folder.is_dir() else []
    for commit in commits:
        names = [p.name[len(PREFIX):] for p in commit.glob(PREFIX + "*") if p.is_file()]
        try:
            chosen = ids.pick_gguf(names, mid.quant)
        except ids.ModelChoiceError:
            continue
        path = commit / (PREFIX + chosen)
        return HeaderFile(path, 0, path.stat().st_size)
    raise ModelMissing(f"{why}, and the header of {mid} was never fetched here; run again "
                       "with the network")


SPARSE_PROBE = 64 << 20  # a hole this large takes no block where files may be sparse
_sparse: dict[Path, bool] = {}  # per folder, probed once per process


def sparse_files(folder: Path) -> bool:
    """Whether a file in ``folder`` can hold a hole without writing it out."""
    if folder not in _sparse:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".sparse-probe.{os.getpid()}.{threading.get_ident()}"
        try:
            with probe.open("wb") as f:
                f.truncate(SPARSE_PROBE)
                _sparse[folder] = os.fstat(f.fileno()).st_blocks * 512 < SPARSE_PROBE // 2
        finally:
            probe.unlink(missing_ok=True)
    return _sparse[folder]


def _one(info: RepoInfo, name: str, home: Path) -> int:
    """The header of one file in place; the bytes fetched for it."""
    size = info.file(name).size
    target = header_path(home, info.repo, info.commit, name)
    if target.is_file() and target.stat().st_size == size:
        return 0
    label = f"{info.repo}/{name}"
    got, done = _read_header(info, name, size, label)
    try:
        sparse = sparse_files(target.parent)
    except OSError as exc:
        raise ModelMissing(f"cannot write the header of {label} under {target.parent} "
                           f"({exc.strerror or exc}); check the folder, then run again") \
            from None
    if not sparse:
        raise ModelMissing(f"{target.parent} is on a file system without sparse files, where "
                           f"reading the tokenizer of {label} would write {amount(size)} of "
                           "zeros; pull the model on this machine to serve it here")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("wb") as out:
            out.write(got[:done.size])
            out.truncate(size)  # a hole: the file's size without its tensors' bytes
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ModelMissing(f"cannot write the header of {label} under {target.parent} "
                           f"({exc.strerror or exc}); check the folder, then run again") \
            from None
    fsync_dir(target.parent)
    return len(got)


def _read_header(info: RepoInfo, name: str, size: int, label: str
                 ) -> tuple[bytearray, Complete]:
    """The file's first bytes, as many as its header takes (growing ranges)."""
    from huggingface_hub import hf_hub_url

    url = hf_hub_url(info.repo, name, revision=info.commit)
    got = bytearray()
    want = min(FIRST_BYTES, size)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        _get_range(url, got, want, label, deadline)
        try:
            found = header_extent(got, file_size=size)
        except HeaderError as exc:
            raise ModelMissing(f"{label}: {exc}") from None
        if isinstance(found, Complete):
            return got, found
        if len(got) >= size:
            raise ModelMissing(f"{label} ends inside its own header; the file on the hub is "
                               "damaged, pick another")
        want = min(size, MAX_HEADER_BYTES, max(len(got) + found.at_least, 2 * len(got)))


def _get_range(url: str, got: bytearray, end: int, label: str, deadline: float) -> None:
    """Bytes ``len(got)`` to ``end`` of the file at ``url`` added to ``got``; never more,
    whatever the server sends, and never past ``deadline`` (a monotonic time)."""
    import httpx2
    from huggingface_hub import get_session, hf_raise_for_status
    from huggingface_hub.utils._headers import build_hf_headers  # its token and agent

    start = len(got)
    headers = {**build_hf_headers(), "Accept-Encoding": "identity",
               "Range": f"bytes={start}-{end - 1}"}
    try:
        with get_session().stream("GET", url, headers=headers, timeout=TIMEOUT_S,
                                  follow_redirects=True) as response:
            if response.status_code >= 400:
                response.read()
                try:
                    hf_raise_for_status(response)
                except Exception as exc:
                    raise ModelMissing(f"fetching the header of {label} failed "
                                       f"({one_line(exc)}); check the id and the network, "
                                       "then run again") from None
            if response.status_code != 206 or body_starts_at(
                    206, response.headers.get("Content-Range"), start) != start:
                raise NoRange(f"the hub sends no part of {label} (it answered "
                              f"{response.status_code} to a range), so this head cannot "
                              "read its tokenizer without the whole model; pull the model "
                              "on this machine to serve it here")
            for block in response.iter_raw():
                got += block[:end - len(got)]
                if len(got) >= end:
                    break
                if time.monotonic() > deadline:
                    raise ModelMissing(f"the hub sent the header of {label} too slowly "
                                       f"({amount(len(got))} in {DEADLINE_S:.0f} s); check "
                                       "the network, then run again")
    except httpx2.TransportError as exc:
        raise ModelMissing(f"fetching the header of {label} broke off "
                           f"({one_line(exc) if str(exc) else type(exc).__name__}); check "
                           "the network, then run again") from None
    if len(got) < end:
        raise ModelMissing(f"the hub ended the header of {label} at {amount(len(got))} of "
                           f"{amount(end)}; run again")

"""The hub's cache layout under ``$SHOAL_HOME/models/hub``, as huggingface_hub keeps it:

    models--org--repo/blobs/<sha256>                 the file, named by its content
    models--org--repo/snapshots/<commit>/<name>      a relative link to its blob
    models--org--repo/refs/main                      the commit main points at

A blob arrives whole (renamed from its checked part, or copied beside it first when the
downloads folder is on another filesystem), so the model folder never holds half a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from pathlib import Path

from engine.files import write_private


def repo_dir(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


def blob_path(cache: Path, repo: str, sha256: str) -> Path:
    return repo_dir(cache, repo) / "blobs" / sha256


def snapshot_path(cache: Path, repo: str, commit: str, name: str) -> Path:
    return repo_dir(cache, repo) / "snapshots" / commit / name


def main_commit(cache: Path, repo: str) -> str | None:
    try:
        return (repo_dir(cache, repo) / "refs" / "main").read_text().strip() or None
    except OSError:
        return None


def has_blob(blob: Path, size: int) -> bool:
    """A finished blob: only checked parts are ever renamed to one, so its size says it."""
    try:
        return blob.is_file() and blob.stat().st_size == size
    except OSError:
        return False


def install_blob(part: Path, blob: Path) -> None:
    """Move a checked part into place as ``blob``."""
    blob.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(part, blob)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        _copy_in(part, blob)
        part.unlink()
    os.chmod(blob, 0o644)  # a model is not a secret
    fsync_dir(blob.parent)


def _copy_in(source: Path, blob: Path) -> None:
    """``source`` copied to ``blob`` through a temporary name beside it."""
    tmp = blob.with_name(f".{blob.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with source.open("rb") as src, tmp.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, blob)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def link(cache: Path, repo: str, commit: str, name: str, sha256: str,
         source: Path | None = None) -> Path:
    """The snapshot path of ``name`` at ``commit``, linked to its blob, with ``refs/main``
    at ``commit``. ``source``: the same content as a blob of another repository (a shared
    download), hard-linked or copied in when this repository has no such blob yet."""
    blob = blob_path(cache, repo, sha256)
    if source is not None and source != blob and not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, blob)
        except FileExistsError:
            pass
        except OSError:
            _copy_in(source, blob)
    snap = snapshot_path(cache, repo, commit, name)
    snap.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob, snap.parent)
    if not (snap.is_symlink() and os.readlink(snap) == target):
        tmp = snap.with_name(f".{snap.name}.{os.getpid()}.{threading.get_ident()}.link")
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, snap)
    if main_commit(cache, repo) != commit:
        write_private(repo_dir(cache, repo) / "refs" / "main", commit.encode())
    return snap


def fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable (POSIX; a no-op where it cannot be)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

"""The hub cache layout a pull installs into (engine/models/pulls/cache.py): a blob named by its
sha256, a relative link to it in the commit's snapshot, refs/main; and --offline reading
it (engine.models.cache.resolve_model)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from engine.models import cache as model_cache
from engine.models import errors as model_errors
from engine.models.pulls import cache

SHA = "ab" * 32
COMMIT = "1" * 40
REPO = "org/repo-GGUF"


def test_a_blob_goes_in_whole_and_its_snapshot_links_to_it(tmp_path: Path) -> None:
    hub = tmp_path / "models" / "hub"
    part = tmp_path / "downloads" / f"{SHA}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"GGUF model")
    blob = cache.blob_path(hub, REPO, SHA)
    cache.install_blob(part, blob)
    assert not part.exists() and blob.read_bytes() == b"GGUF model"
    snap = cache.link(hub, REPO, COMMIT, "sub/m-Q4_K_M.gguf", SHA)
    assert snap == hub / "models--org--repo-GGUF" / "snapshots" / COMMIT / "sub" / \
        "m-Q4_K_M.gguf"
    assert os.readlink(snap) == "../../../blobs/" + SHA  # relative: the cache can move
    assert snap.read_bytes() == b"GGUF model"
    assert cache.main_commit(hub, REPO) == COMMIT
    assert cache.link(hub, REPO, COMMIT, "sub/m-Q4_K_M.gguf", SHA) == snap  # idempotent
    got = model_cache.resolve_model(f"{REPO}:Q4_K_M", home=tmp_path, offline=True)
    assert got == snap


def test_a_blob_from_another_filesystem_is_copied_in(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    part = tmp_path / "part"
    part.write_bytes(b"x" * 3000)
    real = os.replace

    def across(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        if Path(src) == part:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real(src, dst)

    monkeypatch.setattr(os, "replace", across)
    blob = cache.blob_path(tmp_path / "hub", REPO, SHA)
    cache.install_blob(part, blob)
    assert blob.read_bytes() == b"x" * 3000 and not part.exists()
    assert sorted(p.name for p in blob.parent.iterdir()) == [SHA]  # no temporary left


def test_the_same_file_in_another_repository_is_linked_not_fetched(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    first = cache.blob_path(hub, REPO, SHA)
    first.parent.mkdir(parents=True)
    first.write_bytes(b"same bytes")
    snap = cache.link(hub, "other/repo", COMMIT, "m.gguf", SHA, source=first)
    other = cache.blob_path(hub, "other/repo", SHA)
    assert snap.read_bytes() == b"same bytes" and other.stat().st_ino == first.stat().st_ino


def test_a_snapshot_whose_blob_is_gone_is_not_in_the_cache(tmp_path: Path) -> None:
    hub = tmp_path / "models" / "hub"
    cache.link(hub, REPO, COMMIT, "m-Q4_K_M.gguf", SHA)  # a link to no blob
    with pytest.raises(model_errors.ModelMissing, match="not in the cache"):
        model_cache.resolve_model(f"{REPO}:Q4_K_M", home=tmp_path, offline=True)

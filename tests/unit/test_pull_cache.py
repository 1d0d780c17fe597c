"""The hub cache layout a pull installs into (engine/models/pulls/cache.py): a blob named by its
sha256, a relative link to it in the commit's snapshot, refs/main; and --offline reading
it (engine.models.cache.resolve_model)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.models import cache as model_cache
from engine.models import errors as model_errors
from engine.models.pulls import cache
from engine.models.pulls import peers as fleet_peers
from engine.models.pulls.hub import HubUnreachable
from engine.models.pulls.peers import PeerOffer
from engine.models.pulls.transfer import Source, Wanted

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


class Keeps:
    """A machine of the fleet that keeps ``sizes`` (its model's shards), or none."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes
        self.asked: list[tuple[str, str | None]] = []

    def offer(self, repo: str, quant: str | None,
              stopped: Callable[[], bool]) -> PeerOffer | None:
        self.asked.append((repo, quant))
        if not self.sizes:
            return None
        wanted = [Wanted(repo, COMMIT, f"m-{i}.gguf", size, SHA)
                  for i, size in enumerate(self.sizes)]
        return PeerOffer(wanted, Source("from desk", lambda *_: None))


def unreachable(repo: str) -> object:
    raise HubUnreachable("[Errno 111] Connection refused")


def test_a_model_is_sized_by_the_machine_of_the_fleet_it_is_pulled_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_cache, "repo_info", unreachable)  # the hub: never reached
    desk = Keeps(3000, 500)
    with fleet_peers.fleet_for(desk):
        assert model_cache.pull_size(f"{REPO}:Q4_K_M", home=tmp_path, offline=False) == 3500
    assert desk.asked == [(REPO, "Q4_K_M")]


def test_without_a_machine_that_keeps_it_the_hub_sizes_it_and_says_when_it_cannot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_cache, "repo_info", unreachable)
    nobody = Keeps()
    with fleet_peers.fleet_for(nobody), \
            pytest.raises(model_errors.ModelMissing, match="could not reach the Hugging Face "
                                                           "hub to size"):
        model_cache.pull_size(f"{REPO}:Q4_K_M", home=tmp_path, offline=False)
    assert nobody.asked == [(REPO, "Q4_K_M")]

"""A model spec made a file on this machine: a path as it is, a hub id found in the cache
``$SHOAL_HOME/models/hub`` (the hub's own layout, which ``--offline`` reads) or pulled
into it by :mod:`engine.models.pulls`: checked against the hub's sha256, resumable, shared.

Every expected failure is a :class:`ModelMissing` whose message is one line naming the
cause and the fix, so the CLI can print it without a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from engine.models.errors import CancelFlag, ModelMissing
from engine.models.ids import (
    ModelChoiceError,
    ModelId,
    imported_path,
    looks_like_path,
    models_dir,
    parse_model_id,
    pick_gguf,
    shards_of,
)
from engine.models.pulls import peers as fleet_peers
from engine.models.pulls.cache import main_commit, repo_dir, snapshot_path
from engine.models.pulls.hub import HubUnreachable, repo_info
from engine.models.pulls.pull import pull_files, wanted_files

Progress = Callable[[str, int, int], None]
"""What a pull reports: a line for people, and bytes done and in all (0 when unknown)."""


# --- resolving a model spec -------------------------------------------------


class HubId(str):
    """A model name that came over a fleet link: a hub id, never a path on this machine
    (``etc/hostname`` has the shape of org/repo)."""

    __slots__ = ()


def resolve_model(
    spec: str, *, home: Path, offline: bool, progress: Progress | None = None,
    cancel: CancelFlag | None = None,
) -> Path:
    """A local file or directory as it is (unless ``spec`` is a :class:`HubId`); a hub id
    pulled (or found in the cache)."""
    local = Path(spec).expanduser()
    if not isinstance(spec, HubId) and local.exists():
        return local
    imported = imported_path(home, spec)
    if not isinstance(spec, HubId) and imported is not None and imported.is_file():
        return imported
    if looks_like_path(spec):
        raise ModelMissing(
            f"model file {local} does not exist; check the path, or give a Hugging Face "
            "id such as org/repo:Q4_K_M"
        )
    try:
        mid = parse_model_id(spec)
    except ValueError as exc:
        raise ModelMissing(f"{exc}, a path to an existing .gguf file, or the name of one "
                           "`shoal models import` kept") from None
    cache = models_dir(home) / "hub"
    if offline or _hub_offline_env():
        found = _from_cache(mid, cache)
        if found is None:
            raise ModelMissing(
                f"model {mid} is not in the cache at {cache}; run once without --offline to pull it"
            )
        return found
    return _pull(mid, cache, progress, cancel)


def _hub_offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "on", "yes", "true"}


def _snapshot_files(mid: ModelId, cache: Path) -> list[str]:
    """Files of the cached snapshot that ``main`` points at (hub cache layout)."""
    commit = main_commit(cache, mid.repo)
    if commit is None:
        return []
    snap = repo_dir(cache, mid.repo) / "snapshots" / commit
    if not snap.is_dir():
        return []
    # is_file follows the links to the blobs: a link whose blob is gone is no file
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def _from_cache(mid: ModelId, cache: Path) -> Path | None:
    """The model's first file in the snapshot ``refs/main`` names, every shard there."""
    files = _snapshot_files(mid, cache)
    try:
        chosen = pick_gguf(files, mid.quant)
    except ModelChoiceError:
        return None
    commit = main_commit(cache, mid.repo)
    assert commit is not None  # there are files
    return snapshot_path(cache, mid.repo, commit, chosen)


def _pull(mid: ModelId, cache: Path, progress: Progress | None,
          cancel: CancelFlag | None = None) -> Path:
    """The model's files pulled through engine.models.pulls (checked, resumable, shared):
    from a machine of the fleet that keeps them, else from the hub."""
    from_fleet: ModelMissing | None = None
    try:
        found = _from_fleet(mid, cache, progress, cancel)
    except ModelMissing as exc:  # the hub may still have it whole
        say(progress, str(exc))
        from_fleet = exc
    else:
        if found is not None:
            return found
    try:
        import huggingface_hub  # noqa: F401  # only to say so when it is missing
    except ImportError:
        raise ModelMissing(
            f"pulling {mid} needs huggingface-hub, which is not installed; "
            "run: pip install 'shoal[hub]'"
        ) from None
    try:
        info = repo_info(mid.repo)
    except HubUnreachable as exc:
        # the network is down: a model pulled earlier still serves
        found = _from_cache(mid, cache)
        if found is not None:
            say(progress, f"hub unreachable ({exc}); using the cached {found.name}")
            return found
        if from_fleet is not None:
            raise from_fleet from None
        raise ModelMissing(
            f"could not reach the Hugging Face hub to pull {mid} ({exc}); "
            "check the network, then run again"
        ) from None
    chosen = pick_gguf(info.names, mid.quant)
    wanted = wanted_files(info, shards_of(info.names, chosen))
    # the cache is <home>/models/hub
    paths = pull_files(wanted, home=cache.parent.parent, cache=cache,
                       what=f"{mid.repo}/{chosen}", progress=progress, cancel=cancel)
    return paths[0]


def _from_fleet(mid: ModelId, cache: Path, progress: Progress | None,
                cancel: CancelFlag | None) -> Path | None:
    """The model's files taken from a machine of the fleet that keeps them (None: no
    machine answered with them)."""
    peers = fleet_peers.current()
    if peers is None:
        return None
    flag = cancel if cancel is not None else CancelFlag()
    offer = peers.offer(mid.repo, mid.quant, lambda: flag.requested)
    if offer is None:
        return None
    paths = pull_files(offer.wanted, home=cache.parent.parent, cache=cache,
                       what=f"{mid.repo}/{offer.wanted[0].name}", progress=progress,
                       cancel=flag, source=offer.source)
    return paths[0]


def pull_size(spec: str, *, home: Path, offline: bool) -> int:
    """The bytes the hub model ``spec`` takes on disk once pulled; 0 when it is in the cache
    already (or offline, where nothing is pulled). Asks where the pull takes it from: a
    machine of the fleet that keeps it (those the pull would ask, in this context), else
    the hub. Blocking. ModelMissing (one line) when neither can say."""
    try:
        mid = parse_model_id(spec)
    except ValueError as exc:
        raise ModelMissing(str(exc)) from None
    cache = models_dir(home) / "hub"
    if offline or _hub_offline_env() or _from_cache(mid, cache) is not None:
        return 0
    peers = fleet_peers.current()
    offer = peers.offer(mid.repo, mid.quant, lambda: False) if peers is not None else None
    if offer is not None:
        return sum(w.size for w in offer.wanted)
    try:
        info = repo_info(mid.repo)
    except HubUnreachable as exc:
        raise ModelMissing(f"could not reach the Hugging Face hub to size {mid} ({exc}); "
                           "check the network, then ask again") from None
    chosen = pick_gguf(info.names, mid.quant)
    return sum(info.file(name).size for name in shards_of(info.names, chosen))


def say(progress: Progress | None, line: str) -> None:
    if progress is not None:
        progress(line, 0, 0)

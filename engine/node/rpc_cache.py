"""The tensors a lending machine keeps for the fleet's split models: llama.cpp's RPC tensor
cache (``$SHOAL_HOME/rpc-cache``, one file per tensor, named by its hash), so that a split
that forms again sends no weight twice.

It is disk the fleet takes on this machine, so it shares the owner's quota for what the
fleet may keep here (``[node] fleet_models_quota``, engine.models.pulls.quota) with the
models heads chose: within the quota less what those models take, the least recently
used tensors go first (a tensor removed is sent again by the next split that needs it).
:func:`over` decides (pure); :func:`trim` does the IO (blocking: run it off the loop).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.models import ids
from engine.models import store as model_store
from engine.models.pulls import disk
from engine.models.pulls.quota import Quota, quota_bytes
from engine.sizes import amount

log = logging.getLogger("shoal.node")


@dataclass(frozen=True, slots=True)
class Cached:
    path: Path
    size: int
    used: float  # when last read or written (the later of its access and change times)


def over(files: Sequence[Cached], limit: int) -> list[Path]:
    """The files to remove, least recently used first, for the rest to take at most
    ``limit`` bytes."""
    excess = sum(f.size for f in files) - max(limit, 0)
    out: list[Path] = []
    for f in sorted(files, key=lambda f: (f.used, f.path)):
        if excess <= 0:
            break
        out.append(f.path)
        excess -= f.size
    return out


def scan(cache: Path) -> list[Cached]:
    out: list[Cached] = []
    try:
        entries = list(os.scandir(cache))
    except FileNotFoundError:
        return out
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if entry.is_file(follow_symlinks=False):
            out.append(Cached(Path(entry.path), st.st_size, max(st.st_atime, st.st_mtime)))
    return out


def fleet_models_bytes(home: Path) -> int:
    """What the models a head of the fleet chose take on this machine's disk now."""
    return sum(m.size for m in model_store.fleet_models(home))


def trim(home: Path, cache: Path, quota: Quota) -> int:
    """Remove the least recently used tensors past the fleet's quota; the bytes freed."""
    folder = ids.models_dir(home)
    limit = quota_bytes(quota, disk.total_bytes(folder)) - fleet_models_bytes(home)
    freed = 0
    for path in over(scan(cache), limit):
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        freed += size
    if freed:
        log.info("removed %s of tensors kept for the fleet's split models, to stay within "
                 "what the fleet may keep here (%s)", amount(freed), amount(max(limit, 0)))
    return freed

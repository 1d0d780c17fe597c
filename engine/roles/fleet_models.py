"""Room on this machine's disk for a model a head of the fleet chose: sized on the hub,
weighed against the owner's quota (engine.models.pulls.quota decides), and the fleet models that
must go removed. Blocking file and network IO: run it off the event loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.models import cache as model_cache
from engine.models import errors as model_errors
from engine.models import ids
from engine.models import store as model_store
from engine.models.pulls import disk
from engine.models.pulls.quota import Quota, make_room, quota_bytes
from engine.runtimes import registry
from engine.runtimes.base import RuntimeUnavailable

log = logging.getLogger("shoal")


@dataclass(frozen=True, slots=True)
class Made:
    """What making room came to: the bytes the pull brings (0: kept already, so it is no
    new fleet model), or why it cannot be had (one line)."""

    need: int = 0
    refusal: str | None = None


def room_for(spec: str, *, home: Path, offline: bool, quota: Quota, runtime: str | None,
             serving: str) -> Made:
    """Make room for ``spec`` among the fleet models kept here within ``quota``, never
    removing ``serving`` (the model this node serves) nor a model the owner used. Only a
    runtime that keeps its pulls in Shoal's cache has fleet models to weigh."""
    try:
        if not registry.keeps_pulls(registry.pick_runtime(runtime, spec)):
            return Made()
    except RuntimeUnavailable:
        return Made()  # the pull says so, in its own words
    try:
        need = model_cache.pull_size(spec, home=home, offline=offline)
    except model_errors.ModelMissing as exc:
        return Made(refusal=str(exc))
    if need == 0:
        return Made()
    fleet = model_store.fleet_models(home, serving)
    folder = ids.models_dir(home)
    room = make_room(fleet, quota_bytes(quota, disk.total_bytes(folder)), need, spec)
    if room.refusal is not None:
        return Made(need, room.refusal)
    for name in room.evict:
        try:
            model_store.remove(home, name)
        except (model_store.ModelInUse, model_store.ModelNotKept) as exc:
            return Made(need, f"could not remove {name} to make room for {spec} ({exc})")
        log.info("removed %s, which a head of the fleet chose, to make room for %s",
                 name, spec)
    return Made(need)

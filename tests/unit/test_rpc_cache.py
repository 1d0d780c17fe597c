"""The tensors a lending machine keeps for the fleet's split models stay within what the
fleet may keep on its disk, beside the models heads chose (engine.node.rpc_cache): the
least recently used go first."""

from __future__ import annotations

import os
from pathlib import Path

from engine.models import store as model_store
from engine.node import rpc_cache
from engine.node.rpc_cache import Cached, over
from engine.sizes import MiB
from tests.e2e.conftest import smollm2_gguf  # noqa: F401  # a real GGUF to keep


def test_the_least_recently_used_go_until_the_rest_fits() -> None:
    files = [Cached(Path("c"), 3, used=30.0), Cached(Path("a"), 4, used=10.0),
             Cached(Path("b"), 2, used=20.0)]
    assert over(files, 9) == []
    assert over(files, 8) == [Path("a")]
    assert over(files, 4) == [Path("a"), Path("b")]
    assert over(files, 0) == [Path("a"), Path("b"), Path("c")]
    assert over(files, -5) == [Path("a"), Path("b"), Path("c")]  # the models took it all


def tensors(cache: Path, *ages: float) -> list[Path]:
    """A tensor file of 1 MiB per age (seconds ago it was last used), oldest first."""
    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for i, age in enumerate(ages):
        path = cache / f"{i:016x}"
        path.write_bytes(b"\0" * MiB)
        when = 1_700_000_000 - age
        os.utime(path, (when, when))
        out.append(path)
    return out


def test_the_cache_shares_the_fleets_quota_with_the_models_heads_chose(
        tmp_path: Path, smollm2_gguf: Path) -> None:  # noqa: F811
    home = tmp_path / "home"
    cache = home / "rpc-cache"
    old, mid, new = tensors(cache, 300, 200, 100)
    assert rpc_cache.trim(home, cache, 3 * MiB) == 0  # within: nothing goes
    assert rpc_cache.trim(home, cache, 2 * MiB + 10) == MiB
    assert not old.exists() and mid.exists() and new.exists()
    # a model a head chose takes its share first; the owner's own models never count
    model = model_store.import_gguf(home, smollm2_gguf, "chosen")
    assert rpc_cache.trim(home, cache, model.size + 2 * MiB) == 0
    model_store.note_fleet_chosen(home, "chosen")
    assert rpc_cache.fleet_models_bytes(home) == model.size
    assert rpc_cache.trim(home, cache, model.size + MiB) == MiB
    assert not mid.exists() and new.exists()

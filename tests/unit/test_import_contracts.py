"""The import contracts (`lint-imports`, pyproject.toml) cover every module: each module at
the top of engine/ sits in the engine's layers or among the shared leaves, and each module
of the engine is either the app's public API or forbidden to the app. A module added
without a place in them fails here, naming it."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import engine

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
    "contracts"]
# what the app may import (the contract's name says the same)
APP_API = {"engine", "engine.service", "engine.settings", "engine.config", "engine.events",
           "engine.snapshot", "engine.errors", "engine.sizes", "engine.tasks", "engine.models",
           "engine.models.store", "engine.models.commands", "engine.models.choice",
           "engine.models.fit", "engine.models.speed", "engine.models.pulls",
           "engine.models.pulls.text",
           "engine.models.pulls.quota"}


def _contract(start: str) -> dict:
    return next(c for c in CONTRACTS if c["name"].startswith(start))


def _engine_modules() -> list[str]:
    return ["engine", *(m.name for m in pkgutil.walk_packages(engine.__path__, "engine."))]


def _within(module: str, names: set[str]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def test_every_top_level_module_of_the_engine_is_layered_or_a_shared_leaf():
    layers = _contract("Every arrow inside engine points down")["layers"]
    layered = {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}
    leaves = set(_contract("The shared leaf modules")["source_modules"])
    top = {m for m in _engine_modules() if m.count(".") == 1}
    missing = sorted(m for m in top if not _within(m, layered | leaves)
                     and m not in {"engine.models"})  # models/: its parts are placed
    assert missing == [], f"place these in the import contracts: {missing}"
    models = {m for m in _engine_modules() if m.count(".") == 2
              and m.startswith("engine.models.")}
    assert sorted(m for m in models if not _within(m, layered | leaves)) == []


def test_every_module_of_the_engine_is_the_apps_public_api_or_forbidden_to_it():
    forbidden = set(_contract("The app uses only the engine's public API")["forbidden_modules"])
    unplaced = sorted(m for m in _engine_modules()
                      if m not in APP_API and not _within(m, forbidden))
    assert unplaced == [], f"public to the app, or forbidden to it: {unplaced}"
    assert not (APP_API & forbidden)

"""The embedded default model taken from an installed bundle: no network on the first run."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from engine.models import embedded as model_embedded
from engine.models.embedded import (
    EMBEDDED_FILE,
    _verified,
    bundled_models_dir,
    ensure_embedded_default,
)
from engine.models.errors import ModelMissing

GGUF = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture(autouse=True)
def _no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach the package index fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the bundled model must be used without pip")

    monkeypatch.setattr(model_embedded, "_pip_download", refuse)
    monkeypatch.delenv("SHOAL_BUNDLED_MODELS", raising=False)


def _bundle(folder: Path, data: bytes = GGUF, recorded: bytes | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / EMBEDDED_FILE).write_bytes(data)
    sha = hashlib.sha256(recorded if recorded is not None else data).hexdigest()
    (folder / f"{EMBEDDED_FILE}.sha256").write_text(f"{sha}  {EMBEDDED_FILE}\n")
    return folder


@pytest.mark.parametrize("offline", [True, False])
def test_bundled_copy_lands_in_the_cache_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: bool
) -> None:
    bundle = _bundle(tmp_path / "bundle")
    monkeypatch.setenv("SHOAL_BUNDLED_MODELS", str(bundle))
    lines: list[str] = []
    home = tmp_path / "home"
    got = ensure_embedded_default(home, offline=offline, progress=lambda s, *_: lines.append(s))
    assert got == home / "models" / "embedded" / EMBEDDED_FILE
    assert got.read_bytes() == GGUF
    assert not got.is_symlink()  # a copy: removing the app leaves the user's cache whole
    assert _verified(got)
    assert any("bundled" in line for line in lines)
    # the second call finds the cache and copies nothing
    (bundle / EMBEDDED_FILE).unlink()
    assert ensure_embedded_default(home, offline=True) == got


def test_a_bundled_copy_that_fails_its_checksum_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = _bundle(tmp_path / "bundle", recorded=b"something else")
    monkeypatch.setenv("SHOAL_BUNDLED_MODELS", str(bundle))
    with pytest.raises(ModelMissing, match="without --offline"):
        ensure_embedded_default(tmp_path / "home", offline=True)
    assert not (tmp_path / "home" / "models" / "embedded" / EMBEDDED_FILE).exists()


def test_a_bundle_without_its_checksum_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = _bundle(tmp_path / "bundle")
    (bundle / f"{EMBEDDED_FILE}.sha256").unlink()
    monkeypatch.setenv("SHOAL_BUNDLED_MODELS", str(bundle))
    with pytest.raises(ModelMissing):
        ensure_embedded_default(tmp_path / "home", offline=True)


def test_a_frozen_bundle_looks_in_its_resources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert bundled_models_dir() is None  # a source checkout carries no model
    _bundle(tmp_path / "resources" / "models")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert bundled_models_dir() == tmp_path / "resources" / "models"
    got = ensure_embedded_default(tmp_path / "home", offline=True)
    assert got.read_bytes() == GGUF
    # an explicit folder wins over the bundle's own
    monkeypatch.setenv("SHOAL_BUNDLED_MODELS", str(tmp_path / "elsewhere"))
    assert bundled_models_dir() == tmp_path / "elsewhere"

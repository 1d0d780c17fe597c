"""llama.cpp's own log lines go to Shoal's log, never straight to the user's terminal."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runtimes import llama_log

ROOT = Path(__file__).resolve().parents[2]


def test_the_fit_of_this_machine_prints_no_line_of_llama_cpps_own(tmp_path: Path) -> None:
    """`shoal models catalog --fits` opened with `ggml_vulkan: No devices found.` and
    `load_backend: loaded Vulkan backend from ...` (the Vulkan backend probed for the fit)."""
    env = {**os.environ, "SHOAL_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("SHOAL_LLAMA_LOG", None)
    out = subprocess.run([sys.executable, "-m", "engine.cli", "models", "catalog", "--fits"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "the fit for this machine" in out.stdout
    said = out.stdout + out.stderr
    for raw in ("ggml_vulkan", "load_backend", "llama_", "ggml_"):
        assert raw not in said, said[:2000]


def test_its_lines_reach_the_logger_whole_errors_as_warnings(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHOAL_LLAMA_LOG", raising=False)
    caplog.set_level(logging.DEBUG, logger="shoal.llama")
    llama_log._heard(2, b"load_backend: loaded ", None)  # a line in two calls
    llama_log._heard(5, b"Vulkan backend\n", None)
    llama_log._heard(4, b"ggml: out of memory\n", None)
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shoal.llama"]
    assert got == [(logging.DEBUG, "llama.cpp: load_backend: loaded Vulkan backend"),
                   (logging.WARNING, "llama.cpp: ggml: out of memory")]

"""scripts/examples/embed.py, run as a user would: Shoal in another program's process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def test_the_embedding_example_runs(tmp_path: Path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/examples/embed.py"), "--mock",
                          "--home", str(tmp_path)], capture_output=True, text=True,
                         timeout=100, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                     "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "stopped"
    assert any(line.startswith("snapshot: model demo, 1 node(s), 0/2 lanes busy") for line in lines)
    assert "alias: assistant -> demo (ver 1): 1/1 heads" in lines
    kinds = [line.split(":")[0] for line in lines if line.startswith("event ")]
    assert kinds[:2] == ["event RolesChanged", "event NodeLinked"]
    assert "event AliasChanged" in kinds and "event SessionPlaced" in kinds
    finished = next(line for line in lines if line.startswith("event SessionFinished"))
    assert "'requested': 'assistant'" in finished and "'completion_tokens': 12" in finished

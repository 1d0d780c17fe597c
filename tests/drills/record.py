"""The figures of docs/reliability.md: every drill and hostile case adds its row here.

A row says what was tried, how many times, what happened, how many tokens were lost and
how many requests failed with a clear error. Rows are merged by id into
``test-artifacts/drills.json`` (``$SHOAL_ARTIFACTS`` moves the folder), which
``scripts/reliability_report.py`` turns into the table.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def artifacts() -> Path:
    return Path(os.environ.get("SHOAL_ARTIFACTS", ROOT / "test-artifacts"))


def record(case: str, *, kind: str, tried: str, times: int, outcome: str,
           tokens_lost: int | None = 0, failed_clear: int | None = 0,
           **figures: Any) -> dict[str, Any]:
    """File one row (replacing an older row of ``case``) and return it.

    ``kind`` is "drill" or "hostile"; ``tokens_lost`` and ``failed_clear`` are None where
    they mean nothing (no tokens were being generated)."""
    row = {"case": case, "kind": kind, "tried": tried, "times": times, "outcome": outcome,
           "tokens_lost": tokens_lost, "failed_clear": failed_clear,
           "figures": figures, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    folder = artifacts()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "drills.json"
    with open(folder / ".drills.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # tests of several processes may write at once
        rows: dict[str, Any] = {}
        with contextlib.suppress(FileNotFoundError, ValueError):
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                rows = loaded
        rows[case] = row
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1, sort_keys=True))
        tmp.replace(path)
    return row


def token_free(texts: dict[str, str], token_hex: str) -> None:
    """Fail naming the log that holds the fleet token (in hex, either case)."""
    for name, text in texts.items():
        low = text.lower()
        assert token_hex.lower() not in low, f"the fleet token is in the log of {name}"

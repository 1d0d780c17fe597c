"""The benchmarks' smoke mode (``--smoke``): a run small enough to take seconds, whose
figures are checked for sense, that writes nothing under docs/. tests/bench/test_smoke.py
runs every benchmark so, so that none rots unseen until someone needs its numbers.

A smoke run ends with one line, ``smoke: ok {figures as JSON}``, or ``smoke: FAILED
(what is wrong) {figures}`` and exit status 1.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

MARK = "smoke:"


def scratch(name: str) -> Path:
    """A fresh folder for what the run would write under docs/ (its report, its plots),
    removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=f"shoal-smoke-{name}-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def verdict(figures: dict[str, object], checks: dict[str, bool]) -> None:
    """Print the figures on the one line the test reads; exit 1 naming every check
    (a sentence saying what must hold) that does not hold."""
    line = json.dumps(figures, default=str, sort_keys=True)
    failed = [what for what, held in checks.items() if not held]
    if failed:
        print(f"{MARK} FAILED ({'; '.join(failed)}) {line}", flush=True)
        sys.exit(1)
    print(f"{MARK} ok {line}", flush=True)

"""What the disk has free, read where a pull writes (the only IO of the disk check).

`free_bytes` is looked up through this module at each check, so a test can give it a
figure of its own."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def existing(path: Path) -> Path:
    """``path``, or the nearest folder above it that exists (a pull makes the rest)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return path


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the filesystem that holds ``path``."""
    return shutil.disk_usage(existing(path)).free


def total_bytes(path: Path) -> int:
    """The size of the filesystem that holds ``path``."""
    return shutil.disk_usage(existing(path)).total


def same_filesystem(a: Path, b: Path) -> bool:
    return os.stat(existing(a)).st_dev == os.stat(existing(b)).st_dev

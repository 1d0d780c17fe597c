"""Whether this machine runs on its battery: a machine lends memory to the fleet only on
mains power unless its owner asked otherwise (issue 33), since a split model keeps its CPU
busy for another machine's requests.

Linux: ``/sys/class/power_supply``: on battery when it has a battery and no mains or USB
supply that is online. macOS: ``pmset -g batt`` says "Battery Power". A machine with no
battery (a desktop, a VM) never is. Blocking (reads files, runs pmset): off the loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SYSFS = Path("/sys/class/power_supply")
_MAINS = {"Mains", "USB", "USB_C", "USB_PD", "USB_PD_DRP"}


def on_battery(root: Path | None = None) -> bool:
    if sys.platform == "darwin":
        return _pmset_on_battery()
    # SHOAL_POWER_SUPPLY stands in for sysfs in tests (a folder laid out the same way)
    root = root or Path(os.environ.get("SHOAL_POWER_SUPPLY") or SYSFS)
    return sysfs_on_battery(root)


def sysfs_on_battery(root: Path) -> bool:
    """From a ``power_supply`` folder: a battery, and no mains supply online."""
    battery = mains_online = False
    try:
        supplies = list(root.iterdir())
    except OSError:
        return False
    for supply in supplies:
        kind = _read(supply / "type")
        if kind == "Battery":
            battery = battery or _read(supply / "present") != "0"
        elif kind in _MAINS and _read(supply / "online") == "1":
            mains_online = True
    return battery and not mains_online


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()[:64]
    except OSError:
        return ""


def _pmset_on_battery() -> bool:
    try:
        out = subprocess.run(["/usr/bin/pmset", "-g", "batt"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "'Battery Power'" in out

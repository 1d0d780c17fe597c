"""Which process a pid names: a stamp that tells a process apart from a later one that
was given the same pid.

A state file that names a process by its pid alone can outlive it: the pid is reused,
and a command that signals "the pid in the file" then signals whoever has it now. A
process's stamp is taken when it writes the file and compared before it is signalled;
when the two differ, or the stamp cannot be read, nobody is signalled.

Linux (``/proc``)
    ``proc:<boot id>:<start time>``: the start time in clock ticks since boot (field 22
    of ``/proc/<pid>/stat``), with the boot's id, since the ticks start again at boot.
Elsewhere (macOS)
    ``ps:<start>``: the start date ``ps -o lstart=`` prints (to the second), in the C
    locale and UTC so that the text does not change with the user's settings.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

PROC = Path("/proc")
PS_TIMEOUT_S = 5.0
MAX_STAT_BYTES = 4096


def process_stamp(pid: int, *, proc: Path = PROC) -> str | None:
    """The stamp of the live process ``pid``; None when there is none or it cannot be
    read. ``proc``: where procfs is (Linux); when it is not there, ``ps`` is asked.
    Blocking (a file read or a short subprocess)."""
    if pid <= 0:
        return None
    if proc.is_dir():
        return _proc_stamp(pid, proc)
    return _ps_stamp(pid)


def same_process(pid: int, stamp: object, *, proc: Path = PROC) -> bool:
    """Whether ``pid`` is still the process that ``stamp`` was taken of: False when the
    pid was reused, the process is gone, or either stamp is unknown."""
    if not isinstance(stamp, str) or not stamp:
        return False
    return process_stamp(pid, proc=proc) == stamp


def _proc_stamp(pid: int, proc: Path) -> str | None:
    try:
        with (proc / str(pid) / "stat").open("rb") as f:
            stat = f.read(MAX_STAT_BYTES).decode("ascii", errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; it ends at the
    # last ")", and the start time is the 20th field after it
    fields = stat[stat.rfind(")") + 1:].split()
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    try:
        boot = (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"proc:{boot}:{fields[19]}"


def _ps_stamp(pid: int) -> str | None:
    ps = shutil.which("ps")
    if ps is None:
        return None
    try:
        out = subprocess.run(  # noqa: S603 - a fixed program, the pid as a number
            [ps, "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True,
            timeout=PS_TIMEOUT_S, check=False,
            env={**os.environ, "LC_ALL": "C", "TZ": "UTC"})
    except (OSError, subprocess.SubprocessError):
        return None
    started = " ".join(out.stdout.split())
    if out.returncode != 0 or not started:
        return None
    return f"ps:{started}"

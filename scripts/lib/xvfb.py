"""Xvfb for the tests and benchmarks: a free display, started and ended one at a time.

Xvfb takes the first display number whose abstract socket it can bind, then replaces that
number's socket file in /tmp/.X11-unix. A server that is ending releases the abstract
socket before it removes its socket file, so a second server starting in that moment takes
the same number and loses its socket file to the first one's exit: its clients then get
"cannot open display" (it failed CI once, trayer on a display another test was ending).
Every Xvfb this project starts goes through here, and a lock file lets one start (until it
wrote its number) or end (until it is reaped) at a time, across processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

LOCK = Path(tempfile.gettempdir()) / "shoal-xvfb.lock"


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    with LOCK.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def start(screen: str = "1024x768x24",
          log: IO[bytes] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Xvfb on a free display; returns it and its ``:N`` once it accepts clients (Xvfb
    writes the number when it is ready)."""
    with _alone():
        read, write = os.pipe()
        proc = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", screen,
                                 "-nolisten", "tcp"], pass_fds=(write,),
                                stdout=log or subprocess.DEVNULL,
                                stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
        os.close(write)
        with os.fdopen(read) as numbers:
            number = numbers.readline().strip()
        if not number.isdigit():
            proc.kill()
            proc.wait(10)
            raise RuntimeError("Xvfb did not start (it wrote no display number)")
        return proc, f":{number}"


def stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """End an Xvfb started by ``start`` (by its id), and wait until it is gone."""
    if proc.poll() is not None:
        return
    with _alone():
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

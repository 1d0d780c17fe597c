"""The CPUs one process's decode threads share (engine.runtimes.cpu_share): an engine alone
with work has them all; busy engines split them evenly, never below one thread."""

from __future__ import annotations

import pytest

from engine.runtimes.cpu_share import CpuShare

pytestmark = pytest.mark.quick


def test_busy_engines_split_the_cpus_and_an_idle_one_gives_its_part_back() -> None:
    share = CpuShare()
    assert share.threads(8) == 8  # nothing busy: an engine that starts work has them all
    share.working(1, True)
    assert share.threads(8) == 8
    share.working(2, True)
    assert share.threads(8) == 4 and share.threads(2) == 1
    share.working(3, True)
    assert share.threads(8) == 2 and share.threads(2) == 1  # never below one thread
    share.working(2, False)
    share.working(2, False)  # said twice: still one engine less
    assert share.threads(8) == 4
    share.working(1, False)
    share.working(3, False)
    assert share.threads(2) == 2

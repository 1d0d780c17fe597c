"""How a pull reads (engine/models/pulls/text.py), and what the CLI prints of its events: a
line per step, then one at every tenth with the rate and the time left."""

from __future__ import annotations

import pytest

from engine.cli.run import PullLines
from engine.events import PullProgress
from engine.models.pulls.text import duration, progress
from engine.sizes import amount

MB = 1 << 20
GB = 1 << 30


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (999, "999 B"), (18 * 1024, "18 KiB"), (412 * MB, "412 MiB"),
     (int(1.2 * GB), "1.2 GiB"), (12.4 * MB, "12.4 MiB"),
     (int(11.8 * GB), "11.8 GiB"), (6 * GB, "6 GiB"), (150 * GB, "150 GiB"),
     (1023 * MB, "1023 MiB")],
)
def test_amount(n: float, text: str) -> None:
    assert amount(n) == text


@pytest.mark.parametrize(
    ("s", "text"),
    [(0.0, "0 s"), (0.2, "1 s"), (45.0, "45 s"), (80.0, "1 min 20 s"), (59.5, "1 min 0 s"),
     (7500.0, "2 h 5 min"), (-3.0, "0 s")],
)
def test_duration(s: float, text: str) -> None:
    assert duration(s) == text


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ((int(0.4 * GB), int(1.2 * GB), 12 * MB, 80.0),
         "33% of 1.2 GiB, 12 MiB/s, 1 min 20 s left"),
        ((40 * MB, 100 * MB), "40% of 100 MiB"),
        ((40 * MB, 100 * MB, 0.0, None), "40% of 100 MiB"),
        ((40 * MB, 0, 5 * MB, None), "40 MiB, 5 MiB/s"),
        ((100 * MB, 100 * MB, 5 * MB, 0.0), "100% of 100 MiB, 5 MiB/s, 0 s left"),
    ],
)
def test_progress(args: tuple[int, int] | tuple[int, int, float, float | None],
                  text: str) -> None:
    assert progress(*args) == text


def running(done: int, message: str = "", total: int = 100 * MB, rate: float = 0.0,
            eta: float | None = None) -> PullProgress:
    return PullProgress(model="org/repo:Q4_K_M", done_bytes=done, total_bytes=total,
                        message=message, rate_bps=rate, eta_s=eta)


def test_the_cli_says_each_step_once_then_every_tenth() -> None:
    lines = PullLines()
    start = "pulling org/repo/m.gguf (100 MiB)"
    said = [
        lines.lines(running(0, start)),
        lines.lines(running(5 * MB, start)),  # the same step, under a tenth: nothing
        lines.lines(running(12 * MB, start, rate=10 * MB, eta=9.0)),
        lines.lines(running(15 * MB, start, rate=10 * MB, eta=9.0)),  # the same tenth
        lines.lines(running(100 * MB, start, rate=10 * MB, eta=0.0)),
        lines.lines(PullProgress(model="org/repo:Q4_K_M", done_bytes=100 * MB,
                                 total_bytes=100 * MB, state="done")),
    ]
    assert said == [
        [start],
        [],
        ["pulling org/repo:Q4_K_M: 12% of 100 MiB, 10 MiB/s, 9 s left"],
        [],
        ["pulling org/repo:Q4_K_M: 100% of 100 MiB, 10 MiB/s, 0 s left"],
        [],
    ]


def test_the_cli_says_a_resumed_step_and_a_failure() -> None:
    lines = PullLines()
    resumed = "resuming org/repo/m.gguf at 50 MiB of 100 MiB"
    assert lines.lines(running(50 * MB, resumed)) == [resumed]
    assert lines.lines(running(61 * MB, resumed, rate=MB, eta=39.0)) == [
        "pulling org/repo:Q4_K_M: 61% of 100 MiB, 1 MiB/s, 39 s left"]
    failed = PullProgress(model="org/repo:Q4_K_M", done_bytes=61 * MB, total_bytes=100 * MB,
                          state="failed", message="the download stopped; run again")
    assert lines.lines(failed) == ["the download stopped; run again"]

"""One app per user and home: a second `shoal app` hands over to the running one (whose
window comes forward) and exits; a lock left by a crashed app does not block the next."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.instance import SingleInstance, server_name
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def env_for(home: Path) -> dict[str, str]:
    return {**os.environ, "SHOAL_HOME": str(home), "QT_QPA_PLATFORM": "offscreen",
            "PYTHONPATH": str(ROOT)}


async def test_a_second_launch_hands_over_and_exits(tmp_path: Path):
    home = tmp_path / "home"
    first = SingleInstance(home)
    asked: list[bool] = []
    first.activated.connect(lambda: asked.append(True))
    try:
        assert first.claim()
        second = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "app.launch", "app"], cwd=ROOT,
            env=env_for(home), capture_output=True, text=True, timeout=30)
        assert second.returncode == 0, second.stderr
        assert "Shoal is already running: its window was brought forward" in second.stderr
        await until(lambda: asked, "the first app to be asked to come forward")
        assert asked == [True]
        assert not (home / "config.toml").exists()  # the second one started nothing
    finally:
        first.release()


async def test_another_home_is_another_app(tmp_path: Path):
    assert server_name(tmp_path / "a") != server_name(tmp_path / "b")
    a, b = SingleInstance(tmp_path / "a"), SingleInstance(tmp_path / "b")
    try:
        assert a.claim() and b.claim()
    finally:
        a.release()
        b.release()


async def test_the_lock_of_a_crashed_app_is_taken_over(tmp_path: Path):
    home = tmp_path / "home"
    script = ("import sys, time\n"
              "from PySide6.QtCore import QCoreApplication\n"
              "from app.instance import SingleInstance\n"
              "app = QCoreApplication([])\n"
              f"guard = SingleInstance(__import__('pathlib').Path({str(home)!r}))\n"
              "print('claimed' if guard.claim() else 'handed over', flush=True)\n"
              "time.sleep(60)\n")
    crashed = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env_for(home),
                               stdout=subprocess.PIPE, text=True)
    try:
        assert crashed.stdout is not None
        line = await asyncio.to_thread(crashed.stdout.readline)
        assert line.strip() == "claimed"
    finally:
        os.kill(crashed.pid, signal.SIGKILL)  # a crash: no release, the lock file stays
        await asyncio.to_thread(crashed.wait, 10)
        crashed.stdout.close()  # type: ignore[union-attr]
    assert (home / "app.lock").exists()
    guard = SingleInstance(home)
    try:
        assert guard.claim(handover_s=0)  # at once: the holder is known to be dead
    finally:
        guard.release()

"""A UI test that hangs fails at its timeout and the run goes on (tests/ui/qtimeout.py).
Before, pytest-timeout's SIGALRM landed in a callback of the Qt loop, was logged and
dropped, and one hung test stalled the whole suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = """\
from tests.ui.conftest import pytest_asyncio_loop_factories, pytest_timeout_set_timer
from tests.ui import qtimeout
qtimeout.GRACE_S = 3
"""


def run_pytest(tmp_path: Path, test: str) -> subprocess.CompletedProcess[str]:
    """Run ``test`` (an async test, with a 2 s timeout, then what follows it) on the UI
    tests' Qt loop, in a pytest of its own."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_hung.py").write_text(
        "import asyncio, pytest\n\n@pytest.mark.timeout(2)\n" + textwrap.dedent(test))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), "-o", "asyncio_mode=auto", str(tmp_path / "test_hung.py")],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen",
                       "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.timeout(90)
def test_a_hung_test_on_the_qt_loop_fails_with_where_it_waited_and_the_run_goes_on(
        tmp_path: Path):
    done = run_pytest(tmp_path, """\
        async def test_hangs():
            await asyncio.get_running_loop().create_future()

        def test_after():
            pass
    """)
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    assert "Timeout: the test ran over 2 s" in done.stdout
    assert "test_hung.py\", line 5, in test_hangs" in done.stdout


@pytest.mark.timeout(90)
def test_a_test_that_swallows_its_cancellation_ends_the_run_with_every_stack(
        tmp_path: Path):
    done = run_pytest(tmp_path, """\
        async def test_swallows():
            while True:
                try:
                    await asyncio.get_running_loop().create_future()
                except asyncio.CancelledError:
                    pass
    """)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Stack of MainThread" in done.stdout and "in test_swallows" in done.stdout

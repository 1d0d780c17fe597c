"""`shoal node leave` signals the joined node it recorded, and nobody else.

A stale `node.json` (its node ended, say, with the machine's power) names a pid that may
have gone to another program since. Leave signals the pid only when the process there is
the one that wrote the file (its start, from /proc on Linux, from `ps` elsewhere), so
each case runs twice: with /proc, and as on macOS with no /proc (a folder that is not
there stands for it). The processes here are this test's own, ended by their pids.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cli.run import _write_state, leave, node_state_path
from engine.process_stamp import PROC, process_stamp

ROOT = Path(__file__).resolve().parents[2]
HEAD = "10.0.0.9:8454"
# a program that has nothing to do with the node, though "shoal" is in its command line
# (an editor on shoal-notes.txt, another Shoal command): it waits until its stdin closes
IDLE = [sys.executable, "-c", "import sys; sys.stdin.read()", "shoal-notes.txt"]
# the joined node as `shoal node join` records itself, then waiting for its signal
NODE = """
import sys
from pathlib import Path
from engine.cli.run import _write_state, node_state_path
home, proc = Path(sys.argv[1]), Path(sys.argv[2])
_write_state(node_state_path(home), {"heads": [sys.argv[3]]}, proc=proc)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture(params=["proc", "no-proc"])
def proc(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Where procfs is: the real one, or (as on macOS) none, so `ps` is asked."""
    if request.param == "proc":
        if not PROC.is_dir():
            pytest.skip("this machine has no /proc")
        return PROC
    if shutil.which("ps") is None:
        pytest.skip("no ps on this machine")
    return tmp_path / "no-proc"


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _end(p: subprocess.Popen[str]) -> None:
    """End one of this test's processes by its pid."""
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    for pipe in (p.stdin, p.stdout):
        if pipe is not None:
            pipe.close()


@pytest.fixture
def unrelated() -> Iterator[subprocess.Popen[str]]:
    p = _start(IDLE)
    try:
        yield p
    finally:
        _end(p)


def _earlier_owner(pid: int, proc: Path) -> str:
    """The stamp of the process that had ``pid`` before the live one: the same pid,
    started earlier (what a stale node.json holds once the pid was reused). The OS
    cannot be made to hand out a pid again, so the live stamp is moved back in time."""
    stamp = process_stamp(pid, proc=proc)
    assert stamp is not None
    kind, _, rest = stamp.partition(":")
    if kind == "proc":  # proc:<boot id>:<ticks since boot>
        boot, _, ticks = rest.rpartition(":")
        return f"proc:{boot}:{int(ticks) - 1}"
    assert kind == "ps"  # ps:<start, as `ps -o lstart=` says it>, to the second
    then = time.localtime(time.mktime(time.strptime(rest, "%a %b %d %H:%M:%S %Y")) - 3600)
    return (f"ps:{time.strftime('%a %b', then)} {then.tm_mday} "
            f"{time.strftime('%H:%M:%S %Y', then)}")


def test_a_stale_node_json_naming_a_live_unrelated_pid_is_not_signalled(
        tmp_path: Path, proc: Path, unrelated: subprocess.Popen[str]):
    path = node_state_path(tmp_path)
    path.parent.mkdir(parents=True)
    stale = _earlier_owner(unrelated.pid, proc)
    path.write_text(json.dumps({"pid": unrelated.pid, "started": stale, "heads": [HEAD]}))
    done = leave(tmp_path, forget_token=False, proc=proc)
    # signalled, it would have ended (leave waits for the pid to go before it returns)
    assert unrelated.poll() is None
    assert done == [f"left process {unrelated.pid} alone: it cannot be confirmed as the "
                    "node that joined (its pid may belong to another program now); if the "
                    "node still runs, stop it in its terminal with Ctrl-C", "forgot the head"]
    assert not path.exists()


def test_a_node_json_with_no_start_is_not_signalled(
        tmp_path: Path, proc: Path, unrelated: subprocess.Popen[str]):
    """A file that names a pid and nothing else (as Shoal wrote it before) cannot be
    confirmed: nobody is signalled."""
    path = node_state_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": unrelated.pid, "heads": [HEAD]}))
    done = leave(tmp_path, forget_token=False, proc=proc)
    assert unrelated.poll() is None
    assert done[0].startswith(f"left process {unrelated.pid} alone") and len(done) == 2


def test_the_joined_node_itself_is_signalled(tmp_path: Path, proc: Path):
    node = _start([sys.executable, "-c", NODE, str(tmp_path), str(proc), HEAD])
    try:
        assert node.stdout is not None and node.stdout.readline() == "ready\n"
        done: list[str] = []
        # leave waits for the pid to go, which it does once this test reaps its child
        leaving = threading.Thread(
            target=lambda: done.extend(leave(tmp_path, forget_token=False, proc=proc)))
        leaving.start()
        assert node.wait(30) == -signal.SIGTERM
        leaving.join(30)
        assert done == [f"closed the links to {HEAD}", "forgot the head"]
        assert not node_state_path(tmp_path).exists()
    finally:
        _end(node)


def test_node_json_is_written_atomically_and_private(tmp_path: Path):
    path = node_state_path(tmp_path)
    _write_state(path, {"heads": ["a:1"]})
    with path.open() as before:  # a reader that opened the file before the next write
        _write_state(path, {"heads": ["b:2"]})
        # replaced by a rename: the reader still reads the whole older file
        assert json.loads(before.read())["heads"] == ["a:1"]
    state = json.loads(path.read_text())
    assert state == {"pid": os.getpid(), "started": process_stamp(os.getpid()),
                     "heads": ["b:2"]}
    assert state["started"] is not None
    assert (path.stat().st_mode & 0o777) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["node.json"]  # no temp file left

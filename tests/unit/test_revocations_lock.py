"""Revocations made at the same moment all land in the list: from many threads of one
process (the app and a running head revoke off the loop) and from two processes (two
`shoal keys revoke` at once). Each revocation reads the list, adds a name and writes it
back; without a lock around the three, one writer's file replaces the other's and a
revoked key keeps working."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.filelock import lock_path
from engine.head.access.keys import KeysError, load_revoked, revoke, unrevoke

THREADS = 16
PER_THREAD = 10
PER_PROCESS = 80
ROOT = Path(__file__).resolve().parents[2]

# a process that revokes its names once told to go (both start loaded, then race)
REVOKER = """
import sys
from pathlib import Path
from engine.head.access.keys import revoke
path, prefix, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sys.stdin.readline()
said = [revoke(path, f"{prefix}{i}") for i in range(count)]
print(sum(said))
"""


def test_revocations_from_many_threads_all_land(tmp_path: Path):
    path = tmp_path / "fleet" / "revoked.json"
    start = threading.Barrier(THREADS)
    said: list[bool] = []
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            start.wait(timeout=30)
            for i in range(PER_THREAD):
                said.append(revoke(path, f"t{t}k{i}"))
        except BaseException as exc:  # surfaced below, with the names that were lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert said == [True] * (THREADS * PER_THREAD)  # every command said "revoked"
    want = {f"t{t}k{i}" for t in range(THREADS) for i in range(PER_THREAD)}
    assert sorted(want - load_revoked(path)) == []


def test_revocations_from_two_processes_all_land(tmp_path: Path):
    path = tmp_path / "fleet" / "revoked.json"
    procs = [subprocess.Popen([sys.executable, "-c", REVOKER, str(path), prefix,
                               str(PER_PROCESS)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
             for prefix in ("a", "b")]
    try:
        for p in procs:  # both are loaded and waiting: go at once
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0]
    assert [o.strip() for o in outs] == [str(PER_PROCESS)] * 2  # each said "revoked" for all
    want = {f"{prefix}{i}" for prefix in ("a", "b") for i in range(PER_PROCESS)}
    assert sorted(want - load_revoked(path)) == []


def test_the_lock_file_sits_beside_the_list_private(tmp_path: Path):
    path = tmp_path / "fleet" / "revoked.json"
    assert revoke(path, "alice") is True and revoke(path, "bob") is True
    assert lock_path(path) == tmp_path / "fleet" / "revoked.json.lock"
    assert (lock_path(path).stat().st_mode & 0o777) == 0o600
    assert unrevoke(path, "alice") is True and unrevoke(path, "alice") is False
    assert load_revoked(path) == {"bob"}


def test_a_lock_file_that_cannot_be_made_is_one_line_with_the_fix(tmp_path: Path):
    folder = tmp_path / "fleet"
    folder.mkdir()
    lock_path(folder / "revoked.json").mkdir()  # something that is not a file is in the way
    with pytest.raises(KeysError, match=r"cannot lock the revocation list .*check the "):
        revoke(folder / "revoked.json", "alice")

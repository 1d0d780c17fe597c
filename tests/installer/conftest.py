"""The installer level: build the .deb once, install it on this machine, drive the installed
program as a user would, remove it. Root only (dpkg -i); every test here is marked
``installer`` so a developer skips them with ``-m 'not installer'``; CI runs them.

Nothing of the developer's is touched: a machine that already has a `shoal` package, or
anything at /opt/shoal or /usr/bin/shoal, skips the level; the package installed here is
removed (and purged) at the end whatever happens; the installed program runs with a HOME,
SHOAL_HOME and TMPDIR of its own, in a network namespace that has only loopback.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from installers import bundle

ROOT = bundle.ROOT
ARTIFACTS = ROOT / "test-artifacts" / "installer"
DIST = ROOT / "dist"
BUNDLE_DIR = ROOT / "build" / "installer" / "dist" / "shoal"
BUILD_VENV_PY = ROOT / "build" / "installer" / "venv" / "bin" / "python"
# the CPU variants the tested bundle carries: the baseline and this CPU's best, the same
# llama.cpp wheel .venv runs (a release's every variant is a build of its own, 14 more
# minutes, for what this level checks: that ggml scores the bundle's variants and picks)
VARIANTS = os.environ.get("SHOAL_LLAMA_VARIANTS", "dev")
# the .tar.zst packed at zstd's fastest level (a release: 10, 8 s more of CPU for 8 % less)
TAR_LEVEL = "1"


class Lines:
    """A process's output, read on a thread so a test can wait for one line with a bound."""

    def __init__(self, stream: IO[str], copy: Path) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._copy = copy.open("w")
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._copy.write(line)
            self._copy.flush()
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, *, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._queue.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise AssertionError(
                    f"no line matching {pattern!r} within {timeout:.0f} s; last lines: "
                    f"{self.seen[-8:]}") from None
            if line is None:
                raise AssertionError(f"the process ended before {pattern!r}: {self.seen[-8:]}")
            self.seen.append(line)
            if m := rx.search(line):
                return m

    def close(self) -> list[str]:
        self._thread.join(timeout=30)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.seen.append(line)
        self._copy.close()
        return self.seen


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]


def dpkg_status(package: str) -> str:
    return run(["dpkg-query", "-W", "-f=${Status}", package]).stdout


@dataclass(frozen=True)
class Built:
    deb: Path
    tar: Path
    bundle: Path
    build_log: Path


def _prerequisite() -> str | None:
    """Why this machine cannot run the level, or None."""
    if os.uname().sysname != "Linux" or shutil.which("dpkg") is None:
        return "the .deb is built and installed on a Debian-like Linux"
    if os.geteuid() != 0:
        return "installing a .deb needs root (CI runs as root)"
    try:
        bundle.icon_files()
    except bundle.BuildError as exc:
        return f"the app's icons are not in this tree yet ({exc})"
    if "installed" in dpkg_status("shoal") or Path("/opt/shoal").exists() \
            or Path("/usr/bin/shoal").exists():
        return "this machine has a Shoal of its own installed; the test leaves it alone"
    for tool in ("dpkg-deb", "dpkg-shlibdeps", "desktop-file-validate", "zstd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt install dpkg-dev desktop-file-utils zstd)"
    return None


@pytest.fixture(scope="session")
def built() -> Built:
    """scripts/build-installer, run once: the .deb and .tar.zst of this tree."""
    why = _prerequisite()
    if why:
        pytest.skip(why)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = ARTIFACTS / "build-installer.log"
    with log.open("w") as out:
        proc = subprocess.run([str(ROOT / "scripts" / "build-installer")], cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT, check=False,
                              env={**os.environ, "SHOAL_LLAMA_VARIANTS": VARIANTS,
                                   "SHOAL_TAR_ZSTD_LEVEL": TAR_LEVEL})
    lines = log.read_text().splitlines()
    assert proc.returncode == 0, f"scripts/build-installer failed: {lines[-10:]}"
    version = bundle.version()
    debs = sorted(DIST.glob(f"shoal_{version}_*.deb"))
    tars = sorted(DIST.glob(f"shoal-{version}-linux-*.tar.zst"))
    assert debs and tars, f"no .deb or .tar.zst in {DIST}: {lines[-5:]}"
    return Built(debs[-1], tars[-1], BUNDLE_DIR, log)


@dataclass(frozen=True)
class Installed:
    deb: Path
    home: Path  # HOME of the installed program in every test
    tmp: Path  # its TMPDIR
    netns: str  # a network namespace with loopback only ("" where there is none)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": str(self.home),
            "SHOAL_HOME": str(self.home / ".shoal"),
            "TMPDIR": str(self.tmp),
            "XDG_RUNTIME_DIR": str(self.tmp / "run"),
            "LANG": "C.UTF-8",
            **extra,
        }

    def cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (no network but loopback)."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv


def _netns() -> str:
    if shutil.which("ip") is None:
        return ""
    name = f"shoal-inst-{os.getpid()}"
    if run(["ip", "netns", "add", name]).returncode != 0:
        return ""
    run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
    return name


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """The .deb installed with dpkg -i; removed and purged after the module whatever
    happened, so the rest of the suite runs without it."""
    home = tmp_path_factory.mktemp("home")
    tmp = tmp_path_factory.mktemp("tmp")
    (tmp / "run").mkdir(mode=0o700)
    netns = _netns()
    started = time.monotonic()
    out = run(["dpkg", "-i", str(built.deb)],
              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    (ARTIFACTS / "dpkg-install.log").write_text(
        out.stdout + out.stderr + f"\ninstalled in {time.monotonic() - started:.1f} s\n")
    try:
        assert out.returncode == 0, f"dpkg -i failed: {out.stderr.strip()[-400:]}"
        yield Installed(built.deb, home, tmp, netns)
    finally:
        if dpkg_status("shoal"):
            run(["dpkg", "--purge", "shoal"])
        if netns:
            run(["ip", "netns", "delete", netns])


def start(installed: Installed, argv: list[str], log_name: str,
          **env: str) -> tuple[subprocess.Popen[str], Lines]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(installed.cmd(argv), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=installed.env(**env),
                            cwd=installed.home)
    assert proc.stdout is not None
    return proc, Lines(proc.stdout, ARTIFACTS / log_name)


def stop(proc: subprocess.Popen[str], lines: Lines) -> list[str]:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise AssertionError(
                "the installed program did not stop within 30 s of SIGTERM") from None
    return lines.close()

"""Build (once) and locate llama.cpp's ``llama-server`` for the benchmarks.

The source is the llama.cpp that the installed llama-cpp-python's sdist carries
(``vendor/llama.cpp``), so the server runs the same kernels as our runtime.
Steps, each skipped when its result is already in the cache folder:

  1. ``pip download --no-deps --no-binary :all: llama-cpp-python==<installed>``
  2. extract ``vendor/llama.cpp`` only
  3. ``cmake`` configure (CPU, native, static, no curl/openssl, no tests/examples)
  4. ``cmake --build --target llama-server -j2`` under ``nice``
  5. copy the binary to ``<cache>/bin/llama-server-<version>``

Run on its own: .venv/bin/python scripts/bench/llama_server.py [--cache DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("SHOAL_BENCH_CACHE", "~/.cache/shoal-bench")).expanduser()
PACKAGE = "llama-cpp-python"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
DOWNLOAD_TIMEOUT = 900  # s
CONFIGURE_TIMEOUT = 600
BUILD_TIMEOUT = 3 * 3600

Say = Callable[[str], None]


class BuildFailed(RuntimeError):
    """A step failed; the message is one line with the reason."""


def _say(msg: str) -> None:
    print(f"[llama-server] {msg}", flush=True)


def installed_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise BuildFailed(f"{PACKAGE} is not installed in this environment") from None


def binary_path(cache: Path, version: str) -> Path:
    return cache / "bin" / f"llama-server-{version}"


def _works(binary: Path) -> bool:
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _last_error(log: Path) -> str:
    """The most telling line of a build log, for a one-line message."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for pat in (r"error:", r"CMake Error", r"Error \d+", r"[Ee]rror"):
        for line in lines:
            if re.search(pat, line):
                return line.strip()[:200]
    return (lines[-1].strip()[:200] if lines else "empty log")


def _run_logged(cmd: list[str], log: Path, timeout: float, say: Say, what: str,
                cwd: Path | None = None) -> None:
    """Run a step, its output into ``log``; print build percentages as they pass."""
    t0 = time.monotonic()
    shown = -10
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=cwd, start_new_session=True)
        except OSError as exc:
            raise BuildFailed(f"{what} failed: cannot run {cmd[0]}: {exc}") from None
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                fh.write(line)
                m = re.match(r"\[\s*(\d+)%\]", line)
                if m and int(m.group(1)) >= shown + 10:
                    shown = int(m.group(1))
                    say(f"{what}: {shown}% ({time.monotonic() - t0:.0f} s)")
                if time.monotonic() - t0 > timeout:
                    raise BuildFailed(f"{what} failed: took longer than {timeout:.0f} s "
                                      f"(log: {log})")
            rc = proc.wait(timeout=max(timeout - (time.monotonic() - t0), 1))
        except subprocess.TimeoutExpired:
            raise BuildFailed(f"{what} failed: took longer than {timeout:.0f} s "
                              f"(log: {log})") from None
        finally:
            if proc.poll() is None:
                proc.kill()  # our own child, by its handle
                proc.wait()
    if rc != 0:
        raise BuildFailed(f"{what} failed (exit {rc}): {_last_error(log)} (log: {log})")


def _download(cache: Path, version: str, say: Say) -> Path:
    sdist_dir = cache / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    names = (f"llama_cpp_python-{version}.tar.gz", f"llama-cpp-python-{version}.tar.gz")
    for name in names:
        if (sdist_dir / name).is_file():
            say(f"source: {sdist_dir / name} (cached)")
            return sdist_dir / name
    say(f"downloading the {PACKAGE}=={version} sdist into {sdist_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(sdist_dir), f"{PACKAGE}=={version}"]
    _run_logged(cmd, cache / "download.log", DOWNLOAD_TIMEOUT, say, "download")
    for name in names:
        if (sdist_dir / name).is_file():
            return sdist_dir / name
    raise BuildFailed(f"download failed: pip saved no {names[0]} in {sdist_dir}")


def _extract(sdist: Path, cache: Path, version: str, say: Say) -> Path:
    src = cache / f"src-{version}" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file() and (src / ".extracted").is_file():
        return src
    say(f"extracting vendor/llama.cpp into {src}")
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    try:
        with tarfile.open(sdist) as tf:
            marker = "/vendor/llama.cpp/"
            for member in tf:
                i = member.name.find(marker)
                if i < 0 or member.name.count("/", 0, i) != 0:
                    continue
                rel = member.name[i + len(marker):]
                if not rel or rel.startswith(".git/") or rel == ".git":
                    continue
                if member.issym() or member.islnk() or ".." in Path(rel).parts:
                    continue
                member.name = rel
                tf.extract(member, src, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise BuildFailed(f"extract failed: {sdist}: {exc}") from None
    if not (src / "CMakeLists.txt").is_file():
        raise BuildFailed(f"extract failed: {sdist} has no vendor/llama.cpp/CMakeLists.txt")
    (src / ".extracted").write_text(version)
    return src


def ensure_llama_server(cache: Path = DEFAULT_CACHE, *, version: str | None = None,
                        jobs: int = 2, say: Say = _say) -> Path:
    """The path of a working ``llama-server`` for the installed llama-cpp-python."""
    version = version or installed_version()
    cache = cache.expanduser()
    binary = binary_path(cache, version)
    if _works(binary):
        say(f"using cached {binary}")
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildFailed(f"build failed: {tool} is not on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    sdist = _download(cache, version, say)
    src = _extract(sdist, cache, version, say)
    build = cache / f"build-{version}"
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    if not (build / "CMakeCache.txt").is_file():
        say(f"configuring in {build}")
        _run_logged([*nice, "cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
                    cache / "configure.log", CONFIGURE_TIMEOUT, say, "configure")
    say(f"building llama-server with -j{jobs} (several minutes on 2 cores; "
        f"log: {cache / 'build.log'})")
    _run_logged([*nice, "cmake", "--build", str(build), "--target", "llama-server",
                 "-j", str(jobs)], cache / "build.log", BUILD_TIMEOUT, say, "build")
    built = build / "bin" / "llama-server"
    if not built.is_file():
        raise BuildFailed(f"build failed: no {built} after a successful build")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(binary)
    if not _works(binary):
        raise BuildFailed(f"build failed: {binary} does not run `--version`")
    say(f"built {binary}")
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args()
    try:
        print(ensure_llama_server(args.cache, jobs=args.jobs))
    except BuildFailed as exc:
        raise SystemExit(f"llama-server: {exc}") from None


if __name__ == "__main__":
    main()

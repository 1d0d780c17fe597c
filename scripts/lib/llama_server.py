"""Build (once per machine) and locate llama.cpp's ``llama-server``, for tests and benchmarks.

The source is the llama.cpp that the installed llama-cpp-python's sdist carries
(``vendor/llama.cpp``), so the server runs the same kernels as our runtime. The
binary is native (``-DGGML_NATIVE=ON``), so it is kept in a folder keyed by the
llama-cpp-python version, the machine kind and the CPU's instruction-set flags:
a binary built on another CPU is never taken for this one. That folder sits in
pip's cache folder (``$PIP_CACHE_DIR`` or ``~/.cache/pip``, like the portable
wheel of ``scripts/lib/llama_wheel.sh``), which CI keeps between runs.

Steps, each skipped when its result is already there (the work folder stays
until a build succeeds, so an interrupted build resumes):

  1. ``pip download --no-deps --no-binary :all: llama-cpp-python==<installed>``
  2. extract ``vendor/llama.cpp`` only
  3. ``cmake`` configure (CPU, native, static, no curl/openssl, no tests/examples)
  4. ``cmake --build --target llama-server -j2`` under ``nice`` (about 30 min on 2 cores)
  5. copy the binary into the keyed folder, check it runs, drop the work folder

Run on its own (``scripts/test`` does, before pytest):
    .venv/bin/python scripts/lib/llama_server.py [--jobs N] [--check]
Prints the binary's path; ``--check`` only says whether it is there (exit 1 if not).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

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
NEEDED_TOOLS = ("cmake", "c++", "make")  # Debian: cmake, build-essential (scripts/lib/apt.sh)
DOWNLOAD_TIMEOUT = 900  # s
CONFIGURE_TIMEOUT = 600
BUILD_TIMEOUT = 3 * 3600

Say = Callable[[str], None]


class BuildFailed(RuntimeError):
    """A step failed; the message is one line with the reason."""


def _say(msg: str) -> None:
    print(f"[llama-server] {msg}", file=sys.stderr, flush=True)


def installed_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise BuildFailed(f"{PACKAGE} is not installed in this environment; "
                          "run scripts/test to set up .venv") from None


def cache_root() -> Path:
    """``<pip's cache>/shoal-llama-server``; ``SHOAL_LLAMA_SERVER_CACHE`` overrides."""
    if own := os.environ.get("SHOAL_LLAMA_SERVER_CACHE"):
        return Path(own).expanduser()
    pip = os.environ.get("PIP_CACHE_DIR")
    if not pip:
        xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
        pip = str(Path(xdg) / "pip")
    return Path(pip).expanduser() / "shoal-llama-server"


def cpu_flags() -> str:
    """The CPU's instruction-set flags, sorted (what a native build depends on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return platform.processor()


def build_key(version: str) -> str:
    """The cache folder's name: version plus a hash of machine, CPU flags and options."""
    digest = hashlib.sha256(
        "\n".join((version, platform.machine(), platform.system(), cpu_flags(),
                   *CMAKE_FLAGS)).encode()).hexdigest()[:12]
    return f"{version}-{digest}"


def binary_path(version: str | None = None, root: Path | None = None) -> Path:
    version = version or installed_version()
    return (root or cache_root()) / build_key(version) / "llama-server"


def works(binary: Path) -> bool:
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def find_llama_server() -> Path | None:
    """The cached binary for the installed llama-cpp-python on this CPU, if it is there."""
    try:
        binary = binary_path()
    except BuildFailed:
        return None
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


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


def _download(work: Path, version: str, say: Say) -> Path:
    sdist_dir = work / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    names = (f"llama_cpp_python-{version}.tar.gz", f"llama-cpp-python-{version}.tar.gz")
    for name in names:
        if (sdist_dir / name).is_file():
            say(f"source: {sdist_dir / name} (cached)")
            return sdist_dir / name
    say(f"downloading the {PACKAGE}=={version} sdist into {sdist_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(sdist_dir), f"{PACKAGE}=={version}"]
    _run_logged(cmd, work / "download.log", DOWNLOAD_TIMEOUT, say, "download")
    for name in names:
        if (sdist_dir / name).is_file():
            return sdist_dir / name
    raise BuildFailed(f"download failed: pip saved no {names[0]} in {sdist_dir}")


def _extract(sdist: Path, work: Path, version: str, say: Say) -> Path:
    src = work / "src" / "llama.cpp"
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


def ensure_llama_server(*, version: str | None = None, root: Path | None = None,
                        jobs: int = 2, say: Say = _say) -> Path:
    """The path of a working ``llama-server`` for the installed llama-cpp-python."""
    version = version or installed_version()
    binary = binary_path(version, root)
    if works(binary):
        return binary
    missing = [tool for tool in NEEDED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise BuildFailed(f"cannot build: {', '.join(missing)} not on PATH; "
                          "install them (apt install build-essential cmake) and run again")
    work = binary.parent.parent / f"work-{version}"
    work.mkdir(parents=True, exist_ok=True)
    say(f"building llama-server {version} once for this machine into {binary.parent} "
        f"(about 30 minutes on 2 cores; work folder {work})")
    sdist = _download(work, version, say)
    src = _extract(sdist, work, version, say)
    build = work / "build"
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    if not (build / "CMakeCache.txt").is_file():
        say(f"configuring in {build}")
        _run_logged([*nice, "cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
                    work / "configure.log", CONFIGURE_TIMEOUT, say, "configure")
    say(f"building with -j{jobs} (log: {work / 'build.log'})")
    _run_logged([*nice, "cmake", "--build", str(build), "--target", "llama-server",
                 "-j", str(jobs)], work / "build.log", BUILD_TIMEOUT, say, "build")
    built = build / "bin" / "llama-server"
    if not built.is_file():
        raise BuildFailed(f"build failed: no {built} after a successful build")
    install(built, binary)
    shutil.rmtree(work, ignore_errors=True)
    say(f"built {binary}")
    return binary


def install(built: Path, binary: Path) -> None:
    """Copy a built binary into its keyed folder atomically, and check that it runs."""
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(binary)
    if not works(binary):
        binary.unlink(missing_ok=True)
        raise BuildFailed(f"build failed: {built} does not run `--version`")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--check", action="store_true",
                    help="only say whether the binary is built (exit 1 if not)")
    ap.add_argument("--adopt", type=Path, default=None,
                    help="take this already built llama-server (same version, this machine) "
                         "as the cached one instead of building")
    args = ap.parse_args()
    try:
        if args.check:
            found = find_llama_server()
            if found is None:
                raise SystemExit(f"llama-server: not built yet (expected at {binary_path()})")
            print(found)
            return
        if args.adopt is not None:
            install(args.adopt.expanduser(), binary_path())
        print(ensure_llama_server(jobs=args.jobs))
    except BuildFailed as exc:
        raise SystemExit(f"llama-server: {exc}") from None


if __name__ == "__main__":
    main()

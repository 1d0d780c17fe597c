"""Build (once per machine) and locate llama.cpp's ``llama-server``, for tests and benchmarks.

The source is the llama.cpp that the installed llama-cpp-python's sdist carries
(``vendor/llama.cpp``), so the server runs the same kernels as our runtime. Two
builds, the first that applies is made and either one found is used:

* **over the wheel's tree** (``--tree``, what ``scripts/test`` passes): the CMake
  tree ``scripts/lib/llama_wheel.sh`` keeps after building the portable wheel.
  Reconfigured with the server on, only the server and ``llama-common`` compile
  (about 2 minutes on 2 cores); ggml and llama are the wheel's own objects,
  linked as the wheel's shared libraries, the CPU variant picked at load time as
  our runtime picks it. The server and those libraries are copied into one folder
  (RUNPATH ``$ORIGIN``) keyed by version and machine kind, and the tree deleted.
* **static and native** (``-DGGML_NATIVE=ON``) from the sdist on its own, when no
  tree is there (a machine whose wheel was built before the tree was kept): about
  13 minutes on 2 cores, kept in a folder keyed by the version, the machine kind
  and the CPU's instruction-set flags, so a binary built on another CPU is never
  taken for this one. Where both exist, this one is used (CI's cache holds it).

Both folders sit in pip's cache folder (``$PIP_CACHE_DIR`` or ``~/.cache/pip``,
like the portable wheel), which CI keeps between runs.

Steps of the static build, each skipped when its result is already there (the
work folder stays until a build succeeds, so an interrupted build resumes):

  1. ``pip download --no-deps --no-binary :all: llama-cpp-python==<installed>``
  2. extract ``vendor/llama.cpp`` only
  3. ``cmake`` configure (CPU, native, static, no curl/openssl, no tests/examples)
  4. ``cmake --build --target llama-server -j2`` under ``nice`` (about 13 min on 2 cores)
  5. copy the binary into the keyed folder, check it runs, drop the work folder

Run on its own (``scripts/test`` does, before pytest):
    .venv/bin/python scripts/lib/llama_server.py [--tree DIR] [--jobs N] [--check]
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
# the wheel's tree reconfigured: the server on, no OpenSSL (as the static build), no
# download of the web UI's assets (no network here but PyPI); $ORIGIN so the server finds
# the libraries copied beside it
TREE_FLAGS = (
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
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


def portable_path(version: str | None = None, root: Path | None = None) -> Path:
    """Where the server built over the wheel's tree lives: portable, so keyed by version
    and machine kind only (every variant set carries the baseline ``x64``)."""
    version = version or installed_version()
    digest = hashlib.sha256("\n".join((version, platform.machine(), platform.system(),
                                       *TREE_FLAGS)).encode()).hexdigest()[:12]
    return (root or cache_root()) / f"{version}-portable-{digest}" / "llama-server"


def works(binary: Path) -> bool:
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def find_llama_server() -> Path | None:
    """The cached binary for the installed llama-cpp-python on this machine, if it is
    there: the static native one first, else the one built over the wheel's tree."""
    try:
        candidates = (binary_path(), portable_path())
    except BuildFailed:
        return None
    for binary in candidates:
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    return None


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


def _tree_tools(tree: Path, version: str) -> tuple[str, str] | None:
    """The cmake and ninja (or make) a whole tree of this version was configured with, if
    both are still there (pip may have run them from a build environment it has deleted)."""
    try:
        if (tree / "VERSION").read_text().strip() != version:
            return None
        cache = (tree / "build" / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return None
    found = dict(re.findall(r"^(CMAKE_COMMAND|CMAKE_MAKE_PROGRAM):[A-Z]+=(.*)$", cache,
                            re.MULTILINE))
    cmake, make = found.get("CMAKE_COMMAND", ""), found.get("CMAKE_MAKE_PROGRAM", "")
    if not (cmake and make and os.access(cmake, os.X_OK) and os.access(make, os.X_OK)):
        return None
    return cmake, make


def build_over_tree(tree: Path, cmake: str, binary: Path, *, jobs: int, say: Say) -> None:
    """Build llama-server in the wheel's kept tree with its own ``cmake``, and copy it with
    the shared libraries it links into ``binary``'s folder."""
    build, src = tree / "build", tree / "src"
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    say(f"building llama-server over the wheel's tree {tree} (about 2 minutes on 2 cores)")
    _run_logged([*nice, cmake, "-S", str(src), "-B", str(build), *TREE_FLAGS],
                tree / "configure.log", CONFIGURE_TIMEOUT, say, "configure")
    _run_logged([*nice, cmake, "--build", str(build), "--target", "llama-server",
                 "-j", str(jobs)], tree / "server.log", BUILD_TIMEOUT, say, "build")
    built = build / "bin" / "llama-server"
    if not built.is_file():
        raise BuildFailed(f"build failed: no {built} after a successful build")
    staging = binary.parent.with_name(binary.parent.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in built.parent.iterdir():
        if item.name == built.name or (item.name.startswith("lib") and ".so" in item.name):
            shutil.copy2(item, staging / item.name, follow_symlinks=False)
    shutil.rmtree(binary.parent, ignore_errors=True)
    staging.replace(binary.parent)
    if not works(binary):
        shutil.rmtree(binary.parent, ignore_errors=True)
        raise BuildFailed(f"build failed: {binary} does not run `--version`")


def ensure_llama_server(*, version: str | None = None, root: Path | None = None,
                        jobs: int = 2, tree: Path | None = None, say: Say = _say) -> Path:
    """The path of a working ``llama-server`` for the installed llama-cpp-python: found,
    else built over the wheel's ``tree`` when it is whole, else built static and native.
    The tree is deleted once a server exists: it is only kept for this."""
    version = version or installed_version()
    binary = binary_path(version, root)
    portable = portable_path(version, root)
    found = next((b for b in (binary, portable) if works(b)), None)
    tools = _tree_tools(tree, version) if tree is not None else None
    if found is None and tree is not None and tools is not None:
        build_over_tree(tree, tools[0], portable, jobs=jobs, say=say)
        say(f"built {portable}")
        found = portable
    if found is None:
        found = _build_static(binary, version, jobs=jobs, say=say)
    if tree is not None:
        shutil.rmtree(tree, ignore_errors=True)
    return found


def _build_static(binary: Path, version: str, *, jobs: int, say: Say) -> Path:
    missing = [tool for tool in NEEDED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise BuildFailed(f"cannot build: {', '.join(missing)} not on PATH; "
                          "install them (apt install build-essential cmake) and run again")
    work = binary.parent.parent / f"work-{version}"
    work.mkdir(parents=True, exist_ok=True)
    say(f"building llama-server {version} once for this machine into {binary.parent} "
        f"(about 15 minutes on 2 cores; work folder {work})")
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
    ap.add_argument("--tree", type=Path, default=None,
                    help="the portable wheel's kept CMake tree (scripts/lib/llama_wheel.sh): "
                         "build the server over it rather than from the source on its own")
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
        print(ensure_llama_server(jobs=args.jobs, tree=args.tree))
    except BuildFailed as exc:
        raise SystemExit(f"llama-server: {exc}") from None


if __name__ == "__main__":
    main()

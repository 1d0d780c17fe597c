"""Build (once per machine) llama.cpp's Vulkan backend, ``libggml-vulkan.so``, and install it.

The backend is one loadable ggml library (``GGML_BACKEND_DL``), built from the llama.cpp
that the installed llama-cpp-python's sdist carries, so it matches the ``libggml-base``
beside it. A node loads it at start (``engine/runtimes/gpu.py``) next to the CPU
backend; the bundle (``scripts/build-installer``) carries it in ``llama_cpp/lib`` next to
the CPU variants, and ``--install`` puts it there in this ``.venv`` too.

Debian 12's Vulkan headers (1.3.239) are too old for ``ggml-vulkan.cpp``
(``'LayerSettingEXT' is not a member of 'vk'``), so the build takes the headers of
Debian 13's ``libvulkan-dev`` (1.4.309): ``apt-get download`` from Debian's own archive
with a private sources list and state folder (the system's apt is not touched), unpacked
with ``dpkg-deb -x`` into the work folder. Shaders compile with the system's ``glslc``
(Debian 12's lacks the cooperative-matrix extensions; llama.cpp then leaves those
shaders out). Linking uses the system's ``libvulkan.so`` (Debian 12 ``libvulkan-dev``):
the loader's ABI is stable, the newer headers only add declarations.

Kept in pip's cache folder (``<cache>/shoal-vulkan/<version>-<key>/``), keyed by the
version, the machine kind and the options: a portable build (``GGML_NATIVE=OFF``), so the
bundle can carry it to other machines. Steps are skipped when their result is there.

``--server`` also builds, once, a ``llama-server`` with the Vulkan backend linked in
(static, native: ``SERVER_FLAGS``), for ``scripts/bench/gpu.py`` to compare a node with.
It is kept in the library's keyed folder, under ``server-<key>/`` keyed by its own
options and this CPU's instruction-set flags (a native binary is never taken for
another CPU), and takes the same Debian 13 headers and source steps.

    .venv/bin/python scripts/lib/vulkan_backend.py [--install] [--server] [--check] [--jobs N]

Prints the library's path (and, with ``--server``, the server's on the next line);
``--install`` also copies the library into the installed llama_cpp's ``lib/`` folder;
``--check`` only says whether they are built (exit 1 if not).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server import CMAKE_FLAGS as CPU_SERVER_FLAGS
from llama_server import (
    BuildFailed,
    Say,
    _download,
    _extract,
    _run_logged,
    cpu_flags,
    installed_version,
    works,
)

LIBRARY = "libggml-vulkan.so"
HEADERS_SUITE = "trixie"  # Debian 13: libvulkan-dev 1.4.309
HEADERS_PACKAGE = "libvulkan-dev"
DEBIAN_ARCHIVE = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_VULKAN=ON",
    "-DGGML_OPENMP=OFF",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
)
# --server: llama_server.py's CPU build (static, native) with the Vulkan backend linked in
SERVER_FLAGS = (*CPU_SERVER_FLAGS, "-DGGML_VULKAN=ON", "-DGGML_BACKEND_DL=OFF")
SERVER = "llama-server"
NEEDED_TOOLS = ("cmake", "c++", "glslc", "apt-get", "dpkg-deb")  # scripts/lib/apt.sh
APT_TIMEOUT = 600  # s
CONFIGURE_TIMEOUT = 600
BUILD_TIMEOUT = 3 * 3600


def _say(msg: str) -> None:
    print(f"[vulkan] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``<pip's cache>/shoal-vulkan``; ``SHOAL_VULKAN_CACHE`` overrides."""
    if own := os.environ.get("SHOAL_VULKAN_CACHE"):
        return Path(own).expanduser()
    pip = os.environ.get("PIP_CACHE_DIR")
    if not pip:
        pip = str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "pip")
    return Path(pip).expanduser() / "shoal-vulkan"


def build_key(version: str) -> str:
    digest = hashlib.sha256("\n".join((version, platform.machine(), platform.system(),
                                       HEADERS_SUITE, *CMAKE_FLAGS)).encode()).hexdigest()[:12]
    return f"{version}-{digest}"


def library_path(version: str | None = None, root: Path | None = None) -> Path:
    version = version or installed_version()
    return (root or cache_root()) / build_key(version) / LIBRARY


def server_path(version: str | None = None, root: Path | None = None) -> Path:
    """The Vulkan ``llama-server``: in the library's keyed folder, under a folder keyed by
    the server's options and this CPU's flags (it is a native build)."""
    version = version or installed_version()
    digest = hashlib.sha256("\n".join((cpu_flags(), *SERVER_FLAGS)).encode()).hexdigest()[:12]
    return library_path(version, root).parent / f"server-{digest}" / SERVER


def is_backend(lib: Path) -> bool:
    """A ggml backend module: an ELF file exporting ``ggml_backend_init``."""
    if not lib.is_file():
        return False
    try:
        r = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return lib.stat().st_size > 0  # no binutils: trust the keyed folder
    return r.returncode == 0 and " ggml_backend_init" in r.stdout


def fetch_headers(work: Path, say: Say) -> Path:
    """Debian 13's Vulkan headers unpacked under ``work/headers``; their include folder."""
    include = work / "headers" / "usr" / "include"
    if (include / "vulkan" / "vulkan.hpp").is_file():
        return include
    apt = work / "apt"
    for sub in ("lists/partial", "cache/archives/partial", "debs"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    sources = apt / "sources.list"
    sources.write_text(f"deb [signed-by={KEYRING}] {DEBIAN_ARCHIVE} {HEADERS_SUITE} main\n")
    opts = [f"-oDir::Etc::sourcelist={sources}", "-oDir::Etc::sourceparts=/dev/null",
            f"-oDir::State::Lists={apt / 'lists'}", f"-oDir::Cache={apt / 'cache'}",
            "-oAPT::Get::List-Cleanup=0", "-oDebug::NoLocking=1",
            "-oAPT::Sandbox::User=root"]
    say(f"fetching Debian {HEADERS_SUITE}'s {HEADERS_PACKAGE} (the Vulkan headers) "
        f"into {apt}; the system's apt is not touched")
    _run_logged(["apt-get", *opts, "update"], work / "apt-update.log", APT_TIMEOUT, say,
                "apt-get update")
    _run_logged(["apt-get", *opts, "download", HEADERS_PACKAGE], work / "apt-download.log",
                APT_TIMEOUT, say, "apt-get download", cwd=apt / "debs")
    debs = sorted((apt / "debs").glob(f"{HEADERS_PACKAGE}_*.deb"))
    if not debs:
        raise BuildFailed(f"apt-get download saved no {HEADERS_PACKAGE} in {apt / 'debs'}")
    _run_logged(["dpkg-deb", "-x", str(debs[-1]), str(work / "headers")],
                work / "dpkg-deb.log", APT_TIMEOUT, say, "dpkg-deb -x")
    if not (include / "vulkan" / "vulkan.hpp").is_file():
        raise BuildFailed(f"{debs[-1].name} holds no vulkan/vulkan.hpp")
    return include


def ensure_vulkan_backend(*, version: str | None = None, root: Path | None = None,
                          jobs: int = 2, say: Say = _say) -> Path:
    """The path of a built ``libggml-vulkan.so`` for the installed llama-cpp-python."""
    version = version or installed_version()
    lib = library_path(version, root)
    if is_backend(lib):
        return lib
    if sys.platform != "linux":
        raise BuildFailed("the Vulkan backend is built for Linux only (macOS uses Metal)")
    missing = [tool for tool in NEEDED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise BuildFailed(f"cannot build: {', '.join(missing)} not on PATH; install them "
                          "(apt install build-essential cmake glslc libvulkan-dev) and run "
                          "again")
    work = lib.parent.parent / f"work-{version}"
    work.mkdir(parents=True, exist_ok=True)
    say(f"building llama.cpp's Vulkan backend {version} once for this machine into "
        f"{lib.parent} (about 15 minutes on 2 cores; work folder {work})")
    include = fetch_headers(work, say)
    sdist = _download(work, version, say)
    src = _extract(sdist, work, version, say)
    build = work / "build"
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    if not (build / "CMakeCache.txt").is_file():
        say(f"configuring in {build}")
        _run_logged([*nice, "cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS,
                     f"-DVulkan_INCLUDE_DIR={include}"],
                    work / "configure.log", CONFIGURE_TIMEOUT, say, "configure")
    say(f"building with -j{jobs} (log: {work / 'build.log'})")
    _run_logged([*nice, "cmake", "--build", str(build), "--target", "ggml-vulkan",
                 "-j", str(jobs)], work / "build.log", BUILD_TIMEOUT, say, "build")
    return keep_built(build, lib, work, say, also=build / "ggml" / "src" / "ggml-vulkan")


def keep_built(build: Path, lib: Path, work: Path, say: Say, *, also: Path | None = None) -> Path:
    """The backend module a build made, copied to ``lib`` (atomically) and checked; the
    work folder removed. ``also``: one more folder the build may leave it in."""
    places = [build / "bin", build / "ggml" / "src", *([also] if also else [])]
    built = next((p / lib.name for p in places if (p / lib.name).is_file()), None)
    if built is None:
        raise BuildFailed(f"build failed: no {lib.name} under {build} after a successful build")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(lib)
    if not is_backend(lib):
        lib.unlink(missing_ok=True)
        raise BuildFailed(f"build failed: {built} exports no ggml_backend_init")
    shutil.rmtree(work, ignore_errors=True)
    say(f"built {lib}")
    return lib


def ensure_vulkan_server(*, version: str | None = None, root: Path | None = None,
                         jobs: int = 2, say: Say = _say) -> Path:
    """The path of a working ``llama-server`` with the Vulkan backend, built once."""
    version = version or installed_version()
    binary = server_path(version, root)
    if works(binary):
        return binary
    if sys.platform != "linux":
        raise BuildFailed("the Vulkan llama-server is built for Linux only")
    missing = [tool for tool in (*NEEDED_TOOLS, "make") if shutil.which(tool) is None]
    if missing:
        raise BuildFailed(f"cannot build: {', '.join(missing)} not on PATH; install them "
                          "(apt install build-essential cmake glslc libvulkan-dev) and run "
                          "again")
    work = binary.parent.parent.parent / f"work-server-{version}"
    work.mkdir(parents=True, exist_ok=True)
    say(f"building llama-server {version} with the Vulkan backend once for this machine "
        f"into {binary.parent} (work folder {work})")
    include = fetch_headers(work, say)
    src = _extract(_download(work, version, say), work, version, say)
    build = work / "build"
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    if not (build / "CMakeCache.txt").is_file():
        say(f"configuring in {build}")
        _run_logged([*nice, "cmake", "-S", str(src), "-B", str(build), *SERVER_FLAGS,
                     f"-DVulkan_INCLUDE_DIR={include}"],
                    work / "configure.log", CONFIGURE_TIMEOUT, say, "configure")
    say(f"building with -j{jobs} (log: {work / 'build.log'})")
    _run_logged([*nice, "cmake", "--build", str(build), "--target", SERVER, "-j", str(jobs)],
                work / "build.log", BUILD_TIMEOUT, say, "build")
    built = build / "bin" / SERVER
    if not built.is_file():
        raise BuildFailed(f"build failed: no {built} after a successful build")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(binary)
    if not works(binary):
        binary.unlink(missing_ok=True)
        raise BuildFailed(f"build failed: {built} does not run `--version`")
    shutil.rmtree(work, ignore_errors=True)
    say(f"built {binary}")
    return binary


def llama_lib_dir() -> Path:
    """The installed llama_cpp package's ``lib/`` folder (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise BuildFailed("llama-cpp-python is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def install_into(lib: Path, dest_dir: Path) -> Path:
    """``lib`` copied into ``dest_dir`` under its own name, atomically."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / lib.name
    tmp = dest.with_suffix(".tmp")
    shutil.copy2(lib, tmp)
    tmp.replace(dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--check", action="store_true",
                    help="only say whether the library is built (exit 1 if not)")
    ap.add_argument("--install", action="store_true",
                    help="also copy it into the installed llama_cpp's lib/ folder")
    ap.add_argument("--server", action="store_true",
                    help="also build a llama-server with the Vulkan backend (printed after "
                    "the library)")
    args = ap.parse_args()
    try:
        if args.check:
            lib = library_path()
            if not is_backend(lib):
                raise SystemExit(f"vulkan: not built yet (expected at {lib})")
            print(lib)
            if args.server:
                if not works(server := server_path()):
                    raise SystemExit(f"vulkan: llama-server not built yet (expected at {server})")
                print(server)
            return
        lib = ensure_vulkan_backend(jobs=args.jobs)
        if args.install:
            _say(f"installed {install_into(lib, llama_lib_dir())}")
        print(lib)
        if args.server:
            print(ensure_vulkan_server(jobs=args.jobs))
    except BuildFailed as exc:
        raise SystemExit(f"vulkan: {exc}") from None


if __name__ == "__main__":
    main()

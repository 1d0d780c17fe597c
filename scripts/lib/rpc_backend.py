"""Build (once per machine) llama.cpp's RPC backend, ``libggml-rpc.so``, and install it.

A model split across machines (issue 33) runs the layers the serving node does not hold
on the lending machines through this backend: its client side on the serving node
(``ggml_backend_rpc_add_server``), its server side on each lending machine
(``ggml_backend_rpc_start_server``), both reached only through the fleet's link
(``engine/node/lending.py``). llama-cpp-python's wheel does not build it, so it is built
here from the llama.cpp its sdist carries, as one loadable ggml module (``GGML_BACKEND_DL``)
that matches the ``libggml-base`` beside it, and copied into ``llama_cpp/lib`` (the bundle
takes it from there). Only ``ggml-base`` and the module compile: about 15 s on 2 cores.

Kept in pip's cache folder (``<cache>/shoal-rpc/<version>-<key>/``), keyed by the version,
the machine kind and the options; a step is skipped when its result is there.

    .venv/bin/python scripts/lib/rpc_backend.py [--install] [--check] [--jobs N]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server import BuildFailed, Say, _download, _extract, _run_logged, installed_version
from vulkan_backend import install_into, is_backend, keep_built, llama_lib_dir

LIBRARY = "libggml-rpc.so"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_RPC=ON",
    "-DGGML_CPU=OFF",  # the wheel's CPU variants serve the lent layers
    "-DGGML_OPENMP=OFF",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
)
CONFIGURE_TIMEOUT = 600
BUILD_TIMEOUT = 1800


def _say(msg: str) -> None:
    print(f"[rpc] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``<pip's cache>/shoal-rpc``; ``SHOAL_RPC_CACHE`` overrides."""
    if own := os.environ.get("SHOAL_RPC_CACHE"):
        return Path(own).expanduser()
    pip = os.environ.get("PIP_CACHE_DIR")
    if not pip:
        pip = str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "pip")
    return Path(pip).expanduser() / "shoal-rpc"


def library_path(version: str | None = None, root: Path | None = None) -> Path:
    version = version or installed_version()
    digest = hashlib.sha256("\n".join((version, platform.machine(), platform.system(),
                                       *CMAKE_FLAGS)).encode()).hexdigest()[:12]
    return (root or cache_root()) / f"{version}-{digest}" / LIBRARY


def ensure_rpc_backend(*, version: str | None = None, root: Path | None = None,
                       jobs: int = 2, say: Say = _say) -> Path:
    """The path of a built ``libggml-rpc.so`` for the installed llama-cpp-python."""
    version = version or installed_version()
    lib = library_path(version, root)
    if is_backend(lib):
        return lib
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise BuildFailed(f"cannot build: {', '.join(missing)} not on PATH; install them "
                          "(apt install build-essential cmake) and run again")
    work = lib.parent.parent / f"work-{version}"
    work.mkdir(parents=True, exist_ok=True)
    say(f"building llama.cpp's RPC backend {version} once for this machine into "
        f"{lib.parent} (work folder {work})")
    src = _extract(_download(work, version, say), work, version, say)
    build = work / "build"
    if not (build / "CMakeCache.txt").is_file():
        _run_logged(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
                    work / "configure.log", CONFIGURE_TIMEOUT, say, "configure")
    _run_logged(["cmake", "--build", str(build), "--target", "ggml-rpc", "-j", str(jobs)],
                work / "build.log", BUILD_TIMEOUT, say, "build")
    return keep_built(build, lib, work, say)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--check", action="store_true",
                    help="only say whether the library is built (exit 1 if not)")
    ap.add_argument("--install", action="store_true",
                    help="also copy it into the installed llama_cpp's lib/ folder")
    args = ap.parse_args()
    try:
        if args.check:
            lib = library_path()
            if not is_backend(lib):
                raise SystemExit(f"rpc: not built yet (expected at {lib})")
            print(lib)
            return
        lib = ensure_rpc_backend(jobs=args.jobs)
        if args.install:
            _say(f"installed {install_into(lib, llama_lib_dir())}")
        print(lib)
    except BuildFailed as exc:
        raise SystemExit(f"rpc: {exc}") from None


if __name__ == "__main__":
    main()

"""llama.cpp's CPU backend, when the build carries one library per CPU variant.

A portable build (``GGML_BACKEND_DL`` with CPU variants: the bundle's, and the one
``scripts/run`` and ``scripts/test`` install into ``.venv``) has ``libggml-cpu-<variant>.so``
files instead of one CPU library. ggml looks for them beside the executable and in the
working folder, which for a Python program is neither; the bundle moves them beside its
executable, and everywhere else the runtime loads the best one from ``llama_cpp/lib``
itself, scored the way ggml scores them (each library's ``ggml_backend_score`` for this
CPU; 0 means it cannot run here). The GPU backends that sit in the same folder are loaded
on their own terms (``engine/runtimes/gpu.py``), never here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from pathlib import Path
from typing import Any

VARIANT_GLOB = "libggml-cpu-*.so"
_SONAME = re.compile(r"^libggml\.so\.\d+$")


def lib_dir(binding: Any) -> Path:
    """The folder of llama-cpp-python's libraries, beside its binding module."""
    return Path(str(binding.__file__)).parent / "lib"


@functools.cache
def ggml_in_use(lib_dir: Path, fallback: Any) -> Any:
    """libggml as libllama uses it: the one backend registry that llama.cpp reads.

    The wheel holds ``libggml.so`` and ``libggml.so.0`` as two copies of one file; libllama
    loads the second by its soname, and llama-cpp-python's ``_ggml`` opens the first by its
    path, which makes a second copy with a registry of its own, where a backend loaded is
    never seen by llama.cpp. Opened by its soname alone, the loader hands back the copy
    already loaded for libllama. ``fallback`` (``_ggml.libggml``) where there is none
    (a Mac's dylibs, a build whose files are links)."""
    for path in sorted(lib_dir.glob("libggml.so.*")) if lib_dir.is_dir() else []:
        if _SONAME.match(path.name):
            try:
                return ctypes.CDLL(path.name)
            except OSError:
                break
    return fallback


def variant_libraries(lib_dir: Path) -> list[Path]:
    """The CPU variants beside libllama (none in a native build or in the bundle)."""
    return sorted(lib_dir.glob(VARIANT_GLOB)) if lib_dir.is_dir() else []


def score(path: Path) -> int:
    """ggml's score of one variant for this CPU (0: cannot run here or not a variant)."""
    try:
        lib = ctypes.CDLL(os.fspath(path))
        fn = lib.ggml_backend_score
    except (OSError, AttributeError):
        return 0
    fn.argtypes = []
    fn.restype = ctypes.c_int
    return int(fn())


def best_variant(lib_dir: Path) -> Path | None:
    """The highest-scoring variant for this CPU, or None."""
    scored = [(score(p), p) for p in variant_libraries(lib_dir)]
    best = max(scored, default=(0, None), key=lambda sp: sp[0])
    return best[1] if best[0] > 0 else None


def load_cpu_variant(lib_dir: Path, ggml: Any) -> Path | None:
    """Load the best CPU variant from ``lib_dir`` into ``ggml`` (libggml, as ctypes sees it)
    unless a CPU backend is there already; returns what it loaded."""
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    if ggml.ggml_backend_reg_by_name(b"CPU"):
        return None
    best = best_variant(lib_dir)
    if best is None:
        return None
    ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load.restype = ctypes.c_void_p
    return best if ggml.ggml_backend_load(os.fspath(best).encode()) else None

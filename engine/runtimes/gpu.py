"""The GPUs llama.cpp can use in this process: its Vulkan backend loaded, devices listed.

On Linux the Vulkan backend is one loadable ggml library, ``libggml-vulkan.so``, beside
llama-cpp-python's own libraries (``llama_cpp/lib``: the bundle carries it there, and
``scripts/lib/vulkan_backend.py --install`` puts it in a dev ``.venv``). It is loaded
here, once per process and only when a node wants a GPU, rather than by ggml's search
at start, so that ``--gpu off`` never touches a driver. On macOS the Metal backend is
part of the build and is listed like any other device.

The library needs the Vulkan loader (``libvulkan.so.1``) and a driver; where either is
missing or fails, :func:`gpu_devices` lists nothing and says why in one line, and the
node runs on the CPU. Decisions are made in :mod:`engine.runtimes.offload`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.runtimes import llama_log
from engine.runtimes.cpu_backend import ggml_in_use, lib_dir
from engine.runtimes.offload import Device, DeviceKind

VULKAN_LIBRARY = "libggml-vulkan.so"
# ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL, META
_KINDS: dict[int, DeviceKind] = {1: "gpu", 2: "igpu"}

_lock = threading.Lock()
_loaded: GpuBackends | None = None


@dataclass(frozen=True, slots=True)
class GpuBackends:
    devices: list[Device]
    unavailable: str  # why no GPU backend loaded ("" when one did)


def _ggml(lib: Any) -> Any:
    """libggml, typed for the calls below (llama-cpp-python loads it beside libllama)."""
    from llama_cpp import _ggml

    # the copy of libggml whose registry llama.cpp reads (cpu_backend.ggml_in_use)
    g = ggml_in_use(lib_dir(lib), _ggml.libggml)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, args, res in (
        ("ggml_backend_load", [ctypes.c_char_p], vp),
        ("ggml_backend_reg_by_name", [ctypes.c_char_p], vp),
        ("ggml_backend_dev_count", [], sz),
        ("ggml_backend_dev_get", [sz], vp),
        ("ggml_backend_dev_name", [vp], ctypes.c_char_p),
        ("ggml_backend_dev_description", [vp], ctypes.c_char_p),
        ("ggml_backend_dev_type", [vp], ctypes.c_int),
        ("ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
    ):
        fn = getattr(g, name)
        fn.argtypes = args
        fn.restype = res
    return g


def vulkan_library() -> Path | None:
    """Where this install keeps the Vulkan backend, if it has one."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "lib" / VULKAN_LIBRARY
    return path if path.is_file() else None


def _load_vulkan(g: Any) -> str:
    """Load the Vulkan backend once; "" when it is in, else why not (one line)."""
    if sys.platform != "linux" or g.ggml_backend_reg_by_name(b"Vulkan"):
        return ""
    path = vulkan_library()
    if path is None:
        return ("this llama.cpp build has no Vulkan backend (scripts/test builds it into "
                ".venv; the .deb carries it)")
    if ctypes.util.find_library("vulkan") is None:
        try:
            ctypes.CDLL("libvulkan.so.1")
        except OSError:
            return "the Vulkan loader is not installed (apt install libvulkan1)"
    if not g.ggml_backend_load(os.fspath(path).encode()):
        return ("llama.cpp's Vulkan backend did not start: no working Vulkan driver (install "
                "your GPU's Vulkan driver, mesa-vulkan-drivers or the vendor's; "
                "SHOAL_LLAMA_LOG=1 shows llama.cpp's log)")
    return ""


def _list(g: Any) -> list[Device]:
    out: list[Device] = []
    for i in range(int(g.ggml_backend_dev_count())):
        dev = g.ggml_backend_dev_get(i)
        kind = _KINDS.get(int(g.ggml_backend_dev_type(dev)))
        if kind is None:
            continue
        if sys.platform == "darwin":
            kind = "igpu"  # Apple silicon's memory is the RAM: the budget counts all of it
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(Device(name=(g.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                          description=(g.ggml_backend_dev_description(dev) or b"").decode(
                              errors="replace"),
                          kind=kind, free=int(free.value), total=int(total.value)))
    return out


def gpu_backends(lib: Any) -> GpuBackends:
    """The GPU devices llama.cpp lists, the Vulkan backend loaded first (once)."""
    global _loaded
    llama_log.route(lib)  # the backend's own lines go to Shoal's log, not the terminal
    with _lock:
        if _loaded is not None:
            # free memory changes: list again, the backend stays loaded
            return GpuBackends(_list(_ggml(lib)), _loaded.unavailable)
        g = _ggml(lib)
        why = _load_vulkan(g)
        devices = _list(g)
        if not devices and not why and sys.platform == "linux":
            why = ("no Vulkan driver lists a GPU (install your GPU's Vulkan driver: "
                   "mesa-vulkan-drivers, or the vendor's)")
        _loaded = GpuBackends(devices, why)
        return _loaded


def device_handle(lib: Any, name: str) -> int | None:
    """ggml's handle of the device called ``name`` (for llama_model_params.devices)."""
    g = _ggml(lib)
    for i in range(int(g.ggml_backend_dev_count())):
        dev = g.ggml_backend_dev_get(i)
        if (g.ggml_backend_dev_name(dev) or b"").decode(errors="replace") == name:
            return int(dev)
    return None

"""llama.cpp's RPC backend in this process: a model's layers on another machine's memory.

The backend is one loadable ggml library, ``libggml-rpc.so``, beside llama-cpp-python's own
(``scripts/lib/rpc_backend.py --install`` builds it into a dev ``.venv``; the bundle
carries it). It is loaded here once, when a node first splits a model or lends memory,
as the Vulkan backend is (engine.runtimes.gpu). Two sides:

- serving: :func:`add_server` registers a lending machine's device at an endpoint
  (``127.0.0.1:PORT``, the local end of a tunnel over the fleet's link) and gives its
  handle, which a model's load takes as the device for the layers it does not keep;
- lending: :func:`serve` runs llama.cpp's RPC server on this machine's CPU at an
  endpoint that must be ``127.0.0.1`` (engine.node.lending runs it in a process of its
  own: it serves until killed, one client at a time), with its tensor cache.

llama.cpp's own README calls the RPC server fragile and insecure and says never to open it
to a network: here it listens on loopback only and the fleet's encrypted link carries its
bytes between machines.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.runtimes.base import RuntimeUnavailable

RPC_LIBRARY = "libggml-rpc.so"

_lock = threading.Lock()
_fns: _Rpc | None = None


@dataclass(frozen=True, slots=True)
class _Rpc:
    g: Any  # libggml, typed
    add_server: Any
    start_server: Any


def rpc_library() -> Path | None:
    """Where this install keeps the RPC backend, if it has one."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "lib" / RPC_LIBRARY
    return path if path.is_file() else None


def _load() -> _Rpc:
    global _fns
    with _lock:
        if _fns is not None:
            return _fns
        from engine.runtimes.gpu import _ggml
        from engine.runtimes.llamacpp import _lib

        g = _ggml(_lib())
        g.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        g.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
        g.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
        g.ggml_backend_dev_by_type.restype = ctypes.c_void_p
        g.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        g.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
        g.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
        g.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
        g.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
        g.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
        reg = g.ggml_backend_reg_by_name(b"RPC")
        if not reg:
            path = rpc_library()
            if path is None:
                raise RuntimeUnavailable(
                    "this llama.cpp build has no RPC backend, which splitting a model across "
                    "machines and lending memory need; run scripts/lib/rpc_backend.py "
                    "--install (the .deb carries it)")
            reg = g.ggml_backend_load(os.fspath(path).encode())
            if not reg:
                raise RuntimeUnavailable(f"llama.cpp could not load its RPC backend {path}; "
                                         "run scripts/lib/rpc_backend.py --install again")
        add = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        start = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_start_server")
        if not add or not start:
            raise RuntimeUnavailable("llama.cpp's RPC backend lacks its server functions; "
                                     "run scripts/lib/rpc_backend.py --install again")
        _fns = _Rpc(
            g=g,
            add_server=ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add),
            start_server=ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p,
                                          ctypes.c_size_t, ctypes.c_size_t,
                                          ctypes.c_void_p)(start))
        return _fns


def check_available() -> None:
    """RuntimeUnavailable (one line: cause and fix) when the RPC backend cannot load."""
    _load()


def add_server(endpoint: str) -> int:
    """The first device of the RPC server at ``endpoint`` (registered once per endpoint by
    llama.cpp, which asks the server for its devices: blocking, off the loop)."""
    rpc = _load()
    reg = rpc.add_server(endpoint.encode())
    if not reg or not rpc.g.ggml_backend_reg_dev_count(reg):
        raise RuntimeUnavailable(f"the lending machine's RPC server at {endpoint} did not "
                                 "answer; check that it still lends memory")
    return int(rpc.g.ggml_backend_reg_dev_get(reg, 0))


class _Override(ctypes.Structure):
    """llama.cpp's llama_model_tensor_buft_override: tensors whose name the pattern finds
    go to that buffer type."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# the output layer (its norm and weights; Gemma's tied output is a second token_embd):
# llama.cpp puts it with the last of the layers given to devices, so on the lending machine
# it would compute every token's logits there (a MiB per token back over the link, and a
# batch's logits, 512 MiB for a 262k vocabulary, in the lent memory)
OUTPUT_HERE = b"^(output|token_embd)"


def output_here() -> Any:
    """The NULL-terminated overrides that keep the output layer in this machine's RAM
    (for llama_model_params.tensor_buft_overrides; keep the array alive while loading)."""
    rpc = _load()
    cpu = rpc.g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    buft = rpc.g.ggml_backend_dev_buffer_type(cpu)
    return (_Override * 2)(_Override(OUTPUT_HERE, buft), _Override(None, None))


def serve(endpoint: str, cache_dir: str, threads: int) -> None:
    """Serve this machine's CPU to one RPC client at a time at ``endpoint`` (127.0.0.1
    only), caching tensors under ``cache_dir``; returns only when the server fails."""
    if not endpoint.startswith("127.0.0.1:"):
        raise ValueError("the RPC server listens on 127.0.0.1 only; the fleet's link "
                         "carries it to other machines")
    rpc = _load()
    cpu = rpc.g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    devices = (ctypes.c_void_p * 1)(cpu)
    rpc.start_server(endpoint.encode(), cache_dir.encode(), max(threads, 1), 1,
                     ctypes.cast(devices, ctypes.c_void_p))

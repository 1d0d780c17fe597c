"""A persistent ggml CPU threadpool for one llama.cpp context.

Without one attached, ggml's CPU backend makes a pool for every graph it computes: it
starts the pool's threads for each ``llama_decode`` and joins them after. Each start is a
new thread the scheduler must place while the caller waits at the graph's first barrier;
in a node process (an event loop and a link beside the compute) an embedding of one short
text took 3.4 ms at the median with a kept pool and 11-13 ms without, 25 ms at the 90th
percentile. llama-server attaches one to every context (``common_threadpools``).

``poll`` is 0: the pool's threads sleep between graphs instead of spinning for a while
(llama-server's default, 50), which would take the CPUs from a node's other models and
drain a laptop's battery for no gain here (no faster at one or sixteen inputs).

The pool comes from the CPU backend's registry (``ggml_threadpool_new`` is not exported
by libllama itself), so a build whose CPU backend lacks it gets None, and ggml keeps its
own per-graph pools.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

GGML_MAX_N_THREADS = 512  # ggml.h
_DEVICE_CPU = 0  # GGML_BACKEND_DEVICE_TYPE_CPU


class _Params(ctypes.Structure):
    """ggml.h's ``struct ggml_threadpool_params``."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),  # enum ggml_sched_priority
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


_New = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_Params))
_Free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@dataclass(frozen=True, slots=True)
class Threadpool:
    """An attached pool: free it after the context it serves (``free``)."""

    handle: int
    _free: Any


def _declare(so: Any) -> None:
    so.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    so.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    so.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    so.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    so.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    so.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    so.ggml_threadpool_params_init.restype = None
    so.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(_Params), ctypes.c_int]
    so.llama_attach_threadpool.restype = None
    so.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


def attach(so: Any, ctx: Any, n_threads: int) -> Threadpool | None:
    """Make a pool of ``n_threads`` and attach it to ``ctx`` (decode and batch alike);
    None where the CPU backend offers no pools. ``so``: llama.cpp's shared library."""
    if n_threads < 1:
        raise ValueError("a threadpool needs at least one thread")
    _declare(so)
    dev = so.ggml_backend_dev_by_type(_DEVICE_CPU)
    reg = so.ggml_backend_dev_backend_reg(dev) if dev else None
    new_at = so.ggml_backend_reg_get_proc_address(reg, b"ggml_threadpool_new") if reg else None
    free_at = so.ggml_backend_reg_get_proc_address(reg, b"ggml_threadpool_free") if reg else None
    if not new_at or not free_at:
        return None
    params = _Params()
    so.ggml_threadpool_params_init(ctypes.byref(params), min(n_threads, GGML_MAX_N_THREADS))
    params.poll = 0
    handle = _New(new_at)(ctypes.byref(params))
    if not handle:
        return None
    so.llama_attach_threadpool(ctx, handle, None)
    return Threadpool(handle=handle, _free=_Free(free_at))


def free(pool: Threadpool) -> None:
    """Free ``pool``: only after the context it was attached to is freed (or detached)."""
    pool._free(pool.handle)

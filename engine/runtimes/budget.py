"""How much memory a node may use, and how its KV pool and host cache fit in it.

The budget covers the whole node process: the interpreter and libraries (``base``),
the model's weights, the KV pool that all lanes share, llama.cpp's compute buffers
(``overhead``) and the host-memory prompt cache. :func:`plan_pool` is pure; the
readers of this machine's memory below it do the IO.

The default budget leaves the desktop usable: half of the RAM, but at least 4 GiB
left to everything else, and never under a quarter of the RAM (a small machine
lends a quarter). 16 GiB gives 8 GiB, 8 GiB gives 4, 4 GiB gives 1.

The pool holds one whole window (a session may grow to the model's trained
context, or ``--max-context``), and at least ``MIN_CELLS_PER_LANE`` per lane, as
llama-server's ``-c`` with ``--kv-unified``; not more, however large the budget,
since what is idle in RAM is the desktop's. What the budget leaves after it goes
to the host cache, up to ``HOST_CACHE_MAX`` (llama-server's ``--cache-ram``
default).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

from engine.sizes import GiB, amount

MIN_CELLS_PER_LANE = 1024
POOL_FLOOR = 512  # fewer cells than this cannot hold a chat turn
CELL_ROUND = 256  # llama.cpp pads its context to this
HOST_CACHE_MAX = 8 * GiB
DEFAULT_TRAIN_CONTEXT = 4096  # a model that names no trained context


def default_budget_bytes(total: int) -> int:
    """The share of ``total`` RAM a node uses unless told otherwise (see the module doc)."""
    return max(min(total // 2, total - 4 * GiB), total // 4)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    cells: int  # KV cells of the pool all lanes share
    window: int  # tokens one session may hold
    host_cache_bytes: int  # what the host-memory prompt cache may hold
    kv_bytes: int  # the pool's size in bytes


class BudgetTooSmall(ValueError):
    """The budget cannot hold the model and a usable pool; the message names the fix."""


def wanted_cells(*, lanes: int, n_ctx_train: int, max_context: int | None,
                 pool_cells: int | None = None) -> int:
    """The pool a node asks for before the budget has its say (see the module doc)."""
    if pool_cells is not None:
        return max(pool_cells, POOL_FLOOR)
    lanes = max(lanes, 1)
    want_window = max_context or n_ctx_train or DEFAULT_TRAIN_CONTEXT
    return min(max(want_window, lanes * MIN_CELLS_PER_LANE), lanes * want_window)


def plan_pool(
    *,
    budget: int,
    base: int,
    model_bytes: int,
    overhead: int,
    kv_bytes_per_token: int,
    lanes: int,
    n_ctx_train: int,
    max_context: int | None,
    pool_cells: int | None = None,
    device_cells: int | None = None,
) -> PoolPlan:
    """The pool, window and host cache that fit ``budget`` (see the module doc).

    ``pool_cells`` sizes the pool itself (as llama-server's ``-c``: benchmarks compare
    them at one size), still within the budget; the window is then at most the pool.
    With a GPU (:mod:`engine.runtimes.offload`), ``model_bytes`` and
    ``kv_bytes_per_token`` are what stays in RAM, and ``device_cells`` the pool the
    device has room for.
    """
    per_token = max(kv_bytes_per_token, 1)
    want_window = max_context or n_ctx_train or DEFAULT_TRAIN_CONTEXT
    want_cells = wanted_cells(lanes=lanes, n_ctx_train=n_ctx_train, max_context=max_context,
                              pool_cells=pool_cells)
    room = budget - base - model_bytes - overhead
    fit = max(room, 0) // per_token
    if device_cells is not None:
        fit = min(fit, device_cells)
    if fit < POOL_FLOOR:
        raise BudgetTooSmall(
            f"a memory budget of {amount(budget)} leaves no room for the KV cache "
            f"(the model takes {amount(model_bytes)}, the process "
            f"{amount(base + overhead)}); raise --memory-budget or serve a smaller "
            "model")
    cells = min(want_cells, fit)
    if cells > CELL_ROUND:
        cells = cells // CELL_ROUND * CELL_ROUND
    if max_context is not None and cells < max_context and pool_cells is None:
        raise BudgetTooSmall(
            f"--max-context {max_context} needs {amount(max_context * per_token)} of KV "
            f"cache and the memory budget of {amount(budget)} leaves "
            f"{amount(max(room, 0))}; lower --max-context, raise --memory-budget or use "
            "--kv-type q8_0")
    window = min(want_window, cells)
    kv_bytes = cells * per_token
    host = min(max(room - kv_bytes, 0), HOST_CACHE_MAX)
    return PoolPlan(cells=cells, window=window, host_cache_bytes=host, kv_bytes=kv_bytes)


# -- this machine ------------------------------------------------------------------------


def total_memory_bytes() -> int:
    """Physical memory: MemTotal on Linux, the page count elsewhere (macOS)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    with contextlib.suppress(ValueError, OSError):
        pages = os.sysconf("SC_PHYS_PAGES")
        if pages > 0:
            return int(os.sysconf("SC_PAGE_SIZE") * pages)
    return 8 * GiB


def process_rss_bytes() -> int:
    """This process's resident memory now (Linux); elsewhere its peak, an upper bound."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB else

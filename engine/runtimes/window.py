"""How many tokens one lane holds when ``--max-context`` does not say: shared by the runtimes."""

from __future__ import annotations

import contextlib
import os

WINDOW_FLOOR = 512


def available_memory_bytes() -> int:
    """Memory free for the KV cache: MemAvailable on Linux, else physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        for name in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
            with contextlib.suppress(ValueError, OSError):
                pages = os.sysconf(name)
                if pages > 0:
                    return int(page * pages)
    except (ValueError, OSError):
        pass
    return 4 * 1024**3


def size_window(
    *, free_bytes: int, model_bytes: int, kv_bytes_per_token: int, lanes: int, n_ctx_train: int
) -> int:
    """Per-lane window: half of the memory left after the model, over all lanes.

    Capped by the model's training context, floored at 512 tokens, rounded
    down to a multiple of 256 above the floor.
    """
    left = max(free_bytes - model_bytes, 0)
    per_lane = left // 2 // max(kv_bytes_per_token, 1) // max(lanes, 1)
    if n_ctx_train > 0:
        per_lane = min(per_lane, n_ctx_train)
    if per_lane > WINDOW_FLOOR:
        per_lane = max(WINDOW_FLOOR, per_lane // 256 * 256)
    return max(int(per_lane), WINDOW_FLOOR)

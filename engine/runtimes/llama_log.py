"""llama.cpp's and ggml's own log, into Shoal's (the logger ``shoal.llama``).

Left alone, llama.cpp writes to the terminal: `shoal models catalog --fits` opened with
``ggml_vulkan: No devices found.`` and ``load_backend: loaded Vulkan backend from ...``.
Its lines go to the logger at DEBUG (errors at WARNING), so they show at the level the
user chose; what matters Shoal says in its own words (the GPU used or not, and why).
``SHOAL_LLAMA_LOG=1`` still copies every line to stderr, for a bug report.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger("shoal.llama")
# ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT (a line's continuation)
_LEVELS = {4: logging.WARNING}
_lock = threading.Lock()
_callback: Any = None  # the ctypes callback must outlive every call into llama.cpp
_pending: dict[int, str] = {}  # a line in parts, per thread, until its newline


def _heard(level: int, text: bytes | None, user_data: object) -> None:
    if not text:
        return
    line = text.decode("utf-8", errors="replace")
    if os.environ.get("SHOAL_LLAMA_LOG", "") == "1":
        sys.stderr.write(line)
    key = threading.get_ident()
    line = _pending.pop(key, "") + line
    if not line.endswith("\n"):
        _pending[key] = line[-4096:]  # bounded: a part that never ends
        return
    log.log(_LEVELS.get(level, logging.DEBUG), "llama.cpp: %s", line.rstrip())


def route(lib: Any) -> None:
    """Send llama.cpp's log (and ggml's: llama_log_set sets both) to ``shoal.llama``;
    once per process, before anything loads a backend."""
    global _callback
    with _lock:
        if _callback is None:
            _callback = lib.llama_log_callback(_heard)
            lib.llama_log_set(_callback, None)

"""What llama.cpp must not do on this CPU (read once; the decision itself is pure).

On CPUs with AMX (Intel Sapphire Rapids and later) llama.cpp repacks a model's weights
into AMX tiles at load ("extra" CPU buffer types), and its AMX matrix multiply crashes
the process at the first decode on some of those machines (llama.cpp issue 20824,
closed unfixed; the dspy project met it on its CI runners). It did so on every run on
the machine Shoal is developed on. So on a CPU with AMX the weights stay as they are in
the file: a crash takes a whole node down, a slower matrix multiply only slows it.
``SHOAL_LLAMA_REPACK=1`` turns repacking back on for a machine where it works.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})


def repack_allowed(cpu_flags: frozenset[str], env: str | None) -> bool:
    """Whether llama.cpp may repack weights into its extra CPU buffers."""
    if env is not None and env.strip():
        return env.strip() not in ("0", "false", "no", "off")
    return not (cpu_flags & AMX_FLAGS)


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is not there: macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def repack_here() -> bool:
    """The decision for this machine (reads a file: call it where loading happens)."""
    return repack_allowed(cpu_flags(), os.environ.get("SHOAL_LLAMA_REPACK"))

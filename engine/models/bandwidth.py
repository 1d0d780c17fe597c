"""This machine's memory bandwidth, measured once, and its GPU's, known by name: what
:mod:`engine.models.speed` turns into tokens/s.

The RAM is measured by reading a buffer larger than any CPU cache (numpy's max over
bytes, which SIMD makes a pure read), on one thread and on as many as llama.cpp would use
(numpy releases the GIL while it reads), the median of a few passes each, the better of
the two kept, in about a second at most. Without numpy one thread copies a bytearray. The
figure is kept in ``$SHOAL_HOME/machine-speed.json`` under the CPU's model, its usable
cores and the RAM size, so it is measured once per machine, not at every start.

A GPU's bandwidth cannot be read from llama.cpp's device listing (it gives a name and
memory only), so it comes from a table of rated figures by name; a GPU not in the table
has none (0), and the estimate for models on it is absent. An integrated GPU not in the
table reads the same RAM as the CPU: it gets the RAM's figure.

IO (it reads and writes a file, and spends up to a second reading RAM): call it off the
event loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.runtimes.budget import total_memory_bytes

SPEED_FILE = "machine-speed.json"
MAX_SPEED_FILE = 4096
BUFFER_BYTES = 128 << 20  # beyond any CPU's last-level cache
MAX_THREADS = 16
PASSES = 8
MAX_SECONDS = 1.0  # stop measuring after this, with the best pass so far
# one measurement at a time: callers that ask together get the first one's figure (two
# copies at once would each read half as fast, and say so)
_measuring = threading.Lock()

GB = 1_000_000_000
# rated memory bandwidth (GB/s) by the name a driver gives, from the vendors' spec sheets;
# a longer name is matched before a shorter one it contains ("RTX 4070 Ti" before
# "RTX 4070"). Laptop parts share desktop names at lower figures: they are not matched.
GPU_BANDWIDTH_GBS: dict[str, int] = {
    # NVIDIA data centre
    "H200": 4800, "H100 PCIe": 2000, "H100": 3350, "A100": 1555, "L40S": 864, "L40": 864,
    "L4": 300, "A10G": 600, "A10": 600, "T4": 320, "V100": 900,
    # NVIDIA GeForce
    "RTX 5090": 1792, "RTX 5080": 960, "RTX 5070 Ti": 896, "RTX 5070": 672,
    "RTX 5060 Ti": 448, "RTX 4090": 1008, "RTX 4080 SUPER": 736, "RTX 4080": 717,
    "RTX 4070 Ti SUPER": 672, "RTX 4070 Ti": 504, "RTX 4070 SUPER": 504, "RTX 4070": 504,
    "RTX 4060 Ti": 288, "RTX 4060": 272, "RTX 3090 Ti": 1008, "RTX 3090": 936,
    "RTX 3080 Ti": 912, "RTX 3080": 760, "RTX 3070 Ti": 608, "RTX 3070": 448,
    "RTX 3060 Ti": 448, "RTX 3060": 360, "RTX 3050": 224, "RTX 2080 Ti": 616,
    "RTX 2080": 448, "RTX 2070": 448, "RTX 2060": 336,
    # AMD Radeon
    "RX 7900 XTX": 960, "RX 7900 XT": 800, "RX 7800 XT": 624, "RX 7700 XT": 432,
    "RX 7600": 288, "RX 6900 XT": 512, "RX 6800 XT": 512, "RX 6800": 512, "RX 6700 XT": 384,
    # Apple silicon (unified memory; the lower figure where a chip comes in two)
    "M1 Ultra": 800, "M1 Max": 400, "M1 Pro": 200, "M1": 68, "M2 Ultra": 800,
    "M2 Max": 400, "M2 Pro": 200, "M2": 100, "M3 Ultra": 819, "M3 Max": 300, "M3 Pro": 150,
    "M3": 100, "M4 Max": 410, "M4 Pro": 273, "M4": 120,
}
_GPU_PATTERNS = [(re.compile(rf"(?<![A-Z0-9]){re.escape(name.upper())}(?![A-Z0-9])"), gbs)
                 for name, gbs in sorted(GPU_BANDWIDTH_GBS.items(), key=lambda kv: -len(kv[0]))]


def gpu_bandwidth(description: str, kind: str, mem_bandwidth: int) -> int:
    """Bytes/s of the GPU llama.cpp described as ``description`` (0: not known). An
    integrated GPU (``kind`` "igpu") not in the table reads at the RAM's ``mem_bandwidth``."""
    if not kind:
        return 0
    name = description.upper()
    if "LAPTOP" not in name and "MOBILE" not in name:
        for pattern, gbs in _GPU_PATTERNS:
            if pattern.search(name):
                return gbs * GB
    return mem_bandwidth if kind == "igpu" else 0


# -- the RAM ----------------------------------------------------------------------------


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # macOS has no affinity
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name as the OS gives it ("" when it does not)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8",
                                            errors="replace") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()[:200]
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["/usr/sbin/sysctl", "-n", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5, check=False)
            if out.stdout.strip():
                return out.stdout.strip()[:200]
    return (platform.processor() or platform.machine())[:200]


def machine_key() -> str:
    """What the measured figure belongs to: another CPU, core count or RAM size measures
    again."""
    return f"{cpu_model()}|{_cpus()} cpus|{total_memory_bytes()} bytes"


def _measure_numpy(threads: int) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    src = np.ones(BUFFER_BYTES, dtype=np.uint8)  # written once: its pages are all mapped
    best, start = 0.0, time.perf_counter()
    for n in sorted({1, threads}):  # one thread wins on a busy machine, all on an idle one
        step = -(-BUFFER_BYTES // n)
        parts = [src[i:i + step] for i in range(0, BUFFER_BYTES, step)]
        rates: list[float] = []
        with ThreadPoolExecutor(len(parts)) as pool:
            for i in range(PASSES + 1):  # the first pass starts the threads: not kept
                t0 = time.perf_counter()
                list(pool.map(np.max, parts))  # SIMD over bytes: the read, not the max, counts
                if i:
                    rates.append(BUFFER_BYTES / max(time.perf_counter() - t0, 1e-9))
                if time.perf_counter() - start > MAX_SECONDS:
                    break
        if rates:  # the median pass: one lucky or unlucky pass moves it little
            best = max(best, statistics.median(rates))
        if time.perf_counter() - start > MAX_SECONDS:
            break
    return int(best)


def _measure_bytes() -> int:
    src = bytes(BUFFER_BYTES)
    dst = bytearray(BUFFER_BYTES)
    view = memoryview(dst)
    best, start = 0.0, time.perf_counter()
    for _ in range(PASSES):
        t0 = time.perf_counter()
        view[:] = src
        # a copy reads and writes each byte; a read alone would take about half the time
        best = max(best, 2 * BUFFER_BYTES / max(time.perf_counter() - t0, 1e-9))
        if time.perf_counter() - start > MAX_SECONDS:
            break
    return int(best)


def measure_memory_bandwidth() -> int:
    """Bytes/s this machine reads from RAM, measured now."""
    try:
        return _measure_numpy(min(_cpus(), MAX_THREADS))
    except ImportError:
        return _measure_bytes()


def _cached(path: Path, key: str) -> int:
    try:
        with path.open("rb") as fh:
            data = json.loads(fh.read(MAX_SPEED_FILE))
    except (OSError, ValueError):
        return 0
    if not isinstance(data, dict) or data.get("key") != key:
        return 0
    value = data.get("mem_bandwidth")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


MACHINE_CACHE_ENV = "SHOAL_MACHINE_CACHE"


def machine_cache(home: Path) -> Path:
    """Where what is true of this machine is kept: ``home`` (everything Shoal writes is
    under it), or ``$SHOAL_MACHINE_CACHE`` where set (the tests share one measurement
    across their many homes)."""
    env = os.environ.get(MACHINE_CACHE_ENV)
    return Path(env) if env else home


def memory_bandwidth(folder: Path) -> int:
    """This machine's RAM bandwidth (bytes/s): kept in ``folder`` (machine_cache(home))
    after its first measurement; 0 when it cannot be measured."""
    key = machine_key()
    path = folder / SPEED_FILE
    with _measuring:
        known = _cached(path, key)
        if known:
            return known
        try:
            measured = measure_memory_bandwidth()
        except (MemoryError, OSError):
            return 0
        if measured > 0:
            with contextlib.suppress(OSError):
                folder.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"key": key, "mem_bandwidth": measured}),
                               encoding="utf-8")
                tmp.replace(path)
        return measured

"""This machine's figures for the fit estimate (:mod:`engine.models.fit`): RAM, the node's
memory budget, the GPU llama.cpp would choose, the disk free where models go, and the
bandwidths that set its decode speed (:mod:`engine.models.bandwidth`).

IO (it may load llama.cpp's GPU backend to list devices, and measures the RAM's bandwidth
the first time): call it off the event loop.
"""

from __future__ import annotations

import socket
from pathlib import Path

from engine.models import bandwidth, ids
from engine.models.fit import Machine
from engine.models.pulls import disk
from engine.runtimes.budget import total_memory_bytes
from engine.sizes import Budget, amount, budget_bytes


def disk_free(home: Path) -> int | None:
    """Bytes free on the filesystem that holds ``home``'s models (None: cannot tell)."""
    try:
        return disk.free_bytes(ids.models_dir(home))
    except OSError:
        return None


def gpu_device(gpu: str) -> tuple[str, int, int, str]:
    """(kind, total, free, description) of the device ``--gpu gpu`` would take, or
    ("", 0, 0, why none) when the node would run on the CPU."""
    if gpu == "off":
        return "", 0, 0, "off"
    try:
        import llama_cpp

        from engine.runtimes.gpu import gpu_backends
        from engine.runtimes.offload import choose_device
    except ImportError:
        return "", 0, 0, "llama.cpp is not installed"
    found = gpu_backends(llama_cpp.llama_cpp)
    choice = choose_device(found.devices, gpu, unavailable=found.unavailable)
    if choice.device is None:
        return "", 0, 0, choice.why
    d = choice.device
    return d.kind, d.total, d.free, d.description


def this_machine(home: Path, *, budget: Budget = None, gpu: str = "auto",
                 lanes: int = 8, name: str | None = None) -> tuple[Machine, str]:
    """This machine as the fit estimate sees it, and a line saying what it found."""
    total = total_memory_bytes()
    limit = budget_bytes(budget, total) or 0
    kind, dev_total, dev_free, desc = gpu_device(gpu)
    mem_bw = bandwidth.memory_bandwidth(bandwidth.machine_cache(home))  # measured once
    gpu_bw = bandwidth.gpu_bandwidth(desc, kind, mem_bw)
    machine = Machine(name or socket.gethostname(), ram_total=total, budget=limit,
                      device_kind=kind, device_total=dev_total,  # type: ignore[arg-type]
                      device_free=dev_free, disk_free=disk_free(home), lanes=lanes,
                      mem_bandwidth=mem_bw, gpu_bandwidth=gpu_bw)
    gpu_text = f"GPU {desc} ({amount(dev_free)} free)" if kind else "no GPU used"
    disk = machine.disk_free
    speed = f", RAM read at {bandwidth_text(mem_bw)}" if mem_bw else ""
    if kind:
        speed += (f", the GPU's at {bandwidth_text(gpu_bw)}" if gpu_bw else
                  ", the GPU's speed not known (no estimate for models on it)")
    line = (f"{amount(total)} of RAM, a node budget of {amount(machine.memory)}, "
            f"{gpu_text}" + (f", {amount(disk)} of disk free" if disk is not None else "")
            + speed)
    return machine, line


def bandwidth_text(bytes_per_s: int) -> str:
    """``21 GB/s``: a bandwidth as people read it (decimal, as vendors rate them)."""
    return f"{bytes_per_s / 1e9:.0f} GB/s"

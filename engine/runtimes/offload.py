"""Which GPU a llama.cpp node uses, and how much of the model goes on it (pure).

``--gpu auto`` takes the device llama.cpp lists with the most free memory, a discrete
GPU before an integrated one; ggml's Vulkan backend lists no CPU-type device (Mesa's
lavapipe) unless ``GGML_VK_VISIBLE_DEVICES`` names it, since those are slower than the
CPU backend. ``--gpu off`` uses none, and ``--gpu DEVICE`` the device of that name
(``Vulkan0``) or whose description holds it (``RTX 4070``).

:func:`plan_offload` puts every layer on the device when the weights and at least a
small pool fit its free memory (less a reserve for llama.cpp's compute buffers); the
pool is then capped by what the device has left. Otherwise it offloads the repeating
layers that fit together with their share of the whole pool, and the rest stays in RAM.
A discrete GPU's memory is its own, so what it holds leaves the RAM budget; an
integrated GPU's is the machine's RAM, so all of it still counts there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from engine.sizes import MiB, amount

DeviceKind = Literal["gpu", "igpu"]
GPU_CHOICES = ("auto", "off")  # or a device's name
RESERVE_MIN = 256 * MiB  # the device's compute buffers and the driver's own
RESERVE_SHARE = 0.05  # of its total memory, when that is more
MIN_POOL_CELLS = 512  # engine.runtimes.budget.POOL_FLOOR: a chat turn


@dataclass(frozen=True, slots=True)
class Device:
    name: str  # ggml's: "Vulkan0"
    description: str  # the driver's: "NVIDIA GeForce RTX 4070", "llvmpipe (LLVM 15.0.6, 256 bits)"
    kind: DeviceKind
    free: int  # bytes
    total: int

    def label(self) -> str:
        return f"{self.name} ({self.description}, {amount(self.free)} free)"


@dataclass(frozen=True, slots=True)
class Choice:
    device: Device | None
    why: str  # one line: the device chosen, or why none is


def choose_device(devices: list[Device], want: str, *, unavailable: str = "") -> Choice:
    """The device for ``want`` (auto, off or a name; none, with why, for a name that
    matches none). ``unavailable``: why the GPU backend could not load, if it could not."""
    want = want.strip() or "auto"
    if want == "off":
        return Choice(None, "the GPU is not used (--gpu off); the model runs on the CPU")
    if want == "auto":
        if not devices:
            reason = unavailable or "llama.cpp finds no GPU on this machine"
            return Choice(None, f"the GPU is not used: {reason}; the model runs on the CPU")
        best = max(devices, key=lambda d: (d.kind == "gpu", d.free))
        return Choice(best, f"GPU {best.label()}")
    low = want.lower()
    named = [d for d in devices if d.name.lower() == low] or [
        d for d in devices if low in d.description.lower()]
    if not named:
        # not an error: a named GPU may be unplugged (an eGPU) or its driver gone, and the
        # node still serves, on the CPU
        listed = ", ".join(d.label() for d in devices) or (unavailable or "none")
        return Choice(None, f"the GPU is not used: --gpu {want} names no device llama.cpp "
                            f"lists (it lists: {listed}); pick one of them, auto or off; the "
                            "model runs on the CPU")
    best = max(named, key=lambda d: d.free)
    return Choice(best, f"GPU {best.label()}")


@dataclass(frozen=True, slots=True)
class Offload:
    layers: int  # n_gpu_layers for llama.cpp (0: none)
    of: int  # the model's layers plus its output layer
    max_cells: int | None  # the pool the device leaves room for (None: no device cap)
    ram_weights: int  # bytes of weights that stay in RAM
    ram_kv_per_token: int  # bytes of KV per token that stay in RAM

    @property
    def full(self) -> bool:
        return self.layers >= self.of

    def describe(self) -> str:
        return "all layers" if self.full else f"{self.layers} of {self.of} layers"


def no_offload(n_layer: int, model_bytes: int, kv_bytes_per_token: int) -> Offload:
    return Offload(0, n_layer + 1, None, model_bytes, kv_bytes_per_token)


def plan_split(*, n_layer: int, model_bytes: int, kv_bytes_per_token: int, want_cells: int,
               lend_bytes: int, overhead: int) -> Offload:
    """How many of the model's last layers go to memory another machine lends (llama.cpp's
    RPC backend) and what stays here: each takes its weights and its share of the pool
    there; the lender keeps room for its compute buffers (``overhead``, as here). The
    output layer and the embeddings stay here: every token's logits are read here."""
    return plan_split_among(n_layer=n_layer, model_bytes=model_bytes,
                            kv_bytes_per_token=kv_bytes_per_token, want_cells=want_cells,
                            lends=(lend_bytes,), overhead=overhead)[0]


def plan_split_among(*, n_layer: int, model_bytes: int, kv_bytes_per_token: int,
                     want_cells: int, lends: Sequence[int], overhead: int,
                     block_bytes: int = 0) -> tuple[Offload, tuple[int, ...]]:
    """:func:`plan_split` with several lending machines: each holds the layers its memory
    holds (less its own compute buffers); when together they could hold more than the
    model has, each keeps a share in proportion to what it could hold. Returns the plan and
    the layers of each lender, in order (llama.cpp gives the first lender the first of
    the lent layers). ``block_bytes``: what the repeating layers weigh together, where the
    file says (the embeddings and output layer, which stay here, are the rest: two thirds
    of Gemma 3 270M); else every layer and the output layer weigh alike."""
    n_layer = max(n_layer, 1)
    per_token = max(kv_bytes_per_token, 1)
    block: float
    rest: float
    if 0 < block_bytes <= model_bytes:
        block, rest = block_bytes / n_layer, float(model_bytes - block_bytes)
    else:
        block = rest = model_bytes / (n_layer + 1)
    per_layer = block + want_cells * per_token / n_layer
    room = [max(min(int(max(lend - overhead, 0) // per_layer), n_layer), 0) for lend in lends]
    parts = _within(room, n_layer)
    layers = sum(parts)
    left = n_layer - layers
    return (Offload(layers, n_layer + 1, None, int(rest + block * left),
                    max(per_token * left // n_layer, 1)), parts)


def _within(room: Sequence[int], most: int) -> tuple[int, ...]:
    """``room`` itself when it sums to at most ``most``; else shares of ``most`` in
    proportion to it, each at most its room (the largest remainders rounded up)."""
    total = sum(room)
    if total <= most:
        return tuple(room)
    exact = [most * r / total for r in room]
    parts = [int(e) for e in exact]
    order = sorted(range(len(room)), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in order[:most - sum(parts)]:
        parts[i] += 1
    return tuple(parts)


def device_reserve(device: Device, overhead: int) -> int:
    return max(RESERVE_MIN, int(device.total * RESERVE_SHARE)) + overhead


def plan_offload(*, device: Device | None, n_layer: int, model_bytes: int,
                 kv_bytes_per_token: int, want_cells: int, overhead: int) -> Offload:
    """How many layers go on ``device`` and what stays in RAM (see the module doc)."""
    n_layer = max(n_layer, 1)
    if device is None:
        return no_offload(n_layer, model_bytes, kv_bytes_per_token)
    usable = device.free - device_reserve(device, overhead)
    shared = device.kind == "igpu"  # its memory is the RAM: the budget still counts it all
    per_token = max(kv_bytes_per_token, 1)
    if model_bytes + MIN_POOL_CELLS * per_token <= usable:
        cap = (usable - model_bytes) // per_token
        return Offload(n_layer + 1, n_layer + 1, cap,
                       model_bytes if shared else 0, per_token if shared else 0)
    # a repeating layer's weights and its share of the pool the node wants
    per_layer = model_bytes / (n_layer + 1) + want_cells * per_token / n_layer
    layers = max(min(int(max(usable, 0) // per_layer), n_layer), 0)
    if shared or layers == 0:
        return Offload(layers, n_layer + 1, None, model_bytes, per_token)
    left = n_layer - layers
    return Offload(layers, n_layer + 1, None,
                   int(model_bytes * (left + 1) / (n_layer + 1)),
                   max(per_token * left // n_layer, 1))

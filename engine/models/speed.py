"""How fast a model would answer on a machine: decode tokens/s from memory bandwidth (pure:
bytes/s and a model's shape in, tokens/s out).

Decoding one token reads every weight the token passes through once, and the KV cache of
the context so far; on CPUs and GPUs alike that read, not the arithmetic, sets the pace of
a single answer of a model of any size. So the seconds a token takes are

    sum over devices of (bytes read there / (bandwidth there x efficiency))
    + layers there x a fixed cost a layer

where the efficiency is the share of the bandwidth llama.cpp's decode attains and the
fixed cost a layer is what every layer spends whatever its size (threads meeting at a
barrier, small kernels): it rules a tiny model, and vanishes in a large one. Both are
calibrated on a node (docs/decisions.md, "Speed estimate (issue 32)"). A machine whose
bandwidth is not known (an older node, a GPU not in :mod:`engine.models.bandwidth`'s
table) gets no estimate: None, never a guess.

"Usable" is a speed a person waits for without giving up: :data:`CHAT_TPS` for chat (a
little faster than one reads), :data:`AUTOCOMPLETE_TPS` for autocomplete (a suggestion of
a line or two is worth showing only while the user still looks at the line).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fit.py imports this module: the shape only types the argument
    from engine.models.fit import ModelShape

# the share of the measured RAM read bandwidth (engine.models.bandwidth) llama.cpp's CPU
# decode attains, and the fixed cost of a layer on the CPU (barriers, small kernels, the
# node's own step): fitted to the decode rates a node measured for SmolLM2 135M (30
# layers, 121 tok/s) and Gemma 3 270M (18 layers, 66 tok/s) on a quiet 2-core x86 VM
# that read at 30 GB/s (docs/decisions.md, "Speed estimate (issue 32)")
CPU_EFFICIENCY = 0.6
CPU_LAYER_S = 0.1e-3
# the share of a GPU's rated bandwidth its decode attains: public llama.cpp decode results
# put it at about 0.6 (CUDA) to 0.85 (Apple M4, Metal) of the rated figure; a layer's
# fixed cost there is about ten kernel launches (an estimate, not measured here)
GPU_EFFICIENCY = 0.7
GPU_LAYER_S = 0.05e-3
# the context a typical turn has reached: the KV cache read per token grows with it
TYPICAL_CONTEXT = 4096
# below these an answer is too slow to be worth waiting for (tokens/s)
CHAT_TPS = 10.0  # people read about 5 words (7 tokens) a second: 10 keeps ahead of them
AUTOCOMPLETE_TPS = 20.0  # a 40-token suggestion within about 2 s, while the line is fresh


def bytes_per_token(shape: ModelShape, *, context: int = TYPICAL_CONTEXT) -> tuple[int, int]:
    """(weights, KV) bytes one decoded token reads: the weights it passes through (a
    mixture of experts reads its active share only) and the cache of ``context`` tokens
    (at most the model's window)."""
    weights = shape.active_size or shape.size
    return weights, shape.kv_bytes_per_token * min(context, shape.context)


def decode_tps(shape: ModelShape, *, mem_bandwidth: int, gpu_bandwidth: int = 0,
               gpu_share: float = 0.0, kv_gpu_share: float = 0.0,
               context: int = TYPICAL_CONTEXT) -> float | None:
    """Estimated decode tokens/s of one answer: ``gpu_share`` of the weights and layers (and
    ``kv_gpu_share`` of the cache) read from the GPU at ``gpu_bandwidth``, the rest from
    RAM at ``mem_bandwidth`` (bytes/s). None when a bandwidth the model needs is not known."""
    weights, kv = bytes_per_token(shape, context=context)
    gpu_share, kv_gpu_share = min(max(gpu_share, 0.0), 1.0), min(max(kv_gpu_share, 0.0), 1.0)
    on_gpu = weights * gpu_share + kv * kv_gpu_share
    on_cpu = weights + kv - on_gpu
    return _tps([(on_cpu, shape.layers * (1 - gpu_share), mem_bandwidth, CPU_EFFICIENCY,
                  CPU_LAYER_S),
                 (on_gpu, shape.layers * gpu_share, gpu_bandwidth, GPU_EFFICIENCY,
                  GPU_LAYER_S)])


# a split token's trip to a machine that lends layers and back (llama.cpp's RPC through the
# fleet's link): the split benchmark's one-stream token took 42 ms against 15 ms whole
# (docs/benchmarks.md, "A model split across machines"), two processes on one machine's
# loopback; a LAN adds its round trips to that
SPLIT_HOP_S = 25e-3


def split_tps(shape: ModelShape, parts: Sequence[tuple[int, int]], *,
              context: int = TYPICAL_CONTEXT) -> float | None:
    """Estimated decode tokens/s of one answer of a model split across machines: ``parts``
    are (repeating layers, RAM bandwidth in bytes/s) of each machine in the order a token
    passes them, the first holding the output layer too; each reads its layers' weights
    and cache on its CPU, and every other part costs a hop (:data:`SPLIT_HOP_S`). None
    when a machine's bandwidth is not known."""
    weights, kv = bytes_per_token(shape, context=context)
    n_layer = max(shape.layers, 1)
    per_layer = weights / (n_layer + 1)  # the output layer weighs as one more
    reads = [(per_layer * (layers + (i == 0)) + kv * layers / n_layer, layers, bandwidth,
              CPU_EFFICIENCY, CPU_LAYER_S) for i, (layers, bandwidth) in enumerate(parts)]
    tps = _tps(reads)
    if tps is None:
        return None
    return 1.0 / (1.0 / tps + SPLIT_HOP_S * max(len(parts) - 1, 0))


def _tps(reads: Sequence[tuple[float, float, int, float, float]]) -> float | None:
    """Tokens/s of a token that reads each (bytes, layers, bandwidth, efficiency, fixed cost
    a layer) in turn; None when bytes are read where the bandwidth is not known."""
    seconds = 0.0
    for read, layers, bandwidth, efficiency, per_layer in reads:
        if read <= 0:
            continue
        if bandwidth <= 0:
            return None
        seconds += read / (bandwidth * efficiency) + layers * per_layer
    return 1.0 / seconds if seconds > 0 else None


def speed_text(tps: float) -> str:
    """``~35 tok/s``, ``~2.5 tok/s``: an estimate as people read it."""
    return f"~{tps:.0f} tok/s" if tps >= 10 else f"~{tps:.1f} tok/s"


def speed_line(tps: float | None, usable: float = CHAT_TPS, use: str = "chat") -> str:
    """What a fit line says of the speed: ``; ~35 tok/s``, or for a model slower than
    ``use`` wants, ``; slow here: ~2.1 tok/s (chat wants 10)``; "" with no estimate."""
    if tps is None:
        return ""
    if tps >= usable:
        return f"; {speed_text(tps)}"
    return f"; slow here: {speed_text(tps)} ({use} wants {usable:g})"

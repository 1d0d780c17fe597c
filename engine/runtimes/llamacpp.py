"""The ``llamacpp`` runtime: llama-cpp-python's low-level ctypes API.

One model and one ``llama_context`` per node. The context holds one sequence
per lane (``n_seq_max = lanes``) in one KV pool that all lanes share
(llama.cpp's unified KV, as llama-server's ``--kv-unified``), sized inside the
node's memory budget (:mod:`engine.runtimes.budget`): one session may grow to
the whole window while cells are free. The decode thread
(:mod:`engine.runtimes.decode_thread`) owns the context and runs continuous
batching: every step it builds one ``llama_batch`` holding one token for each
decoding lane plus chunks of the prompts that are still prefilling (bounded by
``n_batch``; :func:`~engine.runtimes.lanes.plan_batch`), decodes it and samples
each lane with its own sampler chain. Lanes join and leave between steps.

A finished sequence stays parked in its lane (its tokens remembered) under its
session until another request needs the lane or its cells; the next request of
the session reuses the longest common prefix and prefills only the rest
(:func:`~engine.runtimes.lanes.pick_lane`). Parked cells are reclaimed least
recently used first; a reclaimed sequence's KV state moves to the host-memory
prompt cache (:mod:`engine.runtimes.host_cache`), from which a prompt sharing a
long prefix with it is restored instead of prefilled.

The head side uses :class:`LlamaCppVocab`, which loads the vocabulary only.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.runtimes import cpu_threadpool, gguf_meta, llama_log
from engine.runtimes.base import EngineInfo, EngineStats, RuntimeUnavailable, Sampling
from engine.runtimes.budget import (
    default_budget_bytes,
    plan_pool,
    process_rss_bytes,
    total_memory_bytes,
    wanted_cells,
)
from engine.runtimes.cpu_backend import ggml_in_use, lib_dir, load_cpu_variant
from engine.runtimes.cpu_quirks import repack_here
from engine.runtimes.cpu_share import SHARE
from engine.runtimes.decode_thread import DecodeJob, DecodeThreadEngine, PoolLane
from engine.runtimes.gpu import device_handle, gpu_backends
from engine.runtimes.host_cache import MIN_ENTRY, HostCache
from engine.runtimes.lanes import Lane, LaneWant, common_prefix, pick_lane, plan_batch
from engine.runtimes.offload import (
    Choice,
    Device,
    Offload,
    choose_device,
    no_offload,
    plan_offload,
    plan_split_among,
)
from engine.runtimes.threaded import ThreadedGeneration
from engine.sizes import MiB, amount
from engine.snapshot import LENT

RUNTIME_ID = "llamacpp"
log = logging.getLogger("shoal.node")

PENALTY_LAST_N = 64
N_BATCH_MAX = 512
KV_TYPES = {"f16": (1, 2.0), "q8_0": (8, 34 / 32)}  # ggml type id, bytes per element
WARM_PROMPT = 32  # tokens the start-up measurement prefills, and then decodes one by one
WARM_DECODE = 3
WARM_FIRST_ID = 1000  # ordinary tokens in every vocabulary this size
HOST_MIN_GAIN = 32  # the host cache is used when it holds this many more tokens than a lane

_LLAMA_DEFAULT_SEED = 0xFFFFFFFF

# ----------------------------------------------------------------------------
# the library, loaded lazily so that importing this module never needs it

_lib_lock = threading.Lock()
_lib_mod: Any = None


MAX_LENDERS = 16  # ggml's RPC backend takes at most 16 servers


def _lib() -> Any:
    """``llama_cpp.llama_cpp``, the backend initialised and its log routed once."""
    global _lib_mod
    with _lib_lock:
        if _lib_mod is not None:
            return _lib_mod
        try:
            lib = importlib.import_module("llama_cpp.llama_cpp")
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeUnavailable(
                "runtime llamacpp needs llama-cpp-python, which is not installed "
                f"({exc}); install it with: pip install 'llama-cpp-python>=0.3.36,<0.4'"
            ) from exc
        except (OSError, RuntimeError) as exc:  # pragma: no cover - a broken build
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RuntimeUnavailable(
                f"runtime llamacpp cannot load llama.cpp's library ({detail}); reinstall it "
                "with: pip install --force-reinstall 'llama-cpp-python>=0.3.36,<0.4'"
            ) from exc
        llama_log.route(lib)
        from llama_cpp import _ggml

        # a portable build's CPU variants sit in llama_cpp/lib, where ggml does not look
        folder = lib_dir(lib)
        load_cpu_variant(folder, ggml_in_use(folder, _ggml.libggml))
        lib.llama_backend_init()
        _lib_mod = lib
        return lib


def library() -> Any:
    """llama.cpp's shared library itself (ctypes), for the functions the bindings leave out
    (engine.runtimes.gguf_meta)."""
    return _lib()._lib


def check_available() -> None:
    """Raise RuntimeUnavailable (one line: cause and fix) when llama.cpp cannot load here."""
    _lib()


def _read_str(fill: Callable[[Any, int], int], initial: int = 256) -> str:
    """Call a llama.cpp ``(buf, size) -> needed length`` getter until it fits."""
    size = initial
    for _ in range(4):
        buf = ctypes.create_string_buffer(size)
        n = int(fill(buf, size))
        if n < 0:
            return ""
        if n < size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
    return ""


def _meta_dict(lib: Any, model: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    count = int(lib.llama_model_meta_count(model))
    for i in range(count):

        def _key(buf: Any, size: int, i: int = i) -> int:
            return int(lib.llama_model_meta_key_by_index(model, i, buf, size))

        def _val(buf: Any, size: int, i: int = i) -> int:
            return int(lib.llama_model_meta_val_str_by_index(model, i, buf, size))

        key = _read_str(_key)
        if key:
            out[key] = _read_str(_val, initial=4096)
    return out


def _piece(lib: Any, vocab: Any, token: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = int(lib.llama_token_to_piece(vocab, token, buf, 64, 0, special))
    if n < 0:
        size = -n
        buf = ctypes.create_string_buffer(size)
        n = int(lib.llama_token_to_piece(vocab, token, buf, size, 0, special))
    return buf.raw[: max(n, 0)]


def _check_path(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file {path} does not exist; pass the path of a .gguf file")


# ----------------------------------------------------------------------------
# sizing


def _kv_bytes_per_token(lib: Any, model: Any, meta: dict[str, str],
                        bytes_per_element: float = 2.0) -> int:
    """K and V over all layers for one token (f16: 2 bytes an element)."""
    n_layer = int(lib.llama_model_n_layer(model))
    n_embd = int(lib.llama_model_n_embd(model))
    n_head = max(int(lib.llama_model_n_head(model)), 1)
    n_head_kv = max(int(lib.llama_model_n_head_kv(model)), 1)
    arch = meta.get("general.architecture", "")

    def _dim(key: str) -> int:
        try:
            return int(meta.get(f"{arch}.attention.{key}", ""))
        except ValueError:
            return n_embd // n_head

    n_embd_k_gqa = _dim("key_length") * n_head_kv
    n_embd_v_gqa = _dim("value_length") * n_head_kv
    return max(int(n_layer * (n_embd_k_gqa + n_embd_v_gqa) * bytes_per_element), 1)


def _overhead_bytes(lib: Any, model: Any, n_batch: int) -> int:
    """llama.cpp's compute buffers and outputs for a batch, estimated: the budget
    counts them before the context exists."""
    n_embd = int(lib.llama_model_n_embd(model))
    return 48 * MiB + n_batch * n_embd * 4 * 24


def start_line(info: EngineInfo) -> str:
    """The line a node prints when it starts serving."""
    how = "pinned by --max-context" if info.window_pinned else "the model's own"
    return (
        f"runtime {info.runtime} serves {info.path}: context window "
        f"{info.context_window} tokens ({how}), {info.lanes} lanes"
    )


def device_line(engine: LlamaCppEngine) -> str:
    """Where the model runs, for the start-up lines: the device and its share, or why
    the GPU is not used."""
    off = engine.offload
    if engine.device is None or off is None or off.layers == 0:
        why = engine.device_why
        if engine.device is not None and off is not None:
            why = (f"the GPU is not used: {engine.device.label()} has no room for a layer "
                   "of this model; the model runs on the CPU")
        return why
    return f"{engine.device_why}: {off.describe()} of the model on it"


def pool_line(engine: LlamaCppEngine) -> str:
    """What the pool holds and what it fits in, for the start-up lines."""
    return (f"KV pool of {engine.pool_cells} cells ({engine.kv_type}) shared by "
            f"{engine.lanes} lanes, host prompt cache up to "
            f"{amount(engine.host_cache_limit)}, within a memory budget of "
            f"{amount(engine.memory_budget_bytes)}")


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a container's cpuset), not the machine's:
    more threads than those spin at ggml's barriers for cores they never get."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # macOS has no affinity
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------
# the engine

# the asyncio side of a generation on a llama.cpp lane
LlamaCppGeneration = ThreadedGeneration


@dataclass(eq=False)
class _LlamaJob(DecodeJob):
    lane: _LlamaLane | None = None
    sampler: Any = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: int = -1  # sampled, to be fed at the next step


@dataclass(eq=False, slots=True)
class _LlamaLane(Lane):
    job: _LlamaJob | None = None


class LlamaCppEngine(DecodeThreadEngine[_LlamaJob]):
    """A node's engine on llama.cpp: one context, one sequence per lane."""

    pool_hint = "raise --memory-budget, use --kv-type q8_0 or serve fewer lanes"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        model_name: str,
        lanes: int = 8,
        max_context: int | None = None,
        n_threads: int | None = None,
        memory_budget: int | None = None,
        kv_type: str = "f16",
        pool_cells: int | None = None,
        gpu: str = "auto",
        measure_at_start: bool = True,
        split_with: Sequence[tuple[str, int, str]] = (),
    ) -> None:
        if kv_type not in KV_TYPES:
            raise ValueError(f"--kv-type {kv_type} is not one of {', '.join(KV_TYPES)}")
        super().__init__(
            os.fspath(path),
            runtime=RUNTIME_ID,
            job_type=_LlamaJob,
            model_name=model_name,
            lanes=lanes,
            max_context=max_context,
        )
        self.n_threads = n_threads or usable_cpus()
        self._n_batch = 0
        self._model: Any = None
        self._ctx: Any = None
        self._mem: Any = None
        self._vocab: Any = None
        self._batch: Any = None
        self._lanes = [_LlamaLane(seq=i) for i in range(lanes)]
        self.kv_type = kv_type
        self.pool_cells_wanted = pool_cells  # None: one window (budget.plan_pool)
        self.memory_budget_bytes = memory_budget or default_budget_bytes(total_memory_bytes())
        self._host: HostCache | None = None
        self.gpu = gpu.strip() or "auto"  # auto | off | a device's name (offload.py)
        self.device: Any = None  # the offload.Device the model runs on, if any
        self.device_why = ""  # the device chosen, or why none is (one line)
        self.offload: Offload | None = None
        self.measure_at_start = measure_at_start  # the warm-up pass (registry.EngineSpec)
        self._threads_now = self.n_threads  # what the context uses now (cpu_share.py)
        # a split model: the RPC endpoint (a tunnel's loopback end) of the memory another
        # machine lends, how much it lends and which machine that is; its last layers run
        # there
        self.split_with = tuple(split_with)[:MAX_LENDERS]
        self._rpc_devices: tuple[int, ...] = ()  # their handles, in split_with's order
        self._threadpool: cpu_threadpool.Threadpool | None = None  # a split's CPU threads
        self.split_parts: tuple[int, ...] = ()  # the layers each holds

    @property
    def pool_cells(self) -> int:
        return self._pool

    @property
    def host_cache_limit(self) -> int:
        return self._host.limit if self._host is not None else 0

    @property
    def host_cache_bytes(self) -> int:
        return self._host.size if self._host is not None else 0

    # -- loading ------------------------------------------------------------

    def _choose(self, lib: Any) -> Choice:
        if self.split_with:
            from engine.runtimes import rpc

            self._rpc_devices = tuple(rpc.add_server(endpoint)
                                      for endpoint, _, _ in self.split_with)
            lent = sum(lend for _, lend, _ in self.split_with)
            names = [lender.partition(" (")[0] for _, _, lender in self.split_with]
            labels = ", ".join(lender for _, _, lender in self.split_with)
            # its text names each lender's layers: written once the plan says them (_load)
            return Choice(Device(name=" + ".join(names), description="",
                                 kind="gpu", free=lent, total=lent),
                          f"its last layers run on memory {labels} "
                          f"{'lends' if len(names) == 1 else 'lend'}")
        if self.gpu == "off":
            return choose_device([], "off")
        found = gpu_backends(lib)
        return choose_device(found.devices, self.gpu, unavailable=found.unavailable)

    @property
    def kept_threadpool(self) -> bool:
        """Whether its graphs run on CPU threads kept between them (a split's do)."""
        return self._threadpool is not None

    def _lent_text(self) -> str:
        """Where a split model's lent layers are: "192.168.1.20:8455, 300 MiB lent over
        the fleet's link"; with several machines, each one's address, memory and layers."""
        if len(self.split_with) == 1:
            _, lend, lender = self.split_with[0]
            return f"{lender.partition(' (')[2].rstrip(')')}, {amount(lend)} {LENT}"
        each = "; ".join(f"{lender}: {amount(lend)}, {n} layers"
                         for (_, lend, lender), n in zip(self.split_with, self.split_parts,
                                                         strict=True))
        return f"{each}; {LENT}"

    def _device_handles(self, lib: Any, choice: Choice, off: Offload) -> list[int]:
        """The devices llama.cpp may put layers on, in order: the lending machines' (those
        given layers), the chosen GPU, or none."""
        if choice.device is None or not off.layers:
            return []
        if self._rpc_devices:
            return [dev for dev, n in zip(self._rpc_devices, self.split_parts, strict=True)
                    if n]
        handle = device_handle(lib, choice.device.name)
        return [handle] if handle else []

    def _sizes(self, lib: Any, model: Any) -> tuple[int, int, int, int]:
        """(n_ctx_train, n_batch, compute overhead, KV bytes per token) of a loaded model."""
        meta = _meta_dict(lib, model)
        n_ctx_train = int(lib.llama_model_n_ctx_train(model))
        n_batch = min(N_BATCH_MAX, max(self.max_context or n_ctx_train or N_BATCH_MAX,
                                       self.lanes))
        per_token = _kv_bytes_per_token(lib, model, meta, KV_TYPES[self.kv_type][1])
        return n_ctx_train, n_batch, _overhead_bytes(lib, model, n_batch), per_token

    def _plan_offload(self, lib: Any, choice: Choice, model_bytes: int) -> Offload:
        """The layers for the chosen device, sized from the model's header (llama.cpp's
        ``no_alloc`` reads the metadata only: the tensors load once, where they go)."""
        if choice.device is None:
            return no_offload(0, model_bytes, 0)
        params = lib.llama_model_default_params()
        if self._rpc_devices:
            params.use_extra_bufts = False
        params.no_alloc = True
        params.load_mode = 0  # LLAMA_LOAD_MODE_NONE: no_alloc maps nothing (as common/fit.cpp)
        params.n_gpu_layers = 0
        nothing = (ctypes.c_void_p * 1)(None)
        params.devices = ctypes.cast(nothing, ctypes.c_void_p)
        head = lib.llama_model_load_from_file(self.path.encode(), params)
        if not head:
            raise ValueError(
                f"llama.cpp cannot load {self.path}; check that it is a complete GGUF file")
        try:
            n_ctx_train, _, overhead, per_token = self._sizes(lib, head)
            n_layer = int(lib.llama_model_n_layer(head))
        finally:
            lib.llama_model_free(head)
        want = wanted_cells(lanes=self.lanes, n_ctx_train=n_ctx_train,
                            max_context=self.max_context, pool_cells=self.pool_cells_wanted)
        if self._rpc_devices:
            off, self.split_parts = plan_split_among(
                n_layer=n_layer, model_bytes=model_bytes, kv_bytes_per_token=per_token,
                want_cells=want, lends=[lend for _, lend, _ in self.split_with],
                overhead=overhead, block_bytes=gguf_meta.block_bytes(lib._lib, self.path))
            return off
        return plan_offload(device=choice.device, n_layer=n_layer, model_bytes=model_bytes,
                            kv_bytes_per_token=per_token, want_cells=want, overhead=overhead)

    def _load(self) -> None:
        _check_path(self.path)
        lib = _lib()
        model_bytes = os.path.getsize(self.path)
        choice = self._choose(lib)
        # the process before the model, counted in the budget: after the GPU backend and
        # its driver are in (about 60 MB for Vulkan with Mesa's drivers)
        base = process_rss_bytes()
        off = self._plan_offload(lib, choice, model_bytes)
        if self._rpc_devices and choice.device is not None:  # each lender's layers, now known
            choice = replace(choice, device=replace(choice.device,
                                                    description=self._lent_text()))
        mparams = lib.llama_model_default_params()
        # not on AMX CPUs (cpu_quirks.py); not for a split model either: the lent layers
        # run the plain CPU kernels there, and the same kernels here keep its answers
        # what the model gives whole on a machine without repacking
        mparams.use_extra_bufts = repack_here() and not self._rpc_devices
        # the devices llama.cpp may use, NULL-terminated: the chosen one, or none at all
        # (NULL itself would mean every GPU it lists)
        handles = self._device_handles(lib, choice, off)
        handle = handles[0] if handles else None
        devices = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
        mparams.devices = ctypes.cast(devices, ctypes.c_void_p)
        mparams.n_gpu_layers = off.layers if handle else 0
        keep: Any = None  # what llama.cpp reads while it loads
        if self._rpc_devices and handle:
            from engine.runtimes import rpc

            # llama.cpp gives devices the last n_gpu_layers of the model's layers and its
            # output layer, in that order: one more, and the output kept here
            keep = rpc.output_here()
            mparams.tensor_buft_overrides = ctypes.cast(keep, ctypes.c_void_p)
            mparams.n_gpu_layers = off.layers + 1
            if len(handles) > 1:  # several lending machines: the layers each holds
                shares = [float(n) for n in self.split_parts if n]
                shares[-1] += 1.0  # the output layer's place, in the last one's range
                split = (ctypes.c_float * max(int(lib.llama_max_devices()),
                                              len(shares)))(*shares)
                mparams.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
                keep = (keep, split)
        model = lib.llama_model_load_from_file(self.path.encode(), mparams)
        if not model and handle and choice.device is not None:
            # the device refused what the plan gave it (its free memory changed, or the
            # layers are less even than the plan assumes): serve from the CPU instead
            choice = Choice(None, f"the GPU is not used: llama.cpp could not load the model "
                                  f"onto {choice.device.label()}; the model runs on the CPU")
            handle = None
            devices[0] = None
            mparams.n_gpu_layers = 0
            model = lib.llama_model_load_from_file(self.path.encode(), mparams)
        if not model:
            raise ValueError(
                f"llama.cpp cannot load {self.path}; check that it is a complete GGUF file"
            )
        n_ctx_train, n_batch, overhead, per_token = self._sizes(lib, model)
        if not handle:
            off = no_offload(int(lib.llama_model_n_layer(model)), model_bytes, per_token)
        type_id, _ = KV_TYPES[self.kv_type]
        try:
            plan = plan_pool(budget=self.memory_budget_bytes, base=base,
                             model_bytes=off.ram_weights, overhead=overhead,
                             kv_bytes_per_token=off.ram_kv_per_token,
                             lanes=self.lanes, n_ctx_train=n_ctx_train,
                             max_context=self.max_context,
                             pool_cells=self.pool_cells_wanted,
                             device_cells=off.max_cells)
        except ValueError:
            lib.llama_model_free(model)
            raise
        window = plan.window
        n_batch = min(n_batch, max(window, self.lanes))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = plan.cells
        cparams.n_seq_max = self.lanes
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        self._threads_now = self.n_threads
        # one KV pool for every sequence: a session grows while cells are free
        cparams.kv_unified = True
        cparams.no_perf = True
        # a node without layers on a GPU keeps its prompts off it too (llama.cpp would
        # otherwise copy weights to a GPU it lists for every large batch)
        cparams.op_offload = bool(handle) and not self._rpc_devices  # weights stay put
        if type_id != 1:
            cparams.type_k = type_id
            cparams.type_v = type_id
            cparams.flash_attn_type = 1  # llama.cpp quantizes V only with flash attention
        if int(lib.llama_model_n_swa(model)) > 0:
            # keep the whole window in the sliding-window layers too, so that a
            # parked prefix is still complete when the next turn reuses it
            cparams.swa_full = True
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise ValueError(
                f"llama.cpp cannot make a KV pool of {plan.cells} cells for {self.path}; "
                "lower --memory-budget or --max-context"
            )
        self.device = choice.device
        self.device_why = choice.why
        self.offload = off
        self._model = model
        self._ctx = ctx
        if self._rpc_devices:
            # a split's every token is several graphs (here, there, here): without a pool
            # kept for the context, ggml starts and ends its threads for each (25 against
            # 57 tokens/s for Gemma 3 270M split on one machine's loopback)
            self._threadpool = cpu_threadpool.attach(lib._lib, ctx, self.n_threads)
        self._mem = lib.llama_get_memory(ctx)
        self._vocab = lib.llama_model_get_vocab(model)
        self._n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self._eos = frozenset(
            t for t in range(self._n_vocab) if lib.llama_vocab_is_eog(self._vocab, t)
        )
        cells = int(lib.llama_n_ctx(ctx))
        self._pool = cells if cells > 0 else plan.cells
        self._window = min(window, self._pool)
        self._budget = self.memory_budget_bytes
        # what the budget leaves once the model is in: the model's pages counted whole (an
        # mmap fills as it is read) and the pool (llama.cpp clears it, so it is resident
        # already), and the compute buffers, which fill at the first steps
        held = max(process_rss_bytes(), base + off.ram_weights + plan.kv_bytes) + overhead
        # no host cache for a split model: its lent layers' KV lives on the other machine,
        # and parking a sequence here reads it back over the network cell range by cell
        # range (a 70-token sequence took 300 ms through the link, before the next first
        # token)
        self._host = None if self._rpc_devices else HostCache(
            min(plan.host_cache_bytes, max(self._budget - held, 0)))
        self._n_batch = int(lib.llama_n_batch(ctx))
        self._batch = lib.llama_batch_init(self._n_batch, 0, 1)
        if self.measure_at_start:
            self._warm_up(lib)

    def _warm_up(self, lib: Any) -> None:
        """Measure prefill and decode once before serving, so that the node's first stats
        (and its hello to every head) carry real rates and placement sends the first
        sessions to the fast machine: a short pass to warm the kernels (a GPU compiles
        its pipelines at first use), then a measured one; the pool is cleared after."""
        batch, n_vocab = self._batch, max(self._n_vocab, 2)
        prompt = min(WARM_PROMPT, self._n_batch, max(self._pool - WARM_DECODE - 1, 1))

        def feed(tokens: list[int], pos: int) -> bool:
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if i == len(tokens) - 1 else 0
            batch.n_tokens = len(tokens)
            return int(lib.llama_decode(self._ctx, batch)) == 0

        ids = [(WARM_FIRST_ID + i) % n_vocab for i in range(prompt + WARM_DECODE)]
        try:
            # the same shapes as the measured pass: a GPU builds a pipeline per shape
            if not (feed(ids[:prompt], 0) and feed(ids[prompt:prompt + 1], prompt)):
                return
            lib.llama_memory_clear(self._mem, True)
            t0 = time.perf_counter()
            if not feed(ids[:prompt], 0):
                return
            t1 = time.perf_counter()
            for i in range(WARM_DECODE):
                if not feed(ids[prompt + i:prompt + i + 1], prompt + i):
                    return
            t2 = time.perf_counter()
        finally:
            lib.llama_memory_clear(self._mem, True)
        self.record_rates(prompt, t1 - t0, WARM_DECODE / max(t2 - t1, 1e-9))

    def _share_cpus(self) -> None:
        """This engine's part of the CPUs while other models of the node decode too."""
        want = SHARE.threads(self.n_threads)
        if want != self._threads_now and self._ctx:
            _lib().llama_set_n_threads(self._ctx, want, want)
            self._threads_now = want

    def _unload(self) -> None:
        lib = _lib()
        for lane in self._lanes:
            lane.tokens = []
            lane.session = ""
        self._host = None
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
            self._mem = None
        if self._threadpool is not None:  # only once its context is freed
            cpu_threadpool.free(self._threadpool)
            self._threadpool = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def kv_used_from_llama(self) -> int:
        """Tokens held over all sequences, as llama.cpp's memory reports them."""
        lib = _lib_mod
        if lib is None or not self._mem:
            return 0
        total = 0
        for lane in self._lanes:
            hi = int(lib.llama_memory_seq_pos_max(self._mem, lane.seq))
            if hi >= 0:
                lo = int(lib.llama_memory_seq_pos_min(self._mem, lane.seq))
                total += hi - max(lo, 0) + 1
        return total

    # -- lanes (on the decode thread) ---------------------------------------

    def _admit(self, job: _LlamaJob, active: dict[int, _LlamaJob]) -> bool:
        """Put a job on a lane: keep the common prefix (or restore a longer one from the
        host cache), drop the rest of the sequence, and reclaim parked cells until the
        job's commitment fits; False (it waits) while it does not."""
        lane = pick_lane(
            [lane for lane in self._lanes if lane.job is None], job.prompt, job.request.session
        )
        if lane is None:
            return False
        lib = _lib()
        now = time.perf_counter()
        prompt = job.prompt
        # re-evaluate the last prompt token for its logits
        keep = min(common_prefix(lane.tokens, prompt), len(prompt) - 1)
        hit = None
        if self._host is not None and len(self._host):
            hit = self._host.best(prompt, better_than=keep + HOST_MIN_GAIN)
        # cells this lane will hold at most while the job is admitted
        peak = max(job.commit, len(hit.tokens)) if hit is not None else job.commit
        if hit is not None and not self._room_for(peak, lane):
            hit = None  # the restore does not fit beside the others: prefill instead
            peak = job.commit
        if not self._room_for(peak, lane):
            return False
        if hit is not None:
            self._cut(lane, 0)
            restored = self._restore(lane, hit.tokens, hit.state)
            keep = min(hit.common, len(prompt) - 1) if restored else 0
            job.from_host = keep
        self._cut(lane, keep)
        lane.job = job
        lane.session = job.request.session
        lane.last_used = now
        job.lane = lane
        job.cached = keep
        job.pending = prompt[keep:]
        job.t_lane = now
        job.sampler = self._make_sampler(lib, job.request.sampling, prompt)
        self._note_parked()
        return True

    def _pool_lanes(self) -> list[_LlamaLane]:
        return self._lanes

    def _device_stats(self) -> tuple[str, int, int]:
        off, dev = self.offload, self.device
        if off is None:
            return "", 0, 0
        if dev is None or off.layers == 0:
            return "", 0, off.of
        return f"{dev.name} ({dev.description})", off.layers, off.of

    def _device_note(self) -> str:
        return device_line(self) if self.offload is not None else ""

    def stats(self) -> EngineStats:
        st = super().stats()
        dev = self.device  # read once: a load on the decode thread replaces it
        if dev is None or self._rpc_devices:  # another machine's: no GPU here
            return st
        # a fit estimate of another model here needs the GPU's memory, even where this
        # model left it no layer
        return replace(st, device_kind=dev.kind, device_total=dev.total, device_free=dev.free)

    def _host_cache_use(self) -> tuple[int, int]:
        host = self._host  # read once: the decode thread replaces it on unload
        return (host.size, host.limit) if host is not None else (0, 0)

    def _lane_of(self, job: _LlamaJob) -> _LlamaLane | None:
        return job.lane

    def _reclaim(self, lane: PoolLane) -> None:
        assert isinstance(lane, _LlamaLane)
        self._cut(lane, 0)  # into the host cache, when long enough to keep

    def _cut(self, lane: _LlamaLane, keep: int) -> None:
        """Drop the lane's sequence after ``keep`` tokens; a long cut parks the whole
        sequence in the host cache first."""
        if keep >= len(lane.tokens):
            return
        lib = _lib()
        if self._host is not None and len(lane.tokens) - keep >= MIN_ENTRY:
            state = self._save(lane)
            if state is not None:
                self._host.put(lane.tokens, state)
        if not lib.llama_memory_seq_rm(self._mem, lane.seq, keep, -1):
            lib.llama_memory_seq_rm(self._mem, lane.seq, -1, -1)
            keep = 0
        self._kv_add(keep - len(lane.tokens))
        lane.tokens = lane.tokens[:keep]
        if not keep:
            lane.session = ""

    def _save(self, lane: _LlamaLane) -> Any:
        """The lane's KV state as llama.cpp serializes it, in a buffer of its own (kept
        as it is: a copy would double the memory at the moment the budget is tightest),
        or None when it cannot."""
        lib = _lib()
        size = int(lib.llama_state_seq_get_size(self._ctx, lane.seq))
        # room first, then the buffer: the other way the cache passes its budget by a state
        if size <= 0 or self._host is None or not self._host.make_room(lane.tokens, size):
            return None
        buf = (ctypes.c_uint8 * size)()
        got = int(lib.llama_state_seq_get_data(self._ctx, buf, size, lane.seq))
        return buf if got == size else None

    def _restore(self, lane: _LlamaLane, tokens: tuple[int, ...], state: Any) -> bool:
        """Put a host-cache entry into the (empty) lane; False when llama.cpp refuses."""
        lib = _lib()
        if int(lib.llama_state_seq_set_data(self._ctx, state, len(state), lane.seq)) <= 0:
            lib.llama_memory_seq_rm(self._mem, lane.seq, -1, -1)
            return False
        lane.tokens = list(tokens)
        self._kv_add(len(tokens))
        return True

    def _note_parked(self) -> None:
        self._set_parked(sum(len(lane.tokens) for lane in self._lanes if lane.job is None))

    def _leave_lane(self, job: _LlamaJob, now: float) -> None:
        lane = job.lane
        if lane is not None:
            # the sequence stays parked (a half-prefilled prompt is a valid prefix too)
            lane.job = None
            lane.last_used = now
            self._note_parked()
        if job.sampler is not None:
            _lib().llama_sampler_free(job.sampler)
            job.sampler = None

    def _make_sampler(self, lib: Any, s: Sampling, prompt: list[int]) -> Any:
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        penalties = (
            s.repeat_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
        )
        if penalties:
            lib.llama_sampler_chain_add(
                chain,
                lib.llama_sampler_init_penalties(
                    self._n_vocab,
                    PENALTY_LAST_N,
                    float(s.repeat_penalty) if s.repeat_penalty > 0 else 1.0,
                    float(s.frequency_penalty),
                    float(s.presence_penalty),
                ),
            )
        if s.temperature <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:
            if s.top_k > 0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(int(s.top_k)))
            if 0.0 < s.top_p < 1.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(float(s.top_p), 1))
            if s.min_p > 0.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(float(s.min_p), 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(float(s.temperature)))
            seed = _LLAMA_DEFAULT_SEED if s.seed is None else int(s.seed) & 0xFFFFFFFF
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        if penalties:
            # the penalties look back over the prompt as well
            for tok in prompt[-PENALTY_LAST_N:]:
                lib.llama_sampler_accept(chain, tok)
        return chain

    # -- one step (on the decode thread) ------------------------------------

    def _step(self, active: dict[int, _LlamaJob]) -> None:
        """One decode: a token for every decoding lane, prompt chunks for the rest.

        :func:`plan_batch` decides what goes in and in which order (decoding lanes
        first, each group in lane order, which llama.cpp needs to keep the batch whole).
        """
        lib = _lib_mod
        batch = self._batch
        self._grow_answers(active)
        if not active:
            return
        jobs = list(active.values())
        wants: list[LaneWant] = []
        for job in jobs:
            assert job.lane is not None
            wants.append(LaneWant(job.lane.seq, job.pending, job.next_token))
        plan = plan_batch(wants, self._n_batch)
        sampled: list[tuple[_LlamaJob, int]] = []  # each job that samples, and where its logits are
        n = 0
        for slot, tokens, logits in plan:
            job = jobs[slot]
            lane = job.lane
            assert lane is not None
            pos = len(lane.tokens)
            seq = lane.seq
            last = len(tokens) - 1
            for i, tok in enumerate(tokens):
                batch.token[n] = tok
                batch.pos[n] = pos + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = 1 if logits and i == last else 0
                n += 1
            if logits:
                sampled.append((job, n - 1))
        if n == 0:
            return
        batch.n_tokens = n
        rc = int(lib.llama_decode(self._ctx, batch))
        if rc != 0:
            self._decode_failed(lib, rc, [jobs[feed.slot] for feed in plan], active)
            return
        now = time.perf_counter()
        for slot, tokens, _logits in plan:
            job = jobs[slot]
            lane = job.lane
            assert lane is not None
            lane.tokens.extend(tokens)
            if job.pending:
                job.pending = job.pending[len(tokens) :]
                job.sink.prefilled = len(job.prompt) - len(job.pending)
        self._kv_add(n)
        ctx = self._ctx
        for job, index in sampled:
            tok = int(lib.llama_sampler_sample(job.sampler, ctx, index))
            if self._sampled(job, tok, now, active):
                job.next_token = tok

    def _decode_failed(self, lib: Any, rc: int, fed: list[_LlamaJob],
                       active: dict[int, _LlamaJob]) -> None:
        """No KV slot (1) or an error: end what was in the batch, keep the rest going."""
        for job in fed:
            lane = job.lane
            assert lane is not None
            # resync the bookkeeping with what the memory really holds
            lib.llama_memory_seq_rm(self._mem, lane.seq, len(lane.tokens), -1)
            self._finish(job, "length" if rc == 1 else "cancelled", active)


# ----------------------------------------------------------------------------
# the head's tokenizer


class LlamaCppVocab:
    """The vocabulary of a GGUF file, loaded without weights."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        _check_path(path)
        lib = _lib()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        model = lib.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise ValueError(f"llama.cpp cannot read the vocabulary of {path}")
        self.path = path
        self._lib = lib
        self._model: Any = model
        self._vocab: Any = lib.llama_model_get_vocab(model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.bos_id = int(lib.llama_vocab_bos(self._vocab))
        self.eos_id = int(lib.llama_vocab_eos(self._vocab))
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self._vocab))
        self._eos_ids: frozenset[int] | None = None
        self._meta: dict[str, str] | None = None
        self._bytes: dict[int, bytes] = {}
        self._finalizer = weakref.finalize(self, lib.llama_model_free, model)

    def close(self) -> None:
        self._finalizer()

    @property
    def eos_ids(self) -> frozenset[int]:
        if self._eos_ids is None:
            lib, vocab = self._lib, self._vocab
            self._eos_ids = frozenset(
                t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(vocab, t)
            )
        return self._eos_ids

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        for _ in range(2):
            arr = (ctypes.c_int32 * cap)()
            n = int(
                self._lib.llama_tokenize(self._vocab, data, len(data), arr, cap, False, special)
            )
            if n >= 0:
                ids = list(arr[:n])
                break
            cap = -n
        else:  # pragma: no cover - the second call has the exact size
            raise RuntimeError("llama_tokenize failed")
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id >= 0 and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def encode_input(self, text: str) -> list[int]:
        """``text`` as an embedding model reads it alone: plain text (no control token
        parsed), between the special tokens the vocabulary adds (BERT's CLS and SEP)."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            arr = (ctypes.c_int32 * cap)()
            n = int(self._lib.llama_tokenize(self._vocab, data, len(data), arr, cap, True,
                                             False))
            if n >= 0:
                return list(arr[:n])
            cap = -n

    def token_bytes(self, token: int) -> bytes:
        got = self._bytes.get(token)
        if got is None:
            if not 0 <= token < self.n_vocab:
                return b""
            got = _piece(self._lib, self._vocab, token, False)
            self._bytes[token] = got
        return got

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def special_text(self, token: int) -> str:
        if not 0 <= token < self.n_vocab:
            return ""
        return _piece(self._lib, self._vocab, token, True).decode("utf-8", errors="replace")

    def metadata(self) -> dict[str, str]:
        if self._meta is None:
            self._meta = _meta_dict(self._lib, self._model)
        return dict(self._meta)

    def chat_template(self) -> str | None:
        return self.metadata().get("tokenizer.chat_template") or None

    @property
    def bos_text(self) -> str:
        return self.special_text(self.bos_id) if self.bos_id >= 0 else ""

    @property
    def eos_text(self) -> str:
        return self.special_text(self.eos_id) if self.eos_id >= 0 else ""

    def fim_ids(self) -> tuple[int, int, int] | None:
        lib, vocab = self._lib, self._vocab
        ids = (
            int(lib.llama_vocab_fim_pre(vocab)),
            int(lib.llama_vocab_fim_suf(vocab)),
            int(lib.llama_vocab_fim_mid(vocab)),
        )
        if any(i < 0 for i in ids):
            return None
        return ids

"""The ``llamacpp`` runtime: llama-cpp-python's low-level ctypes API.

One model and one ``llama_context`` per node. The context holds one sequence
per lane (``n_seq_max = lanes``, a separate KV stream of ``window`` cells per
sequence). A single daemon thread owns the context and runs continuous
batching: every step it builds one ``llama_batch`` holding one token for each
decoding lane plus chunks of the prompts that are still prefilling (bounded by
``n_batch``), decodes it, samples each lane with its own sampler chain and
hands the new ids to the asyncio side with ``call_soon_threadsafe``. Lanes
join and leave between steps.

A finished sequence stays parked in its lane (its tokens remembered) under its
session until another request needs the lane; the next request of the session
reuses the longest common prefix and prefills only the rest.

The head side uses :class:`LlamaCppVocab`, which loads the vocabulary only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import os
import queue
import statistics
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.runtimes.base import (
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RuntimeUnavailable,
    Sampling,
)
from engine.runtimes.threaded import ThreadedGeneration, TokenSink, check_prompt

RUNTIME_ID = "llamacpp"

PENALTY_LAST_N = 64
WINDOW_FLOOR = 512
MIN_REUSE = 16  # a shorter shared prefix does not pick a lane by itself
N_BATCH_MAX = 512
RECENT = 64  # requests the measured rates and the ttft median look back over

_LLAMA_DEFAULT_SEED = 0xFFFFFFFF

# ----------------------------------------------------------------------------
# the library, loaded lazily so that importing this module never needs it

_lib_lock = threading.Lock()
_lib_mod: Any = None
_log_cb: Any = None  # the ctypes callback must outlive every call into llama.cpp


def _lib() -> Any:
    """``llama_cpp.llama_cpp``, the backend initialised and its log routed once."""
    global _lib_mod, _log_cb
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
        verbose = os.environ.get("SHOAL_LLAMA_LOG", "") == "1"

        def _log(level: int, text: bytes | None, user_data: object) -> None:
            if verbose and text:
                sys.stderr.write(text.decode("utf-8", errors="replace"))

        _log_cb = lib.llama_log_callback(_log)
        lib.llama_log_set(_log_cb, None)
        lib.llama_backend_init()
        _lib_mod = lib
        return lib


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
# window sizing


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


def _kv_bytes_per_token(lib: Any, model: Any, meta: dict[str, str]) -> int:
    """K and V in f16 over all layers for one token."""
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
    return max(n_layer * (n_embd_k_gqa + n_embd_v_gqa) * 2, 1)


def start_line(info: EngineInfo) -> str:
    """The line a node prints when it starts serving."""
    how = "pinned by --max-context" if info.window_pinned else "sized for this device"
    return (
        f"runtime {info.runtime} serves {info.path}: context window "
        f"{info.context_window} tokens ({how}), {info.lanes} lanes"
    )


# ----------------------------------------------------------------------------
# the asyncio side of one generation


class LlamaCppGeneration(ThreadedGeneration):
    """A generation on a llama.cpp lane."""


# ----------------------------------------------------------------------------
# the decode thread's bookkeeping


@dataclass(eq=False)
class _Job:
    id: int
    request: GenerationRequest
    sink: TokenSink
    t_submit: float
    prompt: list[int] = field(default_factory=list)
    lane: _Lane | None = None
    sampler: Any = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    cached: int = 0
    next_token: int = -1  # sampled, to be fed at the next step
    completion: int = 0
    t_lane: float = 0.0
    t_first: float = 0.0
    batch_index: int = -1  # where its logits are in this step's batch


@dataclass(eq=False)
class _Lane:
    seq: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds
    session: str = ""
    last_used: float = float("-inf")
    job: _Job | None = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Stop:
    pass


_STOP = _Stop()


# ----------------------------------------------------------------------------
# the engine


class LlamaCppEngine:
    """A node's engine on llama.cpp: one context, one sequence per lane."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        model_name: str,
        lanes: int = 8,
        max_context: int | None = None,
        n_threads: int | None = None,
    ) -> None:
        path = os.fspath(path)
        if lanes < 1:
            raise ValueError("lanes must be at least 1")
        if max_context is not None and max_context < 1:
            raise ValueError("--max-context must be a positive number of tokens")
        self.path = path
        self.lanes = lanes
        self.max_context = max_context
        self.n_threads = n_threads or os.cpu_count() or 1
        self.info = EngineInfo(
            model=model_name,
            runtime=RUNTIME_ID,
            context_window=max_context or 0,
            lanes=lanes,
            path=path,
            window_pinned=max_context is not None,
        )
        self._window = max_context or 0
        self._n_ctx = 0
        self._n_batch = 0
        self._model: Any = None
        self._ctx: Any = None
        self._mem: Any = None
        self._vocab: Any = None
        self._n_vocab = 0
        self._eog: frozenset[int] = frozenset()
        self._commands: queue.SimpleQueue[_Job | int | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lanes = [_Lane(seq=i) for i in range(lanes)]
        self._lock = threading.Lock()
        self._busy = 0  # admitted and not finished
        self._kv_used = 0
        self._next_id = 0
        self._closed = False
        self._accepting = False
        self._failure: Exception | None = None
        self._ttft: deque[float] = deque(maxlen=RECENT)
        self._prefill_rates: deque[float] = deque(maxlen=RECENT)
        self._decode_rates: deque[float] = deque(maxlen=RECENT)

    # -- life cycle ---------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        _check_path(self.path)
        await asyncio.to_thread(self._load)
        self.info = replace(self.info, context_window=self._window)
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="shoal-llamacpp-decode", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        lib = _lib()
        mparams = lib.llama_model_default_params()
        model = lib.llama_model_load_from_file(self.path.encode(), mparams)
        if not model:
            raise ValueError(
                f"llama.cpp cannot load {self.path}; check that it is a complete GGUF file"
            )
        meta = _meta_dict(lib, model)
        n_ctx_train = int(lib.llama_model_n_ctx_train(model))
        if self.max_context is not None:
            window = self.max_context
        else:
            window = size_window(
                free_bytes=available_memory_bytes(),
                model_bytes=os.path.getsize(self.path),
                kv_bytes_per_token=_kv_bytes_per_token(lib, model, meta),
                lanes=self.lanes,
                n_ctx_train=n_ctx_train,
            )
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = window * self.lanes
        cparams.n_seq_max = self.lanes
        n_batch = min(N_BATCH_MAX, max(window, self.lanes))
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        # one KV stream per sequence: every lane gets exactly its window
        cparams.kv_unified = False
        cparams.no_perf = True
        if int(lib.llama_model_n_swa(model)) > 0:
            # keep the whole window in the sliding-window layers too, so that a
            # parked prefix is still complete when the next turn reuses it
            cparams.swa_full = True
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise ValueError(
                f"llama.cpp cannot make a context of {window} x {self.lanes} tokens for "
                f"{self.path}; lower --max-context or --max-batch"
            )
        self._model = model
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        self._vocab = lib.llama_model_get_vocab(model)
        self._n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self._eog = frozenset(
            t for t in range(self._n_vocab) if lib.llama_vocab_is_eog(self._vocab, t)
        )
        per_seq = int(lib.llama_n_ctx_seq(ctx))
        self._window = min(window, per_seq) if per_seq > 0 else window
        # the cells the lanes may use; llama.cpp pads n_ctx (per sequence to 256),
        # so a pinned odd window leaves a few cells that no lane reaches
        self._n_ctx = self._window * self.lanes
        self._n_batch = int(lib.llama_n_batch(ctx))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._accepting = False
        thread = self._thread
        if thread is not None:
            self._commands.put(_STOP)
            await asyncio.to_thread(thread.join)
        self._free()

    def _free(self) -> None:
        lib = _lib_mod
        if lib is None:
            return
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    # -- requests -----------------------------------------------------------

    def generate(self, request: GenerationRequest) -> LlamaCppGeneration:
        if self._failure is not None:
            raise RuntimeError(f"the llamacpp engine stopped: {self._failure!r}")
        if self._thread is None or self._closed:
            raise RuntimeError("the engine is not running; await start() first")
        prompt = check_prompt(request.prompt, window=self._window, n_vocab=self._n_vocab)
        loop = asyncio.get_running_loop()
        sink = TokenSink(loop)
        with self._lock:
            if not self._accepting:
                raise RuntimeError("the engine is closing")
            self._next_id += 1
            job = _Job(
                id=self._next_id,
                request=request,
                sink=sink,
                t_submit=time.perf_counter(),
                prompt=prompt,
            )
            self._busy += 1
            self._commands.put(job)
        return LlamaCppGeneration(self._post_cancel, job.id, sink)

    def _post_cancel(self, job_id: int) -> None:
        if not self._closed:
            self._commands.put(job_id)

    def stats(self) -> EngineStats:
        with self._lock:
            busy = self._busy
            kv_used = self._kv_used
            ttft = statistics.median(self._ttft) if self._ttft else 0.0
            prefill = statistics.median(self._prefill_rates) if self._prefill_rates else 0.0
            decode = statistics.median(self._decode_rates) if self._decode_rates else 0.0
        return EngineStats(
            lanes=self.lanes,
            lanes_busy=min(busy, self.lanes),
            kv_used=kv_used,
            kv_total=self._n_ctx,
            prefill_tps=prefill,
            decode_tps=decode,
            ttft_ms=ttft,
        )

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

    # -- the decode thread --------------------------------------------------

    def _run(self) -> None:
        lib = _lib()
        batch = lib.llama_batch_init(self._n_batch, 0, 1)
        waiting: deque[_Job] = deque()
        active: list[_Job] = []  # in admission order
        try:
            self._loop(lib, batch, waiting, active)
        except Exception as exc:  # pragma: no cover - a bug or a broken library
            self._failure = exc
            sys.stderr.write(f"shoal: the llamacpp decode loop stopped: {exc!r}\n")
        finally:
            with self._lock:
                self._accepting = False
            # whatever is still queued or running ends as cancelled
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, _Job):
                    waiting.append(cmd)
            for job in list(active):
                self._finish(lib, job, "cancelled", active)
            for job in waiting:
                self._done_bookkeeping(job)
                self._deliver(job, [], self._result(job, "cancelled", time.perf_counter()))
            lib.llama_batch_free(batch)

    def _loop(self, lib: Any, batch: Any, waiting: deque[_Job], active: list[_Job]) -> None:
        while True:
            # take commands; block when there is nothing to do
            block = not active and not waiting
            while True:
                try:
                    cmd = self._commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if isinstance(cmd, _Stop):
                    return
                if isinstance(cmd, _Job):
                    waiting.append(cmd)
                else:
                    self._cancel(cmd, waiting, active)
            # lanes join between steps
            while waiting:
                lane = self._pick_lane(waiting[0])
                if lane is None:
                    break
                job = waiting.popleft()
                if self._admit(lib, job, lane):
                    active.append(job)
            if active:
                self._step(lib, batch, active)

    def _cancel(self, job_id: int, waiting: deque[_Job], active: list[_Job]) -> None:
        for job in waiting:
            if job.id == job_id:
                waiting.remove(job)
                self._deliver(job, [], self._result(job, "cancelled", time.perf_counter()))
                self._done_bookkeeping(job)
                return
        for job in active:
            if job.id == job_id:
                self._finish(_lib(), job, "cancelled", active)
                return

    def _pick_lane(self, job: _Job) -> _Lane | None:
        """The session's parked lane, else the longest useful common prefix, else LRU.

        A prefix shorter than ``MIN_REUSE`` tokens (a chat header) saves
        nothing worth evicting another session's parked sequence for, unless
        it is the whole prompt but its last token.
        """
        free = [lane for lane in self._lanes if lane.job is None]
        if not free:
            return None
        session = job.request.session
        if session:
            for lane in free:
                if lane.session == session and lane.tokens:
                    return lane
        best = max(free, key=lambda ln: _common_prefix(ln.tokens, job.prompt))
        common = _common_prefix(best.tokens, job.prompt)
        if common > 0 and common >= min(MIN_REUSE, len(job.prompt) - 1):
            return best
        return min(free, key=lambda ln: ln.last_used)

    def _admit(self, lib: Any, job: _Job, lane: _Lane) -> bool:
        """Put a job on a lane: keep the common prefix, drop the rest of the sequence."""
        now = time.perf_counter()
        if job.request.max_tokens <= 0:
            self._deliver(job, [], self._result(job, "length", now))
            self._done_bookkeeping(job)
            return False
        prompt = job.prompt
        keep = _common_prefix(lane.tokens, prompt)
        keep = min(keep, len(prompt) - 1)  # re-evaluate the last prompt token for its logits
        if keep < len(lane.tokens):
            if not lib.llama_memory_seq_rm(self._mem, lane.seq, keep, -1):
                lib.llama_memory_seq_rm(self._mem, lane.seq, -1, -1)
                keep = 0
            self._set_lane_tokens(lane, lane.tokens[:keep])
        lane.job = job
        lane.session = job.request.session
        lane.last_used = now
        job.lane = lane
        job.cached = keep
        job.pending = prompt[keep:]
        job.t_lane = now
        job.sampler = self._make_sampler(lib, job.request.sampling, prompt)
        return True

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

    def _set_lane_tokens(self, lane: _Lane, tokens: list[int]) -> None:
        with self._lock:
            self._kv_used += len(tokens) - len(lane.tokens)
        lane.tokens = tokens

    def _step(self, lib: Any, batch: Any, active: list[_Job]) -> None:
        """One decode: a token for every decoding lane, prompt chunks for the rest.

        Decoding lanes always get their token; prompts share what is left of the
        batch. Each group is written in lane order: with one KV stream per lane,
        llama.cpp splits a batch whose sequence ids are out of order into several
        smaller decodes, which cost up to a third of the throughput at 8 lanes.
        """
        fed: list[tuple[_Job, list[int]]] = []
        for job in active:
            job.batch_index = -1
            if not job.pending:
                fed.append((job, [job.next_token]))
        budget = self._n_batch - len(fed)
        for job in active:
            if budget <= 0:
                break
            if not job.pending:
                continue
            chunk = job.pending[:budget]
            fed.append((job, chunk))
            budget -= len(chunk)
        # decoding lanes first, then prompts (a mixed order can stall llama_decode),
        # each group by lane
        fed.sort(key=lambda item: (bool(item[0].pending),
                                   item[0].lane.seq if item[0].lane is not None else 0))
        n = 0
        for job, chunk in fed:
            lane = job.lane
            assert lane is not None
            pos = len(lane.tokens)
            # logits for a decoding lane's token, and for a prompt's very last token
            wants = not job.pending or len(chunk) == len(job.pending)
            for i, tok in enumerate(chunk):
                last = i == len(chunk) - 1
                self._batch_put(batch, n, tok, pos + i, lane.seq, wants and last)
                n += 1
            if wants:
                job.batch_index = n - 1
        if n == 0:
            return
        batch.n_tokens = n
        rc = int(lib.llama_decode(self._ctx, batch))
        if rc != 0:
            self._decode_failed(lib, rc, fed, active)
            return
        now = time.perf_counter()
        for job, chunk in fed:
            lane = job.lane
            assert lane is not None
            with self._lock:
                self._kv_used += len(chunk)
            lane.tokens.extend(chunk)
            if job.pending:
                job.pending = job.pending[len(chunk) :]
        for job, _chunk in fed:
            if job.batch_index < 0:
                continue
            tok = int(lib.llama_sampler_sample(job.sampler, self._ctx, job.batch_index))
            if job.t_first == 0.0:
                job.t_first = now
                self._record_first(job)
            reason: FinishReason | None = None
            emit: list[int] = []
            if tok in self._eog or tok in job.request.stop_ids:
                reason = "stop"
            else:
                emit.append(tok)
                job.completion += 1
                # the window holds the prompt and the whole completion
                full = len(job.prompt) + job.completion >= self._window
                if job.completion >= job.request.max_tokens or full:
                    reason = "length"
                else:
                    job.next_token = tok
            if reason is None:
                self._deliver(job, emit, None)
            else:
                self._finish(lib, job, reason, active, emit)

    @staticmethod
    def _batch_put(batch: Any, i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if logits else 0

    def _decode_failed(
        self, lib: Any, rc: int, fed: list[tuple[_Job, list[int]]], active: list[_Job]
    ) -> None:
        """No KV slot (1) or an error: end what was in the batch, keep the rest going."""
        for job, _chunk in fed:
            lane = job.lane
            assert lane is not None
            # resync the bookkeeping with what the memory really holds
            lib.llama_memory_seq_rm(self._mem, lane.seq, len(lane.tokens), -1)
            self._finish(lib, job, "length" if rc == 1 else "cancelled", active)

    def _record_first(self, job: _Job) -> None:
        ttft_ms = (job.t_first - job.t_submit) * 1000.0
        prefilled = len(job.prompt) - job.cached
        dt = job.t_first - job.t_lane
        with self._lock:
            self._ttft.append(ttft_ms)
            if prefilled >= 8 and dt > 0:
                self._prefill_rates.append(prefilled / dt)

    def _result(self, job: _Job, reason: FinishReason, now: float) -> GenerationResult:
        ttft_ms = (job.t_first - job.t_submit) * 1000.0 if job.t_first else 0.0
        prefilled = len(job.prompt) - job.cached
        prefill_dt = (job.t_first - job.t_lane) if job.t_first else 0.0
        decode_dt = now - job.t_first if job.t_first else 0.0
        return GenerationResult(
            finish_reason=reason,
            prompt_tokens=len(job.prompt),
            completion_tokens=job.completion,
            cached_tokens=job.cached,
            ttft_ms=ttft_ms,
            prefill_tps=prefilled / prefill_dt if prefill_dt > 0 else 0.0,
            decode_tps=(job.completion - 1) / decode_dt
            if decode_dt > 0 and job.completion > 1
            else 0.0,
        )

    def _finish(
        self,
        lib: Any,
        job: _Job,
        reason: FinishReason,
        active: list[_Job],
        emit: list[int] | None = None,
    ) -> None:
        """The job leaves its lane; the sequence stays parked for its session."""
        now = time.perf_counter()
        result = self._result(job, reason, now)
        if job in active:
            active.remove(job)
        lane = job.lane
        if lane is not None:
            # the sequence stays parked (a half-prefilled prompt is a valid prefix too)
            lane.job = None
            lane.last_used = now
        if job.sampler is not None:
            lib.llama_sampler_free(job.sampler)
            job.sampler = None
        if result.decode_tps > 0:
            with self._lock:
                self._decode_rates.append(result.decode_tps)
        self._done_bookkeeping(job)
        self._deliver(job, emit or [], result)

    def _done_bookkeeping(self, job: _Job) -> None:
        with self._lock:
            self._busy -= 1

    def _deliver(self, job: _Job, tokens: list[int], result: GenerationResult | None) -> None:
        if not job.sink.hand_over(tokens, result) and result is None:
            self._commands.put(job.id)  # nobody reads it any more: cancel the job


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

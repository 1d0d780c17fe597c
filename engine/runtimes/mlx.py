"""The ``mlx`` runtime: mlx-lm, for Apple silicon (and mlx's CPU build on Linux).

One model per node, loaded by ``mlx_lm.utils.load`` from an MLX model folder
(``config.json``, ``*.safetensors``, tokenizer files) or from a Hugging Face
repo id already in the local cache (nothing is downloaded here).

Lanes are truly batched: a single daemon thread owns the model and an
``mlx_lm.generate.BatchGenerator``, mlx-lm's continuous batching. Every step
decodes one token for each generating lane in one forward pass over a batched
KV cache and prefills one chunk (``PREFILL_STEP`` tokens) of the prompts that
are still being read, so a new prompt joins while the others decode. Each lane
has its own sampler (temperature, top-p, top-k, min-p, and a seed of its own),
its own penalties (``make_logits_processors``), its own stop ids and token
budget; a cancelled generation is removed from the batch between steps. New
ids reach the caller's event loop through ``call_soon_threadsafe``.

A model whose KV cache mlx-lm cannot batch (a cache type without ``merge``)
falls back to round-robin: each lane runs its own ``generate_step`` and the
decode thread advances every lane by one token per step.

No prompt cache is kept between requests: every request prefills its whole
prompt (``cached_tokens`` is 0).

The head side uses :class:`MlxVocab`, which loads the tokenizer only.

mlx is imported lazily; where it cannot be imported, constructing
:class:`MlxEngine` or :class:`MlxVocab` raises
:class:`~engine.runtimes.base.RuntimeUnavailable` with one line naming the
cause and the fix.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import json
import platform
import queue
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
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
from engine.runtimes.llamacpp import available_memory_bytes, size_window
from engine.runtimes.threaded import ThreadedGeneration, TokenSink, check_prompt

RUNTIME_ID = "mlx"

PENALTY_LAST_N = 64
PREFILL_STEP = 512  # prompt tokens one step prefills per lane
RECENT = 64  # requests the measured rates and the ttft median look back over
DEFAULT_TRAIN_CONTEXT = 4096  # when config.json names no trained context

INSTALL_HINT = "pip install mlx-lm on Apple silicon, pip install 'mlx[cpu]' mlx-lm on Linux"

# ----------------------------------------------------------------------------
# the library, imported lazily so that importing this module never needs it


def unavailable_reason(exc: BaseException | None = None) -> str:
    """The one line :class:`RuntimeUnavailable` carries: the cause and the fix."""
    if sys.platform == "darwin" and platform.machine() != "arm64":
        return (
            "runtime mlx needs Apple silicon and this Mac has an Intel processor; "
            "use --runtime llamacpp on this machine"
        )
    cause = "mlx-lm is not installed"
    if exc is not None:
        text = str(exc).strip().splitlines()
        detail = text[0].strip() if text else type(exc).__name__
        cause = f"mlx cannot be imported here ({detail})"
    return (
        f"runtime mlx needs Apple silicon with mlx-lm installed, or mlx's CPU build on Linux, "
        f"and {cause}; install it ({INSTALL_HINT}) or use --runtime llamacpp on this machine"
    )


def _import_mlx() -> Any:
    """``mlx.core``, after checking that mlx-lm imports too."""
    try:
        mx = importlib.import_module("mlx.core")
        importlib.import_module("mlx_lm")
    except (ImportError, OSError) as exc:
        raise RuntimeUnavailable(unavailable_reason(exc)) from exc
    return mx


def check_available() -> None:
    """Raise RuntimeUnavailable (one line: cause and fix) when mlx cannot run here."""
    _import_mlx()


def _mlx_lm(name: str) -> Any:
    return importlib.import_module(f"mlx_lm.{name}")


def resolve_model_dir(path: str) -> Path:
    """An MLX model folder, or the snapshot of a repo id in the local HF cache."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(
                f"{p} is not an MLX model folder: it has no config.json; pass a folder with "
                "config.json, *.safetensors and the tokenizer files"
            )
        return p
    if p.exists():
        raise FileNotFoundError(
            f"{path} is a file; runtime mlx serves an MLX model folder (config.json, "
            "*.safetensors, tokenizer files); use --runtime llamacpp for a GGUF file"
        )
    parts = path.split("/")
    if len(parts) == 2 and all(parts) and not path.startswith((".", "~")):
        try:
            hub = importlib.import_module("huggingface_hub")
            snap = Path(str(hub.snapshot_download(path, local_files_only=True)))
        except Exception:  # noqa: S110 - not cached (or no hub library): said below
            pass
        else:
            if (snap / "config.json").is_file():
                return snap
    raise FileNotFoundError(
        f"model {path} is neither an MLX model folder nor a Hugging Face repo in the local "
        f"cache; pass the folder's path or download it first (hf download {path})"
    )


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def _config_int(config: dict[str, Any], *keys: str) -> int:
    for cfg in (_text_config(config), config):
        for key in keys:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """K and V over all layers for one token, from config.json."""
    layers = _config_int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_int(config, "num_attention_heads", "n_head")
    kv_heads = _config_int(config, "num_key_value_heads") or heads
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    head_dim = _config_int(config, "head_dim") or (hidden // heads if heads else 0)
    return max(layers * kv_heads * head_dim * 2 * max(dtype_bytes, 1), 1)


def _weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


# ----------------------------------------------------------------------------
# the asyncio side of one generation


class MlxGeneration(ThreadedGeneration):
    """A generation on an mlx lane."""


# ----------------------------------------------------------------------------
# the decode thread's bookkeeping


@dataclass(eq=False)
class _Job:
    id: int
    request: GenerationRequest
    sink: TokenSink
    t_submit: float
    prompt: list[int] = field(default_factory=list)
    stops: frozenset[int] = frozenset()
    limit: int = 0  # completion tokens allowed: max_tokens, capped by the window
    uid: int = -1  # the BatchGenerator's id
    solo: Iterator[tuple[Any, Any]] | None = None  # the round-robin fallback's stream
    admitted: bool = False
    completion: int = 0
    t_lane: float = 0.0
    t_first: float = 0.0


class _Stop:
    pass


_STOP = _Stop()


def make_sampler(s: Sampling) -> Callable[[Any], Any]:
    """The lane's sampler: greedy at temperature 0, else the mlx-lm chain.

    With a seed the chain draws from its own key (derived from the seed and the
    step), so one lane's seed neither depends on nor disturbs the others.
    """
    su = _mlx_lm("sample_utils")
    top_p = float(s.top_p) if 0.0 < s.top_p < 1.0 else 0.0
    min_p = max(float(s.min_p), 0.0)
    top_k = max(int(s.top_k), 0)
    if s.temperature <= 0:
        return su.greedy_sampler  # type: ignore[no-any-return]
    if s.seed is None:
        return su.make_sampler(  # type: ignore[no-any-return]
            float(s.temperature), top_p=top_p, min_p=min_p, top_k=top_k
        )
    mx = _import_mlx()
    methods: list[Callable[[Any], Any]] = []
    if top_p:
        methods.append(lambda x: su.apply_top_p(x, top_p))
    if min_p:
        methods.append(lambda x: su.apply_min_p(x, min_p, 1))
    if top_k:
        methods.append(lambda x: su.apply_top_k(x, top_k))
    inv_temp = 1.0 / float(s.temperature)
    base = int(s.seed) & 0xFFFFFFFF
    step = [0]

    def sampler(logprobs: Any) -> Any:
        for method in methods:
            logprobs = method(logprobs)
        key = mx.random.key((base << 32) | (step[0] & 0xFFFFFFFF))
        step[0] += 1
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return sampler


def make_processors(s: Sampling) -> list[Callable[[Any, Any], Any]]:
    """Repetition, presence and frequency penalties over the last 64 tokens."""
    kw: dict[str, Any] = {}
    if s.repeat_penalty > 0 and s.repeat_penalty != 1.0:
        kw.update(
            repetition_penalty=float(s.repeat_penalty), repetition_context_size=PENALTY_LAST_N
        )
    if s.presence_penalty != 0.0:
        kw.update(presence_penalty=float(s.presence_penalty), presence_context_size=PENALTY_LAST_N)
    if s.frequency_penalty != 0.0:
        kw.update(
            frequency_penalty=float(s.frequency_penalty), frequency_context_size=PENALTY_LAST_N
        )
    if not kw:
        return []
    return list(_mlx_lm("sample_utils").make_logits_processors(**kw))


def _batchable(caches: list[Any]) -> bool:
    """Whether mlx-lm can merge these per-sequence caches into one batched cache."""
    return bool(caches) and all(hasattr(type(c), "merge") for c in caches)


# ----------------------------------------------------------------------------
# the engine


class MlxEngine:
    """A node's engine on mlx-lm: one model, one batch of lanes on one decode thread."""

    def __init__(
        self,
        path: str,
        *,
        model_name: str,
        lanes: int = 8,
        max_context: int | None = None,
    ) -> None:
        _import_mlx()
        if lanes < 1:
            raise ValueError("lanes must be at least 1")
        if max_context is not None and max_context < 1:
            raise ValueError("--max-context must be a positive number of tokens")
        self.path = path
        self.lanes = lanes
        self.max_context = max_context
        self.info = EngineInfo(
            model=model_name,
            runtime=RUNTIME_ID,
            context_window=max_context or 0,
            lanes=lanes,
            path=path,
            window_pinned=max_context is not None,
        )
        self.batched = True  # False: the round-robin fallback (set at load)
        self._window = max_context or 0
        self._n_vocab = 0
        self._eos: frozenset[int] = frozenset()
        self._model: Any = None
        self._gen: Any = None  # the BatchGenerator
        self._commands: queue.SimpleQueue[_Job | int | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
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
        model_dir = await asyncio.to_thread(resolve_model_dir, self.path)
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        # the model is loaded on the decode thread: mlx-lm's generation stream
        # is per thread, and the thread that loads is the one that runs
        thread = threading.Thread(
            target=self._run, args=(model_dir, ready), name="shoal-mlx-decode", daemon=True
        )
        self._thread = thread
        thread.start()
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            self._thread = None
            await asyncio.to_thread(thread.join)
            raise
        self.info = replace(self.info, context_window=self._window)
        with self._lock:
            self._accepting = not self._closed

    def _load(self, model_dir: Path) -> None:
        mx = _import_mlx()
        utils = _mlx_lm("utils")
        try:
            model, tokenizer, config = utils.load(str(model_dir), return_config=True)
        except (ValueError, FileNotFoundError, KeyError) as exc:
            raise ValueError(
                f"mlx-lm cannot load {self.path}: {exc}; check that it is a complete MLX "
                "model folder of an architecture mlx-lm supports"
            ) from exc
        params = importlib.import_module("mlx.utils").tree_flatten(model.parameters())
        float_sizes = [int(a.dtype.size) for _, a in params if mx.issubdtype(a.dtype, mx.floating)]
        dtype_bytes = min(float_sizes) if float_sizes else 2
        n_ctx_train = (
            _config_int(config, "max_position_embeddings", "n_positions", "max_seq_len")
            or DEFAULT_TRAIN_CONTEXT
        )
        if self.max_context is not None:
            window = self.max_context
        else:
            window = size_window(
                free_bytes=available_memory_bytes(),
                model_bytes=_weights_bytes(model_dir),
                kv_bytes_per_token=kv_bytes_per_token(config, dtype_bytes),
                lanes=self.lanes,
                n_ctx_train=n_ctx_train,
            )
        self._window = window
        self._n_vocab = _config_int(config, "vocab_size") or len(tokenizer)
        self._eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._model = model
        cache_mod = _mlx_lm("models.cache")
        self.batched = _batchable(list(cache_mod.make_prompt_cache(model)))
        if self.batched:
            gen_mod = _mlx_lm("generate")
            self._gen = gen_mod.BatchGenerator(
                model,
                completion_batch_size=self.lanes,
                prefill_batch_size=self.lanes,
                prefill_step_size=PREFILL_STEP,
            )

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

    # -- requests -----------------------------------------------------------

    def generate(self, request: GenerationRequest) -> MlxGeneration:
        if self._failure is not None:
            raise RuntimeError(f"the mlx engine stopped: {self._failure!r}")
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
                stops=self._eos | frozenset(int(t) for t in request.stop_ids),
            )
            self._busy += 1
            self._commands.put(job)
        return MlxGeneration(self._post_cancel, job.id, sink)

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
            kv_total=self._window * self.lanes,
            prefill_tps=prefill,
            decode_tps=decode,
            ttft_ms=ttft,
        )

    # -- the decode thread --------------------------------------------------

    def _run(self, model_dir: Path, ready: concurrent.futures.Future[None]) -> None:
        try:
            self._load(model_dir)
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        waiting: deque[_Job] = deque()
        active: dict[int, _Job] = {}  # by job id, in admission order
        mx = _import_mlx()
        try:
            self._loop(waiting, active)
        except Exception as exc:  # pragma: no cover - a bug or a broken library
            self._failure = exc
            sys.stderr.write(f"shoal: the mlx decode loop stopped: {exc!r}\n")
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
            for job in list(active.values()):
                self._finish(job, "cancelled", active)
            for job in waiting:
                self._done_bookkeeping(job)
                self._deliver(job, [], self._result(job, "cancelled", time.perf_counter()))
            gen, self._gen = self._gen, None
            if gen is not None:
                gen.close()
            self._model = None
            mx.clear_cache()

    def _loop(self, waiting: deque[_Job], active: dict[int, _Job]) -> None:
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
            while waiting and len(active) < self.lanes:
                job = waiting.popleft()
                if self._admit(job):
                    active[job.id] = job
            if active:
                if self.batched:
                    self._step_batched(active)
                else:
                    self._step_round_robin(active)

    def _cancel(self, job_id: int, waiting: deque[_Job], active: dict[int, _Job]) -> None:
        for job in waiting:
            if job.id == job_id:
                waiting.remove(job)
                self._deliver(job, [], self._result(job, "cancelled", time.perf_counter()))
                self._done_bookkeeping(job)
                return
        job_on_lane = active.get(job_id)
        if job_on_lane is not None:
            self._finish(job_on_lane, "cancelled", active)

    def _admit(self, job: _Job) -> bool:
        """Put a job on a lane: its sampler, penalties, stop ids and token budget."""
        now = time.perf_counter()
        if job.request.max_tokens <= 0:
            self._deliver(job, [], self._result(job, "length", now))
            self._done_bookkeeping(job)
            return False
        # the window holds the prompt and the whole completion
        job.limit = min(job.request.max_tokens, self._window - len(job.prompt))
        sampler = make_sampler(job.request.sampling)
        processors = make_processors(job.request.sampling)
        if self.batched:
            gen_mod = _mlx_lm("generate")
            stops = gen_mod.StopSequences([[t] for t in sorted(job.stops)])
            (job.uid,) = self._gen.insert(
                [job.prompt],
                max_tokens=[job.limit],
                samplers=[sampler],
                logits_processors=[processors],
                stop_sequences=[stops],
            )
        else:
            mx = _import_mlx()
            job.solo = _mlx_lm("generate").generate_step(
                mx.array(job.prompt),
                self._model,
                max_tokens=job.limit,
                sampler=sampler,
                logits_processors=processors or None,
                prefill_step_size=PREFILL_STEP,
            )
        job.admitted = True
        job.t_lane = now
        with self._lock:
            self._kv_used += len(job.prompt)
        return True

    def _step_batched(self, active: dict[int, _Job]) -> None:
        """One BatchGenerator step: a token for each decoding lane, a prefill chunk."""
        by_uid = {job.uid: job for job in active.values()}
        _prompt_progress, responses = self._gen.next()
        now = time.perf_counter()
        for r in responses:
            job = by_uid.get(int(r.uid))
            if job is None or job.id not in active:
                continue
            self._token(job, int(r.token), now, active, ended=r.finish_reason is not None)

    def _step_round_robin(self, active: dict[int, _Job]) -> None:
        """The fallback: every lane's own stream advances by one token."""
        for job in list(active.values()):
            if job.id not in active or job.solo is None:
                continue
            try:
                tok, _logprobs = next(job.solo)
            except StopIteration:
                self._finish(job, "length", active)
                continue
            self._token(job, int(tok), time.perf_counter(), active, ended=False)

    def _token(
        self, job: _Job, tok: int, now: float, active: dict[int, _Job], *, ended: bool
    ) -> None:
        """A sampled token: hand it over, or end the lane at a stop id or the budget."""
        if job.t_first == 0.0:
            job.t_first = now
            self._record_first(job)
        reason: FinishReason | None = None
        emit: list[int] = []
        if tok in job.stops:
            reason = "stop"  # the stop id is not yielded
        else:
            emit.append(tok)
            job.completion += 1
            with self._lock:
                self._kv_used += 1
            if job.completion >= job.limit or ended:
                reason = "length"
        if reason is None:
            self._deliver(job, emit, None)
        else:
            # the BatchGenerator already dropped a sequence it ended itself
            self._finish(job, reason, active, emit, in_batch=not ended)

    def _record_first(self, job: _Job) -> None:
        ttft_ms = (job.t_first - job.t_submit) * 1000.0
        dt = job.t_first - job.t_lane
        with self._lock:
            self._ttft.append(ttft_ms)
            if len(job.prompt) >= 8 and dt > 0:
                self._prefill_rates.append(len(job.prompt) / dt)

    def _result(self, job: _Job, reason: FinishReason, now: float) -> GenerationResult:
        ttft_ms = (job.t_first - job.t_submit) * 1000.0 if job.t_first else 0.0
        prefill_dt = (job.t_first - job.t_lane) if job.t_first else 0.0
        decode_dt = now - job.t_first if job.t_first else 0.0
        return GenerationResult(
            finish_reason=reason,
            prompt_tokens=len(job.prompt),
            completion_tokens=job.completion,
            cached_tokens=0,
            ttft_ms=ttft_ms,
            prefill_tps=len(job.prompt) / prefill_dt if prefill_dt > 0 else 0.0,
            decode_tps=(job.completion - 1) / decode_dt
            if decode_dt > 0 and job.completion > 1
            else 0.0,
        )

    def _finish(
        self,
        job: _Job,
        reason: FinishReason,
        active: dict[int, _Job],
        emit: list[int] | None = None,
        *,
        in_batch: bool = True,
    ) -> None:
        """The job leaves its lane and the lane's KV is freed."""
        now = time.perf_counter()
        result = self._result(job, reason, now)
        active.pop(job.id, None)
        if job.admitted:
            if self._gen is not None and in_batch and job.uid >= 0:
                self._gen.remove([job.uid])
            if job.solo is not None:
                close = getattr(job.solo, "close", None)
                if close is not None:
                    close()
                job.solo = None
            with self._lock:
                self._kv_used -= len(job.prompt) + job.completion
            job.admitted = False
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


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, mapped back to the bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + n)] = b
            n += 1
    return out


def _decoder_kind(decoder: Any) -> str:
    """One of bytelevel, spm (▁ for spaces, <0xNN> byte fallback) or plain."""
    if not isinstance(decoder, dict):
        return "plain"
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "bytelevel"
    if kind == "Sequence":
        parts = [d for d in decoder.get("decoders", []) if isinstance(d, dict)]
        if any(d.get("type") == "ByteLevel" for d in parts):
            return "bytelevel"
        if any(
            d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "\u2581"
            for d in parts
        ):
            return "spm"
    if kind == "Metaspace":
        return "spm"
    return "plain"


class MlxVocab:
    """The tokenizer of an MLX model folder (or cached repo), loaded without weights."""

    def __init__(self, path: str) -> None:
        _import_mlx()
        model_dir = resolve_model_dir(path)
        utils = _mlx_lm("utils")
        config: dict[str, Any] = utils.load_config(model_dir)
        self.path = path
        self.model_dir = model_dir
        self._config = config
        self._tok: Any = utils.load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
        tok = self._tok
        self.n_vocab = len(tok)
        self.bos_id: int = tok.bos_token_id if tok.bos_token_id is not None else -1
        self.eos_id: int = tok.eos_token_id if tok.eos_token_id is not None else -1
        probe = list(tok.encode("a", add_special_tokens=True))
        self.add_bos = self.bos_id >= 0 and bool(probe) and probe[0] == self.bos_id
        self._special: dict[int, str] = {}
        for tid, added in dict(getattr(tok, "added_tokens_decoder", {}) or {}).items():
            if getattr(added, "special", False):
                self._special[int(tid)] = str(added.content)
        for tid in getattr(tok, "all_special_ids", []) or []:
            if int(tid) not in self._special:
                self._special[int(tid)] = str(tok.convert_ids_to_tokens(int(tid)))
        self._added_plain = {
            int(tid): str(added.content)
            for tid, added in dict(getattr(tok, "added_tokens_decoder", {}) or {}).items()
            if not getattr(added, "special", False)
        }
        self._kind = self._read_kind()
        self._bytes: dict[int, bytes] = {}

    def _read_kind(self) -> str:
        try:
            backend = self._tok.backend_tokenizer
            return _decoder_kind(json.loads(backend.to_str()).get("decoder"))
        except Exception:  # a slow tokenizer: decode piece by piece
            return "plain"

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = {int(t) for t in self._tok.eos_token_ids}
        if self.eos_id >= 0:
            ids.add(self.eos_id)
        return frozenset(ids)

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        if special:
            ids = list(self._tok.encode(text, add_special_tokens=False))
        else:
            ids = list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))
        ids = [int(t) for t in ids]
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id >= 0 and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, token: int) -> bytes:
        got = self._bytes.get(token)
        if got is None:
            got = self._piece(token)
            self._bytes[token] = got
        return got

    def _piece(self, token: int) -> bytes:
        if not 0 <= token < self.n_vocab or token in self._special:
            return b""
        plain = self._added_plain.get(token)
        if plain is not None:
            return plain.encode("utf-8")
        piece = self._tok.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return b""
        if self._kind == "bytelevel":
            table = _BYTE_DECODER
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")
        if self._kind == "spm":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("\u2581", " ").encode("utf-8")
        return str(self._tok.decode([token])).encode("utf-8")

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def special_text(self, token: int) -> str:
        if not 0 <= token < self.n_vocab:
            return ""
        text = self._special.get(token)
        if text is not None:
            return text
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def metadata(self) -> dict[str, str]:
        if Path(self.path).expanduser().is_dir():
            name = self.model_dir.name
        else:  # a repo id: its name, not the snapshot's hash
            name = self.path.rstrip("/").split("/")[-1]
        arch = _text_config(self._config).get("model_type") or self._config.get("model_type")
        out = {
            "general.architecture": str(arch or ""),
            "general.name": name,
            "general.basename": name,
        }
        template = self.chat_template()
        if template:
            out["tokenizer.chat_template"] = template
        return out

    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        return template if isinstance(template, str) and template else None

    @property
    def bos_text(self) -> str:
        return self.special_text(self.bos_id) if self.bos_id >= 0 else ""

    @property
    def eos_text(self) -> str:
        return self.special_text(self.eos_id) if self.eos_id >= 0 else ""

    def fim_ids(self) -> tuple[int, int, int] | None:
        return None


_BYTE_DECODER = _byte_decoder()

"""The ``mlx`` runtime: mlx-lm, for Apple silicon (and mlx's CPU build on Linux).

One model per node, loaded by ``mlx_lm.utils.load`` from an MLX model folder
(``config.json``, ``*.safetensors``, tokenizer files) or from a Hugging Face
repo id already in the local cache (nothing is downloaded here).

Lanes are truly batched: the decode thread (:mod:`engine.runtimes.decode_thread`)
owns the model and an ``mlx_lm.generate.BatchGenerator``, mlx-lm's continuous
batching. Every step decodes one token for each generating lane in one forward
pass over a batched KV cache and prefills one chunk (``PREFILL_STEP`` tokens) of
the prompts that are still being read, so a new prompt joins while the others
decode. Each lane has its own sampler (temperature, top-p, top-k, min-p, and a
seed of its own), its own penalties (``make_logits_processors``), its own stop
ids and token budget; a cancelled generation is removed from the batch between
steps.

A model whose KV cache mlx-lm cannot batch (a cache type without ``merge``)
falls back to round-robin: each lane runs its own ``generate_step`` over its own
cache and the decode thread advances every lane by one token per step.

Prompt cache, as llama.cpp's (:mod:`engine.runtimes.llamacpp`): a finished
sequence stays parked in its lane under its session, as mlx-lm's own
per-sequence cache (the list ``make_prompt_cache`` makes) and the tokens it
holds. mlx-lm feeds each token before it hands it over, so the lane holds the
prompt and every token of the answer, the last one (a stop id too) included.
The next request takes a lane with :func:`~engine.runtimes.lanes.pick_lane`
(its session's, else the longest common prefix), trims the cache to the common
prefix (at most the prompt less its last token, which is read again for its
logits) with ``trim_prompt_cache`` and prefills only the rest; its
``cached_tokens`` is what it kept. A cache that cannot be trimmed (a cache type
without ``trim``, or a sliding window that has wrapped) is kept only when the
prompt extends all it holds; otherwise the lane starts from a fresh cache
(:func:`reuse_cache`). mlx-lm 0.32.2's ``BatchGenerator`` takes a sequence's
existing cache at ``insert(..., caches=, all_tokens=)`` (it merges it into the
batch, left-padded) and hands it back when it ends a sequence itself (the
response's ``prompt_cache`` and ``all_tokens``) or at ``remove(...,
return_prompt_caches=True)``: the path mlx-lm's own server takes, so the
batched lanes reuse without a second code path. The round-robin fallback
passes the lane's cache to ``generate_step(prompt_cache=...)``, which fills it
in place; its penalties are shown the reused prefix's last tokens, as the
batched lanes' are through ``all_tokens``, so reuse changes no output.

The KV pool (:mod:`engine.runtimes.budget`): ``_load`` sizes it within the
memory budget beside the weights (``plan_pool``: one whole window, the model's
trained context or ``--max-context``), and the decode thread's base commits
each generation's prompt and answer reserve against it. mlx allocates a cache
as it fills, so the pool is an account of tokens, as llama.cpp's cells are: a
job is admitted when its commitment fits beside what the other lanes hold and
their running jobs committed, and parked lanes are reclaimed least recently
used first until it does. A reclaimed lane's cache is simply dropped: there is
no host-memory prompt cache here (the cache is already in unified memory, and
keeping it as bytes would need its arrays serialized). While lanes decode
together the batched cache is padded to the longest of them, so memory can
pass the pool's count when one long session runs beside short ones.

The head side uses :class:`MlxVocab`, which loads the tokenizer only.

mlx is imported lazily; where it cannot be imported, constructing
:class:`MlxEngine` or :class:`MlxVocab` raises
:class:`~engine.runtimes.base.RuntimeUnavailable` with one line naming the
cause and the fix.
"""

from __future__ import annotations

import importlib
import json
import logging
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.runtimes.base import RuntimeUnavailable, Sampling
from engine.runtimes.budget import (
    default_budget_bytes,
    plan_pool,
    process_rss_bytes,
    total_memory_bytes,
)
from engine.runtimes.decode_thread import DecodeJob, DecodeThreadEngine, PoolLane
from engine.runtimes.lanes import Lane, common_prefix, pick_lane
from engine.runtimes.threaded import ThreadedGeneration
from engine.sizes import MiB

RUNTIME_ID = "mlx"
log = logging.getLogger("shoal.node")

PENALTY_LAST_N = 64
PREFILL_STEP = 512  # prompt tokens one step prefills per lane
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
# the engine

# the asyncio side of a generation on an mlx lane
MlxGeneration = ThreadedGeneration


@dataclass(eq=False)
class _MlxJob(DecodeJob):
    lane: _MlxLane | None = None
    uid: int = -1  # the BatchGenerator's id
    solo: Iterator[tuple[Any, Any]] | None = None  # the round-robin fallback's stream
    # what the BatchGenerator handed back when it ended the sequence itself: the
    # sequence's cache and the tokens it holds
    final: tuple[list[Any], list[int]] | None = None


@dataclass(eq=False, slots=True)
class _MlxLane(Lane):
    # the lane's KV cache (mlx-lm's per-layer cache list) while it is parked, and while
    # it runs on the round-robin fallback; a running batched lane's KV is in the batch
    cache: list[Any] | None = None
    job: _MlxJob | None = None


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


def _with_history(
    processors: list[Callable[[Any, Any], Any]], history: list[int]
) -> list[Callable[[Any, Any], Any]]:
    """The processors seeing ``history`` (the reused prefix's last tokens) before the
    tokens ``generate_step`` passes them, which start after the prefix: the penalties
    then look back as they would over the whole prompt."""
    if not processors or not history:
        return processors
    mx = _import_mlx()
    before = mx.array(history)

    def wrap(proc: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        return lambda tokens, logits: proc(mx.concatenate([before, tokens]), logits)

    return [wrap(p) for p in processors]


def _batchable(caches: list[Any]) -> bool:
    """Whether mlx-lm can merge these per-sequence caches into one batched cache."""
    return bool(caches) and all(hasattr(type(c), "merge") for c in caches)


def reuse_cache(cache: list[Any] | None, held: int, keep: int) -> int:
    """How many tokens of a lane's ``cache`` (which holds ``held``) a new prompt keeps.

    ``keep`` (the common prefix, at most the prompt less its last token), once the
    cache is trimmed to it in place; 0 when there is no cache, nothing to keep, or the
    cache cannot be trimmed (a cache type without ``trim``, or a sliding window that
    has already wrapped): the lane then starts from a fresh cache. A cache that needs
    no trim (the prompt extends what it holds) is kept whatever its type.
    """
    if cache is None or keep <= 0:
        return 0
    drop = held - keep
    if drop <= 0:
        return keep
    cache_mod = _mlx_lm("models.cache")
    if not cache_mod.can_trim_prompt_cache(cache):
        return 0
    trimmed = cache_mod.trim_prompt_cache(cache, drop)
    return keep if trimmed == drop else 0


def _overhead_bytes(config: dict[str, Any], lanes: int, dtype_bytes: int) -> int:
    """mlx's working memory for one step (a prefill chunk on every lane), estimated as
    llama.cpp's compute buffers are: the budget counts it before the first step."""
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    return 64 * MiB + max(lanes, 1) * PREFILL_STEP * hidden * max(dtype_bytes, 1) * 24


class MlxEngine(DecodeThreadEngine[_MlxJob]):
    """A node's engine on mlx-lm: one model, one batch of lanes on one decode thread."""

    def __init__(
        self,
        path: str,
        *,
        model_name: str,
        lanes: int = 8,
        max_context: int | None = None,
        memory_budget: int | None = None,
    ) -> None:
        _import_mlx()
        super().__init__(
            path,
            runtime=RUNTIME_ID,
            job_type=_MlxJob,
            model_name=model_name,
            lanes=lanes,
            max_context=max_context,
        )
        self.batched = True  # False: the round-robin fallback (set at load)
        self._model: Any = None
        self._gen: Any = None  # the BatchGenerator
        self._lanes = [_MlxLane(seq=i) for i in range(lanes)]
        self.memory_budget_bytes = memory_budget or default_budget_bytes(total_memory_bytes())

    @property
    def pool_cells(self) -> int:
        return self._pool

    # -- loading ------------------------------------------------------------

    def _load(self) -> None:
        model_dir = resolve_model_dir(self.path)
        mx = _import_mlx()
        utils = _mlx_lm("utils")
        base = process_rss_bytes()  # the process before the model: counted in the budget
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
        plan = plan_pool(
            budget=self.memory_budget_bytes,
            base=base,
            model_bytes=_weights_bytes(model_dir),
            overhead=_overhead_bytes(config, self.lanes, dtype_bytes),
            kv_bytes_per_token=kv_bytes_per_token(config, dtype_bytes),
            lanes=self.lanes,
            n_ctx_train=n_ctx_train,
            max_context=self.max_context,
        )
        self._pool = plan.cells
        self._window = plan.window
        self._budget = self.memory_budget_bytes
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

    def _unload(self) -> None:
        """Free the model and every lane's cache: the next ``_load`` starts afresh."""
        for lane in self._lanes:
            self._hold(lane, [])
            lane.cache = None
            lane.job = None
            lane.session = ""
            lane.last_used = float("-inf")
        self._set_parked(0)
        gen, self._gen = self._gen, None
        if gen is not None:
            gen.close()
        self._model = None
        _import_mlx().clear_cache()

    # -- lanes (on the decode thread) ---------------------------------------

    def _admit(self, job: _MlxJob, active: dict[int, _MlxJob]) -> bool:
        """Put a job on a lane: keep the common prefix of the lane's cache, drop the
        rest, and reclaim parked lanes until the job's commitment fits; False (it waits)
        while no lane is free or it does not fit."""
        lane = pick_lane(
            [lane for lane in self._lanes if lane.job is None], job.prompt, job.request.session
        )
        if lane is None or not self._room_for(job.commit, lane):
            return False
        now = time.perf_counter()
        prompt = job.prompt
        # re-evaluate the last prompt token for its logits
        keep = min(common_prefix(lane.tokens, prompt), len(prompt) - 1)
        keep = reuse_cache(lane.cache, len(lane.tokens), keep)
        cache = lane.cache if keep else None
        if cache is None:
            cache = list(_mlx_lm("models.cache").make_prompt_cache(self._model))
        self._hold(lane, prompt[:keep])
        lane.job = job
        lane.session = job.request.session
        lane.last_used = now
        job.lane = lane
        job.cached = keep
        job.from_host = 0
        job.sink.prefilled = keep
        job.t_lane = now
        sampler = make_sampler(job.request.sampling)
        processors = make_processors(job.request.sampling)
        if self.batched:
            lane.cache = None  # the batch holds it until the job leaves
            gen_mod = _mlx_lm("generate")
            stops = gen_mod.StopSequences([[t] for t in sorted(job.stops)])
            (job.uid,) = self._gen.insert(
                [prompt[keep:]],
                max_tokens=[job.limit],
                caches=[cache],
                all_tokens=[prompt[:keep]],  # the penalties look back over the prefix
                samplers=[sampler],
                logits_processors=[processors],
                stop_sequences=[stops],
            )
        else:
            lane.cache = cache  # generate_step fills it in place
            mx = _import_mlx()
            sink = job.sink

            def progress(done: int, _total: int) -> None:
                sink.prefilled = keep + done

            job.solo = _mlx_lm("generate").generate_step(
                mx.array(prompt[keep:]),
                self._model,
                max_tokens=job.limit,
                sampler=sampler,
                logits_processors=_with_history(processors, prompt[:keep][-PENALTY_LAST_N:])
                or None,
                prompt_cache=cache,
                prefill_step_size=PREFILL_STEP,
                prompt_progress_callback=progress,
            )
        self._note_parked()
        return True

    def _pool_lanes(self) -> list[_MlxLane]:
        return self._lanes

    def _lane_of(self, job: _MlxJob) -> _MlxLane | None:
        return job.lane

    def _reclaim(self, lane: PoolLane) -> None:
        """A parked lane's cache is dropped (mlx frees it; nothing keeps it elsewhere)."""
        assert isinstance(lane, _MlxLane)
        lane.cache = None
        lane.session = ""
        self._hold(lane, [])
        self._note_parked()

    def _hold(self, lane: _MlxLane, tokens: list[int]) -> None:
        """The lane's cache now holds ``tokens``."""
        self._kv_add(len(tokens) - len(lane.tokens))
        lane.tokens = tokens

    def _note_parked(self) -> None:
        self._set_parked(sum(len(lane.tokens) for lane in self._lanes if lane.job is None))

    def _leave_lane(self, job: _MlxJob, now: float) -> None:
        """The job's sequence stays parked in its lane: the cache and the tokens it holds
        (a half-prefilled prompt is a valid prefix too)."""
        lane = job.lane
        if lane is None:
            return
        job.lane = None
        if self.batched:
            cache, tokens = job.final if job.final is not None else self._take_back(job)
        else:
            if job.solo is not None:
                close = getattr(job.solo, "close", None)
                if close is not None:
                    close()
                job.solo = None
            cache, tokens = lane.cache, lane.tokens
        lane.cache = cache if tokens else None
        self._hold(lane, list(tokens) if cache is not None else [])
        lane.job = None
        lane.last_used = now
        self._note_parked()

    def _take_back(self, job: _MlxJob) -> tuple[list[Any] | None, list[int]]:
        """Take a running sequence out of the batch, with its cache and tokens."""
        if self._gen is None or job.uid < 0:
            return None, []
        got = self._gen.remove([job.uid], return_prompt_caches=True).get(job.uid)
        if got is None:
            return None, []
        cache, tokens = got
        return list(cache), list(tokens)

    # -- one step (on the decode thread) ------------------------------------

    def _step(self, active: dict[int, _MlxJob]) -> None:
        self._grow_answers(active)
        if not active:
            return
        if self.batched:
            self._step_batched(active)
        else:
            self._step_round_robin(active)

    def _step_batched(self, active: dict[int, _MlxJob]) -> None:
        """One BatchGenerator step: a token for each decoding lane, a prefill chunk."""
        by_uid = {job.uid: job for job in active.values()}
        prompt_progress, responses = self._gen.next()
        for p in prompt_progress:
            job = by_uid.get(int(p.uid))
            if job is None or job.lane is None:
                continue
            read = min(job.cached + int(p.progress[0]), len(job.prompt))
            job.sink.prefilled = read
            self._hold(job.lane, job.prompt[:read])
        now = time.perf_counter()
        for r in responses:
            job = by_uid.get(int(r.uid))
            if job is None or job.id not in active:
                continue
            ended = r.finish_reason is not None
            if ended:  # the BatchGenerator dropped it and handed back what it held
                job.final = (list(r.prompt_cache), list(r.all_tokens))
            self._token(job, int(r.token), now, active, ended=ended)

    def _step_round_robin(self, active: dict[int, _MlxJob]) -> None:
        """The fallback: every lane's own stream advances by one token."""
        for job in list(active.values()):
            if job.id not in active or job.solo is None or job.lane is None:
                continue
            try:
                tok, _logprobs = next(job.solo)  # the first one reads the prompt
            except StopIteration:
                self._finish(job, "length", active)
                continue
            if job.t_first == 0.0:
                self._hold(job.lane, list(job.prompt))  # the lane's own list: it grows
            self._token(job, int(tok), time.perf_counter(), active, ended=False)

    def _token(
        self, job: _MlxJob, tok: int, now: float, active: dict[int, _MlxJob], *, ended: bool
    ) -> None:
        """A sampled token: mlx-lm has already put it in the lane's cache (a stop id too)."""
        lane = job.lane
        if lane is not None:
            lane.tokens.append(tok)
            self._kv_add(1)
        self._sampled(job, tok, now, active, ended=ended)


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

    def encode_input(self, text: str) -> list[int]:
        """``text`` as an embedding model reads it alone, with the tokenizer's own
        special tokens around it."""
        return [int(t) for t in self._tok.encode(text, add_special_tokens=True,
                                                 split_special_tokens=True)]

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

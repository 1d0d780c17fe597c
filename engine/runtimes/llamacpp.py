"""The ``llamacpp`` runtime: llama-cpp-python's low-level ctypes API.

One model and one ``llama_context`` per node. The context holds one sequence
per lane (``n_seq_max = lanes``, a separate KV stream of ``window`` cells per
sequence). The decode thread (:mod:`engine.runtimes.decode_thread`) owns the
context and runs continuous batching: every step it builds one ``llama_batch``
holding one token for each decoding lane plus chunks of the prompts that are
still prefilling (bounded by ``n_batch``; :func:`~engine.runtimes.lanes.plan_batch`),
decodes it and samples each lane with its own sampler chain. Lanes join and
leave between steps.

A finished sequence stays parked in its lane (its tokens remembered) under its
session until another request needs the lane; the next request of the session
reuses the longest common prefix and prefills only the rest
(:func:`~engine.runtimes.lanes.pick_lane`).

The head side uses :class:`LlamaCppVocab`, which loads the vocabulary only.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.runtimes.base import EngineInfo, RuntimeUnavailable, Sampling
from engine.runtimes.cpu_quirks import repack_here
from engine.runtimes.decode_thread import DecodeThreadEngine, Job
from engine.runtimes.lanes import Lane, LaneWant, common_prefix, pick_lane, plan_batch
from engine.runtimes.threaded import ThreadedGeneration
from engine.runtimes.window import available_memory_bytes, size_window

RUNTIME_ID = "llamacpp"

PENALTY_LAST_N = 64
N_BATCH_MAX = 512

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
        except (OSError, RuntimeError) as exc:  # pragma: no cover - a broken build
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RuntimeUnavailable(
                f"runtime llamacpp cannot load llama.cpp's library ({detail}); reinstall it "
                "with: pip install --force-reinstall 'llama-cpp-python>=0.3.36,<0.4'"
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
# the engine

# the asyncio side of a generation on a llama.cpp lane
LlamaCppGeneration = ThreadedGeneration


@dataclass(eq=False)
class _Job(Job):
    lane: _Lane | None = None
    sampler: Any = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: int = -1  # sampled, to be fed at the next step


@dataclass(eq=False, slots=True)
class _Lane(Lane):
    job: _Job | None = None


class LlamaCppEngine(DecodeThreadEngine[_Job]):
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
        super().__init__(
            os.fspath(path),
            runtime=RUNTIME_ID,
            job_type=_Job,
            model_name=model_name,
            lanes=lanes,
            max_context=max_context,
        )
        self.n_threads = n_threads or os.cpu_count() or 1
        self._n_batch = 0
        self._model: Any = None
        self._ctx: Any = None
        self._mem: Any = None
        self._vocab: Any = None
        self._batch: Any = None
        self._lanes = [_Lane(seq=i) for i in range(lanes)]

    # -- loading ------------------------------------------------------------

    def _load(self) -> None:
        _check_path(self.path)
        lib = _lib()
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = repack_here()  # not on AMX CPUs: cpu_quirks.py
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
        self._eos = frozenset(
            t for t in range(self._n_vocab) if lib.llama_vocab_is_eog(self._vocab, t)
        )
        per_seq = int(lib.llama_n_ctx_seq(ctx))
        # the cells a lane may use; llama.cpp pads n_ctx (per sequence to 256),
        # so a pinned odd window leaves a few cells that no lane reaches
        self._window = min(window, per_seq) if per_seq > 0 else window
        self._n_batch = int(lib.llama_n_batch(ctx))
        self._batch = lib.llama_batch_init(self._n_batch, 0, 1)

    def _unload(self) -> None:
        lib = _lib()
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
            self._mem = None
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

    def _admit(self, job: _Job, active: dict[int, _Job]) -> bool:
        """Put a job on a lane: keep the common prefix, drop the rest of the sequence."""
        lane = pick_lane(
            [lane for lane in self._lanes if lane.job is None], job.prompt, job.request.session
        )
        if lane is None:
            return False
        lib = _lib()
        now = time.perf_counter()
        prompt = job.prompt
        keep = common_prefix(lane.tokens, prompt)
        keep = min(keep, len(prompt) - 1)  # re-evaluate the last prompt token for its logits
        if keep < len(lane.tokens):
            if not lib.llama_memory_seq_rm(self._mem, lane.seq, keep, -1):
                lib.llama_memory_seq_rm(self._mem, lane.seq, -1, -1)
                keep = 0
            self._kv_add(keep - len(lane.tokens))
            lane.tokens = lane.tokens[:keep]
        lane.job = job
        lane.session = job.request.session
        lane.last_used = now
        job.lane = lane
        job.cached = keep
        job.pending = prompt[keep:]
        job.t_lane = now
        job.sampler = self._make_sampler(lib, job.request.sampling, prompt)
        return True

    def _leave_lane(self, job: _Job, now: float) -> None:
        lane = job.lane
        if lane is not None:
            # the sequence stays parked (a half-prefilled prompt is a valid prefix too)
            lane.job = None
            lane.last_used = now
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

    def _step(self, active: dict[int, _Job]) -> None:
        """One decode: a token for every decoding lane, prompt chunks for the rest.

        :func:`plan_batch` decides what goes in and in which order (decoding lanes
        first, each group in lane order, which llama.cpp needs to keep the batch whole).
        """
        lib = _lib_mod
        batch = self._batch
        jobs = list(active.values())
        wants: list[LaneWant] = []
        for job in jobs:
            assert job.lane is not None
            wants.append(LaneWant(job.lane.seq, job.pending, job.next_token))
        plan = plan_batch(wants, self._n_batch)
        sampled: list[tuple[_Job, int]] = []  # each job that samples, and where its logits are
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
        self._kv_add(n)
        ctx = self._ctx
        for job, index in sampled:
            tok = int(lib.llama_sampler_sample(job.sampler, ctx, index))
            if self._sampled(job, tok, now, active):
                job.next_token = tok

    def _decode_failed(self, lib: Any, rc: int, fed: list[_Job], active: dict[int, _Job]) -> None:
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

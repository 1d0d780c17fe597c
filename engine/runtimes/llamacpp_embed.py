"""The node's embedder on llama.cpp: one unit-length vector per input of token ids.

The head tokenizes (``Tokenizer.encode_input``: the text between the special tokens the
vocabulary adds, BERT's CLS and SEP); the node runs the model and pools. One model and
one ``llama_context`` with ``embeddings`` on and the model's own pooling (mean for
all-MiniLM, the last token for Qwen3-Embedding); a model that pools nothing (a
generative model) or ranks (a reranker) is refused at start.

Inputs go through in batches, several sequences to one ``llama_decode``, one seq_id per
input (as llama-server's embedding path does), each read back with
``llama_get_embeddings_seq``. The batches are sized here, never by llama.cpp: an
encoder-only model (BERT) has no KV memory, so ``llama_decode`` runs the encoder over
the whole batch in one micro-batch and *aborts the process* (a GGML_ASSERT) when the
batch holds more tokens than ``n_ubatch``; so ``n_batch == n_ubatch == batch_tokens``,
every batch holds at most that many tokens, and an input longer than the model's window
(or than a batch) is refused with a ValueError before anything runs. A causal model
that pools (it has a KV memory) has its memory cleared before each batch.

Every llama.cpp call runs on one worker thread of the embedder's own (load, batches,
free), off the event loop; concurrent requests queue there in order. The model runs on
the CPU, on a threadpool kept for the context's life (engine.runtimes.cpu_threadpool).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from engine.runtimes import cpu_threadpool
from engine.runtimes.base import (
    Embeddings,
    EngineInfo,
    EngineStats,
    Generation,
    GenerationRequest,
    RuntimeUnavailable,
)
from engine.runtimes.cpu_quirks import repack_here
from engine.runtimes.embedding import is_embedding_model, pack, unit
from engine.runtimes.llamacpp import RUNTIME_ID, _check_path, _lib, _meta_dict, usable_cpus

T = TypeVar("T")

BATCH_TOKENS = 2048  # tokens in one llama_decode, every sequence of the batch together
MAX_SEQS = 64  # sequences in one llama_decode
LLAMA_MAX_SEQ = 256  # llama.cpp refuses a context with more
# llama_pooling_type: the ones that make one vector per sequence
POOLING_NAMES = {1: "mean", 2: "cls", 3: "last"}
_POOLING_RANK = 4


@dataclass(frozen=True, slots=True)
class EmbedderInfo:
    """What the loaded model makes."""

    model: str
    dims: int  # values in each vector
    window: int  # the model's training window (n_ctx_train), in tokens
    max_input: int  # the longest input taken: the window, or a batch where that is smaller
    pooling: str  # "mean" | "cls" | "last"


@dataclass(slots=True)
class _Loaded:
    model: Any
    ctx: Any
    mem: Any
    batch: Any
    n_vocab: int
    info: EmbedderInfo
    batch_tokens: int  # n_batch == n_ubatch of its context: what one llama_decode holds
    pool: cpu_threadpool.Threadpool | None  # its CPU threads, kept between batches


def plan_batches(lengths: Sequence[int], *, batch_tokens: int, max_seqs: int) -> list[range]:
    """Consecutive runs of inputs, each at most ``batch_tokens`` tokens and ``max_seqs``
    inputs (every length is at most ``batch_tokens``), in input order."""
    out: list[range] = []
    start = tokens = 0
    for i, n in enumerate(lengths):
        if i > start and (tokens + n > batch_tokens or i - start >= max_seqs):
            out.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


class LlamaCppEmbedder:
    """An engine of the llamacpp runtime whose model makes embeddings, not text."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        model_name: str = "",
        n_threads: int | None = None,
        batch_tokens: int = BATCH_TOKENS,
        max_seqs: int = MAX_SEQS,
        lanes: int = 4,
    ) -> None:
        if batch_tokens < 1 or max_seqs < 1 or lanes < 1:
            raise ValueError("batch_tokens, max_seqs and lanes must each be at least 1")
        self.path = os.fspath(path)
        self.n_threads = n_threads or usable_cpus()
        self.batch_tokens = batch_tokens
        self.max_seqs = min(max_seqs, LLAMA_MAX_SEQ)
        self._given_name = model_name  # else the file's general.name, else its stem
        # lanes: how many requests the node takes at once (they queue on the worker)
        self.info = EngineInfo(model=model_name or Path(self.path).stem, runtime=RUNTIME_ID,
                               context_window=0, lanes=lanes, path=self.path)
        self._worker: ThreadPoolExecutor | None = None
        self._loaded: _Loaded | None = None
        self._embedding: EmbedderInfo | None = None
        self._busy = 0
        self._tokens_per_s = 0.0

    @property
    def embedding(self) -> EmbedderInfo:
        """The loaded model's dimension, window and pooling (after ``start``)."""
        if self._embedding is None:
            raise RuntimeError("the embedder is not started")
        return self._embedding

    @property
    def kept_threadpool(self) -> bool:
        """Whether its batches run on CPU threads kept between them (cpu_threadpool)."""
        return self._loaded is not None and self._loaded.pool is not None

    # -- life ---------------------------------------------------------------

    async def start(self) -> None:
        if self._worker is not None:
            return
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-embed")
        try:
            loaded = await self._on_worker(self._load)
        except BaseException:
            await self._stop_worker()
            raise
        self._loaded = loaded
        self._embedding = loaded.info
        self.info = EngineInfo(model=loaded.info.model, runtime=RUNTIME_ID,
                               context_window=loaded.info.max_input, lanes=self.info.lanes,
                               path=self.path)

    async def close(self) -> None:
        if self._worker is None:
            return
        loaded, self._loaded = self._loaded, None
        try:
            if loaded is not None:
                await self._on_worker(lambda: _free(loaded))
        finally:
            await self._stop_worker()

    async def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            # the join waits for a queued batch, so it runs off the loop
            await asyncio.to_thread(worker.shutdown, True)

    async def _on_worker(self, fn: Callable[[], T]) -> T:
        assert self._worker is not None
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    def _not_embedding(self, what: str) -> RuntimeUnavailable:
        return RuntimeUnavailable(
            f"{self.path} is not an embedding model: it {what}; serve an embedding GGUF "
            "(one with a pooling type, such as all-MiniLM-L6-v2) for embeddings")

    def _load(self) -> _Loaded:
        _check_path(self.path)
        lib = _lib()
        # the metadata first (no weights): a generative model is refused before it loads
        vparams = lib.llama_model_default_params()
        vparams.vocab_only = True
        head = lib.llama_model_load_from_file(self.path.encode(), vparams)
        if not head:
            raise ValueError(
                f"llama.cpp cannot load {self.path}; check that it is a complete GGUF file")
        try:
            meta = _meta_dict(lib, head)
        finally:
            lib.llama_model_free(head)
        if not is_embedding_model(meta):
            raise self._not_embedding("pools no vector per input (a generative model)")
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = repack_here()  # not on AMX CPUs: cpu_quirks.py
        nothing = (ctypes.c_void_p * 1)(None)  # no GPU: an empty, NULL-terminated list
        mparams.devices = ctypes.cast(nothing, ctypes.c_void_p)
        mparams.n_gpu_layers = 0
        model = lib.llama_model_load_from_file(self.path.encode(), mparams)
        if not model:
            raise ValueError(
                f"llama.cpp cannot load {self.path}; check that it is a complete GGUF file")
        ctx = None
        try:
            n_ctx_train = int(lib.llama_model_n_ctx_train(model))
            # an encoder runs a batch in one micro-batch, whose attention and buffers grow
            # with the square of its tokens: no larger than the longest input the model
            # takes (all-MiniLM's 512: half the memory of 2,048, at the same speed)
            tokens = min(self.batch_tokens, n_ctx_train) if n_ctx_train > 0 \
                else self.batch_tokens
            cparams = lib.llama_context_default_params()
            cparams.embeddings = True
            cparams.pooling_type = -1  # the model's own
            cparams.n_ctx = tokens
            cparams.n_batch = tokens
            cparams.n_ubatch = tokens
            cparams.n_seq_max = self.max_seqs
            cparams.kv_unified = True
            cparams.n_threads = self.n_threads
            cparams.n_threads_batch = self.n_threads
            cparams.no_perf = True
            cparams.op_offload = False
            ctx = lib.llama_init_from_model(model, cparams)
            if not ctx:
                raise ValueError(f"llama.cpp cannot make a context for {self.path}; "
                                 "lower the batch size or free memory")
            pooling = int(lib.llama_pooling_type(ctx))
            if pooling not in POOLING_NAMES:
                raise self._not_embedding(
                    "ranks pairs (a reranker)" if pooling == _POOLING_RANK
                    else "pools no vector per input (a generative model)")
            window = n_ctx_train if n_ctx_train > 0 else tokens
            info = EmbedderInfo(
                model=self._given_name or meta.get("general.name") or Path(self.path).stem,
                dims=int(lib.llama_model_n_embd_out(model)),
                window=window,
                max_input=min(window, tokens),
                pooling=POOLING_NAMES[pooling],
            )
            vocab = lib.llama_model_get_vocab(model)
            pool = cpu_threadpool.attach(lib._lib, ctx, self.n_threads)
            return _Loaded(model=model, ctx=ctx, mem=lib.llama_get_memory(ctx),
                           batch=lib.llama_batch_init(tokens, 0, 1),
                           n_vocab=int(lib.llama_vocab_n_tokens(vocab)), info=info,
                           batch_tokens=tokens, pool=pool)
        except BaseException:
            if ctx:
                lib.llama_free(ctx)
            lib.llama_model_free(model)
            raise

    # -- the engine's face --------------------------------------------------

    def generate(self, request: GenerationRequest) -> Generation:
        raise ValueError(f"'{self.info.model}' is an embedding model and makes no text")

    def stats(self) -> EngineStats:
        return EngineStats(lanes=self.info.lanes, lanes_busy=min(self._busy, self.info.lanes),
                           kv_used=0, kv_total=0, prefill_tps=self._tokens_per_s,
                           decode_tps=0.0, ttft_ms=0.0)

    # -- embedding ----------------------------------------------------------

    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        """Each input's unit-length vector, in input order. ValueError names an input
        the model cannot take (empty, longer than its window, ids outside its
        vocabulary); nothing runs then."""
        loaded = self._loaded
        if loaded is None:
            raise RuntimeError("the embedder is not started")
        limit = loaded.info.max_input
        for i, ids in enumerate(inputs):  # lengths only: cheap on the loop
            if not ids:
                raise ValueError(f"input {i} has no tokens")
            if len(ids) > limit:
                raise ValueError(
                    f"input {i} has {len(ids)} tokens, more than the {limit} that "
                    f"{loaded.info.model} takes (its window is {loaded.info.window}); "
                    "shorten it or split it")
        self._busy += 1
        try:
            vectors = await self._on_worker(lambda: self._run(loaded, inputs))
        finally:
            self._busy -= 1
        return Embeddings(dims=loaded.info.dims, count=len(inputs), vectors=vectors,
                          tokens=sum(len(ids) for ids in inputs))

    def _run(self, loaded: _Loaded, inputs: Sequence[Sequence[int]]) -> bytes:
        """On the worker: check the ids, decode batch after batch, pack the vectors."""
        n_vocab = loaded.n_vocab
        for i, ids in enumerate(inputs):
            if not all(0 <= t < n_vocab for t in ids):
                raise ValueError(f"input {i} holds ids outside the model's vocabulary "
                                 f"of {n_vocab}")
        out: list[list[float]] = []
        t0 = time.perf_counter()
        for run in plan_batches([len(ids) for ids in inputs], batch_tokens=loaded.batch_tokens,
                                max_seqs=self.max_seqs):
            out.extend(self._batch(loaded, [inputs[i] for i in run]))
        elapsed = time.perf_counter() - t0
        if elapsed > 0:
            self._tokens_per_s = sum(len(ids) for ids in inputs) / elapsed
        return pack(out)

    def _batch(self, loaded: _Loaded, seqs: list[Sequence[int]]) -> list[list[float]]:
        lib = _lib()
        batch = loaded.batch
        n = 0
        for seq, ids in enumerate(seqs):
            for pos, tok in enumerate(ids):
                batch.token[n] = tok
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = 1  # an encoder outputs every token anyway
                n += 1
        batch.n_tokens = n
        if loaded.mem:  # a causal model that pools keeps a KV memory: start it empty
            lib.llama_memory_clear(loaded.mem, True)
        rc = int(lib.llama_decode(loaded.ctx, batch))
        if rc != 0:
            raise RuntimeError(f"llama.cpp failed to embed a batch of {len(seqs)} inputs "
                               f"({n} tokens): llama_decode returned {rc}")
        dims = loaded.info.dims
        vectors: list[list[float]] = []
        for seq in range(len(seqs)):
            ptr = lib.llama_get_embeddings_seq(loaded.ctx, seq)
            if not ptr:
                raise RuntimeError(f"llama.cpp gave no embedding for sequence {seq}")
            vectors.append(unit(ptr[:dims]))
        return vectors


def _free(loaded: _Loaded) -> None:
    lib = _lib()
    lib.llama_batch_free(loaded.batch)
    lib.llama_free(loaded.ctx)
    if loaded.pool is not None:  # after the context that computes on it
        cpu_threadpool.free(loaded.pool)
    lib.llama_model_free(loaded.model)

"""The runtimes Shoal knows, in one table: the one place that maps a runtime id to code.

For each runtime: how to check that it can run here, how to find the model a
spec names, how to make a node's engine, and how to load the head's vocabulary.
Adding a runtime is adding one :class:`Runtime` to ``_RUNTIMES``.

Which runtime serves a model: the one the user named, else llama.cpp (the
default for every model spec today); ``mock`` only when named. ``llama-server`` and
``vllm`` front an engine the user runs (:mod:`engine.runtimes.upstream`): their
"model" is the engine's URL, and a head cannot read its vocabulary through them.

Errors carry one line naming the cause and the fix: :class:`UnknownRuntime`
(an id not in the table), :class:`~engine.runtimes.base.RuntimeUnavailable`
(it cannot run here), and, when finding a model, ``engine.models.errors.ModelMissing``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from engine.runtimes import llamacpp, mlx, mock, mock_embed
from engine.runtimes.base import Engine, RuntimeUnavailable, Tokenizer
from engine.runtimes.embedding import is_embedding_model
from engine.runtimes.upstream import llama_server, vllm
from engine.runtimes.upstream.dialect import Dialect
from engine.runtimes.upstream.engine import UpstreamEngine

if TYPE_CHECKING:
    from engine.models.cache import Progress
    from engine.models.errors import CancelFlag

DEFAULT_RUNTIME = "llamacpp"
log = logging.getLogger("shoal")


class UnknownRuntime(RuntimeUnavailable):
    """A runtime id that no entry has; the message names the known ones."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What a node's engine is made from."""

    path: str  # what the runtime loads: ResolvedModel.path (an upstream's URL)
    model_name: str  # the model's name on the link ("" for an upstream: its own)
    lanes: int = 8  # 0 for an upstream: as many as it says
    max_context: int | None = None  # None: the model's own window, within the budget
    mock_speed: float = 0.0  # the mock runtime's tokens/s per lane (0: unlimited)
    memory_budget: int | None = None  # bytes for the model and its KV pool; None: default
    kv_type: str = "f16"  # the KV pool's number type: f16 or q8_0 (llama.cpp only)
    gpu: str = "auto"  # auto | off | a device name or part of its description (llama.cpp)
    embedding: bool = False  # the model makes embeddings (makes_embeddings said so)
    # measure prefill and decode once before serving (its first stats carry rates); off
    # for a model a node loads on demand, whose request waits for it and whose rates
    # placement does not read
    measure_at_start: bool = True
    # split: the loopback endpoint of memory another machine lends, and how much (llama.cpp)
    split_with: tuple[tuple[str, int, str], ...] = ()


class ResolvedModel(NamedTuple):
    path: str  # what the runtime loads (a file, a folder, a repo id, or only a name)
    name: str  # the model's name on the link


@dataclass(frozen=True, slots=True)
class Runtime:
    id: str
    check: Callable[[], None]  # raises RuntimeUnavailable when it cannot run here
    find_model: Callable[[str | None, Path, bool, Progress | None, CancelFlag | None],
                         ResolvedModel]
    make_engine: Callable[[EngineSpec], Engine]
    load_vocab: Callable[[str], Tokenizer]
    # it pulls hub models into Shoal's own cache ($SHOAL_HOME/models/hub), where the
    # quota of the models a fleet's head chose applies
    keeps_pulls: bool = False


# -- llamacpp: a GGUF file from Shoal's model cache ------------------------------------


def _gguf_model(spec: str | None, home: Path, offline: bool, progress: Progress | None,
                cancel: CancelFlag | None) -> ResolvedModel:
    """A path as it is, an ``org/repo[:QUANT]`` pulled, no spec: the embedded default."""
    from engine.models import cache as model_cache
    from engine.models import embedded as model_embedded
    from engine.models import ids as model_ids

    if spec is None:
        path = model_embedded.ensure_embedded_default(home, offline=offline, progress=progress,
                                              cancel=cancel)
        return ResolvedModel(str(path), model_embedded.EMBEDDED_NAME)
    path = model_cache.resolve_model(spec, home=home, offline=offline, progress=progress,
                                cancel=cancel)
    return ResolvedModel(str(path), model_ids.model_name(spec))


def _llamacpp_engine(spec: EngineSpec) -> Engine:
    if spec.embedding:
        from engine.runtimes.llamacpp_embed import LlamaCppEmbedder

        _ignores_gpu("llamacpp", spec, "an embedding model runs on the CPU")
        return LlamaCppEmbedder(spec.path, model_name=spec.model_name, lanes=spec.lanes)
    return llamacpp.LlamaCppEngine(spec.path, model_name=spec.model_name, lanes=spec.lanes,
                                   max_context=spec.max_context,
                                   memory_budget=spec.memory_budget, kv_type=spec.kv_type,
                                   gpu=spec.gpu, measure_at_start=spec.measure_at_start,
                                   split_with=spec.split_with)


def _ignores_gpu(runtime: str, spec: EngineSpec, where: str) -> None:
    """One line where a GPU was asked of a runtime that chooses its own."""
    if spec.gpu != "auto":
        log.warning("runtime %s ignores --gpu %s: %s", runtime, spec.gpu, where)


# -- mlx: a model folder, or a repo id mlx-lm finds in the Hugging Face cache itself ----


def _mlx_model(spec: str | None, home: Path, offline: bool, progress: Progress | None,
               cancel: CancelFlag | None) -> ResolvedModel:
    from engine.models import errors as model_errors
    from engine.models import ids as model_ids

    if spec is None:
        raise model_errors.ModelMissing("runtime mlx has no embedded default model; give an MLX "
                                  "model folder or repo id, or use --runtime llamacpp")
    return ResolvedModel(spec, model_ids.model_name(spec))


def _mlx_engine(spec: EngineSpec) -> Engine:
    if spec.kv_type != "f16":
        # mlx-lm's batched cache holds keys and values as the model computes them
        log.warning("runtime mlx keeps its KV cache in the model's own precision and "
                    "ignores --kv-type %s; lower --max-context or raise --memory-budget "
                    "for more context", spec.kv_type)
    _ignores_gpu("mlx", spec, "it runs the model on Apple silicon's GPU")
    return mlx.MlxEngine(spec.path, model_name=spec.model_name, lanes=spec.lanes,
                         max_context=spec.max_context, memory_budget=spec.memory_budget)


# -- mock: built in; the spec only names it --------------------------------------------


def _no_check() -> None:
    return None


def _mock_model(spec: str | None, home: Path, offline: bool, progress: Progress | None,
                cancel: CancelFlag | None) -> ResolvedModel:
    name = spec or "mock"
    return ResolvedModel(name, name)


def _mock_engine(spec: EngineSpec) -> Engine:
    if spec.embedding or spec.model_name.endswith(mock_embed.MOCK_EMBED_SUFFIX):
        return mock_embed.MockEmbedder(model=spec.model_name, lanes=spec.lanes,
                                       context_window=spec.max_context or 512)
    return mock.MockEngine(model=spec.model_name, lanes=spec.lanes,
                           context_window=spec.max_context or 4096, speed=spec.mock_speed)


def _mock_vocab(path: str) -> Tokenizer:
    return mock.MockTokenizer(embedding=path.endswith(mock_embed.MOCK_EMBED_SUFFIX))


# -- llama-server, vllm: an engine the user runs, reached at a URL ------------------------


def _upstream_model(spec: str | None, home: Path, offline: bool, progress: Progress | None,
                    cancel: CancelFlag | None) -> ResolvedModel:
    """The spec is the upstream's URL; its model's name comes from the engine at start."""
    from urllib.parse import urlsplit

    url = urlsplit(spec or "")
    if url.scheme not in ("http", "https") or not url.hostname:
        raise RuntimeUnavailable(f"'{spec or ''}' is not the address of a serving engine; "
                                 "give --upstream http://HOST:PORT")
    return ResolvedModel((spec or "").rstrip("/"), "")


def _upstream_engine(dialect: Dialect) -> Callable[[EngineSpec], Engine]:
    def make(spec: EngineSpec) -> Engine:
        _ignores_gpu(dialect.runtime, spec, "the engine it fronts chooses its own device")
        return UpstreamEngine(dialect, spec.path, model_name=spec.model_name, lanes=spec.lanes,
                              max_context=spec.max_context)
    return make


def _no_vocab(runtime: str) -> Callable[[str], Tokenizer]:
    def refuse(path: str) -> Tokenizer:
        raise RuntimeUnavailable(f"a head reads its model's vocabulary from the GGUF or MLX "
                                 f"files, not from a {runtime} engine; give the head the model "
                                 "file (--runtime llamacpp or mlx)")
    return refuse


_RUNTIMES: dict[str, Runtime] = {
    r.id: r
    for r in (
        Runtime("llamacpp", llamacpp.check_available, _gguf_model, _llamacpp_engine,
                llamacpp.LlamaCppVocab, keeps_pulls=True),
        Runtime("mlx", mlx.check_available, _mlx_model, _mlx_engine, mlx.MlxVocab),
        Runtime("mock", _no_check, _mock_model, _mock_engine, _mock_vocab),
        Runtime("llama-server", _no_check, _upstream_model,
                _upstream_engine(llama_server.DIALECT), _no_vocab("llama-server")),
        Runtime("vllm", _no_check, _upstream_model, _upstream_engine(vllm.DIALECT),
                _no_vocab("vLLM")),
    )
}


# -- the API ---------------------------------------------------------------------------


def runtime_ids() -> tuple[str, ...]:
    """Every runtime id, the default first."""
    return tuple(_RUNTIMES)


def get_runtime(runtime_id: str) -> Runtime:
    """The entry for ``runtime_id``; UnknownRuntime names the known ids."""
    entry = _RUNTIMES.get(runtime_id)
    if entry is None:
        *rest, last = runtime_ids()
        raise UnknownRuntime(f"unknown runtime '{runtime_id}'; use {', '.join(rest)} or {last}")
    return entry


def default_runtime(model: str | None) -> str:
    """The runtime for a model spec when none is named: llama.cpp, for every spec today."""
    return DEFAULT_RUNTIME


def pick_runtime(named: str | None, model: str | None) -> str:
    """The runtime named (checked to exist), else the default for ``model``."""
    return get_runtime(named).id if named else default_runtime(model)


def keeps_pulls(runtime_id: str) -> bool:
    """Whether the runtime pulls hub models into Shoal's own cache."""
    return get_runtime(runtime_id).keeps_pulls


def check_runtime(runtime_id: str) -> None:
    """Raise RuntimeUnavailable (one line) when the runtime cannot run here."""
    get_runtime(runtime_id).check()


def resolve_model(runtime_id: str, spec: str | None, *, home: Path, offline: bool,
                  progress: Progress | None = None,
                  cancel: CancelFlag | None = None) -> ResolvedModel:
    """What the runtime loads for ``spec`` (pulled into ``home`` if it must) and its name.

    The runtime is checked first, so that one that cannot run here pulls nothing.
    Raises ModelMissing (engine.models) or RuntimeUnavailable, each with one line.
    """
    entry = get_runtime(runtime_id)
    entry.check()
    return entry.find_model(spec, home, offline, progress, cancel)


def makes_embeddings(runtime_id: str, path: str) -> bool:
    """Whether the model at ``path`` makes embeddings rather than text, from its metadata
    (blocking: a vocabulary loads; run it off the loop). Only llama.cpp and the mock serve
    embedding models."""
    if runtime_id not in ("llamacpp", "mock"):
        return False
    if runtime_id == "llamacpp":  # its header's keys alone, not its whole vocabulary
        from engine.runtimes import gguf_meta, llamacpp

        return is_embedding_model(gguf_meta.read_metadata(llamacpp.library(), path, [],
                                                          arch_keys=["pooling_type"]))
    vocab = load_vocab(runtime_id, path)
    try:
        return is_embedding_model(vocab.metadata())
    finally:
        close = getattr(vocab, "close", None)
        if close is not None:
            close()


def make_engine(runtime_id: str, path: str, *, model_name: str, lanes: int = 8,
                max_context: int | None = None, mock_speed: float = 0.0,
                memory_budget: int | None = None, kv_type: str = "f16",
                gpu: str = "auto", embedding: bool = False,
                measure_at_start: bool = True,
                split_with: tuple[tuple[str, int, str], ...] = ()) -> Engine:
    """A node's engine, not started yet (``await engine.start()`` loads the model).
    ``memory_budget`` and ``kv_type``: for the runtimes that size a KV pool (llama.cpp
    takes both, mlx the budget; the mock and the engines a node fronts, neither);
    ``gpu``: the device llama.cpp runs on (auto, off or a name; the others choose their own)."""
    spec = EngineSpec(path=path, model_name=model_name, lanes=lanes, max_context=max_context,
                      mock_speed=mock_speed, memory_budget=memory_budget, kv_type=kv_type,
                      gpu=gpu, embedding=embedding, measure_at_start=measure_at_start,
                      split_with=split_with)
    if split_with and runtime_id != "llamacpp":
        raise RuntimeUnavailable(f"only the llamacpp runtime splits a model across machines; "
                                 f"{runtime_id} cannot")
    return get_runtime(runtime_id).make_engine(spec)


def load_vocab(runtime_id: str, path: str) -> Tokenizer:
    """The head's vocabulary of the model at ``path`` (no weights), through the runtime."""
    return get_runtime(runtime_id).load_vocab(path)

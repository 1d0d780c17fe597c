"""What a runtime gives the node (an engine) and the head (a tokenizer).

A node drives an :class:`Engine`: one per process, a fixed number of lanes,
each lane running one generation at a time. The head never loads an engine;
it loads a :class:`Tokenizer` through the same runtime to turn text into ids
and ids back into bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "cancelled"]


class RuntimeUnavailable(Exception):
    """The runtime cannot run here; the message names the cause and the fix."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """Per-lane sampler settings. temperature 0 means greedy."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: Sequence[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: frozenset[int] = frozenset()
    # the conversation this belongs to; engines with a prompt cache park the
    # finished sequence under it and reuse the common prefix next turn
    session: str = ""


@dataclass(frozen=True, slots=True)
class GenerationResult:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens reused from the session's cache
    ttft_ms: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    lanes: int
    lanes_busy: int
    kv_used: int  # KV cells in use (tokens held), over all lanes
    kv_total: int
    prefill_tps: float  # measured, 0.0 until measured
    decode_tps: float  # per lane, measured, 0.0 until measured
    ttft_ms: float  # median of recent, 0.0 until measured
    # why the engine takes no generation now (an upstream that stopped answering); "" when
    # it does. The node then refuses sessions as busy and reports every lane busy.
    down: str = ""
    kv_parked: int = 0  # cells held by parked prefixes (reclaimed when a session needs them)
    max_prompt: int = 0  # the longest prompt a new session can bring now; 0: no pool
    mem_used: int = 0  # bytes the engine's process holds (0: not measured)
    mem_budget: int = 0  # bytes it keeps within (0: no budget)
    prompt_from_lanes: int = 0  # prompt tokens reused from a parked lane, so far
    prompt_from_host: int = 0  # prompt tokens restored from the host-memory cache, so far
    prompt_prefilled: int = 0  # prompt tokens prefilled, so far
    host_cache_bytes: int = 0  # what the host-memory prompt cache holds now
    host_cache_limit: int = 0  # and may hold, within the budget
    prefill_s_per_token: float = 0.0  # engine.runtimes.prefill_fit; 0.0 until fitted
    prefill_s_per_token_ctx: float = 0.0
    # the device the model runs on ("Vulkan0 (NVIDIA GeForce RTX 4070)"; "" the CPU), and
    # how many of the model's layers (its output layer counted) are on it
    device: str = ""
    gpu_layers: int = 0
    model_layers: int = 0
    device_note: str = ""  # what the node chose and why, one line ("" where no choice)
    # the GPU llama.cpp chose ("gpu" or "igpu"; "" none), whether or not a layer went
    # there, and its memory in bytes: the free figure as listed before the model loaded
    device_kind: str = ""
    device_total: int = 0
    device_free: int = 0


@runtime_checkable
class Admitter(Protocol):
    """An engine whose lanes share one KV pool says, before it is asked, whether a new
    session fits now (the node then refuses it as busy at once, and the head places it
    elsewhere)."""

    def admission(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """None when it fits now; else why not, one line."""
        ...


@runtime_checkable
class Sleeper(Protocol):
    """An engine that can free its model and pool while idle and load them again."""

    async def suspend(self) -> None: ...

    async def resume(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One vector per input, ``dims`` float32 values each (little-endian, one after another,
    in input order), each of unit length; ``tokens``: the inputs' tokens, all together."""

    dims: int
    count: int
    vectors: bytes
    tokens: int


@runtime_checkable
class Embedder(Protocol):
    """An engine whose model makes embeddings, not text (its ``generate`` refuses)."""

    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embeddings:
        """Each input's vector (ids with the model's own special tokens). ValueError names
        an input the model cannot take (too long, ids outside the vocabulary)."""
        ...


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str  # the model's name as the node announces it
    runtime: str  # "llamacpp" | "mlx" | "mock" | "llama-server" | "vllm"
    context_window: int  # tokens one session can hold (per lane)
    lanes: int
    path: str = ""  # the file it serves, for the start-up line
    window_pinned: bool = False  # --max-context given (else the model's own window)


class Generation(Protocol):
    """One running generation: iterate for batches of token ids, then read result.

    Iteration ends on EOS or a stop id (the stop id is not yielded), on
    max_tokens, or after :meth:`cancel`. ``aclose`` / ``cancel`` free the lane.
    """

    def __aiter__(self) -> AsyncIterator[list[int]]: ...

    @property
    def result(self) -> GenerationResult: ...

    def cancel(self) -> None: ...


class Engine(Protocol):
    info: EngineInfo

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: GenerationRequest) -> Generation:
        """Start on a free lane. The caller never asks for more than ``info.lanes``."""
        ...

    def stats(self) -> EngineStats: ...


class Tokenizer(Protocol):
    """Vocabulary only: what the head needs to make prompts and read tokens."""

    @property
    def eos_ids(self) -> frozenset[int]:
        """End-of-generation and end-of-turn ids; generation stops at them."""
        ...

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Text to ids; with ``special`` the template's control tokens parse as one id."""
        ...

    def encode_input(self, text: str) -> list[int]:
        """An embedding's input: plain text between the special tokens the vocabulary
        adds to a sequence (BERT's CLS and SEP)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (control tokens render as b"")."""
        ...

    def special_text(self, token: int) -> str: ...

    def metadata(self) -> Mapping[str, str]:
        """The model's metadata as GGUF names it (``general.architecture``, ...)."""
        ...

    def chat_template(self) -> str | None:
        """The model's own chat template, if it carries one."""
        ...

    @property
    def bos_text(self) -> str: ...

    @property
    def eos_text(self) -> str: ...

    def fim_ids(self) -> tuple[int, int, int] | None:
        """Fill-in-the-middle prefix, suffix and middle ids, when the model has them."""
        ...

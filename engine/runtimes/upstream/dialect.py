"""What a dialect (one serving engine's HTTP API) gives the upstream engine. Pure types.

A dialect builds request bodies and reads answers; it never does IO. The engine
GETs ``info_paths`` once at start (:meth:`Dialect.layout`), ``poll_paths`` every
second (:meth:`Dialect.load`; ``/health`` must answer 200, the others may be
missing), tokenizes through ``tokenize_path`` and streams from ``completion_path``.
JSON answers come parsed; ``/metrics`` comes as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from engine.runtimes.base import FinishReason, GenerationRequest

Answers = Mapping[str, object]  # path -> parsed JSON (or text for /metrics); absent: no answer


class UpstreamAnswerError(ValueError):
    """The upstream answered something of the wrong shape, or an error; one line."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What the upstream says at start."""

    model_id: str  # the name it serves the model under
    context_window: int  # tokens one sequence can hold; 0 when it does not say
    lanes: int  # sequences it runs at once; 0 when it does not say
    eos_text: str = ""  # the model's end-of-sequence text, when it says it


@dataclass(frozen=True, slots=True)
class Load:
    """What one poll says."""

    running: int = 0  # sequences running, whoever sent them
    waiting: int = 0  # requests it queued
    kv_used: int = 0  # KV cells (tokens) held
    kv_total: int = 0  # 0 when it does not say
    lanes: int = 0  # sequences it runs at once, when /metrics shows it; else 0
    missing: str = ""  # what it does not show and how to make it, said once


@dataclass(frozen=True, slots=True)
class Chunk:
    """One event of a streamed completion."""

    ids: tuple[int, ...] = ()
    finish: FinishReason | None = None  # set once the upstream says why it stopped
    done: bool = False  # the last event of the stream
    cached_tokens: int | None = None  # prompt tokens it reused from its cache


class Dialect(Protocol):
    runtime: str  # the runtime id: "llama-server" | "vllm"
    label: str  # how messages name it
    info_paths: tuple[str, ...]
    poll_paths: tuple[str, ...]
    tokenize_path: str
    completion_path: str
    uses_slots: bool  # requests name the slot (lane) they run in

    def model_name(self, model_id: str) -> str:
        """The name the node announces for ``model_id`` when --model-name does not say."""
        ...

    def layout(self, answers: Answers) -> Layout: ...

    def load(self, answers: Answers, *, context_window: int, lanes: int) -> Load: ...

    def tokenize_body(self, model: str, text: str, *, special: bool) -> dict[str, object]: ...

    def tokens(self, answer: object) -> list[int]: ...

    def completion_body(self, request: GenerationRequest, *, model: str,
                        slot: int | None) -> dict[str, object]: ...

    def chunk(self, data: bytes) -> Chunk | None:
        """One SSE event's data; None for an event that carries nothing for us."""
        ...


def as_dict(answer: object, what: str) -> Mapping[str, object]:
    if not isinstance(answer, dict):
        raise UpstreamAnswerError(f"{what} is not a JSON object")
    return answer


def as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 40:
        raise UpstreamAnswerError(f"{what} is not a count")
    return value


def as_ids(value: object, what: str, *, limit: int = 1 << 20) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > limit:
        raise UpstreamAnswerError(f"{what} is not a list of token ids")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 31:
            raise UpstreamAnswerError(f"{what} holds something that is not a token id")
    return tuple(value)


def error_text(answer: object) -> str | None:
    """The message of an OpenAI-style ``{"error": ...}`` answer, if it is one."""
    if isinstance(answer, dict) and "error" in answer:
        err = answer["error"]
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        return str(err)[:500]
    return None


def first_model(answers: Answers) -> Mapping[str, object]:
    """The first model card of ``/v1/models`` (both engines answer it the OpenAI way)."""
    models = as_dict(answers.get("/v1/models"), "the answer of /v1/models")
    data = models.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) \
            or not isinstance(data[0].get("id"), str):
        raise UpstreamAnswerError("/v1/models names no model")
    return data[0]


def tokenized(answer: object) -> list[int]:
    """The ids of a ``/tokenize`` answer (``{"tokens": [...]}`` in both engines)."""
    return list(as_ids(as_dict(answer, "the answer of /tokenize").get("tokens"),
                       "tokens of /tokenize"))

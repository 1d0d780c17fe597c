"""vLLM's OpenAI-compatible server, as the node talks to it. Pure: bodies out, answers in.

Token ids out of ``/v1/completions`` need ``return_token_ids``, added to vLLM by
pull request #22587 (merged August 2025, first released in v0.10.2); see
``vllm/entrypoints/openai/protocol.py`` there: ``CompletionRequest.return_token_ids``,
``CompletionResponseStreamChoice.token_ids`` (the ids of that chunk; ``prompt_token_ids``
only in a choice's first chunk). Older vLLM ignores the field and sends text only:
the node then fails the generation in one line naming the version it needs.

Shapes followed (vLLM 0.10.2 and later):

- ``GET /v1/models``: ``data[0].id`` and ``data[0].max_model_len``.
- ``POST /tokenize`` ``{"model", "prompt", "add_special_tokens": false}`` → ``{"tokens": [...],
  "count", "max_model_len"}``.
- ``POST /v1/completions`` with ``prompt`` a list of ids, ``stream``, ``stream_options:
  {"include_usage": true}``, ``return_token_ids``, ``stop_token_ids``: SSE chunks
  ``{"choices": [{"text", "token_ids", "finish_reason": null|"stop"|"length"|"abort"}]}``,
  then a usage chunk ``{"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens"}}}``
  (cached tokens only with ``--enable-prompt-tokens-details``), then ``[DONE]``.
- ``GET /metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction, 0-1; before v0.10: ``vllm:gpu_cache_usage_perc``),
  and ``vllm:cache_config_info`` whose labels carry ``num_gpu_blocks`` and ``block_size``.
  vLLM shows nowhere how many sequences it runs at once (``--max-num-seqs``), so the node
  is told (``--max-batch``).
- ``GET /health``: 200 with an empty body once the engine runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.runtimes.base import FinishReason, GenerationRequest
from engine.runtimes.upstream import prometheus
from engine.runtimes.upstream.dialect import (
    Answers,
    Chunk,
    Layout,
    Load,
    UpstreamAnswerError,
    as_dict,
    as_ids,
    as_int,
    error_text,
    first_model,
    tokenized,
)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
_METRICS = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD, CACHE_INFO)
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "cancelled"}


@dataclass(slots=True)
class Vllm:
    runtime: str = "vllm"
    label: str = "vLLM"
    info_paths: tuple[str, ...] = ("/v1/models",)
    poll_paths: tuple[str, ...] = ("/health", "/metrics")
    tokenize_path: str = "/tokenize"
    completion_path: str = "/v1/completions"
    uses_slots: bool = False

    def model_name(self, model_id: str) -> str:
        return model_id

    def layout(self, answers: Answers) -> Layout:
        card = first_model(answers)
        window = card.get("max_model_len")
        return Layout(model_id=str(card["id"])[:256],
                      context_window=as_int(window, "max_model_len of /v1/models")
                      if window is not None else 0, lanes=0)

    def load(self, answers: Answers, *, context_window: int, lanes: int) -> Load:
        text = answers.get("/metrics")
        if not isinstance(text, str):
            return Load(missing="/metrics (vLLM serves it unless started with "
                                "--disable-log-stats)")
        samples = prometheus.parse(text, _METRICS)
        running = int(prometheus.total(samples, RUNNING) or 0)
        waiting = int(prometheus.total(samples, WAITING) or 0)
        usage = prometheus.total(samples, KV_USAGE)
        if usage is None:
            usage = prometheus.total(samples, KV_USAGE_OLD)
        kv_total = 0
        for s in samples:
            if s.name == CACHE_INFO:
                kv_total = _int_label(s.labels, "num_gpu_blocks") * _int_label(s.labels,
                                                                              "block_size")
        kv_total = kv_total or context_window * lanes
        fraction = min(max(usage or 0.0, 0.0), 1.0)
        return Load(running=running, waiting=waiting, kv_used=int(fraction * kv_total),
                    kv_total=kv_total,
                    missing="" if usage is not None else f"{KV_USAGE} in /metrics")

    def tokenize_body(self, model: str, text: str, *, special: bool) -> dict[str, object]:
        return {"model": model, "prompt": text, "add_special_tokens": False}

    def tokens(self, answer: object) -> list[int]:
        return tokenized(answer)

    def completion_body(self, request: GenerationRequest, *, model: str,
                        slot: int | None) -> dict[str, object]:
        s = request.sampling
        body: dict[str, object] = {
            "model": model, "prompt": list(request.prompt), "max_tokens": request.max_tokens,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1, "min_p": s.min_p,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repeat_penalty,
            "stop_token_ids": sorted(request.stop_ids),
        }
        if s.seed is not None:
            body["seed"] = s.seed
        return body

    def chunk(self, data: bytes) -> Chunk | None:
        if data.strip() == b"[DONE]":
            return Chunk(done=True)
        try:
            event = json.loads(data)
        except ValueError:
            raise UpstreamAnswerError("vLLM streamed a chunk that is not JSON") from None
        message = error_text(event)
        if message is not None:
            raise UpstreamAnswerError(f"vLLM failed the generation: {message}")
        event = as_dict(event, "a streamed chunk")
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise UpstreamAnswerError("vLLM streamed a chunk without choices")
        if not choices:  # the usage chunk
            return Chunk(cached_tokens=_cached(event.get("usage")))
        choice = as_dict(choices[0], "a streamed choice")
        if "token_ids" not in choice or choice["token_ids"] is None:
            if choice.get("text") or choice.get("finish_reason") is None:
                raise UpstreamAnswerError("vLLM streamed text without token ids; the node "
                                          "needs vLLM 0.10.2 or later (return_token_ids)")
            ids: tuple[int, ...] = ()
        else:
            ids = as_ids(choice["token_ids"], "token_ids of a streamed choice")
        reason = choice.get("finish_reason")
        finish = _FINISH.get(reason, "stop") if isinstance(reason, str) else None
        return Chunk(ids=ids, finish=finish, cached_tokens=_cached(event.get("usage")))


def _cached(usage: object) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and cached >= 0 else None


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        value = int(labels.get(name, "0"))
    except ValueError:
        return 0
    return value if 0 < value < 1 << 31 else 0


DIALECT = Vllm()

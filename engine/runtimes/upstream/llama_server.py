"""llama.cpp's ``llama-server``, as the node talks to it. Pure: bodies out, answers in.

Shapes as a llama-server built from the llama.cpp of llama-cpp-python 0.3.36
answers them (checked against that binary; the unit tests hold recorded answers):

- ``GET /props``: ``total_slots`` (its ``--parallel``), ``default_generation_settings.n_ctx``
  (the window of one slot: ``--ctx-size`` divided by the slots), ``eos_token`` (text).
- ``GET /v1/models``: ``data[0].id``, the model path or its ``--alias``.
- ``GET /slots``: per slot ``id``, ``n_ctx``, ``is_processing``, and once a slot has run a
  task ``n_prompt_tokens`` and ``next_token[0].n_decoded``.
- ``GET /metrics`` (only with ``--metrics``): ``llamacpp:requests_processing`` and
  ``llamacpp:requests_deferred``; no KV occupancy in this version.
- ``POST /tokenize`` ``{"content", "add_special": false, "parse_special"}`` → ``{"tokens": [...]}``.
- ``POST /completion`` with ``prompt`` a list of ids, ``id_slot``, ``cache_prompt``,
  ``return_tokens``, ``stream``: SSE events ``{"tokens": [...], "stop": false}``, the model's
  end-of-generation token included, then a last ``{"stop": true, "stop_type":
  "eos"|"limit"|"word"|"none", "timings": {"cache_n": ...}}``. An error mid-stream comes as
  ``{"error": {...}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import PurePosixPath

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

_STOP_TYPES: dict[str, FinishReason] = {"eos": "stop", "word": "stop", "limit": "length",
                                        "none": "stop"}
_METRICS = ("llamacpp:requests_processing", "llamacpp:requests_deferred")


@dataclass(slots=True)
class LlamaServer:
    runtime: str = "llama-server"
    label: str = "llama-server"
    info_paths: tuple[str, ...] = ("/v1/models", "/props")
    poll_paths: tuple[str, ...] = ("/health", "/slots", "/metrics")
    tokenize_path: str = "/tokenize"
    completion_path: str = "/completion"
    uses_slots: bool = True

    def model_name(self, model_id: str) -> str:
        """A model path goes by its file name without ``.gguf``, as a head names a GGUF."""
        name = PurePosixPath(model_id).name if "/" in model_id else model_id
        return name[:-5] if name.lower().endswith(".gguf") else name

    def layout(self, answers: Answers) -> Layout:
        card = first_model(answers)
        props = as_dict(answers.get("/props"), "the answer of /props")
        slots = as_int(props.get("total_slots"), "total_slots of /props")
        settings = as_dict(props.get("default_generation_settings", {}),
                           "default_generation_settings of /props")
        n_ctx = as_int(settings.get("n_ctx", 0), "n_ctx of /props")
        eos = props.get("eos_token")
        return Layout(model_id=str(card["id"])[:256], context_window=n_ctx, lanes=slots,
                      eos_text=eos if isinstance(eos, str) else "")

    def load(self, answers: Answers, *, context_window: int, lanes: int) -> Load:
        running = waiting = kv_used = 0
        slots = answers.get("/slots")
        missing = ""
        if isinstance(slots, list):
            for slot in slots[:4096]:
                if not isinstance(slot, dict):
                    continue
                running += 1 if slot.get("is_processing") is True else 0
                kv_used += _slot_tokens(slot)
        else:
            missing = "/slots (start llama-server without --no-slots)"
        text = answers.get("/metrics")
        if isinstance(text, str):
            samples = prometheus.parse(text, _METRICS)
            running = int(prometheus.total(samples, _METRICS[0]) or running)
            waiting = int(prometheus.total(samples, _METRICS[1]) or 0)
        else:
            missing = missing or "/metrics (start llama-server with --metrics)"
        return Load(running=running, waiting=waiting, kv_used=kv_used,
                    kv_total=context_window * lanes, missing=missing)

    def tokenize_body(self, model: str, text: str, *, special: bool) -> dict[str, object]:
        return {"content": text, "add_special": False, "parse_special": special}

    def tokens(self, answer: object) -> list[int]:
        return tokenized(answer)

    def completion_body(self, request: GenerationRequest, *, model: str,
                        slot: int | None) -> dict[str, object]:
        s = request.sampling
        body: dict[str, object] = {
            "prompt": list(request.prompt), "n_predict": request.max_tokens,
            "stream": True, "return_tokens": True, "cache_prompt": True,
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "min_p": s.min_p, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "repeat_penalty": s.repeat_penalty,
        }
        if s.seed is not None:
            body["seed"] = s.seed & 0xFFFFFFFF  # llama.cpp seeds are 32-bit
        if slot is not None:
            body["id_slot"] = slot
        return body

    def chunk(self, data: bytes) -> Chunk | None:
        try:
            event = json.loads(data)
        except ValueError:
            raise UpstreamAnswerError("llama-server streamed an event that is not JSON") from None
        message = error_text(event)
        if message is not None:
            raise UpstreamAnswerError(f"llama-server failed the generation: {message}")
        event = as_dict(event, "a streamed event")
        ids = as_ids(event.get("tokens", []), "tokens of a streamed event")
        if "tokens" not in event and event.get("stop") is not True:
            raise UpstreamAnswerError("llama-server streamed no token ids; run a newer "
                                      "llama-server (one that takes return_tokens)")
        if event.get("stop") is not True:
            return Chunk(ids=ids)
        stop_type = event.get("stop_type")
        timings = event.get("timings")
        cached = timings.get("cache_n") if isinstance(timings, dict) else None
        return Chunk(ids=ids, done=True,
                     finish=_STOP_TYPES.get(stop_type if isinstance(stop_type, str) else "",
                                            "stop"),
                     cached_tokens=cached if isinstance(cached, int) and cached >= 0 else None)


def _slot_tokens(slot: dict[str, object]) -> int:
    """Tokens a slot's KV holds (its last prompt and what it decoded), roughly."""
    prompt = slot.get("n_prompt_tokens")
    decoded = 0
    nxt = slot.get("next_token")
    if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict):
        d = nxt[0].get("n_decoded")
        decoded = d if isinstance(d, int) and d > 0 else 0
    n = (prompt if isinstance(prompt, int) and prompt > 0 else 0) + decoded
    ctx = slot.get("n_ctx")
    return min(n, ctx) if isinstance(ctx, int) and ctx > 0 else n


DIALECT = LlamaServer()

"""The llama-server dialect, pure: bodies built from a request, and answers read as a
llama-server built from llama-cpp-python 0.3.36's llama.cpp gives them (recorded from
that binary with SmolLM2 at --parallel 4 -c 4096 --metrics), plus the bounded SSE reader."""

from __future__ import annotations

import json

import pytest

from engine.runtimes.base import GenerationRequest, Sampling
from engine.runtimes.upstream.dialect import Chunk, UpstreamAnswerError
from engine.runtimes.upstream.llama_server import DIALECT
from engine.runtimes.upstream.sse import SseParser, SseTooLarge

PATH = "/tmp/shoal-test-models/home/models/embedded/SmolLM2-135M-Instruct.Q4_1.gguf"
PROPS = {"default_generation_settings": {"params": {"seed": 4294967295}, "n_ctx": 1024},
         "total_slots": 4, "model_alias": PATH, "model_path": PATH,
         "endpoint_slots": True, "endpoint_metrics": True,
         "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "build_info": "b0-unknown"}
MODELS = {"models": [{"name": PATH, "model": PATH}], "object": "list",
          "data": [{"id": PATH, "aliases": [PATH], "object": "model", "owned_by": "llamacpp",
                    "meta": {"n_vocab": 49152, "n_ctx": 1024, "n_ctx_train": 8192}}]}
SLOTS = [
    {"id": 0, "n_ctx": 1024, "speculative": False, "is_processing": False},
    {"id": 1, "n_ctx": 1024, "speculative": False, "is_processing": True, "id_task": 11,
     "n_prompt_tokens": 6, "n_prompt_tokens_processed": 0, "n_prompt_tokens_cache": 0,
     "next_token": [{"has_next_token": True, "n_remain": -1, "n_decoded": 3}]},
    {"id": 2, "n_ctx": 1024, "speculative": False, "is_processing": False},
    {"id": 3, "n_ctx": 1024, "speculative": False, "is_processing": False, "id_task": 77,
     "n_prompt_tokens": 44, "next_token": [{"has_next_token": False, "n_decoded": 0}]},
]
METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 0
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""
# the stream of POST /completion {"prompt": [...], "stream": true, "return_tokens": true}
STREAM = (
    b'data: {"index":0,"content":"?","tokens":[47],"stop":false,"id_slot":-1,'
    b'"tokens_predicted":32,"tokens_evaluated":12}\n\n'
    b'data: {"index":0,"content":"","tokens":[2],"stop":false,"id_slot":-1,'
    b'"tokens_predicted":33,"tokens_evaluated":12}\n\n'
    b'data: {"index":0,"content":"","tokens":[],"id_slot":1,"stop":true,"model":"m",'
    b'"tokens_predicted":33,"tokens_evaluated":12,"stop_type":"eos","stopping_word":"",'
    b'"tokens_cached":44,"timings":{"cache_n":3,"prompt_n":9,"prompt_ms":97.4,'
    b'"predicted_n":33,"predicted_per_second":55.7}}\n\n'
)


def test_layout_from_props_and_models() -> None:
    layout = DIALECT.layout({"/v1/models": MODELS, "/props": PROPS})
    assert (layout.model_id, layout.context_window, layout.lanes, layout.eos_text) == (
        PATH, 1024, 4, "<|im_end|>")
    # a GGUF path goes by its file name, as a head given that path names the model
    assert DIALECT.model_name(layout.model_id) == "SmolLM2-135M-Instruct.Q4_1"
    assert DIALECT.model_name("my-alias") == "my-alias"


@pytest.mark.parametrize("answers", [
    {"/v1/models": {"data": []}, "/props": PROPS},
    {"/v1/models": MODELS, "/props": {"total_slots": "four"}},
    {"/v1/models": MODELS, "/props": [1]},
])
def test_odd_answers_are_refused(answers: dict[str, object]) -> None:
    with pytest.raises(UpstreamAnswerError):
        DIALECT.layout(answers)


def test_load_from_slots_and_metrics() -> None:
    load = DIALECT.load({"/slots": SLOTS, "/metrics": METRICS}, context_window=1024, lanes=4)
    assert (load.running, load.waiting, load.kv_used, load.kv_total, load.missing) == (
        2, 1, 6 + 3 + 44, 4096, "")


def test_load_without_metrics_says_what_is_missing_and_counts_slots() -> None:
    load = DIALECT.load({"/slots": SLOTS}, context_window=1024, lanes=4)
    assert load.running == 1 and load.kv_used == 53
    assert load.missing == "/metrics (start llama-server with --metrics)"


def test_completion_body_carries_ids_slot_and_sampling() -> None:
    req = GenerationRequest(prompt=[1, 2, 3], max_tokens=7, session="s",
                            sampling=Sampling(temperature=0.0, top_k=5, seed=-1,
                                              repeat_penalty=1.1))
    body = DIALECT.completion_body(req, model="m", slot=2)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 7 and body["id_slot"] == 2
    assert body["stream"] is True and body["return_tokens"] is True
    assert body["cache_prompt"] is True
    assert (body["temperature"], body["top_k"], body["repeat_penalty"]) == (0.0, 5, 1.1)
    assert body["seed"] == 0xFFFFFFFF  # a negative seed as llama.cpp's 32-bit one
    assert "seed" not in DIALECT.completion_body(GenerationRequest([1], 1), model="m",
                                                 slot=None)
    assert json.dumps(body)  # what aiohttp sends


def test_stream_events_read_into_ids_and_the_end() -> None:
    parser = SseParser()
    events = parser.feed(STREAM[:50]) + parser.feed(STREAM[50:])  # split mid-event
    chunks = [DIALECT.chunk(e) for e in events]
    assert chunks == [Chunk(ids=(47,)), Chunk(ids=(2,)),
                      Chunk(ids=(), finish="stop", done=True, cached_tokens=3)]
    limit = b'{"tokens":[],"stop":true,"stop_type":"limit","timings":{}}'
    assert DIALECT.chunk(limit) == Chunk(finish="length", done=True)


@pytest.mark.parametrize("data", [
    b'{"error":{"code":500,"message":"slot unavailable","type":"server_error"}}',
    b'not json', b'{"content":"x","stop":false}', b'{"tokens":[-1],"stop":false}',
])
def test_errors_and_odd_events_fail_the_generation(data: bytes) -> None:
    with pytest.raises(UpstreamAnswerError):
        DIALECT.chunk(data)


def test_tokenize_body_and_answer() -> None:
    assert DIALECT.tokenize_body("m", "Hello, world", special=False) == {
        "content": "Hello, world", "add_special": False, "parse_special": False}
    assert DIALECT.tokens({"tokens": [19556, 28, 905]}) == [19556, 28, 905]


def test_sse_reader_bounds_lines_and_events_before_keeping_them() -> None:
    parser = SseParser(max_line=64, max_event=100)
    assert parser.feed(b": keepalive\n\ndata: a\r\ndata: b\r\n\r\n") == [b"a\nb"]
    with pytest.raises(SseTooLarge):
        SseParser(max_line=64).feed(b"data: " + b"x" * 100)  # no newline yet: still refused
    with pytest.raises(SseTooLarge):
        parser.feed(b"data: " + b"y" * 50 + b"\ndata: " + b"z" * 50 + b"\n")

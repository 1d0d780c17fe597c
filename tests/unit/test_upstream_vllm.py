"""The vLLM dialect, pure: request bodies and answers in the shapes of vLLM 0.10.2 and
later (vllm/entrypoints/openai/protocol.py; return_token_ids from pull request #22587)."""

from __future__ import annotations

import pytest

from engine.runtimes.base import GenerationRequest, Sampling
from engine.runtimes.upstream.dialect import Chunk, UpstreamAnswerError
from engine.runtimes.upstream.vllm import DIALECT

MODELS = {"object": "list", "data": [{"id": "Qwen/Qwen2.5-0.5B-Instruct", "object": "model",
                                      "owned_by": "vllm", "root": "Qwen/Qwen2.5-0.5B-Instruct",
                                      "max_model_len": 4096, "permission": []}]}
METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 3.0
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
"""


def test_layout_from_models() -> None:
    layout = DIALECT.layout({"/v1/models": MODELS})
    assert (layout.model_id, layout.context_window, layout.lanes) == (
        "Qwen/Qwen2.5-0.5B-Instruct", 4096, 0)  # lanes: the node is told (--max-batch)
    assert DIALECT.model_name(layout.model_id) == "Qwen/Qwen2.5-0.5B-Instruct"


def test_load_from_metrics_current_and_older_names() -> None:
    load = DIALECT.load({"/metrics": METRICS}, context_window=4096, lanes=8)
    assert (load.running, load.waiting, load.kv_total, load.kv_used, load.lanes) == (
        3, 2, 16_000, 4_000, 0)
    older = METRICS.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert DIALECT.load({"/metrics": older}, context_window=4096, lanes=8).kv_used == 4_000
    bare = "vllm:num_requests_running 1\n"  # no usage, no cache info
    load = DIALECT.load({"/metrics": bare}, context_window=4096, lanes=8)
    assert (load.kv_total, load.kv_used) == (4096 * 8, 0)
    assert load.missing == "vllm:kv_cache_usage_perc in /metrics"
    assert load.lanes == 0  # vLLM does not show its --max-num-seqs: the node is told


def test_completion_body() -> None:
    req = GenerationRequest(prompt=[5, 6], max_tokens=9, stop_ids=frozenset({2, 1}),
                            sampling=Sampling(temperature=0.0, top_k=0, seed=42,
                                              repeat_penalty=1.2))
    body = DIALECT.completion_body(req, model="Qwen/Qwen2.5-0.5B-Instruct", slot=None)
    assert body == {
        "model": "Qwen/Qwen2.5-0.5B-Instruct", "prompt": [5, 6], "max_tokens": 9,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
        "temperature": 0.0, "top_p": 0.95, "top_k": -1, "min_p": 0.05,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.2,
        "stop_token_ids": [1, 2], "seed": 42}


def test_stream_chunks() -> None:
    first = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
             b'[{"index":0,"text":"Hi","logprobs":null,"finish_reason":null,"stop_reason":null,'
             b'"prompt_token_ids":[5,6],"token_ids":[13048]}],"usage":null}')
    last = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
            b'[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null,'
            b'"token_ids":[]}],"usage":null}')
    usage = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],'
             b'"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2,'
             b'"prompt_tokens_details":{"cached_tokens":1}}}')
    assert DIALECT.chunk(first) == Chunk(ids=(13048,))
    assert DIALECT.chunk(last) == Chunk(finish="length")
    assert DIALECT.chunk(usage) == Chunk(cached_tokens=1)
    assert DIALECT.chunk(b"[DONE]") == Chunk(done=True)


def test_a_vllm_without_return_token_ids_is_named() -> None:
    old = (b'{"choices":[{"index":0,"text":"Hi","logprobs":null,"finish_reason":null}]}')
    with pytest.raises(UpstreamAnswerError, match=r"needs vLLM 0\.10\.2 or later"):
        DIALECT.chunk(old)


@pytest.mark.parametrize("data", [
    b'{"error":{"message":"This model\'s maximum context length is 4096","code":400}}',
    b'{"object":"error","choices":"x"}', b'{"choices":[{"token_ids":["a"]}]}',
])
def test_errors_fail_the_generation(data: bytes) -> None:
    with pytest.raises(UpstreamAnswerError):
        DIALECT.chunk(data)


def test_tokenize() -> None:
    assert DIALECT.tokenize_body("m", "Hello", special=False) == {
        "model": "m", "prompt": "Hello", "add_special_tokens": False}
    assert DIALECT.tokens({"count": 2, "max_model_len": 4096, "tokens": [9707, 11]}) == [
        9707, 11]

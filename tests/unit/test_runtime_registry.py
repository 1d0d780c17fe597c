"""The registry of runtimes: ids, refusals, and engines and vocabularies made through it."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from engine.models.errors import ModelMissing
from engine.runtimes import registry
from engine.runtimes.base import GenerationRequest, RuntimeUnavailable, Sampling
from engine.runtimes.llamacpp import LlamaCppEngine
from engine.runtimes.mock import EOS, MockEngine
from engine.runtimes.registry import ResolvedModel, UnknownRuntime


def test_ids_default_first() -> None:
    assert registry.runtime_ids() == ("llamacpp", "mlx", "mock", "llama-server", "vllm")


@pytest.mark.parametrize("call", [
    lambda: registry.get_runtime("sglang"),
    lambda: registry.check_runtime("sglang"),
    lambda: registry.pick_runtime("sglang", "m"),
    lambda: registry.make_engine("sglang", "m", model_name="m"),
    lambda: registry.load_vocab("sglang", "m"),
    lambda: registry.resolve_model("sglang", "m", home=Path("/nowhere"), offline=True),
])
def test_unknown_id_is_refused_in_one_line_naming_the_known(call: object) -> None:
    with pytest.raises(UnknownRuntime) as info:
        call()  # type: ignore[operator]
    assert str(info.value) == ("unknown runtime 'sglang'; use llamacpp, mlx, mock, "
                               "llama-server or vllm")
    assert isinstance(info.value, RuntimeUnavailable)  # callers that refuse those refuse it


@pytest.mark.parametrize(("named", "model", "want"), [
    (None, "org/repo:Q4_K_M", "llamacpp"),
    (None, None, "llamacpp"),
    (None, "mock", "llamacpp"),  # mock only when named
    ("mock", "m", "mock"),
    ("mlx", "org/repo", "mlx"),
    ("llamacpp", None, "llamacpp"),
])
def test_pick_runtime(named: str | None, model: str | None, want: str) -> None:
    assert registry.pick_runtime(named, model) == want


def test_mock_runs_anywhere_and_its_model_is_only_a_name(tmp_path: Path) -> None:
    registry.check_runtime("mock")
    assert registry.resolve_model("mock", None, home=tmp_path, offline=True) == ("mock", "mock")
    assert registry.resolve_model("mock", "m1", home=tmp_path, offline=True) == \
        ResolvedModel(path="m1", name="m1")
    assert not list(tmp_path.iterdir())  # nothing pulled, nothing written


async def test_mock_engine_and_vocab_made_through_it() -> None:
    engine = registry.make_engine("mock", "m1", model_name="m1", lanes=3, max_context=256,
                                  mock_speed=50.0)
    assert isinstance(engine, MockEngine) and engine.speed == 50.0
    assert (engine.info.runtime, engine.info.model, engine.info.lanes,
            engine.info.context_window) == ("mock", "m1", 3, 256)
    vocab = registry.load_vocab("mock", "m1")
    assert vocab.chat_template() and EOS in vocab.eos_ids
    prompt = vocab.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert b"".join(vocab.token_bytes(t) for t in prompt) == b"user\nhi\n"
    await engine.start()
    try:
        gen = engine.generate(GenerationRequest(prompt=prompt, max_tokens=4,
                                                sampling=Sampling(temperature=0.0)))
        out = [t async for batch in gen for t in batch]
        assert gen.result.completion_tokens == len(out) > 0
    finally:
        await engine.close()


def test_mock_window_defaults_when_not_pinned() -> None:
    engine = registry.make_engine("mock", "m", model_name="m")
    assert (engine.info.lanes, engine.info.context_window) == (8, 4096)


def test_llamacpp_engine_is_made_without_loading() -> None:
    engine = registry.make_engine("llamacpp", "/nowhere/model.gguf", model_name="x", lanes=2,
                                  max_context=512)
    assert isinstance(engine, LlamaCppEngine)
    assert (engine.info.runtime, engine.info.model, engine.info.path, engine.info.lanes,
            engine.info.context_window, engine.info.window_pinned) == \
        ("llamacpp", "x", "/nowhere/model.gguf", 2, 512, True)


def test_a_runtime_that_cannot_run_here_finds_no_model(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    looked: list[str | None] = []

    def unavailable() -> None:
        raise RuntimeUnavailable("runtime mlx needs Apple silicon; use --runtime llamacpp")

    def find(spec: str | None, *_: object) -> ResolvedModel:
        looked.append(spec)
        return ResolvedModel("p", "n")

    entry = registry.get_runtime("mlx")
    monkeypatch.setitem(registry._RUNTIMES, "mlx",
                        dataclasses.replace(entry, check=unavailable, find_model=find))
    with pytest.raises(RuntimeUnavailable, match="Apple silicon"):
        registry.resolve_model("mlx", "org/repo", home=tmp_path, offline=False)
    assert looked == []


def test_mlx_has_no_default_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    entry = registry.get_runtime("mlx")
    monkeypatch.setitem(registry._RUNTIMES, "mlx",
                        dataclasses.replace(entry, check=lambda: None))
    with pytest.raises(ModelMissing) as info:
        registry.resolve_model("mlx", None, home=tmp_path, offline=True)
    assert "\n" not in str(info.value) and "--runtime llamacpp" in str(info.value)
    # the runtime finds the folder or the cached repo itself: the spec goes through as it is
    assert registry.resolve_model("mlx", "org/some-model-4bit", home=tmp_path, offline=True) == \
        ("org/some-model-4bit", "org/some-model-4bit")
    assert registry.resolve_model("mlx", "/models/qwen-4bit", home=tmp_path, offline=True) == \
        ("/models/qwen-4bit", "qwen-4bit")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("runtime", ["llama-server", "vllm"])
def test_an_upstream_runtime_takes_a_url_and_refuses_to_be_a_heads_vocabulary(
        runtime: str) -> None:
    found = registry.resolve_model(runtime, "http://127.0.0.1:8080/", home=Path("/nowhere"),
                                   offline=True)
    assert found == ResolvedModel("http://127.0.0.1:8080", "")  # named by the engine itself
    with pytest.raises(RuntimeUnavailable, match="is not the address of a serving engine; "
                       "give --upstream http://HOST:PORT"):
        registry.resolve_model(runtime, "/models/x.gguf", home=Path("/nowhere"), offline=True)
    with pytest.raises(RuntimeUnavailable, match="a head reads its model's vocabulary from the "
                       "GGUF or MLX files"):
        registry.load_vocab(runtime, "http://127.0.0.1:8080")


def test_llamacpp_takes_the_gpu_asked_for() -> None:
    for gpu in ("auto", "off", "Vulkan0"):
        engine = registry.get_runtime("llamacpp").make_engine(
            registry.EngineSpec(path="/nowhere/m.gguf", model_name="m", gpu=gpu))
        assert isinstance(engine, LlamaCppEngine) and engine.gpu == gpu


@pytest.mark.parametrize(("runtime", "path", "why"), [
    ("mlx", "org/repo", "it runs the model on Apple silicon's GPU"),
    ("llama-server", "http://127.0.0.1:8080", "the engine it fronts chooses its own device"),
    ("vllm", "http://127.0.0.1:8000", "the engine it fronts chooses its own device"),
])
def test_a_runtime_that_chooses_its_own_gpu_says_it_ignores_one(
        caplog: pytest.LogCaptureFixture, runtime: str, path: str, why: str) -> None:
    caplog.set_level(logging.WARNING)
    entry = registry.get_runtime(runtime)
    entry.make_engine(registry.EngineSpec(path=path, model_name="m", gpu="off"))  # builds only
    assert f"runtime {runtime} ignores --gpu off: {why}" in caplog.text
    caplog.clear()
    entry.make_engine(registry.EngineSpec(path=path, model_name="m"))  # auto: nothing to say
    assert "--gpu" not in caplog.text


def test_mlx_says_it_ignores_a_kv_type(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    spec = registry.EngineSpec(path="org/repo", model_name="m", kv_type="q8_0")
    registry.get_runtime("mlx").make_engine(spec)  # builds only: nothing loads yet
    assert "runtime mlx keeps its KV cache in the model's own precision and ignores " \
        "--kv-type q8_0" in caplog.text
    caplog.clear()
    registry.get_runtime("mlx").make_engine(registry.EngineSpec(path="org/repo", model_name="m"))
    assert "--kv-type" not in caplog.text

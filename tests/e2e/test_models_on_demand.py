"""Several real models on one node (`shoal serve --serve-kept`): SmolLM2 serves first,
Gemma 3 270M and all-MiniLM-L6-v2 are kept in the store (`shoal models import`) and load
on the first request that names them, each answering as it does served alone; under a
budget that holds two of them, the third evicts the least recently used, which loads again
on its next request; Ollama's ``keep_alive: 0`` unloads a model at once after its answer;
a model nobody keeps is a one-line 404 naming what the fleet serves.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engine.models.store import import_gguf
from tests.integration.conftest import Cluster, Proc
from tests.waiting import until_sync

pytestmark = [pytest.mark.e2e, pytest.mark.processes, pytest.mark.timeout(300)]

PROMPT = "The three primary colours are"
TOKENS = 12
MiB = 1 << 20


def _post(proc: Proc, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://{proc.address}{path}", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(proc: Proc, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{proc.address}{path}", timeout=30) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _complete(proc: Proc, model: str) -> str:
    status, body = _post(proc, "/v1/completions", {"model": model, "prompt": PROMPT,
                                                   "max_tokens": TOKENS, "temperature": 0})
    assert status == 200, body
    text: str = body["choices"][0]["text"]
    return text


def _loaded(proc: Proc) -> set[str]:
    return {m["name"] for m in _get(proc, "/api/ps")["models"]}


def _rss(proc: Proc) -> int:
    for line in Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def kept_home(cluster: Cluster, gemma_gguf: Path, minilm_gguf: Path) -> Cluster:
    import_gguf(cluster.home, gemma_gguf, "gemma")
    import_gguf(cluster.home, minilm_gguf, "minilm")
    return cluster


def _serve(cluster: Cluster, model: Path, *extra: str) -> Proc:
    return cluster.head([], model=str(model), runtime="llamacpp",
                        extra=("--max-batch", "2", "--max-context", "1024", *extra),
                        ready_timeout=120)


def test_kept_models_load_on_demand_and_answer_as_alone(kept_home: Cluster, smollm2_gguf: Path,
                                                        gemma_gguf: Path) -> None:
    cluster = kept_home
    alone = _serve(cluster, gemma_gguf)
    gemma_alone = _complete(alone, "gemma-3-270m-q4_k_m")
    alone.stop()

    node = _serve(cluster, smollm2_gguf, "--serve-kept")
    smol = "SmolLM2-135M-Instruct.Q4_1"
    listed = {m["id"]: m for m in _get(node, "/v1/models")["data"]}
    assert {smol, "gemma", "minilm"} <= set(listed), listed
    assert listed[smol]["loaded"] and not listed["gemma"]["loaded"], listed
    smol_alone = _complete(node, smol)  # nothing else is loaded yet
    assert _loaded(node) == {smol}

    # interleaved, both at once on the node's two lanes: each by its own model
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda m: (m, _complete(node, m)), ["gemma", smol] * 2))
    for model, text in answers:
        assert text == (gemma_alone if model == "gemma" else smol_alone), answers
    assert _loaded(node) == {smol, "gemma"}
    two = _rss(node)

    status, body = _post(node, "/v1/embeddings", {"model": "minilm", "input": ["a cat"]})
    assert status == 200 and len(body["data"][0]["embedding"]) == 384, body
    assert _loaded(node) == {smol, "gemma", "minilm"}
    three = _rss(node)
    assert three > two

    # keep_alive 0 on Ollama's route: unloaded as soon as the answer is given
    status, body = _post(node, "/api/generate", {"model": "gemma", "prompt": PROMPT,
                                                 "raw": True, "keep_alive": 0, "stream": False,
                                                 "options": {"num_predict": 2,
                                                             "temperature": 0}})
    assert status == 200, body
    until_sync(lambda: "gemma" not in _loaded(node), "gemma to unload after keep_alive 0",
               timeout=30)

    # nothing to generate, as Ollama's clients load and stop a model: gemma loads, and
    # `keep_alive: 0` unloads it again
    status, body = _post(node, "/api/generate", {"model": "gemma", "stream": False})
    assert status == 200 and body["done_reason"] == "load", body
    assert "gemma" in _loaded(node)
    status, body = _post(node, "/api/generate", {"model": "gemma", "keep_alive": 0,
                                                 "stream": False})
    assert status == 200 and body["done_reason"] == "unload", body
    until_sync(lambda: "gemma" not in _loaded(node), "gemma stopped", timeout=30)

    status, body = _post(node, "/v1/completions", {"model": "nobody-keeps-this",
                                                   "prompt": "x", "max_tokens": 1})
    assert status == 404, body
    message = body["error"]["message"]
    assert "\n" not in message and "gemma" in message and smol in message, message
    node.stop()

    # a budget that holds two of the models and not the third
    budget = (two + three) // 2
    tight = _serve(cluster, smollm2_gguf, "--serve-kept", "--memory-budget",
                   f"{budget // MiB}M")
    assert _complete(tight, "gemma") == gemma_alone
    assert _complete(tight, smol) == smol_alone  # gemma is now the least recently used
    assert _loaded(tight) == {smol, "gemma"}
    status, body = _post(tight, "/v1/embeddings", {"model": "minilm", "input": ["a cat"]})
    assert status == 200, body
    loaded = _loaded(tight)
    assert "minilm" in loaded and "gemma" not in loaded, loaded
    assert "unloaded gemma to make room for minilm" in tight.log_text()
    assert _complete(tight, "gemma") == gemma_alone  # it loads again
    assert "gemma" in _loaded(tight)
    assert _rss(tight) <= budget


def test_a_head_on_another_machine_learns_a_kept_model_it_can_read(
        cluster: Cluster, smollm2_gguf: Path, gemma_gguf: Path) -> None:
    """A node keeps Gemma under an imported name; a head on another machine (another
    SHOAL_HOME) cannot fetch that name's tokenizer and says how to fix it in one line; with
    the same file imported there too, it learns it and serves it through that node."""
    far = cluster.home.parent / "far"
    far.mkdir()
    import_gguf(far, gemma_gguf, "gemma")
    node = cluster.node("far", model=str(smollm2_gguf), runtime="llamacpp", lanes=1,
                        extra=("--serve-kept", "--max-context", "1024"),
                        env={**cluster.env, "SHOAL_HOME": str(far)}, ready_timeout=120)
    blind = cluster.head([node], model=str(smollm2_gguf), runtime="llamacpp",
                         ready_timeout=120)
    until_sync(lambda: "a fleet node keeps gemma, which this machine's API cannot serve"
               in blind.log_text(), "the head to say it cannot serve gemma", timeout=30)
    assert "shoal models import FILE --name gemma" in blind.log_text()
    assert "gemma" not in {m["id"] for m in _get(blind, "/v1/models")["data"]}
    blind.stop()

    import_gguf(cluster.home, gemma_gguf, "gemma")
    head = cluster.head([node], model=str(smollm2_gguf), runtime="llamacpp",
                        ready_timeout=120)
    until_sync(lambda: "gemma" in {m["id"] for m in _get(head, "/v1/models")["data"]},
               "the head to learn gemma from its own copy", timeout=30)
    assert _complete(head, "gemma").strip()
    assert "gemma" in _loaded(head)


async def test_serve_too_keeps_a_file_here_and_serves_it_beside_the_first(
        tmp_path: Path, smollm2_gguf: Path, gemma_gguf: Path) -> None:
    """`Shoal.serve_too` (the app's "serve it too"): a GGUF elsewhere is imported into the
    models kept here and served at once beside the first model, loaded by its first
    request, and the node serves every kept model from then on (its next start too)."""
    from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings
    from tests.integration.test_service import chat, ready, running

    settings = Settings(home=tmp_path / "home", discovery=DiscoverySettings(mode="none"),
                        head=HeadSettings(http="127.0.0.1:0"),
                        node=NodeSettings(model=str(smollm2_gguf), runtime="llamacpp",
                                          lanes=1, gpu="off", max_context=1024))
    name = "gemma-3-270m-q4_k_m"
    async with running(settings) as shoal:
        await ready(shoal)
        line = await shoal.serve_too(str(gemma_gguf))
        assert line == f"this machine serves {name} too; it loads on the first request for it"
        node = shoal.snapshot().roles.node
        assert node is not None and [(k.name, k.state) for k in node.kept] == \
            [(name, "unloaded")]
        assert shoal.settings.node is not None and shoal.settings.node.serve_kept
        assert name in {m.name for m in await shoal.models.kept()}
        status, body = await chat(shoal, path="/v1/completions", model=name,
                                  prompt=PROMPT, messages=None, temperature=0)
        assert status == 200 and body["model"] == name, body
        node = shoal.snapshot().roles.node
        assert node is not None and node.kept[0].state == "loaded"
        assert await shoal.serve_too(str(gemma_gguf)) == f"this machine serves {name} already"

"""`shoal models serve MODEL --split laptop,desk` forms a real split (issue 33): the hub
unreachable for every machine, the desk lends part of its memory and keeps Gemma 3 270M
in its hub cache, the laptop is a node that takes the models its heads choose, and a head
dials both. The command asks the laptop, which takes the model's bytes from the desk over
the fleet's link (never from the hub), then serves it with its last layers on the desk;
its greedy answer through the head equals the model's whole on the laptop before, with
the same CPU kernels (``SHOAL_LLAMA_REPACK=0``). Real processes on loopback, real
llama.cpp.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import gemma_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.integration.conftest import SHOAL, Cluster, Proc
from tests.integration.test_model_from_peer import NOWHERE, keep_as_pulled, sha256_of
from tests.waiting import until_sync

pytestmark = [pytest.mark.processes, pytest.mark.e2e]

HUB_ID = "bench/Gemma-GGUF"
SPEC = f"{HUB_ID}:Q4_K_M"
PROMPT = "The history of the printing press begins"
MAX_TOKENS = 16


def greedy(head: Proc, model: str) -> str:
    req = urllib.request.Request(
        f"http://{head.address}/v1/completions",
        json.dumps({"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "temperature": 0}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = json.loads(r.read())
    assert body["usage"]["completion_tokens"] == MAX_TOKENS, body
    return str(body["choices"][0]["text"])


def node_row(head: Proc, identity: str) -> dict:
    with urllib.request.urlopen(f"http://{head.address}/v1/fleet", timeout=30) as r:
        nodes = json.loads(r.read())["nodes"]
    return next((n for n in nodes if n["identity"] == identity), {})


def test_models_serve_split_forms_the_split_with_the_files_from_the_lender(
        cluster: Cluster, gemma_gguf: Path) -> None:  # noqa: F811
    desk_env = cluster.machine("desk", HF_ENDPOINT=NOWHERE)
    keep_as_pulled(Path(desk_env["SHOAL_HOME"]), gemma_gguf, sha256_of(gemma_gguf),
                   hub_id=HUB_ID, file="gemma-3-270m-Q4_K_M.gguf")
    # the desk lends less memory than the model takes: the laptop keeps some layers
    desk = cluster.node("desk", extra=("--lend", "--memory-budget", "300M"), env=desk_env)
    # the laptop serves the model's file whole first: the answer the split must give
    laptop = cluster.node("laptop", model=str(gemma_gguf), runtime="llamacpp", lanes=1,
                          env=cluster.machine("laptop", HF_ENDPOINT=NOWHERE,
                                              SHOAL_LLAMA_REPACK="0"),
                          ready_timeout=120)
    # the head runs on the desk beside its node (its API reads tokenizers from the desk's
    # models), dialing both machines' nodes
    head = cluster.head([laptop, desk], model=str(gemma_gguf), runtime="llamacpp",
                        env=desk_env, ready_timeout=120)
    until_sync(lambda: node_row(head, "laptop").get("state") == "ready"
               and node_row(head, "desk").get("lend_bytes", 0) > 0,
               "both nodes ready at the head, the desk lending", timeout=60)
    whole = greedy(head, gemma_gguf.stem)

    out = subprocess.run([*SHOAL, "models", "serve", SPEC, "--split", "laptop,desk",
                          "--head", head.address], env=desk_env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"laptop: pulling {SPEC}; this node serves it split with "
                                 f"{desk.address} once it is loaded"), out.stdout

    # the split formed: the laptop serves the model, its last layers on the desk's memory
    def formed() -> dict | None:
        assert "could not serve" not in laptop.log_text(), laptop.log_text()
        n = node_row(head, "laptop")
        return n if n.get("model") == SPEC and n["state"] == "ready" \
            and n["device"].startswith("desk (") else None

    row = until_sync(formed, "the laptop serving the model split", timeout=120)
    assert row["device"].startswith(f"desk ({desk.address}, ") and \
        row["device"].endswith(" lent over the fleet's link)"), row["device"]
    assert 0 < row["gpu_layers"] < row["model_layers"]
    # its bytes came from the desk over the link; the laptop never asked the hub
    log = laptop.log_text()
    assert f"from desk ({desk.address}), a machine of the fleet" in log, log
    assert not re.search(r"(?i)hugging face hub|hub unreachable", log), log

    assert greedy(head, SPEC) == whole


def test_serve_split_with_a_lender_takes_the_model_from_it(
        cluster: Cluster, gemma_gguf: Path) -> None:  # noqa: F811
    """`shoal serve org/repo:Q --split-with desk`: the machine it splits with keeps the
    model, and the pull takes it from there, the hub unreachable."""
    desk_env = cluster.machine("desk", HF_ENDPOINT=NOWHERE)
    keep_as_pulled(Path(desk_env["SHOAL_HOME"]), gemma_gguf, sha256_of(gemma_gguf),
                   hub_id=HUB_ID, file="gemma-3-270m-Q4_K_M.gguf")
    desk = cluster.node("desk", extra=("--lend", "--memory-budget", "300M"), env=desk_env)
    laptop = cluster.head([], model=SPEC, runtime="llamacpp", ready_timeout=120,
                          extra=("--split-with", desk.address, "--max-batch", "1"),
                          env=cluster.machine("laptop", HF_ENDPOINT=NOWHERE))
    log = laptop.log_text()
    assert f"from desk ({desk.address}), a machine of the fleet" in log, log
    assert f"its last layers run on memory desk ({desk.address}) lends: " in log, log
    assert greedy(laptop, SPEC)

"""Two node processes, each keeping a different model besides the one they serve first
(`--serve-kept`, a model imported into each one's store), and a head that serves only the
first: it learns the kept models as the nodes say them, a request for one goes to the
node that keeps it, loads it there, and its stats then say it is loaded; the shared first
model goes to either. Mock runtime: the routing is
the head's, the loading the node's shelf, and neither depends on what the model says.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine.models.store import import_gguf, set_keep_alive
from tests.e2e.conftest import smollm2_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.integration.conftest import Cluster, Proc
from tests.waiting import until_sync

pytestmark = [pytest.mark.processes, pytest.mark.quick]

def _complete(head: Proc, model: str) -> tuple[int, str, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://{head.address}/v1/completions",
        json.dumps({"model": model, "prompt": "hi", "max_tokens": 3}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.headers["X-Shoal-Node"], json.loads(r.read())


def _ps(head: Proc) -> dict[str, str]:
    with urllib.request.urlopen(f"http://{head.address}/api/ps", timeout=30) as r:
        return {m["name"]: m["shoal"]["node"] for m in json.loads(r.read())["models"]}


def _home(cluster: Cluster, name: str, kept: str, gguf: Path,
          idle_s: float | None = None) -> dict[str, str]:
    home = cluster.home.parent / name
    home.mkdir()
    import_gguf(home, gguf, kept)
    if idle_s is not None:  # its owner's idle time for it (`shoal models keep-alive`)
        set_keep_alive(home, kept, idle_s)
    return {**cluster.env, "SHOAL_HOME": str(home)}


def test_the_head_routes_each_kept_model_to_the_node_that_keeps_it(
        cluster: Cluster, smollm2_gguf: Path) -> None:  # noqa: F811
    # any whole GGUF serves as the kept file: the mock runtime does not read it
    one = cluster.node("one", model="mock-a", lanes=2, extra=("--serve-kept",),
                       env=_home(cluster, "home-one", "mock-b", smollm2_gguf))
    two = cluster.node("two", model="mock-a", lanes=2, extra=("--serve-kept",),
                       env=_home(cluster, "home-two", "mock-c", smollm2_gguf, idle_s=0.0))
    head = cluster.head([one, two], model="mock-a")
    until_sync(lambda: {"mock-b", "mock-c"} <= set(_listed(head)),
               "the head to learn and list both kept models", timeout=20)
    assert _listed(head)["mock-b"] is False  # kept on a disk, not loaded yet

    for model, node in [("mock-b", "one"), ("mock-c", "two"), ("mock-b", "one")]:
        status, served_by, body = _complete(head, model)
        assert status == 200 and served_by == node and body["model"] == model, body
    until_sync(lambda: _ps(head).get("mock-b") == "one",
               "node one's stats to say its kept model is loaded", timeout=20)
    assert _listed(head)["mock-b"] is True
    # node two's owner set mock-c to unload after each request: it did, the next one
    # loads it again there
    until_sync(lambda: "mock-c" not in _ps(head) and _listed(head)["mock-c"] is False,
               "mock-c unloaded after its request, as its idle time says", timeout=20)
    assert _complete(head, "mock-c")[1] == "two"
    assert {_complete(head, "mock-a")[1] for _ in range(6)} <= {"one", "two"}


def _listed(head: Proc) -> dict[str, bool]:
    with urllib.request.urlopen(f"http://{head.address}/v1/models", timeout=30) as r:
        return {m["id"]: m.get("loaded", False) for m in json.loads(r.read())["data"]}

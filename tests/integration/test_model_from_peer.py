"""A model's files taken from a machine of the fleet, the hub unreachable: a head started
on a hub id that the node it dials (``--fleet``) keeps pulls the files from that node over
the fleet's encrypted link, checked against the sha256 the node's own pull checked, and
serves the model through it; from a node whose copy has one byte changed, nothing is kept
and the head says why in one line. Real processes on loopback, real llama.cpp (SmolLM2).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from engine.models import ids
from tests.e2e.conftest import smollm2_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.integration.conftest import SHOAL, Cluster

pytestmark = [pytest.mark.processes, pytest.mark.e2e]

REPO = "peer-org/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMMIT = "c0ffee" + "0" * 34
NOWHERE = "http://127.0.0.1:9"  # the hub: nothing listens there


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def keep_as_pulled(home: Path, gguf: Path, sha: str, *, flip_at: int | None = None,
                   hub_id: str = REPO, file: str = FILE) -> Path:
    """``gguf`` in ``home``'s hub cache as a pull of the repo ``hub_id`` leaves it, named
    ``file`` there (a blob named by the hub's sha256, a snapshot link, refs/main);
    ``flip_at``: one byte changed there since."""
    repo = ids.models_dir(home) / "hub" / ("models--" + hub_id.replace("/", "--"))
    blob = repo / "blobs" / sha
    blob.parent.mkdir(parents=True)
    shutil.copyfile(gguf, blob)
    if flip_at is not None:
        with blob.open("r+b") as f:
            f.seek(flip_at)
            byte = f.read(1)
            f.seek(flip_at)
            f.write(bytes([byte[0] ^ 0xFF]))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    link = repo / "snapshots" / COMMIT / file
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return blob


def test_a_head_takes_its_model_from_a_node_of_the_fleet_with_the_hub_unreachable(
        cluster: Cluster, smollm2_gguf: Path) -> None:  # noqa: F811
    sha = sha256_of(smollm2_gguf)
    desk = cluster.machine("desk", HF_ENDPOINT=NOWHERE)
    laptop = cluster.machine("laptop", HF_ENDPOINT=NOWHERE)
    keep_as_pulled(Path(desk["SHOAL_HOME"]), smollm2_gguf, sha)
    node = cluster.node("desk", model=f"{REPO}:Q4_1", runtime="llamacpp", lanes=1,
                        extra=("--offline",), env=desk, ready_timeout=60)
    head = cluster.head([node], model=f"{REPO}:Q4_1", runtime="llamacpp", env=laptop,
                        ready_timeout=120)

    blob = ids.models_dir(Path(laptop["SHOAL_HOME"])) / "hub" / (
        "models--" + REPO.replace("/", "--")) / "blobs" / sha
    assert blob.is_file() and sha256_of(blob) == sha
    assert f"from desk (127.0.0.1:{node.port}), a machine of the fleet" in head.log_text()
    req = urllib.request.Request(
        f"http://{head.address}/v1/completions",
        json.dumps({"model": f"{REPO}:Q4_1", "prompt": "The capital of France is",
                    "max_tokens": 4, "temperature": 0}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.headers["X-Shoal-Node"] == "desk"
        assert json.loads(r.read())["usage"]["completion_tokens"] >= 1


def test_a_copy_with_a_byte_changed_is_refused_and_nothing_kept(
        cluster: Cluster, smollm2_gguf: Path) -> None:  # noqa: F811
    sha = sha256_of(smollm2_gguf)
    desk = cluster.machine("desk", HF_ENDPOINT=NOWHERE)
    laptop = cluster.machine("laptop", HF_ENDPOINT=NOWHERE)
    keep_as_pulled(Path(desk["SHOAL_HOME"]), smollm2_gguf, sha, flip_at=1_000_000)
    # the mock runtime serves there: handing out files does not need the model loaded
    node = cluster.node("desk", env=desk)
    out = subprocess.run([*SHOAL, "serve", f"{REPO}:Q4_1", "--runtime", "llamacpp",
                          "--fleet", node.address, "--http", "127.0.0.1:0"],
                         env=laptop, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert f"{REPO}/{FILE} from desk (127.0.0.1:{node.port}), a machine of the fleet came " \
           f"out with sha256 " in last, out.stderr
    assert f"the hub says {sha[:12]}…; its copy there is damaged" in last
    hub = ids.models_dir(Path(laptop["SHOAL_HOME"])) / "hub"
    assert not list(hub.rglob(sha)), "nothing of the damaged copy is kept"
    assert not list((Path(laptop["SHOAL_HOME"]) / "downloads").glob("*.part"))

"""Every benchmark under scripts/bench/ in its smoke mode, as a process: a run of seconds
whose figures the script checks itself (exit 1 otherwise) and prints on one line
(scripts/bench/smoke.py), read back here. A benchmark that nobody runs for months still
fails here the day an engine change breaks it.

Each test needs what its benchmark needs, and is marked as the suite marks that: the real
model (e2e), llama-server (the ``llama_server_binary`` fixture), the pinned agents
(``agent_binaries``), the app (ui). The GPU benchmark runs on Mesa's lavapipe where the
Vulkan backend and its llama-server are built, and is skipped, with the reason, elsewhere;
the installer's runs on a build already made (it never builds one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.models.embedded import ensure_embedded_default, ensure_test_gemma
from tests.e2e.conftest import CACHE
from tests.minilm import ensure_minilm_gguf

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"
MARK = "smoke: "
HELPERS = {"smoke", "node_memory_runner"}  # not benchmarks: used by them
GRACE_S = 20.0  # after an interrupt, for the benchmark to stop what it started


def smoke(script: str, *extra: str | Path, timeout: float) -> dict[str, Any]:
    """``scripts/bench/<script> --smoke`` as a process of its own session; the figures it
    printed on its ``smoke: ok`` line. Past ``timeout`` it is interrupted (its cleanups
    run: it stops the processes it started), then killed."""
    proc = subprocess.Popen([sys.executable, str(BENCH / script), "--smoke", *map(str, extra)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{script} --smoke took over {timeout:.0f} s:\n{out[-3000:]}")
    said = [line for line in out.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and said and said[-1].startswith(MARK + "ok "), \
        f"{script} --smoke exited {proc.returncode}:\n{out[-3000:]}"
    figures: dict[str, Any] = json.loads(said[-1].removeprefix(MARK + "ok "))
    return figures


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return ensure_embedded_default(CACHE / "home")


@pytest.fixture(scope="session")
def gemma() -> Path:
    return ensure_test_gemma(CACHE / "home")


@pytest.fixture(scope="session")
def minilm() -> Path:
    return ensure_minilm_gguf(CACHE)


def test_every_benchmark_has_a_smoke_test() -> None:
    benchmarks = {p.stem for p in BENCH.glob("*.py")} - HELPERS
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert benchmarks <= tested, f"no smoke test here for {sorted(benchmarks - tested)}"
    assert all("--smoke" in (BENCH / f"{b}.py").read_text() for b in benchmarks)


# -- the mock runtime and the placement model: every machine --------------------------


def test_placement_study() -> None:
    got = smoke("placement_study.py", timeout=60)
    assert all(n > 0 for n in got["requests"].values())
    assert got["round_robin_over_load_aware"] > 0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fleet_scale() -> None:
    got = smoke("fleet_scale.py", timeout=120)
    assert got["streams_run"] > 0 and got["failures"] == 0
    assert got["lost"] == got["duplicated"] == 0 and got["moves"] == 0
    assert got["latency_samples"] > 0  # the nodes' stamps met the tokens the client read


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_head_overhead() -> None:
    got = smoke("head_overhead.py", timeout=120)
    assert got["ratio"] and all(r > 0 for r in got["ratio"])
    assert set(got["route_tok_s"]) == {f"{c} {r}" for c in (1, 2)
                                       for r in ("chat", "messages", "responses")}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_discovery() -> None:
    got = smoke("discovery.py", timeout=120)
    assert got["runs"] == got["ok"] == 1 and not got["pin_broken"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agents(agent_binaries: dict[str, Path]) -> None:
    got = smoke("agents.py", timeout=200)
    assert [s["status"] for s in got["sessions"]] == [200, 200]
    assert got["ratio"] > 0


# -- the real model -------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_node(llama_server_binary: Path, smollm2: Path, tmp_path: Path) -> None:
    got = smoke("engine_node.py", "--llama-server", llama_server_binary, "--head-model",
                smollm2, "--cache", tmp_path, timeout=200)
    assert got["ratio"] and all(r > 0 for r in got["ratio"])
    assert not any(got["failed"]) and not got["turn_failed"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_node_lanes(llama_server_binary: Path, smollm2: Path, tmp_path: Path) -> None:
    got = smoke("node_lanes.py", "--llama-server", llama_server_binary, "--model", smollm2,
                "--cache", tmp_path, timeout=200)
    assert got["tps_ratio"] and all(r > 0 for r in got["tps_ratio"])
    assert min(got["cached_second_turn"]) > 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_models_on_demand(llama_server_binary: Path, minilm: Path, smollm2: Path,
                          gemma: Path, tmp_path: Path) -> None:
    got = smoke("models_on_demand.py", "--llama-server", llama_server_binary, "--model",
                minilm, "--smollm2", smollm2, "--gemma", gemma, "--cache", tmp_path,
                timeout=120)
    assert got["parts"] == ["load", "interleaved", "embeddings", "memory", "estimate"]
    assert all(ours > 0 and theirs > 0 for ours, theirs in got["load.ttft_ms"].values())
    assert min(got["interleaved.tokens_per_s"].values()) > 0
    assert all(ours > 0 and theirs > 0 for ours, theirs in got["embeddings.inputs_per_s"].values())
    assert got["embeddings.min_cosine"] >= 0.99
    assert min(got["embeddings.rss_mib"].values()) > 0
    assert min(got["memory.rss_mib"].values()) > 0
    assert min(got["estimate.ratio"].values()) > 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_node_memory(llama_server_binary: Path, smollm2: Path, gemma: Path,
                     tmp_path: Path) -> None:
    got = smoke("node_memory.py", "--llama-server", llama_server_binary, "--model", smollm2,
                "--gemma", gemma, "--cache", tmp_path, timeout=380)
    assert all(cells > 0 for _, cells, _ in got["pools"])
    assert got["gemma_window"] > 0 and min(got["from_host"]) > 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_split(llama_server_binary: Path, gemma: Path) -> None:
    got = smoke("split.py", "--llama-server", llama_server_binary, "--model", gemma,
                timeout=260)
    assert got["layers"] > 0 and got["same_text"]
    assert min(got["tps1"].values()) > 0 and min(got["tps4"].values()) > 0
    assert min(got["copy_mb_s"]) > 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_capacity(gemma: Path) -> None:
    got = smoke("capacity.py", timeout=200)
    assert got["ran_to_window_end"] and got["second_session_refused"]
    assert got["prefill_tps"] > 0


def _lavapipe_server() -> tuple[Path | None, str]:
    """The Vulkan llama-server to compare with, or why the GPU smoke cannot run here."""
    from engine.runtimes.gpu import vulkan_library
    from scripts.lib import vulkan_backend as vb

    icds = ("/usr/share/vulkan/icd.d/lvp_icd.x86_64.json",
            "/usr/share/vulkan/icd.d/lvp_icd.aarch64.json")
    if vulkan_library() is None or not any(os.path.exists(p) for p in icds):
        return None, ("needs llama.cpp's Vulkan backend in .venv and Mesa's lavapipe "
                      "(scripts/test installs both)")
    server = vb.server_path()
    if not vb.works(server):
        return None, ("needs the Vulkan llama-server, built once by .venv/bin/python "
                      "scripts/lib/vulkan_backend.py --server (minutes)")
    return server, ""


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_gpu(smollm2: Path, tmp_path: Path) -> None:
    server, why = _lavapipe_server()
    if server is None:
        pytest.skip(why)
    # lavapipe compiles the shaders at start and at their first use: about two minutes,
    # where the other smoke runs take seconds
    got = smoke("gpu.py", "--device", "0", "--llama-server", server, "--model", smollm2,
                "--cache", tmp_path, timeout=380)
    assert got["device"] and all(r > 0 for pair in got["ratios"] for r in pair)


# -- the app: Qt, under Xvfb with a tray where there is one, else offscreen -----------------


@pytest.mark.ui
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_app(smollm2: Path) -> None:
    got = smoke("app.py", timeout=200)
    assert got["answer"].strip() and got["ticks"] > 0
    assert got["rss_app_over_headless"] > 0


@pytest.mark.ui
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_welcome_model(smollm2: Path) -> None:
    got = smoke("welcome_model.py", timeout=200)
    assert 1 <= len(got["clicks"]) <= 2 and got["pulled_bytes"] > 0
    assert got["answer"].strip()


# -- the installer: a build already made, never built here ---------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_installer() -> None:
    from installers import bundle

    if os.geteuid() != 0:
        pytest.skip("runs the bundle in a network namespace of its own: needs root")
    version = bundle.version()
    dist = ROOT / "dist"
    if not (list(dist.glob(f"shoal_{version}_*.deb"))
            and list(dist.glob(f"shoal-{version}-linux-*.tar.zst"))
            and (ROOT / "build" / "installer" / "dist" / "shoal" / "shoal").is_file()):
        pytest.skip(f"no installer build of {version} in dist/ and build/installer (it takes "
                    "minutes; scripts/build-installer makes one, tests/installer does too)")
    got = smoke("installer.py", timeout=200)
    assert got["serve_first"]["answer"] > 0 and 0 < got["model_share"] < 1

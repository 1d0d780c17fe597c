"""The speed estimate (pure), the slow verdict, the models a machine gets together, and the
bandwidth a machine measures once (no sockets; no assertion on elapsed time)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.models import bandwidth
from engine.models.fit import (
    BASE_BYTES,
    Candidate,
    Machine,
    ModelShape,
    Suggestion,
    estimate,
    suggest_split,
)
from engine.models.speed import (
    AUTOCOMPLETE_TPS,
    CHAT_TPS,
    CPU_EFFICIENCY,
    CPU_LAYER_S,
    GPU_EFFICIENCY,
    GPU_LAYER_S,
    decode_tps,
)
from engine.sizes import GiB, MiB

GB = 1_000_000_000
# weights only (no KV), so that the arithmetic is plain
FLAT = ModelShape(size=GB, layers=24, embedding=2048, kv_bytes_per_token=0, context=8192)
CODER_7B = ModelShape(size=4_683_073_504, layers=28, embedding=3584,
                      kv_bytes_per_token=28 * 2 * 4 * 128 * 2, context=32768)


# --- the estimate ------------------------------------------------------------------------


def test_a_cpu_decodes_at_its_usable_bandwidth_over_the_bytes_a_token_reads() -> None:
    # a token reads 1 GB at 20 GB/s x the efficiency, and pays each layer's fixed cost
    seconds = 1 / (20 * CPU_EFFICIENCY) + 24 * CPU_LAYER_S
    assert decode_tps(FLAT, mem_bandwidth=20 * GB) == pytest.approx(1 / seconds)


def test_a_tiny_model_is_ruled_by_its_layers_a_large_one_by_its_bytes() -> None:
    tiny = ModelShape(size=100_000_000, layers=30, embedding=576, kv_bytes_per_token=0,
                      context=8192)
    big = ModelShape(size=10 * GB, layers=30, embedding=5120, kv_bytes_per_token=0,
                     context=8192)
    tiny_tps, big_tps = (decode_tps(m, mem_bandwidth=30 * GB) for m in (tiny, big))
    assert tiny_tps is not None and big_tps is not None
    # the bytes alone would make the tiny one 100x faster; its layers' cost keeps it less
    assert big_tps * 20 < tiny_tps < big_tps * 100
    assert big_tps == pytest.approx(30 * CPU_EFFICIENCY / 10, rel=0.02)


def test_layers_on_the_gpu_read_at_its_bandwidth_and_the_rest_at_the_rams() -> None:
    got = decode_tps(FLAT, mem_bandwidth=20 * GB, gpu_bandwidth=500 * GB, gpu_share=0.5)
    seconds = (0.5 / (20 * CPU_EFFICIENCY) + 12 * CPU_LAYER_S
               + 0.5 / (500 * GPU_EFFICIENCY) + 12 * GPU_LAYER_S)
    assert got == pytest.approx(1 / seconds)
    # all on the GPU: the RAM's bandwidth plays no part
    assert decode_tps(FLAT, mem_bandwidth=0, gpu_bandwidth=500 * GB, gpu_share=1.0) == \
        pytest.approx(1 / (1 / (500 * GPU_EFFICIENCY) + 24 * GPU_LAYER_S))


@pytest.mark.parametrize(("mem", "gpu", "share"), [
    (0, 0, 0.0),  # an older node: it measured nothing
    (20 * GB, 0, 0.5),  # a GPU not in the table holds half the layers
    (0, 500 * GB, 0.5),  # the RAM not measured, half the layers in it
])
def test_no_estimate_where_a_bandwidth_it_needs_is_not_known(
        mem: int, gpu: int, share: float) -> None:
    assert decode_tps(FLAT, mem_bandwidth=mem, gpu_bandwidth=gpu, gpu_share=share) is None


def test_a_mixture_of_experts_reads_only_its_active_weights() -> None:
    moe = ModelShape(size=16 * GB, layers=48, embedding=2048, kv_bytes_per_token=0,
                     context=8192, active_size=2 * GB)
    dense = replace(moe, active_size=0)
    moe_tps, dense_tps = (decode_tps(m, mem_bandwidth=20 * GB) for m in (moe, dense))
    assert moe_tps == pytest.approx(1 / (2 / (20 * CPU_EFFICIENCY) + 48 * CPU_LAYER_S))
    assert dense_tps is not None and moe_tps > 6 * dense_tps


def test_a_longer_context_reads_more_cache_a_token_so_decodes_slower() -> None:
    short = decode_tps(CODER_7B, mem_bandwidth=50 * GB, context=1024)
    long = decode_tps(CODER_7B, mem_bandwidth=50 * GB, context=32768)
    assert short is not None and long is not None and long < short * 0.9


# --- the fit carries it ----------------------------------------------------------------


def test_the_fit_shows_the_estimate_beside_the_memory_verdict() -> None:
    fit = estimate(CODER_7B, Machine("desk", ram_total=32 * GiB, mem_bandwidth=150 * GB))
    assert fit.verdict == "full" and fit.tps is not None and fit.tps >= CHAT_TPS
    assert fit.line == f"fits with its whole 32K window; ~{fit.tps:.0f} tok/s"
    assert not fit.slow


def test_a_model_that_fits_but_would_be_slow_says_so_in_one_line() -> None:
    fit = estimate(CODER_7B, Machine("vm", ram_total=32 * GiB, mem_bandwidth=10 * GB))
    assert fit.fits and fit.slow and fit.tps is not None and fit.tps < CHAT_TPS
    assert fit.line == (f"fits with its whole 32K window; slow here: ~{fit.tps:.1f} tok/s "
                        "(chat wants 10)")
    assert "\n" not in fit.line


def test_a_machine_that_measured_no_bandwidth_gets_no_estimate() -> None:
    fit = estimate(CODER_7B, Machine("old", ram_total=32 * GiB))
    assert fit.tps is None and not fit.slow and fit.usable(AUTOCOMPLETE_TPS)
    assert fit.line == "fits with its whole 32K window"


def test_an_embeddings_model_needs_one_lanes_window_and_has_no_decode_speed() -> None:
    # a 2K window: eight chat lanes would want a pool of 8 x 4K cells, one lane its 2K
    emb = ModelShape(size=146 * MiB, layers=12, embedding=768,
                     kv_bytes_per_token=12 * 2 * 12 * 64 * 2, context=2048, embeddings=True)
    chat = replace(emb, embeddings=False)
    desk = Machine("desk", ram_total=32 * GiB, mem_bandwidth=20 * GB)
    as_emb, as_chat = estimate(emb, desk), estimate(chat, desk)
    assert as_emb.tps is None and as_chat.tps is not None
    assert as_emb.verdict == as_chat.verdict == "full"
    assert as_emb.ram_bytes < as_chat.ram_bytes


# --- the models a machine gets together --------------------------------------------------


def cand(entry_id: str, shape: ModelShape, *, params_b: float, tools: bool = False,
         fim: bool = False, bits: float = 4.85) -> Candidate:
    return Candidate(entry_id=entry_id, quant="Q4_K_M", spec=f"org/{entry_id}:Q4_K_M",
                     params_b=params_b, tools=tools, fim=fim, bits=bits, shape=shape)


CHAT_14B = cand("chat-14b", ModelShape(8_990_000_000, 48, 5120, 48 * 2 * 4 * 128 * 2, 32768),
                params_b=14.8, tools=True)
CHAT_4B = cand("chat-4b", ModelShape(2_500_000_000, 36, 2560, 36 * 2 * 8 * 128 * 2, 32768),
               params_b=4.0, tools=True)
FIM_1B = cand("fim-1.5b", ModelShape(986_000_000, 28, 1536, 28 * 2 * 2 * 128 * 2, 32768),
              params_b=1.54, fim=True)
EMBED = cand("embed", ModelShape(146_000_000, 12, 768, 12 * 2 * 12 * 64 * 2, 2048,
                                 embeddings=True), params_b=0.137, bits=8.5)
ALL = (CHAT_14B, CHAT_4B, FIM_1B, EMBED)


def test_one_machine_gets_chat_autocomplete_and_embeddings_that_fit_together() -> None:
    desk = Machine("desk", ram_total=32 * GiB, mem_bandwidth=200 * GB)
    got = suggest_split(ALL, [desk])
    assert [(s.candidate.entry_id, s.role) for s in got] == [
        ("chat-14b", "agents"), ("fim-1.5b", "autocomplete"), ("embed", "embeddings")]
    # the process once, then what each model holds beside it: within the budget
    held = BASE_BYTES + sum(s.fit.ram_bytes - BASE_BYTES for s in got)
    assert held <= desk.memory
    assert all(s.fit.usable(AUTOCOMPLETE_TPS if s.role == "autocomplete" else CHAT_TPS)
               for s in got)


def test_the_models_beside_leave_the_main_one_less_room_not_none() -> None:
    # the 14B fits 13 GiB alone with an agent's window, but not beside the other two: the
    # 4B does (the 14B with a smaller window would serve chat, not agents)
    desk = Machine("desk", ram_total=64 * GiB, budget=13 * GiB, mem_bandwidth=200 * GB)
    alone = suggest_split((CHAT_14B,), [desk])
    assert [s.candidate.entry_id for s in alone] == ["chat-14b"]
    together = suggest_split(ALL, [desk])
    assert [s.candidate.entry_id for s in together] == ["chat-4b", "fim-1.5b", "embed"]
    held = BASE_BYTES + sum(s.fit.ram_bytes - BASE_BYTES for s in together)
    assert held <= desk.memory


def test_a_main_model_that_does_fill_in_the_middle_serves_autocomplete_itself() -> None:
    coder = cand("coder-7b", CODER_7B, params_b=7.6, tools=True, fim=True)
    desk = Machine("desk", ram_total=16 * GiB, mem_bandwidth=200 * GB)
    got = suggest_split((coder, FIM_1B, EMBED), [desk])
    assert [(s.candidate.entry_id, s.role, s.also) for s in got] == [
        ("coder-7b", "agents", ("autocomplete",)), ("embed", "embeddings", ())]
    assert got[0].line.startswith("desk: coder-7b Q4_K_M for agents and autocomplete (")


def test_a_slow_machine_gets_the_largest_usable_model_not_the_largest_that_fits() -> None:
    # 80 GB/s at the CPU's efficiency: the 14B (9 GB) would answer at about 5 tok/s, the
    # 4B (2.5 GB) at about 14
    vm = Machine("vm", ram_total=64 * GiB, mem_bandwidth=80 * GB)
    assert estimate(CHAT_14B.shape, vm).slow
    got = suggest_split(ALL, [vm])
    assert got[0].candidate.entry_id == "chat-4b" and got[0].fit.usable(CHAT_TPS)


def test_where_nothing_is_fast_enough_the_suggestion_says_it_is_slow() -> None:
    crawl = Machine("pi", ram_total=64 * GiB, mem_bandwidth=4 * GB)
    got = suggest_split((CHAT_14B, CHAT_4B), [crawl])
    assert [s.candidate.entry_id for s in got] == ["chat-4b"]  # the fastest of the slow
    assert "slow here: ~" in got[0].line and "(chat wants 10)" in got[0].line


def test_an_autocomplete_model_is_judged_by_what_autocomplete_wants() -> None:
    # about 15 tok/s: enough for chat, too slow for autocomplete
    vm = Machine("vm", ram_total=64 * GiB,
                 mem_bandwidth=int(16 * 1.1 * GB / CPU_EFFICIENCY))
    fit = estimate(FIM_1B.shape, vm)
    assert fit.tps is not None and CHAT_TPS <= fit.tps < AUTOCOMPLETE_TPS
    as_chat = Suggestion("vm", FIM_1B, fit, "chat")
    as_auto = Suggestion("vm", FIM_1B, fit, "autocomplete")
    assert as_chat.fit_line == f"fits with its whole 32K window; ~{fit.tps:.0f} tok/s"
    assert as_auto.fit_line == (f"fits with its whole 32K window; slow here: "
                                f"~{fit.tps:.0f} tok/s (autocomplete wants 20)")
    assert as_auto.line == f"vm: fim-1.5b Q4_K_M for autocomplete ({as_auto.fit_line})"


def test_machines_that_measured_nothing_get_the_split_by_memory_alone() -> None:
    desk = Machine("desk", ram_total=32 * GiB)
    got = suggest_split(ALL, [desk])
    assert [s.candidate.entry_id for s in got] == ["chat-14b", "fim-1.5b", "embed"]
    assert all(s.fit.tps is None for s in got)


# --- the bandwidths ------------------------------------------------------------------------


@pytest.mark.parametrize(("description", "kind", "expected"), [
    ("NVIDIA GeForce RTX 4070 Ti SUPER", "gpu", 672 * GB),
    ("NVIDIA GeForce RTX 4070", "gpu", 504 * GB),
    ("NVIDIA A100-SXM4-40GB", "gpu", 1555 * GB),
    ("NVIDIA A10", "gpu", 600 * GB),  # not the A100's
    ("NVIDIA H200", "gpu", 4800 * GB),
    ("Apple M2 Max", "igpu", 400 * GB),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", "gpu", 0),  # a laptop part: not rated here
    ("Some Future GPU", "gpu", 0),
    ("AMD Radeon Graphics (RADV REMBRANDT)", "igpu", 30 * GB),  # reads the RAM
    ("NVIDIA H200", "", 0),  # no GPU used
])
def test_a_gpus_bandwidth_is_known_by_its_name_or_not_at_all(
        description: str, kind: str, expected: int) -> None:
    assert bandwidth.gpu_bandwidth(description, kind, 30 * GB) == expected


def test_the_ram_is_measured_once_per_machine_and_again_on_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def measure() -> int:
        calls.append(1)
        return 12 * GB + len(calls)

    monkeypatch.setattr(bandwidth, "measure_memory_bandwidth", measure)
    monkeypatch.setattr(bandwidth, "machine_key", lambda: "cpu A|2 cpus|8 bytes")
    assert bandwidth.memory_bandwidth(tmp_path) == 12 * GB + 1
    assert bandwidth.memory_bandwidth(tmp_path) == 12 * GB + 1  # kept, not measured
    assert len(calls) == 1
    saved = json.loads((tmp_path / bandwidth.SPEED_FILE).read_text())
    assert saved == {"key": "cpu A|2 cpus|8 bytes", "mem_bandwidth": 12 * GB + 1}
    monkeypatch.setattr(bandwidth, "machine_key", lambda: "cpu B|2 cpus|8 bytes")
    assert bandwidth.memory_bandwidth(tmp_path) == 12 * GB + 2
    assert len(calls) == 2


def test_a_broken_speed_file_is_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bandwidth, "measure_memory_bandwidth", lambda: 7 * GB)
    (tmp_path / bandwidth.SPEED_FILE).write_text('{"key": ')
    assert bandwidth.memory_bandwidth(tmp_path) == 7 * GB


def test_a_real_measurement_gives_a_plausible_figure() -> None:
    # any machine that runs a model reads RAM faster than 1 GB/s and slower than 10 TB/s
    assert 1 * GB < bandwidth.measure_memory_bandwidth() < 10_000 * GB

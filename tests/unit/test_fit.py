"""The fit estimate and the fleet split, table-tested (no files, no sockets)."""

from __future__ import annotations

import pytest

from engine.models.fit import (
    AGENT_WINDOW,
    Candidate,
    Machine,
    ModelShape,
    estimate,
    suggest_split,
    tokens_text,
)
from engine.sizes import GiB, MiB

# Qwen2.5-Coder 7B Instruct at Q4_K_M: 28 layers, 4 KV heads of 128, a 32K window
CODER_7B = ModelShape(size=4_683_073_504, layers=28, embedding=3584,
                      kv_bytes_per_token=28 * 2 * 4 * 128 * 2, context=32768)
# a 32B model at Q4_K_M: 64 layers, 8 KV heads of 128
CODER_32B = ModelShape(size=19_851_336_192, layers=64, embedding=5120,
                       kv_bytes_per_token=64 * 2 * 8 * 128 * 2, context=32768)
SMOL = ModelShape(size=105 * MiB, layers=30, embedding=576,
                  kv_bytes_per_token=30 * 2 * 3 * 64 * 2, context=8192)


@pytest.mark.parametrize(("model", "machine", "verdict", "window", "gpu_layers"), [
    # 16 GiB of RAM lends 8: the 7B and its whole window fit on the CPU
    (CODER_7B, Machine("desk", ram_total=16 * GiB), "full", 32768, 0),
    # 8 GiB lends 4: the weights alone are more
    (CODER_7B, Machine("laptop", ram_total=8 * GiB), "none", 0, 0),
    # a budget that holds the weights and part of the pool: a smaller window
    (CODER_7B, Machine("tight", ram_total=64 * GiB, budget=6 * GiB), "reduced", 22016, 0),
    # a 12 GiB GPU takes every layer and the pool; the RAM budget keeps nothing of them
    (CODER_7B, Machine("gpu", ram_total=8 * GiB, device_kind="gpu", device_total=12 * GiB,
                       device_free=11 * GiB), "full", 32768, 29),
    # a 4 GiB GPU takes part of the layers, the rest stays in a roomy RAM budget
    (CODER_7B, Machine("small-gpu", ram_total=32 * GiB, device_kind="gpu",
                       device_total=4 * GiB, device_free=4 * GiB), "full", 32768, 16),
    # 64 GiB lends 32: the 32B fits whole
    (CODER_32B, Machine("big", ram_total=64 * GiB), "full", 32768, 0),
    (CODER_32B, Machine("desk", ram_total=16 * GiB), "none", 0, 0),
    # a Mac's GPU shares the RAM: all layers on it, all of it still within the budget
    (CODER_7B, Machine("mac", ram_total=16 * GiB, device_kind="igpu", device_total=16 * GiB,
                       device_free=12 * GiB), "full", 32768, 29),
    (SMOL, Machine("pi", ram_total=4 * GiB), "full", 8192, 0),
])
def test_a_model_fits_fully_with_a_smaller_window_or_not_at_all(
        model: ModelShape, machine: Machine, verdict: str, window: int, gpu_layers: int
) -> None:
    fit = estimate(model, machine)
    assert (fit.verdict, fit.window, fit.gpu_layers) == (verdict, window, gpu_layers)
    assert fit.fits == (verdict != "none")


def test_each_verdict_says_in_one_line_what_it_means() -> None:
    assert estimate(CODER_7B, Machine("d", ram_total=16 * GiB)).line == \
        "fits with its whole 32K window"
    reduced = estimate(CODER_7B, Machine("t", ram_total=64 * GiB, budget=6 * GiB))
    assert reduced.line == "fits with a 21.5K window (of 32K)"
    none = estimate(CODER_7B, Machine("l", ram_total=8 * GiB))
    assert none.line == "does not fit: it needs about 4.8 GiB and the budget is 4 GiB"
    gpu = estimate(CODER_7B, Machine("g", ram_total=8 * GiB, device_kind="gpu",
                                     device_total=12 * GiB, device_free=11 * GiB))
    assert gpu.line == "fits with its whole 32K window, all on the GPU" and gpu.on_gpu == "GPU"
    part = estimate(CODER_7B, Machine("s", ram_total=32 * GiB, device_kind="gpu",
                                      device_total=4 * GiB, device_free=4 * GiB))
    assert part.line.endswith(", 16 of 29 layers on the GPU") and part.on_gpu == "16/29 on GPU"
    # a miss by less than the rounding says by how much
    q8 = ModelShape(8_098_525_888, 28, 3584, 57344, 32768)
    assert estimate(q8, Machine("d", ram_total=16 * GiB)).line == \
        "does not fit: it needs about 8.03 GiB and the budget is 8 GiB"


def test_the_disk_a_download_lacks_is_named_unless_the_model_is_already_there() -> None:
    machine = Machine("d", ram_total=16 * GiB, disk_free=2 * GiB)
    fit = estimate(CODER_7B, machine)
    assert fit.disk_short > 2 * GiB and "the disk lacks 2." in fit.line
    assert estimate(CODER_7B, machine, downloaded=True).disk_short == 0


@pytest.mark.parametrize(("n", "text"), [(32768, "32K"), (6144, "6K"), (1536, "1.5K"),
                                          (512, "512")])
def test_windows_read_as_people_write_them(n: int, text: str) -> None:
    assert tokens_text(n) == text


def cand(entry_id: str, shape: ModelShape, *, params_b: float, tools: bool = True,
         fim: bool = False, quant: str = "Q4_K_M", bits: float = 4.85) -> Candidate:
    return Candidate(entry_id=entry_id, quant=quant, spec=f"org/{entry_id}:{quant}",
                     params_b=params_b, tools=tools, fim=fim, bits=bits, shape=shape)


QWEN_32B = cand("coder-32b", CODER_32B, params_b=32.8, fim=True)
QWEN_7B = cand("coder-7b", CODER_7B, params_b=7.6, fim=True)
QWEN_7B_Q8 = cand("coder-7b", ModelShape(8_098_525_888, 28, 3584, 57344, 32768),
                  params_b=7.6, fim=True, quant="Q8_0", bits=8.5)
CHAT_7B_NO_TOOLS = cand("chat-7b", CODER_7B, params_b=7.0, tools=False)
TINY = cand("smol", SMOL, params_b=0.135, tools=False, fim=False)
ALL = (QWEN_32B, QWEN_7B, QWEN_7B_Q8, CHAT_7B_NO_TOOLS, TINY)


def picks(machines: list[Machine], candidates: tuple[Candidate, ...] = ALL
          ) -> list[tuple[str, str, str, str]]:
    return [(s.machine, s.candidate.entry_id, s.candidate.quant, s.role)
            for s in suggest_split(candidates, machines)]


def test_the_largest_machine_serves_the_largest_agent_model_and_the_smallest_autocomplete() -> None:
    fleet = [Machine("laptop", ram_total=16 * GiB), Machine("desk", ram_total=64 * GiB)]
    assert picks(fleet) == [("desk", "coder-32b", "Q4_K_M", "agents"),
                            ("laptop", "coder-7b", "Q4_K_M", "autocomplete")]


def test_machines_between_serve_the_lead_model_where_it_fits_else_the_largest_that_does() -> None:
    fleet = [Machine("a", ram_total=64 * GiB), Machine("b", ram_total=64 * GiB),
             Machine("c", ram_total=32 * GiB), Machine("d", ram_total=16 * GiB)]
    assert picks(fleet) == [("b", "coder-32b", "Q4_K_M", "agents"),
                            ("a", "coder-32b", "Q4_K_M", "agents"),
                            ("c", "coder-7b", "Q8_0", "agents"),
                            ("d", "coder-7b", "Q4_K_M", "autocomplete")]


def test_one_machine_gets_an_agent_model_and_a_small_one_what_fits() -> None:
    # the finest quantisation that fits whole: Q8_0 misses 16 GiB's budget of 8
    assert picks([Machine("desk", ram_total=16 * GiB)]) == [
        ("desk", "coder-7b", "Q4_K_M", "agents")]
    assert picks([Machine("desk", ram_total=32 * GiB)]) == [
        ("desk", "coder-7b", "Q8_0", "agents")]
    # 4 GiB lends 1: only the tiny model, which has no tools, for chat
    assert picks([Machine("pi", ram_total=4 * GiB)]) == [("pi", "smol", "Q4_K_M", "chat")]
    # nothing fits at all: no suggestion rather than a wrong one
    assert picks([Machine("pi", ram_total=4 * GiB)], (QWEN_32B,)) == []


def test_an_agent_model_needs_room_for_an_agents_prompt() -> None:
    # the 7B fits this budget only with a 21.5K window: too little for an agent, so it is
    # suggested for chat only when nothing with tools has room
    tight = Machine("t", ram_total=64 * GiB, budget=6 * GiB)
    got = suggest_split((QWEN_7B,), [tight])
    assert [(s.role, s.fit.verdict, s.fit.window < AGENT_WINDOW) for s in got] == [
        ("chat", "reduced", True)]

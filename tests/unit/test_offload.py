"""Which GPU a node takes and how much of the model goes on it (engine.runtimes.offload),
and the pool the budget gives it then (engine.runtimes.budget): pure, table-tested."""

from __future__ import annotations

import pytest

from engine.runtimes.budget import plan_pool
from engine.runtimes.offload import (
    MIN_POOL_CELLS,
    Device,
    choose_device,
    device_reserve,
    no_offload,
    plan_offload,
    plan_split,
    plan_split_among,
)
from engine.sizes import GiB, MiB

RTX = Device("Vulkan0", "NVIDIA GeForce RTX 4070", "gpu", free=11 * GiB, total=12 * GiB)
IRIS = Device("Vulkan1", "Intel(R) Iris(R) Xe Graphics", "igpu", free=14 * GiB, total=16 * GiB)
SMALL = Device("Vulkan2", "AMD Radeon RX 6400", "gpu", free=3 * GiB, total=4 * GiB)
LVP = Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "gpu", free=2 * GiB, total=2 * GiB)


@pytest.mark.parametrize(("devices", "want", "chosen"), [
    ([RTX, IRIS], "auto", "Vulkan0"),  # a discrete GPU before an integrated one
    ([IRIS, SMALL], "auto", "Vulkan2"),  # even with less free memory
    ([IRIS], "auto", "Vulkan1"),
    ([SMALL, RTX], "auto", "Vulkan0"),  # the discrete one with most free memory
    ([RTX, IRIS], "vulkan1", "Vulkan1"),  # by name, any case
    ([RTX, IRIS], "Iris", "Vulkan1"),  # by a piece of the description
    ([LVP], "llvmpipe", "Vulkan0"),
    ([RTX, IRIS], "off", None),
    ([], "auto", None),
    ([RTX], "", "Vulkan0"),  # empty is auto
])
def test_choose_device(devices: list[Device], want: str, chosen: str | None) -> None:
    choice = choose_device(devices, want)
    assert (choice.device.name if choice.device else None) == chosen
    if chosen is not None:
        assert choice.why.startswith(f"GPU {chosen} (")
    else:
        assert "runs on the CPU" in choice.why


def test_no_gpu_says_why_in_one_line() -> None:
    why = "the Vulkan loader is not installed (apt install libvulkan1)"
    choice = choose_device([], "auto", unavailable=why)
    assert choice.why == f"the GPU is not used: {why}; the model runs on the CPU"
    assert choose_device([RTX], "off").why == (
        "the GPU is not used (--gpu off); the model runs on the CPU")


def test_a_name_that_matches_nothing_runs_on_the_cpu_and_lists_the_devices() -> None:
    choice = choose_device([RTX], "Vulkan7")
    assert choice.device is None
    assert choice.why.startswith("the GPU is not used: --gpu Vulkan7 names no device")
    assert "Vulkan0 (NVIDIA GeForce RTX 4070, 11 GiB free)" in choice.why
    assert choice.why.endswith("the model runs on the CPU")
    gone = choose_device([], "Vulkan0", unavailable="no Vulkan driver")
    assert gone.device is None and "(it lists: no Vulkan driver)" in gone.why


MODEL = 4 * GiB  # a 7B at Q4
PER_TOKEN = 128 * 1024  # KV bytes per token, f16
LAYERS = 32


def _plan(device: Device | None, want_cells: int = 8192, model: int = MODEL):
    return plan_offload(device=device, n_layer=LAYERS, model_bytes=model,
                        kv_bytes_per_token=PER_TOKEN, want_cells=want_cells, overhead=64 * MiB)


def test_a_model_that_fits_goes_whole_and_the_device_caps_the_pool() -> None:
    off = _plan(RTX)
    assert off.full and off.layers == LAYERS + 1 and off.describe() == "all layers"
    usable = RTX.free - device_reserve(RTX, 64 * MiB)
    assert off.max_cells == (usable - MODEL) // PER_TOKEN
    assert (off.ram_weights, off.ram_kv_per_token) == (0, 0)  # a discrete GPU's own memory


def test_an_integrated_gpu_still_counts_in_the_ram_budget() -> None:
    off = _plan(IRIS)
    assert off.full
    assert (off.ram_weights, off.ram_kv_per_token) == (MODEL, PER_TOKEN)


def test_a_model_too_big_for_the_gpu_offloads_the_layers_that_fit_with_their_kv() -> None:
    off = _plan(SMALL)
    assert 0 < off.layers < LAYERS and not off.full
    assert off.describe() == f"{off.layers} of {LAYERS + 1} layers"
    per_layer = MODEL / (LAYERS + 1) + 8192 * PER_TOKEN / LAYERS
    usable = SMALL.free - device_reserve(SMALL, 64 * MiB)
    assert off.layers * per_layer <= usable < (off.layers + 1) * per_layer
    left = LAYERS - off.layers
    assert off.ram_weights == int(MODEL * (left + 1) / (LAYERS + 1))
    assert off.ram_kv_per_token == PER_TOKEN * left // LAYERS
    assert off.max_cells is None


def test_a_device_without_room_for_a_layer_offloads_nothing() -> None:
    tiny = Device("Vulkan0", "old", "gpu", free=300 * MiB, total=512 * MiB)
    off = _plan(tiny)
    assert off.layers == 0 and (off.ram_weights, off.ram_kv_per_token) == (MODEL, PER_TOKEN)


def test_the_whole_model_needs_room_for_a_small_pool_too() -> None:
    reserve = device_reserve(RTX, 64 * MiB)
    exact = Device("Vulkan0", "x", "gpu", free=MODEL + reserve + MIN_POOL_CELLS * PER_TOKEN,
                   total=12 * GiB)
    assert _plan(exact).full
    short = Device("Vulkan0", "x", "gpu", free=exact.free - 1, total=12 * GiB)
    assert not _plan(short).full


def test_no_device_is_no_offload() -> None:
    off = _plan(None)
    assert off == no_offload(LAYERS, MODEL, PER_TOKEN)
    assert off.layers == 0 and off.of == LAYERS + 1


def test_the_pool_on_a_gpu_is_capped_by_it_not_by_ram() -> None:
    """All layers on a discrete GPU: the RAM budget no longer holds the model, and the
    pool is what the device has room for, within the window the node wants."""
    common = dict(budget=2 * GiB, base=300 * MiB, overhead=64 * MiB, lanes=8,
                  n_ctx_train=32768, max_context=None)
    cpu = dict(common, model_bytes=MODEL, kv_bytes_per_token=PER_TOKEN)
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        plan_pool(**cpu)  # type: ignore[arg-type]
    plan = plan_pool(**common, model_bytes=0, kv_bytes_per_token=0,  # type: ignore[arg-type]
                     device_cells=20_000)
    assert plan.cells == 19_968  # the device's room, rounded to llama.cpp's 256
    roomy = plan_pool(**common, model_bytes=0, kv_bytes_per_token=0,  # type: ignore[arg-type]
                      device_cells=10 ** 7)
    assert roomy.cells == 32768  # the node's own want (one window), not the device's room


def test_a_split_puts_as_many_last_layers_as_the_lent_memory_holds_there() -> None:
    # 24 layers and an output layer of 40 MiB each; 1 MiB of KV per 1,024 cells a layer
    model, per_token = 25 * 40 * MiB, 24 * 1024
    split = plan_split(n_layer=24, model_bytes=model, kv_bytes_per_token=per_token,
                       want_cells=1024, lend_bytes=500 * MiB, overhead=80 * MiB)
    # each layer there takes 40 MiB of weights and 1 MiB of pool: 420 MiB hold 10
    assert (split.layers, split.of) == (10, 25)
    assert split.ram_weights == 15 * 40 * MiB  # 14 layers and the output layer stay here
    assert split.ram_kv_per_token == per_token * 14 // 24
    nothing = plan_split(n_layer=24, model_bytes=model, kv_bytes_per_token=per_token,
                         want_cells=1024, lend_bytes=60 * MiB, overhead=80 * MiB)
    assert (nothing.layers, nothing.ram_weights) == (0, model)
    every = plan_split(n_layer=24, model_bytes=model, kv_bytes_per_token=per_token,
                       want_cells=1024, lend_bytes=100_000 * MiB, overhead=80 * MiB)
    assert every.layers == 24 and every.ram_weights == 40 * MiB  # the output layer stays


def test_several_lenders_each_hold_what_their_memory_holds_or_a_share_of_the_model() -> None:
    model, per_token = 25 * 40 * MiB, 24 * 1024
    kw = dict(n_layer=24, model_bytes=model, kv_bytes_per_token=per_token, want_cells=1024,
              overhead=80 * MiB)
    # 420 MiB and 200 MiB past their compute buffers: 10 and 4 layers (41 MiB each)
    split, parts = plan_split_among(lends=(500 * MiB, 280 * MiB, 60 * MiB), **kw)
    assert parts == (10, 4, 0) and split.layers == 14  # one too small to hold a layer
    assert split.ram_weights == 11 * 40 * MiB  # 10 layers and the output layer stay here
    # together they could hold 30 layers of 24: shares in proportion (20:10), 16 + 8
    split, parts = plan_split_among(lends=(80 * MiB + 20 * 41 * MiB, 80 * MiB + 10 * 41 * MiB),
                                    **kw)
    assert parts == (16, 8) and split.layers == 24
    # rounding never gives one more than it holds, and the parts sum to the layers
    split, parts = plan_split_among(lends=(80 * MiB + 13 * 41 * MiB,) * 3, **kw)
    assert sum(parts) == 24 and max(parts) - min(parts) <= 1 and max(parts) <= 13
    assert plan_split_among(lends=(500 * MiB,), **kw)[0] == plan_split(lend_bytes=500 * MiB,
                                                                       **kw)


def test_a_split_weighs_the_repeating_layers_apart_from_the_embeddings_that_stay_here() -> None:
    # Gemma-like: 240 MiB, of which the 18 repeating layers 72 MiB (4 MiB each), the
    # embeddings and output layer the other 168 MiB; no pool to speak of
    model, per_token = 240 * MiB, 1
    kw = dict(n_layer=18, model_bytes=model, kv_bytes_per_token=per_token, want_cells=1,
              overhead=10 * MiB)
    weighed, parts = plan_split_among(lends=(50 * MiB,), block_bytes=72 * MiB, **kw)
    assert parts == (9,)  # 40 MiB past its buffers hold 9 layers of 4 MiB (and a byte)
    assert weighed.ram_weights == 168 * MiB + 9 * 4 * MiB  # the embeddings stay here
    alike, _ = plan_split_among(lends=(50 * MiB,), **kw)  # every layer 240 / 19 MiB
    assert alike.layers == 3 and alike.ram_weights == model * 16 // 19

"""`Shoal.update_settings` for how the node holds its model (memory budget, KV type, GPU,
idle unload): checked first with the fix in one line, then kept for the node's next start."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import CommandError
from engine.service import Shoal
from engine.settings import NodeSettings, Settings
from engine.sizes import GiB, MiB, Share


async def test_nothing_running_takes_them_at_once(tmp_path: Path) -> None:
    shoal = Shoal(Settings(home=tmp_path, node=NodeSettings(lanes=4)))
    try:
        change = await shoal.update_settings(memory_budget=8 * GiB, kv_type="q8_0",
                                             idle_unload_s=0)
        assert not change.restart_needed  # the next open starts with them
        node = shoal.settings.node
        assert node is not None and node.lanes == 4
        assert (node.memory_budget, node.kv_type, node.idle_unload_s) == (8 * GiB, "q8_0", None)
        await shoal.update_settings(memory_budget=0, idle_unload_s=300)
        node = shoal.pending.node
        assert node is not None
        assert (node.memory_budget, node.kv_type, node.idle_unload_s) == (None, "q8_0", 300.0)
        await shoal.update_settings(memory_budget=Share(25.0))
        assert shoal.pending.node is not None
        assert shoal.pending.node.memory_budget == Share(25.0)
        await shoal.update_settings(gpu=" Vulkan1 ")
        node = shoal.pending.node
        assert node is not None and (node.gpu, node.kv_type) == ("Vulkan1", "q8_0")
        await shoal.update_settings(kv_type="f16")  # the GPU stays as chosen
        assert shoal.pending.node is not None and shoal.pending.node.gpu == "Vulkan1"
    finally:
        await shoal.stop(drain=0)


@pytest.mark.parametrize(("change", "line"), [
    ({"memory_budget": 100 * MiB}, "a memory budget of 100 MiB cannot hold a model and its "
     "KV cache; give at least 256M"),
    ({"memory_budget": -1}, "give at least 256M"),
    ({"memory_budget": Share(0.000001)}, "too little for a model and its KV cache"),
    ({"memory_budget": True}, "the memory budget is a number of bytes or a share"),
    ({"memory_budget": "6G"}, "the memory budget is a number of bytes or a share"),
    ({"kv_type": "q4_0"}, "the KV cache is f16 or q8_0, not 'q4_0'"),
    ({"gpu": ""}, "the GPU choice '' is not valid; give auto, off (CPU only) or a device name "
     "such as Vulkan0 (1-64 printable characters)"),
    ({"gpu": "x" * 65}, "give auto, off (CPU only) or a device name"),
    ({"gpu": 0}, "the GPU choice 0 is not valid"),
    ({"idle_unload_s": -60}, "the model unloads after 0 (never) to 10080 minutes idle"),
    ({"idle_unload_s": 10_080 * 60 + 1}, "0 (never) to 10080 minutes"),
    ({"idle_unload_s": float("nan")}, "0 (never) to 10080 minutes"),
])
async def test_a_wrong_value_is_refused_with_the_fix(tmp_path: Path, change: dict,
                                                     line: str) -> None:
    shoal = Shoal(Settings(home=tmp_path, node=NodeSettings()))
    try:
        with pytest.raises(CommandError) as err:
            await shoal.update_settings(**change)
        assert line in str(err.value) and err.value.code == "bad_setting"
        assert shoal.pending.node == NodeSettings()  # nothing changed
    finally:
        await shoal.stop(drain=0)


async def test_without_a_node_there_is_nothing_to_hold_a_model(tmp_path: Path) -> None:
    shoal = Shoal(Settings(home=tmp_path))
    try:
        with pytest.raises(CommandError) as err:
            await shoal.update_settings(kv_type="q8_0")
        assert err.value.code == "no_node"
        assert str(err.value) == "this machine serves no model; choose one to serve first"
    finally:
        await shoal.stop(drain=0)


def test_this_machines_memory_and_the_default_share(tmp_path: Path) -> None:
    from engine.runtimes.budget import default_budget_bytes, total_memory_bytes

    mem = Shoal(Settings(home=tmp_path)).memory
    assert mem.total == total_memory_bytes() > 0
    assert mem.default_budget == default_budget_bytes(mem.total) < mem.total

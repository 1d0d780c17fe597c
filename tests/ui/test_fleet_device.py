"""The Fleet page says, per node, which device its model runs on and how much of the model
is there, from the snapshot alone (issue 24): a user sees which machine is the fast one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.bridge import ShoalBridge
from app.pages.fleet import NODE_COLUMNS, FleetPage
from tests.ui.test_tray_view import node, snap

pytestmark = pytest.mark.timeout(60)
GPU = "Vulkan0 (NVIDIA GeForce RTX 4070)"


async def test_each_node_shows_the_device_its_model_runs_on(bridge: ShoalBridge) -> None:
    page = FleetPage(bridge)
    try:
        page.render(snap(replace(node("desk"), device=GPU, gpu_layers=31, model_layers=31),
                         replace(node("laptop"), device=GPU, gpu_layers=20,
                                 model_layers=31),
                         replace(node("pi"), model_layers=31)))
        rows = {page.nodes.key_at(r): r for r in range(page.nodes.rowCount())}
        desk, laptop, pi = (rows[k] for k in ("desk", "laptop", "pi"))
        assert page.nodes.text(desk, "Device") == f"{GPU}: all 31 layers"
        assert page.nodes.text(laptop, "Device") == f"{GPU}: 20 of 31 layers"
        assert page.nodes.text(pi, "Device") == "CPU"
        column = NODE_COLUMNS.index("Device")
        assert page.nodes.rows[laptop][column].tip == f"{GPU}\n20 of 31 layers on the GPU"
        assert page.nodes.rows[desk][column].tip == f"{GPU}\n31 of 31 layers on the GPU"
        assert page.nodes.rows[pi][column].tip == "The model runs on the CPU."
        # the columns beside it still hold what they did
        assert page.nodes.text(desk, "Runtime") == "mock"
        assert page.nodes.text(desk, "Context") == "4k"

        # a split model: its last layers on the memory another machine lends
        lent = "desk (192.168.1.20:8455, 300 MiB lent over the fleet's link)"
        page.render(snap(replace(node("laptop"), device=lent, gpu_layers=13, model_layers=19)))
        assert page.nodes.text(0, "Device") == f"{lent}: 13 of 19 layers"
        assert page.nodes.rows[0][column].tip == (
            f"{lent}\n13 of 19 layers there (memory another machine lends)")

        page.render(snap(replace(node("desk"), model_layers=31)))  # the node moved to its CPU
        assert page.nodes.text(0, "Device") == "CPU"
    finally:
        page.deleteLater()

"""A node says which device its model runs on and how many of its layers are there (issue
24): the Stats record that carries it, with peers on either side of the change, how people
read it, and Ollama's ``size_vram`` made of it."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from engine.api.ollama import size_vram
from engine.link import messages as m
from engine.node.agent import NodeAgent
from engine.runtimes.base import EngineStats
from engine.runtimes.mock import MockEngine
from engine.snapshot import NodeSnapshot, offload_text

GPU = "Vulkan0 (NVIDIA GeForce RTX 4070)"
# the Stats fields an older node sends: everything up to the prompt token counts
OLD_STATS = ["stats", 4, 1, 100, 4096, [0.0, 0.0, 0.0, 0.0, 0.0], 1, 2, 0, 3000, 0, 0, "",
             5, 6, 7]


def test_stats_carry_the_device_and_its_layers() -> None:
    sent = m.Stats(lanes=4, lanes_busy=1, kv_used=100, kv_total=4096, device=GPU,
                   gpu_layers=20, model_layers=31)
    got = m.decode(m.encode(sent))
    assert got == sent
    assert isinstance(got, m.Stats)
    assert (got.device, got.gpu_layers, got.model_layers) == (GPU, 20, 31)


def test_an_older_nodes_stats_read_as_the_cpu() -> None:
    got = m.decode(m._encoder.encode(OLD_STATS))
    assert isinstance(got, m.Stats)
    assert got.prompt_prefilled == 7  # its own fields where they were
    assert (got.device, got.gpu_layers, got.model_layers) == ("", 0, 0)


def test_an_older_head_reads_a_newer_nodes_stats() -> None:
    class OldStats(msgspec.Struct, frozen=True, array_like=True, tag="stats", tag_field="t"):
        lanes: int
        lanes_busy: int
        kv_used: int
        kv_total: int

    sent = m.Stats(lanes=4, lanes_busy=1, kv_used=100, kv_total=4096, device=GPU,
                   gpu_layers=31, model_layers=31)
    old = msgspec.msgpack.Decoder(OldStats).decode(m.encode(sent))
    assert (old.lanes, old.lanes_busy, old.kv_used, old.kv_total) == (4, 1, 100, 4096)


def test_a_device_name_past_the_bound_is_refused() -> None:
    fits = [*OLD_STATS, "x" * m.MAX_DEVICE, 1, 2]
    assert m.decode(m._encoder.encode(fits)) == m.Stats(
        lanes=4, lanes_busy=1, kv_used=100, kv_total=4096, sessions=1, peak_busy=2,
        max_prompt=3000, prompt_from_lanes=5, prompt_from_host=6, prompt_prefilled=7,
        device="x" * m.MAX_DEVICE, gpu_layers=1, model_layers=2)
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode([*OLD_STATS, "x" * (m.MAX_DEVICE + 1), 1, 2]))
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode([*OLD_STATS, GPU, -1, 2]))


class DeviceEngine(MockEngine):
    def __init__(self, device: str, gpu_layers: int, model_layers: int) -> None:
        super().__init__(lanes=2)
        self.device = (device, gpu_layers, model_layers)

    def stats(self) -> EngineStats:
        device, gpu, total = self.device
        return dataclasses.replace(super().stats(), device=device, gpu_layers=gpu,
                                   model_layers=total)


@pytest.mark.parametrize(("device", "sent"), [
    (GPU, GPU),
    ("", ""),
    # a name the link would refuse is cut to what it carries, not sent to fail the record
    ("V" * 500, "V" * m.MAX_DEVICE),
])
def test_the_node_reports_what_its_engine_says(device: str, sent: str) -> None:
    agent = NodeAgent(DeviceEngine(device, 20, 31), identity="n", psk=None)
    rec = agent.stats_record()
    assert (rec.device, rec.gpu_layers, rec.model_layers) == (sent, 20, 31)
    assert m.decode(m.encode(rec)) == rec


@pytest.mark.parametrize(("device", "gpu", "total", "text"), [
    ("", 0, 0, "CPU"),
    ("", 0, 31, "CPU"),
    (GPU, 31, 31, f"{GPU}: all 31 layers"),
    (GPU, 40, 31, f"{GPU}: all 31 layers"),  # llama.cpp's "all" asks for more than there are
    (GPU, 20, 31, f"{GPU}: 20 of 31 layers"),
    (GPU, 0, 31, f"{GPU}: 0 of 31 layers"),
    (GPU, 0, 0, GPU),  # a device without a count
])
def test_offload_reads_as_people_say_it(device: str, gpu: int, total: int, text: str) -> None:
    assert offload_text(device, gpu, total) == text


@pytest.mark.parametrize(("device", "gpu", "total", "vram"), [
    ("", 0, 0, 0),
    ("", 31, 31, 0),  # no device: nothing on a GPU, whatever the count says
    (GPU, 31, 31, 3100),
    (GPU, 40, 31, 3100),
    (GPU, 20, 31, 2000),
    (GPU, 0, 31, 0),
    (GPU, 5, 0, 0),  # no count: no share to tell
])
def test_size_vram_is_the_models_share_on_the_gpu(device: str, gpu: int, total: int,
                                                   vram: int) -> None:
    n = NodeSnapshot(key="n", identity="n", address="127.0.0.1:1", link="dialed",
                     state="ready", model="m", runtime="llama.cpp", context_window=4096,
                     lanes=1, lanes_busy=0, own_sessions=0, kv_used=0, kv_total=0,
                     prefill_tps=0, decode_tps=0, ttft_ms=0, last_seen=0, sessions_total=0,
                     peak_busy=0, connections=1, error=None, device=device, gpu_layers=gpu,
                     model_layers=total)
    assert size_vram(3100, n) == vram

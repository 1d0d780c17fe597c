"""The link records of a head choosing a node's model (issue 25): ServeModel and its answer,
the Stats fields a fit estimate needs (RAM, GPU memory, disk free, a pull under way), their
bounds, peers on either side of the change, and what the agent answers and reports."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from engine.link import messages as m
from engine.node.agent import NO_FLEET_MODELS, NodeAgent
from engine.node.machine import DiskFree, MachineFacts, free_bytes
from engine.runtimes.base import EngineStats
from engine.runtimes.mock import MockEngine

GiB = 1 << 30
# the Stats an older node sends: every field up to the device and its layers
OLD_STATS = ["stats", 4, 1, 100, 4096, [0.0, 0.0, 0.0, 0.0, 0.0], 1, 2, 0, 3000, 0, 0, "",
             5, 6, 7, "Vulkan0 (X)", 20, 31]
FACTS = [64 * GiB, "gpu", 12 * GiB, 11 * GiB, 900 * GiB, "acme/Coder-GGUF:Q4_K_M", 10, 20]


def roundtrip(rec: m.Record) -> m.Record:
    return m.decode(m.encode(rec))


@pytest.mark.parametrize("spec", ["acme/Coder-GGUF:Q4_K_M", "bartowski/SmolLM2-135M-Instruct-GGUF",
                                  "a/b", "Org_1/repo.v2-GGUF:IQ4_XS"])
def test_serve_model_carries_a_hub_id(spec: str) -> None:
    rec = m.ServeModel(spec=spec, ask=7)
    assert roundtrip(rec) == rec
    answer = m.ServeModelResult(accepted=True, message=f"pulling {spec}", ask=7)
    assert roundtrip(answer) == answer


@pytest.mark.parametrize("spec", [
    "", "ab", "/etc/passwd", "../models/x.gguf", "~/m.gguf", "acme/repo/file.gguf",
    "acme/repo:Q4 K", "C:\\models\\x.gguf", "acme/ repo", "-x/y", "acme/repo:",
    "acme/" + "r" * m.MAX_SPEC,  # past the bound
])
def test_serve_model_refuses_what_is_no_hub_id(spec: str) -> None:
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode(["serve_model", spec, 1]))


def test_an_answer_past_its_bound_is_refused() -> None:
    fits = ["serve_model_result", False, "x" * m.MAX_ANSWER, 3]
    assert m.decode(m._encoder.encode(fits)) == m.ServeModelResult(
        accepted=False, message="x" * m.MAX_ANSWER, ask=3)
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode(["serve_model_result", False, "x" * (m.MAX_ANSWER + 1), 3]))
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode(["serve_model_result", "yes", "ok", 3]))


def test_the_records_travel_as_channel_records_too() -> None:
    batch = m.Batch(items=[(1, m.ServeModel(spec="a/b:Q8_0", ask=1)),
                           (2, m.ServeModelResult(accepted=True, message="ok", ask=1))])
    assert roundtrip(batch) == batch


def test_stats_carry_what_a_fit_estimate_needs() -> None:
    sent = m.Stats(lanes=4, lanes_busy=0, kv_used=0, kv_total=4096, ram_total=64 * GiB,
                   device_kind="gpu", device_total=12 * GiB, device_free=11 * GiB,
                   disk_free=4 << 40, pull_model="acme/Coder-GGUF:Q4_K_M", pull_done=10,
                   pull_total=20)
    got = roundtrip(sent)
    assert got == sent
    assert isinstance(got, m.Stats) and got.disk_free == 4 << 40  # past 1 TiB: a big disk


def test_an_older_nodes_stats_say_nothing_of_the_machine() -> None:
    got = m.decode(m._encoder.encode(OLD_STATS))
    assert isinstance(got, m.Stats)
    assert got.model_layers == 31  # its own fields where they were
    assert (got.ram_total, got.device_kind, got.disk_free, got.pull_model) == (0, "", 0, "")


def test_the_new_figures_come_after_every_older_field() -> None:
    # an older head reads a newer node's Stats because they only add at the end
    sent = m.decode(m._encoder.encode([*OLD_STATS, *FACTS]))
    paused, serve_failed = False, ""  # added after the facts, as an older node sends none
    mem_bandwidth = gpu_bandwidth = 0  # added after those (issue 32's speed estimate)
    kept: list[object] = []  # then the models it keeps besides its first (issue 32)
    lend_bytes = 0  # then the memory it lends to split models (issue 33)
    listens = 0  # and where a node that joined takes links while it lends
    assert msgspec.msgpack.decode(m.encode(sent)) == [*OLD_STATS, *FACTS, paused,
                                                      serve_failed, mem_bandwidth,
                                                      gpu_bandwidth, kept, lend_bytes,
                                                      listens]


@pytest.mark.parametrize(("index", "bad"), [
    (0, -1), (0, 1 << 62), (1, "x" * (m.MAX_KIND + 1)), (2, -5), (4, "lots"),
    (5, "x" * (m.MAX_NAME + 1)), (7, -1),
])
def test_machine_figures_past_their_bounds_are_refused(index: int, bad: object) -> None:
    facts = list(FACTS)
    facts[index] = bad
    with pytest.raises(m.RecordError):
        m.decode(m._encoder.encode([*OLD_STATS, *facts]))


def test_hellos_say_whether_a_node_takes_models() -> None:
    old = ["node_hello", "n", "m", "mock", 4096, 2, 0, [0.0] * 5, 1, "i", True]
    got = m.decode(m._encoder.encode(old))
    assert isinstance(got, m.NodeHello) and got.channels and not got.takes_models
    agent = NodeAgent(MockEngine(lanes=1), identity="n", psk=None)
    assert agent._hello().takes_models


def test_a_split_ask_carries_the_lenders_bounded_and_an_older_ask_none() -> None:
    rec = m.ServeModel(spec="acme/Big-GGUF:Q4_K_M", ask=2,
                       split_with=["desk.local:8455", "[fe80::1]:8455"])
    assert roundtrip(rec) == rec
    older = m.decode(m._encoder.encode(["serve_model", "acme/Big-GGUF:Q4_K_M", 2]))
    assert isinstance(older, m.ServeModel) and older.split_with == []
    for bad in (["h:1"] * (m.MAX_SPLIT + 1), ["h" * m.MAX_ADDRESS + ":1"], [""], [7]):
        with pytest.raises(m.RecordError):
            m.decode(m._encoder.encode(["serve_model", "acme/Big-GGUF:Q4_K_M", 2, bad]))


def test_a_node_says_it_takes_splits_and_what_it_lends(tmp_path: Path) -> None:
    from engine.node.lending import Lender

    agent = NodeAgent(MockEngine(lanes=1), identity="n", psk=None)
    assert agent._hello().splits and agent.stats_record().lend_bytes == 0
    agent.lender = Lender(tmp_path, lend_bytes=3 * GiB, threads=1)  # started on first use
    assert roundtrip(agent.stats_record()).lend_bytes == 3 * GiB  # type: ignore[union-attr]
    old = ["node_hello", "n", "m", "mock", 4096, 2, 0, [0.0] * 5, 1, "i", True, True]
    got = m.decode(m._encoder.encode(old))
    assert isinstance(got, m.NodeHello) and got.takes_models and not got.splits


class GpuEngine(MockEngine):
    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), device_kind="igpu", device_total=32 * GiB,
                                   device_free=20 * GiB)


def test_the_node_reports_its_machine_its_device_and_its_pull() -> None:
    facts = MachineFacts(ram_total=32 * GiB, disk_free=100 * GiB, pull_model="p" * 300,
                         pull_done=5, pull_total=9)
    agent = NodeAgent(GpuEngine(lanes=1), identity="n", psk=None, machine=lambda: facts)
    rec = agent.stats_record()
    assert (rec.ram_total, rec.disk_free, rec.pull_done, rec.pull_total) == (
        32 * GiB, 100 * GiB, 5, 9)
    assert (rec.device_kind, rec.device_total, rec.device_free) == ("igpu", 32 * GiB, 20 * GiB)
    assert rec.pull_model == "p" * m.MAX_NAME  # cut to what the link carries
    assert roundtrip(rec) == rec
    bare = NodeAgent(MockEngine(lanes=1), identity="n", psk=None).stats_record()
    assert (bare.ram_total, bare.disk_free, bare.pull_model) == (0, 0, "")


async def test_the_agent_hands_a_hub_id_to_its_owner_and_answers_with_its_word() -> None:
    asked: list[tuple[str, tuple[str, ...]]] = []

    async def owner(spec: str, split_with: tuple[str, ...]) -> tuple[bool, str]:
        asked.append((spec, split_with))
        return spec.endswith("Q4_K_M"), f"pulling {spec}" if spec.endswith("Q4_K_M") else "no"

    agent = NodeAgent(MockEngine(lanes=1), identity="n", psk=None, serve_model=owner)
    assert await agent.asked_to_serve(m.ServeModel(spec="acme/C-GGUF:Q4_K_M", ask=4)) == \
        m.ServeModelResult(accepted=True, message="pulling acme/C-GGUF:Q4_K_M", ask=4)
    assert await agent.asked_to_serve(m.ServeModel(spec="acme/C-GGUF:Q8_0", ask=5)) == \
        m.ServeModelResult(accepted=False, message="no", ask=5)
    # a name that passes the link's pattern but not the hub's rules is refused here
    refused = await agent.asked_to_serve(m.ServeModel(spec="acme/re..po", ask=6))
    assert not refused.accepted and "is not a model id" in refused.message
    # a split: the lending machines' addresses reach the owner as the head sent them
    split = m.ServeModel(spec="acme/Big-GGUF:Q4_K_M", ask=7, split_with=["10.0.0.2:8455"])
    assert (await agent.asked_to_serve(split)).accepted
    assert asked == [("acme/C-GGUF:Q4_K_M", ()), ("acme/C-GGUF:Q8_0", ()),
                     ("acme/Big-GGUF:Q4_K_M", ("10.0.0.2:8455",))]


async def test_an_agent_without_an_owner_or_with_a_failing_one_refuses() -> None:
    bare = NodeAgent(MockEngine(lanes=1), identity="n", psk=None)
    assert await bare.asked_to_serve(m.ServeModel(spec="a/b:Q4_0", ask=1)) == m.ServeModelResult(
        accepted=False, message=NO_FLEET_MODELS, ask=1)

    async def broken(spec: str, split_with: tuple[str, ...]) -> tuple[bool, str]:
        raise RuntimeError("disk on fire")

    agent = NodeAgent(MockEngine(lanes=1), identity="n", psk=None, serve_model=broken)
    answer = await agent.asked_to_serve(m.ServeModel(spec="a/b:Q4_0", ask=2))
    assert not answer.accepted and "disk on fire" in answer.message


def test_free_bytes_looks_at_the_nearest_folder_there_is(tmp_path: Path) -> None:
    assert free_bytes(tmp_path / "models" / "not" / "yet") == free_bytes(tmp_path) > 0


async def test_disk_free_is_read_off_the_loop_at_most_every_few_seconds(tmp_path: Path) -> None:
    now = [100.0]
    disk = DiskFree(tmp_path, every_s=5.0, clock=lambda: now[0])
    assert disk.now() == 0  # the first reading has only begun, in a worker thread
    first = disk._reading
    assert first is not None
    await first
    assert disk.now() == free_bytes(tmp_path) > 0
    assert disk._reading is None  # read a moment ago: no new reading
    now[0] += 4.9
    disk.now()
    assert disk._reading is None
    now[0] += 0.1
    disk.now()
    assert disk._reading is not None and disk._reading is not first  # stale: read again
    await disk._reading


def test_a_llamacpp_engine_says_the_gpu_it_chose_even_with_no_layer_there() -> None:
    from engine.runtimes.llamacpp import LlamaCppEngine
    from engine.runtimes.offload import Device

    engine = LlamaCppEngine("/nowhere/model.gguf", model_name="x", lanes=1)
    st = engine.stats()  # not loaded: no device chosen
    assert (st.device_kind, st.device_total, st.device_free) == ("", 0, 0)
    engine.device = Device(name="Vulkan0", description="RTX 4070", kind="gpu",
                           free=11 * GiB, total=12 * GiB)
    st = engine.stats()
    assert (st.device_kind, st.device_total, st.device_free) == ("gpu", 12 * GiB, 11 * GiB)
    assert st.device == ""  # no layers were placed there (no offload planned)


def test_kept_models_travel_bounded_and_after_every_older_field() -> None:
    kept = [m.KeptModel(name=f"model-{i}", state="loaded", mem=300 << 20, embeds=i == 1,
                        context_window=2048, size=250 << 20) for i in range(m.MAX_KEPT)]
    stats = m.Stats(lanes=4, lanes_busy=0, kv_used=0, kv_total=0, kept=kept)
    got = m.decode(m.encode(stats))
    assert isinstance(got, m.Stats) and got.kept == kept
    hello = m.NodeHello(identity="n", model="first", runtime="mock", context_window=4096,
                        lanes=4, kept=kept[:2])
    got_hello = m.decode(m.encode(hello))
    assert isinstance(got_hello, m.NodeHello) and got_hello.kept == kept[:2]
    # one more than a node may say, a name past the bound, a state no node has: refused
    at = -3  # the kept models, before the memory lent and the port it lends on (issue 33)
    too_many = msgspec.msgpack.decode(m.encode(stats))
    too_many[at] = [*too_many[at], too_many[at][0]]
    long_name = msgspec.msgpack.decode(m.encode(stats))
    long_name[at][0][0] = "x" * (m.MAX_NAME + 1)
    odd_state = msgspec.msgpack.decode(m.encode(stats))
    odd_state[at][0][1] = "sleeping"
    for bad in (too_many, long_name, odd_state):
        with pytest.raises(m.RecordError):
            m.decode(msgspec.msgpack.encode(bad))
    # a request names its model last, so an older node reads it as its first model's
    gen = m.Generate(session="s", lease_ms=1000, prompt=[1], max_tokens=1, model="gemma")
    assert msgspec.msgpack.decode(m.encode(gen))[-1] == "gemma"
    assert m.decode(m.encode(m.Generate(session="s", lease_ms=1000, prompt=[1],
                                        max_tokens=1))).model == ""  # type: ignore[union-attr]

from __future__ import annotations

import pytest

from engine.config import Config, ConfigError, load_config, parse_config


def test_missing_file_gives_defaults(tmp_path):
    assert load_config(tmp_path) == Config()


def test_discovery_settings_are_read(tmp_path):
    (tmp_path / "config.toml").write_text(
        '[discovery]\nmode = "tailnet"\nseeds = ["10.0.0.5:8454"]\n'
        'tailscale_socket = "/tmp/ts.sock"\n')
    cfg = load_config(tmp_path)
    assert cfg == Config(discovery="tailnet", seeds=["10.0.0.5:8454"],
                         tailscale_socket="/tmp/ts.sock")


@pytest.mark.parametrize("text, words", [
    ("[discovery\n", "not valid TOML"),
    ('[discovery]\nmode = "radio"\n', "use one of lan, tailnet, both, none"),
    ('[discovery]\nseeds = "a:1"\n', "must be a list"),
    ('discovery = 3\n', "must be a table"),
    ('[node]\nmemory_budget = "6X"\n',
     "config.toml: node.memory_budget: '6X' is not a memory budget; give a size like 6G"),
    ('[node]\nmemory_budget = "100M"\n', "node.memory_budget: a memory budget of 100 MiB"),
    ("[node]\nmemory_budget = true\n", "config.toml: node.memory_budget: give a size like 6G"),
    ("[node]\nmemory_budget = 6.5\n", "as a string"),
    ('[node]\nkv_type = "q4_0"\n', "config.toml: node.kv_type is 'q4_0'; use f16 or q8_0"),
    ("[node]\nkv_type = 8\n", "config.toml: node.kv_type is 8; use f16 or q8_0"),
    ('[node]\ngpu = ""\n', "config.toml: node.gpu is ''; give auto, off (CPU only) or a "
     "device name such as Vulkan0 (1-64 printable characters)"),
    ("[node]\ngpu = 0\n", "config.toml: node.gpu is 0; give auto, off"),
    ('[node]\ngpu = "Vulkan\\t0"\n', "config.toml: node.gpu is 'Vulkan\\t0'; give auto"),
    (f'[node]\ngpu = "{"x" * 65}"\n', "(1-64 printable characters)"),
    ("[node]\nidle_unload = -1\n", "node.idle_unload: an idle time of -1 minutes is out"),
    ('[node]\nidle_unload = "soon"\n', "node.idle_unload: 'soon' is not an idle time"),
    ("[node]\nidle_unload = false\n", "config.toml: node.idle_unload: give minutes from 0"),
    ("node = 1\n", "config.toml: [node] must be a table"),
])
def test_bad_config_is_refused_in_one_line(text, words):
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="config.toml")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_machine_settings_default_to_head_and_node(tmp_path):
    from engine.config import machine_settings

    settings, app = machine_settings(tmp_path)
    assert settings.head is not None and settings.node is not None and app == {}
    assert settings.head.http == "127.0.0.1:8453" and settings.node.model is None


def test_machine_settings_round_trip(tmp_path):
    from dataclasses import replace

    from engine.config import machine_settings, save_machine_settings
    from engine.settings import HeadSettings, NodeSettings, Settings

    mine = Settings(home=tmp_path, fleet_name="desk",
                    head=HeadSettings(http="127.0.0.1:9000", fleet_listen="0.0.0.0:8454",
                                      allow_hosts=("box.lan",)),
                    node=NodeSettings(model="org/repo:Q4_K_M", lanes=4, paused=True))
    save_machine_settings(mine, {"start_at_login": True})
    assert oct((tmp_path / "config.toml").stat().st_mode & 0o777) == "0o600"
    again, app = machine_settings(tmp_path)
    assert app == {"start_at_login": True}
    assert again.fleet_name is None  # kept beside the token only (fleet/name)
    assert again.head == replace(mine.head, queue_timeout_s=20.0)  # type: ignore[arg-type]
    assert again.node == mine.node
    save_machine_settings(replace(mine, head=None), {})
    assert machine_settings(tmp_path)[0].head is None


def test_machine_settings_refuse_wrong_types_in_one_line(tmp_path):
    from engine.config import machine_settings

    (tmp_path / "config.toml").write_text('[node]\nlanes = "eight"\n')
    with pytest.raises(ConfigError) as err:
        machine_settings(tmp_path)
    assert "node.lanes has the wrong type" in str(err.value)
    (tmp_path / "config.toml").write_text('[node]\nlanes = true\n')
    with pytest.raises(ConfigError):
        machine_settings(tmp_path)


def test_the_fleet_table_brings_a_restart_back_into_its_fleet(tmp_path):
    from dataclasses import replace

    from engine.config import machine_settings, save_machine_settings
    from engine.settings import HeadSettings, JoinSettings, NodeSettings, Settings

    member = Settings(home=tmp_path, fleet_name="desk", head=HeadSettings(
        fleet_listen="0.0.0.0:8454"), node=NodeSettings(),
        join=JoinSettings(head="10.0.0.5:8454", code="shoal://join?token=secret"))
    save_machine_settings(member, {})
    text = (tmp_path / "config.toml").read_text()
    assert "secret" not in text and "fleet_listen" not in text
    again, _ = machine_settings(tmp_path)
    assert again.join == JoinSettings(head="10.0.0.5:8454")  # no code: the token stays put
    assert again.head is not None and again.head.fleet_listen == "0.0.0.0:8454"
    # joined by the network (no head given), and without taking joins here
    save_machine_settings(replace(member, join=JoinSettings(), head=HeadSettings()), {})
    again, _ = machine_settings(tmp_path)
    assert again.join == JoinSettings() and again.head.fleet_listen is None  # type: ignore[union-attr]
    # after leaving: neither
    save_machine_settings(replace(member, join=None, head=HeadSettings()), {})
    again, _ = machine_settings(tmp_path)
    assert again.join is None and again.head.fleet_listen is None  # type: ignore[union-attr]


def test_a_wrong_fleet_table_is_one_line(tmp_path):
    from engine.config import machine_settings

    (tmp_path / "config.toml").write_text('[fleet]\nmember = "yes"\n')
    with pytest.raises(ConfigError) as err:
        machine_settings(tmp_path)
    assert "fleet.member has the wrong type" in str(err.value)


def test_how_the_node_holds_its_model_round_trips(tmp_path):
    from engine.config import machine_settings, save_machine_settings
    from engine.settings import HeadSettings, NodeSettings, Settings
    from engine.sizes import GiB, Share

    for node in (NodeSettings(memory_budget=12 * GiB, kv_type="q8_0", idle_unload_s=None),
                 NodeSettings(memory_budget=Share(50.0), idle_unload_s=1800.0),
                 NodeSettings(gpu="off"), NodeSettings(gpu="RTX 4070"),
                 NodeSettings()):
        save_machine_settings(Settings(home=tmp_path, head=HeadSettings(), node=node), {})
        assert machine_settings(tmp_path)[0].node == node
    text = (tmp_path / "config.toml").read_text()
    assert 'kv_type = "f16"' in text and "idle_unload = 15\n" in text
    assert 'gpu = "auto"' in text
    assert "memory_budget" not in text  # the default share: nothing to keep
    save_machine_settings(Settings(home=tmp_path, node=NodeSettings(
        memory_budget=12 * GiB, idle_unload_s=None)), {})
    text = (tmp_path / "config.toml").read_text()
    assert 'memory_budget = "12GiB"' in text and 'idle_unload = "never"' in text


def test_the_cli_reads_how_the_node_holds_its_model(tmp_path):
    from engine.sizes import GiB, Share

    (tmp_path / "config.toml").write_text(
        '[node]\nmemory_budget = "50%"\nkv_type = "q8_0"\ngpu = "Vulkan0"\nidle_unload = 30\n')
    assert load_config(tmp_path).node_memory == {
        "memory_budget": Share(50.0), "kv_type": "q8_0", "gpu": "Vulkan0",
        "idle_unload_s": 1800.0}
    cfg = parse_config(f'[node]\nmemory_budget = {6 * GiB}\nidle_unload = "never"\n',
                       source="c")
    assert cfg.node_memory == {"memory_budget": 6 * GiB, "idle_unload_s": None}
    assert parse_config('[node]\nidle_unload = 0.5\n', source="c").node_memory == {
        "idle_unload_s": 30.0}
    assert parse_config("[node]\nlanes = 4\n", source="c").node_memory == {}


def test_the_next_start_holds_how_the_node_will_hold_its_model():
    from engine.config import NextStart, NodeMemory
    from engine.settings import NodeSettings, Settings
    from engine.sizes import GiB

    now = Settings(node=NodeSettings(lanes=4))
    memory = NodeMemory(memory_budget=8 * GiB, kv_type="q8_0", idle_unload_s=None, gpu="off")
    later = NextStart(node_memory=memory).over(now)
    assert later.node == NodeSettings(lanes=4, memory_budget=8 * GiB, kv_type="q8_0",
                                      idle_unload_s=None, gpu="off")
    assert NodeMemory.of(later.node) == memory
    assert NextStart().over(now) == now
    assert NextStart(node_memory=memory).over(Settings()).node is None  # no node, none made


def test_the_apps_rewrite_keeps_the_nodes_upstream(tmp_path):
    """Dropped, the next start had a llama-server runtime with no engine to front."""
    from engine.config import machine_settings, save_machine_settings
    from engine.settings import NodeSettings, Settings

    node = NodeSettings(runtime="llama-server", upstream="http://127.0.0.1:8080", lanes=0)
    save_machine_settings(Settings(home=tmp_path, node=node), {})
    assert machine_settings(tmp_path)[0].node == node
    assert 'upstream = "http://127.0.0.1:8080"' in (tmp_path / "config.toml").read_text()

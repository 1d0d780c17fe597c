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
    assert again.fleet_name == "desk"
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
    assert again.fleet_name == "desk"
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

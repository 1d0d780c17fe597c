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

"""``[node] fleet_may_choose_model`` in config.toml (issue 25): read by the CLI and the app,
written by the app's one writer, on by default, refused in one line when not true/false;
and ``[node] fleet_models_quota``, the disk the models the fleet chose may take (issue 30,
item 4), half the models folder's disk by default."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, machine_settings, parse_config, save_machine_settings
from engine.models.pulls.quota import Quota
from engine.settings import HeadSettings, NodeSettings, Settings
from engine.sizes import GiB, MiB, Share


def test_on_unless_the_file_says_off(tmp_path: Path) -> None:
    assert NodeSettings().fleet_may_choose_model
    assert parse_config("[node]\nfleet_may_choose_model = false\n", source="c").node_memory \
        == {"fleet_may_choose_model": False}
    assert parse_config("[node]\nkv_type = \"f16\"\n", source="c").node_memory == {
        "kv_type": "f16"}
    node = machine_settings(tmp_path)[0].node
    assert node is not None and node.fleet_may_choose_model


@pytest.mark.parametrize("on", [True, False])
def test_it_round_trips_through_the_apps_writer(tmp_path: Path, on: bool) -> None:
    node = NodeSettings(fleet_may_choose_model=on)
    save_machine_settings(Settings(home=tmp_path, head=HeadSettings(), node=node), {})
    assert f"fleet_may_choose_model = {str(on).lower()}\n" in (
        tmp_path / "config.toml").read_text()
    got = machine_settings(tmp_path)[0].node
    assert got is not None and got.fleet_may_choose_model is on


@pytest.mark.parametrize("value", ['"no"', "0", "1"])
def test_anything_but_true_or_false_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(f"[node]\nfleet_may_choose_model = {value}\n", source="c.toml")
    assert str(err.value) == "c.toml: node.fleet_may_choose_model is true or false"


@pytest.mark.parametrize(("quota", "kept"), [
    (Share(50.0), '"50%"'), (Share(12.5), '"12.5%"'), (20 * GiB, '"20GiB"'),
    (300 * MiB, '"300MiB"'), (800_000, "800000"), (0, "0")])
def test_the_fleet_models_quota_round_trips_through_the_apps_writer(
        tmp_path: Path, quota: Quota, kept: str) -> None:
    node = NodeSettings(fleet_models_quota=quota)
    save_machine_settings(Settings(home=tmp_path, head=HeadSettings(), node=node), {})
    assert f"fleet_models_quota = {kept}\n" in (tmp_path / "config.toml").read_text()
    got = machine_settings(tmp_path)[0].node
    assert got is not None and got.fleet_models_quota == quota


def test_the_fleet_models_quota_is_half_the_disk_unless_the_file_says_otherwise(
        tmp_path: Path) -> None:
    assert NodeSettings().fleet_models_quota == Share(50.0)
    assert parse_config('[node]\nfleet_models_quota = "20G"\n', source="c").node_memory == {
        "fleet_models_quota": 20 * GiB}
    node = machine_settings(tmp_path)[0].node
    assert node is not None and node.fleet_models_quota == Share(50.0)


@pytest.mark.parametrize("value", ['"lots"', '"150%"', "-1", "true", "1.5"])
def test_a_quota_that_is_no_size_or_share_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(f"[node]\nfleet_models_quota = {value}\n", source="c.toml")
    line = str(err.value)
    assert line.startswith("c.toml: node.fleet_models_quota: ") and "\n" not in line
    assert "like 50%" in line

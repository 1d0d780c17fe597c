"""Whether this machine runs on its battery (engine.node.power), from sysfs trees laid out
as Linux lays out /sys/class/power_supply: a machine lends memory on battery only when
its owner asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.node.power import sysfs_on_battery

pytestmark = pytest.mark.quick


def supply(root: Path, name: str, **files: str) -> None:
    (root / name).mkdir(parents=True)
    for key, value in files.items():
        (root / name / key).write_text(value + "\n")


@pytest.mark.parametrize(("supplies", "battery"), [
    ({}, False),  # a desktop, a VM
    ({"AC": {"type": "Mains", "online": "1"}, "BAT0": {"type": "Battery", "present": "1"}},
     False),  # a laptop on its charger
    ({"AC": {"type": "Mains", "online": "0"}, "BAT0": {"type": "Battery", "present": "1"}},
     True),  # a laptop on its battery
    ({"ucsi-source-psy-USBC000:001": {"type": "USB", "online": "1"},
      "BAT0": {"type": "Battery", "present": "1"}}, False),  # charging over USB-C
    ({"AC": {"type": "Mains", "online": "0"}, "BAT0": {"type": "Battery", "present": "0"}},
     False),  # its battery taken out
    ({"hidpp_battery_0": {"type": "Battery"}, "AC": {"type": "Mains", "online": "1"}},
     False),  # a wireless mouse's battery beside mains power
])
def test_on_battery_reads_the_power_supplies(tmp_path: Path,
                                             supplies: dict[str, dict[str, str]],
                                             battery: bool) -> None:
    root = tmp_path / "power_supply"
    root.mkdir()
    for name, files in supplies.items():
        supply(root, name, **files)
    assert sysfs_on_battery(root) is battery


def test_no_power_supply_folder_is_no_battery(tmp_path: Path) -> None:
    assert sysfs_on_battery(tmp_path / "absent") is False

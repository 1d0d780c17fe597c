"""Start at login: the XDG autostart entry and the LaunchAgent as texts (checked with
desktop-file-validate and plistlib), where they go, and the command they start."""

from __future__ import annotations

import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import autostart

ROOT = Path(__file__).resolve().parents[2]
VALIDATE = shutil.which("desktop-file-validate")
needs_validator = pytest.mark.skipif(
    VALIDATE is None, reason="desktop-file-validate is not installed (apt install "
    "desktop-file-utils; scripts/lib/apt.sh does)")

ODD = ["/opt/My Apps/py thon", "-m", "app.launch", "app", '50% "quoted" $HOME `x` back\\slash']


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    assert VALIDATE is not None
    return subprocess.run([VALIDATE, str(path)], capture_output=True, text=True, timeout=30)


def unquote_exec(value: str) -> list[str]:
    """The Exec value as a launcher reads it back (the spec's rules): the string's own
    escapes, then arguments split on spaces, a quoted one taking \\" \\` \\$ \\\\ as
    escapes, then %% as %."""
    text = value.replace("\\\\", "\\")
    args, current, quoted, i = [], "", False, 0
    while i < len(text):
        c = text[i]
        if quoted and c == "\\" and text[i + 1] in '"`$\\':
            current, i = current + text[i + 1], i + 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == " " and not quoted:
            args.append(current)
            current = ""
        else:
            current += c
        i += 1
    return [a.replace("%%", "%") for a in [*args, current]]


@needs_validator
def test_the_desktop_entry_is_valid_and_starts_the_app(tmp_path: Path):
    entry = tmp_path / "shoal.desktop"
    entry.write_text(autostart.desktop_entry(ODD, {"SHOAL_HOME": "/home/me/my shoal"},
                                             "/opt/shoal/icons/shoal-256.png"))
    result = validate(entry)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
    [exec_value] = [line.removeprefix("Exec=") for line in entry.read_text().splitlines()
                    if line.startswith("Exec=")]
    assert unquote_exec(exec_value) == ["env", "SHOAL_HOME=/home/me/my shoal", *ODD]


@needs_validator
def test_the_installers_desktop_file_is_valid():
    result = validate(ROOT / "resources" / "shoal.desktop")
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_the_launch_agent_runs_the_app_at_login():
    plist = plistlib.loads(autostart.launch_agent(ODD, {"SHOAL_HOME": "/Users/me/.shoal"}))
    assert plist == {"Label": "org.shoal.Shoal", "ProgramArguments": ODD, "RunAtLoad": True,
                     "KeepAlive": False, "ProcessType": "Interactive",
                     "EnvironmentVariables": {"SHOAL_HOME": "/Users/me/.shoal"}}
    assert "EnvironmentVariables" not in plistlib.loads(autostart.launch_agent(ODD, {}))


def test_the_command_is_how_the_app_was_started():
    assert autostart.launch_command(frozen=True, executable="/Applications/Shoal.app/"
                                    "Contents/MacOS/Shoal") == [
        "/Applications/Shoal.app/Contents/MacOS/Shoal"]
    assert autostart.launch_command(frozen=False, executable="/x/.venv/bin/python") == [
        "/x/.venv/bin/python", "-m", "app.launch", "app"]
    assert autostart.launch_environment({"SHOAL_HOME": "/h"}) == {"SHOAL_HOME": "/h"}
    assert autostart.launch_environment({}) == {}


@pytest.mark.parametrize(("platform", "environ", "expected"), [
    ("linux", {}, "/home/me/.config/autostart/shoal.desktop"),
    ("linux", {"XDG_CONFIG_HOME": "/home/me/cfg"}, "/home/me/cfg/autostart/shoal.desktop"),
    ("linux", {"XDG_CONFIG_HOME": "relative/cfg"}, "/home/me/.config/autostart/shoal.desktop"),
    ("darwin", {"XDG_CONFIG_HOME": "/x"},
     "/home/me/Library/LaunchAgents/org.shoal.Shoal.plist"),
])
def test_where_the_entry_goes(platform: str, environ: dict[str, str], expected: str):
    assert str(autostart.entry_path(platform=platform, environ=environ,
                                    home=Path("/home/me"))) == expected
    assert autostart.entry_path(platform="win32", environ={}, home=Path("/h")) is None


@needs_validator
def test_turning_it_on_writes_a_valid_entry_and_off_removes_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "home"))
    path = autostart.apply(True)
    assert path == tmp_path / "cfg" / "autostart" / "shoal.desktop"
    assert validate(path).returncode == 0
    [exec_value] = [line.removeprefix("Exec=") for line in path.read_text().splitlines()
                    if line.startswith("Exec=")]
    assert unquote_exec(exec_value) == ["env", f"SHOAL_HOME={tmp_path / 'home'}",
                                        sys.executable, "-m", "app.launch", "app"]
    icon = next(line for line in path.read_text().splitlines() if line.startswith("Icon="))
    assert Path(icon.removeprefix("Icon=")).is_file()
    autostart.apply(False)
    assert not path.exists()
    autostart.apply(False)  # already off: nothing to do, no error

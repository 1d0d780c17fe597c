"""Start at login: an XDG autostart entry on Linux (``$XDG_CONFIG_HOME/autostart/
shoal.desktop``), a LaunchAgent on macOS (``~/Library/LaunchAgents/LABEL.plist`` with
RunAtLoad). The texts are built by pure functions; the files are written off the loop.

The command is how this app was started: a bundle's own executable, else this Python
running ``-m app.launch app``; a ``SHOAL_HOME`` other than the default goes with it.
"""

from __future__ import annotations

import asyncio
import os
import plistlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

LABEL = "org.shoal.Shoal"
DESKTOP_FILE = "shoal.desktop"
# the characters that make the desktop entry spec's Exec quote an argument
_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


def launch_command(*, frozen: bool | None = None, executable: str | None = None) -> list[str]:
    """The command line that starts this app again."""
    frozen = getattr(sys, "frozen", False) if frozen is None else frozen
    executable = executable or sys.executable
    if frozen:
        return [executable]
    return [executable, "-m", "app.launch", "app"]


def launch_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables the started app needs: SHOAL_HOME, when one was chosen."""
    environ = os.environ if environ is None else environ
    home = environ.get("SHOAL_HOME")
    return {"SHOAL_HOME": home} if home else {}


def _exec_arg(arg: str) -> str:
    """One argument of an Exec key: quoted when needed, with the spec's escapes."""
    if arg and not (set(arg) & _RESERVED):
        quoted = arg
    else:
        inner = "".join("\\" + c if c in '"`$\\' else c for c in arg)
        quoted = f'"{inner}"'
    # the value is a string too: backslashes escape once more, and % is a field code
    return quoted.replace("\\", "\\\\").replace("%", "%%")


def exec_line(command: Sequence[str], env: Mapping[str, str]) -> str:
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return " ".join(_exec_arg(a) for a in [*prefix, *command])


def _string_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def desktop_entry(command: Sequence[str], env: Mapping[str, str], icon: str) -> str:
    """The XDG autostart entry (Desktop Entry Specification 1.5)."""
    return "\n".join([
        "[Desktop Entry]",
        "Type=Application",
        "Version=1.4",
        "Name=Shoal",
        "GenericName=Private LLM endpoint",
        "Comment=Pool your machines into one private LLM endpoint",
        f"Exec={exec_line(command, env)}",
        f"Icon={_string_value(icon)}",
        "Terminal=false",
        "Categories=Utility;",
        "StartupNotify=false",
        "X-GNOME-Autostart-enabled=true",
        "",
    ])


def launch_agent(command: Sequence[str], env: Mapping[str, str]) -> bytes:
    """The LaunchAgent property list: run at login, once (Quit stays quit)."""
    plist: dict[str, object] = {
        "Label": LABEL,
        "ProgramArguments": list(command),
        "RunAtLoad": True,
        "KeepAlive": False,
        "ProcessType": "Interactive",
    }
    if env:
        plist["EnvironmentVariables"] = dict(env)
    return plistlib.dumps(plist)


def entry_path(*, platform: str | None = None, environ: Mapping[str, str] | None = None,
               home: Path | None = None) -> Path | None:
    """Where the entry goes on this system (None: start at login is not offered here)."""
    platform = platform or sys.platform
    environ = os.environ if environ is None else environ
    home = home or Path.home()
    if platform.startswith("linux") or "bsd" in platform:
        config = environ.get("XDG_CONFIG_HOME")
        base = Path(config) if config and Path(config).is_absolute() else home / ".config"
        return base / "autostart" / DESKTOP_FILE
    if platform == "darwin":
        return home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    return None


def supported() -> bool:
    return entry_path() is not None


def entry_text(path: Path) -> bytes:
    from app.icons import icons_dir

    command, env = launch_command(), launch_environment()
    if path.suffix == ".plist":
        return launch_agent(command, env)
    return desktop_entry(command, env, str(icons_dir() / "shoal-256.png")).encode("utf-8")


def apply(on: bool, path: Path | None = None) -> Path:
    """Write or remove the entry (blocking: call it off the loop). Returns its path."""
    path = path or entry_path()
    if path is None:
        raise OSError(f"start at login is not supported on {sys.platform}")
    if on:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(entry_text(path))
        os.replace(tmp, path)
    else:
        path.unlink(missing_ok=True)
    return path


async def set_enabled(on: bool, path: Path | None = None) -> Path:
    return await asyncio.to_thread(apply, on, path)

"""The coding agents Shoal is tested against, pinned, installed once per machine.

    python scripts/lib/agents.py            install what is missing; print each binary
    python scripts/lib/agents.py --check    print what is installed; install nothing

The npm agents (Claude Code, Codex, opencode, the Continue CLI, pi, the Cline CLI, the Kilo
CLI, Qwen Code) go into one npm prefix
named after the pins, aider into a virtual environment of its own (its dependencies pin
versions that Shoal's would fight with). Both live in pip's cache folder (like the
llama-server build: scripts/lib/llama_server.py), so CI on a machine that has them
installs nothing; ``SHOAL_AGENTS_CACHE`` overrides. An install goes into a temporary
folder renamed into place once every binary answers ``--version``, so an interrupted
one is never taken for a good one. Only the npm registry and PyPI are used.

To move to a newer agent: change its pin here, run this script, then re-record the
requests the agents send, which the unit tests decode (tests/fixtures/agents/):
``SHOAL_RECORD_AGENTS=1 .venv/bin/python -m pytest tests/integration/test_real_agents.py``
(tests/unit/test_agent_pins.py fails, naming that command, until they are recorded).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Agent:
    name: str  # what the tests call it
    registry: str  # "npm" or "pypi"
    package: str
    version: str
    binary: str  # the command it installs


PINS: tuple[Agent, ...] = (
    Agent("claude", "npm", "@anthropic-ai/claude-code", "2.1.332", "claude"),
    Agent("codex", "npm", "@openai/codex", "0.171.0", "codex"),
    Agent("opencode", "npm", "opencode-ai", "1.18.33", "opencode"),
    Agent("cn", "npm", "@continuedev/cli", "1.5.47", "cn"),
    Agent("pi", "npm", "@mariozechner/pi-coding-agent", "0.73.1", "pi"),
    Agent("cline", "npm", "cline", "3.0.65", "cline"),
    # 7.8.1 is out, but not its platform packages (@kilocode/cli-linux-x64 stops at 7.7.9)
    Agent("kilo", "npm", "@kilocode/cli", "7.7.7", "kilo"),
    Agent("qwen", "npm", "@qwen-code/qwen-code", "0.24.4", "qwen"),
    Agent("aider", "pypi", "aider-chat", "0.86.2", "aider"),
)
BY_NAME = {a.name: a for a in PINS}


class InstallFailed(RuntimeError):
    """One line: what failed, and what to do."""


def _say(msg: str) -> None:
    print(f"[agents] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    if own := os.environ.get("SHOAL_AGENTS_CACHE"):
        return Path(own).expanduser()
    pip = os.environ.get("PIP_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "pip")
    return Path(pip).expanduser() / "shoal-agents"


def _npm_agents() -> list[Agent]:
    return [a for a in PINS if a.registry == "npm"]


def npm_prefix(root: Path | None = None) -> Path:
    pins = " ".join(f"{a.package}@{a.version}" for a in _npm_agents())
    key = hashlib.sha256(pins.encode()).hexdigest()[:12]
    return (root or cache_root()) / f"npm-{key}"


def venv_dir(agent: Agent, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{agent.package}-{agent.version}"


def binary_path(name: str, root: Path | None = None) -> Path:
    agent = BY_NAME[name]
    if agent.registry == "npm":
        return npm_prefix(root) / "node_modules" / ".bin" / agent.binary
    return venv_dir(agent, root) / "bin" / agent.binary


def version_of(binary: Path) -> str | None:
    """What ``binary --version`` prints (its first line), None when it does not run."""
    if not binary.exists():
        return None
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "NO_COLOR": "1"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if out.returncode == 0 and text else None


def _answers(agent: Agent, binary: Path) -> bool:
    found = version_of(binary)
    return found is not None and agent.version in found


def _install_npm(root: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise InstallFailed("npm is not installed; install Node.js 20 or newer "
                            "(apt install nodejs npm) and run again")
    final = npm_prefix(root)
    tmp = final.with_name(final.name + f".tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specs = [f"{a.package}@{a.version}" for a in _npm_agents()]
    _say(f"installing {', '.join(specs)} (once per machine, into {final})")
    out = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(tmp),
                          *specs], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise InstallFailed(f"npm install failed ({' / '.join(tail)}); check the network "
                            "to the npm registry and run again")
    for agent in _npm_agents():
        if not _answers(agent, tmp / "node_modules" / ".bin" / agent.binary):
            shutil.rmtree(tmp, ignore_errors=True)
            raise InstallFailed(f"{agent.package}@{agent.version} installed but "
                                f"`{agent.binary} --version` does not say {agent.version}")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    # npm wrote absolute paths nowhere but .bin links are relative: the rename keeps them
    (final / "pins.json").write_text(json.dumps(specs))


def _install_pypi(agent: Agent, root: Path) -> None:
    final = venv_dir(agent, root)
    tmp = final.with_name(final.name + f".tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _say(f"installing {agent.package}=={agent.version} into its own environment {final}")
    # the environment is made where it will live: a venv's scripts name their folder
    shutil.rmtree(final, ignore_errors=True)
    venv.create(final, with_pip=True, clear=True)
    out = subprocess.run([str(final / "bin" / "python"), "-m", "pip", "install", "--quiet",
                          "--disable-pip-version-check", f"{agent.package}=={agent.version}"],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0 or not _answers(agent, final / "bin" / agent.binary):
        shutil.rmtree(final, ignore_errors=True)
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise InstallFailed(f"pip install {agent.package}=={agent.version} failed "
                            f"({' / '.join(tail)}); check the network to PyPI and run again")
    (final / ".shoal-ok").write_text(agent.version)


def installed(name: str, root: Path | None = None) -> Path | None:
    """The agent's binary when it is installed and complete, else None."""
    agent = BY_NAME[name]
    binary = binary_path(name, root)
    if agent.registry == "npm":
        ok = (npm_prefix(root) / "pins.json").is_file()
    else:
        ok = (venv_dir(agent, root) / ".shoal-ok").is_file()
    return binary if ok and binary.exists() else None


def ensure_all(root: Path | None = None) -> dict[str, Path]:
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    if any(installed(a.name, root) is None for a in _npm_agents()):
        _install_npm(root)
    for agent in PINS:
        if agent.registry == "pypi" and installed(agent.name, root) is None:
            _install_pypi(agent, root)
    return {a.name: binary_path(a.name, root) for a in PINS}


def main(argv: list[str]) -> int:
    if "--check" in argv:
        for agent in PINS:
            path = installed(agent.name)
            print(f"{agent.name} {agent.version}: {path or 'not installed'}")
        return 0
    try:
        paths = ensure_all()
    except InstallFailed as exc:
        _say(str(exc))
        return 1
    for name, path in paths.items():
        print(f"{name} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

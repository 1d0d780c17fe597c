"""The fleet token in a real keychain backend, in isolation: never the user's keychain.

Each scenario runs in a subprocess whose HOME, XDG directories and SHOAL_HOME
are inside tmp_path:

- Secret Service: a private D-Bus session (``dbus-run-session``) with its own
  ``gnome-keyring-daemon`` unlocked with a throwaway password; the daemon is
  started in the foreground by the script and killed by its pid at the end.
- keyrings.alt: its file backend, chosen with PYTHON_KEYRING_BACKEND, writing
  under the temporary XDG_DATA_HOME.
- no keychain: keyring's fail backend, so everything goes to the token file.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import keyrings.alt.file
import pytest

from engine.credentials import tokens as sec

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 60

GNOME_KEYRING = r"""
printf 'throwaway' | gnome-keyring-daemon --foreground --unlock --components=secrets >/dev/null &
GK=$!
trap 'kill $GK 2>/dev/null; wait $GK 2>/dev/null' EXIT
for i in $(seq 1 50); do
  if dbus-send --session --print-reply --dest=org.freedesktop.DBus /org/freedesktop/DBus \
       org.freedesktop.DBus.NameHasOwner string:org.freedesktop.secrets 2>/dev/null \
       | grep -q 'boolean true'; then break; fi
  sleep 0.1
done
"$@"
"""


def scenario(expect: str) -> None:
    """Store, load, move keychain -> file -> keychain, rotate, forget (run in a subprocess)."""
    home = Path(os.environ["SHOAL_HOME"])
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.DEBUG)
    import keyring

    assert sec.keychain_usable(), keyring.get_keyring()
    account = sec.keychain_account(home)
    assert account.startswith("fleet-token@")  # never the default home's entry
    store = sec.KeychainStore()
    assert expect in store.describe(), store.describe()
    said: list[str] = []

    token = os.urandom(32)
    said.append(sec.store_fleet_token(home, token, "auto"))
    assert expect in said[-1]
    assert sec.load_fleet_token(home) == token
    assert sec.token_location(home) == "keychain"
    assert not sec.token_path(home).exists()
    assert keyring.get_password("shoal", account) == token.hex()  # service "shoal"

    said.append(sec.move_token(home, "file"))
    assert said[-1] == f"the fleet token is now in the token file {sec.token_path(home)}"
    assert keyring.get_password("shoal", account) is None
    assert stat.S_IMODE(sec.token_path(home).stat().st_mode) == 0o600
    assert sec.load_fleet_token(home) == token
    assert sec.token_location(home) == "file"

    said.append(sec.move_token(home, "keychain"))
    assert expect in said[-1] and said[-1].startswith("the fleet token is now in ")
    assert not sec.token_path(home).exists()
    assert sec.load_fleet_token(home) == token

    rotated = sec.ensure_fleet_token(home, rotate=True)
    assert rotated != token and sec.token_location(home) == "keychain"
    assert sec.ensure_fleet_token(home) == rotated

    said.extend(sec.forget_token(home))
    assert len(said) == 4 and expect in said[-1]
    assert sec.load_fleet_token(home) is None
    assert sec.token_location(home) is None
    assert keyring.get_password("shoal", account) is None

    text = "\n".join(said) + logs.getvalue() + repr(store)
    for secret in (token, rotated):
        assert secret.hex() not in text and secret.hex().upper() not in text
    print("SCENARIO-OK")


def no_keychain_scenario() -> None:
    """With no usable backend the token goes to the file; asking for the keychain fails clearly."""
    home = Path(os.environ["SHOAL_HOME"])
    assert not sec.keychain_usable()
    token = sec.ensure_fleet_token(home)
    assert sec.token_path(home).read_text().strip() == token.hex()
    assert sec.token_location(home) == "file"
    try:
        sec.move_token(home, "keychain")
    except sec.TokenError as exc:
        message = str(exc)
    else:
        raise AssertionError("moved to a keychain that is not there")
    assert "no usable keychain" in message and "--store file" in message
    assert token.hex() not in message
    assert sec.load_fleet_token(home) == token  # still in the file
    assert sec.forget_token(home) == [f"the token file {sec.token_path(home)}"]
    print("SCENARIO-OK")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    dirs = {name: tmp_path / name for name in ("home", "data", "config", "cache", "run", "shoal")}
    for d in dirs.values():
        d.mkdir(mode=0o700, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DBUS_", "PYTHON_KEYRING", "XDG_", "GNOME_KEYRING"))}
    env.update(HOME=str(dirs["home"]), XDG_DATA_HOME=str(dirs["data"]),
               XDG_CONFIG_HOME=str(dirs["config"]), XDG_CACHE_HOME=str(dirs["cache"]),
               XDG_RUNTIME_DIR=str(dirs["run"]), SHOAL_HOME=str(dirs["shoal"]),
               PYTHONPATH=str(ROOT), **extra)
    return env


def _run(cmd: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0 and "SCENARIO-OK" in done.stdout, \
        f"rc={done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"


def _py(call: str) -> list[str]:
    return [sys.executable, "-c", f"from tests.integration.test_keyring import *; {call}"]


def test_secret_service_in_private_dbus_session(tmp_path: Path) -> None:
    missing = [tool for tool in ("dbus-run-session", "dbus-send", "gnome-keyring-daemon")
               if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no isolated Secret Service: {', '.join(missing)} not installed "
                    "(Debian: dbus, gnome-keyring)")
    cmd = ["dbus-run-session", "--", "bash", "-c", GNOME_KEYRING, "bash",
           *_py("scenario('Secret Service')")]
    _run(cmd, _env(tmp_path))
    # The secret lived in the temporary keyring directory, nowhere else.
    assert list((tmp_path / "data" / "keyrings").glob("*.keyring"))


def test_keyrings_alt_file_backend(tmp_path: Path) -> None:
    env = _env(tmp_path, PYTHON_KEYRING_BACKEND="keyrings.alt.file.PlaintextKeyring")
    _run(_py("scenario('PlaintextKeyring')"), env)
    assert (tmp_path / "data" / "python_keyring").is_dir()


def test_no_keychain_uses_the_file(tmp_path: Path) -> None:
    env = _env(tmp_path, PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring")
    _run(_py("no_keychain_scenario()"), env)


def test_plaintext_fallback_is_not_a_keychain_unless_chosen(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    alt = keyrings.alt.file
    monkeypatch.delenv("PYTHON_KEYRING_BACKEND", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no keyringrc.cfg there
    assert not sec._usable(alt.PlaintextKeyring())
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyrings.alt.file.PlaintextKeyring")
    assert sec._usable(alt.PlaintextKeyring())


def test_file_store_is_private_and_atomic(tmp_path: Path) -> None:
    path = tmp_path / "fleet" / "token"
    store = sec.FileStore(path)
    assert store.get("x") is None
    store.put("x", "ab" * 32)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.get("x") == "ab" * 32
    assert [p.name for p in path.parent.iterdir()] == ["token"]  # no temp file left
    assert str(path) in store.describe() and "ab" * 32 not in repr(store)
    store.delete("x")
    store.delete("x")
    assert not path.exists()


def test_bad_file_token_message_hides_content(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("cd" * 31 + "zz\n")
    path.chmod(0o600)
    with pytest.raises(sec.TokenError) as err:
        sec.read_token(path)
    assert "cd" * 31 not in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606])
def test_a_token_file_open_to_other_users_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: int) -> None:
    monkeypatch.setattr(sec, "_real_backend", lambda: None)  # no keychain: the file
    path = tmp_path / "fleet" / "token"
    sec.write_token(path, bytes(range(32)))
    path.chmod(mode)
    for read in (lambda: sec.read_token(path), lambda: sec.FileStore(path).get("x"),
                 lambda: sec.load_fleet_token(tmp_path)):
        with pytest.raises(sec.TokenError) as err:
            read()
        message = str(err.value)
        assert message == (f"other users can read or change the fleet token file {path} "
                           f"(mode {mode:04o}); run `chmod 600 {path}`")
        assert bytes(range(32)).hex() not in message
    path.chmod(0o600)
    assert sec.read_token(path) == bytes(range(32))

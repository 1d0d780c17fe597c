"""The fleet token: 32 random bytes, kept as 64 hex characters.

It lives in the OS keychain (``keyring``, service ``shoal``) where a real
backend is usable, as on a desktop, and in the token file
``$SHOAL_HOME/fleet/token`` (0600) otherwise, as on a headless machine. One
place holds it at a time: storing it in one removes it from the other.

In the keychain the account is ``fleet-token`` for the default home
(``~/.shoal``) and ``fleet-token@<home path>`` for any other ``SHOAL_HOME``,
so separate homes on one machine (tests, a second fleet) keep separate tokens.

The token never appears in a log line, a process title, an exception message
or a repr; callers get bytes and print the token only when the user asks for it.
Keychain calls can block (a D-Bus round trip, an unlock prompt): from asyncio
code call these functions through ``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any, Literal, Protocol

from engine.files import hex_secret, read_secret_file, write_private
from engine.settings import standard_home

log = logging.getLogger("shoal.secrets")

TOKEN_BYTES = 32
KEYRING_SERVICE = "shoal"
TOKEN_ACCOUNT = "fleet-token"  # noqa: S105 (an account name, not a secret)

Place = Literal["keychain", "file"]
Where = Literal["keychain", "file", "auto"]


class TokenError(Exception):
    """The token cannot be read or stored; the message names the place and the fix."""


# --- the token file (unchanged contract) ------------------------------------------

def token_path(home: Path) -> Path:
    return home / "fleet" / "token"


def parse_token(text: str, *, source: str) -> bytes:
    data = hex_secret(text, TOKEN_BYTES)
    if data is None:
        raise TokenError(f"{source} does not hold a fleet token (64 hex characters); "
                         "make one with `shoal fleet token` and copy it there")
    return data


def read_token(path: Path) -> bytes | None:
    """The token at path, None when the file does not exist; TokenError when it is
    malformed or readable by other users (group or others)."""
    text = _read_text(path)
    return None if text is None else parse_token(text, source=str(path))


def write_token(path: Path, token: bytes) -> None:
    _write_private(path, token.hex() + "\n")


def ensure_token(path: Path, *, rotate: bool = False) -> bytes:
    """The token at path, made first when absent (or replaced when rotating)."""
    if not rotate:
        existing = read_token(path)
        if existing is not None:
            return existing
    token = secrets.token_bytes(TOKEN_BYTES)
    write_token(path, token)
    return token


def _read_text(path: Path) -> str | None:
    """The token file's text; refused when other users may read or change it."""
    data = read_secret_file(path, "the fleet token file", TokenError)
    return None if data is None else data.decode("ascii", errors="replace")


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by this user only (0600)."""
    try:
        write_private(path, text.encode("ascii"))
    except OSError as exc:
        raise TokenError(f"cannot write the fleet token at {path}: {exc.strerror}; "
                         f"check that {path.parent} is writable") from None


# --- stores ------------------------------------------------------------------------

class SecretStore(Protocol):
    """A place that keeps named secrets (strings)."""

    def get(self, name: str) -> str | None: ...

    def put(self, name: str, value: str) -> None: ...

    def delete(self, name: str) -> None:
        """Remove ``name``; nothing happens when it is absent."""
        ...

    def describe(self) -> str:
        """Where this is, for a user ("the token file ~/.shoal/fleet/token")."""
        ...


class FileStore:
    """One secret in one file (0600, written atomically): the token file.

    ``name`` is accepted for the SecretStore protocol; the file holds one value.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"FileStore({str(self.path)!r})"

    def get(self, name: str) -> str | None:
        text = _read_text(self.path)
        return None if text is None else text.strip()

    def put(self, name: str, value: str) -> None:
        _write_private(self.path, value + "\n")

    def delete(self, name: str) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            raise TokenError(f"cannot remove {self.path}: {exc.strerror}; "
                             "check its permissions") from None

    def describe(self) -> str:
        return f"the token file {self.path}"


def _explicitly_chosen() -> bool:
    """Whether the user picked a keyring backend (environment or keyringrc)."""
    if os.environ.get("PYTHON_KEYRING_BACKEND"):
        return True
    try:
        from keyring import core

        return core.load_config() is not None
    except Exception:
        return False


def _usable(backend: Any) -> bool:
    module = type(backend).__module__
    if module.startswith(("keyring.backends.fail", "keyring.backends.null")):
        return False
    # keyrings.alt stores secrets in plain or weakly protected files: no better
    # than the 0600 token file, so it is used only when chosen on purpose.
    if module.startswith("keyrings.alt") and not _explicitly_chosen():
        return False
    try:
        return float(backend.priority) > 0
    except Exception:
        return False


def _real_backend() -> Any | None:
    """The keyring backend Shoal would use, or None when there is no usable one."""
    try:
        import keyring
        from keyring.backends import chainer

        backend = keyring.get_keyring()
    except Exception as exc:  # a broken keyring install or configuration
        log.debug("no keyring backend: %s", type(exc).__name__)
        return None
    if isinstance(backend, chainer.ChainerBackend):
        # Use the best real member directly: never let a write fall through to
        # a lower, weaker backend of the chain.
        members = [b for b in backend.backends if _usable(b)]
        return max(members, key=lambda b: float(b.priority)) if members else None
    return backend if _usable(backend) else None


def keychain_usable() -> bool:
    """Whether a real OS keychain backend is available (not fail/null, priority > 0)."""
    return _real_backend() is not None


def _backend_label(backend: Any) -> str:
    module = type(backend).__module__
    if "macOS" in module:
        return "the macOS Keychain"
    if "SecretService" in module:
        return "the Secret Service keyring"
    if "kwallet" in module:
        return "KWallet"
    if "Windows" in module:
        return "Windows Credential Manager"
    return f"the {type(backend).__name__} keyring ({module})"


class KeychainStore:
    """Secrets in the OS keychain through ``keyring``, under service ``shoal``."""

    def __init__(self, service: str = KEYRING_SERVICE, *, backend: Any | None = None) -> None:
        self.service = service
        chosen = backend if backend is not None else _real_backend()
        if chosen is None:
            raise TokenError("there is no usable keychain here (keyring found no Secret "
                             "Service, macOS Keychain or similar); keep the token in the file "
                             "with `shoal fleet token --store file`")
        self._backend: Any = chosen

    def __repr__(self) -> str:
        return f"KeychainStore({self.service!r}, {type(self._backend).__name__})"

    def _fail(self, verb: str, exc: Exception) -> TokenError:
        # Only the exception's type: a backend message could quote what it was given.
        return TokenError(f"{self.describe()} could not {verb} the fleet token "
                          f"({type(exc).__name__}); unlock it and retry, or keep the token "
                          "in the file with `shoal fleet token --store file`")

    def get(self, name: str) -> str | None:
        try:
            value = self._backend.get_password(self.service, name)
        except Exception as exc:
            raise self._fail("read", exc) from None
        return value if isinstance(value, str) else None

    def put(self, name: str, value: str) -> None:
        try:
            self._backend.set_password(self.service, name, value)
        except Exception as exc:
            raise self._fail("store", exc) from None

    def delete(self, name: str) -> None:
        from keyring.errors import PasswordDeleteError

        try:
            self._backend.delete_password(self.service, name)
        except PasswordDeleteError:
            return  # absent
        except Exception as exc:
            raise self._fail("remove", exc) from None

    def describe(self) -> str:
        return f"{_backend_label(self._backend)} (service {self.service})"


# --- the fleet token in its place ------------------------------------------------------

def keychain_account(home: Path) -> str:
    """The keychain account holding ``home``'s token (see the module docstring)."""
    # ~/.shoal whatever $SHOAL_HOME says: the account follows the folder, not the variable
    default = standard_home().absolute()
    here = home.expanduser().absolute()
    return TOKEN_ACCOUNT if here == default else f"{TOKEN_ACCOUNT}@{here}"


def _keychain_or_none() -> KeychainStore | None:
    backend = _real_backend()
    return KeychainStore(backend=backend) if backend is not None else None


def token_location(home: Path) -> Place | None:
    """Where ``home``'s token is now: the keychain, the file, or nowhere."""
    keychain = _keychain_or_none()
    if keychain is not None and keychain.get(keychain_account(home)) is not None:
        return "keychain"
    if token_path(home).exists():
        return "file"
    return None


def load_fleet_token(home: Path) -> bytes | None:
    """The fleet token: from the keychain where usable, else the token file; None if absent.

    When the keychain cannot be read (locked), the file is used if it holds the
    token; otherwise the keychain's error (one line, with the fix) is raised, so
    a caller never mistakes a locked keychain for a missing token.
    """
    keychain = _keychain_or_none()
    if keychain is not None:
        try:
            value = keychain.get(keychain_account(home))
        except TokenError:
            from_file = read_token(token_path(home))
            if from_file is not None:
                return from_file
            raise
        if value is not None:
            return parse_token(value, source=keychain.describe())
    return read_token(token_path(home))


def store_fleet_token(home: Path, token: bytes, where: Where = "auto") -> str:
    """Keep ``token`` in one place (removing it from the other); returns where it went.

    ``auto`` picks the keychain where one is usable, the file otherwise.
    """
    if len(token) != TOKEN_BYTES:
        raise TokenError(f"a fleet token is {TOKEN_BYTES} bytes; make one with "
                         "`shoal fleet token --rotate`")
    keychain = _keychain_or_none()
    if where == "auto":
        where = "keychain" if keychain is not None else "file"
    file_store = FileStore(token_path(home))
    account = keychain_account(home)
    if where == "keychain":
        if keychain is None:
            keychain = KeychainStore()  # raises the "no usable keychain" line
        keychain.put(account, token.hex())
        if keychain.get(account) != token.hex():
            raise TokenError(f"{keychain.describe()} did not keep the fleet token; "
                             "keep it in the file with `shoal fleet token --store file`")
        file_store.delete(TOKEN_ACCOUNT)
        log.info("fleet token stored in %s", keychain.describe())
        return keychain.describe()
    file_store.put(TOKEN_ACCOUNT, token.hex())
    if keychain is not None:
        try:
            keychain.delete(account)
        except TokenError as exc:
            raise TokenError(f"the fleet token is in {file_store.path} now, but an older copy "
                             f"stays in {keychain.describe()} and would be used first; unlock "
                             "it and run `shoal fleet token --store file` again") from exc
    log.info("fleet token stored in %s", file_store.describe())
    return file_store.describe()


def move_token(home: Path, to: Place) -> str:
    """Move the token to the keychain or the file (``shoal fleet token --store``).

    Returns one line saying where it is now.
    """
    token = load_fleet_token(home)
    if token is None:
        raise TokenError("there is no fleet token to move; make one with `shoal fleet token`")
    place = store_fleet_token(home, token, to)
    return f"the fleet token is now in {place}"


def forget_token(home: Path) -> list[str]:
    """Remove the token from the keychain and the file; returns the places it was in."""
    removed: list[str] = []
    keychain = _keychain_or_none()
    account = keychain_account(home)
    if keychain is not None and keychain.get(account) is not None:
        keychain.delete(account)
        removed.append(keychain.describe())
    file_store = FileStore(token_path(home))
    if file_store.path.exists():
        file_store.delete(TOKEN_ACCOUNT)
        removed.append(file_store.describe())
    if removed:
        log.info("fleet token removed from %s", " and ".join(removed))
    return removed


def ensure_fleet_token(home: Path, *, rotate: bool = False, where: Where = "auto") -> bytes:
    """The fleet token, made first when absent; ``rotate`` replaces it in the same place."""
    if not rotate:
        existing = load_fleet_token(home)
        if existing is not None:
            return existing
    elif where == "auto":
        where = token_location(home) or "auto"
    token = secrets.token_bytes(TOKEN_BYTES)
    store_fleet_token(home, token, where)
    return token

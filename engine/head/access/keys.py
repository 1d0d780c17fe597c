"""API keys without a database, per-key limits, and browser-origin checks.

Stateless keys
    A key is ``sk-shoal-<name>-<signature>``. The signature is the whole 32-byte
    HMAC-SHA256 of the ASCII name under the keys secret, in base64url without
    padding (43 characters). Any head holding the secret verifies any key with
    no lookup: it recomputes the signature and compares in constant time. One
    name is revoked through the revocation list; every key is rotated at once
    by changing the secret (`rotate_secret`).

    Names match ``[a-z0-9][a-z0-9_.]{0,62}``: no hyphen, so the name ends at the
    first hyphen after ``sk-shoal-`` and the signature (whose base64url alphabet
    has hyphens) is everything after it. Lower case only, so ``Alice`` and
    ``alice`` cannot be two keys with one policy entry.

Files (thin adapters; the policy code is pure)
    ``$SHOAL_HOME/fleet/keys.secret``   32 random bytes as 64 hex chars, 0600,
                                        beside the fleet token
    ``$SHOAL_HOME/fleet/revoked.json``  ``{"format": "shoal-revoked", "version": 1,
                                        "names": [...]}``, 0600; changed under a lock
                                        (``revoked.json.lock``, `engine.filelock`)
    ``$SHOAL_HOME/keys.policy.json``    per-key limits (JSON, or TOML when the
                                        path ends in ``.toml``)::

        {"default": {"rpm": 60, "burst": 10, "concurrent": 4},
         "keys": {"alice": {"rpm": 600, "burst": 50, "concurrent": 8}}}

    A key's entry may give only some fields; the others come from ``default``.

    A running head watches all three (`FileWatch`), so issuing, revoking,
    rotating and editing the policy apply within a second, with no restart. The
    keys secret, like the token, is refused when other users may read it.

Limits
    `Limiter` keeps, per key name, a token bucket (`engine.head.access.limits`: ``rpm``
    per minute sustained, ``burst`` at once) and the number of requests in
    flight (at most ``concurrent``). Time is passed in. A request refused for
    concurrency takes no token and is told to retry in 1 s (nobody knows when a
    running request ends); one refused for rate is told when a token is back,
    rounded up. State is per head and bounded (least recently used names are
    dropped first, those with requests in flight last): a dropped name starts
    again with a full bucket, which only an issued key can profit from.

CORS
    `origin_allowed`: no ``Origin`` header (curl, SDKs, editors) is always
    allowed; a browser origin must be listed: exactly (``https://app.example``),
    by ``*``, or with a port wildcard (``http://localhost:*`` also matches
    ``http://localhost`` with no port). The default allow-list is empty.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from engine import nesting
from engine.filelock import exclusive, lock_path
from engine.files import hex_secret, read_secret_file, write_private
from engine.head.access.limits import Bucket, fresh, take

KEY_PREFIX = "sk-shoal-"
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
SIGNATURE_CHARS = 43  # base64url of 32 bytes, unpadded
MAX_KEY_LEN = len(KEY_PREFIX) + 63 + 1 + SIGNATURE_CHARS
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.]{0,62}")
REVOKED_FORMAT = "shoal-revoked"
CONCURRENCY_RETRY_S = 1
MAX_RETRY_S = 86_400
DEFAULT_CORS_ALLOW: tuple[str, ...] = ()
T = TypeVar("T")


class KeysError(ValueError):
    """A refused key operation or an unusable keys file; one line, cause and fix."""


# -- paths -------------------------------------------------------------------------


def _home(home: Path | None) -> Path:
    if home is not None:
        return home
    from engine.settings import default_home
    return default_home()


def secret_path(home: Path | None = None) -> Path:
    return _home(home) / "fleet" / "keys.secret"


def revoked_path(home: Path | None = None) -> Path:
    return _home(home) / "fleet" / "revoked.json"


def policy_path(home: Path | None = None) -> Path:
    return _home(home) / "keys.policy.json"


# -- keys --------------------------------------------------------------------------


def valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def check_name(name: str) -> str:
    if not valid_name(name):
        raise KeysError(f"key name {name!r} is not allowed; use 1 to 63 characters of "
                        "a-z, 0-9, '_' and '.', starting with a letter or digit")
    return name


def _check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise KeysError(f"the keys secret has {len(secret)} bytes, fewer than "
                        f"{MIN_SECRET_BYTES}; make one with load_or_make_secret")


def _signature(secret: bytes, name: str) -> str:
    mac = hmac.new(secret, name.encode("ascii"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")


def issue_key(secret: bytes, name: str) -> str:
    """The key of ``name`` under ``secret`` (the same key every time)."""
    _check_secret(secret)
    check_name(name)
    return f"{KEY_PREFIX}{name}-{_signature(secret, name)}"


def key_name(key: str) -> str | None:
    """The name a key claims (unverified), None when it is not shaped like a key."""
    if len(key) > MAX_KEY_LEN or not key.startswith(KEY_PREFIX):
        return None
    name, sep, _ = key[len(KEY_PREFIX):].partition("-")
    return name if sep and valid_name(name) else None


def verify_key(secret: bytes, key: str, revoked: frozenset[str]) -> str | None:
    """The name of a genuine, unrevoked key; None otherwise. No lookup beyond
    ``revoked``; the signature is compared in constant time."""
    _check_secret(secret)
    if not key.isascii():
        return None
    name = key_name(key)
    if name is None:
        return None
    presented = key[len(KEY_PREFIX) + len(name) + 1:]
    if not hmac.compare_digest(presented, _signature(secret, name)):
        return None
    return None if name in revoked else name


def static_key_ok(expected: str | None, presented: str | None) -> bool:
    """``--api-key``: True when no static key is set, else when ``presented`` is
    that key (constant-time compare)."""
    if expected is None:
        return True
    if presented is None:
        return False
    try:
        given = presented.encode("utf-8")
    except UnicodeEncodeError:  # a header byte that is not UTF-8 (a surrogate here)
        return False
    return hmac.compare_digest(expected.encode("utf-8"), given)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


# -- files -------------------------------------------------------------------------


def read_secret(path: Path) -> bytes | None:
    """The keys secret at ``path``, None when absent; refused when malformed or open
    to other users (anyone who reads it can mint every key)."""
    raw = read_secret_file(path, "the keys secret", KeysError)
    if raw is None:
        return None
    data = hex_secret(raw.decode("ascii", errors="replace"), SECRET_BYTES)
    if data is None:
        raise KeysError(f"{path} does not hold a keys secret (64 hex characters); "
                        "delete it to make a new one (every issued key stops working)")
    return data


def load_or_make_secret(path: Path) -> bytes:
    """The keys secret at ``path``, made (32 random bytes, 0600) when absent.
    Two processes racing to make it end with the same secret."""
    existing = read_secret(path)
    if existing is not None:
        return existing
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        made = write_private(path, secret.hex().encode("ascii") + b"\n", replace=False)
    except OSError as exc:
        raise KeysError(f"cannot write the keys secret at {path}: {exc.strerror}; "
                        "check the permissions of its folder") from None
    if made:
        return secret
    again = read_secret(path)
    assert again is not None
    return again


def rotate_secret(path: Path) -> bytes:
    """Replace the keys secret: every key issued so far stops working."""
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        write_private(path, secret.hex().encode("ascii") + b"\n")
    except OSError as exc:
        raise KeysError(f"cannot write the keys secret at {path}: {exc.strerror}; "
                        "check the permissions of its folder") from None
    return secret


def parse_revoked(text: str | bytes, *, source: str = "the revocation list") -> frozenset[str]:
    fix = "fix the file or move it aside (then revoke the names again)"
    try:
        doc = nesting.json_loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeysError(f"{source} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(doc, dict) or doc.get("format") != REVOKED_FORMAT:
        raise KeysError(f"{source} is not a Shoal revocation list "
                        f"(no \"format\": \"{REVOKED_FORMAT}\"); {fix}")
    names = doc.get("names")
    if not isinstance(names, list) or not all(valid_name(n) for n in names):
        raise KeysError(f"{source} needs \"names\": a list of key names; {fix}")
    return frozenset(names)


def load_revoked(path: Path) -> frozenset[str]:
    """The revoked names at ``path``; empty when the file does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return frozenset()
    except OSError as exc:
        raise KeysError(f"cannot read the revocation list at {path}: {exc.strerror}; "
                        "check its permissions") from None
    return parse_revoked(data, source=f"revocation list {path}")


def _save_revoked(path: Path, names: frozenset[str]) -> None:
    doc = {"format": REVOKED_FORMAT, "version": 1, "names": sorted(names)}
    try:
        write_private(path, (json.dumps(doc, indent=1) + "\n").encode("ascii"))
    except OSError as exc:
        raise KeysError(f"cannot write the revocation list at {path}: {exc.strerror}; "
                        "check the permissions of its folder") from None


def _change_revoked(path: Path, change: Callable[[frozenset[str]], frozenset[str]]) -> bool:
    """Read the list, change it, write it back, as one step: under `exclusive`, so two
    revocations at once (threads, or two `shoal keys revoke`) both land. False when
    ``change`` left the list as it was (nothing is written)."""
    try:
        with exclusive(path):
            names = load_revoked(path)
            changed = change(names)
            if changed == names:
                return False
            _save_revoked(path, changed)
            return True
    except OSError as exc:  # the lock file: reading and writing name their own errors
        raise KeysError(f"cannot lock the revocation list at {lock_path(path)}: "
                        f"{exc.strerror}; check the permissions of its folder") from None


def revoke(path: Path, name: str) -> bool:
    """Add ``name`` to the revocation list; False when it was already there. Blocking (a
    file lock, an fsync): off the event loop."""
    check_name(name)
    return _change_revoked(path, lambda names: names | {name})


def unrevoke(path: Path, name: str) -> bool:
    """Take ``name`` off the revocation list; False when it was not there."""
    check_name(name)
    return _change_revoked(path, lambda names: names - {name})


Stamp = tuple[int, int, int]  # (mtime_ns, size, inode)
WATCH_EVERY_S = 0.5  # a change reaches a running head within this (plus one request)


def file_stamp(path: Path) -> Stamp | None:
    """What tells a changed file apart, None when it does not exist. The inode
    catches an atomic replacement (every Shoal writer renames a new file into
    place) even when the size and the mtime's granularity would not."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class FileWatch(Generic[T]):
    """A value loaded from one file and re-loaded when the file changes, so
    `shoal keys issue`, `revoke` and a rotated secret reach a running head
    without a restart.

    ``current(now)`` stats the file at most once per ``every_s`` (time passed
    in) and reads it only when its stamp changed: cheap enough to call from the
    request path. A file that turns unreadable or corrupt keeps the last good
    value, its error kept in ``error`` for the log; a missing file gives
    ``missing``. ``seen`` tells whether the file ever existed at a check.
    """

    def __init__(self, path: Path, load: Callable[[Path], T], missing: T, *,
                 every_s: float = WATCH_EVERY_S) -> None:
        self.path = path
        self.every_s = every_s
        self.error: str | None = None
        self.seen = False
        self.value: T = missing
        self._load = load
        self._missing = missing
        self._stamp: Stamp | None = None
        self._checked: float | None = None

    def current(self, now: float) -> T:
        if self._checked is not None and 0 <= now - self._checked < self.every_s:
            return self.value
        self._checked = now
        try:
            stamp = file_stamp(self.path)
        except OSError as exc:
            self.error = f"cannot read {self.path}: {exc.strerror}; check its permissions"
            return self.value
        if stamp is None:
            self.value, self._stamp, self.error = self._missing, None, None
            return self.value
        self.seen = True
        if stamp == self._stamp and self.error is None:
            return self.value
        try:
            self.value = self._load(self.path)
            self.error = None
        except KeysError as exc:
            self.error = str(exc)
        self._stamp = stamp
        return self.value


class RevokedWatcher(FileWatch[frozenset[str]]):
    """The revocation list at a path, re-read when the file changes."""

    def __init__(self, path: Path, *, every_s: float = WATCH_EVERY_S) -> None:
        super().__init__(path, load_revoked, frozenset(), every_s=every_s)


# -- policy ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limits:
    rpm: float  # sustained requests per minute
    burst: int  # requests that may arrive at once
    concurrent: int  # requests in flight at once

    @property
    def rate_per_s(self) -> float:
        return self.rpm / 60.0


DEFAULT_LIMITS = Limits(rpm=60.0, burst=10, concurrent=4)
_LIMIT_FIELDS = ("rpm", "burst", "concurrent")


def _limits_from(data: object, base: Limits, where: str) -> Limits:
    if not isinstance(data, Mapping):
        raise KeysError(f"{where} must be an object like "
                        '{"rpm": 60, "burst": 10, "concurrent": 4}')
    extra = sorted(set(data) - set(_LIMIT_FIELDS))
    if extra:
        raise KeysError(f"{where} has unknown fields {extra}; use rpm, burst and concurrent")
    rpm = data.get("rpm", base.rpm)
    if (isinstance(rpm, bool) or not isinstance(rpm, int | float)
            or not math.isfinite(rpm) or rpm <= 0):
        raise KeysError(f"{where}: rpm must be a number above 0")
    values = {}
    for key in ("burst", "concurrent"):
        value = data.get(key, getattr(base, key))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KeysError(f"{where}: {key} must be a whole number of at least 1")
        values[key] = value
    return Limits(rpm=float(rpm), burst=values["burst"], concurrent=values["concurrent"])


@dataclass(frozen=True)
class Policy:
    default: Limits = DEFAULT_LIMITS
    keys: Mapping[str, Limits] = field(default_factory=dict)

    def limits_for(self, name: str) -> Limits:
        return self.keys.get(name, self.default)

    @classmethod
    def from_dict(cls, data: object, *, source: str = "the key policy") -> Policy:
        if not isinstance(data, Mapping):
            raise KeysError(f"{source} must be an object with \"default\" and \"keys\"")
        extra = sorted(set(data) - {"default", "keys"})
        if extra:
            raise KeysError(f"{source} has unknown fields {extra}; use default and keys")
        default = _limits_from(data.get("default", {}), DEFAULT_LIMITS, f"{source} default")
        raw_keys = data.get("keys", {})
        if not isinstance(raw_keys, Mapping):
            raise KeysError(f"{source} keys must be an object of key name -> limits")
        keys: dict[str, Limits] = {}
        for name, limits in raw_keys.items():
            if not valid_name(name):
                raise KeysError(f"{source} names key {name!r}, which no key can have; "
                                "use the lower-case name given to `shoal keys issue`")
            keys[name] = _limits_from(limits, default, f"{source} key {name!r}")
        return cls(default=default, keys=keys)


def load_policy(path: Path) -> Policy:
    """The policy at ``path`` (JSON, or TOML for ``*.toml``); the defaults when
    the file does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Policy()
    except OSError as exc:
        raise KeysError(f"cannot read the key policy at {path}: {exc.strerror}; "
                        "check its permissions") from None
    source = f"key policy {path}"
    try:
        doc: object = (nesting.toml_loads(data.decode("utf-8")) if path.suffix == ".toml"
                       else nesting.json_loads(data))
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeysError(f"{source} cannot be parsed ({exc}); fix the syntax") from None
    return Policy.from_dict(doc, source=source)


# -- limiter -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admission:
    ok: bool
    retry_after_s: int = 0  # for Retry-After when refused
    reason: str = ""  # "" when admitted, else "rate" or "concurrency"
    message: str = ""  # one line for the 429 body


ADMITTED = Admission(ok=True)


@dataclass(slots=True)
class _KeyState:
    bucket: Bucket
    in_flight: int = 0


class Limiter:
    """Per-key token buckets and concurrency caps; state in memory, time passed in.
    Call `release` once for every admitted request when it ends."""

    def __init__(self, policy: Policy | None = None, *, max_tracked: int = 10_000) -> None:
        if max_tracked < 1:
            raise ValueError("max_tracked must be at least 1")
        self.policy = Policy() if policy is None else policy
        self.max_tracked = max_tracked
        self._state: OrderedDict[str, _KeyState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._state)

    def in_flight(self, name: str) -> int:
        st = self._state.get(name)
        return 0 if st is None else st.in_flight

    def admit(self, name: str, now: float) -> Admission:
        limits = self.policy.limits_for(name)
        st = self._state.get(name)
        if st is None:
            self._evict(room_for=1)
            st = _KeyState(fresh(now, float(limits.burst)))
            self._state[name] = st
        else:
            self._state.move_to_end(name)
        if st.in_flight >= limits.concurrent:
            return Admission(
                ok=False, retry_after_s=CONCURRENCY_RETRY_S, reason="concurrency",
                message=(f"key {name!r} already has {st.in_flight} requests running, its "
                         f"limit; retry when one ends or raise \"concurrent\" in the policy"))
        ok, st.bucket, wait = take(st.bucket, now, limits.rate_per_s, float(limits.burst))
        if not ok:
            retry = MAX_RETRY_S if not math.isfinite(wait) else min(
                MAX_RETRY_S, max(1, math.ceil(wait)))
            return Admission(
                ok=False, retry_after_s=retry, reason="rate",
                message=(f"key {name!r} is over its rate limit ({limits.rpm:g} requests per "
                         f"minute, burst {limits.burst}); retry in {retry} s"))
        st.in_flight += 1
        return ADMITTED

    def release(self, name: str) -> None:
        st = self._state.get(name)
        if st is not None and st.in_flight > 0:
            st.in_flight -= 1

    def _evict(self, *, room_for: int) -> None:
        while self._state and len(self._state) + room_for > self.max_tracked:
            victim = next((n for n, s in self._state.items() if s.in_flight == 0),
                          next(iter(self._state)))
            del self._state[victim]


# -- CORS --------------------------------------------------------------------------

_ORIGIN_RE = re.compile(
    r"(?P<base>[a-z][a-z0-9+.\-]*://(?:\[[0-9a-f:.]+\]|[a-z0-9\-._~%!$&'()*+,;=]+))"
    r"(?::(?P<port>[0-9]{1,5}))?")


def _split_origin(origin: str) -> tuple[str, str | None] | None:
    m = _ORIGIN_RE.fullmatch(origin.lower())
    if m is None:
        return None
    return m.group("base"), m.group("port")


def check_cors_pattern(pattern: str) -> str:
    """``pattern`` when it is ``*``, ``null``, an origin, or an origin with ``:*``."""
    p = pattern.strip().rstrip("/").lower()
    if p in ("*", "null"):
        return p
    if p.endswith(":*"):
        ok = _split_origin(p[:-2]) == (p[:-2], None)
    else:
        ok = _split_origin(p) is not None
    if not ok:
        raise KeysError(f"CORS origin {pattern!r} is not an origin; write it like "
                        "https://app.example, http://localhost:* or *")
    return p


def parse_allow_list(spec: str) -> tuple[str, ...]:
    """A comma-separated allow-list (``--cors-allow``), each entry checked."""
    return tuple(check_cors_pattern(p) for p in spec.split(",") if p.strip())


def origin_allowed(origin: str | None, allow: Sequence[str] = DEFAULT_CORS_ALLOW) -> bool:
    """Whether a request with this ``Origin`` header may be answered."""
    if origin is None:
        return True
    o = origin.strip().lower()
    parts = _split_origin(o)
    for raw in allow:
        p = raw.strip().rstrip("/").lower()
        if p == "*" or p == o:
            return True
        if p.endswith(":*") and parts is not None and parts[0] == p[:-2]:
            return True
    return False

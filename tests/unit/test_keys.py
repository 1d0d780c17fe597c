from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.head.access.keys import (
    DEFAULT_LIMITS,
    KEY_PREFIX,
    Admission,
    FileWatch,
    KeysError,
    Limiter,
    Limits,
    Policy,
    RevokedWatcher,
    bearer_token,
    check_cors_pattern,
    issue_key,
    key_name,
    load_or_make_secret,
    load_policy,
    load_revoked,
    origin_allowed,
    parse_allow_list,
    policy_path,
    read_secret,
    revoke,
    revoked_path,
    rotate_secret,
    secret_path,
    static_key_ok,
    unrevoke,
    verify_key,
)

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
NONE: frozenset[str] = frozenset()

# -- keys --------------------------------------------------------------------------


def test_issue_and_verify() -> None:
    key = issue_key(SECRET, "alice")
    assert key.startswith("sk-shoal-alice-")
    assert len(key) == len("sk-shoal-alice-") + 43
    assert issue_key(SECRET, "alice") == key  # stateless: the same key every time
    assert verify_key(SECRET, key, NONE) == "alice"
    assert key_name(key) == "alice"


@pytest.mark.parametrize("name", ["a", "bob_2", "team.ci", "0", "x" * 63])
def test_names_that_may_have_keys(name: str) -> None:
    assert verify_key(SECRET, issue_key(SECRET, name), NONE) == name


@pytest.mark.parametrize("name", ["", "Alice", "a-b", "_a", ".a", "a b", "x" * 64, "é"])
def test_names_that_may_not(name: str) -> None:
    with pytest.raises(KeysError, match="is not allowed") as exc:
        issue_key(SECRET, name)
    assert "\n" not in str(exc.value)


def test_tampered_signature_fails() -> None:
    key = issue_key(SECRET, "alice")
    flipped = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert verify_key(SECRET, flipped, NONE) is None
    assert verify_key(SECRET, key[:-1], NONE) is None  # truncated
    assert verify_key(SECRET, key + "A", NONE) is None  # extended
    assert verify_key(SECRET, key + "=", NONE) is None  # padded


def test_key_for_one_name_does_not_work_for_another() -> None:
    sig = issue_key(SECRET, "alice").rsplit("-", 1)[-1]
    assert verify_key(SECRET, f"{KEY_PREFIX}admin-{sig}", NONE) is None


def test_key_under_another_secret_fails() -> None:
    assert verify_key(OTHER, issue_key(SECRET, "alice"), NONE) is None


def test_revoked_name_fails() -> None:
    key = issue_key(SECRET, "alice")
    assert verify_key(SECRET, key, frozenset({"alice"})) is None
    assert verify_key(SECRET, issue_key(SECRET, "bob"), frozenset({"alice"})) == "bob"


@pytest.mark.parametrize(
    "key",
    ["", "sk-shoal-", "sk-shoal-alice", "sk-shoal-alice-", "sk-other-alice-abc",
     "Bearer sk-shoal-alice-x", "sk-shoal-Alice-abc", "sk-shoal-alicé-abc",
     "sk-shoal-alice-é" + "a" * 42, "sk-shoal-" + "a" * 500],
)
def test_garbage_is_refused_without_error(key: str) -> None:
    assert verify_key(SECRET, key, NONE) is None


@given(st.text(max_size=200))
def test_verify_never_raises(key: str) -> None:
    assert verify_key(SECRET, key, NONE) is None


def test_a_weak_secret_is_refused() -> None:
    with pytest.raises(KeysError, match="fewer than"):
        issue_key(b"short", "alice")


def test_secret_file_is_made_once_and_private(tmp_path: Path) -> None:
    path = secret_path(tmp_path)
    assert path == tmp_path / "fleet" / "keys.secret"
    s1 = load_or_make_secret(path)
    assert len(s1) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(path.read_text().strip()) == 64
    assert load_or_make_secret(path) == s1
    assert sorted(p.name for p in path.parent.iterdir()) == ["keys.secret"]


def test_rotation_invalidates_old_keys(tmp_path: Path) -> None:
    path = secret_path(tmp_path)
    old = load_or_make_secret(path)
    key = issue_key(old, "alice")
    new = rotate_secret(path)
    assert new != old and load_or_make_secret(path) == new
    assert verify_key(new, key, NONE) is None
    assert verify_key(new, issue_key(new, "alice"), NONE) == "alice"


def test_corrupt_secret_is_refused(tmp_path: Path) -> None:
    path = secret_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("not hex\n")
    path.chmod(0o600)
    with pytest.raises(KeysError, match="does not hold a keys secret"):
        load_or_make_secret(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602])
def test_secret_file_open_to_other_users_is_refused(tmp_path: Path, mode: int) -> None:
    # whoever reads the secret can mint every key: refuse it like ssh refuses a key file
    path = secret_path(tmp_path)
    made = load_or_make_secret(path)
    path.chmod(mode)
    with pytest.raises(KeysError) as exc:
        read_secret(path)
    message = str(exc.value)
    assert f"(mode {mode:04o}); run `chmod 600 {path}`" in message
    assert made.hex() not in message and "\n" not in message
    path.chmod(0o600)
    assert read_secret(path) == made


def test_revocation_list_file(tmp_path: Path) -> None:
    path = revoked_path(tmp_path)
    assert path == tmp_path / "fleet" / "revoked.json"
    assert load_revoked(path) == frozenset()
    assert revoke(path, "alice") is True
    assert revoke(path, "alice") is False
    assert revoke(path, "bob") is True
    assert load_revoked(path) == {"alice", "bob"}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text())["names"] == ["alice", "bob"]
    assert unrevoke(path, "alice") is True and unrevoke(path, "alice") is False
    assert load_revoked(path) == {"bob"}
    with pytest.raises(KeysError):
        revoke(path, "Not-A-Name")


def test_corrupt_revocation_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "revoked.json"
    path.write_text("{")
    with pytest.raises(KeysError, match="not valid JSON") as exc:
        load_revoked(path)
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)
    path.write_text('{"format": "shoal-revoked", "version": 1, "names": ["A B"]}')
    with pytest.raises(KeysError, match="list of key names"):
        load_revoked(path)


def test_revoked_watcher_sees_changes(tmp_path: Path) -> None:
    path = tmp_path / "revoked.json"
    w = RevokedWatcher(path, every_s=0.5)
    assert w.current(0.0) == frozenset()
    revoke(path, "alice")
    assert w.current(0.1) == frozenset()  # checked at most every 0.5 s
    assert w.current(0.5) == {"alice"}
    path.write_text("garbage that is longer than before")
    assert w.current(1.0) == {"alice"}  # the last good list is kept
    assert w.error is not None and "not valid JSON" in w.error
    revoke(path.with_name("other.json"), "x")
    os.replace(path.with_name("other.json"), path)
    assert w.current(1.5) == {"x"} and w.error is None
    path.unlink()
    assert w.current(2.0) == frozenset() and w.seen


def test_a_same_size_replacement_within_one_mtime_tick_is_seen(tmp_path: Path) -> None:
    # (mtime, size) alone misses it: coarse file system clocks, equal-length names
    path = tmp_path / "revoked.json"
    revoke(path, "alice")
    w = RevokedWatcher(path, every_s=0.0)
    assert w.current(0.0) == {"alice"}
    before = path.stat()
    other = path.with_name("other.json")
    revoke(other, "bobby")
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(other, path)
    assert path.stat().st_size == before.st_size
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    assert w.current(1.0) == {"bobby"}


def test_file_watch_of_the_keys_secret(tmp_path: Path) -> None:
    path = secret_path(tmp_path)
    reads: list[Path] = []

    def load(p: Path) -> bytes | None:
        reads.append(p)
        return read_secret(p)

    w: FileWatch[bytes | None] = FileWatch(path, load, None, every_s=1.0)
    assert w.current(0.0) is None and not w.seen and reads == []
    first = load_or_make_secret(path)
    assert w.current(0.5) is None  # not looked at again yet
    assert w.current(1.0) == first and w.seen and len(reads) == 1
    assert w.current(2.0) == first and len(reads) == 1  # unchanged: a stat, no read
    second = rotate_secret(path)
    assert w.current(3.0) == second and len(reads) == 2
    path.write_text("broken\n")
    path.chmod(0o600)
    assert w.current(4.0) == second and w.error is not None  # the last good one is kept
    path.unlink()
    assert w.current(5.0) is None and w.seen and w.error is None
    third = load_or_make_secret(path)
    assert w.current(4.5) == third  # a clock that went back looks again


# -- static key and bearer ----------------------------------------------------------


def test_static_key() -> None:
    assert static_key_ok(None, None) and static_key_ok(None, "anything")
    assert static_key_ok("s3cret", "s3cret")
    assert not static_key_ok("s3cret", "s3cre")
    assert not static_key_ok("s3cret", None)
    assert not static_key_ok("s3cret", "sécret")  # non-ASCII does not raise


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token(None) is None


# -- policy ------------------------------------------------------------------------


def test_policy_defaults_when_the_file_is_missing(tmp_path: Path) -> None:
    p = load_policy(policy_path(tmp_path))
    assert policy_path(tmp_path) == tmp_path / "keys.policy.json"
    assert p.limits_for("anyone") == DEFAULT_LIMITS == Limits(60.0, 10, 4)


def test_policy_overrides(tmp_path: Path) -> None:
    path = policy_path(tmp_path)
    path.write_text(json.dumps({
        "default": {"rpm": 30, "burst": 5, "concurrent": 2},
        "keys": {"alice": {"rpm": 600, "burst": 50, "concurrent": 8},
                 "bob": {"concurrent": 1}},
    }))
    p = load_policy(path)
    assert p.limits_for("alice") == Limits(600.0, 50, 8)
    assert p.limits_for("bob") == Limits(30.0, 5, 1)  # the rest from default
    assert p.limits_for("carol") == Limits(30.0, 5, 2)


def test_policy_in_toml(tmp_path: Path) -> None:
    path = tmp_path / "keys.policy.toml"
    path.write_text('[default]\nrpm = 120\n[keys.alice]\nburst = 3\n')
    p = load_policy(path)
    assert p.limits_for("x") == Limits(120.0, 10, 4)
    assert p.limits_for("alice") == Limits(120.0, 3, 4)


@pytest.mark.parametrize(
    ("doc", "cause"),
    [
        ({"default": {"rpm": 0}}, "rpm must be a number above 0"),
        ({"default": {"burst": 0}}, "burst must be a whole number"),
        ({"default": {"concurrent": 1.5}}, "concurrent must be a whole number"),
        ({"default": {"rmp": 5}}, "unknown fields"),
        ({"keyz": {}}, "unknown fields"),
        ({"keys": {"Alice": {}}}, "which no key can have"),
        ({"keys": {"alice": 5}}, "must be an object"),
        ([], "must be an object"),
    ],
)
def test_bad_policy_is_refused(tmp_path: Path, doc: object, cause: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(KeysError, match=cause) as exc:
        load_policy(path)
    assert "\n" not in str(exc.value)


def test_unparsable_policy(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{")
    with pytest.raises(KeysError, match="cannot be parsed"):
        load_policy(path)


# -- limiter -----------------------------------------------------------------------


def _limiter(rpm: float = 60, burst: int = 3, concurrent: int = 100) -> Limiter:
    return Limiter(Policy(default=Limits(rpm, burst, concurrent)))


def test_burst_then_refusal_with_retry_after() -> None:
    lim = _limiter(rpm=60, burst=3)  # one token per second
    for _ in range(3):
        assert lim.admit("alice", 0.0).ok
    refused = lim.admit("alice", 0.0)
    assert refused == Admission(ok=False, retry_after_s=1, reason="rate",
                                message=refused.message)
    assert "rate limit" in refused.message and "\n" not in refused.message
    assert lim.admit("bob", 0.0).ok  # per key


def test_retry_after_is_rounded_up() -> None:
    lim = _limiter(rpm=6, burst=1)  # one token every 10 s
    assert lim.admit("a", 0.0).ok
    assert lim.admit("a", 2.5).retry_after_s == 8
    assert lim.admit("a", 9.99).retry_after_s == 1


def test_refill_after_time_passes() -> None:
    lim = _limiter(rpm=60, burst=3)
    for _ in range(3):
        assert lim.admit("alice", 100.0).ok
    assert not lim.admit("alice", 100.5).ok
    assert lim.admit("alice", 101.0).ok
    assert not lim.admit("alice", 101.0).ok
    for _ in range(3):  # a long pause refills up to the burst, no more
        assert lim.admit("alice", 1000.0).ok
    assert not lim.admit("alice", 1000.0).ok


def test_concurrency_cap_and_release() -> None:
    lim = _limiter(rpm=6000, burst=100, concurrent=2)
    assert lim.admit("alice", 0.0).ok and lim.admit("alice", 0.0).ok
    refused = lim.admit("alice", 0.0)
    assert (refused.ok, refused.reason, refused.retry_after_s) == (False, "concurrency", 1)
    assert lim.in_flight("alice") == 2
    lim.release("alice")
    assert lim.in_flight("alice") == 1
    assert lim.admit("alice", 0.0).ok
    lim.release("alice")
    lim.release("alice")
    lim.release("alice")
    lim.release("alice")  # extra releases do not go below zero
    assert lim.in_flight("alice") == 0
    lim.release("never-seen")


def test_a_refusal_for_concurrency_takes_no_token() -> None:
    lim = _limiter(rpm=60, burst=2, concurrent=1)
    assert lim.admit("a", 0.0).ok
    for _ in range(5):
        assert lim.admit("a", 0.0).reason == "concurrency"
    lim.release("a")
    assert lim.admit("a", 0.0).ok  # the second burst token is still there


def test_limiter_uses_per_key_policy() -> None:
    lim = Limiter(Policy(default=Limits(60, 1, 1), keys={"alice": Limits(60, 3, 3)}))
    assert [lim.admit("alice", 0.0).ok for _ in range(4)] == [True, True, True, False]
    assert [lim.admit("bob", 0.0).ok for _ in range(2)] == [True, False]


def test_limiter_state_is_bounded() -> None:
    lim = Limiter(Policy(default=Limits(60, 1, 5)), max_tracked=3)
    assert lim.admit("busy", 0.0).ok  # stays in flight
    for i in range(10):
        assert lim.admit(f"k{i}", 0.0).ok
        lim.release(f"k{i}")
    assert len(lim) == 3
    assert lim.in_flight("busy") == 1  # names with requests in flight go last
    assert not lim.admit("k9", 0.0).ok  # the most recent names keep their buckets
    assert lim.admit("k0", 0.0).ok  # a dropped name starts again with a full bucket
    assert len(lim) == 3


# -- CORS --------------------------------------------------------------------------


def test_no_origin_is_allowed_and_the_default_list_is_empty() -> None:
    assert origin_allowed(None, ())
    assert origin_allowed(None)
    assert not origin_allowed("https://evil.example")
    assert not origin_allowed("http://localhost:3000")


def test_exact_origins() -> None:
    allow = ["https://app.example", "http://127.0.0.1:5173/"]
    assert origin_allowed("https://app.example", allow)
    assert origin_allowed("HTTPS://APP.EXAMPLE", allow)
    assert origin_allowed("http://127.0.0.1:5173", allow)
    assert not origin_allowed("http://app.example", allow)
    assert not origin_allowed("https://app.example:8443", allow)
    assert not origin_allowed("https://app.example.evil", allow)
    assert not origin_allowed("null", allow)


def test_star_allows_every_origin() -> None:
    assert origin_allowed("https://anything.example", ["*"])
    assert origin_allowed("null", ["*"])


def test_port_wildcards() -> None:
    allow = ["http://localhost:*"]
    assert origin_allowed("http://localhost:3000", allow)
    assert origin_allowed("http://localhost", allow)
    assert not origin_allowed("https://localhost:3000", allow)
    assert not origin_allowed("http://localhost.evil.example:3000", allow)
    assert not origin_allowed("http://evil.example/http://localhost:1", allow)
    assert origin_allowed("http://[::1]:8080", ["http://[::1]:*"])


def test_allow_list_parsing() -> None:
    assert parse_allow_list("https://a.example, http://localhost:*,") == (
        "https://a.example", "http://localhost:*")
    assert check_cors_pattern("*") == "*"
    for bad in ("localhost:3000", "http://", "http://a.example/path", "http://a:*:*"):
        with pytest.raises(KeysError, match="is not an origin"):
            check_cors_pattern(bad)

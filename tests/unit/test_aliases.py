from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.head.naming.aliases import (
    HISTORY_LIMIT,
    RETRY_AFTER_S,
    AliasEntry,
    AliasError,
    AliasStore,
    AliasTable,
    Resolution,
    load,
    resolve,
    save,
)

# -- versions, history, revert, rm -------------------------------------------------


def test_versions_count_up() -> None:
    t = AliasTable()
    e1 = t.set("coder", "qwen3:8b", (), now=1.0, origin="h1")
    e2 = t.set("coder", "gemma3:270m", ("qwen3:8b",), now=2.0, origin="h1")
    assert (e1.version, e2.version) == (1, 2)
    assert t.lookup("coder") == e2
    assert e2.fallbacks == ("qwen3:8b",)
    assert e2.updated_at == 2.0 and e2.origin == "h1"
    assert [e.name for e in t.entries()] == ["coder"]


def test_setting_the_same_value_is_a_no_op() -> None:
    t = AliasTable()
    e1 = t.set("coder", "m1", ("m2",), now=1.0, origin="h1")
    assert t.set("coder", "m1", ["m2"], now=5.0, origin="h2") == e1
    assert len(t.history("coder")) == 1


def test_history_is_kept_and_bounded() -> None:
    t = AliasTable()
    for i in range(HISTORY_LIMIT + 7):
        t.set("a", f"m{i}", (), now=float(i), origin="h1")
    hist = t.history("a")
    assert len(hist) == HISTORY_LIMIT
    assert [e.version for e in hist] == list(range(8, HISTORY_LIMIT + 8))
    assert hist[-1].target == f"m{HISTORY_LIMIT + 6}"
    assert t.history("nope") == []


def test_revert_swaps_back_as_a_new_version() -> None:
    t = AliasTable()
    t.set("a", "m1", ("f1",), now=1.0, origin="h1")
    t.set("a", "m2", (), now=2.0, origin="h1")
    r = t.revert("a", now=3.0, origin="h2")
    assert (r.target, r.fallbacks, r.version, r.origin) == ("m1", ("f1",), 3, "h2")
    r2 = t.revert("a", now=4.0, origin="h2")  # and back again
    assert (r2.target, r2.version) == ("m2", 4)


def test_revert_skips_identical_versions() -> None:
    t = AliasTable()
    t.set("a", "m1", (), now=1.0, origin="h1")
    t.set("a", "m2", (), now=2.0, origin="h1")
    t.merge([AliasEntry("a", "m2", (), 3, 3.0, "h2")])  # same value, newer version
    assert t.revert("a", now=4.0, origin="h1").target == "m1"


def test_revert_without_an_earlier_version_is_refused() -> None:
    t = AliasTable()
    with pytest.raises(AliasError, match="no alias named"):
        t.revert("a", now=1.0, origin="h1")
    t.set("a", "m1", (), now=1.0, origin="h1")
    with pytest.raises(AliasError, match="no earlier version") as exc:
        t.revert("a", now=2.0, origin="h1")
    assert "\n" not in str(exc.value) and "shoal alias set" in str(exc.value)


def test_rm_then_set_again_continues_the_count() -> None:
    t = AliasTable()
    t.set("a", "m1", (), now=1.0, origin="h1")
    tomb = t.remove("a", now=2.0, origin="h1")
    assert tomb.removed and tomb.version == 2 and tomb.fallbacks == ()
    assert t.lookup("a") is None and t.entries() == []
    assert t.get("a") == tomb and t.snapshot() == [tomb]
    with pytest.raises(AliasError, match="no alias named"):
        t.remove("a", now=3.0, origin="h1")
    again = t.set("a", "m1", (), now=3.0, origin="h1")
    assert again.version == 3 and t.lookup("a") == again


def test_revert_after_rm_restores() -> None:
    t = AliasTable()
    t.set("a", "m1", ("f",), now=1.0, origin="h1")
    t.remove("a", now=2.0, origin="h1")
    r = t.revert("a", now=3.0, origin="h1")
    assert (r.target, r.fallbacks, r.version) == ("m1", ("f",), 3)


@pytest.mark.parametrize(
    ("name", "target", "fallbacks", "cause"),
    [
        ("a", "a", (), "cannot target itself"),
        ("a", "m", ("a",), "cannot fall back to itself"),
        ("a", "m", ("m",), "already its target"),
        ("a", "m", ("f", "f"), "given twice"),
        ("my alias", "m", (), "whitespace"),
        ("a", "m\tx", (), "whitespace"),
        ("a", "m\x00", (), "control character"),
        ("", "m", (), "empty"),
        ("a" * 201, "m", (), "201 characters"),
        ("a", "m", "f", "list of model names"),
    ],
)
def test_validation(name: str, target: str, fallbacks: tuple[str, ...], cause: str) -> None:
    t = AliasTable()
    with pytest.raises(AliasError, match=cause) as exc:
        t.set(name, target, fallbacks, now=1.0, origin="h1")
    msg = str(exc.value)
    assert "\n" not in msg and ";" in msg  # one line: the cause; the fix
    assert t.snapshot() == []


def test_long_names_up_to_the_limit_are_fine() -> None:
    t = AliasTable()
    assert t.set("a" * 200, "org/repo:Q4_K_M", (), now=1.0, origin="h1").version == 1


# -- merge between heads -----------------------------------------------------------


def test_diverged_heads_converge_in_both_directions() -> None:
    h1, h2 = AliasTable(), AliasTable()
    h1.set("shared", "m1", (), now=1.0, origin="h1")
    h2.merge(h1.snapshot())
    # apart: both change "shared" (same version), each adds its own alias, h1 removes one
    h1.set("shared", "m2", (), now=10.0, origin="h1")
    h2.set("shared", "m3", ("m1",), now=11.0, origin="h2")
    h1.set("only1", "x", (), now=12.0, origin="h1")
    h2.set("only2", "y", (), now=13.0, origin="h2")
    h2.set("gone", "z", (), now=14.0, origin="h2")
    h1.merge(h2.snapshot())
    h1.remove("gone", now=15.0, origin="h1")
    assert h1.digest() != h2.digest()

    a, b = h1.copy(), h2.copy()
    changed_a = a.merge(b.snapshot())
    changed_b = b.merge(a.snapshot())
    assert a.digest() == b.digest()
    assert a.snapshot() == b.snapshot()
    assert changed_a == []  # h1 already had h2's changes
    assert changed_b == ["gone", "only1"]

    # and starting from the other side
    c, d = h2.copy(), h1.copy()
    c.merge(d.snapshot())
    d.merge(c.snapshot())
    assert c.digest() == d.digest() == a.digest()

    # the tie on "shared" (both version 2) goes to the later change
    shared = a.lookup("shared")
    assert shared is not None and (shared.target, shared.version) == ("m3", 2)
    assert a.lookup("gone") is None and a.get("gone") is not None


def test_tie_break_is_total() -> None:
    x = AliasEntry("a", "m1", (), 2, 5.0, "h1")
    y = AliasEntry("a", "m2", (), 2, 5.0, "h2")  # same version and time: the head id decides
    t1, t2 = AliasTable([x]), AliasTable([y])
    t1.merge([y])
    t2.merge([x])
    assert t1.lookup("a") == t2.lookup("a") == y


def test_a_head_that_was_off_catches_up(tmp_path: Path) -> None:
    path_b = tmp_path / "b" / "aliases.json"
    a, b = AliasTable(), AliasTable()
    a.set("coder", "m1", (), now=1.0, origin="a")
    b.merge(a.snapshot())
    save(path_b, b)
    # b is off; a changes things meanwhile
    a.set("coder", "m2", ("m1",), now=2.0, origin="a")
    a.set("chat", "g", (), now=3.0, origin="a")
    a.remove("chat", now=4.0, origin="a")
    a.set("new", "n", (), now=5.0, origin="a")
    # b comes back: it serves its last table first...
    b2 = load(path_b)
    assert b2.lookup("coder") is not None and b2.lookup("coder").target == "m1"  # type: ignore[union-attr]
    assert not b2.holds("coder", 2)
    # ...then catches up on the first exchange
    changed = b2.merge(a.snapshot())
    assert changed == ["chat", "coder", "new"]
    assert b2.digest() == a.digest()
    assert b2.holds("coder", 2)
    assert b2.merge(a.snapshot()) == []


def test_merge_refuses_a_malformed_entry_as_a_whole() -> None:
    t = AliasTable()
    good = AliasEntry("a", "m", (), 1, 1.0, "h1")
    bad = AliasEntry("b", "b", (), 1, 1.0, "h1")  # targets itself
    with pytest.raises(AliasError):
        t.merge([good, bad])
    assert t.snapshot() == []
    with pytest.raises(AliasError):
        t.merge([AliasEntry("a", "m", (), 0, 1.0, "h1")])


def test_merge_of_a_full_history_keeps_newer_versions_in_history() -> None:
    a = AliasTable()
    for i in range(1, 4):
        a.set("x", f"m{i}", (), now=float(i), origin="a")
    b = AliasTable()
    b.set("x", "m1", (), now=1.0, origin="a")
    assert b.merge(a.all_entries()) == ["x"]
    assert [e.version for e in b.history("x")] == [1, 2, 3]


def test_import_sets_new_versions() -> None:
    old = AliasTable()
    old.set("coder", "m1", (), now=1.0, origin="a")
    old.set("chat", "c1", (), now=1.0, origin="a")
    t = AliasTable()
    for i in range(5):
        t.set("coder", f"z{i}", (), now=2.0 + i, origin="b")
    t.set("chat", "c1", (), now=3.0, origin="b")
    exported = AliasTable.from_json(old.to_json()).all_entries()
    assert t.import_entries(exported, now=10.0, origin="b") == ["coder"]
    coder = t.lookup("coder")
    assert coder is not None and (coder.target, coder.version) == ("m1", 6)


entries_strategy = st.lists(
    st.builds(
        AliasEntry,
        name=st.sampled_from(["a", "b", "c"]),
        target=st.one_of(st.none(), st.sampled_from(["m1", "m2", "m3"])),
        fallbacks=st.just(()),
        version=st.integers(1, 4),
        updated_at=st.sampled_from([0.0, 1.0, 2.0]),
        origin=st.sampled_from(["h1", "h2"]),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(entries_strategy, entries_strategy, entries_strategy)
def test_merge_is_commutative_associative_and_idempotent(
    xs: list[AliasEntry], ys: list[AliasEntry], zs: list[AliasEntry]
) -> None:
    ab = AliasTable(xs)
    ab.merge(ys)
    ba = AliasTable(ys)
    ba.merge(xs)
    assert ab.snapshot() == ba.snapshot()
    assert ab.digest() == ba.digest()
    before = ab.digest()
    assert ab.merge(ys) == [] and ab.merge(xs) == [] and ab.merge(ab.snapshot()) == []
    assert ab.digest() == before
    # associativity: (x + y) + z == x + (y + z)
    left = ab.copy()
    left.merge(zs)
    yz = AliasTable(ys)
    yz.merge(zs)
    right = AliasTable(xs)
    right.merge(yz.snapshot())
    assert left.digest() == right.digest()


# -- persistence -------------------------------------------------------------------


def test_json_round_trip() -> None:
    t = AliasTable()
    t.set("coder", "qwen3:8b", ("gemma3:270m", "smollm2"), now=1.5, origin="h1")
    t.set("coder", "qwen3:14b", (), now=2.5, origin="h2")
    t.set("chat", "m", (), now=3.0, origin="h1")
    t.remove("chat", now=4.0, origin="h1")
    text = t.to_json()
    doc = json.loads(text)
    assert doc["format"] == "shoal-aliases" and doc["version"] == 1
    back = AliasTable.from_json(text)
    assert back.all_entries() == t.all_entries()
    assert back.digest() == t.digest()


def test_store_round_trip_survives_reload(tmp_path: Path) -> None:
    path = tmp_path / "home" / "aliases.json"
    store = AliasStore(path)
    assert store.load().snapshot() == []  # missing file: empty table
    t = store.load()
    t.set("coder", "qwen3:8b", ("smollm2",), now=1.0, origin="h1")
    store.save(t)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["aliases.json"]  # no temp left
    # a "restart": a fresh store object reading the same file
    t2 = AliasStore(path).load()
    assert t2.digest() == t.digest()
    t2.set("coder", "qwen3:14b", (), now=2.0, origin="h1")
    AliasStore(path).save(t2)
    t3 = AliasStore(path).load()
    assert [e.version for e in t3.history("coder")] == [1, 2]


@pytest.mark.parametrize(
    ("content", "cause"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "not a Shoal alias table"),
        (b'{"format": "shoal-aliases", "version": 99, "aliases": []}', "newer Shoal"),
        (b'{"format": "shoal-aliases", "version": 1}', "no \"aliases\" list"),
        (b'{"format": "shoal-aliases", "version": 1, "aliases": [{"name": "a"}]}',
         "version must be"),
        (b'{"format": "shoal-aliases", "version": 1, "aliases": '
         b'[{"name": "a", "target": "a", "fallbacks": [], "version": 1, '
         b'"updated_at": 1, "origin": "h"}]}', "cannot target itself"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_corrupt_file_is_refused_in_one_line(tmp_path: Path, content: bytes, cause: str) -> None:
    path = tmp_path / "aliases.json"
    path.write_bytes(content)
    with pytest.raises(AliasError, match=cause) as exc:
        load(path)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg


# -- resolution --------------------------------------------------------------------


def _table() -> AliasTable:
    t = AliasTable()
    t.set("coder", "qwen3:8b", ("gemma3:270m", "smollm2:135m"), now=1.0, origin="h1")
    return t


def test_alias_resolves_to_its_served_target() -> None:
    r = resolve("coder", table=_table(), served={"qwen3:8b": True, "gemma3:270m": True})
    assert r == Resolution(requested="coder", model="qwen3:8b", alias="coder", free=True)


def test_full_target_queues_rather_than_falls_back() -> None:
    r = resolve("coder", table=_table(), served={"qwen3:8b": False, "gemma3:270m": True})
    assert (r.model, r.alias, r.fallback, r.free) == ("qwen3:8b", "coder", False, False)
    assert not r.unavailable


def test_first_served_fallback_in_order() -> None:
    t = _table()
    r = resolve("coder", table=t, served={"smollm2:135m": True, "gemma3:270m": False})
    assert (r.model, r.alias, r.fallback, r.free) == ("gemma3:270m", "coder", True, False)
    r = resolve("coder", table=t, served={"smollm2:135m": True, "other": True})
    assert (r.model, r.fallback) == ("smollm2:135m", True)


def test_nothing_served_is_unavailable_with_retry_after() -> None:
    r = resolve("coder", table=_table(), served={"other": True})
    assert r.unavailable and r.retry_after == RETRY_AFTER_S == 5
    assert r.model is None and r.alias == "coder"
    assert "\n" not in r.message and "coder" in r.message


def test_unknown_name() -> None:
    r = resolve("nope", table=_table(), served={"qwen3:8b": True})
    assert r.unknown and r.model is None and r.alias is None
    assert "nope" in r.message


def test_removed_alias_is_unknown() -> None:
    t = _table()
    t.remove("coder", now=2.0, origin="h1")
    assert resolve("coder", table=t, served={"qwen3:8b": True}).unknown


def test_real_model_name_wins_over_an_alias() -> None:
    t = AliasTable()
    t.set("qwen3:8b", "gemma3:270m", (), now=1.0, origin="h1")
    r = resolve("qwen3:8b", table=t, served={"qwen3:8b": False, "gemma3:270m": True})
    assert (r.model, r.alias, r.free) == ("qwen3:8b", None, False)
    # once no node serves the real model, the alias applies
    r = resolve("qwen3:8b", table=t, served={"gemma3:270m": True})
    assert (r.model, r.alias) == ("gemma3:270m", "qwen3:8b")


def test_a_real_model_is_served_without_aliases() -> None:
    r = resolve("qwen3:8b", table=AliasTable(), served={"qwen3:8b": True})
    assert (r.model, r.alias, r.free) == ("qwen3:8b", None, True)


def test_loose_names_for_real_models() -> None:
    served = {"qwen3:8b": True}
    for spelled in ("qwen3:8b", "Qwen3:8B", "qwen3-8b", "QWEN3-8B"):
        assert resolve(spelled, table=AliasTable(), served=served).model == "qwen3:8b"


def test_loose_names_for_aliases_and_targets() -> None:
    t = AliasTable()
    t.set("Stable:Coder", "Qwen3:8B", ("Gemma3:270M",), now=1.0, origin="h1")
    r = resolve("stable-coder", table=t, served={"qwen3:8b": True})
    assert (r.model, r.alias) == ("qwen3:8b", "Stable:Coder")
    r = resolve("STABLE:CODER", table=t, served={"gemma3:270m": True})
    assert (r.model, r.alias, r.fallback) == ("gemma3:270m", "Stable:Coder", True)


def test_loose_tiers_between_real_names_and_aliases() -> None:
    t = AliasTable()
    t.set("qwen3-8b", "gemma3:270m", (), now=1.0, origin="h1")
    served = {"qwen3:8b": True, "gemma3:270m": True}
    # an alias named exactly as requested beats a real model reached through the hyphen
    assert resolve("qwen3-8b", table=t, served=served).alias == "qwen3-8b"
    # a real model matched more strictly wins
    r = resolve("QWEN3:8B", table=t, served=served)
    assert (r.model, r.alias) == ("qwen3:8b", None)
    # and at the same looseness too
    t.set("a-b:c", "gemma3:270m", (), now=1.0, origin="h1")
    r = resolve("a-b-c", table=t, served={"a:b-c": True, "gemma3:270m": True})
    assert (r.model, r.alias) == ("a:b-c", None)

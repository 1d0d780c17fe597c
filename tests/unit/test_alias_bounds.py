"""The alias table is bounded, so that it always crosses a link to another head: at most
MAX_ALIASES names and MAX_TABLE_BYTES as sent; a change past either is refused in one
line with the fix (413 over HTTP), a removal never is; removals older than
TOMBSTONE_TTL_S are purged, and the merge stays commutative, associative and idempotent;
an import is checked whole and pushed to the other heads once."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.head.commands import AliasCommands
from engine.head.fleet.links import Fleet
from engine.head.fleet.peers import HeadPeers
from engine.head.fleet.sessions import SessionRunner
from engine.head.head import Head
from engine.head.naming import aliases as al
from engine.head.naming.aliases import AliasEntry, AliasError, AliasTable
from engine.head.prompt.model import load_head_model
from engine.link import messages as m
from engine.link.connection import NEED_DATA, LinkConnection

WIDE = "\U0001d538"  # printable, 4 bytes in UTF-8: the widest a name's character gets
ORIGIN = "h" * al.MAX_NAME_LEN
DAY = 86400.0


def widest(tag: str) -> str:
    return tag + WIDE * (al.MAX_NAME_LEN - len(tag))


def fill(table: AliasTable, *, tries: int = 1000) -> AliasError | None:
    """Set aliases as large as an alias can be until the table refuses one."""
    for i in range(tries):
        try:
            table.set(widest(f"a{i}-"), widest(f"t{i}-"),
                      [widest(f"f{i}-{j}-") for j in range(al.MAX_FALLBACKS)],
                      now=1.0, origin=ORIGIN)
        except AliasError as exc:
            return exc
    return None


def opened() -> tuple[LinkConnection, LinkConnection]:
    """Two ends of a link, handshake done (sans-IO, with a token)."""
    token = bytes(range(32))
    ini = LinkConnection(initiator=True, psk=token)
    res = LinkConnection(initiator=False, psk=token)
    res.receive_data(ini.initiate(now=0.0))
    assert res.next_event() is not NEED_DATA
    ini.receive_data(res.handshake_reply())
    assert ini.next_event() is not NEED_DATA
    return ini, res


# -- the bounds --------------------------------------------------------------------------


def test_a_table_at_the_bound_crosses_a_link() -> None:
    table = AliasTable()
    refused = fill(table)
    assert refused is not None, "a table of 1000 of the largest aliases was taken"
    assert "over its limit" in str(refused) and "shoal alias rm" in str(refused)
    from engine.head.fleet.peers import SYNC_LIMIT

    data = table.sync_json()
    assert len(data) == table.sync_size() <= al.MAX_TABLE_BYTES < SYNC_LIMIT
    assert AliasTable.from_json(data).digest() == table.digest()  # what a peer reads
    # the largest table a head makes goes through a real link's sending and receiving ends
    ini, res = opened()
    res.receive_data(ini.send(m.AliasSync(table=data, reply=True, serial=7)))
    got = res.next_event()
    assert isinstance(got, m.AliasSync) and got.table == data and got.serial == 7


def test_names_are_bounded_in_number_and_length() -> None:
    table = AliasTable()
    with pytest.raises(AliasError, match="201 characters long; use at most 200"):
        table.set("a" * (al.MAX_NAME_LEN + 1), "m", (), now=1.0, origin="h")
    refused = None
    for i in range(5000):
        try:
            table.set(f"n{i}", "m", (), now=1.0, origin="h")
        except AliasError as exc:
            refused = exc
            break
    assert refused is not None, "5000 names were taken"
    assert "its limit" in str(refused) and "shoal alias rm" in str(refused)
    assert table.names == al.MAX_ALIASES
    # a full table still takes changes to its names, and removals
    assert table.set("n0", "other", (), now=2.0, origin="h").version == 2
    assert table.remove("n1", now=2.0, origin="h").removed
    with pytest.raises(al.AliasTableFull):  # a removed name still counts ...
        table.set("new", "m", (), now=3.0, origin="h")
    # ... until its removal is old enough to be purged
    assert table.set("new", "m", (), now=2.0 + al.TOMBSTONE_TTL_S + 1, origin="h").version == 1
    assert table.get("n1") is None and table.names == al.MAX_ALIASES


def test_a_merge_is_never_refused_and_a_removal_shrinks_an_oversized_table() -> None:
    big, other = AliasTable(), AliasTable()
    assert fill(big) is not None
    for i in range(40):
        other.set(widest(f"b{i}-"), widest("t-"),
                  [widest(f"g{i}-{j}-") for j in range(al.MAX_FALLBACKS)], now=1.0,
                  origin=ORIGIN)
    assert big.merge(other.snapshot())  # two tables that grew apart, together
    assert big.sync_size() > al.MAX_TABLE_BYTES
    with pytest.raises(al.AliasTableFull, match="over its limit"):
        big.set("small", "m", (), now=2.0, origin="h")
    before = big.sync_size()
    big.remove(widest("b0-"), now=2.0, origin="h")
    assert big.sync_size() < before


def test_old_removals_are_purged_at_the_next_change() -> None:
    table = AliasTable()
    table.set("gone", "m", (), now=0.0, origin="h")
    table.remove("gone", now=1.0, origin="h")
    table.set("kept", "m", (), now=1.0, origin="h")
    table.set("other", "m", (), now=1.0 + al.TOMBSTONE_TTL_S - DAY, origin="h")
    assert table.get("gone") is not None  # younger than the TTL: kept
    table.set("later", "m", (), now=2.0 + al.TOMBSTONE_TTL_S, origin="h")
    assert table.get("gone") is None and table.history("gone") == []
    assert [e.name for e in table.snapshot()] == ["kept", "later", "other"]
    assert table.sync_size() == len(table.sync_json())


def test_a_merge_at_now_takes_old_removals_as_absent() -> None:
    now = 100 * DAY
    old_removal = AliasEntry("x", None, (), 3, now - al.TOMBSTONE_TTL_S - 1, "h2")
    fresh_removal = AliasEntry("y", None, (), 3, now - DAY, "h2")
    mine = AliasTable([AliasEntry("y", "m", (), 2, 1.0, "h1")])
    assert mine.merge([old_removal, fresh_removal], now=now) == ["y"]
    assert mine.get("x") is None and mine.get("y") == fresh_removal


entries = st.lists(
    st.builds(
        AliasEntry,
        name=st.sampled_from(["a", "b", "c"]),
        target=st.one_of(st.none(), st.sampled_from(["m1", "m2"])),
        fallbacks=st.just(()),
        version=st.integers(1, 4),
        updated_at=st.sampled_from([0.0, 5.0, 31 * DAY]),
        origin=st.sampled_from(["h1", "h2"]),
    ),
    max_size=10,
)


@settings(max_examples=150, deadline=None)
# at these times the removals made at 0 and 5 s are older than the TTL (30 days), and
# those made at 31 days are not
@given(entries, entries, entries, st.sampled_from([31 * DAY + 1.0, 31 * DAY + 7.0]))
def test_a_merge_at_now_is_commutative_associative_and_idempotent(
        xs: list[AliasEntry], ys: list[AliasEntry], zs: list[AliasEntry], now: float) -> None:
    def table(es: list[AliasEntry]) -> AliasTable:
        t = AliasTable()
        t.merge(es, now=now)
        return t

    ab, ba = table(xs), table(ys)
    ab.merge(ys, now=now)
    ba.merge(xs, now=now)
    assert ab.digest() == ba.digest()
    before = ab.digest()
    assert ab.merge(ys, now=now) == [] and ab.merge(xs, now=now) == []
    assert ab.merge(ab.snapshot(), now=now) == [] and ab.digest() == before
    left = ab.copy()
    left.merge(zs, now=now)
    yz = table(ys)
    yz.merge(zs, now=now)
    right = table(xs)
    right.merge(yz.snapshot(), now=now)
    assert left.digest() == right.digest()
    assert left.sync_size() == len(left.sync_json())


# -- an import ---------------------------------------------------------------------------


class CountedPeers(HeadPeers):
    """The head's links to other heads (none linked here), counting the pushes."""

    def __init__(self) -> None:
        super().__init__(head_id="h-import", model="mock-m", psk=None, listen_port=0,
                         table=AliasTable, on_merged=lambda _names: None)
        self.pushes = 0

    async def spread(self, entries: object) -> tuple[int, int]:  # type: ignore[override]
        self.pushes += 1
        return await super().spread(entries)  # type: ignore[arg-type]


def make_head(path: Path) -> Head:
    model = load_head_model("mock", "mock-m", name="mock-m")
    fleet = Fleet(model=model.name, head_id="h-import", psk=None)
    return Head([model], fleet, SessionRunner(fleet), aliases_path=path,
                aliases=AliasTable())


async def test_an_import_of_many_names_is_pushed_once(tmp_path: Path) -> None:
    source = AliasTable()
    for i in range(300):
        source.set(f"coder-{i}", f"model-{i}", (), now=1.0, origin="h-other")
    head = make_head(tmp_path / "aliases.json")
    peers = head.peers = CountedPeers()
    try:
        result = await AliasCommands(head, clock=lambda: 5.0).import_table(
            source.to_json().encode())
        assert len(result.imported) == 300 and len(head.aliases) == 300
        assert peers.pushes == 1
    finally:
        await head.close()


async def test_an_import_past_the_bound_is_refused_whole(tmp_path: Path) -> None:
    from engine.errors import CommandError

    head = make_head(tmp_path / "aliases.json")
    head.aliases.set("mine", "m", (), now=1.0, origin="h")
    source = AliasTable()
    for i in range(al.MAX_ALIASES):
        source.set(f"n{i}", "m", (), now=1.0, origin="h-other")
    try:
        with pytest.raises(CommandError, match="its limit") as exc:
            await AliasCommands(head, clock=lambda: 5.0).import_table(
                source.to_json().encode())
        assert exc.value.code == "alias_table_full"
        assert [e.name for e in head.aliases.entries()] == ["mine"]  # nothing taken
    finally:
        await head.close()

"""What the tray shows, as pure functions of a view (snapshot, prefs, start phase), and the
rate limit of notifications: tables, no Qt loop, no engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.notify import Coalescer
from app.prefs import Prefs
from app.tray import TrayView, look, menu_entries, status_line, tooltip
from engine.snapshot import FleetSnapshot, LocalNodeSnapshot, NodeSnapshot, Roles


def node(key: str = "local", *, lanes: int = 8, busy: int = 0, state: str = "ready"
         ) -> NodeSnapshot:
    return NodeSnapshot(key=key, identity=key, address="127.0.0.1:1", link="local",
                        state=state, model="m", runtime="mock",  # type: ignore[arg-type]
                        context_window=4096, lanes=lanes, lanes_busy=busy, own_sessions=busy,
                        kv_used=0, kv_total=0, prefill_tps=0, decode_tps=0, ttft_ms=0,
                        last_seen=0, sessions_total=0, peak_busy=0, connections=lanes,
                        error=None)


def local(state: str = "serving", busy: int = 0) -> LocalNodeSnapshot:
    return LocalNodeSnapshot(state=state, identity="me", model="m",  # type: ignore[arg-type]
                             runtime="mock", path="m", context_window=4096,
                             window_pinned=False, lanes=8, lanes_busy=busy,
                             address="127.0.0.1:1", listening=False, encrypted=True,
                             heads=(), linked=())


def snap(*nodes: NodeSnapshot, head: bool = True, member: bool = False,
         listen: str | None = None, name: str | None = None,
         mine: LocalNodeSnapshot | None = None, queued: int = 0) -> FleetSnapshot:
    roles = Roles(head=head, api_url="http://127.0.0.1:8453/v1" if head else None,
                  fleet_listen=listen, node=mine or local(), member=member)
    return FleetSnapshot(at=0, fleet_name=name, fleet_id="x", has_token=name is not None,
                         roles=roles, model="m", models=(), nodes=nodes if head else (),
                         heads=(), aliases=(), queued=queued, moves=0, pulls=())


def view(snapshot: FleetSnapshot, **kw: object) -> TrayView:
    return TrayView(snapshot=snapshot, prefs=Prefs(welcomed=True), **kw)  # type: ignore[arg-type]


FLEET = dict(listen="0.0.0.0:8454", name="desk")


@pytest.mark.parametrize(("v", "expected"), [
    (view(snap(node())), "lonely"),
    (view(snap(node(), **FLEET)), "serving"),
    (view(snap(node(), member=True, name="desk")), "serving"),
    (view(snap(node(busy=1), **FLEET)), "busy"),
    (view(snap(node(), queued=2, **FLEET)), "busy"),
    (view(snap(head=False, mine=local(busy=2))), "busy"),
    (view(snap(node(), **FLEET), phase="starting"), "busy"),
    (view(snap(node(busy=3), mine=local("paused"), **FLEET)), "paused"),
    (view(snap(node(), mine=local("failed"), **FLEET)), "error"),
    (view(snap(node(), **FLEET), phase="failed", problem="port 8453 is in use"), "error"),
    (view(snap(node(), mine=local("paused")), problem="Not linked with the fleet"), "error"),
    (view(snap(node()), rejoining=True), "serving"),
])
def test_the_icon_tells_the_state(v: TrayView, expected: str):
    assert look(v) == expected


@pytest.mark.parametrize(("v", "expected"), [
    (view(snap(node(busy=1), node("b", lanes=4, busy=4), node("c", state="unreachable"),
               **FLEET)), "desk · 2 nodes ready · 5/12 lanes busy"),
    (view(snap(node())), "Not in a fleet · 1 node ready · 0/8 lanes busy"),
    (view(snap(head=False, mine=local(busy=1), member=True, name="desk")),
     "desk · API off here · 1/8 lanes busy"),
    (view(snap(node(), mine=local("paused"), **FLEET)),
     "desk · 1 node ready · 0/8 lanes busy · paused"),
    (view(snap(), phase="starting", progress="preparing the model: 40 %"),
     "Starting: preparing the model: 40 %…"),
    (view(snap(), phase="starting"), "Starting: loading the model…"),
    (view(snap(), phase="failed", problem="x"), "Shoal is not running"),
])
def test_the_status_line(v: TrayView, expected: str):
    assert status_line(v) == expected
    assert tooltip(v).splitlines()[1] == expected


def entries(v: TrayView) -> dict[str, tuple[str, bool, bool]]:
    return {e.key: (e.text, e.enabled, e.checked) for e in menu_entries(v)}


def test_the_menu_while_starting_offers_only_what_works():
    shown = entries(view(snap(), phase="starting"))
    enabled = {k for k, (_, on, _) in shown.items() if on}
    assert enabled == {"open", "login", "quit"}


def test_the_menu_after_a_failed_start_shows_the_line():
    shown = entries(view(snap(head=False), phase="failed",
                         problem="port 8453 is in use; quit the other program"))
    assert shown["problem"] == ("port 8453 is in use; quit the other program", False, False)
    assert shown["status"][0] == "Shoal is not running"


def test_the_menu_checks_follow_the_snapshot_and_prefs():
    v = view(snap(node(), mine=local("paused"), **FLEET))
    shown = entries(replace(v, prefs=Prefs(start_at_login=True)))
    assert shown["api"][1:] == (True, True)
    assert shown["pause"][1:] == (True, True)
    assert shown["login"][1:] == (True, True)
    assert shown["leave"][1] is True
    off = entries(view(snap(head=False)))
    assert off["api"][1:] == (True, False)
    assert off["copy_api_url"] == ("Copy API URL (the API is off here)", False, False)
    assert entries(view(snap(node()), autostart=False))["login"][1] is False


def test_a_long_problem_is_cut_to_one_readable_line():
    shown = entries(view(snap(), problem="x" * 300))
    assert len(shown["problem"][0]) == 90 and shown["problem"][0].endswith("…")


def test_notifications_in_a_burst_become_one():
    c = Coalescer(gap_s=10)
    assert c.offer("a joined", now=100) == "a joined"
    assert c.offer("b joined", now=101) is None
    assert c.offer("c joined", now=102) is None
    assert c.due_at == 110
    assert c.flush(now=109) is None
    assert c.flush(now=110) == "c joined (and 1 more: Open Shoal to see them)"
    assert c.offer("d left", now=115) is None  # within the gap of the summary
    assert c.flush(now=120) == "d left"
    assert c.offer("e joined", now=131) == "e joined"
    assert c.due_at is None and c.flush(now=999) is None


def test_a_long_burst_shows_the_latest_and_a_count():
    c = Coalescer(gap_s=1)
    c.offer("first", now=0)
    for i in range(10_000):
        c.offer(f"line {i}", now=0.5)
    text = c.flush(now=1)
    assert text == "line 9999 (and 9999 more: Open Shoal to see them)"

"""The pure decisions of a node's model set: keep-alive as Ollama reads it, which models
make room for a new one, and which unload when."""

from __future__ import annotations

import pytest

from engine.node.model_set import (
    FOREVER,
    BadKeepAlive,
    Held,
    Load,
    Refuse,
    due_to_unload,
    keep_alive_seconds,
    next_unload,
    plan_load,
)
from engine.sizes import GiB, MiB


@pytest.mark.parametrize(("value", "seconds"), [
    (None, 300.0), (0, 0.0), ("0", 0.0), (-1, FOREVER), ("-1", FOREVER), ("-5m", FOREVER),
    (90, 90.0), (2.5, 2.5), ("90", 90.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("1.5h", 5400.0), ("250ms", 0.25), ("10s", 10.0),
])
def test_keep_alive_reads_as_ollama_does(value, seconds):
    assert keep_alive_seconds(value, 300.0) == seconds


@pytest.mark.parametrize("value", ["", "five minutes", "5 m", "5mm", "m", True, float("nan"),
                                   "1" * 100, "5d"])
def test_a_keep_alive_that_is_no_duration_is_refused(value):
    with pytest.raises(BadKeepAlive):
        keep_alive_seconds(value, 300.0)


def test_room_is_made_from_the_least_recently_used_idle_models():
    held = [Held("a", 1 * GiB, last_used=10), Held("b", 1 * GiB, last_used=5),
            Held("c", 1 * GiB, last_used=1, busy=1)]
    assert plan_load("d", 1 * GiB, held, budget=4 * GiB) == Load(())  # it fits already
    assert plan_load("d", 2 * GiB, held, budget=4 * GiB) == Load(("b",))
    assert plan_load("d", 3 * GiB, held, budget=4 * GiB) == Load(("b", "a"))  # never c


def test_a_model_that_cannot_fit_is_refused_with_the_numbers():
    held = [Held("a", 1 * GiB, last_used=1, busy=2)]
    refused = plan_load("big", 5 * GiB, held, budget=4 * GiB)
    assert isinstance(refused, Refuse)
    assert "big needs 5 GiB, more than this node's memory budget of 4 GiB" in refused.message
    busy = plan_load("mid", 3500 * MiB, held, budget=4 * GiB)
    assert isinstance(busy, Refuse)
    assert "only 3 GiB" in busy.message and "a (1 GiB)" in busy.message
    # what the process holds itself (its interpreter and libraries) is not the models'
    beside = plan_load("big", 3 * GiB, [], budget=4 * GiB, base=1536 * MiB)
    assert isinstance(beside, Refuse)
    assert ("big needs 3 GiB, more than this node's memory budget of 4 GiB leaves beside "
            "the 1.5 GiB the process holds") in beside.message
    assert plan_load("d", 2560 * MiB, [Held("a", GiB, 1)], budget=4 * GiB, base=GiB) == \
        Load(("a",))


def test_idle_models_unload_after_their_keep_alive_and_busy_ones_never():
    held = [Held("a", 1, last_used=0, keep_alive_s=300), Held("b", 1, last_used=100,
                                                              keep_alive_s=0),
            Held("c", 1, last_used=0, keep_alive_s=FOREVER),
            Held("d", 1, last_used=0, keep_alive_s=0, busy=1)]
    assert due_to_unload(held, now=50) == []
    assert due_to_unload(held, now=100) == ["b"]
    assert due_to_unload(held, now=300) == ["b", "a"]
    assert next_unload(held) == 100
    assert next_unload([Held("c", 1, 0, keep_alive_s=FOREVER)]) is None

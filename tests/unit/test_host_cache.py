"""The host-memory prompt cache (pure)."""

from __future__ import annotations

from engine.runtimes.host_cache import MIN_ENTRY, HostCache


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_the_longest_shared_prefix_wins_and_short_ones_are_not_kept() -> None:
    cache = HostCache(10_000)
    assert not cache.put(toks(0, MIN_ENTRY - 1), b"x")
    assert cache.put(toks(0, 100), b"a" * 100)
    assert cache.put(toks(1000, 200), b"b" * 200)
    hit = cache.best([*toks(1000, 150), 7, 7])
    assert hit is not None and hit.common == 150 and hit.state == b"b" * 200
    assert cache.best(toks(0, 10) + [5] * 100) is None  # shares fewer than MIN_ENTRY
    assert cache.best(toks(0, 100), better_than=100) is None  # no better than the lane


def test_lru_eviction_keeps_within_the_limit() -> None:
    cache = HostCache(300)
    cache.put(toks(0, 100), b"a" * 100)
    cache.put(toks(1000, 100), b"b" * 100)
    cache.put(toks(2000, 100), b"c" * 100)
    assert cache.best(toks(0, 100)) is not None  # the first is now the most recent
    cache.put(toks(3000, 100), b"d" * 100)
    assert cache.size <= 300 and len(cache) == 3
    assert cache.best(toks(1000, 100)) is None  # the least recently used went first
    assert not cache.put(toks(4000, 100), b"e" * 301)  # larger than the whole cache


def test_an_entry_that_extends_another_replaces_it() -> None:
    cache = HostCache(10_000)
    cache.put(toks(0, 100), b"a" * 100)
    cache.put(toks(0, 300), b"b" * 300)
    assert len(cache) == 1 and cache.size == 300
    hit = cache.best(toks(0, 80) + [9] * 10)
    assert hit is not None and hit.tokens == tuple(toks(0, 300)) and hit.common == 80


def test_room_is_made_before_a_state_is_made() -> None:
    cache = HostCache(300)
    cache.put(toks(0, 100), b"a" * 100)
    cache.put(toks(1000, 100), b"b" * 100)
    assert cache.make_room(toks(2000, 100), 200)
    assert cache.size + 200 <= 300 and len(cache) == 1  # the oldest went first
    assert not cache.make_room(toks(2000, 100), 301)  # larger than the whole cache
    assert not cache.make_room(toks(2000, MIN_ENTRY - 1), 10)  # too short to keep


def test_the_engine_frees_the_cache_before_it_copies_a_lane_out(monkeypatch) -> None:
    """The state buffer of a 32K lane of a large model is gigabytes: made before the
    eviction, the cache and it together passed the memory budget by that much."""
    from types import SimpleNamespace

    from engine.runtimes import llamacpp

    cache = HostCache(300)
    cache.put(toks(0, 100), b"a" * 150)
    cache.put(toks(1000, 100), b"b" * 150)
    held: list[int] = []  # the cache's bytes and the new state's, while both exist

    class Lib:
        def llama_state_seq_get_size(self, ctx: object, seq: int) -> int:
            return 200

        def llama_state_seq_get_data(self, ctx: object, buf: object, size: int,
                                     seq: int) -> int:
            held.append(cache.size + size)
            return size

    monkeypatch.setattr(llamacpp, "_lib", Lib)
    engine = object.__new__(llamacpp.LlamaCppEngine)
    engine._ctx, engine._host = None, cache
    state = engine._save(SimpleNamespace(seq=0, tokens=toks(2000, 100)))
    assert state is not None and len(state) == 200
    assert held and max(held) <= 300, held

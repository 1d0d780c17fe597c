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

"""The host-memory prompt cache: KV states of reclaimed prefixes, bounded, LRU.

When the pool needs the cells of a parked sequence, its KV state (as the runtime
serializes it) moves here under its tokens; a prompt that shares a long prefix
with an entry (the same conversation coming back, or another one with the same
agent system prompt and tools) is restored from it instead of prefilled again.

Pure: the runtime hands blobs in and out (anything with a length in bytes: llama.cpp's
state stays in the buffer it was written to, never copied). An entry that another one extends is
dropped (the longer one restores everything the shorter one would). The cache
never holds more than ``limit`` bytes; the least recently used entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Sized
from dataclasses import dataclass

from engine.runtimes.lanes import common_prefix

MIN_ENTRY = 64  # a shorter prefix costs less to prefill than to keep


@dataclass(frozen=True, slots=True)
class Hit:
    tokens: tuple[int, ...]  # the entry's tokens (what restoring puts in the lane)
    state: Sized
    common: int  # tokens the prompt shares with it


class HostCache:
    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 0)
        self._entries: OrderedDict[tuple[int, ...], Sized] = OrderedDict()
        self.size = 0

    def __len__(self) -> int:
        return len(self._entries)

    def make_room(self, tokens: Sequence[int], size: int) -> bool:
        """Before a state of ``size`` bytes for ``tokens`` is made: drop what the new entry
        replaces (its prefixes) and the oldest entries until it fits, so that the cache
        and the new state together never pass the limit (for a 32K lane of a large model
        the state is gigabytes). False when it cannot be kept at all."""
        key = tuple(tokens)
        if len(key) < MIN_ENTRY or size > self.limit:
            return False
        for old in [k for k in self._entries if len(k) <= len(key) and key[:len(k)] == k]:
            self._drop(old)  # a prefix of the new entry: the new one restores it all
        while self.size + size > self.limit and self._entries:
            self._drop(next(iter(self._entries)))
        return True

    def put(self, tokens: Sequence[int], state: Sized) -> bool:
        """Keep ``state`` for ``tokens``; False when it is too short or too large to keep."""
        if not self.make_room(tokens, len(state)):
            return False
        key = tuple(tokens)
        self._entries[key] = state
        self.size += len(state)
        return True

    def best(self, prompt: Sequence[int], *, better_than: int = 0) -> Hit | None:
        """The entry sharing the longest prefix with ``prompt``, if it shares more than
        ``better_than`` tokens and at least MIN_ENTRY; it becomes the most recent."""
        best_key: tuple[int, ...] | None = None
        best_common = max(better_than, MIN_ENTRY - 1)
        for key in self._entries:
            common = common_prefix(key, prompt)
            if common > best_common:
                best_key, best_common = key, common
        if best_key is None:
            return None
        self._entries.move_to_end(best_key)
        return Hit(best_key, self._entries[best_key], best_common)

    def _drop(self, key: tuple[int, ...]) -> None:
        self.size -= len(self._entries.pop(key))

"""Fleet-wide model aliases: a versioned table, its merge, and request resolution.

An alias is a stable name for a real model (``stable-coder -> qwen3:8b``) with
optional fallbacks. Every head keeps the whole table on disk; heads that meet
exchange their current entries and keep, per name, the higher version.

Everything here is pure except `AliasStore` (and `load`/`save`), the thin file
adapter, and `AliasWriter`, its one writer on a head's loop: the table never reads a
clock, callers pass ``now`` and their head id.

Versions and history
    Each change to a name (``set``, ``remove``, ``revert``) makes an entry with
    the previous version + 1 (the first is 1). A removal is a tombstone (target
    None) so that it, too, wins a merge against the older live entry; ``set``
    after ``rm`` continues the count. ``set`` with exactly the current target
    and fallbacks changes nothing and returns the current entry. The last
    `HISTORY_LIMIT` entries of every name are kept, oldest first.

Revert
    Makes a new, higher version carrying the target and fallbacks of the most
    recent earlier live entry that differs from the current one: revert twice
    and you are back where you started; revert after ``rm`` undoes the removal.

Merge and tie-break
    Per name, the entry with the larger `AliasEntry.order_key` wins:
    ``(version, updated_at, origin, live, target, fallbacks)``. Two heads that
    changed the same alias while apart both made version n+1; the one made
    later wins, then the larger head id, and the remaining fields make the
    order total, so merge is commutative, associative and idempotent: heads that
    exchange in any order end with the same table (the same `digest`).

Bounds and old removals
    A table holds at most `MAX_ALIASES` names and `MAX_TABLE_BYTES` as sent to
    another head (`sync_json`); a change that would grow it past either is refused
    (`AliasTableFull`, one line with the fix), a removal never is. Merges are
    never refused (refusing some would make the result depend on the order of
    exchanges), so tables that grew apart may together pass the bound until
    aliases are removed. A removal (tombstone) older than `TOMBSTONE_TTL_S` is
    purged at the next change or merge, and a merge given ``now`` treats such a
    removal as absent on either side: for a given ``now`` the merge stays
    commutative, associative and idempotent. The price, as with any purge of
    tombstones: a head that was away longer than the TTL, holding an alias that
    was removed meanwhile, brings it back when it returns.

Digest
    SHA-256 over every current entry (tombstones included) in name order: name,
    version, and also updated_at, origin, target and fallbacks, since two heads
    that tied on a version with different targets hold different tables.

Resolution (`resolve`), on every request, against ``served``: every model name
some node serves -> whether any of those nodes has a free lane now.

1. Loose names (`engine.head.naming.names`): tier by tier (exact, case-insensitive,
   hyphen as colon), a real model name wins over an alias matched in the same
   or a looser tier; an alias matched in a stricter tier wins over a real name
   matched only loosely (an alias named exactly ``qwen3-8b`` beats the served
   ``qwen3:8b`` reached through the hyphen rule).
2. An alias resolves to its target when any node serves it, even when no lane
   is free (the request queues for it; it does not fall back); else to the
   first fallback that is served; else it is unavailable (503, Retry-After 5).
   Targets and fallbacks are matched loosely against served names too, and are
   never aliases themselves (no chains).
3. Anything else is unknown (404).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import nesting
from engine.files import write_private
from engine.head.naming.names import match_name, match_name_tier

FORMAT = "shoal-aliases"
FORMAT_VERSION = 1
HISTORY_LIMIT = 50
MAX_NAME_LEN = 200
MAX_FALLBACKS = 16
MAX_ALIASES = 1024  # names in a table, removed ones (tombstones) included
# the current entries as a head sends them to another (`sync_json`): far under what one
# link record carries, so that a table made here always crosses a link
MAX_TABLE_BYTES = 1 << 20
TOMBSTONE_TTL_S = 30 * 86400.0  # how long a removal is kept for heads that were away
RETRY_AFTER_S = 5
FILE_NAME = "aliases.json"
log = logging.getLogger("shoal.head")


class AliasError(ValueError):
    """A refused alias operation or an unusable alias file; one line, cause and fix."""


class AliasTableFull(AliasError):
    """A change refused because the table would outgrow its bounds (MAX_ALIASES names,
    MAX_TABLE_BYTES as sent to another head)."""


_SPACE = re.compile(r"\s")


def _bad_char(value: str) -> str | None:
    # at C speed: a peer's table or an imported file checks thousands of names at once
    if _SPACE.search(value):
        return "whitespace"
    if not value.isprintable():
        return "a control character"
    return None


def check_model_name(value: object, what: str) -> str:
    """``value`` when it is model-name-like (1..200 characters, no whitespace or
    control characters), else AliasError naming ``what``."""
    if not isinstance(value, str):
        raise AliasError(f"{what} must be a string, not {type(value).__name__}; "
                         "give a model name such as qwen3:8b")
    if not value:
        raise AliasError(f"{what} is empty; give a model name such as qwen3:8b")
    if len(value) > MAX_NAME_LEN:
        raise AliasError(f"{what} is {len(value)} characters long; "
                         f"use at most {MAX_NAME_LEN}")
    bad = _bad_char(value)
    if bad is not None:
        raise AliasError(f"{what} {value!r} contains {bad}; "
                         "use a name without spaces or control characters")
    return value


def _check_origin(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_LEN:
        raise AliasError("alias entry origin must be a head id of 1 to "
                         f"{MAX_NAME_LEN} characters; pass the head's identity")
    if any(not ch.isprintable() for ch in value):
        raise AliasError("alias entry origin contains a control character; "
                         "pass the head's identity")
    return value


def _check_now(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AliasError("alias timestamp must be a finite number of seconds; "
                         "pass time.time()")
    return float(value)


def _check_fallbacks(name: str, target: str, fallbacks: object) -> tuple[str, ...]:
    if isinstance(fallbacks, str) or not isinstance(fallbacks, Sequence):
        raise AliasError(f"fallbacks of alias {name!r} must be a list of model names; "
                         "pass --fallback once per model")
    fallbacks = tuple(fallbacks)
    if len(fallbacks) > MAX_FALLBACKS:
        raise AliasError(f"alias {name!r} has {len(fallbacks)} fallbacks; "
                         f"keep at most {MAX_FALLBACKS}")
    seen: set[str] = set()
    for fb in fallbacks:
        check_model_name(fb, f"fallback of alias {name!r}")
        if fb == name:
            raise AliasError(f"alias {name!r} cannot fall back to itself; "
                             "name a real model as --fallback")
        if fb == target:
            raise AliasError(f"fallback {fb!r} of alias {name!r} is already its target; "
                             "drop it from --fallback")
        if fb in seen:
            raise AliasError(f"fallback {fb!r} of alias {name!r} is given twice; "
                             "give each fallback once")
        seen.add(fb)
    return tuple(fallbacks)


@dataclass(frozen=True, slots=True)
class AliasEntry:
    """One version of one alias; ``target`` None is a removal (a tombstone)."""

    name: str
    target: str | None
    fallbacks: tuple[str, ...]
    version: int
    updated_at: float
    origin: str

    @property
    def removed(self) -> bool:
        return self.target is None

    def order_key(self) -> tuple[int, float, str, bool, str, tuple[str, ...]]:
        """Total order of the entries of one name; the larger wins a merge."""
        return (self.version, self.updated_at, self.origin, self.target is not None,
                self.target or "", self.fallbacks)

    def same_value(self, other: AliasEntry) -> bool:
        return self.target == other.target and self.fallbacks == other.fallbacks

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "fallbacks": list(self.fallbacks),
                "version": self.version, "updated_at": self.updated_at,
                "origin": self.origin}

    def wire(self) -> bytes:
        """The entry as `AliasTable.sync_json` sends it (compact JSON)."""
        return json.dumps(self.to_dict(), separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")

    def expired(self, now: float) -> bool:
        """A removal older than TOMBSTONE_TTL_S: merges treat it as absent."""
        return self.target is None and self.updated_at < now - TOMBSTONE_TTL_S

    @classmethod
    def from_dict(cls, data: object) -> AliasEntry:
        if not isinstance(data, Mapping):
            raise AliasError("an alias entry must be an object; "
                             "restore the table from `shoal alias export`")
        extra = set(data) - {"name", "target", "fallbacks", "version", "updated_at", "origin"}
        if extra:
            raise AliasError(f"alias entry has unknown fields {sorted(extra)}; "
                             "restore the table from `shoal alias export`")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise AliasError("alias entry version must be an integer >= 1; "
                             "restore the table from `shoal alias export`")
        fallbacks = data.get("fallbacks", [])
        if not isinstance(fallbacks, list):
            raise AliasError("alias entry fallbacks must be a list; "
                             "restore the table from `shoal alias export`")
        return make_entry(name=data.get("name"), target=data.get("target"),
                          fallbacks=fallbacks, version=version,
                          updated_at=data.get("updated_at"), origin=data.get("origin"))


def make_entry(*, name: object, target: object, fallbacks: object, version: int,
               updated_at: object, origin: object) -> AliasEntry:
    """A validated entry (AliasError otherwise)."""
    n = check_model_name(name, "alias name")
    if target is None:
        if fallbacks not in ((), []):
            raise AliasError(f"removed alias {n!r} cannot keep fallbacks; "
                             "restore the table from `shoal alias export`")
        fbs: tuple[str, ...] = ()
        t: str | None = None
    else:
        t = check_model_name(target, f"target of alias {n!r}")
        if t == n:
            raise AliasError(f"alias {n!r} cannot target itself; "
                             "point it at a model that a node serves")
        fbs = _check_fallbacks(n, t, fallbacks)
    return AliasEntry(name=n, target=t, fallbacks=fbs,
                      version=version, updated_at=_check_now(updated_at),
                      origin=_check_origin(origin))


class AliasTable:
    """The versioned alias table of one head. Mutable, but deterministic: every
    method takes the time and the head id it needs, and reads nothing else."""

    def __init__(self, entries: Iterable[AliasEntry] = ()) -> None:
        self._history: dict[str, list[AliasEntry]] = {}
        self._wire: dict[str, bytes] = {}  # each name's current entry as sync_json sends it
        self._wire_bytes = 0  # their sum
        self._oldest_removal = math.inf  # at most the oldest current tombstone's time
        self.merge(entries)

    # -- reading -----------------------------------------------------------------

    def get(self, name: str) -> AliasEntry | None:
        """The current entry of ``name`` (a tombstone when removed), None if never set."""
        hist = self._history.get(name)
        return hist[-1] if hist else None

    def lookup(self, name: str) -> AliasEntry | None:
        """The current entry of ``name`` when it is live (not removed)."""
        entry = self.get(name)
        return None if entry is None or entry.removed else entry

    def entries(self) -> list[AliasEntry]:
        """The live aliases, by name."""
        return [e for e in self.snapshot() if not e.removed]

    def snapshot(self) -> list[AliasEntry]:
        """The current entry of every name, tombstones included, by name: what a
        head sends a peer so that removals propagate too."""
        return [hist[-1] for _, hist in sorted(self._history.items())]

    def history(self, name: str) -> list[AliasEntry]:
        """The kept versions of ``name``, oldest first ([] when never set)."""
        return list(self._history.get(name, ()))

    def all_entries(self) -> list[AliasEntry]:
        """Every kept version of every name, by name then version."""
        return [e for _, hist in sorted(self._history.items()) for e in hist]

    def holds(self, name: str, version: int) -> bool:
        """Whether this table has ``name`` at ``version`` or later (for `3/3 heads`)."""
        entry = self.get(name)
        return entry is not None and entry.version >= version

    def digest(self) -> str:
        rows = [[e.name, e.version, e.updated_at, e.origin, e.target, list(e.fallbacks)]
                for e in self.snapshot()]
        blob = json.dumps(rows, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(blob.encode("ascii")).hexdigest()

    def copy(self) -> AliasTable:
        other = AliasTable()
        other._history = {name: list(hist) for name, hist in self._history.items()}
        other._wire = dict(self._wire)
        other._wire_bytes = self._wire_bytes
        other._oldest_removal = self._oldest_removal
        return other

    def __len__(self) -> int:
        return len(self.entries())

    @property
    def names(self) -> int:
        """Names in the table, removed ones included (at most MAX_ALIASES by changes)."""
        return len(self._history)

    def sync_size(self, names: int | None = None, wire_bytes: int | None = None) -> int:
        """The length of :meth:`sync_json` (for a table of ``names`` names whose entries
        take ``wire_bytes``: this one by default), without making it."""
        n = self.names if names is None else names
        total = self._wire_bytes if wire_bytes is None else wire_bytes
        return len(_SYNC_HEAD) + total + max(n - 1, 0) + len(_SYNC_TAIL)

    def sync_json(self) -> bytes:
        """The current entries (tombstones included) as one head sends them to another:
        compact JSON that `from_json` reads, made from each entry's kept bytes."""
        return _SYNC_HEAD + b",".join(self._wire[name] for name in sorted(self._wire)) \
            + _SYNC_TAIL

    # -- changing ----------------------------------------------------------------

    def _append(self, *entries: AliasEntry) -> None:
        """Add ``entries`` (versions of one name, oldest first) to its history; the last
        becomes its current entry."""
        entry = entries[-1]
        hist = self._history.setdefault(entry.name, [])
        hist.extend(entries)
        if len(hist) > HISTORY_LIMIT:
            del hist[: len(hist) - HISTORY_LIMIT]
        wire = entry.wire()
        self._wire_bytes += len(wire) - len(self._wire.get(entry.name, b""))
        self._wire[entry.name] = wire
        if entry.target is None:
            self._oldest_removal = min(self._oldest_removal, entry.updated_at)

    def _drop(self, name: str) -> None:
        del self._history[name]
        self._wire_bytes -= len(self._wire.pop(name))

    def purge(self, now: float) -> list[str]:
        """Forget the names whose current entry is a removal older than TOMBSTONE_TTL_S
        (see the module's docstring); returns them, sorted."""
        cutoff = now - TOMBSTONE_TTL_S
        if self._oldest_removal >= cutoff:
            return []  # nothing can be old enough: no walk over the table
        gone = sorted(name for name, hist in self._history.items()
                      if hist[-1].expired(now))
        for name in gone:
            self._drop(name)
        self._oldest_removal = min((hist[-1].updated_at for hist in self._history.values()
                                    if hist[-1].target is None), default=math.inf)
        return gone

    def _check_room(self, entry: AliasEntry) -> None:
        """AliasTableFull when making ``entry`` current would grow the table past its
        bounds (a change that leaves it as large, or makes it smaller, is taken)."""
        current = self._wire.get(entry.name)
        names = self.names + (current is None)
        if names > MAX_ALIASES:
            raise AliasTableFull(
                f"the alias table holds {self.names} names, its limit (removed ones count "
                f"for {int(TOMBSTONE_TTL_S // 86400)} days, so that every head hears of "
                "the removal); remove aliases with `shoal alias rm NAME`, or reuse a name")
        wire_bytes = self._wire_bytes + len(entry.wire()) - len(current or b"")
        size = self.sync_size(names, wire_bytes)
        if size > MAX_TABLE_BYTES and size > self.sync_size():
            raise AliasTableFull(
                f"the alias table would take {size} bytes, over its limit of "
                f"{MAX_TABLE_BYTES} (every head sends it whole to the others); remove "
                "aliases with `shoal alias rm NAME`, or use fewer or shorter fallbacks")

    def _next_version(self, name: str) -> int:
        current = self.get(name)
        return 1 if current is None else current.version + 1

    def set(self, name: str, target: str, fallbacks: Sequence[str], now: float,
            origin: str) -> AliasEntry:
        """Point ``name`` at ``target`` (then ``fallbacks``) as a new version;
        AliasTableFull when the table has no room for it."""
        if target is None:
            raise AliasError(f"alias {name!r} needs a target; "
                             f"use `shoal alias rm {name}` to remove it")
        # the count goes on after a removal, even one about to be purged
        entry = make_entry(name=name, target=target, fallbacks=fallbacks,
                           version=self._next_version(name), updated_at=now, origin=origin)
        current = self.get(name)
        if current is not None and not current.removed and current.same_value(entry):
            return current
        self.purge(now)
        self._check_room(entry)
        self._append(entry)
        return entry

    def remove(self, name: str, now: float, origin: str) -> AliasEntry:
        """Remove ``name``: a tombstone with the next version (never refused for room)."""
        if self.lookup(name) is None:
            raise AliasError(f"there is no alias named {name!r}; "
                             "`shoal alias ls` lists the aliases")
        entry = make_entry(name=name, target=None, fallbacks=(),
                           version=self._next_version(name), updated_at=now, origin=origin)
        self.purge(now)
        self._append(entry)
        return entry

    def revert(self, name: str, now: float, origin: str) -> AliasEntry:
        """Swap ``name`` back to its previous different value, as a new version."""
        hist = self._history.get(name)
        if not hist:
            raise AliasError(f"there is no alias named {name!r}; "
                             "`shoal alias ls` lists the aliases")
        current = hist[-1]
        for earlier in reversed(hist[:-1]):
            if earlier.target is not None and not earlier.same_value(current):
                entry = make_entry(name=name, target=earlier.target,
                                   fallbacks=earlier.fallbacks, version=current.version + 1,
                                   updated_at=now, origin=origin)
                self.purge(now)
                self._check_room(entry)
                self._append(entry)
                return entry
        raise AliasError(f"alias {name!r} has no earlier version to revert to; "
                         f"set it with `shoal alias set {name} MODEL`")

    def merge(self, other_entries: Iterable[AliasEntry], *,
              now: float | None = None) -> list[str]:
        """Take, per name, the winning entry of ours and ``other_entries`` (any
        versions of any names; later versions than ours join our history).
        Returns the names whose current entry changed, sorted. All entries are
        checked first: a malformed one refuses the whole merge. With ``now``, old
        removals are purged here first and taken from the others as absent (see the
        module's docstring). A merge is never refused for room."""
        incoming: dict[str, list[AliasEntry]] = {}
        for e in other_entries:
            if not isinstance(e, AliasEntry):
                raise AliasError("merge takes AliasEntry values; "
                                 "parse peers' tables with AliasEntry.from_dict")
            if isinstance(e.version, bool) or not isinstance(e.version, int) or e.version < 1:
                raise AliasError("alias entry version must be an integer >= 1; "
                                 "restore the table from `shoal alias export`")
            make_entry(name=e.name, target=e.target, fallbacks=e.fallbacks,
                       version=e.version, updated_at=e.updated_at, origin=e.origin)
            if now is not None and e.expired(now):
                continue
            incoming.setdefault(e.name, []).append(e)
        if now is not None:
            self.purge(now)
        changed: list[str] = []
        for name, entries in sorted(incoming.items()):
            current = self.get(name)
            newer = sorted({e for e in entries
                            if current is None or e.order_key() > current.order_key()},
                           key=AliasEntry.order_key)
            if not newer:
                continue
            self._append(*newer)
            changed.append(name)
        return changed

    def import_entries(self, entries: Iterable[AliasEntry], now: float,
                       origin: str) -> list[str]:
        """`shoal alias import`: make the file's live aliases current here as new
        versions (whatever their versions in the file), leaving the others alone.
        Returns the names that changed, sorted. All or nothing: AliasTableFull (and
        the table as it was) when the result would outgrow the table's bounds."""
        latest: dict[str, AliasEntry] = {}
        for e in entries:
            if e.name not in latest or e.order_key() > latest[e.name].order_key():
                latest[e.name] = e
        live = sorted((name, e) for name, e in latest.items() if e.target is not None)
        if len(live) > MAX_ALIASES:
            raise AliasTableFull(f"the file holds {len(live)} aliases; a table holds at "
                                 f"most {MAX_ALIASES}: import fewer")
        trial = self.copy()
        changed: list[str] = []
        for name, e in live:
            assert e.target is not None
            before = trial.get(name)
            after = trial.set(name, e.target, e.fallbacks, now, origin)
            if after is not before:
                changed.append(name)
        self._history, self._wire = trial._history, trial._wire
        self._wire_bytes, self._oldest_removal = trial._wire_bytes, trial._oldest_removal
        return changed

    # -- file format -------------------------------------------------------------

    def to_json(self) -> str:
        doc = {"format": FORMAT, "version": FORMAT_VERSION,
               "aliases": [e.to_dict() for e in self.all_entries()]}
        return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "the alias table") -> AliasTable:
        fix = "restore it from `shoal alias export` or move it aside to start empty"
        try:
            doc = nesting.json_loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise AliasError(f"{source} is not valid JSON ({exc}); {fix}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise AliasError(f"{source} is not a Shoal alias table "
                             f"(no \"format\": \"{FORMAT}\"); {fix}")
        version = doc.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise AliasError(f"{source} has no format version; {fix}")
        if version > FORMAT_VERSION:
            raise AliasError(f"{source} was written by a newer Shoal (format {version}); "
                             "upgrade Shoal on this machine")
        rows = doc.get("aliases")
        if not isinstance(rows, list):
            raise AliasError(f"{source} has no \"aliases\" list; {fix}")
        try:
            entries = [AliasEntry.from_dict(row) for row in rows]
        except AliasError as exc:
            raise AliasError(f"{source}: {exc}") from None
        return cls(entries)


_SYNC_HEAD = json.dumps({"format": FORMAT, "version": FORMAT_VERSION},
                        separators=(",", ":")).encode()[:-1] + b',"aliases":['
_SYNC_TAIL = b"]}"


MAX_NAMED = 12  # models a refusal names before "and N more"


@dataclass(frozen=True, slots=True)
class Resolution:
    """What a requested model name means right now.

    ``model``: the served model to run (None when unknown or unavailable);
    ``alias``: the alias the request named, if any; ``fallback``: ``model`` is a
    fallback, not the alias's target; ``free``: some node serving ``model`` has
    a free lane now (else the request queues for it)."""

    requested: str
    model: str | None = None
    alias: str | None = None
    fallback: bool = False
    free: bool = False
    unknown: bool = False
    unavailable: bool = False
    retry_after: int | None = None
    served: tuple[str, ...] = ()  # what the fleet serves, named when ``unknown``

    @property
    def message(self) -> str:
        """One line for the error body when nothing can run."""
        if self.unknown:
            names = ", ".join(self.served[:MAX_NAMED])
            more = len(self.served) - MAX_NAMED
            serves = (f" (the fleet serves {names}{f' and {more} more' if more > 0 else ''})"
                      if self.served else " (no node serves a model now)")
            return (f"model {self.requested!r} is neither served by a node nor an alias"
                    f"{serves}; GET /v1/models lists the models and aliases")
        if self.unavailable:
            return (f"alias {self.alias!r}: no node serves its target or any fallback "
                    f"right now; retry in {self.retry_after} s or point it elsewhere "
                    "with `shoal alias set`")
        return ""


def resolve(requested: str, *, table: AliasTable, served: Mapping[str, bool]) -> Resolution:
    """Resolve ``requested`` against the served models and the live aliases."""
    real = match_name_tier(requested, served.keys())
    live = {e.name: e for e in table.entries()}
    aliased = match_name_tier(requested, live.keys())
    if real is not None and (aliased is None or real[1] <= aliased[1]):
        return Resolution(requested=requested, model=real[0], free=bool(served[real[0]]))
    if aliased is None:
        return Resolution(requested=requested, unknown=True, served=tuple(sorted(served)))
    entry = live[aliased[0]]
    assert entry.target is not None
    target = match_name(entry.target, served.keys())
    if target is not None:
        return Resolution(requested=requested, model=target, alias=entry.name,
                          free=bool(served[target]))
    for fb in entry.fallbacks:
        model = match_name(fb, served.keys())
        if model is not None:
            return Resolution(requested=requested, model=model, alias=entry.name,
                              fallback=True, free=bool(served[model]))
    return Resolution(requested=requested, alias=entry.name, unavailable=True,
                      retry_after=RETRY_AFTER_S)


# -- file adapter ----------------------------------------------------------------


def default_path(home: Path | None = None) -> Path:
    """``$SHOAL_HOME/aliases.json``."""
    if home is None:
        from engine.settings import default_home
        home = default_home()
    return home / FILE_NAME


def load(path: Path) -> AliasTable:
    """The table saved at ``path``; empty when the file does not exist, AliasError
    (one line naming the file and the fix) when it is unreadable or corrupt."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return AliasTable()
    except OSError as exc:
        raise AliasError(f"cannot read the alias table at {path}: {exc.strerror}; "
                         "check its permissions") from None
    return AliasTable.from_json(data, source=f"alias table {path}")


def save(path: Path, table: AliasTable) -> None:
    """Write ``table`` to ``path`` atomically, readable by the owner only."""
    try:
        write_private(path, table.to_json().encode("utf-8"))
    except OSError as exc:
        raise AliasError(f"cannot write the alias table at {path}: {exc.strerror}; "
                         "check the permissions and free space of its folder") from None


class AliasStore:
    """The alias table of one head on disk (``$SHOAL_HOME/aliases.json`` by default)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = default_path() if path is None else path

    def load(self) -> AliasTable:
        return load(self.path)

    def save(self, table: AliasTable) -> None:
        save(self.path, table)


class AliasWriter:
    """The one writer of a head's alias file: one write at a time, in a worker thread,
    of the table as it is when the write starts. Changes asked for while a write is
    under way are written together by the next one, so the latest table wins and an
    older one never lands after a newer one (two threads each writing a copy could
    finish in either order)."""

    def __init__(self, store: AliasStore, table: Callable[[], AliasTable]) -> None:
        self.store = store
        self._table = table
        self._asked = 0  # changes asked to be saved so far
        self._started = 0  # the changes the write under way (or the last one) holds
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    def submit(self) -> int:
        """Ask for the table as it is now (or a later one) to be written; returns the
        change's number for :meth:`wait`."""
        self._asked += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                 name="alias-writer")
        return self._asked

    async def save(self) -> None:
        """Write the table as it is now (or a later one) and return once it is on disk;
        AliasError when that write failed. The write goes on if the caller is cancelled."""
        number = self.submit()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((number, fut))
        await fut

    async def _run(self) -> None:
        try:
            while self._started < self._asked:
                self._started = upto = self._asked
                error: Exception | None = None
                try:
                    # the copy is taken on the loop, where the table changes
                    await asyncio.to_thread(self.store.save, self._table().copy())
                except Exception as exc:  # told to whoever waits for it, else logged
                    error = exc
                done = [fut for n, fut in self._waiting if n <= upto and not fut.done()]
                self._waiting = [(n, fut) for n, fut in self._waiting if n > upto]
                if error is not None and not done:
                    log.warning("%s", error)
                for fut in done:
                    if error is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(error)
        finally:
            for _, fut in self._waiting:  # cancelled: nobody waits for ever
                fut.cancel()
            self._waiting = []

    async def close(self) -> None:
        """Wait for the write under way and those asked for (the file stays whole)."""
        task = self._task
        if task is not None:
            await asyncio.shield(task)

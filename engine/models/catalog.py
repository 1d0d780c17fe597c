"""The model catalog: the models Shoal knows work, shipped as ``resources/catalog.toml``.

Each entry names a GGUF repository on the Hugging Face hub and the files of each of its
quantisations with their size, and the figures the fit estimate needs (parameters, the
trained window, layers and the key/value heads that size the KV cache). A user can drop a
newer catalog at ``$SHOAL_HOME/catalog.toml``: it is used when it parses and its
``version`` is higher than the bundled one's; otherwise the bundled one is, with one line
saying why.

:func:`parse_catalog` is pure (text in, a :class:`Catalog` or one :class:`CatalogError`
out); :func:`load_catalog` reads the two files and is the only part that touches the disk
(callers run it in a thread). Every refusal is one line naming the file, the entry and
the fix.
"""

from __future__ import annotations

import datetime
import re
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import nesting
from engine.models.ids import parse_model_id
from engine.sizes import amount

CATALOG_FILE = "catalog.toml"
# the sizes a catalog may be read at: a larger file is not a catalog
MAX_CATALOG_BYTES = 4 << 20
USES = ("code", "chat", "autocomplete", "agents", "small", "embeddings")
MIN_CONTEXT = 2048
MIN_EMBEDDINGS_CONTEXT = 512  # BERT-style embedding models are trained on 512 tokens
MAX_DIMENSIONS = 16384  # engine.link.messages.MAX_EMBED_DIMS
# a quantisation's size must lie this close to params x bits / 8: further off, a figure
# (the size, the parameter count or the quant's name) is wrong
PLAUSIBLE = (0.6, 1.7)

# bits a weight, averaged over a whole file, for the quant names llama.cpp writes
_BITS: dict[str, float] = {
    "Q2_K": 3.35, "Q3_K_M": 3.9, "Q4_0": 4.55, "Q4_1": 5.0, "Q4_K_M": 4.85, "Q4_K_S": 4.6,
    "IQ4_XS": 4.25, "Q5_K_M": 5.7, "Q5_K_S": 5.55, "Q6_K": 6.56, "Q8_0": 8.5,
    "F16": 16.0, "BF16": 16.0, "MXFP4": 4.25,
}
# bytes of one cached key or value element, as a fraction: q8_0 packs 32 in 34 bytes
_KV_ELEMENT: dict[str, tuple[int, int]] = {"f16": (2, 1), "q8_0": (34, 32)}

_ID_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$")
_QUANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,32}$")
_FILE_RE = re.compile(r"^(?!/)(?!.*\.\.)[A-Za-z0-9._/-]{1,200}\.gguf$")
# what `estimated` may name: the entry's figures, and a quantisation's size or files
_ESTIMABLE = frozenset({"params_b", "context", "layers", "embedding", "kv_heads",
                        "head_dim", "license", "tools", "fim", "thinking", "mlx_repo",
                        "size", "files", "dimensions", "active_b"})


class CatalogError(ValueError):
    """A catalog file that cannot be used. ``reason`` is the short cause (``entry 'x':
    size missing``); ``str()`` is the whole line: the file, the cause and the fix."""

    def __init__(self, source: str, reason: str, fix: str) -> None:
        super().__init__(f"{source}: {reason}; {fix}")
        self.source = source
        self.reason = reason
        self.fix = fix


@dataclass(frozen=True, slots=True)
class CatalogQuant:
    """One quantisation of an entry: its files in the repository (several for a split
    GGUF, first shard first) and their size in bytes, all files together."""

    name: str
    files: tuple[str, ...]
    size: int

    @property
    def bits_per_weight(self) -> float | None:
        """The average bits a weight for this quant's name; None for a name not known."""
        return _BITS.get(self.name.upper())


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    id: str
    name: str
    params_b: float
    uses: tuple[str, ...]
    tools: bool
    fim: bool
    thinking: bool
    context: int
    license: str
    layers: int
    embedding: int
    kv_heads: int
    head_dim: int
    gguf_repo: str
    default_quant: str
    quants: tuple[CatalogQuant, ...]
    mlx_repo: str | None
    estimated: tuple[str, ...]
    note: str
    dimensions: int = 0  # an embeddings model's vector length (0: not one)
    active_b: float | None = None  # a mixture of experts: the parameters one token uses

    @property
    def embeddings(self) -> bool:
        return "embeddings" in self.uses

    def quant(self, name: str | None = None) -> CatalogQuant:
        """The quantisation called ``name`` (any case), or the default one for None."""
        wanted = self.default_quant if name is None else name
        for q in self.quants:
            if q.name.lower() == wanted.lower():
                return q
        raise CatalogError(
            self.id, f"no quantisation {wanted!r}",
            f"choose one of {', '.join(q.name for q in self.quants)}")

    def spec(self, quant: str | None = None) -> str:
        """The model id a node is served or pulled by: ``org/repo:QUANT``."""
        return f"{self.gguf_repo}:{self.quant(quant).name}"

    def kv_bytes_per_token(self, kv_type: str = "f16") -> int:
        """Bytes the KV cache takes a token: a key and a value per layer and KV head."""
        try:
            num, den = _KV_ELEMENT[kv_type]
        except KeyError:
            raise CatalogError(self.id, f"no KV cache type {kv_type!r}",
                               f"use one of {', '.join(_KV_ELEMENT)}") from None
        return self.layers * 2 * self.kv_heads * self.head_dim * num // den


@dataclass(frozen=True, slots=True)
class Catalog:
    version: int
    updated: str
    entries: tuple[CatalogEntry, ...]
    source: str  # the file it was read from, as shown to people

    def get(self, entry_id: str) -> CatalogEntry | None:
        wanted = entry_id.strip().lower()
        return next((e for e in self.entries if e.id == wanted), None)

    def by_spec(self, spec: str) -> tuple[CatalogEntry, CatalogQuant] | None:
        """The entry and quantisation a model id names (``org/repo:QUANT``, any case;
        ``org/repo`` alone names the default quantisation), or None when none does."""
        try:
            mid = parse_model_id(spec)
        except ValueError:
            return None
        for e in self.entries:
            if e.gguf_repo.lower() != mid.repo.lower():
                continue
            if mid.quant is None:
                return e, e.quant()
            return next(((e, q) for q in e.quants if q.name.lower() == mid.quant.lower()),
                        None)
        return None


# --- parsing ---------------------------------------------------------------------------


class _Refusal(Exception):
    """One field found wrong; turned into a CatalogError that names the file and entry."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fix = fix


def _type_name(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _field(table: Mapping[str, Any], key: str, kind: str, check: Callable[[Any], bool],
           want: str, *, where: str = "") -> Any:
    label = f"{key!r}{where}"
    if key not in table:
        raise _Refusal(f"{label} is missing", f"add {key} = <{want}>")
    value = table[key]
    if not check(value):
        raise _Refusal(f"{label} is {_type_name(value)} ({value!r:.40}), not {kind}",
                       f"make it {want}")
    return value


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(table: Mapping[str, Any], key: str, *, where: str = "") -> int:
    value: int = _field(table, key, "an integer", _is_int, "a positive integer", where=where)
    if value <= 0:
        raise _Refusal(f"{key!r}{where} is {value}", "make it a positive integer")
    return value


def _text(table: Mapping[str, Any], key: str, *, empty: bool = False) -> str:
    value: str = _field(table, key, "a string", lambda v: isinstance(v, str), "a string")
    if "\n" in value or (not empty and not value.strip()):
        raise _Refusal(f"{key!r} is {'empty' if not value.strip() else 'several lines'}",
                       "give it one line of text")
    return value


def _flag(table: Mapping[str, Any], key: str) -> bool:
    value: bool = _field(table, key, "a boolean", lambda v: isinstance(v, bool),
                         "true or false")
    return value


def _strings(table: Mapping[str, Any], key: str, *, where: str = "") -> tuple[str, ...]:
    value: list[str] = _field(
        table, key, "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
        'a list of strings like ["a", "b"]', where=where)
    if len({s.lower() for s in value}) != len(value):
        raise _Refusal(f"{key!r}{where} names something twice", "list each item once")
    return tuple(value)


def _hub_repo(value: str, key: str) -> str:
    try:
        mid = parse_model_id(value)
    except ValueError:
        mid = None
    if mid is None or mid.quant is not None:
        raise _Refusal(f"{key!r} {value!r:.60} is not a hub repository id",
                       "give it as org/repo (letters, digits, '-', '_', '.')")
    return mid.repo


def _quant(table: object, index: int, params_b: float) -> CatalogQuant:
    where = f" of quant #{index + 1}"
    if not isinstance(table, dict):
        raise _Refusal(f"quant #{index + 1} is {_type_name(table)}",
                       "write each as a [[model.quant]] table")
    name: str = _field(table, "name", "a string", lambda v: isinstance(v, str),
                       'a quant name like "Q4_K_M"', where=where)
    if not _QUANT_RE.match(name):
        raise _Refusal(f"quant name {name!r:.40} is not one", 'use a name like "Q4_K_M"')
    where = f" of quant {name}"
    files = _strings(table, "files", where=where)
    if not files:
        raise _Refusal(f"'files'{where} is empty", "list the quant's .gguf files")
    for f in files:
        if not _FILE_RE.match(f):
            raise _Refusal(f"file {f!r:.60}{where} is not a .gguf path inside the repository",
                           "give it as the repository lists it, like Model-Q4_K_M.gguf")
    size = _positive_int(table, "size", where=where)
    q = CatalogQuant(name, files, size)
    bits = q.bits_per_weight
    if bits is not None:
        expected = params_b * 1e9 * bits / 8
        low, high = PLAUSIBLE
        if not low * expected <= size <= high * expected:
            raise _Refusal(
                f"size {size:,} of {name} is implausible for {params_b:g}B parameters at "
                f"{bits:g} bits a weight (about {expected:,.0f} expected)",
                "check the size in bytes, params_b and the quant's name")
    return q


def _entry(table: object, index: int) -> CatalogEntry:
    if not isinstance(table, dict):
        raise _Refusal(f"model #{index + 1} is {_type_name(table)}",
                       "write each model as a [[model]] table")
    entry_id = _text(table, "id")
    if not _ID_RE.match(entry_id):
        raise _Refusal(f"id {entry_id!r:.70} is not a short slug",
                       "use lowercase letters, digits, '.', '_' and '-'")
    params_b: float = _field(table, "params_b", "a number",
                             lambda v: isinstance(v, int | float) and not isinstance(v, bool),
                             "the parameter count in billions, like 7.6")
    if not 0 < params_b < 10_000:
        raise _Refusal(f"'params_b' is {params_b}", "give the parameters in billions")
    uses = _strings(table, "uses")
    unknown = [u for u in uses if u not in USES]
    if not uses or unknown:
        raise _Refusal(f"'uses' {'is empty' if not uses else f'has {unknown[0]!r}'}",
                       f"list some of {', '.join(USES)}")
    embeddings = "embeddings" in uses
    if embeddings and len(uses) > 1:
        raise _Refusal("'uses' names embeddings with other uses",
                       'an embeddings model is only that: uses = ["embeddings"]')
    context = _positive_int(table, "context")
    least = MIN_EMBEDDINGS_CONTEXT if embeddings else MIN_CONTEXT
    if context < least:
        raise _Refusal(f"'context' is {context} tokens",
                       f"give the trained window, at least {least}")
    dimensions = 0
    if embeddings:
        dimensions = _positive_int(table, "dimensions")
        if dimensions > MAX_DIMENSIONS:
            raise _Refusal(f"'dimensions' is {dimensions}",
                           f"give the vector length, at most {MAX_DIMENSIONS}")
    elif "dimensions" in table:
        raise _Refusal("'dimensions' is set on a model that is not for embeddings",
                       'remove it, or set uses = ["embeddings"]')
    active_b = table.get("active_b")
    if active_b is not None and (not isinstance(active_b, int | float)
                                 or isinstance(active_b, bool)
                                 or not 0 < active_b <= params_b):
        raise _Refusal(f"'active_b' is {active_b!r:.30}",
                       "give the parameters one token uses, in billions, at most params_b")
    raw_quants = _field(table, "quant", "a list of tables", lambda v: isinstance(v, list),
                        "[[model.quant]] tables")
    quants = tuple(_quant(q, i, float(params_b)) for i, q in enumerate(raw_quants))
    if not quants:
        raise _Refusal("there is no [[model.quant]]", "add at least one quantisation")
    names = [q.name.lower() for q in quants]
    twice = next((q.name for q in quants if names.count(q.name.lower()) > 1), None)
    if twice is not None:
        raise _Refusal(f"quant {twice} is listed twice", "keep one [[model.quant]] per name")
    default = _text(table, "default_quant")
    if default.lower() not in names:
        raise _Refusal(f"default_quant {default!r:.40} is not among its quants",
                       f"set it to one of {', '.join(q.name for q in quants)}")
    default = next(q.name for q in quants if q.name.lower() == default.lower())
    mlx = table.get("mlx_repo")
    if mlx is not None:
        if not isinstance(mlx, str):
            raise _Refusal(f"'mlx_repo' is {_type_name(mlx)}", "make it an org/repo string")
        mlx = _hub_repo(mlx, "mlx_repo")
    estimated = _strings(table, "estimated")
    odd = next((f for f in estimated if f not in _ESTIMABLE), None)
    if odd is not None:
        raise _Refusal(f"'estimated' names {odd!r:.30}, not a figure",
                       f"name some of {', '.join(sorted(_ESTIMABLE))}")
    return CatalogEntry(
        id=entry_id, name=_text(table, "name"), params_b=float(params_b), uses=uses,
        tools=_flag(table, "tools"), fim=_flag(table, "fim"),
        thinking=_flag(table, "thinking"), context=context, license=_text(table, "license"),
        layers=_positive_int(table, "layers"), embedding=_positive_int(table, "embedding"),
        kv_heads=_positive_int(table, "kv_heads"), head_dim=_positive_int(table, "head_dim"),
        gguf_repo=_hub_repo(_text(table, "gguf_repo"), "gguf_repo"), default_quant=default,
        quants=quants, mlx_repo=mlx, estimated=estimated, note=_text(table, "note", empty=True),
        dimensions=dimensions, active_b=None if active_b is None else float(active_b))


def _is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def _label(table: object, index: int) -> str:
    entry_id = table.get("id") if isinstance(table, dict) else None
    return repr(entry_id) if isinstance(entry_id, str) and entry_id else f"#{index + 1}"


def parse_catalog(text: str, *, source: str) -> Catalog:
    """The catalog in ``text`` (``source`` names its file in messages), every field
    checked; CatalogError (one line) for the first thing wrong."""
    try:
        doc = nesting.toml_loads(text)
    except nesting.TooDeep as exc:
        raise CatalogError(source, f"nests too deep ({exc})", "flatten it, or delete the "
                           "file to use the catalog Shoal ships") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(source, f"is not TOML ({exc})", "fix its syntax") from None
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version <= 0:
        raise CatalogError(source, f"version {version!r:.30} is not a positive integer",
                           "set version = <N> at the top, higher than the catalog it replaces")
    updated = doc.get("updated")
    if not isinstance(updated, str) or not _is_date(updated):
        raise CatalogError(source, f"'updated' {updated!r:.30} is not a date",
                           'set updated = "YYYY-MM-DD"')
    raw = doc.get("model")
    if not isinstance(raw, list) or not raw:
        raise CatalogError(source, "has no [[model]] entries", "add the models it lists")
    entries: list[CatalogEntry] = []
    for i, table in enumerate(raw):
        try:
            entry = _entry(table, i)
        except _Refusal as r:
            raise CatalogError(source, f"entry {_label(table, i)}: {r.reason}", r.fix) from None
        for other in entries:
            if entry.id == other.id:
                raise CatalogError(source, f"entry {entry.id!r} is listed twice",
                                   "give each entry its own id")
            if entry.gguf_repo.lower() == other.gguf_repo.lower():
                raise CatalogError(
                    source, f"entry {entry.id!r}: gguf_repo {entry.gguf_repo} is also "
                    f"entry {other.id!r}'s", "list each repository in one entry")
        entries.append(entry)
    return Catalog(version, updated, tuple(entries), source)


# --- files ----------------------------------------------------------------------------


def bundled_catalog_path() -> Path:
    """resources/catalog.toml beside the engine package, or inside a frozen bundle
    (PyInstaller's ``sys._MEIPASS``)."""
    base = getattr(sys, "_MEIPASS", None)
    root = Path(base) if getattr(sys, "frozen", False) and base else Path(__file__).parents[2]
    return root / "resources" / CATALOG_FILE


def _shown(path: Path) -> str:
    """A path as people read it: under the home folder as ``~/...``."""
    try:
        return "~/" + path.relative_to(Path.home()).as_posix()
    except (ValueError, RuntimeError):  # not under it, or no home folder known
        return str(path)


def _read(path: Path, shown: str) -> str:
    """The file's text; CatalogError when it is unreadable, too large or not UTF-8."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CATALOG_BYTES + 1)
    except OSError as exc:
        raise CatalogError(shown, f"cannot be read ({exc.strerror or exc})",
                           "check that the file exists and can be read") from None
    if len(data) > MAX_CATALOG_BYTES:
        raise CatalogError(shown, f"is larger than {amount(MAX_CATALOG_BYTES)}",
                           "use a catalog file, not another file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CatalogError(shown, "is not UTF-8 text", "save it as UTF-8") from None


def load_catalog(home: Path) -> tuple[Catalog, str]:
    """The catalog to use, and a line about it ("" when it is simply the bundled one).

    A ``catalog.toml`` in ``home`` replaces the bundled catalog when it parses and its
    version is higher; a broken or older one leaves the bundled catalog in use, and the
    line says why. A bundled catalog that cannot be used raises CatalogError (a broken
    install). Reads files: run it in a thread from async code.
    """
    path = bundled_catalog_path()
    shown = str(path)
    bundled = parse_catalog(_read(path, shown), source=shown)
    mine = home / CATALOG_FILE
    if not mine.exists():
        return bundled, ""
    theirs_shown = _shown(mine)
    try:
        theirs = parse_catalog(_read(mine, theirs_shown), source=theirs_shown)
    except CatalogError as exc:
        return bundled, (f"{theirs_shown} is refused ({exc.reason}); using the bundled "
                         f"catalog v{bundled.version}; fix or remove it")
    if theirs.version > bundled.version:
        return theirs, (f"using {theirs_shown} (catalog v{theirs.version}, newer than the "
                        f"bundled v{bundled.version})")
    return bundled, (f"{theirs_shown} is catalog v{theirs.version}, not newer than the "
                     f"bundled v{bundled.version}; using the bundled catalog (remove the "
                     "file to stop this line)")

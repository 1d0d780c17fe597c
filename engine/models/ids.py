"""Model ids and names: ``org/repo[:QUANT]`` parsed, a file's name on the link, the GGUF
a repository's files are chosen by, and where the models folder lives."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.models.errors import ModelMissing

DEFAULT_QUANT = "Q4_K_M"


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


# a name a GGUF the user already had is kept under (`shoal models import`): one word, so it
# is never taken for a hub id (org/repo) or a path
IMPORT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def imported_path(home: Path, name: str) -> Path | None:
    """Where the imported model ``name`` is kept (None: ``name`` cannot be one)."""
    if not IMPORT_NAME.match(name) or name.lower().endswith(".gguf"):
        return None
    return models_dir(home) / "imported" / f"{name}.gguf"


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


def is_shard(name: str) -> bool:
    """``model-00001-of-00003.gguf``: one part of a split model."""
    return _SHARD_RE.search(name) is not None


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

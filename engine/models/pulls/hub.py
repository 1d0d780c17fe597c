"""A repository on the Hugging Face hub: its files with their sizes and LFS sha256, and the
commit they belong to, through ``HfApi().model_info(repo, files_metadata=True)``
(``GET {endpoint}/api/models/{repo}?blobs=True``; the endpoint is huggingface_hub's, so
``HF_ENDPOINT`` and a test's local hub both hold).

What the hub says is checked before it names a path here: a commit is 40 hex digits, a
sha256 64, a file name a relative path that climbs nowhere, a size a count of bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.models.errors import ModelMissing, one_line

INFO_TIMEOUT_S = 30.0
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_FILE_BYTES = 1 << 42  # 4 TiB: larger than any model file, smaller than a lie


class HubUnreachable(ModelMissing):
    """The hub did not answer (the network, or the hub itself): a cached model may serve."""


@dataclass(frozen=True, slots=True)
class RepoFile:
    name: str  # the path inside the repository
    size: int
    sha256: str | None  # an LFS file's; None for a file kept in git itself


@dataclass(frozen=True, slots=True)
class RepoInfo:
    repo: str
    commit: str
    files: tuple[RepoFile, ...]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.files]

    def file(self, name: str) -> RepoFile:
        return next(f for f in self.files if f.name == name)


def safe_name(name: str) -> bool:
    """A path inside a repository that stays inside it once joined to a folder."""
    if not name or name.startswith("/") or "\\" in name or "\x00" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def repo_info(repo: str) -> RepoInfo:
    """The files of ``repo`` at its main branch. ModelMissing (one line) when it is not
    there; HubUnreachable when the hub cannot be asked."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi().model_info(repo, files_metadata=True, timeout=INFO_TIMEOUT_S)
    except GatedRepoError:
        raise ModelMissing(
            f"model {repo} is gated on the Hugging Face hub; accept its terms on the "
            "model's page and log in with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise ModelMissing(
            f"model {repo} was not found on the Hugging Face hub (or it is private or "
            "gated); check the id, or log in with `hf auth login`") from None
    except RevisionNotFoundError:
        raise ModelMissing(f"model {repo} has no main branch on the hub; check the id") \
            from None
    except Exception as exc:  # the network, or the hub's own trouble
        raise HubUnreachable(one_line(exc)) from None
    commit = info.sha or ""
    if not _COMMIT.match(commit):
        raise ModelMissing(f"the hub gave no commit for {repo} ({commit[:48]!r}); run again "
                           "later, or report it if it stays so")
    files: list[RepoFile] = []
    for sibling in info.siblings or []:
        name = sibling.rfilename
        if not safe_name(name):
            continue  # not a path we would write; never one of the model's files
        lfs = sibling.lfs
        size = lfs.size if lfs is not None else sibling.size
        sha = lfs.sha256.lower() if lfs is not None and isinstance(lfs.sha256, str) else None
        if not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
            continue
        files.append(RepoFile(name, size, sha if sha and _SHA256.match(sha) else None))
    return RepoInfo(repo, commit, tuple(files))

"""Loose model-name matching: pure functions, no I/O.

Clients spell model names in their own ways (some OpenAI clients refuse a colon
in a model id outright), so a requested name is compared with the known names
in three tiers, the first tier with a match deciding:

0. exact: ``"qwen3:8b"`` matches ``"qwen3:8b"``;
1. case-insensitive: ``"Qwen3:8B"`` matches ``"qwen3:8b"``;
2. a hyphen read as a colon (and case-insensitive): ``"qwen3-8b"`` matches
   ``"qwen3:8b"``. Both sides are folded the same way, so every hyphen and
   colon compare equal: ``"qwen3-8b-instruct"`` matches ``"qwen3:8b-instruct"``.

When several candidates match in the same tier (``"Qwen3:8b"`` and
``"qwen3:8B"`` both match ``"QWEN3:8B"`` case-insensitively), the smallest one
in code-point order wins, so every head picks the same model for the same
request whatever order its candidates come in.
"""

from __future__ import annotations

from collections.abc import Iterable

EXACT = 0
CASE_INSENSITIVE = 1
HYPHEN_AS_COLON = 2


def fold(name: str, tier: int) -> str:
    """The form of ``name`` compared at ``tier``."""
    if tier == EXACT:
        return name
    if tier == CASE_INSENSITIVE:
        return name.casefold()
    return name.casefold().replace("-", ":")


def match_tier(requested: str, candidate: str) -> int | None:
    """The first tier at which ``requested`` matches ``candidate``, None when none does."""
    for tier in (EXACT, CASE_INSENSITIVE, HYPHEN_AS_COLON):
        if fold(requested, tier) == fold(candidate, tier):
            return tier
    return None


def match_name_tier(requested: str, candidates: Iterable[str]) -> tuple[str, int] | None:
    """The best candidate for ``requested`` and the tier it matched at, or None."""
    best: tuple[int, str] | None = None
    for candidate in candidates:
        tier = match_tier(requested, candidate)
        if tier is None:
            continue
        key = (tier, candidate)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    return best[1], best[0]


def match_name(requested: str, candidates: Iterable[str]) -> str | None:
    """The candidate that ``requested`` names: exact, then case-insensitive, then a
    hyphen read as a colon; None when nothing matches."""
    found = match_name_tier(requested, candidates)
    return None if found is None else found[0]

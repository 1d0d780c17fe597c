from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.head.naming.names import (
    CASE_INSENSITIVE,
    EXACT,
    HYPHEN_AS_COLON,
    match_name,
    match_name_tier,
    match_tier,
)


def test_exact_match() -> None:
    assert match_name("qwen3:8b", ["gemma3:270m", "qwen3:8b"]) == "qwen3:8b"


def test_exact_beats_case_insensitive() -> None:
    assert match_name("Qwen3:8b", ["qwen3:8b", "Qwen3:8b"]) == "Qwen3:8b"


def test_case_insensitive() -> None:
    assert match_name("QWEN3:8B", ["qwen3:8b"]) == "qwen3:8b"


def test_hyphen_read_as_colon() -> None:
    assert match_name("qwen3-8b", ["qwen3:8b"]) == "qwen3:8b"
    assert match_name("Qwen3-8B", ["qwen3:8b"]) == "qwen3:8b"
    # only the separator changes: a hyphen elsewhere in the name still matches
    assert match_name("qwen3-8b-instruct", ["qwen3:8b-instruct"]) == "qwen3:8b-instruct"


def test_case_insensitive_beats_hyphen() -> None:
    assert match_name("QWEN3-8B", ["qwen3:8b", "qwen3-8b"]) == "qwen3-8b"


def test_no_match() -> None:
    assert match_name("llama3", ["qwen3:8b"]) is None
    assert match_name("qwen3", ["qwen3:8b"]) is None
    assert match_name("x", []) is None


def test_ties_within_a_tier_are_deterministic() -> None:
    cands = ["qwen3:8B", "Qwen3:8b"]
    assert match_name("QWEN3:8B", cands) == match_name("QWEN3:8B", list(reversed(cands)))
    assert match_name("QWEN3:8B", cands) == "Qwen3:8b"


def test_tiers() -> None:
    assert match_tier("a:b", "a:b") == EXACT
    assert match_tier("A:B", "a:b") == CASE_INSENSITIVE
    assert match_tier("A-B", "a:b") == HYPHEN_AS_COLON
    assert match_tier("a_b", "a:b") is None
    assert match_name_tier("A-B", iter(["a:b"])) == ("a:b", HYPHEN_AS_COLON)


@given(st.text(max_size=20), st.lists(st.text(max_size=20), max_size=6))
def test_result_is_a_candidate_and_order_free(requested: str, cands: list[str]) -> None:
    got = match_name(requested, cands)
    assert got is None or got in cands
    assert got == match_name(requested, list(reversed(cands)))
    if requested in cands:
        assert got == requested

"""A node's memory budget and idle unload as people write them (engine/sizes.py): the
forms taken, the one-line refusals, and what config.toml keeps reading back the same."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.sizes import (
    MIN_BUDGET,
    GiB,
    MiB,
    Share,
    budget_bytes,
    budget_value,
    idle_unload_minutes,
    idle_unload_s,
    parse_budget,
    parse_idle_unload,
)


@pytest.mark.parametrize(("text", "want"), [
    ("6G", 6 * GiB), ("6GiB", 6 * GiB), ("6GB", 6 * GiB), ("6g", 6 * GiB), ("6gib", 6 * GiB),
    ("4096M", 4 * GiB), ("512MB", 512 * MiB), ("512MiB", 512 * MiB), ("256M", MIN_BUDGET),
    ("1.5G", 3 * GiB // 2), (" 8 G ", 8 * GiB), ("1T", 1 << 40), ("262144K", MIN_BUDGET),
    ("50%", Share(50.0)), ("100%", Share(100.0)), ("12.5%", Share(12.5)), ("0.5 %", Share(0.5)),
])
def test_the_forms_a_budget_takes(text: str, want: int | Share) -> None:
    assert parse_budget(text) == want


FORMS = "6G, 6GiB, 4096M or 512MB (binary units), or a share of this machine's RAM like 50%"


@pytest.mark.parametrize(("text", "words"), [
    ("6", FORMS), ("6X", FORMS), ("", FORMS), ("six gigs", FORMS), ("-1G", FORMS),
    ("1e3G", FORMS), ("6GiBs", FORMS), ("G", FORMS), ("0x10G", FORMS), ("6 GiB RAM", FORMS),
    ("12345678901G", FORMS),
    ("255M", "a memory budget of 255 MiB cannot hold a model and its KV cache; give at "
     "least 256M"),
    ("0G", "give at least 256M"), ("100K", "give at least 256M"),
    ("0%", "give a percentage above 0 and at most 100"), ("101%", "at most 100"),
    ("1000%", FORMS),
])
def test_anything_else_is_refused_in_one_line_naming_the_forms(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=r"\A[^\n]+\Z") as err:
        parse_budget(text)
    assert words in str(err.value)


@given(st.text(max_size=20))
def test_any_text_is_a_budget_or_one_line(text: str) -> None:
    try:
        got = parse_budget(text)
    except ValueError as exc:
        assert "\n" not in str(exc) and str(exc)
    else:
        assert isinstance(got, Share) or got >= MIN_BUDGET


@given(st.integers(min_value=256, max_value=1 << 30))
def test_whole_mebibytes_read_as_they_are_written(mib: int) -> None:
    assert parse_budget(f"{mib}M") == parse_budget(f"{mib}MiB") == mib * MiB


@given(st.one_of(st.integers(min_value=MIN_BUDGET, max_value=1 << 50),
                 st.integers(min_value=1, max_value=100_000_000).map(lambda n: Share(n / 1e6))))
def test_config_toml_reads_back_what_it_keeps(budget: int | Share) -> None:
    kept = budget_value(budget)
    again = kept if isinstance(kept, int) else parse_budget(kept)
    assert again == budget


def test_what_config_toml_keeps_is_short_where_it_can_be() -> None:
    assert budget_value(12 * GiB) == "12GiB"
    assert budget_value(512 * MiB) == "512MiB"
    assert budget_value(MIN_BUDGET + 1) == MIN_BUDGET + 1  # bytes, as a TOML integer
    assert budget_value(Share(50.0)) == "50%" and budget_value(Share(33.333333)) == "33.333333%"


def test_a_share_is_taken_of_the_ram_given() -> None:
    assert budget_bytes(Share(50.0), 24 * GiB) == 12 * GiB
    assert budget_bytes(Share(12.5), 8 * GiB) == GiB
    assert budget_bytes(6 * GiB, 1) == 6 * GiB  # a size is what it says, whatever the RAM
    assert budget_bytes(None, 24 * GiB) is None  # the runtime's default share
    with pytest.raises(ValueError) as err:
        budget_bytes(Share(1.0), 8 * GiB)
    assert str(err.value) == ("1% of this machine's 8192 MiB of RAM is 81 MiB, too little "
                              "for a model and its KV cache; give a larger share or a size "
                              "of at least 256M")


@pytest.mark.parametrize(("text", "want"), [
    ("15", 900.0), ("0", None), ("never", None), ("Never", None), (" NEVER ", None),
    ("0.5", 30.0), ("60", 3600.0), ("10080", 604_800.0), ("0.0", None),
])
def test_the_idle_unload_forms(text: str, want: float | None) -> None:
    assert parse_idle_unload(text) == want


@pytest.mark.parametrize("text", ["-1", "abc", "", "10081", "inf", "nan", "15m", "1e3",
                                  "forever"])
def test_an_idle_unload_out_of_its_forms_is_one_line(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_idle_unload(text)
    assert "minutes from 0 to 10080 (like 15), or never" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("minutes", [-0.1, float("inf"), float("nan"), 10_080.5])
def test_config_minutes_out_of_range_are_refused(minutes: float) -> None:
    with pytest.raises(ValueError, match="out of range"):
        idle_unload_s(minutes)


@given(st.one_of(st.none(), st.integers(min_value=1, max_value=10_080).map(lambda m: m * 60.0),
                 st.floats(min_value=0.001, max_value=10_080)))
def test_config_toml_reads_back_the_idle_unload_it_keeps(seconds: float | None) -> None:
    if seconds is not None:
        seconds = idle_unload_s(seconds / 60.0)
    kept = idle_unload_minutes(seconds)
    again = parse_idle_unload(kept) if isinstance(kept, str) else idle_unload_s(kept)
    assert again == pytest.approx(seconds)

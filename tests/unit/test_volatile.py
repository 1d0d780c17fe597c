"""Per-request lines at the head of agents' prompts are taken out (prompt/volatile.py)."""

from __future__ import annotations

import pytest

from engine.head.prompt.volatile import without_volatile

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.4c1; cc_entrypoint=sdk-cli;"


@pytest.mark.parametrize(("text", "kept"), [
    (BILLING, ""),
    (BILLING + "\nYou are Claude Code.", "You are Claude Code."),
    (BILLING + "\n" + BILLING.replace("4c1", "9f0") + "\nrest", "rest"),
    ("You are Claude Code.", "You are Claude Code."),
    # only at the start: a quoted header inside a prompt is the user's text
    ("see: " + BILLING, "see: " + BILLING),
    ("line one\n" + BILLING, "line one\n" + BILLING),
    ("", ""),
])
def test_the_billing_header_is_taken_from_the_start_only(text: str, kept: str):
    assert without_volatile(text) == kept


def test_two_conversations_differ_only_in_the_header_and_become_equal():
    a = BILLING.replace("4c1", "111") + "\nYou are an interactive agent."
    b = BILLING.replace("4c1", "222") + "\nYou are an interactive agent."
    assert a != b and without_volatile(a) == without_volatile(b)

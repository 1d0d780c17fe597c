"""Lines that agents put at the head of their prompts and change with every request (pure).

Claude Code opens its system prompt with a block of one line,
``x-anthropic-billing-header: cc_version=2.1.197.<hash>; cc_entrypoint=...;``, whose hash
differs from one conversation (and one kind of request) to the next. Left in, it would
sit about ten tokens into every prompt, so no two conversations would share the prefill
of the same 20,000-token system prompt and tools, and it would also split the affinity
key of one conversation's requests. It says nothing to the model (it is for Anthropic's
billing), so the head takes it out before templating. Every pattern here names the agent
that sends it; a line that only looks like one somewhere else in a prompt is left alone,
since only whole lines at the start of a system text are taken.
"""

from __future__ import annotations

import re

# one pattern per known line: the agent that sends it, then the line (anchored at the start)
VOLATILE_LINES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("Claude Code", re.compile(r"x-anthropic-billing-header:[^\n]*(?:\n|$)")),
)


def without_volatile(text: str) -> str:
    """``text`` less the per-request lines at its start (any number, in any order)."""
    rest = text
    while True:
        for _agent, pattern in VOLATILE_LINES:
            found = pattern.match(rest)
            if found is not None:
                rest = rest[found.end():]
                break
        else:
            return rest

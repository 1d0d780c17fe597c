"""A node whose sessions fail before their first token is let rest (pure; time comes in).

A node that takes a session and fails it at once (its engine refuses every generation,
its model is broken) looks free to placement: every new session went there first, failed
over and came back with the next one. With a hundred such nodes one head made 29,638
placements in 15 s. After ``FAILS`` such failures in a row a node cools down: placement
passes it over for ``FIRST_S``, doubling with each further failure up to ``MAX_S``, and
the fleet shows it as failing, with the cause the node gave. A session that produces a
token ends the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.backoff import doubling

FAILS = 3  # immediate failures in a row before the node rests
FIRST_S = 1.0
MAX_S = 60.0


@dataclass(slots=True)
class Cooldown:
    failures: int = 0  # sessions failed before their first token, in a row
    until: float = 0.0  # passed over by placement until then
    cause: str = ""  # the last failure, as the node gave it

    def failed_at_once(self, cause: str, now: float) -> float:
        """A session failed there before its first token; returns the rest (0: none yet)."""
        self.failures += 1
        self.cause = cause
        if self.failures < FAILS:
            return 0.0
        rest = doubling(FIRST_S, self.failures - FAILS, MAX_S)
        self.until = now + rest
        return rest

    def worked(self) -> None:
        """A session got a token there (or finished): the count starts again."""
        self.failures, self.until, self.cause = 0, 0.0, ""

    def resting(self, now: float) -> bool:
        return now < self.until

"""The garbage collector's pace for a long-running headless process (`shoal serve`, `shoal
node`): measured on a head relaying 400 paced streams, the default pace spent a quarter of
its CPU in collections (docs/reliability.md, "Scale: a hundred nodes").

Almost everything a head allocates per token (records, dataclasses, futures) is freed by
reference counting the moment it is done with, so the collector has little to find; what
costs is how often it looks and how much it walks each time. Two changes:

* the objects alive once the process has started (modules, the tokenizer, templates) are
  frozen: collections no longer walk them;
* a collection of the youngest objects waits for 20,000 net allocations instead of 700,
  and the older generations for 20 of the one below, so a full collection of a head
  holding thousands of connections runs seldom. A pass over 20,000 young objects takes
  about a millisecond.
"""

from __future__ import annotations

import gc

YOUNG = 20_000
OLDER = 20


def pace_for_serving() -> None:
    """Call once the process has started serving; only from a CLI entry point (the app
    leaves its GUI toolkit's process to its defaults)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, OLDER, OLDER)

"""Which lane a request takes, and what one llama.cpp step feeds: pure decisions.

Lane choice (:func:`pick_lane`), over the free lanes, in this order:

1. the lane parked under the request's session (it holds that conversation);
2. the lane sharing the longest common prefix with the prompt, when the prefix
   is worth keeping: at least ``MIN_REUSE`` tokens, or the whole prompt but its
   last token (a chat header alone saves nothing worth evicting another
   session's parked sequence for);
3. the least recently used lane.

Ties go to the first lane in the order given.

Batch plan (:func:`plan_batch`), for one step over the lanes that run:

1. every decoding lane feeds its one sampled token, and wants its logits;
2. prompts still prefilling share what is left of ``n_batch``, in the order
   given (admission order), each taking as much of its rest as fits; a chunk
   that ends its prompt wants the logits of its last token;
3. the batch lists the decoding lanes first, then the prompt chunks, each group
   in lane (sequence id) order. With one KV stream per lane, llama.cpp splits a
   batch whose sequence ids are out of order into several smaller decodes,
   which costs up to a third of the throughput at 8 lanes; a mixed order of
   decoding and prefilling lanes can stall ``llama_decode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

MIN_REUSE = 16  # a shorter shared prefix does not pick a lane by itself


@dataclass(eq=False, slots=True)
class Lane:
    """One sequence of the context: what its KV holds and whom it was last for."""

    seq: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds
    session: str = ""
    last_used: float = float("-inf")


L = TypeVar("L", bound=Lane)


_CHUNK = 256


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    Compared a chunk at a time (slice equality runs in C): a 30,000-token agent
    prompt against every lane and host-cache entry costs microseconds, not a step.
    """
    n = min(len(a), len(b))
    if type(a) is not type(b) or not isinstance(a, list | tuple):
        a, b = list(a[:n]), list(b[:n])
    i = 0
    while i + _CHUNK <= n and a[i:i + _CHUNK] == b[i:i + _CHUNK]:
        i += _CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pick_lane(free: Sequence[L], prompt: Sequence[int], session: str) -> L | None:
    """The free lane a prompt takes (see the module's docstring), or None when none is free."""
    if not free:
        return None
    if session:
        for lane in free:
            if lane.session == session and lane.tokens:
                return lane
    best = max(free, key=lambda ln: common_prefix(ln.tokens, prompt))
    common = common_prefix(best.tokens, prompt)
    if common > 0 and common >= min(MIN_REUSE, len(prompt) - 1):
        return best
    return min(free, key=lambda ln: ln.last_used)


class LaneWant(NamedTuple):
    """What one running lane needs from the next step."""

    seq: int
    pending: Sequence[int]  # prompt tokens still to prefill; empty once it decodes
    next_token: int  # the sampled token a decoding lane feeds


class Feed(NamedTuple):
    """Tokens one lane feeds in this step, at consecutive positions after what it holds."""

    slot: int  # index of the lane's LaneWant in the plan's input
    tokens: Sequence[int]
    logits: bool  # whether the last of them wants logits (a token is sampled after it)


def plan_batch(wants: Sequence[LaneWant], n_batch: int) -> list[Feed]:
    """One step's batch, in the order it is written (see the module's docstring)."""
    decoding: list[Feed] = []
    prompts: list[Feed] = []
    for slot, want in enumerate(wants):
        if not want.pending:
            decoding.append(Feed(slot, (want.next_token,), True))
    budget = n_batch - len(decoding)
    for slot, want in enumerate(wants):
        if budget <= 0:
            break
        pending = want.pending
        if not pending:
            continue
        chunk = pending[:budget]
        prompts.append(Feed(slot, chunk, len(chunk) == len(pending)))
        budget -= len(chunk)
    decoding.sort(key=lambda feed: wants[feed.slot].seq)
    prompts.sort(key=lambda feed: wants[feed.slot].seq)
    return decoding + prompts

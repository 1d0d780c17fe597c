"""A model larger than any one machine, split across the fleet (pure: a model's shape and
the fleet's machines in, a proposal out).

For a model that fits no single machine's budget (:func:`engine.models.fit.estimate` says
it does not fit on each), :func:`propose_split` proposes serving it on one machine with
its last layers in memory that other machines lend (``Machine.lend``: what their owners
let the fleet use, their node budget less what their own model holds). The order of
decisions:

1. What each part holds, counted as the node counts it (:mod:`engine.runtimes.offload`'s
   ``plan_split``): a repeating layer is its weights (the model's size over its layers
   plus the output layer) and its share of a chat turn's pool
   (:data:`engine.runtimes.budget.POOL_FLOOR` cells). The serving machine serves the
   model in place of its own, so its whole budget holds the process, the compute buffers,
   the embeddings and output layer, and as many layers as are left room for; a lending
   machine holds as many as its lent memory leaves after its compute buffers. Its RAM
   only: a split's serving node runs its own layers on its CPU, the lent ones run on the
   lending machine's CPU (llama.cpp's RPC server).
2. For each machine that may serve, the fewest lenders, those holding the most first,
   whose layers with its own cover every layer. A machine that lends nothing is never a
   lender.
3. The layers shared in proportion to what each part can hold, weighted by its RAM's
   bandwidth where every part's is known (a faster machine takes more), never more than
   a part holds (largest remainders get the layers left over).
4. Of those, the split needing the fewest lenders, then the fastest estimate, then the one
   whose serving machine holds the most itself (the fewest bytes cross the network).

The speed is :func:`engine.models.speed.split_tps`: a token passes every part in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.models.fit import BASE_BYTES, Machine, ModelShape, estimate, overhead_bytes
from engine.models.speed import split_tps
from engine.runtimes.budget import POOL_FLOOR


@dataclass(frozen=True, slots=True)
class SplitPart:
    """One machine's part of a split model."""

    machine: str
    layers: int  # the model's repeating layers held there
    bytes: int  # what those hold there: weights and their share of the pool (the serving
    # machine's part counts the embeddings and output layer too)


@dataclass(frozen=True, slots=True)
class SplitProposal:
    """Serve the model on ``serving`` with its last layers on ``lenders`` (in that order)."""

    serving: SplitPart
    lenders: tuple[SplitPart, ...]
    layers: int  # the model's repeating layers, all parts together
    tps: float | None  # estimated decode tokens/s of one answer (None: not known)

    @property
    def parts(self) -> tuple[SplitPart, ...]:
        return (self.serving, *self.lenders)

    @property
    def machines(self) -> tuple[str, ...]:
        """The machines, the serving one first: what ``--split`` takes."""
        return tuple(p.machine for p in self.parts)

    def line_for(self, names: dict[str, str] | None = None) -> str:
        """For people, each machine by ``names`` (else as the proposal names it): ``split
        across laptop + desk (14 + 10 of 24 layers), about 6 tokens/s``."""
        who = " + ".join((names or {}).get(p.machine, p.machine) for p in self.parts)
        counts = " + ".join(str(p.layers) for p in self.parts)
        speed = "" if self.tps is None else f", about {tokens_per_s(self.tps)} tokens/s"
        return f"split across {who} ({counts} of {self.layers} layers){speed}"

    @property
    def line(self) -> str:
        return self.line_for()


def tokens_per_s(tps: float) -> str:
    """``6``, ``1.4``: a split's speed as the line says it (whole tokens from 2 up)."""
    return f"{tps:.0f}" if tps >= 2 else f"{tps:.1f}"


def share_layers(total: int, room: Sequence[int], weights: Sequence[float]
                 ) -> list[int] | None:
    """``total`` layers shared in proportion to ``weights``, none past its ``room``; the
    layers left over by rounding down go to the largest remainders. None when the rooms
    together hold fewer than ``total``."""
    if sum(max(r, 0) for r in room) < total:
        return None
    got = [0] * len(room)
    left = total
    open_ = [i for i, r in enumerate(room) if r > 0]
    while left > 0 and open_:
        w = {i: max(weights[i], 1e-12) for i in open_}
        ideal = {i: left * w[i] / sum(w.values()) for i in open_}
        full = [i for i in open_ if got[i] + ideal[i] >= room[i]]
        if full:  # these take all they hold; the rest is shared again among the others
            for i in full:
                left -= room[i] - got[i]
                got[i] = room[i]
            open_ = [i for i in open_ if i not in full]
            continue
        whole = {i: int(ideal[i]) for i in open_}
        for i in open_:
            got[i] += whole[i]
        rest = left - sum(whole.values())
        # each below its room by more than its remainder: one more still fits
        by_remainder = sorted(open_, key=lambda i: (ideal[i] - whole[i], w[i], -i),
                              reverse=True)
        for i in by_remainder[:rest]:
            got[i] += 1
        left = 0
    return got


def propose_split(model: ModelShape, machines: Sequence[Machine], *,
                  cells: int = POOL_FLOOR) -> SplitProposal | None:
    """How to serve ``model`` across ``machines`` (see the module doc); None when one
    machine holds it alone, when the lending machines together cannot hold it with any
    one serving it, or for an embeddings model (it is small, and never split)."""
    if model.embeddings or not machines:
        return None
    if any(estimate(model, m).fits for m in machines):
        return None
    n_layer = max(model.layers, 1)
    weights_per_layer = model.size / (n_layer + 1)  # the output layer weighs as one more
    per_layer = weights_per_layer + cells * max(model.kv_bytes_per_token, 1) / n_layer
    overhead = overhead_bytes(model.embedding)

    def lent_room(m: Machine) -> int:
        return max(min(int(max(m.lend - overhead, 0) // per_layer), n_layer), 0)

    best: tuple[tuple[int, float, int, str], SplitProposal] | None = None
    for serving in machines:
        free = serving.memory - BASE_BYTES - overhead - weights_per_layer
        if free < 0:
            continue  # not even the embeddings and output layer
        own = min(int(free // per_layer), n_layer)
        lenders = sorted((m for m in machines if m is not serving and lent_room(m) > 0),
                         key=lambda m: (-lent_room(m), m.name))
        chosen: list[Machine] = []
        held = own
        for m in lenders:
            if held >= n_layer:
                break
            chosen.append(m)
            held += lent_room(m)
        if held < n_layer or not chosen:
            continue
        parts = [serving, *chosen]
        room = [own, *(lent_room(m) for m in chosen)]
        known = all(m.mem_bandwidth > 0 for m in parts)
        weights = [r * (m.mem_bandwidth if known else 1.0)
                   for r, m in zip(room, parts, strict=True)]
        shared = share_layers(n_layer, room, weights)
        if shared is None:
            continue
        kept = [(m, n) for i, (m, n) in enumerate(zip(parts, shared, strict=True))
                if i == 0 or n > 0]
        if len(kept) < 2:
            continue
        tps = split_tps(model, [(n, m.mem_bandwidth) for m, n in kept])
        out = [SplitPart(m.name, n, int(n * per_layer + (weights_per_layer if i == 0 else 0)))
               for i, (m, n) in enumerate(kept)]
        proposal = SplitProposal(out[0], tuple(out[1:]), n_layer, tps)
        key = (len(out) - 1, -(tps or 0.0), -own, serving.name)
        if best is None or key < best[0]:
            best = (key, proposal)
    return best[1] if best is not None else None

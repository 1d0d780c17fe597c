"""The catalog seen through the fit estimate: which of its models fit a machine, and the
split a fleet is offered (pure: the catalog and machines in, verdicts out)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.models.catalog import Catalog, CatalogEntry, CatalogQuant
from engine.models.fit import (
    Candidate,
    Fit,
    Machine,
    ModelShape,
    Suggestion,
    estimate,
    suggest_split,
)


def shape_of(entry: CatalogEntry, quant: CatalogQuant, kv_type: str = "f16") -> ModelShape:
    # a mixture of experts reads its active share of the weights a token (about: the
    # attention and embeddings every token uses are counted at that share too)
    active = 0 if entry.active_b is None else int(quant.size * entry.active_b / entry.params_b)
    return ModelShape(size=quant.size, layers=entry.layers, embedding=entry.embedding,
                      kv_bytes_per_token=entry.kv_bytes_per_token(kv_type),
                      context=entry.context, active_size=active, embeddings=entry.embeddings)


def candidates(catalog: Catalog, kv_type: str = "f16") -> list[Candidate]:
    return [Candidate(entry_id=e.id, quant=q.name, spec=e.spec(q.name), params_b=e.params_b,
                      tools=e.tools, fim=e.fim, bits=q.bits_per_weight or 0.0,
                      shape=shape_of(e, q, kv_type))
            for e in catalog.entries for q in e.quants]


@dataclass(frozen=True, slots=True)
class QuantFit:
    quant: CatalogQuant
    spec: str
    fit: Fit
    kept: bool  # already on this machine's disk


@dataclass(frozen=True, slots=True)
class EntryFit:
    entry: CatalogEntry
    quants: tuple[QuantFit, ...]

    @property
    def best(self) -> QuantFit:
        """The finest quantisation that fits whole, else the one with the largest window,
        else the default."""
        full = [q for q in self.quants if q.fit.verdict == "full"]
        if full:
            return max(full, key=lambda q: q.quant.size)
        some = [q for q in self.quants if q.fit.verdict == "reduced"]
        if some:
            return max(some, key=lambda q: (q.fit.window, q.quant.size))
        default = self.entry.quant(None).name
        return next(q for q in self.quants if q.quant.name == default)


def fits_for(catalog: Catalog, machine: Machine, *, kept: Iterable[str] = (),
             kv_type: str = "f16") -> list[EntryFit]:
    """Every entry with the fit of each of its quantisations on ``machine``; ``kept``: the
    specs already downloaded here (they need no disk)."""
    have = {s.lower() for s in kept}
    out = []
    for e in catalog.entries:
        rows = []
        for q in e.quants:
            spec = e.spec(q.name)
            is_kept = spec.lower() in have
            rows.append(QuantFit(q, spec, estimate(shape_of(e, q, kv_type), machine,
                                                   downloaded=is_kept), is_kept))
        out.append(EntryFit(e, tuple(rows)))
    return out


def fleet_split(catalog: Catalog, machines: Sequence[Machine], *,
                kv_type: str = "f16") -> tuple[Suggestion, ...]:
    return suggest_split(candidates(catalog, kv_type), machines)

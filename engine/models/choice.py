"""The catalog seen through the fit estimate: which of its models fit a machine, the
split a fleet is offered, and a model no machine holds alone split across those that lend
memory (pure: the catalog and machines in, verdicts out)."""

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
from engine.models.split_fit import SplitProposal, propose_split


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


@dataclass(frozen=True, slots=True)
class SplitOffer:
    """A catalog model no machine of the fleet holds alone, served split across machines
    that lend memory (:mod:`engine.models.split_fit`)."""

    entry_id: str
    quant: str
    spec: str
    proposal: SplitProposal

    def command(self, names: dict[str, str] | None = None) -> str:
        """The command that serves it so, each machine by ``names`` (else its own key)."""
        who = ",".join((names or {}).get(m, m) for m in self.proposal.machines)
        return f"shoal models serve {self.spec} --split {who}"


def split_offers(catalog: Catalog, machines: Sequence[Machine], *,
                 kv_type: str = "f16") -> tuple[SplitOffer, ...]:
    """For each catalog model that no machine holds alone at any of its quantisations,
    the split of its default quantisation, else of the finest one a split holds; models
    no split holds are left out."""
    out = []
    for e in catalog.entries:
        shapes = [(q, shape_of(e, q, kv_type)) for q in e.quants]
        if e.embeddings or any(estimate(shape, m).fits for _, shape in shapes
                               for m in machines):
            continue
        default = e.quant(None).name
        for q, shape in sorted(shapes, key=lambda qs: (qs[0].name != default, -qs[0].size)):
            proposal = propose_split(shape, machines)
            if proposal is not None:
                out.append(SplitOffer(e.id, q.name, e.spec(q.name), proposal))
                break
    return tuple(out)

"""Just enough of the Prometheus text format to read a few gauges. Pure.

A dependency (prometheus_client's parser) for three numbers is more than they
need: this reads ``name{labels} value`` lines, skips comments, and keeps only the
names asked for. The text is bounded by the caller before it gets here.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str, names: Collection[str], *, max_samples: int = 4096) -> list[Sample]:
    """The samples of ``names`` in ``text`` (at most ``max_samples``); odd lines are skipped."""
    out: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            if close < brace or name not in names:
                continue
            labels = _labels(line[brace + 1:close])
            rest = line[close + 1:].split()
        else:
            name, _, tail = line.partition(" ")
            if name not in names:
                continue
            labels = {}
            rest = tail.split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        out.append(Sample(name, labels, value))
        if len(out) >= max_samples:
            break
    return out


def _labels(text: str) -> dict[str, str]:
    """``a="x",b="y"`` (escaped quotes inside values are kept as they are)."""
    labels: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= len(text) or text[eq + 1] != '"':
            break
        j = eq + 2
        while j < len(text) and not (text[j] == '"' and text[j - 1] != "\\"):
            j += 1
        labels[text[i:eq].strip().lstrip(",").strip()] = text[eq + 2:j]
        i = j + 1
        while i < len(text) and text[i] in ", ":
            i += 1
    return labels


def total(samples: list[Sample], name: str) -> float | None:
    """The sum of ``name`` over its label sets (several engines), or None when absent."""
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None

"""Whether a model fits a machine, and which model each machine of a fleet should serve
(pure: sizes in, verdicts out).

The estimate is the node's own arithmetic run ahead of time: the same device choice
and offload plan (:mod:`engine.runtimes.offload`) and the same pool plan
(:mod:`engine.runtimes.budget`) a llama.cpp node makes when it loads the file, fed
with the catalog's figures instead of the GGUF's header. A model

* **fits** when a session may hold its whole trained window;
* **fits with a smaller window** when the budget leaves room for a pool smaller than
  the window (the window it would get is named);
* **does not fit** when not even a chat turn's pool is left.

:func:`suggest_split` gives each machine of a fleet one model: the largest
machine the largest model with tool calling that leaves an agent's prompt room
(Claude Code's is about 22,000 tokens), the others the same model where it fits
(more lanes for the same name), and, in a fleet of two or more, the smallest machine
a fill-in-the-middle code model for editor autocomplete.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from engine.runtimes.budget import (
    BudgetTooSmall,
    default_budget_bytes,
    plan_pool,
    wanted_cells,
)
from engine.runtimes.offload import Device, DeviceKind, plan_offload
from engine.sizes import MiB, amount

# the node process before its model: the interpreter, llama.cpp and its backends (an
# estimate; a node measures its own at start)
BASE_BYTES = 256 * MiB
N_BATCH = 512  # engine.runtimes.llamacpp.N_BATCH_MAX: what the compute buffers are sized for
AGENT_WINDOW = 32768  # room for a coding agent's system prompt and tools, and its work
LANES = 8  # engine.settings.LANES_DEFAULT

Verdict = Literal["full", "reduced", "none"]


def overhead_bytes(n_embd: int, n_batch: int = N_BATCH) -> int:
    """llama.cpp's compute buffers and outputs for a batch, as a node estimates them."""
    return 48 * MiB + n_batch * n_embd * 4 * 24


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs of a model file (from the catalog, or a GGUF header)."""

    size: int  # bytes of the weights
    layers: int
    embedding: int
    kv_bytes_per_token: int
    context: int  # the trained window


@dataclass(frozen=True, slots=True)
class Machine:
    """What a node says about its machine (Stats on the link, or this machine's own)."""

    name: str
    ram_total: int
    budget: int = 0  # the node's memory budget (0: the default share of ram_total)
    device_kind: DeviceKind | Literal[""] = ""
    device_total: int = 0
    device_free: int = 0
    disk_free: int | None = None  # where it keeps models (None: not known)
    lanes: int = LANES

    @property
    def memory(self) -> int:
        return self.budget or default_budget_bytes(self.ram_total)

    def device(self) -> Device | None:
        if not self.device_kind or self.device_free <= 0:
            return None
        return Device(name="GPU", description=self.name, kind=self.device_kind,
                      free=self.device_free, total=max(self.device_total, self.device_free))


@dataclass(frozen=True, slots=True)
class Fit:
    verdict: Verdict
    window: int  # the tokens one session may hold (0: does not fit)
    gpu_layers: int  # layers (the output layer counted) on the GPU
    layers: int
    disk_short: int  # bytes more the download needs on disk than there are (0: enough)
    line: str  # for people: "fits with its whole 32K window, all on the GPU"

    @property
    def fits(self) -> bool:
        return self.verdict != "none"

    @property
    def on_gpu(self) -> str:
        if self.gpu_layers <= 0:
            return "CPU"
        if self.gpu_layers >= self.layers:
            return "GPU"
        return f"{self.gpu_layers}/{self.layers} on GPU"


def tokens_text(n: int) -> str:
    """``32K``, ``8K``, ``1.5K``: windows as people read them."""
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return f"{n / 1024:.1f}K" if n >= 1024 else str(n)


def estimate(model: ModelShape, machine: Machine, *, downloaded: bool = False) -> Fit:
    """How ``model`` would serve on ``machine`` (see the module doc)."""
    want = wanted_cells(lanes=machine.lanes, n_ctx_train=model.context, max_context=None)
    overhead = overhead_bytes(model.embedding)
    off = plan_offload(device=machine.device(), n_layer=model.layers, model_bytes=model.size,
                       kv_bytes_per_token=model.kv_bytes_per_token, want_cells=want,
                       overhead=overhead)
    disk_short = 0 if downloaded or machine.disk_free is None else max(
        model.size + 64 * MiB - machine.disk_free, 0)
    where = ("" if off.layers == 0 else
             ", all on the GPU" if off.full else f", {off.layers} of {off.of} layers on the GPU")
    disk = f"; the disk lacks {amount(disk_short)} for it" if disk_short else ""
    try:
        plan = plan_pool(budget=machine.memory, base=BASE_BYTES, model_bytes=off.ram_weights,
                         overhead=overhead, kv_bytes_per_token=off.ram_kv_per_token,
                         lanes=machine.lanes, n_ctx_train=model.context, max_context=None,
                         device_cells=off.max_cells)
    except BudgetTooSmall:
        need = BASE_BYTES + off.ram_weights + overhead + 512 * max(off.ram_kv_per_token, 1)
        need_text, budget_text = amount(need), amount(machine.memory)
        if need_text == budget_text:  # close: say by how much it misses
            need_text, budget_text = amount(need, 2), amount(machine.memory, 2)
        return Fit("none", 0, off.layers, off.of, disk_short,
                   f"does not fit: it needs about {need_text} and the budget is "
                   f"{budget_text}{disk}")
    if plan.window >= model.context:
        return Fit("full", plan.window, off.layers, off.of, disk_short,
                   f"fits with its whole {tokens_text(model.context)} window{where}{disk}")
    return Fit("reduced", plan.window, off.layers, off.of, disk_short,
               f"fits with a {tokens_text(plan.window)} window (of "
               f"{tokens_text(model.context)}){where}{disk}")


# -- a split for the fleet --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """One catalog entry at one quantisation, as the split weighs it."""

    entry_id: str
    quant: str
    spec: str  # what a node serves: "org/repo:QUANT"
    params_b: float
    tools: bool
    fim: bool
    bits: float  # bits per weight (quality, among quants of one model)
    shape: ModelShape


@dataclass(frozen=True, slots=True)
class Suggestion:
    machine: str
    candidate: Candidate
    fit: Fit
    role: Literal["agents", "autocomplete", "chat"]

    @property
    def line(self) -> str:
        c = self.candidate
        return f"{self.machine}: {c.entry_id} {c.quant} for {self.role} ({self.fit.line})"


def _usable(c: Candidate, m: Machine, min_window: int) -> Fit | None:
    fit = estimate(c.shape, m)
    if not fit.fits or fit.disk_short or fit.window < min(min_window, c.shape.context):
        return None
    return fit


def best_for(candidates: Iterable[Candidate], machine: Machine, *, tools: bool = False,
             fim: bool = False, min_window: int = 0, max_params_b: float = 1e9
             ) -> tuple[Candidate, Fit] | None:
    """The largest model (then the finest quantisation) that fits ``machine`` with at least
    ``min_window`` tokens (its whole window when smaller), among those with the asked
    capabilities."""
    best: tuple[Candidate, Fit] | None = None
    for c in candidates:
        if (tools and not c.tools) or (fim and not c.fim) or c.params_b > max_params_b:
            continue
        fit = _usable(c, machine, min_window)
        if fit is None:
            continue
        if best is None or (c.params_b, c.bits, fit.window) > (
                best[0].params_b, best[0].bits, best[1].window):
            best = (c, fit)
    return best


AUTOCOMPLETE_MAX_B = 8.0  # autocomplete wants a fast answer more than a large model


def suggest_split(candidates: Sequence[Candidate], machines: Sequence[Machine]
                  ) -> tuple[Suggestion, ...]:
    """One model for each machine that any fits (see the module doc), largest machine
    first."""
    order = sorted(machines, key=lambda m: (m.memory + m.device_free, m.name), reverse=True)
    out: list[Suggestion] = []
    lead: Candidate | None = None
    for i, m in enumerate(order):
        if len(order) >= 2 and i == len(order) - 1:
            got = best_for(candidates, m, fim=True, max_params_b=AUTOCOMPLETE_MAX_B)
            if got is not None:
                out.append(Suggestion(m.name, got[0], got[1], "autocomplete"))
                continue
        if lead is not None:
            same = _usable(lead, m, AGENT_WINDOW)
            if same is not None:
                out.append(Suggestion(m.name, lead, same, "agents"))
                continue
        got = best_for(candidates, m, tools=True, min_window=AGENT_WINDOW)
        if got is not None:
            lead = lead or got[0]
            out.append(Suggestion(m.name, got[0], got[1], "agents"))
            continue
        got = best_for(candidates, m)
        if got is not None:
            out.append(Suggestion(m.name, got[0], got[1], "chat"))
    return tuple(out)

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
a fill-in-the-middle code model for editor autocomplete. Each machine also gets the
models an editor needs beside its own, where they fit together in its budget: an
embeddings model, and on a machine alone a fill-in-the-middle model for autocomplete
(none when its main model does fill-in-the-middle itself).

Where a machine's bandwidth is known, every fit carries an estimated decode speed
(:mod:`engine.models.speed`); the split prefers models that answer at a usable speed
(chat 10 tokens/s, autocomplete 20) and says so of one that fits but would be slow.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from engine.models.speed import AUTOCOMPLETE_TPS, CHAT_TPS, decode_tps, speed_line
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
    active_size: int = 0  # weights one token reads, for a mixture of experts (0: all)
    embeddings: bool = False  # an embeddings model: one lane's window, no decoding


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
    # what decides decode speed (engine.models.bandwidth), bytes/s; 0: not known
    mem_bandwidth: int = 0
    gpu_bandwidth: int = 0
    # the memory its owner lends to the fleet's split models now: its node budget less what
    # its own model holds (0: it lends none; engine.models.split_fit)
    lend: int = 0

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
    line: str  # for people: "fits with its whole 32K window, all on the GPU; ~35 tok/s"
    # estimated decode tokens/s of one answer (None: the machine's bandwidth is not
    # known, or an embeddings model, which does not decode)
    tps: float | None = None
    ram_bytes: int = 0  # what the node would hold in RAM with the model loaded
    device_bytes: int = 0  # and on the GPU
    base_line: str = ""  # the line without what it says of the speed

    def line_for(self, usable: float, use: str) -> str:
        """The line with the speed judged for ``use`` (which wants ``usable`` tokens/s)."""
        return self.base_line + speed_line(self.tps, usable, use) if self.base_line else (
            self.line)

    @property
    def fits(self) -> bool:
        return self.verdict != "none"

    def usable(self, tps: float = CHAT_TPS) -> bool:
        """Fast enough for a use that wants ``tps`` (True when the speed is not known)."""
        return self.tps is None or self.tps >= tps

    @property
    def slow(self) -> bool:
        """It fits, but would answer more slowly than chat wants."""
        return self.fits and not self.usable(CHAT_TPS)

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


def estimate(model: ModelShape, machine: Machine, *, downloaded: bool = False,
             pool: int | None = None) -> Fit:
    """How ``model`` would serve on ``machine`` (see the module doc); ``pool``: the KV
    cells to hold at most (a model served beside another needs less than a whole pool)."""
    lanes = 1 if model.embeddings else machine.lanes
    want = wanted_cells(lanes=lanes, n_ctx_train=model.context, max_context=None,
                        pool_cells=pool)
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
                         lanes=lanes, n_ctx_train=model.context, max_context=None,
                         pool_cells=pool, device_cells=off.max_cells)
    except BudgetTooSmall:
        need = BASE_BYTES + off.ram_weights + overhead + 512 * max(off.ram_kv_per_token, 1)
        need_text, budget_text = amount(need), amount(machine.memory)
        if need_text == budget_text:  # close: say by how much it misses
            need_text, budget_text = amount(need, 2), amount(machine.memory, 2)
        return Fit("none", 0, off.layers, off.of, disk_short,
                   f"does not fit: it needs about {need_text} and the budget is "
                   f"{budget_text}{disk}")
    gpu_share = off.layers / max(off.of, 1)
    kv_gpu_share = min(off.layers, model.layers) / max(model.layers, 1)
    tps = None if model.embeddings else decode_tps(
        model, mem_bandwidth=machine.mem_bandwidth, gpu_bandwidth=machine.gpu_bandwidth,
        gpu_share=gpu_share, kv_gpu_share=kv_gpu_share)
    speed = speed_line(tps)
    ram = BASE_BYTES + off.ram_weights + overhead + plan.cells * off.ram_kv_per_token
    kv = plan.cells * model.kv_bytes_per_token
    device = int(model.size * gpu_share + kv * kv_gpu_share)
    if plan.window >= model.context:
        base = f"fits with its whole {tokens_text(model.context)} window{where}{disk}"
        return Fit("full", plan.window, off.layers, off.of, disk_short, base + speed,
                   tps=tps, ram_bytes=ram, device_bytes=device, base_line=base)
    base = (f"fits with a {tokens_text(plan.window)} window (of "
            f"{tokens_text(model.context)}){where}{disk}")
    return Fit("reduced", plan.window, off.layers, off.of, disk_short, base + speed,
               tps=tps, ram_bytes=ram, device_bytes=device, base_line=base)


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

    @property
    def embeddings(self) -> bool:
        return self.shape.embeddings


Role = Literal["agents", "autocomplete", "chat", "embeddings"]


@dataclass(frozen=True, slots=True)
class Suggestion:
    machine: str
    candidate: Candidate
    fit: Fit
    role: Role
    also: tuple[Role, ...] = ()  # the roles it serves too ("autocomplete": it does FIM)

    @property
    def fit_line(self) -> str:
        """The fit's line, its speed judged for the role (autocomplete wants more)."""
        if self.role == "autocomplete" or "autocomplete" in self.also:
            return self.fit.line_for(AUTOCOMPLETE_TPS, "autocomplete")
        return self.fit.line

    @property
    def line(self) -> str:
        c = self.candidate
        roles = " and ".join((self.role, *self.also))
        return f"{self.machine}: {c.entry_id} {c.quant} for {roles} ({self.fit_line})"


def _usable(c: Candidate, m: Machine, min_window: int, pool: int | None = None
            ) -> Fit | None:
    fit = estimate(c.shape, m, pool=pool)
    if not fit.fits or fit.disk_short or fit.window < min(min_window, c.shape.context):
        return None
    return fit


# below this a model is a toy (the catalog's test models): suggested only where nothing
# larger fits
TOY_B = 1.0


def best_for(candidates: Iterable[Candidate], machine: Machine, *, tools: bool = False,
             fim: bool = False, min_window: int = 0, max_params_b: float = 1e9,
             min_tps: float = 0.0) -> tuple[Candidate, Fit] | None:
    """The largest model (then the finest quantisation) that fits ``machine`` with at least
    ``min_window`` tokens (its whole window when smaller), among those with the asked
    capabilities and estimated at least ``min_tps`` fast; where none is that fast, the
    fastest (a slow answer rather than none). A toy only where nothing larger fits."""
    fitting: list[tuple[Candidate, Fit]] = []
    for c in candidates:
        if (c.embeddings or (tools and not c.tools) or (fim and not c.fim)
                or c.params_b > max_params_b):
            continue
        fit = _usable(c, machine, min_window)
        if fit is not None:
            fitting.append((c, fit))
    real = [cf for cf in fitting if cf[0].params_b >= TOY_B] or fitting
    fast = [cf for cf in real if cf[1].usable(min_tps)]
    if fast:
        return max(fast, key=lambda cf: (cf[0].params_b, cf[0].bits, cf[1].window))
    return max(real, key=lambda cf: (cf[1].tps or 0.0, cf[0].params_b, cf[0].bits),
               default=None)


AUTOCOMPLETE_MAX_B = 8.0  # autocomplete wants a fast answer more than a large model
# the KV pool a model served beside the main one holds: autocomplete's prompts are the
# code around the cursor (editors send 1-4K tokens), a few at a time; an embeddings model
# serves one lane, and an editor's chunks are far shorter than 8K
AUTOCOMPLETE_POOL = 8192
EMBEDDINGS_POOL = 8192
# the share of a machine's budget a model beside the main one may take: the main model
# (chat and agents) is what the machine is for
AUTOCOMPLETE_SHARE = 0.25
EMBEDDINGS_SHARE = 0.125


def _beside(candidates: Sequence[Candidate], m: Machine, role: Role
            ) -> tuple[Candidate, Fit] | None:
    """A model to serve beside the main one on ``m``: the largest that takes at most its
    share of the budget and is fast enough, else the smallest within that share (the
    fastest); an embeddings model, else the smallest that fits at all."""
    if role == "embeddings":
        pick = [c for c in candidates if c.embeddings]
        pool, share, min_tps = EMBEDDINGS_POOL, EMBEDDINGS_SHARE, 0.0
    else:
        pick = [c for c in candidates
                if c.fim and not c.embeddings and c.params_b <= AUTOCOMPLETE_MAX_B]
        pool, share, min_tps = AUTOCOMPLETE_POOL, AUTOCOMPLETE_SHARE, AUTOCOMPLETE_TPS
    fitted = [(c, f) for c in pick
              if (f := _usable(c, m, 0, min(pool, c.shape.context))) is not None]
    within = [(c, f) for c, f in fitted if f.ram_bytes - BASE_BYTES <= m.memory * share]
    fast = [(c, f) for c, f in within if f.usable(min_tps)]
    if fast:
        return max(fast, key=lambda cf: (cf[0].params_b, cf[0].bits))
    smallest = within or (fitted if role == "embeddings" else [])
    return min(smallest, key=lambda cf: cf[1].ram_bytes, default=None)


def _less(m: Machine, taken: Sequence[Fit]) -> Machine | None:
    """``m`` with what models already placed on it hold taken from its budget (None: no
    room is left). The process itself is counted once, with the main model."""
    ram = sum(f.ram_bytes - BASE_BYTES for f in taken)
    device = sum(f.device_bytes for f in taken)
    if ram >= m.memory:
        return None
    return replace(m, budget=m.memory - ram, device_free=max(m.device_free - device, 0))


def _main(candidates: Sequence[Candidate], m: Machine, lead: Candidate | None
          ) -> tuple[Candidate, Fit, Role] | None:
    """The machine's own model: the fleet's lead model where it fits, else the largest
    with tool calling and an agent's window, else the largest at all (for chat); each
    usable for chat where one is."""
    if lead is not None:
        same = _usable(lead, m, AGENT_WINDOW)
        if same is not None and same.usable(CHAT_TPS):
            return lead, same, "agents"
    got = best_for(candidates, m, tools=True, min_window=AGENT_WINDOW, min_tps=CHAT_TPS)
    if got is not None and got[1].usable(CHAT_TPS):
        return got[0], got[1], "agents"
    chat = best_for(candidates, m, min_tps=CHAT_TPS)
    if got is not None and (chat is None or not chat[1].usable(CHAT_TPS)):
        return got[0], got[1], "agents"  # nothing is fast here: the agent model, slow
    return None if chat is None else (chat[0], chat[1], "chat")


Placed = tuple[Candidate, Fit, Role]


def _score(main: Placed, beside: Sequence[Placed], autocomplete: bool
           ) -> tuple[int, bool, bool, bool, float, float, int, int]:
    """How good a main model and the models beside it are together: the most roles served
    first, then a main model usable for chat, one with room for agents, autocomplete fast
    enough, the largest main model (then its finest quantisation and window), the fewest
    models."""
    c, f, role = main
    roles = {r for _, _, r in beside}
    auto = next((bf for _, bf, r in beside if r == "autocomplete"), None)
    if auto is None and c.fim:
        auto = f  # the main model does fill-in-the-middle itself
    served = 1 + ("embeddings" in roles) + (autocomplete and auto is not None)
    auto_fast = autocomplete and auto is not None and auto.usable(AUTOCOMPLETE_TPS)
    return (served, f.usable(CHAT_TPS), role == "agents", auto_fast, c.params_b, c.bits,
            f.window, -len(beside))


def _machine_set(candidates: Sequence[Candidate], m: Machine, lead: Candidate | None,
                 *, autocomplete: bool) -> list[Suggestion]:
    """The main model for ``m`` and, fitting together with it in its budget, an embeddings
    model and (with ``autocomplete``) a fill-in-the-middle model, unless the main model is
    one: of the ways to combine them, the one :func:`_score` ranks first."""
    emb = _beside(candidates, m, "embeddings")
    auto = _beside(candidates, m, "autocomplete") if autocomplete else None
    combos: list[list[tuple[Role, tuple[Candidate, Fit] | None]]] = [
        [("autocomplete", auto), ("embeddings", emb)], [("embeddings", emb)],
        [("autocomplete", auto)], []]
    best: tuple[Placed, list[Placed]] | None = None
    for combo in combos:
        beside: list[Placed] = [(got[0], got[1], role) for role, got in combo
                                if got is not None]
        rest = _less(m, [f for _, f, _ in beside])
        main = None if rest is None else _main(candidates, rest, lead)
        if main is not None and (best is None or _score(main, beside, autocomplete)
                                 > _score(*best, autocomplete)):
            best = (main, beside)
    if best is None:
        return []
    (c, f, role), beside = best
    also: tuple[Role, ...] = ("autocomplete",) if (
        autocomplete and c.fim and all(r != "autocomplete" for _, _, r in beside)) else ()
    return [Suggestion(m.name, c, f, role, also),
            *(Suggestion(m.name, bc, bf, br) for bc, bf, br in beside)]


def suggest_split(candidates: Sequence[Candidate], machines: Sequence[Machine]
                  ) -> tuple[Suggestion, ...]:
    """The models for each machine that any fits (see the module doc), largest machine
    first: its main model first, then those beside it."""
    order = sorted(machines, key=lambda m: (m.memory + m.device_free, m.name), reverse=True)
    out: list[Suggestion] = []
    lead: Candidate | None = None
    for i, m in enumerate(order):
        if len(order) >= 2 and i == len(order) - 1:
            # the smallest machine serves autocomplete, with an embeddings model beside
            # it where both fit
            emb = _beside(candidates, m, "embeddings")
            rest = _less(m, [emb[1]]) if emb else m
            got = None if rest is None else best_for(
                candidates, rest, fim=True, max_params_b=AUTOCOMPLETE_MAX_B,
                min_tps=AUTOCOMPLETE_TPS)
            if got is None and emb is not None:
                emb, got = None, best_for(candidates, m, fim=True,
                                          max_params_b=AUTOCOMPLETE_MAX_B,
                                          min_tps=AUTOCOMPLETE_TPS)
            if got is not None:
                out.append(Suggestion(m.name, got[0], got[1], "autocomplete"))
                if emb is not None:
                    out.append(Suggestion(m.name, emb[0], emb[1], "embeddings"))
                continue
        chosen = _machine_set(candidates, m, lead, autocomplete=len(order) == 1)
        if chosen:
            if chosen[0].role == "agents":
                lead = lead or chosen[0].candidate
            out.extend(chosen)
    return tuple(out)

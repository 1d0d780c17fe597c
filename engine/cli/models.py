"""`shoal models list|rm|catalog|pull|import|keep-alive|serve`: the models kept on this
machine, the catalog with the fit for this machine (and a model no machine holds alone split
across the fleet), a pull with progress, a GGUF the user has kept by name, how long a model
stays loaded once idle, and a model served split across machines that lend memory.
Parses and prints only: the work is :mod:`engine.models.store`, :mod:`engine.models.catalog`
and :mod:`engine.models.choice`."""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import StartError
from engine.models import store as model_store
from engine.models.fit import Machine, Suggestion, tokens_text
from engine.models.speed import AUTOCOMPLETE_TPS, CHAT_TPS
from engine.node import model_set
from engine.settings import HTTP_DEFAULT
from engine.sizes import amount

if TYPE_CHECKING:
    from engine.models.catalog import Catalog
    from engine.models.choice import SplitOffer

FLEET_TIMEOUT_S = 3.0
MAX_FLEET_BYTES = 16 << 20


def add_parser(sub: Any) -> None:
    p = sub.add_parser("models", help="the models kept on this machine, and the catalog")
    msub = p.add_subparsers(dest="models_command", required=True,
                            metavar="{list,rm,catalog,pull,import,keep-alive,serve}",
                            help="`shoal models VERB --help` for its arguments")
    ls = msub.add_parser("list", help="the models on this machine: size, who serves them, "
                                      "when last used")
    ls.add_argument("--head", default=HTTP_DEFAULT, metavar="HOST:PORT",
                    help="the head asked which fleet nodes serve each model (default: "
                         "this machine's)")
    rm = msub.add_parser("rm", help="remove a model from this machine (refused while served)")
    rm.add_argument("name", help="the model, as `shoal models list` names it")
    cat = msub.add_parser("catalog", help="the models Shoal knows work, with their sizes")
    cat.add_argument("--fits", action="store_true",
                     help="with whether each fits this machine, and with which window")
    cat.add_argument("--memory-budget", default=None, metavar="SIZE",
                     help="the node budget to judge the fit by (default: this machine's)")
    cat.add_argument("--head", default=HTTP_DEFAULT, metavar="HOST:PORT",
                     help="with --fits: the head asked for the fleet's machines, to split a "
                          "model no machine holds alone across those that lend memory "
                          "(default: this machine's)")
    pull = msub.add_parser("pull", help="download a model (a catalog id or org/repo:QUANT) "
                                        "without serving it")
    pull.add_argument("model", help="a catalog id (`shoal models catalog`) or org/repo:QUANT")
    imp = msub.add_parser("import", help="keep a GGUF file you already have among the models "
                                         "here, to serve it by name")
    imp.add_argument("file", type=Path, help="the .gguf file (linked where it is on the same "
                                             "disk, else copied)")
    imp.add_argument("--name", default=None,
                     help="the name to serve it by (default: the file's name without .gguf)")
    ka = msub.add_parser("keep-alive", help="how long a model stays loaded once idle on this "
                                            "machine's node (its default for requests that "
                                            "name no keep_alive)")
    ka.add_argument("name", help="the model, as `shoal models list` names it")
    ka.add_argument("idle", nargs="?", default=None, metavar="DURATION",
                    help="5m, 1h30m, 90s, 0 (unload after each request), never, or default "
                         "(the node's --idle-unload); without it, show the current one")
    serve = msub.add_parser("serve", help="serve a model on one machine of the fleet, its "
                                          "last layers on memory other machines lend")
    serve.add_argument("model", help="a catalog id (`shoal models catalog`) or org/repo:QUANT")
    serve.add_argument("--split", required=True, metavar="SERVING,LENDER[,...]",
                       help="the machine that serves it, then those that lend memory, as "
                            "the Fleet page and /v1/fleet name them (`shoal models catalog "
                            "--fits` proposes a split)")
    serve.add_argument("--head", default=HTTP_DEFAULT, metavar="HOST:PORT",
                       help="the head that asks the machines (default: this machine's)")


def main(args: argparse.Namespace, home: Path) -> int:
    cmd = args.models_command
    if cmd == "list":
        return _list(home, args.head)
    if cmd == "rm":
        try:
            gone = model_store.remove(home, args.name)
        except (model_store.ModelInUse, model_store.ModelNotKept) as exc:
            raise StartError(str(exc)) from None
        print(f"removed {gone.name} ({amount(gone.size)} freed)")
        return 0
    if cmd == "catalog":
        return _catalog(home, fits=args.fits, budget=args.memory_budget, head=args.head)
    if cmd == "import":
        return _import(home, args.file.expanduser(), args.name)
    if cmd == "keep-alive":
        return _keep_alive(home, args.name, args.idle)
    if cmd == "serve":
        return _serve_split(home, args.model, args.split, args.head)
    return _pull(home, args.model)


def _ago(when: float | None, now: float) -> str:
    if when is None:
        return "never"
    s = max(now - when, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{int(s // size)} {unit} ago"
    return "just now"


def fleet_nodes(head: str, unseen: str) -> tuple[list[dict[str, Any]], str]:
    """The nodes of the head's /v1/fleet; and a line, saying what is ``unseen`` then, when
    the head could not be asked."""
    try:
        with urllib.request.urlopen(f"http://{head}/v1/fleet",  # http only
                                    timeout=FLEET_TIMEOUT_S) as r:
            data = json.loads(r.read(MAX_FLEET_BYTES))
    except (OSError, ValueError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", exc)
        return [], f"(no head answered at {head}: {reason}; {unseen})"
    nodes = data.get("nodes", []) if isinstance(data, dict) else []
    return [n for n in nodes if isinstance(n, dict)] if isinstance(nodes, list) else [], ""


def fleet_models(head: str) -> tuple[dict[str, list[str]], str]:
    """Model name -> the fleet nodes serving it, from the head's /v1/fleet; and a line when
    the head could not be asked."""
    nodes, note = fleet_nodes(head, "fleet nodes are not shown")
    out: dict[str, list[str]] = {}
    for n in nodes:
        if isinstance(n.get("model"), str):
            out.setdefault(n["model"].lower(), []).append(str(n.get("identity") or n.get("key")))
    return out, note


def _served_names(m: model_store.StoredModel) -> set[str]:
    """The names a node serving ``m`` goes by: its spec, and its repo for the default."""
    names = {m.name.lower(), m.spec.lower()} - {""}
    if m.repo:
        names.add(m.repo.lower())
    return names


def _list(home: Path, head: str) -> int:
    kept = model_store.kept_models(home)
    if not kept:
        print("no models on this machine yet; `shoal models catalog --fits` shows some to pull")
        return 0
    by_name, note = fleet_models(head)
    now = time.time()
    rows = [("NAME", "SIZE", "SERVED BY", "LAST USED")]
    for m in kept:
        fleet = sorted({n for name in _served_names(m) for n in by_name.get(name, [])})
        served = ", ".join([*m.served_by, *fleet]) or "-"
        rows.append((m.name, amount(m.size), served, _ago(m.last_used, now)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
    count = f"{len(kept)} model" + ("" if len(kept) == 1 else "s")
    print(f"{count}, {amount(model_store.total_bytes(kept))} in all")
    if note:
        print(note)
    return 0


def _catalog(home: Path, *, fits: bool, budget: str | None, head: str = HTTP_DEFAULT) -> int:
    from engine.models.catalog import CatalogError, load_catalog

    try:
        catalog, line = load_catalog(home)
    except CatalogError as exc:
        raise StartError(str(exc)) from None
    if line:
        print(line)
    title = f"catalog v{catalog.version} ({catalog.updated}), {len(catalog.entries)} models"
    results = None
    split: tuple[Suggestion, ...] = ()
    offers: dict[str, SplitOffer] = {}
    unseen = ""
    if fits:
        from engine.config import ConfigError, machine_settings
        from engine.models.choice import fits_for, fleet_split
        from engine.models.machine import this_machine
        from engine.sizes import parse_budget

        try:
            settings, _ = machine_settings(home)
            node = settings.node
            chosen = parse_budget(budget) if budget else (node.memory_budget if node else None)
        except (ConfigError, ValueError) as exc:
            raise StartError(str(exc)) from None
        machine, facts = this_machine(home, budget=chosen, gpu=node.gpu if node else "auto",
                                      name="this machine")
        kept = [m.spec for m in model_store.kept_models(home)]
        results = {f.entry.id: f for f in fits_for(catalog, machine, kept=kept)}
        title += f"; the fit for this machine: {facts}"
        split = fleet_split(catalog, [machine])
        offers, unseen = _fleet_offers(catalog, machine, head)
    print(title)
    for e in catalog.entries:
        caps = ", ".join(c for c, on in (("tools", e.tools), ("fill-in-the-middle", e.fim),
                                          ("thinking", e.thinking)) if on) or "chat"
        if e.embeddings:
            caps = f"embeddings, {e.dimensions} dimensions"
        print(f"\n{e.id}: {e.name}, {e.params_b:g}B, {tokens_text(e.context)} window, {caps}; "
              f"{e.license}" + (f"; MLX {e.mlx_repo}" if e.mlx_repo else ""))
        fitted = {q.quant.name: q for q in results[e.id].quants} if results else {}
        for q in e.quants:
            mark = "*" if q.name == e.default_quant else " "
            text = f"  {mark} {q.name:<8} {amount(q.size):>8}  {e.spec(q.name)}"
            got = fitted.get(q.name)
            if got is not None:
                text += f"  {got.fit.line}" + ("  (downloaded)" if got.kept else "")
            print(text)
        offer = offers.get(e.id)
        if offer is not None:
            print(f"    no machine holds it alone; {offer.quant} {offer.proposal.line}: "
                  f"`{offer.command()}`")
    print("\n* the default quantisation; serve one with `shoal serve ID` or pull it with "
          "`shoal models pull ID`")
    if results is not None:
        _suggested(split)
    if unseen:
        print(unseen)
    return 0


def _fleet_offers(catalog: Catalog, here: Machine, head: str
                  ) -> tuple[dict[str, SplitOffer], str]:
    """The catalog models no machine of the fleet holds alone, split across those that lend
    memory (each machine named as /v1/fleet names it), by entry id; and a line when the
    head (which knows the fleet's machines) could not be asked."""
    from engine.models.choice import split_offers
    from engine.models.commands import machine_of_json

    nodes, note = fleet_nodes(head, "a model no machine holds alone is not offered split "
                                    "across the fleet")
    machines = [here]
    for n in nodes:
        if n.get("key") == "local":  # this machine's own node: its name and what it lends
            lend = n.get("lend_bytes")
            machines[0] = replace(here, name=str(n.get("identity") or here.name)[:256],
                                  lend=lend if isinstance(lend, int) and lend >= 0 else 0)
        elif (other := machine_of_json(n)) is not None:
            machines.append(other)
    return {o.entry_id: o for o in split_offers(catalog, machines)}, note


def _suggested(split: tuple[Suggestion, ...]) -> None:
    """The models suggested for this machine, fitting together: its main model, and the
    autocomplete and embeddings models beside it."""
    if not split:
        print("\nnothing in the catalog fits this machine's budget; raise it with "
              "--memory-budget")
        return
    print(f"\nsuggested for this machine, together within its budget (usable: chat from "
          f"{CHAT_TPS:g} tok/s, autocomplete from {AUTOCOMPLETE_TPS:g}):")
    for s in split:
        roles = " and ".join((s.role, *s.also))
        print(f"  {roles}: {s.candidate.entry_id} {s.candidate.quant} ({s.fit_line})")


def _pull(home: Path, model: str) -> int:
    """Pull ``model`` (a catalog id or a hub id) into this machine's cache, printing the
    pull's lines as `shoal serve` does: each step, then every tenth with rate and time left.
    Interrupted (Ctrl-C, the network), it resumes from where it stopped on the next try."""
    import asyncio

    from engine.cli.run import PullLines
    from engine.events import PullProgress
    from engine.service import Shoal
    from engine.settings import Settings

    spec = _spec_of(home, model)

    async def pull() -> Path:
        shoal = Shoal(Settings(home=home))  # nothing started: only its pull
        lines = PullLines()

        async def show() -> None:
            async for event in events:
                if isinstance(event, PullProgress):
                    for line in lines.lines(event):
                        print(f"shoal: {line}", flush=True)

        events = shoal.events()
        shown = asyncio.get_running_loop().create_task(show())
        try:
            return await shoal.pull_model(spec, runtime="llamacpp")
        finally:
            events.close()
            await shown  # the lines already published, then it ends
            await shoal.stop(drain=0)

    path = asyncio.run(pull())
    print(f"{spec} is ready at {path}; serve it with `shoal serve {spec}`")
    return 0


def _spec_of(home: Path, model: str) -> str:
    """``model`` as a hub id: a catalog id's default quantisation, else as given."""
    from engine.models.catalog import CatalogError, load_catalog

    try:
        catalog, _ = load_catalog(home)
    except CatalogError:
        return model  # a broken catalog does not stop an ask by id
    entry = catalog.get(model)
    return entry.spec() if entry is not None else model


def _serve_split(home: Path, model: str, split: str, head: str) -> int:
    """Ask the head to serve ``model`` on the first machine of ``split``, its last layers
    on the memory the others lend; the head asks the machines and says what happens."""
    from engine.cli.http import call

    machines = [m.strip() for m in split.split(",") if m.strip()]
    body = json.dumps({"model": _spec_of(home, model), "split": machines}).encode()
    print(call(head, "POST", "/v1/fleet/serve", body)["message"])
    return 0


def parse_idle(text: str) -> float | None:
    """A model's idle time as `shoal models keep-alive` takes it: seconds, math.inf for
    never, None for the node's own. StartError (one line) for anything else."""
    value = text.strip().lower()
    if value == "default":
        return None
    if value == "never":
        return math.inf
    try:
        return model_set.keep_alive_seconds(value, model_set.DEFAULT_KEEP_ALIVE_S)
    except model_set.BadKeepAlive as exc:
        raise StartError(f"{exc}, never, or default") from None


def _keep_alive(home: Path, name: str, idle: str | None) -> int:
    try:
        stored = model_store.find_kept(model_store.kept_models(home), name)
    except model_store.ModelNotKept as exc:
        raise StartError(str(exc)) from None
    if idle is None:
        print(f"{stored.name} {model_set.idle_words(stored.keep_alive_s)}")
        return 0
    seconds = parse_idle(idle)
    model_store.set_keep_alive(home, stored.name, seconds)
    print(f"{stored.name} {model_set.idle_words(seconds)} (a node running now takes it at "
          "its next start; the app's Models page sets it at once)")
    return 0


def _import(home: Path, file: Path, name: str | None) -> int:
    shown = [-1]

    def progress(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > shown[0]:
            shown[0] = tenth
            print(f"shoal: copying {file.name}: {tenth * 10}% of {amount(total)}", flush=True)

    try:
        kept = model_store.import_gguf(home, file, name, progress=progress)
    except model_store.CannotImport as exc:
        raise StartError(str(exc)) from None
    print(f"kept {file} as {kept.name} ({amount(kept.size)}); serve it with "
          f"`shoal serve {kept.name}`")
    return 0

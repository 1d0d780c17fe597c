"""The models a head learns besides its own: the tokenizer and template of a model a fleet
node serves, read from the model's file when this machine has it, else from its GGUF
header alone (`engine.models.pulls.header_fetch`: megabytes, not the whole model).

Every slow step runs in a worker thread.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.errors import StartError
from engine.head.prompt.model import HeadModel
from engine.models import cache as model_cache
from engine.models import errors as model_errors
from engine.models import ids
from engine.models.loading import Resolved, load_head_model
from engine.models.pulls.header_fetch import HeaderFile, fetch_header
from engine.sizes import amount

READS_HEADERS = ("llamacpp", "mock")  # the runtimes a head learns a model through here


async def learn_model(spec: str, runtime: str, *, home: Path, offline: bool
                      ) -> tuple[HeadModel, str]:
    """The head's model ``spec`` through ``runtime``, and a line of what was fetched for it
    ("" when nothing was). StartError (one line) when it cannot be had."""
    name = ids.model_name(spec)
    if runtime == "mock":  # its vocabulary needs no file
        return await load_head_model(Resolved(path=spec, name=name, runtime=runtime)), ""
    if runtime not in READS_HEADERS:
        raise StartError(f"this head reads tokenizers through {runtime}, which takes no GGUF "
                         f"header; pull {spec} on this machine to serve it here",
                         code="cannot_load")
    try:
        path, got = await asyncio.to_thread(_gguf_for, spec, home, offline)
    except model_errors.ModelMissing as exc:
        raise StartError(str(exc), code="model_missing") from None
    model = await load_head_model(Resolved(path=str(path), name=name, runtime=runtime))
    line = "" if got is None or not got.fetched else (
        f"read the tokenizer and template of {name} from {amount(got.fetched)} of its "
        f"{amount(got.size)} file")
    return model, line


def _gguf_for(spec: str, home: Path, offline: bool) -> tuple[Path, HeaderFile | None]:
    """The model's file when it is here (a path, or a hub id pulled before), else its
    header file (fetched unless fetched before)."""
    try:
        return model_cache.resolve_model(spec, home=home, offline=True), None
    except model_errors.ModelMissing:
        if ids.looks_like_path(spec):
            raise
    got = fetch_header(spec, home=home, offline=offline)
    return got.path, got

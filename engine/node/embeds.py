"""A node's answer to an Embed record: its engine's vectors, or an Error saying why not."""

from __future__ import annotations

import contextlib
import logging

from engine.link import messages as m
from engine.link.mux import Carrier
from engine.link.transport import LinkClosed
from engine.runtimes.base import Embedder

log = logging.getLogger("shoal.node")


def refusal(engine: object, model: str, rec: m.Embed) -> m.Error | None:
    """Why this node's engine cannot take ``rec`` at all (a head asked the wrong node)."""
    if not isinstance(engine, Embedder):
        return m.Error(code="bad_request",
                       message=f"this node's model '{model}' makes no embeddings; ask a node "
                               "that serves an embedding model")
    if not all(rec.inputs):
        return m.Error(code="bad_request", message="an input to embed has no tokens")
    return None


async def answer(engine: Embedder, link: Carrier, rec: m.Embed) -> None:
    """Embed ``rec``'s inputs and send the vectors (or why not) back on ``link``."""
    try:
        out = await engine.embed(rec.inputs)
    except ValueError as exc:  # an input the model cannot take: the request's to fix
        reply: m.ChannelRecord = m.Error(code="bad_request", message=str(exc)[:4000])
    except Exception as exc:  # the runtime failed: the head may try another node
        log.error("embedding %s failed on this node: %s", rec.session, exc)
        reply = m.Error(code="internal", message=f"the node's runtime failed: "
                                                 f"{str(exc)[:3000]}")
    else:
        if out.count != len(rec.inputs) or len(out.vectors) != out.count * out.dims * 4:
            reply = m.Error(code="internal", message="the node's runtime gave "
                            f"{out.count} vectors for {len(rec.inputs)} inputs")
        elif len(out.vectors) > m.MAX_EMBED_BYTES or out.dims > m.MAX_EMBED_DIMS:
            reply = m.Error(code="bad_request",
                            message=f"{out.count} vectors of {out.dims} dimensions exceed "
                                    "one record; send fewer inputs at a time")
        else:
            reply = m.Embedded(session=rec.session, dims=out.dims, count=out.count,
                               vectors=out.vectors, prompt_tokens=out.tokens)
    with contextlib.suppress(LinkClosed):  # the head went: nobody hears it
        link.send(reply)

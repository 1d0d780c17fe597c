"""Embeddings through the fleet: a request's inputs go to nodes serving the model in
records of at most ``CHUNK`` inputs, each placed like a session (the same queue, the same
placement, a free lane each), on several nodes' lanes at once when they are free. A node
that fails a record or does not answer is left out for that record, which goes to the next;
one that says busy is tried again once placement finds it free."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import RequestError
from engine.head.fleet.links import ConnClosed, Inbound, NodeConn
from engine.head.fleet.sessions import Job, SessionRunner
from engine.link import messages as m
from engine.link.transport import LinkClosed

# inputs in one record: 64 vectors of the widest model a record carries stay within it
CHUNK = m.MAX_EMBED_BYTES // (m.MAX_EMBED_DIMS * 4)
ANSWER_S = 300.0  # a node's answer to one record (64 long inputs on a slow CPU take long)
TRIES = 4  # nodes one record is tried on before the request fails


@dataclass(frozen=True, slots=True)
class EmbedJob:
    session: str  # unique per request: names its records on the link
    model: str
    inputs: list[list[int]]  # token ids, the model's special tokens included
    pin_host: str | None = None
    prefer: tuple[str, ...] = ()
    keep_alive_s: float | None = None  # Ollama's keep_alive (Embed.keep_alive_s)


@dataclass(frozen=True, slots=True)
class EmbedAnswer:
    dims: int
    vectors: bytes  # float32, little-endian, one vector after another in input order
    prompt_tokens: int
    nodes: tuple[str, ...]  # who made them, in order of the records


@dataclass(frozen=True, slots=True)
class _Retry:
    why: str
    drop: bool  # the node failed: leave it out for this record (else it was only busy)


def judge(reply: Inbound | None, count: int) -> m.Embedded | _Retry:
    """What a node's reply to an Embed of ``count`` inputs means (None: no answer in
    time). Raises RequestError for a request no node can answer (the node said why)."""
    if isinstance(reply, m.Embedded):
        if reply.count != count or len(reply.vectors) != count * reply.dims * 4:
            return _Retry(f"the node sent {reply.count} vectors for {count} inputs", True)
        return reply
    if reply is None:
        return _Retry(f"the node did not answer in {ANSWER_S:.0f} s", True)
    if isinstance(reply, ConnClosed):
        return _Retry(f"the link to the node closed ({reply.reason})", True)
    if isinstance(reply, m.Error):
        if reply.code == "bad_request":
            raise RequestError(reply.message)
        if reply.code == "context_length_exceeded":
            raise RequestError(reply.message, code="context_length_exceeded")
        return _Retry(reply.message, reply.code != "busy")
    return _Retry(f"the node answered with {type(reply).__name__}", True)


def chunks(inputs: Sequence[list[int]], size: int = CHUNK) -> list[list[list[int]]]:
    return [list(inputs[i:i + size]) for i in range(0, len(inputs), size)]


async def embed(runner: SessionRunner, job: EmbedJob) -> EmbedAnswer:
    """Every input's vector, in order. Raises RequestError (no node, the fleet busy, an
    input a node refuses)."""
    parts = chunks(job.inputs)
    try:
        async with asyncio.TaskGroup() as group:  # one failing record cancels the others
            tasks = [group.create_task(_record(runner, job, i, part))
                     for i, part in enumerate(parts)]
    except ExceptionGroup as failed:  # the first record's refusal is the request's
        raise failed.exceptions[0] from None
    done = [t.result() for t in tasks]
    dims = {rec.dims for rec, _node in done}
    if len(dims) != 1:  # two nodes serving one name disagree: not the same model
        raise RequestError(f"nodes serving '{job.model}' gave vectors of "
                           f"{' and '.join(str(d) for d in sorted(dims))} dimensions; serve "
                           "one model under one name", code="internal_error")
    return EmbedAnswer(dims=dims.pop(), vectors=b"".join(rec.vectors for rec, _ in done),
                       prompt_tokens=sum(rec.prompt_tokens for rec, _ in done),
                       nodes=tuple(node for _, node in done))


async def _record(runner: SessionRunner, job: EmbedJob, index: int,
                  part: list[list[int]]) -> tuple[m.Embedded, str]:
    session = f"{job.session}-{index}"
    # placement keeps room for one generated token, which an embedding never makes
    longest = max(len(x) for x in part) - 1
    placing = Job(session=session, model=job.model, prompt=[], max_tokens=1,
                  pin_host=job.pin_host, prefer=job.prefer)
    deadline = runner.clock() + runner.queue_timeout_s
    exclude: frozenset[str] = frozenset()
    why = ""
    for _ in range(TRIES):
        pool, conn, _reason = await runner.acquire(placing, longest, 1, exclude, deadline)
        reply: Inbound | None = None
        try:
            reply = await _ask(conn, m.Embed(session=session, inputs=part,
                                             keep_alive_s=job.keep_alive_s, model=job.model))
            verdict = judge(reply, len(part))
        finally:
            clean = isinstance(reply, m.Embedded | m.Error) and not conn.closed
            pool.release(conn, reusable=clean)
        if isinstance(verdict, m.Embedded):
            return verdict, pool.info.identity or pool.address
        why = verdict.why
        if verdict.drop:
            exclude |= {pool.key}
        else:
            pool.mark_full(runner.clock())
    raise RequestError(f"no node of the fleet could embed the input: {why}; retry later",
                       code="no_node_available", retry_after=10)


async def _ask(conn: NodeConn, record: m.Embed) -> Inbound | None:
    """Send ``record`` on ``conn`` and wait for its answer (None: none in ANSWER_S)."""
    answered: asyncio.Future[Inbound] = asyncio.get_running_loop().create_future()

    def sink(rec: Inbound) -> None:
        if not answered.done() and (
                isinstance(rec, m.Error | ConnClosed)
                or (isinstance(rec, m.Embedded) and rec.session == record.session)):
            answered.set_result(rec)

    conn.sink = sink
    try:
        if conn.closed:
            return ConnClosed(conn.close_reason)
        try:
            conn.link.send(record)
        except LinkClosed as exc:
            return ConnClosed(str(exc))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ANSWER_S):
                return await answered
        return None
    finally:
        if conn.sink is sink:
            conn.sink = None

"""``python -m engine.roles.engine_process``: one model's engine in a process of its own,
for a node whose engine may abort (a model split across machines: llama.cpp's RPC client
ends its process when a lending machine leaves). engine.runtimes.isolated starts it and
speaks to it: a Load record on stdin, then generations and cancels; Ready, tokens and stats
back on stdout. It ends when its stdin does, so it never outlives its node."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys

from engine.errors import StartError
from engine.models.loading import Resolved, load_engine
from engine.runtimes import isolated

log = logging.getLogger("shoal.node")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: killed with the node even when the node is killed outright (its stdin's end
    is the portable way, and is seen once the loop reads)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


async def _run(records_fd: int) -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(records_fd, "wb", buffering=0))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    try:
        load = await isolated.read_frame(reader, isolated.to_child)
    except asyncio.IncompleteReadError:
        return 0
    if not isinstance(load, isolated.Load):
        return 2
    try:
        engine = await load_engine(
            Resolved(path=load.path, name=load.name, runtime=load.runtime), name=load.name,
            lanes=load.lanes, max_context=load.max_context, mock_speed=load.mock_speed,
            memory_budget=load.memory_budget or None, kv_type=load.kv_type, gpu=load.gpu,
            split_with=load.split_with)
    except StartError as exc:
        writer.write(isolated.frame(isolated.StartFailed(message=str(exc)[:isolated.MAX_LINE],
                                                         code=exc.code)))
        await writer.drain()
        return 1
    try:
        writer.write(isolated.frame(isolated.Ready(info=engine.info, stats=engine.stats())))
        await isolated.serve(engine, reader, writer.write)
    finally:
        await engine.close()
    return 0


def main() -> int:
    # fd 1 carries the records: keep it for them, and send whatever else prints (llama.cpp)
    # to stderr, the node's log
    records_fd = os.dup(1)
    os.dup2(2, 1)
    _die_with_parent()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("shoal engine: %(message)s"))
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger().setLevel(logging.INFO)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the node, which ends it
    return asyncio.run(_run(records_fd))


if __name__ == "__main__":
    sys.exit(main())

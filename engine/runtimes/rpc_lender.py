"""``python -m engine.runtimes.rpc_lender 127.0.0.1:PORT CACHE_DIR THREADS [LEND_BYTES]``:
llama.cpp's RPC server on this machine's CPU, for engine.node.lending, which starts it and
ends it. A process of its own: the server serves until it is killed and has no way to
stop; it ends when its stdin does, so that it never outlives its node.

With ``LEND_BYTES`` (Linux), the process's data segment is limited to what the machine
lends and :data:`HEADROOM` for the process itself: llama.cpp's server allocates whatever
its client asks, and the owner's budget must hold against a peer that asks for more
(the allocation fails there, and the serving side's split ends as for a lender that left).
"""

from __future__ import annotations

import os
import sys
import threading

from engine.runtimes import rpc

HEADROOM = 512 << 20  # the interpreter, llama.cpp and its threads (~110 MB measured idle)


def _end_with_stdin() -> None:
    """A thread: the node ended (even killed outright) when its end of our stdin closes."""
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)


def _limit(lend_bytes: int) -> None:
    if not sys.platform.startswith("linux") or lend_bytes <= 0:
        return  # macOS counts RLIMIT_DATA otherwise, and llama.cpp's Metal memory apart
    import resource

    limit = lend_bytes + HEADROOM
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print("usage: python -m engine.runtimes.rpc_lender 127.0.0.1:PORT CACHE_DIR THREADS "
              "[LEND_BYTES]", file=sys.stderr)
        return 2
    endpoint, cache_dir, threads = argv[:3]
    if len(argv) == 4:
        _limit(int(argv[3]))
    threading.Thread(target=_end_with_stdin, name="stdin-watch", daemon=True).start()
    rpc.serve(endpoint, cache_dir, int(threads))
    return 1  # it returns only when it could not serve (its line is on stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

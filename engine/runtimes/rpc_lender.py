"""``python -m engine.runtimes.rpc_lender 127.0.0.1:PORT CACHE_DIR THREADS``: llama.cpp's RPC
server on this machine's CPU, for engine.node.lending, which starts it and ends it. A
process of its own: the server serves until it is killed and has no way to stop; it ends
when its stdin does, so that it never outlives its node."""

from __future__ import annotations

import os
import sys
import threading

from engine.runtimes import rpc


def _end_with_stdin() -> None:
    """A thread: the node ended (even killed outright) when its end of our stdin closes."""
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m engine.runtimes.rpc_lender 127.0.0.1:PORT CACHE_DIR THREADS",
              file=sys.stderr)
        return 2
    endpoint, cache_dir, threads = argv
    threading.Thread(target=_end_with_stdin, name="stdin-watch", daemon=True).start()
    rpc.serve(endpoint, cache_dir, int(threads))
    return 1  # it returns only when it could not serve (its line is on stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

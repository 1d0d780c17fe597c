"""Our engine alone in a process of its own, for ``scripts/bench/node_memory.py``.

The parent reads this process's resident memory (``/proc/PID/status``), so the
process holds what a node's process holds to serve and nothing of the benchmark:
the node's own modules (``engine.node.agent`` brings the link and the runtimes a
node runs) and one ``LlamaCppEngine``. It takes one JSON command a line on stdin
and answers each with one JSON line on stdout:

  {"op": "gen", "prompts": [[ids], ...], "max_tokens": N, "sessions": [..], "stop_ids": [..]}
      -> {"replies": [{"ttft": s, "tokens": n, "cached": n, "prompt": n, "finish": ..}],
          "stats": {...}}    (the prompts run concurrently, greedy)
  {"op": "stats"}  -> {"stats": {...}}
  {"op": "quit"}   -> the engine closes and the process exits

Its first line, once the model is loaded: ``{"ready": {"info": .., "stats": ..,
"pool_cells": n, "rss_before_load": bytes}}``. With ``SHOAL_LLAMA_LOG=1`` in its
environment llama.cpp's log goes to stderr (the parent reads the KV pool's size there).

Run: .venv/bin/python scripts/bench/node_memory_runner.py '{"model": PATH, "lanes": 8,
     "memory_budget": BYTES|null, "kv_type": "f16", "pool_cells": N|null, "threads": N}'
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import engine.node.agent  # noqa: E402, F401  (what a node's process imports to serve)
from engine.runtimes.base import GenerationRequest, Sampling  # noqa: E402
from engine.runtimes.budget import process_rss_bytes  # noqa: E402
from engine.runtimes.llamacpp import LlamaCppEngine  # noqa: E402

GREEDY = Sampling(temperature=0.0)


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def one(engine: LlamaCppEngine, prompt: list[int], max_tokens: int, session: str,
              stop: frozenset[int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = 0.0
    gen = engine.generate(GenerationRequest(
        prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, session=session,
        stop_ids=stop))
    out: list[int] = []
    async for ids in gen:
        if not ttft:
            ttft = time.perf_counter() - t0
        out.extend(ids)
    res = gen.result
    return {"ttft": ttft or time.perf_counter() - t0, "tokens": res.completion_tokens,
            "cached": res.cached_tokens, "prompt": res.prompt_tokens,
            "finish": res.finish_reason, "ids": out}


async def serve(conf: dict[str, Any]) -> None:
    rss0 = process_rss_bytes()
    engine = LlamaCppEngine(conf["model"], model_name="bench", lanes=int(conf["lanes"]),
                            memory_budget=conf.get("memory_budget"),
                            kv_type=conf.get("kv_type", "f16"),
                            pool_cells=conf.get("pool_cells"),
                            max_context=conf.get("max_context"),
                            n_threads=conf.get("threads"))
    await engine.start()
    try:
        say({"ready": {"info": dataclasses.asdict(engine.info),
                       "stats": dataclasses.asdict(engine.stats()),
                       "pool_cells": engine.pool_cells, "rss_before_load": rss0}})
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                return
            if cmd["op"] == "stats":
                say({"stats": dataclasses.asdict(engine.stats())})
                continue
            prompts: list[list[int]] = cmd["prompts"]
            sessions = cmd.get("sessions") or [""] * len(prompts)
            stop = frozenset(int(t) for t in cmd.get("stop_ids") or ())
            replies = await asyncio.gather(*(
                one(engine, p, int(cmd["max_tokens"]), s, stop)
                for p, s in zip(prompts, sessions, strict=True)))
            say({"replies": list(replies), "stats": dataclasses.asdict(engine.stats())})
    finally:
        await engine.close()


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))

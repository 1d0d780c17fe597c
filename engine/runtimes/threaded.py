"""The asyncio side of a generation that a decode thread runs.

A runtime's decode thread hands tokens to the event loop through
``loop.call_soon_threadsafe(sink.push, tokens, result)``; the caller iterates a
:class:`ThreadedGeneration` for batches of ids. Shared by the llama.cpp and mlx
runtimes.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Callable, Sequence

from engine.runtimes.base import GenerationResult


def check_prompt(prompt: Sequence[int], *, window: int, n_vocab: int) -> list[int]:
    """The prompt as a list, or ValueError naming what is wrong with it and the fix."""
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty; send at least one token")
    if len(ids) >= window:
        raise ValueError(f"the prompt has {len(ids)} tokens and the window is {window}; "
                         "shorten it or start the node with a larger --max-context")
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary of {n_vocab}")
    return ids


class TokenSink:
    """Where the decode thread drops tokens; lives on the caller's event loop."""

    __slots__ = ("_buf", "_done", "_event", "_result", "loop", "prefilled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # prompt tokens read so far, written by the decode thread (an int store is atomic)
        self.prefilled = 0
        self._buf: list[int] = []
        self._done = False
        self._result: GenerationResult | None = None
        self._event = asyncio.Event()

    def hand_over(self, tokens: list[int], result: GenerationResult | None) -> bool:
        """From the decode thread: pass tokens (and the end) to the loop.

        False when the caller's loop is gone and nobody reads this generation.
        """
        if not tokens and result is None:
            return True
        try:
            self.loop.call_soon_threadsafe(self.push, tokens, result)
        except RuntimeError:
            return False
        return True

    # called on the loop (through call_soon_threadsafe)
    def push(self, tokens: list[int], result: GenerationResult | None) -> None:
        if self._done:
            return
        self._buf.extend(tokens)
        if result is not None:
            self._result = result
            self._done = True
        self._event.set()


class ThreadedGeneration:
    """A running generation: async-iterate for batches of ids, then read ``result``.

    ``post_cancel(job_id)`` asks the decode thread to stop the job and free its lane.
    """

    def __init__(self, post_cancel: Callable[[int], None], job_id: int,
                 sink: TokenSink) -> None:
        self._sink = sink
        self._job_id = job_id
        self._cancel = post_cancel
        # a generation dropped without being read frees its lane
        self._finalizer = weakref.finalize(self, post_cancel, job_id)
        self._finalizer.atexit = False

    def __aiter__(self) -> AsyncGenerator[list[int], None]:
        return self._iterate()

    async def _iterate(self) -> AsyncGenerator[list[int], None]:
        sink = self._sink
        try:
            while True:
                if sink._buf:
                    batch = sink._buf
                    sink._buf = []
                    yield batch
                    continue
                if sink._done:
                    self._finalizer.detach()
                    return
                sink._event.clear()
                await sink._event.wait()
        finally:
            if not sink._done:
                self.cancel()

    @property
    def done(self) -> bool:
        return self._sink._done

    @property
    def prefilled(self) -> int:
        """Prompt tokens read so far (reused ones included): the node reports it to the
        head while the first token is still coming."""
        return self._sink.prefilled

    @property
    def result(self) -> GenerationResult:
        res = self._sink._result
        if res is None:
            raise RuntimeError("the generation is still running; read result after iterating")
        return res

    def cancel(self) -> None:
        if not self._sink._done:
            self._cancel(self._job_id)

    async def wait(self) -> GenerationResult:
        """Drain what is left and return the result."""
        async for _ in self:
            pass
        return self.result

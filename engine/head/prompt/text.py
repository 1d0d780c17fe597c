"""Token ids to text on the head: incremental UTF-8 and stop strings (pure)."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class Detokenizer:
    """Turns a stream of token ids into text without splitting a UTF-8 character."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(b"".join(self._bytes(i) for i in ids))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


# Longest stop string a request may send (OpenAI allows short stops only): the
# text held back while a stop might be starting is shorter than this.
MAX_STOP_CHARS = 256


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could begin one.

    ``feed`` returns the text safe to deliver and whether a stop string was
    hit (the stop string itself and anything after it are never delivered).
    Within one ``feed``, the stop that starts earliest wins; ``matched`` says which.

    One Aho-Corasick automaton over all the stop strings, fed one character at
    a time: its state is the longest tail of the text so far that begins some
    stop string, which is exactly the text to hold back. Each character costs
    amortised O(1) steps whatever the number and length of the stops; ``steps``
    counts them (transitions and failure links taken).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._any = any(stops)
        self._longest = max((len(s) for s in stops), default=0)
        # node 0 is the root; node n stands for the stop prefix of length depth[n]
        self._goto: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._out = [0]  # length of the longest stop that ends at this node, 0 if none
        self.steps = 0
        for stop in stops:
            self._add(stop)
        self._link()
        self._state = 0
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once hit

    def _add(self, stop: str) -> None:
        node = 0
        for ch in stop:
            self.steps += 1
            nxt = self._goto[node].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[node][ch] = nxt
                self._goto.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._out.append(0)
            node = nxt
        if stop:
            self._out[node] = len(stop)

    def _link(self) -> None:
        """Failure links breadth first: each node's longest proper suffix in the trie."""
        queue = list(self._goto[0].values())
        for node in queue:  # the queue grows as it is walked
            for ch, child in self._goto[node].items():
                queue.append(child)
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    self.steps += 1
                    f = self._fail[f]
                nxt = self._goto[f].get(ch, 0)
                self._fail[child] = nxt if nxt != child else 0
                self._out[child] = max(self._out[child], self._out[self._fail[child]])

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._any:
            return text, False
        buf = self._held + text
        goto, fail, out = self._goto, self._fail, self._out
        state, steps = self._state, 0
        best = -1  # start of the earliest stop found in this feed
        end = len(buf)
        i = len(self._held)  # the held text is already in the state
        while i < end:
            ch = buf[i]
            while state and ch not in goto[state]:
                state = fail[state]
                steps += 1
            state = goto[state].get(ch, 0)
            steps += 1
            n = out[state]
            i += 1
            if n and (best == -1 or i - n < best):
                best = i - n
                self.matched = buf[best:i]
                # a stop that starts before ``best`` ends before best + longest
                end = min(end, best + self._longest - 1)
        self.steps += steps
        if best != -1:
            self.stopped = True
            self._held = ""
            return buf[:best], True
        self._state = state
        keep = self._depth[state]
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

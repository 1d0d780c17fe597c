from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.head.prompt.text import MAX_STOP_CHARS, Detokenizer, StopMatcher


def test_detokenizer_never_splits_a_character():
    data = "héllo ✓ 世界".encode()
    d = Detokenizer(lambda t: bytes([t]))
    pieces = [d.feed([b]) for b in data]
    assert "".join(pieces) + d.flush() == "héllo ✓ 世界"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_pieces_is_cut_and_never_delivered():
    s = StopMatcher(["END"])
    out = []
    for piece in ["abc E", "N", "D tail"]:
        text, hit = s.feed(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "abc "
    assert s.stopped


def test_held_prefix_is_released_when_it_was_not_a_stop():
    s = StopMatcher(["END"])
    assert s.feed("abc EN") == ("abc ", False)
    assert s.feed("x") == ("ENx", False)
    assert s.flush() == ""


@given(st.text(max_size=60), st.lists(st.integers(1, 10), max_size=20))
def test_stop_matcher_equals_one_shot_find(text, cuts):
    stop = "zz"
    s = StopMatcher([stop])
    out, i = [], 0
    for c in [*cuts, len(text)]:
        piece = text[i:i + c]
        i += c
        t, hit = s.feed(piece)
        out.append(t)
        if hit:
            break
    else:
        out.append(s.flush())
    got = "".join(out)
    expected = text.split(stop)[0]
    assert got == expected


# -- the matcher against a naive reference ---------------------------------------------


class NaiveStopMatcher:
    """The matcher as it was: every stop searched, every prefix tried, on each feed."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = -1
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.stopped = True
            self._held = ""
            return buf[:cut], True
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


def trace(matcher: StopMatcher | NaiveStopMatcher, chunks: list[str]) -> list[object]:
    """Every feed's answer, then flush: the whole observable behaviour."""
    out: list[object] = [matcher.feed(c) for c in chunks]
    out.append(matcher.flush())
    out.append(matcher.stopped)
    return out


STOP_CASES = [
    # stops, chunks, delivered text, stopped
    (["END"], ["abc E", "N", "D tail"], "abc ", True),
    (["END"], ["abc EN", "x"], "abc ENx", False),
    (["abcd", "bc"], ["abcd"], "", True),  # in one feed the earliest start wins
    (["abcd", "bc"], ["a", "b", "c", "d"], "a", True),  # streamed: "bc" ends first
    (["ab", "xaby"], ["xab"], "x", True),  # a stop inside a longer one's prefix
    (["aab"], ["a", "a", "a", "a", "b"], "aa", True),  # the failure link keeps "aa"
    (["abab"], ["aba", "bab"], "", True),
    (["abab"], ["ab", "ac", "ab"], "abacab", False),
    (["a", "b"], ["xyz", "zzb"], "xyzzz", True),
    (["", "x"], ["ab", "cx"], "abc", True),  # empty stops are ignored
    ([""], ["ab"], "ab", False),
    ([], ["a", "b"], "ab", False),
    (["\n\n", "</s>"], ["one\n", "\ntwo"], "one", True),
    (["</s>"], ["a</", "s", ">b"], "a", True),
    (["é✓"], ["xé", "✓y"], "x", True),
]


@pytest.mark.parametrize(("stops", "chunks", "text", "stopped"), STOP_CASES)
def test_stop_matcher_table(stops: list[str], chunks: list[str], text: str,
                            stopped: bool) -> None:
    new, naive = StopMatcher(stops), NaiveStopMatcher(stops)
    got = trace(new, chunks)
    assert got == trace(naive, chunks)
    delivered = "".join(t for t, _ in got[:-2]) + got[-2]  # type: ignore[misc]
    assert (delivered, new.stopped) == (text, stopped)


ALPHABET = "ab c"
STOPS = st.lists(st.text(ALPHABET, min_size=1, max_size=6), max_size=5)


def chunked(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=500, deadline=None)
@given(stops=STOPS, text=st.text(ALPHABET, max_size=60),
       cuts=st.lists(st.integers(0, 200), max_size=20))
def test_stop_matcher_equals_the_naive_one_on_any_chunking(
        stops: list[str], text: str, cuts: list[int]) -> None:
    chunks = chunked(text, cuts)
    assert trace(StopMatcher(stops), chunks) == trace(NaiveStopMatcher(stops), chunks)


@settings(max_examples=200, deadline=None)
@given(stops=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3),
       text=st.text(max_size=40), cuts=st.lists(st.integers(0, 60), max_size=10))
def test_stop_matcher_equals_the_naive_one_on_any_text(
        stops: list[str], text: str, cuts: list[int]) -> None:
    chunks = chunked(text, cuts)
    assert trace(StopMatcher(stops), chunks) == trace(NaiveStopMatcher(stops), chunks)


def feed_all(matcher: StopMatcher, text: str, sizes: list[int]) -> tuple[str, bool]:
    out, i, k = [], 0, 0
    while i < len(text):
        size = sizes[k % len(sizes)]
        k += 1
        piece, hit = matcher.feed(text[i:i + size])
        i += size
        out.append(piece)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(("stops", "text"), [
    # every tail of the text begins all 16 stops: the naive matcher tried 255 prefixes
    # of each on every feed, and searched the held text again
    (["a" * (MAX_STOP_CHARS - 1) + chr(ord("b") + k) for k in range(16)], "a" * 200_000),
    # periodic stops: a mismatch falls back along many failure links
    (["ab" * (MAX_STOP_CHARS // 2 - 1) + "a" + chr(ord("c") + k) for k in range(16)],
     "ab" * 100_000),
    (["".join(chr(ord("a") + (i * k) % 7) for i in range(MAX_STOP_CHARS)) for k in range(16)],
     "".join(chr(ord("a") + (i * i) % 7) for i in range(200_000))),
])
def test_stop_matcher_work_is_linear(stops: list[str], text: str) -> None:
    assert len(stops) == 16 and all(len(s) == MAX_STOP_CHARS for s in stops)
    built = StopMatcher(stops)
    setup = built.steps
    assert setup <= 2 * sum(len(s) for s in stops)
    matcher = StopMatcher(stops)
    delivered, hit = feed_all(matcher, text, [1, 3, 2, 7])
    assert (delivered, hit) == (text, False)
    # at most one transition and one failure link per character, amortised
    assert matcher.steps - setup <= 2 * len(text)

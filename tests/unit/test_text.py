from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.head.text import Detokenizer, StopMatcher


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

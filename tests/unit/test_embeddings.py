"""The pure parts of embeddings: which models make them, their wire form and bounds, how
the head reads a request's input, cuts a long one, splits a batch and judges a reply."""

from __future__ import annotations

import math

import msgspec
import pytest

from engine.api.embeddings import Inputs, read_input, tokenize, vectors_of
from engine.api.schemas import BadRequest
from engine.errors import RequestError
from engine.head.fleet import embeds
from engine.head.fleet.links import ConnClosed
from engine.head.prompt.model import capabilities, load_head_model
from engine.link import messages as m
from engine.runtimes.embedding import is_embedding_model, pack, unit, unpack


@pytest.mark.parametrize(("meta", "embeds_"), [
    ({"general.architecture": "bert", "bert.pooling_type": "1"}, True),
    ({"general.architecture": "bert"}, True),  # an encoder, whatever its pooling
    ({"general.architecture": "qwen3", "qwen3.pooling_type": "3"}, True),  # last token
    ({"general.architecture": "qwen3"}, False),
    ({"general.architecture": "llama", "llama.pooling_type": "0"}, False),  # none
    ({"general.architecture": "nomic-bert", "nomic-bert.pooling_type": "-1"}, False),
    ({}, False),
])
def test_which_models_make_embeddings(meta, embeds_):
    assert is_embedding_model(meta) is embeds_


def test_vectors_pack_as_float32_little_endian_and_back():
    vs = [[1.0, -2.5, 0.125], [0.0, 3.0, -1.0]]
    data = pack(vs)
    assert len(data) == 2 * 3 * 4
    assert data[:4] == b"\x00\x00\x80\x3f"  # 1.0 as float32, little-endian
    assert unpack(data, 3) == vs


def test_unit_scales_to_length_one_and_leaves_zero_alone():
    v = unit([3.0, 4.0])
    assert v == [0.6, 0.8]
    assert unit([0.0, 0.0]) == [0.0, 0.0]


def test_embed_records_are_bounded():
    too_many = m.Embed(session="s", inputs=[[1]] * (m.MAX_EMBED_INPUTS + 1))
    with pytest.raises(m.RecordError):
        m.decode(m.encode(too_many))
    with pytest.raises(m.RecordError):
        m.decode(m.encode(m.Embed(session="s", inputs=[])))
    wide = m.Embedded(session="s", dims=m.MAX_EMBED_DIMS + 1, count=1, vectors=b"")
    with pytest.raises(m.RecordError):
        m.decode(m.encode(wide))
    big = m.Embedded(session="s", dims=4, count=1, vectors=b"\0" * (m.MAX_EMBED_BYTES + 1))
    with pytest.raises(m.RecordError):
        m.decode(m.encode(big))
    ok = m.Embedded(session="s", dims=2, count=1, vectors=pack([[1.0, 0.0]]), prompt_tokens=3)
    assert m.decode(m.encode(ok)) == ok
    # an older head's hello has no ``embeds``: a node's reads False
    assert m.NodeHello(identity="n", model="x", runtime="mock", context_window=8,
                       lanes=1).embeds is False


def test_a_chunk_of_the_widest_vectors_fits_one_record():
    assert embeds.CHUNK * m.MAX_EMBED_DIMS * 4 <= m.MAX_EMBED_BYTES
    assert embeds.CHUNK <= m.MAX_EMBED_INPUTS
    parts = embeds.chunks([[i] for i in range(150)], 64)
    assert [len(p) for p in parts] == [64, 64, 22]
    assert [x for p in parts for x in p] == [[i] for i in range(150)]


def test_judging_a_nodes_reply():
    good = m.Embedded(session="s", dims=2, count=1, vectors=pack([[1.0, 0.0]]))
    assert embeds.judge(good, 1) is good
    short = embeds.judge(good, 2)
    assert isinstance(short, embeds._Retry) and short.drop
    busy = embeds.judge(m.Error(code="busy", message="all 1 lanes are busy"), 1)
    assert isinstance(busy, embeds._Retry) and not busy.drop
    failed = embeds.judge(m.Error(code="internal", message="boom"), 1)
    assert isinstance(failed, embeds._Retry) and failed.drop and failed.why == "boom"
    gone = embeds.judge(ConnClosed("reset"), 1)
    assert isinstance(gone, embeds._Retry) and gone.drop and "reset" in gone.why
    silent = embeds.judge(None, 1)
    assert isinstance(silent, embeds._Retry) and silent.drop
    with pytest.raises(RequestError) as refused:
        embeds.judge(m.Error(code="bad_request", message="ids outside the vocabulary"), 1)
    assert refused.value.code == "invalid_request"
    with pytest.raises(RequestError) as long:
        embeds.judge(m.Error(code="context_length_exceeded", message="too long"), 1)
    assert long.value.code == "context_length_exceeded"


@pytest.mark.parametrize(("value", "texts", "ids"), [
    ("a", ["a"], None),
    (["a", "b"], ["a", "b"], None),
    ([1, 2, 3], None, [[1, 2, 3]]),
    ([[1], [2, 3]], None, [[1], [2, 3]]),
])
def test_reading_an_input(value, texts, ids):
    assert read_input(value) == Inputs(texts, ids)


@pytest.mark.parametrize("value", [None, [], 3, [1.5], [[]], ["a", 1], [True], [-1],
                                   {"a": 1}, ["x"] * 2049])
def test_a_malformed_input_is_refused(value):
    with pytest.raises(BadRequest):
        read_input(value)


class Wrapped:
    """A vocabulary that puts its special tokens around an input, as BERT's does."""

    def encode_input(self, text: str) -> list[int]:
        return [1, *(ord(c) for c in text), 2]


class Model:
    vocab = Wrapped()


def test_a_long_input_is_cut_to_the_window_keeping_its_closing_token_or_refused():
    model = Model()
    inputs = Inputs(["abcdefgh"], None)
    assert tokenize(model, inputs, window=20, truncate=False) == [[1, *b"abcdefgh", 2]]
    cut = tokenize(model, inputs, window=5, truncate=True)
    assert cut == [[1, *b"abc", 2]]
    with pytest.raises(RequestError) as refused:
        tokenize(model, inputs, window=5, truncate=False)
    assert refused.value.code == "context_length_exceeded"
    assert "10 tokens" in str(refused.value) and "window of 5" in str(refused.value)
    with pytest.raises(RequestError):
        tokenize(model, Inputs([""], None), window=5, truncate=True)
    # token ids are taken as they are, cut without a closing token they do not end with
    assert tokenize(model, Inputs(None, [[7, 8, 9]]), window=2, truncate=True) == [[7, 8]]


def test_fewer_dimensions_cut_each_vector_and_scale_it_again():
    answer = embeds.EmbedAnswer(dims=3, vectors=pack([[0.6, 0.8, 0.0], [0.0, 0.6, 0.8]]),
                                prompt_tokens=4, nodes=("n",))
    assert vectors_of(answer, None) == unpack(answer.vectors, 3)
    cut = vectors_of(answer, 1)
    assert cut == [[1.0], [0.0]]
    two = vectors_of(answer, 2)
    assert math.isclose(two[1][1], 1.0)


def test_an_embedding_models_capabilities():
    embed = load_head_model("mock", "mini-embed", name="mini-embed")
    chat = load_head_model("mock", "chat", name="chat")
    assert embed.embedding and not chat.embedding
    assert capabilities(embed).names() == ["embedding"]
    assert capabilities(embed).flags()["embeddings"] is True
    assert capabilities(embed).flags()["chat"] is False
    assert capabilities(chat).flags()["embeddings"] is False


def test_the_record_bounds_survive_a_hostile_length():
    # a length prefix saying more inputs than allowed never decodes into a list
    raw = msgspec.msgpack.encode(["embed", "s", [[1]] * 300])
    with pytest.raises(m.RecordError):
        m.decode(raw)

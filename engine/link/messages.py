"""The typed records that cross the link, and their codec.

Records are msgpack-encoded msgspec Structs tagged by ``t``; decoding is strict
(unknown tags, wrong types and missing fields are refused). Sizes a peer
chooses (prompt length, id lists, strings) are bounded here so that a decoded
record never holds more than the link allowed to buffer.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 1
# one record never exceeds this; checked against the length prefix before buffering
MAX_RECORD = 8 * 1024 * 1024
MAX_TOKENS_PER_RECORD = 1 << 20
_Name = Annotated[str, msgspec.Meta(max_length=256)]
_Text = Annotated[str, msgspec.Meta(max_length=4096)]
MAX_DEVICE = 200
_Device = Annotated[str, msgspec.Meta(max_length=MAX_DEVICE)]
_Ids = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]],
                 msgspec.Meta(max_length=MAX_TOKENS_PER_RECORD)]
_Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
_Probe = Annotated[list[Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]],
                                  msgspec.Meta(max_length=256)]],
                   msgspec.Meta(max_length=16)]
_Rate = Annotated[float, msgspec.Meta(ge=0.0)]


class Rates(msgspec.Struct, frozen=True, array_like=True):
    prefill_tps: _Rate = 0.0
    decode_tps: _Rate = 0.0
    ttft_ms: _Rate = 0.0
    # prefill priced by length (engine.runtimes.prefill_fit): seconds per prompt token, and
    # the extra seconds per token for every token of context before it (attention grows
    # with the context); both 0.0 until fitted, and then prefill_tps prices it
    prefill_s_per_token: _Rate = 0.0
    prefill_s_per_token_ctx: _Rate = 0.0


class NodeHello(msgspec.Struct, frozen=True, array_like=True, tag="node_hello", tag_field="t"):
    identity: _Name
    model: _Name
    runtime: _Name
    context_window: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    lanes: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    kv_total: _Count = 0
    rates: Rates = Rates()
    protocol: int = PROTOCOL_VERSION
    instance: _Name = ""  # random per node process: tells a restart from a namesake
    channels: bool = False  # it can carry a head's sessions as channels of one link


class HeadHello(msgspec.Struct, frozen=True, array_like=True, tag="head_hello", tag_field="t"):
    head_id: _Name  # random per head process: lets a node send stats once per head
    model: _Name  # the model the head announces
    protocol: int = PROTOCOL_VERSION
    listen_port: Annotated[int, msgspec.Meta(ge=0, lt=65536)] = 0  # its fleet listener, if any
    # the head's ids for engine.runtimes.probe.PROBE_TEXTS; a node fronting an engine
    # checks that engine tokenizes alike. Last, with a default: an older peer leaves it
    # out, and an older node ignores it (array-like records drop extra trailing fields)
    probe: _Probe = msgspec.field(default_factory=list)
    # this head, which dialed, carries all its sessions to the node over this one link
    # (engine.link.mux) if the node said it can; otherwise one generation per connection
    channels: bool = False
    # this head reads Progress records (an older one refuses unknown tags)
    progress: bool = False


class SamplingParams(msgspec.Struct, frozen=True, array_like=True):
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0


class Generate(msgspec.Struct, frozen=True, array_like=True, tag="generate", tag_field="t"):
    session: _Name
    lease_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)]
    prompt: _Ids
    max_tokens: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    sampling: SamplingParams = SamplingParams()
    stop_ids: _Ids = msgspec.field(default_factory=list)


class Accepted(msgspec.Struct, frozen=True, array_like=True, tag="accepted", tag_field="t"):
    session: _Name


class Tokens(msgspec.Struct, frozen=True, array_like=True, tag="tokens", tag_field="t"):
    ids: _Ids
    index: _Count  # position of ids[0] among this generation's output tokens


class Done(msgspec.Struct, frozen=True, array_like=True, tag="done", tag_field="t"):
    finish_reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: _Count
    completion_tokens: _Count
    cached_tokens: _Count = 0
    ttft_ms: _Rate = 0.0
    prefill_tps: _Rate = 0.0
    decode_tps: _Rate = 0.0


class Renew(msgspec.Struct, frozen=True, array_like=True, tag="renew", tag_field="t"):
    session: _Name
    lease_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)]


class Cancel(msgspec.Struct, frozen=True, array_like=True, tag="cancel", tag_field="t"):
    session: _Name


class Ping(msgspec.Struct, frozen=True, array_like=True, tag="ping", tag_field="t"):
    nonce: _Count


class Pong(msgspec.Struct, frozen=True, array_like=True, tag="pong", tag_field="t"):
    nonce: _Count


class Stats(msgspec.Struct, frozen=True, array_like=True, tag="stats", tag_field="t"):
    lanes: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    lanes_busy: Annotated[int, msgspec.Meta(ge=0, le=1024)]
    kv_used: _Count
    kv_total: _Count
    rates: Rates = Rates()
    sessions: _Count = 0  # generations running now, all heads together
    peak_busy: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0  # most lanes ever busy at once
    # the KV pool that all lanes share: cells held by parked prefixes (reclaimable), and
    # the longest prompt a new session can bring now (0: not said; the window then)
    kv_parked: _Count = 0
    max_prompt: _Count = 0
    # bytes of memory the node uses now, and the budget it keeps within (0: not said)
    mem_used: _Count = 0
    mem_budget: _Count = 0
    # "" awake, "asleep" (the model unloaded after --idle-unload), "waking" (loading)
    sleep: Literal["", "asleep", "waking"] = ""
    # prompt tokens served so far: reused from a lane, restored from the host-memory
    # cache, and prefilled
    prompt_from_lanes: _Count = 0
    prompt_from_host: _Count = 0
    prompt_prefilled: _Count = 0
    # the device the model runs on ("Vulkan0 (NVIDIA GeForce RTX 4070)"; "" the CPU), and
    # how many of the model's layers (its output layer counted) are on it
    device: _Device = ""
    gpu_layers: _Count = 0
    model_layers: _Count = 0


class Progress(msgspec.Struct, frozen=True, array_like=True, tag="progress", tag_field="t"):
    """Node to head, before the first token: the prompt is being prefilled (``prefilled``
    of ``prompt`` tokens), or the model is loading (``loading``: the node was asleep).
    Sent only to a head whose hello said ``progress``."""

    prefilled: _Count
    prompt: _Count
    loading: bool = False


class AliasSync(msgspec.Struct, frozen=True, array_like=True, tag="alias_sync", tag_field="t"):
    """Head to head: this head's whole alias table; ``reply`` asks for the peer's."""

    table: Annotated[bytes, msgspec.Meta(max_length=MAX_RECORD - 1024)]
    reply: bool = False
    serial: _Count = 0  # echoed in the reply, so the asker knows which push it answers


# wrong_model: a node refusing a head whose model tokenizes otherwise (sent only to a
# head that sent a probe, so only to heads that know the code)
ErrorCode = Literal["busy", "bad_request", "context_length_exceeded", "internal", "shutdown",
                    "wrong_model"]


class Error(msgspec.Struct, frozen=True, array_like=True, tag="error", tag_field="t"):
    code: ErrorCode
    message: _Text


class End(msgspec.Struct, frozen=True, array_like=True, tag="end", tag_field="t"):
    """A channel of a multiplexed link is closed (engine.link.mux); its id is not reused."""

    reason: _Text


# what a channel carries: what one connection carries, and its end
ChannelRecord = (Generate | Accepted | Tokens | Done | Renew | Cancel | Ping | Pong | Stats
                 | Error | End | Progress)
MAX_BATCH = 4096
_Channel = Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]


class Batch(msgspec.Struct, frozen=True, array_like=True, tag="batch", tag_field="t"):
    """Records of a multiplexed link's channels, each with its channel, in order: what
    one step of the sender's loop sent, as one record (one frame, one encryption)."""

    items: Annotated[list[tuple[_Channel, ChannelRecord]], msgspec.Meta(max_length=MAX_BATCH)]


Record = (NodeHello | HeadHello | Generate | Accepted | Tokens | Done | Renew | Cancel
          | Ping | Pong | Stats | Error | AliasSync | End | Batch | Progress)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class RecordError(ValueError):
    """A peer sent a record we cannot accept (malformed, unknown or out of bounds)."""


def encode(record: Record) -> bytes:
    return _encoder.encode(record)


def decode(data: bytes | memoryview) -> Record:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordError(f"bad record from peer: {exc}") from None
    except RecursionError:
        # no record nests more than a few levels; only a broken or hostile peer gets here
        raise RecordError("bad record from peer: arrays nested too deep to decode") from None

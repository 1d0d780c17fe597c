"""The typed records that cross the link, and their codec.

Records are msgpack-encoded msgspec Structs tagged by ``t``; decoding is strict
(unknown tags, wrong types and missing fields are refused). Sizes a peer
chooses (prompt length, id lists, strings) are bounded here so that a decoded
record never holds more than the link allowed to buffer.

A record gains fields only at its end, with defaults: an older peer leaves them out
and reads a newer peer's record without them (array-like records drop extra trailing
fields). A new record type is sent only to a peer whose hello says it reads it (an older
one refuses an unknown tag and drops the link): ``HeadHello.progress`` for Progress,
``NodeHello.takes_models`` for ServeModel (answered by ServeModelResult; its
``split_with`` only where ``NodeHello.splits``),
``NodeHello.embeds`` for Embed (answered by Embedded or Error).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 1
# one record never exceeds this; checked against the length prefix before buffering
MAX_RECORD = 8 * 1024 * 1024
MAX_TOKENS_PER_RECORD = 1 << 20
MAX_NAME = 256
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
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
_KeepAlive = Annotated[float, msgspec.Meta(ge=0.0)] | None
_Bytes = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]  # RAM, disk, a device's memory
MAX_KIND = 16
MAX_SPEC = 256
MAX_ANSWER = 1000  # a ServeModelResult's line
# a model a head asks a node to serve: a hub id, org/repo[:QUANT] (engine.models checks it
# fully where it is handled); never a path, which would name a file on the head's machine
MODEL_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]*/[A-Za-z0-9_][A-Za-z0-9._-]*(:[A-Za-z0-9._-]+)?$"
_Spec = Annotated[str, msgspec.Meta(min_length=3, max_length=MAX_SPEC,
                                    pattern=MODEL_ID_PATTERN)]
MAX_SPLIT = 8  # machines lending to one split model
MAX_ADDRESS = 300  # HOST:PORT (a DNS name is at most 253)
_Addresses = Annotated[list[Annotated[str, msgspec.Meta(min_length=3, max_length=MAX_ADDRESS)]],
                       msgspec.Meta(max_length=MAX_SPLIT)]


class Rates(msgspec.Struct, frozen=True, array_like=True):
    prefill_tps: _Rate = 0.0
    decode_tps: _Rate = 0.0
    ttft_ms: _Rate = 0.0
    # prefill priced by length (engine.runtimes.prefill_fit): seconds per prompt token, and
    # the extra seconds per token for every token of context before it (attention grows
    # with the context); both 0.0 until fitted, and then prefill_tps prices it
    prefill_s_per_token: _Rate = 0.0
    prefill_s_per_token_ctx: _Rate = 0.0


MAX_KEPT = 32  # models one node says it keeps


class KeptModel(msgspec.Struct, frozen=True, array_like=True):
    """A model a node keeps besides the one its hello names (on disk, loaded on demand),
    and where it is now. A head places a request for it on the node (``Generate.model``,
    ``Embed.model``): a node loads one that is not loaded, within its memory budget."""

    name: _Name
    state: Literal["loaded", "loading", "unloaded"] = "unloaded"
    mem: _Bytes = 0  # what it holds of the budget while loaded (0: not loaded or not said)
    embeds: bool = False  # an embedding model: Embed records, no text
    context_window: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)] = 0  # 0: not known yet
    size: _Bytes = 0  # its file's bytes: what a load reads from disk
    load_ms: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)] = 0  # its last load (0: none yet)


_Kept = Annotated[list[KeptModel], msgspec.Meta(max_length=MAX_KEPT)]


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
    # it reads ServeModel (and answers it, yes or no); a head sends it to no other node
    takes_models: bool = False
    # its model is an embedding model: it answers Embed records, and makes no text
    embeds: bool = False
    # the models it keeps besides ``model``, loaded on demand (its Stats say them anew)
    kept: _Kept = msgspec.field(default_factory=list)
    # it reads ServeModel.split_with (an older node would serve the model whole)
    splits: bool = False


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
    # its machine's host name, which people know it by (the id is random per process)
    name: _Name = ""


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
    # how long the node keeps its model loaded once idle after this request (Ollama's
    # keep_alive, in seconds: 0 unloads at once, inf never); None: the node's own default
    keep_alive_s: _KeepAlive = None
    # which of the node's models answers ("": the one its hello names; else one it keeps)
    model: _Name = ""


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
    # what a fit estimate of another model on this machine needs (0 / "": not said): its
    # RAM; the GPU llama.cpp chose ("gpu", "igpu"; "" none) with its memory, the free
    # figure as it was before this model loaded (what a model there may take); the disk
    # free where the node keeps its models
    ram_total: _Bytes = 0
    device_kind: Annotated[str, msgspec.Meta(max_length=MAX_KIND)] = ""
    device_total: _Bytes = 0
    device_free: _Bytes = 0
    disk_free: _Bytes = 0
    # a pull under way on the node (a model a head asked it to serve, or its user chose)
    pull_model: _Name = ""
    pull_done: _Bytes = 0
    pull_total: _Bytes = 0
    # its user paused serving: it takes no new session (lanes_busy stays the real count)
    paused: bool = False
    # why the model a head last chose for it could not be served ("" none, or it serves it)
    serve_failed: Annotated[str, msgspec.Meta(max_length=MAX_ANSWER)] = ""
    # what decides its decode speed, measured once per machine (engine.models.speed): the
    # memory bandwidth its CPU reads at, and its GPU's where it has one (bytes/s; 0: not
    # measured)
    mem_bandwidth: _Bytes = 0
    gpu_bandwidth: _Bytes = 0
    # the models it keeps besides its hello's, and which are loaded now (as NodeHello.kept)
    kept: _Kept = msgspec.field(default_factory=list)
    # the memory its owner lends to the fleet's split models now (engine.node.lending): its
    # budget less what its own model holds (0: it lends none)
    lend_bytes: _Bytes = 0
    # the port where it takes links from the fleet's machines besides the heads it joined
    # (a node that joined and lends memory listens so that a split reaches it; 0: none)
    listens: Annotated[int, msgspec.Meta(ge=0, lt=65536)] = 0


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


class ServeModel(msgspec.Struct, frozen=True, array_like=True, tag="serve_model",
                 tag_field="t"):
    """Head to node: serve ``spec`` (a hub id, org/repo[:QUANT]) instead of the model served
    now. Sent only to a node whose hello said ``takes_models``, on any of its connections
    or channels. The node answers at once with a ServeModelResult of the same ``ask``; if it
    accepted, it pulls the model (its Stats' pull fields say how far), then swaps it in as
    its user would, and its next hello names it."""

    spec: _Spec
    ask: _Count = 0  # echoed in the answer, so the head knows which question it answers
    # serve it split: its last layers on the memory these machines lend, each named by its
    # node's listener (HOST:PORT, as --split-with takes them); sent only to a node whose
    # hello said ``splits``
    split_with: _Addresses = msgspec.field(default_factory=list)


class ServeModelResult(msgspec.Struct, frozen=True, array_like=True,
                       tag="serve_model_result", tag_field="t"):
    """Node to head, the answer to a ServeModel: accepted ("pulling org/repo:Q4_K_M") or
    refused, with why in one line ("this node does not take models chosen by heads...")."""

    accepted: bool
    message: Annotated[str, msgspec.Meta(max_length=MAX_ANSWER)]
    ask: _Count = 0


MAX_EMBED_INPUTS = 256  # inputs in one Embed record; the head splits a larger request
MAX_EMBED_DIMS = 16384
# the vectors of one Embedded record, as float32: within one record with room to spare
MAX_EMBED_BYTES = 4 * 1024 * 1024


class Embed(msgspec.Struct, frozen=True, array_like=True, tag="embed", tag_field="t"):
    """Head to a node whose hello said ``embeds``: one vector per input (token ids, the
    model's special tokens included). Answered by an Embedded of the same ``session``, or
    an Error (``busy``: try another node)."""

    session: _Name
    inputs: Annotated[list[_Ids], msgspec.Meta(min_length=1, max_length=MAX_EMBED_INPUTS)]
    keep_alive_s: _KeepAlive = None  # as Generate's
    model: _Name = ""  # as Generate's


class Embedded(msgspec.Struct, frozen=True, array_like=True, tag="embedded", tag_field="t"):
    """Node to head: ``count`` vectors of ``dims`` float32 values each, little-endian, one
    after another in input order, each of unit length (the model's pooling, then L2)."""

    session: _Name
    dims: Annotated[int, msgspec.Meta(ge=1, le=MAX_EMBED_DIMS)]
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_EMBED_INPUTS)]
    vectors: Annotated[bytes, msgspec.Meta(max_length=MAX_EMBED_BYTES)]
    prompt_tokens: _Count = 0


# wrong_model: a node refusing a head whose model tokenizes otherwise (sent only to a
# head that sent a probe, so only to heads that know the code)
ErrorCode = Literal["busy", "bad_request", "context_length_exceeded", "internal", "shutdown",
                    "wrong_model", "not_found"]


class Error(msgspec.Struct, frozen=True, array_like=True, tag="error", tag_field="t"):
    code: ErrorCode
    message: _Text


class End(msgspec.Struct, frozen=True, array_like=True, tag="end", tag_field="t"):
    """A channel of a multiplexed link is closed (engine.link.mux); its id is not reused."""

    reason: _Text


# -- a model's files from a machine of the fleet (engine.node.files) ---------------------
MAX_FILES = 64  # files of one model (its shards) offered at once
MAX_CHUNK = 1 << 20  # bytes of a file in one FileChunk
MAX_FILE_NAME = 1000  # a file's path inside its repository
_Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
_Commit = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{40}$")]
_Repo = Annotated[str, msgspec.Meta(min_length=3, max_length=MAX_SPEC,
                                    pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*/"
                                            r"[A-Za-z0-9_][A-Za-z0-9._-]*$")]


class FilesWanted(msgspec.Struct, frozen=True, array_like=True, tag="files_wanted",
                  tag_field="t"):
    """Which files of hub model ``repo`` (at ``quant``, "" for the repository's default)
    the peer keeps; answered by FilesOffered, or Error not_found."""

    repo: _Repo
    quant: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9._-]*$")] = ""


class OfferedFile(msgspec.Struct, frozen=True, array_like=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_FILE_NAME)]
    size: _Bytes
    sha256: _Sha256  # the hub's, which the peer's pull checked (its blob's name)


class FilesOffered(msgspec.Struct, frozen=True, array_like=True, tag="files_offered",
                   tag_field="t"):
    repo: _Repo
    commit: _Commit  # the snapshot the files are of
    files: Annotated[list[OfferedFile], msgspec.Meta(min_length=1, max_length=MAX_FILES)]


class FileWanted(msgspec.Struct, frozen=True, array_like=True, tag="file_wanted",
                 tag_field="t"):
    """The bytes of a file FilesOffered named, from ``offset`` to its end: FileChunk
    records in order (the receiver knows the size), or Error not_found."""

    repo: _Repo
    sha256: _Sha256
    offset: _Bytes = 0


class FileChunk(msgspec.Struct, frozen=True, array_like=True, tag="file_chunk",
                tag_field="t"):
    data: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_CHUNK)]


# -- memory lent for a split model's layers (engine.node.lending) ------------------------


class RpcOpen(msgspec.Struct, frozen=True, array_like=True, tag="rpc_open", tag_field="t"):
    """From here on this link carries a connection to the peer's llama.cpp RPC server
    (which listens on its loopback only): RpcOpened, then RpcBytes both ways until it ends;
    or Error not_found where the peer lends no memory."""


class RpcOpened(msgspec.Struct, frozen=True, array_like=True, tag="rpc_opened",
                tag_field="t"):
    lend_bytes: _Bytes  # the memory its owner lets the fleet use there now


class RpcBytes(msgspec.Struct, frozen=True, array_like=True, tag="rpc_bytes", tag_field="t"):
    """Bytes of an RPC connection carried over the link; empty, the lending side's sign of
    life while its server computes (engine.node.lending)."""

    data: Annotated[bytes, msgspec.Meta(max_length=MAX_CHUNK)]


# what a channel carries: what one connection carries, and its end
ChannelRecord = (Generate | Accepted | Tokens | Done | Renew | Cancel | Ping | Pong | Stats
                 | Error | End | Progress | ServeModel | ServeModelResult | Embed | Embedded)
MAX_BATCH = 4096
_Channel = Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]


class Batch(msgspec.Struct, frozen=True, array_like=True, tag="batch", tag_field="t"):
    """Records of a multiplexed link's channels, each with its channel, in order: what
    one step of the sender's loop sent, as one record (one frame, one encryption)."""

    items: Annotated[list[tuple[_Channel, ChannelRecord]], msgspec.Meta(max_length=MAX_BATCH)]


Record = (NodeHello | HeadHello | Generate | Accepted | Tokens | Done | Renew | Cancel
          | Ping | Pong | Stats | Error | AliasSync | End | Batch | Progress | ServeModel
          | ServeModelResult | Embed | Embedded | FilesWanted | FilesOffered | FileWanted
          | FileChunk | RpcOpen | RpcOpened | RpcBytes)

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

"""Request bodies of the OpenAI routes, decoded strictly by msgspec.

Unknown fields are ignored (clients send many), but a field we read must have
the right type, and parameters we cannot honour are refused by name rather
than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from engine import nesting
from engine.head.prompt.text import MAX_STOP_CHARS

MAX_BODY = 8 * 1024 * 1024
_Str = Annotated[str, msgspec.Meta(max_length=MAX_BODY)]
_Name = Annotated[str, msgspec.Meta(max_length=512)]
# the head matches stop strings in linear time, and holds back at most this much text
_Stop = Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]
_Stops = _Stop | Annotated[list[_Stop], msgspec.Meta(max_length=16)] | None


class ContentPart(msgspec.Struct):
    type: _Name
    text: _Str | None = None


class ToolCallFunction(msgspec.Struct):
    name: _Name
    arguments: _Str = ""


class ToolCall(msgspec.Struct):
    function: ToolCallFunction
    id: _Name = ""
    type: _Name = "function"


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _Str | list[ContentPart] | None = None
    name: _Name | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: _Name | None = None
    reasoning_content: _Str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


_Temp = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
_Prob = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
_Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
_MaxTok = Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
_Seed = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]  # what the link carries


class SamplingRequest(msgspec.Struct, kw_only=True):
    """The sampling fields that chat and completion requests share."""

    temperature: _Temp | None = None
    top_p: _Prob | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    min_p: _Prob | None = None
    seed: _Seed | None = None
    stop: _Stops = None
    n: int | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repeat_penalty: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] | None = None


class ChatRequest(SamplingRequest, kw_only=True):
    model: _Name
    messages: Annotated[list[Message], msgspec.Meta(min_length=1, max_length=100_000)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: _MaxTok | None = None
    max_completion_tokens: _MaxTok | None = None
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=512)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: _Name | None = None
    reasoning_effort: _Name | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def unsupported(req: ChatRequest) -> str | None:
    """Name the first parameter we cannot honour, or None."""
    if req.n is not None and req.n != 1:
        return "n other than 1 is not supported; send one request per completion"
    if req.logprobs:
        return "logprobs is not supported"
    if req.top_logprobs:
        return "top_logprobs is not supported"
    if req.logit_bias:
        return "logit_bias is not supported"
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        return "response_format other than text is not supported"
    for msg in req.messages:
        if isinstance(msg.content, list):
            for part in msg.content:
                if part.type != "text":
                    return f"content parts of type '{part.type}' are not supported; send text"
                if part.text is None:
                    return "a text content part needs a 'text' string"
    return None


class BadRequest(ValueError):
    pass


def decode_chat(body: bytes) -> ChatRequest:
    result: ChatRequest = decode_as(ChatRequest, body)
    return result


def message_text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content)


# -- /v1/completions ------------------------------------------------------------------

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for the legacy completions route


class CompletionRequest(SamplingRequest, kw_only=True):
    model: _Name
    prompt: _Str | Annotated[list[_Str], msgspec.Meta(max_length=16)] = ""
    suffix: _Str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: _MaxTok | None = None
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    user: _Name | None = None


def unsupported_completion(req: CompletionRequest) -> str | None:
    """Name the first parameter of a completion request we cannot honour, or None."""
    if isinstance(req.prompt, list) and len(req.prompt) != 1:
        return ("prompt as a list must hold exactly one string; send one request per prompt")
    if req.n is not None and req.n != 1:
        return "n other than 1 is not supported; send one request per completion"
    if req.best_of is not None and req.best_of != 1:
        return "best_of other than 1 is not supported"
    if req.echo:
        return "echo is not supported"
    if req.logprobs:
        return "logprobs is not supported"
    if req.logit_bias:
        return "logit_bias is not supported"
    return None


def completion_prompt(req: CompletionRequest) -> str:
    return req.prompt[0] if isinstance(req.prompt, list) else req.prompt


# -- Ollama: /api/chat, /api/generate, /api/show ----------------------------------------


class OllamaOptions(msgspec.Struct):
    """The options Shoal honours; Ollama's others (num_ctx, mirostat, ...) are ignored."""

    temperature: _Temp | None = None
    top_p: _Prob | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    min_p: _Prob | None = None
    num_predict: Annotated[int, msgspec.Meta(ge=-2, lt=1 << 31)] | None = None
    seed: _Seed | None = None
    stop: _Stops = None
    repeat_penalty: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None


class OllamaFunction(msgspec.Struct):
    name: _Name
    arguments: dict[str, Any] | _Str = msgspec.field(default_factory=dict)


class OllamaToolCall(msgspec.Struct):
    function: OllamaFunction


class OllamaMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: _Str = ""
    images: Annotated[list[_Str], msgspec.Meta(max_length=64)] | None = None
    tool_calls: Annotated[list[OllamaToolCall], msgspec.Meta(max_length=512)] | None = None
    tool_name: _Name | None = None
    thinking: _Str | None = None


_Think = bool | Literal["low", "medium", "high"] | None
_KeepAlive = Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)] | _Name | None


class OllamaChatRequest(msgspec.Struct):
    model: _Name
    messages: Annotated[list[OllamaMessage], msgspec.Meta(max_length=100_000)] = \
        msgspec.field(default_factory=list)
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=512)] | None = None
    format: Any = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: _KeepAlive = None
    think: _Think = None


class OllamaGenerateRequest(msgspec.Struct):
    model: _Name
    prompt: _Str = ""
    suffix: _Str | None = None
    system: _Str | None = None
    template: _Str | None = None
    context: Annotated[list[int], msgspec.Meta(max_length=1_000_000)] | None = None
    raw: bool = False
    images: Annotated[list[_Str], msgspec.Meta(max_length=64)] | None = None
    format: Any = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: _KeepAlive = None
    think: _Think = None


class OllamaShowRequest(msgspec.Struct):
    model: _Name | None = None
    name: _Name | None = None  # the older spelling
    verbose: bool = False


def unsupported_ollama(req: OllamaChatRequest | OllamaGenerateRequest) -> str | None:
    """Name the first field of an Ollama request we cannot honour, or None."""
    if req.format not in (None, ""):
        return "format (JSON output) is not supported; ask for JSON in the prompt"
    if isinstance(req, OllamaGenerateRequest):
        if req.images:
            return "images are not supported; send text"
        if req.template:
            return ("template is not supported: the head renders the model's own chat "
                    "template; send raw=true with a formatted prompt instead")
        if req.context:
            return "context is not supported; use /api/chat to continue a conversation"
    else:
        for msg in req.messages:
            if msg.images:
                return "images are not supported; send text"
    n = req.options.num_predict if req.options else None
    if n is not None and n == 0:
        return "options.num_predict 0 asks for no tokens; give a positive number or -1"
    return None


def _decoder_for(kind: type[Any]) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decode_as(kind: type[Any], body: bytes) -> Any:
    """Decode a request body strictly as ``kind``; BadRequest with the field at fault."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = _decoder_for(kind)
    try:
        return nesting.msgspec_decode(dec, body)
    except nesting.TooDeep as exc:
        raise BadRequest(f"invalid request: the body has {exc}; send a flatter body") from None
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None

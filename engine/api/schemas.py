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


# -- Anthropic: /v1/messages, /v1/messages/count_tokens ---------------------------------
# Blocks and items are read loosely (every field optional but typed), so that a block
# of a kind Shoal cannot take is refused by name (engine.api.anthropic), not as a
# decoding error.

_Id = Annotated[str, msgspec.Meta(max_length=256)]


class AnthropicInnerBlock(msgspec.Struct):
    """A block inside a ``tool_result``: text, or an image (refused)."""

    type: _Name
    text: _Str | None = None


class AnthropicBlock(msgspec.Struct):
    type: _Name
    text: _Str | None = None
    id: _Id | None = None  # tool_use
    name: _Name | None = None  # tool_use
    input: Any = None  # tool_use: the call's arguments, an object
    tool_use_id: _Id | None = None  # tool_result
    content: _Str | Annotated[list[AnthropicInnerBlock],
                              msgspec.Meta(max_length=10_000)] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


_Blocks = Annotated[list[AnthropicBlock], msgspec.Meta(max_length=100_000)]


class AnthropicMessage(msgspec.Struct):
    # "system" inside messages: Claude Code's mid-conversation system messages
    # (anthropic-beta mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: _Str | _Blocks


class AnthropicTool(msgspec.Struct):
    name: _Name
    description: _Str | None = None
    input_schema: dict[str, Any] | None = None
    type: _Name | None = None  # absent or "custom" for a client tool; else a server tool


class AnthropicToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: _Name | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicCountRequest(msgspec.Struct, kw_only=True):
    """POST /v1/messages/count_tokens: what a Messages request would put in the prompt."""

    model: _Name
    messages: Annotated[list[AnthropicMessage], msgspec.Meta(min_length=1, max_length=100_000)]
    system: _Str | _Blocks | None = None
    tools: Annotated[list[AnthropicTool], msgspec.Meta(max_length=512)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    # read only to refuse what would change the answer (a structured-output format);
    # effort, context_management and cache_control markers are taken and ignored
    output_config: dict[str, Any] | None = None
    output_format: Any = None


class AnthropicRequest(AnthropicCountRequest, kw_only=True):
    """POST /v1/messages."""

    max_tokens: _MaxTok
    stop_sequences: Annotated[list[_Stop], msgspec.Meta(max_length=16)] | None = None
    temperature: _Temp | None = None
    top_p: _Prob | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: _Name | None = None


# -- OpenAI Responses: /v1/responses --------------------------------------------------


class ResponsesPart(msgspec.Struct):
    """A content part of an input message: ``input_text``/``output_text`` (read), others
    (images, files: refused)."""

    type: _Name
    text: _Str | None = None


_Parts = Annotated[list[ResponsesPart], msgspec.Meta(max_length=10_000)]


class ResponsesItem(msgspec.Struct, kw_only=True):
    """An input item: a message (``type`` absent or ``message``), a ``function_call``
    the model made, the ``function_call_output`` that answers it, or ``reasoning``."""

    type: _Name | None = None
    role: _Name | None = None
    content: _Str | _Parts | None = None
    id: _Id | None = None
    call_id: _Id | None = None
    name: _Name | None = None
    namespace: _Name | None = None  # a function_call of a tool inside a namespace tool
    arguments: _Str | None = None
    output: _Str | _Parts | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: _Name
    name: _Name | None = None
    description: _Str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # a ``namespace`` tool: the function tools it groups (Codex's multi_agent_v1)
    tools: Annotated[list[ResponsesTool], msgspec.Meta(max_length=512)] | None = None


class ResponsesNamedChoice(msgspec.Struct, kw_only=True):
    type: _Name
    name: _Name | None = None


class ResponsesFormat(msgspec.Struct, kw_only=True):
    type: _Name = "text"


class ResponsesText(msgspec.Struct, kw_only=True):
    format: ResponsesFormat | None = None
    verbosity: _Name | None = None


class ResponsesReasoning(msgspec.Struct, kw_only=True):
    effort: _Name | None = None
    summary: _Name | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: _Name
    input: _Str | Annotated[list[ResponsesItem], msgspec.Meta(max_length=100_000)] = ""
    instructions: _Str | None = None
    max_output_tokens: _MaxTok | None = None
    temperature: _Temp | None = None
    top_p: _Prob | None = None
    tools: Annotated[list[ResponsesTool], msgspec.Meta(max_length=512)] | None = None
    tool_choice: _Name | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: _Id | None = None
    conversation: Any = None
    store: bool | None = None
    stream: bool = False
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: dict[str, Any] | None = None
    user: _Name | None = None
    prompt_cache_key: _Id | None = None
    background: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    truncation: _Name | None = None
    include: Annotated[list[_Name], msgspec.Meta(max_length=64)] | None = None
    service_tier: _Name | None = None
    stream_options: dict[str, Any] | None = None


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


# -- embeddings: /v1/embeddings, Ollama's /api/embed and /api/embeddings ---------------------

MAX_EMBED_INPUTS = 2048  # inputs in one request, as OpenAI's own limit
_Dims = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]


class OpenAIEmbedRequest(msgspec.Struct):
    model: _Name
    input: Any
    encoding_format: str = "float"
    dimensions: _Dims | None = None
    user: _Name | None = None


class OllamaEmbedRequest(msgspec.Struct):
    model: _Name
    input: Any = None
    truncate: bool = True
    dimensions: _Dims | None = None
    options: dict[str, Any] | None = None
    keep_alive: _KeepAlive = None


class OllamaEmbeddingsRequest(msgspec.Struct):
    """The older route: one ``prompt``, one ``embedding``."""

    model: _Name
    prompt: Annotated[str, msgspec.Meta(max_length=16 << 20)] = ""
    options: dict[str, Any] | None = None
    keep_alive: _KeepAlive = None

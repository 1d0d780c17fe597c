"""Chat templates for the head: the GGUF's own Jinja template, or a built-in one.

Templates render the way Hugging Face ``apply_chat_template`` does (same
sandbox, filters and globals), so a template written for transformers renders
the same prompt here. The GGUF template comes from the model file; the user
never sends template source, but it is still untrusted text from a download,
hence the immutable sandbox.

Messages are normalised before rendering so that OpenAI-shaped requests work
with templates written for transformers: text content parts are joined,
``None`` content becomes ``""``, ``developer`` becomes ``system``, and tool
call ``arguments`` given as a JSON string are parsed into an object (templates
``tojson`` them).

Built-in templates emit ``bos_token`` where the family's official template
does (Gemma, Llama 3, Mistral), so the head must not add another BOS when the
rendered text already starts with it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine import nesting

FAMILIES = ("chatml", "gemma", "llama3", "mistral", "phi3")

# End-of-turn markers by family; the head adds their token ids as stop ids.
_END_OF_TURN: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_end|>",),
    "gemma": ("<end_of_turn>",),
    "llama3": ("<|eot_id|>", "<|eom_id|>"),
    "mistral": (),  # a Mistral turn ends with EOS itself
    "phi3": ("<|end|>",),
}
_KNOWN_MARKERS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


class TemplateError(ValueError):
    """The template cannot render these messages; one line, shown as a 400."""


# --- the Jinja environment, as transformers builds it -------------------------


def _raise_exception(message: str) -> None:
    raise TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: no HTML escaping (Jinja's own tojson escapes <>&')
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """``{% generation %}…{% endgeneration %}``: transformers marks assistant
    spans with it for training masks; for inference it just renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        # Jinja renders a refused attribute as an empty string unless it is
        # used further; refuse loudly so a probing template fails every time
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# --- messages as templates expect them ---------------------------------------


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise TemplateError(f"content part of type {kind!r} is not supported; send text")
        return "\n".join(texts)
    raise TemplateError(f"message content must be a string or a list of parts, not {content!r}")


def _normalise_call(call: Any) -> Any:
    if not isinstance(call, Mapping):
        return call
    out = dict(call)
    fn = out.get("function")
    if isinstance(fn, Mapping):
        fn = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str):
            # not JSON: the template shows it as given
            with contextlib.suppress(ValueError):
                fn["arguments"] = nesting.json_loads(args) if args.strip() else {}
        out["function"] = fn
    return out


def _normalise(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise TemplateError(f"message {i} must be an object with a role and content")
        m = dict(msg)
        role = m.get("role")
        if not isinstance(role, str):
            raise TemplateError(f"message {i} has no role")
        m["role"] = "system" if role == "developer" else role
        m["content"] = _text_of(m.get("content"))
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = [_normalise_call(c) for c in calls]
        elif "tool_calls" in m and calls is None:
            del m["tool_calls"]  # templates test `tool_calls in message`
        out.append(m)
    return out


# --- system messages after the first turn -------------------------------------


def later_system(messages: list[dict[str, Any]]) -> list[int]:
    """The indexes of system messages that do not open the conversation."""
    return [i for i, m in enumerate(messages) if i > 0 and m["role"] == "system"]


def _shown(content: str, rendered: str) -> bool:
    """Whether a template kept a message's text (it can trim it, not drop it)."""
    text = content.strip()
    return not text or text[:64] in rendered


def fold_later_system(messages: list[dict[str, Any]], later: list[int]) -> list[dict[str, Any]]:
    """For a template that allows one system message only (it refuses others, or drops
    them): each later system message's text goes into the user turn right after it, or
    else the one right before it, or else becomes a user turn of its own. Either
    neighbour is already in the conversation when the system message is, so a
    conversation that grows keeps the same prompt for its earlier turns (and its cache)."""
    out = [dict(m) for m in messages]
    drop: set[int] = set()
    for i in later:
        text = out[i]["content"]
        after = i + 1 if i + 1 < len(out) and out[i + 1]["role"] == "user" else None
        kept = [j for j in range(i) if j not in drop]  # folded ones are gone from there
        before = kept[-1] if kept and out[kept[-1]]["role"] == "user" else None
        if after is not None:
            out[after]["content"] = f"{text}\n\n{out[after]['content']}"
        elif before is not None:
            out[before]["content"] = f"{out[before]['content']}\n\n{text}"
        else:
            out[i]["role"] = "user"
            continue
        drop.add(i)
    return [m for j, m in enumerate(out) if j not in drop]


# --- the template ------------------------------------------------------------


class ChatTemplate:
    """A compiled chat template with what the head needs to know about it."""

    def __init__(
        self,
        source: str,
        *,
        family: str,
        bos_text: str = "",
        eos_text: str = "",
        end_of_turn: tuple[str, ...] | None = None,
        origin: str = "custom",
        tool_source: str | None = None,
    ) -> None:
        self.source = source
        self.tool_source = tool_source
        self.family = family
        self.origin = origin  # "gguf", "override" or "builtin"
        self.bos_text = bos_text
        self.eos_text = eos_text
        self.end_of_turn = end_of_turn if end_of_turn is not None else _markers(family, source)
        env = _environment()
        self._template = _compile(env, source, origin)
        # some GGUFs carry a separate template for requests with tools
        self._tool_template = _compile(env, tool_source, origin) if tool_source else None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        normal = _normalise(messages)
        later = later_system(normal)
        if not later:
            return self._render(normal, tools, add_generation_prompt, kwargs)
        # system messages after the first turn (Claude Code sends them): where they stand
        # when the template shows them there, else folded into a neighbouring user turn
        try:
            text = self._render(normal, tools, add_generation_prompt, kwargs)
        except TemplateError:
            text = None
        if text is not None and all(_shown(normal[i]["content"], text) for i in later):
            return text
        return self._render(fold_later_system(normal, later), tools, add_generation_prompt,
                            kwargs)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        template = self._tool_template if tools and self._tool_template else self._template
        context: dict[str, Any] = {
            "bos_token": self.bos_text,
            "eos_token": self.eos_text,
            "documents": None,
            **kwargs,
            "messages": messages,
            "tools": tools or None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except TemplateError:
            raise
        except SecurityError as exc:
            raise TemplateError(
                f"chat template refused an unsafe operation: {_one_line(exc)}"
            ) from None
        except Exception as exc:  # any failure inside a template is the request's 400
            raise TemplateError(
                f"chat template ({self.origin}) failed on these messages: "
                f"{type(exc).__name__}: {_one_line(exc)}"
            ) from None

    def __repr__(self) -> str:
        return f"ChatTemplate(family={self.family!r}, origin={self.origin!r})"


def _compile(env: ImmutableSandboxedEnvironment, source: str, origin: str) -> jinja2.Template:
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template ({origin}) does not compile: line {exc.lineno}: {_one_line(exc)}"
        ) from None


def _markers(family: str, source: str) -> tuple[str, ...]:
    found = [m for m in _KNOWN_MARKERS if m in source]
    ordered = list(_END_OF_TURN.get(family, ())) + found
    return tuple(dict.fromkeys(ordered))


def detect_family(metadata: Mapping[str, str], template: str | None = None) -> str:
    """The model family: from the template's markers when there is one, else metadata.

    Names come before the architecture because fine-tunes keep their base's
    architecture: SmolLM2 is ``llama`` yet speaks ChatML.
    """
    if template:
        for marker, family in (
            ("<start_of_turn>", "gemma"),
            ("<|start_header_id|>", "llama3"),
            ("<|im_start|>", "chatml"),
            ("[INST]", "mistral"),
            ("<|user|>", "phi3"),
        ):
            if marker in template:
                return family
    arch = str(metadata.get("general.architecture", "")).lower()
    names = " ".join(str(metadata.get(k, "")) for k in ("general.basename", "general.name")).lower()
    pre = str(metadata.get("tokenizer.ggml.pre", "")).lower()
    if arch.startswith("gemma") or "gemma" in names:
        return "gemma"
    if (
        any(k in names for k in ("smollm", "qwen", "chatml", "hermes"))
        or arch.startswith("qwen")
        or pre in ("qwen2", "smollm")
    ):
        return "chatml"
    if arch.startswith("phi3") or "phi-3" in names or "phi3" in names:
        return "phi3"
    if any(k in names for k in ("mistral", "mixtral", "ministral", "codestral")):
        return "mistral"
    if arch.startswith("llama") and (
        pre == "llama-bpe" or any(k in names for k in ("llama-3", "llama 3", "llama3"))
    ):
        return "llama3"
    return "chatml"  # the most widely understood format for unknown fine-tunes


def builtin_template(family: str) -> str:
    try:
        return _BUILTIN[family]
    except KeyError:
        raise TemplateError(
            f"no built-in chat template for family {family!r}; one of: {', '.join(FAMILIES)}"
        ) from None


def load_chat_template(
    metadata: Mapping[str, str], *, chat_template: str | None, bos_text: str, eos_text: str
) -> ChatTemplate:
    """``chat_template`` (an explicit override), else the GGUF's, else the family's built-in.

    An override that does not compile is the user's to fix, so it raises; a
    broken template inside a model file falls back to the built-in one.
    """
    if chat_template:
        family = detect_family(metadata, chat_template)
        return ChatTemplate(
            chat_template,
            family=family,
            bos_text=bos_text,
            eos_text=eos_text,
            end_of_turn=_eot(family, chat_template, eos_text),
            origin="override",
        )
    embedded = metadata.get("tokenizer.chat_template")
    if embedded:
        family = detect_family(metadata, embedded)
        try:
            return ChatTemplate(
                embedded,
                family=family,
                bos_text=bos_text,
                eos_text=eos_text,
                end_of_turn=_eot(family, embedded, eos_text),
                origin="gguf",
                tool_source=metadata.get("tokenizer.chat_template.tool_use"),
            )
        except TemplateError:
            pass
    family = detect_family(metadata)
    source = builtin_template(family)
    return ChatTemplate(
        source,
        family=family,
        bos_text=bos_text,
        eos_text=eos_text,
        end_of_turn=_eot(family, source, eos_text),
        origin="builtin",
    )


def _eot(family: str, source: str, eos_text: str) -> tuple[str, ...]:
    # EOS ends a turn too (it is Mistral's only end of turn); listed for completeness
    return tuple(dict.fromkeys(_markers(family, source) + ((eos_text,) if eos_text else ())))


# --- built-in templates --------------------------------------------------------
#
# Raw strings: the "\n" escapes are Jinja's, as in a tokenizer_config.json.

# Hermes-style tool instructions (Qwen 2.5's wording), shared by the families
# without a tool format of their own; the model answers with <tool_call> blocks.
_HERMES_TOOLS = r"""
{%- set tools_text = "" %}
{%- if tools %}
{%- set tools_text -%}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
{{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" + (tool | tojson) }}
{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and " }}
{{- "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
{{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" }}
{%- endset %}
{%- endif %}
{%- macro hermes_calls(calls, lead) %}
{%- for tc in calls %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- (lead if loop.first else "\n") + "<tool_call>\n{\"name\": " + (f.name | tojson)
    + ", \"arguments\": " + (f.arguments | tojson) + "}\n</tool_call>" }}
{%- endfor %}
{%- endmacro %}
{%- if messages and messages[0].role == "system" %}
{%- set system = messages[0].content %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system = none %}
{%- set loop_messages = messages %}
{%- endif %}
"""

_CHATML = (
    _HERMES_TOOLS
    + r"""
{%- if tools %}
{{- "<|im_start|>system\n" + (system + "\n\n" if system else "") + tools_text + "<|im_end|>\n" }}
{%- elif system is not none %}
{{- "<|im_start|>system\n" + system + "<|im_end|>\n" }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message.role == "assistant" and message.tool_calls %}
{{- "<|im_start|>assistant" + ("\n" + message.content if message.content else "") }}
{{- hermes_calls(message.tool_calls, "\n") + "<|im_end|>\n" }}
{%- elif message.role == "tool" %}
{%- if loop.first or loop.previtem.role != "tool" %}
{{- "<|im_start|>user" }}
{%- endif %}
{{- "\n<tool_response>\n" + message.content + "\n</tool_response>" }}
{%- if loop.last or loop.nextitem.role != "tool" %}
{{- "<|im_end|>\n" }}
{%- endif %}
{%- else %}
{{- "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- "<|im_start|>assistant\n" }}
{%- endif %}
"""
)

# Gemma has no system role: the system text (and the tools) open the first user turn.
_GEMMA = (
    _HERMES_TOOLS
    + r"""
{{- bos_token }}
{%- set prefix = (system + "\n\n" if system else "") + (tools_text + "\n\n" if tools else "") %}
{%- if not loop_messages and prefix %}
{{- "<start_of_turn>user\n" + prefix | trim + "<end_of_turn>\n" }}
{%- endif %}
{%- for message in loop_messages %}
{%- set head = prefix if loop.first else "" %}
{%- if message.role == "tool" %}
{%- if loop.first or loop.previtem.role != "tool" %}
{{- "<start_of_turn>user\n" + head }}
{%- else %}
{{- "\n" }}
{%- endif %}
{{- "<tool_response>\n" + message.content + "\n</tool_response>" }}
{%- if loop.last or loop.nextitem.role != "tool" %}
{{- "<end_of_turn>\n" }}
{%- endif %}
{%- else %}
{%- set role = "model" if message.role == "assistant" else "user" %}
{{- "<start_of_turn>" + role + "\n" + head + message.content | trim }}
{%- if message.role == "assistant" and message.tool_calls %}
{{- hermes_calls(message.tool_calls, "\n" if message.content | trim else "") }}
{%- endif %}
{{- "<end_of_turn>\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- "<start_of_turn>model\n" }}
{%- endif %}
"""
)

_PHI3 = (
    _HERMES_TOOLS
    + r"""
{%- if tools %}
{{- "<|system|>\n" + (system + "\n\n" if system else "") + tools_text + "<|end|>\n" }}
{%- elif system is not none %}
{{- "<|system|>\n" + system + "<|end|>\n" }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message.role == "tool" %}
{%- if loop.first or loop.previtem.role != "tool" %}
{{- "<|user|>" }}
{%- endif %}
{{- "\n<tool_response>\n" + message.content + "\n</tool_response>" }}
{%- if loop.last or loop.nextitem.role != "tool" %}
{{- "<|end|>\n" }}
{%- endif %}
{%- else %}
{{- "<|" + message.role + "|>\n" + message.content }}
{%- if message.role == "assistant" and message.tool_calls %}
{{- hermes_calls(message.tool_calls, "\n" if message.content else "") }}
{%- endif %}
{{- "<|end|>\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- "<|assistant|>\n" }}
{%- else %}
{{- eos_token }}
{%- endif %}
"""
)

# Llama 3.x: tools in the system turn as JSON schemas (3.1's wording); the
# model answers {"name": ..., "parameters": ...}, tool results come as ipython.
_LLAMA3 = r"""
{{- bos_token }}
{%- if messages and messages[0].role == "system" %}
{%- set system = messages[0].content | trim %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system = none %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
{{- "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n" }}
{{- "You have access to the following functions. "
    "To call a function, please respond with JSON for a function call. " }}
{{- "Respond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}. " }}
{{- "Do not use variables.\n\n" }}
{%- for t in tools %}
{{- (t | tojson(indent=4)) + "\n\n" }}
{%- endfor %}
{{- (system or "") + "<|eot_id|>" }}
{%- elif system is not none %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" + system + "<|eot_id|>" }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message.role == "assistant" and message.tool_calls %}
{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
{%- for tc in message.tool_calls %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- ("" if loop.first else "\n") + "{\"name\": " + (f.name | tojson)
    + ", \"parameters\": " + (f.arguments | tojson) + "}" }}
{%- endfor %}
{{- "<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- "<|start_header_id|>ipython<|end_header_id|>\n\n" + message.content + "<|eot_id|>" }}
{%- else %}
{{- "<|start_header_id|>" + message.role + "<|end_header_id|>\n\n"
    + message.content | trim + "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
{%- endif %}
"""

# Mistral v0.3: the system text and the tools go with the last user turn; the
# model answers [TOOL_CALLS] [...]; there is no generation prompt.
_MISTRAL = r"""
{%- if messages and messages[0].role == "system" %}
{%- set system = messages[0].content %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system = none %}
{%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in loop_messages %}
{%- if message.role == "user" %}
{%- set ns.last_user = loop.index0 %}
{%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message.role == "user" %}
{%- if tools and loop.index0 == ns.last_user %}
{{- "[AVAILABLE_TOOLS] " + (tools | tojson) + "[/AVAILABLE_TOOLS]" }}
{%- endif %}
{%- if system and loop.index0 == ns.last_user %}
{{- "[INST] " + system + "\n\n" + message.content + "[/INST]" }}
{%- else %}
{{- "[INST] " + message.content + "[/INST]" }}
{%- endif %}
{%- elif message.role == "assistant" and message.tool_calls %}
{{- "[TOOL_CALLS] [" }}
{%- for tc in message.tool_calls %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- ("" if loop.first else ", ") + "{\"name\": " + (f.name | tojson)
    + ", \"arguments\": " + (f.arguments | tojson) }}
{%- if tc.id %}
{{- ", \"id\": " + (tc.id | tojson) }}
{%- endif %}
{{- "}" }}
{%- endfor %}
{{- "]" + eos_token }}
{%- elif message.role == "assistant" %}
{{- " " + message.content | trim + eos_token }}
{%- elif message.role == "tool" %}
{{- "[TOOL_RESULTS] {\"content\": " + (message.content | tojson)
    + ", \"call_id\": " + ((message.tool_call_id or "") | tojson) + "}[/TOOL_RESULTS]" }}
{%- elif message.role == "system" %}
{{- "[INST] " + message.content + "[/INST]" }}
{%- endif %}
{%- endfor %}
"""

_BUILTIN: dict[str, str] = {
    "chatml": _CHATML.strip(),
    "gemma": _GEMMA.strip(),
    "llama3": _LLAMA3.strip(),
    "mistral": _MISTRAL.strip(),
    "phi3": _PHI3.strip(),
}

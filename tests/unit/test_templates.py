"""Chat templates: built-in fallbacks, GGUF templates, the sandbox and tools."""

from __future__ import annotations

from typing import Any

import pytest

from engine.head.prompt.templates import (
    FAMILIES,
    ChatTemplate,
    TemplateError,
    builtin_template,
    detect_family,
    load_chat_template,
)

CONV: list[dict[str, Any]] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# (family, metadata, bos, eos, expected render of CONV)
CASES: list[tuple[str, dict[str, str], str, str, str]] = [
    (
        "gemma",
        {"general.architecture": "gemma3", "general.name": "Gemma 3 270m"},
        "<bos>",
        "<eos>",
        "<bos><start_of_turn>user\nS\n\nU1<end_of_turn>\n"
        "<start_of_turn>model\nA1<end_of_turn>\n"
        "<start_of_turn>user\nU2<end_of_turn>\n"
        "<start_of_turn>model\n",
    ),
    (
        "llama3",
        {"general.architecture": "llama", "general.name": "Meta Llama 3.1 8B Instruct"},
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    (
        "chatml",
        # SmolLM2 is a llama architecture that speaks ChatML
        {"general.architecture": "llama", "general.basename": "smollm2"},
        "<|im_start|>",
        "<|im_end|>",
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    (
        "mistral",
        {"general.architecture": "llama", "general.name": "Mistral 7B Instruct v0.3"},
        "<s>",
        "</s>",
        "<s>[INST] U1[/INST] A1</s>[INST] S\n\nU2[/INST]",
    ),
    (
        "phi3",
        {"general.architecture": "phi3", "general.name": "Phi 3.5 Mini Instruct"},
        "<s>",
        "<|endoftext|>",
        "<|system|>\nS<|end|>\n<|user|>\nU1<|end|>\n<|assistant|>\nA1<|end|>\n"
        "<|user|>\nU2<|end|>\n<|assistant|>\n",
    ),
]


@pytest.mark.parametrize(("family", "meta", "bos", "eos", "expected"), CASES)
def test_fallback_renders_exactly(
    family: str, meta: dict[str, str], bos: str, eos: str, expected: str
) -> None:
    t = load_chat_template(meta, chat_template=None, bos_text=bos, eos_text=eos)
    assert (t.family, t.origin) == (family, "builtin")
    assert t.render(CONV) == expected


@pytest.mark.parametrize(
    ("family", "marker"),
    [
        ("gemma", "<end_of_turn>"),
        ("llama3", "<|eot_id|>"),
        ("chatml", "<|im_end|>"),
        ("mistral", "</s>"),
        ("phi3", "<|end|>"),
    ],
)
def test_end_of_turn(family: str, marker: str) -> None:
    meta = next(m for f, m, *_ in CASES if f == family)
    eos = next(e for f, _, _, e, _ in CASES if f == family)
    t = load_chat_template(meta, chat_template=None, bos_text="", eos_text=eos)
    assert marker in t.end_of_turn


def test_gemma_270m_metadata_has_no_template_and_gets_gemma() -> None:
    meta = {"general.architecture": "gemma3", "general.basename": "gemma-3"}
    t = load_chat_template(meta, chat_template=None, bos_text="<bos>", eos_text="<eos>")
    assert t.family == "gemma"
    assert t.end_of_turn == ("<end_of_turn>", "<eos>")


def test_no_generation_prompt() -> None:
    t = ChatTemplate(builtin_template("chatml"), family="chatml")
    out = t.render(CONV[:2], add_generation_prompt=False)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"


# SmolLM2-135M-Instruct's template as its GGUF carries it
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_gguf_template_renders() -> None:
    meta = {
        "general.architecture": "llama",
        "general.basename": "smollm2",
        "tokenizer.chat_template": SMOLLM2,
    }
    t = load_chat_template(meta, chat_template=None, bos_text="<|im_start|>", eos_text="<|im_end|>")
    assert (t.family, t.origin, t.end_of_turn) == ("chatml", "gguf", ("<|im_end|>",))
    assert t.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_override_wins_and_broken_override_raises() -> None:
    meta = {"general.architecture": "gemma3", "tokenizer.chat_template": SMOLLM2}
    t = load_chat_template(meta, chat_template="{{ bos_token }}X", bos_text="B", eos_text="E")
    assert t.origin == "override" and t.render([]) == "BX"
    with pytest.raises(TemplateError, match="does not compile"):
        load_chat_template(meta, chat_template="{% for %}", bos_text="", eos_text="")


def test_broken_gguf_template_falls_back() -> None:
    meta = {"general.architecture": "gemma3", "tokenizer.chat_template": "{% if %}"}
    t = load_chat_template(meta, chat_template=None, bos_text="<bos>", eos_text="<eos>")
    assert (t.family, t.origin) == ("gemma", "builtin")


def test_hf_environment_features() -> None:
    src = (
        "{{ bos_token }}{{ messages[0].content | tojson }}|{{ {'a': [1]} | tojson(indent=2) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}|{{ eos_token }}|"
        "{{ strftime_now('%Y') | length }}|{{ extra }}"
    )
    t = ChatTemplate(src, family="chatml", bos_text="<s>", eos_text="</s>")
    out = t.render([{"role": "user", "content": "é<&>"}, CONV[1]], extra="K")
    assert out == '<s>"é<&>"|{\n  "a": [\n    1\n  ]\n}|user|</s>|4|K'


def test_raise_exception_becomes_template_error() -> None:
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}", family="chatml")
    with pytest.raises(TemplateError, match=r"^roles must alternate$"):
        t.render(CONV)


@pytest.mark.parametrize(
    "src",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}{{ cycler.__init__.__globals__ }}",
        "{{ messages.append(1) }}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_sandbox_refuses(src: str) -> None:
    t = ChatTemplate(src, family="chatml")
    with pytest.raises(TemplateError) as ei:
        t.render(CONV)
    assert "\n" not in str(ei.value)


def test_syntax_error_is_template_error() -> None:
    with pytest.raises(TemplateError, match="line 1"):
        ChatTemplate("{% if x %}", family="chatml")


def test_runtime_error_is_one_line_template_error() -> None:
    t = ChatTemplate("{{ messages[0].content + 1 }}", family="chatml")
    with pytest.raises(TemplateError, match="TypeError"):
        t.render(CONV)


def test_content_parts_and_none_and_developer() -> None:
    t = ChatTemplate(builtin_template("chatml"), family="chatml")
    msgs: list[dict[str, Any]] = [
        {"role": "developer", "content": "D"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    assert t.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
    )
    with pytest.raises(TemplateError, match="image_url"):
        t.render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(TemplateError, match="role"):
        t.render([{"content": "x"}])


def test_messages_are_not_mutated() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
    ]
    before = repr(msgs)
    ChatTemplate(builtin_template("chatml"), family="chatml").render(msgs, tools=TOOLS)
    assert repr(msgs) == before


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_appear_in_prompt(family: str) -> None:
    t = ChatTemplate(builtin_template(family), family=family, bos_text="<s>", eos_text="</s>")
    out = t.render(CONV, tools=TOOLS)
    assert "get_weather" in out and "Current weather in a city" in out
    assert "get_weather" not in t.render(CONV)


def test_chatml_hermes_tools_block() -> None:
    t = ChatTemplate(builtin_template("chatml"), family="chatml")
    out = t.render([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert out.startswith("<|im_start|>system\n# Tools\n\n")
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in out
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ) in out


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def test_chatml_tool_history() -> None:
    t = ChatTemplate(builtin_template("chatml"), family="chatml")
    out = t.render(HISTORY, tools=TOOLS)
    assert out.endswith(
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_tools_json() -> None:
    t = ChatTemplate(builtin_template("llama3"), family="llama3", bos_text="<|begin_of_text|>")
    out = t.render(HISTORY, tools=TOOLS)
    assert out.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n"
    )
    assert '"parameters": dictionary of argument name and its value}' in out
    assert '{\n    "type": "function",\n    "function": {\n        "name": "get_weather"' in out
    assert (
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
        '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>"
    ) in out


def test_mistral_tools() -> None:
    t = ChatTemplate(builtin_template("mistral"), family="mistral", bos_text="<s>", eos_text="</s>")
    out = t.render(HISTORY, tools=TOOLS)
    assert out.startswith('<s>[AVAILABLE_TOOLS] [{"type": "function"')
    assert '[/AVAILABLE_TOOLS][INST] Weather in Paris and Rome?[/INST][TOOL_CALLS] [{"name"' in out
    assert '[TOOL_RESULTS] {"content": "sunny", "call_id": "call_1"}[/TOOL_RESULTS]' in out


def test_gemma_tools_fold_into_first_user_turn() -> None:
    t = ChatTemplate(builtin_template("gemma"), family="gemma", bos_text="<bos>")
    out = t.render([{"role": "system", "content": "S"}, *HISTORY], tools=TOOLS)
    assert out.startswith("<bos><start_of_turn>user\nS\n\n# Tools\n\n")
    assert "</tool_call>\n\nWeather in Paris and Rome?<end_of_turn>\n" in out
    assert (
        "<start_of_turn>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><end_of_turn>\n<start_of_turn>model\n"
    ) in out
    assert "<start_of_turn>system" not in out


def test_tool_use_template_is_chosen_with_tools() -> None:
    meta = {
        "general.architecture": "qwen2",
        "tokenizer.chat_template": "plain",
        "tokenizer.chat_template.tool_use": "with tools",
    }
    t = load_chat_template(meta, chat_template=None, bos_text="", eos_text="")
    assert t.render(CONV) == "plain"
    assert t.render(CONV, tools=TOOLS) == "with tools"


@pytest.mark.parametrize(
    ("meta", "family"),
    [
        ({"general.architecture": "gemma2"}, "gemma"),
        ({"general.architecture": "qwen2", "general.name": "Qwen2.5 0.5B Instruct"}, "chatml"),
        ({"general.architecture": "llama", "tokenizer.ggml.pre": "llama-bpe"}, "llama3"),
        ({"general.architecture": "llama", "general.name": "Mixtral 8x7B"}, "mistral"),
        ({"general.architecture": "phi3"}, "phi3"),
        ({"general.architecture": "llama", "general.name": "Hermes 3 Llama 3.1 8B"}, "chatml"),
        ({}, "chatml"),
    ],
)
def test_detect_family(meta: dict[str, str], family: str) -> None:
    assert detect_family(meta) == family


def test_unknown_builtin() -> None:
    with pytest.raises(TemplateError, match="chatml"):
        builtin_template("nope")

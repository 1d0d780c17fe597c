"""What a model says it can do, read from its chat template and vocabulary: one function
that `/v1/models`, Ollama's `/api/show` and the fleet snapshot all read."""

from __future__ import annotations

from engine.head.prompt.model import HeadModel, capabilities, load_head_model
from engine.head.prompt.templates import load_chat_template
from engine.runtimes.mock import MockTokenizer


def model_with(template: str, *, tool_source: str | None = None) -> HeadModel:
    vocab = MockTokenizer()
    tpl = load_chat_template(vocab.metadata(), chat_template=template, bos_text="",
                             eos_text=vocab.eos_text)
    tpl.tool_source = tool_source
    return HeadModel(name="m", runtime="mock", vocab=vocab, template=tpl,
                     stop_ids=frozenset(vocab.eos_ids))


def test_capabilities_come_from_the_template_and_vocabulary():
    plain = capabilities(load_head_model("mock", "m", name="m"))
    assert (plain.tools, plain.fill_in_middle, plain.thinking) == (False, False, False)
    assert plain.names() == ["completion"]
    tools = capabilities(model_with("{% if tools %}{{ tools }}{% endif %}{{ messages }}"))
    assert tools.tools and tools.names() == ["completion", "tools"]
    separate = capabilities(model_with("{{ messages }}", tool_source="{{ tools }}"))
    assert separate.tools
    thinking = capabilities(model_with("{% if enable_thinking %}<think>{% endif %}"))
    assert thinking.thinking and thinking.names() == ["completion", "thinking"]
    assert thinking.flags() == {"chat": True, "completion": True, "tools": False,
                                "fill_in_middle": False, "thinking": True,
                                "embeddings": False}


class Fim(MockTokenizer):
    def fim_ids(self) -> tuple[int, int, int] | None:
        return (256, 257, 258)


def test_fill_in_the_middle_is_a_capability():
    model = load_head_model("mock", "m", name="m")
    model.vocab = Fim()
    assert capabilities(model).fill_in_middle
    assert capabilities(model).names() == ["completion", "insert"]

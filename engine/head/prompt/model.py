"""What the head knows of its model: vocabulary, chat template, stop ids.

The head loads only the vocabulary, through the runtime the user named,
never an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from engine.head.prompt.templates import ChatTemplate, load_chat_template
from engine.runtimes.embedding import is_embedding_model
from engine.runtimes.registry import load_vocab


class HeadVocab(Protocol):
    @property
    def eos_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, *, special: bool = True) -> list[int]: ...

    def encode_input(self, text: str) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def metadata(self) -> Mapping[str, str]: ...

    def chat_template(self) -> str | None: ...

    @property
    def bos_text(self) -> str: ...

    @property
    def eos_text(self) -> str: ...

    def fim_ids(self) -> tuple[int, int, int] | None: ...


@dataclass
class HeadModel:
    name: str
    runtime: str
    vocab: HeadVocab
    template: ChatTemplate
    stop_ids: frozenset[int]
    # it makes embeddings, not text (engine.runtimes.embedding.is_embedding_model)
    embedding: bool = False

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
               prefill: str = "", **kwargs: Any) -> list[int]:
        """Prompt ids: the template with its generation prompt, then ``prefill`` (text the
        answer is to begin with, which the model continues)."""
        text = self.template.render(messages, tools=tools, add_generation_prompt=True, **kwargs)
        return self.vocab.encode(text + prefill, special=True)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a model can do besides chat and plain completion, as every route reports it
    (``/v1/models``, Ollama's ``/api/show``, the fleet snapshot)."""

    tools: bool  # its chat template takes tool definitions
    fill_in_middle: bool  # its vocabulary has the prefix, suffix and middle tokens
    thinking: bool  # its template can switch reasoning on and off
    embedding: bool = False  # it makes embeddings, and no text

    def names(self) -> list[str]:
        """In Ollama's words: ``completion``, ``tools``, ``insert``, ``thinking``, and
        ``embedding`` alone for an embedding model."""
        if self.embedding:
            return ["embedding"]
        out = ["completion"]
        if self.tools:
            out.append("tools")
        if self.fill_in_middle:
            out.append("insert")
        if self.thinking:
            out.append("thinking")
        return out

    def flags(self) -> dict[str, bool]:
        return {"chat": not self.embedding, "completion": not self.embedding,
                "tools": self.tools, "fill_in_middle": self.fill_in_middle,
                "thinking": self.thinking, "embeddings": self.embedding}


def capabilities(model: HeadModel) -> Capabilities:
    """The one place that says what ``model`` can do, read from its template and
    vocabulary (the context window is the fleet's to say: it depends on the nodes)."""
    if model.embedding:
        return Capabilities(tools=False, fill_in_middle=False, thinking=False, embedding=True)
    source = model.template.source
    return Capabilities(tools="tools" in source or bool(model.template.tool_source),
                        fill_in_middle=model.vocab.fim_ids() is not None,
                        thinking="enable_thinking" in source or "<think>" in source)


def load_head_model(runtime: str, model: str, *, name: str,
                    chat_template: str | None = None) -> HeadModel:
    """The vocabulary through ``runtime``; ``chat_template`` overrides the model's own."""
    vocab: HeadVocab = load_vocab(runtime, model)
    template = load_chat_template(vocab.metadata(), chat_template=chat_template,
                                  bos_text=vocab.bos_text, eos_text=vocab.eos_text)
    stop_ids = set(vocab.eos_ids)
    for text in template.end_of_turn:
        ids = vocab.encode(text, special=True)
        if len(ids) == 1:
            stop_ids.add(ids[0])
    return HeadModel(name=name, runtime=runtime, vocab=vocab, template=template,
                     stop_ids=frozenset(stop_ids),
                     embedding=is_embedding_model(vocab.metadata()))

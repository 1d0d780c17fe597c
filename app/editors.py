"""Connect your editor: ready-to-paste settings for the clients people use with local
models, generated from the fleet's live model and alias list, and the panel that shows them.

The builders are pure (text in, text out) so a test can parse each snippet in its own
format: Continue's ``config.yaml`` (YAML), Zed's ``settings.json`` (JSON), the fields of
JetBrains AI Assistant and Cline (``Field: value`` lines), shell lines for Aider, Claude
Code and any OpenAI or Ollama client, Codex's ``config.toml`` (TOML), and the JSON files
of opencode, the Kilo CLI, pi, the Cline CLI and Qwen Code. Formats as
documented by each client: Continue's config.yaml reference (``provider: openai`` with
``apiBase``, ``roles`` of chat, autocomplete and embed), Zed's
``language_models.openai_compatible`` with ``available_models`` and its
``edit_predictions`` provider ``open_ai_compatible_api`` (a raw ``/v1/completions`` prompt
in the model's FIM format), Aider's
``OPENAI_API_BASE`` with ``--model openai/NAME``, Ollama's ``OLLAMA_HOST``, Claude Code's
``ANTHROPIC_BASE_URL`` (Anthropic Messages), Codex's ``model_providers`` with
``wire_api = "responses"`` (the Responses API), opencode's ``provider`` with the
``@ai-sdk/openai-compatible`` package, pi's ``models.json``, Qwen Code's ``modelProviders``.

An embedding model makes vectors and no text: it is never offered as a chat or agent model,
only to the one client setting that embeds (Continue's ``embed`` role; Zed, JetBrains AI
Assistant's third-party providers, Cline and Aider have no embeddings setting).

Every agent is given each model's window in its own setting: an agent that does not know
the window guesses (Claude Code assumes 1M tokens) and compacts its conversation only once
the fleet has refused a prompt too long for the model.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.bridge import ShoalBridge
from app.widgets import (
    Card,
    CopyButton,
    CopyField,
    PageHeader,
    inline_error,
    note,
    page_layout,
    warning_line,
)
from engine.settings import HTTP_DEFAULT
from engine.snapshot import FleetSnapshot

DUMMY_KEY = "shoal"  # clients that insist on a key; the API asks for none until keys are issued
DEFAULT_WINDOW = 4096  # a context window to write when the fleet reports none
PROVIDER = "Shoal"
LOCAL_BASE = f"http://{HTTP_DEFAULT}/v1"  # the snippets shown before the API says its own


@dataclass(frozen=True, slots=True)
class Offer:
    """A name an editor can ask the API for: a served model, or an alias of one."""

    name: str
    context_window: int
    tools: bool
    fim: bool
    embeddings: bool = False  # it makes vectors, no text: never a chat model
    alias_of: str | None = None

    @property
    def window(self) -> int:
        return self.context_window or DEFAULT_WINDOW

    @property
    def output_room(self) -> int:
        """The most an agent should ask for in one answer: a quarter of the window, at
        most 4,096 tokens (what it may set aside of the window for the answer)."""
        return min(4096, self.window // 4)

    @property
    def label(self) -> str:
        return f"{self.name} → {self.alias_of}" if self.alias_of else self.name


@dataclass(frozen=True, slots=True)
class Snippet:
    client: str
    kind: str  # "yaml" | "json" | "fields" | "shell" | "toml"
    where: str  # where it goes, one line
    text: str
    warning: str = ""  # a limit to say plainly (no FIM model for autocomplete)


def offers(snapshot: FleetSnapshot) -> list[Offer]:
    """The head's main model first, the other served models, then the aliases that resolve
    to a served model now."""
    served = [m for m in snapshot.models if m.served]
    served.sort(key=lambda m: (m.name != snapshot.model, m.name))
    by_name = {m.name: m for m in snapshot.models}
    out = [Offer(m.name, m.context_window, m.tools, m.fill_in_middle, m.embeddings)
           for m in served]
    for alias in sorted(snapshot.aliases, key=lambda a: a.name):
        target = by_name.get(alias.resolves_to or "")
        if target is None or not target.served or alias.state == "unavailable":
            continue
        out.append(Offer(alias.name, target.context_window, target.tools,
                         target.fill_in_middle, target.embeddings, alias_of=target.name))
    return out


def root_url(base_url: str) -> str:
    """``http://127.0.0.1:8453`` for ``http://127.0.0.1:8453/v1`` (Ollama's routes live there)."""
    return base_url.rstrip("/").removesuffix("/v1")


def _q(text: str) -> str:
    """A YAML scalar: a JSON string is a valid double-quoted YAML scalar."""
    return json.dumps(text, ensure_ascii=False)


def chat_models(models: Sequence[Offer]) -> list[Offer]:
    """The models that answer with text: every client's chat and agent models."""
    return [m for m in models if not m.embeddings]


def _pick(models: Sequence[Offer], chat: str | None) -> Offer | None:
    talkers = chat_models(models)
    for m in talkers:
        if m.name == chat:
            return m
    return talkers[0] if talkers else None


NO_FIM = ("No model the fleet serves has fill-in-the-middle tokens, so there is no "
          "autocomplete; serve a code model (Qwen2.5-Coder, StarCoder2, CodeLlama) for it.")
NO_EMBED = ("No model the fleet serves makes embeddings, so codebase search (@Codebase, "
            "@Docs) has only Continue's own small model in VS Code and none in JetBrains; "
            "serve an embedding model (all-MiniLM-L6-v2, nomic-embed-text) for it.")


def fim_model(models: Sequence[Offer], first: Offer | None = None) -> Offer | None:
    """The model for autocomplete: the chosen chat model when it has FIM tokens, else the
    first that has them: one served anywhere will do, on one machine as on several."""
    ordered = ([first] if first else []) + chat_models(models)
    return next((m for m in ordered if m.fim), None)


def embedder(models: Sequence[Offer]) -> Offer | None:
    """The model for codebase indexing: the first embedding model served."""
    return next((m for m in models if m.embeddings), None)


def _continue_model(name: str, m: Offer, base_url: str, roles: Sequence[str]) -> list[str]:
    return [f"  - name: {_q(name)}", "    provider: openai", f"    model: {_q(m.name)}",
            f"    apiBase: {_q(base_url)}", "    roles:", *(f"      - {r}" for r in roles)]


def continue_yaml(base_url: str, models: Sequence[Offer], chat: str | None = None) -> Snippet:
    """A model entry per chat model (chat, edit, apply), one for autocomplete (a model with
    FIM tokens) and one for embeddings (``embed``: what Continue indexes the codebase with,
    through ``/v1/embeddings``)."""
    first = _pick(models, chat)
    ordered = ([first] if first else []) + [m for m in chat_models(models) if m is not first]
    fim, embed = fim_model(models, first), embedder(models)
    lines = ["name: Shoal", "version: 0.0.1", "schema: v1"]
    if not ordered and embed is None:
        lines += ["# the fleet serves no model right now: come back when one is served",
                  "models: []"]
    else:
        lines.append("models:")
    for m in ordered:
        lines += _continue_model("Shoal: " + m.name, m, base_url, ("chat", "edit", "apply"))
        lines += ["    defaultCompletionOptions:", f"      contextLength: {m.window}"]
        if m.tools:
            lines += ["    capabilities:", "      - tool_use"]
    if fim is not None:
        lines += _continue_model("Shoal autocomplete: " + fim.name, fim, base_url,
                                 ("autocomplete",))
    if embed is not None:
        lines += _continue_model("Shoal embeddings: " + embed.name, embed, base_url,
                                 ("embed",))
    limits = [] if not ordered else [
        line for line, missing in ((NO_FIM, fim is None), (NO_EMBED, embed is None))
        if missing]
    lines += ["# " + line for line in limits]
    return Snippet("Continue", "yaml", "~/.continue/config.yaml (replace its models, or add "
                   "these to them)", "\n".join(lines) + "\n", warning="\n".join(limits))


def zed_json(base_url: str, models: Sequence[Offer], chat: str | None = None) -> Snippet:
    """The chat models under ``language_models.openai_compatible``; with a FIM model, Zed's
    edit predictions from it: Zed writes the FIM prompt itself (``prompt_format`` "infer"
    reads the family from the model's name) and posts it to ``/v1/completions``."""
    available = [{"name": m.name,
                  "display_name": f"{m.label} (Shoal)",
                  "max_tokens": m.window,
                  "capabilities": {"tools": m.tools, "images": False,
                                   "parallel_tool_calls": False, "prompt_cache_key": False}}
                 for m in chat_models(models)]
    doc: dict[str, object] = {"language_models": {"openai_compatible": {PROVIDER: {
        "api_url": base_url, "available_models": available}}}}
    fim = fim_model(models, _pick(models, chat))
    where = "language_models"
    if fim is not None:
        doc["edit_predictions"] = {"provider": "open_ai_compatible_api",
                                   "open_ai_compatible_api": {
                                       "api_url": base_url.rstrip("/") + "/completions",
                                       "model": fim.name, "prompt_format": "infer"}}
        where = "language_models and edit_predictions"
    return Snippet("Zed", "json", f"Zed's settings.json (merge into {where}); if Zed "
                   f"asks for a key, any text works, or set {PROVIDER.upper()}_API_KEY",
                   json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def _fields(pairs: Sequence[tuple[str, str]]) -> str:
    return "".join(f"{k}: {v}\n" for k, v in pairs)


def jetbrains_fields(base_url: str, models: Sequence[Offer], chat: str | None = None
                     ) -> Snippet:
    first = _pick(models, chat)
    pairs = [("Provider", "OpenAI-compatible"), ("URL", base_url), ("API Key", DUMMY_KEY),
             ("Tool calling", "on" if first is not None and first.tools else "off")]
    if first is not None:
        pairs.append(("Model", first.name))
    return Snippet("JetBrains AI Assistant", "fields",
                   "Settings | Tools | AI Assistant | Providers & API keys → Third-party AI "
                   "providers; then pick the model in AI Chat", _fields(pairs))


def cline_fields(base_url: str, models: Sequence[Offer], chat: str | None = None) -> Snippet:
    first = _pick(models, chat)
    pairs = [("API Provider", "OpenAI Compatible"), ("Base URL", base_url),
             ("API Key", DUMMY_KEY)]
    if first is not None:
        pairs += [("Model ID", first.name), ("Context Window Size", str(first.window))]
    return Snippet("Cline", "fields", "Cline's settings (the gear in its panel) → API Provider",
                   _fields(pairs))


AIDER_METADATA = "~/.aider.shoal.json"  # its own file: ~/.aider.model.metadata.json is the user's


def aider_shell(base_url: str, models: Sequence[Offer], chat: str | None = None) -> Snippet:
    """Aider learns a model's window from a model metadata file (litellm's fields); without
    one it warns that it does not know the window and guesses."""
    first = _pick(models, chat)
    lines = [f"export OPENAI_API_BASE={shlex.quote(base_url)}",
             f"export OPENAI_API_KEY={DUMMY_KEY}"]
    if first is not None:
        metadata = {f"openai/{m.name}": {
            "max_input_tokens": m.window, "max_output_tokens": m.output_room,
            "input_cost_per_token": 0, "output_cost_per_token": 0,
            "litellm_provider": "openai", "mode": "chat"} for m in chat_models(models)}
        lines += [f"printf '%s\\n' {shlex.quote(json.dumps(metadata, ensure_ascii=False))}"
                  f" > {AIDER_METADATA}",
                  f"aider --model {shlex.quote('openai/' + first.name)} "
                  f"--model-metadata-file {AIDER_METADATA}"]
    return Snippet("Aider", "shell", "a terminal, in your project's folder",
                   "\n".join(lines) + "\n")


# What an agent sends with every request before the user's words, in tokens (its system
# prompt and tools, measured with Gemma 3's tokenizer through the head's
# /v1/messages/count_tokens on the requests the pinned versions sent: tests/fixtures/
# agents), and the window a model needs for it with room for an answer.
AGENT_PROMPT = {"Claude Code": 22_000, "Codex": 9_700}
ANSWER_ROOM = 8_192


def too_small(agent: str, models: Sequence[Offer]) -> str:
    """The panel's warning when no model the fleet serves (with tool calling: an agent's
    work is tool calls) has a window for ``agent``'s own prompt; "" when one has."""
    need = AGENT_PROMPT[agent] + ANSWER_ROOM
    talkers = chat_models(models)
    able = [m.window for m in talkers if m.tools]
    if not talkers or (able and max(able) >= need):
        return ""
    largest = f"the largest is {max(able):,}" if able else "none of them calls tools"
    return (f"{agent} sends about {AGENT_PROMPT[agent]:,} tokens of system prompt and tools "
            f"with every request, and no model the fleet serves with tool calling has room "
            f"for it ({largest}): serve one with a window of {need:,} tokens or more "
            "(Gemma 3 and Qwen2.5-Coder have 32,768).")


def claude_code_shell(base_url: str, models: Sequence[Offer],
                      chat: str | None = None) -> Snippet:
    """Claude Code talks Anthropic Messages to ``ANTHROPIC_BASE_URL`` (the root: it adds
    ``/v1/messages``); both of its model slots get the chosen model. A model it does not
    know gets the window ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` says (else it assumes 1M
    tokens and compacts only once the fleet has refused the prompt)."""
    first = _pick(models, chat)
    lines = [f"export ANTHROPIC_BASE_URL={shlex.quote(root_url(base_url))}",
             f"export ANTHROPIC_AUTH_TOKEN={DUMMY_KEY}"]
    if first is not None:
        lines += [f"export ANTHROPIC_MODEL={shlex.quote(first.name)}",
                  f"export ANTHROPIC_DEFAULT_HAIKU_MODEL={shlex.quote(first.name)}",
                  f"export CLAUDE_CODE_MAX_CONTEXT_TOKENS={first.window}"]
    lines.append("claude")
    return Snippet("Claude Code", "shell", "a terminal, in your project's folder",
                   "\n".join(lines) + "\n", warning=too_small("Claude Code", models))


def codex_toml(base_url: str, models: Sequence[Offer], chat: str | None = None) -> Snippet:
    """Codex reads providers from ``~/.codex/config.toml``; Shoal serves the Responses API
    it speaks. ``model_context_window`` is the window it compacts within (its own table
    knows only OpenAI's models)."""
    first = _pick(models, chat)
    lines: list[str] = []
    if first is not None:
        lines += [f"model = {json.dumps(first.name)}",
                  f"model_context_window = {first.window}"]
    lines += ['model_provider = "shoal"', "", "[model_providers.shoal]",
              f"name = {json.dumps(PROVIDER)}", f"base_url = {json.dumps(base_url)}",
              'wire_api = "responses"']
    return Snippet("Codex", "toml", "~/.codex/config.toml", "\n".join(lines) + "\n",
                   warning=too_small("Codex", models))


def opencode_json(base_url: str, models: Sequence[Offer], chat: str | None = None, *,
                  client: str = "opencode",
                  path: str = "~/.config/opencode/opencode.json") -> Snippet:
    """opencode reads providers from ``~/.config/opencode/opencode.json``; an
    OpenAI-compatible one names the AI SDK package that speaks Chat Completions. The Kilo
    CLI, opencode's fork, reads the same settings from its own file."""
    first = _pick(models, chat)
    entries = {m.name: {"name": f"{m.label} (Shoal)", "tool_call": m.tools,
                        "limit": {"context": m.window, "output": m.output_room}}
               for m in chat_models(models)}
    doc: dict[str, object] = {
        "provider": {"shoal": {"npm": "@ai-sdk/openai-compatible", "name": PROVIDER,
                               "options": {"baseURL": base_url, "apiKey": DUMMY_KEY},
                               "models": entries}}}
    if client == "opencode":
        doc = {"$schema": "https://opencode.ai/config.json", **doc}
    if first is not None:
        doc["model"] = f"shoal/{first.name}"
    return Snippet(client, "json", f"{path} (merge into provider)",
                   json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def kilo_json(base_url: str, models: Sequence[Offer], chat: str | None = None) -> Snippet:
    return opencode_json(base_url, models, chat, client="Kilo CLI",
                         path="~/.config/kilo/kilo.json")


def pi_json(base_url: str, models: Sequence[Offer], chat: str | None = None) -> Snippet:
    """pi reads providers from ``~/.pi/agent/models.json``; a model's ``contextWindow`` is
    the window it compacts within. Shoal takes the system prompt as a system message, and
    asks for no reasoning effort."""
    first = _pick(models, chat)
    entries = [{"id": m.name, "name": f"{m.label} (Shoal)", "input": ["text"],
                "reasoning": False, "contextWindow": m.window, "maxTokens": m.output_room}
               for m in chat_models(models)]
    doc = {"providers": {"shoal": {
        "baseUrl": base_url, "api": "openai-completions", "apiKey": DUMMY_KEY,
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": entries}}}
    run = f"; then run pi --model {shlex.quote('shoal/' + first.name)}" if first else ""
    return Snippet("pi", "json", f"~/.pi/agent/models.json (merge into providers){run}",
                   json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


# the Cline CLI's settings file wants when a provider was set; any time will do
CLINE_SET_AT = "2026-01-01T00:00:00.000Z"


def cline_cli_json(base_url: str, models: Sequence[Offer], chat: str | None = None
                   ) -> Snippet:
    """The Cline CLI keeps its provider in ``~/.cline/data/settings/providers.json`` (what
    ``cline auth`` writes, which has no option for the window)."""
    first = _pick(models, chat)
    settings: dict[str, object] = {"provider": "openai-compatible", "apiKey": DUMMY_KEY,
                                   "baseUrl": base_url}
    if first is not None:
        settings |= {"model": first.name, "contextWindow": first.window,
                     "maxTokens": first.output_room}
    doc = {"version": 1, "lastUsedProvider": "openai-compatible", "modes": {},
           "providers": {"openai-compatible": {"settings": settings,
                                               "updatedAt": CLINE_SET_AT,
                                               "tokenSource": "manual"}}}
    return Snippet("Cline CLI", "json", "~/.cline/data/settings/providers.json (merge into "
                   "providers); then run cline", json.dumps(doc, indent=2) + "\n")


def qwen_json(base_url: str, models: Sequence[Offer], chat: str | None = None) -> Snippet:
    """Qwen Code reads ``~/.qwen/settings.json``: models of the ``openai`` auth type with a
    base URL, the key from the environment variable ``envKey`` names, and each model's
    window as ``contextWindowSize``."""
    first = _pick(models, chat)
    key = f"{PROVIDER.upper()}_API_KEY"
    entries = [{"id": m.name, "name": f"{m.label} (Shoal)", "envKey": key,
                "baseUrl": base_url,
                "generationConfig": {"contextWindowSize": m.window,
                                     "samplingParams": {"max_tokens": m.output_room}}}
               for m in chat_models(models)]
    doc: dict[str, object] = {"env": {key: DUMMY_KEY}, "modelProviders": {"openai": entries},
                              "security": {"auth": {"selectedType": "openai"}}}
    if first is not None:
        doc["model"] = {"name": first.name}
    return Snippet("Qwen Code", "json", "~/.qwen/settings.json (merge into it); then run "
                   "qwen", json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def clients_shell(base_url: str) -> Snippet:
    lines = ["# OpenAI SDKs and tools",
             f"export OPENAI_BASE_URL={shlex.quote(base_url)}",
             f"export OPENAI_API_KEY={DUMMY_KEY}",
             "# Ollama clients (the ollama command, ollama-python, Open WebUI)",
             f"export OLLAMA_HOST={shlex.quote(root_url(base_url))}"]
    return Snippet("OpenAI or Ollama client", "shell", "your shell profile, or the "
                   "environment of the program", "\n".join(lines) + "\n")


def snippets(base_url: str, models: Sequence[Offer], chat: str | None = None) -> list[Snippet]:
    return [continue_yaml(base_url, models, chat), zed_json(base_url, models, chat),
            jetbrains_fields(base_url, models, chat), cline_fields(base_url, models, chat),
            aider_shell(base_url, models, chat), claude_code_shell(base_url, models, chat),
            codex_toml(base_url, models, chat), opencode_json(base_url, models, chat),
            pi_json(base_url, models, chat), cline_cli_json(base_url, models, chat),
            kilo_json(base_url, models, chat), qwen_json(base_url, models, chat),
            clients_shell(base_url)]


# -- the panel -----------------------------------------------------------------------

API_OFF = ("The API is off on this machine, so an editor here has nothing to talk to: turn "
           "on Run the API on this machine (in the tray menu) first.")


class SnippetView(QWidget):
    """One client's settings: where they go, a limit if any, the text and a Copy button."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 12, 12, 12)
        layout.setSpacing(8)
        top = QHBoxLayout()
        self.where = note("")
        self.copy = CopyButton(lambda: self.text.toPlainText(), "Copy")
        top.addWidget(self.where, 1)
        top.addWidget(self.copy, 0, Qt.AlignmentFlag.AlignTop)
        self.warning = warning_line()
        self.text = QPlainTextEdit()
        self.text.setObjectName("snippet")
        self.text.setReadOnly(True)
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        layout.addLayout(top)
        layout.addWidget(self.warning)
        layout.addWidget(self.text, 1)

    def show_snippet(self, snippet: Snippet) -> None:
        self.where.setText(f"Paste into {snippet.where}.")
        self.warning.setText(snippet.warning)
        self.warning.setVisible(bool(snippet.warning))
        if self.text.toPlainText() != snippet.text:
            self.text.setPlainText(snippet.text)


class EditorsPanel(QWidget):
    """The base URL and, per client, settings to paste, kept up to date with the fleet."""

    def __init__(self, bridge: ShoalBridge, parent: QWidget | None = None, *,
                 header: bool = True) -> None:
        super().__init__(parent)
        self._bridge = bridge
        self._shown: tuple[str | None, tuple[Offer, ...], str | None] | None = None
        layout = page_layout(self)
        if header:
            layout.addWidget(PageHeader(
                "Connect your editor",
                "Point any editor or script at this machine's API; the fleet answers."))
        card = Card()
        self.base = CopyField()
        self.base.setObjectName("baseUrl")
        self.off = inline_error()
        self.off.setText(API_OFF)
        self.chat = QComboBox()
        self.chat.setObjectName("chatModel")
        self.chat.setMinimumWidth(240)
        self.chat.currentIndexChanged.connect(lambda _i: self.refresh(self._bridge.last))
        card.row(QLabel("Base URL"), self.base)
        card.add(self.off)
        card.row(QLabel("Model for chat"), self.chat, None)
        layout.addWidget(card)
        self.tabs = QTabWidget()
        self.tabs.setObjectName("clients")
        self.views: dict[str, SnippetView] = {}
        for s in snippets(LOCAL_BASE, []):
            view = SnippetView()
            self.views[s.client] = view
            self.tabs.addTab(view, s.client)
        layout.addWidget(self.tabs, 1)
        bridge.snapshot.connect(self.refresh)
        self.refresh(bridge.last)

    def snippet_text(self, client: str) -> str:
        return self.views[client].text.toPlainText()

    def refresh(self, snapshot: FleetSnapshot) -> None:
        url = snapshot.roles.api_url
        models = tuple(offers(snapshot))
        talkers = chat_models(models)  # an embedding model is no model to chat with
        names = [m.name for m in talkers]
        current = self.chat.currentData()
        if [self.chat.itemData(i) for i in range(self.chat.count())] != names:
            self.chat.blockSignals(True)
            self.chat.clear()
            for m in talkers:
                self.chat.addItem(m.label, m.name)
            if current in names:
                self.chat.setCurrentIndex(names.index(current))
            self.chat.blockSignals(False)
        chat = self.chat.currentData()
        state = (url, models, chat)
        if state == self._shown:
            return
        self._shown = state
        self.off.setVisible(url is None)
        self.tabs.setEnabled(url is not None)
        base = url or LOCAL_BASE
        self.base.set_text(base if url else "", shown=base if url else "(the API is off)")
        for s in snippets(base, models, chat):
            self.views[s.client].show_snippet(s)

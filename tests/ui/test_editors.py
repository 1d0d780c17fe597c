"""Connect your editor: each snippet parses in its own format (YAML, JSON, ``Field: value``
lines, shell lines) and names the base URL and the fleet's models as the client needs."""

from __future__ import annotations

import json
import shlex
import tomllib
from dataclasses import replace
from typing import Any

import pytest
import yaml

from app import editors
from app.editors import NO_EMBED, NO_FIM, Offer, offers, root_url, snippets
from engine.snapshot import AliasSnapshot, FleetSnapshot, ModelSnapshot, Roles

pytestmark = pytest.mark.ui
BASE = "http://127.0.0.1:8453/v1"
CHAT = Offer("qwen2.5-coder-7b", 32768, tools=True, fim=True)
PLAIN = Offer("llama-3.2-3b", 8192, tools=False, fim=False)
ODD = Offer('org/repo:Q4_K_M "x" #1', 0, tools=False, fim=False)  # quotes, colon, hash
EMBED = Offer("all-minilm-l6-v2", 512, tools=False, fim=False, embeddings=True)


def shell_env(text: str) -> tuple[dict[str, str], list[list[str]]]:
    """``export NAME=value`` lines as a dict, and the other commands, split as sh would."""
    env: dict[str, str] = {}
    commands: list[list[str]] = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "export":
            name, _, value = words[1].partition("=")
            env[name] = value
        else:
            commands.append(words)
    return env, commands


def written(commands: list[list[str]]) -> dict[str, str]:
    """What the ``printf '%s\\n' TEXT > PATH`` commands write, by path."""
    return {c[4]: c[2] for c in commands if c[0] == "printf" and c[1] == "%s\\n"
            and c[3] == ">" and len(c) == 5}


def fields(text: str) -> dict[str, str]:
    """``Field: value`` lines, one per field, as a settings form shows them."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(": ")
        assert sep and name and value and name not in out, f"not a field line: {line!r}"
        out[name] = value
    return out


def test_continue_yaml_has_a_chat_model_per_name_and_fim_autocomplete():
    s = editors.continue_yaml(BASE, [PLAIN, CHAT, ODD], chat=CHAT.name)
    doc = yaml.safe_load(s.text)
    assert doc["name"] == "Shoal" and doc["schema"] == "v1"
    models = doc["models"]
    chat = [m for m in models if "chat" in m["roles"]]
    assert [m["model"] for m in chat] == [CHAT.name, PLAIN.name, ODD.name]
    assert all(m["provider"] == "openai" and m["apiBase"] == BASE for m in models)
    assert chat[0]["defaultCompletionOptions"]["contextLength"] == 32768
    assert chat[0]["capabilities"] == ["tool_use"] and "capabilities" not in chat[1]
    assert chat[2]["defaultCompletionOptions"]["contextLength"] == editors.DEFAULT_WINDOW
    [auto] = [m for m in models if m["roles"] == ["autocomplete"]]
    assert auto["model"] == CHAT.name and all("embed" not in m["roles"] for m in models)
    assert s.warning == NO_EMBED and "# " + NO_EMBED in s.text  # no embedding model served


def test_continue_says_plainly_when_no_model_has_fim():
    s = editors.continue_yaml(BASE, [PLAIN])
    doc = yaml.safe_load(s.text)
    assert all("autocomplete" not in m["roles"] for m in doc["models"])
    assert s.warning.splitlines() == [NO_FIM, NO_EMBED] and "# " + NO_FIM in s.text
    empty = editors.continue_yaml(BASE, [])
    assert yaml.safe_load(empty.text)["models"] == [] and empty.warning == ""


def test_continue_yaml_gives_chat_autocomplete_and_embed_each_a_model():
    # the embedding model first, and even asked for as the chat model: never a chat model
    s = editors.continue_yaml(BASE, [EMBED, PLAIN, CHAT], chat=EMBED.name)
    models = yaml.safe_load(s.text)["models"]
    by_role = {role: [m["model"] for m in models if role in m["roles"]]
               for role in ("chat", "edit", "apply", "autocomplete", "embed")}
    assert by_role == {"chat": [PLAIN.name, CHAT.name], "edit": [PLAIN.name, CHAT.name],
                       "apply": [PLAIN.name, CHAT.name], "autocomplete": [CHAT.name],
                       "embed": [EMBED.name]}
    [embed] = [m for m in models if m["model"] == EMBED.name]
    # Continue's openai provider posts to apiBase + "embeddings": the API's /v1/embeddings
    assert embed == {"name": f"Shoal embeddings: {EMBED.name}", "provider": "openai",
                     "model": EMBED.name, "apiBase": BASE, "roles": ["embed"]}
    assert s.warning == "" and not [line for line in s.text.splitlines() if "#" in line]
    # only an embedding model: Continue indexes with it, and there is nothing to chat with
    alone = yaml.safe_load(editors.continue_yaml(BASE, [EMBED]).text)["models"]
    assert [m["roles"] for m in alone] == [["embed"]]


def test_an_embedding_model_is_no_client_s_chat_model():
    got = snippets(BASE, [EMBED, ODD, CHAT], chat=EMBED.name)
    for s in got:
        if s.client == "Continue":
            entries = yaml.safe_load(s.text)["models"]
            assert [m["roles"] for m in entries if m["model"] == EMBED.name] == [["embed"]]
        else:
            assert EMBED.name not in s.text + s.where, s.client
    # the chosen chat model is one that makes text: the first of them
    jet = fields(next(s for s in got if s.client == "JetBrains AI Assistant").text)
    assert jet["Model"] == ODD.name
    assert json.loads(next(s for s in got if s.client == "Cline CLI").text)[
        "providers"]["openai-compatible"]["settings"]["model"] == ODD.name
    # an agent with only an embedding model served has no model to warn about
    assert editors.claude_code_shell(BASE, [EMBED]).warning == ""
    assert "ANTHROPIC_MODEL" not in shell_env(editors.claude_code_shell(BASE, [EMBED]).text)[0]


def test_zed_predicts_edits_with_a_fim_model_through_completions():
    coder = Offer("starcoder2-3b", 16384, tools=False, fim=True)
    doc = json.loads(editors.zed_json(BASE, [PLAIN, coder, CHAT, EMBED], CHAT.name).text)
    # the chosen chat model has FIM tokens: it predicts; Zed formats the FIM prompt itself
    assert doc["edit_predictions"] == {"provider": "open_ai_compatible_api",
                                       "open_ai_compatible_api": {
                                           "api_url": BASE + "/completions",
                                           "model": CHAT.name, "prompt_format": "infer"}}
    names = [m["name"] for m in
             doc["language_models"]["openai_compatible"]["Shoal"]["available_models"]]
    assert names == [PLAIN.name, coder.name, CHAT.name]
    picked = json.loads(editors.zed_json(BASE + "/", [PLAIN, coder], PLAIN.name).text)
    assert picked["edit_predictions"]["open_ai_compatible_api"]["model"] == coder.name
    assert picked["edit_predictions"]["open_ai_compatible_api"]["api_url"] == \
        BASE + "/completions"
    plain = editors.zed_json(BASE, [PLAIN, EMBED])
    assert "edit_predictions" not in json.loads(plain.text)
    assert "edit_predictions" not in plain.where


def test_zed_json_lists_every_model_under_openai_compatible():
    s = editors.zed_json(BASE, [CHAT, PLAIN, Offer("coder", 32768, True, True, alias_of=CHAT.name)])
    doc = json.loads(s.text)
    provider = doc["language_models"]["openai_compatible"]["Shoal"]
    assert provider["api_url"] == BASE
    models = provider["available_models"]
    assert [m["name"] for m in models] == [CHAT.name, PLAIN.name, "coder"]
    assert models[0]["max_tokens"] == 32768 and models[0]["capabilities"]["tools"] is True
    assert models[1]["capabilities"]["tools"] is False
    assert models[2]["display_name"] == f"coder → {CHAT.name} (Shoal)"


def test_jetbrains_and_cline_fields_parse_as_field_value_lines():
    jet = fields(editors.jetbrains_fields(BASE, [PLAIN, CHAT], chat=CHAT.name).text)
    assert jet == {"Provider": "OpenAI-compatible", "URL": BASE, "API Key": "shoal",
                   "Tool calling": "on", "Model": CHAT.name}
    cline = fields(editors.cline_fields(BASE, [PLAIN]).text)
    assert cline["API Provider"] == "OpenAI Compatible" and cline["Base URL"] == BASE
    assert cline["Model ID"] == PLAIN.name and cline["Context Window Size"] == "8192"


def test_aider_and_clients_are_shell_lines_sh_can_read():
    env, commands = shell_env(editors.aider_shell(BASE, [ODD, CHAT]).text)
    assert env == {"OPENAI_API_BASE": BASE, "OPENAI_API_KEY": "shoal"}
    assert commands[-1] == ["aider", "--model", f"openai/{ODD.name}",
                            "--model-metadata-file", "~/.aider.shoal.json"]
    # aider's model metadata (litellm's fields) gives every model its window: without it
    # aider says it does not know the window and guesses
    metadata = json.loads(written(commands[:-1])["~/.aider.shoal.json"])
    assert metadata[f"openai/{ODD.name}"]["max_input_tokens"] == editors.DEFAULT_WINDOW
    assert metadata[f"openai/{CHAT.name}"] == {
        "max_input_tokens": 32768, "max_output_tokens": 4096, "input_cost_per_token": 0,
        "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}
    assert shell_env(editors.aider_shell(BASE, []).text)[1] == []
    env, commands = shell_env(editors.clients_shell(BASE).text)
    assert env == {"OPENAI_BASE_URL": BASE, "OPENAI_API_KEY": "shoal",
                   "OLLAMA_HOST": "http://127.0.0.1:8453"} and commands == []
    assert root_url("http://[::1]:9000/v1/") == "http://[::1]:9000"


def test_claude_code_is_shell_lines_pointing_at_the_root():
    env, commands = shell_env(editors.claude_code_shell(BASE, [ODD]).text)
    # Claude Code adds /v1/messages itself: the base is the root, not .../v1
    assert env == {"ANTHROPIC_BASE_URL": "http://127.0.0.1:8453",
                   "ANTHROPIC_AUTH_TOKEN": "shoal", "ANTHROPIC_MODEL": ODD.name,
                   "ANTHROPIC_DEFAULT_HAIKU_MODEL": ODD.name,
                   "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(editors.DEFAULT_WINDOW)}
    assert commands == [["claude"]]
    # the chosen model's window, which Claude Code compacts within (else it assumes 1M)
    env, _ = shell_env(editors.claude_code_shell(BASE, [ODD, CHAT], CHAT.name).text)
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"


def test_codex_toml_parses_and_speaks_the_responses_api():
    doc = tomllib.loads(editors.codex_toml(BASE, [PLAIN, ODD], ODD.name).text)
    assert doc["model"] == ODD.name and doc["model_provider"] == "shoal"
    assert doc["model_context_window"] == editors.DEFAULT_WINDOW  # else Codex guesses
    assert tomllib.loads(editors.codex_toml(BASE, [PLAIN])
                        .text)["model_context_window"] == PLAIN.window
    assert doc["model_providers"]["shoal"] == {"name": "Shoal", "base_url": BASE,
                                               "wire_api": "responses"}
    assert {"model", "model_context_window"}.isdisjoint(
        tomllib.loads(editors.codex_toml(BASE, []).text))


def test_opencode_json_names_an_openai_compatible_provider():
    doc = json.loads(editors.opencode_json(BASE, [PLAIN, ODD], ODD.name).text)
    assert doc["model"] == f"shoal/{ODD.name}"
    provider = doc["provider"]["shoal"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == BASE
    assert set(provider["models"]) == {PLAIN.name, ODD.name}
    assert provider["models"][PLAIN.name]["limit"]["context"] == PLAIN.window
    assert "model" not in json.loads(editors.opencode_json(BASE, []).text)


def test_kilo_json_is_opencode_s_provider_in_kilo_s_own_file():
    s = editors.kilo_json(BASE, [PLAIN, ODD], ODD.name)
    doc = json.loads(s.text)
    assert s.where.startswith("~/.config/kilo/kilo.json ") and "$schema" not in doc
    assert doc["model"] == f"shoal/{ODD.name}"
    assert doc["provider"]["shoal"]["models"][PLAIN.name]["limit"] == {"context": 8192,
                                                                       "output": 2048}


def test_pi_models_json_gives_each_model_its_window():
    s = editors.pi_json(BASE, [PLAIN, ODD], ODD.name)
    provider = json.loads(s.text)["providers"]["shoal"]
    assert provider["baseUrl"] == BASE and provider["api"] == "openai-completions"
    assert provider["compat"] == {"supportsDeveloperRole": False,
                                  "supportsReasoningEffort": False}
    assert [(m["id"], m["contextWindow"], m["maxTokens"]) for m in provider["models"]] == [
        (PLAIN.name, 8192, 2048), (ODD.name, editors.DEFAULT_WINDOW, 1024)]
    assert s.where.startswith("~/.pi/agent/models.json ")
    assert s.where.endswith(f"pi --model {shlex.quote('shoal/' + ODD.name)}")


def test_cline_cli_providers_json_names_the_model_and_its_window():
    s = editors.cline_cli_json(BASE, [PLAIN, CHAT], CHAT.name)
    doc = json.loads(s.text)
    assert doc["version"] == 1 and doc["lastUsedProvider"] == "openai-compatible"
    entry = doc["providers"]["openai-compatible"]
    assert entry["tokenSource"] == "manual" and entry["updatedAt"].endswith("Z")
    assert entry["settings"] == {"provider": "openai-compatible", "apiKey": "shoal",
                                 "baseUrl": BASE, "model": CHAT.name,
                                 "contextWindow": 32768, "maxTokens": 4096}
    assert s.where.startswith("~/.cline/data/settings/providers.json ")


def test_qwen_settings_json_gives_each_model_its_window():
    s = editors.qwen_json(BASE, [PLAIN, ODD], ODD.name)
    doc = json.loads(s.text)
    assert doc["model"] == {"name": ODD.name}
    assert doc["security"]["auth"]["selectedType"] == "openai"
    assert doc["env"] == {"SHOAL_API_KEY": "shoal"}
    models = doc["modelProviders"]["openai"]
    assert [m["id"] for m in models] == [PLAIN.name, ODD.name]
    assert all(m["baseUrl"] == BASE and m["envKey"] == "SHOAL_API_KEY" for m in models)
    assert models[0]["generationConfig"] == {"contextWindowSize": 8192,
                                             "samplingParams": {"max_tokens": 2048}}
    assert "model" not in json.loads(editors.qwen_json(BASE, []).text)


@pytest.mark.parametrize(("agent", "build"), [("Claude Code", editors.claude_code_shell),
                                              ("Codex", editors.codex_toml)])
def test_the_agents_warn_when_no_model_has_room_for_their_prompt(agent: str, build: Any):
    small = Offer("smollm2", 8192, tools=True, fim=False)
    big_plain = Offer("base", 131072, tools=False, fim=False)
    roomy = Offer("gemma", 32768, tools=True, fim=False)
    warning = build(BASE, [small, big_plain]).warning
    assert warning.startswith(f"{agent} sends about ") and "the largest is 8,192" in warning
    assert "\n" not in warning
    assert build(BASE, [small, roomy]).warning == ""
    assert "none of them calls tools" in build(BASE, [big_plain]).warning
    assert build(BASE, []).warning == ""  # nothing served: the panel says so itself


def test_every_client_has_a_snippet_naming_the_url():
    got = snippets(BASE, [CHAT])
    assert [s.client for s in got] == ["Continue", "Zed", "JetBrains AI Assistant", "Cline",
                                      "Aider", "Claude Code", "Codex", "opencode", "pi",
                                      "Cline CLI", "Kilo CLI", "Qwen Code",
                                      "OpenAI or Ollama client"]
    for s in got:
        assert BASE.removesuffix("/v1") in s.text and s.where


def _snapshot(*, aliases: tuple[AliasSnapshot, ...] = ()) -> FleetSnapshot:
    models = (ModelSnapshot("b-model", True, 4096, False, False),
              ModelSnapshot("a-model", True, 8192, True, True),
              ModelSnapshot("gone", False, 2048, False, False))
    return FleetSnapshot(at=0.0, fleet_name=None, fleet_id="open", has_token=False,
                         roles=Roles(head=True, api_url=BASE, fleet_listen=None, node=None,
                                     member=False),
                         model="b-model", models=models, nodes=(), heads=(), aliases=aliases,
                         queued=0, moves=0, pulls=())


def test_offers_put_the_main_model_first_then_served_models_then_live_aliases():
    aliases = (AliasSnapshot("coder", "a-model", (), 1, 0.0, "a-model", "ok"),
               AliasSnapshot("old", "gone", (), 1, 0.0, None, "unavailable"))
    got = offers(_snapshot(aliases=aliases))
    assert [o.name for o in got] == ["b-model", "a-model", "coder"]
    assert got[2] == Offer("coder", 8192, True, True, alias_of="a-model")


def test_offers_carry_which_model_embeds_and_one_machine_gets_all_three_roles():
    """One machine serving a chat model, a FIM model and an embedding model (the snapshot
    names no other machine): the Continue snippet has every role and no warning."""
    snap = _snapshot(aliases=(AliasSnapshot("vectors", "minilm", (), 1, 0.0, "minilm", "ok"),))
    snap = replace(snap, models=(*snap.models,
                                 ModelSnapshot("minilm", True, 512, False, False,
                                               embeddings=True)))
    got = offers(snap)
    assert [(o.name, o.embeddings) for o in got] == [
        ("b-model", False), ("a-model", False), ("minilm", True), ("vectors", True)]
    s = editors.continue_yaml(BASE, got, chat="b-model")
    roles = {role: m["model"] for m in yaml.safe_load(s.text)["models"] for role in m["roles"]
             if role in ("autocomplete", "embed")}
    assert roles == {"autocomplete": "a-model", "embed": "minilm"} and s.warning == ""

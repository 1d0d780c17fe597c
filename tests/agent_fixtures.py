"""The requests the coding agents sent, as recorded from the real binaries
(tests/integration/real_agents.py) and kept under tests/fixtures/agents/<agent>-<version>/:
where they live, and what they carry, read from each API's own shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
RECORD_ENV = "SHOAL_RECORD_AGENTS"
REFRESH = (f"{RECORD_ENV}=1 .venv/bin/python -m pytest tests/integration/test_real_agents.py "
           "-p no:cacheprovider")  # the one command that re-records every agent's fixtures


def fixture_dir(name: str, version: str) -> Path:
    return FIXTURES / f"{name}-{version}"


def fixture_files() -> list[Path]:
    return sorted(FIXTURES.glob("*/*.json"))


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def text_of(content: Any) -> str:
    """The text in a message's content, whichever API's shape it has."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(text_of(part.get("text", part.get("content", "")))
                       if isinstance(part, dict) else str(part) for part in content)
    return ""


def offered_tools(path: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The client tools a request offers the model, by name, each with its parameters'
    schema; a Responses ``namespace`` tool's functions count, hosted tools do not."""
    out: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        if path == "/v1/chat/completions":
            out[tool["function"]["name"]] = tool["function"].get("parameters") or {}
        elif path == "/v1/messages":
            out[tool["name"]] = tool.get("input_schema") or {}
        elif tool.get("type") == "namespace":
            for inner in tool.get("tools") or []:
                out[inner["name"]] = inner.get("parameters") or {}
        elif tool.get("type") == "function":
            out[tool["name"]] = tool.get("parameters") or {}
    return out


def hosted_tools(body: dict[str, Any]) -> list[str]:
    """A Responses request's tools that run on OpenAI's servers (web_search, ...)."""
    return [t["type"] for t in body.get("tools") or []
            if t.get("type") not in ("function", "namespace")]


def tool_results(path: str, body: dict[str, Any]) -> list[str]:
    """The tool results a request carries back to the model."""
    if path == "/v1/messages":
        return [text_of(block.get("content")) for m in body.get("messages", [])
                if isinstance(m.get("content"), list)
                for block in m["content"] if block.get("type") == "tool_result"]
    if path == "/v1/responses":
        items = body.get("input") if isinstance(body.get("input"), list) else []
        return [text_of(i.get("output")) for i in items
                if i.get("type") == "function_call_output"]
    return [text_of(m.get("content")) for m in body.get("messages", [])
            if m.get("role") == "tool"]

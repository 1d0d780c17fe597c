"""The engine's error codes and the HTTP statuses the API answers them with."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.api.errors import STATUS, status_for
from engine.errors import REQUEST_CODES, RequestError, ShoalError

ENGINE = Path(__file__).resolve().parents[2] / "engine"


@pytest.mark.parametrize(("code", "status"), [
    ("invalid_request", 400), ("invalid_request_error", 400),
    ("context_length_exceeded", 400), ("fim_unsupported", 400),
    ("node_not_found", 404), ("model_not_found", 404),
    ("fleet_busy", 429),
    ("internal_error", 500),
    ("no_node_available", 503), ("node_unavailable", 503), ("model_unavailable", 503),
    ("shutting_down", 503),
])
def test_each_code_has_its_status(code: str, status: int) -> None:
    assert code in REQUEST_CODES
    assert status_for(RequestError("x", code=code)) == status


def test_the_table_and_the_codes_are_the_same_set() -> None:
    assert set(STATUS) == REQUEST_CODES


def test_a_request_error_without_a_code_is_a_bad_request() -> None:
    assert status_for(RequestError("the prompt is empty")) == 400


def test_a_code_without_a_status_is_answered_as_a_bug() -> None:
    assert status_for(ShoalError("x", code="no_such_code")) == 500


def _raised_codes() -> list[tuple[str, str]]:
    """(file, code) of every ``RequestError(..., code="...")`` in the engine."""
    found = []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RequestError":
                for kw in node.keywords:
                    if kw.arg == "code" and isinstance(kw.value, ast.Constant):
                        found.append((str(path.relative_to(ENGINE)), kw.value.value))
    return found


def test_every_code_the_engine_raises_has_a_status() -> None:
    raised = _raised_codes()
    assert len(raised) >= 8  # the scan finds the head's refusals
    assert [(f, c) for f, c in raised if c not in STATUS] == []

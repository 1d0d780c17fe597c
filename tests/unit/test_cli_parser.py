"""The command line: options before or after the verb, a help line for every option,
and secrets taken out of argv."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cli_argv import secrets_in_argv as _secrets_in_argv
from engine.cli_argv import without_option
from engine.cli_parser import build_parser


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(("after", "before"), [
    (["alias", "set", "a", "b", "--head", "h:1"], ["alias", "--head", "h:1", "set", "a", "b"]),
    (["alias", "ls", "--head", "h:1"], ["alias", "--head", "h:1", "ls"]),
    (["alias", "rm", "a", "--head=h:1"], ["alias", "--head=h:1", "rm", "a"]),
    (["alias", "import", "f.json", "--head", "h:1"],
     ["alias", "--head", "h:1", "import", "f.json"]),
    (["node", "join", "h:8454", "--model", "m", "--max-batch", "3", "--offline",
      "--discovery", "none"],
     ["node", "--model", "m", "--max-batch", "3", "--offline", "--discovery", "none",
      "join", "h:8454"]),
])
def test_options_go_before_or_after_the_verb(after: list[str], before: list[str]) -> None:
    assert vars(parse(*after)) == vars(parse(*before))


def test_a_verb_without_the_option_keeps_the_default() -> None:
    assert parse("alias", "ls").head == "127.0.0.1:8453"
    assert parse("alias", "--head", "h:1", "ls").head == "h:1"
    assert parse("alias", "--head", "h:1", "ls", "--head", "h:2").head == "h:2"
    joined = parse("node", "join")
    # None: 8 lanes, or as many as an upstream engine says (engine.cli._node)
    assert joined.max_batch is None and joined.model is None and joined.offline is False
    assert joined.discovery is None and joined.handshake_timeout_ms == 10_000


def _parsers(parser: argparse.ArgumentParser, path: str) -> Iterator[
        tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_and_verb_has_a_help_line() -> None:
    missing = []
    seen = 0
    for path, parser in _parsers(build_parser(), "shoal"):
        for action in parser._actions:
            seen += 1
            name = "/".join(action.option_strings) or action.dest
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {name}")
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{path} {choice.dest}" for choice in action._choices_actions
                            if not choice.help]
    assert seen > 100
    assert missing == []


def test_the_secret_options_say_argv_is_visible() -> None:
    serve = dict(_parsers(build_parser(), "shoal"))["shoal serve"]
    helps = {a.dest: a.help or "" for a in serve._actions}
    assert "other users" in helps["api_key"] and "--api-key-file" in helps["api_key"]
    assert "0600" in helps["api_key_file"]
    assert "DNS rebinding" in helps["allow_host"]


@pytest.mark.parametrize(("argv", "option", "left"), [
    (["node", "join", "--code", "URL", "--model", "m"], "--code", ["node", "join", "--model", "m"]),
    (["node", "join", "--code=URL"], "--code", ["node", "join"]),
    (["node", "join", "--cod", "URL"], "--code", ["node", "join"]),  # argparse's abbreviation
    (["node", "join", "--code", "A", "--code", "B"], "--code", ["node", "join"]),
    (["serve", "--api-key", "K", "--api-key-file", "f"], "--api-key",
     ["serve", "--api-key-file", "f"]),
    (["serve", "--", "--api-key", "K"], "--api-key", ["serve", "--", "--api-key", "K"]),
    (["serve", "-", "--x"], "--api-key", ["serve", "-", "--x"]),
])
def test_without_option(argv: list[str], option: str, left: list[str]) -> None:
    assert without_option(argv, option) == left


def test_which_values_are_secrets_in_argv(tmp_path: Path) -> None:
    url = "shoal://join?head=h:1&token=" + "ab" * 32 + "&fleet=f"
    assert _secrets_in_argv(parse("node", "join", "--code", url)) == {"code": url}
    image = tmp_path / "code.png"
    image.write_bytes(b"x")
    for kept in ("-", f"@{image}", str(image)):
        assert _secrets_in_argv(parse("node", "join", "--code", kept)) == {}
    assert _secrets_in_argv(parse("serve", "--api-key", "k")) == {"api_key": "k"}
    assert _secrets_in_argv(parse("serve")) == {}

"""The command line: options before or after the verb, a help line for every option,
and secrets taken out of argv."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cli.argv import secrets_in_argv as _secrets_in_argv
from engine.cli.argv import without_option
from engine.cli.parser import build_parser


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
    (["node", "join", "--memory-budget", "6G", "--kv-type", "q8_0", "--idle-unload", "never"],
     ["node", "--memory-budget", "6G", "--kv-type", "q8_0", "--idle-unload", "never", "join"]),
    (["node", "join", "--gpu", "Vulkan0"], ["node", "--gpu", "Vulkan0", "join"]),
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


@pytest.mark.parametrize("verb", [["serve"], ["node"], ["node", "join"]])
def test_how_a_node_holds_its_model_is_an_option_of_each_node(verb: list[str]) -> None:
    from engine.sizes import GiB, Share

    args = parse(*verb, "--memory-budget", "6GiB", "--kv-type", "q8_0", "--idle-unload", "30")
    assert (args.memory_budget, args.kv_type, args.idle_unload) == (6 * GiB, "q8_0", 1800.0)
    args = parse(*verb, "--memory-budget", "50%", "--idle-unload", "0")
    assert (args.memory_budget, args.idle_unload) == (Share(50.0), None)
    assert parse(*verb, "--gpu", "off").gpu == "off"
    assert parse(*verb, "--gpu", " RTX 4070 ").gpu == "RTX 4070"  # part of a description
    # left out: not in the result, so that config.toml's [node] (then the default) stands
    left_out = vars(parse(*verb))
    assert not {"memory_budget", "kv_type", "gpu", "idle_unload"} & set(left_out)


@pytest.mark.parametrize(("argv", "line"), [
    (["serve", "--memory-budget", "6X"], "argument --memory-budget: '6X' is not a memory "
     "budget; give a size like 6G, 6GiB, 4096M or 512MB (binary units), or a share of this "
     "machine's RAM like 50%"),
    (["node", "--memory-budget", "128M"], "argument --memory-budget: a memory budget of "
     "128 MiB cannot hold a model and its KV cache; give at least 256M"),
    (["node", "join", "--memory-budget", "0.000001%"], "too little for a model and its KV "
     "cache; give a larger share or a size of at least 256M"),
    (["serve", "--kv-type", "q4_0"], "argument --kv-type: invalid choice: 'q4_0' (choose from "),
    (["node", "join", "--gpu", " "], "argument --gpu: give auto, off (CPU only) or a device "
     "name such as Vulkan0 (1-64 printable characters)"),
    (["serve", "--gpu", "x" * 65], "argument --gpu: give auto, off (CPU only) or a device"),
    (["node", "join", "--idle-unload", "soon"], "argument --idle-unload: 'soon' is not an idle "
     "time; give minutes from 0 to 10080 (like 15), or never"),
    (["serve", "--idle-unload", "-5"], "argument --idle-unload: '-5' is not an idle time"),
])
def test_a_wrong_value_is_refused_in_one_line(argv: list[str], line: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        parse(*argv)
    assert done.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert line in last

"""`shoal models catalog [--fits]` and `shoal models list` as a user reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.cli import main
from engine.cli import models as cli_models


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text('[node]\ngpu = "off"\n')
    return tmp_path


@pytest.fixture(autouse=True)
def fleet(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The nodes the head answers with (/v1/fleet): none unless a test adds some; no
    socket in a unit test."""
    nodes: list[dict[str, Any]] = []
    monkeypatch.setattr(cli_models, "fleet_nodes", lambda head, unseen: (nodes, ""))
    return nodes


def entry_block(out: str, entry_id: str) -> str:
    return next(b for b in out.split("\n\n") if b.startswith(entry_id + ":"))


def test_the_catalog_lists_each_model_with_its_quantisations_and_ids(
        home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "catalog"]) == 0
    out = capsys.readouterr().out
    block = entry_block(out, "qwen2.5-coder-7b-instruct")
    assert "tools, fill-in-the-middle" in block.splitlines()[0]
    assert "* Q4_K_M" in block and "unsloth/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M" in block
    assert "fits" not in out  # no fit without --fits


def test_fits_judges_each_quantisation_by_the_budget_given(
        home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "catalog", "--fits", "--memory-budget", "3GiB"]) == 0
    out = capsys.readouterr().out
    assert "a node budget of 3 GiB, no GPU used" in out.splitlines()[0]
    small = entry_block(out, "smollm2-135m-instruct")
    assert all("fits with its whole 8K window" in line for line in small.splitlines()[1:])
    big = entry_block(out, "qwen2.5-coder-32b-instruct")
    assert all("does not fit: it needs about" in line for line in big.splitlines()[1:])
    assert "fits with a " in entry_block(out, "qwen2.5-coder-3b-instruct")  # a smaller window


def test_list_on_an_empty_machine_says_where_to_look(
        home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    assert capsys.readouterr().out == (
        "no models on this machine yet; `shoal models catalog --fits` shows some to pull\n")


def test_rm_of_a_model_not_kept_says_what_is(
        home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "rm", "org/none:Q4_K_M"]) == 2
    assert capsys.readouterr().err == (
        "shoal: no model 'org/none:Q4_K_M' is kept on this machine (kept: none); "
        "`shoal models list` shows them\n")


def test_fits_shows_each_speed_and_three_models_that_fit_together(
        home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models import bandwidth

    # this machine's bandwidth as if measured before: 20 GB/s (no measuring in a test)
    monkeypatch.delenv(bandwidth.MACHINE_CACHE_ENV, raising=False)  # kept in the home
    (bandwidth.machine_cache(home) / bandwidth.SPEED_FILE).write_text(json.dumps(
        {"key": bandwidth.machine_key(), "mem_bandwidth": 20_000_000_000}))
    assert main(["models", "catalog", "--fits", "--memory-budget", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(", RAM read at 20 GB/s")
    big = entry_block(out, "qwen2.5-coder-7b-instruct")
    assert "slow here: ~" in big and "(chat wants 10)" in big
    emb = entry_block(out, "nomic-embed-text-v1.5")
    assert "embeddings, 768 dimensions" in emb.splitlines()[0] and "tok/s" not in emb
    tail = out.split("\nsuggested for this machine", 1)[1].splitlines()[1:]
    roles = [line.strip().split(":")[0] for line in tail]
    assert len(tail) >= 2 and roles[-1] == "embeddings"
    assert any("autocomplete" in r for r in roles) and any(
        r.startswith(("agents", "chat")) for r in roles)
    assert all("tok/s" in line for line in tail if not line.strip().startswith("embeddings"))


def test_keep_alive_sets_shows_and_refuses_a_models_idle_time(
        home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.models import embedded, ids

    tiny = ids.models_dir(home) / "embedded" / embedded.EMBEDDED_FILE
    tiny.parent.mkdir(parents=True)
    tiny.write_bytes(b"e" * 100)
    name = embedded.EMBEDDED_NAME
    assert main(["models", "keep-alive", name]) == 0
    assert capsys.readouterr().out.startswith(f"{name} unloads after the node's idle time")
    assert main(["models", "keep-alive", name, "1h30m"]) == 0
    assert capsys.readouterr().out.startswith(f"{name} stays loaded 1.5 h once idle (a node")
    assert main(["models", "keep-alive", name, "never"]) == 0
    capsys.readouterr()
    assert main(["models", "keep-alive", name]) == 0
    assert capsys.readouterr().out == f"{name} stays loaded until you unload it\n"
    assert main(["models", "keep-alive", name, "soon"]) == 2
    assert "'soon' is not a duration" in capsys.readouterr().err
    assert main(["models", "keep-alive", name, "default"]) == 0
    assert main(["models", "keep-alive", "other", "5m"]) == 2
    assert "no model 'other' is kept on this machine" in capsys.readouterr().err


def test_fits_offers_a_model_no_machine_holds_split_across_one_that_lends(
        home: Path, capsys: pytest.CaptureFixture[str], fleet: list[dict[str, Any]]) -> None:
    from engine.sizes import GiB

    # this machine's own node lends nothing; the desk lends 14 GiB of its 14 GiB budget
    fleet.append({"key": "local", "identity": "laptop", "lend_bytes": 0})
    fleet.append({"key": "10.0.0.2:8455", "identity": "desk", "ram_total": 32 * GiB,
                  "mem_budget": 14 * GiB, "lend_bytes": 14 * GiB, "lanes": 8,
                  "device_kind": "", "lend_junk": "x" * 10_000})
    assert main(["models", "catalog", "--fits", "--memory-budget", "8GiB"]) == 0
    out = capsys.readouterr().out
    big = entry_block(out, "qwen2.5-coder-32b-instruct").splitlines()
    assert all("does not fit" in line for line in big[1:-1])
    assert big[-1].startswith("    no machine holds it alone; Q4_K_M split across laptop + "
                              "desk (")
    assert big[-1].endswith(" of 64 layers): `shoal models serve "
                            "bartowski/Qwen2.5-Coder-32B-Instruct-GGUF:Q4_K_M --split "
                            "laptop,desk`")
    # a model the desk holds alone is offered no split
    assert "no machine holds it alone" not in entry_block(out, "qwen2.5-coder-14b-instruct")
    # the desk lending nothing: no split at all
    fleet[1]["lend_bytes"] = 0
    assert main(["models", "catalog", "--fits", "--memory-budget", "8GiB"]) == 0
    assert "no machine holds it alone" not in capsys.readouterr().out


def test_fits_says_when_no_head_answers_for_the_fleet(
        home: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_models, "fleet_nodes", lambda head, unseen: (
        [], f"(no head answered at {head}: refused; {unseen})"))
    assert main(["models", "catalog", "--fits", "--memory-budget", "8GiB",
                 "--head", "127.0.0.1:9"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "(no head answered at 127.0.0.1:9: refused; a model no machine holds alone is not "
        "offered split across the fleet)")

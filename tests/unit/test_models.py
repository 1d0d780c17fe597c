"""Model ids, the GGUF choice in a repository, and offline resolution (no network)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.models.cache import resolve_model
from engine.models.embedded import (
    _install_stream,
    _verified,
    ensure_embedded_default,
    ensure_test_gemma,
)
from engine.models.errors import ModelMissing
from engine.models.ids import ModelChoiceError, ModelId, parse_model_id, pick_gguf, shards_of
from engine.settings import default_home


@pytest.fixture(autouse=True)
def _no_hub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("SHOAL_BUNDLED_MODELS", raising=False)


def test_default_home_reads_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One keeper of where Shoal lives (three once differed on `~`)."""
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "h"))
    assert default_home() == tmp_path / "h"
    monkeypatch.setenv("SHOAL_HOME", "~/elsewhere")
    assert default_home() == Path.home() / "elsewhere"
    monkeypatch.delenv("SHOAL_HOME")
    assert default_home() == Path.home() / ".shoal"


def test_resolve_local_path_is_itself(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f), home=tmp_path, offline=True) == f
    assert resolve_model(str(tmp_path), home=tmp_path, offline=False) == tmp_path


def test_resolve_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelMissing) as ei:
        resolve_model(str(missing), home=tmp_path, offline=False)
    msg = str(ei.value)
    assert str(missing) in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("org/repo", ModelId("org/repo", None)),
        ("org/repo:Q8_0", ModelId("org/repo", "Q8_0")),
        (
            "bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M",
            ModelId("bartowski/SmolLM2-135M-Instruct-GGUF", "Q4_K_M"),
        ),
        ("unsloth/Qwen3-8B-GGUF:UD-Q4_K_XL", ModelId("unsloth/Qwen3-8B-GGUF", "UD-Q4_K_XL")),
        ("a.b/c_d.e", ModelId("a.b/c_d.e", None)),
    ],
)
def test_parse_model_id(spec: str, expected: ModelId) -> None:
    assert parse_model_id(spec) == expected
    assert str(expected) == spec


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "org",
        "org/",
        "/repo",
        "a/b/c",
        "org/repo:",
        "org/re po",
        "org//repo",
        "-org/repo",
        "org/repo.",
        "o--rg/repo",
        "org/re..po",
        "org/repo:Q4 K",
    ],
)
def test_bad_ids(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_model_id(spec)


@pytest.mark.parametrize("spec", ["org", "org/repo:", "org/re po"])
def test_resolve_bad_id_is_model_missing(tmp_path: Path, spec: str) -> None:
    with pytest.raises(ModelMissing, match="not a model id"):
        resolve_model(spec, home=tmp_path, offline=True)


def test_offline_missing_id_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelMissing) as ei:
        resolve_model("org/repo:Q4_K_M", home=tmp_path, offline=True)
    assert str(ei.value) == (
        f"model org/repo:Q4_K_M is not in the cache at {tmp_path / 'models' / 'hub'}; "
        "run once without --offline to pull it"
    )


def test_hf_hub_offline_env_means_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelMissing, match="not in the cache"):
        resolve_model("org/repo", home=tmp_path, offline=False)


def _fake_cache(cache: Path, repo: str, files: list[str]) -> Path:
    """The hub cache layout: refs/main -> snapshots/<commit>/<files>."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snap = repo_dir / "snapshots" / commit
    for name in files:
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_bytes(b"GGUF" + name.encode())
    return snap


def test_offline_finds_a_cached_pull(tmp_path: Path) -> None:
    snap = _fake_cache(
        tmp_path / "models" / "hub",
        "org/repo",
        ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf"],
    )
    got = resolve_model("org/repo:q8_0", home=tmp_path, offline=True)
    assert got == snap / "m-Q8_0.gguf"
    assert resolve_model("org/repo", home=tmp_path, offline=True) == snap / "m-Q4_K_M.gguf"
    with pytest.raises(ModelMissing, match="not in the cache"):
        resolve_model("org/repo:Q2_K", home=tmp_path, offline=True)


LISTING = [
    ".gitattributes",
    "README.md",
    "model-Q2_K.gguf",
    "model-Q4_K_M.gguf",
    "model-Q4_K_S.gguf",
    "model-Q8_0.gguf",
    "model-f16.gguf",
    "mmproj-model-f16.gguf",
]


@pytest.mark.parametrize(
    ("quant", "expected"),
    [
        ("Q8_0", "model-Q8_0.gguf"),
        ("q8_0", "model-Q8_0.gguf"),
        ("Q4_K_S", "model-Q4_K_S.gguf"),
        ("F16", "model-f16.gguf"),
        (None, "model-Q4_K_M.gguf"),
    ],
)
def test_pick_gguf(quant: str | None, expected: str) -> None:
    assert pick_gguf(LISTING, quant) == expected


def test_pick_gguf_ambiguous_lists_choices() -> None:
    # "Q4_K" is a whole token in neither name, and a substring of both
    with pytest.raises(ModelChoiceError) as ei:
        pick_gguf(LISTING, "Q4_K")
    assert "model-Q4_K_M.gguf" in str(ei.value) and "model-Q4_K_S.gguf" in str(ei.value)


def test_pick_gguf_no_match_lists_choices() -> None:
    with pytest.raises(ModelChoiceError, match=re.escape("model-Q2_K.gguf")):
        pick_gguf(LISTING, "IQ3_XS")


def test_pick_gguf_single_and_none() -> None:
    assert pick_gguf(["README.md", "only.Q5_K_M.gguf"], None) == "only.Q5_K_M.gguf"
    with pytest.raises(ModelChoiceError, match=re.escape("no .gguf")):
        pick_gguf(["README.md", "model.safetensors"], None)
    with pytest.raises(ModelChoiceError, match="add ':QUANT'"):
        pick_gguf(["a-Q8_0.gguf", "a-Q6_K.gguf"], None)


def test_pick_gguf_split_model_takes_first_shard() -> None:
    files = [
        "Q4_K_M/big-Q4_K_M-00002-of-00002.gguf",
        "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf",
        "Q8_0/big-Q8_0-00001-of-00003.gguf",
        "Q8_0/big-Q8_0-00002-of-00003.gguf",
        "Q8_0/big-Q8_0-00003-of-00003.gguf",
    ]
    chosen = pick_gguf(files, "Q8_0")
    assert chosen == "Q8_0/big-Q8_0-00001-of-00003.gguf"
    assert shards_of(files, chosen) == [
        "Q8_0/big-Q8_0-00001-of-00003.gguf",
        "Q8_0/big-Q8_0-00002-of-00003.gguf",
        "Q8_0/big-Q8_0-00003-of-00003.gguf",
    ]
    assert pick_gguf(files, None) == "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf"
    assert shards_of(files, "a.gguf") == ["a.gguf"]


def test_offline_embedded_and_gemma_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelMissing, match="without --offline"):
        ensure_embedded_default(tmp_path, offline=True)
    with pytest.raises(ModelMissing, match="without --offline"):
        ensure_test_gemma(tmp_path, offline=True)


def test_install_records_checksum_and_detects_tampering(tmp_path: Path) -> None:
    target = tmp_path / "embedded" / "m.gguf"
    _install_stream(target, [b"GGUF", b"rest"], None)
    assert target.read_bytes() == b"GGUFrest"
    assert _verified(target)
    assert not list(target.parent.glob(".tmp-*"))
    target.write_bytes(b"GGUFother")
    assert not _verified(target)


def test_install_refuses_a_wrong_checksum(tmp_path: Path) -> None:
    target = tmp_path / "m.gguf"
    with pytest.raises(ModelMissing, match="corrupt"):
        _install_stream(target, [b"GGUF"], "00" * 32)
    assert not target.exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_name_from_the_fleet_is_never_a_path_here(tmp_path, monkeypatch) -> None:
    """`etc/hostname` has the shape of org/repo: a head must not make a node load a file of
    its machine by naming it."""
    from engine.models.cache import HubId, resolve_model
    from engine.models.errors import ModelMissing

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hostname").write_text("box\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("etc/hostname", home=tmp_path / "home", offline=True) \
        == Path("etc/hostname")  # typed by the user: the file is what they meant
    with pytest.raises(ModelMissing) as err:
        resolve_model(HubId("etc/hostname"), home=tmp_path / "home", offline=True)
    assert "not in the cache" in str(err.value)

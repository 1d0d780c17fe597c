"""The models kept on this machine: listed with their size and use, removed unless served."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models import embedded as model_embedded
from engine.models import ids
from engine.models import store as ms


def hub_file(home: Path, repo: str, name: str, data: bytes, *, sha: str) -> Path:
    """A file laid out as a hub pull leaves it: a blob and a snapshot link to it."""
    repo_dir = ids.models_dir(home) / "hub" / ("models--" + repo.replace("/", "--"))
    blob = repo_dir / "blobs" / sha
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text("c" * 40)
    link = repo_dir / "snapshots" / ("c" * 40) / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return link


@pytest.fixture
def home(tmp_path: Path) -> Path:
    hub_file(tmp_path, "org/Coder-GGUF", "Coder-Q4_K_M.gguf", b"a" * 4000, sha="1" * 64)
    hub_file(tmp_path, "org/Coder-GGUF", "Coder-Q8_0.gguf", b"b" * 7000, sha="2" * 64)
    for i in (1, 2):
        hub_file(tmp_path, "org/Big-GGUF", f"Big-Q4_K_M-0000{i}-of-00002.gguf", b"c" * 3000,
                 sha=str(2 + i) * 64)
    embedded = ids.models_dir(tmp_path) / "embedded" / model_embedded.EMBEDDED_FILE
    embedded.parent.mkdir(parents=True)
    embedded.write_bytes(b"e" * 100)
    part = ms.downloads_dir(tmp_path) / ("9" * 64 + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"p" * 50)
    return tmp_path


def test_every_kept_model_is_listed_by_the_name_a_user_types_with_its_disk(home: Path) -> None:
    kept = ms.kept_models(home)
    assert [(m.name, m.size, m.source) for m in kept] == [
        ("org/Coder-GGUF:Q8_0", 7000, "hub"),
        ("org/Big-GGUF:Q4_K_M", 6000, "hub"),  # both shards, listed once
        ("org/Coder-GGUF:Q4_K_M", 4000, "hub"),
        (model_embedded.EMBEDDED_NAME, 100, "embedded"),
        ("partial download 999999999999", 50, "partial"),
    ]
    assert ms.total_bytes(kept) == 17150
    assert kept[0].spec == "org/Coder-GGUF:Q8_0" and kept[3].spec == ""
    assert all(m.last_used is None and m.served_by == () for m in kept)


@pytest.mark.parametrize(("name", "quant"), [
    ("SmolLM2-135M-Instruct-Q4_K_M.gguf", "Q4_K_M"),
    ("qwen2.5-coder-7b-instruct-q8_0.gguf", "Q8_0"),
    ("Big-IQ4_XS-00001-of-00003.gguf", "IQ4_XS"), ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
    ("model-bf16.gguf", "BF16"), ("model.gguf", None)])
def test_the_quantisation_is_read_from_the_file_name(name: str, quant: str | None) -> None:
    assert ms.quant_of(name) == quant


def test_a_model_served_here_is_refused_removal_with_why_then_removed_after(home: Path) -> None:
    coder = ms.find_kept(ms.kept_models(home), "org/Coder-GGUF:Q4_K_M")
    with ms.serving(home, coder.path):
        served = ms.find_kept(ms.kept_models(home), coder.name)
        assert served.served_by == (f"pid {os.getpid()}",) and served.last_used is not None
        with pytest.raises(ms.ModelInUse, match=r"^org/Coder-GGUF:Q4_K_M is being served on "
                                                r"this machine \(pid \d+\); switch"):
            ms.remove(home, coder.name)
        assert coder.path.exists()
    gone = ms.remove(home, "org/coder-gguf:q4_k_m")
    assert gone.name == coder.name and not coder.path.exists()
    assert not any(f.exists() for f in gone.files)
    names = [m.name for m in ms.kept_models(home)]
    assert "org/Coder-GGUF:Q4_K_M" not in names and "org/Coder-GGUF:Q8_0" in names


def test_removing_a_repositorys_last_model_removes_its_folder(home: Path) -> None:
    ms.remove(home, "org/Big-GGUF")  # the repo alone names it: one quant kept
    assert not (ids.models_dir(home) / "hub" / "models--org--Big-GGUF").exists()
    ms.remove(home, "partial download 999999999999")
    assert not any(ms.downloads_dir(home).iterdir())


def test_a_marker_left_by_a_process_that_died_does_not_hold_the_model(home: Path) -> None:
    coder = ms.find_kept(ms.kept_models(home), "org/Coder-GGUF:Q8_0")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        with ms.serving(home, coder.path, pid=proc.pid):
            assert ms.find_kept(ms.kept_models(home), coder.name).served_by == (
                f"pid {proc.pid}",)
            proc.communicate(b"", timeout=30)  # it ends: its marker no longer counts
            assert ms.find_kept(ms.kept_models(home), coder.name).served_by == ()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_name_that_matches_nothing_or_several_says_what_there_is(home: Path) -> None:
    kept = ms.kept_models(home)
    with pytest.raises(ms.ModelNotKept, match=r"no model 'nope' is kept on this machine "
                                              r"\(kept: org/Coder-GGUF:Q8_0, "):
        ms.find_kept(kept, "nope")
    with pytest.raises(ms.ModelNotKept, match=r"'org/Coder-GGUF' names 2 models here"):
        ms.find_kept(kept, "org/Coder-GGUF")


def test_an_idle_time_set_for_a_model_is_kept_and_listed_with_it(home: Path) -> None:
    ms.set_keep_alive(home, "org/Coder-GGUF:Q8_0", 1800.0)
    ms.set_keep_alive(home, "org/Big-GGUF:Q4_K_M", math.inf)
    ms.set_keep_alive(home, "org/Coder-GGUF:Q4_K_M", 0.0)
    by_name = {m.name: m.keep_alive_s for m in ms.kept_models(home)}
    assert by_name["org/Coder-GGUF:Q8_0"] == 1800.0
    assert by_name["org/Big-GGUF:Q4_K_M"] == math.inf  # never unloads
    assert by_name["org/Coder-GGUF:Q4_K_M"] == 0.0
    assert by_name[model_embedded.EMBEDDED_NAME] is None  # the node's own
    ms.set_keep_alive(home, "org/Coder-GGUF:Q8_0", None)  # the node's own again
    assert ms.keep_alive_defaults(home) == {"org/Big-GGUF:Q4_K_M": math.inf,
                                            "org/Coder-GGUF:Q4_K_M": 0.0}
    with pytest.raises(ValueError, match="0 or more seconds"):
        ms.set_keep_alive(home, "org/Coder-GGUF:Q8_0", -5.0)

"""`shoal models import FILE [--name NAME]`: a GGUF the user already has is kept among the
models here under a name (linked on the same disk, else copied with progress), listed, served
by that name through llama.cpp, and removable; a file that is not a whole GGUF model, a name
that could be taken for a hub id or a path, or one already kept, is refused in one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from engine.models import store
from engine.models.cache import resolve_model
from engine.models.errors import ModelMissing
from engine.service import Shoal
from engine.settings import DiscoverySettings, HeadSettings, NodeSettings, Settings
from tests.e2e.conftest import smollm2_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.cli", "models", *args],
                          env={**os.environ, "SHOAL_HOME": str(home)}, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.e2e  # a real model through llama.cpp: not in the quick selection
async def test_an_imported_gguf_is_listed_served_by_its_name_and_removed(
        tmp_path: Path, smollm2_gguf: Path) -> None:  # noqa: F811
    home = tmp_path / "home"
    done = await asyncio.to_thread(cli, home, "import", str(smollm2_gguf), "--name", "tiny")
    assert done.returncode == 0, done.stderr
    assert "as tiny" in done.stdout and "`shoal serve tiny`" in done.stdout
    listed = await asyncio.to_thread(cli, home, "list", "--head", "127.0.0.1:9")
    assert listed.returncode == 0, listed.stderr
    assert any(line.split()[:1] == ["tiny"] for line in listed.stdout.splitlines())
    kept = store.find_kept(await asyncio.to_thread(store.kept_models, home), "tiny")
    assert kept.source == "imported" and kept.size == smollm2_gguf.stat().st_size
    assert await asyncio.to_thread(resolve_model, "tiny", home=home, offline=True) == kept.path

    settings = Settings(home=home, discovery=DiscoverySettings(mode="none"),
                        head=HeadSettings(http="127.0.0.1:0"),
                        node=NodeSettings(model="tiny", runtime="llamacpp", lanes=1))
    shoal = await Shoal.start(settings)
    try:
        assert [m.name for m in shoal.snapshot().models] == ["tiny"]
        await until(lambda: shoal.snapshot().ready_nodes >= 1, "the node serving tiny")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2}
        async with aiohttp.ClientSession() as http, \
                http.post(f"{shoal.api_url}/chat/completions", json=body) as r:
            answer = await r.json()
        assert r.status == 200 and answer["model"] == "tiny", answer
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        await shoal.stop(drain=0)

    gone = await asyncio.to_thread(cli, home, "rm", "tiny")
    assert gone.returncode == 0, gone.stderr
    assert not kept.path.exists() and smollm2_gguf.is_file()  # the user's file stays
    with pytest.raises(ModelMissing, match="shoal models import"):
        await asyncio.to_thread(resolve_model, "tiny", home=home, offline=True)


def test_a_copy_across_disks_says_its_progress(tmp_path: Path, smollm2_gguf: Path,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(store.os, "link", no_link)
    seen: list[tuple[int, int]] = []
    kept = store.import_gguf(tmp_path, smollm2_gguf, progress=lambda d, t: seen.append((d, t)))
    size = smollm2_gguf.stat().st_size
    assert kept.name == smollm2_gguf.name.removesuffix(".gguf") and kept.size == size
    assert seen and seen[-1] == (size, size) and kept.path.read_bytes()[:4] == b"GGUF"
    assert not kept.path.with_name(kept.path.name + ".part").exists()


def test_what_is_not_a_whole_gguf_model_or_a_usable_name_is_refused(
        tmp_path: Path, smollm2_gguf: Path) -> None:  # noqa: F811
    home = tmp_path / "home"
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    cut = tmp_path / "cut.gguf"
    with smollm2_gguf.open("rb") as fh:
        cut.write_bytes(fh.read(4 << 20))  # the header whole, most tensors missing
    shard = tmp_path / "big-00001-of-00002.gguf"
    shard.write_bytes(b"GGUF")
    cases = [
        (text, None, "is not a GGUF model"),
        (cut, None, "is not a GGUF model"),
        (shard, None, "one part of a split model"),
        (tmp_path / "missing.gguf", None, "there is no file"),
        (smollm2_gguf, "org/repo", "cannot name a model"),
        (smollm2_gguf, "x.gguf", "cannot name a model"),
    ]
    for file, name, why in cases:
        with pytest.raises(store.CannotImport, match=why):
            store.import_gguf(home, file, name)
    store.import_gguf(home, smollm2_gguf, "tiny")
    with pytest.raises(store.CannotImport, match="kept here already"):
        store.import_gguf(home, smollm2_gguf, "TINY")
    refused = cli(home, "import", str(text))
    assert refused.returncode != 0 and "is not a GGUF model" in refused.stderr
    assert [m.name for m in store.kept_models(home) if m.source == "imported"] == ["tiny"]

"""What a node offers the fleet of its hub cache (engine.node.files.FileShelf): a model's
files with the sha256 its pull checked, every shard of a split one, nothing for a model
it does not keep whole or keeps in a layout that gives no sha256 to check by."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.link import messages as m
from engine.node.files import FileShelf
from tests.unit.test_model_store import hub_file

pytestmark = pytest.mark.quick


def test_a_kept_model_is_offered_with_each_files_size_and_sha256(tmp_path: Path) -> None:
    hub_file(tmp_path, "org/Coder-GGUF", "Coder-Q4_K_M.gguf", b"a" * 4000, sha="1" * 64)
    hub_file(tmp_path, "org/Coder-GGUF", "Coder-Q8_0.gguf", b"b" * 7000, sha="2" * 64)
    for i in (1, 2):
        hub_file(tmp_path, "org/Big-GGUF", f"Big-Q4_K_M-0000{i}-of-00002.gguf", b"c" * 3000,
                 sha=str(2 + i) * 64)
    shelf = FileShelf(tmp_path)
    offered = shelf.offer(m.FilesWanted(repo="org/Coder-GGUF", quant="Q8_0"))
    assert offered == m.FilesOffered(repo="org/Coder-GGUF", commit="c" * 40, files=[
        m.OfferedFile("Coder-Q8_0.gguf", 7000, "2" * 64)])
    big = shelf.offer(m.FilesWanted(repo="org/Big-GGUF", quant="Q4_K_M"))
    assert big is not None and [(f.name, f.sha256) for f in big.files] == [
        ("Big-Q4_K_M-00001-of-00002.gguf", "3" * 64), ("Big-Q4_K_M-00002-of-00002.gguf", "4" * 64)]
    assert shelf.offer(m.FilesWanted(repo="org/Coder-GGUF", quant="Q2_K")) is None
    assert shelf.offer(m.FilesWanted(repo="org/Other-GGUF")) is None
    assert shelf.blob(m.FileWanted(repo="org/Coder-GGUF", sha256="1" * 64)) is not None
    assert shelf.blob(m.FileWanted(repo="org/Coder-GGUF", sha256="9" * 64)) is None


def test_a_file_whose_blob_is_not_named_by_its_sha256_is_not_offered(tmp_path: Path) -> None:
    link = hub_file(tmp_path, "org/Coder-GGUF", "Coder-Q4_K_M.gguf", b"a" * 4000,
                    sha="1" * 64)
    renamed = link.resolve().with_name("not-a-sha256")
    os.replace(link.resolve(), renamed)
    link.unlink()
    link.symlink_to(os.path.relpath(renamed, link.parent))
    assert FileShelf(tmp_path).offer(m.FilesWanted(repo="org/Coder-GGUF")) is None


@pytest.mark.parametrize("record", [
    m.FileChunk(data=b"x" * (m.MAX_CHUNK + 1)),
    m.FileWanted(repo="org/Coder-GGUF", sha256="A" * 64),
    m.FileWanted(repo="../../etc", sha256="1" * 64),
    m.FilesOffered(repo="org/x", commit="c" * 40, files=[]),
    m.FilesWanted(repo="org/x", quant="Q4/../.."),
])
def test_a_file_record_out_of_bounds_is_refused_before_use(record: m.Record) -> None:
    with pytest.raises(m.RecordError):
        m.decode(m.encode(record))


def test_rpc_bytes_are_bounded_like_a_files_chunks() -> None:
    assert m.decode(m.encode(m.RpcBytes(data=b"x" * m.MAX_CHUNK))) == m.RpcBytes(
        data=b"x" * m.MAX_CHUNK)
    with pytest.raises(m.RecordError):
        m.decode(m.encode(m.RpcBytes(data=b"x" * (m.MAX_CHUNK + 1))))
    # empty: the lending side's sign of life while its server computes
    assert m.decode(m.encode(m.RpcBytes(data=b""))) == m.RpcBytes(data=b"")
